//! Hostile ring entries of virtio-rdma: `decode_send` and `decode_recv`
//! take a WQE's copy (any bytes, any length) for a QP of any type and
//! limits; they must never panic, and what they accept must be within
//! what the QP allows.
//!
//! Input: a byte for the QP type, a byte for its SGE limit, a byte for its
//! inline limit (×4), then the entry.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_engine::qp::QpType;
use vrdma_virtio::decode::{Payload, SendShape, decode_recv, decode_send};

fuzz_target!(|data: &[u8]| {
    let [ty, sge, inline, entry @ ..] = data else {
        return;
    };
    let shape = SendShape {
        qp_type: [QpType::Rc, QpType::Uc, QpType::Ud, QpType::Gsi][usize::from(*ty % 4)],
        max_sge: u32::from(*sge % 33),
        max_inline: u32::from(*inline) * 4,
    };
    if let Ok(w) = decode_send(entry, &shape) {
        match &w.payload {
            Payload::Sges(s) => assert!(s.len() as u32 <= shape.max_sge),
            Payload::Inline(d) => assert!(d.len() as u32 <= shape.max_inline),
        }
        assert_eq!(w.ud.is_some(), shape.qp_type.is_datagram());
        if let Some(f) = w.fast_reg {
            assert!(f.npages > 0 && (12..=30).contains(&f.page_shift));
        }
    }
    if let Ok((_, s)) = decode_recv(entry, shape.max_sge) {
        assert!(s.len() as u32 <= shape.max_sge);
    }
});
