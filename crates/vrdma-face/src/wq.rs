//! Work queues in guest memory, taken into the engine: a QP's send and
//! receive rings ([`QpQueues`]) and an SRQ's ring ([`SrqQueue`]). A face
//! says how its ABI's WQEs decode (a pure function from an entry's copy to
//! a [`SendWqe`] or a [`RecvWqe`], reading nothing else); what the device
//! does with them is the same for every face:
//!
//! - a send WQE is resolved by the core ([`resolve`]): a fast
//!   registration's MR and a bind's window by their key's index, the page
//!   list bounded before it is read, then read and checked;
//! - a WQE is taken only when the engine's queue has room for it, so the
//!   guest's ring and the engine's queue have the same depth: a full ring
//!   means WRs outstanding, as a verbs consumer expects, and the engine
//!   never refuses a WQE for room;
//! - a WQE that cannot be decoded (an opcode the QP type has no use for,
//!   too many SGEs, a bad fast-registration page list) completes in error
//!   in its turn and takes the QP to ERR, as a hardware device does with a
//!   malformed descriptor; on an SRQ, which has no QP of its own to fail,
//!   it is taken with no buffer, and the message it receives ends in a
//!   length error;
//! - a ring the guest broke (an impossible index, memory gone) stops the
//!   QP's rings — both of them — until the QP is reset, and is reported
//!   once (the face device, `crate::device`, fails the QP: the engine's
//!   `qp_fatal`).

use vm_memory::GuestMemory;
use vrdma_engine::{
    Engine, SrqHandle,
    mr::Translation,
    qp::QpState,
    wc::WcStatus,
    wr::{self, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_wire::{Lkey, Qpn};

use crate::{
    GuestError, Malformed, PageList, Refusals, WqeIdentity, guest,
    refusals::Kind,
    ring::{Consumer, Decoded, Decoder, GuestRing, Indices, Taken},
};

/// Bytes of a scatter/gather element as every device ABI lays it out
/// (`struct ibv_sge`: le64 address, le32 length, le32 lkey).
pub const SGE_SIZE: usize = 16;

/// `n` scatter/gather elements from the start of `bytes` (a WQE's copy),
/// if it holds them.
pub fn sges(bytes: &[u8], n: usize) -> Option<SgeList> {
    let need = n.checked_mul(SGE_SIZE)?;
    let bytes = bytes.get(..need)?;
    let sge = |c: &[u8]| {
        let u32_at = |o: usize| u32::from_le_bytes([c[o], c[o + 1], c[o + 2], c[o + 3]]);
        Sge {
            addr: u64::from(u32_at(0)) | u64::from(u32_at(4)) << 32,
            length: u32_at(8),
            lkey: Lkey(u32_at(12)),
        }
    };
    let mut list = SgeList::default();
    if n > FEW_SGES {
        list.many = bytes.chunks_exact(SGE_SIZE).map(sge).collect();
    } else {
        for (i, c) in bytes.chunks_exact(SGE_SIZE).enumerate() {
            list.few[i] = sge(c);
        }
        list.n = n as u8;
    }
    Some(list)
}

/// How many scatter/gather elements an [`SgeList`] holds in place.
pub const FEW_SGES: usize = 4;

/// A WQE's scatter/gather list: up to [`FEW_SGES`] elements in place — a
/// WQE's list is short, and a vector each was an allocation and a free
/// for every WQE the device takes — more in a vector. Read as a slice.
#[derive(Clone, Default)]
pub struct SgeList {
    few: [Sge; FEW_SGES],
    /// How many of `few` are the list's (0 when `many` holds it).
    n: u8,
    many: Vec<Sge>,
}

impl std::ops::Deref for SgeList {
    type Target = [Sge];

    fn deref(&self) -> &[Sge] {
        if self.many.is_empty() {
            &self.few[..usize::from(self.n)]
        } else {
            &self.many
        }
    }
}

impl From<Vec<Sge>> for SgeList {
    fn from(v: Vec<Sge>) -> Self {
        if v.len() <= FEW_SGES {
            let mut list = SgeList::default();
            list.few[..v.len()].copy_from_slice(&v);
            list.n = v.len() as u8;
            list
        } else {
            SgeList {
                many: v,
                ..SgeList::default()
            }
        }
    }
}

impl PartialEq for SgeList {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for SgeList {}

impl std::fmt::Debug for SgeList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A send WQE as a face's decoder gives it: the ABI's bytes turned into
/// typed values, nothing looked up. Keys are as the WQE names them — a
/// fast registration's MR and a bind's window by their key's index — and
/// a fast registration's page list is where the WQE says it is, still in
/// guest memory: the core resolves both for every face ([`resolve`]).
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct SendWqe {
    pub wr_id: u64,
    /// The opcode as the WQE carries it (the face's numbering), for the
    /// refusal log.
    pub opcode: u32,
    pub op: SendOp,
    pub flags: SendFlags,
    pub payload: Payload,
    pub ud: Option<UdDest>,
    /// With [`SendOp::RegMr`]: the page list to map.
    pub fast_reg: Option<FastReg>,
}

/// A send WQE's data.
#[derive(Clone, Debug, Eq, PartialEq)]
pub enum Payload {
    Sges(SgeList),
    /// The data carried in the WQE itself.
    Inline(Vec<u8>),
}

/// A fast registration's page list, still in guest memory.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct FastReg {
    pub list: ListAt,
    /// Pages the list names.
    pub npages: u32,
    /// log2 of the MR's page size (12 ..= 30 at most; a face may take
    /// fewer).
    pub page_shift: u8,
    /// The MR's first byte within its first page.
    pub offset: u64,
}

/// Where a page list is and how it is laid out.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum ListAt {
    /// An array of le64 page addresses (virtio-rdma).
    Flat(u64),
    /// A two-level page directory (PVRDMA's `pvrdma_page_dir`,
    /// [`PageList::read_directory`]).
    Directory(u64),
}

/// A send WQE resolved for the engine: keys the objects' current ones, a
/// fast registration's pages read (a copy) and checked.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct Resolved {
    pub wqe: SendWqe,
    pub pages: Option<Translation>,
}

