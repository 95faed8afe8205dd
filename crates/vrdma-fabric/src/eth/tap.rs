//! The TAP uplink: frames to and from the kernel, each after a virtio-net
//! header (`IFF_VNET_HDR`, little-endian), and — where the kernel segments
//! UDP (`TUN_F_USO4` and `TUN_F_USO6`, Linux 6.2 on) — in runs:
//!
//! - **Out.** The device's consecutive RoCE packets to one peer that
//!   differ only in their IPv4 Identification (each the previous one's
//!   plus one) and whose payloads are all one size (the last may be
//!   shorter) leave as one frame of up to 64 KiB that the kernel cuts
//!   into the packets again (`VIRTIO_NET_HDR_GSO_UDP_L4`): it numbers the
//!   segments' Identifications from the first's, one by one, so each
//!   packet's ICRC — computed for its own Identification when it was
//!   framed — still holds. The segments leave with a UDP checksum (the
//!   kernel's segmentation needs one); the ICRC masks that field.
//! - **In.** A peer's UDP GSO datagram (`UDP_SEGMENT`) stays whole up to
//!   a TAP that takes USO: it is read as one frame and cut here, each
//!   segment given its Identification (the first's plus its index, as the
//!   kernel would have numbered it), its lengths and its IPv4 header
//!   checksum. A frame whose UDP checksum is still to be written (checksum
//!   offload: the field holds the pseudo-header's sum) comes with where it
//!   goes ([`Partial`]); the port completes it for a frame it gives the
//!   guest, and the device's parser accepts the pseudo-header sum.
//!
//! Every header the kernel writes is checked as any input is: a frame
//! whose virtio-net header, IP or UDP header does not add up is dropped
//! and counted (`bad_vnet`).
//!
//! Written here: no crate of the field reads and writes a TAP's
//! virtio-net framing or cuts UDP GSO frames (rust-vmm's `virtio-bindings`
//! has the header's layout, not this; `vm-memory` and `virtio-queue` see
//! guest rings, not a TAP).

use std::{
    fs::File,
    io::{self, IoSlice, Read, Write},
    net::{Ipv4Addr, Ipv6Addr},
};

use vrdma_wire::{ipv4, udp};

use super::{EthStats, sys};

/// Bytes of the virtio-net header before each frame (`struct
/// virtio_net_hdr`; `TUNSETVNETHDRSZ` says so).
pub(super) const VNET_HDR_LEN: usize = 10;

const F_NEEDS_CSUM: u8 = 1;
const GSO_NONE: u8 = 0;
const GSO_UDP_L4: u8 = 5;
const GSO_ECN: u8 = 0x80;

/// The longest IP packet a frame holds (IPv4's and IPv6's 16-bit lengths).
const MAX_IP: usize = 65_535;
/// Segments in one frame written: the kernel's `UDP_MAX_SEGMENTS` is 128
/// on current kernels and was 64 before.
const MAX_SEGS: usize = 64;
/// The shortest segment a frame read may be cut into: a RoCE packet is at
/// least a BTH and an ICRC. Shorter would let one 64 KiB frame make
/// thousands of segments (each a copy of the headers).
const MIN_SEG: usize = vrdma_wire::packet::MIN_LEN;

const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_IPV6: u16 = 0x86dd;
const ETHERTYPE_VLAN: u16 = 0x8100;
const PROTO_UDP: u8 = 17;

/// `struct virtio_net_hdr`.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub(super) struct VnetHdr {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
}

impl VnetHdr {
    pub fn parse(b: &[u8; VNET_HDR_LEN]) -> Self {
        let u = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        VnetHdr {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u(2),
            gso_size: u(4),
            csum_start: u(6),
            csum_offset: u(8),
        }
    }

    pub fn emit(&self) -> [u8; VNET_HDR_LEN] {
        let mut b = [0u8; VNET_HDR_LEN];
        b[0] = self.flags;
        b[1] = self.gso_type;
        b[2..4].copy_from_slice(&self.hdr_len.to_le_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_le_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_le_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_le_bytes());
        b
    }
}

/// A frame's checksum still to be written (checksum offload): the
/// ones'-complement sum of the bytes from `start` to the frame's end — the
/// field, which holds the pseudo-header's sum, among them — goes at
/// `start + offset`. Both were checked to lie in the frame.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Partial {
    pub start: usize,
    pub offset: usize,
}

