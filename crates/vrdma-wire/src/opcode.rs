//! The BTH opcode table (IBTA Vol1 §9.2.1, Table 38; RoCEv2 CNP from Annex
//! A17.9.3), as data.
//!
//! The top three bits of an opcode name the transport service, the low five
//! the operation. Each opcode fixes which extension headers follow the BTH
//! and whether a payload follows them; [`OpcodeInfo`] records that.

use core::fmt;

use crate::{Error, Header};

/// Transport service, from the top three bits of the opcode.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum ServiceType {
    /// Reliable connection (prefix 000).
    Rc,
    /// Unreliable connection (prefix 001).
    Uc,
    /// Unreliable datagram (prefix 011).
    Ud,
    /// RoCEv2 congestion notification packet (opcode 0x81).
    Cnp,
}

impl ServiceType {
    /// Short name as used in opcode names.
    pub const fn name(self) -> &'static str {
        match self {
            ServiceType::Rc => "RC",
            ServiceType::Uc => "UC",
            ServiceType::Ud => "UD",
            ServiceType::Cnp => "CNP",
        }
    }
}

/// What a packet does, independent of service and position.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Operation {
    Send,
    RdmaWrite,
    RdmaReadRequest,
    RdmaReadResponse,
    Acknowledge,
    AtomicAcknowledge,
    CompareSwap,
    FetchAdd,
    /// Congestion notification (RoCEv2).
    Cnp,
}

/// Where a packet stands in its message.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Position {
    First,
    Middle,
    Last,
    Only,
}

impl Position {
    /// First or Only: the packet starts a message.
    pub const fn starts(self) -> bool {
        matches!(self, Position::First | Position::Only)
    }

    /// Last or Only: the packet ends a message.
    pub const fn ends(self) -> bool {
        matches!(self, Position::Last | Position::Only)
    }
}

/// A set of extension headers, in their fixed wire order.
#[derive(Clone, Copy, Default, Eq, Hash, PartialEq)]
pub struct HeaderSet(u8);

impl HeaderSet {
    pub const NONE: Self = Self(0);
    pub const DETH: Self = Self(1 << 0);
    pub const RETH: Self = Self(1 << 1);
    pub const ATOMIC_ETH: Self = Self(1 << 2);
    pub const AETH: Self = Self(1 << 3);
    pub const ATOMIC_ACK_ETH: Self = Self(1 << 4);
    pub const IMMDT: Self = Self(1 << 5);
    pub const IETH: Self = Self(1 << 6);
    pub const CNP_RESERVED: Self = Self(1 << 7);

    /// The headers in the order they follow the BTH (IBTA Vol1 §9.2), with
    /// their lengths.
    pub const ORDER: [(HeaderSet, Header, usize); 8] = [
        (Self::DETH, Header::Deth, crate::deth::HEADER_LEN),
        (Self::RETH, Header::Reth, crate::reth::HEADER_LEN),
        (
            Self::ATOMIC_ETH,
            Header::AtomicEth,
            crate::atomic::ATOMIC_ETH_LEN,
        ),
        (Self::AETH, Header::Aeth, crate::aeth::HEADER_LEN),
        (
            Self::ATOMIC_ACK_ETH,
            Header::AtomicAckEth,
            crate::atomic::ATOMIC_ACK_ETH_LEN,
        ),
        (Self::IMMDT, Header::ImmDt, crate::immdt::HEADER_LEN),
        (Self::IETH, Header::Ieth, crate::ieth::HEADER_LEN),
        (Self::CNP_RESERVED, Header::CnpReserved, CNP_RESERVED_LEN),
    ];

    /// Union of two sets.
    pub const fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// `self` without the headers of `other`.
    pub const fn without(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }

    /// True when every header of `other` is in `self`.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// Total length of the headers in the set.
    pub const fn len(self) -> usize {
        let mut n = 0;
        let mut i = 0;
        while i < Self::ORDER.len() {
            if self.contains(Self::ORDER[i].0) {
                n += Self::ORDER[i].2;
            }
            i += 1;
        }
        n
    }

    /// True for the empty set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Debug for HeaderSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut l = f.debug_set();
        for (bit, h, _) in Self::ORDER {
            if self.contains(bit) {
                l.entry(&h);
            }
        }
        l.finish()
    }
}

/// Length of the reserved field after a CNP's BTH (Annex A17.9.3).
pub const CNP_RESERVED_LEN: usize = 16;