/// Resolves decoded WQE `w` against the engine, for every face alike: a
/// REG_MR's MR and a BIND_MW's window by their key's index (the WQE names
/// the key they take, whose byte the operation changes); a REG_MR's page
/// list bounded by the device's `max_fast_reg_page_list_len` before it is
/// read, then read from `mem` (a copy) with every page aligned to the
/// MR's page size and inside guest memory. A list or page outside guest
/// memory is a protection error (virtio-rdma §7.9), anything else the
/// WQE's own error.
pub fn resolve<M: GuestMemory + ?Sized>(
    mem: &M,
    engine: &Engine,
    mut w: SendWqe,
) -> Result<Resolved, Malformed> {
    let identity = WqeIdentity {
        wr_id: w.wr_id,
        opcode: w.opcode,
    };
    let bad = |status, rule, field, value| identity.refuse(status, rule, field, value);
    match &mut w.op {
        SendOp::RegMr { mr, .. } => {
            let Some(f) = w.fast_reg else {
                return bad(WcStatus::LocQpOpErr, "a REG_MR's page list", "opcode", 0);
            };
            let Some(cur) = engine.current_lkey(mr.0 >> 8) else {
                return bad(
                    WcStatus::LocQpOpErr,
                    "a key naming a fast-registration MR",
                    "key",
                    mr.0.into(),
                );
            };
            let max = engine.query_device().max_fast_reg_page_list_len;
            if f.npages == 0 || f.npages > max {
                return bad(
                    WcStatus::LocQpOpErr,
                    "npages within max_fast_reg_page_list_len",
                    "npages",
                    f.npages.into(),
                );
            }
            if !(12..=30).contains(&f.page_shift) {
                return bad(
                    WcStatus::LocQpOpErr,
                    "a page shift of 12 to 30",
                    "page_shift",
                    f.page_shift.into(),
                );
            }
            let (read, at) = match f.list {
                ListAt::Flat(at) => (PageList::read(mem, at, f.npages as usize), at),
                ListAt::Directory(at) => {
                    (PageList::read_directory(mem, at, u64::from(f.npages)), at)
                }
            };
            let pages = match read {
                Ok(p) => p,
                Err(GuestError::Unaligned(p)) => {
                    return bad(WcStatus::LocQpOpErr, "a page-aligned page list", "page", p);
                }
                Err(_) => {
                    return bad(
                        WcStatus::LocProtErr,
                        "a page list in guest memory",
                        "page_list",
                        at,
                    );
                }
            };
            let page = 1u64 << f.page_shift;
            if let Some(&p) = pages.pages().iter().find(|p| !p.is_multiple_of(page)) {
                return bad(
                    WcStatus::LocQpOpErr,
                    "pages aligned to the page size",
                    "page",
                    p,
                );
            }
            if let Some(&p) = pages
                .pages()
                .iter()
                .find(|&&p| !guest::is_mapped(mem, p, page))
            {
                return bad(WcStatus::LocProtErr, "pages in guest memory", "page", p);
            }
            *mr = cur;
            let pages = Translation::Pages {
                page_shift: f.page_shift,
                offset: f.offset,
                pages: pages.into_pages(),
            };
            Ok(Resolved {
                wqe: w,
                pages: Some(pages),
            })
        }
        SendOp::BindMw { mw, .. } => {
            let Some(cur) = engine.current_rkey(mw.0 >> 8) else {
                return bad(
                    WcStatus::MwBindErr,
                    "a key naming a memory window",
                    "mw",
                    mw.0.into(),
                );
            };
            *mw = cur;
            Ok(Resolved {
                wqe: w,
                pages: None,
            })
        }
        _ => Ok(Resolved {
            wqe: w,
            pages: None,
        }),
    }
}

