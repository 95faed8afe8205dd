//! Why a command was refused, face-neutral: an errno (Linux's numbering,
//! as rdma-core reports it: what `ibv_*` calls return) and a short
//! description of what was wrong. Made from the engine's refusals
//! ([`VerbsError::errno`]), from guest memory that did not hold what a
//! command named ([`GuestError`]: EINVAL), and from a face's own argument
//! checks; each face answers it in its ABI's status encoding.

use vrdma_engine::{VerbsError, error::errno};

use crate::guest::GuestError;

/// A refused command.
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
#[error("{what} (errno {errno})")]
pub struct Refused {
    /// The errno, positive.
    pub errno: u32,
    /// What was wrong.
    pub what: &'static str,
}

impl Refused {
    pub const fn new(errno: u32, what: &'static str) -> Self {
        Refused { errno, what }
    }

    /// EINVAL: a bad handle, argument, size or page list.
    pub const fn invalid(what: &'static str) -> Self {
        Refused::new(errno::EINVAL.unsigned_abs(), what)
    }

    /// EBUSY: the object is still in use.
    pub const fn busy(what: &'static str) -> Self {
        Refused::new(errno::EBUSY.unsigned_abs(), what)
    }

    /// EOPNOTSUPP: something the device does not offer.
    pub const fn unsupported(what: &'static str) -> Self {
        Refused::new(errno::EOPNOTSUPP.unsigned_abs(), what)
    }

    /// The engine refused: its errno.
    pub const fn verbs(e: &VerbsError, what: &'static str) -> Self {
        Refused::new(e.errno().unsigned_abs(), what)
    }

    /// Guest memory a command named could not be read, or does not hold
    /// what it must: EINVAL.
    pub const fn guest(_e: GuestError, what: &'static str) -> Self {
        Refused::invalid(what)
    }
}

/// A result or option turned into a refusal saying `what`.
pub trait OrRefuse<T> {
    fn or_refuse(self, what: &'static str) -> Result<T, Refused>;
}

/// The engine's refusal, with its errno.
impl<T> OrRefuse<T> for Result<T, VerbsError> {
    fn or_refuse(self, what: &'static str) -> Result<T, Refused> {
        self.map_err(|e| Refused::verbs(&e, what))
    }
}

/// Guest memory that could not be read: EINVAL.
impl<T> OrRefuse<T> for Result<T, GuestError> {
    fn or_refuse(self, what: &'static str) -> Result<T, Refused> {
        self.map_err(|e| Refused::guest(e, what))
    }
}

/// Nothing there (a handle that names no object of the guest's): EINVAL.
impl<T> OrRefuse<T> for Option<T> {
    fn or_refuse(self, what: &'static str) -> Result<T, Refused> {
        self.ok_or(Refused::invalid(what))
    }
}

#[cfg(test)]
mod tests {
    use vrdma_engine::Kind;

    use super::*;

    #[test]
    fn errnos_are_the_engines_and_einval_for_guest_memory_and_missing_handles() {
        let busy: Result<(), _> = Err(VerbsError::Busy {
            kind: Kind::Pd,
            handle: 1,
            users: 2,
        });
        assert_eq!(busy.or_refuse("PD"), Err(Refused::new(16, "PD")));
        let gone: Result<(), _> = Err(GuestError::Unmapped(0x1000));
        assert_eq!(
            gone.or_refuse("page directory"),
            Err(Refused::new(22, "page directory"))
        );
        assert_eq!(None::<u32>.or_refuse("QP"), Err(Refused::invalid("QP")));
        assert_eq!(Some(3).or_refuse("QP"), Ok(3));
        assert_eq!(Refused::busy("x").errno, 16);
        assert_eq!(Refused::unsupported("x").errno, 95);
        assert_eq!(
            Refused::invalid("CQ size").to_string(),
            "CQ size (errno 22)"
        );
    }
}
