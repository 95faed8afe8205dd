//! A hostile guest: a vfio-user client playing a malicious `vmw_pvrdma`
//! driver against a PVRDMA device — bad handles and fields in commands,
//! page directories pointing outside guest memory or at the device's own
//! rings, wild ring indices, WQEs rewritten after their doorbell or
//! malformed, doorbells on the wrong page, a shared region of garbage,
//! malformed vfio-user messages, a client gone mid-transfer.
//!
//! Each case checks the answer the device owes (the ERR register and the
//! response header's `err`, a completion's status, an async event), then
//! that the device still serves a well-behaved guest — the hostile one's
//! good objects on the same device, exchanging with a second device —
//! with its data intact, and that nothing outside what the guest handed
//! the device was written: every allocation is followed by a canary page,
//! and the guest's RAM sits between two guard pages the device has no map
//! for.

use std::{
    io::{Read, Write},
    os::{fd::AsFd, unix::net::UnixStream},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use vrdma_engine::{attr::Mtu, qp::AttrMask as M};
use vrdma_pvrdma::abi::{
    self, PAGE_SIZE, cmd, eqe, qp_type, reg, send_flags, uar, wc_opcode, wr_opcode,
};
use vrdma_testkit::pvrdma::{
    Endpoint, Guest, GuestCq, GuestQp, Net, RAM_BASE, UAR_PFN, completion, connect, eventually,
    exchange, function, hdr, mac_of, one_page, page_lists_past_the_budget, rc_up, sealed_memfd,
    sge,
    side::{MR_VA, RAM},
    udp_function, unsealed_page, wait_event, wqe,
};
use vrdma_testkit::tripwire::Tripwire;
use vrdma_vfio_user::proto::{self, DmaMap, Header, IrqSet, RegionAccess, cmd as vcmd};
use vrdma_wire::Gid;
use zerocopy::IntoBytes;

/// This binary's block of addresses (see `vrdma_testkit::pvrdma`).
static NET: Net = Net::new(21);

use vrdma_testkit::errno::{EBUSY, EINVAL, EOPNOTSUPP};
/// ERR for a command code the device does not know (QEMU's value).
const BAD_COMMAND: u32 = 0xffff;
/// ERR: the shared region was refused / there is none.
const ERR_INVALID: u32 = 1;
const ERR_NO_DSR: u32 = 2;

/// Completion statuses (`pvrdma_wc_status`).
const WC_SUCCESS: u32 = 0;
const WC_LOC_LEN_ERR: u32 = 1;
const WC_LOC_QP_OP_ERR: u32 = 2;
const WC_LOC_PROT_ERR: u32 = 4;
const WC_WR_FLUSH_ERR: u32 = 5;

/// QP states.
const RESET: u32 = 0;
const RTS: u32 = 3;
const ERR: u32 = 6;

/// The last page of the 64-bit address space.
const TOP_PAGE: u64 = !(PAGE_SIZE - 1);
/// A QP number nobody has: hostile QPs are connected to it.
const NOBODY: u32 = 0xab_cdef;

fn handle(code: u32, h: u32) -> abi::Handle {
    abi::Handle {
        hdr: hdr(code),
        handle: h.into(),
        reserved: [0; 4],
    }
}

/// CREATE_QP of an RC QP, 16 deep both ways with 2 SGEs: its pages are 1
/// (state) + 1 (send) + 1 (receive).
fn qp_req(pd: u32, cq: u32, dir: u64) -> abi::CreateQp {
    abi::CreateQp {
        hdr: hdr(cmd::CREATE_QP),
        pdir_dma: dir.into(),
        pd_handle: pd.into(),
        send_cq_handle: cq.into(),
        recv_cq_handle: cq.into(),
        max_send_wr: 16.into(),
        max_recv_wr: 16.into(),
        max_send_sge: 2.into(),
        max_recv_sge: 2.into(),
        access_flags: 1.into(),
        total_chunks: 3.into(),
        send_chunks: 1.into(),
        qp_type: qp_type::RC,
        ..abi::CreateQp::default()
    }
}

/// A QP (as [`qp_req`]) over the given state, send and receive pages.
fn qp_on(g: &mut Guest, pd: u32, cq: u32, pages: [u64; 3], uar: u64) -> GuestQp {
    let dir = g.pdir(&pages);
    let r = g.command(&qp_req(pd, cq, dir)).expect("CREATE_QP");
    let resp = <abi::CreateQpRespV2 as zerocopy::FromBytes>::read_from_bytes(&r[..48]).unwrap();
    GuestQp {
        qpn: resp.qpn.get(),
        handle: resp.qp_handle.get(),
        state: pages[0],
        sq: vec![pages[1]],
        rq: vec![pages[2]],
        sq_stride: 128,
        rq_stride: 64,
        sq_wr: 16,
        rq_wr: 16,
        sq_tail: 0,
        rq_tail: 0,
        uar,
    }
}

/// A hostile QP on fresh pages, in RTS towards a QP nobody has.
fn hostile_qp(s: &mut Endpoint, cq: u32, peer: &Endpoint) -> GuestQp {
    let pages = s.g.alloc(3);
    let qp = qp_on(
        &mut s.g,
        s.pd,
        cq,
        [pages, pages + PAGE_SIZE, pages + 2 * PAGE_SIZE],
        0,
    );
    rc_up(&mut s.g, &qp, peer.gid, NOBODY, peer.mac);
    qp
}

fn cq_req(dir: u64, ctx: u32, cqe: u32, nchunks: u32) -> abi::CreateCq {
    abi::CreateCq {
        hdr: hdr(cmd::CREATE_CQ),
        pdir_dma: dir.into(),
        ctx_handle: ctx.into(),
        cqe: cqe.into(),
        nchunks: nchunks.into(),
        reserved: [0; 4],
    }
}

/// A 64-entry CQ over a state page and a data page.
fn cq_on(g: &mut Guest, state: u64, data: u64) -> GuestCq {
    cq_sized(g, state, data, 64)
}

/// A CQ of `cqe` (at most 64) entries over a state page and a data page.
fn cq_sized(g: &mut Guest, state: u64, data: u64, cqe: u32) -> GuestCq {
    let dir = g.pdir(&[state, data]);
    let r = g.command(&cq_req(dir, 0, cqe, 2)).expect("CREATE_CQ");
    GuestCq {
        handle: u32::from_le_bytes(r[16..20].try_into().unwrap()),
        state,
        data: vec![data],
        cqe,
        head: 0,
        uar: 0,
    }
}

fn srq_req(pd: u32, dir: u64, wr: u32, sge: u32, nchunks: u32) -> abi::CreateSrq {
    abi::CreateSrq {
        hdr: hdr(cmd::CREATE_SRQ),
        pdir_dma: dir.into(),
        pd_handle: pd.into(),
        nchunks: nchunks.into(),
        attrs: abi::SrqAttr {
            max_wr: wr.into(),
            max_sge: sge.into(),
            srq_limit: 0.into(),
            reserved: 0.into(),
        },
        srq_type: 0,
        reserved: [0; 7],
    }
}

fn user_mr_req(pd: u32, start: u64, length: u64, dir: u64, access: u32, n: u32) -> abi::CreateMr {
    abi::CreateMr {
        hdr: hdr(cmd::CREATE_MR),
        start: start.into(),
        length: length.into(),
        pdir_dma: dir.into(),
        pd_handle: pd.into(),
        access_flags: access.into(),
        flags: 0.into(),
        nchunks: n.into(),
    }
}

fn modify(qp: u32, attrs: abi::QpAttr, mask: u32) -> abi::ModifyQp {
    abi::ModifyQp {
        hdr: hdr(cmd::MODIFY_QP),
        qp_handle: qp.into(),
        attr_mask: mask.into(),
        attrs,
    }
}

fn create_uc(g: &mut Guest, page: u64) -> u32 {
    let r = g
        .command(&abi::CreateUc {
            hdr: hdr(cmd::CREATE_UC),
            pfn64: (UAR_PFN + page).into(),
        })
        .expect("CREATE_UC");
    u32::from_le_bytes(r[16..20].try_into().unwrap())
}

#[test]
fn commands_on_bad_destroyed_or_busy_handles_are_refused() {
    let (da, _db, mut a, mut b) = NET.pair("hostile-handles");
    let g = &mut a.g;

    // Handles that never existed.
    for code in [
        cmd::DESTROY_PD,
        cmd::DESTROY_MR,
        cmd::DESTROY_CQ,
        cmd::DESTROY_QP,
        cmd::DESTROY_UC,
        cmd::DESTROY_SRQ,
        cmd::QUERY_SRQ,
    ] {
        for h in [0, 9999, 0x00ff_ffff, u32::MAX] {
            assert_eq!(g.refused(&handle(code, h)), EINVAL, "{code} {h}");
        }
    }
    let query = |h: u32| abi::QueryQp {
        hdr: hdr(cmd::QUERY_QP),
        qp_handle: h.into(),
        attr_mask: 0.into(),
    };
    assert_eq!(g.refused(&query(9999)), EINVAL);
    assert_eq!(
        g.refused(&modify(9999, abi::QpAttr::default(), M::STATE.0)),
        EINVAL
    );
    let msrq = abi::ModifySrq {
        hdr: hdr(cmd::MODIFY_SRQ),
        srq_handle: 9999.into(),
        attr_mask: 2.into(),
        attrs: abi::SrqAttr::default(),
    };
    assert_eq!(g.refused(&msrq), EINVAL);
    // Creation on objects that do not exist.
    let p = g.alloc(3);
    let dir = g.pdir(&[p, p + PAGE_SIZE, p + 2 * PAGE_SIZE]);
    assert_eq!(g.refused(&handle(cmd::CREATE_PD, 77)), EINVAL);
    assert_eq!(g.refused(&cq_req(dir, 77, 64, 2)), EINVAL);
    assert_eq!(g.refused(&qp_req(9999, a.cq.handle, dir)), EINVAL);
    assert_eq!(g.refused(&qp_req(a.pd, 9999, dir)), EINVAL);
    let mut r = qp_req(a.pd, a.cq.handle, dir);
    r.recv_cq_handle = 9999.into();
    assert_eq!(g.refused(&r), EINVAL);
    let mut r = qp_req(a.pd, a.cq.handle, dir);
    r.is_srq = 1;
    r.srq_handle = 9999.into();
    assert_eq!(g.refused(&r), EINVAL);
    assert_eq!(
        g.refused(&user_mr_req(9999, MR_VA, 4096, dir, 1, 1)),
        EINVAL
    );
    assert_eq!(g.refused(&srq_req(9999, dir, 16, 2, 2)), EINVAL);

    // Handles of objects destroyed.
    let pd = g.create_pd(0);
    g.command(&handle(cmd::DESTROY_PD, pd)).unwrap();
    assert_eq!(g.refused(&handle(cmd::DESTROY_PD, pd)), EINVAL);
    assert_eq!(g.refused(&user_mr_req(pd, MR_VA, 4096, dir, 1, 1)), EINVAL);
    assert_eq!(g.refused(&qp_req(pd, a.cq.handle, dir)), EINVAL);
    let cq = g.create_cq(64, 0);
    g.command(&handle(cmd::DESTROY_CQ, cq.handle)).unwrap();
    assert_eq!(g.refused(&handle(cmd::DESTROY_CQ, cq.handle)), EINVAL);
    assert_eq!(g.refused(&qp_req(a.pd, cq.handle, dir)), EINVAL);
    let qp = g.create_qp(qp_type::RC, a.pd, a.cq.handle, a.cq.handle, 16);
    g.command(&handle(cmd::DESTROY_QP, qp.handle)).unwrap();
    assert_eq!(g.refused(&handle(cmd::DESTROY_QP, qp.handle)), EINVAL);
    assert_eq!(g.refused(&query(qp.handle)), EINVAL);
    assert_eq!(
        g.refused(&modify(qp.handle, abi::QpAttr::default(), M::STATE.0)),
        EINVAL
    );
    let page = g.alloc(1);
    let (mr, _, _) = g.user_mr(a.pd, MR_VA, &[page], 1);
    g.command(&handle(cmd::DESTROY_MR, mr)).unwrap();
    assert_eq!(g.refused(&handle(cmd::DESTROY_MR, mr)), EINVAL);

    // Objects still in use.
    assert_eq!(g.refused(&handle(cmd::DESTROY_PD, a.pd)), EBUSY);
    assert_eq!(g.refused(&handle(cmd::DESTROY_CQ, a.cq.handle)), EBUSY);
    // The kernel's "context" 0 is no context.
    assert_eq!(g.refused(&handle(cmd::DESTROY_UC, 0)), EINVAL);

    exchange(&mut a, &mut b);
    let s = da.stats();
    assert!(s.command_errors >= 40, "{s:?}");
}

#[test]
fn bad_sizes_fields_and_command_codes_are_refused() {
    let (_da, _db, mut a, mut b) = NET.pair("hostile-fields");
    let (pd, cqh) = (a.pd, a.cq.handle);
    let g = &mut a.g;

    // Command codes the device does not know: QEMU's 0xffff.
    for code in [21, 0x100, cmd::ACK | cmd::CREATE_PD, u32::MAX] {
        assert_eq!(g.refused(&hdr(code)), BAD_COMMAND, "{code:#x}");
    }
    // One it knows but does not implement (the driver never sends it).
    let resize = abi::ResizeCq {
        hdr: hdr(cmd::RESIZE_CQ),
        cq_handle: cqh.into(),
        cqe: 128.into(),
    };
    assert_eq!(g.refused(&resize), EOPNOTSUPP);

    // Ports, P_Keys and GIDs out of range.
    for port in [0, 2, 255] {
        let q = abi::QueryPort {
            hdr: hdr(cmd::QUERY_PORT),
            port_num: port,
            reserved: [0; 7],
        };
        assert_eq!(g.refused(&q), EINVAL);
    }
    let q = abi::QueryPkey {
        hdr: hdr(cmd::QUERY_PKEY),
        port_num: 1,
        index: 1,
        reserved: [0; 6],
    };
    assert_eq!(g.refused(&q), EINVAL);
    let bind = |index: u32, ty: u8| abi::CreateBind {
        hdr: hdr(cmd::CREATE_BIND),
        mtu: 1024.into(),
        vlan: 0.into(),
        index: index.into(),
        new_gid: Gid::from(NET.addr()).0,
        gid_type: ty,
        reserved: [0; 3],
    };
    assert_eq!(g.refused(&bind(128, abi::GID_TYPE_ROCE_V2)), EINVAL);
    assert_eq!(g.refused(&bind(u32::MAX, abi::GID_TYPE_ROCE_V2)), EINVAL);
    assert_eq!(g.refused(&bind(1, abi::GID_TYPE_ROCE_V1)), EINVAL);
    assert_eq!(g.refused(&bind(1, 0)), EINVAL);
    let unbind = abi::DestroyBind {
        hdr: hdr(cmd::DESTROY_BIND),
        index: 128.into(),
        dest_gid: [0; 16],
        reserved: [0; 4],
    };
    assert_eq!(g.refused(&unbind), EINVAL);

    // CQs: sizes and page counts.
    let (cq_pages, cq_dir) = g.pages(4);
    for (cqe, n) in [
        (0, 2),
        (3, 2),
        (100, 3),
        (16384, 257),
        (u32::MAX, 4),
        (64, 1),
        (64, 4),
        (64, 0),
        (128, 2),
    ] {
        assert_eq!(g.refused(&cq_req(cq_dir, 0, cqe, n)), EINVAL, "{cqe} {n}");
    }
    let _ = cq_pages;

    // QPs: types, sizes, SGEs, inline data, page counts.
    let qp_dir = {
        let p = g.alloc(3);
        g.pdir(&[p, p + PAGE_SIZE, p + 2 * PAGE_SIZE])
    };
    let base = qp_req(pd, cqh, qp_dir);
    let mut bad: Vec<abi::CreateQp> = Vec::new();
    for t in [0, qp_type::UC + 2, 255] {
        bad.push(abi::CreateQp { qp_type: t, ..base });
    }
    for (sw, rw) in [(0, 16), (16, 0), (3, 16), (16, 12), (2048, 16), (16, 2048)] {
        bad.push(abi::CreateQp {
            max_send_wr: sw.into(),
            max_recv_wr: rw.into(),
            ..base
        });
    }
    for (ss, rs) in [(9, 2), (2, 9), (u32::MAX, 2)] {
        bad.push(abi::CreateQp {
            max_send_sge: ss.into(),
            max_recv_sge: rs.into(),
            ..base
        });
    }
    bad.push(abi::CreateQp {
        max_inline_data: 64.into(),
        ..base
    });
    for (total, send) in [
        (2, 1),
        (5, 1),
        (3, 2),
        (3, 0),
        (0, 0),
        (0xffff, 0xffff),
        (1, 0),
    ] {
        bad.push(abi::CreateQp {
            total_chunks: total.into(),
            send_chunks: send.into(),
            ..base
        });
    }
    bad.push(abi::CreateQp {
        is_srq: 1,
        srq_handle: 0.into(),
        ..base
    });
    for r in &bad {
        assert_eq!(g.refused(r), EINVAL, "{r:?}");
    }

    // MRs: flags, lengths, page counts, rights.
    let page = g.alloc(2);
    let dir = g.pdir(&[page, page + PAGE_SIZE]);
    let mut mrs = vec![
        user_mr_req(pd, MR_VA, 0, dir, 1, 0),
        user_mr_req(pd, MR_VA, (1 << 30) + 4096, dir, 1, 2),
        user_mr_req(pd, MR_VA, 8192, dir, 1, 1),
        user_mr_req(pd, MR_VA, 8192, dir, 1, 3),
        user_mr_req(pd, MR_VA + 1, 8192, dir, 1, 2),
        user_mr_req(pd, u64::MAX - 100, 4096, dir, 1, 2),
        // Zero-based (the driver passes no IOVA).
        user_mr_req(pd, MR_VA, 8192, dir, 1 | 0x20, 2),
        // Remote write without local write (IBTA: not allowed).
        user_mr_req(pd, MR_VA, 8192, dir, 2, 2),
        // Remote atomic without local write.
        user_mr_req(pd, MR_VA, 8192, dir, 8, 2),
    ];
    for flags in [3, 4, u32::MAX] {
        let mut r = user_mr_req(pd, MR_VA, 8192, dir, 1, 2);
        r.flags = flags.into();
        mrs.push(r);
    }
    for n in [0, abi::MAX_FAST_REG_PAGES + 1, u32::MAX] {
        let mut r = user_mr_req(pd, 0, 0, 0, 1, n);
        r.flags = abi::MR_FLAG_FRMR.into();
        mrs.push(r);
    }
    for r in &mrs {
        assert_eq!(g.refused(r), EINVAL, "{r:?}");
    }

    // SRQs: type, sizes, SGEs, page counts.
    let srq_pages = g.alloc(2);
    let srq_dir = g.pdir(&[srq_pages, srq_pages + PAGE_SIZE]);
    for (wr, sge, n) in [
        (0, 2, 2),
        (3, 2, 2),
        (2048, 2, 2),
        (16, 0, 2),
        (16, 9, 2),
        (16, 2, 1),
        (16, 2, 6),
    ] {
        assert_eq!(
            g.refused(&srq_req(pd, srq_dir, wr, sge, n)),
            EINVAL,
            "{wr} {sge} {n}"
        );
    }
    let mut r = srq_req(pd, srq_dir, 16, 2, 2);
    r.srq_type = 1;
    assert_eq!(g.refused(&r), EINVAL);

    // Contexts: doorbell page 0 (the kernel's), past BAR2, taken, wrapped.
    for pfn in [UAR_PFN, UAR_PFN + 256, UAR_PFN - 1, 0, u64::MAX] {
        let r = abi::CreateUc {
            hdr: hdr(cmd::CREATE_UC),
            pfn64: pfn.into(),
        };
        assert_eq!(g.refused(&r), EINVAL, "{pfn:#x}");
    }
    let uc = create_uc(g, 5);
    let again = abi::CreateUc {
        hdr: hdr(cmd::CREATE_UC),
        pfn64: (UAR_PFN + 5).into(),
    };
    assert_eq!(g.refused(&again), EINVAL);
    g.command(&handle(cmd::DESTROY_UC, uc)).unwrap();

    // QP state transitions the verbs do not allow, and bad values.
    let q = g.create_qp(qp_type::RC, pd, cqh, cqh, 16);
    let state = |s: u32| abi::QpAttr {
        qp_state: s.into(),
        port_num: 1,
        ..abi::QpAttr::default()
    };
    for s in [RTS, 2, 4, 5, 7, u32::MAX] {
        assert_eq!(
            g.refused(&modify(q.handle, state(s), M::STATE.0)),
            EINVAL,
            "RESET to {s}"
        );
    }
    // The current state must be what it is.
    let mut wrong = state(1);
    wrong.cur_qp_state = RTS.into();
    assert_eq!(
        g.refused(&modify(q.handle, wrong, (M::STATE | M::CUR_STATE).0)),
        EINVAL
    );
    // INIT without its required attributes; a path MTU code out of range.
    assert_eq!(g.refused(&modify(q.handle, state(1), M::STATE.0)), EINVAL);
    let mut mtu = state(RESET);
    mtu.path_mtu = 9.into();
    assert_eq!(
        g.refused(&modify(q.handle, mtu, (M::STATE | M::PATH_MTU).0)),
        EINVAL
    );
    assert_eq!(g.qp_state(&q), RESET);
    // From RTS, back to RTR is not a transition.
    rc_up(g, &q, b.gid, NOBODY, b.mac);
    assert_eq!(g.refused(&modify(q.handle, state(2), M::STATE.0)), EINVAL);
    assert_eq!(g.qp_state(&q), RTS);

    exchange(&mut a, &mut b);
}

#[test]
fn objects_of_another_context_and_doorbells_on_the_wrong_page_are_refused() {
    let (da, _db, mut a, mut b) = NET.pair("hostile-ctx");
    let g = &mut a.g;

    // Two user contexts, on doorbell pages 1 and 2.
    let uc1 = create_uc(g, 1);
    let uc2 = create_uc(g, 2);
    let pd1 = g.create_pd(uc1);
    let pd2 = g.create_pd(uc2);
    let mut cq1 = g.create_cq(64, uc1);
    cq1.uar = 1;
    let mut cq2 = g.create_cq(64, uc2);
    cq2.uar = 2;
    let srq_pages = g.alloc(2);
    let srq_dir = g.pdir(&[srq_pages, srq_pages + PAGE_SIZE]);
    let r = g.command(&srq_req(pd2, srq_dir, 16, 2, 2)).unwrap();
    let srq2 = u32::from_le_bytes(r[16..20].try_into().unwrap());

    // A QP may only use its PD's context's CQs and SRQ.
    let p = g.alloc(3);
    let dir = g.pdir(&[p, p + PAGE_SIZE, p + 2 * PAGE_SIZE]);
    assert_eq!(g.refused(&qp_req(pd1, cq2.handle, dir)), EINVAL);
    let mut mixed = qp_req(pd1, cq1.handle, dir);
    mixed.recv_cq_handle = cq2.handle.into();
    assert_eq!(g.refused(&mixed), EINVAL);
    assert_eq!(g.refused(&qp_req(pd1, a.cq.handle, dir)), EINVAL);
    assert_eq!(g.refused(&qp_req(a.pd, cq1.handle, dir)), EINVAL);
    let mut srq = qp_req(pd1, cq1.handle, dir);
    srq.is_srq = 1;
    srq.srq_handle = srq2.into();
    srq.total_chunks = 2.into();
    assert_eq!(g.refused(&srq), EINVAL);
    let mut qp1 = qp_on(g, pd1, cq1.handle, [p, p + PAGE_SIZE, p + 2 * PAGE_SIZE], 1);

    // A context with objects cannot go.
    assert_eq!(g.refused(&handle(cmd::DESTROY_UC, uc1)), EBUSY);

    // Doorbells: each refused one is counted, nothing else happens.
    let before = da.stats_when(|_| true).doorbells_refused;
    let page = |n: u64| n * PAGE_SIZE;
    let mut refused = 0;
    let mut ring = |g: &mut Guest, offset: u64, v: u32| {
        g.write32(2, offset, v);
        refused += 1;
    };
    // Another context's CQ, QP and SRQ; the kernel's objects from a
    // context's page.
    ring(g, page(1) + uar::CQ_OFFSET, cq2.handle | uar::CQ_ARM);
    ring(g, page(0) + uar::CQ_OFFSET, cq1.handle | uar::CQ_ARM);
    ring(g, page(2) + uar::QP_OFFSET, qp1.handle | uar::QP_SEND);
    ring(g, page(0) + uar::QP_OFFSET, qp1.handle | uar::QP_RECV);
    ring(g, page(1) + uar::SRQ_OFFSET, srq2 | uar::SRQ_RECV);
    ring(g, page(1) + uar::QP_OFFSET, a.qp.handle | uar::QP_SEND);
    ring(g, page(2) + uar::CQ_OFFSET, a.cq.handle | uar::CQ_POLL);
    // Objects that do not exist, a page no context has, offsets that are
    // no doorbell.
    ring(g, page(0) + uar::QP_OFFSET, 0xabcd | uar::QP_SEND);
    ring(g, page(0) + uar::CQ_OFFSET, 0x77 | uar::CQ_ARM);
    ring(g, page(0) + uar::SRQ_OFFSET, 0x77 | uar::SRQ_RECV);
    ring(g, page(200) + uar::QP_OFFSET, qp1.handle | uar::QP_SEND);
    ring(g, page(0) + 12, a.qp.handle | uar::QP_SEND);
    ring(g, page(1) + 0xffc, qp1.handle | uar::QP_SEND);
    // Objects destroyed.
    let cq3 = g.create_cq(64, 0);
    let qp3 = g.create_qp(qp_type::RC, a.pd, cq3.handle, cq3.handle, 16);
    g.command(&handle(cmd::DESTROY_QP, qp3.handle)).unwrap();
    g.command(&handle(cmd::DESTROY_CQ, cq3.handle)).unwrap();
    ring(g, page(0) + uar::QP_OFFSET, qp3.handle | uar::QP_SEND);
    ring(g, page(0) + uar::CQ_OFFSET, cq3.handle | uar::CQ_ARM);
    let s = da.stats_when(|s| s.doorbells_refused >= before + refused);
    assert_eq!(s.doorbells_refused, before + refused);
    // What is the page's is taken: a receive on qp1 from page 1.
    rc_up(g, &qp1, b.gid, NOBODY, b.mac);
    g.post_recv(&mut qp1, 5, &[sge(a.buf, 64, a.lkey)]);
    g.arm(&cq1, 1, false);
    let s = da.stats_when(|_| true);
    assert_eq!(
        s.doorbells_refused,
        before + refused,
        "its own page's doorbells"
    );

    // The context's CQ holds it too (its doorbell page would otherwise
    // ring it for the next context given that page).
    g.command(&handle(cmd::DESTROY_QP, qp1.handle)).unwrap();
    g.command(&handle(cmd::DESTROY_PD, pd1)).unwrap();
    assert_eq!(g.refused(&handle(cmd::DESTROY_UC, uc1)), EBUSY);
    g.command(&handle(cmd::DESTROY_CQ, cq1.handle)).unwrap();
    g.command(&handle(cmd::DESTROY_UC, uc1)).unwrap();
    assert_eq!(create_uc(g, 1), uc1 + 2, "page 1 is free again");

    exchange(&mut a, &mut b);
}

#[test]
fn page_directories_outside_guest_memory_or_on_other_rings_are_refused() {
    let (da, _db, mut a, mut b) = NET.pair("hostile-pdir");
    let (pd, cqh, lkey) = (a.pd, a.cq.handle, a.lkey);
    let g = &mut a.g;
    let lo = RAM_BASE - PAGE_SIZE;
    let hi = g.ram_end();

    // Directories outside the RAM the device was given: the guard pages
    // either side of it, address 0, far away, the top of the address
    // space; one not page-aligned.
    for dir in [0, lo, hi, hi + (1 << 20), 1 << 40, TOP_PAGE, RAM_BASE + 8] {
        assert_eq!(g.refused(&cq_req(dir, 0, 64, 2)), EINVAL, "{dir:#x}");
        assert_eq!(g.refused(&qp_req(pd, cqh, dir)), EINVAL);
        assert_eq!(g.refused(&user_mr_req(pd, MR_VA, 8192, dir, 1, 2)), EINVAL);
        assert_eq!(g.refused(&srq_req(pd, dir, 16, 2, 2)), EINVAL);
    }
    // A directory whose table is outside, or not aligned.
    for table in [lo, hi, 1 << 40, RAM_BASE + 0x10] {
        let dir = g.alloc(1);
        g.put(dir, &table.to_le_bytes());
        assert_eq!(g.refused(&cq_req(dir, 0, 64, 2)), EINVAL);
        assert_eq!(g.refused(&qp_req(pd, cqh, dir)), EINVAL);
    }
    // Page addresses not aligned.
    let p = g.alloc(2);
    let dir = g.pdir(&[p, p + 0x800]);
    assert_eq!(g.refused(&cq_req(dir, 0, 64, 2)), EINVAL);
    // A CQ whose state page is outside: nothing to start its ring from.
    let dir = g.pdir(&[hi, p]);
    assert_eq!(g.refused(&cq_req(dir, 0, 64, 2)), EINVAL);

    // Rings over pages outside: made (a real device cannot tell either),
    // and broken on first use, each with its event.
    let state = g.alloc(1);
    let mut out_cq = cq_on(g, state, hi);
    let mut q = hostile_qp_g(g, pd, out_cq.handle, &b);
    g.post_send(&mut q, &wqe(1, 99, send_flags::SIGNALED, 0), &[]);
    wait_event(g, (eqe::CQ_ERR, out_cq.handle));
    assert!(g.poll(&mut out_cq).is_empty());
    let p = g.alloc(2);
    let q = qp_on(g, pd, cqh, [p, lo, p + PAGE_SIZE], 0);
    rc_up(g, &q, b.gid, NOBODY, b.mac);
    // (Its WQE would be in the guard page: only the index moves.)
    g.put32(q.state, 1);
    g.ring_qp(&q, uar::QP_SEND);
    wait_event(g, (eqe::QP_FATAL, q.qpn));
    assert_eq!(g.qp_state(&q), ERR);
    // An MR over pages outside: an SGE in it is a protection error.
    let dir = g.pdir(&[lo, hi]);
    let r = g
        .command(&user_mr_req(pd, MR_VA, 8192, dir, 1, 2))
        .expect("an MR over pages the device cannot reach");
    let out_lkey = u32::from_le_bytes(r[20..24].try_into().unwrap());
    let mut hcq = g.create_cq(64, 0);
    let mut q = hostile_qp_g(g, pd, hcq.handle, &b);
    g.post_send(
        &mut q,
        &wqe(3, wr_opcode::SEND, send_flags::SIGNALED, 1),
        &[sge(MR_VA + 100, 64, out_lkey)],
    );
    assert_eq!(completion(g, &mut hcq, 3).status.get(), WC_LOC_PROT_ERR);
    // So is an SGE of the DMA MR outside the RAM.
    let mut q = hostile_qp_g(g, pd, hcq.handle, &b);
    g.post_send(
        &mut q,
        &wqe(4, wr_opcode::SEND, send_flags::SIGNALED, 1),
        &[sge(hi, 64, lkey)],
    );
    assert_eq!(completion(g, &mut hcq, 4).status.get(), WC_LOC_PROT_ERR);

    // Rings on another ring's pages. A QP over a CQ's pages would have its
    // receive ring's indices be the CQ's: each completion the device
    // wrote would post a receive that completed again, for ever. Each
    // ring's pages are its own: such objects are refused.
    let cs = g.alloc(2);
    let cq = cq_on(g, cs, cs + PAGE_SIZE);
    let fresh = g.alloc(3);
    let (slot, async_data, cqn_state) = (g.cmd_slot, g.async_ring + PAGE_SIZE, g.cq_ring);
    for pages in [
        // The CQ's state page as the QP's; its entries as the QP's rings.
        [cs, fresh, fresh + PAGE_SIZE],
        [fresh, cs + PAGE_SIZE, fresh + PAGE_SIZE],
        [fresh, fresh + PAGE_SIZE, cs + PAGE_SIZE],
        // The device's async-event ring; the CQ-notification ring's state.
        [fresh, fresh + PAGE_SIZE, async_data],
        [cqn_state, fresh, fresh + PAGE_SIZE],
        // One page twice.
        [fresh, fresh + PAGE_SIZE, fresh + PAGE_SIZE],
        [fresh, fresh, fresh + PAGE_SIZE],
    ] {
        let dir = g.pdir(&pages);
        assert_eq!(g.refused(&qp_req(pd, cq.handle, dir)), EINVAL, "{pages:x?}");
    }
    for pages in [
        [cs, fresh],
        [fresh, cs + PAGE_SIZE],
        [cqn_state, fresh],
        [fresh, fresh],
    ] {
        let dir = g.pdir(&pages);
        assert_eq!(g.refused(&cq_req(dir, 0, 64, 2)), EINVAL, "{pages:x?}");
        assert_eq!(g.refused(&srq_req(pd, dir, 16, 2, 2)), EINVAL);
    }
    // Pages of a QP (not a CQ's) are taken too.
    let q = qp_on(
        g,
        pd,
        cq.handle,
        [fresh, fresh + PAGE_SIZE, fresh + 2 * PAGE_SIZE],
        0,
    );
    let dir = g.pdir(&[fresh + PAGE_SIZE, cs + PAGE_SIZE]);
    assert_eq!(g.refused(&cq_req(dir, 0, 64, 2)), EINVAL);
    // Destroyed, an object's pages are free again.
    g.command(&handle(cmd::DESTROY_QP, q.handle)).unwrap();
    g.command(&handle(cmd::DESTROY_CQ, cq.handle)).unwrap();
    let cq = cq_on(g, fresh, fresh + PAGE_SIZE);
    let mut q = qp_on(
        g,
        pd,
        cq.handle,
        [cs, cs + PAGE_SIZE, fresh + 2 * PAGE_SIZE],
        0,
    );
    // A QP whose send ring is the command slot (not a ring: the device
    // only reads WQEs from it, as garbage). The device settles.
    let st = g.alloc(2);
    let mut q2 = qp_on(g, pd, hcq.handle, [st, slot, st + PAGE_SIZE], 0);
    rc_up(g, &q2, b.gid, NOBODY, b.mac);
    g.write_send(&mut q2, &wqe(9, 99, 0, 0), &[]);
    g.post_recv(&mut q2, 10, &[]);
    g.ring_qp(&q2, uar::QP_SEND);
    rc_up(g, &q, b.gid, NOBODY, b.mac);
    g.post_recv(&mut q, 7, &[sge(a.buf, 64, lkey)]);
    g.post_send(&mut q, &wqe(8, 99, send_flags::SIGNALED, 0), &[]);
    // The device settles: its counters stop moving (over longer than its
    // idle wait of 200 ms).
    let mut last = da.stats();
    let settled = (0..20).any(|_| {
        std::thread::sleep(Duration::from_millis(300));
        let now = da.stats();
        let same = now == last;
        last = now;
        same
    });
    assert!(settled, "the device keeps working on its own: {last:?}");
    // The commands still work (the slot a QP reads its WQEs from).
    let _ = g.create_pd(0);
    // Nothing outside the RAM and nothing in the canaries was written.
    g.check_canaries();

    exchange(&mut a, &mut b);
}

/// A hostile QP on `pd` (with `g` alone), in RTS towards nobody on
/// device `peer`.
fn hostile_qp_g(g: &mut Guest, pd: u32, cq: u32, peer: &Endpoint) -> GuestQp {
    let pages = g.alloc(3);
    let qp = qp_on(
        g,
        pd,
        cq,
        [pages, pages + PAGE_SIZE, pages + 2 * PAGE_SIZE],
        0,
    );
    rc_up(g, &qp, peer.gid, NOBODY, peer.mac);
    qp
}

#[test]
fn wild_ring_indices_break_only_their_queue_once() {
    let (da, _db, mut a, mut b) = NET.pair("hostile-rings");
    let mut hcq = a.g.create_cq(256, 0);

    // A send producer index the driver could never write.
    let mut q1 = hostile_qp(&mut a, hcq.handle, &b);
    let g = &mut a.g;
    let broken = da.stats().rings.broken_rings;
    g.put32(q1.state, 0xdead_beef);
    g.ring_qp(&q1, uar::QP_SEND);
    wait_event(g, (eqe::QP_FATAL, q1.qpn));
    assert_eq!(g.qp_state(&q1), ERR);
    // Rung again and again: broken once, one event. The device has taken
    // all five doorbells (its count) before the event ring is read.
    let rung = da.stats().doorbells;
    for _ in 0..5 {
        g.ring_qp(&q1, uar::QP_SEND | uar::QP_RECV);
    }
    assert!(
        da.stats_when(|s| s.doorbells >= rung + 5).doorbells >= rung + 5,
        "the five doorbells taken"
    );
    assert_eq!(g.events(), vec![], "one QP_FATAL for a broken ring");
    assert_eq!(
        da.stats_when(|s| s.rings.broken_rings > broken)
            .rings
            .broken_rings,
        broken + 1
    );

    // A receive producer index of twice the ring (the first one invalid).
    let q2 = hostile_qp_g(g, a.pd, hcq.handle, &b);
    g.put32(q2.state + 8, 32);
    g.ring_qp(&q2, uar::QP_RECV);
    wait_event(g, (eqe::QP_FATAL, q2.qpn));
    // A valid index, but more than a ring ahead of what the device gave
    // back: 17 WQEs in a ring of 16.
    let q3 = hostile_qp_g(g, a.pd, hcq.handle, &b);
    g.put32(q3.state, 17);
    g.ring_qp(&q3, uar::QP_SEND);
    wait_event(g, (eqe::QP_FATAL, q3.qpn));
    assert!(g.poll(&mut hcq).is_empty(), "nothing was taken from them");

    // A CQ whose consumer index is wild: the completion cannot go in; the
    // CQ overflows (CQ_ERR) and its QP fails.
    let mut wild = g.create_cq(64, 0);
    g.put32(wild.state + 12, 0xffff_fff0);
    let mut q4 = hostile_qp_g(g, a.pd, wild.handle, &b);
    g.post_send(&mut q4, &wqe(40, 99, send_flags::SIGNALED, 0), &[]);
    wait_event(g, (eqe::CQ_ERR, wild.handle));
    assert_eq!(g.qp_state(&q4), ERR);
    wild.head = 0;
    g.put32(wild.state + 12, 0);
    assert!(g.poll(&mut wild).is_empty());

    // Back to RESET, the broken QP is whole again: its ring is taken.
    g.modify_qp(
        &q1,
        abi::QpAttr {
            qp_state: RESET.into(),
            ..abi::QpAttr::default()
        },
        M::STATE.0,
    )
    .unwrap();
    let drained = g.poll(&mut hcq);
    assert!(drained.iter().all(|c| c.qp.get() != u64::from(q1.handle)));
    for off in [0, 4, 8, 12] {
        g.put32(q1.state + off, 0);
    }
    q1.sq_tail = 0;
    q1.rq_tail = 0;
    rc_up(g, &q1, b.gid, NOBODY, b.mac);
    g.post_send(&mut q1, &wqe(41, 99, send_flags::SIGNALED, 0), &[]);
    assert_eq!(completion(g, &mut hcq, 41).status.get(), WC_LOC_QP_OP_ERR);

    // An SRQ with a wild producer index: broken once, one SRQ_ERR (an SRQ
    // has no QP of its own to fail).
    let sp = g.alloc(2);
    let sdir = g.pdir(&[sp, sp + PAGE_SIZE]);
    let r = g.command(&srq_req(a.pd, sdir, 16, 2, 2)).unwrap();
    let srq = u32::from_le_bytes(r[16..20].try_into().unwrap());
    let broken = da.stats().rings.broken_rings;
    g.put32(sp + 8, 0x8000_0000);
    for _ in 0..3 {
        g.write32(2, uar::SRQ_OFFSET, srq | uar::SRQ_RECV);
    }
    let seen = wait_event(g, (eqe::SRQ_ERR, srq));
    assert_eq!(
        da.stats_when(|s| s.rings.broken_rings > broken)
            .rings
            .broken_rings,
        broken + 1
    );
    let more = g.events();
    let errs = seen
        .iter()
        .chain(&more)
        .filter(|&&e| e == (eqe::SRQ_ERR, srq));
    assert_eq!(errs.count(), 1, "one SRQ_ERR for a broken ring");

    // The device's own async ring, its consumer index wild: the event is
    // dropped and counted; put right, events come again.
    let drops = da.stats().ring_drops;
    let head = g.async_head;
    g.put32(g.async_ring + 12, 0xffff_ffff);
    let q5 = hostile_qp_g(g, a.pd, hcq.handle, &b);
    g.put32(q5.state, 0xffff);
    g.ring_qp(&q5, uar::QP_SEND);
    let s = da.stats_when(|s| s.ring_drops > drops);
    assert_eq!(s.ring_drops, drops + 1);
    g.put32(g.async_ring + 12, head);
    assert_eq!(g.events(), vec![]);
    let q6 = hostile_qp_g(g, a.pd, hcq.handle, &b);
    g.put32(q6.state + 8, 0xffff);
    g.ring_qp(&q6, uar::QP_RECV);
    wait_event(g, (eqe::QP_FATAL, q6.qpn));

    exchange(&mut a, &mut b);
}

#[test]
fn malformed_wqes_complete_in_error_in_their_turn() {
    let (da, _db, mut a, mut b) = NET.pair("hostile-wqe");
    let (pd, lkey, buf) = (a.pd, a.lkey, a.buf);
    let g = &mut a.g;
    let mut hcq = g.create_cq(256, 0);

    let mut case = |g: &mut Guest, w: abi::SqWqeHdr, sges: &[abi::Sge], status: u32| {
        let mut q = hostile_qp_g(g, pd, hcq.handle, &b);
        let id = w.wr_id.get();
        g.post_send(&mut q, &w, sges);
        // A good WQE after it is flushed: the QP is in ERR.
        g.post_send(
            &mut q,
            &wqe(id + 1, wr_opcode::SEND, send_flags::SIGNALED, 1),
            &[sge(buf, 16, lkey)],
        );
        let c = g.poll_n(&mut hcq, 2);
        assert_eq!(c.len(), 2, "case {id}");
        assert_eq!(
            (c[0].wr_id.get(), c[0].status.get()),
            (id, status),
            "case {id}"
        );
        assert_eq!(c[0].qp.get(), u64::from(q.handle));
        assert_eq!(
            (c[1].wr_id.get(), c[1].status.get()),
            (id + 1, WC_WR_FLUSH_ERR)
        );
        assert_eq!(g.qp_state(&q), ERR, "case {id}");
        // The ring slots came back.
        assert!(eventually(|| g.sq_cons(&q) == 2), "case {id}: sq cons");
    };
    // Opcodes unknown, or with no meaning on RC (LSO).
    case(
        g,
        wqe(100, 99, send_flags::SIGNALED, 0),
        &[],
        WC_LOC_QP_OP_ERR,
    );
    case(g, wqe(110, u32::MAX, 0, 0), &[], WC_LOC_QP_OP_ERR);
    case(
        g,
        wqe(120, wr_opcode::LSO, send_flags::SIGNALED, 0),
        &[],
        WC_LOC_QP_OP_ERR,
    );
    // More SGEs than the QP has, or than the WQE slot holds.
    case(
        g,
        wqe(130, wr_opcode::SEND, send_flags::SIGNALED, 3),
        &[sge(buf, 1, lkey); 3],
        WC_LOC_LEN_ERR,
    );
    case(
        g,
        wqe(140, wr_opcode::SEND, send_flags::SIGNALED, u32::MAX),
        &[],
        WC_LOC_LEN_ERR,
    );
    // Inline data (the device offers none).
    case(
        g,
        wqe(
            150,
            wr_opcode::SEND,
            send_flags::SIGNALED | send_flags::INLINE,
            0,
        ),
        &[],
        WC_LOC_QP_OP_ERR,
    );
    // SGEs with a key nobody has, or past the MR's end.
    case(
        g,
        wqe(160, wr_opcode::SEND, send_flags::SIGNALED, 1),
        &[sge(buf, 64, 0xdead_0000)],
        WC_LOC_PROT_ERR,
    );
    // (A READ's local SGEs are looked at when its response comes, as in
    // rxe: not here, where nobody answers.) The second of two SGEs bad:
    case(
        g,
        wqe(170, wr_opcode::SEND, send_flags::SIGNALED, 2),
        &[sge(buf, 64, lkey), sge(buf, 64, lkey ^ 0xff)],
        WC_LOC_PROT_ERR,
    );
    let user_page = g.alloc(1);
    let (_, user_lkey, _) = g.user_mr(pd, MR_VA, &[user_page], 1);
    case(
        g,
        wqe(180, wr_opcode::SEND, send_flags::SIGNALED, 1),
        &[sge(MR_VA + 4000, 200, user_lkey)],
        WC_LOC_PROT_ERR,
    );
    // Fast registrations of nothing: a page shift the device does not
    // take, an empty list, an MR that does not exist.
    for (id, shift, len, key) in [
        (190, 16u64, 1u32, 0u32),
        (200, 12, 0, 0),
        (210, 12, 1, 0xffff_ff00),
    ] {
        let mut f = wqe(id, wr_opcode::FAST_REG_MR, send_flags::SIGNALED, 0);
        let dir = g.pdir(&[user_page]);
        f.wr[1] = dir.into();
        f.wr[2] = (u64::from(len) << 32 | shift).into();
        f.wr[4] = u64::from(key).into();
        case(g, f, &[], WC_LOC_QP_OP_ERR);
    }

    // A receive WQE with more SGEs than the QP has: the QP fails (with
    // its event) and the WQE is flushed.
    let mut q = hostile_qp_g(g, pd, hcq.handle, &b);
    g.post_recv(&mut q, 300, &[sge(buf, 8, lkey); 3]);
    wait_event(g, (eqe::QP_FATAL, q.qpn));
    let c = completion(g, &mut hcq, 300);
    assert_eq!(c.status.get(), WC_WR_FLUSH_ERR);
    assert_eq!(c.opcode.get() & wc_opcode::RECV, wc_opcode::RECV);

    // On UD QPs: an address vector of another PD, an RDMA WRITE; and, to
    // show the rest is right, a good SEND (to a QP nobody has: a datagram
    // completes when it leaves).
    let other_pd = g.create_pd(0);
    let mut ud_case = |g: &mut Guest, w: abi::SqWqeHdr, av_pd: u32, status: u32| {
        let pages = g.alloc(3);
        let dir = g.pdir(&[pages, pages + PAGE_SIZE, pages + 2 * PAGE_SIZE]);
        let mut req = qp_req(pd, hcq.handle, dir);
        req.qp_type = qp_type::UD;
        let r = g.command(&req).unwrap();
        let handle = u32::from_le_bytes(r[20..24].try_into().unwrap());
        let mut ud = GuestQp {
            qpn: handle,
            handle,
            state: pages,
            sq: vec![pages + PAGE_SIZE],
            rq: vec![pages + 2 * PAGE_SIZE],
            sq_stride: 128,
            rq_stride: 64,
            sq_wr: 16,
            rq_wr: 16,
            sq_tail: 0,
            rq_tail: 0,
            uar: 0,
        };
        let mut at = abi::QpAttr {
            qp_state: 1.into(),
            port_num: 1,
            qkey: 0x1111.into(),
            ..abi::QpAttr::default()
        };
        g.modify_qp(&ud, at, (M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY).0)
            .unwrap();
        at.qp_state = 2.into();
        g.modify_qp(&ud, at, M::STATE.0).unwrap();
        at.qp_state = 3.into();
        g.modify_qp(&ud, at, (M::STATE | M::SQ_PSN).0).unwrap();
        let mut w = w;
        w.wr[0] = (u64::from(0x1111u32) << 32 | u64::from(NOBODY)).into();
        let av = abi::Av {
            port_pd: (1 << 24 | av_pd).into(),
            dgid: b.gid.0,
            hop_limit: 64,
            ..abi::Av::default()
        };
        w.wr.as_mut_bytes()[8..48].copy_from_slice(av.as_bytes());
        g.post_send(&mut ud, &w, &[sge(buf, 16, lkey)]);
        let id = w.wr_id.get();
        assert_eq!(
            completion(g, &mut hcq, id).status.get(),
            status,
            "UD case {id}"
        );
    };
    let send = |id| wqe(id, wr_opcode::SEND, send_flags::SIGNALED, 1);
    ud_case(g, send(400), other_pd, WC_LOC_QP_OP_ERR);
    ud_case(
        g,
        wqe(410, wr_opcode::RDMA_WRITE, send_flags::SIGNALED, 1),
        pd,
        WC_LOC_QP_OP_ERR,
    );
    ud_case(g, send(420), pd, WC_SUCCESS);

    let s = da.stats_when(|s| s.rings.malformed_wqes >= 10);
    assert!(s.rings.malformed_wqes >= 10, "{s:?}");
    // Each counted by the rule it broke (issue 38: a refusal can be seen).
    for (name, n) in [
        (
            "pvrdma.refused.send_wqe.an_opcode_the_qp_type_has_no_use_for",
            4,
        ),
        ("pvrdma.refused.send_wqe.more_sges_than_the_queue_takes", 2),
        (
            "pvrdma.refused.send_wqe.inline_data_max_inline_data_is_0",
            1,
        ),
        (
            "pvrdma.refused.send_wqe.4_kib_pages_in_a_fast_registration",
            1,
        ),
        (
            "pvrdma.refused.send_wqe.1_to_max_fast_reg_pages_pages_in_a_fast_registration",
            1,
        ),
        (
            "pvrdma.refused.send_wqe.a_key_naming_a_fast_registration_mr",
            1,
        ),
        (
            "pvrdma.refused.send_wqe.an_address_vector_of_the_qp_s_pd",
            1,
        ),
        ("pvrdma.refused.recv_wqe.more_sges_than_the_queue_takes", 1),
    ] {
        assert_eq!(da.counter_when(name, |v| v >= n), n, "{name}");
    }
    exchange(&mut a, &mut b);
}

#[test]
fn wqes_and_buffers_rewritten_after_the_doorbell() {
    let (_da, _db, mut a, mut b) = NET.pair("hostile-toctou");

    // A SEND WQE rewritten once its doorbell returned: the device copied
    // it, what it sends is what was there.
    let p1: Vec<u8> = (0..64u8).collect();
    a.g.put(a.buf, &p1);
    a.g.put(a.buf + PAGE_SIZE, &[0xee; 128]);
    b.g.post_recv(&mut b.qp, 10, &[sge(b.buf, 4096, b.lkey)]);
    // And the receive WQE rewritten the same way, to a canary page.
    let canary = b.g.canary(1);
    let recv_at = {
        let slot = u64::from((b.qp.rq_tail + 2 * 16 - 1) & 15);
        b.qp.rq[0] + slot * b.qp.rq_stride
    };
    b.g.put(recv_at + 16, sge(canary, 4096, b.lkey).as_bytes());
    let at = a.g.write_send(
        &mut a.qp,
        &wqe(500, wr_opcode::SEND, send_flags::SIGNALED, 1),
        &[sge(a.buf, 64, a.lkey)],
    );
    a.g.ring_qp(&a.qp, uar::QP_SEND);
    a.g.put(at, wqe(666, 99, send_flags::SIGNALED, 1).as_bytes());
    a.g.put(at + 80, sge(a.buf + PAGE_SIZE, 128, a.lkey).as_bytes());
    let c = completion(&mut a.g, &mut a.cq, 500);
    assert_eq!(
        (c.status.get(), c.opcode.get()),
        (WC_SUCCESS, wc_opcode::SEND)
    );
    let c = completion(&mut b.g, &mut b.cq, 10);
    assert_eq!((c.status.get(), c.byte_len.get()), (WC_SUCCESS, 64));
    assert_eq!(b.g.get(b.buf, 64), p1);
    b.g.check_canaries();

    // A 256 KiB WRITE whose source is rewritten over and over while it
    // goes: every word that lands is one the source held at some point
    // (each packet's payload and ICRC come from one copy), and the WRITE
    // completes.
    const LEN: u64 = 256 << 10;
    let src = a.g.alloc(LEN / PAGE_SIZE);
    let dst = b.g.alloc(LEN / PAGE_SIZE);
    let pages: Vec<u64> = (0..LEN / PAGE_SIZE).map(|i| dst + i * PAGE_SIZE).collect();
    let va = 0x6000_0000_0000u64;
    let (_, _, rkey) = b.g.user_mr(b.pd, va, &pages, 1 | 2);
    let patterns: Vec<Vec<u8>> = (0..=8u32)
        .map(|k| {
            (0..(LEN / 4) as u32)
                .flat_map(|i| (k << 24 | i).to_le_bytes())
                .collect()
        })
        .collect();
    a.g.put(src, &patterns[1]);
    let mut w = wqe(600, wr_opcode::RDMA_WRITE, send_flags::SIGNALED, 1);
    w.wr[0] = va.into();
    w.wr[1] = u64::from(rkey).into();
    a.g.post_send(&mut a.qp, &w, &[sge(src, LEN as u32, a.lkey)]);
    let mut k = 1;
    let deadline = Instant::now() + Duration::from_secs(10);
    let done = loop {
        k = k % 8 + 1;
        a.g.put(src, &patterns[k]);
        // The rewriting paced (a millisecond a pass): a loop with no pause
        // took a core from the two device threads on a 2-core machine with
        // the other tests running, and the WRITE ran out of retries.
        std::thread::sleep(Duration::from_millis(1));
        let c = a.g.poll(&mut a.cq);
        if let Some(c) = c.first() {
            break *c;
        }
        assert!(Instant::now() < deadline, "the WRITE never completed");
    };
    assert_eq!((done.wr_id.get(), done.status.get()), (600, WC_SUCCESS));
    let got = b.g.get(dst, LEN as usize);
    for (i, w) in got.chunks(4).enumerate() {
        let v = u32::from_le_bytes(w.try_into().unwrap());
        assert_eq!(v & 0xff_ffff, i as u32, "word {i}");
        assert!((1..=8).contains(&(v >> 24)), "word {i}: {v:#x}");
    }

    exchange(&mut a, &mut b);
}

#[test]
fn a_shared_region_of_garbage_is_refused_and_a_good_one_still_taken() {
    let da = NET.device("hostile-dsr-a");
    let db = NET.device("hostile-dsr-b");
    let mut b = Endpoint::new(&db);
    let mut g = Guest::connect(&da.socket, RAM);
    g.guarded = true;

    // Nothing before a shared region: REQUEST, ACTIVATE, UNQUIESCE.
    g.write32(1, reg::REQUEST, 0);
    assert_eq!(g.read32(1, reg::ERR), ERR_NO_DSR);
    g.write32(1, reg::CTL, reg::CTL_ACTIVATE);
    assert_eq!(g.read32(1, reg::ERR), ERR_NO_DSR);
    g.write32(1, reg::CTL, reg::CTL_UNQUIESCE);
    assert_eq!(g.read32(1, reg::ERR), ERR_NO_DSR);
    g.write32(1, reg::CTL, 7);
    assert_eq!(g.read32(1, reg::ERR), ERR_INVALID);
    // Accesses the driver never makes: ignored.
    g.write32(1, 0x800, 1);
    g.write32(1, reg::VERSION, 99);
    assert_eq!(g.read32(1, reg::VERSION), abi::VERSION);

    // A region outside the RAM, or running off its end.
    let hi = g.ram_end();
    for at in [0, RAM_BASE - PAGE_SIZE, hi, hi - 100, 1 << 40, TOP_PAGE] {
        g.write32(1, reg::DSRLOW, at as u32);
        g.write32(1, reg::DSRHIGH, (at >> 32) as u32);
        assert_eq!(g.read32(1, reg::ERR), ERR_INVALID, "{at:#x}");
        g.write32(1, reg::CTL, reg::CTL_ACTIVATE);
        assert_eq!(g.read32(1, reg::ERR), ERR_NO_DSR);
    }

    // Regions whose fields are bad.
    let good = g.dsr_template();
    let lo = RAM_BASE - PAGE_SIZE;
    let mut bad: Vec<abi::Dsr> = Vec::new();
    for slot in [0, lo, hi, good.cmd_slot_dma.get() + 8, TOP_PAGE] {
        bad.push(abi::Dsr {
            cmd_slot_dma: slot.into(),
            ..good
        });
        bad.push(abi::Dsr {
            resp_slot_dma: slot.into(),
            ..good
        });
    }
    for n in [0, 1, 513, u32::MAX] {
        let mut d = good;
        d.async_ring_pages.num_pages = n.into();
        bad.push(d);
        let mut d = good;
        d.cq_ring_pages.num_pages = n.into();
        bad.push(d);
    }
    for dir in [0, lo, hi, good.async_ring_pages.pdir_dma.get() + 8] {
        let mut d = good;
        d.async_ring_pages.pdir_dma = dir.into();
        bad.push(d);
        let mut d = good;
        d.cq_ring_pages.pdir_dma = dir.into();
        bad.push(d);
    }
    // The two rings on the same pages.
    let mut d = good;
    d.cq_ring_pages = good.async_ring_pages;
    bad.push(d);
    // Garbage: every byte 0xff; a pattern.
    bad.push(zerocopy::FromBytes::read_from_bytes(&[0xff; 280][..]).unwrap());
    let junk: Vec<u8> = (0..280u32).map(|i| (i * 97 + 13) as u8).collect();
    bad.push(zerocopy::FromBytes::read_from_bytes(&junk[..]).unwrap());
    for d in &bad {
        assert_eq!(g.load_dsr(d), ERR_INVALID, "{d:?}");
        g.write32(1, reg::CTL, reg::CTL_ACTIVATE);
        assert_eq!(g.read32(1, reg::ERR), ERR_NO_DSR);
        g.write32(1, reg::REQUEST, 0);
        assert_eq!(g.read32(1, reg::ERR), ERR_NO_DSR);
    }

    // A good region is taken, and a later bad one forgets it.
    assert_eq!(g.load_dsr(&good), 0);
    g.write32(1, reg::IMR, 0);
    g.write32(1, reg::CTL, reg::CTL_ACTIVATE);
    assert_eq!(g.read32(1, reg::ERR), 0);
    let pd = g.create_pd(0);
    assert_eq!(g.load_dsr(&bad[0]), ERR_INVALID);
    g.write32(1, reg::REQUEST, 0);
    assert_eq!(g.read32(1, reg::ERR), ERR_NO_DSR);
    // A reset, then the probe as the driver does it: all from nothing.
    g.write32(1, reg::CTL, reg::CTL_RESET);
    assert_eq!(g.probe(), 0);
    assert_eq!(g.create_pd(0), pd, "a fresh device");
    g.check_canaries();
    drop(g);

    let mut a = Endpoint::new(&da);
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);
}

