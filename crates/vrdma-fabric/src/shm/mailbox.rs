//! A device's mailbox on the switch: the packets sent to it, in order,
//! bounded in bytes, with the count a polling receiver reads and the
//! eventfd that wakes a sleeping one; and the packets it holds, copied or
//! with their payload lent on.

use std::{
    collections::VecDeque,
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicUsize},
    },
};

use nix::sys::eventfd::EventFd;
use vrdma_wire::frame::Route;

/// A count a receiver polls, on a cache line of its own: a sender that
/// takes the queue's lock does not take the line the receiver spins on.
#[derive(Debug)]
#[repr(align(64))]
pub(super) struct Pending(pub(super) AtomicUsize);

/// A device's mailbox: the packets sent to it, in order.
#[derive(Debug)]
pub(super) struct Mailbox {
    /// The port it belongs to.
    pub(super) id: u64,
    /// Bytes it holds at most.
    pub(super) limit: usize,
    /// Packets queued (read without the lock by a polling receiver).
    pub(super) pending: Pending,
    /// Whether the receiver may be asleep on its descriptor, so that a sender
    /// must wake it (true until its first
    /// [`Port::receive`](super::Port::receive)).
    ///
    /// A receiver that polls spares its senders the wake-up (an eventfd write
    /// and read, two system calls per packet of a ping-pong): a receive clears
    /// the flag; before it sleeps the receiver sets it
    /// ([`Port::arm`](super::Port::arm)) and looks at the count once more,
    /// while a sender stores the count, then reads the flag. Both sequentially
    /// consistent, so at least one of them sees the other: no packet is left
    /// unannounced to a sleeper.
    pub(super) armed: AtomicBool,
    pub(super) queue: Mutex<Queue>,
    /// Readable while packets wait (once written per empty-to-not-empty
    /// change, read when the receiver finds the queue empty).
    pub(super) event: EventFd,
}

impl Mailbox {
    /// The empty mailbox of port `id`, holding `limit` bytes at most, whose
    /// receiver `event` wakes (armed until its first receive).
    pub(super) fn new(id: u64, limit: usize, event: EventFd) -> Self {
        Mailbox {
            id,
            limit,
            pending: Pending(AtomicUsize::new(0)),
            armed: AtomicBool::new(true),
            queue: Mutex::new(Queue::default()),
            event,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Queue {
    pub(super) packets: VecDeque<Parcel>,
    /// Bytes of the packets queued.
    pub(super) bytes: usize,
    /// Whether the eventfd was written since the receiver last emptied
    /// the queue.
    pub(super) signaled: bool,
    /// Buffers the receiver gave back, for the next packets.
    pub(super) spare: Vec<Vec<u8>>,
    /// The port is gone: nothing more is queued.
    pub(super) closed: bool,
}

/// A packet in a mailbox: its route (from which the receiver rebuilds the IP
/// header the engine checks) and its bytes, BTH through ICRC — or, for a
/// payload lent on ([`Port::send_loan`](super::Port::send_loan)), the bytes
/// around the payload and the loan.
#[derive(Debug)]
pub(super) struct Parcel {
    pub(super) route: Route,
    /// A buffer whose first `len` bytes are the packet (its length never
    /// shrinks, so that a reused buffer is not cleared again).
    pub(super) bytes: Vec<u8>,
    pub(super) len: usize,
    /// Boxed: a loan is rare (long payloads only), and the short packets'
    /// parcels stay small as they move through the queues.
    pub(super) loan: Option<Box<Loan>>,
}

/// A payload a device lent on to its receiver instead of copying it: the
/// receiver copies it, once, from the sender's memory into its own MR
/// ([`Port::send_loan`](super::Port::send_loan)). What `token` holds — the
/// sender's memory and the fences its MRs and maps are revoked through — is the
/// devices' business, not the medium's: the medium carries it, the receiving
/// device reads it.
#[derive(Debug)]
pub struct Loan {
    /// Where the payload goes in the packet: the packet's bytes before it
    /// are those up to here, those after it follow.
    pub payload_at: usize,
    /// Its length.
    pub len: usize,
    pub token: Box<dyn std::any::Any + Send>,
}

/// Bytes a lent-on packet counts in its receiver's mailbox beside its
/// headers: what a copy of its payload would hold, up to a 4 KiB page (a
/// mailbox bounds a slow receiver's backlog, and a loan holds its
/// sender's MR against deregistration until it is read).
const LOAN_WEIGHT: usize = 4096;

impl Parcel {
    pub(super) fn packet(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// What it counts against its mailbox's bound.
    pub(super) fn weight(&self) -> usize {
        self.len + self.loan.as_ref().map_or(0, |l| l.len.min(LOAN_WEIGHT))
    }
}
