//! Every operation on every QP type where it is valid, end to end through
//! the test network: the bytes in memory on both sides and every field of
//! every completion, at message sizes around the path MTU (1024), with SGE
//! lists and with inline data. Then solicited events per QP type.

mod common;
use common::*;

use vrdma_engine::{
    event::AsyncEvent,
    qp::{AhAttr, QpState, QpType},
    wc::{Wc, WcFlags, WcOpcode, WcStatus},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, UdDest},
};
use vrdma_testkit::net::{Net, Quiet};
use vrdma_wire::{Lkey, QKey, Rkey};

#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Op {
    Send,
    SendImm,
    SendInv,
    Write,
    WriteImm,
    Read,
    CmpSwap,
    FetchAdd,
}

const OPS: [Op; 8] = [
    Op::Send,
    Op::SendImm,
    Op::SendInv,
    Op::Write,
    Op::WriteImm,
    Op::Read,
    Op::CmpSwap,
    Op::FetchAdd,
];

/// IBTA Vol1 Table 116 (operations per service): UD sends only, UC sends
/// and writes, RC everything.
fn valid(ty: QpType, op: Op) -> bool {
    match ty {
        QpType::Ud | QpType::Gsi => matches!(op, Op::Send | Op::SendImm),
        QpType::Uc => matches!(op, Op::Send | Op::SendImm | Op::Write | Op::WriteImm),
        QpType::Rc => true,
    }
}

/// The sender's data (on A).
const SRC: u64 = 0x1000;
/// Where a READ or atomic result lands (on A).
const LOCAL: u64 = 0x4000;
/// The receive buffer or the remote target (on B); a second receive
/// buffer follows at `DST2`.
const DST: u64 = 0x8000;
const DST2: u64 = 0x9800;
/// The receive buffer a WRITE with immediate consumes (never written).
const IMM_RECV: u64 = 0x3000;
/// An FRMR on B for SEND with invalidate (4 pages from here).
const FRMR_AT: u64 = 0xc000;
const IMM: u32 = 0x1234_5678;
const ATOMIC_START: u64 = 0x0102_0304_0506_0708;
const SWAP: u64 = 0x1111_2222_3333_4444;
const ADD: u64 = 5;

struct Case {
    ty: QpType,
    op: Op,
    len: u32,
    inline: bool,
}

impl Case {
    fn consumes_recv(&self) -> bool {
        matches!(self.op, Op::Send | Op::SendImm | Op::SendInv | Op::WriteImm)
    }

    /// Sent twice (first unsignaled) where a second run is the same
    /// operation again; a SEND with invalidate would find its key gone and
    /// atomics are checked once, exactly.
    fn twice(&self) -> bool {
        !matches!(self.op, Op::SendInv | Op::CmpSwap | Op::FetchAdd)
    }

    fn wc_opcode(&self) -> WcOpcode {
        match self.op {
            Op::Send | Op::SendImm | Op::SendInv => WcOpcode::Send,
            Op::Write | Op::WriteImm => WcOpcode::RdmaWrite,
            Op::Read => WcOpcode::RdmaRead,
            Op::CmpSwap => WcOpcode::CompSwap,
            Op::FetchAdd => WcOpcode::FetchAdd,
        }
    }
}

