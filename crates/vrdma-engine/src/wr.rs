//! Work requests as a consumer posts them (`struct ibv_send_wr`,
//! `struct ibv_recv_wr`), and the work queues that hold them.
//!
//! A queue's slots are allocated once, when the QP is created, each with
//! room for the QP's maximum SGE count and inline size; posting copies the
//! request into a free slot and allocates nothing.

use vrdma_wire::{Lkey, QKey, Qpn, Rkey};

use crate::wc::WcOpcode;

/// A scatter/gather element (`struct ibv_sge`).
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: Lkey,
}

/// What a send WR does (`enum ibv_wr_opcode` with its operands).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum SendOp {
    Send,
    /// `imm` as the consumer wrote it (network byte order, passed through).
    SendWithImm {
        imm: u32,
    },
    SendWithInv {
        invalidate: Rkey,
    },
    RdmaWrite {
        remote_addr: u64,
        rkey: Rkey,
    },
    RdmaWriteWithImm {
        remote_addr: u64,
        rkey: Rkey,
        imm: u32,
    },
    RdmaRead {
        remote_addr: u64,
        rkey: Rkey,
    },
    CompareSwap {
        remote_addr: u64,
        rkey: Rkey,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        remote_addr: u64,
        rkey: Rkey,
        add: u64,
    },
    LocalInv {
        invalidate: Rkey,
    },
    /// Bind a memory window (type 1 through the bind verb, type 2 as a
    /// work request) over `length` bytes at `addr` of the MR `mr`, giving
    /// it the key byte `key` (`ibv_inc_rkey`).
    BindMw {
        mw: Rkey,
        key: u8,
        mr: Lkey,
        addr: u64,
        length: u64,
        access: crate::mr::Access,
    },
    /// Fast registration (REG_MR): make the MR `mr` (allocated for fast
    /// registration, its pages mapped) valid at `iova` for `length` bytes
    /// with `access`, under the key byte `key`.
    RegMr {
        mr: Lkey,
        key: u8,
        iova: u64,
        length: u64,
        access: crate::mr::Access,
    },
    /// A work request a device face could not decode from its guest's
    /// queue (an opcode the QP has no use for, too many SGEs): it completes
    /// in its turn with `status` and takes the QP to ERR, as a malformed
    /// descriptor does on a hardware device.
    Malformed {
        status: crate::wc::WcStatus,
    },
}

impl SendOp {
    /// The opcode its completion carries.
    pub const fn wc_opcode(self) -> WcOpcode {
        match self {
            SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. } => {
                WcOpcode::Send
            }
            SendOp::RdmaWrite { .. } | SendOp::RdmaWriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::RdmaRead { .. } => WcOpcode::RdmaRead,
            SendOp::CompareSwap { .. } => WcOpcode::CompSwap,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
            SendOp::LocalInv { .. } => WcOpcode::LocalInv,
            SendOp::BindMw { .. } => WcOpcode::BindMw,
            SendOp::RegMr { .. } => WcOpcode::RegMr,
            SendOp::Malformed { .. } => WcOpcode::Send,
        }
    }

    /// Executed by the device itself, without a packet.
    pub const fn is_local(self) -> bool {
        matches!(
            self,
            SendOp::LocalInv { .. }
                | SendOp::BindMw { .. }
                | SendOp::RegMr { .. }
                | SendOp::Malformed { .. }
        )
    }

    /// True for an RDMA READ or an atomic: the requests that wait for a
    /// response and count against max_rd_atomic.
    pub const fn is_read_or_atomic(self) -> bool {
        matches!(self, SendOp::RdmaRead { .. }) || self.is_atomic()
    }

    /// True for the two atomics.
    pub const fn is_atomic(self) -> bool {
        matches!(self, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }

    /// Remote address of the operation, if it has one.
    pub const fn remote_addr(self) -> Option<u64> {
        match self {
            SendOp::RdmaWrite { remote_addr, .. }
            | SendOp::RdmaWriteWithImm { remote_addr, .. }
            | SendOp::RdmaRead { remote_addr, .. }
            | SendOp::CompareSwap { remote_addr, .. }
            | SendOp::FetchAdd { remote_addr, .. } => Some(remote_addr),
            _ => None,
        }
    }
}

