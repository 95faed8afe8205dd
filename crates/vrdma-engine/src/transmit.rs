//! What the engine's data path puts out: a RoCE packet's bytes (BTH
//! through a zeroed ICRC) in the caller's buffer, and a [`Transmit`] that
//! says where it goes — plain data, as quinn-proto's `Transmit` is. The
//! fabric frames it (IP/UDP headers, the ICRC, which covers them).

use vrdma_wire::{Gid, bth, frame::IpRepr, packet};

/// The largest RoCE packet the engine emits: BTH, the largest extension
/// headers (RETH + ImmDt, or AtomicETH), 4096 bytes of payload, pad, ICRC.
pub const MAX_PACKET: usize = 12 + 28 + vrdma_wire::MAX_PAYLOAD + 4;

/// Where a packet from [`crate::Engine::poll_transmit`] goes.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Transmit {
    /// Bytes written to the buffer (BTH through ICRC).
    pub len: usize,
    pub sgid: Gid,
    pub dgid: Gid,
    /// UDP source port: per QP, for ECMP entropy (0xC000 and up, as rxe).
    pub udp_src_port: u16,
    pub traffic_class: u8,
    pub hop_limit: u8,
    pub flow_label: u32,
    /// Where in the packet the payload lent by reference goes
    /// ([`crate::Engine::poll_transmit_gather`]): the buffer holds the packet's
    /// bytes before it (the headers) and, from this offset on, the bytes
    /// after it (pad and ICRC field); `len` counts them all.
    pub payload_at: usize,
    /// Payload bytes lent by reference ([`crate::Engine::gathered`]), not in the
    /// buffer; 0 when the buffer holds the whole packet.
    pub referenced: usize,
}

/// A piece of a packet's payload that stays in memory (a gather send):
/// `len` bytes at device address `addr`, which the engine checked against
/// the WR's SGEs, their MRs' keys, PD, rights and bounds.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct PayloadRef {
    pub addr: u64,
    pub len: usize,
}

impl Transmit {
    /// Frames the RoCE packet `roce` (this transmit's bytes) into an IP
    /// packet in `out` — IPv4 for IPv4-mapped GIDs, else IPv6 — with
    /// lengths, checksums and the ICRC: what a fabric that writes whole IP
    /// packets (a TAP device, the simulators) puts on its wire.
    pub fn frame_ip(&self, roce: &[u8], out: &mut Vec<u8>) -> Result<(), vrdma_wire::Error> {
        // The engine's packet is already laid out: the headers go in
        // front of it and the ICRC over the whole, with no second parse
        // or emit of the RoCE part (this runs for every packet a fabric
        // sends).
        let ip = self.ip_repr(roce.len(), 0)?;
        let udp_at = ip.buffer_len();
        let roce_at = udp_at + vrdma_wire::udp::HEADER_LEN;
        out.clear();
        out.resize(roce_at, 0);
        out.extend_from_slice(roce);
        ip.emit(&mut out[..udp_at])?;
        // RoCEv2 sends no UDP checksum (the ICRC covers the packet).
        vrdma_wire::udp::Repr {
            src_port: self.udp_src_port,
            checksum: false,
        }
        .emit(&mut out[udp_at..], ip.pseudo_header())?;
        let (headers, roce) = out.split_at_mut(roce_at);
        let crc = vrdma_wire::icrc::compute(&headers[..udp_at], &headers[udp_at..], roce)?;
        packet::Packet::new_unchecked(roce).set_icrc(crc);
        Ok(())
    }
}

impl Transmit {
    /// The IP header of this packet: IPv4 for IPv4-mapped GIDs (DF,
    /// Identification 0 — what Linux writes for DF datagrams from an
    /// unconnected UDP socket), else IPv6.
    fn ip_repr(&self, roce_len: usize, ident: u16) -> Result<IpRepr, vrdma_wire::Error> {
        if roce_len < packet::MIN_LEN {
            return Err(vrdma_wire::Error::Truncated {
                header: vrdma_wire::Header::Bth,
                needed: packet::MIN_LEN,
                available: roce_len,
            });
        }
        let payload_len = vrdma_wire::udp::HEADER_LEN + roce_len;
        Ok(match (self.sgid.to_ipv4(), self.dgid.to_ipv4()) {
            (Some(src), Some(dst)) => IpRepr::V4(vrdma_wire::ipv4::Repr {
                src,
                dst,
                tos: self.traffic_class,
                ident,
                dont_frag: true,
                ttl: self.hop_limit,
                payload_len,
            }),
            _ => IpRepr::V6(vrdma_wire::ipv6::Repr {
                src: self.sgid.into(),
                dst: self.dgid.into(),
                traffic_class: self.traffic_class,
                flow_label: self.flow_label,
                hop_limit: self.hop_limit,
                payload_len,
            }),
        })
    }