fn run(c: &Case) {
    let what = format!("{:?} {:?} len {} inline {}", c.ty, c.op, c.len, c.inline);
    let (mut net, a, b) = pair(c.ty, 7);
    let ud = c.ty == QpType::Ud;
    let grh = if ud { 40 } else { 0 };
    let atomic = matches!(c.op, Op::CmpSwap | Op::FetchAdd);
    let len = if atomic { 8 } else { c.len };
    let data = pattern(len as usize, (len as u8) ^ 0x5a);
    fill(&mut net, a, SRC, &data);
    match c.op {
        Op::Read => fill(&mut net, b, DST, &data),
        Op::CmpSwap | Op::FetchAdd => fill(&mut net, b, DST, &ATOMIC_START.to_le_bytes()),
        _ => {}
    }
    let frmr = (c.op == Op::SendInv).then(|| fast_reg(&mut net, b, FRMR_AT, 0x42));
    let runs: u64 = if c.twice() { 2 } else { 1 };

    // Receives on B, one per message that consumes one.
    if c.consumes_recv() {
        for i in 0..runs {
            let at = match (c.op, i) {
                (Op::WriteImm, _) => IMM_RECV,
                (_, 0) => DST,
                _ => DST2,
            };
            // Larger than the message: byte_len must say what arrived.
            let r = [sge(b, at, len + grh + 16)];
            recv(&mut net, b, 70 + i, &r);
        }
    }

    // The WRs on A: an unsignaled one first (when the operation can run
    // twice), then a signaled one.
    let ah = ud.then(|| ah_to(&mut net, a, gid(2)));
    let remote = b.rkey;
    let op = match c.op {
        Op::Send => SendOp::Send,
        Op::SendImm => SendOp::SendWithImm { imm: IMM },
        Op::SendInv => SendOp::SendWithInv {
            invalidate: Rkey(frmr.map_or(0, |k: Lkey| k.0)),
        },
        Op::Write => SendOp::RdmaWrite {
            remote_addr: BASE + DST,
            rkey: remote,
        },
        Op::WriteImm => SendOp::RdmaWriteWithImm {
            remote_addr: BASE + DST,
            rkey: remote,
            imm: IMM,
        },
        Op::Read => SendOp::RdmaRead {
            remote_addr: BASE + DST,
            rkey: remote,
        },
        Op::CmpSwap => SendOp::CompareSwap {
            remote_addr: BASE + DST,
            rkey: remote,
            compare: ATOMIC_START,
            swap: SWAP,
        },
        Op::FetchAdd => SendOp::FetchAdd {
            remote_addr: BASE + DST,
            rkey: remote,
            add: ADD,
        },
    };
    // Two SGEs when there is enough to split, to walk an SGE list.
    let at = if matches!(c.op, Op::Read) || atomic {
        LOCAL
    } else {
        SRC
    };
    let half = len / 2;
    let split = [sge(a, at, half), sge(a, at + u64::from(half), len - half)];
    let single = [sge(a, at, len)];
    let payload = if c.inline {
        Payload::Inline(&data)
    } else if len >= 2 && !atomic {
        Payload::Sges(&split)
    } else {
        Payload::Sges(&single)
    };
    for i in 0..runs {
        let signaled = i + 1 == runs;
        let mut flags = if signaled {
            SendFlags::SIGNALED
        } else {
            SendFlags::default()
        };
        if c.inline {
            flags = flags | SendFlags::INLINE;
        }
        let wr = SendWr {
            wr_id: 1 + i,
            op,
            payload,
            flags,
            ud: ah.map(|ah| UdDest {
                av: vrdma_engine::wr::Av::Handle(ah),
                remote_qpn: b.qpn,
                remote_qkey: QKey(0x1111_1111),
            }),
        };
        post(&mut net, a, &wr);
    }
    assert_eq!(net.run(10_000), Quiet::Idle, "{what}");

    // The requester: one completion, for the signaled WR, every field.
    let mut want = Wc::new(runs, WcStatus::Success, c.wc_opcode(), a.qpn.value());
    want.byte_len = len;
    // Every WR of the run retired, the unsignaled ones without completions.
    want.sq_retired = runs as u32;
    assert_eq!(poll(&mut net, a), [want], "{what}: requester");

    // The responder: one completion per receive consumed, every field.
    let mut want_b = Vec::new();
    if c.consumes_recv() {
        for i in 0..runs {
            let opcode = if c.op == Op::WriteImm {
                WcOpcode::RecvRdmaWithImm
            } else {
                WcOpcode::Recv
            };
            let mut w = Wc::new(70 + i, WcStatus::Success, opcode, b.qpn.value());
            w.byte_len = len + grh;
            if ud {
                w.src_qp = a.qpn.value();
                w.wc_flags = WcFlags::GRH;
                // The engines talk IPv4 (127.0.0.x).
                w.network_hdr = Some(vrdma_engine::wc::NetworkHdr::Ipv4);
            }
            match c.op {
                Op::SendImm | Op::WriteImm => {
                    w.imm_data = IMM;
                    w.wc_flags = w.wc_flags.with(WcFlags::WITH_IMM);
                }
                Op::SendInv => {
                    w.imm_data = frmr.map_or(0, |k| k.0);
                    w.wc_flags = w.wc_flags.with(WcFlags::WITH_INV);
                }
                _ => {}
            }
            want_b.push(w);
        }
    }
    assert_eq!(poll(&mut net, b), want_b, "{what}: responder");

    // The bytes.
    let n = len as usize;
    match c.op {
        Op::Send | Op::SendImm | Op::SendInv => {
            let g = u64::from(grh);
            assert_eq!(read(&net, b, DST + g, n), data, "{what}: first receive");
            if runs == 2 {
                assert_eq!(read(&net, b, DST2 + g, n), data, "{what}: second receive");
            }
        }
        Op::Write | Op::WriteImm => {
            assert_eq!(read(&net, b, DST, n), data, "{what}: written");
            if c.op == Op::WriteImm {
                let untouched = vec![0; n + 16];
                assert_eq!(read(&net, b, IMM_RECV, n + 16), untouched, "{what}");
            }
        }
        Op::Read => assert_eq!(read(&net, a, LOCAL, n), data, "{what}: read"),
        Op::CmpSwap => {
            assert_eq!(read(&net, b, DST, 8), SWAP.to_le_bytes(), "{what}");
            assert_eq!(read(&net, a, LOCAL, 8), ATOMIC_START.to_le_bytes());
        }
        Op::FetchAdd => {
            let sum = ATOMIC_START + ADD;
            assert_eq!(read(&net, b, DST, 8), sum.to_le_bytes(), "{what}");
            assert_eq!(read(&net, a, LOCAL, 8), ATOMIC_START.to_le_bytes());
        }
    }
    if let Some(k) = frmr {
        assert!(e(&mut net, b).mr(k).is_none(), "{what}: invalidated");
    }
    for s in [a, b] {
        assert_eq!(qp_state(&mut net, s), QpState::Rts, "{what}");
        // The port came up when the engine started; nothing else happened.
        let events: Vec<AsyncEvent> = std::iter::from_fn(|| e(&mut net, s).poll_event()).collect();
        assert_eq!(events, [AsyncEvent::PortActive { port: 1 }], "{what}");
    }
}