#[test]
fn a_command_whose_response_cannot_be_written_does_not_run() {
    let da = NET.device("hostile-resp-a");
    let db = NET.device("hostile-resp-b");
    let mut b = Endpoint::new(&db);
    let mut g = Guest::connect(&da.socket, RAM);
    // The response slot in memory of its own, which goes away.
    let extra = 0x1_0000_0000u64;
    let view = g.map_extra(extra, PAGE_SIZE);
    let mut dsr = g.dsr_template();
    dsr.resp_slot_dma = extra.into();
    g.resp_slot = extra;
    assert_eq!(g.load_dsr(&dsr), 0);
    g.write32(1, reg::IMR, 0);
    g.write32(1, reg::CTL, reg::CTL_ACTIVATE);
    assert_eq!(g.read32(1, reg::ERR), 0);
    let pd = create_pd_via(&mut g, &view, 0);
    g.unmap(extra, PAGE_SIZE);
    for _ in 0..3 {
        g.write32(1, reg::REQUEST, 0);
        assert_eq!(g.read32(1, reg::ERR), ERR_INVALID);
    }
    assert!(!g.irq_fired(0));
    // Back: the next PD is the next handle (none was made meanwhile).
    let view = g.map_extra(extra, PAGE_SIZE);
    assert_eq!(create_pd_via(&mut g, &view, 0), pd + 1);
    g.check_canaries();
    drop(g);

    let mut a = Endpoint::new(&da);
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);
}

