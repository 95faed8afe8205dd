//! The device's turn: doorbells read, the rings they name taken into the
//! engine (WQEs decoded, malformed ones refused and counted), the engine
//! and the port run, events collected.

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vrdma_device::Transport;
use vrdma_engine::{Engine, event::AsyncEvent, mr::Translation, wc::WcStatus};
use vrdma_face::{
    PageList, Refusals, refusals,
    wq::{self},
};

use super::{
    events::event_code,
    state::{FACE, Obj, QpFace, Turn, VirtioRdma},
};
use crate::{
    abi::event as ev,
    decode::{self, Payload, SendShape},
};

impl<T: Transport> VirtioRdma<T> {
    /// Whether the device polls the doorbell areas now; says so in each.
    pub fn set_polling(&mut self, on: bool) {
        self.polling = on;
        let mem = self.device.mem().clone();
        for c in self.contexts.values() {
            if c.area.set_poll(&mem, on).is_err() {
                self.stats.area_faults += 1;
            }
        }
    }

    pub fn polling(&self) -> bool {
        self.polling
    }

    /// Takes every doorbell rung in every context: the rings that moved
    /// are taken, the CQs armed. Returns how many doorbells.
    pub fn doorbells(&mut self) -> usize {
        let mem = self.device.mem().clone();
        let mut rung = 0;
        let ctxs: Vec<u32> = self.contexts.keys().copied().collect();
        for ctx in ctxs {
            let mut bits = std::mem::take(&mut self.scratch);
            bits.clear();
            let Some(c) = self.contexts.get(&ctx) else {
                continue;
            };
            if c.area.take(&mem, &mut bits).is_err() {
                self.stats.area_faults += 1;
            }
            for &i in &bits {
                rung += 1;
                match self.contexts.get(&ctx).and_then(|c| c.doorbells.get(&i)) {
                    Some(Obj::Qp(q)) => self.take_qp(*q),
                    Some(Obj::Srq(s)) => self.take_srq(*s),
                    Some(Obj::Cq(cq)) => self.arm(*cq),
                    None => self.stats.stale_doorbells += 1,
                }
            }
            self.scratch = bits;
        }
        self.stats.doorbells += rung as u64;
        rung
    }

    pub(super) fn take_qp(&mut self, qpn: u32) {
        let mem = self.device.mem().map().clone();
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let now = self.device.now();
        let engine = self.device.engine_mut();
        let t = take_wqes(q, &mem, engine, &mut self.refusals, now, qpn);
        self.stats.wqes += u64::from(t.entries);
        self.stats.malformed_wqes += u64::from(t.malformed);
        if t.broken {
            self.stats.broken_rings += 1;
            let _ = engine.qp_fatal(q.queues.qpn());
        }
        self.busy_qps.insert(qpn);
    }

    pub(super) fn take_srq(&mut self, srq: u32) {
        let mem = self.device.mem().map().clone();
        let Some(s) = self.srqs.get_mut(&srq) else {
            return;
        };
        let (max, ctx) = (s.max_sge, s.context);
        let now = self.device.now();
        let refusals = &mut self.refusals;
        let t = s.queue.take(&mem, self.device.engine_mut(), |e| {
            recv_wqe(e, max).map_err(|m| {
                refusals
                    .note_wqe(now, FACE, refusals::Kind::RecvWqe, srq, &m)
                    .0
            })
        });
        self.srq_taken(srq, ctx, t);
        self.busy_srqs.insert(srq);
    }

    pub(super) fn srq_taken(&mut self, srq: u32, ctx: u32, t: vrdma_face::Taken) {
        self.stats.wqes += u64::from(t.entries);
        self.stats.malformed_wqes += u64::from(t.malformed);
        if t.broken {
            self.stats.broken_rings += 1;
            self.event(ev::SRQ_ERR, srq, ctx);
        }
    }

