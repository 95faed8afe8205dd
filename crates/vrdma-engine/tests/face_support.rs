//! What a device face needs from the engine beyond the verbs a process
//! uses: the GSI QP (QP1), a GID table that changes at run time, DMA MRs,
//! address vectors carried in the work request, the destination MAC on
//! every packet, WQEs it could not decode, QPs it found broken, and how
//! much each queue holds.

use vrdma_engine::{
    attr::{GidEntry, GidType},
    event::AsyncEvent,
    mr::Access,
    qp::{AhAttr, AttrMask, QpAttr, QpState, QpType},
    wc::{NetworkHdr, WcFlags, WcOpcode, WcStatus},
    wr::{Av, Payload, SendFlags, SendOp, SendWr, UdDest},
};
use vrdma_testkit::net::{Net, Quiet};
use vrdma_wire::{QKey, Qpn};

mod common;
use common::*;

/// The GSI QP's well-known Q_Key.
const GSI_QKEY: QKey = QKey(0x8001_0000);

#[test]
fn the_gsi_qp_is_qp1_once_per_device_and_exchanges_datagrams_with_another_qp1() {
    let mut net = Net::default();
    let a = side(&mut net, 1, QpType::Gsi, false);
    let b = side(&mut net, 2, QpType::Gsi, false);
    assert_eq!((a.qpn, b.qpn), (Qpn::GSI, Qpn::GSI));
    // A second GSI QP on the same device is refused.
    let init = e(&mut net, a).query_qp(Qpn::GSI).unwrap().1.to_owned();
    assert!(e(&mut net, a).create_qp(init).is_err());
    // ib_mad's bring-up: INIT with P_Key index and Q_Key (no port), RTR,
    // RTS with the SQ PSN. A port attribute is refused, as Linux does.
    for s in [a, b] {
        let attr = QpAttr {
            qp_state: QpState::Init,
            qkey: GSI_QKEY,
            port_num: 1,
            ..QpAttr::default()
        };
        let eng = e(&mut net, s);
        assert!(
            eng.modify_qp(
                s.qpn,
                &attr,
                AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::QKEY | AttrMask::PORT
            )
            .is_err()
        );
        eng.modify_qp(
            s.qpn,
            &attr,
            AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::QKEY,
        )
        .unwrap();
        let rtr = QpAttr {
            qp_state: QpState::Rtr,
            ..attr
        };
        eng.modify_qp(s.qpn, &rtr, AttrMask::STATE).unwrap();
        let rts = QpAttr {
            qp_state: QpState::Rts,
            ..attr
        };
        eng.modify_qp(s.qpn, &rts, AttrMask::STATE | AttrMask::SQ_PSN)
            .unwrap();
    }
    let rsge = [sge(b, 0x100, 296)];
    recv(&mut net, b, 5, &rsge);
    let mad = pattern(256, 3);
    fill(&mut net, a, 0, &mad);
    let ssge = [sge(a, 0, 256)];
    // The address vector rides in the work request, as a PVRDMA guest's
    // does; the Q_Key with the high bit set means "the QP's own".
    let av = AhAttr {
        dgid: gid(2),
        hop_limit: 64,
        port_num: 1,
        dmac: Some([2, 0, 0, 0, 0, 2]),
        ..AhAttr::default()
    };
    post(
        &mut net,
        a,
        &SendWr {
            wr_id: 1,
            op: SendOp::Send,
            payload: Payload::Sges(&ssge),
            flags: SendFlags::SIGNALED,
            ud: Some(UdDest {
                av: Av::Inline(av),
                remote_qpn: Qpn::GSI,
                remote_qkey: GSI_QKEY,
            }),
        },
    );
    assert_eq!(net.run(100), Quiet::Idle);
    let got = poll(&mut net, b);
    assert_eq!(got.len(), 1, "{got:?}");
    let w = got[0];
    assert_eq!(
        (w.wr_id, w.status, w.opcode),
        (5, WcStatus::Success, WcOpcode::Recv)
    );
    assert_eq!((w.src_qp, w.qp_num, w.byte_len), (1, 1, 296));
    assert_eq!(w.wc_flags, WcFlags::GRH);
    assert_eq!(w.network_hdr, Some(NetworkHdr::Ipv4));
    assert_eq!(read(&net, b, 0x100 + 40, 256), mad);
    let sent = poll(&mut net, a);
    assert_eq!((sent[0].wr_id, sent[0].status), (1, WcStatus::Success));
}

