//! Where the faces' test devices live: each test binary a block of
//! loopback addresses of its own, 127.N.0.0/16, handed out one by one
//! (from 127.N.0.1; no address ends in 0 or 255), and each device's MAC
//! made of its address. Both faces' kits (`pvrdma::Net`, `virtio::Net`)
//! hand out their devices' addresses from a [`Block`].

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::atomic::{AtomicU32, Ordering},
};

/// A test binary's block of loopback addresses.
#[derive(Debug)]
pub struct Block {
    block: u8,
    next: AtomicU32,
}

impl Block {
    pub const fn new(block: u8) -> Self {
        assert!(block != 0, "127.0.x.y is the older suites'");
        Block {
            block,
            next: AtomicU32::new(0),
        }
    }

    /// An address no other device of this binary has.
    pub fn addr(&self) -> IpAddr {
        let k = self.next.fetch_add(1, Ordering::Relaxed);
        let (hi, lo) = (k / 254, k % 254 + 1);
        let hi = u8::try_from(hi).expect("fewer than 65 024 devices in one binary");
        IpAddr::V4(Ipv4Addr::new(127, self.block, hi, lo as u8))
    }
}

/// The MAC of the device at `addr` (locally administered, unicast, its
/// last four bytes the IPv4 address's).
pub fn mac_of(addr: IpAddr) -> [u8; 6] {
    let o = match addr {
        IpAddr::V4(a) => a.octets(),
        IpAddr::V6(a) => {
            let b = a.octets();
            [b[12], b[13], b[14], b[15]]
        }
    };
    [2, 0, o[0], o[1], o[2], o[3]]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_distinct_and_never_end_in_0_or_255() {
        let b = Block::new(42);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            let a = b.addr();
            let IpAddr::V4(v4) = a else { panic!("IPv4") };
            let o = v4.octets();
            assert_eq!((o[0], o[1]), (127, 42));
            assert!(o[3] != 0 && o[3] != 255, "{a}");
            assert!(seen.insert(a), "{a} twice");
        }
        assert_eq!(mac_of("127.42.0.1".parse().unwrap()), [2, 0, 127, 42, 0, 1]);
    }
}
