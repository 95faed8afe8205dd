//! Hostile RoCE packets (UDP payloads) and GRH areas: the checked views and
//! every accessor must never panic, and a parsed packet must re-emit to
//! bytes that parse to the same meaning.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_wire::{grh, icrc, packet};

fuzz_target!(|data: &[u8]| {
    let view = packet::Packet::new_unchecked(data);
    // Accessors on an unchecked view must not panic either.
    let _ = (
        view.payload(),
        view.icrc(),
        view.reth(),
        view.aeth(),
        view.deth(),
    );
    let _ = (
        view.immdt(),
        view.ieth(),
        view.atomic_eth(),
        view.atomic_ack_eth(),
    );
    if let Ok(p) = packet::Packet::new_checked(data) {
        let b = p.bth();
        let _ = (b.opcode_raw(), b.psn(), b.dest_qp(), b.pad_cnt(), b.pkey());
        if let Ok(r) = packet::Repr::parse(&p) {
            let mut out = vec![0; r.buffer_len()];
            r.emit(&mut packet::Packet::new_unchecked(&mut out[..]))
                .expect("a parsed packet re-emits");
            let again = packet::Repr::parse(&packet::Packet::new_checked(&out[..]).unwrap());
            assert_eq!(again, Ok(r));
        }
    }
    if let Ok(ip) = grh::Packet::new_checked(data).and_then(|g| grh::parse(&g)) {
        let mut out = [0u8; grh::HEADER_LEN];
        grh::emit(&ip, &mut grh::Packet::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(grh::parse(&grh::Packet::new_unchecked(&out[..])), Ok(ip));
    }
    // The ICRC over splits chosen by the input: the first two bytes pick the
    // IP header length (IPv4 with options or IPv6, or wrong on purpose) and
    // the UDP header length.
    if let [a, b, rest @ ..] = data {
        let ip_len = usize::from(*a % 64);
        let udp_len = usize::from(*b % 12);
        if rest.len() >= ip_len + udp_len {
            let (ip, rest) = rest.split_at(ip_len);
            let (udp, roce) = rest.split_at(udp_len);
            let _ = icrc::compute(ip, udp, roce);
            let _ = icrc::verify(ip, udp, roce);
        }
    }
});
