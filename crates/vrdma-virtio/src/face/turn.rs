//! The device's turn: doorbells read, the rings they name taken into the
//! engine (WQEs decoded, malformed ones refused and counted), the engine
//! and the port run, events collected.

use vrdma_device::Transport;
use vrdma_engine::event::AsyncEvent;

use super::{
    events::event_code,
    state::{Turn, VirtioRdma},
};

impl<T: Transport> VirtioRdma<T> {
    /// One turn of the device: doorbells (when `scan`), the engine's
    /// progress, the rings that waited for room, and the events and
    /// notifications it raised. Returns whether anything happened and the
    /// next deadline.
    pub fn turn(&mut self, scan: bool) -> std::io::Result<Turn> {
        let rung = if scan { self.doorbells() } else { 0 };
        let progress = self.dev.device.progress()?;
        let waiting = self.dev.progress_rings();
        self.report_broken_srqs();
        // What this turn made the engine owe — the answers to the packets
        // it took (ACKs, READ responses), the WQEs taken after the
        // progress's send — goes now: a device that sleeps after the turn
        // (event mode, or idle past its spin) would otherwise hold them
        // until a timer, tens of milliseconds.
        let flushed = self.dev.device.send_pending();
        let mut raised = 0;
        while let Some(cq) = self.dev.device.engine_mut().poll_notification() {
            let ctx = self.cqs.get(&cq.0).map_or(0, |c| c.context);
            self.notify(cq.0, ctx);
            raised += 1;
        }
        while let Some(e) = self.dev.device.engine_mut().poll_event() {
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