/// Everything the table says about one opcode.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct OpcodeInfo {
    pub service: ServiceType,
    pub operation: Operation,
    /// Position in a message; `None` for ACKs and CNPs, which are not part of
    /// a message.
    pub position: Option<Position>,
    /// Extension headers following the BTH.
    pub headers: HeaderSet,
    /// Their total length in bytes.
    pub header_len: usize,
    /// Whether a payload (possibly empty) follows the headers.
    pub payload: bool,
    /// Carries immediate data (ImmDt).
    pub immediate: bool,
    /// Carries an rkey to invalidate (IETH).
    pub invalidate: bool,
    /// IBTA name without the service prefix, e.g. `SEND_ONLY_WITH_IMMEDIATE`.
    pub name: &'static str,
}

macro_rules! opcodes {
    ($( $variant:ident = $code:literal, $svc:ident, $op:ident, $pos:expr, $hdrs:expr, $payload:literal, $name:literal; )*) => {
        /// A BTH opcode that vrdma understands: every RC, UC and UD opcode of
        /// IBTA Vol1 Table 38 and the RoCEv2 CNP.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
        #[repr(u8)]
        pub enum Opcode {
            $( $variant = $code, )*
        }

        impl Opcode {
            /// Every opcode, in numeric order.
            pub const ALL: &'static [Opcode] = &[$(Opcode::$variant,)*];

            /// Builds the table row (used once, to fill [`INFO`]).
            const fn build_info(self) -> OpcodeInfo {
                match self {
                    $( Opcode::$variant => {
                        let headers: HeaderSet = $hdrs;
                        OpcodeInfo {
                            service: ServiceType::$svc,
                            operation: Operation::$op,
                            position: $pos,
                            headers,
                            header_len: headers.len(),
                            payload: $payload,
                            immediate: headers.contains(HeaderSet::IMMDT),
                            invalidate: headers.contains(HeaderSet::IETH),
                            name: $name,
                        }
                    } )*
                }
            }
        }

        impl TryFrom<u8> for Opcode {
            type Error = Error;
            fn try_from(v: u8) -> Result<Self, Error> {
                OPCODE_OF[usize::from(v)].ok_or(Error::UnknownOpcode(v))
            }
        }
    };
}

const F: Option<Position> = Some(Position::First);
const M: Option<Position> = Some(Position::Middle);
const L: Option<Position> = Some(Position::Last);
const O: Option<Position> = Some(Position::Only);
const N: Option<Position> = None;
const NONE: HeaderSet = HeaderSet::NONE;
const RETH: HeaderSet = HeaderSet::RETH;
const AETH: HeaderSet = HeaderSet::AETH;
const DETH: HeaderSet = HeaderSet::DETH;
const IMM: HeaderSet = HeaderSet::IMMDT;
const IETH: HeaderSet = HeaderSet::IETH;

