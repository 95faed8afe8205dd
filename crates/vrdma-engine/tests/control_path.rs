//! The control path as rdma-core users meet it: create, modify, query and
//! destroy, with the errno each failure must carry.

use std::net::Ipv4Addr;

use vrdma_engine::{
    CqHandle, Engine, Kind, PdHandle, VerbsError,
    attr::{DeviceAttr, Mtu, PortAttr},
    error::errno::{EBUSY, EINVAL, ENOMEM, EOPNOTSUPP},
    event::AsyncEvent,
    mr::{Access, AccessError, MrRequest, Translation},
    objects::SrqAttr,
    qp::{AhAttr, AttrMask, QpAttr, QpCap, QpInitAttr, QpState, QpType},
};
use vrdma_wire::{Gid, Psn, QKey, Qpn};

fn gid(last: u8) -> Gid {
    Gid::from(Ipv4Addr::new(127, 0, 0, last))
}

fn engine() -> Engine {
    Engine::new(DeviceAttr::default(), PortAttr::with_gids(&[gid(1)]))
}

fn small() -> Engine {
    Engine::new(
        DeviceAttr {
            max_qp: 2,
            max_pd: 2,
            max_cq: 2,
            max_mr: 2,
            ..DeviceAttr::default()
        },
        PortAttr::with_gids(&[gid(1)]),
    )
}

fn mr_req(pd: PdHandle) -> MrRequest {
    MrRequest {
        pd,
        iova: 0x1000,
        length: 4096,
        access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        translation: Translation::Identity,
    }
}

fn cap() -> QpCap {
    QpCap {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
    }
}

fn init(pd: PdHandle, cq: CqHandle, qp_type: QpType) -> QpInitAttr {
    QpInitAttr {
        pd,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: cap(),
        qp_type,
        sq_sig_all: false,
    }
}

fn av() -> AhAttr {
    AhAttr {
        dgid: gid(2),
        sgid_index: 0,
        hop_limit: 64,
        port_num: 1,
        ..AhAttr::default()
    }
}

/// The RESET→INIT mask of a connected QP.
const CONNECTED_INIT: AttrMask = AttrMask(
    AttrMask::STATE.0 | AttrMask::PKEY_INDEX.0 | AttrMask::PORT.0 | AttrMask::ACCESS_FLAGS.0,
);

/// An engine with a PD, a 16-entry CQ and one QP of type `ty`.
fn with_qp(ty: QpType) -> (Engine, PdHandle, CqHandle, Qpn) {
    let mut e = engine();
    let pd = e.alloc_pd().unwrap();
    let (cq, _) = e.create_cq(16, 0).unwrap();
    let (qpn, _) = e.create_qp(init(pd, cq, ty)).unwrap();
    (e, pd, cq, qpn)
}

/// RESET→INIT for a connected QP, port 1, P_Key index 0.
fn connected_init(e: &mut Engine, qpn: Qpn) -> QpAttr {
    let a = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        ..QpAttr::default()
    };
    e.modify_qp(qpn, &a, CONNECTED_INIT).unwrap();
    a
}

/// Brings an RC QP to RTS the way ibv_rc_pingpong does.
fn to_rts(e: &mut Engine, qpn: Qpn) {
    let a = QpAttr {
        qp_state: QpState::Init,
        pkey_index: 0,
        port_num: 1,
        qp_access_flags: Access::REMOTE_WRITE | Access::REMOTE_READ,
        ..QpAttr::default()
    };
    e.modify_qp(qpn, &a, CONNECTED_INIT).unwrap();
    let a = QpAttr {
        qp_state: QpState::Rtr,
        path_mtu: Mtu::Mtu1024,
        dest_qp_num: Qpn::from_masked(0x42),
        rq_psn: Psn::from_masked(0x1234),
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        ah_attr: av(),
        ..QpAttr::default()
    };
    e.modify_qp(
        qpn,
        &a,
        AttrMask::STATE
            | AttrMask::AV
            | AttrMask::PATH_MTU
            | AttrMask::DEST_QPN
            | AttrMask::RQ_PSN
            | AttrMask::MAX_DEST_RD_ATOMIC
            | AttrMask::MIN_RNR_TIMER,
    )
    .unwrap();
    let a = QpAttr {
        qp_state: QpState::Rts,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        sq_psn: Psn::from_masked(0x9999),
        max_rd_atomic: 1,
        ..QpAttr::default()
    };
    e.modify_qp(
        qpn,
        &a,
        AttrMask::STATE
            | AttrMask::TIMEOUT
            | AttrMask::RETRY_CNT
            | AttrMask::RNR_RETRY
            | AttrMask::SQ_PSN
            | AttrMask::MAX_QP_RD_ATOMIC,
    )
    .unwrap();
}

