//! Asynchronous events (`enum ibv_event_type`, the ones a RoCE device
//! raises), delivered through the engine's event queue.

use vrdma_wire::Qpn;

/// An asynchronous event.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum AsyncEvent {
    /// A CQ overflowed (IBV_EVENT_CQ_ERR); its QPs were moved to error.
    CqErr { cq: u32 },
    /// A QP hit an error that is not reported in a completion
    /// (IBV_EVENT_QP_FATAL).
    QpFatal { qp: Qpn },
    /// A QP that uses an SRQ reached error and will consume no more WQEs
    /// (IBV_EVENT_QP_LAST_WQE_REACHED).
    QpLastWqeReached { qp: Qpn },
    /// The SQ of a QP in SQD drained (IBV_EVENT_SQ_DRAINED).
    SqDrained { qp: Qpn },
    /// An armed SRQ fell below its limit (IBV_EVENT_SRQ_LIMIT_REACHED).
    SrqLimitReached { srq: u32 },
    /// The port became active (IBV_EVENT_PORT_ACTIVE).
    PortActive { port: u8 },
}
