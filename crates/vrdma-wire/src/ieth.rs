//! Invalidate Extended Transport Header (IBTA Vol1 §9.3.6): the R_Key a
//! SEND_WITH_INVALIDATE asks the responder to invalidate.

use crate::{Header, Result, Rkey, be};

/// Length of the IETH.
pub const HEADER_LEN: usize = 4;

crate::fixed_view!("A view over an IETH.", Header::Ieth, HEADER_LEN);

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn rkey(&self) -> Rkey {
        Rkey(be::u32(self.buffer.as_ref(), 0))
    }
}

/// The meaning of an IETH.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr {
    pub rkey: Rkey,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
        p.check_len()?;
        Ok(Self { rkey: p.rkey() })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        p.check_len()?;
        be::set_u32(p.buffer.as_mut(), 0, self.rkey.0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_emit() {
        let bytes = [0x00, 0x12, 0x34, 0x56];
        let r = Repr::parse(&Packet::new_unchecked(&bytes[..])).unwrap();
        assert_eq!(r.rkey, Rkey::new(0x1234, 0x56));
        let mut b = [0; 4];
        r.emit(&mut Packet::new_unchecked(&mut b[..])).unwrap();
        assert_eq!(b, bytes);
        assert_eq!(
            Packet::new_checked(&bytes[..2]),
            Err(crate::Error::Truncated {
                header: Header::Ieth,
                needed: 4,
                available: 2
            })
        );
    }
}