/// The next packet `s` sends, taken off the engine (not delivered).
fn next_transmit(net: &mut Net, s: Ids) -> vrdma_engine::transmit::Transmit {
    let node = &mut net.nodes[s.node];
    let mut buf = vec![0u8; vrdma_engine::transmit::MAX_PACKET];
    node.engine
        .poll_transmit(0, &node.mem, &mut buf)
        .expect("a packet")
}

#[test]
fn every_packet_carries_the_destination_mac_of_its_address_vector() {
    // UD: the vector in the work request.
    let (mut net, a, b) = pair(QpType::Ud, 7);
    let sg = [sge(a, 0, 16)];
    let mac = [2, 0, 0, 0, 0, 0x22];
    post(
        &mut net,
        a,
        &SendWr {
            wr_id: 1,
            op: SendOp::Send,
            payload: Payload::Sges(&sg),
            flags: SendFlags::SIGNALED,
            ud: Some(UdDest {
                av: Av::Inline(AhAttr {
                    dgid: gid(2),
                    hop_limit: 64,
                    port_num: 1,
                    dmac: Some(mac),
                    ..AhAttr::default()
                }),
                remote_qpn: b.qpn,
                remote_qkey: QKey(0x1111_1111),
            }),
        },
    );
    assert_eq!(next_transmit(&mut net, a).dmac, Some(mac));
    // RC: the QP's path.
    let mut net = Net::default();
    let a = side(&mut net, 1, QpType::Rc, false);
    let b = side(&mut net, 2, QpType::Rc, false);
    let mut attr = conn(7, vrdma_engine::attr::Mtu::Mtu1024).attr(b.gid, b.qpn);
    attr.ah_attr.dmac = Some(mac);
    e(&mut net, a).bring_up_qp(a.qpn, &attr).unwrap();
    let rsg = [sge(a, 0, 16)];
    post(
        &mut net,
        a,
        &SendWr {
            wr_id: 2,
            op: SendOp::RdmaWrite {
                remote_addr: BASE,
                rkey: b.rkey,
            },
            payload: Payload::Sges(&rsg),
            flags: SendFlags::SIGNALED,
            ud: None,
        },
    );
    assert_eq!(next_transmit(&mut net, a).dmac, Some(mac));
}

#[test]
fn the_gid_table_changes_at_run_time_and_a_missing_source_gid_fails_the_wqe() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    fill(&mut net, a, 0, &pattern(64, 1));
    let sg = [sge(a, 0, 64)];
    let write = |id| SendWr {
        wr_id: id,
        op: SendOp::RdmaWrite {
            remote_addr: BASE + 0x800,
            rkey: b.rkey,
        },
        payload: Payload::Sges(&sg),
        flags: SendFlags::SIGNALED,
        ud: None,
    };
    // Unbound and bound again before use: the connection carries on.
    let entry = GidEntry {
        gid: gid(1),
        ty: GidType::RoceV2,
    };
    e(&mut net, a).set_gid(0, None).unwrap();
    e(&mut net, a).set_gid(0, Some(entry)).unwrap();
    post(&mut net, a, &write(1));
    assert_eq!(net.run(1000), Quiet::Idle);
    let done = poll(&mut net, a);
    assert_eq!((done[0].wr_id, done[0].status), (1, WcStatus::Success));
    assert_eq!(read(&net, b, 0x800, 64), pattern(64, 1));
    // Unbound: the next WRITE has no source address; it fails as rxe
    // fails it, and the QP enters ERR, instead of waiting forever.
    e(&mut net, a).set_gid(0, None).unwrap();
    post(&mut net, a, &write(2));
    post(&mut net, a, &write(3));
    assert_eq!(net.run(1000), Quiet::Idle);
    let wcs: Vec<_> = poll(&mut net, a)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(wcs, [(2, WcStatus::LocQpOpErr), (3, WcStatus::WrFlushErr)]);
    assert_eq!(qp_state(&mut net, a), QpState::Err);
    assert!(e(&mut net, a).set_gid(200, None).is_err(), "past the table");
}

