//! Every QP state transition, allowed and refused, for RC, UC and UD.
//!
//! The expectations come from [`KERNEL_TABLE`] below, written for this test
//! from Linux's `qp_state_table` (drivers/infiniband/core/verbs.c), the
//! table `ib_modify_qp_is_ok()` checks every driver's Modify QP against. It
//! is kept in a different shape from the engine's `qp::state` module (one
//! row per permitted transition, the bits of rdma-core's
//! `enum ibv_qp_attr_mask` spelled as plain numbers) so that a slip in one
//! does not hide in the other.
//!
//! For every QP type and every (from, to) pair a fresh QP is driven to
//! `from` and asked to move to `to` with:
//!
//! * (a) exactly the required attributes: accepted iff the table has the
//!   cell, and then `query_qp` returns what was set and nothing else moved;
//! * (b) the required attributes less each one: `MissingRequired`;
//! * (c) the required attributes plus each optional one: accepted;
//! * (d) the required attributes plus each other bit of the 32:
//!   `NotPermitted` (or `CurStateNotAccepted`, which the kernel checks
//!   first, for CUR_STATE outside RTR/RTS/SQD/SQE);
//!
//! every refusal being `VerbsError::Transition(..)` (EINVAL, as the kernel
//! returns when `ib_modify_qp_is_ok()` fails) and leaving the QP exactly as
//! it was.
//!
//! SQE: the engine never enters it. IBTA Vol1 §10.3.1 has UC and UD QPs
//! enter SQE when a send WR completes in error, but the engine (like Linux
//! rxe, whose requester calls `rxe_qp_error()` for every type) takes them
//! to ERR instead, and no Modify QP may enter SQE. And since a CUR_STATE
//! must name the QP's real state here, a caller cannot assert SQE either.
//! So the SQE rows (SQE→RTS/RESET/ERR) cannot be driven; what is tested is
//! that every modify *into* SQE is refused and that asserting SQE with
//! CUR_STATE is refused.
//!
//! Automatic path migration: ALT_PATH and PATH_MIG_STATE are optional in
//! several cells. The matrix checks only that the state machine accepts
//! them (the engine refuses APM itself, as NotSupported); what Linux does
//! with ALT_PATH on a RoCE port is tested on its own.

use std::net::Ipv4Addr;

