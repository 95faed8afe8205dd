//! What wraps a RoCEv2 packet in a capture taken where tenants' networks
//! are VLANs or VXLAN segments: up to [`crate::vlan::MAX_TAGS`] VLAN tags on an
//! Ethernet header (802.1Q, or 802.1ad QinQ), and at most one VXLAN tunnel
//! (RFC 7348): an IPv4 or IPv6 UDP datagram to port 4789 whose VXLAN header
//! carries the tenant's Ethernet frame, itself possibly tagged.
//!
//! * [`peek`] tells RoCEv2 from other traffic, through the encapsulation,
//!   without validating anything;
//! * [`peel_ethernet`] / [`peel_ip`] check the encapsulation and find the
//!   RoCEv2 packet's IP packet inside;
//! * [`decode_ethernet`] / [`decode_ip`] also decode that packet. Its ICRC
//!   is computed over the inner IP, UDP and BTH only: the ICRC covers no
//!   other header (IBTA Annex A17.8.1), so a tunnel or a tag changes
//!   nothing in it.
//!
//! A tool path (`vrdma decode`): the fabric and the engine frame with
//! [`frame`], which knows one 802.1Q tag and no tunnel.

use crate::{
    Error, Header, ROCEV2_UDP_PORT, Result, Vni, be,
    ethernet::EtherType,
    frame::{self, Decoded, IpRepr},
    ipv4, ipv6, udp,
    vlan::{TAG_LEN, TaggedRepr, Tpid},
    vxlan,
};

/// What a captured frame carries, seen through tags and one VXLAN tunnel
/// without validating anything (see [`peek`]).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Peek {
    /// UDP to port 4791: RoCEv2, well formed or not.
    Roce,
    /// A VXLAN tunnel whose inner frame is not UDP to port 4791.
    VxlanOther,
    /// Anything else.
    Other,
}

/// The layers around the IP packet of a RoCEv2 packet.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Encapsulation {
    /// A bare IP packet (a raw-IP or cooked capture).
    Ip,
    /// An Ethernet header, with its tags.
    Ethernet(TaggedRepr),
    /// A VXLAN tunnel: the underlay's headers, the tenant's Ethernet header.
    Vxlan(VxlanTunnel),
}

/// The headers of a VXLAN tunnel, outermost first, and the tenant's
/// Ethernet header inside it.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct VxlanTunnel {
    /// The underlay's Ethernet header; `None` when the capture starts at
    /// the outer IP header.
    pub outer: Option<TaggedRepr>,
    /// The underlay's IP header (the tunnel endpoints). Its `payload_len`
    /// is recomputed on emit.
    pub ip: IpRepr,
    /// The outer UDP source port (an entropy hash of the inner flow).
    pub src_port: u16,
    /// Whether the outer UDP checksum is present (RFC 7348 asks for zero).
    pub udp_checksum: bool,
    pub vni: Vni,
    /// The tenant's Ethernet header, carrying the RoCEv2 packet's IP.
    pub inner: TaggedRepr,
}

impl Encapsulation {
    /// The Ethernet header right in front of the RoCEv2 packet's IP header:
    /// the tenant's inside a tunnel.
    pub fn ethernet(&self) -> Option<&TaggedRepr> {
        match self {
            Encapsulation::Ip => None,
            Encapsulation::Ethernet(e) => Some(e),
            Encapsulation::Vxlan(t) => Some(&t.inner),
        }
    }

    pub fn vxlan(&self) -> Option<&VxlanTunnel> {
        match self {
            Encapsulation::Vxlan(t) => Some(t),
            _ => None,
        }
    }

    /// Bytes in front of the RoCEv2 packet's IP header.
    pub const fn buffer_len(&self) -> usize {
        match self {
            Encapsulation::Ip => 0,
            Encapsulation::Ethernet(e) => e.buffer_len(),
            Encapsulation::Vxlan(t) => t.buffer_len(),
        }
    }

    /// Writes the headers into `frame[..self.buffer_len()]`, in front of
    /// the IP packet already in the rest of `frame` (a tunnel's lengths
    /// and UDP checksum cover it).
    pub fn emit(&self, frame: &mut [u8]) -> Result<()> {
        let len = self.buffer_len();
        if frame.len() < len {
            return Err(Error::BufferSize {
                needed: len,
                available: frame.len(),
            });
        }
        match self {
            Encapsulation::Ip => Ok(()),
            Encapsulation::Ethernet(e) => e.emit(frame),
            Encapsulation::Vxlan(t) => t.emit(frame),
        }
    }
}

impl VxlanTunnel {
    /// Bytes from the underlay's first header to the tenant's IP header.
    pub const fn buffer_len(&self) -> usize {
        let outer = match &self.outer {
            Some(e) => e.buffer_len(),
            None => 0,
        };
        outer + self.ip.buffer_len() + udp::HEADER_LEN + vxlan::HEADER_LEN + self.inner.buffer_len()
    }

