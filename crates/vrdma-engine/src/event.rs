//! Asynchronous events (`enum ibv_event_type`, the ones a RoCE device
//! raises), delivered through the engine's event queue.

use vrdma_wire::Qpn;

use crate::handle::{CqHandle, SrqHandle};

/// An asynchronous event.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum AsyncEvent {
    /// A CQ overflowed (IBV_EVENT_CQ_ERR); its QPs were moved to error.
    CqErr { cq: CqHandle },
    /// A QP hit an error that is not reported in a completion
    /// (IBV_EVENT_QP_FATAL: local work queue catastrophic error; on a
    /// responder, the one behind a remote operational error NAK).
    QpFatal { qp: Qpn },
    /// The responder received an invalid request and NAKed it
    /// (IBV_EVENT_QP_REQ_ERR: invalid request local work queue error).
    QpReqErr { qp: Qpn },
    /// The responder refused a remote access and NAKed it
    /// (IBV_EVENT_QP_ACCESS_ERR: local access violation work queue error).
    QpAccessErr { qp: Qpn },
    /// A QP that uses an SRQ reached error and will consume no more WQEs
    /// (IBV_EVENT_QP_LAST_WQE_REACHED).
    QpLastWqeReached { qp: Qpn },
    /// The SQ of a QP in SQD drained (IBV_EVENT_SQ_DRAINED).
    SqDrained { qp: Qpn },
    /// An armed SRQ fell below its limit (IBV_EVENT_SRQ_LIMIT_REACHED).
    SrqLimitReached { srq: SrqHandle },
    /// The port became active (IBV_EVENT_PORT_ACTIVE).
    PortActive { port: u8 },
}
