//! Base Transport Header (IBTA Vol1 §9.2; RoCEv2 FECN/BECN from Annex A17).
//!
//! ```text
//!  0       1               2               3
//!  opcode | SE M Pad TVer | P_Key                       |
//!  F B resv6 | DestQP                                    |
//!  A resv7   | PSN                                       |
//! ```

use crate::{Error, Header, Opcode, PKey, Psn, Qpn, Result, be};

/// Length of the BTH.
pub const HEADER_LEN: usize = 12;

mod field {
    pub const OPCODE: usize = 0;
    /// SE (bit 7), MigReq (bit 6), PadCnt (bits 5..4), TVer (bits 3..0).
    pub const FLAGS: usize = 1;
    pub const PKEY: usize = 2;
    /// FECN (bit 7), BECN (bit 6), six reserved bits. This whole byte is the
    /// one the ICRC masks.
    pub const FB: usize = 4;
    pub const DEST_QP: usize = 5;
    /// AckReq (bit 7), seven reserved bits.
    pub const ACK: usize = 8;
    pub const PSN: usize = 9;
}

/// Offset of the BTH byte masked for the ICRC (Annex A17.8.1).
pub const ICRC_MASKED_BYTE: usize = field::FB;

crate::fixed_view!("A view over a BTH.", Header::Bth, HEADER_LEN);

impl<T: AsRef<[u8]>> Packet<T> {
    /// The raw opcode byte.
    pub fn opcode_raw(&self) -> u8 {
        self.buffer.as_ref()[field::OPCODE]
    }
    /// Solicited event.
    pub fn solicited(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & 0x80 != 0
    }
    /// Migration request.
    pub fn mig_req(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & 0x40 != 0
    }
    /// Pad count: bytes of pad after the payload (0..=3).
    pub fn pad_cnt(&self) -> u8 {
        (self.buffer.as_ref()[field::FLAGS] >> 4) & 0x3
    }
    /// Transport header version.
    pub fn tver(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS] & 0x0f
    }
    /// Partition key.
    pub fn pkey(&self) -> PKey {
        PKey(be::u16(self.buffer.as_ref(), field::PKEY))
    }
    /// Forward explicit congestion notification (RoCEv2).
    pub fn fecn(&self) -> bool {
        self.buffer.as_ref()[field::FB] & 0x80 != 0
    }
    /// Backward explicit congestion notification (RoCEv2).
    pub fn becn(&self) -> bool {
        self.buffer.as_ref()[field::FB] & 0x40 != 0
    }
    /// Destination QP.
    pub fn dest_qp(&self) -> Qpn {
        Qpn::from_masked(be::u24(self.buffer.as_ref(), field::DEST_QP))
    }
    /// Acknowledge request.
    pub fn ack_req(&self) -> bool {
        self.buffer.as_ref()[field::ACK] & 0x80 != 0
    }
    /// Packet sequence number.
    pub fn psn(&self) -> Psn {
        Psn::from_masked(be::u24(self.buffer.as_ref(), field::PSN))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Writes every field; reserved bits become zero.
    fn set_all(&mut self, r: &Repr) {
        let d = self.buffer.as_mut();
        d[field::OPCODE] = r.opcode.code();
        d[field::FLAGS] = (u8::from(r.solicited) << 7)
            | (u8::from(r.mig_req) << 6)
            | ((r.pad_cnt & 0x3) << 4)
            | TVER;
        be::set_u16(d, field::PKEY, r.pkey.0);
        d[field::FB] = (u8::from(r.fecn) << 7) | (u8::from(r.becn) << 6);
        be::set_u24(d, field::DEST_QP, r.dest_qp.value());
        d[field::ACK] = u8::from(r.ack_req) << 7;
        be::set_u24(d, field::PSN, r.psn.value());
    }
}

/// The only transport header version defined.
pub(crate) const TVER: u8 = 0;

/// The meaning of a BTH.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr {
    pub opcode: Opcode,
    /// SE: ask the responder to raise a solicited event.
    pub solicited: bool,
    /// MigReq (path migration; RoCE sends 0 and ignores it).
    pub mig_req: bool,
    /// PadCnt (0..=3). When a whole packet is emitted this is recomputed
    /// from the payload length.
    pub pad_cnt: u8,
    pub pkey: PKey,
    pub fecn: bool,
    pub becn: bool,
    pub dest_qp: Qpn,
    /// AckReq: ask the responder to acknowledge this packet.
    pub ack_req: bool,
    pub psn: Psn,
}