/// CREATE_PD with the response slot in `view` (memory apart from RAM).
fn create_pd_via(g: &mut Guest, view: &vm_memory::GuestMemoryMmap<()>, ctx: u32) -> u32 {
    use vm_memory::Bytes;
    let mut slot = vec![0u8; abi::MAX_REQUEST];
    slot[..24].copy_from_slice(handle(cmd::CREATE_PD, ctx).as_bytes());
    g.put(g.cmd_slot, &slot);
    g.write32(1, reg::REQUEST, 0);
    assert_eq!(g.read32(1, reg::ERR), 0);
    assert!(g.wait_irq(0));
    let mut r = [0u8; 24];
    view.read_slice(&mut r, vm_memory::GuestAddress(g.resp_slot))
        .unwrap();
    assert_eq!(
        u32::from_le_bytes(r[8..12].try_into().unwrap()),
        cmd::ACK | cmd::CREATE_PD
    );
    u32::from_le_bytes(r[16..20].try_into().unwrap())
}

#[test]
fn a_client_gone_mid_write_stream_leaves_the_device_reset_for_the_next() {
    let da = NET.device("hostile-gone-a");
    let db = NET.device("hostile-gone-b");
    let mut b = Endpoint::new(&db);
    let mut a = Endpoint::new(&da);
    let first_pd = a.pd;
    connect(&mut a, &mut b);
    // A stream of 256 KiB WRITEs into B, and the client gone while they
    // go.
    const LEN: u64 = 256 << 10;
    let src = a.g.alloc(LEN / PAGE_SIZE);
    let dst = b.g.alloc(LEN / PAGE_SIZE);
    let pages: Vec<u64> = (0..LEN / PAGE_SIZE).map(|i| dst + i * PAGE_SIZE).collect();
    let va = 0x6000_0000_0000u64;
    let (_, _, rkey) = b.g.user_mr(b.pd, va, &pages, 1 | 2);
    a.g.put(src, &vec![0x5a; LEN as usize]);
    for i in 0..16 {
        let mut w = wqe(i, wr_opcode::RDMA_WRITE, send_flags::SIGNALED, 1);
        w.wr[0] = va.into();
        w.wr[1] = u64::from(rkey).into();
        a.g.write_send(&mut a.qp, &w, &[sge(src, LEN as u32, a.lkey)]);
    }
    let resets = da.stats().resets;
    a.g.ring_qp(&a.qp, uar::QP_SEND);
    drop(a);

    // The next client: a device from nothing (the first PD's handle
    // again), which works.
    let mut a = Endpoint::new(&da);
    assert_eq!(a.pd, first_pd);
    assert!(da.stats().resets > resets);
    assert_eq!(da.clients(), 2);
    // B's QP was mid-message from the old one: B's guest makes a new one.
    b.qp =
        b.g.create_qp(qp_type::RC, b.pd, b.cq.handle, b.cq.handle, 16);
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);
    b.g.check_canaries();
}

