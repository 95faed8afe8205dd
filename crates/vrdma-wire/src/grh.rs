//! The Global Route Header as a UD receive buffer holds it.
//!
//! Every receive on a UD QP starts with 40 bytes for the GRH (IBTA Vol1
//! §11.4.1.2, "the first 40 bytes of the receive buffer"). On RoCEv2 the
//! GRH is the IP header of the received packet: an IPv6 header fills all 40
//! bytes; an IPv4 header occupies the last 20 and the first 20 are zero
//! (what Linux rxe writes and what `ibv_init_ah_from_wc` looks for). Its
//! meaning is therefore an [`IpRepr`], read by [`parse`] and written
//! by [`emit`].

use crate::{Error, Header, Result, frame::IpRepr, ipv4, ipv6};

/// Length of the GRH area.
pub const HEADER_LEN: usize = 40;
/// Offset of an IPv4 header inside the GRH area.
pub const IPV4_OFFSET: usize = HEADER_LEN - ipv4::HEADER_LEN;

crate::fixed_view!(
    "A view over the 40-byte GRH area of a UD receive buffer.",
    Header::Grh,
    HEADER_LEN
);

/// Reads the GRH area. An area that starts with 20 zero bytes holds an
/// IPv4 header (checksum verified, no options); otherwise it must hold an
/// IPv6 header. Either must carry UDP.
pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<IpRepr> {
    p.check_len()?;
    let d = &p.buffer.as_ref()[..HEADER_LEN];
    if d[..IPV4_OFFSET].iter().all(|&b| b == 0) {
        let v = ipv4::Packet::new_unchecked(&d[IPV4_OFFSET..]);
        if v.version() != 4 || v.ihl() != 5 {
            return Err(Error::BadGrh);
        }
        let payload_len = usize::from(v.total_len()).saturating_sub(ipv4::HEADER_LEN);
        ipv4::Repr::parse_header(&v, payload_len).map(IpRepr::V4)
    } else {
        // The IPv6 payload is not in the area: only the header is read.
        let v = ipv6::Packet::new_unchecked(d);
        if v.version() != 6 {
            return Err(Error::BadGrh);
        }
        ipv6::Repr::parse_header(&v).map(IpRepr::V6)
    }
}

/// Fills the 40-byte area with `ip`'s header.
pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(ip: &IpRepr, p: &mut Packet<T>) -> Result<()> {
    p.check_len()?;
    let d = &mut p.buffer.as_mut()[..HEADER_LEN];
    match ip {
        IpRepr::V4(r) => {
            d[..IPV4_OFFSET].fill(0);
            r.emit(&mut d[IPV4_OFFSET..])
        }
        IpRepr::V6(r) => r.emit(d),
    }
}

#[cfg(test)]
mod tests {
    use core::net::Ipv4Addr;

    use super::*;

    #[test]
    fn ipv4_grh_is_zero_prefixed() {
        let r = IpRepr::V4(ipv4::Repr {
            src: Ipv4Addr::new(10, 47, 91, 12),
            dst: Ipv4Addr::new(10, 47, 91, 11),
            tos: 0,
            ident: 7,
            dont_frag: true,
            ttl: 64,
            payload_len: 100,
        });
        let mut b = [0xaa; 40];
        emit(&r, &mut Packet::new_unchecked(&mut b[..])).unwrap();
        assert!(b[..20].iter().all(|&x| x == 0));
        assert_eq!(b[20], 0x45);
        assert_eq!(parse(&Packet::new_unchecked(&b[..])), Ok(r));
        assert_eq!(r.sgid().to_string(), "::ffff:10.47.91.12");
    }

    #[test]
    fn ipv6_grh_fills_the_area() {
        let r = IpRepr::V6(ipv6::Repr {
            src: "fe80::1".parse().unwrap(),
            dst: "fe80::2".parse().unwrap(),
            traffic_class: 0,
            flow_label: 7,
            hop_limit: 64,
            payload_len: 100,
        });
        let mut b = [0; 40];
        emit(&r, &mut Packet::new_unchecked(&mut b[..])).unwrap();
        assert_eq!(b[0] >> 4, 6);
        assert_eq!(parse(&Packet::new_unchecked(&b[..])), Ok(r));
        assert_eq!(r.dgid().to_string(), "fe80::2");
    }

    #[test]
    fn garbage_is_rejected() {
        let b = [0x11; 40];
        assert_eq!(parse(&Packet::new_unchecked(&b[..])), Err(Error::BadGrh));
        let mut z = [0; 40];
        z[20] = 0x46;
        assert_eq!(parse(&Packet::new_unchecked(&z[..])), Err(Error::BadGrh));
        assert_eq!(
            Packet::new_checked(&b[..39]),
            Err(Error::Truncated {
                header: Header::Grh,
                needed: 40,
                available: 39
            })
        );
    }
}
