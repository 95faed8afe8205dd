//! IPv4 header (RFC 791), as RoCEv2 uses it: no fragments, UDP inside.

use core::net::Ipv4Addr;

use crate::{Error, Header, Result, be};

/// Length of an IPv4 header without options.
pub const HEADER_LEN: usize = 20;
/// IP protocol number of UDP.
pub const PROTO_UDP: u8 = 17;

mod field {
    pub const VER_IHL: usize = 0;
    pub const TOS: usize = 1;
    pub const TOTAL_LEN: usize = 2;
    pub const IDENT: usize = 4;
    pub const FLAGS_FRAG: usize = 6;
    pub const TTL: usize = 8;
    pub const PROTOCOL: usize = 9;
    pub const CHECKSUM: usize = 10;
    pub const SRC: usize = 12;
    pub const DST: usize = 16;
}

const FLAG_DF: u16 = 0x4000;
const FLAG_MF: u16 = 0x2000;
const FRAG_OFFSET: u16 = 0x1fff;

/// Internet checksum (RFC 1071) over the concatenation of `parts`, each of
/// even length except possibly the last: the value a checksum field holds.
/// Summed eight bytes at a time as two 32-bit words (their sum folds to
/// the sum of the 16-bit words, as 2^16 is 1 modulo 0xffff).
pub fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u64 = 0;
    for part in parts {
        let mut words = part.chunks_exact(8);
        for c in &mut words {
            let v = u64::from_be_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            sum += (v >> 32) + (v & 0xffff_ffff);
        }
        let mut pairs = words.remainder().chunks_exact(2);
        for c in &mut pairs {
            sum += u64::from(u16::from_be_bytes([c[0], c[1]]));
        }
        if let [last] = pairs.remainder() {
            sum += u64::from(u16::from_be_bytes([*last, 0]));
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    // The loop above leaves a 16-bit value.
    !(sum as u16)
}

/// A view over an IPv4 packet.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// Checks the version, the header length and that the total length
    /// fits the buffer (bytes beyond it, such as Ethernet padding, are
    /// allowed and ignored).
    pub fn check_len(&self) -> Result<()> {
        let d = self.buffer.as_ref();
        crate::need(Header::Ipv4, HEADER_LEN, d.len())?;
        if self.version() != 4 {
            return Err(Error::BadIpVersion(self.version(), 4));
        }
        let hl = self.header_len();
        if hl < HEADER_LEN {
            return Err(Error::BadIpv4HeaderLen(self.ihl()));
        }
        let total = usize::from(self.total_len());
        if total < hl {
            return Err(Error::BadLength {
                header: Header::Ipv4,
                stated: total,
                available: hl,
            });
        }
        if total > d.len() {
            return Err(Error::BadLength {
                header: Header::Ipv4,
                stated: total,
                available: d.len(),
            });
        }
        Ok(())
    }

    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VER_IHL] >> 4
    }
    /// Header length in 32-bit words.
    pub fn ihl(&self) -> u8 {
        self.buffer.as_ref()[field::VER_IHL] & 0x0f
    }
    /// Header length in bytes.
    pub fn header_len(&self) -> usize {
        usize::from(self.ihl()) * 4
    }
    /// Type of service: DSCP (6 bits) and ECN (2 bits).
    pub fn tos(&self) -> u8 {
        self.buffer.as_ref()[field::TOS]
    }
    pub fn total_len(&self) -> u16 {
        be::u16(self.buffer.as_ref(), field::TOTAL_LEN)
    }
    pub fn ident(&self) -> u16 {
        be::u16(self.buffer.as_ref(), field::IDENT)
    }
    pub fn dont_frag(&self) -> bool {
        be::u16(self.buffer.as_ref(), field::FLAGS_FRAG) & FLAG_DF != 0
    }
    pub fn more_frags(&self) -> bool {
        be::u16(self.buffer.as_ref(), field::FLAGS_FRAG) & FLAG_MF != 0
    }
    /// Fragment offset in 8-byte units.
    pub fn frag_offset(&self) -> u16 {
        be::u16(self.buffer.as_ref(), field::FLAGS_FRAG) & FRAG_OFFSET
    }
    pub fn ttl(&self) -> u8 {
        self.buffer.as_ref()[field::TTL]
    }
    pub fn protocol(&self) -> u8 {
        self.buffer.as_ref()[field::PROTOCOL]
    }
    pub fn checksum(&self) -> u16 {
        be::u16(self.buffer.as_ref(), field::CHECKSUM)
    }
    pub fn src(&self) -> Ipv4Addr {
        Ipv4Addr::from(be::u32(self.buffer.as_ref(), field::SRC))
    }
    pub fn dst(&self) -> Ipv4Addr {
        Ipv4Addr::from(be::u32(self.buffer.as_ref(), field::DST))
    }

    /// The header, options included (needs `check_len`).
    pub fn header(&self) -> &[u8] {
        let d = self.buffer.as_ref();
        d.get(..self.header_len()).unwrap_or(d)
    }

    /// The bytes the total length covers after the header.
    pub fn payload(&self) -> &[u8] {
        let d = self.buffer.as_ref();
        d.get(self.header_len()..usize::from(self.total_len()))
            .unwrap_or(&[])
    }

    /// The header checksum computed over the header as it stands (the
    /// stored checksum counts as zero).
    pub fn compute_checksum(&self) -> u16 {
        let h = self.header();
        if h.len() < HEADER_LEN {
            return 0;
        }
        checksum(&[&h[..field::CHECKSUM], &h[field::CHECKSUM + 2..]])
    }
}