    /// See [`Encapsulation::emit`]; `frame` is at least
    /// [`Self::buffer_len`] bytes.
    fn emit(&self, frame: &mut [u8]) -> Result<()> {
        let ip_at = match &self.outer {
            Some(e) => {
                e.emit(frame)?;
                e.buffer_len()
            }
            None => 0,
        };
        let udp_at = ip_at + self.ip.buffer_len();
        let vxlan_at = udp_at + udp::HEADER_LEN;
        let datagram_len = frame.len() - udp_at;
        let ip = self.ip.with_payload_len(datagram_len);
        ip.emit(&mut frame[ip_at..udp_at])?;
        let udp_len = u16::try_from(datagram_len).map_err(|_| Error::OutOfRange {
            what: "a UDP length",
            value: datagram_len as u64,
        })?;
        let datagram = &mut frame[udp_at..];
        be::set_u16(datagram, 0, self.src_port);
        be::set_u16(datagram, 2, vxlan::UDP_PORT);
        be::set_u16(datagram, 4, udp_len);
        be::set_u16(datagram, 6, 0);
        vxlan::Repr { vni: self.vni }.emit(&mut frame[vxlan_at..])?;
        self.inner
            .emit(&mut frame[vxlan_at + vxlan::HEADER_LEN..])?;
        if self.udp_checksum {
            let c = udp::compute_checksum(ip.pseudo_header(), &frame[udp_at..]);
            be::set_u16(frame, udp_at + 6, c);
        }
        Ok(())
    }
}

/// An encapsulation checked, and where the RoCEv2 packet's IP packet is.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Peeled<'a> {
    pub encap: Encapsulation,
    /// The IP packet (perhaps followed by Ethernet padding).
    pub ip: &'a [u8],
    /// 4 or 6: from the EtherType in front, or the version nibble of a
    /// bare packet.
    version: u8,
}

impl<'a> Peeled<'a> {
    /// Decodes the RoCEv2 packet inside, reporting its ICRC (computed over
    /// the inner headers). The result's `repr.ethernet` is `None`: the
    /// Ethernet header, with every tag, is in [`Self::encap`].
    pub fn decode(&self) -> Result<Decoded<'a>> {
        frame::decode_ip_version(None, self.ip, self.version)
    }
}

/// A RoCEv2 packet decoded inside its encapsulation.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Encapsulated<'a> {
    pub encap: Encapsulation,
    /// The RoCEv2 packet from its IP header on (`repr.ethernet` is `None`)
    /// and its ICRC check.
    pub inner: Decoded<'a>,
}

impl Encapsulated<'_> {
    /// Length of the whole frame.
    pub const fn buffer_len(&self) -> usize {
        self.encap.buffer_len() + self.inner.repr.buffer_len()
    }

    /// Writes the frame into `buf`, exactly [`Self::buffer_len`] bytes:
    /// the inner packet with its ICRC, then the headers around it.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        let len = self.buffer_len();
        if buf.len() != len {
            return Err(Error::BufferSize {
                needed: len,
                available: buf.len(),
            });
        }
        let inner = frame::Repr {
            ethernet: None,
            ..self.inner.repr
        };
        inner.emit(&mut buf[self.encap.buffer_len()..])?;
        self.encap.emit(buf)
    }
}

/// What `data` carries: an Ethernet frame when `ethernet`, else a bare IP
/// packet. Walks any number of tags (TPID 0x8100 or 0x88a8) and one VXLAN
/// tunnel (UDP to port 4789) to the UDP destination port, as
/// [`frame::peek_udp_dst_port`] does for an untagged frame; nothing is
/// validated, so a malformed RoCEv2 packet is still [`Peek::Roce`] (and
/// then fails to peel or decode with the reason).
pub fn peek(data: &[u8], ethernet: bool) -> Peek {
    let ip = if ethernet {
        after_tags(data)
    } else {
        Some(data)
    };
    let Some(ip) = ip else {
        return Peek::Other;
    };
    match udp_at(ip).and_then(|at| port_at(ip, at)) {
        Some(ROCEV2_UDP_PORT) => Peek::Roce,
        Some(vxlan::UDP_PORT) => {
            let inner = udp_at(ip)
                .and_then(|at| ip.get(at + udp::HEADER_LEN + vxlan::HEADER_LEN..))
                .and_then(after_tags);
            match inner.and_then(|i| port_at(i, udp_at(i)?)) {
                Some(ROCEV2_UDP_PORT) => Peek::Roce,
                _ => Peek::VxlanOther,
            }
        }
        _ => Peek::Other,
    }
}