#[test]
fn the_port_announces_itself() {
    let mut e = engine();
    assert_eq!(e.poll_event(), Some(AsyncEvent::PortActive { port: 1 }));
    assert_eq!(e.poll_event(), None);
    assert_eq!(e.query_port(1).unwrap().gid(0).unwrap().gid, gid(1));
    assert_eq!(e.query_port(2).unwrap_err().errno(), EINVAL);
}

#[test]
fn a_pd_in_use_cannot_be_deallocated() {
    let mut e = engine();
    let pd = e.alloc_pd().unwrap();
    let (cq, _) = e.create_cq(16, 0).unwrap();
    let (lkey, _) = e.reg_mr(mr_req(pd)).unwrap();
    let (qpn, _) = e.create_qp(init(pd, cq, QpType::Rc)).unwrap();
    let (srq, _) = e
        .create_srq(
            pd,
            SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 0,
            },
        )
        .unwrap();
    let ah = e.create_ah(pd, av()).unwrap();
    let err = e.dealloc_pd(pd).unwrap_err();
    assert_eq!(
        err,
        VerbsError::Busy {
            kind: Kind::Pd,
            handle: pd.0,
            users: 4
        }
    );
    assert_eq!(err.errno(), EBUSY);
    e.dereg_mr(lkey).unwrap();
    e.destroy_qp(qpn).unwrap();
    e.destroy_srq(srq).unwrap();
    assert_eq!(e.dealloc_pd(pd).unwrap_err().errno(), EBUSY, "the AH");
    e.destroy_ah(ah).unwrap();
    e.dealloc_pd(pd).unwrap();
    assert_eq!(
        e.dealloc_pd(pd),
        Err(VerbsError::NotFound {
            kind: Kind::Pd,
            handle: pd.0
        })
    );
}

#[test]
fn a_cq_or_srq_with_qps_cannot_be_destroyed() {
    let mut e = engine();
    let pd = e.alloc_pd().unwrap();
    let (cq, _) = e.create_cq(16, 0).unwrap();
    let (cq2, _) = e.create_cq(16, 0).unwrap();
    let (srq, _) = e
        .create_srq(
            pd,
            SrqAttr {
                max_wr: 8,
                max_sge: 1,
                srq_limit: 0,
            },
        )
        .unwrap();
    let (qpn, granted) = e
        .create_qp(QpInitAttr {
            recv_cq: cq2,
            srq: Some(srq),
            ..init(pd, cq, QpType::Ud)
        })
        .unwrap();
    assert_eq!((granted.max_recv_wr, granted.max_recv_sge), (0, 0));
    assert_eq!(e.destroy_cq(cq).unwrap_err().errno(), EBUSY);
    assert_eq!(e.destroy_cq(cq2).unwrap_err().errno(), EBUSY);
    assert_eq!(e.destroy_srq(srq).unwrap_err().errno(), EBUSY);
    e.destroy_qp(qpn).unwrap();
    e.destroy_cq(cq).unwrap();
    e.destroy_cq(cq2).unwrap();
    e.destroy_srq(srq).unwrap();
    assert_eq!(
        e.counts(),
        vrdma_engine::Counts {
            pds: 1,
            ..Default::default()
        }
    );
}

