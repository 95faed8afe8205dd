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

    /// The source GID (IPv4-mapped for IPv4).
    pub fn sgid(&self) -> crate::Gid {
        match self {
            IpRepr::V4(r) => r.src.into(),
            IpRepr::V6(r) => r.src.into(),
        }
    }

    /// The destination GID (IPv4-mapped for IPv4).
    pub fn dgid(&self) -> crate::Gid {
        match self {
            IpRepr::V4(r) => r.dst.into(),
            IpRepr::V6(r) => r.dst.into(),
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

    pub(crate) fn with_payload_len(self, len: usize) -> Self {
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

    /// Writes the header into the front of `d`.
    pub fn emit(&self, d: &mut [u8]) -> Result<()> {
        match self {
            IpRepr::V4(r) => r.emit(d),
            IpRepr::V6(r) => r.emit(d),
        }
    }
}

/// Where a RoCEv2 packet goes at the IP layer: its GIDs and the header
/// fields the sender chooses. A fabric turns it into the IP header the
/// packet travels with ([`Route::ip`]).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Route {
    pub src: crate::Gid,
    pub dst: crate::Gid,
    pub traffic_class: u8,
    pub hop_limit: u8,
    pub flow_label: u32,
}

impl Route {
    /// The IP header of a RoCE packet of `roce_len` bytes (BTH through
    /// ICRC) on this route: IPv4 when both GIDs are IPv4-mapped, with DF
    /// and Identification `ident`, else IPv6.
    pub fn ip(&self, roce_len: usize, ident: u16) -> Result<IpRepr> {
        crate::need(Header::Bth, packet::MIN_LEN, roce_len)?;
        let payload_len = udp::HEADER_LEN + roce_len;
        Ok(match (self.src.to_ipv4(), self.dst.to_ipv4()) {
            (Some(src), Some(dst)) => IpRepr::V4(ipv4::Repr {
                src,
                dst,
                tos: self.traffic_class,
                ident,
                dont_frag: true,
                ttl: self.hop_limit,
                payload_len,
            }),
            _ => IpRepr::V6(ipv6::Repr {
                src: self.src.into(),
                dst: self.dst.into(),
                traffic_class: self.traffic_class,
                flow_label: self.flow_label,
                hop_limit: self.hop_limit,
                payload_len,
            }),
        })
    }
}

/// Frames the RoCE packet `roce` (BTH through the ICRC field) into a whole
/// IP packet in `out`: the IP header `ip`, a UDP header from `src_port` to
/// 4791 without checksum (RoCEv2's ICRC covers the packet), and the ICRC
/// stored. What a fabric that carries whole IP packets (a tap, a
/// simulator) puts on its wire.
pub fn emit_ip_packet(ip: &IpRepr, src_port: u16, roce: &[u8], out: &mut Vec<u8>) -> Result<()> {
    crate::need(Header::Bth, packet::MIN_LEN, roce.len())?;
    out.clear();
    out.resize(ip.buffer_len() + udp::HEADER_LEN, 0);
    out.extend_from_slice(roce);
    seal_ip_packet(ip, src_port, out)
}

/// [`emit_ip_packet`] in place: `packet` holds room for the IP and UDP
/// headers (`ip.buffer_len()` and 8 bytes), then the RoCE packet (BTH
/// through the ICRC field); the headers are written and the ICRC stored.
/// A fabric that gathers the packet where it will be sent copies it once.
pub fn seal_ip_packet(ip: &IpRepr, src_port: u16, packet: &mut [u8]) -> Result<()> {
    let udp_at = ip.buffer_len();
    let roce_at = udp_at + udp::HEADER_LEN;
    let roce_len = packet.len().saturating_sub(roce_at);
    crate::need(Header::Bth, packet::MIN_LEN, roce_len)?;
    ip.with_payload_len(udp::HEADER_LEN + roce_len)
        .emit(&mut packet[..udp_at])?;
    udp::Repr {
        src_port,
        checksum: false,
    }
    .emit(&mut packet[udp_at..], ip.pseudo_header())?;
    let (headers, roce) = packet.split_at_mut(roce_at);
    let crc = icrc::compute(&headers[..udp_at], &headers[udp_at..], roce)?;
    packet::Packet::new_unchecked(roce).set_icrc(crc);
    Ok(())
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

/// The UDP destination port of a frame, read without validating anything
/// else: `Some` when the frame is (or claims to be) IPv4/IPv6 carrying the
/// first fragment of a UDP datagram whose header's port field is present.
/// Tools use it to tell RoCEv2 that is malformed from traffic that is not
/// RoCEv2 at all. `ethernet` says whether `data` starts with an Ethernet
/// header (else with the IP header).
pub fn peek_udp_dst_port(data: &[u8], ethernet: bool) -> Option<u16> {
    let ip = if ethernet {
        let f = ethernet::Frame::new_checked(data).ok()?;
        let ip = data.get(f.header_len()..)?;
        let version = match f.ethertype() {
            0x0800 => 4,
            0x86dd => 6,
            _ => return None,
        };
        if ip.first()? >> 4 != version {
            return None;
        }
        ip
    } else {
        data
    };
    let udp_at = match ip.first()? >> 4 {
        4 => {
            let p = ipv4::Packet::new_unchecked(ip);
            let ihl = usize::from(ip.first()? & 0x0f) * 4;
            ip.get(..ipv4::HEADER_LEN)?;
            if p.protocol() != ipv4::PROTO_UDP || p.frag_offset() != 0 {
                return None;
            }
            ihl
        }
        6 => {
            ip.get(..ipv6::HEADER_LEN)?;
            if ipv6::Packet::new_unchecked(ip).next_header() != ipv4::PROTO_UDP {
                return None;
            }
            ipv6::HEADER_LEN
        }
        _ => return None,
    };
    let port = ip.get(udp_at + 2..udp_at + 4)?;
    Some(u16::from_be_bytes([port[0], port[1]]))
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
    decode_ip_version(Some(eth), payload, version)
}

/// Parses a bare IPv4 or IPv6 packet carrying RoCEv2 (told apart by the
/// version nibble); the ICRC is reported, not enforced.
pub fn decode_ip(packet: &[u8]) -> Result<Decoded<'_>> {
    crate::need(Header::Ipv4, 1, packet.len())?;
    decode_ip_version(None, packet, packet[0] >> 4)
}

/// The IP header of a bare IP packet (`version` 4 or 6), parsed, with
/// the header's bytes and the datagram it carries.
pub(crate) fn ip_parts(data: &[u8], version: u8) -> Result<(IpRepr, &[u8], &[u8])> {
    Ok(match version {
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
    })
}

/// A bare IP packet carrying RoCEv2 whose IP and UDP headers were checked
/// and whose ICRC was verified, the RoCE packet itself left unparsed: what
/// a fabric hands to the engine (which parses the RoCE part once).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Unframed<'a> {
    pub ip: IpRepr,
    pub udp: udp::Repr,
    /// BTH through ICRC (at least [`packet::MIN_LEN`] bytes).
    pub roce: &'a [u8],
}

