//! Hostile frames: Ethernet and bare IP decoding must never panic, and
//! whatever decodes must re-emit to bytes that decode to the same meaning.
//! (Under `cfg(fuzzing)` checksum and ICRC comparisons pass, so the fuzzer
//! reaches everything behind them.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_wire::frame;

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
});
