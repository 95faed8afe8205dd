//! Datagram Extended Transport Header (IBTA Vol1 §9.3.2): the Q_Key and
//! source QP of a UD packet.

use crate::{Header, QKey, Qpn, Result, be};

/// Length of the DETH.
pub const HEADER_LEN: usize = 8;

mod field {
    pub const QKEY: usize = 0;
    /// One reserved byte, then the 24-bit source QP.
    pub const SRC_QP: usize = 5;
}

crate::fixed_view!("A view over a DETH.", Header::Deth, HEADER_LEN);

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn qkey(&self) -> QKey {
        QKey(be::u32(self.buffer.as_ref(), field::QKEY))
    }
    pub fn src_qp(&self) -> Qpn {
        Qpn::from_masked(be::u24(self.buffer.as_ref(), field::SRC_QP))
    }
}

/// The meaning of a DETH.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr {
    pub qkey: QKey,
    pub src_qp: Qpn,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
        p.check_len()?;
        Ok(Self {
            qkey: p.qkey(),
            src_qp: p.src_qp(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header; the reserved byte becomes zero.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        p.check_len()?;
        let d = p.buffer.as_mut();
        be::set_u32(d, field::QKEY, self.qkey.0);
        d[field::SRC_QP - 1] = 0;
        be::set_u24(d, field::SRC_QP, self.src_qp.value());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    // DETH from ud_pingpong_64.pcap (Q_Key 0x11111111, source QP 0x11).
    static BYTES: [u8; 8] = [0x11, 0x11, 0x11, 0x11, 0x00, 0x00, 0x00, 0x11];

    #[test]
    fn parse_and_emit() {
        let r = Repr::parse(&Packet::new_unchecked(&BYTES[..])).unwrap();
        assert_eq!(r.qkey, QKey(0x1111_1111));
        assert_eq!(r.src_qp, Qpn::from_masked(0x11));
        assert!(!r.qkey.is_controlled());
        let mut b = [0xee; 8];
        r.emit(&mut Packet::new_unchecked(&mut b[..])).unwrap();
        assert_eq!(b, BYTES);
    }

    #[test]
    fn truncated() {
        assert_eq!(
            Packet::new_checked(&BYTES[..7]),
            Err(Error::Truncated {
                header: Header::Deth,
                needed: 8,
                available: 7
            })
        );
    }
}