impl Partial {
    /// Writes the checksum into `f` (the frame it came with). A UDP
    /// checksum that computes to zero is sent as 0xffff (RFC 768); TCP's
    /// cannot compute to zero over a non-empty segment.
    pub fn complete(self, f: &mut [u8]) {
        let at = self.start + self.offset;
        if at + 2 > f.len() || self.start > f.len() {
            return;
        }
        let c = ipv4::checksum(&[&f[self.start..]]);
        let c = if c == 0 { 0xffff } else { c };
        f[at..at + 2].copy_from_slice(&c.to_be_bytes());
    }
}

/// Why a frame from the TAP was dropped.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Malformed {
    /// Shorter than its virtio-net header.
    Short,
    /// A checksum position outside the frame.
    Checksum,
    /// A GSO type the port did not ask for (TCP, UFO).
    GsoType,
    /// A UDP GSO frame whose headers do not add up.
    Segments,
}

/// Where a UDP datagram's headers are in a frame.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
struct Layout {
    /// The IP header's offset (after Ethernet, perhaps a VLAN tag).
    l3: usize,
    /// The UDP header's offset.
    l4: usize,
    v6: bool,
}

impl Layout {
    /// The headers of a UDP datagram in `f` that fills it: IPv4 without
    /// fragments, or IPv6 with UDP as its next header; the IP length
    /// agrees with the frame's.
    fn of(f: &[u8]) -> Option<Self> {
        let (l3, ethertype) = match be16(f, 12)? {
            ETHERTYPE_VLAN => (18, be16(f, 16)?),
            t => (14, t),
        };
        let ip = f.get(l3..)?;
        let (l4, v6) = match ethertype {
            ETHERTYPE_IPV4 => {
                let ihl = usize::from(*ip.first()? & 0x0f) * 4;
                let frag = be16(ip, 6)? & 0x3fff;
                if ip[0] >> 4 != 4
                    || ihl < 20
                    || *ip.get(9)? != PROTO_UDP
                    || frag != 0
                    || usize::from(be16(ip, 2)?) != ip.len()
                {
                    return None;
                }
                (l3 + ihl, false)
            }
            ETHERTYPE_IPV6 => {
                if *ip.first()? >> 4 != 6
                    || *ip.get(6)? != PROTO_UDP
                    || usize::from(be16(ip, 4)?) + 40 != ip.len()
                {
                    return None;
                }
                (l3 + 40, true)
            }
            _ => return None,
        };
        if f.len() < l4 + udp::HEADER_LEN || usize::from(be16(f, l4 + 4)?) != f.len() - l4 {
            return None;
        }
        Some(Layout { l3, l4, v6 })
    }

    fn pseudo(&self, f: &[u8]) -> udp::PseudoHeader {
        if self.v6 {
            let a = |at: usize| {
                let mut b = [0u8; 16];
                b.copy_from_slice(&f[at..at + 16]);
                Ipv6Addr::from(b)
            };
            udp::PseudoHeader::V6 {
                src: a(self.l3 + 8),
                dst: a(self.l3 + 24),
            }
        } else {
            let a = |at: usize| Ipv4Addr::new(f[at], f[at + 1], f[at + 2], f[at + 3]);
            udp::PseudoHeader::V4 {
                src: a(self.l3 + 12),
                dst: a(self.l3 + 16),
            }
        }
    }

    /// Writes the lengths (and IPv4's Identification `ident` and header
    /// checksum) of the datagram that now fills `f`, and `udp_check` as
    /// its UDP checksum.
    fn set_lengths(&self, f: &mut [u8], ident: Option<u16>, udp_check: u16) {
        let udp_len = (f.len() - self.l4) as u16;
        f[self.l4 + 4..self.l4 + 6].copy_from_slice(&udp_len.to_be_bytes());
        f[self.l4 + 6..self.l4 + 8].copy_from_slice(&udp_check.to_be_bytes());
        let l3 = self.l3;
        if self.v6 {
            f[l3 + 4..l3 + 6].copy_from_slice(&udp_len.to_be_bytes());
        } else {
            let total = (f.len() - l3) as u16;
            f[l3 + 2..l3 + 4].copy_from_slice(&total.to_be_bytes());
            if let Some(id) = ident {
                f[l3 + 4..l3 + 6].copy_from_slice(&id.to_be_bytes());
            }
            f[l3 + 10..l3 + 12].fill(0);
            let c = ipv4::checksum(&[&f[l3..self.l4]]);
            f[l3 + 10..l3 + 12].copy_from_slice(&c.to_be_bytes());
        }
    }
}

