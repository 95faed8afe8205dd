//! The virtio-rdma device's state, transport-neutral: the spec's commands
//! carried out on a vrdma device, contexts and their doorbell areas, the
//! objects each context owns, rings taken into the engine, CQs armed
//! through guest memory, and the events and notifications waiting for the
//! driver's buffers. The vhost-user backend (`vhost`) moves bytes between
//! virtqueues and this; nothing here knows a virtqueue.
//!
//! | module | what |
//! |---|---|
//! | `state` | the device and its objects, what it is made with, reset and failure |
//! | `cmd` | the commands: each decoded request checked and carried out |
//! | `objects` | CQs, SRQs and QPs: their rings checked, claimed, made and destroyed |
//! | `sink` | the CQ sink: completions into the driver's CQ ring, tracked for arming |
//! | `doorbells` | doorbell areas read: rings taken (by the face core's device), CQs armed |
//! | `turn` | the device's turn: doorbells, the engine, the busy rings, events collected |
//! | `events` | notifications and asynchronous events for the driver |

mod cmd;
mod doorbells;
mod events;
mod objects;
mod sink;
mod state;
mod turn;

pub use state::{FaceStats, GID_TABLE_LEN, MAX_REQUEST, Options, Turn, VirtioRdma, device_attr};
