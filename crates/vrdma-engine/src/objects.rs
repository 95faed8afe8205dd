//! The small objects: protection domains, shared receive queues, address
//! handles.

use crate::qp::AhAttr;

/// A protection domain. Its users are counted by the engine's tables.
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct Pd;

/// Shared receive queue attributes (`struct ibv_srq_attr`).
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct SrqAttr {
    pub max_wr: u32,
    pub max_sge: u32,
    /// Limit below which the SRQ limit event fires once armed (0 =
    /// disarmed).
    pub srq_limit: u32,
}

/// A shared receive queue's control state.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Srq {
    pub pd: u32,
    pub attr: SrqAttr,
}

/// An address handle: where UD sends go.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Ah {
    pub pd: u32,
    pub attr: AhAttr,
}
