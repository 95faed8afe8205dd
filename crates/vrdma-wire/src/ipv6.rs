//! IPv6 header (RFC 8200), as RoCEv2 uses it: UDP directly after it
//! (extension headers are not accepted).

use core::net::Ipv6Addr;

use crate::{Error, Header, Result, be, ipv4::PROTO_UDP};

/// Length of the IPv6 header.
pub const HEADER_LEN: usize = 40;

mod field {
    pub const VER_TC_FLOW: usize = 0;
    pub const PAYLOAD_LEN: usize = 4;
    pub const NEXT_HEADER: usize = 6;
    pub const HOP_LIMIT: usize = 7;
    pub const SRC: usize = 8;
    pub const DST: usize = 24;
}

crate::fixed_view!(
    "A view over an IPv6 packet (its header and what follows).",
    Header::Ipv6,
    HEADER_LEN
);

impl<T: AsRef<[u8]>> Packet<T> {
    fn word0(&self) -> u32 {
        be::u32(self.buffer.as_ref(), field::VER_TC_FLOW)
    }
    pub fn version(&self) -> u8 {
        (self.word0() >> 28) as u8
    }
    pub fn traffic_class(&self) -> u8 {
        // Bits 27..20: a byte.
        ((self.word0() >> 20) & 0xff) as u8
    }
    pub fn flow_label(&self) -> u32 {
        self.word0() & 0x000f_ffff
    }
    pub fn payload_len(&self) -> u16 {
        be::u16(self.buffer.as_ref(), field::PAYLOAD_LEN)
    }
    pub fn next_header(&self) -> u8 {
        self.buffer.as_ref()[field::NEXT_HEADER]
    }
    pub fn hop_limit(&self) -> u8 {
        self.buffer.as_ref()[field::HOP_LIMIT]
    }
    pub fn src(&self) -> Ipv6Addr {
        let mut a = [0; 16];
        a.copy_from_slice(&self.buffer.as_ref()[field::SRC..field::SRC + 16]);
        Ipv6Addr::from(a)
    }
    pub fn dst(&self) -> Ipv6Addr {
        let mut a = [0; 16];
        a.copy_from_slice(&self.buffer.as_ref()[field::DST..field::DST + 16]);
        Ipv6Addr::from(a)
    }
    /// The 40-byte header.
    pub fn header(&self) -> &[u8] {
        let d = self.buffer.as_ref();
        d.get(..HEADER_LEN).unwrap_or(d)
    }
    /// The bytes the payload length covers (empty if they are not all
    /// there; `Repr::parse` reports that).
    pub fn payload(&self) -> &[u8] {
        let end = HEADER_LEN + usize::from(self.payload_len());
        self.buffer.as_ref().get(HEADER_LEN..end).unwrap_or(&[])
    }
}

/// The meaning of an IPv6 header carrying RoCEv2.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub traffic_class: u8,
    /// 20 bits.
    pub flow_label: u32,
    pub hop_limit: u8,
    /// Bytes after the header (the UDP datagram).
    pub payload_len: usize,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
        let r = Self::parse_header(p)?;
        let available = p.buffer.as_ref().len() - HEADER_LEN;
        if r.payload_len > available {
            return Err(Error::BadLength {
                header: Header::Ipv6,
                stated: r.payload_len,
                available,
            });
        }
        Ok(r)
    }

    /// The checks and fields of [`Self::parse`] without requiring the
    /// payload to be in the buffer (a GRH area).
    pub(crate) fn parse_header<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
        p.check_len()?;
        if p.version() != 6 {
            return Err(Error::BadIpVersion(p.version(), 6));
        }
        if p.next_header() != PROTO_UDP {
            return Err(Error::NotUdp(p.next_header()));
        }
        Ok(Self {
            src: p.src(),
            dst: p.dst(),
            traffic_class: p.traffic_class(),
            flow_label: p.flow_label(),
            hop_limit: p.hop_limit(),
            payload_len: usize::from(p.payload_len()),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header into the front of `d`.
    pub fn emit(&self, d: &mut [u8]) -> Result<()> {
        crate::need(Header::Ipv6, HEADER_LEN, d.len())?;
        let len = u16::try_from(self.payload_len).map_err(|_| Error::OutOfRange {
            what: "an IPv6 payload length",
            value: self.payload_len as u64,
        })?;
        if self.flow_label > 0x000f_ffff {
            return Err(Error::OutOfRange {
                what: "a 20-bit flow label",
                value: u64::from(self.flow_label),
            });
        }
        let word0 = (6 << 28) | (u32::from(self.traffic_class) << 20) | self.flow_label;
        be::set_u32(d, field::VER_TC_FLOW, word0);
        be::set_u16(d, field::PAYLOAD_LEN, len);
        d[field::NEXT_HEADER] = PROTO_UDP;
        d[field::HOP_LIMIT] = self.hop_limit;
        d[field::SRC..field::SRC + 16].copy_from_slice(&self.src.octets());
        d[field::DST..field::DST + 16].copy_from_slice(&self.dst.octets());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let r = Repr {
            src: "fe80::1".parse().unwrap(),
            dst: "2001:db8::2".parse().unwrap(),
            traffic_class: 0xb8,
            flow_label: 0xabcde,
            hop_limit: 64,
            payload_len: 8,
        };
        let mut b = [0u8; 48];
        r.emit(&mut b).unwrap();
        assert_eq!(&b[..4], &[0x6b, 0x8a, 0xbc, 0xde]);
        assert_eq!(Repr::parse(&Packet::new_unchecked(&b[..])), Ok(r));
    }

    #[test]
    fn payload_beyond_buffer() {
        let mut b = [0u8; 44];
        b[0] = 0x60;
        b[5] = 8;
        b[6] = 17;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&b[..])),
            Err(Error::BadLength {
                header: Header::Ipv6,
                stated: 8,
                available: 4
            })
        );
    }

    #[test]
    fn wrong_version_and_next_header() {
        let mut b = [0u8; 40];
        b[0] = 0x40;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&b[..])),
            Err(Error::BadIpVersion(4, 6))
        );
        b[0] = 0x60;
        b[6] = 6;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&b[..])),
            Err(Error::NotUdp(6))
        );
    }
}