    /// Room freed in the engine: takes what waited in the busy QPs' and
    /// SRQs' rings, and forgets those with nothing left. Returns whether a
    /// ring still holds WQEs the engine had no room for.
    pub(super) fn progress_rings(&mut self) -> bool {
        let mut waiting = false;
        let mem = self.device.mem().map().clone();
        let busy: Vec<u32> = self.busy_qps.iter().copied().collect();
        for qpn in busy {
            let Some(q) = self.qps.get_mut(&qpn) else {
                self.busy_qps.remove(&qpn);
                continue;
            };
            let now = self.device.now();
            let engine = self.device.engine_mut();
            if q.queues.pending(&mem) {
                let t = take_wqes(q, &mem, engine, &mut self.refusals, now, qpn);
                self.stats.wqes += u64::from(t.entries);
                self.stats.malformed_wqes += u64::from(t.malformed);
                if t.broken {
                    self.stats.broken_rings += 1;
                    let _ = engine.qp_fatal(q.queues.qpn());
                }
            }
            if q.queues.settle(&mem, engine) {
                self.busy_qps.remove(&qpn);
            } else {
                waiting |= q.queues.pending(&mem);
            }
        }
        let busy: Vec<u32> = self.busy_srqs.iter().copied().collect();
        for srq in busy {
            let Some(s) = self.srqs.get_mut(&srq) else {
                self.busy_srqs.remove(&srq);
                continue;
            };
            let now = self.device.now();
            let engine = self.device.engine_mut();
            let max = s.max_sge;
            let refusals = &mut self.refusals;
            let t = if s.queue.pending(&mem) {
                s.queue.take(&mem, engine, |e| {
                    recv_wqe(e, max).map_err(|m| {
                        refusals
                            .note_wqe(now, FACE, refusals::Kind::RecvWqe, srq, &m)
                            .0
                    })
                })
            } else {
                vrdma_face::Taken::default()
            };
            let idle = s.queue.settle(&mem, engine);
            waiting |= !idle && s.queue.pending(&mem);
            let ctx = s.context;
            self.srq_taken(srq, ctx, t);
            if idle {
                self.busy_srqs.remove(&srq);
            }
        }
        waiting
    }

    /// One turn of the device: doorbells (when `scan`), the engine's
    /// progress, the rings that waited for room, and the events and
    /// notifications it raised. Returns whether anything happened and the
    /// next deadline.
    pub fn turn(&mut self, scan: bool) -> std::io::Result<Turn> {
        let rung = if scan { self.doorbells() } else { 0 };
        let progress = self.device.progress()?;
        let waiting = self.progress_rings();
        // What this turn made the engine owe — the answers to the packets
        // it took (ACKs, READ responses), the WQEs taken after the
        // progress's send — goes now: a device that sleeps after the turn
        // (event mode, or idle past its spin) would otherwise hold them
        // until a timer, tens of milliseconds.
        let flushed = self.device.send_pending();
        let mut raised = 0;
        while let Some(cq) = self.device.engine_mut().poll_notification() {
            let ctx = self.cqs.get(&cq.0).map_or(0, |c| c.context);
            self.notify(cq.0, ctx);
            raised += 1;
        }
        while let Some(e) = self.device.engine_mut().poll_event() {
            let (kind, object) = event_code(e);
            let ctx = self.owner_of_event(e);
            self.event(kind, object, ctx);
            raised += 1;
            if let AsyncEvent::CqErr { cq } = e {
                if let Some(c) = self.cqs.get_mut(&cq.0) {
                    c.in_error = true;
                }
                raised += self.cq_error_takes_down(cq);
            }
        }
        Ok(Turn {
            // A QP whose WQEs all sit in the engine (receives waiting for
            // messages, sends for ACKs) needs no turn until the network,
            // a timer or a doorbell brings one: only WQEs still in a ring,
            // waiting for room in the engine, keep the device turning.
            // (Counting every busy QP kept a device with receives posted
            // — any QP that waits for a message — turning at full speed,
            // a core gone in event mode and polling that never stopped.)
            busy: rung > 0 || !progress.is_idle() || raised > 0 || waiting,
            moved: !progress.is_idle() || flushed > 0,
            deadline: progress.deadline,
        })
    }
}