/// A process that reconnects gets a QPN its peer's connection manager has
/// not just seen: a number reused at once is rejected there as a stale
/// connection while the old one waits out its time-wait.
#[test]
fn a_destroyed_qps_number_comes_back_only_after_every_other() {
    let mut e = small();
    let pd = e.alloc_pd().unwrap();
    let (cq, _) = e.create_cq(16, 0).unwrap();
    let mut seen = Vec::new();
    for _ in 0..5 {
        let (qpn, _) = e.create_qp(init(pd, cq, QpType::Rc)).unwrap();
        e.destroy_qp(qpn).unwrap();
        seen.push(qpn.value());
    }
    assert_eq!(
        seen,
        [17, 18, 17, 18, 17],
        "in turn over max_qp (2) numbers"
    );
    let (held, _) = e.create_qp(init(pd, cq, QpType::Rc)).unwrap();
    assert_eq!(held.value(), 18);
    let (next, _) = e.create_qp(init(pd, cq, QpType::Rc)).unwrap();
    assert_eq!(next.value(), 17, "past the one held, wrapping");
    assert_eq!(
        e.create_qp(init(pd, cq, QpType::Rc)).unwrap_err().errno(),
        ENOMEM
    );
}

#[test]
fn limits_are_einval_and_exhaustion_is_enomem() {
    let mut e = small();
    let pd = e.alloc_pd().unwrap();
    e.alloc_pd().unwrap();
    assert_eq!(e.alloc_pd().unwrap_err().errno(), ENOMEM);
    assert_eq!(e.create_cq(0, 0).unwrap_err().errno(), EINVAL);
    let max_cqe = e.query_device().max_cqe;
    assert_eq!(e.create_cq(max_cqe + 1, 0).unwrap_err().errno(), EINVAL);
    let (cq, _) = e.create_cq(max_cqe, 0).unwrap();
    let too_deep = QpInitAttr {
        cap: QpCap {
            max_send_wr: e.query_device().max_qp_wr + 1,
            ..cap()
        },
        ..init(pd, cq, QpType::Rc)
    };
    assert_eq!(
        e.create_qp(too_deep).unwrap_err(),
        VerbsError::ExceedsLimit {
            what: "max_send_wr",
            requested: 0x4001,
            max: 0x4000
        }
    );
    let unknown_cq = init(pd, CqHandle(99), QpType::Rc);
    assert_eq!(e.create_qp(unknown_cq).unwrap_err().errno(), EINVAL);
    e.create_qp(init(pd, cq, QpType::Rc)).unwrap();
    e.create_qp(init(pd, cq, QpType::Uc)).unwrap();
    assert_eq!(
        e.create_qp(init(pd, cq, QpType::Ud)).unwrap_err(),
        VerbsError::Exhausted {
            kind: Kind::Qp,
            max: 2
        }
    );
}

#[test]
fn mr_registration_is_validated() {
    let mut e = engine();
    let pd = e.alloc_pd().unwrap();
    let bad = |e: &mut Engine, req: MrRequest| e.reg_mr(req).unwrap_err().errno();
    assert_eq!(
        bad(
            &mut e,
            MrRequest {
                length: 0,
                ..mr_req(pd)
            }
        ),
        EINVAL
    );
    assert_eq!(
        bad(
            &mut e,
            MrRequest {
                access: Access::REMOTE_WRITE,
                ..mr_req(pd)
            }
        ),
        EINVAL
    );
    assert_eq!(
        bad(
            &mut e,
            MrRequest {
                pd: PdHandle(77),
                ..mr_req(pd)
            }
        ),
        EINVAL
    );
    assert_eq!(
        bad(
            &mut e,
            MrRequest {
                iova: u64::MAX - 10,
                ..mr_req(pd)
            }
        ),
        EINVAL
    );
    let paged = |pages: Vec<u64>, offset: u64| MrRequest {
        length: 8192,
        translation: Translation::Pages {
            page_shift: 12,
            offset,
            pages,
        },
        ..mr_req(pd)
    };
    assert_eq!(bad(&mut e, paged(vec![0x1000], 0)), EINVAL, "too few pages");
    assert_eq!(
        bad(&mut e, paged(vec![0x1000, 0x2000], 8)),
        EINVAL,
        "offset needs a third page"
    );
    assert_eq!(
        bad(&mut e, paged(vec![0x1000, 0x2001], 0)),
        EINVAL,
        "unaligned page"
    );
    assert_eq!(
        bad(&mut e, paged(vec![0x1000, 0x2000], 4096)),
        EINVAL,
        "offset of a page"
    );
    let (lkey, rkey) = e.reg_mr(paged(vec![0x1000, 0x2000, 0x3000], 8)).unwrap();
    assert_eq!(lkey.0, rkey.0);
    // Re-registration in the same slot gets a new key byte.
    e.dereg_mr(lkey).unwrap();
    let (lkey2, _) = e.reg_mr(mr_req(pd)).unwrap();
    assert_eq!(lkey2.index(), lkey.index());
    assert_ne!(lkey2, lkey);
    assert_eq!(
        e.check_local(lkey, pd, 0x1000, 1, Access::NONE)
            .unwrap_err(),
        AccessError::InvalidKey(lkey.0)
    );
    assert!(
        e.check_local(lkey2, pd, 0x1000, 4096, Access::LOCAL_WRITE)
            .is_ok()
    );
    assert!(
        e.check_remote(
            vrdma_wire::Rkey(lkey2.0),
            pd,
            0x1000,
            8,
            Access::REMOTE_WRITE,
            Qpn::from_masked(17)
        )
        .is_ok()
    );
    assert_eq!(
        e.check_remote(
            vrdma_wire::Rkey(lkey2.0),
            pd,
            0x1000,
            8,
            Access::REMOTE_READ,
            Qpn::from_masked(17)
        )
        .unwrap_err(),
        AccessError::Denied {
            key: lkey2.0,
            needed: Access::REMOTE_READ
        }
    );
}

