//! Work queues in guest memory, taken into the engine: a QP's send and
//! receive rings ([`QpQueues`]) and an SRQ's ring ([`SrqQueue`]). A face
//! says how its ABI's WQEs decode (a closure from an entry's copy to a
//! [`SendWqe`] or a [`RecvWqe`]); what the device does with them is the
//! same for every face:
//!
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
//!   once (the caller fails the QP: the engine's `qp_fatal`).

use vm_memory::GuestMemory;
use vrdma_engine::{
    Engine, SrqHandle,
    mr::Translation,
    qp::QpState,
    wc::WcStatus,
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_wire::{Lkey, Qpn};

use crate::ring::{Consumer, Decoded, Decoder, GuestRing, Indices, Taken};

/// Bytes of a scatter/gather element as every device ABI lays it out
/// (`struct ibv_sge`: le64 address, le32 length, le32 lkey).
pub const SGE_SIZE: usize = 16;

/// `n` scatter/gather elements from the start of `bytes` (a WQE's copy),
/// if it holds them.
pub fn sges(bytes: &[u8], n: usize) -> Option<Vec<Sge>> {
    let need = n.checked_mul(SGE_SIZE)?;
    let bytes = bytes.get(..need)?;
    Some(
        bytes
            .chunks_exact(SGE_SIZE)
            .map(|c| {
                let u32_at = |o: usize| u32::from_le_bytes([c[o], c[o + 1], c[o + 2], c[o + 3]]);
                Sge {
                    addr: u64::from(u32_at(0)) | u64::from(u32_at(4)) << 32,
                    length: u32_at(8),
                    lkey: Lkey(u32_at(12)),
                }
            })
            .collect(),
    )
}

/// A decoded send WQE, ready for the engine.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct SendWqe {
    pub wr_id: u64,
    pub op: SendOp,
    pub flags: SendFlags,
    pub sges: Vec<Sge>,
    /// The WQE's data carried in the WQE itself (`sges` is then empty).
    pub inline: Option<Vec<u8>>,
    pub ud: Option<UdDest>,
    /// A fast registration's page list, for the MR before it runs.
    pub fast_reg: Option<(Lkey, Translation)>,
}