use vrdma_engine::{
    AhHandle, CqHandle, Engine, PdHandle, VerbsError,
    attr::{DeviceAttr, Mtu, PortAttr},
    error::errno::EINVAL,
    event::AsyncEvent,
    memory::VecMemory,
    mr::Access,
    qp::{AhAttr, AttrMask, QpAttr, QpCap, QpInitAttr, QpState, QpType, state::TransitionError},
    wc::{Wc, WcOpcode, WcStatus},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_testkit::net::{Net, Quiet};
use vrdma_wire::{Gid, Lkey, PKey, Psn, QKey, Qpn};

use QpState::{Err as ERR, Init as INIT, Reset as RESET, Rtr as RTR, Rts as RTS};
use QpState::{Sqd as SQD, Sqe as SQE};

// ---- rdma-core's attribute mask bits (verbs.h, enum ibv_qp_attr_mask) ----

const STATE: u32 = 1 << 0;
const CUR_STATE: u32 = 1 << 1;
const EN_SQD_ASYNC_NOTIFY: u32 = 1 << 2;
const ACCESS_FLAGS: u32 = 1 << 3;
const PKEY_INDEX: u32 = 1 << 4;
const PORT: u32 = 1 << 5;
const QKEY: u32 = 1 << 6;
const AV: u32 = 1 << 7;
const PATH_MTU: u32 = 1 << 8;
const TIMEOUT: u32 = 1 << 9;
const RETRY_CNT: u32 = 1 << 10;
const RNR_RETRY: u32 = 1 << 11;
const RQ_PSN: u32 = 1 << 12;
const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
const ALT_PATH: u32 = 1 << 14;
const MIN_RNR_TIMER: u32 = 1 << 15;
const SQ_PSN: u32 = 1 << 16;
const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
const PATH_MIG_STATE: u32 = 1 << 18;
const CAP: u32 = 1 << 19;
const DEST_QPN: u32 = 1 << 20;
const RATE_LIMIT: u32 = 1 << 25;

/// Automatic path migration attributes (see the module docs).
const APM: u32 = ALT_PATH | PATH_MIG_STATE;

// ---- the kernel's table, RC / UC / UD / GSI columns only ----------------

/// One permitted transition: `(from, to, required, optional)`, each mask
/// given per type as `[RC, UC, UD, GSI]`. A pair that is not listed is not a
/// transition. STATE itself is never listed: it is always allowed.
type Row = (QpState, QpState, [u32; 4], [u32; 4]);

const NONE4: [u32; 4] = [0, 0, 0, 0];

const KERNEL_TABLE: &[Row] = &[
    // [IB_QPS_RESET]
    (RESET, RESET, NONE4, NONE4),
    (
        RESET,
        INIT,
        [
            PKEY_INDEX | PORT | ACCESS_FLAGS,
            PKEY_INDEX | PORT | ACCESS_FLAGS,
            PKEY_INDEX | PORT | QKEY,
            PKEY_INDEX | QKEY,
        ],
        NONE4,
    ),
    // [IB_QPS_INIT]
    (INIT, RESET, NONE4, NONE4),
    (INIT, ERR, NONE4, NONE4),
    (
        INIT,
        INIT,
        NONE4,
        [
            PKEY_INDEX | PORT | ACCESS_FLAGS,
            PKEY_INDEX | PORT | ACCESS_FLAGS,
            PKEY_INDEX | PORT | QKEY,
            PKEY_INDEX | QKEY,
        ],
    ),
    (
        INIT,
        RTR,
        [
            AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER,
            AV | PATH_MTU | DEST_QPN | RQ_PSN,
            0,
            0,
        ],
        [
            ALT_PATH | ACCESS_FLAGS | PKEY_INDEX,
            ALT_PATH | ACCESS_FLAGS | PKEY_INDEX,
            PKEY_INDEX | QKEY,
            PKEY_INDEX | QKEY,
        ],
    ),
    // [IB_QPS_RTR]
    (RTR, RESET, NONE4, NONE4),
    (RTR, ERR, NONE4, NONE4),
    (
        RTR,
        RTS,
        [
            TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC,
            SQ_PSN,
            SQ_PSN,
            SQ_PSN,
        ],
        [
            CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE,
            CUR_STATE | ALT_PATH | ACCESS_FLAGS | PATH_MIG_STATE,
            CUR_STATE | QKEY,
            CUR_STATE | QKEY,
        ],
    ),
    // [IB_QPS_RTS]
    (RTS, RESET, NONE4, NONE4),
    (RTS, ERR, NONE4, NONE4),
    (
        RTS,
        RTS,
        NONE4,
        [
            CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE | MIN_RNR_TIMER,
            CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE,
            CUR_STATE | QKEY,
            CUR_STATE | QKEY,
        ],
    ),
    (
        RTS,
        SQD,
        NONE4,
        [
            EN_SQD_ASYNC_NOTIFY,
            EN_SQD_ASYNC_NOTIFY,
            EN_SQD_ASYNC_NOTIFY,
            EN_SQD_ASYNC_NOTIFY,
        ],
    ),
    // [IB_QPS_SQD]
    (SQD, RESET, NONE4, NONE4),
    (SQD, ERR, NONE4, NONE4),
    (
        SQD,
        RTS,
        NONE4,
        [
            CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE,
            CUR_STATE | ALT_PATH | ACCESS_FLAGS | PATH_MIG_STATE,
            CUR_STATE | QKEY,
            CUR_STATE | QKEY,
        ],
    ),
    (
        SQD,
        SQD,
        NONE4,
        [
            PORT | AV
                | TIMEOUT
                | RETRY_CNT
                | RNR_RETRY
                | MAX_QP_RD_ATOMIC
                | MAX_DEST_RD_ATOMIC
                | ALT_PATH
                | ACCESS_FLAGS
                | PKEY_INDEX
                | MIN_RNR_TIMER
                | PATH_MIG_STATE,
            AV | ALT_PATH | ACCESS_FLAGS | PKEY_INDEX | PATH_MIG_STATE,
            PKEY_INDEX | QKEY,
            PKEY_INDEX | QKEY,
        ],
    ),
    // [IB_QPS_SQE]: valid for every type; the kernel lists optional
    // attributes for UC and UD only.
    (SQE, RESET, NONE4, NONE4),
    (SQE, ERR, NONE4, NONE4),
    (
        SQE,
        RTS,
        NONE4,
        [
            0,
            CUR_STATE | ACCESS_FLAGS,
            CUR_STATE | QKEY,
            CUR_STATE | QKEY,
        ],
    ),
    // [IB_QPS_ERR]
    (ERR, RESET, NONE4, NONE4),
    (ERR, ERR, NONE4, NONE4),
];

const STATES: [QpState; 7] = [RESET, INIT, RTR, RTS, SQD, SQE, ERR];
/// The states a test can put a QP in (see the module docs on SQE).
const REACHABLE: [QpState; 6] = [RESET, INIT, RTR, RTS, SQD, ERR];
const TYPES: [QpType; 4] = [QpType::Rc, QpType::Uc, QpType::Ud, QpType::Gsi];

fn column(ty: QpType) -> usize {
    match ty {
        QpType::Rc => 0,
        QpType::Uc => 1,
        QpType::Ud => 2,
        QpType::Gsi => 3,
    }
}

/// `(required, optional)` for `from → to` on a `ty` QP; `None`: not a
/// transition.
fn kernel(from: QpState, to: QpState, ty: QpType) -> Option<(u32, u32)> {
    KERNEL_TABLE
        .iter()
        .find(|r| r.0 == from && r.1 == to)
        .map(|r| (r.2[column(ty)], r.3[column(ty)]))
}

/// The single bits of `mask`, lowest first.
fn bits(mask: u32) -> impl Iterator<Item = u32> {
    (0..32).map(|i| 1u32 << i).filter(move |b| mask & b != 0)
}

// ---- fixtures ---------------------------------------------------------

fn gid(last: u8) -> Gid {
    Gid::from(Ipv4Addr::new(127, 0, 0, last))
}

/// A device whose port has two P_Keys, so that a modify of PKEY_INDEX is
/// visible in query_qp.
fn port(last: u8) -> PortAttr {
    PortAttr {
        pkeys: vec![PKey::DEFAULT, PKey(0xffee)],
        ..PortAttr::with_gids(&[gid(last)])
    }
}

struct Fx {
    e: Engine,
    pd: PdHandle,
    cq: CqHandle,
    ah: AhHandle,
}

fn fx() -> Fx {
    let mut e = Engine::new(DeviceAttr::default(), port(1));
    let pd = e.alloc_pd().unwrap();
    let (cq, _) = e.create_cq(256, 0).unwrap();
    let ah = e
        .create_ah(
            pd,
            AhAttr {
                dgid: gid(2),
                port_num: 1,
                hop_limit: 64,
                ..AhAttr::default()
            },
        )
        .unwrap();
    while e.poll_event().is_some() {}
    Fx { e, pd, cq, ah }
}

fn create(f: &mut Fx, ty: QpType) -> Qpn {
    if ty == QpType::Gsi {
        // A device has one GSI QP: a test's next one replaces it.
        let _ = f.e.destroy_qp(Qpn::GSI);
    }
    f.e.create_qp(QpInitAttr {
        pd: f.pd,
        send_cq: f.cq,
        recv_cq: f.cq,
        srq: None,
        cap: QpCap {
            max_send_wr: 4,
            max_recv_wr: 4,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 16,
        },
        qp_type: ty,
        sq_sig_all: false,
    })
    .unwrap()
    .0
}

/// The values used to bring QPs up.
fn base() -> QpAttr {
    QpAttr {
        qp_access_flags: Access::REMOTE_WRITE,
        pkey_index: 0,
        port_num: 1,
        qkey: QKey(0x1111),
        ah_attr: AhAttr {
            dgid: gid(2),
            port_num: 1,
            hop_limit: 64,
            ..AhAttr::default()
        },
        path_mtu: Mtu::Mtu1024,
        dest_qp_num: Qpn::from_masked(0x42),
        rq_psn: Psn::from_masked(0x100),
        sq_psn: Psn::from_masked(0x200),
        timeout: 10,
        retry_cnt: 3,
        rnr_retry: 4,
        max_rd_atomic: 1,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 5,
        en_sqd_async_notify: false,
        ..QpAttr::default()
    }
}

/// The values of the modify under test: every one differs from [`base`]
/// (but the port, of which there is one), so query_qp shows what moved.
/// `cur_qp_state` names the QP's real state, as a CUR_STATE must here.
fn probe(from: QpState, to: QpState) -> QpAttr {
    QpAttr {
        qp_state: to,
        cur_qp_state: from,
        qp_access_flags: Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
        pkey_index: 1,
        port_num: 1,
        qkey: QKey(0x2222),
        ah_attr: AhAttr {
            dgid: gid(3),
            flow_label: 7,
            sgid_index: 0,
            hop_limit: 32,
            traffic_class: 8,
            sl: 0,
            port_num: 1,
            dmac: None,
        },
        path_mtu: Mtu::Mtu2048,
        dest_qp_num: Qpn::from_masked(0x43),
        rq_psn: Psn::from_masked(0x300),
        sq_psn: Psn::from_masked(0x400),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 6,
        max_rd_atomic: 2,
        max_dest_rd_atomic: 3,
        min_rnr_timer: 12,
        en_sqd_async_notify: true,
        ..QpAttr::default()
    }
}

/// The transitions that lead from RESET to `to` (never SQE).
fn path(to: QpState) -> &'static [QpState] {
    match to {
        RESET => &[],
        INIT => &[INIT],
        RTR => &[INIT, RTR],
        RTS => &[INIT, RTR, RTS],
        SQD => &[INIT, RTR, RTS, SQD],
        ERR => &[INIT, RTR, RTS, ERR],
        SQE => panic!("no transition leads into SQE"),
    }
}

