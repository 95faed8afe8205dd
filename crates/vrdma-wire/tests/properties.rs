//! Property tests: parse ∘ emit is the identity for every header and for
//! random valid packets and frames, and corruption never goes unnoticed.

use std::net::{Ipv4Addr, Ipv6Addr};

use proptest::prelude::*;
use vrdma_wire::{
    Error, MAX_PAYLOAD, Msn, Opcode, PKey, Psn, QKey, Qpn, Rkey, aeth, atomic, bth, deth,
    ethernet::{self, EtherType, MacAddr, VlanTag},
    frame::{self, IpRepr},
    grh, ieth, immdt, ipv4, ipv6,
    opcode::HeaderSet,
    packet::{self, ExtHeaders},
    reth, udp,
};

fn opcode() -> impl Strategy<Value = Opcode> {
    prop::sample::select(Opcode::ALL)
}

fn bth_for(op: Opcode) -> impl Strategy<Value = bth::Repr> {
    (
        any::<[bool; 5]>(),
        0u8..4,
        any::<u16>(),
        0u32..1 << 24,
        0u32..1 << 24,
    )
        .prop_map(move |(f, pad_cnt, pkey, qpn, psn)| bth::Repr {
            opcode: op,
            solicited: f[0],
            mig_req: f[1],
            pad_cnt,
            pkey: PKey(pkey),
            fecn: f[2],
            becn: f[3],
            dest_qp: Qpn::from_masked(qpn),
            ack_req: f[4],
            psn: Psn::from_masked(psn),
        })
}

fn syndrome() -> impl Strategy<Value = aeth::Syndrome> {
    any::<u8>().prop_filter_map("reserved syndrome", |b| aeth::Syndrome::from_byte(b).ok())
}

fn aeth() -> impl Strategy<Value = aeth::Repr> {
    (syndrome(), 0u32..1 << 24).prop_map(|(syndrome, msn)| aeth::Repr {
        syndrome,
        msn: Msn::from_masked(msn),
    })
}

fn reth() -> impl Strategy<Value = reth::Repr> {
    any::<(u64, u32, u32)>().prop_map(|(va, rkey, dma_len)| reth::Repr {
        va,
        rkey: Rkey(rkey),
        dma_len,
    })
}

fn deth() -> impl Strategy<Value = deth::Repr> {
    (any::<u32>(), 0u32..1 << 24).prop_map(|(q, s)| deth::Repr {
        qkey: QKey(q),
        src_qp: Qpn::from_masked(s),
    })
}

fn atomic_eth() -> impl Strategy<Value = atomic::eth::Repr> {
    any::<(u64, u32, u64, u64)>().prop_map(|(va, rkey, swap_add, compare)| atomic::eth::Repr {
        va,
        rkey: Rkey(rkey),
        swap_add,
        compare,
    })
}

