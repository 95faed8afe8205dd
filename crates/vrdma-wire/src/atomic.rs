//! Atomic Extended Transport Header (IBTA Vol1 §9.3.3.2) and Atomic
//! Acknowledge Extended Transport Header (§9.3.5.3).

use crate::{Header, Result, Rkey, be};

/// Length of the AtomicETH.
pub const ATOMIC_ETH_LEN: usize = 28;
/// Length of the AtomicAckETH.
pub const ATOMIC_ACK_ETH_LEN: usize = 8;

mod field {
    pub const VA: usize = 0;
    pub const RKEY: usize = 8;
    pub const SWAP_ADD: usize = 12;
    pub const COMPARE: usize = 20;
}

/// AtomicETH: target address, R_Key, swap (or add) data, compare data.
pub mod eth {
    use super::*;

    crate::fixed_view!(
        "A view over an AtomicETH.",
        Header::AtomicEth,
        ATOMIC_ETH_LEN
    );

    impl<T: AsRef<[u8]>> Packet<T> {
        pub fn va(&self) -> u64 {
            be::u64(self.buffer.as_ref(), field::VA)
        }
        pub fn rkey(&self) -> Rkey {
            Rkey(be::u32(self.buffer.as_ref(), field::RKEY))
        }
        pub fn swap_add(&self) -> u64 {
            be::u64(self.buffer.as_ref(), field::SWAP_ADD)
        }
        pub fn compare(&self) -> u64 {
            be::u64(self.buffer.as_ref(), field::COMPARE)
        }
    }

    /// The meaning of an AtomicETH.
    #[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
    pub struct Repr {
        /// Remote address of the 8-byte target (8-byte aligned to be valid;
        /// alignment is the responder's check, not a framing rule).
        pub va: u64,
        pub rkey: Rkey,
        /// Swap value (COMPARE_SWAP) or addend (FETCH_ADD).
        pub swap_add: u64,
        /// Compare value (COMPARE_SWAP; ignored by FETCH_ADD).
        pub compare: u64,
    }

    impl Repr {
        pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
            p.check_len()?;
            Ok(Self {
                va: p.va(),
                rkey: p.rkey(),
                swap_add: p.swap_add(),
                compare: p.compare(),
            })
        }

        pub const fn buffer_len(&self) -> usize {
            ATOMIC_ETH_LEN
        }

        pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
            p.check_len()?;
            let d = p.buffer.as_mut();
            be::set_u64(d, field::VA, self.va);
            be::set_u32(d, field::RKEY, self.rkey.0);
            be::set_u64(d, field::SWAP_ADD, self.swap_add);
            be::set_u64(d, field::COMPARE, self.compare);
            Ok(())
        }
    }
}

/// AtomicAckETH: the original value at the target.
pub mod ack {
    use super::*;

    crate::fixed_view!(
        "A view over an AtomicAckETH.",
        Header::AtomicAckEth,
        ATOMIC_ACK_ETH_LEN
    );

    impl<T: AsRef<[u8]>> Packet<T> {
        pub fn orig(&self) -> u64 {
            be::u64(self.buffer.as_ref(), 0)
        }
    }

    /// The meaning of an AtomicAckETH.
    #[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
    pub struct Repr {
        /// The value at the target before the operation.
        pub orig: u64,
    }

    impl Repr {
        pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
            p.check_len()?;
            Ok(Self { orig: p.orig() })
        }

        pub const fn buffer_len(&self) -> usize {
            ATOMIC_ACK_ETH_LEN
        }

        pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
            p.check_len()?;
            be::set_u64(p.buffer.as_mut(), 0, self.orig);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    // AtomicETH of a COMPARE_SWAP from atomic_cmp_swap.pcap.
    static CMP_SWAP: [u8; 28] = [
        0x00, 0x00, 0x55, 0xde, 0x16, 0x30, 0x50, 0x00, 0x00, 0x00, 0x0e, 0xef, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];

    #[test]
    fn atomic_eth() {
        let r = eth::Repr::parse(&eth::Packet::new_unchecked(&CMP_SWAP[..])).unwrap();
        assert_eq!(r.va, 0x55de_1630_5000);
        assert_eq!(r.rkey, Rkey(0xeef));
        let r = eth::Repr {
            swap_add: 0x0102_0304_0506_0708,
            compare: 0x1112_1314_1516_1718,
            ..r
        };
        let mut b = [0; 28];
        r.emit(&mut eth::Packet::new_unchecked(&mut b[..])).unwrap();
        assert_eq!(&b[..12], &CMP_SWAP[..12]);
        assert_eq!(&b[12..20], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&b[20..], &[0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18]);
        assert_eq!(
            eth::Packet::new_checked(&CMP_SWAP[..27]),
            Err(Error::Truncated {
                header: Header::AtomicEth,
                needed: 28,
                available: 27
            })
        );
    }

    #[test]
    fn atomic_ack_eth() {
        let bytes = [0, 0, 0, 0, 0, 0, 0, 0x2a];
        let r = ack::Repr::parse(&ack::Packet::new_unchecked(&bytes[..])).unwrap();
        assert_eq!(r.orig, 42);
        let mut b = [0xff; 8];
        r.emit(&mut ack::Packet::new_unchecked(&mut b[..])).unwrap();
        assert_eq!(b, bytes);
        assert_eq!(
            ack::Packet::new_checked(&bytes[..7]),
            Err(Error::Truncated {
                header: Header::AtomicAckEth,
                needed: 8,
                available: 7
            })
        );
    }
}
