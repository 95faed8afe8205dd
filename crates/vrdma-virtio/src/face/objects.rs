//! The objects with rings: CQs, SRQs and QPs made, resized and destroyed —
//! their rings and headers in guest memory checked and claimed, their
//! doorbells given out.

use std::sync::atomic::Ordering;

use vm_memory::{GuestAddress, GuestMemoryBackend};
use vrdma_device::Transport;
use vrdma_engine::{
    CqHandle, PdHandle, SrqHandle, errno,
    objects::SrqAttr,
    qp::{QpCap, QpInitAttr},
};
use vrdma_face::{
    GuestRing, Owner, PageList, Refused,
    ring::{FreeRunning, Indices},
    status::OrRefuse,
    wq::{QpQueues, SrqQueue},
};
use vrdma_wire::Qpn;
use zerocopy::{FromZeros, IntoBytes};

use super::{
    sink::Sink,
    state::{CqFace, Obj, QpFace, SrqFace, VirtioRdma},
};
use crate::{
    abi::{self, cq_header, event as ev, wq_header},
    decode::{CreateQp, RingSpec, SendShape, fault, noent},
};

impl<T: Transport> VirtioRdma<T> {
    /// Whether `len` bytes at `addr` are guest memory.
    pub(super) fn in_memory(&self, addr: u64, len: usize) -> bool {
        // One region holds it (regions are page-aligned: a page or a
        // ring header is in one or in none).
        self.dev
            .device
            .mem()
            .map()
            .get_slice(GuestAddress(addr), len)
            .is_ok()
    }

    /// A work queue's ring (its header's producer and consumer words).
    pub(super) fn guest_ring(&self, r: &RingSpec) -> Result<GuestRing<FreeRunning>, Refused> {
        self.ring_at(r, wq_header::PRODUCER, wq_header::CONSUMER)
    }

    /// A ring whose header and pages are guest memory, for the face core,
    /// its index words at `prod` and `cons` in its header.
    pub(super) fn ring_at(
        &self,
        r: &RingSpec,
        prod: u64,
        cons: u64,
    ) -> Result<GuestRing<FreeRunning>, Refused> {
        if !self.in_memory(r.header, abi::RING_HEADER_SIZE as usize) {
            return Err(fault("ring header outside guest memory"));
        }
        if r.pages
            .iter()
            .any(|&p| !self.in_memory(p, abi::PAGE_SIZE as usize))
        {
            return Err(fault("ring page outside guest memory"));
        }
        let indices = FreeRunning::new(r.entries).ok_or(Refused::invalid("ring entries"))?;
        let pages = PageList::new(r.pages.clone()).or_refuse("ring pages")?;
        GuestRing::new(
            indices,
            u64::from(r.stride),
            r.header + prod,
            r.header + cons,
            pages,
        )
        .ok_or(Refused::invalid("ring shape"))
    }

    pub(super) fn take_doorbell(&mut self, ctx: u32, obj: Obj) -> Result<u32, Refused> {
        let c = self.contexts.get_mut(&ctx).ok_or(noent("context"))?;
        let i = c.indices.take().ok_or(Refused::new(
            errno::ENOMEM.unsigned_abs(),
            "doorbells of the context",
        ))?;
        c.doorbells.insert(i, obj);
        Ok(i)
    }

    pub(super) fn free_doorbell(&mut self, ctx: u32, i: u32) {
        if let Some(c) = self.contexts.get_mut(&ctx) {
            c.indices.give(i);
            c.doorbells.remove(&i);
        }
    }

    /// A CQ's ring (the device produces, the driver consumes).
    pub(super) fn cq_ring(&self, r: &RingSpec) -> Result<GuestRing<FreeRunning>, Refused> {
        self.ring_at(r, cq_header::PRODUCER, cq_header::CONSUMER)
    }

    pub(super) fn create_cq(&mut self, ctx: u32, r: RingSpec) -> Result<Vec<u8>, Refused> {
        let ring = self.cq_ring(&r)?;
        self.dev.claims.check(&r.pages, &[r.header], None)?;
        let tail = ring
            .prod(self.dev.device.mem().map())
            .or_refuse("CQ header")?;
        let (sink, track) = Sink::new(self.dev.shared.clone(), ring.clone(), tail)?;
        let doorbell = self.take_doorbell(ctx, Obj::Cq(0))?;
        let made = self
            .dev
            .device
            .engine_mut()
            .create_cq_with_sink(r.entries, 0, Box::new(sink));
        let (cq, entries) = match made {
            Ok(v) => v,
            Err(e) => {
                self.free_doorbell(ctx, doorbell);
                return Err(Refused::verbs(&e, "CQ"));
            }
        };
        if let Some(c) = self.contexts.get_mut(&ctx) {
            c.doorbells.insert(doorbell, Obj::Cq(cq.0));
        }
        let arm = self
            .dev
            .device
            .mem()
            .load_u64(r.header + cq_header::ARM)
            .unwrap_or(0);
        self.dev
            .claims
            .claim(Owner::Cq(cq.0), &r.pages, &[r.header]);
        self.cqs.insert(
            cq.0,
            CqFace {
                context: ctx,
                doorbell,
                ring,
                header: r.header,
                arm_seq: arm >> 34,
                track,
                in_error: false,
            },
        );
        Ok(abi::CreateCqResp {
            cq: cq.0.into(),
            entries: entries.into(),
            doorbell: doorbell.into(),
            reserved: 0.into(),
        }
        .as_bytes()
        .to_vec())
    }

