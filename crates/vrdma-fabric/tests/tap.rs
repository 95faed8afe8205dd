//! The TAP uplink against the kernel's own network stack: two ports whose
//! TAPs are on one bridge, in a network namespace of the test's own (the
//! test needs root, as CI has). A message of equal packets leaves one port
//! as UDP GSO frames; the other port reads them
//!
//! - whole, where its TAP takes UDP segmentation (the bridge passes the
//!   frame on as it is) and cuts them itself, or
//! - cut by the kernel, where its TAP does not (the bridge segments in
//!   software, numbering the IPv4 Identifications as a NIC would),
//!
//! and in both cases every packet arrives once, in order, byte for byte,
//! its ICRC — sealed by the sender for the Identification it would carry —
//! verified against the header it came with. Frames for an address that
//! is not the device's go to the guest with their UDP checksum written.

use std::{
    io::Read,
    net::{IpAddr, Ipv4Addr},
    os::unix::net::UnixStream,
    process::Command,
    time::{Duration, Instant},
};

use nix::{
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sched::{CloneFlags, unshare},
};
use vrdma_fabric::{
    NoLender,
    eth::{EthPort, Link},
};
use vrdma_wire::{Gid, frame::Route, udp};

const MAC_A: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0a];
const MAC_B: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0b];
const A: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 2);
/// An address on B's side that is not its device's: the guest's.
const GUEST_B: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 3);

/// Runs `f` on a thread of its own in a new network namespace (a thread's
/// namespace is its own; the processes it starts inherit it).
fn in_netns<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            unshare(CloneFlags::CLONE_NEWNET)
                .expect("a network namespace of the test's own (root)");
            f()
        })
        .join()
        .unwrap()
    })
}

fn ip(args: &str) {
    let st = Command::new("ip")
        .args(args.split(' '))
        .status()
        .expect("iproute2's ip");
    assert!(st.success(), "ip {args}");
}

/// The two ports on one bridge: A's TAP with offloads, B's as `b_link`
/// opens it; each port's guest side is one end of a socket pair.
fn ports(b_link: fn(&str) -> std::io::Result<Link>) -> [(EthPort, UnixStream); 2] {
    ip("link set lo up");
    ip("link add br0 type bridge");
    let (ga, guest_a) = UnixStream::pair().unwrap();
    let a = EthPort::with_stream(ga, Link::tap("vta").unwrap(), MAC_A).unwrap();
    let (gb, guest_b) = UnixStream::pair().unwrap();
    let mut b = EthPort::with_stream(gb, b_link("vtb").unwrap(), MAC_B).unwrap();
    b.set_local(&[Gid::from(B)]);
    for t in ["vta", "vtb"] {
        ip(&format!("link set {t} mtu 1500 master br0 up"));
    }
    ip("link set br0 up");
    [(a, guest_a), (b, guest_b)]
}

/// Sends `count` packets of `len` bytes to `dst` from port `a`, the
/// packets of one message (consecutive Identifications), then flushes.
fn send(a: &mut EthPort, dst: Ipv4Addr, count: usize, len: usize) {
    let route = Route {
        src: Gid::from(A),
        dst: Gid::from(dst),
        traffic_class: 0,
        hop_limit: 64,
        flow_label: 0,
    };
    for k in 0..count {
        let slot = a.slot();
        slot[..len].fill(0);
        // A BTH's worth of header: its PSN field says which packet.
        slot[0] = 0x0a;
        slot[9..12].copy_from_slice(&(k as u32).to_be_bytes()[1..]);
        slot[12..len - 4].fill(k as u8);
        let sent = a
            .queue(&route, 0xc001, Some(MAC_B), len, len, &[], &NoLender)
            .unwrap();
        assert_eq!(sent, 1);
    }
    a.flush().unwrap();
}

/// What port `b` delivers to its device until `count` packets came (or
/// ten seconds passed): each packet's bytes.
fn receive(b: &mut EthPort, count: usize) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.len() < count && Instant::now() < deadline {
        let mut p = [PollFd::new(b.fd(), PollFlags::POLLIN)];
        poll(&mut p, PollTimeout::from(100u16)).unwrap();
        b.receive(|ip, roce| {
            assert_eq!(ip.src(), IpAddr::V4(A));
            got.push(roce.to_vec());
        })
        .unwrap();
    }
    got
}

/// Checks that the packets `got` are the `count` sent, in order.
fn check(got: &[Vec<u8>], count: usize, len: usize) {
    assert_eq!(got.len(), count, "every packet, once");
    for (k, p) in got.iter().enumerate() {
        assert_eq!(p.len(), len);
        assert_eq!(&p[9..12], &(k as u32).to_be_bytes()[1..], "in order");
        assert!(p[12..len - 4].iter().all(|&b| b == k as u8), "its bytes");
    }
}

