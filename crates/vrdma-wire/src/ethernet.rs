//! Ethernet II framing with an optional 802.1Q tag.

use core::fmt;

use crate::{Error, Header, Result, be};

/// Length of an untagged Ethernet II header.
pub const HEADER_LEN: usize = 14;
/// Length of the 802.1Q tag (TPID + TCI).
pub const VLAN_LEN: usize = 4;

const TPID_8021Q: u16 = 0x8100;

mod field {
    pub const DST: usize = 0;
    pub const SRC: usize = 6;
    pub const ETHERTYPE: usize = 12;
    pub const TCI: usize = 14;
    pub const INNER_ETHERTYPE: usize = 16;
}

/// A MAC address.
#[derive(Clone, Copy, Default, Eq, Hash, PartialEq)]
pub struct MacAddr(pub [u8; 6]);

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MacAddr({self})")
    }
}

/// The network protocols RoCEv2 runs over.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum EtherType {
    Ipv4,
    Ipv6,
}

impl EtherType {
    pub const fn value(self) -> u16 {
        match self {
            EtherType::Ipv4 => 0x0800,
            EtherType::Ipv6 => 0x86dd,
        }
    }

    pub(crate) fn from_value(v: u16) -> Result<Self> {
        match v {
            0x0800 => Ok(EtherType::Ipv4),
            0x86dd => Ok(EtherType::Ipv6),
            other => Err(Error::UnsupportedEtherType(other)),
        }
    }
}

/// An 802.1Q tag control field.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct VlanTag {
    /// Priority code point (3 bits).
    pub pcp: u8,
    /// Drop eligible indicator.
    pub dei: bool,
    /// VLAN identifier (12 bits).
    pub vid: u16,
}

impl VlanTag {
    pub(crate) const fn from_tci(tci: u16) -> Self {
        Self {
            pcp: (tci >> 13) as u8,
            dei: tci & 0x1000 != 0,
            vid: tci & 0x0fff,
        }
    }

    pub(crate) const fn tci(self) -> u16 {
        ((self.pcp as u16 & 0x7) << 13) | ((self.dei as u16) << 12) | (self.vid & 0x0fff)
    }
}

/// A view over an Ethernet II frame.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Frame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Frame<T> {
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    pub fn new_checked(buffer: T) -> Result<Self> {
        let f = Self::new_unchecked(buffer);
        f.check_len()?;
        Ok(f)
    }

    /// Checks the header, and the 802.1Q tag if the frame has one.
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        crate::need(Header::Ethernet, HEADER_LEN, len)?;
        if self.tagged() {
            crate::need(Header::Vlan, HEADER_LEN + VLAN_LEN, len)?;
        }
        Ok(())
    }

    pub fn dst(&self) -> MacAddr {
        let mut m = [0; 6];
        m.copy_from_slice(&self.buffer.as_ref()[field::DST..field::DST + 6]);
        MacAddr(m)
    }

    pub fn src(&self) -> MacAddr {
        let mut m = [0; 6];
        m.copy_from_slice(&self.buffer.as_ref()[field::SRC..field::SRC + 6]);
        MacAddr(m)
    }

    /// True when an 802.1Q tag follows the addresses.
    pub fn tagged(&self) -> bool {
        let d = self.buffer.as_ref();
        d.len() >= HEADER_LEN && be::u16(d, field::ETHERTYPE) == TPID_8021Q
    }

    /// The 802.1Q tag, if any.
    pub fn vlan(&self) -> Option<VlanTag> {
        self.tagged()
            .then(|| VlanTag::from_tci(be::u16(self.buffer.as_ref(), field::TCI)))
    }

    /// The EtherType of the payload (inside the tag, if tagged).
    pub fn ethertype(&self) -> u16 {
        let at = if self.tagged() {
            field::INNER_ETHERTYPE
        } else {
            field::ETHERTYPE
        };
        be::u16(self.buffer.as_ref(), at)
    }

    /// Length of the header, tag included.
    pub fn header_len(&self) -> usize {
        if self.tagged() {
            HEADER_LEN + VLAN_LEN
        } else {
            HEADER_LEN
        }
    }

    /// The bytes after the header.
    pub fn payload(&self) -> &[u8] {
        let d = self.buffer.as_ref();
        d.get(self.header_len()..).unwrap_or(&[])
    }
}

/// The meaning of an Ethernet header.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr {
    pub dst: MacAddr,
    pub src: MacAddr,
    pub vlan: Option<VlanTag>,
    pub ethertype: EtherType,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]> + ?Sized>(f: &Frame<&T>) -> Result<Self> {
        f.check_len()?;
        Ok(Self {
            dst: f.dst(),
            src: f.src(),
            vlan: f.vlan(),
            ethertype: EtherType::from_value(f.ethertype())?,
        })
    }

    pub const fn buffer_len(&self) -> usize {
        if self.vlan.is_some() {
            HEADER_LEN + VLAN_LEN
        } else {
            HEADER_LEN
        }
    }

    /// Writes the header into the front of `d`.
    pub fn emit(&self, d: &mut [u8]) -> Result<()> {
        crate::need(Header::Ethernet, self.buffer_len(), d.len())?;
        d[field::DST..field::DST + 6].copy_from_slice(&self.dst.0);
        d[field::SRC..field::SRC + 6].copy_from_slice(&self.src.0);
        match self.vlan {
            Some(tag) => {
                be::set_u16(d, field::ETHERTYPE, TPID_8021Q);
                be::set_u16(d, field::TCI, tag.tci());
                be::set_u16(d, field::INNER_ETHERTYPE, self.ethertype.value());
            }
            None => be::set_u16(d, field::ETHERTYPE, self.ethertype.value()),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tagged_round_trip() {
        let r = Repr {
            dst: MacAddr([2, 0, 0, 0, 0, 1]),
            src: MacAddr([2, 0, 0, 0, 0, 2]),
            vlan: Some(VlanTag {
                pcp: 5,
                dei: true,
                vid: 0x123,
            }),
            ethertype: EtherType::Ipv6,
        };
        let mut b = [0; 18];
        r.emit(&mut b).unwrap();
        assert_eq!(&b[12..], &[0x81, 0x00, 0xb1, 0x23, 0x86, 0xdd]);
        assert_eq!(Repr::parse(&Frame::new_unchecked(&b[..])), Ok(r));
    }

    #[test]
    fn truncated_tag() {
        let mut b = [0; 16];
        b[12] = 0x81;
        assert_eq!(
            Frame::new_checked(&b[..]),
            Err(Error::Truncated {
                header: Header::Vlan,
                needed: 18,
                available: 16
            })
        );
    }

    #[test]
    fn arp_is_rejected() {
        let mut b = [0; 14];
        b[12] = 0x08;
        b[13] = 0x06;
        assert_eq!(
            Repr::parse(&Frame::new_unchecked(&b[..])),
            Err(Error::UnsupportedEtherType(0x0806))
        );
    }
}
