//! errno values (Linux), as rdma-core reports them: the one table the
//! engine, the faces and their tests use.

pub const EPERM: i32 = 1;
pub const ENOENT: i32 = 2;
pub const EIO: i32 = 5;
pub const ENOMEM: i32 = 12;
pub const EFAULT: i32 = 14;
pub const EBUSY: i32 = 16;
pub const EINVAL: i32 = 22;
pub const ENOSPC: i32 = 28;
pub const EMSGSIZE: i32 = 90;
pub const EOPNOTSUPP: i32 = 95;
