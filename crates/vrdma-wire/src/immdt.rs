//! Immediate Data Extended Transport Header (IBTA Vol1 §9.3.4): four bytes
//! delivered to the receiver's completion.

use crate::{Header, Result, be};

/// Length of the ImmDt header.
pub const HEADER_LEN: usize = 4;

crate::fixed_view!("A view over an ImmDt header.", Header::ImmDt, HEADER_LEN);

impl<T: AsRef<[u8]>> Packet<T> {
    /// The immediate data, read big-endian (as it stands on the wire; verbs
    /// hand the same four bytes to the receiver as `imm_data`).
    pub fn imm(&self) -> u32 {
        be::u32(self.buffer.as_ref(), 0)
    }
}

/// The meaning of an ImmDt header.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr {
    pub imm: u32,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
        p.check_len()?;
        Ok(Self { imm: p.imm() })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        p.check_len()?;
        be::set_u32(p.buffer.as_mut(), 0, self.imm);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn big_endian_on_the_wire() {
        // pyverbs' imm_data 0x11223344 went out as bytes 44 33 22 11.
        let r = Repr::parse(&Packet::new_unchecked(&[0x44, 0x33, 0x22, 0x11][..])).unwrap();
        assert_eq!(r.imm, 0x4433_2211);
        let mut b = [0; 4];
        r.emit(&mut Packet::new_unchecked(&mut b[..])).unwrap();
        assert_eq!(b, [0x44, 0x33, 0x22, 0x11]);
        assert_eq!(
            Packet::new_checked(&b[..3]),
            Err(crate::Error::Truncated {
                header: Header::ImmDt,
                needed: 4,
                available: 3
            })
        );
    }
}
