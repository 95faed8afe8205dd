//! Posting work requests: validation as rxe's post calls do it, and the
//! error state's flush (IBTA Vol1 §10.3.1, C10-26).

use std::net::Ipv4Addr;

use vrdma_engine::{
    CqHandle, Engine, PdHandle, SrqHandle, VerbsError,
    attr::{DeviceAttr, Mtu, PortAttr},
    error::errno::{EINVAL, ENOMEM},
    event::AsyncEvent,
    objects::SrqAttr,
    qp::{AhAttr, AttrMask, QpAttr, QpCap, QpInitAttr, QpState, QpType},
    wc::{Wc, WcOpcode, WcStatus},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_wire::{Gid, Lkey, Psn, QKey, Qpn, Rkey};

fn gid(last: u8) -> Gid {
    Gid::from(Ipv4Addr::new(127, 0, 0, last))
}

struct Setup {
    e: Engine,
    pd: PdHandle,
    cq: CqHandle,
}

fn setup(cqe: u32) -> Setup {
    let mut e = Engine::new(DeviceAttr::default(), PortAttr::with_gids(&[gid(1)]));
    let pd = e.alloc_pd().unwrap();
    let (cq, _) = e.create_cq(cqe, 0).unwrap();
    Setup { e, pd, cq }
}

fn cap() -> QpCap {
    QpCap {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 32,
    }
}

fn qp(s: &mut Setup, ty: QpType, srq: Option<SrqHandle>) -> Qpn {
    s.e.create_qp(QpInitAttr {
        pd: s.pd,
        send_cq: s.cq,
        recv_cq: s.cq,
        srq,
        cap: cap(),
        qp_type: ty,
        sq_sig_all: false,
    })
    .unwrap()
    .0
}

fn av() -> AhAttr {
    AhAttr {
        dgid: gid(2),
        port_num: 1,
        ..AhAttr::default()
    }
}

fn modify(e: &mut Engine, qpn: Qpn, a: QpAttr, mask: AttrMask) {
    e.modify_qp(qpn, &a, mask).unwrap();
}

/// RESET → INIT → RTR → RTS for any QP type.
fn to_rts(e: &mut Engine, qpn: Qpn) {
    let base = QpAttr {
        port_num: 1,
        ah_attr: av(),
        path_mtu: Mtu::Mtu1024,
        qkey: QKey(0x1111),
        dest_qp_num: Qpn::from_masked(99),
        rq_psn: Psn::from_masked(1),
        sq_psn: Psn::from_masked(1),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        ..QpAttr::default()
    };
    e.bring_up_qp(qpn, &base).unwrap();
}

fn to_err(e: &mut Engine, qpn: Qpn) {
    modify(
        e,
        qpn,
        QpAttr {
            qp_state: QpState::Err,
            ..QpAttr::default()
        },
        AttrMask::STATE,
    );
}

const SGE: Sge = Sge {
    addr: 0x1000,
    length: 8,
    lkey: Lkey(0x100),
};

fn send(wr_id: u64, op: SendOp, flags: SendFlags) -> SendWr<'static> {
    SendWr {
        wr_id,
        op,
        payload: Payload::Sges(std::slice::from_ref(&SGE)),
        flags,
        ud: None,
    }
}

fn recv(wr_id: u64) -> RecvWr<'static> {
    RecvWr {
        wr_id,
        sg_list: std::slice::from_ref(&SGE),
    }
}

fn poll(e: &mut Engine, cq: CqHandle) -> Vec<Wc> {
    let mut v = Vec::new();
    e.poll_cq(cq, 64, &mut v).unwrap();
    v
}

#[test]
fn sends_need_rts_and_receives_need_init() {
    let mut s = setup(16);
    let q = qp(&mut s, QpType::Rc, None);
    let wr = send(1, SendOp::Send, SendFlags::SIGNALED);
    assert_eq!(s.e.post_send(q, &wr).unwrap_err().errno(), EINVAL);
    assert_eq!(s.e.post_recv(q, &recv(1)).unwrap_err().errno(), EINVAL);
    to_rts(&mut s.e, q);
    s.e.post_send(q, &wr).unwrap();
    s.e.post_recv(q, &recv(2)).unwrap();
    let (attr, _) = s.e.query_qp(q).unwrap();
    assert_eq!(attr.qp_state, QpState::Rts);
}