/// Where a face's malformed WQEs are noted: its refusals, its name for
/// the log, the device clock.
#[derive(Debug)]
pub struct Noting<'r> {
    pub refusals: &'r mut Refusals,
    pub face: &'static str,
    pub now: u64,
}

impl Noting<'_> {
    fn wqe(&mut self, kind: Kind, object: u32, m: &Malformed) -> (u64, WcStatus) {
        self.refusals.note_wqe(self.now, self.face, kind, object, m)
    }
}

/// A decoded receive WQE.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct RecvWqe {
    pub wr_id: u64,
    pub sges: SgeList,
}

/// A QP's rings as the device takes them.
#[derive(Clone, Debug)]
pub struct QpQueues<I> {
    qpn: Qpn,
    sq: Consumer<I>,
    /// None when the QP uses an SRQ.
    rq: Option<Consumer<I>>,
}

impl<I: Indices> QpQueues<I> {
    pub fn new(qpn: Qpn, sq: GuestRing<I>, rq: Option<GuestRing<I>>) -> Self {
        QpQueues {
            qpn,
            sq: Consumer::new(sq),
            rq: rq.map(Consumer::new),
        }
    }

    pub fn qpn(&self) -> Qpn {
        self.qpn
    }

    pub fn sq(&self) -> &Consumer<I> {
        &self.sq
    }

    pub fn rq(&self) -> Option<&Consumer<I>> {
        self.rq.as_ref()
    }

    /// Whether the guest broke one of the rings: nothing more is taken
    /// from either until [`QpQueues::reset`].
    pub fn is_broken(&self) -> bool {
        self.sq.is_broken() || self.rq.as_ref().is_some_and(Consumer::is_broken)
    }

    /// After a transition to RESET: the guest zeroes both rings; so does
    /// the device's view of them.
    pub fn reset(&mut self) {
        self.sq.reset();
        if let Some(rq) = &mut self.rq {
            rq.reset();
        }
    }

    /// Takes the send WQEs the guest posted, decoded by `decode` and
    /// resolved ([`resolve`]), as far as the engine has room, and gives
    /// their slots back; a malformed one is noted in `noting`. Nothing is
    /// taken before RTS (the WQEs wait in the ring; a driver refuses to
    /// post them anyway), nor in RESET.
    pub fn take_sends<M, F>(
        &mut self,
        mem: &M,
        engine: &mut Engine,
        noting: &mut Noting<'_>,
        decode: F,
    ) -> Taken
    where
        M: GuestMemory + ?Sized,
        F: FnMut(&[u8]) -> Result<SendWqe, Malformed>,
    {
        if self.is_broken() {
            return Taken::default();
        }
        let Ok((attr, init)) = engine.query_qp(self.qpn) else {
            return Taken::default();
        };
        if !matches!(attr.qp_state, QpState::Rts | QpState::Sqd | QpState::Err) {
            return Taken::default();
        }
        let room = room(init.cap.max_send_wr, engine.sq_len(self.qpn));
        self.sq.take(
            mem,
            &mut Sends {
                mem,
                engine,
                noting,
                qpn: self.qpn,
                room,
                decode,
            },
        )
    }

    /// Takes the receive WQEs the guest posted, decoded by `decode`, as far
    /// as the engine has room, and gives their slots back; a malformed one
    /// is noted in `noting`. Nothing is taken in RESET.
    pub fn take_recvs<M, F>(
        &mut self,
        mem: &M,
        engine: &mut Engine,
        noting: &mut Noting<'_>,
        decode: F,
    ) -> Taken
    where
        M: GuestMemory + ?Sized,
        F: FnMut(&[u8]) -> Result<RecvWqe, Malformed>,
    {
        if self.is_broken() {
            return Taken::default();
        }
        let Some(rq) = &mut self.rq else {
            return Taken::default();
        };
        let Ok((attr, init)) = engine.query_qp(self.qpn) else {
            return Taken::default();
        };
        if attr.qp_state == QpState::Reset {
            return Taken::default();
        }
        let room = room(init.cap.max_recv_wr, engine.rq_len(self.qpn));
        rq.take(
            mem,
            &mut Recvs {
                engine,
                noting,
                qpn: self.qpn,
                room,
                decode,
            },
        )
    }

