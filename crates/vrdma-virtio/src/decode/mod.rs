//! Requests and ring entries decoded from copies into typed values: the
//! only way anything the driver wrote reaches the device. Pure functions of
//! bytes (no guest memory, no device state), so every rule here is
//! exercised by unit tests, property tests and the fuzz targets.
//!
//! What needs the device (does a handle exist, is a page inside guest
//! memory, does the engine accept the attributes) is checked later, on the
//! typed values.
//!
//! | module | what |
//! |---|---|
//! | `request` | control requests into a typed [`Command`] |
//! | `attrs` | address vectors and QP attributes, both ways |
//! | `wqe` | send and receive WQEs into the face core's types |
//! | `cqe` | work completions as CQ ring entries |

use vrdma_engine::errno;
use vrdma_face::Refused;

use crate::abi::status;

/// A request shorter or longer than its command, or a trailing array not
/// the length it names (EMSGSIZE: status LENGTH).
pub const fn length(what: &'static str) -> Refused {
    Refused::new(errno::EMSGSIZE.unsigned_abs(), what)
}

/// A guest address misaligned or outside guest memory (EFAULT: status
/// FAULT).
pub const fn fault(what: &'static str) -> Refused {
    Refused::new(errno::EFAULT.unsigned_abs(), what)
}

/// A handle that names no object of the command's context (ENOENT).
pub const fn noent(what: &'static str) -> Refused {
    Refused::new(errno::ENOENT.unsigned_abs(), what)
}

/// The status a refusal answers with: a function of its errno.
pub const fn status_of(r: &Refused) -> u16 {
    const fn is(r: &Refused, e: i32) -> bool {
        r.errno == e.unsigned_abs()
    }
    if is(r, errno::ENOENT) {
        status::NOENT
    } else if is(r, errno::ENOMEM) || is(r, errno::ENOSPC) {
        status::NOMEM
    } else if is(r, errno::EBUSY) {
        status::BUSY
    } else if is(r, errno::EOPNOTSUPP) {
        status::UNSUPPORTED
    } else if is(r, errno::EFAULT) {
        status::FAULT
    } else if is(r, errno::EMSGSIZE) {
        status::LENGTH
    } else if is(r, errno::EIO) {
        status::DEVICE
    } else {
        status::INVALID
    }
}

mod attrs;
mod cqe;
mod request;
mod wqe;

pub use attrs::*;
pub use cqe::*;
pub use request::*;
pub use wqe::*;

#[cfg(test)]
mod tests;
