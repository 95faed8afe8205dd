//! Doorbells: the bits each context's area holds taken, the rings they
//! name taken into the engine by the face device, the CQs they name armed
//! through the arm word in guest memory; the areas told whether the device
//! polls them.

use std::sync::atomic::Ordering;

use vrdma_device::Transport;
use vrdma_engine::CqHandle;
use vrdma_face::{Rings, ring::Indices};

use super::state::{Obj, VirtioRdma};
use crate::abi::{cq_header, event as ev};

impl<T: Transport> VirtioRdma<T> {
    /// Whether the device polls the doorbell areas now; says so in each.
    pub fn set_polling(&mut self, on: bool) {
        self.polling = on;
        let mem = self.dev.device.mem().clone();
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
    /// are taken, the CQs armed. Returns how many doorbells. Every area is
    /// swapped first (a look at each context's summary words, no copy of
    /// the context list), then what the bits name is acted on.
    pub fn doorbells(&mut self) -> usize {
        let mem = self.dev.device.mem();
        let mut bits = std::mem::take(&mut self.scratch);
        let mut rung = std::mem::take(&mut self.rung);
        rung.clear();
        let (mut count, mut faults, mut stale) = (0u64, 0u64, 0u64);
        for c in self.contexts.values() {
            bits.clear();
            if c.area.take(mem, &mut bits).is_err() {
                faults += 1;
            }
            count += bits.len() as u64;
            for i in &bits {
                match c.doorbells.get(i) {
                    Some(o) => rung.push(*o),
                    None => stale += 1,
                }
            }
        }
        self.scratch = bits;
        self.stats.area_faults += faults;
        self.stats.stale_doorbells += stale;
        self.stats.doorbells += count;
        for o in &rung {
            match *o {
                Obj::Qp(q) => self.take_qp(q),
                Obj::Srq(s) => self.dev.take_srq(s),
                Obj::Cq(cq) => self.arm(cq),
            }
        }
        self.rung = rung;
        count as usize
    }

    pub(super) fn take_qp(&mut self, qpn: u32) {
        self.dev.take_qp(qpn, Rings::BOTH);
    }

    /// SRQs whose ring broke: SRQ_ERR to their context (§10.2).
    pub(super) fn report_broken_srqs(&mut self) {
        for srq in self.dev.take_broken_srqs() {
            let ctx = self.dev.srqs.get(&srq).map_or(0, |s| s.context);
            self.event(ev::SRQ_ERR, srq, ctx);
        }
    }

    /// A CQ's arm word, read after its doorbell: a new arm (its sequence
    /// changed) notifies at once if a completion it wants is already
    /// there past the consumer index the driver armed at, and arms the
    /// engine's CQ otherwise.
    pub(super) fn arm(&mut self, cq: u32) {
        let Some(c) = self.cqs.get_mut(&cq) else {
            return;
        };
        let Ok(word) = self.dev.device.mem().load_u64(c.header + cq_header::ARM) else {
            self.stats.area_faults += 1;
            return;
        };
        let seq = word >> 34;
        let mode = (word >> 32) & 3;
        if seq == c.arm_seq || mode == 0 || mode == 3 {
            return;
        }
        c.arm_seq = seq;
        self.stats.arms += 1;
        let at = word as u32;
        let tail = c.track.tail.load(Ordering::Relaxed);
        let ahead = tail.wrapping_sub(at);
        let cap = c.ring.indices().capacity();
        let ready = if mode == cq_header::ARM_NEXT {
            ahead != 0 && ahead <= cap
        } else {
            let due = c.track.due.load(Ordering::Relaxed);
            let d = due.wrapping_sub(at);
            d != 0 && d <= ahead && ahead <= cap
        };
        let ctx = c.context;
        if ready {
            // This arm is satisfied now; an earlier one the engine still
            // holds (solicited-only, passed by unsolicited completions)
            // merged into it and goes too: one arm, one notification.
            let _ = self.dev.device.engine_mut().disarm_cq(CqHandle(cq));
            self.notify(cq, ctx);
        } else {
            let _ = self
                .dev
                .device
                .engine_mut()
                .req_notify_cq(CqHandle(cq), mode == cq_header::ARM_SOLICITED);
        }
    }
}