#[test]
fn malformed_send_wrs_are_einval() {
    let mut s = setup(16);
    let rc = qp(&mut s, QpType::Rc, None);
    to_rts(&mut s.e, rc);
    let atomic = |addr| SendOp::FetchAdd {
        remote_addr: addr,
        rkey: Rkey(1),
        add: 1,
    };
    let bad = |e: &mut Engine, wr: SendWr<'_>| e.post_send(rc, &wr).unwrap_err();
    assert_eq!(
        bad(&mut s.e, send(1, atomic(0x1004), SendFlags::default())),
        VerbsError::Invalid {
            what: "atomic remote address (not 8-byte aligned)"
        }
    );
    let three = [SGE; 3];
    let wr = SendWr {
        payload: Payload::Sges(&three),
        ..send(1, SendOp::Send, SendFlags::default())
    };
    assert_eq!(bad(&mut s.e, wr).errno(), EINVAL, "3 SGEs on a 2-SGE QP");
    let long = [0u8; 33];
    let wr = SendWr {
        payload: Payload::Inline(&long),
        ..send(1, SendOp::Send, SendFlags::INLINE)
    };
    assert_eq!(
        bad(&mut s.e, wr).errno(),
        EINVAL,
        "inline above max_inline_data"
    );
    let wr = SendWr {
        payload: Payload::Inline(&long[..4]),
        ..send(1, SendOp::Send, SendFlags::default())
    };
    assert_eq!(bad(&mut s.e, wr).errno(), EINVAL, "inline without the flag");
    let nine = Sge { length: 9, ..SGE };
    let wr = SendWr {
        payload: Payload::Sges(std::slice::from_ref(&nine)),
        ..send(1, atomic(0x1000), SendFlags::default())
    };
    assert_eq!(bad(&mut s.e, wr).errno(), EINVAL, "atomic of 9 bytes");
    assert_eq!(
        bad(&mut s.e, send(1, SendOp::Send, SendFlags(1 << 7))).errno(),
        EINVAL,
        "unknown flag"
    );
    // Nothing was queued by the failures.
    to_err(&mut s.e, rc);
    assert!(poll(&mut s.e, s.cq).is_empty());
}

#[test]
fn operations_are_checked_against_the_qp_type() {
    let mut s = setup(16);
    let ud = qp(&mut s, QpType::Ud, None);
    let uc = qp(&mut s, QpType::Uc, None);
    to_rts(&mut s.e, ud);
    to_rts(&mut s.e, uc);
    let read = SendOp::RdmaRead {
        remote_addr: 0,
        rkey: Rkey(1),
    };
    assert_eq!(
        s.e.post_send(uc, &send(1, read, SendFlags::default()))
            .unwrap_err()
            .errno(),
        EINVAL
    );
    let write = SendOp::RdmaWrite {
        remote_addr: 0,
        rkey: Rkey(1),
    };
    s.e.post_send(uc, &send(1, write, SendFlags::default()))
        .unwrap();
    assert_eq!(
        s.e.post_send(ud, &send(1, write, SendFlags::default()))
            .unwrap_err()
            .errno(),
        EINVAL
    );
    // UD needs a destination whose AH is in the QP's PD, and one packet.
    assert_eq!(
        s.e.post_send(ud, &send(1, SendOp::Send, SendFlags::default()))
            .unwrap_err(),
        VerbsError::Invalid {
            what: "UD send without a destination"
        }
    );
    let ah = s.e.create_ah(s.pd, av()).unwrap();
    let other_pd = s.e.alloc_pd().unwrap();
    let foreign = s.e.create_ah(other_pd, av()).unwrap();
    let dest = |ah| UdDest {
        av: vrdma_engine::wr::Av::Handle(ah),
        remote_qpn: Qpn::from_masked(5),
        remote_qkey: QKey(0x1111),
    };
    let with = |ah, sge: &'static [Sge]| SendWr {
        ud: Some(dest(ah)),
        payload: Payload::Sges(sge),
        ..send(2, SendOp::Send, SendFlags::default())
    };
    static BIG: [Sge; 1] = [Sge {
        addr: 0,
        length: 1025,
        lkey: Lkey(0x100),
    }];
    assert_eq!(
        s.e.post_send(ud, &with(foreign, std::slice::from_ref(&SGE)))
            .unwrap_err()
            .errno(),
        EINVAL
    );
    assert_eq!(
        s.e.post_send(ud, &with(ah, &BIG)).unwrap_err(),
        VerbsError::ExceedsLimit {
            what: "UD message",
            requested: 1025,
            max: 1024
        }
    );
    s.e.post_send(ud, &with(ah, std::slice::from_ref(&SGE)))
        .unwrap();
}