/// Sends raw bytes on a new connection to `socket`; true if the server
/// closed it (EOF within 2 s).
fn closed_after(socket: &std::path::Path, bytes: &[u8]) -> bool {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

fn header(command: u16, size: u32) -> Header {
    Header {
        id: 1,
        command,
        size,
        flags: 0,
        error: 0,
    }
}

#[test]
fn malformed_vfio_user_messages_are_answered_or_end_the_connection() {
    let da = NET.device("hostile-vfio-a");
    let db = NET.device("hostile-vfio-b");
    let mut b = Endpoint::new(&db);

    // Framing the server cannot follow ends the connection; the next
    // client is served.
    assert!(closed_after(
        &da.socket,
        header(vcmd::VERSION, 8).as_bytes()
    ));
    assert!(closed_after(
        &da.socket,
        header(vcmd::VERSION, u32::MAX).as_bytes()
    ));
    assert!(closed_after(
        &da.socket,
        &header(vcmd::VERSION, 100).as_bytes()[..10]
    ));
    assert!(closed_after(
        &da.socket,
        header(vcmd::VERSION, 100).as_bytes()
    ));

    let mut g = Guest::connect(&da.socket, RAM);
    // A second client while one is connected is turned away.
    let mut v = proto::VersionHead { major: 0, minor: 0 }
        .as_bytes()
        .to_vec();
    v.extend_from_slice(b"{}\0");
    let mut msg = header(vcmd::VERSION, (16 + v.len()) as u32)
        .as_bytes()
        .to_vec();
    msg.extend_from_slice(&v);
    assert!(closed_after(&da.socket, &msg), "a second client");

    let errno = |g: &mut Guest, command: u16, payload: &[u8]| -> u32 {
        let (h, p) = g.request(command, payload, &[]);
        assert_ne!(h.flags & proto::flags::ERROR, 0, "command {command}");
        assert!(p.is_empty());
        h.error
    };
    let access = |region: u32, offset: u64, count: u32| {
        RegionAccess {
            offset,
            region,
            count,
        }
        .as_bytes()
        .to_vec()
    };
    assert_eq!(errno(&mut g, 99, &[]), EOPNOTSUPP);
    assert_eq!(errno(&mut g, vcmd::DMA_READ, &[0; 24]), EOPNOTSUPP);
    // Region accesses outside their region, or of nothing.
    for (region, offset, count) in [
        (9, 0, 4),
        (1, 0x1000, 4),
        (1, 0xffe, 4),
        (1, u64::MAX, 4),
        (1, 0, 0),
        (3, 0, 4),
        (2, 256 * PAGE_SIZE, 4),
    ] {
        assert_eq!(
            errno(&mut g, vcmd::REGION_READ, &access(region, offset, count)),
            22,
            "{region} {offset:#x} {count}"
        );
    }
    assert_eq!(
        errno(&mut g, vcmd::REGION_READ, &access(1, 0, 1 << 30)),
        7,
        "E2BIG"
    );
    let mut w = access(1, 0x2000, 4);
    w.extend_from_slice(&[1, 2, 3, 4]);
    assert_eq!(errno(&mut g, vcmd::REGION_WRITE, &w), 22);
    let mut w = access(1, 0, 8);
    w.extend_from_slice(&[1, 2, 3, 4]);
    assert_eq!(errno(&mut g, vcmd::REGION_WRITE, &w), 22, "count vs data");
    // Registers written 2 bytes at a time: ignored (the driver never
    // does it).
    let mut w = access(1, reg::CTL, 2);
    w.extend_from_slice(&[2, 0]);
    g.ok(vcmd::REGION_WRITE, &w, &[]);
    // DMA maps overlapping, unaligned, of a file too short; unmapping
    // what was never mapped.
    let fd = sealed_memfd(c"short", 4096);
    let map = |addr: u64, size: u64| DmaMap {
        argsz: 32,
        flags: proto::dma::READ | proto::dma::WRITE,
        offset: 0,
        addr,
        size,
    };
    for (m, want) in [
        (map(RAM_BASE + PAGE_SIZE, PAGE_SIZE), 17),
        (map(RAM_BASE - PAGE_SIZE, 2 * PAGE_SIZE), 17),
        (map(0x3_0000_0000, 2 * PAGE_SIZE), 22),
        (map(0x3_0000_0100, PAGE_SIZE), 22),
        (map(TOP_PAGE, 2 * PAGE_SIZE), 22),
    ] {
        let (h, _) = g.request(vcmd::DMA_MAP, m.as_bytes(), &[fd.as_fd()]);
        assert_eq!(h.error, want, "{m:?}");
    }
    let u = proto::DmaUnmap {
        argsz: 24,
        flags: 0,
        addr: 0x5_0000_0000,
        size: PAGE_SIZE,
    };
    assert_eq!(errno(&mut g, vcmd::DMA_UNMAP, u.as_bytes()), 2);
    // Interrupts of an index the device has not, or as booleans.
    let set = |index: u32, flags: u32| IrqSet {
        argsz: 20,
        flags,
        index,
        start: 0,
        count: 1,
    };
    let trigger = proto::irq::DATA_NONE | proto::irq::ACTION_TRIGGER;
    assert_eq!(
        errno(&mut g, vcmd::DEVICE_SET_IRQS, set(9, trigger).as_bytes()),
        22
    );
    assert_eq!(
        errno(
            &mut g,
            vcmd::DEVICE_SET_IRQS,
            set(2, proto::irq::DATA_BOOL | proto::irq::ACTION_TRIGGER).as_bytes()
        ),
        95
    );
    let mut far = set(2, trigger);
    far.start = 2;
    far.count = 5;
    assert_eq!(errno(&mut g, vcmd::DEVICE_SET_IRQS, far.as_bytes()), 22);
    // A descriptor where none is taken.
    let (h, _) = g.request(vcmd::REGION_READ, &access(1, 0, 4), &[fd.as_fd()]);
    assert_eq!(h.error, 22);
    // Memory mapped with no descriptor: recorded, never reachable.
    let nofd = map(0x2_0000_0000, PAGE_SIZE);
    g.ok(vcmd::DMA_MAP, nofd.as_bytes(), &[]);

    // The device behind all that is whole.
    assert_eq!(g.probe(), 0);
    let dir = 0x2_0000_0000u64;
    assert_eq!(g.refused(&cq_req(dir, 0, 64, 2)), EINVAL);
    g.check_canaries();
    drop(g);
    let mut a = Endpoint::new(&da);
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);
}