    /// Gives back the slots taken (again, where writing the consumer index
    /// failed before).
    pub fn publish<M: GuestMemory + ?Sized>(&mut self, mem: &M) {
        self.sq.publish(mem);
        if let Some(rq) = &mut self.rq {
            rq.publish(mem);
        }
    }

    /// Whether the guest has posted WQEs the device has not taken.
    pub fn pending<M: GuestMemory + ?Sized>(&self, mem: &M) -> bool {
        !self.is_broken()
            && (self.sq.pending(mem) || self.rq.as_ref().is_some_and(|rq| rq.pending(mem)))
    }

    /// After a round of taking: gives back the slots taken, and says
    /// whether nothing of the QP waits any more — no WQE in the engine's
    /// queues, none posted in its rings — so that a face stops visiting it
    /// until its doorbell rings again.
    pub fn settle<M: GuestMemory + ?Sized>(&mut self, mem: &M, engine: &Engine) -> bool {
        self.publish(mem);
        engine.sq_len(self.qpn).unwrap_or(0) == 0
            && engine.rq_len(self.qpn).unwrap_or(0) == 0
            && !self.pending(mem)
    }
}

/// An SRQ's ring as the device takes it.
#[derive(Clone, Debug)]
pub struct SrqQueue<I> {
    handle: SrqHandle,
    ring: Consumer<I>,
    /// The engine's SRQ depth.
    depth: u32,
    /// A malformed WQE breaks the SRQ ([`SrqQueue::breaking_on_malformed`]).
    breaks: bool,
}

impl<I: Indices> SrqQueue<I> {
    pub fn new(handle: SrqHandle, ring: GuestRing<I>, depth: u32) -> Self {
        SrqQueue {
            handle,
            ring: Consumer::new(ring),
            depth,
            breaks: false,
        }
    }

    pub fn handle(&self) -> SrqHandle {
        self.handle
    }

    pub fn ring(&self) -> &Consumer<I> {
        &self.ring
    }

    /// A malformed WQE breaks this SRQ: it is not posted, and the ring
    /// reports itself broken (once) and is taken from no more, as a ring
    /// with an impossible index (virtio-rdma's SRQ_ERR). Without this, a
    /// malformed WQE is posted with no buffer (PVRDMA's ABI has no SRQ
    /// error event).
    pub fn breaking_on_malformed(mut self) -> Self {
        self.breaks = true;
        self
    }

    /// Takes the receive WQEs the guest posted, decoded by `decode`, as far
    /// as the engine's SRQ has room, and gives their slots back; a
    /// malformed one is noted in `noting`.
    pub fn take<M, F>(
        &mut self,
        mem: &M,
        engine: &mut Engine,
        noting: &mut Noting<'_>,
        decode: F,
    ) -> Taken
    where
        M: GuestMemory + ?Sized,
        F: FnMut(&[u8]) -> Result<RecvWqe, Malformed>,
    {
        let room = room(self.depth, engine.srq_len(self.handle));
        let mut recvs = SrqRecvs {
            engine,
            noting,
            srq: self.handle,
            room,
            decode,
            breaks: self.breaks,
            broke: false,
        };
        let mut t = self.ring.take(mem, &mut recvs);
        if recvs.broke {
            t.broken |= self.ring.fail();
        }
        t
    }

    /// Gives back the slots taken (again, where that failed before).
    pub fn publish<M: GuestMemory + ?Sized>(&mut self, mem: &M) {
        self.ring.publish(mem);
    }

    /// Whether the guest has posted WQEs the device has not taken.
    pub fn pending<M: GuestMemory + ?Sized>(&self, mem: &M) -> bool {
        self.ring.pending(mem)
    }

    /// As [`QpQueues::settle`]: the slots given back; whether nothing of
    /// the SRQ waits in the engine or its ring.
    pub fn settle<M: GuestMemory + ?Sized>(&mut self, mem: &M, engine: &Engine) -> bool {
        self.publish(mem);
        engine.srq_len(self.handle).unwrap_or(0) == 0 && !self.pending(mem)
    }
}

/// What a queue `depth` deep holding `len` (the engine's count, asked once
/// per take) has room for: each WQE taken counts against it.
fn room(depth: u32, len: Option<u32>) -> u32 {
    len.map_or(0, |l| depth.saturating_sub(l))
}

