//! vrdma's vfio-user server: one PCI function served to a client — QEMU's
//! `vfio-user-pci` — over a UNIX socket.
//!
//! Written here rather than taken from rust-vmm's `vfio_user` crate
//! (0.1.7), whose server owns its thread in a blocking `run()` with no fd
//! to poll (a device here runs one event loop: engine, network port and
//! this socket), answers backend errors with errno 0 (which QEMU reads as
//! success for DMA_MAP and SET_IRQS), sends a region's descriptor only with
//! a sparse-mmap list, reads the unmap-all flag at the wrong bit, and can
//! panic or lose framing on malformed input. The crate's message layouts
//! are the kernel's VFIO structures, declared again in [`proto`] with
//! `zerocopy` so that every one is decoded from a copy, size-checked.
//!
//! - [`proto`]: the wire format and the decoder (fuzzed).
//! - [`session`]: a client's session — handshake, DMA maps, interrupts,
//!   region and config accesses — and the [`session::Function`] a device
//!   implements; no I/O.
//! - [`dma`]: the client's memory, mapped with `vm-memory`; a memory table
//!   mapped elsewhere (vhost-user's) held to the same rules.
//! - [`irq`]: MSI-X vectors as eventfds.
//! - [`sigbus`]: a guard that turns faults in memory a client shrank into
//!   zero pages instead of a dead daemon.
//! - [`pci`]: the config space.
//! - [`socket`]: the listening socket and a connection (messages with
//!   their descriptors).

// Unsafe code only in `sigbus` (the signal handler and its table) and
// where `dma` registers a mapping with it.
#![deny(unsafe_code)]

pub mod dma;
pub mod irq;
pub mod pci;
pub mod proto;
pub mod session;
pub mod sigbus;
pub mod socket;

pub use session::{Bus, Function, Mmap, Region, Session};

/// How a server treats its clients; every default suits QEMU.
#[derive(Clone, Debug, Default)]
pub struct Config {
    /// The listening socket's and its connections'.
    pub socket: socket::SocketConfig,
    /// What a client may map.
    pub dma: dma::DmaConfig,
}

/// Tests that must watch a process die (or survive what would kill it) run
/// their scenario in a child: the test binary again, running only that
/// test, told by an environment variable that it is the child.
#[cfg(test)]
mod child {
    use std::process::{Command, ExitStatus, Stdio};

    const VAR: &str = "VRDMA_TEST_CHILD";

    /// Whether this process is the child running test `name` (its path in
    /// the crate, `module::tests::name`).
    pub fn is(name: &str) -> bool {
        std::env::var(VAR).is_ok_and(|v| v == name)
    }

    /// Runs test `name` in a child; how the child ended.
    pub fn run(name: &str) -> ExitStatus {
        Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--test-threads=1", "--nocapture"])
            .env(VAR, name)
            .stdout(Stdio::null())
            .status()
            .unwrap()
    }
}