/// Checks the Ethernet header of `frame` (and its tags) and, when its IP
/// packet is UDP to port 4789, the VXLAN tunnel and the tenant's Ethernet
/// header; returns them with the IP packet inside.
pub fn peel_ethernet(frame: &[u8]) -> Result<Peeled<'_>> {
    let eth = TaggedRepr::parse(frame)?;
    let ip = frame.get(eth.buffer_len()..).unwrap_or(&[]);
    let version = version_of(eth.ethertype);
    if is_vxlan(ip) {
        tunnel(Some(eth), ip, version)
    } else {
        Ok(Peeled {
            encap: Encapsulation::Ethernet(eth),
            ip,
            version,
        })
    }
}

/// The counterpart of [`peel_ethernet`] for a bare IP packet (the version
/// nibble says 4 or 6): a VXLAN tunnel whose outer IP header starts the
/// capture, or the RoCEv2 packet itself.
pub fn peel_ip(packet: &[u8]) -> Result<Peeled<'_>> {
    crate::need(Header::Ipv4, 1, packet.len())?;
    let version = packet[0] >> 4;
    if is_vxlan(packet) {
        tunnel(None, packet, version)
    } else {
        Ok(Peeled {
            encap: Encapsulation::Ip,
            ip: packet,
            version,
        })
    }
}

/// [`peel_ethernet`], then [`Peeled::decode`].
pub fn decode_ethernet(frame: &[u8]) -> Result<Encapsulated<'_>> {
    let p = peel_ethernet(frame)?;
    Ok(Encapsulated {
        encap: p.encap,
        inner: p.decode()?,
    })
}

/// [`peel_ip`], then [`Peeled::decode`].
pub fn decode_ip(packet: &[u8]) -> Result<Encapsulated<'_>> {
    let p = peel_ip(packet)?;
    Ok(Encapsulated {
        encap: p.encap,
        inner: p.decode()?,
    })
}

const fn version_of(t: EtherType) -> u8 {
    match t {
        EtherType::Ipv4 => 4,
        EtherType::Ipv6 => 6,
    }
}

/// VXLAN is recognised by the UDP destination port alone (RFC 7348 §5).
fn is_vxlan(ip: &[u8]) -> bool {
    udp_at(ip).and_then(|at| port_at(ip, at)) == Some(vxlan::UDP_PORT)
}

/// Checks the underlay's IP and UDP headers in `data` (IP version
/// `version`), the VXLAN header and the tenant's Ethernet header.
fn tunnel<'a>(outer: Option<TaggedRepr>, data: &'a [u8], version: u8) -> Result<Peeled<'a>> {
    let (ip, _, datagram) = frame::ip_parts(data, version)?;
    let u = udp::Packet::new_checked(datagram)?;
    let stated = usize::from(u.length());
    if stated != datagram.len() {
        return Err(Error::BadLength {
            header: Header::Udp,
            stated,
            available: datagram.len(),
        });
    }
    // The destination port is 4789: the caller looked at these bytes.
    let found = u.checksum();
    if found != 0 {
        let ph = ip.pseudo_header();
        let computed = udp::compute_checksum(ph, datagram);
        if computed != found
            && found != udp::offload_partial_checksum(ph, datagram.len())
            && !cfg!(fuzzing)
        {
            return Err(Error::BadUdpChecksum { found, computed });
        }
    }
    let vxlan_header = datagram.get(udp::HEADER_LEN..).unwrap_or(&[]);
    let vni = vxlan::Repr::parse(&vxlan::Packet::new_checked(vxlan_header)?)?.vni;
    let inner_frame = vxlan_header.get(vxlan::HEADER_LEN..).unwrap_or(&[]);
    let inner = TaggedRepr::parse(inner_frame)?;
    Ok(Peeled {
        encap: Encapsulation::Vxlan(VxlanTunnel {
            outer,
            ip,
            src_port: u.src_port(),
            udp_checksum: found != 0,
            vni,
            inner,
        }),
        ip: inner_frame.get(inner.buffer_len()..).unwrap_or(&[]),
        version: version_of(inner.ethertype),
    })
}

/// The IP packet after an Ethernet header and any number of tags, if the
/// EtherType says IPv4 or IPv6 and the version nibble agrees.
fn after_tags(frame: &[u8]) -> Option<&[u8]> {
    let mut at = 12;
    loop {
        let t = frame.get(at..at + 2)?;
        let t = u16::from_be_bytes([t[0], t[1]]);
        if Tpid::from_value(t).is_some() {
            at += TAG_LEN;
            continue;
        }
        let version = match t {
            0x0800 => 4,
            0x86dd => 6,
            _ => return None,
        };
        let ip = frame.get(at + 2..)?;
        return (ip.first()? >> 4 == version).then_some(ip);
    }
}

