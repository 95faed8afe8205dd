//! errno values (Linux), as rdma-core reports them: the one table the
//! engine, the faces and their tests use.

pub const EPERM: i32 = 1;
pub const ENOMEM: i32 = 12;
pub const EBUSY: i32 = 16;
pub const EINVAL: i32 = 22;
pub const EOPNOTSUPP: i32 = 95;