/// Send WQEs into a QP's send queue.
struct Sends<'a, 'r, M: ?Sized, F> {
    mem: &'a M,
    engine: &'a mut Engine,
    noting: &'a mut Noting<'r>,
    qpn: Qpn,
    room: u32,
    decode: F,
}

impl<M, F> Decoder for Sends<'_, '_, M, F>
where
    M: GuestMemory + ?Sized,
    F: FnMut(&[u8]) -> Result<SendWqe, Malformed>,
{
    fn room(&mut self) -> bool {
        self.room > 0
    }

    fn decode(&mut self, entry: &[u8]) -> Decoded {
        self.room -= 1;
        let resolved = (self.decode)(entry)
            .and_then(|w| resolve(self.mem, self.engine, w))
            .map_err(|m| self.noting.wqe(Kind::SendWqe, self.qpn.value(), &m));
        let posted = resolved.and_then(|Resolved { wqe: w, pages }| {
            let wr = SendWr {
                wr_id: w.wr_id,
                op: w.op,
                payload: match &w.payload {
                    Payload::Inline(data) => wr::Payload::Inline(data),
                    Payload::Sges(sges) => wr::Payload::Sges(sges),
                },
                flags: w.flags,
                ud: w.ud,
            };
            match pages {
                // The page list goes with the REG_MR and is mapped when it
                // runs, in its turn (a list the MR cannot take fails the
                // REG_MR itself).
                Some(pages) => self.engine.post_reg_mr(self.qpn, &wr, pages),
                None => self.engine.post_send(self.qpn, &wr),
            }
            .map_err(|_| (w.wr_id, WcStatus::LocQpOpErr))
        });
        let Err((wr_id, status)) = posted else {
            return Decoded::Taken;
        };
        // In its turn: completes in error, takes the QP to ERR.
        let _ = self.engine.post_send(
            self.qpn,
            &SendWr {
                wr_id,
                op: SendOp::Malformed { status },
                payload: wr::Payload::Sges(&[]),
                flags: SendFlags::SIGNALED,
                ud: None,
            },
        );
        Decoded::Malformed
    }
}

/// Receive WQEs into a QP's receive queue.
struct Recvs<'a, 'r, F> {
    engine: &'a mut Engine,
    noting: &'a mut Noting<'r>,
    qpn: Qpn,
    room: u32,
    decode: F,
}

impl<F: FnMut(&[u8]) -> Result<RecvWqe, Malformed>> Decoder for Recvs<'_, '_, F> {
    fn room(&mut self) -> bool {
        self.room > 0
    }

    fn decode(&mut self, entry: &[u8]) -> Decoded {
        self.room -= 1;
        match (self.decode)(entry) {
            Ok(w) => {
                let wr = RecvWr {
                    wr_id: w.wr_id,
                    sg_list: &w.sges,
                };
                let _ = self.engine.post_recv(self.qpn, &wr);
                Decoded::Taken
            }
            Err(m) => {
                let (wr_id, _) = self.noting.wqe(Kind::RecvWqe, self.qpn.value(), &m);
                // The QP fails, and this WQE is flushed with the others;
                // once: a QP already in ERR flushes it with no new event
                // (a guest writing malformed WQEs raises one QP_FATAL,
                // not one per WQE).
                let failed = self
                    .engine
                    .query_qp(self.qpn)
                    .is_ok_and(|(a, _)| a.qp_state == QpState::Err);
                if !failed {
                    let _ = self.engine.qp_fatal(self.qpn);
                }
                let wr = RecvWr {
                    wr_id,
                    sg_list: &[],
                };
                let _ = self.engine.post_recv(self.qpn, &wr);
                Decoded::Malformed
            }
        }
    }
}

/// Receive WQEs into an SRQ.
struct SrqRecvs<'a, 'r, F> {
    engine: &'a mut Engine,
    noting: &'a mut Noting<'r>,
    srq: SrqHandle,
    room: u32,
    decode: F,
    /// What a malformed WQE does: breaks the SRQ (true), or is taken with
    /// no buffer (false).
    breaks: bool,
    /// A malformed WQE broke the SRQ in this turn.
    broke: bool,
}

impl<F: FnMut(&[u8]) -> Result<RecvWqe, Malformed>> Decoder for SrqRecvs<'_, '_, F> {
    fn room(&mut self) -> bool {
        !self.broke && self.room > 0
    }