#[test]
fn a_message_crosses_a_bridge_as_gso_frames_and_is_cut_by_the_reader() {
    in_netns(|| {
        let [(mut a, _ga), (mut b, _gb)] = ports(Link::tap);
        // 1 024 B payloads and their headers: what path MTU 1024 makes.
        let (count, len) = (200, 12 + 1024 + 4);
        send(&mut a, B, count, len);
        let got = receive(&mut b, count);
        check(&got, count, len);
        let (sa, sb) = (a.stats(), b.stats());
        assert!(sa.uplink_gso_tx > 0, "A wrote GSO frames: {sa:?}");
        assert!(sb.uplink_gso_rx > 0, "B read GSO frames: {sb:?}");
        assert_eq!(sb.bad_roce + sb.bad_vnet, 0, "{sb:?}");
        // A frame written holds at most 64 packets.
        assert!(sa.uplink_gso_tx >= (count as u64).div_ceil(64));
    });
}

#[test]
fn a_tap_without_offloads_gets_the_kernels_segments_and_every_icrc_holds() {
    in_netns(|| {
        let [(mut a, _ga), (mut b, _gb)] = ports(Link::tap_whole);
        let (count, len) = (150, 12 + 1024 + 4);
        send(&mut a, B, count, len);
        let got = receive(&mut b, count);
        check(&got, count, len);
        let (sa, sb) = (a.stats(), b.stats());
        assert!(sa.uplink_gso_tx > 0, "A wrote GSO frames: {sa:?}");
        // The bridge cut them: each packet a frame of its own, its
        // Identification the kernel's, its ICRC verified against it.
        assert_eq!(sb.uplink_gso_rx, 0, "{sb:?}");
        assert_eq!(sb.bad_roce + sb.bad_vnet, 0, "{sb:?}");
    });
}

#[test]
fn roce_for_the_guests_address_reaches_the_guest_with_its_checksum_written() {
    in_netns(|| {
        let [(mut a, _ga), (mut b, mut guest_b)] = ports(Link::tap);
        let (count, len) = (40, 12 + 1024 + 4);
        send(&mut a, GUEST_B, count, len);
        guest_b.set_nonblocking(true).unwrap();
        let mut stream = Vec::new();
        let mut frames = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while frames.len() < count && Instant::now() < deadline {
            let mut p = [PollFd::new(b.fd(), PollFlags::POLLIN)];
            poll(&mut p, PollTimeout::from(100u16)).unwrap();
            b.receive(|_, _| panic!("not the device's")).unwrap();
            let mut buf = [0u8; 65536];
            while let Ok(n) = guest_b.read(&mut buf) {
                if n == 0 {
                    break;
                }
                stream.extend_from_slice(&buf[..n]);
            }
            // Length-prefixed frames; the RoCE ones kept.
            while stream.len() >= 4 {
                let l = u32::from_be_bytes(stream[..4].try_into().unwrap()) as usize;
                if stream.len() < 4 + l {
                    break;
                }
                let f: Vec<u8> = stream.drain(..4 + l).skip(4).collect();
                if f.len() > 42 && f[23] == 17 && f[36..38] == 4791u16.to_be_bytes() {
                    frames.push(f);
                }
            }
        }
        assert_eq!(frames.len(), count);
        assert!(b.stats().uplink_gso_rx > 0, "{:?}", b.stats());
        for f in &frames {
            let datagram = &f[34..];
            let ph = udp::PseudoHeader::V4 {
                src: A,
                dst: GUEST_B,
            };
            let found = u16::from_be_bytes([datagram[6], datagram[7]]);
            assert_ne!(found, 0);
            assert_eq!(
                found,
                udp::compute_checksum(ph, datagram),
                "a whole checksum"
            );
        }
    });
}

#[test]
fn a_frame_longer_than_the_port_carries_is_dropped_and_counted() {
    in_netns(|| {
        let [(_a, _ga), (mut b, _gb)] = ports(Link::tap_whole);
        // The operator's TAP takes 64 KB frames; the port carries 9 KB.
        ip("link set vtb mtu 65000");
        ip("addr add 10.9.1.1/24 dev vtb");
        ip("neigh add 10.9.1.2 lladdr 02:00:00:00:00:0b dev vtb nud permanent");
        let s = std::net::UdpSocket::bind("10.9.1.1:0").unwrap();
        s.send_to(&[7u8; 20_000], "10.9.1.2:9").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while b.stats().oversize == 0 && Instant::now() < deadline {
            let mut p = [PollFd::new(b.fd(), PollFlags::POLLIN)];
            poll(&mut p, PollTimeout::from(100u16)).unwrap();
            b.receive(|_, _| panic!("not the device's")).unwrap();
        }
        assert_eq!(b.stats().oversize, 1, "{:?}", b.stats());
    });
}