/// Gives `out` each frame that one read from a TAP (`read`: the
/// virtio-net header, then the frame) carries, cutting a UDP GSO frame
/// into its segments (rebuilt in `seg`); returns how many frames it gave.
/// What [`Tap`] does with each read, public for the fuzzer.
pub fn cut(
    read: &mut [u8],
    seg: &mut Vec<u8>,
    out: impl FnMut(&mut [u8], Option<Partial>),
) -> Result<usize, Malformed> {
    let (h, frame) = read
        .split_first_chunk_mut::<VNET_HDR_LEN>()
        .ok_or(Malformed::Short)?;
    unpack(&VnetHdr::parse(h), frame, seg, out)
}

/// Gives `out` each frame that `frame` (read after `hdr`) carries: itself,
/// or — a UDP GSO frame — each of its segments, rebuilt in `seg`. Returns
/// the frames given.
pub(super) fn unpack(
    hdr: &VnetHdr,
    frame: &mut [u8],
    seg: &mut Vec<u8>,
    mut out: impl FnMut(&mut [u8], Option<Partial>),
) -> Result<usize, Malformed> {
    let partial = if hdr.flags & F_NEEDS_CSUM != 0 {
        let p = Partial {
            start: usize::from(hdr.csum_start),
            offset: usize::from(hdr.csum_offset),
        };
        if p.start + p.offset + 2 > frame.len() {
            return Err(Malformed::Checksum);
        }
        Some(p)
    } else {
        None
    };
    match hdr.gso_type & !GSO_ECN {
        GSO_NONE => {
            out(frame, partial);
            Ok(1)
        }
        GSO_UDP_L4 => split_udp(frame, usize::from(hdr.gso_size), partial, seg, out),
        _ => Err(Malformed::GsoType),
    }
}

/// Cuts a UDP GSO frame into its segments of `size` bytes of payload (the
/// last may be shorter), in place: each segment's headers (a copy of the
/// frame's, kept in `head`, its lengths, Identification and checksums its
/// own) are written just before its payload, over the end of the segment
/// before it, which was given to `out` already. No payload is copied.
fn split_udp(
    frame: &mut [u8],
    size: usize,
    partial: Option<Partial>,
    head: &mut Vec<u8>,
    mut out: impl FnMut(&mut [u8], Option<Partial>),
) -> Result<usize, Malformed> {
    let l = Layout::of(frame).ok_or(Malformed::Segments)?;
    // Checksum offload is what UDP segmentation rests on: the field is the
    // UDP checksum of this datagram.
    if partial
        != Some(Partial {
            start: l.l4,
            offset: 6,
        })
        || size < MIN_SEG
    {
        return Err(Malformed::Segments);
    }
    let hlen = l.l4 + udp::HEADER_LEN;
    if frame.len() <= hlen {
        return Err(Malformed::Segments);
    }
    let ph = l.pseudo(frame);
    let base = if l.v6 {
        0
    } else {
        be16(frame, l.l3 + 4).unwrap_or(0)
    };
    head.clear();
    head.extend_from_slice(&frame[..hlen]);
    let (mut at, mut k, mut n) = (hlen, 0u16, 0usize);
    while at < frame.len() {
        let len = size.min(frame.len() - at);
        let s = &mut frame[at - hlen..at + len];
        s[..hlen].copy_from_slice(head);
        let ident = (!l.v6).then(|| base.wrapping_add(k));
        l.set_lengths(
            s,
            ident,
            udp::offload_partial_checksum(ph, udp::HEADER_LEN + len),
        );
        out(
            s,
            Some(Partial {
                start: l.l4,
                offset: 6,
            }),
        );
        at += len;
        k = k.wrapping_add(1);
        n += 1;
    }
    Ok(n)
}

