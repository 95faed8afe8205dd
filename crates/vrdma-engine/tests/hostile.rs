//! A hostile peer: random, well-framed packets and raw garbage addressed to
//! an RC QP must never panic the engine, and must never touch memory
//! outside what the QP's MRs grant.

use std::net::Ipv4Addr;

use proptest::prelude::*;
use vrdma_engine::{
    Engine,
    attr::{DeviceAttr, Mtu, PortAttr},
    memory::{Memory, VecMemory},
    mr::{Access, MrRequest, Translation},
    qp::{AhAttr, AttrMask, QpAttr, QpCap, QpInitAttr, QpState, QpType},
    wr::{RecvWr, Sge},
};
use vrdma_wire::{
    Gid, Msn, Opcode, PKey, Psn, QKey, Qpn, Rkey, aeth, atomic, bth, deth,
    frame::IpRepr,
    ieth, immdt, ipv4,
    opcode::HeaderSet,
    packet::{self, ExtHeaders},
    reth,
};

const BASE: u64 = 0x1_0000;
/// Memory is twice the MR: the upper half must stay untouched.
const MR_LEN: u64 = 0x4000;

fn victim() -> (Engine, VecMemory, Qpn, Rkey) {
    let mut e = Engine::new(
        DeviceAttr::default(),
        PortAttr::with_gids(&[Gid::from(Ipv4Addr::new(127, 0, 0, 2))]),
    );
    let pd = e.alloc_pd().unwrap();
    let (cq, _) = e.create_cq(256, 0).unwrap();
    let (lkey, rkey) = e
        .reg_mr(MrRequest {
            pd,
            iova: BASE,
            length: MR_LEN,
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
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap: QpCap {
                max_send_wr: 8,
                max_recv_wr: 64,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: QpType::Rc,
            sq_sig_all: false,
        })
        .unwrap();
    let a = QpAttr {
        port_num: 1,
        qp_access_flags: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
        ah_attr: AhAttr {
            dgid: Gid::from(Ipv4Addr::new(127, 0, 0, 1)),
            port_num: 1,
            ..AhAttr::default()
        },
        path_mtu: Mtu::Mtu256,
        dest_qp_num: Qpn::from_masked(0x42),
        rq_psn: Psn::from_masked(100),
        max_dest_rd_atomic: 4,
        min_rnr_timer: 1,
        ..QpAttr::default()
    };
    e.modify_qp(
        qpn,
        &QpAttr {
            qp_state: QpState::Init,
            ..a
        },
        AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS,
    )
    .unwrap();
    e.modify_qp(
        qpn,
        &QpAttr {
            qp_state: QpState::Rtr,
            ..a
        },
        AttrMask::STATE
            | AttrMask::AV
            | AttrMask::PATH_MTU
            | AttrMask::DEST_QPN
            | AttrMask::RQ_PSN
            | AttrMask::MAX_DEST_RD_ATOMIC
            | AttrMask::MIN_RNR_TIMER,
    )
    .unwrap();
    for i in 0..32 {
        let sg = [Sge {
            addr: BASE + i * 0x100,
            length: 0x100,
            lkey,
        }];
        e.post_recv(
            qpn,
            &RecvWr {
                wr_id: i,
                sg_list: &sg,
            },
        )
        .unwrap();
    }
    (e, VecMemory::new(BASE, (2 * MR_LEN) as usize), qpn, rkey)
}

fn ip() -> IpRepr {
    IpRepr::V4(ipv4::Repr {
        src: Ipv4Addr::new(127, 0, 0, 1),
        dst: Ipv4Addr::new(127, 0, 0, 2),
        tos: 0,
        ident: 0,
        dont_frag: true,
        ttl: 64,
        payload_len: 0,
    })
}

/// A well-framed packet of a random opcode, PSN near the expected one,
/// headers with random (often nearly right) values.
fn hostile_packet(rkey: Rkey) -> impl Strategy<Value = Vec<u8>> {
    (
        prop::sample::select(Opcode::ALL),
        0u32..8,
        any::<bool>(),
        prop_oneof![Just(rkey.0), any::<u32>()],
        prop_oneof![BASE..BASE + 2 * MR_LEN, any::<u64>()],
        prop::option::of(any::<u32>().prop_map(|l| l % 0x5000)),
        prop::collection::vec(any::<u8>(), 0..300),
        any::<(u64, u64, u8)>(),
    )
        .prop_map(
            move |(opcode, dpsn, se, key, va, dma_len, payload, (x, y, syn))| {
                let h = opcode.headers();
                let ext = ExtHeaders {
                    deth: h.contains(HeaderSet::DETH).then_some(deth::Repr {
                        qkey: QKey(x as u32),
                        src_qp: Qpn::from_masked(y as u32),
                    }),
                    reth: h.contains(HeaderSet::RETH).then_some(reth::Repr {
                        va,
                        rkey: Rkey(key),
                        // Half the time the length the payload really has.
                        dma_len: dma_len.unwrap_or(payload.len() as u32),
                    }),
                    atomic_eth: h
                        .contains(HeaderSet::ATOMIC_ETH)
                        .then_some(atomic::eth::Repr {
                            va,
                            rkey: Rkey(key),
                            swap_add: x,
                            compare: y,
                        }),
                    aeth: h.contains(HeaderSet::AETH).then_some(aeth::Repr {
                        syndrome: aeth::Syndrome::from_byte(syn & 0x7f)
                            .unwrap_or(aeth::Syndrome::Ack(aeth::CreditCode::INVALID)),
                        msn: Msn::from_masked(y as u32),
                    }),
                    atomic_ack_eth: h
                        .contains(HeaderSet::ATOMIC_ACK_ETH)
                        .then_some(atomic::ack::Repr { orig: x }),
                    immdt: h
                        .contains(HeaderSet::IMMDT)
                        .then_some(immdt::Repr { imm: x as u32 }),
                    ieth: h
                        .contains(HeaderSet::IETH)
                        .then_some(ieth::Repr { rkey: Rkey(key) }),
                };
                let payload: &[u8] = if opcode.has_payload() { &payload } else { &[] };
                let r = packet::Repr::new(
                    bth::Repr {
                        opcode,
                        solicited: se,
                        mig_req: false,
                        pad_cnt: 0,
                        pkey: PKey::DEFAULT,
                        fecn: false,
                        becn: false,
                        dest_qp: Qpn::from_masked(17),
                        ack_req: se,
                        psn: Psn::from_masked(100 + dpsn),
                    },
                    ext,
                    payload,
                );
                let mut v = vec![0; r.buffer_len()];
                r.emit(&mut packet::Packet::new_unchecked(&mut v[..]))
                    .unwrap();
                v
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_packets_never_panic_and_never_escape_the_mr(
        packets in prop::collection::vec(hostile_packet(Rkey(0)), 1..40),
        garbage in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..80), 0..8),
    ) {
        let (mut e, mut mem, qpn, rkey) = victim();
        let ip = ip();
        let mut buf = vec![0u8; vrdma_engine::transmit::MAX_PACKET];
        let mut now = 0u64;
        for p in packets.iter().chain(garbage.iter()) {
            let mut p = p.clone();
            if p.len() >= 12 + 16 {
                // Most packets in sequence (so they are executed), and
                // RETH / AtomicETH rkeys aimed at the real MR.
                if p[11] % 4 != 0 {
                    let (_, epsn) = e.qp_psns(qpn).unwrap();
                    p[9..12].copy_from_slice(&epsn.value().to_be_bytes()[1..]);
                }
                if let Ok(op) = Opcode::try_from(p[0])
                    && (op.headers().contains(HeaderSet::RETH)
                        || op.headers().contains(HeaderSet::ATOMIC_ETH))
                {
                    p[12 + 8..12 + 12].copy_from_slice(&rkey.0.to_be_bytes());
                }
            }
            e.handle_packet(now, &ip, &p, &mut mem);
            // Drain what the victim answers, and run its timers.
            while e.poll_transmit(now, &mem, &mut buf).is_some() {}
            now += 1_000_000;
            e.handle_timeout(now);
        }
        let mut upper = vec![0u8; MR_LEN as usize];
        mem.read(BASE + MR_LEN, &mut upper).unwrap();
        prop_assert!(upper.iter().all(|&b| b == 0), "a byte outside the MR changed");
    }
}
