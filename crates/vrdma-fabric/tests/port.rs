//! The UDP port alone, no engine: packets written into its slot — whole,
//! or as headers and trailer around a payload lent from memory — leave
//! sealed with the ICRC of the headers the kernel writes (alone and in GSO
//! runs), and the receiving port hands over exactly those packets, their
//! ICRC verified, with the IP header they came in.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vrdma_fabric::{
    Piece,
    udp::{Config, Outgoing, UdpPort},
};
use vrdma_wire::{
    Gid, Opcode, PKey, Psn, Qpn, bth,
    frame::{IpRepr, Route},
    packet::{self, ExtHeaders},
};

const MEM: u64 = 0x1_0000;

fn port(last: u8, gso: bool) -> UdpPort {
    let mut c = Config::new(IpAddr::V4(Ipv4Addr::new(127, 0, 8, last)));
    c.gso = gso;
    UdpPort::bind(c).expect("bind")
}

/// The headers of an RC SEND_ONLY of `len` payload bytes with PSN `psn`,
/// written at the front of `out`; where the payload goes.
fn headers(out: &mut [u8], psn: u32, len: usize) -> usize {
    let repr = bth::Repr {
        opcode: Opcode::RcSendOnly,
        solicited: false,
        mig_req: false,
        pad_cnt: 0,
        pkey: PKey::DEFAULT,
        fecn: false,
        becn: false,
        dest_qp: Qpn::from_masked(0x11),
        ack_req: true,
        psn: Psn::from_masked(psn),
    };
    let n = packet::packet_len(Opcode::RcSendOnly, len);
    packet::emit_headers(&mut out[..n], &repr, &ExtHeaders::default(), len).unwrap()
}

#[test]
fn whole_and_lent_packets_arrive_sealed_with_their_ip_headers() {
    for gso in [false, true] {
        let mut tx = port(1, gso);
        let mut rx = port(2, gso);
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(MEM), 0x4000)]).unwrap();
        let pattern: Vec<u8> = (0..0x4000).map(|i| (i * 7 + 3) as u8).collect();
        mem.write_slice(&pattern, GuestAddress(MEM)).unwrap();
        let route = Route {
            src: tx.gid(),
            dst: rx.gid(),
            traffic_class: 0x20,
            hop_limit: 9,
            flow_label: 0,
        };
        let mut want: Vec<Vec<u8>> = Vec::new();
        // 20 equal lent packets (a GSO run), each payload in two pieces
        // (as across a page); then 3 whole ones; then one whose lent memory
        // is not there (dropped, counted); then one more lent.
        for k in 0..25u32 {
            let len = 1000;
            let lent: Vec<Piece> = match k {
                0..20 | 24 => vec![
                    Piece {
                        addr: MEM + u64::from(k) * 100,
                        len: 300,
                    },
                    Piece {
                        addr: MEM + 0x2000 + u64::from(k),
                        len: 700,
                    },
                ],
                23 => vec![Piece {
                    addr: MEM + 0x10_0000,
                    len: 1000,
                }],
                _ => vec![],
            };
            let mut sent = if tx.is_full() { tx.flush(&mem) } else { 0 };
            let slot = tx.slot();
            let at = headers(slot, k, len);
            let total = at + len + packet::ICRC_LEN;
            let mut packet = slot[..at].to_vec();
            if lent.is_empty() {
                for (i, b) in slot[at..at + len].iter_mut().enumerate() {
                    *b = (i as u32 ^ k) as u8;
                }
                packet.extend_from_slice(&slot[at..at + len]);
            } else {
                // The bytes after the payload (the ICRC field) follow the
                // headers in the slot.
                for p in &lent {
                    let mut piece = vec![0; p.len];
                    if mem.read_slice(&mut piece, GuestAddress(p.addr)).is_ok() {
                        packet.extend(piece);
                    }
                }
            }
            sent += tx.queue(
                &Outgoing {
                    route,
                    src_port: 0xc011,
                    len: total,
                    payload_at: at,
                    lent: &lent,
                },
                &mem,
            );
            assert_eq!(sent, 0, "the batch had room and one socket");
            if k != 23 {
                want.push(packet);
            }
        }
        assert_eq!(tx.flush(&mem), want.len(), "gso {gso}");
        assert_eq!(tx.stats().tx_failed, 1, "the packet whose memory was gone");
        let mut got: Vec<(IpRepr, Vec<u8>)> = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while got.len() < want.len() && Instant::now() < deadline {
            rx.receive(|ip, roce| got.push((*ip, roce.to_vec())))
                .unwrap();
        }
        assert_eq!(
            got.len(),
            want.len(),
            "gso {gso}: every good packet, ICRC verified"
        );
        assert_eq!(rx.stats().rx_bad_icrc, 0);
        for (k, ((ip, roce), w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(Gid::from(ip.src()), route.src, "packet {k}");
            assert_eq!(Gid::from(ip.dst()), route.dst, "packet {k}");
            assert_eq!(
                &roce[..roce.len() - packet::ICRC_LEN],
                &w[..],
                "packet {k}, gso {gso}: bytes"
            );
        }
    }
}