    /// A CQ's completions move to a new ring: those the driver has not
    /// consumed are copied to its first slots.
    pub(super) fn resize_cq(&mut self, ctx: u32, cq: u32, r: RingSpec) -> Result<Vec<u8>, Refused> {
        self.cq_of(ctx, cq)?;
        let new = self.cq_ring(&r)?;
        self.dev
            .claims
            .check(&r.pages, &[r.header], Some(Owner::Cq(cq)))?;
        let mem = self.dev.device.mem().map().clone();
        let old = &self.cqs[&cq];
        if old.in_error {
            return Err(Refused::invalid("CQ in error"));
        }
        let tail = old.track.tail.load(Ordering::Relaxed);
        let cons = old.ring.cons(&mem).or_refuse("CQ header")?;
        let waiting = tail.wrapping_sub(cons);
        if waiting > old.ring.indices().capacity() {
            return Err(Refused::invalid("CQ consumer index"));
        }
        if waiting > r.entries {
            return Err(Refused::invalid("CQ too small for its completions"));
        }
        let mut entry = abi::Cqe::new_zeroed();
        for i in 0..waiting {
            old.ring
                .read_entry(&mem, cons.wrapping_add(i), entry.as_mut_bytes())
                .or_refuse("CQ ring")?;
            new.write_entry(&mem, i, &entry).or_refuse("new CQ ring")?;
        }
        new.set_prod(&mem, waiting).or_refuse("new CQ header")?;
        new.set_cons(&mem, 0).or_refuse("new CQ header")?;
        let (sink, track) = Sink::new(self.dev.shared.clone(), new.clone(), waiting)?;
        // A solicited completion that waits stays due for an arm.
        let due_old = old.track.due.load(Ordering::Relaxed);
        if due_old.wrapping_sub(cons) <= waiting && due_old != cons {
            track
                .due
                .store(due_old.wrapping_sub(cons), Ordering::Relaxed);
        }
        let entries = self
            .dev
            .device
            .engine_mut()
            .resize_cq_sink(CqHandle(cq), r.entries, Box::new(sink))
            .or_refuse("CQ size")?;
        self.dev.claims.release(Owner::Cq(cq));
        self.dev.claims.claim(Owner::Cq(cq), &r.pages, &[r.header]);
        if let Some(c) = self.cqs.get_mut(&cq) {
            c.ring = new;
            c.header = r.header;
            c.track = track;
        }
        Ok(abi::HandleResp {
            handle: entries.into(),
            reserved: 0.into(),
        }
        .as_bytes()
        .to_vec())
    }

    pub(super) fn create_srq(
        &mut self,
        ctx: u32,
        pd: u32,
        max_sge: u32,
        srq_limit: u32,
        r: RingSpec,
    ) -> Result<Vec<u8>, Refused> {
        self.owned(&self.pds, pd, ctx, "PD")?;
        let ring = self.guest_ring(&r)?;
        self.dev.claims.check(&r.pages, &[r.header], None)?;
        let doorbell = self.take_doorbell(ctx, Obj::Srq(0))?;
        let made = self.dev.device.engine_mut().create_srq(
            PdHandle(pd),
            SrqAttr {
                max_wr: r.entries,
                max_sge,
                srq_limit,
            },
        );
        let (srq, attr) = match made {
            Ok(v) => v,
            Err(e) => {
                self.free_doorbell(ctx, doorbell);
                return Err(Refused::verbs(&e, "SRQ"));
            }
        };
        if let Some(c) = self.contexts.get_mut(&ctx) {
            c.doorbells.insert(doorbell, Obj::Srq(srq.0));
        }
        self.dev
            .claims
            .claim(Owner::Srq(srq.0), &r.pages, &[r.header]);
        self.dev.srqs.insert(
            srq.0,
            SrqFace {
                context: ctx,
                doorbell,
                queue: SrqQueue::new(srq, ring, attr.max_wr).breaking_on_malformed(),
                max_sge: attr.max_sge,
            },
        );
        Ok(abi::CreateSrqResp {
            srq: srq.0.into(),
            max_wr: attr.max_wr.into(),
            max_sge: attr.max_sge.into(),
            doorbell: doorbell.into(),
        }
        .as_bytes()
        .to_vec())
    }

