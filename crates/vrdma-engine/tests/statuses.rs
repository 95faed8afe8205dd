//! Work-completion error statuses, one scripted test per status and QP
//! type where the engine can produce it, each CQE compared whole (every
//! `ibv_wc` field), with the QP state of both sides and the asynchronous
//! events.
//!
//! Where every status comes from (the engine's data path and control path),
//! and which test covers each cell ("dp::" is tests/datapath.rs, "wr::"
//! tests/work_requests.rs, the rest are here):
//!
//! | status         | RC | UC | UD |
//! |----------------|----|----|----|
//! | LocLenErr      | rc_send_longer_than_the_receive_is_a_local_length_error_and_a_remote_invalid_request | not produced: the message is dropped, the receive kept (uc_message_longer_than_the_receive_is_dropped_and_the_receive_kept) | not produced: likewise (ud_datagram_longer_than_the_receive_is_dropped_and_the_receive_kept) |
//! | LocQpOpErr     | dp::type_1_windows_rebind_with_a_new_key_and_cannot_be_invalidated; local_inv_of_a_key_that_names_nothing_is_a_local_qp_operation_error; reg_mr_of_an_mr_not_allocated_for_it_is_a_local_qp_operation_error | the same two | the same two |
//! | LocProtErr     | dp::a_bad_local_sge_is_a_local_protection_error (send); rc_read_or_atomic_into_a_bad_local_sge_is_a_local_protection_error; rc_receive_into_a_bad_sge_is_a_local_protection_error_and_a_remote_operational_error (receive) | uc_send_from_a_bad_local_sge_is_a_local_protection_error; uc_receive_into_a_bad_sge_is_a_local_protection_error | ud_send_from_a_bad_local_sge_is_a_local_protection_error; ud_receive_into_a_bad_sge_is_a_local_protection_error |
//! | WrFlushErr     | wr::entering_err_flushes_every_wr_in_order_signaled_or_not; dp::a_receive_half_filled_when_the_qp_fails_is_flushed_not_lost; entering_err_flushes_every_work_request_of_every_qp_type; and every error test here | entering_err_flushes_every_work_request_of_every_qp_type; the UC error tests here | entering_err_flushes_every_work_request_of_every_qp_type; the UD error tests here |
//! | MwBindErr      | dp::binding_needs_mw_bind_rights_on_the_mr | uc_bind_without_mw_bind_rights_is_a_memory_window_bind_error | not applicable: BIND_MW is refused at post on UD (EINVAL) |
//! | BadRespErr     | rc_read_response_of_the_wrong_length_is_a_bad_response_error | not applicable (no responses) | not applicable |
//! | RemInvReqErr   | dp::send_with_invalidate_of_a_regular_mr_is_an_invalid_request; rc_send_longer_than_the_receive_is_a_local_length_error_and_a_remote_invalid_request | not applicable: UC sends no NAKs | not applicable |
//! | RemAccessErr   | dp::rc_write_outside_the_remote_mr_is_a_remote_access_error_on_both_sides, dp::rc_read_needs_remote_read_rights, dp::an_atomic_without_remote_atomic_rights_changes_nothing and others | not applicable: a bad UC WRITE is dropped by the responder | not applicable |
//! | RemOpErr       | rc_receive_into_a_bad_sge_is_a_local_protection_error_and_a_remote_operational_error | not applicable | not applicable |
//! | RetryExcErr    | dp::an_unanswered_request_times_out_after_retry_cnt_resends | not applicable | not applicable |
//! | RnrRetryExcErr | dp::rnr_retries_run_out | not applicable | not applicable |
//! | RemInvRdReqErr | rc_nak_with_the_invalid_rd_request_code_is_a_remote_invalid_rd_request_error (a forged NAK: the engine's responder never sends that code) | not applicable | not applicable |
//! | GeneralErr     | not produced | not produced | ud_receive_whose_grh_cannot_be_rebuilt_is_a_general_error (only from an IP header no parser yields) |
//!
//! Never produced, for any type:
//! * LocEecOpErr, LocRddViolErr, InvEecnErr, InvEecStateErr: EE contexts
//!   and RDDs belong to the RD service, which the engine does not have.
//! * RespTimeoutErr: an RD (and iWARP) status; RC's local ACK timeout is
//!   RetryExcErr.
//! * LocAccessErr, RemAbortErr, FatalErr: no path of the engine reports
//!   them (a response whose opcode does not match the outstanding request,
//!   for which rxe reports FatalErr, is ignored as a stray packet here).
//!
//! On UC and UD a send-queue error takes the QP to ERR, as rxe does (its
//! requester calls rxe_qp_error() for every QP type); IBTA Vol1 §10.3.1
//! would have UC and UD enter SQE instead, which the engine never does.

use std::net::{Ipv4Addr, Ipv6Addr};