#[test]
fn an_rc_qp_reaches_rts_and_query_returns_what_was_set() {
    let (mut e, _, _, qpn) = with_qp(QpType::Rc);
    assert_eq!(qpn.value(), 17);
    to_rts(&mut e, qpn);
    let (a, i) = e.query_qp(qpn).unwrap();
    assert_eq!(a.qp_state, QpState::Rts);
    assert_eq!(a.dest_qp_num, Qpn::from_masked(0x42));
    assert_eq!(a.rq_psn, Psn::from_masked(0x1234));
    assert_eq!(a.sq_psn, Psn::from_masked(0x9999));
    assert_eq!((a.timeout, a.retry_cnt, a.rnr_retry), (14, 7, 7));
    assert_eq!(a.min_rnr_timer, 12);
    assert_eq!(a.ah_attr, av());
    assert_eq!(
        a.qp_access_flags,
        Access::REMOTE_WRITE | Access::REMOTE_READ
    );
    assert_eq!(i.cap, cap());
    // Back to RESET forgets the connection.
    let reset = QpAttr {
        qp_state: QpState::Reset,
        ..QpAttr::default()
    };
    e.modify_qp(qpn, &reset, AttrMask::STATE).unwrap();
    let (a, _) = e.query_qp(qpn).unwrap();
    assert_eq!(a.qp_state, QpState::Reset);
    assert_eq!(a.dest_qp_num, Qpn::default());
    assert_eq!(a.cap, cap());
}

#[test]
fn modify_qp_rejects_what_the_state_machine_forbids() {
    let (mut e, _, _, qpn) = with_qp(QpType::Rc);
    // RESET → RTR is not a transition.
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        ..QpAttr::default()
    };
    assert_eq!(
        e.modify_qp(qpn, &rtr, AttrMask::STATE).unwrap_err().errno(),
        EINVAL
    );
    // RESET → INIT without the access flags RC requires.
    let a = QpAttr {
        qp_state: QpState::Init,
        ..QpAttr::default()
    };
    assert!(matches!(
        e.modify_qp(
            qpn,
            &a,
            AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT
        ),
        Err(VerbsError::Transition(_))
    ));
    // Out-of-range values with an allowed mask.
    let full = CONNECTED_INIT;
    let bad_port = QpAttr { port_num: 2, ..a };
    assert_eq!(
        e.modify_qp(qpn, &bad_port, full).unwrap_err(),
        VerbsError::Invalid {
            what: "port number"
        }
    );
    let bad_pkey = QpAttr {
        pkey_index: 1,
        port_num: 1,
        ..a
    };
    assert_eq!(
        e.modify_qp(qpn, &bad_pkey, full).unwrap_err(),
        VerbsError::Invalid {
            what: "P_Key index"
        }
    );
    let bad_access = QpAttr {
        qp_access_flags: Access::MW_BIND,
        port_num: 1,
        ..a
    };
    assert_eq!(
        e.modify_qp(qpn, &bad_access, full).unwrap_err().errno(),
        EINVAL
    );
    assert_eq!(
        e.query_qp(qpn).unwrap().0.qp_state,
        QpState::Reset,
        "nothing applied"
    );
    // RESET → ERR is not a transition (the kernel's table has none); from
    // INIT on, any state may go to ERR.
    let err = QpAttr {
        qp_state: QpState::Err,
        ..QpAttr::default()
    };
    assert_eq!(
        e.modify_qp(qpn, &err, AttrMask::STATE).unwrap_err().errno(),
        EINVAL
    );
    let good = QpAttr {
        port_num: 1,
        qp_access_flags: Access::REMOTE_READ,
        ..a
    };
    e.modify_qp(qpn, &good, full).unwrap();
    e.modify_qp(qpn, &err, AttrMask::STATE).unwrap();
    assert_eq!(e.query_qp(qpn).unwrap().0.qp_state, QpState::Err);
    // CUR_STATE must name the QP's real state.
    let lie = QpAttr {
        qp_state: QpState::Reset,
        cur_qp_state: QpState::Rts,
        ..QpAttr::default()
    };
    assert_eq!(
        e.modify_qp(qpn, &lie, AttrMask::STATE | AttrMask::CUR_STATE)
            .unwrap_err(),
        VerbsError::Invalid {
            what: "cur_qp_state (not the QP's state)"
        }
    );
}