/// Drives a new QP to `to` through the kernel table's required masks.
fn drive(f: &mut Fx, qpn: Qpn, ty: QpType, to: QpState) {
    let mut from = RESET;
    for &next in path(to) {
        let (req, _) = kernel(from, next, ty).expect("a table transition");
        let a = QpAttr {
            qp_state: next,
            ..base()
        };
        f.e.modify_qp(qpn, &a, AttrMask(STATE | req))
            .unwrap_or_else(|e| panic!("{ty:?} {from:?}→{next:?}: {e}"));
        from = next;
    }
    assert_eq!(f.e.query_qp(qpn).unwrap().0.qp_state, to);
}

fn attr(f: &Fx, qpn: Qpn) -> QpAttr {
    *f.e.query_qp(qpn).unwrap().0
}

/// What query_qp must say after `mask` with `p` moved a QP whose
/// attributes were `before` to `to`; `fresh` is a new QP's attributes.
fn expected_after(before: &QpAttr, fresh: &QpAttr, p: &QpAttr, mask: u32, to: QpState) -> QpAttr {
    if to == RESET {
        // IBTA Vol1 §10.3.1: back in RESET the attributes are those of a
        // QP just created.
        return *fresh;
    }
    let mut a = *before;
    let m = |b| mask & b != 0;
    if m(ACCESS_FLAGS) {
        a.qp_access_flags = p.qp_access_flags;
    }
    if m(PKEY_INDEX) {
        a.pkey_index = p.pkey_index;
    }
    if m(PORT) {
        a.port_num = p.port_num;
    }
    if m(QKEY) {
        a.qkey = p.qkey;
    }
    if m(AV) {
        a.ah_attr = p.ah_attr;
    }
    if m(PATH_MTU) {
        a.path_mtu = p.path_mtu;
    }
    if m(TIMEOUT) {
        a.timeout = p.timeout;
    }
    if m(RETRY_CNT) {
        a.retry_cnt = p.retry_cnt;
    }
    if m(RNR_RETRY) {
        a.rnr_retry = p.rnr_retry;
    }
    if m(RQ_PSN) {
        a.rq_psn = p.rq_psn;
    }
    if m(SQ_PSN) {
        a.sq_psn = p.sq_psn;
    }
    if m(MAX_QP_RD_ATOMIC) {
        a.max_rd_atomic = p.max_rd_atomic;
    }
    if m(MAX_DEST_RD_ATOMIC) {
        a.max_dest_rd_atomic = p.max_dest_rd_atomic;
    }
    if m(MIN_RNR_TIMER) {
        a.min_rnr_timer = p.min_rnr_timer;
    }
    if m(DEST_QPN) {
        a.dest_qp_num = p.dest_qp_num;
    }
    if m(EN_SQD_ASYNC_NOTIFY) {
        a.en_sqd_async_notify = p.en_sqd_async_notify;
    }
    a.qp_state = to;
    a.cur_qp_state = to;
    a
}

