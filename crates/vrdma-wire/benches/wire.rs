//! Per-packet cost of the wire layer for a 4 KiB RoCEv2 packet, side by
//! side with plain crc32fast over the same bytes (the floor: every byte has
//! to pass through the CRC once).
//!
//! Run: `cargo bench -p vrdma-wire --bench wire`

use std::{hint::black_box, net::Ipv4Addr};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use vrdma_wire::{
    Opcode, PKey, Psn, Qpn, bth,
    ethernet::{self, EtherType, MacAddr},
    frame::{self, IpRepr},
    ipv4,
    packet::{self, ExtHeaders},
    udp,
};

fn frame_4k(payload: &[u8]) -> frame::Repr<'_> {
    frame::Repr {
        ethernet: Some(ethernet::Repr {
            dst: MacAddr([0x52, 0x54, 0, 0x47, 0x91, 1]),
            src: MacAddr([0x52, 0x54, 0, 0x47, 0x91, 2]),
            vlan: None,
            ethertype: EtherType::Ipv4,
        }),
        ip: IpRepr::V4(ipv4::Repr {
            src: Ipv4Addr::new(10, 47, 91, 12),
            dst: Ipv4Addr::new(10, 47, 91, 11),
            tos: 0,
            ident: 0,
            dont_frag: true,
            ttl: 64,
            payload_len: 0,
        }),
        udp: udp::Repr {
            src_port: 0xc021,
            checksum: false,
        },
        roce: packet::Repr {
            bth: bth::Repr {
                opcode: Opcode::RcWriteMiddle,
                solicited: false,
                mig_req: false,
                pad_cnt: 0,
                pkey: PKey::DEFAULT,
                fecn: false,
                becn: false,
                dest_qp: Qpn::from_masked(0x21),
                ack_req: false,
                psn: Psn::from_masked(0x12_3456),
            },
            ext: ExtHeaders::default(),
            payload,
        },
    }
}

fn wire_4k(c: &mut Criterion) {
    let payload: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let repr = frame_4k(&payload);
    let mut bytes = vec![0; repr.buffer_len()];
    repr.emit(&mut bytes).unwrap();

    let mut g = c.benchmark_group("wire_4k");
    g.throughput(Throughput::Bytes(bytes.len() as u64));
    g.bench_function("crc32fast (floor)", |b| {
        b.iter(|| crc32fast::hash(black_box(&bytes)))
    });
    g.bench_function("parse + ICRC verify", |b| {
        b.iter(|| {
            frame::Repr::parse_ethernet(black_box(&bytes))
                .unwrap()
                .roce
                .payload
                .len()
        })
    });
    g.bench_function("ICRC only", |b| {
        b.iter(|| {
            vrdma_wire::icrc::compute(
                black_box(&bytes[14..34]),
                black_box(&bytes[34..42]),
                black_box(&bytes[42..]),
            )
        })
    });
    g.bench_function("crc32fast two updates (68 + 4086)", |b| {
        b.iter(|| {
            let mut h = crc32fast::Hasher::new();
            h.update(black_box(&bytes[..68]));
            h.update(black_box(&bytes[68..]));
            h.finalize()
        })
    });
    let mut out = vec![0; bytes.len()];
    g.bench_function("emit + ICRC", |b| {
        b.iter(|| black_box(&repr).emit(black_box(&mut out)).unwrap())
    });
    g.finish();
}

criterion_group!(benches, wire_4k);
criterion_main!(benches);
