//! Hostile datagrams as a UDP socket delivers them: `unframe_datagram`
//! (rebuilding the IP/UDP headers from the socket's metadata, the ICRC
//! check with IPv4 Identification recovery) must never panic, and what it
//! accepts must describe the datagram it was given. The first 40 bytes
//! choose the metadata; the rest is the payload.
#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use libfuzzer_sys::fuzz_target;
use vrdma_wire::frame;

fuzz_target!(|data: &[u8]| {
    let Some((meta, roce)) = data.split_at_checked(40) else {
        return;
    };
    let v4 = |b: &[u8]| IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]));
    let v6 = |b: &[u8]| IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(b).unwrap()));
    let (src, dst) = match meta[0] % 4 {
        0 => (v4(&meta[4..8]), v4(&meta[8..12])),
        1 => (v6(&meta[4..20]), v6(&meta[20..36])),
        2 => (v4(&meta[4..8]), v6(&meta[20..36])),
        _ => (v6(&meta[4..20]), v4(&meta[8..12])),
    };
    let info = frame::DatagramInfo {
        src: SocketAddr::new(src, u16::from_be_bytes([meta[1], meta[2]])),
        dst,
        traffic_class: meta[3],
        hop_limit: meta[36],
        flow_label: u32::from_be_bytes([0, meta[37], meta[38], meta[39]]),
    };
    if let Ok(u) = frame::unframe_datagram(&info, roce) {
        assert_eq!(u.roce, roce);
        assert_eq!(u.ip.src(), src);
        assert_eq!(u.ip.dst(), dst);
        assert_eq!(u.udp.src_port, info.src.port());
    }
});