    fn decode(&mut self, entry: &[u8]) -> Decoded {
        self.room -= 1;
        // A malformed WQE either breaks the SRQ (nothing of it posted,
        // nothing more taken), or is taken with no buffer: the message it
        // receives ends in a local length error on its wr_id.
        let (w, decoded) = match (self.decode)(entry) {
            Ok(w) => (w, Decoded::Taken),
            Err(m) => {
                let (wr_id, _) = self.noting.wqe(Kind::RecvWqe, self.srq.0, &m);
                if self.breaks {
                    self.broke = true;
                    return Decoded::Malformed;
                }
                (
                    RecvWqe {
                        wr_id,
                        sges: SgeList::default(),
                    },
                    Decoded::Malformed,
                )
            }
        };
        let wr = RecvWr {
            wr_id: w.wr_id,
            sg_list: &w.sges,
        };
        let _ = self.engine.post_srq_recv(self.srq, &wr);
        decoded
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
    use vrdma_engine::{objects::SrqAttr, qp::QpState};
    use vrdma_testkit::setup::{Connection, EngineSpec, gid};

    use super::*;
    use crate::{pages::PageList, ring::WrapBit};

    const BASE: u64 = 0x10_0000;

    #[test]
    fn an_sge_list_is_the_wqes_elements_in_place_or_not() {
        let mut bytes = Vec::new();
        for i in 0..9u64 {
            bytes.extend_from_slice(&(0x1000 * i + 7).to_le_bytes());
            bytes.extend_from_slice(&(64 + i as u32).to_le_bytes());
            bytes.extend_from_slice(&(0x100 + i as u32).to_le_bytes());
        }
        for n in 0..=9 {
            let list = sges(&bytes, n).unwrap();
            assert_eq!(list.len(), n);
            for (i, s) in list.iter().enumerate() {
                let i = i as u64;
                assert_eq!(
                    (s.addr, s.length, s.lkey),
                    (0x1000 * i + 7, 64 + i as u32, Lkey(0x100 + i as u32))
                );
            }
            // The same list however it was made.
            assert_eq!(SgeList::from(list.to_vec()), list);
        }
        // Not held by the copy: nothing.
        assert!(sges(&bytes, 10).is_none());
        assert!(sges(&bytes[..15], 1).is_none());
        assert_eq!(SgeList::default().len(), 0);
    }
    /// The send ring's indices, then the receive ring's.
    const SQ: u64 = BASE;
    const RQ: u64 = BASE + 8;

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(BASE), 0x4000)]).unwrap()
    }

    /// A ring of `n` 16-byte entries with its indices at `at`, on its own
    /// page.
    fn ring(n: u32, at: u64, page: u64) -> GuestRing<WrapBit> {
        GuestRing::new(
            WrapBit::new(n).unwrap(),
            16,
            at,
            at + 4,
            PageList::new(vec![page]).unwrap(),
        )
        .unwrap()
    }

    /// The guest posts entries holding `wr_ids` (0xbad: malformed).
    fn post(m: &GuestMemoryMmap<()>, r: &GuestRing<WrapBit>, at: u64, wr_ids: &[u64]) {
        let mut prod: u32 = m.read_obj(GuestAddress(at)).unwrap();
        for &w in wr_ids {
            m.write_obj(w, GuestAddress(r.entry_addr(prod))).unwrap();
            prod = r.indices().next(prod);
        }
        m.write_obj(prod, GuestAddress(at)).unwrap();
    }

    fn wr_id(entry: &[u8]) -> u64 {
        u64::from_le_bytes(entry[..8].try_into().unwrap())
    }

    fn malformed(wr_id: u64) -> Malformed {
        Malformed {
            wr_id,
            status: WcStatus::LocQpOpErr,
            opcode: 0,
            rule: "a test's malformed WQE",
            field: "wr_id",
            value: wr_id,
        }
    }

    fn send(entry: &[u8]) -> Result<SendWqe, Malformed> {
        match wr_id(entry) {
            0xbad => Err(malformed(0xbad)),
            wr_id => Ok(SendWqe {
                wr_id,
                opcode: 0,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                payload: Payload::Sges(SgeList::default()),
                ud: None,
                fast_reg: None,
            }),
        }
    }

    fn recv(entry: &[u8]) -> Result<RecvWqe, Malformed> {
        match wr_id(entry) {
            0xbad => Err(malformed(0xbad)),
            wr_id => Ok(RecvWqe {
                wr_id,
                sges: SgeList::default(),
            }),
        }
    }

    fn note(refusals: &mut Refusals) -> Noting<'_> {
        Noting {
            refusals,
            face: "test",
            now: 0,
        }
    }

    /// An RC QP 4 deep and its rings (8 slots each: more than the
    /// engine's queues hold).
    fn qp() -> (Engine, QpQueues<WrapBit>, GuestMemoryMmap<()>) {
        let (e, _, ids) = EngineSpec::new(1).depth(4).build();
        let q = QpQueues::new(
            ids.qpn,
            ring(8, SQ, BASE + 0x1000),
            Some(ring(8, RQ, BASE + 0x2000)),
        );
        (e, q, mem())
    }

    fn rts(e: &mut Engine, q: &QpQueues<WrapBit>) {
        Connection::default().join(e, q.qpn(), gid(2), Qpn::from_masked(17));
    }

    #[test]
    fn sends_wait_for_rts_and_are_taken_as_far_as_the_engine_has_room() {
        let mut r = Refusals::default();
        let (mut e, mut q, m) = qp();
        let sq = q.sq().ring().clone();
        post(&m, &sq, SQ, &[1, 2, 3, 4, 5, 6]);
        assert_eq!(
            q.take_sends(&m, &mut e, &mut note(&mut r), send),
            Taken::default(),
            "RESET"
        );
        assert!(q.pending(&m));
        rts(&mut e, &q);
        let t = q.take_sends(&m, &mut e, &mut note(&mut r), send);
        assert_eq!((t.entries, t.malformed, t.broken), (4, 0, false));
        assert_eq!(e.sq_len(q.qpn()), Some(4));
        assert_eq!(
            m.read_obj::<u32>(GuestAddress(SQ + 4)).unwrap(),
            4,
            "given back"
        );
        assert!(q.pending(&m), "two wait for room");
    }

    #[test]
    fn a_malformed_receive_fails_its_qp_and_a_malformed_send_is_counted() {
        let mut r = Refusals::default();
        let (mut e, mut q, m) = qp();
        rts(&mut e, &q);
        let rq = q.rq().unwrap().ring().clone();
        post(&m, &rq, RQ, &[1, 0xbad, 3]);
        let t = q.take_recvs(&m, &mut e, &mut note(&mut r), recv);
        assert_eq!((t.entries, t.malformed), (3, 1));
        assert_eq!(e.query_qp(q.qpn()).unwrap().0.qp_state, QpState::Err);
        let sq = q.sq().ring().clone();
        post(&m, &sq, SQ, &[0xbad]);
        let t = q.take_sends(&m, &mut e, &mut note(&mut r), send);
        assert_eq!(
            (t.entries, t.malformed),
            (1, 1),
            "taken in ERR, to complete in its turn"
        );
    }

    #[test]
    fn a_broken_ring_stops_both_of_its_qps_rings_until_reset() {
        let mut r = Refusals::default();
        let (mut e, mut q, m) = qp();
        rts(&mut e, &q);
        let rq = q.rq().unwrap().ring().clone();
        post(&m, &rq, RQ, &[1]);
        m.write_obj(0xdead_beefu32, GuestAddress(SQ)).unwrap();
        assert!(q.take_sends(&m, &mut e, &mut note(&mut r), send).broken);
        assert!(q.is_broken());
        assert!(!q.pending(&m));
        assert_eq!(
            q.take_recvs(&m, &mut e, &mut note(&mut r), recv),
            Taken::default()
        );
        assert_eq!(
            q.take_sends(&m, &mut e, &mut note(&mut r), send),
            Taken::default(),
            "once"
        );
        q.reset();
        m.write_obj(0u32, GuestAddress(SQ)).unwrap();
        assert!(!q.is_broken());
        assert_eq!(q.take_recvs(&m, &mut e, &mut note(&mut r), recv).entries, 1);
    }

    #[test]
    fn an_srq_is_taken_as_far_as_it_has_room_and_a_malformed_wqe_has_no_buffer() {
        let mut r = Refusals::default();
        let (mut e, _, ids) = EngineSpec::new(1).build();
        let attr = SrqAttr {
            max_wr: 4,
            max_sge: 1,
            srq_limit: 0,
        };
        let (srq, granted) = e.create_srq(ids.pd, attr).unwrap();
        let m = mem();
        let rq = ring(8, RQ, BASE + 0x2000);
        let mut s = SrqQueue::new(srq, rq.clone(), granted.max_wr);
        post(&m, &rq, RQ, &[1, 0xbad, 3, 4, 5]);
        let t = s.take(&m, &mut e, &mut note(&mut r), recv);
        assert_eq!((t.entries, t.malformed), (4, 1));
        assert_eq!(e.srq_len(srq), Some(4));
        assert!(s.pending(&m));
        assert_eq!(s.handle(), srq);
        assert_eq!(
            r.fields(),
            [("refused.recv_wqe.a_test_s_malformed_wqe".to_owned(), 1)],
            "noted by the core, on the SRQ"
        );
    }

    /// A REG_MR whose page list is `list`, of `npages` pages, naming MR
    /// `key`.
    fn reg_mr(key: u32, list: ListAt, npages: u32, page_shift: u8) -> SendWqe {
        SendWqe {
            wr_id: 7,
            opcode: 0x20,
            op: SendOp::RegMr {
                mr: Lkey(key),
                key: key as u8,
                iova: 0x1_0000_0100,
                length: 4096,
                access: vrdma_engine::mr::Access(0),
            },
            flags: SendFlags::SIGNALED,
            payload: Payload::Sges(SgeList::default()),
            ud: None,
            fast_reg: Some(FastReg {
                list,
                npages,
                page_shift,
                offset: 0x100,
            }),
        }
    }

    #[test]
    fn the_core_resolves_a_fast_registration_for_every_face() {
        use vm_memory::Bytes;
        let (mut e, _, ids) = EngineSpec::new(1).build();
        let lkey = e.alloc_mr(ids.pd, 8).unwrap();
        let m = mem();
        // A flat list of two pages, and a directory naming the same two.
        let (flat, dir, table) = (BASE, BASE + 0x1000, BASE + 0x2000);
        for (i, p) in [BASE + 0x3000, BASE + 0x2000].iter().enumerate() {
            m.write_obj(p.to_le(), GuestAddress(flat + 8 * i as u64))
                .unwrap();
            m.write_obj(p.to_le(), GuestAddress(table + 8 * i as u64))
                .unwrap();
        }
        m.write_obj(table.to_le(), GuestAddress(dir)).unwrap();
        // The WQE names the key the MR is to take: same index, a new byte.
        let next = (lkey.0 & !0xff) | ((lkey.0 + 1) & 0xff);
        for list in [ListAt::Flat(flat), ListAt::Directory(dir)] {
            let r = resolve(&m, &e, reg_mr(next, list, 2, 12)).unwrap();
            assert!(
                matches!(r.wqe.op, SendOp::RegMr { mr, key, .. } if mr == lkey && key == next as u8),
                "the MR by its index, its current key: {:?}",
                r.wqe.op
            );
            assert_eq!(
                r.pages,
                Some(Translation::Pages {
                    page_shift: 12,
                    offset: 0x100,
                    pages: vec![BASE + 0x3000, BASE + 0x2000],
                })
            );
        }
        let why = |w| resolve(&m, &e, w).map(|_| ()).unwrap_err();
        let max = e.query_device().max_fast_reg_page_list_len;
        // Bounded before it is read: a list this long is never copied.
        let m1 = why(reg_mr(next, ListAt::Flat(flat), max + 1, 12));
        assert_eq!((m1.status, m1.field), (WcStatus::LocQpOpErr, "npages"));
        let m2 = why(reg_mr(0xff00_0000, ListAt::Flat(flat), 2, 12));
        assert_eq!((m2.status, m2.field), (WcStatus::LocQpOpErr, "key"));
        assert_eq!(m2.opcode, 0x20, "the face's opcode, for the log");
        let m3 = why(reg_mr(next, ListAt::Flat(0x10), 2, 12));
        assert_eq!((m3.status, m3.field), (WcStatus::LocProtErr, "page_list"));
        // Pages of 8 KiB: the list's second page is not aligned to one.
        let m4 = why(reg_mr(next, ListAt::Flat(flat), 2, 13));
        assert_eq!((m4.status, m4.value), (WcStatus::LocQpOpErr, BASE + 0x3000));
        // A page past guest memory.
        m.write_obj((BASE + 0x10_0000).to_le(), GuestAddress(flat + 8))
            .unwrap();
        let m5 = why(reg_mr(next, ListAt::Flat(flat), 2, 12));
        assert_eq!(
            (m5.status, m5.value),
            (WcStatus::LocProtErr, BASE + 0x10_0000)
        );
    }

    #[test]
    fn room_is_asked_once_per_take_and_counted_down() {
        let mut r = Refusals::default();
        let (mut e, mut q, m) = qp();
        rts(&mut e, &q);
        let sq = q.sq().ring().clone();
        post(&m, &sq, SQ, &[1, 2]);
        assert_eq!(q.take_sends(&m, &mut e, &mut note(&mut r), send).entries, 2);
        // Two in the engine, room for two more: of five posted, two go.
        post(&m, &sq, SQ, &[3, 0xbad, 5, 6, 7]);
        let t = q.take_sends(&m, &mut e, &mut note(&mut r), send);
        assert_eq!(
            (t.entries, t.malformed),
            (2, 1),
            "a malformed WQE takes room too"
        );
        assert_eq!(e.sq_len(q.qpn()), Some(4));
    }
}
