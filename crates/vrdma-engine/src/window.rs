//! The RC send window's sizes: how far a requester runs ahead of its
//! ACKs, how many segments one packet may carry, how often a long message
//! asks for an ACK. The requester, the completer, the responder and the
//! context's budgets all size things by them, so they sit below all four.

/// RC: the most request PSNs in flight, unacknowledged (rxe's
/// RXE_MAX_UNACKED_PSNS). A loss then costs at most this many resent
/// packets, and a responder's reply queue stays bounded.
pub const MAX_UNACKED_PSNS: u32 = 128;

/// The most segments (MTUs, PSNs) one packet carries to a peer whose
/// medium takes a run of them ([`crate::Engine::set_jumbo`]): half the send
/// window, so that two such packets keep the medium busy.
pub const JUMBO_PSNS: u32 = MAX_UNACKED_PSNS / 2;

/// RC: inside a long message every this many packets asks for an ACK, so
/// that the window keeps moving and the retransmit timer, which restarts
/// on progress, does not expire while a long message is still streaming
/// (rxe asks every 64 packets; a 64-packet burst at 25 Gb/s outlasts a
/// 16 µs timeout).
pub const PACKETS_PER_ACK_REQ: u64 = 16;