#[test]
fn full_queues_are_enomem() {
    let mut s = setup(16);
    let q = qp(&mut s, QpType::Rc, None);
    to_rts(&mut s.e, q);
    for i in 0..4 {
        s.e.post_send(q, &send(i, SendOp::Send, SendFlags::default()))
            .unwrap();
        s.e.post_recv(q, &recv(i)).unwrap();
    }
    let e =
        s.e.post_send(q, &send(9, SendOp::Send, SendFlags::default()))
            .unwrap_err();
    assert_eq!(e.errno(), ENOMEM);
    assert_eq!(s.e.post_recv(q, &recv(9)).unwrap_err().errno(), ENOMEM);
}

#[test]
fn entering_err_flushes_every_wr_in_order_signaled_or_not() {
    let mut s = setup(16);
    let q = qp(&mut s, QpType::Rc, None);
    to_rts(&mut s.e, q);
    let write = SendOp::RdmaWrite {
        remote_addr: 0,
        rkey: Rkey(1),
    };
    s.e.post_send(q, &send(10, SendOp::Send, SendFlags::default()))
        .unwrap();
    s.e.post_send(q, &send(11, write, SendFlags::SIGNALED))
        .unwrap();
    s.e.post_recv(q, &recv(20)).unwrap();
    s.e.post_recv(q, &recv(21)).unwrap();
    s.e.req_notify_cq(s.cq, false).unwrap();
    to_err(&mut s.e, q);
    let got: Vec<(u64, WcStatus, WcOpcode)> = poll(&mut s.e, s.cq)
        .iter()
        .map(|w| (w.wr_id, w.status, w.opcode))
        .collect();
    assert_eq!(
        got,
        [
            (10, WcStatus::WrFlushErr, WcOpcode::Send),
            (11, WcStatus::WrFlushErr, WcOpcode::RdmaWrite),
            (20, WcStatus::WrFlushErr, WcOpcode::Recv),
            (21, WcStatus::WrFlushErr, WcOpcode::Recv),
        ]
    );
    assert_eq!(s.e.poll_notification(), Some(s.cq));
    assert_eq!(s.e.poll_notification(), None, "one notification per arming");
    // In ERR a posted WR completes at once.
    s.e.post_send(q, &send(12, SendOp::Send, SendFlags::default()))
        .unwrap();
    s.e.post_recv(q, &recv(22)).unwrap();
    let ids: Vec<u64> = poll(&mut s.e, s.cq).iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [12, 22]);
    assert_eq!(s.e.query_qp(q).unwrap().0.qp_state, QpState::Err);
}

#[test]
fn reset_discards_queued_wrs_without_completions() {
    let mut s = setup(16);
    let q = qp(&mut s, QpType::Uc, None);
    to_rts(&mut s.e, q);
    s.e.post_send(q, &send(1, SendOp::Send, SendFlags::SIGNALED))
        .unwrap();
    s.e.post_recv(q, &recv(2)).unwrap();
    modify(
        &mut s.e,
        q,
        QpAttr {
            qp_state: QpState::Reset,
            ..QpAttr::default()
        },
        AttrMask::STATE,
    );
    assert!(poll(&mut s.e, s.cq).is_empty());
    to_rts(&mut s.e, q);
    to_err(&mut s.e, q);
    assert!(poll(&mut s.e, s.cq).is_empty(), "nothing left to flush");
}

