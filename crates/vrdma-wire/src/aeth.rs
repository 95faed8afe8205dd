//! ACK Extended Transport Header (IBTA Vol1 §9.3.5): a syndrome (ACK with
//! credit count, RNR NAK with timer, or NAK with a code) and the MSN.
//!
//! Syndrome byte: bit 7 reserved (0); bits 6..5 the kind — 00 ACK,
//! 01 RNR NAK, 10 reserved, 11 NAK; bits 4..0 the value.

use core::fmt;

use crate::{Error, Header, Msn, Result, be};

/// Length of the AETH.
pub const HEADER_LEN: usize = 4;

mod field {
    pub const SYNDROME: usize = 0;
    pub const MSN: usize = 1;
}

crate::fixed_view!("A view over an AETH.", Header::Aeth, HEADER_LEN);

impl<T: AsRef<[u8]>> Packet<T> {
    /// The raw syndrome byte.
    pub fn syndrome_raw(&self) -> u8 {
        self.buffer.as_ref()[field::SYNDROME]
    }
    pub fn msn(&self) -> Msn {
        Msn::from_masked(be::u24(self.buffer.as_ref(), field::MSN))
    }
}

/// The 5-bit credit-count code of an ACK (IBTA Vol1 §9.7.7.2.4, Table 45).
#[derive(Clone, Copy, Eq, Hash, PartialEq)]
pub struct CreditCode(u8);

impl CreditCode {
    /// Code 31: end-to-end credits are not in use ("unlimited"), what rxe
    /// sends for QPs without a per-QP receive queue limit.
    pub const INVALID: Self = Self(31);

    /// The code, masked to five bits.
    pub const fn from_masked(code: u8) -> Self {
        Self(code & 0x1f)
    }

    pub const fn code(self) -> u8 {
        self.0
    }

    /// Receive WQEs the code advertises: 0, 1, 2, 3, 4, 6, 8, 12, …, 32768;
    /// `None` for the invalid code 31.
    pub const fn credits(self) -> Option<u32> {
        if self.0 >= 31 {
            None
        } else {
            Some(CREDITS[self.0 as usize])
        }
    }
}

/// Table 45: code 0 is no credit, then 1, 2, 3 and alternately 2^k and 3·2^(k-1).
const CREDITS: [u32; 31] = [
    0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
    2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768,
];

impl fmt::Debug for CreditCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.credits() {
            Some(n) => write!(f, "CreditCode({}: {n})", self.0),
            None => write!(f, "CreditCode(31: invalid)"),
        }
    }
}

/// The 5-bit RNR NAK timer code (IBTA Vol1 §9.7.5.2.8, Table 46): how long
/// the requester must wait before retrying.
#[derive(Clone, Copy, Eq, Hash, PartialEq)]
pub struct RnrTimer(u8);

/// Table 46, in microseconds: 0 is the longest (655.36 ms).
const RNR_MICROS: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840,
    5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
    245_760, 327_680, 491_520,
];

impl RnrTimer {
    /// The code, masked to five bits.
    pub const fn from_masked(code: u8) -> Self {
        Self(code & 0x1f)
    }

    pub const fn code(self) -> u8 {
        self.0
    }

    /// The delay the code stands for.
    pub const fn micros(self) -> u32 {
        RNR_MICROS[(self.0 & 0x1f) as usize]
    }
}

impl fmt::Debug for RnrTimer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RnrTimer({}: {} us)", self.0, self.micros())
    }
}

/// NAK codes (IBTA Vol1 §9.3.5, Table 43). Codes 5..=31 are reserved.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
#[repr(u8)]
pub enum NakCode {
    PsnSequenceError = 0,
    InvalidRequest = 1,
    RemoteAccessError = 2,
    RemoteOperationalError = 3,
    InvalidRdRequest = 4,
}

impl NakCode {
    pub const fn name(self) -> &'static str {
        match self {
            NakCode::PsnSequenceError => "PSN sequence error",
            NakCode::InvalidRequest => "invalid request",
            NakCode::RemoteAccessError => "remote access error",
            NakCode::RemoteOperationalError => "remote operational error",
            NakCode::InvalidRdRequest => "invalid RD request",
        }
    }
}

impl fmt::Display for NakCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What an AETH says.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Syndrome {
    Ack(CreditCode),
    RnrNak(RnrTimer),
    Nak(NakCode),
}

impl Syndrome {
    /// Decodes the syndrome byte; reserved encodings are an error.
    pub fn from_byte(b: u8) -> Result<Self> {
        let value = b & 0x1f;
        match b >> 5 {
            0b00 => Ok(Syndrome::Ack(CreditCode(value))),
            0b01 => Ok(Syndrome::RnrNak(RnrTimer(value))),
            0b11 => Ok(Syndrome::Nak(match value {
                0 => NakCode::PsnSequenceError,
                1 => NakCode::InvalidRequest,
                2 => NakCode::RemoteAccessError,
                3 => NakCode::RemoteOperationalError,
                4 => NakCode::InvalidRdRequest,
                _ => return Err(Error::BadAethSyndrome(b)),
            })),
            // 0b10 is reserved; 0b1xx with bit 7 set is the reserved bit.
            _ => Err(Error::BadAethSyndrome(b)),
        }
    }

    /// The syndrome byte.
    pub const fn to_byte(self) -> u8 {
        match self {
            Syndrome::Ack(c) => c.0,
            Syndrome::RnrNak(t) => 0x20 | t.0,
            Syndrome::Nak(n) => 0x60 | n as u8,
        }
    }
}

