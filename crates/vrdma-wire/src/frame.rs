//! A RoCEv2 packet in its framing: Ethernet II (optionally 802.1Q-tagged),
//! IPv4 or IPv6, UDP to port 4791, then the RoCE packet whose ICRC covers
//! the IP and UDP headers.
//!
//! [`decode_ethernet`] / [`decode_ip`] parse and report the ICRC check
//! separately (for tools that show bad packets); [`Repr::parse_ethernet`]
//! and [`Repr::parse_ip`] turn a bad ICRC into an error (for receivers).

use core::net::IpAddr;

use crate::{
    Error, Header, Result, ethernet, icrc, ipv4, ipv6, packet,
    udp::{self, PseudoHeader},
};

/// The network layer of a RoCEv2 packet.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum IpRepr {
    V4(ipv4::Repr),
    V6(ipv6::Repr),
}

impl IpRepr {
    pub fn src(&self) -> IpAddr {
        match self {
            IpRepr::V4(r) => IpAddr::V4(r.src),
            IpRepr::V6(r) => IpAddr::V6(r.src),
        }
    }

    pub fn dst(&self) -> IpAddr {
        match self {
            IpRepr::V4(r) => IpAddr::V4(r.dst),
            IpRepr::V6(r) => IpAddr::V6(r.dst),
        }
    }

    /// The pseudo-header for the UDP checksum.
    pub fn pseudo_header(&self) -> PseudoHeader {
        match self {
            IpRepr::V4(r) => PseudoHeader::V4 {
                src: r.src,
                dst: r.dst,
            },
            IpRepr::V6(r) => PseudoHeader::V6 {
                src: r.src,
                dst: r.dst,
            },
        }
    }

    pub const fn buffer_len(&self) -> usize {
        match self {
            IpRepr::V4(r) => r.buffer_len(),
            IpRepr::V6(r) => r.buffer_len(),
        }
    }

    fn with_payload_len(self, len: usize) -> Self {
        match self {
            IpRepr::V4(r) => IpRepr::V4(ipv4::Repr {
                payload_len: len,
                ..r
            }),
            IpRepr::V6(r) => IpRepr::V6(ipv6::Repr {
                payload_len: len,
                ..r
            }),
        }
    }

    fn emit(&self, d: &mut [u8]) -> Result<()> {
        match self {
            IpRepr::V4(r) => r.emit(d),
            IpRepr::V6(r) => r.emit(d),
        }
    }
}

/// A RoCEv2 packet with its framing.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr<'a> {
    /// The Ethernet header; `None` for a bare IP packet.
    pub ethernet: Option<ethernet::Repr>,
    /// The IP header. Its `payload_len` is recomputed on emit.
    pub ip: IpRepr,
    pub udp: udp::Repr,
    pub roce: packet::Repr<'a>,
}

/// The ICRC as found in a packet and as computed over it.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct IcrcCheck {
    pub found: u32,
    pub computed: u32,
}

impl IcrcCheck {
    pub const fn is_good(&self) -> bool {
        self.found == self.computed
    }
}

/// A parsed frame and the outcome of its ICRC check.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Decoded<'a> {
    pub repr: Repr<'a>,
    pub icrc: IcrcCheck,
}

/// Parses an Ethernet frame carrying RoCEv2; the ICRC is reported, not
/// enforced. Bytes after the IP packet (Ethernet padding) are ignored.
pub fn decode_ethernet(frame: &[u8]) -> Result<Decoded<'_>> {
    let f = ethernet::Frame::new_checked(frame)?;
    let eth = ethernet::Repr::parse(&f)?;
    let payload = &frame[f.header_len()..];
    let version = match eth.ethertype {
        ethernet::EtherType::Ipv4 => 4,
        ethernet::EtherType::Ipv6 => 6,
    };
    let mut d = decode_ip_version(payload, version)?;
    d.repr.ethernet = Some(eth);
    Ok(d)
}

/// Parses a bare IPv4 or IPv6 packet carrying RoCEv2 (told apart by the
/// version nibble); the ICRC is reported, not enforced.
pub fn decode_ip(packet: &[u8]) -> Result<Decoded<'_>> {
    crate::need(Header::Ipv4, 1, packet.len())?;
    decode_ip_version(packet, packet[0] >> 4)
}