/// The object budget comes from the guest's configured size (8 MiB, its
/// VMM sharing 16 MiB: 64 MiB and 32 KiB) rather than from what the VMM
/// maps; without one, from what is mapped (16 MiB, under the default
/// size). Both devices serve.
#[test]
fn the_object_budget_comes_from_the_guests_configured_size() {
    let sized = NET.device_with(
        "budget-sized",
        vrdma_vfio_user::Config::default(),
        |addr, mac| {
            let mut f = udp_function(addr, mac);
            f.set_guest_size(Some(8 << 20));
            f
        },
    );
    let plain = NET.device("budget-plain");
    let mut a = Endpoint::new(&sized);
    let mut b = Endpoint::new(&plain);
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);
    let want = vrdma_device::derived_budget(8 << 20);
    assert_eq!(sized.counter_when("budget.limit", |n| n == want), want);
    let want = vrdma_device::derived_budget(RAM);
    assert_eq!(plain.counter_when("budget.limit", |n| n == want), want);
}

#[test]
fn page_lists_past_the_guests_budget_are_refused_and_its_work_goes_on() {
    let (da, _db, mut a, mut b) = NET.pair("hostile-budget");
    exchange(&mut a, &mut b);
    page_lists_past_the_budget(&da, &mut a, &mut b);
}

