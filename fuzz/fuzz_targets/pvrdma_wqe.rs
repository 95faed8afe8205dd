//! Hostile WQEs in guest memory: `decode_send` and `decode_recv` decode a
//! send or receive WQE — a stride copied out of guest memory, as the
//! device's ring cursor copies it — for a QP of any type and size, with
//! no engine and nothing else read; then the face core resolves what was
//! decoded (`wq::resolve`: a fast registration's MR by its key, its page
//! directory read out of guest memory). Neither may panic, and what they
//! accept must be within what the QP allows.
//!
//! Input: a byte for the QP type, a byte for its SGEs (and so its WQE
//! stride), a u16 for where the WQE starts, then a page of memory (zero
//! past the input's end), which is all 4 pages at 0x10_0000 hold: a WQE's
//! bytes can then be a fast registration's page directory and table too.
//! A WQE that starts too close to the memory's end to be copied whole is
//! a broken ring (the cursor's to handle), not a decoding.
#![no_main]

use std::cell::RefCell;

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vrdma_engine::{Engine, PdHandle, mr::Translation};
use vrdma_face::wq::{self, Payload};
use vrdma_pvrdma::{
    abi::{self, PAGE_SIZE},
    caps::{self, Limits},
    qp::{self, QpContext},
};

const BASE: u64 = 0x10_0000;
const LEN: usize = 4 * PAGE_SIZE as usize;

thread_local! {
    /// An engine with a PD (handle 1) and fast-registration MRs in it, for
    /// FAST_REG_MR WQEs to name.
    static ENGINE: RefCell<Engine> = RefCell::new({
        let limits = Limits::default();
        let port = vrdma_engine::attr::PortAttr::with_gids(&[]);
        let mut e = Engine::new(limits.device_attr(caps::node_guid([2, 0, 0, 0, 0, 1])), port);
        let pd = e.alloc_pd().unwrap();
        assert_eq!(pd, PdHandle(1));
        for _ in 0..4 {
            e.alloc_mr(pd, abi::MAX_FAST_REG_PAGES).unwrap();
        }
        e
    });
}

fuzz_target!(|data: &[u8]| {
    let [ty, sges, at0, at1, image @ ..] = data else {
        return;
    };
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(BASE), LEN)]).unwrap();
    let page = &image[..image.len().min(PAGE_SIZE as usize)];
    for i in 0..4 {
        mem.write_slice(page, GuestAddress(BASE + i * PAGE_SIZE))
            .unwrap();
    }
    let max_sge = u32::from(*sges % 10);
    let qp = QpContext {
        ty: *ty % 6,
        pd: 1,
        max_send_sge: max_sge,
        stride: qp::sq_stride(max_sge.max(1)),
    };
    // Anywhere in the memory, or a little past its end.
    let addr = BASE + u64::from(u16::from_le_bytes([*at0, *at1])) % (LEN as u64 + 256);
    let copy = |stride: u64| {
        let mut wqe = vec![0u8; stride as usize];
        mem.read_slice(&mut wqe, GuestAddress(addr))
            .ok()
            .map(|_| wqe)
    };
    if let Some(wqe) = copy(qp.stride) {
        let sent = qp::decode_send(&wqe, &qp);
        if common_trace() {
            eprintln!("send: {sent:?}");
        }
        if let Ok(w) = sent {
            match &w.payload {
                Payload::Sges(s) => assert!(s.len() <= max_sge as usize),
                Payload::Inline(_) => panic!("PVRDMA announces no inline data"),
            }
            let resolved = ENGINE.with(|e| wq::resolve(&mem, &e.borrow(), w));
            if common_trace() {
                eprintln!("resolved: {resolved:?}");
            }
            if let Ok(wq::Resolved {
                pages: Some(Translation::Pages { pages, .. }),
                ..
            }) = &resolved
            {
                assert!(!pages.is_empty() && pages.len() <= abi::MAX_FAST_REG_PAGES as usize);
                assert!(pages.iter().all(|p| p % PAGE_SIZE == 0));
            }
        }
    }
    let stride = qp::rq_stride(max_sge.max(1));
    let Some(wqe) = copy(stride) else {
        return;
    };
    let recv = qp::decode_recv(&wqe, max_sge);
    if common_trace() {
        eprintln!("recv: {recv:?}");
    }
    if let Ok(w) = recv {
        assert!(w.sges.len() <= max_sge as usize);
        assert!(qp::RQ_WQE_HDR + qp::SGE * w.sges.len() as u64 <= stride);
    }
});

/// `VRDMA_FUZZ_TRACE=1`: say what was decoded.
fn common_trace() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("VRDMA_FUZZ_TRACE").is_some())
}
