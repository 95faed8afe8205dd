//! vrdma's fabrics: the I/O around the engine.
//!
//! | module | what |
//! |---|---|
//! | [`sim`] | a seeded simulated network with loss, duplication, reordering, delay, corruption and partitions, on a virtual clock |
#![forbid(unsafe_code)]

pub mod sim;