opcodes! {
    // Reliable connection (IBTA Vol1 Table 38, 000xxxxx).
    RcSendFirst = 0x00, Rc, Send, F, NONE, true, "SEND_FIRST";
    RcSendMiddle = 0x01, Rc, Send, M, NONE, true, "SEND_MIDDLE";
    RcSendLast = 0x02, Rc, Send, L, NONE, true, "SEND_LAST";
    RcSendLastImm = 0x03, Rc, Send, L, IMM, true, "SEND_LAST_WITH_IMMEDIATE";
    RcSendOnly = 0x04, Rc, Send, O, NONE, true, "SEND_ONLY";
    RcSendOnlyImm = 0x05, Rc, Send, O, IMM, true, "SEND_ONLY_WITH_IMMEDIATE";
    RcWriteFirst = 0x06, Rc, RdmaWrite, F, RETH, true, "RDMA_WRITE_FIRST";
    RcWriteMiddle = 0x07, Rc, RdmaWrite, M, NONE, true, "RDMA_WRITE_MIDDLE";
    RcWriteLast = 0x08, Rc, RdmaWrite, L, NONE, true, "RDMA_WRITE_LAST";
    RcWriteLastImm = 0x09, Rc, RdmaWrite, L, IMM, true, "RDMA_WRITE_LAST_WITH_IMMEDIATE";
    RcWriteOnly = 0x0a, Rc, RdmaWrite, O, RETH, true, "RDMA_WRITE_ONLY";
    RcWriteOnlyImm = 0x0b, Rc, RdmaWrite, O, RETH.with(IMM), true, "RDMA_WRITE_ONLY_WITH_IMMEDIATE";
    RcReadRequest = 0x0c, Rc, RdmaReadRequest, O, RETH, false, "RDMA_READ_REQUEST";
    RcReadResponseFirst = 0x0d, Rc, RdmaReadResponse, F, AETH, true, "RDMA_READ_RESPONSE_FIRST";
    RcReadResponseMiddle = 0x0e, Rc, RdmaReadResponse, M, NONE, true, "RDMA_READ_RESPONSE_MIDDLE";
    RcReadResponseLast = 0x0f, Rc, RdmaReadResponse, L, AETH, true, "RDMA_READ_RESPONSE_LAST";
    RcReadResponseOnly = 0x10, Rc, RdmaReadResponse, O, AETH, true, "RDMA_READ_RESPONSE_ONLY";
    RcAcknowledge = 0x11, Rc, Acknowledge, N, AETH, false, "ACKNOWLEDGE";
    RcAtomicAcknowledge = 0x12, Rc, AtomicAcknowledge, N, AETH.with(HeaderSet::ATOMIC_ACK_ETH), false, "ATOMIC_ACKNOWLEDGE";
    RcCompareSwap = 0x13, Rc, CompareSwap, O, HeaderSet::ATOMIC_ETH, false, "COMPARE_SWAP";
    RcFetchAdd = 0x14, Rc, FetchAdd, O, HeaderSet::ATOMIC_ETH, false, "FETCH_ADD";
    RcSendLastInv = 0x16, Rc, Send, L, IETH, true, "SEND_LAST_WITH_INVALIDATE";
    RcSendOnlyInv = 0x17, Rc, Send, O, IETH, true, "SEND_ONLY_WITH_INVALIDATE";
    // Unreliable connection (001xxxxx): sends and writes only.
    UcSendFirst = 0x20, Uc, Send, F, NONE, true, "SEND_FIRST";
    UcSendMiddle = 0x21, Uc, Send, M, NONE, true, "SEND_MIDDLE";
    UcSendLast = 0x22, Uc, Send, L, NONE, true, "SEND_LAST";
    UcSendLastImm = 0x23, Uc, Send, L, IMM, true, "SEND_LAST_WITH_IMMEDIATE";
    UcSendOnly = 0x24, Uc, Send, O, NONE, true, "SEND_ONLY";
    UcSendOnlyImm = 0x25, Uc, Send, O, IMM, true, "SEND_ONLY_WITH_IMMEDIATE";
    UcWriteFirst = 0x26, Uc, RdmaWrite, F, RETH, true, "RDMA_WRITE_FIRST";
    UcWriteMiddle = 0x27, Uc, RdmaWrite, M, NONE, true, "RDMA_WRITE_MIDDLE";
    UcWriteLast = 0x28, Uc, RdmaWrite, L, NONE, true, "RDMA_WRITE_LAST";
    UcWriteLastImm = 0x29, Uc, RdmaWrite, L, IMM, true, "RDMA_WRITE_LAST_WITH_IMMEDIATE";
    UcWriteOnly = 0x2a, Uc, RdmaWrite, O, RETH, true, "RDMA_WRITE_ONLY";
    UcWriteOnlyImm = 0x2b, Uc, RdmaWrite, O, RETH.with(IMM), true, "RDMA_WRITE_ONLY_WITH_IMMEDIATE";
    // Unreliable datagram (011xxxxx): single-packet sends, each with a DETH.
    UdSendOnly = 0x64, Ud, Send, O, DETH, true, "SEND_ONLY";
    UdSendOnlyImm = 0x65, Ud, Send, O, DETH.with(IMM), true, "SEND_ONLY_WITH_IMMEDIATE";
    // RoCEv2 congestion notification (Annex A17.9.3): BTH, 16 reserved bytes.
    Cnp = 0x81, Cnp, Cnp, N, HeaderSet::CNP_RESERVED, false, "CNP";
}

/// The table, indexed by opcode byte, so that per-packet lookups are one
/// load. Bytes that are not opcodes hold a row nobody can reach (an
/// `Opcode` is always a valid byte).
const INFO: &[OpcodeInfo; 256] = &{
    let mut t = [Opcode::RcSendFirst.build_info(); 256];
    let mut i = 0;
    while i < Opcode::ALL.len() {
        let op = Opcode::ALL[i];
        t[op as usize] = op.build_info();
        i += 1;
    }
    t
};

/// The opcode of each byte, for a one-load [`Opcode::try_from`].
const OPCODE_OF: &[Option<Opcode>; 256] = &{
    let mut t = [None; 256];
    let mut i = 0;
    while i < Opcode::ALL.len() {
        let op = Opcode::ALL[i];
        t[op as usize] = Some(op);
        i += 1;
    }
    t
};

impl Opcode {
    /// The table row for this opcode.
    pub const fn info(self) -> &'static OpcodeInfo {
        &INFO[self as usize]
    }

    /// The opcode byte.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// Transport service.
    pub const fn service(self) -> ServiceType {
        self.info().service
    }

    /// Extension headers after the BTH.
    pub const fn headers(self) -> HeaderSet {
        self.info().headers
    }

    /// True when a payload follows the headers.
    pub const fn has_payload(self) -> bool {
        self.info().payload
    }
}