/// The extension headers `op` requires, with random contents.
fn ext_for(op: Opcode) -> impl Strategy<Value = ExtHeaders> {
    let h = op.headers();
    let opt = move |bit: HeaderSet| h.contains(bit);
    (
        deth(),
        reth(),
        atomic_eth(),
        aeth(),
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(move |(d, r, a, ae, orig, imm, inv)| ExtHeaders {
            deth: opt(HeaderSet::DETH).then_some(d),
            reth: opt(HeaderSet::RETH).then_some(r),
            atomic_eth: opt(HeaderSet::ATOMIC_ETH).then_some(a),
            aeth: opt(HeaderSet::AETH).then_some(ae),
            atomic_ack_eth: opt(HeaderSet::ATOMIC_ACK_ETH).then_some(atomic::ack::Repr { orig }),
            immdt: opt(HeaderSet::IMMDT).then_some(immdt::Repr { imm }),
            ieth: opt(HeaderSet::IETH).then_some(ieth::Repr { rkey: Rkey(inv) }),
        })
}

fn payload_for(op: Opcode) -> BoxedStrategy<Vec<u8>> {
    if op.has_payload() {
        prop_oneof![
            4 => prop::collection::vec(any::<u8>(), 0..300),
            1 => prop::collection::vec(any::<u8>(), MAX_PAYLOAD - 3..=MAX_PAYLOAD),
        ]
        .boxed()
    } else {
        Just(Vec::new()).boxed()
    }
}

/// A valid packet: its parts, with `pad_cnt` as emission will compute it.
fn packet_parts() -> impl Strategy<Value = (bth::Repr, ExtHeaders, Vec<u8>)> {
    opcode()
        .prop_flat_map(|op| (bth_for(op), ext_for(op), payload_for(op)))
        .prop_map(|(mut b, e, p)| {
            b.pad_cnt = ((4 - p.len() % 4) % 4) as u8;
            (b, e, p)
        })
}

fn ip() -> impl Strategy<Value = IpRepr> {
    prop_oneof![
        (
            any::<[u8; 4]>(),
            any::<[u8; 4]>(),
            any::<(u8, u16, bool, u8)>()
        )
            .prop_map(
                |(s, d, (tos, ident, dont_frag, ttl))| IpRepr::V4(ipv4::Repr {
                    src: Ipv4Addr::from(s),
                    dst: Ipv4Addr::from(d),
                    tos,
                    ident,
                    dont_frag,
                    ttl,
                    payload_len: 0,
                })
            ),
        (
            any::<[u8; 16]>(),
            any::<[u8; 16]>(),
            any::<u8>(),
            0u32..1 << 20,
            any::<u8>()
        )
            .prop_map(|(s, d, traffic_class, flow_label, hop_limit)| {
                IpRepr::V6(ipv6::Repr {
                    src: Ipv6Addr::from(s),
                    dst: Ipv6Addr::from(d),
                    traffic_class,
                    flow_label,
                    hop_limit,
                    payload_len: 0,
                })
            }),
    ]
}

fn ethernet_for(ip: &IpRepr) -> impl Strategy<Value = Option<ethernet::Repr>> + use<> {
    let ethertype = match ip {
        IpRepr::V4(_) => EtherType::Ipv4,
        IpRepr::V6(_) => EtherType::Ipv6,
    };
    prop::option::weighted(
        0.9,
        (
            any::<[u8; 6]>(),
            any::<[u8; 6]>(),
            prop::option::of((0u8..8, any::<bool>(), 0u16..4096)),
        )
            .prop_map(move |(dst, src, tag)| ethernet::Repr {
                dst: MacAddr(dst),
                src: MacAddr(src),
                vlan: tag.map(|(pcp, dei, vid)| VlanTag { pcp, dei, vid }),
                ethertype,
            }),
    )
}

struct Frame {
    bytes: Vec<u8>,
    ethernet: bool,
}

fn decode(f: &Frame) -> Result<frame::Decoded<'_>, Error> {
    if f.ethernet {
        frame::decode_ethernet(&f.bytes)
    } else {
        frame::decode_ip(&f.bytes)
    }
}