#[test]
fn a_dma_mr_reaches_every_address_with_local_rights_only() {
    let (mut net, a, _b) = pair(QpType::Rc, 7);
    let (lkey, rkey) = e(&mut net, a)
        .reg_dma_mr(a.pd, Access::LOCAL_WRITE)
        .unwrap();
    let eng = e(&mut net, a);
    assert!(
        eng.check_local(lkey, a.pd, u64::MAX - 4096, 4096, Access::LOCAL_WRITE)
            .is_ok()
    );
    assert!(
        eng.check_remote(rkey, a.pd, 0x1000, 8, Access::REMOTE_WRITE, a.qpn)
            .is_err()
    );
    assert_eq!(eng.current_lkey(lkey.0 >> 8), Some(lkey));
    assert!(eng.reg_dma_mr(a.pd, Access::ZERO_BASED).is_err());
}

#[test]
fn a_malformed_wqe_completes_in_its_turn_and_takes_the_qp_to_err() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    fill(&mut net, a, 0, &pattern(32, 2));
    let sg = [sge(a, 0, 32)];
    let write = SendWr {
        wr_id: 1,
        op: SendOp::RdmaWrite {
            remote_addr: BASE + 0x400,
            rkey: b.rkey,
        },
        payload: Payload::Sges(&sg),
        flags: SendFlags::SIGNALED,
        ud: None,
    };
    post(&mut net, a, &write);
    post(
        &mut net,
        a,
        &SendWr {
            wr_id: 2,
            op: SendOp::Malformed {
                status: WcStatus::LocQpOpErr,
            },
            payload: Payload::Sges(&[]),
            flags: SendFlags::default(),
            ud: None,
        },
    );
    post(&mut net, a, &SendWr { wr_id: 3, ..write });
    assert_eq!(e(&mut net, a).sq_len(a.qpn), Some(3));
    assert_eq!(net.run(1000), Quiet::Idle);
    let wcs: Vec<_> = poll(&mut net, a)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(
        wcs,
        [
            (1, WcStatus::Success),
            (2, WcStatus::LocQpOpErr),
            (3, WcStatus::WrFlushErr)
        ]
    );
    assert_eq!(qp_state(&mut net, a), QpState::Err);
    assert_eq!(e(&mut net, a).sq_len(a.qpn), Some(0));
}