/// Checks the IP and UDP headers of a bare IPv4 or IPv6 packet and the
/// ICRC of the RoCEv2 packet inside (the comparison always passes under
/// `cfg(fuzzing)`), without parsing the RoCE headers.
pub fn unframe_ip(packet: &[u8]) -> Result<Unframed<'_>> {
    crate::need(Header::Ipv4, 1, packet.len())?;
    let (ip, ip_header, datagram) = ip_parts(packet, packet[0] >> 4)?;
    let u = udp::Packet::new_checked(datagram)?;
    let udp = udp::Repr::parse(&u, ip.pseudo_header())?;
    let roce = &datagram[udp::HEADER_LEN..];
    crate::need(Header::Bth, packet::MIN_LEN, roce.len())?;
    icrc::verify(ip_header, &datagram[..udp::HEADER_LEN], roce)?;
    Ok(Unframed { ip, udp, roce })
}

/// What a UDP socket reports about a datagram it received: enough to
/// rebuild the IP and UDP headers the ICRC covers.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct DatagramInfo {
    pub src: core::net::SocketAddr,
    /// The receiver's own address (the socket's bound address).
    pub dst: IpAddr,
    /// IPv4 TOS / IPv6 traffic class (`IP_RECVTOS` / `IPV6_RECVTCLASS`).
    pub traffic_class: u8,
    /// IPv4 TTL / IPv6 hop limit (`IP_RECVTTL` / `IPV6_RECVHOPLIMIT`).
    pub hop_limit: u8,
    /// IPv6 only (`IPV6_FLOWINFO`); the ICRC masks it.
    pub flow_label: u32,
}

