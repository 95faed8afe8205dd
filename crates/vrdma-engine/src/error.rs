//! Errors of verbs calls, with the errno rdma-core would return for each.

use core::fmt;

use crate::qp::state::TransitionError;

/// The kinds of objects a verbs call names.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Kind {
    Pd,
    Mr,
    Mw,
    Cq,
    Qp,
    Srq,
    Ah,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Pd => "PD",
            Kind::Mr => "MR",
            Kind::Mw => "MW",
            Kind::Cq => "CQ",
            Kind::Qp => "QP",
            Kind::Srq => "SRQ",
            Kind::Ah => "AH",
        })
    }
}

/// Why a verbs call failed.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
pub enum VerbsError {
    /// A handle that names no live object of its kind.
    #[error("no {kind} with handle {handle:#x}")]
    NotFound { kind: Kind, handle: u32 },
    /// An argument outside what the call accepts.
    #[error("invalid {what}")]
    Invalid { what: &'static str },
    /// A requested size above the device's limit.
    #[error("{what} of {requested} exceeds the device limit of {max}")]
    ExceedsLimit {
        what: &'static str,
        requested: u64,
        max: u64,
    },
    /// Every object of this kind the device allows is in use.
    #[error("all {max} {kind}s are in use")]
    Exhausted { kind: Kind, max: u32 },
    /// A work queue with no free slot.
    #[error("{what} is full ({depth} entries)")]
    QueueFull { what: &'static str, depth: u32 },
    /// The object is still used by others (a PD with MRs, a CQ with QPs…).
    #[error("{kind} {handle:#x} is still used by {users} object(s)")]
    Busy { kind: Kind, handle: u32, users: u32 },
    /// A QP state transition the specification does not allow.
    #[error(transparent)]
    Transition(#[from] TransitionError),
    /// A feature the device does not offer.
    #[error("{what} is not supported")]
    NotSupported { what: &'static str },
    /// The object would take the memory held for the consumer's objects
    /// past the device's limit.
    #[error("a {kind} of {bytes} bytes would pass the memory limit ({held} of {limit} bytes held)")]
    OverBudget {
        kind: Kind,
        bytes: u64,
        held: u64,
        limit: u64,
    },
}

/// The errno table (its own module, which `qp::state` also takes).
pub use crate::errno;

impl VerbsError {
    /// The errno rdma-core returns for this failure (what `ibv_*` calls set
    /// or return).
    pub const fn errno(&self) -> i32 {
        match self {
            VerbsError::NotFound { .. }
            | VerbsError::Invalid { .. }
            | VerbsError::ExceedsLimit { .. }
            | VerbsError::Transition(_) => errno::EINVAL,
            VerbsError::Exhausted { .. }
            | VerbsError::QueueFull { .. }
            | VerbsError::OverBudget { .. } => errno::ENOMEM,
            VerbsError::Busy { .. } => errno::EBUSY,
            VerbsError::NotSupported { .. } => errno::EOPNOTSUPP,
        }
    }
}

/// Result of a verbs call.
pub type Result<T> = core::result::Result<T, VerbsError>;

/// Fails with [`VerbsError::ExceedsLimit`] when `requested > max`.
pub(crate) fn within(what: &'static str, requested: u64, max: u64) -> Result<()> {
    if requested > max {
        Err(VerbsError::ExceedsLimit {
            what,
            requested,
            max,
        })
    } else {
        Ok(())
    }
}