/// Where the UDP header of an IP packet starts, if the packet is (or
/// claims to be) the first fragment of a UDP datagram.
fn udp_at(ip: &[u8]) -> Option<usize> {
    match ip.first()? >> 4 {
        4 => {
            let h = ip.get(..ipv4::HEADER_LEN)?;
            let p = ipv4::Packet::new_unchecked(h);
            let ihl = usize::from(h[0] & 0x0f) * 4;
            (ihl >= ipv4::HEADER_LEN && p.protocol() == ipv4::PROTO_UDP && p.frag_offset() == 0)
                .then_some(ihl)
        }
        6 => {
            let h = ip.get(..ipv6::HEADER_LEN)?;
            (ipv6::Packet::new_unchecked(h).next_header() == ipv4::PROTO_UDP)
                .then_some(ipv6::HEADER_LEN)
        }
        _ => None,
    }
}

/// The UDP destination port of the header at `at`, if present.
fn port_at(ip: &[u8], at: usize) -> Option<u16> {
    let p = ip.get(at + 2..at + 4)?;
    Some(u16::from_be_bytes([p[0], p[1]]))
}

#[cfg(test)]
mod tests {
    use core::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::{
        Opcode,
        ethernet::{self, MacAddr},
        reth,
        vlan::Tag,
    };

    // Frame 1 of the rxe capture read_bw_64.pcap: Linux rxe's RC
    // RDMA_READ_REQUEST, 10.47.91.12 → 10.47.91.11, QP 0x1a, PSN 0x85bc0f
    // (AckReq), RETH va 0x562cb0c19000 rkey 0xb6b len 64.
    static RXE_READ: [u8; 74] = [
        0x52, 0x54, 0x00, 0x47, 0x91, 0x01, 0x52, 0x54, 0x00, 0x47, 0x91, 0x02, 0x08, 0x00, 0x45,
        0x00, 0x00, 0x3c, 0x44, 0x60, 0x40, 0x00, 0x40, 0x11, 0x2b, 0xdc, 0x0a, 0x2f, 0x5b, 0x0c,
        0x0a, 0x2f, 0x5b, 0x0b, 0xc2, 0x70, 0x12, 0xb7, 0x00, 0x28, 0x00, 0x00, 0x0c, 0x00, 0xff,
        0xff, 0x00, 0x00, 0x00, 0x1a, 0x80, 0x85, 0xbc, 0x0f, 0x00, 0x00, 0x56, 0x2c, 0xb0, 0xc1,
        0x90, 0x00, 0x00, 0x00, 0x0b, 0x6b, 0x00, 0x00, 0x00, 0x40, 0xd6, 0xfa, 0x12, 0x50,
    ];
    /// Its ICRC, stored least significant byte first.
    const RXE_READ_ICRC: u32 = 0x5012_fad6;

    // RXE_READ tagged (802.1Q, PCP 1, VID 100) inside VXLAN over IPv4, as a
    // Linux vxlan device sends it: 192.0.2.1 → 192.0.2.2 (DF, TTL 64,
    // Identification 0x1234), UDP 54177 → 4789 without checksum, I flag,
    // VNI 5001. tshark 4.0 dissects it clean.
    static VXLAN_V4: [u8; 128] = [
        0x02, 0x00, 0x00, 0x00, 0x00, 0x02, 0x02, 0x00, 0x00, 0x00, 0x00, 0x01, 0x08, 0x00, 0x45,
        0x00, 0x00, 0x72, 0x12, 0x34, 0x40, 0x00, 0x40, 0x11, 0xa4, 0x43, 0xc0, 0x00, 0x02, 0x01,
        0xc0, 0x00, 0x02, 0x02, 0xd3, 0xa1, 0x12, 0xb5, 0x00, 0x5e, 0x00, 0x00, 0x08, 0x00, 0x00,
        0x00, 0x00, 0x13, 0x89, 0x00, 0x52, 0x54, 0x00, 0x47, 0x91, 0x01, 0x52, 0x54, 0x00, 0x47,
        0x91, 0x02, 0x81, 0x00, 0x20, 0x64, 0x08, 0x00, 0x45, 0x00, 0x00, 0x3c, 0x44, 0x60, 0x40,
        0x00, 0x40, 0x11, 0x2b, 0xdc, 0x0a, 0x2f, 0x5b, 0x0c, 0x0a, 0x2f, 0x5b, 0x0b, 0xc2, 0x70,
        0x12, 0xb7, 0x00, 0x28, 0x00, 0x00, 0x0c, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x1a, 0x80,
        0x85, 0xbc, 0x0f, 0x00, 0x00, 0x56, 0x2c, 0xb0, 0xc1, 0x90, 0x00, 0x00, 0x00, 0x0b, 0x6b,
        0x00, 0x00, 0x00, 0x40, 0xd6, 0xfa, 0x12, 0x50,
    ];