/// A frame as a capture taken on a TAP with offloads shows it: a run of
/// RoCE packets as one UDP GSO frame, before the kernel cut it (a capture
/// has no virtio-net header to give the segment size). If `frame`
/// (Ethernet) is such a frame — UDP to 4791 whose payload cuts into RoCE
/// packets of one size, the last perhaps shorter, each a BTH of the first
/// packet's P_Key and destination QP and each's ICRC good for the headers
/// the kernel would have given it — each packet goes to `out` as the
/// kernel would have cut it, and this returns how many; else `None`. The
/// smallest size that gives such packets is taken.
pub fn cut_captured(frame: &[u8], mut out: impl FnMut(&[u8])) -> Option<usize> {
    let l = Layout::of(frame)?;
    let head = l.l4 + udp::HEADER_LEN;
    if be16(frame, l.l4 + 2) != Some(vrdma_wire::ROCEV2_UDP_PORT) {
        return None;
    }
    let payload = &frame[head..];
    let partial = Some(Partial {
        start: l.l4,
        offset: 6,
    });
    let (mut copy, mut headers, mut cut) = (Vec::new(), Vec::new(), Vec::<Vec<u8>>::new());
    // A piece is at most the longest RoCE packet: a frame of 64 KiB is
    // tried at most a few thousand ways, not one per byte.
    let longest = payload
        .len()
        .saturating_sub(MIN_SEG)
        .min(vrdma_wire::packet::MAX_LEN);
    for size in MIN_SEG..=longest {
        if !same_qp(payload, size) {
            continue;
        }
        copy.clear();
        copy.extend_from_slice(frame);
        cut.clear();
        let mut good = true;
        let r = split_udp(&mut copy, size, partial, &mut headers, |seg, _| {
            good &= vrdma_wire::frame::decode_ethernet(seg).is_ok_and(|d| d.icrc.is_good());
            cut.push(seg.to_vec());
        });
        if r.is_ok() && good {
            cut.iter().for_each(|c| out(c));
            return Some(cut.len());
        }
    }
    None
}

/// Whether `payload` cut every `size` bytes (the last piece at least a
/// BTH and ICRC) starts each piece with a BTH of the first's transport
/// version, P_Key and destination QP: the candidates worth checking.
fn same_qp(payload: &[u8], size: usize) -> bool {
    const BTH: usize = 12;
    let first = payload;
    let n = payload.len().div_ceil(size);
    if n < 2 || payload.len() - (n - 1) * size < MIN_SEG {
        return false;
    }
    (1..n).all(|k| {
        let b = &payload[k * size..];
        b.len() >= BTH
            && b[1] & 0x0f == first[1] & 0x0f
            && b[2..4] == first[2..4]
            && b[5..8] == first[5..8]
    })
}

/// The device's packets waiting to leave as one frame: the first packet's
/// frame whole, then each next one's UDP payload.
#[derive(Debug, Default)]
struct Run {
    buf: Vec<u8>,
    layout: Option<Layout>,
    /// The first packet's UDP payload length: every segment's but the
    /// last's.
    size: usize,
    segs: usize,
    /// A segment shorter than `size` ended the run.
    closed: bool,
    /// The IPv4 Identification the next packet must carry.
    next_ident: u16,
}

impl Run {
    /// Takes `f` (a whole frame the port made: Ethernet, IP, UDP, RoCE)
    /// into the run; false if it cannot join it (the run must be written
    /// first) or is no UDP datagram (it is written alone). A run's first
    /// frame is taken by swapping buffers (`f` is left with the run's old
    /// one), the next ones' payloads copied.
    fn join(&mut self, f: &mut Vec<u8>) -> bool {
        let Some(l) = self.layout else {
            let Some(l) = Layout::of(f) else {
                return false;
            };
            std::mem::swap(&mut self.buf, f);
            let f = &self.buf;
            self.layout = Some(l);
            self.size = f.len() - l.l4 - udp::HEADER_LEN;
            self.segs = 1;
            self.closed = self.size < MIN_SEG;
            self.next_ident = be16(f, l.l3 + 4).unwrap_or(0).wrapping_add(1);
            return true;
        };
        let head = l.l4 + udp::HEADER_LEN;
        if self.closed
            || self.segs >= MAX_SEGS
            || f.len() <= head
            || f.len() - head > self.size
            || self.buf.len() - l.l3 + (f.len() - head) > MAX_IP
            || !self.same_flow(&l, f)
        {
            return false;
        }
        let len = f.len() - head;
        self.buf.extend_from_slice(&f[head..]);
        self.segs += 1;
        self.closed = len < self.size;
        self.next_ident = self.next_ident.wrapping_add(1);
        true
    }