#[test]
fn a_device_thread_that_panics_is_reported_and_its_device_reset() {
    let trip = Arc::new(AtomicBool::new(false));
    let wire = trip.clone();
    let da = NET.device_with(
        "hostile-panic-a",
        vrdma_vfio_user::Config::default(),
        move |addr, mac| {
            let port =
                vrdma_fabric::udp::UdpPort::bind(vrdma_fabric::udp::Config::new(addr)).unwrap();
            function(Tripwire::new(port, wire), mac, Mtu::Mtu1024)
        },
    );
    let db = NET.device("hostile-panic-b");
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);

    trip.store(true, Ordering::Relaxed);
    // The guest hears of it; the device counts it and forgets the guest's
    // objects (a reset).
    wait_event(&mut a.g, (eqe::DEVICE_FATAL, 1));
    assert_eq!(da.counter_when("pvrdma.panics", |n| n == 1), 1);
    assert_eq!(da.counter_when("objects.qps", |n| n == 0), 0);
    assert_eq!(da.stats_when(|s| s.resets >= 1).panics, 1);
    // The device thread lives on: a new client (the VM restarted) probes
    // the device and its objects exchange with the other device.
    drop(a);
    drop(b);
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);
}

/// Writes `bytes` to `s` one at a time, `pace` apart, in a thread of its
/// own, until they are all written or the server closes the connection;
/// `sent` counts what went.
fn trickle(
    mut s: UnixStream,
    bytes: Vec<u8>,
    pace: Duration,
    sent: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for b in bytes {
            if s.write_all(&[b]).is_err() {
                return;
            }
            sent.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(pace);
        }
    })
}

