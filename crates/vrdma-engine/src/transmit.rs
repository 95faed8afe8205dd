//! What the engine's data path puts out: a RoCE packet's bytes (BTH
//! through a zeroed ICRC) in the caller's buffer, and a [`Transmit`] that
//! says where it goes — plain data, as quinn-proto's `Transmit` is. The
//! fabric frames it (IP/UDP headers, the ICRC, which covers them) with
//! `vrdma-wire`.

use vrdma_wire::{Gid, bth, frame, packet};

/// The largest RoCE packet the engine emits: BTH, the largest extension
/// headers (RETH + ImmDt, or AtomicETH), 4096 bytes of payload, pad, ICRC.
pub const MAX_PACKET: usize = packet::MAX_LEN;

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
    /// The next hop's Ethernet address, from the address vector (a
    /// transport that frames Ethernet needs it; UDP does not).
    pub dmac: Option<[u8; 6]>,
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
    /// The packet's IP-layer route, from which a fabric builds the IP
    /// header it travels with (`vrdma_wire::frame::Route::ip`).
    pub fn route(&self) -> frame::Route {
        frame::Route {
            src: self.sgid,
            dst: self.dgid,
            traffic_class: self.traffic_class,
            hop_limit: self.hop_limit,
            flow_label: self.flow_label,
        }
    }
}

/// Emits a packet without payload (an ACK, a READ request, an atomic)
/// into `buf`; its length, or `None` if `buf` is too small.
pub(crate) fn emit_bare(buf: &mut [u8], bth: bth::Repr, ext: packet::ExtHeaders) -> Option<usize> {
    let n = packet::packet_len(bth.opcode, 0);
    packet::emit_headers(buf.get_mut(..n)?, &bth, &ext, 0).ok()?;
    Some(n)
}

/// Emits a packet whose `n`-byte payload is lent (left in memory) into
/// `buf`: its headers and, right after them, the bytes that follow the
/// payload (pad, ICRC field) — the payload has no room in `buf`, so a lent
/// payload may be longer than a buffer. Returns where the payload goes
/// and the packet's whole length, or `None` if `buf` is too small.
pub(crate) fn emit_lent(
    buf: &mut [u8],
    bth: &bth::Repr,
    ext: &packet::ExtHeaders,
    n: usize,
) -> Option<(usize, usize)> {
    // A payload of n % 4 bytes takes the same pad and the same headers (a
    // RETH names the message's length, not the packet's).
    let small = n % 4;
    let room = packet::packet_len(bth.opcode, small);
    let out = buf.get_mut(..room)?;
    let at = packet::emit_headers(out, bth, ext, small).ok()?;
    out.copy_within(at + small.., at);
    Some((at, room - small + n))
}