/// The meaning of an IPv4 header carrying RoCEv2.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    /// DSCP and ECN.
    pub tos: u8,
    pub ident: u16,
    pub dont_frag: bool,
    pub ttl: u8,
    /// Bytes after the header (the UDP datagram).
    pub payload_len: usize,
}

impl Repr {
    /// Parses the header: checksum verified (always accepted under
    /// `cfg(fuzzing)`), fragments rejected, protocol must be UDP. Options
    /// are skipped and not kept: emitting gives a 20-byte header.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>) -> Result<Self> {
        p.check_len()?;
        Self::parse_header(p, p.payload().len())
    }

    /// The checks and fields of [`Self::parse`] for a header whose payload
    /// is not in the buffer (a GRH area); the caller has checked that the
    /// whole header is.
    pub(crate) fn parse_header<T: AsRef<[u8]> + ?Sized>(
        p: &Packet<&T>,
        payload_len: usize,
    ) -> Result<Self> {
        let computed = p.compute_checksum();
        if computed != p.checksum() && !cfg!(fuzzing) {
            return Err(Error::BadIpv4Checksum {
                found: p.checksum(),
                computed,
            });
        }
        if p.more_frags() || p.frag_offset() != 0 {
            return Err(Error::Fragmented {
                offset: p.frag_offset(),
                more: p.more_frags(),
            });
        }
        if p.protocol() != PROTO_UDP {
            return Err(Error::NotUdp(p.protocol()));
        }
        Ok(Self {
            src: p.src(),
            dst: p.dst(),
            tos: p.tos(),
            ident: p.ident(),
            dont_frag: p.dont_frag(),
            ttl: p.ttl(),
            payload_len,
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes a 20-byte header with its checksum into the front of `d`.
    pub fn emit(&self, d: &mut [u8]) -> Result<()> {
        crate::need(Header::Ipv4, HEADER_LEN, d.len())?;
        let total = HEADER_LEN
            .checked_add(self.payload_len)
            .and_then(|n| u16::try_from(n).ok())
            .ok_or(Error::OutOfRange {
                what: "an IPv4 payload length",
                value: self.payload_len as u64,
            })?;
        let h = &mut d[..HEADER_LEN];
        h[field::VER_IHL] = 0x45;
        h[field::TOS] = self.tos;
        be::set_u16(h, field::TOTAL_LEN, total);
        be::set_u16(h, field::IDENT, self.ident);
        be::set_u16(
            h,
            field::FLAGS_FRAG,
            if self.dont_frag { FLAG_DF } else { 0 },
        );
        h[field::TTL] = self.ttl;
        h[field::PROTOCOL] = PROTO_UDP;
        be::set_u16(h, field::CHECKSUM, 0);
        h[field::SRC..field::SRC + 4].copy_from_slice(&self.src.octets());
        h[field::DST..field::DST + 4].copy_from_slice(&self.dst.octets());
        let c = checksum(&[h]);
        be::set_u16(h, field::CHECKSUM, c);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // IPv4 header of an RC ACK from rc_pingpong_64.pcap (rxe, 10.47.91.11 →
    // 10.47.91.12, DF, TTL 64, UDP, 48 bytes).
    static HDR: [u8; 20] = [
        0x45, 0x00, 0x00, 0x30, 0xf9, 0x0e, 0x40, 0x00, 0x40, 0x11, 0x77, 0x39, 0x0a, 0x2f, 0x5b,
        0x0b, 0x0a, 0x2f, 0x5b, 0x0c,
    ];

    fn packet() -> Vec<u8> {
        let mut v = HDR.to_vec();
        v.resize(48, 0);
        v
    }

    /// RFC 1071's sum, 16 bits at a time: what [`checksum`] must equal.
    fn reference(parts: &[&[u8]]) -> u16 {
        let mut sum: u32 = 0;
        for part in parts {
            for c in part.chunks(2) {
                let w = u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]);
                sum += u32::from(w);
                sum = (sum & 0xffff) + (sum >> 16);
            }
        }
        !(sum as u16)
    }

    proptest::proptest! {
        #[test]
        fn the_wide_sum_is_rfc_1071s(
            a in proptest::collection::vec(proptest::num::u16::ANY, 0..800),
            b in proptest::collection::vec(proptest::num::u8::ANY, 0..1600),
        ) {
            let a: Vec<u8> = a.iter().flat_map(|w| w.to_be_bytes()).collect();
            proptest::prop_assert_eq!(checksum(&[&a, &b]), reference(&[&a, &b]));
            proptest::prop_assert_eq!(checksum(&[&b]), reference(&[&b]));
        }
    }

    #[test]
    fn checksum_of_a_real_header_verifies() {
        let v = packet();
        let p = Packet::new_checked(&v[..]).unwrap();
        assert_eq!(p.compute_checksum(), p.checksum());
        let r = Repr::parse(&p).unwrap();
        assert_eq!(r.src, Ipv4Addr::new(10, 47, 91, 11));
        assert_eq!(r.payload_len, 28);
        let mut out = [0; 20];
        r.emit(&mut out).unwrap();
        assert_eq!(out, HDR);
    }

    #[test]
    fn bad_checksum() {
        let mut v = packet();
        v[11] ^= 1;
        let p = Packet::new_checked(&v[..]).unwrap();
        assert_eq!(
            Repr::parse(&p),
            Err(Error::BadIpv4Checksum {
                found: 0x7738,
                computed: 0x7739
            })
        );
    }

    #[test]
    fn fragments_are_rejected() {
        let r = Repr::parse(&Packet::new_unchecked(&packet()[..])).unwrap();
        let mut v = packet();
        v[6] = 0x20; // MF
        v[10..12].fill(0);
        let c = checksum(&[&v[..20]]);
        v[10..12].copy_from_slice(&c.to_be_bytes());
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&v[..])),
            Err(Error::Fragmented {
                offset: 0,
                more: true
            })
        );
        assert!(r.dont_frag);
    }

    #[test]
    fn total_length_beyond_buffer() {
        let v = packet();
        assert_eq!(
            Packet::new_checked(&v[..40]),
            Err(Error::BadLength {
                header: Header::Ipv4,
                stated: 48,
                available: 40
            })
        );
    }

    #[test]
    fn short_ihl() {
        let mut v = packet();
        v[0] = 0x44;
        assert_eq!(Packet::new_checked(&v[..]), Err(Error::BadIpv4HeaderLen(4)));
    }

    fn with_flags(flags_frag: u16) -> Vec<u8> {
        let mut v = packet();
        v[6..8].copy_from_slice(&flags_frag.to_be_bytes());
        v[10..12].fill(0);
        let c = checksum(&[&v[..20]]);
        v[10..12].copy_from_slice(&c.to_be_bytes());
        v
    }

    #[test]
    fn a_later_fragment_is_rejected() {
        let v = with_flags(0x0003); // offset 3 (24 bytes), no MF, no DF
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&v[..])),
            Err(Error::Fragmented {
                offset: 3,
                more: false
            })
        );
    }

    #[test]
    fn not_udp() {
        let mut v = with_flags(0x4000);
        v[9] = 6;
        v[10..12].fill(0);
        let c = checksum(&[&v[..20]]);
        v[10..12].copy_from_slice(&c.to_be_bytes());
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&v[..])),
            Err(Error::NotUdp(6))
        );
    }

    #[test]
    fn emit_refuses_a_payload_too_long_for_the_length_field() {
        let r = Repr {
            payload_len: usize::MAX,
            ..Repr::parse(&Packet::new_unchecked(&packet()[..])).unwrap()
        };
        assert_eq!(
            r.emit(&mut [0; 20]),
            Err(Error::OutOfRange {
                what: "an IPv4 payload length",
                value: u64::MAX
            })
        );
    }
}
