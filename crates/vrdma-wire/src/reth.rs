//! RDMA Extended Transport Header (IBTA Vol1 §9.3.3.1): virtual address,
//! R_Key and DMA length of an RDMA WRITE or READ.

use crate::{Header, Result, Rkey, be};

/// Length of the RETH.
pub const HEADER_LEN: usize = 16;

mod field {
    pub const VA: usize = 0;
    pub const RKEY: usize = 8;
    pub const DMA_LEN: usize = 12;
}

crate::fixed_view!("A view over a RETH.", Header::Reth, HEADER_LEN);

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn va(&self) -> u64 {
        be::u64(self.buffer.as_ref(), field::VA)
    }
    pub fn rkey(&self) -> Rkey {
        Rkey(be::u32(self.buffer.as_ref(), field::RKEY))
    }
    pub fn dma_len(&self) -> u32 {
        be::u32(self.buffer.as_ref(), field::DMA_LEN)
    }
}

/// The meaning of a RETH.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr {
    /// Remote virtual address of the first byte.
    pub va: u64,
    pub rkey: Rkey,
    /// Length of the whole message, in bytes (up to 2^31 for RC).
    pub dma_len: u32,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
        p.check_len()?;
        Ok(Self {
            va: p.va(),
            rkey: p.rkey(),
            dma_len: p.dma_len(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        p.check_len()?;
        let d = p.buffer.as_mut();
        be::set_u64(d, field::VA, self.va);
        be::set_u32(d, field::RKEY, self.rkey.0);
        be::set_u32(d, field::DMA_LEN, self.dma_len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    // RETH of an RDMA_WRITE_ONLY from write_bw_64.pcap (rxe).
    static BYTES: [u8; 16] = [
        0x00, 0x00, 0x55, 0xc1, 0x87, 0xa1, 0xb0, 0x00, 0x00, 0x00, 0x09, 0x98, 0x00, 0x00, 0x00,
        0x40,
    ];
    const REPR: Repr = Repr {
        va: 0x55c1_87a1_b000,
        rkey: Rkey(0x998),
        dma_len: 64,
    };

    #[test]
    fn parse_and_emit() {
        assert_eq!(Repr::parse(&Packet::new_unchecked(&BYTES[..])), Ok(REPR));
        let mut b = [0; 16];
        REPR.emit(&mut Packet::new_unchecked(&mut b[..])).unwrap();
        assert_eq!(b, BYTES);
    }

    #[test]
    fn truncated() {
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&BYTES[..15])),
            Err(Error::Truncated {
                header: Header::Reth,
                needed: 16,
                available: 15
            })
        );
        let mut short = [0; 4];
        assert_eq!(
            REPR.emit(&mut Packet::new_unchecked(&mut short[..])),
            Err(Error::Truncated {
                header: Header::Reth,
                needed: 16,
                available: 4
            })
        );
    }
}