/// One modify of a fresh `ty` QP in `from`: the result and the attributes
/// before and after.
struct Attempt {
    result: Result<(), VerbsError>,
    before: QpAttr,
    after: QpAttr,
    fresh: QpAttr,
}

fn attempt(f: &mut Fx, ty: QpType, from: QpState, to: QpState, mask: u32) -> Attempt {
    let qpn = create(f, ty);
    let fresh = attr(f, qpn);
    drive(f, qpn, ty, from);
    let before = attr(f, qpn);
    let result = f.e.modify_qp(qpn, &probe(from, to), AttrMask(mask));
    let after = attr(f, qpn);
    f.e.destroy_qp(qpn).unwrap();
    Attempt {
        result,
        before,
        after,
        fresh,
    }
}

/// Failures, gathered so that one run reports every cell that is wrong.
#[derive(Default)]
struct Report(Vec<String>);

impl Report {
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.0.push(what());
        }
    }

    fn assert_clean(self, total: usize) {
        assert!(
            self.0.is_empty(),
            "{} of {total} modifies went wrong:\n{}",
            self.0.len(),
            self.0.join("\n")
        );
    }
}

/// The refusal `ib_modify_qp_is_ok()` would give, as the engine's variant.
fn refused(e: TransitionError) -> Result<(), VerbsError> {
    Err(VerbsError::Transition(e))
}

// ---- tests ------------------------------------------------------------

#[test]
fn mask_bits_are_rdma_cores() {
    let pairs = [
        (AttrMask::STATE, STATE),
        (AttrMask::CUR_STATE, CUR_STATE),
        (AttrMask::EN_SQD_ASYNC_NOTIFY, EN_SQD_ASYNC_NOTIFY),
        (AttrMask::ACCESS_FLAGS, ACCESS_FLAGS),
        (AttrMask::PKEY_INDEX, PKEY_INDEX),
        (AttrMask::PORT, PORT),
        (AttrMask::QKEY, QKEY),
        (AttrMask::AV, AV),
        (AttrMask::PATH_MTU, PATH_MTU),
        (AttrMask::TIMEOUT, TIMEOUT),
        (AttrMask::RETRY_CNT, RETRY_CNT),
        (AttrMask::RNR_RETRY, RNR_RETRY),
        (AttrMask::RQ_PSN, RQ_PSN),
        (AttrMask::MAX_QP_RD_ATOMIC, MAX_QP_RD_ATOMIC),
        (AttrMask::ALT_PATH, ALT_PATH),
        (AttrMask::MIN_RNR_TIMER, MIN_RNR_TIMER),
        (AttrMask::SQ_PSN, SQ_PSN),
        (AttrMask::MAX_DEST_RD_ATOMIC, MAX_DEST_RD_ATOMIC),
        (AttrMask::PATH_MIG_STATE, PATH_MIG_STATE),
        (AttrMask::CAP, CAP),
        (AttrMask::DEST_QPN, DEST_QPN),
        (AttrMask::RATE_LIMIT, RATE_LIMIT),
    ];
    for (engine, rdma_core) in pairs {
        assert_eq!(engine.0, rdma_core, "{engine:?}");
    }
    // The table never names STATE, and names CUR_STATE only where the
    // kernel accepts it (RTR, RTS, SQD, SQE).
    for &(from, to, req, opt) in KERNEL_TABLE {
        for m in req.iter().chain(&opt) {
            assert_eq!(m & STATE, 0, "{from:?}→{to:?}");
        }
        for i in 0..3 {
            assert_eq!(req[i] & opt[i], 0, "{from:?}→{to:?}");
        }
        if opt.iter().any(|m| m & CUR_STATE != 0) {
            assert!(matches!(from, RTR | RTS | SQD | SQE), "{from:?}→{to:?}");
        }
    }
}

