//! The VXLAN header (RFC 7348 §5): 8 bytes between a UDP header to port
//! 4789 and the tenant's Ethernet frame, naming the 24-bit segment (VNI).
//!
//! ```text
//!  0                   1                   2                   3
//! |R|R|R|R|I|R|R|R|            Reserved                           |
//! |                VXLAN Network Identifier (VNI) |   Reserved    |
//! ```
//!
//! The I flag must be set (a VXLAN header without it names no segment);
//! the other flag bits and the reserved fields are ignored on receipt and
//! sent as zero, as the RFC asks. A tool path, through [`crate::encap`].

use crate::{Error, Header, Result, Vni, be};

/// The UDP destination port IANA assigned to VXLAN (RFC 7348 §5). Linux's
/// older default, 8472, is not treated as VXLAN.
pub const UDP_PORT: u16 = 4789;
/// Length of the VXLAN header.
pub const HEADER_LEN: usize = 8;
/// The I flag: the VNI is valid.
pub const FLAG_I: u8 = 0x08;

mod field {
    pub const FLAGS: usize = 0;
    pub const VNI: usize = 4;
}

crate::fixed_view!(
    "A view over a VXLAN header and the Ethernet frame it carries.",
    Header::Vxlan,
    HEADER_LEN
);

impl<T: AsRef<[u8]>> Packet<T> {
    /// The flags byte (I is 0x08).
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }
    /// The VNI field, whatever the I flag says.
    pub fn vni(&self) -> Vni {
        Vni::from_masked(be::u24(self.buffer.as_ref(), field::VNI))
    }
    /// The inner Ethernet frame.
    pub fn payload(&self) -> &[u8] {
        self.buffer.as_ref().get(HEADER_LEN..).unwrap_or(&[])
    }
}

/// The meaning of a VXLAN header: the segment.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr {
    pub vni: Vni,
}

impl Repr {
    /// Parses the header: [`Error::BadVxlanFlags`] when the I flag is
    /// clear; reserved bits ignored.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
        p.check_len()?;
        if p.flags() & FLAG_I == 0 {
            return Err(Error::BadVxlanFlags(p.flags()));
        }
        Ok(Self { vni: p.vni() })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header into the front of `d`: the I flag, the VNI,
    /// reserved bits zero.
    pub fn emit(&self, d: &mut [u8]) -> Result<()> {
        crate::need(Header::Vxlan, HEADER_LEN, d.len())?;
        d[..HEADER_LEN].fill(0);
        d[field::FLAGS] = FLAG_I;
        be::set_u24(d, field::VNI, self.vni.value());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The VXLAN header of a Linux vxlan device's frame, VNI 5001.
    static HEADER: [u8; 8] = [0x08, 0x00, 0x00, 0x00, 0x00, 0x13, 0x89, 0x00];

    #[test]
    fn deconstruct_and_construct() {
        let p = Packet::new_checked(&HEADER[..]).unwrap();
        assert_eq!(p.flags(), FLAG_I);
        let r = Repr::parse(&p).unwrap();
        assert_eq!(r.vni.value(), 5001);
        let mut b = [0xff; 8];
        r.emit(&mut b).unwrap();
        assert_eq!(b, HEADER);
    }

    #[test]
    fn the_i_flag_is_required_and_reserved_bits_are_ignored() {
        let mut h = HEADER;
        h[0] = 0x00;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&h[..])),
            Err(Error::BadVxlanFlags(0x00))
        );
        // Group Policy's G bit, reserved bytes and the last reserved byte.
        let mut h = HEADER;
        h[0] = 0x88;
        h[2] = 0x12;
        h[7] = 0xff;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&h[..])).map(|r| r.vni.value()),
            Ok(5001)
        );
    }

    #[test]
    fn truncated() {
        assert_eq!(
            Packet::new_checked(&HEADER[..7]),
            Err(Error::Truncated {
                header: Header::Vxlan,
                needed: 8,
                available: 7
            })
        );
        assert_eq!(
            Repr { vni: Vni::MAX }.emit(&mut [0; 4]),
            Err(Error::Truncated {
                header: Header::Vxlan,
                needed: 8,
                available: 4
            })
        );
    }
}
