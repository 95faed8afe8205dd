//! vrdma's RDMA engine: the device model, sans-IO.
//!
//! Inputs are verbs calls (and, with the data path, received packets and
//! `now`); outputs are results, completions and asynchronous events. No
//! sockets, threads or clocks; memory only through the [`Memory`] trait.
//!
//! | module | what |
//! |---|---|
//! | [`engine`] | [`Engine`]: the control-path verbs |
//! | [`datapath`] | the data path's entry points: packets in and out, time |
//! | `scheduler`, `requester`, `responder`, `completer`, `timers`, `completion` | the data path's roles, each on one QP and the shared context (`context`) |
//! | [`transmit`] | [`transmit::Transmit`]: where a packet goes |
//! | [`stats`] | the data path's counters |
//! | [`attr`] | device and port attributes, GID and P_Key tables |
//! | [`mr`] | memory regions, address translation, protection checks |
//! | [`memory`] | the [`Memory`] trait and [`VecMemory`] |
//! | [`cq`], [`wc`] | completion queues and work completions |
//! | [`qp`] | QP types, attributes, the state machine ([`qp::state`]) |
//! | [`objects`] | PDs, SRQs, AHs |
//! | [`wr`] | work requests and the work queues that hold them |
//! | [`event`] | asynchronous events |
//! | [`handle`] | PD, CQ, SRQ and AH handles |
//! | [`error`] | [`VerbsError`] and its errno |
#![forbid(unsafe_code)]

mod access;
pub mod attr;
pub(crate) mod budget;
mod completer;
mod completion;
mod context;
pub mod cq;
pub mod datapath;
mod deadlines;
pub mod engine;
pub mod errno;
pub mod error;
pub mod event;
pub mod fence;
pub mod handle;
pub mod memory;
pub mod mr;
pub mod objects;
pub mod qp;
mod qpc;
mod requester;
mod responder;
mod rx;
mod scheduler;
mod sgl;
pub mod stats;
mod table;
mod timers;
pub mod transmit;
pub mod wc;
mod window;
pub mod wr;

pub use engine::{Counts, Engine};
pub use error::{Kind, VerbsError};
pub use handle::{AhHandle, CqHandle, PdHandle, SrqHandle};
pub use memory::{Memory, VecMemory};
