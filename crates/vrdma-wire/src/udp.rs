//! UDP header (RFC 768) carrying RoCEv2 to port 4791.
//!
//! RoCEv2 senders may leave the checksum zero (Linux rxe does, over IPv4 and
//! IPv6); the ICRC protects the packet. A non-zero checksum must verify.

use core::net::{Ipv4Addr, Ipv6Addr};

use crate::{Error, Header, ROCEV2_UDP_PORT, Result, be, ipv4::checksum};

/// Length of the UDP header.
pub const HEADER_LEN: usize = 8;

mod field {
    pub const SRC_PORT: usize = 0;
    pub const DST_PORT: usize = 2;
    pub const LENGTH: usize = 4;
    pub const CHECKSUM: usize = 6;
}

crate::fixed_view!(
    "A view over a UDP datagram (header and what follows).",
    Header::Udp,
    HEADER_LEN
);

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn src_port(&self) -> u16 {
        be::u16(self.buffer.as_ref(), field::SRC_PORT)
    }
    pub fn dst_port(&self) -> u16 {
        be::u16(self.buffer.as_ref(), field::DST_PORT)
    }
    pub fn length(&self) -> u16 {
        be::u16(self.buffer.as_ref(), field::LENGTH)
    }
    pub fn checksum(&self) -> u16 {
        be::u16(self.buffer.as_ref(), field::CHECKSUM)
    }
    /// The 8-byte header.
    pub fn header(&self) -> &[u8] {
        let d = self.buffer.as_ref();
        d.get(..HEADER_LEN).unwrap_or(d)
    }
    /// The bytes after the header.
    pub fn payload(&self) -> &[u8] {
        self.buffer.as_ref().get(HEADER_LEN..).unwrap_or(&[])
    }
}

/// The IP addresses of the pseudo-header the UDP checksum covers.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum PseudoHeader {
    V4 { src: Ipv4Addr, dst: Ipv4Addr },
    V6 { src: Ipv6Addr, dst: Ipv6Addr },
}

/// The pseudo-header of a UDP datagram of `len` bytes: 12 bytes over
/// IPv4, 40 over IPv6.
fn pseudo_header(ph: PseudoHeader, len: u32, out: &mut [u8; 40]) -> &[u8] {
    match ph {
        PseudoHeader::V4 { src, dst } => {
            out[..4].copy_from_slice(&src.octets());
            out[4..8].copy_from_slice(&dst.octets());
            out[8] = 0;
            out[9] = crate::ipv4::PROTO_UDP;
            // UDP length is 16 bits over IPv4.
            out[10..12].copy_from_slice(&(len as u16).to_be_bytes());
            &out[..12]
        }
        PseudoHeader::V6 { src, dst } => {
            out[..16].copy_from_slice(&src.octets());
            out[16..32].copy_from_slice(&dst.octets());
            out[32..36].copy_from_slice(&len.to_be_bytes());
            out[36..39].fill(0);
            out[39] = crate::ipv4::PROTO_UDP;
            &out[..40]
        }
    }
}

/// UDP checksum of `datagram` (its checksum field counted as zero); a
/// computed zero is sent as 0xffff (RFC 768).
pub fn compute_checksum(ph: PseudoHeader, datagram: &[u8]) -> u16 {
    let len = u32::try_from(datagram.len()).unwrap_or(u32::MAX);
    let (head, tail) = datagram.split_at(datagram.len().min(field::CHECKSUM));
    let tail = tail.get(2..).unwrap_or(&[]);
    let mut p = [0u8; 40];
    let p = pseudo_header(ph, len, &mut p);
    let c = checksum(&[p, head, &[0, 0], tail]);
    if c == 0 { 0xffff } else { c }
}

