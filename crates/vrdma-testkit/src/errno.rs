//! The engine's errno table (`vrdma_engine::errno`, rdma-core's values)
//! as the faces' command refusals carry it — positive, in a u32 — so that
//! the faces' tests name errnos from the one table the device uses.

use vrdma_engine::errno as e;

pub const EPERM: u32 = e::EPERM.unsigned_abs();
pub const ENOENT: u32 = e::ENOENT.unsigned_abs();
pub const EIO: u32 = e::EIO.unsigned_abs();
pub const ENOMEM: u32 = e::ENOMEM.unsigned_abs();
pub const EFAULT: u32 = e::EFAULT.unsigned_abs();
pub const EBUSY: u32 = e::EBUSY.unsigned_abs();
pub const EINVAL: u32 = e::EINVAL.unsigned_abs();
pub const ENOSPC: u32 = e::ENOSPC.unsigned_abs();
pub const EMSGSIZE: u32 = e::EMSGSIZE.unsigned_abs();
pub const EOPNOTSUPP: u32 = e::EOPNOTSUPP.unsigned_abs();