fn parse(f: &Frame) -> Result<frame::Repr<'_>, Error> {
    if f.ethernet {
        frame::Repr::parse_ethernet(&f.bytes)
    } else {
        frame::Repr::parse_ip(&f.bytes)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn bth_round_trips(b in opcode().prop_flat_map(bth_for)) {
        let mut buf = [0u8; bth::HEADER_LEN];
        b.emit(&mut bth::Packet::new_unchecked(&mut buf[..])).unwrap();
        prop_assert_eq!(bth::Repr::parse(&bth::Packet::new_unchecked(&buf[..])), Ok(b));
    }

    #[test]
    fn extension_headers_round_trip(
        r in reth(), a in aeth(), d in deth(), at in atomic_eth(),
        orig in any::<u64>(), imm in any::<u32>(), inv in any::<u32>(),
    ) {
        let mut b = [0u8; 28];
        r.emit(&mut reth::Packet::new_unchecked(&mut b[..])).unwrap();
        prop_assert_eq!(reth::Repr::parse(&reth::Packet::new_unchecked(&b[..])), Ok(r));
        a.emit(&mut aeth::Packet::new_unchecked(&mut b[..])).unwrap();
        prop_assert_eq!(aeth::Repr::parse(&aeth::Packet::new_unchecked(&b[..])), Ok(a));
        d.emit(&mut deth::Packet::new_unchecked(&mut b[..])).unwrap();
        prop_assert_eq!(deth::Repr::parse(&deth::Packet::new_unchecked(&b[..])), Ok(d));
        at.emit(&mut atomic::eth::Packet::new_unchecked(&mut b[..])).unwrap();
        prop_assert_eq!(atomic::eth::Repr::parse(&atomic::eth::Packet::new_unchecked(&b[..])), Ok(at));
        let ack = atomic::ack::Repr { orig };
        ack.emit(&mut atomic::ack::Packet::new_unchecked(&mut b[..])).unwrap();
        prop_assert_eq!(atomic::ack::Repr::parse(&atomic::ack::Packet::new_unchecked(&b[..])), Ok(ack));
        let i = immdt::Repr { imm };
        i.emit(&mut immdt::Packet::new_unchecked(&mut b[..])).unwrap();
        prop_assert_eq!(immdt::Repr::parse(&immdt::Packet::new_unchecked(&b[..])), Ok(i));
        let e = ieth::Repr { rkey: Rkey(inv) };
        e.emit(&mut ieth::Packet::new_unchecked(&mut b[..])).unwrap();
        prop_assert_eq!(ieth::Repr::parse(&ieth::Packet::new_unchecked(&b[..])), Ok(e));
    }

    #[test]
    fn grh_round_trips(ip in ip(), len in 0usize..4200) {
        let g = match ip {
            IpRepr::V4(r) => IpRepr::V4(ipv4::Repr { payload_len: len, ..r }),
            IpRepr::V6(r) => IpRepr::V6(ipv6::Repr { payload_len: len, ..r }),
        };
        let mut b = [0u8; grh::HEADER_LEN];
        grh::emit(&g, &mut grh::Packet::new_unchecked(&mut b[..])).unwrap();
        prop_assert_eq!(grh::parse(&grh::Packet::new_unchecked(&b[..])), Ok(g));
    }

    #[test]
    fn packets_round_trip((b, e, p) in packet_parts()) {
        let r = packet::Repr { bth: b, ext: e, payload: &p };
        let mut buf = vec![0u8; r.buffer_len()];
        r.emit(&mut packet::Packet::new_unchecked(&mut buf[..])).unwrap();
        let parsed = packet::Repr::parse(&packet::Packet::new_checked(&buf[..]).unwrap()).unwrap();
        prop_assert_eq!(parsed, r);
        let mut again = vec![0u8; parsed.buffer_len()];
        parsed.emit(&mut packet::Packet::new_unchecked(&mut again[..])).unwrap();
        prop_assert_eq!(again, buf);
    }

    #[test]
    fn frames_round_trip_with_a_good_icrc(
        (b, e, p) in packet_parts(),
        (ip, eth) in ip().prop_flat_map(|ip| (Just(ip), ethernet_for(&ip))),
        src_port in any::<u16>(),
        checksum in any::<bool>(),
    ) {
        let repr = frame::Repr {
            ethernet: eth,
            ip,
            udp: udp::Repr { src_port, checksum },
            roce: packet::Repr { bth: b, ext: e, payload: &p },
        };
        let f = Frame { bytes: { let mut v = vec![0; repr.buffer_len()]; repr.emit(&mut v).unwrap(); v }, ethernet: eth.is_some() };
        let d = decode(&f).unwrap();
        prop_assert!(d.icrc.is_good());
        // The IP payload length is derived on emit; compare everything else.
        let mut want = repr;
        want.ip = d.repr.ip;
        prop_assert_eq!(d.repr, want);
        prop_assert_eq!(d.repr.ip.src(), repr.ip.src());
        prop_assert_eq!(d.repr.ip.dst(), repr.ip.dst());
        let mut again = vec![0; d.repr.buffer_len()];
        d.repr.emit(&mut again).unwrap();
        prop_assert_eq!(again, f.bytes.clone());
    }

    #[test]
    fn a_flipped_bit_is_always_caught(
        (b, e, p) in packet_parts(),
        ip in ip(),
        checksum in any::<bool>(),
        pick in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let repr = frame::Repr {
            ethernet: None,
            ip,
            udp: udp::Repr { src_port: 0xc000, checksum },
            roce: packet::Repr { bth: b, ext: e, payload: &p },
        };
        let mut f = Frame { bytes: vec![0; repr.buffer_len()], ethernet: false };
        repr.emit(&mut f.bytes).unwrap();
        let at = pick.index(f.bytes.len());
        f.bytes[at] ^= 1 << bit;
        let ip_len = repr.ip.buffer_len();
        let bth_fb = ip_len + udp::HEADER_LEN + 4;
        // Fields the ICRC deliberately leaves out and nothing else covers:
        // the IPv6 traffic class, flow label and hop limit, and BTH byte 4
        // (FECN, BECN, reserved) unless a UDP checksum covers it. Every
        // other flip must be rejected.
        let variant = match repr.ip {
            IpRepr::V6(_) => (at < 4 && !(at == 0 && bit >= 4)) || at == 7,
            IpRepr::V4(_) => false,
        };
        if at == bth_fb && checksum {
            // Outside the ICRC, but inside the UDP checksum.
            prop_assert!(
                matches!(parse(&f), Err(Error::BadUdpChecksum { .. })),
                "flip of bit {} in BTH byte 4 with a UDP checksum", bit
            );
        } else if variant || at == bth_fb {
            // Still a valid packet, with the same payload.
            let r = parse(&f);
            prop_assert!(r.is_ok(), "flip of masked bit {} in byte {}: {:?}", bit, at, r);
            prop_assert_eq!(r.unwrap().roce.payload, &p[..]);
        } else {
            prop_assert!(parse(&f).is_err(), "flip of bit {} in byte {} accepted", bit, at);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = frame::decode_ethernet(&bytes);
        let _ = frame::decode_ip(&bytes);
        let _ = packet::Packet::new_checked(&bytes[..]).and_then(|p| packet::Repr::parse(&p));
        let _ = grh::Packet::new_checked(&bytes[..]).and_then(|p| grh::parse(&p));
    }
}