    /// Whether `f` is the next packet of the run's flow: the same
    /// Ethernet header, IP header but for its lengths, Identification and
    /// checksum (the Identification the next one), and UDP ports.
    fn same_flow(&self, l: &Layout, f: &[u8]) -> bool {
        let b = &self.buf;
        if f.len() < l.l4 + udp::HEADER_LEN || f[..l.l3] != b[..l.l3] {
            return false;
        }
        let (l3, l4) = (l.l3, l.l4);
        let ip_same = if l.v6 {
            f[l3..l3 + 4] == b[l3..l3 + 4] && f[l3 + 6..l4] == b[l3 + 6..l4]
        } else {
            f[l3..l3 + 2] == b[l3..l3 + 2]
                && be16(f, l3 + 4) == Some(self.next_ident)
                && f[l3 + 6..l3 + 10] == b[l3 + 6..l3 + 10]
                && f[l3 + 12..l4] == b[l3 + 12..l4]
        };
        ip_same && f[l4..l4 + 4] == b[l4..l4 + 4] && f[l4 + 6..l4 + 8] == b[l4 + 6..l4 + 8]
    }

    /// The frame to write and its header, the run emptied (segments
    /// counted in the second value).
    fn take(&mut self) -> Option<(VnetHdr, usize)> {
        let l = self.layout.take()?;
        let segs = std::mem::take(&mut self.segs);
        if segs == 1 {
            return Some((VnetHdr::default(), 1));
        }
        let udp_len = self.buf.len() - l.l4;
        let check = udp::offload_partial_checksum(l.pseudo(&self.buf), udp_len);
        l.set_lengths(&mut self.buf, None, check);
        let hdr = VnetHdr {
            flags: F_NEEDS_CSUM,
            gso_type: GSO_UDP_L4,
            hdr_len: (l.l4 + udp::HEADER_LEN) as u16,
            gso_size: self.size as u16,
            csum_start: l.l4 as u16,
            csum_offset: 6,
        };
        Some((hdr, segs))
    }
}

/// A TAP device with virtio-net headers.
#[derive(Debug)]
pub struct Tap {
    file: File,
    /// Whether the kernel takes and gives UDP GSO frames.
    uso: bool,
    rx: Vec<u8>,
    seg: Vec<u8>,
    run: Run,
}

impl Tap {
    /// Opens the TAP device `name` (created if it does not exist),
    /// non-blocking, asking for checksum offload and UDP segmentation
    /// (`uso`) where the kernel has it.
    pub fn open(name: &str, uso: bool) -> io::Result<Self> {
        let (file, uso) = sys::open_tap(name, uso)?;
        Ok(Tap {
            file,
            uso,
            rx: vec![0; VNET_HDR_LEN + MAX_IP + 18],
            seg: Vec::with_capacity(super::MAX_FRAME),
            run: Run::default(),
        })
    }

    /// Whether frames go to and come from the kernel in UDP GSO runs.
    pub fn offloads(&self) -> bool {
        self.uso
    }

    pub(super) fn file(&self) -> &File {
        &self.file
    }

    /// Writes one frame after `hdr`; false if the kernel did not take it.
    fn write(&mut self, hdr: &VnetHdr, frame: &[u8]) -> io::Result<bool> {
        let h = hdr.emit();
        loop {
            return match self
                .file
                .write_vectored(&[IoSlice::new(&h), IoSlice::new(frame)])
            {
                Ok(_) => Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
                // A frame the TAP refuses (too long for it, or no carrier):
                // dropped.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EIO)) => Ok(false),
                Err(e) => Err(e),
            };
        }
    }