/// What QP `qpn`'s rings hold, taken into the engine as far as it has
/// room; each malformed send WQE noted (counted by reason, logged).
pub(super) fn take_wqes(
    q: &mut QpFace,
    mem: &GuestMemoryMmap<()>,
    engine: &mut Engine,
    refusals: &mut Refusals,
    now: u64,
    qpn: u32,
) -> vrdma_face::Taken {
    let (shape, max_recv) = (q.shape, q.max_recv_sge);
    let sends = q.queues.take_sends(mem, engine, |e, engine| {
        send_wqe(mem, e, &shape, engine)
            .map_err(|m| refusals.note_wqe(now, FACE, refusals::Kind::SendWqe, qpn, &m))
    });
    sends.and(q.queues.take_recvs(mem, engine, |e| {
        recv_wqe(e, max_recv).map_err(|m| {
            refusals
                .note_wqe(now, FACE, refusals::Kind::RecvWqe, qpn, &m)
                .0
        })
    }))
}

/// A send WQE from its copy, for the engine: decoded, a fast
/// registration's page list read (a copy), keys resolved to the objects'
/// current ones.
pub(super) fn send_wqe(
    mem: &GuestMemoryMmap<()>,
    entry: &[u8],
    shape: &SendShape,
    engine: &Engine,
) -> Result<wq::SendWqe, decode::Malformed> {
    let w = decode::decode_send_why(entry, shape)?;
    // (the header's opcode byte, after the wr_id)
    let opcode = entry.get(8).copied().map_or(0, u32::from);
    let bad = |status, rule, field, value| {
        Err(decode::Malformed {
            wr_id: w.wr_id,
            status,
            opcode,
            rule,
            field,
            value,
        })
    };
    let (sges, inline) = match w.payload {
        Payload::Sges(s) => (s, None),
        Payload::Inline(d) => (Vec::new(), Some(d)),
    };
    let mut op = w.op;
    let mut fast_reg = None;
    match &mut op {
        vrdma_engine::wr::SendOp::RegMr { mr, .. } => {
            let Some(f) = w.fast_reg else {
                return bad(WcStatus::LocQpOpErr, "a REG_MR segment", "opcode", 0);
            };
            // The MR by its index (the WQE names the key it takes).
            let Some(cur) = engine.current_lkey(f.mr.0 >> 8) else {
                return bad(
                    WcStatus::LocQpOpErr,
                    "a key naming a fast-registration MR",
                    "key",
                    f.mr.0.into(),
                );
            };
            let max = engine.query_device().max_fast_reg_page_list_len;
            if f.npages > max {
                return bad(
                    WcStatus::LocQpOpErr,
                    "npages within max_fast_reg_page_list_len",
                    "npages",
                    f.npages.into(),
                );
            }
            // A page list or page outside guest memory is a protection
            // error (§7.9), a misaligned page a malformed WQE.
            let Ok(pages) = PageList::read(mem, f.page_list, f.npages as usize) else {
                return bad(
                    WcStatus::LocProtErr,
                    "a page list in guest memory",
                    "page_list",
                    f.page_list,
                );
            };
            if let Some(p) = pages
                .pages()
                .iter()
                .find(|p| !p.is_multiple_of(1u64 << f.page_shift))
            {
                return bad(
                    WcStatus::LocQpOpErr,
                    "pages aligned to the page size",
                    "page",
                    *p,
                );
            }
            let page = 1usize << f.page_shift;
            if let Some(p) = pages
                .pages()
                .iter()
                .find(|&&p| mem.get_slice(GuestAddress(p), page).is_err())
            {
                return bad(WcStatus::LocProtErr, "pages in guest memory", "page", *p);
            }
            *mr = cur;
            fast_reg = Some((
                cur,
                Translation::Pages {
                    page_shift: f.page_shift,
                    offset: f.offset,
                    pages: pages.into_pages(),
                },
            ));
        }
        vrdma_engine::wr::SendOp::BindMw { mw, .. } => {
            let Some(cur) = engine.current_rkey(mw.0 >> 8) else {
                return bad(
                    WcStatus::MwBindErr,
                    "a key naming a memory window",
                    "mw",
                    mw.0.into(),
                );
            };
            *mw = cur;
        }
        _ => {}
    }
    Ok(wq::SendWqe {
        wr_id: w.wr_id,
        op,
        flags: w.flags,
        sges,
        inline,
        ud: w.ud,
        fast_reg,
    })
}

pub(super) fn recv_wqe(entry: &[u8], max_sge: u32) -> Result<wq::RecvWqe, decode::Malformed> {
    decode::decode_recv(entry, max_sge).map(|(wr_id, sges)| wq::RecvWqe { wr_id, sges })
}