/// A decoded receive WQE.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct RecvWqe {
    pub wr_id: u64,
    pub sges: Vec<Sge>,
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

    /// Takes the send WQEs the guest posted, decoded by `decode`, as far
    /// as the engine has room, and gives their slots back. Nothing is
    /// taken before RTS (the WQEs wait in the ring; a driver refuses to
    /// post them anyway), nor in RESET.
    pub fn take_sends<M, F>(&mut self, mem: &M, engine: &mut Engine, decode: F) -> Taken
    where
        M: GuestMemory + ?Sized,
        F: FnMut(&[u8], &Engine) -> Result<SendWqe, (u64, WcStatus)>,
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
        let depth = init.cap.max_send_wr;
        self.sq.take(
            mem,
            &mut Sends {
                engine,
                qpn: self.qpn,
                depth,
                decode,
            },
        )
    }

    /// Takes the receive WQEs the guest posted, decoded by `decode` (a
    /// malformed one: `Err(wr_id)`), as far as the engine has room, and
    /// gives their slots back. Nothing is taken in RESET.
    pub fn take_recvs<M, F>(&mut self, mem: &M, engine: &mut Engine, decode: F) -> Taken
    where
        M: GuestMemory + ?Sized,
        F: FnMut(&[u8]) -> Result<RecvWqe, u64>,
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
        let depth = init.cap.max_recv_wr;
        rq.take(
            mem,
            &mut Recvs {
                engine,
                qpn: self.qpn,
                depth,
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

    /// Takes the receive WQEs the guest posted, decoded by `decode` (a
    /// malformed one: `Err(wr_id)`), as far as the engine's SRQ has room,
    /// and gives their slots back.
    pub fn take<M, F>(&mut self, mem: &M, engine: &mut Engine, decode: F) -> Taken
    where
        M: GuestMemory + ?Sized,
        F: FnMut(&[u8]) -> Result<RecvWqe, u64>,
    {
        let mut recvs = SrqRecvs {
            engine,
            srq: self.handle,
            depth: self.depth,
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

/// Send WQEs into a QP's send queue.
struct Sends<'e, F> {
    engine: &'e mut Engine,
    qpn: Qpn,
    depth: u32,
    decode: F,
}

impl<F> Decoder for Sends<'_, F>
where
    F: FnMut(&[u8], &Engine) -> Result<SendWqe, (u64, WcStatus)>,
{
    fn room(&mut self) -> bool {
        self.engine.sq_len(self.qpn).unwrap_or(u32::MAX) < self.depth
    }

    fn decode(&mut self, entry: &[u8]) -> Decoded {
        let posted = (self.decode)(entry, self.engine).and_then(|w| {
            let wr = SendWr {
                wr_id: w.wr_id,
                op: w.op,
                payload: match &w.inline {
                    Some(data) => Payload::Inline(data),
                    None => Payload::Sges(&w.sges),
                },
                flags: w.flags,
                ud: w.ud,
            };
            match w.fast_reg {
                // The page list goes with the REG_MR and is mapped when it
                // runs, in its turn (a list the MR cannot take fails the
                // REG_MR itself).
                Some((_, pages)) => self.engine.post_reg_mr(self.qpn, &wr, pages),
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
                payload: Payload::Sges(&[]),
                flags: SendFlags::SIGNALED,
                ud: None,
            },
        );
        Decoded::Malformed
    }
}

/// Receive WQEs into a QP's receive queue.
struct Recvs<'e, F> {
    engine: &'e mut Engine,
    qpn: Qpn,
    depth: u32,
    decode: F,
}

impl<F: FnMut(&[u8]) -> Result<RecvWqe, u64>> Decoder for Recvs<'_, F> {
    fn room(&mut self) -> bool {
        self.engine.rq_len(self.qpn).unwrap_or(u32::MAX) < self.depth
    }

    fn decode(&mut self, entry: &[u8]) -> Decoded {
        match (self.decode)(entry) {
            Ok(w) => {
                let wr = RecvWr {
                    wr_id: w.wr_id,
                    sg_list: &w.sges,
                };
                let _ = self.engine.post_recv(self.qpn, &wr);
                Decoded::Taken
            }
            Err(wr_id) => {
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
struct SrqRecvs<'e, F> {
    engine: &'e mut Engine,
    srq: SrqHandle,
    depth: u32,
    decode: F,
    /// What a malformed WQE does: breaks the SRQ (true), or is taken with
    /// no buffer (false).
    breaks: bool,
    /// A malformed WQE broke the SRQ in this turn.
    broke: bool,
}

impl<F: FnMut(&[u8]) -> Result<RecvWqe, u64>> Decoder for SrqRecvs<'_, F> {
    fn room(&mut self) -> bool {
        !self.broke && self.engine.srq_len(self.srq).unwrap_or(u32::MAX) < self.depth
    }

    fn decode(&mut self, entry: &[u8]) -> Decoded {
        // A malformed WQE either breaks the SRQ (nothing of it posted,
        // nothing more taken), or is taken with no buffer: the message it
        // receives ends in a local length error on its wr_id.
        let (w, decoded) = match (self.decode)(entry) {
            Ok(w) => (w, Decoded::Taken),
            Err(_) if self.breaks => {
                self.broke = true;
                return Decoded::Malformed;
            }
            Err(wr_id) => (
                RecvWqe {
                    wr_id,
                    sges: Vec::new(),
                },
                Decoded::Malformed,
            ),
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
    use vrdma_testkit::setup::{Connection, Side, gid};

    use super::*;
    use crate::{pages::PageList, ring::WrapBit};

    const BASE: u64 = 0x10_0000;
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

    fn send(entry: &[u8], _: &Engine) -> Result<SendWqe, (u64, WcStatus)> {
        match wr_id(entry) {
            0xbad => Err((0xbad, WcStatus::LocQpOpErr)),
            wr_id => Ok(SendWqe {
                wr_id,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sges: Vec::new(),
                inline: None,
                ud: None,
                fast_reg: None,
            }),
        }
    }

    fn recv(entry: &[u8]) -> Result<RecvWqe, u64> {
        match wr_id(entry) {
            0xbad => Err(0xbad),
            wr_id => Ok(RecvWqe {
                wr_id,
                sges: Vec::new(),
            }),
        }
    }

    /// An RC QP 4 deep and its rings (8 slots each: more than the
    /// engine's queues hold).
    fn qp() -> (Engine, QpQueues<WrapBit>, GuestMemoryMmap<()>) {
        let (e, _, ids) = Side::new(1).depth(4).build();
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
        let (mut e, mut q, m) = qp();
        let sq = q.sq().ring().clone();
        post(&m, &sq, SQ, &[1, 2, 3, 4, 5, 6]);
        assert_eq!(q.take_sends(&m, &mut e, send), Taken::default(), "RESET");
        assert!(q.pending(&m));
        rts(&mut e, &q);
        let t = q.take_sends(&m, &mut e, send);
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
        let (mut e, mut q, m) = qp();
        rts(&mut e, &q);
        let rq = q.rq().unwrap().ring().clone();
        post(&m, &rq, RQ, &[1, 0xbad, 3]);
        let t = q.take_recvs(&m, &mut e, recv);
        assert_eq!((t.entries, t.malformed), (3, 1));
        assert_eq!(e.query_qp(q.qpn()).unwrap().0.qp_state, QpState::Err);
        let sq = q.sq().ring().clone();
        post(&m, &sq, SQ, &[0xbad]);
        let t = q.take_sends(&m, &mut e, send);
        assert_eq!(
            (t.entries, t.malformed),
            (1, 1),
            "taken in ERR, to complete in its turn"
        );
    }

    #[test]
    fn a_broken_ring_stops_both_of_its_qps_rings_until_reset() {
        let (mut e, mut q, m) = qp();
        rts(&mut e, &q);
        let rq = q.rq().unwrap().ring().clone();
        post(&m, &rq, RQ, &[1]);
        m.write_obj(0xdead_beefu32, GuestAddress(SQ)).unwrap();
        assert!(q.take_sends(&m, &mut e, send).broken);
        assert!(q.is_broken());
        assert!(!q.pending(&m));
        assert_eq!(q.take_recvs(&m, &mut e, recv), Taken::default());
        assert_eq!(q.take_sends(&m, &mut e, send), Taken::default(), "once");
        q.reset();
        m.write_obj(0u32, GuestAddress(SQ)).unwrap();
        assert!(!q.is_broken());
        assert_eq!(q.take_recvs(&m, &mut e, recv).entries, 1);
    }

    #[test]
    fn an_srq_is_taken_as_far_as_it_has_room_and_a_malformed_wqe_has_no_buffer() {
        let (mut e, _, ids) = Side::new(1).build();
        let attr = SrqAttr {
            max_wr: 4,
            max_sge: 1,
            srq_limit: 0,
        };
        let (srq, granted) = e.create_srq(ids.pd, attr).unwrap();
        let m = mem();
        let r = ring(8, RQ, BASE + 0x2000);
        let mut s = SrqQueue::new(srq, r.clone(), granted.max_wr);
        post(&m, &r, RQ, &[1, 0xbad, 3, 4, 5]);
        let t = s.take(&m, &mut e, recv);
        assert_eq!((t.entries, t.malformed), (4, 1));
        assert_eq!(e.srq_len(srq), Some(4));
        assert!(s.pending(&m));
        assert_eq!(s.handle(), srq);
    }
}