impl fmt::Display for Opcode {
    /// `RC SEND_ONLY`, `UD SEND_ONLY_WITH_IMMEDIATE`, `CNP`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = self.info();
        if i.service == ServiceType::Cnp {
            f.write_str(i.name)
        } else {
            write!(f, "{} {}", i.service.name(), i.name)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_round_trips_or_is_unknown() {
        let mut known = 0;
        for b in 0..=u8::MAX {
            match Opcode::try_from(b) {
                Ok(op) => {
                    assert_eq!(op.code(), b);
                    known += 1;
                }
                Err(e) => assert_eq!(e, Error::UnknownOpcode(b)),
            }
        }
        // 23 RC + 12 UC + 2 UD + CNP.
        assert_eq!(known, 38);
        assert_eq!(known, Opcode::ALL.len());
    }

    #[test]
    fn service_follows_the_top_three_bits() {
        for &op in Opcode::ALL {
            let expect = match op.code() >> 5 {
                0b000 => ServiceType::Rc,
                0b001 => ServiceType::Uc,
                0b011 => ServiceType::Ud,
                0b100 => ServiceType::Cnp,
                p => panic!("prefix {p:03b} in table"),
            };
            assert_eq!(op.service(), expect, "{op}");
        }
    }

    #[test]
    fn uc_mirrors_rc_sends_and_writes() {
        // IBTA Table 38: UC has the RC SEND and RDMA WRITE opcodes at the
        // same low five bits, and nothing else.
        for &op in Opcode::ALL
            .iter()
            .filter(|o| o.service() == ServiceType::Uc)
        {
            let rc = Opcode::try_from(op.code() & 0x1f).unwrap();
            assert_eq!(rc.info().name, op.info().name);
            assert_eq!(rc.headers(), op.headers());
            assert_eq!(rc.info().position, op.info().position);
        }
        assert!(Opcode::try_from(0x2c).is_err(), "no UC READ");
        assert!(
            Opcode::try_from(0x37).is_err(),
            "no UC SEND with invalidate"
        );
    }

    #[test]
    fn reth_is_on_first_and_only_writes_and_on_reads() {
        for &op in Opcode::ALL {
            let i = op.info();
            let want = matches!(
                (i.operation, i.position),
                (Operation::RdmaWrite, Some(Position::First | Position::Only))
                    | (Operation::RdmaReadRequest, _)
            );
            assert_eq!(i.headers.contains(HeaderSet::RETH), want, "{op}");
        }
    }

    #[test]
    fn aeth_is_on_acks_and_read_responses_except_middle() {
        for &op in Opcode::ALL {
            let i = op.info();
            let want = match i.operation {
                Operation::Acknowledge | Operation::AtomicAcknowledge => true,
                Operation::RdmaReadResponse => i.position != Some(Position::Middle),
                _ => false,
            };
            assert_eq!(i.headers.contains(HeaderSet::AETH), want, "{op}");
        }
    }

    #[test]
    fn immediate_and_invalidate_only_end_messages() {
        for &op in Opcode::ALL {
            let i = op.info();
            if i.immediate || i.invalidate {
                assert!(i.position.is_some_and(Position::ends), "{op}");
                assert!(i.name.contains("WITH_"), "{op}");
            }
            assert!(!(i.immediate && i.invalidate), "{op}");
        }
        assert!(Opcode::RcSendOnlyInv.info().invalidate);
        assert!(Opcode::RcWriteOnlyImm.info().immediate);
    }

    #[test]
    fn payload_rules() {
        let no_payload: Vec<_> = Opcode::ALL
            .iter()
            .filter(|o| !o.has_payload())
            .map(|o| o.code())
            .collect();
        assert_eq!(no_payload, [0x0c, 0x11, 0x12, 0x13, 0x14, 0x81]);
    }

    #[test]
    fn header_lengths() {
        assert_eq!(Opcode::RcWriteOnlyImm.headers().len(), 20);
        assert_eq!(Opcode::RcAtomicAcknowledge.headers().len(), 12);
        assert_eq!(Opcode::RcCompareSwap.headers().len(), 28);
        assert_eq!(Opcode::UdSendOnlyImm.headers().len(), 12);
        assert_eq!(Opcode::Cnp.headers().len(), 16);
        assert_eq!(Opcode::RcSendMiddle.headers().len(), 0);
    }

    #[test]
    fn names() {
        assert_eq!(Opcode::RcSendOnly.to_string(), "RC SEND_ONLY");
        assert_eq!(
            Opcode::UdSendOnlyImm.to_string(),
            "UD SEND_ONLY_WITH_IMMEDIATE"
        );
        assert_eq!(Opcode::Cnp.to_string(), "CNP");
    }
}