/// A REGION_WRITE of `n` bytes into BAR2 (which the device ignores).
fn bar2_write(n: usize) -> Vec<u8> {
    let mut m = header(vcmd::REGION_WRITE, (16 + 16 + n) as u32)
        .as_bytes()
        .to_vec();
    m.extend_from_slice(
        RegionAccess {
            offset: 0,
            region: 2,
            count: n as u32,
        }
        .as_bytes(),
    );
    m.resize(16 + 16 + n, 0xee);
    m
}

/// A REGION_READ of 1 MiB of BAR2: its reply is more than a socket holds.
fn bar2_read_1m() -> Vec<u8> {
    let mut m = header(vcmd::REGION_READ, 16 + 16).as_bytes().to_vec();
    m.extend_from_slice(
        RegionAccess {
            offset: 0,
            region: 2,
            count: 1 << 20,
        }
        .as_bytes(),
    );
    m
}

/// Waits (at most `limit`) until `fd` has one of `events`; which it had.
fn poll_for(fd: std::os::fd::BorrowedFd<'_>, events: PollFlags, limit: Duration) -> PollFlags {
    let mut p = [PollFd::new(fd, events)];
    let ms = u16::try_from(limit.as_millis()).unwrap_or(u16::MAX);
    match nix::poll::poll(&mut p, PollTimeout::from(ms)) {
        Ok(n) if n > 0 => p[0].revents().unwrap_or(PollFlags::empty()),
        _ => PollFlags::empty(),
    }
}