/// Each send completion says how many send WQEs are retired through it
/// since RESET: unsignaled successes retire silently and are counted by
/// the next completion; an unsignaled WQE that fails completes with its
/// own count, and so does each flushed one; RESET starts again from 0.
#[test]
fn a_send_completion_counts_the_wqes_retired_through_it() {
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let sg = [sge(a, 0, 32)];
    let write = |wr_id, flags| SendWr {
        wr_id,
        op: SendOp::RdmaWrite {
            remote_addr: BASE + 0x400,
            rkey: b.rkey,
        },
        payload: Payload::Sges(&sg),
        flags,
        ud: None,
    };
    let unsignaled = SendFlags::default();
    post(&mut net, a, &write(1, unsignaled));
    post(&mut net, a, &write(2, unsignaled));
    post(&mut net, a, &write(3, SendFlags::SIGNALED));
    assert_eq!(net.run(1000), Quiet::Idle);
    post(&mut net, a, &write(4, unsignaled));
    post(
        &mut net,
        a,
        &SendWr {
            wr_id: 5,
            op: SendOp::Malformed {
                status: WcStatus::LocQpOpErr,
            },
            payload: Payload::Sges(&[]),
            flags: unsignaled,
            ud: None,
        },
    );
    post(&mut net, a, &write(6, unsignaled));
    assert_eq!(net.run(1000), Quiet::Idle);
    post(&mut net, a, &write(7, SendFlags::SIGNALED));
    let got: Vec<_> = poll(&mut net, a)
        .iter()
        .map(|w| (w.wr_id, w.status, w.sq_retired))
        .collect();
    assert_eq!(
        got,
        [
            (3, WcStatus::Success, 3),
            // 4 succeeded unsignaled: no completion, but counted.
            (5, WcStatus::LocQpOpErr, 5),
            (6, WcStatus::WrFlushErr, 6),
            (7, WcStatus::WrFlushErr, 7),
        ]
    );
    // A fresh connection: both QPs through RESET.
    for s in [a, b] {
        e(&mut net, s)
            .modify_qp(
                s.qpn,
                &QpAttr {
                    qp_state: QpState::Reset,
                    ..QpAttr::default()
                },
                AttrMask::STATE,
            )
            .unwrap();
    }
    connect(&mut net, a, b, 7);
    connect(&mut net, b, a, 7);
    post(&mut net, a, &write(8, SendFlags::SIGNALED));
    assert_eq!(net.run(1000), Quiet::Idle);
    let got: Vec<_> = poll(&mut net, a)
        .iter()
        .map(|w| (w.wr_id, w.status, w.sq_retired))
        .collect();
    assert_eq!(got, [(8, WcStatus::Success, 1)], "counted again from RESET");
    // A receive completion carries no count.
    let rs = [sge(b, 0x800, 64)];
    recv(&mut net, b, 9, &rs);
    post(
        &mut net,
        a,
        &SendWr {
            op: SendOp::Send,
            ..write(10, SendFlags::SIGNALED)
        },
    );
    assert_eq!(net.run(1000), Quiet::Idle);
    let got: Vec<_> = poll(&mut net, b)
        .iter()
        .map(|w| (w.wr_id, w.status, w.sq_retired))
        .collect();
    assert_eq!(got, [(9, WcStatus::Success, 0)]);
}

#[test]
fn a_qp_found_broken_is_flushed_with_a_fatal_event() {
    let (mut net, a, _b) = pair(QpType::Rc, 7);
    let sg = [sge(a, 0, 64)];
    for id in [7, 8] {
        recv(&mut net, a, id, &sg);
    }
    assert_eq!(e(&mut net, a).rq_len(a.qpn), Some(2));
    while e(&mut net, a).poll_event().is_some() {}
    e(&mut net, a).qp_fatal(a.qpn).unwrap();
    assert_eq!(
        e(&mut net, a).poll_event(),
        Some(AsyncEvent::QpFatal { qp: a.qpn })
    );
    let wcs: Vec<_> = poll(&mut net, a)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(wcs, [(7, WcStatus::WrFlushErr), (8, WcStatus::WrFlushErr)]);
    assert_eq!(e(&mut net, a).rq_len(a.qpn), Some(0));
    assert_eq!(e(&mut net, a).sq_len(Qpn::from_masked(999)), None);
}