    // RXE_READ untagged inside VXLAN over IPv6 on an 802.1Q-tagged underlay
    // (VID 10): 2001:db8::1 → 2001:db8::2, UDP 57345 → 4789 with its
    // checksum (0x9521), VNI 0xabcdef.
    static VXLAN_V6: [u8; 148] = [
        0x02, 0x00, 0x00, 0x00, 0x00, 0x02, 0x02, 0x00, 0x00, 0x00, 0x00, 0x01, 0x81, 0x00, 0x00,
        0x0a, 0x86, 0xdd, 0x60, 0x00, 0x00, 0x00, 0x00, 0x5a, 0x11, 0x40, 0x20, 0x01, 0x0d, 0xb8,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x20, 0x01, 0x0d,
        0xb8, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0xe0, 0x01,
        0x12, 0xb5, 0x00, 0x5a, 0x95, 0x21, 0x08, 0x00, 0x00, 0x00, 0xab, 0xcd, 0xef, 0x00, 0x52,
        0x54, 0x00, 0x47, 0x91, 0x01, 0x52, 0x54, 0x00, 0x47, 0x91, 0x02, 0x08, 0x00, 0x45, 0x00,
        0x00, 0x3c, 0x44, 0x60, 0x40, 0x00, 0x40, 0x11, 0x2b, 0xdc, 0x0a, 0x2f, 0x5b, 0x0c, 0x0a,
        0x2f, 0x5b, 0x0b, 0xc2, 0x70, 0x12, 0xb7, 0x00, 0x28, 0x00, 0x00, 0x0c, 0x00, 0xff, 0xff,
        0x00, 0x00, 0x00, 0x1a, 0x80, 0x85, 0xbc, 0x0f, 0x00, 0x00, 0x56, 0x2c, 0xb0, 0xc1, 0x90,
        0x00, 0x00, 0x00, 0x0b, 0x6b, 0x00, 0x00, 0x00, 0x40, 0xd6, 0xfa, 0x12, 0x50,
    ];

    /// RXE_READ with `tags` (TPID and TCI bytes) after its addresses.
    fn tagged(tags: &[u8]) -> Vec<u8> {
        let mut f = RXE_READ[..12].to_vec();
        f.extend_from_slice(tags);
        f.extend_from_slice(&RXE_READ[12..]);
        f
    }

    /// RXE_READ tagged with VID 100 (PCP 1).
    fn vlan_frame() -> Vec<u8> {
        tagged(&[0x81, 0x00, 0x20, 0x64])
    }

    /// RXE_READ behind an S-tag (VID 10) and a C-tag (VID 100).
    fn qinq_frame() -> Vec<u8> {
        tagged(&[0x88, 0xa8, 0x00, 0x0a, 0x81, 0x00, 0x00, 0x64])
    }

    const RXE_DST: MacAddr = MacAddr([0x52, 0x54, 0x00, 0x47, 0x91, 0x01]);
    const RXE_SRC: MacAddr = MacAddr([0x52, 0x54, 0x00, 0x47, 0x91, 0x02]);

    /// The RoCEv2 packet of RXE_READ, checked field by field: whatever
    /// wraps it, the same packet with a good ICRC.
    fn assert_is_the_rxe_read(d: &Decoded<'_>) {
        let r = &d.repr;
        assert_eq!(r.ethernet, None);
        assert_eq!(r.ip.src(), Ipv4Addr::new(10, 47, 91, 12));
        assert_eq!(r.ip.dst(), Ipv4Addr::new(10, 47, 91, 11));
        assert_eq!(r.udp.src_port, 0xc270);
        let b = &r.roce.bth;
        assert_eq!(b.opcode, Opcode::RcReadRequest);
        assert_eq!(b.dest_qp.value(), 0x1a);
        assert_eq!(b.psn.value(), 0x85_bc0f);
        assert!(b.ack_req);
        assert_eq!(
            r.roce
                .ext
                .reth
                .map(|h: reth::Repr| (h.va, h.rkey.0, h.dma_len)),
            Some((0x562c_b0c1_9000, 0xb6b, 64))
        );
        assert_eq!(
            d.icrc,
            frame::IcrcCheck {
                found: RXE_READ_ICRC,
                computed: RXE_READ_ICRC
            }
        );
        // And exactly what the untagged frame decodes to.
        let plain = frame::decode_ethernet(&RXE_READ).unwrap();
        assert_eq!(
            d.repr,
            frame::Repr {
                ethernet: None,
                ..plain.repr
            }
        );
    }

    fn assert_reemits(f: &[u8]) {
        let d = decode_ethernet(f).unwrap();
        let mut out = vec![0; d.buffer_len()];
        d.emit(&mut out).unwrap();
        assert_eq!(out, f);
    }

    #[test]
    fn an_untagged_frame_decodes_as_the_frame_module_does() {
        assert_eq!(peek(&RXE_READ, true), Peek::Roce);
        let d = decode_ethernet(&RXE_READ).unwrap();
        let e = d.encap.ethernet().unwrap();
        assert!(e.tags.is_empty());
        assert_eq!((e.dst, e.src), (RXE_DST, RXE_SRC));
        assert_eq!(d.encap.vxlan(), None);
        assert_is_the_rxe_read(&d.inner);
        assert_reemits(&RXE_READ);
        // A bare IP packet.
        let d = decode_ip(&RXE_READ[14..]).unwrap();
        assert_eq!(d.encap, Encapsulation::Ip);
        assert_is_the_rxe_read(&d.inner);
    }