    pub(super) fn create_qp(&mut self, ctx: u32, c: CreateQp) -> Result<Vec<u8>, Refused> {
        self.owned(&self.pds, c.pd, ctx, "PD")?;
        self.cq_of(ctx, c.send_cq)?;
        self.cq_of(ctx, c.recv_cq)?;
        if let Some(s) = c.srq {
            self.srq_of(ctx, s)?;
        }
        let sq = self.guest_ring(&c.sq)?;
        let rq = c.rq.as_ref().map(|r| self.guest_ring(r)).transpose()?;
        let mut pages = c.sq.pages.clone();
        let mut headers = vec![c.sq.header];
        if let Some(r) = &c.rq {
            pages.extend_from_slice(&r.pages);
            headers.push(r.header);
        }
        self.dev.claims.check(&pages, &headers, None)?;
        let doorbell = self.take_doorbell(ctx, Obj::Qp(0))?;
        let made = self.dev.device.engine_mut().create_qp(QpInitAttr {
            pd: PdHandle(c.pd),
            send_cq: CqHandle(c.send_cq),
            recv_cq: CqHandle(c.recv_cq),
            srq: c.srq.map(SrqHandle),
            cap: QpCap {
                max_send_wr: c.sq.entries,
                max_recv_wr: c.rq.as_ref().map_or(0, |r| r.entries),
                max_send_sge: c.max_send_sge,
                max_recv_sge: c.max_recv_sge,
                max_inline_data: c.max_inline_data,
            },
            qp_type: c.qp_type,
            sq_sig_all: c.sq_sig_all,
        });
        let (qpn, cap) = match made {
            Ok(v) => v,
            Err(e) => {
                self.free_doorbell(ctx, doorbell);
                return Err(Refused::verbs(&e, "QP"));
            }
        };
        let h = qpn.value();
        self.dev.claims.claim(Owner::Qp(h), &pages, &headers);
        if let Some(cx) = self.contexts.get_mut(&ctx) {
            cx.doorbells.insert(doorbell, Obj::Qp(h));
        }
        self.dev.qps.insert(
            h,
            QpFace {
                context: ctx,
                doorbell,
                queues: QpQueues::new(qpn, sq, rq),
                shape: SendShape {
                    qp_type: c.qp_type,
                    max_sge: cap.max_send_sge,
                    max_inline: cap.max_inline_data,
                },
                max_recv_sge: cap.max_recv_sge,
            },
        );
        Ok(abi::CreateQpResp {
            qpn: h.into(),
            max_send_wr: cap.max_send_wr.into(),
            max_recv_wr: cap.max_recv_wr.into(),
            max_send_sge: cap.max_send_sge.into(),
            max_recv_sge: cap.max_recv_sge.into(),
            max_inline_data: cap.max_inline_data.into(),
            doorbell: doorbell.into(),
            reserved: 0.into(),
        }
        .as_bytes()
        .to_vec())
    }

    /// DESTROY_CQ: its doorbell, pages, notification and events go with it.
    pub(super) fn destroy_cq(&mut self, ctx: u32, cq: u32) -> Result<Vec<u8>, Refused> {
        self.cq_of(ctx, cq)?;
        self.dev
            .device
            .engine_mut()
            .destroy_cq(CqHandle(cq))
            .or_refuse("CQ")?;
        if let Some(c) = self.cqs.remove(&cq) {
            self.free_doorbell(c.context, c.doorbell);
        }
        self.dev.claims.release(Owner::Cq(cq));
        self.notified.remove(&cq);
        self.notifications.retain(|n| n.cq.get() != cq);
        self.drop_events(|e| e.event_type.get() == ev::CQ_ERR && e.object.get() == cq);
        Ok(Vec::new())
    }

    /// DESTROY_SRQ: its doorbell, pages and events go with it.
    pub(super) fn destroy_srq(&mut self, ctx: u32, srq: u32) -> Result<Vec<u8>, Refused> {
        self.srq_of(ctx, srq)?;
        self.dev
            .device
            .engine_mut()
            .destroy_srq(SrqHandle(srq))
            .or_refuse("SRQ")?;
        if let Some(s) = self.dev.remove_srq(srq) {
            self.free_doorbell(s.context, s.doorbell);
        }
        self.dev.claims.release(Owner::Srq(srq));
        self.drop_events(|e| {
            matches!(e.event_type.get(), ev::SRQ_LIMIT_REACHED | ev::SRQ_ERR)
                && e.object.get() == srq
        });
        Ok(Vec::new())
    }

    /// A QP goes; its pending WRs are discarded without completions, and
    /// the device's answers still due go out first.
    pub(super) fn destroy_qp(&mut self, qpn: u32) -> Result<(), Refused> {
        let _ = self.dev.device.send_pending();
        self.dev
            .device
            .engine_mut()
            .destroy_qp(Qpn::from_masked(qpn))
            .or_refuse("QP")?;
        if let Some(q) = self.dev.remove_qp(qpn) {
            self.free_doorbell(q.context, q.doorbell);
        }
        self.dev.claims.release(Owner::Qp(qpn));
        // Its pending events go with it: a reused QPN must not hear them.
        self.drop_events(|e| {
            matches!(
                e.event_type.get(),
                ev::QP_FATAL
                    | ev::QP_REQ_ERR
                    | ev::QP_ACCESS_ERR
                    | ev::QP_LAST_WQE_REACHED
                    | ev::SQ_DRAINED
            ) && e.object.get() == qpn
        });
        Ok(())
    }
}