#[test]
fn every_transition_of_every_qp_type_against_the_kernel_table() {
    let mut report = Report::default();
    let mut total = 0;
    for ty in TYPES {
        let mut f = fx();
        for from in REACHABLE {
            for to in STATES {
                let cell = format!("{ty:?} {from:?}→{to:?}");
                let Some((req, opt)) = kernel(from, to, ty) else {
                    // Not a transition: refused whatever the mask, the QP
                    // untouched.
                    let mut masks = vec![STATE];
                    masks.extend(bits(!STATE).map(|b| STATE | b));
                    masks.push(u32::MAX);
                    if from == to {
                        // Without STATE a modify stays put: the same pair.
                        masks.push(0);
                        masks.extend(bits(!STATE));
                    }
                    for mask in masks {
                        total += 1;
                        let a = attempt(&mut f, ty, from, to, mask);
                        let want = refused(TransitionError::NotAllowed { from, to, ty });
                        report.check(a.result == want, || {
                            format!("{cell} mask {mask:#x}: {:?}, want {want:?}", a.result)
                        });
                        report.check(a.after == a.before, || {
                            format!("{cell} mask {mask:#x}: refused but changed")
                        });
                    }
                    continue;
                };

                // With STATE, and (for a modify that stays put) without.
                let stays = from == to;
                let with_state: &[u32] = if stays { &[STATE, 0] } else { &[STATE] };
                for &st in with_state {
                    // (a) Exactly the required attributes.
                    let mask = st | req;
                    total += 1;
                    let a = attempt(&mut f, ty, from, to, mask);
                    report.check(a.result.is_ok(), || {
                        format!("{cell} required {mask:#x}: {:?}", a.result)
                    });
                    let want = expected_after(&a.before, &a.fresh, &probe(from, to), mask, to);
                    report.check(a.after == want, || {
                        format!(
                            "{cell} required {mask:#x}: query {:?}, want {want:?}",
                            a.after
                        )
                    });

                    // (b) Each required attribute missing.
                    for b in bits(req) {
                        let mask = (st | req) & !b;
                        total += 1;
                        let a = attempt(&mut f, ty, from, to, mask);
                        let want = refused(TransitionError::MissingRequired {
                            from,
                            to,
                            missing: AttrMask(b),
                        });
                        report.check(a.result == want, || {
                            format!("{cell} without {b:#x}: {:?}, want {want:?}", a.result)
                        });
                        report.check(a.after == a.before, || {
                            format!("{cell} without {b:#x}: refused but changed")
                        });
                    }

                    // (c) Each optional attribute added.
                    for b in bits(opt) {
                        let mask = st | req | b;
                        total += 1;
                        let a = attempt(&mut f, ty, from, to, mask);
                        if b & APM != 0 {
                            // The state machine accepts it; the engine's
                            // own answer is tested separately.
                            report
                                .check(!matches!(a.result, Err(VerbsError::Transition(_))), || {
                                    format!("{cell} with {b:#x}: {:?}", a.result)
                                });
                            if a.result.is_err() {
                                report.check(a.after == a.before, || {
                                    format!("{cell} with {b:#x}: refused but changed")
                                });
                            }
                            continue;
                        }
                        report.check(a.result.is_ok(), || {
                            format!("{cell} with optional {b:#x}: {:?}", a.result)
                        });
                        let want = expected_after(&a.before, &a.fresh, &probe(from, to), mask, to);
                        report.check(a.after == want, || {
                            format!("{cell} with {b:#x}: query {:?}, want {want:?}", a.after)
                        });
                    }
                    // Every optional attribute at once (but APM's).
                    let mask = st | req | (opt & !APM);
                    total += 1;
                    let a = attempt(&mut f, ty, from, to, mask);
                    report.check(a.result.is_ok(), || {
                        format!("{cell} all optional {mask:#x}: {:?}", a.result)
                    });
                    let want = expected_after(&a.before, &a.fresh, &probe(from, to), mask, to);
                    report.check(a.after == want, || {
                        format!("{cell} all optional: query {:?}, want {want:?}", a.after)
                    });

                    // (d) Each bit that is neither required nor optional.
                    for b in bits(!(req | opt | STATE)) {
                        let mask = st | req | b;
                        total += 1;
                        let a = attempt(&mut f, ty, from, to, mask);
                        let want = if b == CUR_STATE && !matches!(from, RTR | RTS | SQD | SQE) {
                            refused(TransitionError::CurStateNotAccepted { from })
                        } else {
                            refused(TransitionError::NotPermitted {
                                from,
                                to,
                                extra: AttrMask(b),
                            })
                        };
                        report.check(a.result == want, || {
                            format!("{cell} with stray {b:#x}: {:?}, want {want:?}", a.result)
                        });
                        report.check(a.after == a.before, || {
                            format!("{cell} with stray {b:#x}: refused but changed")
                        });
                    }
                }
            }
        }
    }
    report.assert_clean(total);
}

#[test]
fn every_refusal_is_einval() {
    let mut f = fx();
    for ty in TYPES {
        let q = create(&mut f, ty);
        // Not a transition, a missing attribute, a stray one, CUR_STATE in
        // INIT.
        let cases = [
            (RTS, STATE),
            (INIT, STATE),
            (INIT, STATE | PKEY_INDEX | PORT | ACCESS_FLAGS | QKEY),
        ];
        for (to, mask) in cases {
            let e =
                f.e.modify_qp(q, &probe(RESET, to), AttrMask(mask))
                    .unwrap_err();
            assert!(matches!(e, VerbsError::Transition(_)), "{e:?}");
            assert_eq!(e.errno(), EINVAL, "{e:?}");
        }
        drive(&mut f, q, ty, INIT);
        let e =
            f.e.modify_qp(q, &probe(INIT, INIT), AttrMask(CUR_STATE))
                .unwrap_err();
        assert_eq!(
            e,
            VerbsError::Transition(TransitionError::CurStateNotAccepted { from: INIT })
        );
        assert_eq!(e.errno(), EINVAL);
        assert_eq!(attr(&f, q).qp_state, INIT);
    }
}