#[test]
fn rtr_attributes_are_range_checked() {
    let (mut e, _, _, qpn) = with_qp(QpType::Uc);
    connected_init(&mut e, qpn);
    let mask =
        AttrMask::STATE | AttrMask::AV | AttrMask::PATH_MTU | AttrMask::DEST_QPN | AttrMask::RQ_PSN;
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        ah_attr: av(),
        path_mtu: Mtu::Mtu4096,
        ..QpAttr::default()
    };
    let no_sgid = QpAttr {
        ah_attr: AhAttr {
            sgid_index: 3,
            ..av()
        },
        ..rtr
    };
    assert_eq!(
        e.modify_qp(qpn, &no_sgid, mask).unwrap_err(),
        VerbsError::Invalid {
            what: "source GID index"
        }
    );
    let zero_dgid = QpAttr {
        ah_attr: AhAttr {
            dgid: Gid::default(),
            ..av()
        },
        ..rtr
    };
    assert_eq!(
        e.modify_qp(qpn, &zero_dgid, mask).unwrap_err().errno(),
        EINVAL
    );
    e.modify_qp(qpn, &rtr, mask).unwrap();
    assert_eq!(e.query_qp(qpn).unwrap().0.path_mtu, Mtu::Mtu4096);
}

#[test]
fn ud_qkeys_and_unsupported_attributes() {
    let mut e = engine();
    let pd = e.alloc_pd().unwrap();
    let (cq, _) = e.create_cq(16, 0).unwrap();
    let (qpn, _) = e.create_qp(init(pd, cq, QpType::Ud)).unwrap();
    let mask = AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::QKEY;
    let controlled = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qkey: QKey(0x8000_0001),
        ..QpAttr::default()
    };
    assert_eq!(
        e.modify_qp(qpn, &controlled, mask).unwrap_err().errno(),
        EINVAL
    );
    let ok = QpAttr {
        qkey: QKey(0x1111_1111),
        ..controlled
    };
    e.modify_qp(qpn, &ok, mask).unwrap();
    assert_eq!(e.query_qp(qpn).unwrap().0.qkey, QKey(0x1111_1111));
    // INIT → INIT with QKEY is allowed for UD and changes it.
    let again = QpAttr {
        qkey: QKey(0x2222),
        ..ok
    };
    e.modify_qp(qpn, &again, AttrMask::QKEY).unwrap();
    assert_eq!(e.query_qp(qpn).unwrap().0.qkey, QKey(0x2222));
    let (rc, _) = e.create_qp(init(pd, cq, QpType::Rc)).unwrap();
    let a = connected_init(&mut e, rc);
    // Resizing queues through modify is refused as unsupported, not ignored.
    let err = e
        .modify_qp(
            rc,
            &QpAttr {
                qp_state: QpState::Init,
                ..a
            },
            AttrMask::CAP,
        )
        .unwrap_err();
    assert!(
        err.errno() == EOPNOTSUPP || err.errno() == EINVAL,
        "{err:?}"
    );
}