/// What the checksum field holds before checksum offload completes it:
/// the folded sum of the pseudo-header alone (Linux's `CHECKSUM_PARTIAL`).
/// A capture taken on the sending host before the NIC (or a TAP device
/// whose peer offloads) shows this value.
pub fn offload_partial_checksum(ph: PseudoHeader, len: usize) -> u16 {
    let mut p = [0u8; 40];
    let p = pseudo_header(ph, u32::try_from(len).unwrap_or(u32::MAX), &mut p);
    !checksum(&[p])
}

/// The meaning of a UDP header carrying RoCEv2. The destination port is
/// always 4791, so it is not a field.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr {
    /// Source port: per QP for entropy (rxe: 0xC000 + a hash of the QPN).
    pub src_port: u16,
    /// Whether the checksum is computed (true) or left zero (false).
    pub checksum: bool,
}

impl Repr {
    /// Parses a datagram that fills `p` exactly: the length field must match
    /// (the IP layer has already cut the buffer to its own length), the
    /// destination port must be 4791, a non-zero checksum must verify
    /// against `ph` (always accepted under `cfg(fuzzing)`) or be the
    /// pseudo-header sum that checksum offload has yet to complete
    /// ([`offload_partial_checksum`]: only captures show it).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&T>, ph: PseudoHeader) -> Result<Self> {
        p.check_len()?;
        let available = p.buffer.as_ref().len();
        if usize::from(p.length()) != available {
            return Err(Error::BadLength {
                header: Header::Udp,
                stated: usize::from(p.length()),
                available,
            });
        }
        if p.dst_port() != ROCEV2_UDP_PORT {
            return Err(Error::NotRoce(p.dst_port()));
        }
        let found = p.checksum();
        // The pseudo-header sum first: a frame read before checksum
        // offload completed it (a TAP's) would otherwise cost a checksum
        // over the whole datagram to be told apart.
        if found != 0 && found != offload_partial_checksum(ph, available) {
            let computed = compute_checksum(ph, p.buffer.as_ref());
            if computed != found && !cfg!(fuzzing) {
                return Err(Error::BadUdpChecksum { found, computed });
            }
        }
        Ok(Self {
            src_port: p.src_port(),
            checksum: found != 0,
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header into the front of `datagram`, whose payload must
    /// already be in place when `checksum` is set.
    /// Writes only the header of a datagram of `datagram_len` bytes (its
    /// checksum zero): what a fabric needs to compute the ICRC of a
    /// datagram whose header the kernel will write.
    pub fn emit_header(&self, header: &mut [u8; HEADER_LEN], datagram_len: usize) -> Result<()> {
        let len = u16::try_from(datagram_len)
            .ok()
            .filter(|&l| usize::from(l) >= HEADER_LEN)
            .ok_or(Error::OutOfRange {
                what: "a UDP length",
                value: datagram_len as u64,
            })?;
        be::set_u16(header, field::SRC_PORT, self.src_port);
        be::set_u16(header, field::DST_PORT, ROCEV2_UDP_PORT);
        be::set_u16(header, field::LENGTH, len);
        be::set_u16(header, field::CHECKSUM, 0);
        Ok(())
    }

    pub fn emit(&self, datagram: &mut [u8], ph: PseudoHeader) -> Result<()> {
        crate::need(Header::Udp, HEADER_LEN, datagram.len())?;
        let len = u16::try_from(datagram.len()).map_err(|_| Error::OutOfRange {
            what: "a UDP length",
            value: datagram.len() as u64,
        })?;
        be::set_u16(datagram, field::SRC_PORT, self.src_port);
        be::set_u16(datagram, field::DST_PORT, ROCEV2_UDP_PORT);
        be::set_u16(datagram, field::LENGTH, len);
        be::set_u16(datagram, field::CHECKSUM, 0);
        if self.checksum {
            let c = compute_checksum(ph, datagram);
            be::set_u16(datagram, field::CHECKSUM, c);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PH: PseudoHeader = PseudoHeader::V4 {
        src: Ipv4Addr::new(10, 0, 0, 1),
        dst: Ipv4Addr::new(10, 0, 0, 2),
    };

    #[test]
    fn checksum_round_trip_v4_and_v6() {
        let v6 = PseudoHeader::V6 {
            src: Ipv6Addr::LOCALHOST,
            dst: "fe80::2".parse().unwrap(),
        };
        for ph in [PH, v6] {
            let mut d = [0u8; 13];
            d[8..].copy_from_slice(b"hello");
            let r = Repr {
                src_port: 49152,
                checksum: true,
            };
            r.emit(&mut d, ph).unwrap();
            assert_ne!(u16::from_be_bytes([d[6], d[7]]), 0);
            assert_eq!(Repr::parse(&Packet::new_unchecked(&d[..]), ph), Ok(r));
            let good = u16::from_be_bytes([d[6], d[7]]);
            d[12] ^= 0x40;
            assert_eq!(
                Repr::parse(&Packet::new_unchecked(&d[..]), ph),
                Err(Error::BadUdpChecksum {
                    found: good,
                    computed: compute_checksum(ph, &d)
                })
            );
        }
    }

    #[test]
    fn offload_partial_checksums_are_accepted() {
        // A GSO segment captured on the sending host before offload, from
        // the interop run: 10.47.91.1 → 10.47.91.11, 1060 UDP bytes.
        let ph = PseudoHeader::V4 {
            src: Ipv4Addr::new(10, 47, 91, 1),
            dst: Ipv4Addr::new(10, 47, 91, 11),
        };
        let partial = offload_partial_checksum(ph, 1060);
        let mut d = vec![0u8; 1060];
        d[..8].copy_from_slice(&[0xc0, 0x11, 0x12, 0xb7, 0x04, 0x24, 0, 0]);
        d[6..8].copy_from_slice(&partial.to_be_bytes());
        assert!(Repr::parse(&Packet::new_unchecked(&d[..]), ph).is_ok());
        // The same value for another length is a wrong checksum.
        let other = offload_partial_checksum(ph, 1061);
        assert_ne!(other, partial);
        d[6..8].copy_from_slice(&other.to_be_bytes());
        assert!(matches!(
            Repr::parse(&Packet::new_unchecked(&d[..]), ph),
            Err(Error::BadUdpChecksum { .. })
        ));
    }

    #[test]
    fn zero_checksum_is_accepted() {
        let d = [0xc0, 0x21, 0x12, 0xb7, 0, 8, 0, 0];
        let r = Repr::parse(&Packet::new_unchecked(&d[..]), PH).unwrap();
        assert_eq!((r.src_port, r.checksum), (49185, false));
    }

    #[test]
    fn wrong_port_and_length() {
        let d = [0xc0, 0x21, 0x00, 0x35, 0, 8, 0, 0];
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&d[..]), PH),
            Err(Error::NotRoce(53))
        );
        let d = [0xc0, 0x21, 0x12, 0xb7, 0, 9, 0, 0];
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&d[..]), PH),
            Err(Error::BadLength {
                header: Header::Udp,
                stated: 9,
                available: 8
            })
        );
    }

    #[test]
    fn a_computed_zero_is_sent_as_all_ones() {
        // Choose the last payload word so that the one's complement sum is
        // 0xffff: the checksum computes to 0, which RFC 768 sends as 0xffff
        // (0 would mean "no checksum").
        let mut d = [0u8; 12];
        let r = Repr {
            src_port: 0x1234,
            checksum: true,
        };
        r.emit(&mut d, PH).unwrap();
        let sum = !u16::from_be_bytes([d[6], d[7]]);
        d[10..12].copy_from_slice(&(0xffff - sum).to_be_bytes());
        assert_eq!(compute_checksum(PH, &d), 0xffff);
        r.emit(&mut d, PH).unwrap();
        assert_eq!(&d[6..8], &[0xff, 0xff]);
        assert_eq!(Repr::parse(&Packet::new_unchecked(&d[..]), PH), Ok(r));
    }
}