use vrdma_engine::{
    AhHandle, CqHandle, Engine, PdHandle,
    attr::{DeviceAttr, PortAttr},
    event::AsyncEvent,
    memory::{Memory, VecMemory},
    mr::{Access, MrRequest, MwType, Translation},
    qp::{AhAttr, AttrMask, QpAttr, QpCap, QpInitAttr, QpState, QpType},
    wc::{Wc, WcFlags, WcOpcode, WcStatus},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_testkit::{
    net::{Net, Quiet},
    setup::Connection,
};
use vrdma_wire::{
    Gid, Lkey, Opcode, PKey, Psn, QKey, Qpn, Rkey,
    aeth::{self, NakCode, Syndrome},
    bth, deth,
    frame::IpRepr,
    ipv4, ipv6, packet,
};

const BASE: u64 = 0x10_0000;
const MEM: usize = 64 * 1024;
const QKEY: QKey = QKey(0x1111_1111);
/// The GRH a UD receive gets in front of the payload.
const GRH: u32 = 40;

fn gid(n: u8) -> Gid {
    Gid::from(Ipv4Addr::new(127, 0, 0, n))
}

/// One side: its node, PD, CQs (send and receive apart, to see where each
/// completion goes), QP, the MR over all its memory (no MW_BIND), and an
/// AH towards the other node.
#[derive(Clone, Copy, Debug)]
struct Endpoint {
    node: usize,
    n: u8,
    pd: PdHandle,
    scq: CqHandle,
    rcq: CqHandle,
    qpn: Qpn,
    lkey: Lkey,
    rkey: Rkey,
    ah: AhHandle,
    ty: QpType,
}

fn side(net: &mut Net, n: u8, peer: u8, ty: QpType) -> Endpoint {
    let mut e = Engine::new(DeviceAttr::default(), PortAttr::with_gids(&[gid(n)]));
    let pd = e.alloc_pd().unwrap();
    let (scq, _) = e.create_cq(64, 0).unwrap();
    let (rcq, _) = e.create_cq(64, 0).unwrap();
    let (lkey, rkey) = e
        .reg_mr(MrRequest {
            pd,
            iova: BASE,
            length: MEM as u64,
            access: Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC,
            translation: Translation::Identity,
        })
        .unwrap();
    let (qpn, _) = e
        .create_qp(QpInitAttr {
            pd,
            send_cq: scq,
            recv_cq: rcq,
            srq: None,
            cap: QpCap {
                max_send_wr: 8,
                max_recv_wr: 8,
                max_send_sge: 2,
                max_recv_sge: 2,
                max_inline_data: 64,
            },
            qp_type: ty,
            sq_sig_all: false,
        })
        .unwrap();
    let ah = e
        .create_ah(
            pd,
            AhAttr {
                dgid: gid(peer),
                port_num: 1,
                hop_limit: 64,
                ..AhAttr::default()
            },
        )
        .unwrap();
    assert_eq!(e.poll_event(), Some(AsyncEvent::PortActive { port: 1 }));
    let node = net.add(e, VecMemory::new(BASE, MEM), gid(n));
    Endpoint {
        node,
        n,
        pd,
        scq,
        rcq,
        qpn,
        lkey,
        rkey,
        ah,
        ty,
    }
}

fn e(net: &mut Net, s: Endpoint) -> &mut Engine {
    &mut net.nodes[s.node].engine
}

/// Brings `s` to RTS aimed at `dgid` / `dest`: MTU 1024, retry_cnt 2,
/// rnr_retry 7, every remote right.
fn connect(net: &mut Net, s: Endpoint, dgid: Gid, dest: Qpn) {
    Connection {
        psn: Psn::from_masked(0x0000_0100),
        timeout: 10,
        retry_cnt: 2,
        min_rnr_timer: 1,
        qkey: QKEY,
        ..Connection::default()
    }
    .join(e(net, s), s.qpn, dgid, dest);
}

/// Two connected sides, `a` (node 1) and `b` (node 2).
fn pair(ty: QpType) -> (Net, Endpoint, Endpoint) {
    let mut net = Net::default();
    let a = side(&mut net, 1, 2, ty);
    let b = side(&mut net, 2, 1, ty);
    connect(&mut net, a, gid(2), b.qpn);
    connect(&mut net, b, gid(1), a.qpn);
    (net, a, b)
}

/// One side whose peer does not exist (its GID belongs to nobody): what
/// it sends is lost, and the test plays the peer with forged packets.
fn alone(ty: QpType) -> (Net, Endpoint) {
    let mut net = Net::default();
    let a = side(&mut net, 1, 9, ty);
    connect(&mut net, a, gid(9), Qpn::from_masked(99));
    (net, a)
}

fn sge(s: Endpoint, at: u64, len: u32) -> Sge {
    Sge {
        addr: BASE + at,
        length: len,
        lkey: s.lkey,
    }
}

/// An SGE whose lkey has the wrong key byte: it names no MR.
fn bad_sge(s: Endpoint, at: u64, len: u32) -> Sge {
    Sge {
        lkey: Lkey(s.lkey.0 ^ 0x10),
        ..sge(s, at, len)
    }
}

fn recv(net: &mut Net, s: Endpoint, wr_id: u64, sg_list: &[Sge]) {
    e(net, s)
        .post_recv(s.qpn, &RecvWr { wr_id, sg_list })
        .unwrap();
}

/// Posts a send WR on `s` (a UD one goes to `dest`).
fn send(
    net: &mut Net,
    s: Endpoint,
    dest: Qpn,
    wr_id: u64,
    op: SendOp,
    payload: Payload<'_>,
    flags: SendFlags,
) {
    let ud = (s.ty == QpType::Ud).then_some(UdDest {
        av: vrdma_engine::wr::Av::Handle(s.ah),
        remote_qpn: dest,
        remote_qkey: QKEY,
    });
    e(net, s)
        .post_send(
            s.qpn,
            &SendWr {
                wr_id,
                op,
                payload,
                flags,
                ud,
            },
        )
        .unwrap();
}

/// A SEND of `data`, inline.
fn send_inline(net: &mut Net, s: Endpoint, dest: Qpn, wr_id: u64, data: &[u8], signaled: bool) {
    let flags = if signaled {
        SendFlags::INLINE | SendFlags::SIGNALED
    } else {
        SendFlags::INLINE
    };
    send(
        net,
        s,
        dest,
        wr_id,
        SendOp::Send,
        Payload::Inline(data),
        flags,
    );
}

/// The completions on `cq`, each send's count of retired WQEs zeroed
/// (these tests are about statuses; `work_requests.rs` checks the count).
fn cqes(net: &mut Net, s: Endpoint, cq: CqHandle) -> Vec<Wc> {
    let mut v = Vec::new();
    e(net, s).poll_cq(cq, 64, &mut v).unwrap();
    for w in &mut v {
        w.sq_retired = 0;
    }
    v
}

fn send_cqes(net: &mut Net, s: Endpoint) -> Vec<Wc> {
    cqes(net, s, s.scq)
}

fn recv_cqes(net: &mut Net, s: Endpoint) -> Vec<Wc> {
    cqes(net, s, s.rcq)
}

fn events(net: &mut Net, s: Endpoint) -> Vec<AsyncEvent> {
    let en = e(net, s);
    std::iter::from_fn(|| en.poll_event()).collect()
}

fn state(net: &mut Net, s: Endpoint) -> QpState {
    e(net, s).query_qp(s.qpn).unwrap().0.qp_state
}

fn read(net: &Net, s: Endpoint, at: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    net.nodes[s.node].mem.read(BASE + at, &mut v).unwrap();
    v
}

fn fill(net: &mut Net, s: Endpoint, at: u64, data: &[u8]) {
    net.nodes[s.node].mem.write(BASE + at, data).unwrap();
}

/// A completion with only the fields every completion has: what an error
/// completion carries (IBTA: wr_id, status and qp_num are its only valid
/// fields; the engine zeroes the rest and keeps the WR's opcode).
fn wc(wr_id: u64, status: WcStatus, opcode: WcOpcode, s: Endpoint) -> Wc {
    Wc {
        wr_id,
        status,
        opcode,
        vendor_err: 0,
        byte_len: 0,
        imm_data: 0,
        qp_num: s.qpn.value(),
        src_qp: 0,
        wc_flags: WcFlags::default(),
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
        network_hdr: None,
        sq_retired: 0,
    }
}

/// A successful send-side completion of `len` bytes.
fn sent(wr_id: u64, opcode: WcOpcode, len: u32, s: Endpoint) -> Wc {
    Wc {
        byte_len: len,
        ..wc(wr_id, WcStatus::Success, opcode, s)
    }
}

fn flushed(wr_id: u64, opcode: WcOpcode, s: Endpoint) -> Wc {
    wc(wr_id, WcStatus::WrFlushErr, opcode, s)
}

/// Delivers a forged RC packet to `to` as if from node 9.
fn inject(
    net: &mut Net,
    to: Endpoint,
    opcode: Opcode,
    psn: Psn,
    ext: packet::ExtHeaders,
    data: &[u8],
) {
    let r = packet::Repr::new(
        bth::Repr {
            opcode,
            solicited: false,
            mig_req: false,
            pad_cnt: 0,
            pkey: PKey::DEFAULT,
            fecn: false,
            becn: false,
            dest_qp: to.qpn,
            ack_req: false,
            psn,
        },
        ext,
        data,
    );
    let mut bytes = vec![0; r.buffer_len()];
    r.emit(&mut packet::Packet::new_unchecked(&mut bytes[..]))
        .unwrap();
    let ip = IpRepr::V4(ipv4::Repr {
        src: Ipv4Addr::new(127, 0, 0, 9),
        dst: Ipv4Addr::new(127, 0, 0, to.n),
        tos: 0,
        ident: 0,
        dont_frag: true,
        ttl: 64,
        payload_len: 0,
    });
    let now = net.now;
    let node = &mut net.nodes[to.node];
    node.engine.handle_packet(now, &ip, &bytes, &mut node.mem);
}

fn aeth(syndrome: Syndrome) -> packet::ExtHeaders {
    packet::ExtHeaders {
        aeth: Some(aeth::Repr {
            syndrome,
            msn: vrdma_wire::Msn::from_masked(0),
        }),
        ..Default::default()
    }
}

// ---- requester: a bad local SGE (UC, UD; RC's SEND is in datapath.rs) ----

/// A SEND from a bad SGE completes with LocProtErr before anything is
/// sent, the WR behind it is flushed and the QP enters ERR; the peer sees
/// nothing.
fn send_from_a_bad_local_sge(ty: QpType) {
    let (mut net, a, b) = pair(ty);
    let rsg = [sge(b, 0, 256)];
    recv(&mut net, b, 50, &rsg);
    let bad = [bad_sge(a, 0, 8)];
    send(
        &mut net,
        a,
        b.qpn,
        1,
        SendOp::Send,
        Payload::Sges(&bad),
        SendFlags::default(),
    );
    send_inline(&mut net, a, b.qpn, 2, b"next", true);
    assert_eq!(net.run(100), Quiet::Idle);
    assert_eq!(
        send_cqes(&mut net, a),
        [
            wc(1, WcStatus::LocProtErr, WcOpcode::Send, a),
            flushed(2, WcOpcode::Send, a),
        ],
        "errors complete even unsignaled, in order"
    );
    assert!(recv_cqes(&mut net, a).is_empty());
    assert_eq!(state(&mut net, a), QpState::Err);
    assert_eq!(net.sent, 0, "nothing left the QP");
    assert_eq!(state(&mut net, b), QpState::Rts);
    assert!(recv_cqes(&mut net, b).is_empty());
    assert_eq!(events(&mut net, a), [], "reported by the completion");
    assert_eq!(events(&mut net, b), []);
}

#[test]
fn uc_send_from_a_bad_local_sge_is_a_local_protection_error() {
    send_from_a_bad_local_sge(QpType::Uc);
}

#[test]
fn ud_send_from_a_bad_local_sge_is_a_local_protection_error() {
    send_from_a_bad_local_sge(QpType::Ud);
}

#[test]
fn rc_read_or_atomic_into_a_bad_local_sge_is_a_local_protection_error() {
    // The request goes out and is answered; the response cannot be
    // written: LocProtErr at the requester (IBTA Vol1 §10.7.2.3), the
    // responder untouched (for the atomic, the remote word did change).
    let ops = [
        (
            SendOp::RdmaRead {
                remote_addr: BASE + 0x800,
                rkey: Rkey(0),
            },
            WcOpcode::RdmaRead,
            16,
        ),
        (
            SendOp::FetchAdd {
                remote_addr: BASE + 0x800,
                rkey: Rkey(0),
                add: 5,
            },
            WcOpcode::FetchAdd,
            8,
        ),
    ];
    for (op, opcode, len) in ops {
        let (mut net, a, b) = pair(QpType::Rc);
        fill(&mut net, b, 0x800, &40u64.to_le_bytes());
        let op = match op {
            SendOp::RdmaRead { remote_addr, .. } => SendOp::RdmaRead {
                remote_addr,
                rkey: b.rkey,
            },
            SendOp::FetchAdd {
                remote_addr, add, ..
            } => SendOp::FetchAdd {
                remote_addr,
                rkey: b.rkey,
                add,
            },
            other => other,
        };
        let bad = [bad_sge(a, 0x100, len)];
        send(
            &mut net,
            a,
            b.qpn,
            1,
            op,
            Payload::Sges(&bad),
            SendFlags::default(),
        );
        send_inline(&mut net, a, b.qpn, 2, b"next", true);
        assert_eq!(net.run(100), Quiet::Idle, "{opcode:?}");
        assert_eq!(
            send_cqes(&mut net, a),
            [
                wc(1, WcStatus::LocProtErr, opcode, a),
                flushed(2, WcOpcode::Send, a)
            ],
            "{opcode:?}"
        );
        assert_eq!(state(&mut net, a), QpState::Err);
        assert_eq!(net.next_timer(), None, "nothing left to retry");
        assert_eq!(state(&mut net, b), QpState::Rts, "{opcode:?}");
        assert!(recv_cqes(&mut net, b).is_empty());
        let word = if opcode == WcOpcode::FetchAdd {
            45u64
        } else {
            40
        };
        assert_eq!(read(&net, b, 0x800, 8), word.to_le_bytes(), "{opcode:?}");
        assert_eq!(read(&net, a, 0x100, 16), [0; 16]);
        assert_eq!(events(&mut net, a), []);
        assert_eq!(events(&mut net, b), []);
    }
}

// ---- responder: a bad receive SGE ----------------------------------------

#[test]
fn rc_receive_into_a_bad_sge_is_a_local_protection_error_and_a_remote_operational_error() {
    // IBTA Vol1 §9.9.3 class A: the responder completes its receive WQE in
    // error, NAKs with a remote operational error and enters ERR; the
    // requester completes with RemOpErr and enters ERR.
    let (mut net, a, b) = pair(QpType::Rc);
    let bad = [bad_sge(b, 0, 64)];
    let good = [sge(b, 0x100, 64)];
    recv(&mut net, b, 50, &bad);
    recv(&mut net, b, 51, &good);
    send_inline(&mut net, a, b.qpn, 1, b"hello", false);
    send_inline(&mut net, a, b.qpn, 2, b"again", true);
    assert_eq!(net.run(100), Quiet::Idle);
    assert_eq!(
        recv_cqes(&mut net, b),
        [
            wc(50, WcStatus::LocProtErr, WcOpcode::Recv, b),
            flushed(51, WcOpcode::Recv, b),
        ]
    );
    assert_eq!(state(&mut net, b), QpState::Err);
    assert_eq!(
        send_cqes(&mut net, a),
        [
            wc(1, WcStatus::RemOpErr, WcOpcode::Send, a),
            flushed(2, WcOpcode::Send, a),
        ]
    );
    assert_eq!(state(&mut net, a), QpState::Err);
    assert_eq!(read(&net, b, 0x100, 5), [0; 5], "nothing delivered");
    assert_eq!(events(&mut net, a), []);
    // No affiliated event at the responder: its receive completion in
    // error reported the failure (IBTA Vol1 §11.6.3.2 keeps those events
    // for what no completion reports; rxe raises none either).
    assert_eq!(events(&mut net, b), [], "reported by the completion");
}

/// UC / UD: the receive WQE completes with LocProtErr, the QP enters ERR
/// (flushing the next receive); the sender, which hears nothing, completes
/// successfully and stays in RTS.
fn receive_into_a_bad_sge(ty: QpType) {
    let (mut net, a, b) = pair(ty);
    let bad = [bad_sge(b, 0, 256)];
    let good = [sge(b, 0x200, 256)];
    recv(&mut net, b, 50, &bad);
    recv(&mut net, b, 51, &good);
    send_inline(&mut net, a, b.qpn, 1, b"hello", true);
    assert_eq!(net.run(100), Quiet::Idle);
    assert_eq!(send_cqes(&mut net, a), [sent(1, WcOpcode::Send, 5, a)]);
    assert_eq!(state(&mut net, a), QpState::Rts);
    assert_eq!(
        recv_cqes(&mut net, b),
        [
            wc(50, WcStatus::LocProtErr, WcOpcode::Recv, b),
            flushed(51, WcOpcode::Recv, b),
        ]
    );
    assert_eq!(state(&mut net, b), QpState::Err);
    assert_eq!(read(&net, b, 0x200, 5), [0; 5]);
    assert_eq!(events(&mut net, a), []);
    assert_eq!(events(&mut net, b), [], "reported by the completion");
}

#[test]
fn uc_receive_into_a_bad_sge_is_a_local_protection_error() {
    receive_into_a_bad_sge(QpType::Uc);
}

#[test]
fn ud_receive_into_a_bad_sge_is_a_local_protection_error() {
    receive_into_a_bad_sge(QpType::Ud);
}

// ---- messages longer than the receive -----------------------------------

#[test]
fn rc_send_longer_than_the_receive_is_a_local_length_error_and_a_remote_invalid_request() {
    // IBTA Vol1 §9.9.3 class C: the receive WQE completes with LocLenErr,
    // the requester gets an invalid request NAK (RemInvReqErr); both
    // enter ERR.
    let (mut net, a, b) = pair(QpType::Rc);
    let small = [sge(b, 0, 8)];
    let big = [sge(b, 0x100, 64)];
    recv(&mut net, b, 50, &small);
    recv(&mut net, b, 51, &big);
    send_inline(&mut net, a, b.qpn, 1, b"sixteen bytes!!!", false);
    send_inline(&mut net, a, b.qpn, 2, b"next", true);
    assert_eq!(net.run(100), Quiet::Idle);
    assert_eq!(
        recv_cqes(&mut net, b),
        [
            wc(50, WcStatus::LocLenErr, WcOpcode::Recv, b),
            flushed(51, WcOpcode::Recv, b),
        ]
    );
    assert_eq!(state(&mut net, b), QpState::Err);
    assert_eq!(
        send_cqes(&mut net, a),
        [
            wc(1, WcStatus::RemInvReqErr, WcOpcode::Send, a),
            flushed(2, WcOpcode::Send, a),
        ]
    );
    assert_eq!(state(&mut net, a), QpState::Err);
    assert_eq!(events(&mut net, a), []);
    // As for the remote operational error: the receive completion in
    // error is the report; no event.
    assert_eq!(events(&mut net, b), [], "reported by the completion");
}

/// UC / UD: a message longer than the receive buffer is dropped (rxe's
/// class D for a QP without an SRQ); the receive WQE stays posted and takes
/// the next message that fits. No LocLenErr, no state change.
fn message_longer_than_the_receive(ty: QpType) {
    let (mut net, a, b) = pair(ty);
    let room = if ty == QpType::Ud { GRH + 8 } else { 8 };
    let rsg = [sge(b, 0, room)];
    recv(&mut net, b, 50, &rsg);
    send_inline(&mut net, a, b.qpn, 1, b"sixteen bytes!!!", true);
    send_inline(&mut net, a, b.qpn, 2, b"fits", true);
    assert_eq!(net.run(100), Quiet::Idle);
    assert_eq!(
        send_cqes(&mut net, a),
        [
            sent(1, WcOpcode::Send, 16, a),
            sent(2, WcOpcode::Send, 4, a)
        ]
    );
    let want = if ty == QpType::Ud {
        Wc {
            byte_len: GRH + 4,
            src_qp: a.qpn.value(),
            wc_flags: WcFlags::GRH,
            network_hdr: Some(vrdma_engine::wc::NetworkHdr::Ipv4),
            ..wc(50, WcStatus::Success, WcOpcode::Recv, b)
        }
    } else {
        Wc {
            byte_len: 4,
            ..wc(50, WcStatus::Success, WcOpcode::Recv, b)
        }
    };
    assert_eq!(recv_cqes(&mut net, b), [want]);
    let at = if ty == QpType::Ud { u64::from(GRH) } else { 0 };
    assert_eq!(read(&net, b, at, 4), b"fits");
    assert_eq!(e(&mut net, b).stats().rx_too_long, 1);
    assert_eq!(state(&mut net, a), QpState::Rts);
    assert_eq!(state(&mut net, b), QpState::Rts);
    assert_eq!(events(&mut net, a), []);
    assert_eq!(events(&mut net, b), []);
}

#[test]
fn uc_message_longer_than_the_receive_is_dropped_and_the_receive_kept() {
    message_longer_than_the_receive(QpType::Uc);
}

#[test]
fn ud_datagram_longer_than_the_receive_is_dropped_and_the_receive_kept() {
    message_longer_than_the_receive(QpType::Ud);
}

// ---- local operations ----------------------------------------------------

#[test]
fn local_inv_of_a_key_that_names_nothing_is_a_local_qp_operation_error() {
    for ty in [QpType::Rc, QpType::Uc, QpType::Ud] {
        let (mut net, a, b) = pair(ty);
        send(
            &mut net,
            a,
            b.qpn,
            1,
            SendOp::LocalInv {
                invalidate: Rkey(0x00ab_cd01),
            },
            Payload::Sges(&[]),
            SendFlags::default(),
        );
        send_inline(&mut net, a, b.qpn, 2, b"next", true);
        assert_eq!(net.run(100), Quiet::Idle, "{ty:?}");
        assert_eq!(
            send_cqes(&mut net, a),
            [
                wc(1, WcStatus::LocQpOpErr, WcOpcode::LocalInv, a),
                flushed(2, WcOpcode::Send, a),
            ],
            "{ty:?}"
        );
        assert_eq!(state(&mut net, a), QpState::Err, "{ty:?}");
        assert_eq!(net.sent, 0, "{ty:?}");
        assert_eq!(state(&mut net, b), QpState::Rts, "{ty:?}");
        assert_eq!(events(&mut net, a), [], "{ty:?}");
    }
}

#[test]
fn reg_mr_of_an_mr_not_allocated_for_it_is_a_local_qp_operation_error() {
    // REG_MR needs an MR from ib_alloc_mr; rxe completes a failed fast
    // registration with IB_WC_LOC_QP_OP_ERR too.
    for ty in [QpType::Rc, QpType::Uc, QpType::Ud] {
        let (mut net, a, b) = pair(ty);
        send(
            &mut net,
            a,
            b.qpn,
            1,
            SendOp::RegMr {
                mr: a.lkey,
                key: 0x77,
                iova: BASE,
                length: 4096,
                access: Access::LOCAL_WRITE,
            },
            Payload::Sges(&[]),
            SendFlags::SIGNALED,
        );
        assert_eq!(net.run(100), Quiet::Idle, "{ty:?}");
        assert_eq!(
            send_cqes(&mut net, a),
            [wc(1, WcStatus::LocQpOpErr, WcOpcode::RegMr, a)],
            "{ty:?}"
        );
        assert_eq!(state(&mut net, a), QpState::Err, "{ty:?}");
        let mr = e(&mut net, a).mr(a.lkey).expect("the MR is untouched");
        assert_eq!((mr.iova, mr.length), (BASE, MEM as u64), "{ty:?}");
        assert_eq!(state(&mut net, b), QpState::Rts, "{ty:?}");
        assert_eq!(events(&mut net, a), [], "{ty:?}");
    }
}

#[test]
fn uc_bind_without_mw_bind_rights_is_a_memory_window_bind_error() {
    let (mut net, a, b) = pair(QpType::Uc);
    let mw = e(&mut net, a).alloc_mw(a.pd, MwType::Two).unwrap();
    // a.lkey's MR has no MW_BIND right.
    send(
        &mut net,
        a,
        b.qpn,
        1,
        SendOp::BindMw {
            mw,
            key: 3,
            mr: a.lkey,
            addr: BASE,
            length: 64,
            access: Access::REMOTE_WRITE,
        },
        Payload::Sges(&[]),
        SendFlags::default(),
    );
    send_inline(&mut net, a, b.qpn, 2, b"next", true);
    assert_eq!(net.run(100), Quiet::Idle);
    assert_eq!(
        send_cqes(&mut net, a),
        [
            wc(1, WcStatus::MwBindErr, WcOpcode::BindMw, a),
            flushed(2, WcOpcode::Send, a),
        ]
    );
    assert_eq!(state(&mut net, a), QpState::Err);
    assert!(e(&mut net, a).mw(mw).unwrap().binding.is_none());
    assert_eq!(state(&mut net, b), QpState::Rts);
    assert_eq!(events(&mut net, a), []);
}

// ---- flush ---------------------------------------------------------------

#[test]
fn entering_err_flushes_every_work_request_of_every_qp_type() {
    for ty in [QpType::Rc, QpType::Uc, QpType::Ud] {
        let (mut net, a, b) = pair(ty);
        let (op2, opcode2) = if ty == QpType::Ud {
            (SendOp::SendWithImm { imm: 9 }, WcOpcode::Send)
        } else {
            (
                SendOp::RdmaWrite {
                    remote_addr: BASE,
                    rkey: b.rkey,
                },
                WcOpcode::RdmaWrite,
            )
        };
        let sg = [sge(a, 0, 8)];
        // Posted in RTS, never sent (the network is not run).
        send(
            &mut net,
            a,
            b.qpn,
            10,
            SendOp::Send,
            Payload::Sges(&sg),
            SendFlags::default(),
        );
        send(
            &mut net,
            a,
            b.qpn,
            11,
            op2,
            Payload::Sges(&sg),
            SendFlags::SIGNALED,
        );
        recv(&mut net, a, 20, &sg);
        recv(&mut net, a, 21, &sg);
        e(&mut net, a)
            .modify_qp(
                a.qpn,
                &QpAttr {
                    qp_state: QpState::Err,
                    ..QpAttr::default()
                },
                AttrMask::STATE,
            )
            .unwrap();
        assert_eq!(
            send_cqes(&mut net, a),
            [flushed(10, WcOpcode::Send, a), flushed(11, opcode2, a)],
            "{ty:?}: unsignaled too, on the send CQ"
        );
        assert_eq!(
            recv_cqes(&mut net, a),
            [
                flushed(20, WcOpcode::Recv, a),
                flushed(21, WcOpcode::Recv, a)
            ],
            "{ty:?}: on the receive CQ"
        );
        // In ERR a WR completes as soon as it is posted.
        send(
            &mut net,
            a,
            b.qpn,
            12,
            op2,
            Payload::Sges(&sg),
            SendFlags::default(),
        );
        recv(&mut net, a, 22, &sg);
        assert_eq!(send_cqes(&mut net, a), [flushed(12, opcode2, a)], "{ty:?}");
        assert_eq!(recv_cqes(&mut net, a), [flushed(22, WcOpcode::Recv, a)]);
        assert_eq!(net.run(100), Quiet::Idle);
        assert_eq!(net.sent, 0, "{ty:?}: nothing was sent");
        assert_eq!(state(&mut net, a), QpState::Err);
        assert_eq!(state(&mut net, b), QpState::Rts);
        assert_eq!(events(&mut net, a), [], "{ty:?}: no SRQ, no event");
    }
}

// ---- forged responses ----------------------------------------------------

#[test]
fn rc_nak_with_the_invalid_rd_request_code_is_a_remote_invalid_rd_request_error() {
    // NAK code 4 (invalid RD request) names an RD error; the engine's
    // responder never sends it, a foreign one could. The engine maps it to
    // the matching status (rxe maps every unknown NAK to RemOpErr).
    let (mut net, a) = alone(QpType::Rc);
    let (psn, _) = e(&mut net, a).qp_psns(a.qpn).unwrap();
    send_inline(&mut net, a, Qpn::default(), 1, b"lost", false);
    send_inline(&mut net, a, Qpn::default(), 2, b"next", true);
    assert!(matches!(net.run(100), Quiet::Timer(_)));
    inject(
        &mut net,
        a,
        Opcode::RcAcknowledge,
        psn,
        aeth(Syndrome::Nak(NakCode::InvalidRdRequest)),
        &[],
    );
    assert_eq!(
        send_cqes(&mut net, a),
        [
            wc(1, WcStatus::RemInvRdReqErr, WcOpcode::Send, a),
            flushed(2, WcOpcode::Send, a),
        ]
    );
    assert_eq!(state(&mut net, a), QpState::Err);
    assert_eq!(net.next_timer(), None, "nothing left to retry");
    assert_eq!(events(&mut net, a), []);
}

#[test]
fn rc_read_response_of_the_wrong_length_is_a_bad_response_error() {
    // A READ of 16 bytes answered by a single response of 8: the engine
    // completes the READ with BadRespErr and takes the QP to ERR.
    let (mut net, a) = alone(QpType::Rc);
    let (psn, _) = e(&mut net, a).qp_psns(a.qpn).unwrap();
    let local = [sge(a, 0x100, 16)];
    send(
        &mut net,
        a,
        Qpn::default(),
        1,
        SendOp::RdmaRead {
            remote_addr: 0x5000,
            rkey: Rkey(0x1234),
        },
        Payload::Sges(&local),
        SendFlags::SIGNALED,
    );
    send_inline(&mut net, a, Qpn::default(), 2, b"next", true);
    assert!(matches!(net.run(100), Quiet::Timer(_)));
    inject(
        &mut net,
        a,
        Opcode::RcReadResponseOnly,
        psn,
        aeth(Syndrome::Ack(aeth::CreditCode::INVALID)),
        b"8 bytes!",
    );
    assert_eq!(
        send_cqes(&mut net, a),
        [
            wc(1, WcStatus::BadRespErr, WcOpcode::RdmaRead, a),
            flushed(2, WcOpcode::Send, a),
        ]
    );
    assert_eq!(state(&mut net, a), QpState::Err);
    assert_eq!(read(&net, a, 0x100, 16), [0; 16], "nothing written");
    assert_eq!(net.next_timer(), None);
    assert_eq!(events(&mut net, a), []);
}

#[test]
fn ud_receive_whose_grh_cannot_be_rebuilt_is_a_general_error() {
    // The engine rebuilds the GRH it places in front of a UD payload from
    // the IP header the caller hands it. An IPv6 header with a flow label
    // wider than 20 bits (which no parser yields) cannot be rebuilt: the
    // receive completes with GeneralErr and the QP enters ERR.
    let (mut net, a) = alone(QpType::Ud);
    let rsg = [sge(a, 0, 256)];
    recv(&mut net, a, 50, &rsg);
    recv(&mut net, a, 51, &rsg);
    let r = packet::Repr::new(
        bth::Repr {
            opcode: Opcode::UdSendOnly,
            solicited: false,
            mig_req: false,
            pad_cnt: 0,
            pkey: PKey::DEFAULT,
            fecn: false,
            becn: false,
            dest_qp: a.qpn,
            ack_req: false,
            psn: Psn::from_masked(0),
        },
        packet::ExtHeaders {
            deth: Some(deth::Repr {
                qkey: QKEY,
                src_qp: Qpn::from_masked(77),
            }),
            ..Default::default()
        },
        b"datagram",
    );
    let mut bytes = vec![0; r.buffer_len()];
    r.emit(&mut packet::Packet::new_unchecked(&mut bytes[..]))
        .unwrap();
    let ip = IpRepr::V6(ipv6::Repr {
        src: Ipv6Addr::LOCALHOST,
        dst: Ipv6Addr::LOCALHOST,
        traffic_class: 0,
        flow_label: 0x10_0000,
        hop_limit: 64,
        payload_len: 0,
    });
    let node = &mut net.nodes[a.node];
    node.engine.handle_packet(0, &ip, &bytes, &mut node.mem);
    assert_eq!(
        recv_cqes(&mut net, a),
        [
            wc(50, WcStatus::GeneralErr, WcOpcode::Recv, a),
            flushed(51, WcOpcode::Recv, a),
        ]
    );
    assert_eq!(state(&mut net, a), QpState::Err);
    assert_eq!(read(&net, a, 0, 8), [0; 8]);
    assert_eq!(events(&mut net, a), []);
}
