//! What the driver is told: CQ notifications and asynchronous events,
//! both held until the driver has buffers for them.

use vrdma_device::Transport;
use vrdma_engine::{CqHandle, event::AsyncEvent};
use vrdma_wire::Qpn;

use super::state::VirtioRdma;
use crate::abi::{self, event as ev};

impl<T: Transport> VirtioRdma<T> {
    pub(super) fn notify(&mut self, cq: u32, ctx: u32) {
        if self.notified.insert(cq) {
            self.notifications.push_back(abi::Notification {
                cq: cq.into(),
                context: ctx.into(),
            });
        }
    }

    pub(super) fn event(&mut self, kind: u32, object: u32, context: u32) {
        if self.events.len() >= self.opts.max_pending_events {
            if self.lost_events == 0 {
                self.lost_behind = self.events.len();
            }
            self.lost_events = self.lost_events.saturating_add(1);
            self.stats.events_lost += 1;
            return;
        }
        self.events.push_back(abi::Event {
            event_type: kind.into(),
            object: object.into(),
            context: context.into(),
            reserved: 0.into(),
        });
    }

    /// A CQ in error took the QPs that use it to ERR (the engine did):
    /// one QP_FATAL each, after the CQ_ERR (§10.2, DEV-48). Returns how
    /// many.
    pub(super) fn cq_error_takes_down(&mut self, cq: CqHandle) -> usize {
        let engine = self.dev.device.engine();
        let down: Vec<(u32, u32)> = self
            .dev
            .qps
            .iter()
            .filter(|(qpn, _)| {
                engine
                    .query_qp(Qpn::from_masked(**qpn))
                    .is_ok_and(|(_, init)| init.send_cq == cq || init.recv_cq == cq)
            })
            .map(|(qpn, q)| (*qpn, q.context))
            .collect();
        for &(qpn, ctx) in &down {
            self.event(ev::QP_FATAL, qpn, ctx);
        }
        down.len()
    }

    pub(super) fn owner_of_event(&self, e: AsyncEvent) -> u32 {
        match e {
            AsyncEvent::CqErr { cq } => self.cqs.get(&cq.0).map_or(0, |c| c.context),
            AsyncEvent::QpFatal { qp }
            | AsyncEvent::QpReqErr { qp }
            | AsyncEvent::QpAccessErr { qp }
            | AsyncEvent::QpLastWqeReached { qp }
            | AsyncEvent::SqDrained { qp } => {
                self.dev.qps.get(&qp.value()).map_or(0, |q| q.context)
            }
            AsyncEvent::SrqLimitReached { srq } => {
                self.dev.srqs.get(&srq.0).map_or(0, |s| s.context)
            }
            AsyncEvent::PortActive { .. } => 0,
        }
    }

    /// Pending events `gone` names are dropped (their context or object
    /// is).
    pub(super) fn drop_events(&mut self, gone: impl Fn(&abi::Event) -> bool) {
        let behind = self.lost_behind;
        let (mut i, mut ahead) = (0, 0);
        self.events.retain(|e| {
            let before_lost = i < behind;
            i += 1;
            let drop = gone(e);
            ahead += usize::from(drop && before_lost);
            !drop
        });
        self.lost_behind -= ahead;
    }

    /// The next event for the driver, if one waits (an EVENTS_LOST once
    /// the events queued before the first drop are delivered).
    pub fn next_event(&mut self) -> Option<abi::Event> {
        if self.lost_events > 0 && self.lost_behind == 0 {
            let n = std::mem::take(&mut self.lost_events);
            self.events.push_front(abi::Event {
                event_type: ev::EVENTS_LOST.into(),
                object: n.into(),
                context: 0.into(),
                reserved: 0.into(),
            });
        }
        let e = self.events.pop_front()?;
        if self.lost_events > 0 {
            self.lost_behind -= 1;
        }
        self.stats.events += 1;
        Some(e)
    }

    /// An event taken by [`VirtioRdma::next_event`] that found no buffer
    /// goes back first in line.
    pub fn unget_event(&mut self, e: abi::Event) {
        self.stats.events -= 1;
        if self.lost_events > 0 {
            self.lost_behind += 1;
        }
        self.events.push_front(e);
    }

    /// The next CQ notification, if one waits.
    pub fn next_notification(&mut self) -> Option<abi::Notification> {
        let n = self.notifications.pop_front()?;
        self.notified.remove(&n.cq.get());
        self.stats.notifications += 1;
        Some(n)
    }

    pub fn unget_notification(&mut self, n: abi::Notification) {
        self.stats.notifications -= 1;
        self.notified.insert(n.cq.get());
        self.notifications.push_front(n);
    }
}

/// The event entry's type and object for an engine event.
pub(super) fn event_code(e: AsyncEvent) -> (u32, u32) {
    match e {
        AsyncEvent::CqErr { cq } => (ev::CQ_ERR, cq.0),
        AsyncEvent::QpFatal { qp } => (ev::QP_FATAL, qp.value()),
        AsyncEvent::QpReqErr { qp } => (ev::QP_REQ_ERR, qp.value()),
        AsyncEvent::QpAccessErr { qp } => (ev::QP_ACCESS_ERR, qp.value()),
        AsyncEvent::QpLastWqeReached { qp } => (ev::QP_LAST_WQE_REACHED, qp.value()),
        AsyncEvent::SqDrained { qp } => (ev::SQ_DRAINED, qp.value()),
        AsyncEvent::SrqLimitReached { srq } => (ev::SRQ_LIMIT_REACHED, srq.0),
        AsyncEvent::PortActive { port } => (ev::PORT_ACTIVE, u32::from(port)),
    }
}