#[test]
fn every_operation_on_every_qp_type_with_sges() {
    let mut cases = 0;
    for ty in [QpType::Rc, QpType::Uc, QpType::Ud] {
        // A UD message is one packet: at most the path MTU.
        let sizes: &[u32] = if ty == QpType::Ud {
            &[0, 1, 1023, 1024]
        } else {
            &[0, 1, 1023, 1024, 1025, 3000]
        };
        for op in OPS.into_iter().filter(|&op| valid(ty, op)) {
            for &len in sizes {
                run(&Case {
                    ty,
                    op,
                    len,
                    inline: false,
                });
                cases += 1;
            }
        }
    }
    // RC 8 ops × 6 sizes, UC 4 × 6, UD 2 × 4.
    assert_eq!(cases, 48 + 24 + 8);
}

#[test]
fn every_operation_that_carries_data_with_inline_data() {
    for ty in [QpType::Rc, QpType::Uc, QpType::Ud] {
        for op in [Op::Send, Op::SendImm, Op::SendInv, Op::Write, Op::WriteImm] {
            if !valid(ty, op) {
                continue;
            }
            // The QPs allow 64 bytes inline.
            for len in [0, 1, 63, 64] {
                run(&Case {
                    ty,
                    op,
                    len,
                    inline: true,
                });
            }
        }
    }
}

/// Posts a receive on B and sends `op` from A, solicited or not.
fn send_one(net: &mut Net, a: Ids, b: Ids, ty: QpType, op: SendOp, solicited: bool) {
    let r = [sge(b, DST, 100)];
    e(net, b)
        .post_recv(
            b.qpn,
            &RecvWr {
                wr_id: 70,
                sg_list: &r,
            },
        )
        .unwrap();
    let ud = (ty == QpType::Ud).then(|| {
        let ah = e(net, a)
            .create_ah(
                a.pd,
                AhAttr {
                    dgid: gid(2),
                    port_num: 1,
                    hop_limit: 64,
                    ..AhAttr::default()
                },
            )
            .unwrap();
        UdDest {
            av: vrdma_engine::wr::Av::Handle(ah),
            remote_qpn: b.qpn,
            remote_qkey: QKey(0x1111_1111),
        }
    });
    let s = [sge(a, SRC, 8)];
    let flags = if solicited {
        SendFlags::SOLICITED
    } else {
        SendFlags::default()
    };
    post(
        net,
        a,
        &SendWr {
            wr_id: 1,
            op,
            payload: Payload::Sges(&s),
            flags,
            ud,
        },
    );
    assert_eq!(net.run(1000), Quiet::Idle);
    assert_eq!(poll(net, b).len(), 1, "one receive completion");
}

#[test]
fn a_solicited_arm_fires_once_and_only_for_a_solicited_message() {
    for ty in [QpType::Rc, QpType::Uc, QpType::Ud] {
        let mut ops = vec![SendOp::Send, SendOp::SendWithImm { imm: 1 }];
        if ty != QpType::Ud {
            // The solicited bit rides on the last packet of a WRITE with
            // immediate too (IBTA Vol1 §9.2.1: SE on the last packet of
            // SEND and RDMA WRITE with immediate).
            ops.push(SendOp::RdmaWriteWithImm {
                remote_addr: BASE + DST2,
                rkey: Rkey(0),
                imm: 2,
            });
        }
        for op in ops {
            let (mut net, a, b) = pair(ty, 7);
            let op = match op {
                SendOp::RdmaWriteWithImm {
                    remote_addr, imm, ..
                } => SendOp::RdmaWriteWithImm {
                    remote_addr,
                    rkey: b.rkey,
                    imm,
                },
                op => op,
            };
            let what = format!("{ty:?} {op:?}");
            e(&mut net, b).req_notify_cq(b.cq, true).unwrap();
            send_one(&mut net, a, b, ty, op, false);
            assert_eq!(e(&mut net, b).poll_notification(), None, "{what}");
            send_one(&mut net, a, b, ty, op, true);
            assert_eq!(e(&mut net, b).poll_notification(), Some(b.cq), "{what}");
            assert_eq!(e(&mut net, b).poll_notification(), None, "{what}: once");
            // Disarmed by the event: a second solicited message is quiet.
            send_one(&mut net, a, b, ty, op, true);
            assert_eq!(e(&mut net, b).poll_notification(), None, "{what}");
            // Armed for any completion, an unsolicited one fires.
            e(&mut net, b).req_notify_cq(b.cq, false).unwrap();
            send_one(&mut net, a, b, ty, op, false);
            assert_eq!(e(&mut net, b).poll_notification(), Some(b.cq), "{what}");
        }
    }
}
