//! The Global Route Header as a UD receive buffer holds it.
//!
//! Every receive on a UD QP starts with 40 bytes for the GRH (IBTA Vol1
//! §11.4.1.2, "the first 40 bytes of the receive buffer"). On RoCEv2 the
//! GRH is the IP header of the received packet: an IPv6 header fills all 40
//! bytes; an IPv4 header occupies the last 20 and the first 20 are zero
//! (what Linux rxe writes and what `ibv_init_ah_from_wc` looks for).

use core::net::{Ipv4Addr, Ipv6Addr};

use crate::{Error, Header, Result, ipv4, ipv6};

/// Length of the GRH area.
pub const HEADER_LEN: usize = 40;
/// Offset of an IPv4 header inside the GRH area.
pub const IPV4_OFFSET: usize = HEADER_LEN - ipv4::HEADER_LEN;

crate::fixed_view!(
    "A view over the 40-byte GRH area of a UD receive buffer.",
    Header::Grh,
    HEADER_LEN
);

/// What the GRH area says about the sender.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Repr {
    /// RoCEv2 over IPv4: the IPv4 header at offset 20.
    V4(ipv4::Repr),
    /// RoCEv2 over IPv6: the IPv6 header.
    V6(ipv6::Repr),
}

impl Repr {
    /// Reads the GRH area. An area that starts with 20 zero bytes holds an
    /// IPv4 header (its checksum is verified); otherwise it must hold an
    /// IPv6 header.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
        p.check_len()?;
        let d = &p.buffer.as_ref()[..HEADER_LEN];
        if d[..IPV4_OFFSET].iter().all(|&b| b == 0) {
            let h = &d[IPV4_OFFSET..];
            let v = ipv4::Packet::new_unchecked(h);
            if v.version() != 4 || v.ihl() != 5 {
                return Err(Error::BadGrh);
            }
            let computed = v.compute_checksum();
            if computed != v.checksum() && !cfg!(fuzzing) {
                return Err(Error::BadIpv4Checksum {
                    found: v.checksum(),
                    computed,
                });
            }
            Ok(Repr::V4(ipv4::Repr {
                src: v.src(),
                dst: v.dst(),
                tos: v.tos(),
                ident: v.ident(),
                dont_frag: v.dont_frag(),
                ttl: v.ttl(),
                payload_len: usize::from(v.total_len()).saturating_sub(ipv4::HEADER_LEN),
            }))
        } else {
            let v = ipv6::Packet::new_unchecked(d);
            if v.version() != 6 {
                return Err(Error::BadGrh);
            }
            Ok(Repr::V6(ipv6::Repr {
                src: v.src(),
                dst: v.dst(),
                traffic_class: v.traffic_class(),
                flow_label: v.flow_label(),
                hop_limit: v.hop_limit(),
                payload_len: usize::from(v.payload_len()),
            }))
        }
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Fills the 40-byte area.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        p.check_len()?;
        let d = &mut p.buffer.as_mut()[..HEADER_LEN];
        match self {
            Repr::V4(r) => {
                d[..IPV4_OFFSET].fill(0);
                r.emit(&mut d[IPV4_OFFSET..])
            }
            Repr::V6(r) => r.emit(d),
        }
    }

    /// The source GID (IPv4-mapped for IPv4).
    pub fn sgid(&self) -> crate::Gid {
        match self {
            Repr::V4(r) => r.src.into(),
            Repr::V6(r) => r.src.into(),
        }
    }

    /// The destination GID (IPv4-mapped for IPv4).
    pub fn dgid(&self) -> crate::Gid {
        match self {
            Repr::V4(r) => r.dst.into(),
            Repr::V6(r) => r.dst.into(),
        }
    }
}

/// Builds the IPv4 GRH repr for a received packet.
pub fn from_ipv4(src: Ipv4Addr, dst: Ipv4Addr, tos: u8, ttl: u8, payload_len: usize) -> Repr {
    Repr::V4(ipv4::Repr {
        src,
        dst,
        tos,
        ident: 0,
        dont_frag: true,
        ttl,
        payload_len,
    })
}

/// Builds the IPv6 GRH repr for a received packet.
pub fn from_ipv6(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    traffic_class: u8,
    flow_label: u32,
    hop_limit: u8,
    payload_len: usize,
) -> Repr {
    Repr::V6(ipv6::Repr {
        src,
        dst,
        traffic_class,
        flow_label,
        hop_limit,
        payload_len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_grh_is_zero_prefixed() {
        let r = from_ipv4(
            Ipv4Addr::new(10, 47, 91, 12),
            Ipv4Addr::new(10, 47, 91, 11),
            0,
            64,
            100,
        );
        let mut b = [0xaa; 40];
        r.emit(&mut Packet::new_unchecked(&mut b[..])).unwrap();
        assert!(b[..20].iter().all(|&x| x == 0));
        assert_eq!(b[20], 0x45);
        assert_eq!(Repr::parse(&Packet::new_unchecked(&b[..])), Ok(r));
        assert_eq!(r.sgid().to_string(), "::ffff:10.47.91.12");
    }

    #[test]
    fn ipv6_grh_fills_the_area() {
        let r = from_ipv6(
            "fe80::1".parse().unwrap(),
            "fe80::2".parse().unwrap(),
            0,
            7,
            64,
            100,
        );
        let mut b = [0; 40];
        r.emit(&mut Packet::new_unchecked(&mut b[..])).unwrap();
        assert_eq!(b[0] >> 4, 6);
        assert_eq!(Repr::parse(&Packet::new_unchecked(&b[..])), Ok(r));
    }

    #[test]
    fn garbage_is_rejected() {
        let b = [0x11; 40];
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&b[..])),
            Err(Error::BadGrh)
        );
        let mut z = [0; 40];
        z[20] = 0x46;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&z[..])),
            Err(Error::BadGrh)
        );
        assert!(Packet::new_checked(&b[..39]).is_err());
    }
}
