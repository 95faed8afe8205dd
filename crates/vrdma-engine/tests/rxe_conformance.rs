//! The engine's packets against Linux rxe's, operation by operation: the
//! same operation at the same size and path MTU (1024, what rxe used in the
//! reference captures) must produce the same sequence of packets with the
//! same opcodes, flags, P_Key, AckReq placement, extension headers (the
//! fields that do not depend on addresses or keys), payload lengths, PSN
//! steps and MSNs. QPNs, PSN bases, addresses and keys differ by nature.

use std::{fs, path::Path};

use pcap_file::pcap::PcapReader;
use vrdma_engine::{
    qp::{AhAttr, QpType},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_testkit::{
    net::Net,
    setup::{self, BASE, Connection, Ids},
};
use vrdma_wire::{Opcode, Psn, QKey, Rkey, frame, packet};

/// What must agree between rxe and vrdma for one packet.
#[derive(Clone, Debug, Eq, PartialEq)]
struct Sig {
    opcode: Opcode,
    solicited: bool,
    mig_req: bool,
    pad_cnt: u8,
    pkey: u16,
    ack_req: bool,
    /// PSN minus the PSN of the first packet in the same direction.
    psn_step: u32,
    reth_len: Option<u32>,
    /// Syndrome and MSN, the MSN counted from the operation's start.
    aeth: Option<(u8, u32)>,
    qkey: Option<u32>,
    has_imm: bool,
    payload: usize,
}

/// `first` is the first PSN in the packet's direction, `msn_base` the
/// responder's MSN before the operation.
fn sig(r: &packet::Repr<'_>, first: Psn, msn_base: u32) -> Sig {
    Sig {
        opcode: r.bth.opcode,
        solicited: r.bth.solicited,
        mig_req: r.bth.mig_req,
        pad_cnt: r.bth.pad_cnt,
        pkey: r.bth.pkey.0,
        ack_req: r.bth.ack_req,
        psn_step: first.forward_distance(r.bth.psn),
        reth_len: r.ext.reth.map(|h| h.dma_len),
        aeth: r.ext.aeth.map(|h| {
            (
                h.syndrome.to_byte(),
                h.msn.value().wrapping_sub(msn_base) & 0xff_ffff,
            )
        }),
        qkey: r.ext.deth.map(|h| h.qkey.0),
        has_imm: r.ext.immdt.is_some(),
        payload: r.payload.len(),
    }
}

/// The first `n_req` packets from the requester and `n_resp` from the
/// responder in an rxe capture (the requester sends the first packet),
/// after skipping the requester's first `skip` packets (for captures that
/// hold several operations one after another).
fn rxe_from(file: &str, skip: usize, n_req: usize, n_resp: usize) -> (Vec<Sig>, Vec<Sig>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/rxe")
        .join(file);
    let mut reader = PcapReader::new(fs::File::open(path).unwrap()).unwrap();
    let mut frames = Vec::new();
    while let Some(p) = reader.next_packet() {
        frames.push(p.unwrap().data.into_owned());
    }
    let reprs: Vec<_> = frames
        .iter()
        .map(|f| frame::Repr::parse_ethernet(f).unwrap())
        .collect();
    let requester = reprs[0].ip.src();
    // Everything before the requester's `skip`-th packet belongs to earlier
    // operations: the responder's answers to them too. Their last MSN is
    // where this operation's MSNs count from.
    let mut skipped = 0;
    let mut msn_base = 0;
    let kept = reprs
        .iter()
        .map(|f| (f.ip.src() == requester, f.roce))
        .skip_while(|(from_requester, r)| {
            if !from_requester {
                if let Some(a) = r.ext.aeth {
                    msn_base = a.msn.value();
                }
                return true;
            }
            skipped += 1;
            skipped <= skip
        });
    let kept: Vec<_> = kept.collect();
    split(kept.into_iter(), msn_base, n_req, n_resp)
}

fn split<'a>(
    pkts: impl Iterator<Item = (bool, packet::Repr<'a>)>,
    msn_base: u32,
    n_req: usize,
    n_resp: usize,
) -> (Vec<Sig>, Vec<Sig>) {
    let (mut req, mut resp) = (Vec::new(), Vec::new());
    let (mut req_first, mut resp_first) = (None, None);
    for (from_requester, r) in pkts {
        let (v, first, n) = if from_requester {
            (&mut req, &mut req_first, n_req)
        } else {
            (&mut resp, &mut resp_first, n_resp)
        };
        let base = *first.get_or_insert(r.bth.psn);
        if v.len() < n {
            v.push(sig(&r, base, msn_base));
        }
    }
    (req, resp)
}

/// Two engines (RC, UC or UD), MTU 1024, P_Key 0xffff, Q_Key 0x11111111,
/// connected to each other as perftest connects (timeout 14, retries 7,
/// four READs/atomics each way).
fn pair(ty: QpType) -> (Net, [Ids; 2]) {
    let mut net = Net {
        tap: Some(Vec::new()),
        ..Net::default()
    };
    let ends = [1, 2].map(|n| {
        setup::EngineSpec::new(n)
            .qp_type(ty)
            .depth(8)
            .add_to(&mut net)
    });
    Connection {
        psn: Psn::from_masked(0x10_0000),
        max_rd_atomic: 4,
        max_dest_rd_atomic: 4,
        ..Connection::default()
    }
    .pair(&mut net, ends[0], ends[1]);
    (net, ends)
}

/// Runs one WR from node 0 (with a receive posted at node 1) and returns
/// the signatures of node 0's and node 1's packets.
fn vrdma(ty: QpType, op: impl Fn(Rkey) -> SendOp, len: u32) -> (Vec<Sig>, Vec<Sig>) {
    let (mut net, [a, b]) = pair(ty);
    let (qa, pda, la) = (a.qpn, a.pd, a.lkey);
    let (qb, lb, rb) = (b.qpn, b.lkey, b.rkey);
    let rsge = [Sge {
        addr: BASE + 0x8000,
        length: 8192,
        lkey: lb,
    }];
    net.nodes[1]
        .engine
        .post_recv(
            qb,
            &RecvWr {
                wr_id: 1,
                sg_list: &rsge,
            },
        )
        .unwrap();
    let gid_b = net.nodes[1].gid;
    let ud = if ty == QpType::Ud {
        let ah = net.nodes[0]
            .engine
            .create_ah(
                pda,
                AhAttr {
                    dgid: gid_b,
                    port_num: 1,
                    hop_limit: 64,
                    ..AhAttr::default()
                },
            )
            .unwrap();
        Some(UdDest {
            av: vrdma_engine::wr::Av::Handle(ah),
            remote_qpn: qb,
            remote_qkey: QKey(0x1111_1111),
        })
    } else {
        None
    };
    let ssge = [Sge {
        addr: BASE,
        length: len,
        lkey: la,
    }];
    let wr = SendWr {
        wr_id: 2,
        op: op(rb),
        payload: Payload::Sges(&ssge),
        flags: SendFlags::SIGNALED,
        ud,
    };
    net.nodes[0].engine.post_send(qa, &wr).unwrap();
    net.run(1000);
    let tap = net.tap.take().unwrap();
    let reprs: Vec<(bool, Vec<u8>)> = tap.into_iter().map(|(node, b)| (node == 0, b)).collect();
    let parsed = reprs.iter().map(|(from_a, b)| {
        (
            *from_a,
            packet::Repr::parse(&packet::Packet::new_checked(&b[..]).unwrap()).unwrap(),
        )
    });
    // Every packet vrdma sent for the one WR: a surplus (a second ACK, a
    // response from a UC QP) must fail the comparison, so nothing is cut.
    split(parsed, 0, usize::MAX, usize::MAX)
}

fn agree(
    file: &str,
    ty: QpType,
    op: impl Fn(Rkey) -> SendOp,
    len: u32,
    n_req: usize,
    n_resp: usize,
) {
    agree_from(file, 0, ty, op, len, n_req, n_resp);
}

fn agree_from(
    file: &str,
    skip: usize,
    ty: QpType,
    op: impl Fn(Rkey) -> SendOp,
    len: u32,
    n_req: usize,
    n_resp: usize,
) {
    let theirs = rxe_from(file, skip, n_req, n_resp);
    let ours = vrdma(ty, op, len);
    // The capture may hold later operations too: rxe's side is cut to
    // the counts the operation takes, and vrdma must send exactly those.
    assert_eq!(theirs.0.len(), n_req, "{file}: rxe's requester packets");
    assert_eq!(theirs.1.len(), n_resp, "{file}: rxe's responder packets");
    assert_eq!(ours.0, theirs.0, "{file}: requester packets");
    assert_eq!(ours.1, theirs.1, "{file}: responder packets");
}

#[test]
fn rc_send_of_4096_bytes() {
    agree(
        "rc_pingpong_4096.pcap",
        QpType::Rc,
        |_| SendOp::Send,
        4096,
        4,
        1,
    );
}

#[test]
fn rc_write_of_4096_bytes() {
    agree(
        "write_bw_4096.pcap",
        QpType::Rc,
        |rkey| SendOp::RdmaWrite {
            remote_addr: BASE + 0x8000,
            rkey,
        },
        4096,
        4,
        1,
    );
}

#[test]
fn rc_read_of_4096_bytes() {
    agree(
        "read_bw_4096.pcap",
        QpType::Rc,
        |rkey| SendOp::RdmaRead {
            remote_addr: BASE + 0x8000,
            rkey,
        },
        4096,
        1,
        4,
    );
}

#[test]
fn rc_fetch_add() {
    agree(
        "atomic_fetch_add.pcap",
        QpType::Rc,
        |rkey| SendOp::FetchAdd {
            remote_addr: BASE + 0x8000,
            rkey,
            add: 1,
        },
        8,
        1,
        1,
    );
}

#[test]
fn rc_compare_swap() {
    agree(
        "atomic_cmp_swap.pcap",
        QpType::Rc,
        |rkey| SendOp::CompareSwap {
            remote_addr: BASE + 0x8000,
            rkey,
            compare: 0,
            swap: 0,
        },
        8,
        1,
        1,
    );
}

#[test]
fn rc_send_with_immediate_of_64_bytes() {
    agree(
        "rc_imm_and_rnr_nak.pcap",
        QpType::Rc,
        |_| SendOp::SendWithImm { imm: 0x4433_2211 },
        64,
        1,
        1,
    );
}

#[test]
fn ud_send_of_64_bytes() {
    agree(
        "ud_pingpong_64.pcap",
        QpType::Ud,
        |_| SendOp::Send,
        64,
        1,
        0,
    );
}

#[test]
fn uc_send_of_64_bytes() {
    agree(
        "uc_pingpong_64.pcap",
        QpType::Uc,
        |_| SendOp::Send,
        64,
        1,
        0,
    );
}

#[test]
fn rc_write_of_64_bytes() {
    agree(
        "write_bw_64.pcap",
        QpType::Rc,
        |rkey| SendOp::RdmaWrite {
            remote_addr: BASE + 0x8000,
            rkey,
        },
        64,
        1,
        1,
    );
}

fn write(rkey: Rkey) -> SendOp {
    SendOp::RdmaWrite {
        remote_addr: BASE + 0x8000,
        rkey,
    }
}

fn read(rkey: Rkey) -> SendOp {
    SendOp::RdmaRead {
        remote_addr: BASE + 0x8000,
        rkey,
    }
}

#[test]
fn uc_write_of_64_bytes() {
    agree("uc_write_bw_64.pcap", QpType::Uc, write, 64, 1, 0);
}

#[test]
fn rc_write_of_3000_and_3001_bytes_at_mtu_1024() {
    // First, middle, last; 3001 needs three pad bytes on the last.
    agree("write_bw_3000_mtu1024.pcap", QpType::Rc, write, 3000, 3, 1);
    agree("write_bw_3001_mtu1024.pcap", QpType::Rc, write, 3001, 3, 1);
}

#[test]
fn rc_read_of_3000_and_3001_bytes_at_mtu_1024() {
    agree("read_bw_3000_mtu1024.pcap", QpType::Rc, read, 3000, 1, 3);
    agree("read_bw_3001_mtu1024.pcap", QpType::Rc, read, 3001, 1, 3);
}

#[test]
fn rc_send_of_3000_and_61_bytes() {
    agree(
        "send_bw_3000_mtu1024.pcap",
        QpType::Rc,
        |_| SendOp::Send,
        3000,
        3,
        1,
    );
    agree("send_bw_61.pcap", QpType::Rc, |_| SendOp::Send, 61, 1, 1);
}

#[test]
fn rc_send_of_32_bytes_posted_inline() {
    // rxe's SENDs were posted inline; on the wire an inline SEND is a SEND,
    // so the engine's SGE SEND of the same length must look the same.
    agree(
        "rc_send_inline_32.pcap",
        QpType::Rc,
        |_| SendOp::Send,
        32,
        1,
        1,
    );
}

#[test]
fn uc_send_and_write_with_immediate_of_64_and_3000_bytes() {
    let f = "uc_send_write_imm.pcap";
    let imm = 0x4433_2211;
    let send = |_| SendOp::SendWithImm { imm };
    let write = |rkey| SendOp::RdmaWriteWithImm {
        remote_addr: BASE + 0x8000,
        rkey,
        imm,
    };
    agree_from(f, 0, QpType::Uc, send, 64, 1, 0);
    agree_from(f, 1, QpType::Uc, send, 3000, 3, 0);
    agree_from(f, 4, QpType::Uc, write, 64, 1, 0);
    agree_from(f, 5, QpType::Uc, write, 3000, 3, 0);
}

#[test]
fn ud_send_with_immediate_of_64_bytes() {
    agree(
        "ud_send_imm.pcap",
        QpType::Ud,
        |_| SendOp::SendWithImm { imm: 0x4433_2211 },
        64,
        1,
        0,
    );
}

#[test]
fn rc_write_with_immediate_of_64_and_3000_bytes() {
    // In rc_imm_and_rnr_nak.pcap, after the SEND with immediate: a 64-byte
    // WRITE_ONLY_WITH_IMMEDIATE, then a 3000-byte WRITE with immediate
    // (FIRST, MIDDLE, LAST_WITH_IMMEDIATE), each acknowledged once.
    let f = "rc_imm_and_rnr_nak.pcap";
    let write = |rkey| SendOp::RdmaWriteWithImm {
        remote_addr: BASE + 0x8000,
        rkey,
        imm: 0x8877_6655,
    };
    agree_from(f, 1, QpType::Rc, write, 64, 1, 1);
    agree_from(f, 2, QpType::Rc, write, 3000, 3, 1);
}