#[test]
fn a_qp_on_an_srq_reports_last_wqe_reached_and_leaves_the_srq_alone() {
    let mut s = setup(16);
    let (srq, _) =
        s.e.create_srq(
            s.pd,
            SrqAttr {
                max_wr: 4,
                max_sge: 1,
                srq_limit: 0,
            },
        )
        .unwrap();
    s.e.post_srq_recv(srq, &recv(7)).unwrap();
    let q = qp(&mut s, QpType::Rc, Some(srq));
    to_rts(&mut s.e, q);
    assert_eq!(s.e.post_recv(q, &recv(1)).unwrap_err().errno(), EINVAL);
    while s.e.poll_event().is_some() {}
    to_err(&mut s.e, q);
    assert_eq!(
        s.e.poll_event(),
        Some(AsyncEvent::QpLastWqeReached { qp: q })
    );
    assert_eq!(s.e.poll_event(), None);
    assert!(poll(&mut s.e, s.cq).is_empty(), "SRQ WQEs are not flushed");
    s.e.post_send(q, &send(3, SendOp::Send, SendFlags::default()))
        .unwrap();
    assert_eq!(s.e.poll_event(), None, "raised once");
    // An SRQ that is full refuses more.
    for i in 0..3 {
        s.e.post_srq_recv(srq, &recv(i)).unwrap();
    }
    assert_eq!(
        s.e.post_srq_recv(srq, &recv(9)).unwrap_err().errno(),
        ENOMEM
    );
}

#[test]
fn cq_overflow_raises_the_cq_error_and_takes_its_qps_to_err() {
    let mut s = setup(2);
    let a = qp(&mut s, QpType::Rc, None);
    let b = qp(&mut s, QpType::Rc, None);
    to_rts(&mut s.e, a);
    to_rts(&mut s.e, b);
    for i in 0..3 {
        s.e.post_recv(a, &recv(i)).unwrap();
    }
    s.e.post_recv(b, &recv(100)).unwrap();
    while s.e.poll_event().is_some() {}
    to_err(&mut s.e, a);
    assert_eq!(s.e.poll_event(), Some(AsyncEvent::CqErr { cq: s.cq }));
    assert_eq!(s.e.poll_event(), None, "the CQ error is raised once");
    assert_eq!(s.e.query_qp(b).unwrap().0.qp_state, QpState::Err);
    let ids: Vec<u64> = poll(&mut s.e, s.cq).iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [0, 1], "what fit before the overflow is kept");
    // The CQ stays in error: later completions are lost, not misdelivered.
    s.e.post_recv(b, &recv(101)).unwrap();
    assert!(poll(&mut s.e, s.cq).is_empty());
}

/// A consumer's ring of `room` entries (a device face's CQ in guest
/// memory) that records the completions written into it.
#[derive(Debug)]
struct Ring {
    got: std::sync::Arc<std::sync::Mutex<Vec<Wc>>>,
    room: usize,
}

impl vrdma_engine::cq::CqSink for Ring {
    fn push(&mut self, wc: &Wc) -> bool {
        let mut got = self.got.lock().unwrap();
        if got.len() == self.room {
            return false;
        }
        got.push(*wc);
        true
    }
}

#[test]
fn a_sink_cq_gets_completions_in_order_and_its_overflow_is_the_cq_error() {
    let mut s = setup(2);
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let ring = Ring {
        got: got.clone(),
        room: 3,
    };
    let (cq, n) = s.e.create_cq_with_sink(3, 0, Box::new(ring)).unwrap();
    assert_eq!(n, 3);
    let a =
        s.e.create_qp(QpInitAttr {
            pd: s.pd,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap: cap(),
            qp_type: QpType::Rc,
            sq_sig_all: false,
        })
        .unwrap()
        .0;
    to_rts(&mut s.e, a);
    for i in 0..4 {
        s.e.post_recv(a, &recv(i)).unwrap();
    }
    while s.e.poll_event().is_some() {}
    assert_eq!(
        s.e.resize_cq(cq, 8).unwrap_err().errno(),
        EINVAL,
        "a sink CQ is resized with its new ring"
    );
    to_err(&mut s.e, a);
    let ids: Vec<u64> = got.lock().unwrap().iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [0, 1, 2], "flushed in order into the ring");
    assert!(
        got.lock()
            .unwrap()
            .iter()
            .all(|w| w.status == WcStatus::WrFlushErr)
    );
    assert_eq!(
        s.e.poll_event(),
        Some(AsyncEvent::CqErr { cq }),
        "the fourth did not fit"
    );
    let mut out = Vec::new();
    assert_eq!(
        s.e.poll_cq(cq, 8, &mut out).unwrap(),
        0,
        "nothing waits in the engine"
    );
}