    /// Sends a frame now (the device's run first).
    pub(super) fn send(&mut self, frame: &[u8], stats: &mut EthStats) -> io::Result<()> {
        self.flush(stats)?;
        if self.write(&VnetHdr::default(), frame)? {
            stats.uplink_tx += 1;
        } else {
            stats.uplink_full += 1;
        }
        Ok(())
    }

    /// Sends one of the device's RoCE frames: joined to the run where it
    /// can be (written by [`Tap::flush`], or when the next cannot join).
    pub(super) fn send_roce(
        &mut self,
        frame: &mut Vec<u8>,
        stats: &mut EthStats,
    ) -> io::Result<()> {
        if !self.uso {
            return self.send(frame, stats);
        }
        if self.run.join(frame) {
            return Ok(());
        }
        self.flush(stats)?;
        if self.run.join(frame) {
            return Ok(());
        }
        self.send(frame, stats)
    }

    /// Writes the run.
    pub(super) fn flush(&mut self, stats: &mut EthStats) -> io::Result<()> {
        let Some((hdr, segs)) = self.run.take() else {
            return Ok(());
        };
        let buf = std::mem::take(&mut self.run.buf);
        let r = self.write(&hdr, &buf);
        self.run.buf = buf;
        if r? {
            stats.uplink_tx += segs as u64;
            if segs > 1 {
                stats.uplink_gso_tx += 1;
            }
        } else {
            stats.uplink_full += segs as u64;
        }
        Ok(())
    }