/// A flow label is 20 bits; the bits above are dropped where the engine
/// keeps an address vector, never refused. UCX 1.13 passes `0xffffffff`
/// and the complement of a path index (`!1`) and relies on the device to
/// keep the low 20 bits, as rxe and hardware do: an AH and an RC path
/// with such labels are taken, kept cut, and their packets carry the cut
/// label.
#[test]
fn flow_labels_wider_than_20_bits_are_cut_not_refused() {
    use vrdma_engine::{
        memory::VecMemory,
        wr::{Av, Payload, SendFlags, SendOp, SendWr, UdDest},
    };
    let mem = VecMemory::new(0, 0);
    let mut buf = vec![0; 8192];
    let send = |ud| SendWr {
        wr_id: 1,
        op: SendOp::Send,
        payload: Payload::Inline(b"flow"),
        flags: SendFlags::SIGNALED | SendFlags::INLINE,
        ud,
    };

    // UD through an address handle, and through a vector in the WR.
    let mut e = engine();
    let pd = e.alloc_pd().unwrap();
    let (cq, _) = e.create_cq(16, 0).unwrap();
    let (ud, _) = e.create_qp(init(pd, cq, QpType::Ud)).unwrap();
    for (state, mask) in [
        (
            QpState::Init,
            AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::QKEY,
        ),
        (QpState::Rtr, AttrMask::STATE),
        (QpState::Rts, AttrMask::STATE | AttrMask::SQ_PSN),
    ] {
        let a = QpAttr {
            qp_state: state,
            port_num: 1,
            qkey: QKey(0x1111_1111),
            ..QpAttr::default()
        };
        e.modify_qp(ud, &a, mask).unwrap();
    }
    let wide = AhAttr {
        flow_label: u32::MAX,
        ..av()
    };
    let ah = e
        .create_ah(pd, wide)
        .expect("an AH with flow label 0xffffffff");
    for av in [Av::Handle(ah), Av::Inline(wide)] {
        let dest = UdDest {
            av,
            remote_qpn: Qpn::from_masked(0x42),
            remote_qkey: QKey(0x1111_1111),
        };
        e.post_send(ud, &send(Some(dest))).unwrap();
        let t = e.poll_transmit(0, &mem, &mut buf).expect("the datagram");
        assert_eq!(t.flow_label, 0xf_ffff, "{av:?}");
    }

    // RC: the path's label, as the QP keeps it and its packets carry it.
    let (rc, _) = e.create_qp(init(pd, cq, QpType::Rc)).unwrap();
    connected_init(&mut e, rc);
    let rtr = QpAttr {
        qp_state: QpState::Rtr,
        path_mtu: Mtu::Mtu1024,
        dest_qp_num: Qpn::from_masked(0x42),
        max_dest_rd_atomic: 1,
        ah_attr: AhAttr {
            flow_label: !1,
            ..av()
        },
        ..QpAttr::default()
    };
    let m = AttrMask::STATE
        | AttrMask::AV
        | AttrMask::PATH_MTU
        | AttrMask::DEST_QPN
        | AttrMask::RQ_PSN
        | AttrMask::MAX_DEST_RD_ATOMIC
        | AttrMask::MIN_RNR_TIMER;
    e.modify_qp(rc, &rtr, m).expect("RTR with flow label !1");
    assert_eq!(e.query_qp(rc).unwrap().0.ah_attr.flow_label, 0xf_fffe);
    let rts = QpAttr {
        qp_state: QpState::Rts,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
        ..QpAttr::default()
    };
    let m = AttrMask::STATE
        | AttrMask::TIMEOUT
        | AttrMask::RETRY_CNT
        | AttrMask::RNR_RETRY
        | AttrMask::SQ_PSN
        | AttrMask::MAX_QP_RD_ATOMIC;
    e.modify_qp(rc, &rts, m).unwrap();
    e.post_send(rc, &send(None)).unwrap();
    let t = e.poll_transmit(0, &mem, &mut buf).expect("the SEND");
    assert_eq!(t.flow_label, 0xf_fffe);
}