    #[test]
    fn a_vlan_tagged_frame_shows_its_vid_and_the_inner_icrc_is_good() {
        let f = vlan_frame();
        assert_eq!(peek(&f, true), Peek::Roce);
        let d = decode_ethernet(&f).unwrap();
        let tags = d.encap.ethernet().unwrap().tags;
        assert_eq!(
            tags.iter().collect::<Vec<_>>(),
            [Tag {
                tpid: Tpid::CTag,
                tci: ethernet::VlanTag {
                    pcp: 1,
                    dei: false,
                    vid: 100
                }
            }]
        );
        assert_is_the_rxe_read(&d.inner);
        assert_reemits(&f);
        // The frame module reads the same single tag.
        let fd = frame::decode_ethernet(&f).unwrap();
        assert_eq!(fd.repr.ethernet.and_then(|e| e.vlan), tags.sole_ctag());
    }

    #[test]
    fn a_qinq_frame_shows_both_vids() {
        let f = qinq_frame();
        assert_eq!(peek(&f, true), Peek::Roce);
        let d = decode_ethernet(&f).unwrap();
        let tags = d.encap.ethernet().unwrap().tags;
        assert_eq!(
            tags.iter().map(|t| (t.tpid, t.tci.vid)).collect::<Vec<_>>(),
            [(Tpid::STag, 10), (Tpid::CTag, 100)]
        );
        assert_is_the_rxe_read(&d.inner);
        assert_reemits(&f);
        // The engine's framing knows one 802.1Q tag only, and is unchanged.
        assert_eq!(
            frame::decode_ethernet(&f),
            Err(Error::UnsupportedEtherType(0x88a8))
        );
        // Two C-tags (pre-802.1ad QinQ) are two tags too.
        let f = tagged(&[0x81, 0x00, 0x00, 0x0a, 0x81, 0x00, 0x00, 0x64]);
        let d = decode_ethernet(&f).unwrap();
        let vids: Vec<_> = d.encap.ethernet().unwrap().tags.vids().collect();
        assert_eq!(vids, [10, 100]);
    }

    #[test]
    fn a_third_tag_is_refused_with_its_offset() {
        let f = tagged(&[
            0x88, 0xa8, 0x00, 0x0a, 0x81, 0x00, 0x00, 0x64, 0x81, 0x00, 0x00, 0x07,
        ]);
        // Still RoCEv2 to a tool: malformed, not other traffic.
        assert_eq!(peek(&f, true), Peek::Roce);
        assert_eq!(
            decode_ethernet(&f),
            Err(Error::TooManyVlanTags {
                max: 2,
                tpid: 0x8100,
                at: 20
            })
        );
    }

    #[test]
    fn vxlan_over_ipv4_with_an_inner_vlan() {
        assert_eq!(peek(&VXLAN_V4, true), Peek::Roce);
        let d = decode_ethernet(&VXLAN_V4).unwrap();
        let t = d.encap.vxlan().unwrap();
        let outer = t.outer.unwrap();
        assert!(outer.tags.is_empty());
        assert_eq!(outer.dst, MacAddr([2, 0, 0, 0, 0, 2]));
        assert_eq!(
            t.ip,
            IpRepr::V4(ipv4::Repr {
                src: Ipv4Addr::new(192, 0, 2, 1),
                dst: Ipv4Addr::new(192, 0, 2, 2),
                tos: 0,
                ident: 0x1234,
                dont_frag: true,
                ttl: 64,
                payload_len: 94,
            })
        );
        assert_eq!(t.src_port, 54177);
        assert!(!t.udp_checksum);
        assert_eq!(t.vni.value(), 5001);
        assert_eq!((t.inner.dst, t.inner.src), (RXE_DST, RXE_SRC));
        assert_eq!(t.inner.tags.vids().collect::<Vec<_>>(), [100]);
        assert_eq!(d.encap.ethernet(), Some(&t.inner));
        assert_is_the_rxe_read(&d.inner);
        assert_reemits(&VXLAN_V4);
        // The frame module does not look inside tunnels.
        assert_eq!(frame::decode_ethernet(&VXLAN_V4), Err(Error::NotRoce(4789)));
    }

    #[test]
    fn vxlan_over_ipv6_on_a_tagged_underlay_with_a_udp_checksum() {
        assert_eq!(peek(&VXLAN_V6, true), Peek::Roce);
        let d = decode_ethernet(&VXLAN_V6).unwrap();
        let t = d.encap.vxlan().unwrap();
        assert_eq!(t.outer.unwrap().tags.vids().collect::<Vec<_>>(), [10]);
        assert_eq!(t.ip.src(), "2001:db8::1".parse::<Ipv6Addr>().unwrap());
        assert_eq!(t.ip.dst(), "2001:db8::2".parse::<Ipv6Addr>().unwrap());
        assert_eq!(t.src_port, 0xe001);
        assert!(t.udp_checksum);
        assert_eq!(t.vni.value(), 0xab_cdef);
        assert!(t.inner.tags.is_empty());
        assert_is_the_rxe_read(&d.inner);
        assert_reemits(&VXLAN_V6);
    }