#[test]
fn a_trickled_message_is_dropped_before_it_completes_and_other_devices_go_on() {
    let da = NET.device("hostile-trickle-a");
    let db = NET.device("hostile-trickle-b");
    let dc = NET.device("hostile-trickle-c");
    let mut b = Endpoint::new(&db);
    let mut c = Endpoint::new(&dc);
    connect(&mut b, &mut c);
    // A message whose header and first bytes come at once and the rest a
    // byte every 20 ms: 20 s for the whole, every byte well within a
    // per-read timeout, so only a deadline for the whole message ends it.
    let msg = bar2_write(1000);
    let mut s = UnixStream::connect(&da.socket).unwrap();
    s.write_all(&msg[..40]).unwrap();
    let sent = Arc::new(AtomicUsize::new(40));
    let t = trickle(
        s,
        msg[40..].to_vec(),
        Duration::from_millis(20),
        sent.clone(),
    );
    // Other devices of the process go on meanwhile.
    exchange(&mut b, &mut c);
    t.join().unwrap();
    assert!(
        sent.load(Ordering::SeqCst) < msg.len(),
        "the server waited for the whole trickled message"
    );
    // The device serves its next client (B's QP, connected to C, makes
    // way for one connected to it).
    let mut a = Endpoint::new(&da);
    b.qp =
        b.g.create_qp(qp_type::RC, b.pd, b.cq.handle, b.cq.handle, 16);
    connect(&mut a, &mut b);
    exchange(&mut a, &mut b);
}

#[test]
fn a_client_that_does_not_read_its_reply_does_not_hold_the_device() {
    // A deadline long enough that the client is not dropped while B's
    // WRITE goes (the default's drop is the next test's).
    let mut config = vrdma_vfio_user::Config::default();
    config.socket.deadline = Duration::from_secs(60);
    let da = NET.device_with("hostile-unread-a", config, udp_function);
    let db = NET.device("hostile-unread-b");
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    connect(&mut a, &mut b);
    // A's client asks for 1 MiB and does not read the reply; once the
    // reply has started, the device holds more than the socket takes.
    a.g.conn.send(&bar2_read_1m(), &[]).unwrap();
    let r = poll_for(a.g.conn.as_fd(), PollFlags::POLLIN, Duration::from_secs(5));
    assert!(r.contains(PollFlags::POLLIN), "the reply started");
    // B WRITEs into A's memory: A's thread answers it meanwhile.
    let data: Vec<u8> = (0..200u8).collect();
    b.g.put(b.buf, &data);
    let mut w = wqe(77, wr_opcode::RDMA_WRITE, send_flags::SIGNALED, 1);
    w.wr[0] = MR_VA.into();
    w.wr[1] = u64::from(a.rkey).into();
    b.g.post_send(&mut b.qp, &w, &[sge(b.buf, 200, b.lkey)]);
    let c = completion(&mut b.g, &mut b.cq, 77);
    assert_eq!(c.status.get(), WC_SUCCESS);
    assert_eq!(a.g.get(a.mr, 200), data);
}

#[test]
fn a_client_that_never_reads_its_replies_is_dropped() {
    let da = NET.device("hostile-unread-drop");
    let mut g = Guest::connect(&da.socket, RAM);
    for _ in 0..4 {
        g.conn.send(&bar2_read_1m(), &[]).unwrap();
    }
    // Without reading anything: the server hangs up.
    let r = poll_for(g.conn.as_fd(), PollFlags::empty(), Duration::from_secs(20));
    assert!(r.contains(PollFlags::POLLHUP), "{r:?}");
    drop(g);
    let mut g = Guest::connect(&da.socket, RAM);
    assert_eq!(g.probe(), 0);
}

#[test]
fn run_returns_when_stopped_while_a_client_stalls_mid_message() {
    let socket = std::env::temp_dir().join(format!(
        "vrdma-test-{}-hostile-stop.sock",
        std::process::id()
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let (path, halt) = (socket.clone(), stop.clone());
    let addr = NET.addr();
    let server = std::thread::spawn(move || {
        let f = udp_function(addr, mac_of(addr));
        let mut s = vrdma_pvrdma::Server::bind(&path, f, "hostile-stop").unwrap();
        tx.send(()).unwrap();
        s.run(&halt).unwrap();
    });
    rx.recv().unwrap();
    let msg = bar2_write(1000);
    let mut s = UnixStream::connect(&socket).unwrap();
    s.write_all(&msg[..40]).unwrap();
    let sent = Arc::new(AtomicUsize::new(40));
    let t = trickle(
        s,
        msg[40..].to_vec(),
        Duration::from_millis(20),
        sent.clone(),
    );
    // The server has the header and is waiting for the rest.
    while sent.load(Ordering::SeqCst) < 50 {
        std::thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, Ordering::SeqCst);
    server.join().unwrap();
    assert!(
        sent.load(Ordering::SeqCst) < msg.len(),
        "run() returned only once the client had sent the whole message"
    );
    t.join().unwrap();
}

#[test]
fn interrupt_descriptors_that_are_not_eventfds_are_refused() {
    use std::io::Read;

    use nix::fcntl::{FcntlArg, fcntl};
    use vrdma_vfio_user::proto::{irq, irq_index};

    let da = NET.device("hostile-irq-kind");
    let mut g = Guest::connect(&da.socket, RAM);
    let set = |flags: u32| IrqSet {
        argsz: 20,
        flags,
        index: irq_index::MSIX,
        start: 0,
        count: 1,
    };
    let eventfds = set(irq::DATA_EVENTFD | irq::ACTION_TRIGGER);
    // A pipe of one page (512 interrupts) nobody reads, a socket nobody
    // reads, /dev/null, a memfd: a write to the first two would block
    // the device's thread once they are full.
    let (pipe_r, pipe_w) = nix::unistd::pipe().unwrap();
    fcntl(&pipe_w, FcntlArg::F_SETPIPE_SZ(4096)).unwrap();
    let (sock, _peer) = UnixStream::pair().unwrap();
    let null = std::fs::File::open("/dev/null").unwrap();
    let memfd = nix::sys::memfd::memfd_create(c"irq", nix::sys::memfd::MFdFlags::empty()).unwrap();
    for fd in [pipe_w.as_fd(), sock.as_fd(), null.as_fd(), memfd.as_fd()] {
        let (h, _) = g.request(vcmd::DEVICE_SET_IRQS, eventfds.as_bytes(), &[fd]);
        assert_eq!(h.error, EINVAL, "{fd:?}");
    }
    // Vector 0 keeps its eventfd, and the device raises it more times
    // than the pipe would have held.
    let trigger = set(irq::DATA_NONE | irq::ACTION_TRIGGER);
    for _ in 0..1000 {
        g.ok(vcmd::DEVICE_SET_IRQS, trigger.as_bytes(), &[]);
    }
    let mut n = [0u8; 8];
    g.irq[0].read_exact(&mut n).unwrap();
    assert_eq!(u64::from_ne_bytes(n), 1000);
    drop(pipe_r);
}

#[test]
fn dma_maps_of_other_files_unsealed_memory_or_over_budget_are_refused() {
    let mut config = vrdma_vfio_user::Config::default();
    // The guest's RAM and one more.
    config.dma.max_maps = 2;
    let da = NET.device_with("hostile-dma-kind", config, udp_function);
    let mut g = Guest::connect(&da.socket, RAM);
    let unsealed = unsealed_page();
    let (pipe_r, _pipe_w) = nix::unistd::pipe().unwrap();
    let sealed = sealed_memfd(c"sealed", PAGE_SIZE);
    for (fd, addr, want) in [
        (unsealed.as_fd(), 0x4_0000_0000, 1),
        (pipe_r.as_fd(), 0x4_0000_0000, EINVAL),
        (sealed.as_fd(), 0x4_0000_0000, 0),
        (sealed.as_fd(), 0x5_0000_0000, 28),
    ] {
        let (h, _) = g.request(vcmd::DMA_MAP, one_page(addr).as_bytes(), &[fd]);
        assert_eq!(h.error, want, "{fd:?}");
    }
    assert_eq!(g.probe(), 0, "the device goes on");
    assert_eq!(da.counter_when("vfio.dma_refused", |n| n == 3), 3);
    assert_eq!(da.counter_when("vfio.dma_maps", |n| n == 2), 2);
    assert_eq!(
        da.counter_when("vfio.dma_bytes", |n| n == RAM + PAGE_SIZE),
        RAM + PAGE_SIZE
    );
    // Two files and three eventfds.
    assert_eq!(da.counter_when("vfio.fds", |n| n == 5), 5);
    drop(g);
    assert_eq!(da.counter_when("vfio.fds", |n| n == 0), 0);
    assert_eq!(da.counter_when("vfio.dma_bytes", |n| n == 0), 0);
}

#[test]
fn a_peer_not_allowed_is_turned_away_without_a_word() {
    use std::os::unix::fs::PermissionsExt;

    let mut config = vrdma_vfio_user::Config::default();
    config.socket.allowed_uids = vec![4242];
    let da = NET.device_with("hostile-peer", config, udp_function);
    let mode = std::fs::metadata(&da.socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let mut v = proto::VersionHead { major: 0, minor: 0 }
        .as_bytes()
        .to_vec();
    v.extend_from_slice(b"{}\0");
    let mut msg = header(vcmd::VERSION, (16 + v.len()) as u32)
        .as_bytes()
        .to_vec();
    msg.extend_from_slice(&v);
    let mut s = UnixStream::connect(&da.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(&msg);
    let mut b = [0u8; 64];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("an answer: {other:?}"),
    }
    assert_eq!(da.counter_when("vfio.peers_refused", |n| n == 1), 1);
    assert_eq!(da.clients(), 0);
}