#[test]
fn a_modify_without_state_is_a_self_transition_whatever_qp_state_says() {
    for ty in TYPES {
        let mut f = fx();
        // INIT: an INIT→INIT change of P_Key index, though qp_state says
        // RTS. (Linux ignores qp_state when the mask lacks STATE.)
        let q = create(&mut f, ty);
        drive(&mut f, q, ty, INIT);
        let p = QpAttr {
            qp_state: RTS,
            ..probe(INIT, RTS)
        };
        f.e.modify_qp(q, &p, AttrMask(PKEY_INDEX)).unwrap();
        let a = attr(&f, q);
        assert_eq!((a.qp_state, a.pkey_index), (INIT, 1), "{ty:?}");
        // RTR: RTR→RTR is not a transition, so even an empty modify fails.
        let q = create(&mut f, ty);
        drive(&mut f, q, ty, RTR);
        assert_eq!(
            f.e.modify_qp(q, &probe(RTR, RTS), AttrMask(0)),
            refused(TransitionError::NotAllowed {
                from: RTR,
                to: RTR,
                ty
            })
        );
        assert_eq!(attr(&f, q).qp_state, RTR);
        // RESET and ERR: empty modifies are accepted and change nothing.
        for s in [RESET, ERR] {
            let q = create(&mut f, ty);
            drive(&mut f, q, ty, s);
            let before = attr(&f, q);
            f.e.modify_qp(q, &probe(s, INIT), AttrMask(0)).unwrap();
            assert_eq!(attr(&f, q), before, "{ty:?} {s:?}");
        }
    }
}

#[test]
fn cur_state_must_name_the_state_the_qp_is_in() {
    for ty in TYPES {
        let mut f = fx();
        // Where the table lists CUR_STATE, naming the real state is
        // accepted.
        for (from, to) in [(RTR, RTS), (RTS, RTS), (SQD, RTS)] {
            let q = create(&mut f, ty);
            drive(&mut f, q, ty, from);
            f.e.modify_qp(
                q,
                &probe(from, to),
                AttrMask(STATE | CUR_STATE | kernel(from, to, ty).unwrap().0),
            )
            .unwrap_or_else(|e| panic!("{ty:?} {from:?}→{to:?}: {e}"));
            assert_eq!(attr(&f, q).qp_state, to);
        }
        // Naming another state is refused (EINVAL), the QP untouched: the
        // engine does not take the caller's word for it.
        for (real, claimed) in [(RTS, SQD), (RTS, RTR), (SQD, RTS), (RTR, RTS), (RTS, SQE)] {
            let q = create(&mut f, ty);
            drive(&mut f, q, ty, real);
            let before = attr(&f, q);
            let p = QpAttr {
                cur_qp_state: claimed,
                ..probe(claimed, RTS)
            };
            let e =
                f.e.modify_qp(q, &p, AttrMask(STATE | CUR_STATE))
                    .unwrap_err();
            assert_eq!(
                e,
                VerbsError::Invalid {
                    what: "cur_qp_state (not the QP's state)"
                },
                "{ty:?} real {real:?} claimed {claimed:?}"
            );
            assert_eq!(e.errno(), EINVAL);
            assert_eq!(attr(&f, q), before);
        }
        // CUR_STATE naming the real state, where the kernel refuses it
        // because that state is not RTR/RTS/SQD/SQE.
        for (from, to) in [(INIT, INIT), (INIT, ERR), (ERR, RESET), (RESET, RESET)] {
            let q = create(&mut f, ty);
            drive(&mut f, q, ty, from);
            assert_eq!(
                f.e.modify_qp(q, &probe(from, to), AttrMask(STATE | CUR_STATE)),
                refused(TransitionError::CurStateNotAccepted { from }),
                "{ty:?} {from:?}→{to:?}"
            );
            assert_eq!(attr(&f, q).qp_state, from);
        }
    }
}

#[test]
fn nothing_can_move_a_qp_into_sqe() {
    for ty in TYPES {
        let mut f = fx();
        for from in REACHABLE {
            for mask in [STATE, STATE | CUR_STATE, u32::MAX] {
                let q = create(&mut f, ty);
                drive(&mut f, q, ty, from);
                let before = attr(&f, q);
                assert_eq!(
                    f.e.modify_qp(q, &probe(from, SQE), AttrMask(mask)),
                    refused(TransitionError::NotAllowed { from, to: SQE, ty }),
                    "{ty:?} {from:?}"
                );
                assert_eq!(attr(&f, q), before);
            }
        }
    }
}

// ---- any state → RESET, any state → ERR -------------------------------

fn sge() -> Sge {
    Sge {
        addr: 0x1000,
        length: 8,
        lkey: Lkey(0x100),
    }
}

