//! The guest, as far as a PVRDMA device can tell: a vfio-user client (as
//! QEMU is) with "RAM" in a memfd it shares, and a model of the Linux
//! `vmw_pvrdma` driver on top — the probe handshake, commands, page
//! directories, rings, doorbells — that the tests drive directly,
//! well-behaved or not.
//!
//! | module | what |
//! |---|---|
//! | `vmm` | the VMM's part, as QEMU plays it: the vfio-user client ([`Guest`]) and the guest's RAM, guard and canary pages |
//! | `driver` | the driver's control path: probe, shared region, commands and refusals, event rings, GIDs, PDs, MRs |
//! | `queues` | CQs and QPs ([`GuestCq`], [`GuestQp`]): their rings, polling and arming, posting, modifying, RC bring-up |

mod driver;
mod queues;
mod vmm;

pub use driver::hdr;
pub use queues::{GuestCq, GuestQp, rc_up, rc_up_mtu, sge, wqe};
pub use vmm::{Guest, RAM_BASE, UAR_PFN, le32, one_page, sealed_memfd, unsealed_page};
