//! Hostile reads from a TAP: whatever virtio-net header and frame the
//! kernel (or whoever writes the TAP's other side) gives, the cutter never
//! panics; the frames it gives lie in bounds with their checksum
//! positions; a UDP GSO frame's segments carry between them exactly its
//! payload, in order, each no longer than the segment size; and a
//! segment's checksum, once completed, verifies.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_fabric::eth::cut_tap_read;
use vrdma_wire::udp;

fuzz_target!(|data: &[u8]| {
    let mut read = data.to_vec();
    let gso = data.get(1).is_some_and(|t| t & 0x7f == 5);
    let size = data
        .get(4..6)
        .map_or(0, |b| usize::from(u16::from_le_bytes([b[0], b[1]])));
    let mut seg = Vec::new();
    let mut carried = Vec::new();
    let mut head = None;
    let r = cut_tap_read(&mut read, &mut seg, |f, partial| {
        assert!(f.len() <= data.len() + 64);
        if let Some(p) = partial {
            assert!(p.start + p.offset + 2 <= f.len());
            p.complete(f);
        }
        if gso {
            let p = partial.expect("a segment's checksum is offloaded");
            let payload = &f[p.start + udp::HEADER_LEN..];
            assert!(payload.len() <= size);
            carried.extend_from_slice(payload);
            head = Some(p.start + udp::HEADER_LEN);
            let (l3, ethertype) = if f[12..14] == [0x81, 0] {
                (18, [f[16], f[17]])
            } else {
                (14, [f[12], f[13]])
            };
            let ph = if ethertype == [0x86, 0xdd] {
                let a = |at: usize| <[u8; 16]>::try_from(&f[at..at + 16]).unwrap().into();
                udp::PseudoHeader::V6 {
                    src: a(l3 + 8),
                    dst: a(l3 + 24),
                }
            } else {
                let a = |at: usize| <[u8; 4]>::try_from(&f[at..at + 4]).unwrap().into();
                udp::PseudoHeader::V4 {
                    src: a(l3 + 12),
                    dst: a(l3 + 16),
                }
            };
            let found = u16::from_be_bytes([f[p.start + 6], f[p.start + 7]]);
            assert_eq!(found, udp::compute_checksum(ph, &f[p.start..]));
        }
    });
    if let (Ok(n), true, Some(h)) = (r, gso, head) {
        assert!(n >= 1);
        assert_eq!(&carried[..], &data[10 + h..]);
    }
});