    #[test]
    fn vxlan_from_a_capture_that_starts_at_the_outer_ip_header() {
        assert_eq!(peek(&VXLAN_V4[14..], false), Peek::Roce);
        let d = decode_ip(&VXLAN_V4[14..]).unwrap();
        let t = d.encap.vxlan().unwrap();
        assert_eq!(t.outer, None);
        assert_eq!(t.vni.value(), 5001);
        assert_is_the_rxe_read(&d.inner);
        let mut out = vec![0; d.buffer_len()];
        d.emit(&mut out).unwrap();
        assert_eq!(out, &VXLAN_V4[14..]);
    }

    #[test]
    fn the_icrc_is_the_inner_packets_alone() {
        // Another VNI, outer source port and checksum: the same ICRC.
        let mut f = VXLAN_V4;
        f[48] = 0x8a;
        f[34] = 0x11;
        f[40..42].copy_from_slice(&[0x12, 0x34]);
        let fixed = udp::compute_checksum(
            udp::PseudoHeader::V4 {
                src: Ipv4Addr::new(192, 0, 2, 1),
                dst: Ipv4Addr::new(192, 0, 2, 2),
            },
            &{
                let mut g = f;
                g[40..42].fill(0);
                g
            }[34..],
        );
        f[40..42].copy_from_slice(&fixed.to_be_bytes());
        let d = decode_ethernet(&f).unwrap();
        assert_eq!(d.encap.vxlan().unwrap().vni.value(), 5002);
        assert!(d.inner.icrc.is_good());
        // A flipped bit in the inner RETH: bad, and computed as over the
        // inner frame alone.
        let mut f = VXLAN_V4;
        f[115] ^= 0x01;
        let d = decode_ethernet(&f).unwrap();
        assert!(!d.inner.icrc.is_good());
        let alone = frame::decode_ethernet(&f[50..]).unwrap();
        assert_eq!(d.inner.icrc, alone.icrc);
    }

    #[test]
    fn a_malformed_inner_packet_still_shows_its_tunnel() {
        let mut f = VXLAN_V4;
        f[97] |= 0x01; // TVer 1
        let p = peel_ethernet(&f).unwrap();
        assert_eq!(p.encap.vxlan().map(|t| t.vni.value()), Some(5001));
        assert_eq!(p.decode(), Err(Error::BadTver(1)));
        assert_eq!(decode_ethernet(&f), Err(Error::BadTver(1)));
    }

    /// `f` with its IPv4 header (at `ip`) given total length `total` and
    /// a correct checksum.
    fn fix_ipv4(f: &mut [u8], ip: usize, total: u16) {
        f[ip + 2..ip + 4].copy_from_slice(&total.to_be_bytes());
        f[ip + 10..ip + 12].fill(0);
        let c = ipv4::checksum(&[&f[ip..ip + 20]]);
        f[ip + 10..ip + 12].copy_from_slice(&c.to_be_bytes());
    }

    /// VXLAN_V4 cut to `datagram` bytes of outer UDP datagram, with the
    /// outer lengths saying so.
    fn short_tunnel(datagram: u16) -> Vec<u8> {
        let mut f = VXLAN_V4[..34 + usize::from(datagram)].to_vec();
        fix_ipv4(&mut f, 14, 20 + datagram);
        f[38..40].copy_from_slice(&datagram.to_be_bytes());
        f
    }

    #[test]
    fn malformed_tunnels_give_precise_errors() {
        let mut f = VXLAN_V4;
        f[42] = 0x00;
        assert_eq!(decode_ethernet(&f), Err(Error::BadVxlanFlags(0x00)));
        // Reserved bits are ignored.
        let mut f = VXLAN_V4;
        f[42] = 0x88;
        f[43] = 0xff;
        f[49] = 0xff;
        assert!(decode_ethernet(&f).is_ok());

        let mut f = VXLAN_V6;
        f[65] ^= 0x01;
        assert_eq!(
            decode_ethernet(&f),
            Err(Error::BadUdpChecksum {
                found: 0x9520,
                computed: 0x9521
            })
        );

        let mut f = VXLAN_V4;
        f[39] = 0x5d;
        assert_eq!(
            decode_ethernet(&f),
            Err(Error::BadLength {
                header: Header::Udp,
                stated: 93,
                available: 94
            })
        );

        assert_eq!(
            decode_ethernet(&short_tunnel(12)),
            Err(Error::Truncated {
                header: Header::Vxlan,
                needed: 8,
                available: 4
            })
        );
        assert_eq!(
            decode_ethernet(&short_tunnel(26)),
            Err(Error::Truncated {
                header: Header::Ethernet,
                needed: 14,
                available: 10
            })
        );
        // Inner tag cut after its TPID.
        assert_eq!(
            decode_ethernet(&short_tunnel(30)),
            Err(Error::Truncated {
                header: Header::Vlan,
                needed: 18,
                available: 14
            })
        );
        // Cut inside the inner IP header.
        assert_eq!(
            decode_ethernet(&short_tunnel(40)),
            Err(Error::Truncated {
                header: Header::Ipv4,
                needed: 20,
                available: 6
            })
        );
        // The outer IPv4 header's checksum is checked.
        let mut f = VXLAN_V4;
        f[22] = 63;
        assert_eq!(
            decode_ethernet(&f),
            Err(Error::BadIpv4Checksum {
                found: 0xa443,
                computed: 0xa543
            })
        );
    }