impl Repr {
    /// Parses a BTH: the opcode must be known and TVer zero. Reserved bits
    /// are ignored (IBTA: sent as zero, not checked on receive).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
        p.check_len()?;
        let opcode = Opcode::try_from(p.opcode_raw())?;
        if p.tver() != TVER {
            return Err(Error::BadTver(p.tver()));
        }
        Ok(Self {
            opcode,
            solicited: p.solicited(),
            mig_req: p.mig_req(),
            pad_cnt: p.pad_cnt(),
            pkey: p.pkey(),
            fecn: p.fecn(),
            becn: p.becn(),
            dest_qp: p.dest_qp(),
            ack_req: p.ack_req(),
            psn: p.psn(),
        })
    }

    /// Bytes needed to emit.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header. `pad_cnt` above 3 is an error.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        p.check_len()?;
        if self.pad_cnt > 3 {
            return Err(Error::OutOfRange {
                what: "PadCnt",
                value: u64::from(self.pad_cnt),
            });
        }
        p.set_all(self);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // BTH of an RC COMPARE_SWAP from atomic_cmp_swap.pcap (rxe).
    static RXE_CMP_SWAP: [u8; 12] = [
        0x13, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x1d, 0x80, 0x76, 0x90, 0xd5,
    ];

    fn repr() -> Repr {
        Repr {
            opcode: Opcode::RcCompareSwap,
            solicited: false,
            mig_req: false,
            pad_cnt: 0,
            pkey: PKey::DEFAULT,
            fecn: false,
            becn: false,
            dest_qp: Qpn::from_masked(0x1d),
            ack_req: true,
            psn: Psn::from_masked(7_770_325),
        }
    }

    #[test]
    fn deconstruct() {
        let p = Packet::new_checked(&RXE_CMP_SWAP[..]).unwrap();
        assert_eq!(p.opcode_raw(), 0x13);
        assert!(!p.solicited() && !p.mig_req());
        assert_eq!((p.pad_cnt(), p.tver()), (0, 0));
        assert_eq!(p.pkey(), PKey::DEFAULT);
        assert!(!p.fecn() && !p.becn());
        assert_eq!(p.dest_qp(), Qpn::from_masked(0x1d));
        assert!(p.ack_req());
        assert_eq!(p.psn(), Psn::from_masked(0x7690d5));
    }

    #[test]
    fn parse_and_emit() {
        let p = Packet::new_checked(&RXE_CMP_SWAP[..]).unwrap();
        assert_eq!(Repr::parse(&p), Ok(repr()));
        let mut buf = [0xaa; 12];
        repr()
            .emit(&mut Packet::new_unchecked(&mut buf[..]))
            .unwrap();
        assert_eq!(buf, RXE_CMP_SWAP);
    }

    #[test]
    fn all_flag_bits_land_where_ibta_puts_them() {
        let r = Repr {
            solicited: true,
            mig_req: true,
            pad_cnt: 3,
            fecn: true,
            becn: true,
            pkey: PKey(0x8001),
            dest_qp: Qpn::MAX,
            psn: Psn::MAX,
            ..repr()
        };
        let mut buf = [0; 12];
        r.emit(&mut Packet::new_unchecked(&mut buf[..])).unwrap();
        assert_eq!(
            buf,
            [
                0x13, 0xf0, 0x80, 0x01, 0xc0, 0xff, 0xff, 0xff, 0x80, 0xff, 0xff, 0xff
            ]
        );
        assert_eq!(Repr::parse(&Packet::new_unchecked(&buf[..])), Ok(r));
    }

    #[test]
    fn truncated() {
        assert_eq!(
            Packet::new_checked(&RXE_CMP_SWAP[..11]),
            Err(Error::Truncated {
                header: Header::Bth,
                needed: 12,
                available: 11
            })
        );
    }

    #[test]
    fn wrong_tver() {
        let mut b = RXE_CMP_SWAP;
        b[1] |= 0x01;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&b[..])),
            Err(Error::BadTver(1))
        );
    }

    #[test]
    fn unknown_opcode() {
        let mut b = RXE_CMP_SWAP;
        b[0] = 0x15;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&b[..])),
            Err(Error::UnknownOpcode(0x15))
        );
    }

    #[test]
    fn reserved_bits_are_ignored_and_emitted_as_zero() {
        let mut b = RXE_CMP_SWAP;
        b[4] |= 0x3f;
        b[8] |= 0x7f;
        let r = Repr::parse(&Packet::new_unchecked(&b[..])).unwrap();
        assert_eq!(r, repr());
        let mut out = [0; 12];
        r.emit(&mut Packet::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, RXE_CMP_SWAP);
    }

    #[test]
    fn pad_count_above_three_is_refused_on_emit() {
        let r = Repr {
            pad_cnt: 4,
            ..repr()
        };
        let mut b = [0; 12];
        assert_eq!(
            r.emit(&mut Packet::new_unchecked(&mut b[..])),
            Err(Error::OutOfRange {
                what: "PadCnt",
                value: 4
            })
        );
    }
}