/// The counterpart of [`unframe_ip`] for a fabric that receives through a
/// UDP socket: rebuilds the IP and UDP headers from `info` (the UDP
/// destination port is 4791, the socket's; no checksum, which the ICRC
/// masks anyway) and verifies the ICRC of `roce`, the datagram's payload.
/// IPv4's Identification is not visible through a socket, so it is
/// recovered from the ICRC ([`icrc::verify_ipv4_recover_ident`], a 16-bit
/// weaker check than [`icrc::verify`]); the IPv4 header is assumed to
/// carry DF and no options, as RoCEv2 senders write it.
pub fn unframe_datagram<'a>(info: &DatagramInfo, roce: &'a [u8]) -> Result<Unframed<'a>> {
    crate::need(Header::Bth, packet::MIN_LEN, roce.len())?;
    let payload_len = udp::HEADER_LEN + roce.len();
    let mut ip = match (info.src.ip(), info.dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => IpRepr::V4(ipv4::Repr {
            src,
            dst,
            tos: info.traffic_class,
            ident: 0,
            dont_frag: true,
            ttl: info.hop_limit,
            payload_len,
        }),
        (IpAddr::V6(src), IpAddr::V6(dst)) => IpRepr::V6(ipv6::Repr {
            src,
            dst,
            traffic_class: info.traffic_class,
            flow_label: info.flow_label & 0x000f_ffff,
            hop_limit: info.hop_limit,
            payload_len,
        }),
        (src, dst) => {
            let v = |a: IpAddr| if a.is_ipv4() { 4 } else { 6 };
            return Err(Error::BadIpVersion(v(src), v(dst)));
        }
    };
    let udp = udp::Repr {
        src_port: info.src.port(),
        checksum: false,
    };
    let udp_len = u16::try_from(payload_len).map_err(|_| Error::OutOfRange {
        what: "a UDP length",
        value: payload_len as u64,
    })?;
    let mut headers = [0u8; ipv6::HEADER_LEN + udp::HEADER_LEN];
    let ip_len = ip.buffer_len();
    let (ip_header, rest) = headers.split_at_mut(ip_len);
    ip.emit(ip_header)?;
    // The payload lives elsewhere, so the UDP header is written field by
    // field (its checksum zero: the ICRC masks it).
    let udp_header = &mut rest[..udp::HEADER_LEN];
    udp_header[0..2].copy_from_slice(&udp.src_port.to_be_bytes());
    udp_header[2..4].copy_from_slice(&crate::ROCEV2_UDP_PORT.to_be_bytes());
    udp_header[4..6].copy_from_slice(&udp_len.to_be_bytes());
    match &mut ip {
        IpRepr::V4(v4) => {
            v4.ident = icrc::verify_ipv4_recover_ident(ip_header, udp_header, roce)?;
        }
        IpRepr::V6(_) => icrc::verify(ip_header, udp_header, roce)?,
    }
    Ok(Unframed { ip, udp, roce })
}