impl fmt::Display for Syndrome {
    /// `ACK credits=4`, `ACK credits=invalid`, `RNR-NAK timer=25 (61440 us)`,
    /// `NAK remote access error`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Syndrome::Ack(c) => match c.credits() {
                Some(n) => write!(f, "ACK credits={n}"),
                None => f.write_str("ACK credits=invalid"),
            },
            Syndrome::RnrNak(t) => write!(f, "RNR-NAK timer={} ({} us)", t.code(), t.micros()),
            Syndrome::Nak(n) => write!(f, "NAK {n}"),
        }
    }
}

/// The meaning of an AETH.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr {
    pub syndrome: Syndrome,
    pub msn: Msn,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
        p.check_len()?;
        Ok(Self {
            syndrome: Syndrome::from_byte(p.syndrome_raw())?,
            msn: p.msn(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        p.check_len()?;
        let d = p.buffer.as_mut();
        d[field::SYNDROME] = self.syndrome.to_byte();
        be::set_u24(d, field::MSN, self.msn.value());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rxe_ack_and_rnr_nak() {
        // rc_imm_and_rnr_nak.pcap: ACK with invalid credits, MSN 1; RNR NAK
        // with timer 25 (61.44 ms).
        let ack = Repr::parse(&Packet::new_unchecked(&[0x1f, 0, 0, 1][..])).unwrap();
        assert_eq!(ack.syndrome, Syndrome::Ack(CreditCode::INVALID));
        assert_eq!(ack.msn, Msn::from_masked(1));
        let rnr = Repr::parse(&Packet::new_unchecked(&[0x39, 0, 0, 4][..])).unwrap();
        assert_eq!(rnr.syndrome, Syndrome::RnrNak(RnrTimer::from_masked(25)));
        assert_eq!(RnrTimer::from_masked(25).micros(), 61_440);
    }

    #[test]
    fn every_valid_syndrome_round_trips() {
        let mut valid = 0;
        for b in 0..=u8::MAX {
            match Syndrome::from_byte(b) {
                Ok(s) => {
                    valid += 1;
                    assert_eq!(s.to_byte(), b);
                    let r = Repr {
                        syndrome: s,
                        msn: Msn::MAX,
                    };
                    let mut buf = [0; 4];
                    r.emit(&mut Packet::new_unchecked(&mut buf[..])).unwrap();
                    assert_eq!(buf, [b, 0xff, 0xff, 0xff]);
                }
                Err(e) => assert_eq!(e, Error::BadAethSyndrome(b)),
            }
        }
        // 32 ACK + 32 RNR NAK + 5 NAK codes.
        assert_eq!(valid, 69);
    }

    #[test]
    fn nak_codes() {
        for (b, code) in [
            (0x60, NakCode::PsnSequenceError),
            (0x61, NakCode::InvalidRequest),
            (0x62, NakCode::RemoteAccessError),
            (0x63, NakCode::RemoteOperationalError),
            (0x64, NakCode::InvalidRdRequest),
        ] {
            assert_eq!(Syndrome::from_byte(b), Ok(Syndrome::Nak(code)));
        }
        assert_eq!(Syndrome::from_byte(0x65), Err(Error::BadAethSyndrome(0x65)));
        assert_eq!(Syndrome::from_byte(0x40), Err(Error::BadAethSyndrome(0x40)));
        assert_eq!(Syndrome::from_byte(0x80), Err(Error::BadAethSyndrome(0x80)));
    }

    #[test]
    fn credit_table() {
        let want = [
            0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
            1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768,
        ];
        for (c, n) in want.iter().enumerate() {
            let code = CreditCode::from_masked(u8::try_from(c).unwrap());
            assert_eq!(code.credits(), Some(*n), "code {c}");
        }
        assert_eq!(CreditCode::INVALID.credits(), None);
    }

    #[test]
    fn rnr_timer_table_ends() {
        assert_eq!(RnrTimer::from_masked(0).micros(), 655_360);
        assert_eq!(RnrTimer::from_masked(1).micros(), 10);
        assert_eq!(RnrTimer::from_masked(31).micros(), 491_520);
    }

    #[test]
    fn truncated() {
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&[0u8; 3][..])),
            Err(Error::Truncated {
                header: Header::Aeth,
                needed: 4,
                available: 3
            })
        );
    }

    #[test]
    fn rnr_timer_is_ten_microseconds_times_the_credit_series() {
        // Tables 45 and 46 share one series (1, 2, 3, 4, 6, 8, 12, …): the
        // RNR delay of code c ≥ 1 is 10 µs times credit code c, and code 31
        // continues the series to 49152.
        for c in 1..31u8 {
            let credits = CreditCode::from_masked(c).credits().unwrap();
            assert_eq!(RnrTimer::from_masked(c).micros(), 10 * credits, "code {c}");
        }
        assert_eq!(RnrTimer::from_masked(31).micros(), 10 * 49_152);
    }

    #[test]
    fn display() {
        assert_eq!(
            Syndrome::Ack(CreditCode::from_masked(5)).to_string(),
            "ACK credits=6"
        );
        assert_eq!(
            Syndrome::Ack(CreditCode::INVALID).to_string(),
            "ACK credits=invalid"
        );
        assert_eq!(
            Syndrome::RnrNak(RnrTimer::from_masked(25)).to_string(),
            "RNR-NAK timer=25 (61440 us)"
        );
        assert_eq!(
            Syndrome::Nak(NakCode::RemoteAccessError).to_string(),
            "NAK remote access error"
        );
    }
}