    /// Computes and stores the ICRC of `roce` (this transmit's bytes) for
    /// a fabric that sends the packet as the payload of a UDP socket bound
    /// to `src_port`: the ICRC covers the IP and UDP headers the kernel
    /// will write, which are predictable for an unconnected socket that
    /// sets DF (IPv4 Identification 0; TOS, TTL and the checksums are
    /// masked).
    pub fn seal_for_socket(&self, roce: &mut [u8], src_port: u16) -> Result<(), vrdma_wire::Error> {
        self.seal_for_socket_segment(roce, src_port, 0)
    }

    /// [`Transmit::seal_for_socket`] for segment `index` of a UDP GSO
    /// datagram: the kernel gives the segments consecutive IPv4
    /// Identifications from the datagram's (0), so segment `index` carries
    /// `index` (IPv6 has no Identification).
    pub fn seal_for_socket_segment(
        &self,
        roce: &mut [u8],
        src_port: u16,
        index: u16,
    ) -> Result<(), vrdma_wire::Error> {
        let needed = vrdma_wire::bth::HEADER_LEN + packet::ICRC_LEN;
        if roce.len() < needed {
            return Err(vrdma_wire::Error::Truncated {
                header: vrdma_wire::Header::Bth,
                needed,
                available: roce.len(),
            });
        }
        let (head, tail) = roce.split_at_mut(roce.len() - packet::ICRC_LEN);
        self.seal_parts(head, &[], tail, src_port, index)
    }

    /// [`Transmit::seal_for_socket_segment`] for a packet whose payload
    /// was lent ([`crate::Engine::poll_transmit_gather`]): `head` is the buffer's
    /// bytes before [`Transmit::payload_at`], `payload` the lent bytes (in
    /// [`crate::Engine::gathered`]'s order), `tail` the buffer's bytes after them,
    /// ending with the ICRC field this fills.
    pub fn seal_parts(
        &self,
        head: &[u8],
        payload: &[&[u8]],
        tail: &mut [u8],
        src_port: u16,
        index: u16,
    ) -> Result<(), vrdma_wire::Error> {
        let roce_len = head.len() + payload.iter().map(|p| p.len()).sum::<usize>() + tail.len();
        let ip = self.ip_repr(roce_len, index)?;
        let mut headers = [0u8; vrdma_wire::ipv6::HEADER_LEN + vrdma_wire::udp::HEADER_LEN];
        let (ip_header, udp) = headers.split_at_mut(ip.buffer_len());
        ip.emit(ip_header)?;
        let udp = &mut udp[..vrdma_wire::udp::HEADER_LEN];
        let len = vrdma_wire::udp::HEADER_LEN + roce_len;
        let udp_len = u16::try_from(len).map_err(|_| vrdma_wire::Error::OutOfRange {
            what: "a UDP length",
            value: len as u64,
        })?;
        udp[0..2].copy_from_slice(&src_port.to_be_bytes());
        udp[2..4].copy_from_slice(&vrdma_wire::ROCEV2_UDP_PORT.to_be_bytes());
        udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
        let crc = vrdma_wire::icrc::compute_parts(ip_header, udp, head, payload, tail)?;
        let at = tail.len() - packet::ICRC_LEN;
        tail[at..].copy_from_slice(&crc.to_le_bytes());
        Ok(())
    }
}

/// Emits a packet without payload (an ACK, a READ request, an atomic)
/// into `buf`; its length, or `None` if `buf` is too small.
pub(crate) fn emit_bare(buf: &mut [u8], bth: bth::Repr, ext: packet::ExtHeaders) -> Option<usize> {
    let n = packet::packet_len(bth.opcode, 0);
    packet::emit_headers(buf.get_mut(..n)?, &bth, &ext, 0).ok()?;
    Some(n)
}