/// Posts what `state` allows: a receive from INIT on, a send in RTS and
/// SQD. Returns the wr_ids posted: (sends, receives).
fn post_what_fits(f: &mut Fx, q: Qpn, ty: QpType, state: QpState) -> (Vec<u64>, Vec<u64>) {
    let sg = [sge()];
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    if matches!(state, INIT | RTR | RTS | SQD) {
        f.e.post_recv(
            q,
            &RecvWr {
                wr_id: 20,
                sg_list: &sg,
            },
        )
        .unwrap();
        recvs.push(20);
    }
    if matches!(state, RTS | SQD) {
        let ud = ty.is_datagram().then_some(UdDest {
            av: vrdma_engine::wr::Av::Handle(f.ah),
            remote_qpn: Qpn::from_masked(0x42),
            remote_qkey: QKey(0x1111),
        });
        f.e.post_send(
            q,
            &SendWr {
                wr_id: 10,
                op: SendOp::Send,
                payload: Payload::Sges(&sg),
                flags: SendFlags::default(),
                ud,
            },
        )
        .unwrap();
        sends.push(10);
    }
    (sends, recvs)
}

fn poll(f: &mut Fx) -> Vec<Wc> {
    let mut v = Vec::new();
    f.e.poll_cq(f.cq, 64, &mut v).unwrap();
    v
}

#[test]
fn any_state_to_reset_forgets_attributes_and_work_requests() {
    for ty in TYPES {
        let mut f = fx();
        for from in REACHABLE {
            let q = create(&mut f, ty);
            let fresh = attr(&f, q);
            drive(&mut f, q, ty, from);
            post_what_fits(&mut f, q, ty, from);
            f.e.modify_qp(q, &probe(from, RESET), AttrMask(STATE))
                .unwrap_or_else(|e| panic!("{ty:?} {from:?}→RESET: {e}"));
            assert_eq!(attr(&f, q), fresh, "{ty:?} {from:?}→RESET");
            assert!(
                poll(&mut f).is_empty(),
                "{ty:?} {from:?}: RESET completes nothing"
            );
            // Nothing can be posted in RESET; the QP comes up again and
            // holds nothing of before (ERR would flush it).
            assert_eq!(
                f.e.post_recv(
                    q,
                    &RecvWr {
                        wr_id: 1,
                        sg_list: &[sge()],
                    },
                )
                .unwrap_err()
                .errno(),
                EINVAL
            );
            drive(&mut f, q, ty, ERR);
            assert!(poll(&mut f).is_empty(), "{ty:?} {from:?}: queues emptied");
        }
    }
}

#[test]
fn any_state_but_reset_to_err_flushes_every_work_request() {
    for ty in TYPES {
        let mut f = fx();
        // RESET→ERR is not in the kernel's table.
        let q = create(&mut f, ty);
        assert_eq!(
            f.e.modify_qp(q, &probe(RESET, ERR), AttrMask(STATE)),
            refused(TransitionError::NotAllowed {
                from: RESET,
                to: ERR,
                ty
            })
        );
        assert_eq!(attr(&f, q).qp_state, RESET);
        for from in [INIT, RTR, RTS, SQD, ERR] {
            let q = create(&mut f, ty);
            drive(&mut f, q, ty, from);
            let (sends, recvs) = post_what_fits(&mut f, q, ty, from);
            // Only what the move to ERR raises counts below.
            while f.e.poll_event().is_some() {}
            let before = attr(&f, q);
            f.e.modify_qp(q, &probe(from, ERR), AttrMask(STATE))
                .unwrap();
            assert_eq!(
                attr(&f, q),
                QpAttr {
                    qp_state: ERR,
                    cur_qp_state: ERR,
                    ..before
                },
                "{ty:?} {from:?}→ERR changes only the state"
            );
            let want: Vec<Wc> = sends
                .iter()
                .zip(1..)
                .map(|(&id, retired)| Wc {
                    sq_retired: retired,
                    ..Wc::new(id, WcStatus::WrFlushErr, WcOpcode::Send, q.value())
                })
                .chain(
                    recvs
                        .iter()
                        .map(|&id| Wc::new(id, WcStatus::WrFlushErr, WcOpcode::Recv, q.value())),
                )
                .collect();
            assert_eq!(poll(&mut f), want, "{ty:?} {from:?}→ERR");
            assert_eq!(f.e.poll_event(), None, "{ty:?} {from:?}→ERR: no event");
        }
    }
}

// ---- SQD: the drained event ---------------------------------------------

/// Two nodes on the test network, each with a `ty` QP in RTS aimed at the
/// other; returns the QPNs and the CQ of each.
fn net_pair(ty: QpType) -> (Net, [Qpn; 2], [CqHandle; 2]) {
    let mut net = Net::default();
    let mut qpns = [Qpn::default(); 2];
    let mut cqs = [CqHandle::default(); 2];
    for (i, me) in [1u8, 2].into_iter().enumerate() {
        let mut e = Engine::new(DeviceAttr::default(), PortAttr::with_gids(&[gid(me)]));
        let pd = e.alloc_pd().unwrap();
        let (cq, _) = e.create_cq(16, 0).unwrap();
        let (q, _) = e
            .create_qp(QpInitAttr {
                pd,
                send_cq: cq,
                recv_cq: cq,
                srq: None,
                cap: QpCap {
                    max_send_wr: 4,
                    max_recv_wr: 4,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 16,
                },
                qp_type: ty,
                sq_sig_all: false,
            })
            .unwrap();
        while e.poll_event().is_some() {}
        qpns[i] = q;
        cqs[i] = cq;
        net.add(e, VecMemory::new(0x1000, 4096), gid(me));
    }
    for i in 0..2 {
        let a = QpAttr {
            ah_attr: AhAttr {
                dgid: gid(2 - i as u8),
                port_num: 1,
                hop_limit: 64,
                ..AhAttr::default()
            },
            dest_qp_num: qpns[1 - i],
            rq_psn: Psn::from_masked(0x10),
            sq_psn: Psn::from_masked(0x10),
            ..base()
        };
        net.nodes[i].engine.bring_up_qp(qpns[i], &a).unwrap();
    }
    (net, qpns, cqs)
}