/// Send WR flags (`enum ibv_send_flags`, same bits).
#[derive(Clone, Copy, Default, Eq, Hash, PartialEq)]
pub struct SendFlags(pub u32);

impl SendFlags {
    pub const FENCE: Self = Self(1 << 0);
    pub const SIGNALED: Self = Self(1 << 1);
    pub const SOLICITED: Self = Self(1 << 2);
    pub const INLINE: Self = Self(1 << 3);
    const KNOWN: u32 = 0xf;

    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    pub const fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
}

impl core::ops::BitOr for SendFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        self.with(rhs)
    }
}

impl core::fmt::Debug for SendFlags {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "SendFlags({:#x})", self.0)
    }
}

/// Where a UD send goes (`wr.ud`).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct UdDest {
    pub av: Av,
    pub remote_qpn: Qpn,
    pub remote_qkey: QKey,
}

/// The address vector of a UD send.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Av {
    /// An address handle (`ibv_create_ah`), of the QP's PD.
    Handle(crate::handle::AhHandle),
    /// The vector itself, carried in the work request (a device face's
    /// guests build their address vectors in their own memory; the face
    /// checked the PD).
    Inline(crate::qp::AhAttr),
}

/// The data of a send: gathered from memory, or carried inline (copied
/// into the WQE at post time, as a provider library does).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Payload<'a> {
    Sges(&'a [Sge]),
    Inline(&'a [u8]),
}

/// A send work request.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct SendWr<'a> {
    pub wr_id: u64,
    pub op: SendOp,
    pub payload: Payload<'a>,
    pub flags: SendFlags,
    /// UD only: the destination.
    pub ud: Option<UdDest>,
}

/// A receive work request.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct RecvWr<'a> {
    pub wr_id: u64,
    pub sg_list: &'a [Sge],
}

impl SendFlags {
    pub(crate) fn known(self) -> bool {
        self.0 & !Self::KNOWN == 0
    }
}

/// A send WQE as the device holds it.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub(crate) struct SendWqe {
    pub wr_id: u64,
    pub op: Option<SendOp>,
    pub sges: Vec<Sge>,
    pub inline: Vec<u8>,
    pub is_inline: bool,
    pub flags: SendFlags,
    pub ud: Option<UdDest>,
    /// Total bytes of the message.
    pub length: u64,
    /// Completes with a CQE when successful (signaled or `sq_sig_all`).
    pub signaled: bool,
    /// PSN of the first packet, once sent (RC and UC); the WQE takes one
    /// PSN per packet (a READ one per response packet, an atomic one).
    pub first_psn: vrdma_wire::Psn,
    /// READ: bytes of response data received so far.
    pub read_done: u64,
    /// UD: the address vector of the AH, copied at post (the AH may be
    /// destroyed before the WR is sent).
    pub av: Option<crate::qp::AhAttr>,
    /// A local operation that has run; completes when it reaches the
    /// front of the queue. Its status, if it failed.
    pub executed: bool,
    pub status: Option<crate::wc::WcStatus>,
    /// REG_MR posted with its page list (a device face whose work request
    /// carries one): mapped when the REG_MR runs, not when it is posted,
    /// so that a mapping waiting in the queue cannot change an MR still in
    /// use or one an earlier REG_MR registers.
    pub reg_pages: Option<crate::mr::Translation>,
}

impl SendWqe {
    /// The PSNs the WQE takes: one per packet (an RDMA READ one per
    /// response packet, an atomic one).
    pub(crate) fn psn_span(&self, mtu: u32) -> u32 {
        match self.op {
            Some(op) if op.is_atomic() => 1,
            // At most 2^31 bytes: fits.
            _ => self.length.div_ceil(u64::from(mtu)).max(1) as u32,
        }
    }