pub(crate) fn decode_ip_version(
    ethernet: Option<ethernet::Repr>,
    data: &[u8],
    version: u8,
) -> Result<Decoded<'_>> {
    let (ip, ip_header, datagram) = ip_parts(data, version)?;
    let u = udp::Packet::new_checked(datagram)?;
    let udp = udp::Repr::parse(&u, ip.pseudo_header())?;
    let roce_bytes = &datagram[udp::HEADER_LEN..];
    let roce = packet::Repr::parse(&packet::Packet::new_checked(roce_bytes)?)?;
    let computed = icrc::compute(ip_header, &datagram[..udp::HEADER_LEN], roce_bytes)?;
    Ok(Decoded {
        repr: Repr {
            ethernet,
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
            return Err(Error::BufferSize {
                needed: len,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Msn, Opcode, aeth};

    // Frame 2 of rc_pingpong_64.pcap: Linux rxe's RC ACKNOWLEDGE,
    // 10.47.91.11 → 10.47.91.12, QP 0x11, PSN 0x2bfb3c, MSN 1.
    static RXE_ACK: [u8; 62] = [
        0x52, 0x54, 0x00, 0x47, 0x91, 0x02, 0x52, 0x54, 0x00, 0x47, 0x91, 0x01, 0x08, 0x00, 0x45,
        0x00, 0x00, 0x30, 0xf9, 0x0e, 0x40, 0x00, 0x40, 0x11, 0x77, 0x39, 0x0a, 0x2f, 0x5b, 0x0b,
        0x0a, 0x2f, 0x5b, 0x0c, 0xc1, 0x43, 0x12, 0xb7, 0x00, 0x1c, 0x00, 0x00, 0x11, 0x00, 0xff,
        0xff, 0x00, 0x00, 0x00, 0x11, 0x00, 0x2b, 0xfb, 0x3c, 0x1f, 0x00, 0x00, 0x01, 0x01, 0x67,
        0xae, 0xcb,
    ];
    const RXE_ACK_ICRC: u32 = 0xcbae_6701;

    #[test]
    fn deconstruct_a_real_ack() {
        let r = Repr::parse_ethernet(&RXE_ACK).unwrap();
        assert_eq!(r.ip.src().to_string(), "10.47.91.11");
        assert_eq!(r.udp.src_port, 0xc143);
        assert!(!r.udp.checksum);
        assert_eq!(r.roce.bth.opcode, Opcode::RcAcknowledge);
        assert_eq!(r.roce.bth.psn.value(), 0x2b_fb3c);
        assert_eq!(
            r.roce.ext.aeth,
            Some(aeth::Repr {
                syndrome: aeth::Syndrome::Ack(aeth::CreditCode::INVALID),
                msn: Msn::from_masked(1),
            })
        );
        let d = decode_ethernet(&RXE_ACK).unwrap();
        assert_eq!(
            d.icrc,
            IcrcCheck {
                found: RXE_ACK_ICRC,
                computed: RXE_ACK_ICRC
            }
        );
    }

    #[test]
    fn bad_icrc() {
        let mut f = RXE_ACK;
        f[57] ^= 0x02; // MSN 1 → 3
        let computed = decode_ethernet(&f).unwrap().icrc.computed;
        assert_ne!(computed, RXE_ACK_ICRC);
        assert_eq!(
            Repr::parse_ethernet(&f),
            Err(Error::BadIcrc {
                found: RXE_ACK_ICRC,
                computed
            })
        );
        // The ICRC itself damaged.
        let mut f = RXE_ACK;
        f[61] ^= 0x80;
        assert_eq!(
            Repr::parse_ethernet(&f),
            Err(Error::BadIcrc {
                found: RXE_ACK_ICRC ^ 0x8000_0000,
                computed: RXE_ACK_ICRC
            })
        );
    }

    #[test]
    fn masked_fields_do_not_change_the_icrc() {
        // TTL and TOS (with the IPv4 checksum fixed up) and BTH byte 4
        // (FECN) are outside the ICRC.
        let mut f = RXE_ACK;
        f[22] = 3; // TTL
        f[15] = 0x02; // ECN
        let c = crate::ipv4::Packet::new_unchecked(&f[14..34]).compute_checksum();
        f[24..26].copy_from_slice(&c.to_be_bytes());
        f[46] |= 0x80; // FECN
        let d = decode_ethernet(&f).unwrap();
        assert!(d.icrc.is_good());
        assert!(d.repr.roce.bth.fecn);
    }

    #[test]
    fn truncated_frame() {
        assert_eq!(
            decode_ethernet(&RXE_ACK[..13]),
            Err(Error::Truncated {
                header: Header::Ethernet,
                needed: 14,
                available: 13
            })
        );
        // Cut inside the ICRC: the IPv4 total length no longer fits.
        assert_eq!(
            decode_ethernet(&RXE_ACK[..60]),
            Err(Error::BadLength {
                header: Header::Ipv4,
                stated: 48,
                available: 46
            })
        );
    }

    #[test]
    fn ethernet_padding_is_ignored() {
        let mut f = RXE_ACK.to_vec();
        f.extend_from_slice(&[0; 6]);
        assert_eq!(
            Repr::parse_ethernet(&f).unwrap(),
            Repr::parse_ethernet(&RXE_ACK).unwrap()
        );
    }

    #[test]
    fn wrong_buffer_size_on_emit() {
        let r = Repr::parse_ethernet(&RXE_ACK).unwrap();
        let mut short = [0u8; 61];
        assert_eq!(
            r.emit(&mut short),
            Err(Error::BufferSize {
                needed: 62,
                available: 61
            })
        );
    }

    #[test]
    fn ipv4_options_are_accepted_and_covered_by_the_icrc() {
        // Insert four NOP options into the rxe ACK, fix IHL, total length
        // and header checksum, and recompute the ICRC (it covers options).
        let mut f = RXE_ACK[..34].to_vec();
        f.extend_from_slice(&[1, 1, 1, 1]);
        f.extend_from_slice(&RXE_ACK[34..]);
        f[14] = 0x46;
        f[16..18].copy_from_slice(&52u16.to_be_bytes());
        let fix_checksum = |f: &mut Vec<u8>| {
            f[24..26].fill(0);
            let c = crate::ipv4::checksum(&[&f[14..38]]);
            f[24..26].copy_from_slice(&c.to_be_bytes());
        };
        fix_checksum(&mut f);
        let crc = icrc::compute(&f[14..38], &f[38..46], &f[46..]).unwrap();
        let n = f.len();
        f[n - 4..].copy_from_slice(&crc.to_le_bytes());
        let with = Repr::parse_ethernet(&f).unwrap();
        assert_eq!(with, Repr::parse_ethernet(&RXE_ACK).unwrap());
        // The options are covered: changing one breaks the ICRC.
        f[34] = 0;
        fix_checksum(&mut f);
        let computed = icrc::compute(&f[14..38], &f[38..46], &f[46..]).unwrap();
        assert_eq!(
            Repr::parse_ethernet(&f),
            Err(Error::BadIcrc {
                found: crc,
                computed
            })
        );
        assert_ne!(crc, computed);
    }

    #[test]
    fn peeking_the_udp_port() {
        assert_eq!(peek_udp_dst_port(&RXE_ACK, true), Some(4791));
        assert_eq!(peek_udp_dst_port(&RXE_ACK[14..], false), Some(4791));
        // Cut right after the port: still seen; before it: not.
        assert_eq!(peek_udp_dst_port(&RXE_ACK[..38], true), Some(4791));
        assert_eq!(peek_udp_dst_port(&RXE_ACK[..37], true), None);
        let mut tcp = RXE_ACK;
        tcp[23] = 6;
        assert_eq!(peek_udp_dst_port(&tcp, true), None);
        let mut arp = RXE_ACK;
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        assert_eq!(peek_udp_dst_port(&arp, true), None);
        let mut later_fragment = RXE_ACK;
        later_fragment[21] = 1;
        assert_eq!(peek_udp_dst_port(&later_fragment, true), None);
    }

    #[test]
    fn a_route_frames_into_a_packet_that_parses_with_its_icrc() {
        let roce = {
            // A 64-byte RDMA WRITE_ONLY from the captures' shapes: BTH,
            // RETH, payload, ICRC field.
            let mut p = vec![0u8; 12 + 16 + 64 + 4];
            p[0] = crate::Opcode::RcWriteOnly as u8;
            p[1] = 0x40;
            p[2] = 0xff;
            p[3] = 0xff;
            p[7] = 0x11;
            p
        };
        for (src, dst) in [
            (
                crate::Gid::from(core::net::Ipv4Addr::new(10, 0, 0, 1)),
                crate::Gid::from(core::net::Ipv4Addr::new(10, 0, 0, 2)),
            ),
            (
                crate::Gid::from("fe80::1".parse::<core::net::Ipv6Addr>().unwrap()),
                crate::Gid::from("fe80::2".parse::<core::net::Ipv6Addr>().unwrap()),
            ),
        ] {
            let route = Route {
                src,
                dst,
                traffic_class: 0x68,
                hop_limit: 9,
                flow_label: 0x12345,
            };
            let ip = route.ip(roce.len(), 7).unwrap();
            let mut out = Vec::new();
            emit_ip_packet(&ip, 0xc011, &roce, &mut out).unwrap();
            let r = Repr::parse_ip(&out).expect("parses, ICRC good");
            assert_eq!(r.ip.sgid(), src);
            assert_eq!(r.ip.dgid(), dst);
            assert_eq!(r.udp.src_port, 0xc011);
            assert_eq!(r.roce.payload.len(), 64);
            // The header alone, as a socket fabric seals with it, equals
            // the one the whole datagram carries.
            let mut header = [0u8; udp::HEADER_LEN];
            udp::Repr {
                src_port: 0xc011,
                checksum: false,
            }
            .emit_header(&mut header, udp::HEADER_LEN + roce.len())
            .unwrap();
            let at = ip.buffer_len();
            assert_eq!(&out[at..at + udp::HEADER_LEN], &header);
        }
        assert!(
            Route {
                src: crate::Gid::default(),
                dst: crate::Gid::default(),
                traffic_class: 0,
                hop_limit: 0,
                flow_label: 0,
            }
            .ip(3, 0)
            .is_err(),
            "shorter than a BTH and ICRC"
        );
    }
}
