//! Hostile frames: Ethernet and bare IP decoding must never panic, and
//! whatever decodes must re-emit to bytes that decode to the same meaning.
//! The same for the tools' decoding through VLAN tags and VXLAN
//! (`vrdma_wire::encap`), which must also agree with the plain decoders on
//! every frame those accept. (Under `cfg(fuzzing)` checksum and ICRC
//! comparisons pass, so the fuzzer reaches everything behind them.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_wire::{
    encap::{self, Encapsulation},
    frame::{self, IpRepr},
};

fuzz_target!(|data: &[u8]| {
    for decoded in [frame::decode_ethernet(data), frame::decode_ip(data)] {
        let Ok(d) = decoded else { continue };
        let repr = d.repr;
        let mut out = vec![0; repr.buffer_len()];
        repr.emit(&mut out).expect("a decoded frame re-emits");
        let again = if repr.ethernet.is_some() {
            frame::Repr::parse_ethernet(&out)
        } else {
            frame::Repr::parse_ip(&out)
        }
        .expect("a re-emitted frame parses");
        assert_eq!(again, repr);
    }
    let _ = frame::Repr::parse_ethernet(data);
    let _ = frame::Repr::parse_ip(data);
    encapsulated(data);
});

fn encapsulated(data: &[u8]) {
    for ethernet in [true, false] {
        let peeked = encap::peek(data, ethernet);
        let (decoded, plain) = if ethernet {
            (encap::decode_ethernet(data), frame::decode_ethernet(data))
        } else {
            (encap::decode_ip(data), frame::decode_ip(data))
        };
        // What the plain decoder accepts, the encapsulation-aware one
        // accepts with the same meaning.
        if let Ok(p) = plain {
            let e = decoded
                .as_ref()
                .expect("a plain frame decodes through encap");
            assert_eq!(e.encap.vxlan(), None);
            assert_eq!(
                e.encap.ethernet().map(|h| h.to_ethernet()),
                p.repr.ethernet.map(Some)
            );
            let inner = frame::Repr {
                ethernet: None,
                ..p.repr
            };
            assert_eq!(e.inner.repr, inner);
            assert_eq!(e.inner.icrc, p.icrc);
        }
        let Ok(e) = decoded else { continue };
        assert_eq!(peeked, encap::Peek::Roce, "what decodes peeks as RoCEv2");
        let mut out = vec![0; e.buffer_len()];
        e.emit(&mut out).expect("a decoded encapsulation re-emits");
        let again = if ethernet {
            encap::decode_ethernet(&out)
        } else {
            encap::decode_ip(&out)
        }
        .expect("a re-emitted encapsulation decodes");
        assert_eq!(again.inner.repr, e.inner.repr);
        assert!(again.inner.icrc.is_good(), "re-emission computes the ICRC");
        assert_eq!(lengthless(again.encap), lengthless(e.encap));
    }
}

/// `e` without the tunnel's IP payload length, which re-emission
/// recomputes (padding inside the tunnel is not re-emitted).
fn lengthless(mut e: Encapsulation) -> Encapsulation {
    if let Encapsulation::Vxlan(t) = &mut e {
        match &mut t.ip {
            IpRepr::V4(r) => r.payload_len = 0,
            IpRepr::V6(r) => r.payload_len = 0,
        }
    }
    e
}