    #[test]
    fn every_truncation_fails_and_no_input_panics() {
        let frames = [
            RXE_READ.to_vec(),
            vlan_frame(),
            qinq_frame(),
            VXLAN_V4.to_vec(),
            VXLAN_V6.to_vec(),
        ];
        for f in &frames {
            for len in 0..f.len() {
                assert!(decode_ethernet(&f[..len]).is_err(), "cut at {len}");
                let _ = peek(&f[..len], true);
                let _ = decode_ip(&f[..len]);
            }
            for at in 0..f.len() {
                for bit in 0..8 {
                    let mut g = f.clone();
                    g[at] ^= 1 << bit;
                    let _ = peek(&g, true);
                    let _ = decode_ethernet(&g);
                    let _ = decode_ip(&g[14.min(at)..]);
                }
            }
        }
    }

    #[test]
    fn peeking_tells_roce_from_other_traffic() {
        // Linux's legacy VXLAN port 8472 is not VXLAN here.
        let mut f = VXLAN_V4;
        f[36..38].copy_from_slice(&8472u16.to_be_bytes());
        assert_eq!(peek(&f, true), Peek::Other);
        // ARP inside the tunnel, or behind tags.
        let mut f = VXLAN_V4;
        f[66..68].copy_from_slice(&[0x08, 0x06]);
        assert_eq!(peek(&f, true), Peek::VxlanOther);
        assert_eq!(
            decode_ethernet(&f),
            Err(Error::UnsupportedEtherType(0x0806))
        );
        let mut f = qinq_frame();
        f[20..22].copy_from_slice(&[0x08, 0x06]);
        assert_eq!(peek(&f, true), Peek::Other);
        // TCP inside the tunnel.
        let mut f = VXLAN_V4;
        f[77] = 6;
        assert_eq!(peek(&f, true), Peek::VxlanOther);
        // VXLAN inside VXLAN is not unwrapped twice.
        let mut f = VXLAN_V4;
        f[90..92].copy_from_slice(&4789u16.to_be_bytes());
        assert_eq!(peek(&f, true), Peek::VxlanOther);
        // An EtherType that disagrees with the version nibble.
        let mut f = vlan_frame();
        f[16..18].copy_from_slice(&[0x86, 0xdd]);
        assert_eq!(peek(&f, true), Peek::Other);
        assert_eq!(peek(&[], true), Peek::Other);
        assert_eq!(peek(&[], false), Peek::Other);
    }

    #[test]
    fn vxlan_on_other_ports_is_not_opened() {
        for port in [8472u16, 4790] {
            let mut f = VXLAN_V4;
            f[36..38].copy_from_slice(&port.to_be_bytes());
            assert_eq!(peek(&f, true), Peek::Other, "port {port}");
            assert_eq!(decode_ethernet(&f), Err(Error::NotRoce(port)));
        }
    }

    #[test]
    fn a_zero_udp_checksum_over_ipv6_is_accepted_and_a_fragment_is_not() {
        let mut f = VXLAN_V6;
        f[64..66].fill(0);
        let d = decode_ethernet(&f).unwrap();
        assert!(!d.encap.vxlan().unwrap().udp_checksum);
        assert_reemits(&f);
        let mut f = VXLAN_V4;
        f[20] |= 0x20; // More fragments.
        fix_ipv4(&mut f, 14, 0x72);
        assert_eq!(peek(&f, true), Peek::Roce);
        assert_eq!(
            decode_ethernet(&f),
            Err(Error::Fragmented {
                offset: 0,
                more: true
            })
        );
    }

    #[test]
    fn emit_refuses_a_wrong_buffer() {
        let d = decode_ethernet(&VXLAN_V4).unwrap();
        let mut short = [0; 127];
        assert_eq!(
            d.emit(&mut short),
            Err(Error::BufferSize {
                needed: 128,
                available: 127
            })
        );
        assert_eq!(
            d.encap.emit(&mut short[..67]),
            Err(Error::BufferSize {
                needed: 68,
                available: 67
            })
        );
    }
}