    /// The last PSN of a started WQE.
    pub(crate) fn last_psn(&self, mtu: u32) -> vrdma_wire::Psn {
        self.first_psn.wrapping_add(self.psn_span(mtu) - 1)
    }
}

/// A receive WQE as the device holds it.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub(crate) struct RecvWqe {
    pub wr_id: u64,
    pub sges: Vec<Sge>,
    pub length: u64,
}

/// A work queue of fixed depth whose slots are allocated up front.
#[derive(Clone, Debug)]
pub(crate) struct WorkQueue<T> {
    slots: Vec<T>,
    head: usize,
    len: usize,
}

impl<T> WorkQueue<T> {
    /// `depth` slots made by `make` (which reserves each slot's buffers).
    pub(crate) fn new(depth: u32, make: impl FnMut() -> T) -> Self {
        let mut make = make;
        WorkQueue {
            slots: (0..depth).map(|_| make()).collect(),
            head: 0,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_full(&self) -> bool {
        self.len == self.slots.len()
    }

    /// The next free slot, to be filled and then committed with
    /// [`Self::commit`]; `None` when full.
    pub(crate) fn next_free(&mut self) -> Option<&mut T> {
        if self.is_full() {
            return None;
        }
        let at = (self.head + self.len) % self.slots.len();
        self.slots.get_mut(at)
    }

    /// Makes the slot returned by `next_free` part of the queue.
    pub(crate) fn commit(&mut self) {
        if !self.is_full() {
            self.len += 1;
        }
    }

    /// The oldest entry.
    pub(crate) fn front(&self) -> Option<&T> {
        if self.len == 0 {
            None
        } else {
            self.slots.get(self.head)
        }
    }

    /// Drops the oldest entry (its slot is reused later).
    pub(crate) fn pop_front(&mut self) {
        if self.len > 0 {
            self.head = (self.head + 1) % self.slots.len();
            self.len -= 1;
        }
    }

    /// The `i`-th entry from the oldest.
    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        if i >= self.len {
            return None;
        }
        self.slots.get((self.head + i) % self.slots.len())
    }

    /// The `i`-th entry from the oldest, mutably.
    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        if i >= self.len {
            return None;
        }
        let n = self.slots.len();
        self.slots.get_mut((self.head + i) % n)
    }

    /// Drops every entry.
    pub(crate) fn clear(&mut self) {
        self.head = 0;
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_work_queue_is_a_bounded_fifo_that_reuses_its_slots() {
        let mut q = WorkQueue::new(2, || Vec::<u8>::with_capacity(4));
        for round in 0..3u8 {
            let s = q.next_free().unwrap();
            s.clear();
            s.push(round);
            q.commit();
            let s = q.next_free().unwrap();
            s.clear();
            s.push(round + 100);
            q.commit();
            assert!(q.is_full());
            assert!(q.next_free().is_none());
            assert_eq!(q.front(), Some(&vec![round]));
            q.pop_front();
            assert_eq!(q.front(), Some(&vec![round + 100]));
            q.pop_front();
            assert_eq!(q.len(), 0);
            assert_eq!(q.front(), None);
        }
    }

    #[test]
    fn opcodes_of_completions() {
        assert_eq!(SendOp::SendWithImm { imm: 1 }.wc_opcode(), WcOpcode::Send);
        assert_eq!(
            SendOp::RdmaWriteWithImm {
                remote_addr: 0,
                rkey: Rkey(1),
                imm: 0
            }
            .wc_opcode(),
            WcOpcode::RdmaWrite
        );
        assert!(
            SendOp::FetchAdd {
                remote_addr: 8,
                rkey: Rkey(1),
                add: 1
            }
            .is_atomic()
        );
    }
}