/// A REG_MR that carries its page list (PVRDMA's fast-register WQE) maps
/// it when it runs, in its turn: two registrations of one MR queued with
/// an invalidation between them each register their own pages — a WRITE
/// between them gathers from the first's — and a REG_MR on an MR still
/// valid fails without touching the mapping the MR is in use with.
#[test]
fn a_reg_mr_with_its_page_list_maps_it_when_it_runs() {
    use vrdma_engine::mr::Translation;
    let (mut net, a, b) = pair(QpType::Rc, 7);
    let first = pattern(4096, 1);
    let second = pattern(4096, 2);
    fill(&mut net, a, 0x4000, &first);
    fill(&mut net, a, 0x8000, &second);
    let mr = e(&mut net, a).alloc_mr(a.pd, 4).unwrap();
    let pages = |at: u64| Translation::Pages {
        page_shift: 12,
        offset: 0,
        pages: vec![BASE + at],
    };
    let reg = |wr_id, key| SendWr {
        wr_id,
        op: SendOp::RegMr {
            mr,
            key,
            iova: 0x7700_0000,
            length: 4096,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        },
        payload: Payload::Sges(&[]),
        flags: SendFlags::SIGNALED,
        ud: None,
    };
    let key1 = vrdma_wire::Lkey::new(mr.index(), 1);
    let key2 = vrdma_wire::Lkey::new(mr.index(), 2);
    let gather = [vrdma_engine::wr::Sge {
        addr: 0x7700_0000,
        length: 64,
        lkey: key1,
    }];
    let eng = e(&mut net, a);
    // Only REG_MR carries a page list, and only a well-formed one.
    assert!(
        eng.post_reg_mr(
            a.qpn,
            &SendWr {
                op: SendOp::LocalInv {
                    invalidate: vrdma_wire::Rkey(key1.0)
                },
                ..reg(9, 1)
            },
            pages(0x4000)
        )
        .is_err()
    );
    assert!(eng.post_reg_mr(a.qpn, &reg(9, 1), pages(0x4001)).is_err());
    eng.post_reg_mr(a.qpn, &reg(1, 1), pages(0x4000)).unwrap();
    eng.post_send(
        a.qpn,
        &SendWr {
            wr_id: 2,
            op: SendOp::RdmaWrite {
                remote_addr: BASE + 0x400,
                rkey: b.rkey,
            },
            payload: Payload::Sges(&gather),
            flags: SendFlags::SIGNALED | SendFlags::FENCE,
            ud: None,
        },
    )
    .unwrap();
    eng.post_send(
        a.qpn,
        &SendWr {
            wr_id: 3,
            op: SendOp::LocalInv {
                invalidate: vrdma_wire::Rkey(key1.0),
            },
            payload: Payload::Sges(&[]),
            flags: SendFlags::SIGNALED | SendFlags::FENCE,
            ud: None,
        },
    )
    .unwrap();
    eng.post_reg_mr(a.qpn, &reg(4, 2), pages(0x8000)).unwrap();
    // Nothing is mapped before the first REG_MR runs.
    assert!(eng.mr(key1).is_none() && eng.mr(key2).is_none());
    assert_eq!(net.run(1000), Quiet::Idle);
    let wcs: Vec<_> = poll(&mut net, a)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(
        wcs,
        [1, 2, 3, 4].map(|i| (i, WcStatus::Success)),
        "in order, each with its own pages"
    );
    assert_eq!(
        read(&net, b, 0x400, 64),
        first[..64],
        "the WRITE gathered from the first REG_MR's page"
    );
    let eng = e(&mut net, a);
    assert!(eng.mr(key1).is_none());
    assert!(
        eng.check_local(key2, a.pd, 0x7700_0000, 4096, Access::LOCAL_WRITE)
            .is_ok()
    );
    // key2 maps the second page: a WRITE from it carries `second`.
    let gather2 = [vrdma_engine::wr::Sge {
        lkey: key2,
        ..gather[0]
    }];
    let write2 = SendWr {
        wr_id: 5,
        op: SendOp::RdmaWrite {
            remote_addr: BASE + 0x800,
            rkey: b.rkey,
        },
        payload: Payload::Sges(&gather2),
        flags: SendFlags::SIGNALED,
        ud: None,
    };
    // A REG_MR on the MR while it is valid fails (the QP goes to ERR),
    // and the pages it carried are not mapped: the MR in use keeps its
    // own.
    e(&mut net, a).post_send(a.qpn, &write2).unwrap();
    e(&mut net, a)
        .post_reg_mr(a.qpn, &reg(6, 3), pages(0x4000))
        .unwrap();
    assert_eq!(net.run(1000), Quiet::Idle);
    let wcs: Vec<_> = poll(&mut net, a)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(wcs, [(5, WcStatus::Success), (6, WcStatus::LocQpOpErr)]);
    assert_eq!(read(&net, b, 0x800, 64), second[..64]);
    let m = e(&mut net, a).mr(key2).expect("still valid under key2");
    assert_eq!(m.translation, pages(0x8000));
}