    /// Reads up to `frames` frames; each frame, or segment of a GSO frame,
    /// goes to `f`. Ok(false) when the TAP is gone.
    pub(super) fn receive(
        &mut self,
        frames: usize,
        stats: &mut EthStats,
        mut f: impl FnMut(&mut EthStats, &mut [u8], Option<Partial>),
    ) -> io::Result<bool> {
        for _ in 0..frames {
            let n = match self.file.read(&mut self.rx) {
                Ok(0) => return Ok(false),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            match cut(&mut self.rx[..n], &mut self.seg, |fr, p| f(stats, fr, p)) {
                Ok(k) if k > 1 => stats.uplink_gso_rx += 1,
                Ok(_) => {}
                Err(_) => stats.bad_vnet += 1,
            }
        }
        Ok(true)
    }
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use vrdma_wire::{
        Gid,
        frame::{self, Route},
    };

    use super::*;

    const DMAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0b];
    const SMAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0a];

    fn route(v6: bool) -> Route {
        let (src, dst) = if v6 {
            (
                Gid::from("fd00::a".parse::<Ipv6Addr>().unwrap()),
                Gid::from("fd00::b".parse::<Ipv6Addr>().unwrap()),
            )
        } else {
            (
                Gid::from(Ipv4Addr::new(10, 9, 0, 1)),
                Gid::from(Ipv4Addr::new(10, 9, 0, 2)),
            )
        };
        Route {
            src,
            dst,
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
        }
    }

    /// A frame as the port makes it: a RoCE "packet" of `len` bytes (its
    /// first byte `tag`), Identification `ident`.
    fn frame(r: &Route, len: usize, tag: u8, ident: u16, src_port: u16) -> Vec<u8> {
        let mut roce = vec![tag; len];
        roce[1] = (len >> 8) as u8;
        let ip = r.ip(len, ident).unwrap();
        let mut p = Vec::new();
        frame::emit_ip_packet(&ip, src_port, &roce, &mut p).unwrap();
        let ethertype: u16 = if r.dst.to_ipv4().is_some() {
            0x0800
        } else {
            0x86dd
        };
        let mut f = Vec::new();
        f.extend_from_slice(&DMAC);
        f.extend_from_slice(&SMAC);
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(&p);
        f
    }

    /// What a run of `frames` becomes through [`Run`] and back through
    /// [`unpack`]: the frames the kernel would see, and how many frames
    /// were written.
    fn round_trip(frames: &[Vec<u8>]) -> (Vec<Vec<u8>>, usize) {
        let mut run = Run::default();
        let mut written = Vec::new();
        let mut out = Vec::new();
        let write = |run: &mut Run, written: &mut Vec<(VnetHdr, Vec<u8>)>| {
            if let Some((h, _)) = run.take() {
                written.push((h, run.buf.clone()));
            }
        };
        for f in frames {
            let mut f = f.clone();
            if !run.join(&mut f) {
                write(&mut run, &mut written);
                assert!(run.join(&mut f), "a first packet always starts a run");
            }
        }
        write(&mut run, &mut written);
        let mut seg = Vec::new();
        for (h, mut w) in written.clone() {
            unpack(&h, &mut w, &mut seg, |f, p| {
                let mut f = f.to_vec();
                if let Some(p) = p {
                    // The field held the pseudo-header's sum, which the
                    // device's parser takes; completed, it verifies too.
                    assert!(frame::unframe_ip(&f[14..]).is_ok());
                    p.complete(&mut f);
                    // Back to the zero the port wrote, for comparison.
                    f[p.start + p.offset..p.start + p.offset + 2].fill(0);
                }
                out.push(f);
            })
            .unwrap();
        }
        (out, written.len())
    }

    #[test]
    fn a_message_leaves_as_one_frame_and_comes_back_as_its_packets() {
        let r = route(false);
        // WRITE FIRST (longer: its RETH), MIDDLEs, a shorter LAST.
        let mut frames = vec![frame(&r, 1056, 1, 100, 0xc001)];
        for k in 0..20u16 {
            frames.push(frame(&r, 1040, 2, 101 + k, 0xc001));
        }
        frames.push(frame(&r, 300, 3, 121, 0xc001));
        let (back, written) = round_trip(&frames);
        assert_eq!(back, frames);
        // The FIRST alone, the MIDDLEs and the LAST together.
        assert_eq!(written, 2);
    }

    #[test]
    fn packets_of_other_flows_or_out_of_sequence_break_the_run() {
        let r = route(false);
        let mut other = route(false);
        other.dst = Gid::from(Ipv4Addr::new(10, 9, 0, 3));
        let frames = vec![
            frame(&r, 500, 1, 7, 0xc001),
            frame(&r, 500, 1, 8, 0xc001),
            // Another destination.
            frame(&other, 500, 1, 9, 0xc001),
            // An Identification that is not the next.
            frame(&other, 500, 1, 11, 0xc001),
            // Another source port.
            frame(&other, 500, 1, 12, 0xc002),
            // Longer than the run's packets.
            frame(&other, 600, 1, 13, 0xc002),
        ];
        let (back, written) = round_trip(&frames);
        assert_eq!(back, frames);
        assert_eq!(written, 5);
    }

    #[test]
    fn a_gso_frame_whose_headers_do_not_add_up_is_refused() {
        let r = route(false);
        let frames: Vec<_> = (0..4).map(|k| frame(&r, 400, 1, k, 0xc001)).collect();
        let mut run = Run::default();
        for f in &frames {
            assert!(run.join(&mut f.clone()));
        }
        let (h, _) = run.take().unwrap();
        let good = run.buf.clone();
        let count = |h: &VnetHdr, f: &[u8]| {
            let mut f = f.to_vec();
            let mut seg = Vec::new();
            unpack(h, &mut f, &mut seg, |_, _| {})
        };
        assert_eq!(count(&h, &good), Ok(4));
        // The IP length says more than the frame holds.
        assert_eq!(count(&h, &good[..good.len() - 1]), Err(Malformed::Segments));
        // A checksum position past the frame.
        let far = VnetHdr {
            csum_start: good.len() as u16,
            ..h
        };
        assert_eq!(count(&far, &good), Err(Malformed::Checksum));
        // Segments too short to be RoCE packets.
        let tiny = VnetHdr { gso_size: 4, ..h };
        assert_eq!(count(&tiny, &good), Err(Malformed::Segments));
        // TCP segmentation, which the port never asks for.
        let tcp = VnetHdr { gso_type: 1, ..h };
        assert_eq!(count(&tcp, &good), Err(Malformed::GsoType));
        // A frame whose UDP checksum is not the one offloaded.
        let elsewhere = VnetHdr {
            csum_offset: 4,
            ..h
        };
        assert_eq!(count(&elsewhere, &good), Err(Malformed::Segments));
    }

    /// A frame of a RoCE packet with a BTH (P_Key 0xffff, QP 0x11, `psn`)
    /// and `len` bytes in all.
    fn bth_frame(r: &Route, len: usize, psn: u32, ident: u16) -> Vec<u8> {
        let mut f = frame(r, len, 0x7b, ident, 0xc001);
        let roce = &mut f[42..];
        roce[..12].copy_from_slice(&[0x06, 0, 0xff, 0xff, 0, 0, 0, 0x11, 0, 0, 0, 0]);
        roce[9..12].copy_from_slice(&psn.to_be_bytes()[1..]);
        // Sealed again for the BTH just written.
        let ip = r.ip(len, ident).unwrap();
        let packet = f[14..].to_vec();
        let mut sealed = packet.clone();
        frame::seal_ip_packet(&ip, 0xc001, &mut sealed).unwrap();
        f[14..].copy_from_slice(&sealed);
        f
    }

    /// A run's frame as a capture before the kernel shows it, cut back.
    fn captured(frames: &[Vec<u8>]) -> Option<Vec<Vec<u8>>> {
        let mut run = Run::default();
        for f in frames {
            assert!(run.join(&mut f.clone()), "one run");
        }
        run.take().unwrap();
        let mut out = Vec::new();
        cut_captured(&run.buf, |s| {
            let mut s = s.to_vec();
            // The port wrote no UDP checksum; the cut writes the
            // pseudo-header's sum, as offload leaves it.
            s[40..42].fill(0);
            out.push(s);
        })?;
        Some(out)
    }

    #[test]
    fn a_capture_of_a_run_is_decoded_as_its_packets() {
        let r = route(false);
        // Equal packets, PSNs in order.
        let frames: Vec<_> = (0..5)
            .map(|k| bth_frame(&r, 1040, 100 + k, 7 + k as u16))
            .collect();
        assert_eq!(captured(&frames).unwrap(), frames);
        // A retransmission's PSNs out of order, and a shorter last packet
        // longer than half the first (a WRITE FIRST then a MIDDLE).
        let frames = vec![
            bth_frame(&r, 1040, 40, 1),
            bth_frame(&r, 1040, 38, 2),
            bth_frame(&r, 1040, 39, 3),
            bth_frame(&r, 600, 41, 4),
        ];
        assert_eq!(captured(&frames).unwrap(), frames);
        let frames = vec![bth_frame(&r, 1056, 40, 1), bth_frame(&r, 1040, 41, 2)];
        assert_eq!(captured(&frames).unwrap(), frames);
        // One packet alone is no run to cut.
        let one = bth_frame(&r, 1040, 5, 9);
        assert!(cut_captured(&one, |_| {}).is_none());
        // A frame whose pieces' ICRCs fail is left whole.
        let mut frames: Vec<_> = (0..3).map(|k| bth_frame(&r, 500, k, k as u16)).collect();
        let last = frames[2].len() - 1;
        frames[2][last] ^= 1;
        assert!(captured(&frames).is_none());
    }

    proptest! {
        #[test]
        fn runs_cut_back_into_the_packets_they_joined(
            v6 in any::<bool>(),
            start in any::<u16>(),
            size in 16usize..1500,
            count in 1usize..150,
            last in 16usize..1500,
            src_port in 0xc000u16..0xc004,
        ) {
            let r = route(v6);
            let last = last.min(size);
            let frames: Vec<_> = (0..count)
                .map(|k| {
                    let len = if k + 1 == count { last } else { size };
                    frame(&r, len, k as u8, start.wrapping_add(k as u16), src_port)
                })
                .collect();
            let (back, written) = round_trip(&frames);
            prop_assert_eq!(&back, &frames);
            // Runs as long as a frame allows.
            let per_frame = MAX_SEGS.min((MAX_IP - 48) / (size + 12)).max(1);
            prop_assert!(written <= count.div_ceil(per_frame) + 1);
        }

        #[test]
        fn whatever_the_kernel_writes_is_cut_or_refused(
            hdr in proptest::array::uniform10(any::<u8>()),
            frame in proptest::collection::vec(any::<u8>(), 0..3000),
        ) {
            let h = VnetHdr::parse(&hdr);
            let mut f = frame;
            let mut seg = Vec::new();
            let len = f.len();
            let _ = unpack(&h, &mut f, &mut seg, |s, p| {
                assert!(s.len() <= len.max(1) * 2 + 128);
                if let Some(p) = p {
                    p.complete(s);
                }
            });
        }
    }
}
