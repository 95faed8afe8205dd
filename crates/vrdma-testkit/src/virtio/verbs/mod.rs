//! The driver's verbs over a [`Frontend`](super::Frontend): what a guest kernel
//! driver and its provider do with the device's commands, rings and doorbells —
//! contexts with doorbell areas in guest memory, PDs, MRs (page lists, DMA,
//! fast registration), windows, CQs (polled from their rings, armed through
//! their arm words), QPs (WQEs written into their rings, producer indices
//! published, doorbells rung), SRQs — and a side of a test (a guest with its
//! objects) with two sides' QPs connected.
//!
//! | module | what |
//! |---|---|
//! | `codes` | the verbs' numbers: attribute-mask bits, QP states, completion statuses and opcodes, the kit's access, Q_Key and PSN |
//! | `wqe` | work requests as the ABI lays them out: SGEs, receive and send WQEs, address vectors |
//! | `objects` | the driver's side of the objects: doorbell areas and contexts, MRs, CQs, work rings, QPs, SRQs |
//! | `commands` | the controlq's commands as [`Frontend`](super::Frontend) methods: contexts, PDs, MRs, windows, CQs, SRQs, QPs and their states |
//! | `endpoint` | a side of a test ([`Endpoint`]), two sides' QPs connected, a SEND checked byte for byte |

mod codes;
mod commands;
mod endpoint;
mod objects;
mod wqe;

pub use codes::{ALL_ACCESS, PSN, QKEY, mask, state, wc};
pub use commands::Path;
pub use endpoint::{Endpoint, connect, pattern, send_checked};
pub use objects::{Cq, Ctx, Door, Mr, Qp, QpSpec, Srq, WqRing};
pub use wqe::{Wqe, av, recv_wqe, sge};
