//! The one error type of the wire crate: every way bytes can be malformed.

use core::fmt;

use crate::opcode::Opcode;

/// Result of a wire operation.
pub type Result<T> = core::result::Result<T, Error>;

/// The header (or trailer) an error refers to.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Header {
    Ethernet,
    Vlan,
    /// The 8-byte VXLAN header (RFC 7348 §5).
    Vxlan,
    Ipv4,
    Ipv6,
    Udp,
    Bth,
    Reth,
    Aeth,
    Deth,
    ImmDt,
    Ieth,
    AtomicEth,
    AtomicAckEth,
    /// The 16 reserved bytes that follow the BTH of a CNP (Annex A17.9.3).
    CnpReserved,
    /// The 4-byte invariant CRC at the end of every RoCE packet.
    Icrc,
    Grh,
}

impl fmt::Display for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Header::Ethernet => "Ethernet header",
            Header::Vlan => "802.1Q tag",
            Header::Vxlan => "VXLAN header",
            Header::Ipv4 => "IPv4 header",
            Header::Ipv6 => "IPv6 header",
            Header::Udp => "UDP header",
            Header::Bth => "BTH",
            Header::Reth => "RETH",
            Header::Aeth => "AETH",
            Header::Deth => "DETH",
            Header::ImmDt => "ImmDt",
            Header::Ieth => "IETH",
            Header::AtomicEth => "AtomicETH",
            Header::AtomicAckEth => "AtomicAckETH",
            Header::CnpReserved => "CNP reserved field",
            Header::Icrc => "ICRC",
            Header::Grh => "GRH",
        };
        f.write_str(s)
    }
}

/// Why bytes were rejected (parse) or could not be produced (emit).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
pub enum Error {
    /// Fewer bytes than the header needs (or, on emit, a buffer too small).
    #[error("{header} truncated: {needed} bytes needed, {available} available")]
    Truncated {
        header: Header,
        needed: usize,
        available: usize,
    },
    /// An emit buffer whose size is not the representation's `buffer_len`.
    #[error("buffer of {available} bytes for a {needed}-byte emission")]
    BufferSize { needed: usize, available: usize },
    /// An opcode that is reserved, or belongs to a transport vrdma does not
    /// speak (RD, XRC, the IBTA 1.5 memory-placement extensions).
    #[error("unknown or unsupported opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// BTH TVer other than 0, the only transport version defined.
    #[error("unsupported BTH transport version {0} (only 0 is defined)")]
    BadTver(u8),
    /// PadCnt that cannot describe this packet: larger than the bytes after
    /// the headers, or non-zero on an opcode without payload.
    #[error("pad count {pad_cnt} impossible for {opcode} with {area} bytes after the headers")]
    BadPadCnt {
        opcode: Opcode,
        pad_cnt: u8,
        area: usize,
    },
    /// Payload plus pad is not a whole number of 4-byte words.
    #[error("payload plus pad of {len} bytes is not a multiple of 4")]
    UnalignedPayload { len: usize },
    /// An opcode that carries no payload, followed by bytes.
    #[error("{opcode} carries no payload but {len} bytes follow its headers")]
    UnexpectedPayload { opcode: Opcode, len: usize },
    /// More payload than the largest MTU allows.
    #[error("payload of {len} bytes exceeds the {max}-byte maximum MTU")]
    PayloadTooLong { len: usize, max: usize },
    /// The invariant CRC does not match the packet.
    #[error("ICRC mismatch: packet carries {found:#010x}, computed {computed:#010x}")]
    BadIcrc { found: u32, computed: u32 },
    /// An AETH syndrome with the reserved bit, the reserved type, or a
    /// reserved NAK code.
    #[error("invalid AETH syndrome {0:#04x}")]
    BadAethSyndrome(u8),
    /// A value outside the range of a field (a 24-bit PSN above 2^24, …).
    #[error("{value:#x} is out of range for {what}")]
    OutOfRange { what: &'static str, value: u64 },
    /// A representation whose extension headers do not match its opcode.
    #[error("{opcode} {} a {header}", if *.present { "does not carry" } else { "requires" })]
    HeaderMismatch {
        opcode: Opcode,
        header: Header,
        /// True when the header is present but the opcode has none.
        present: bool,
    },
    /// An EtherType other than IPv4, IPv6 or one 802.1Q tag before them.
    #[error("EtherType {0:#06x} is not IPv4, IPv6 or 802.1Q")]
    UnsupportedEtherType(u16),
    /// A VLAN tag beyond the [`crate::vlan::MAX_TAGS`] an Ethernet header
    /// may carry (802.1ad QinQ stacks two); `at` is the offset of its TPID
    /// in the frame.
    #[error("more than {max} VLAN tags: another TPID {tpid:#06x} at byte {at}")]
    TooManyVlanTags { max: usize, tpid: u16, at: usize },
    /// A VXLAN header without the I flag, so without a valid VNI
    /// (RFC 7348 §5).
    #[error("VXLAN flags {0:#04x} lack the I flag (0x08): no valid VNI")]
    BadVxlanFlags(u8),
    /// An IP version nibble that does not match the header it is in.
    #[error("IP version {0} where {1} was expected")]
    BadIpVersion(u8, u8),
    /// IPv4 IHL below 5, or a header longer than the packet.
    #[error("IPv4 header length {0} words is invalid")]
    BadIpv4HeaderLen(u8),
    /// IPv4 header checksum mismatch.
    #[error("IPv4 header checksum {found:#06x}, computed {computed:#06x}")]
    BadIpv4Checksum { found: u16, computed: u16 },
    /// IP total / payload length that disagrees with the bytes present.
    #[error("{header} says {stated} bytes, {available} available")]
    BadLength {
        header: Header,
        stated: usize,
        available: usize,
    },
    /// A fragment: RoCEv2 packets are never fragmented.
    #[error("IPv4 fragment (offset {offset}, more fragments {more})")]
    Fragmented { offset: u16, more: bool },
    /// An IP protocol / next header other than UDP.
    #[error("IP protocol {0} is not UDP")]
    NotUdp(u8),
    /// A UDP datagram not addressed to the RoCEv2 port.
    #[error("UDP destination port {0} is not RoCEv2 (4791)")]
    NotRoce(u16),
    /// A non-zero UDP checksum that does not verify.
    #[error("UDP checksum {found:#06x}, computed {computed:#06x}")]
    BadUdpChecksum { found: u16, computed: u16 },
    /// A GRH area that holds neither an IPv6 header nor a zero-prefixed IPv4
    /// header.
    #[error("GRH holds neither an IPv6 header nor an IPv4 header at offset 20")]
    BadGrh,
}