#[test]
fn cq_arming_resize_and_polling_through_the_engine() {
    let mut e = engine();
    let (cq, granted) = e.create_cq(4, 0).unwrap();
    assert_eq!(granted, 4);
    e.req_notify_cq(cq, false).unwrap();
    assert_eq!(e.resize_cq(cq, 8), Ok(8));
    assert_eq!(e.resize_cq(cq, 0).unwrap_err().errno(), EINVAL);
    let mut out = Vec::new();
    assert_eq!(e.poll_cq(cq, 16, &mut out), Ok(0));
    assert_eq!(
        e.poll_cq(CqHandle(99), 16, &mut out).unwrap_err().errno(),
        EINVAL
    );
    assert_eq!(
        e.req_notify_cq(CqHandle(99), true).unwrap_err().errno(),
        EINVAL
    );
}

/// A guest's page list: `n` 4 KiB pages.
fn pages(n: usize) -> Translation {
    Translation::Pages {
        page_shift: 12,
        offset: 0,
        pages: (0..n as u64).map(|i| 0x10_0000 + i * 4096).collect(),
    }
}

#[test]
fn objects_past_the_memory_limit_are_refused_with_enomem_and_counted() {
    let mut e = engine();
    let pd = e.alloc_pd().unwrap();
    let (cq, _) = e.create_cq(64, 0).unwrap();
    // What one QP, one 1 GiB MR's page list, one SRQ cost, unlimited.
    let held = |e: &Engine| e.memory_use().held;
    let base = held(&e);
    let qp = e.create_qp(init(pd, cq, QpType::Rc)).unwrap().0;
    let qp_cost = held(&e) - base;
    e.destroy_qp(qp).unwrap();
    assert_eq!(held(&e), base, "a destroyed QP gives back what it held");
    let big = |pd| MrRequest {
        pd,
        iova: 0,
        length: 1 << 30,
        access: Access::LOCAL_WRITE,
        translation: pages(262_144),
    };
    let (lkey, _) = e.reg_mr(big(pd)).unwrap();
    let mr_cost = held(&e) - base;
    assert!(
        mr_cost >= 2 << 20,
        "a 262 144-page list is 2 MiB: {mr_cost}"
    );
    e.dereg_mr(lkey).unwrap();
    assert_eq!(held(&e), base);

    // A limit with room for one such MR and one QP.
    e.set_memory_limit(Some(base + mr_cost + qp_cost));
    let (lkey, _) = e.reg_mr(big(pd)).unwrap();
    let err = e.reg_mr(big(pd)).unwrap_err();
    assert_eq!(err.errno(), ENOMEM);
    assert!(
        matches!(err, VerbsError::OverBudget { kind: Kind::Mr, .. }),
        "{err:?}"
    );
    let qp = e.create_qp(init(pd, cq, QpType::Rc)).unwrap().0;
    for err in [
        e.create_qp(init(pd, cq, QpType::Rc))
            .map(|_| ())
            .unwrap_err(),
        e.create_srq(
            pd,
            SrqAttr {
                max_wr: 1024,
                max_sge: 8,
                srq_limit: 0,
            },
        )
        .map(|_| ())
        .unwrap_err(),
        e.create_cq(8192, 0).map(|_| ()).unwrap_err(),
        e.alloc_mr(pd, 512).map(|_| ()).unwrap_err(),
    ] {
        assert_eq!(err.errno(), ENOMEM, "{err:?}");
    }
    assert_eq!(e.memory_use().refused, 5);
    assert_eq!(e.counts().qps, 1);
    // What was made still works; what goes makes room.
    assert!(e.query_qp(qp).is_ok());
    e.dereg_mr(lkey).unwrap();
    let (srq, _) = e
        .create_srq(
            pd,
            SrqAttr {
                max_wr: 64,
                max_sge: 1,
                srq_limit: 0,
            },
        )
        .unwrap();
    // Growing a queue past the limit is refused and leaves it as it was.
    e.set_memory_limit(Some(held(&e) + 1000));
    let deepest = e.query_device().max_srq_wr;
    let err = e
        .modify_srq(
            srq,
            SrqAttr {
                max_wr: deepest,
                max_sge: 1,
                srq_limit: 0,
            },
            vrdma_engine::objects::SrqAttrMask::MAX_WR,
        )
        .unwrap_err();
    assert_eq!(err.errno(), ENOMEM, "{err:?}");
    assert_eq!(e.query_srq(srq).unwrap().max_wr, 64);
    e.destroy_srq(srq).unwrap();
    e.destroy_qp(qp).unwrap();
    assert_eq!(held(&e), base);
}