fn decode_ip_version(data: &[u8], version: u8) -> Result<Decoded<'_>> {
    let (ip, ip_header, datagram) = match version {
        4 => {
            let p = ipv4::Packet::new_checked(data)?;
            let r = ipv4::Repr::parse(&p)?;
            let hl = p.header_len();
            let total = usize::from(p.total_len());
            (IpRepr::V4(r), &data[..hl], &data[hl..total])
        }
        6 => {
            let p = ipv6::Packet::new_checked(data)?;
            let r = ipv6::Repr::parse(&p)?;
            let end = ipv6::HEADER_LEN + r.payload_len;
            (
                IpRepr::V6(r),
                &data[..ipv6::HEADER_LEN],
                &data[ipv6::HEADER_LEN..end],
            )
        }
        v => return Err(Error::BadIpVersion(v, 4)),
    };
    let u = udp::Packet::new_checked(datagram)?;
    let udp = udp::Repr::parse(&u, ip.pseudo_header())?;
    let roce_bytes = &datagram[udp::HEADER_LEN..];
    let roce = packet::Repr::parse(&packet::Packet::new_checked(roce_bytes)?)?;
    let computed = icrc::compute(ip_header, &datagram[..udp::HEADER_LEN], roce_bytes)?;
    Ok(Decoded {
        repr: Repr {
            ethernet: None,
            ip,
            udp,
            roce,
        },
        icrc: IcrcCheck {
            found: icrc::stored(roce_bytes),
            computed,
        },
    })
}

impl<'a> Repr<'a> {
    /// Parses an Ethernet frame and verifies the ICRC (the comparison always
    /// passes under `cfg(fuzzing)`).
    pub fn parse_ethernet(frame: &'a [u8]) -> Result<Self> {
        Self::checked(decode_ethernet(frame)?)
    }

    /// Parses a bare IP packet and verifies the ICRC.
    pub fn parse_ip(packet: &'a [u8]) -> Result<Self> {
        Self::checked(decode_ip(packet)?)
    }

    fn checked(d: Decoded<'a>) -> Result<Self> {
        if d.icrc.is_good() || cfg!(fuzzing) {
            Ok(d.repr)
        } else {
            Err(Error::BadIcrc {
                found: d.icrc.found,
                computed: d.icrc.computed,
            })
        }
    }

    /// Length of the whole frame (or IP packet when `ethernet` is `None`).
    pub const fn buffer_len(&self) -> usize {
        let eth = match &self.ethernet {
            Some(e) => e.buffer_len(),
            None => 0,
        };
        eth + self.ip.buffer_len() + udp::HEADER_LEN + self.roce.buffer_len()
    }

    /// Writes the frame into `buf`, which must be exactly
    /// [`Self::buffer_len`] bytes: headers, lengths, IPv4 checksum, ICRC and
    /// (if requested) the UDP checksum are all computed here.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        let len = self.buffer_len();
        if buf.len() != len {
            return Err(Error::BadLength {
                header: Header::Ethernet,
                stated: len,
                available: buf.len(),
            });
        }
        let mut at = 0;
        if let Some(e) = &self.ethernet {
            e.emit(buf)?;
            at = e.buffer_len();
        }
        let ip_at = at;
        let udp_at = ip_at + self.ip.buffer_len();
        let roce_at = udp_at + udp::HEADER_LEN;
        let roce_len = self.roce.buffer_len();
        let ip = self.ip.with_payload_len(udp::HEADER_LEN + roce_len);

        let mut rp = packet::Packet::new_unchecked(&mut buf[roce_at..]);
        self.roce.emit(&mut rp)?;
        ip.emit(&mut buf[ip_at..udp_at])?;
        // The ICRC masks the UDP checksum, so the header can be written
        // without it first; the checksum (which covers the ICRC) comes last.
        udp::Repr {
            checksum: false,
            ..self.udp
        }
        .emit(&mut buf[udp_at..], ip.pseudo_header())?;
        let crc = icrc::compute(&buf[ip_at..udp_at], &buf[udp_at..roce_at], &buf[roce_at..])?;
        packet::Packet::new_unchecked(&mut buf[roce_at..]).set_icrc(crc);
        if self.udp.checksum {
            self.udp.emit(&mut buf[udp_at..], ip.pseudo_header())?;
        }
        Ok(())
    }
}
