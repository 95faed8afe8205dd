//! vrdma's tools: what the `vrdma` command runs.
//!
//! | module | what |
//! |---|---|
//! | [`args`] | the command line (clap derive) |
//! | [`mod@bench`] | `vrdma bench`: vrdma beside raw UDP and memcpy, as ratios |
//! | [`capture`] | reading pcap and pcapng files into link-layer frames |
//! | [`common`] | the in-process RC set-up, the TCP side channel, random PSNs |
//! | [`decode`] | `vrdma decode`: one line (or JSON object) per RoCEv2 packet |
//! | [`demo`] | `vrdma demo`: two devices on loopback, a ping-pong and a bandwidth/latency table |
//! | [`perf`] | `vrdma perf`: perftest 4.5's ib_*_bw / ib_*_lat, interoperable |
//! | [`pingpong`] | `vrdma pingpong rc\|uc\|ud`: rdma-core's ibv_*_pingpong, interoperable |
//! | [`rawudp`] | the raw UDP baseline the benchmark compares against |
//! | [`sandbox`] | `vrdma serve`'s confinement: privileges dropped, a seccomp allow-list |
//! | [`serve`] | `vrdma serve`: the daemon — PVRDMA devices over vfio-user, virtio-rdma devices over vhost-user or as virtio-pci functions over vfio-user, each on its uplink and network |
//! | [`stat`] | `vrdma stat`: the counters every device publishes in the run directory |
//!
//! Each device the client tools open is a `vrdma_device::verbs::Context`;
//! `serve` serves `vrdma_pvrdma` and `vrdma_virtio` devices. Above both
//! faces, the crate also holds what joins them: the faces bench
//! (`benches/faces`) and their interoperability suite
//! (`tests/faces_interop.rs`).

// Unsafe code only in `sandbox` (privileges, seccomp, limits) and one
// environment write before any thread starts (`serve`).
#![deny(unsafe_code)]

pub mod args;
pub mod bench;
pub mod capture;
pub mod common;
pub mod decode;
pub mod demo;
pub mod perf;
pub mod pingpong;
pub mod rawudp;
pub mod sandbox;
pub mod serve;
pub mod stat;