#[test]
fn an_idle_qp_moved_to_sqd_with_notify_reports_it_drained() {
    // IBTA Vol1 §10.3.1 and §11.6.3: with EN_SQD_ASYNC_NOTIFY the CI
    // raises the SQ Drained affiliated event once the send queue has
    // drained; an idle send queue is drained at once. (rxe raises
    // IB_EVENT_SQ_DRAINED from its requester when SQD finds nothing in
    // flight.)
    for ty in TYPES {
        let (mut net, q, _) = net_pair(ty);
        let p = QpAttr {
            en_sqd_async_notify: true,
            ..probe(RTS, SQD)
        };
        net.nodes[0]
            .engine
            .modify_qp(q[0], &p, AttrMask(STATE | EN_SQD_ASYNC_NOTIFY))
            .unwrap();
        assert_eq!(net.run(10), Quiet::Idle);
        let e = &mut net.nodes[0].engine;
        let (a, _) = e.query_qp(q[0]).unwrap();
        assert_eq!((a.qp_state, a.sq_draining), (SQD, false), "{ty:?}");
        assert_eq!(
            e.poll_event(),
            Some(AsyncEvent::SqDrained { qp: q[0] }),
            "{ty:?}"
        );
        assert_eq!(e.poll_event(), None, "{ty:?}: raised once");
    }
}

#[test]
fn an_rc_qp_moved_to_sqd_mid_message_drains_then_reports_it() {
    let (mut net, q, cq) = net_pair(QpType::Rc);
    // A zero-length SEND (no memory needed) is in flight, sent and not yet
    // acknowledged, when the QP is moved to SQD.
    net.nodes[1]
        .engine
        .post_recv(
            q[1],
            &RecvWr {
                wr_id: 7,
                sg_list: &[],
            },
        )
        .unwrap();
    net.nodes[0]
        .engine
        .post_send(
            q[0],
            &SendWr {
                wr_id: 1,
                op: SendOp::Send,
                payload: Payload::Sges(&[]),
                flags: SendFlags::SIGNALED,
                ud: None,
            },
        )
        .unwrap();
    // The SEND's packet leaves a (and is lost: it is never delivered).
    let now = net.now;
    let node = &mut net.nodes[0];
    let mut buf = vec![0u8; vrdma_engine::transmit::MAX_PACKET];
    assert!(
        node.engine
            .poll_transmit(now, &node.mem, &mut buf)
            .is_some()
    );
    let p = QpAttr {
        en_sqd_async_notify: true,
        ..probe(RTS, SQD)
    };
    let e = &mut net.nodes[0].engine;
    e.modify_qp(q[0], &p, AttrMask(STATE | EN_SQD_ASYNC_NOTIFY))
        .unwrap();
    let (a, _) = e.query_qp(q[0]).unwrap();
    assert_eq!((a.qp_state, a.sq_draining), (SQD, true), "still draining");
    assert_eq!(e.poll_event(), None, "not drained yet");
    // The retransmit timer resends it (SQD lets a started WR finish) and
    // its ACK drains the send queue.
    let Quiet::Timer(t) = net.run(10) else {
        panic!("expected the retransmit timer")
    };
    net.advance_to(t);
    assert_eq!(net.run(10), Quiet::Idle);
    let e = &mut net.nodes[0].engine;
    let mut wc = Vec::new();
    e.poll_cq(cq[0], 4, &mut wc).unwrap();
    assert_eq!(
        wc.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success)]
    );
    let (a, _) = e.query_qp(q[0]).unwrap();
    assert_eq!((a.qp_state, a.sq_draining), (SQD, false));
    assert_eq!(e.poll_event(), Some(AsyncEvent::SqDrained { qp: q[0] }));
    assert_eq!(e.poll_event(), None);
}

// ---- automatic path migration ------------------------------------------

#[test]
fn alt_path_on_a_roce_port_is_einval_as_in_linux() {
    // Linux's _ib_modify_qp() refuses IB_QP_ALT_PATH on a RoCE port with
    // -EINVAL ("Today the core code can only handle alternate paths and
    // APM for IB. Ban them in roce mode."), whatever the driver; rdma-core
    // hands that errno to the caller. Every cell that lists ALT_PATH is
    // tried.
    for ty in [QpType::Rc, QpType::Uc] {
        let mut f = fx();
        for (from, to) in [(INIT, RTR), (RTR, RTS), (RTS, RTS), (SQD, RTS), (SQD, SQD)] {
            let (req, opt) = kernel(from, to, ty).unwrap();
            assert_ne!(opt & ALT_PATH, 0);
            let a = attempt(&mut f, ty, from, to, STATE | req | ALT_PATH);
            let e = a.result.unwrap_err();
            assert_eq!(e.errno(), EINVAL, "{ty:?} {from:?}→{to:?}: {e:?}");
            assert!(matches!(e, VerbsError::Invalid { .. }), "{e:?}");
            assert_eq!(a.after, a.before);
        }
    }
}
