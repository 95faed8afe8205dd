//! What the PVRDMA fuzz targets share: a transport that sends nothing
//! anywhere (a fuzzed device must not put packets on a real network) and
//! a function built on it.

#![allow(dead_code)]

use std::{
    fs::File,
    io,
    os::fd::{AsFd, BorrowedFd},
    sync::OnceLock,
};

use std::os::unix::net::UnixStream;

use vrdma_device::{Transport, transport::Lent};
use vrdma_engine::transmit::{MAX_PACKET, Transmit};
use vrdma_fabric::Lender;
use vrdma_fabric::eth::{EthPort, Link, SourceFilter, Stream};
use vrdma_pvrdma::{Pvrdma, caps::Limits};
use vrdma_wire::frame::IpRepr;

/// A transport whose packets vanish and which never receives.
pub struct Null {
    slot: Vec<u8>,
    pub queued: u64,
}

impl Null {
    pub fn new() -> Self {
        Null {
            slot: vec![0; MAX_PACKET],
            queued: 0,
        }
    }
}

/// A descriptor that never becomes readable.
fn dev_null() -> BorrowedFd<'static> {
    static FILE: OnceLock<File> = OnceLock::new();
    FILE.get_or_init(|| File::open("/dev/null").expect("/dev/null"))
        .as_fd()
}

impl Transport for Null {
    fn receive(
        &mut self,
        _deliver: impl FnMut(&IpRepr, &[u8], Option<&vrdma_fabric::shm::Loan>),
    ) -> io::Result<usize> {
        Ok(0)
    }

    fn batch(&self) -> usize {
        1
    }

    fn rx_bytes(&self) -> u64 {
        0
    }

    fn slot(&mut self, _mem: &impl Lender) -> (&mut [u8], usize) {
        (&mut self.slot, 0)
    }

    fn queue(&mut self, _t: &Transmit, lent: &Lent<'_>, mem: &impl Lender) -> usize {
        // What a real port would read: the lent pieces (the engine checked
        // them against an MR; memory gone since is a dropped datagram).
        for p in lent.pieces {
            if let Some(s) = mem.lend(p.addr, p.len) {
                let mut b = [0u8; 64];
                let n = s.len().min(b.len());
                let _ = s.subslice(0, n).map(|v| v.copy_to(&mut b[..n]));
            }
        }
        self.queued += 1;
        0
    }

    fn flush(&mut self, _mem: &impl Lender) -> usize {
        0
    }

    fn fd(&self) -> BorrowedFd<'_> {
        dev_null()
    }

    fn counters(&self, out: &mut Vec<(String, u64)>) {
        out.push(("null.queued".into(), self.queued));
    }
}

/// A PVRDMA function with the default limits on a [`Null`] transport.
pub fn function() -> Pvrdma<Null> {
    let limits = Limits::default();
    let mut port = vrdma_engine::attr::PortAttr::with_gids(&[]);
    port.gids = vec![None; limits.gid_tbl_len as usize];
    Pvrdma::new(limits, [2, 0, 0, 0, 0, 1], port, Null::new()).expect("the default limits")
}

/// A PVRDMA function with the default limits on an Ethernet port whose
/// guest NIC and uplink are the far ends of socket pairs the caller holds
/// (nothing reaches a real network; what the device sends to its own
/// addresses loops back into it). The port checks what the guest sends
/// (its MAC; 127.0.0.1, the seeds' GID, and fd00::1 as its addresses).
pub fn eth_function() -> (Pvrdma<EthPort>, UnixStream, UnixStream) {
    let (guest, guest_peer) = UnixStream::pair().expect("socketpair");
    let (uplink, uplink_peer) = UnixStream::pair().expect("socketpair");
    for s in [&guest_peer, &uplink_peer] {
        s.set_nonblocking(true).expect("non-blocking");
    }
    let link = Link::Stream(Stream::new(uplink).expect("stream"));
    let mut port = EthPort::with_stream(guest, link, MAC).expect("port");
    port.set_filter(SourceFilter {
        mac: true,
        addrs: vec![
            "127.0.0.1".parse().expect("address"),
            "fd00::1".parse().expect("address"),
        ],
    });
    let limits = Limits::default();
    let mut attr = vrdma_engine::attr::PortAttr::with_gids(&[]);
    attr.gids = vec![None; limits.gid_tbl_len as usize];
    let f = Pvrdma::new(limits, MAC, attr, port).expect("the default limits");
    (f, guest_peer, uplink_peer)
}

/// A virtio-rdma device on an Ethernet port like [`eth_function`]'s.
pub fn eth_virtio() -> (
    vrdma_virtio::face::VirtioRdma<EthPort>,
    UnixStream,
    UnixStream,
) {
    let (guest, guest_peer) = UnixStream::pair().expect("socketpair");
    let (uplink, uplink_peer) = UnixStream::pair().expect("socketpair");
    for s in [&guest_peer, &uplink_peer] {
        s.set_nonblocking(true).expect("non-blocking");
    }
    let link = Link::Stream(Stream::new(uplink).expect("stream"));
    let mut port = EthPort::with_stream(guest, link, MAC).expect("port");
    port.set_filter(SourceFilter {
        mac: true,
        addrs: vec![
            "127.0.0.1".parse().expect("address"),
            "fd00::1".parse().expect("address"),
        ],
    });
    let mut attr = vrdma_engine::attr::PortAttr::with_gids(&[]);
    attr.gids = vec![None; 16];
    let opts = vrdma_virtio::face::Options {
        mac: MAC,
        ..Default::default()
    };
    let f = vrdma_virtio::face::VirtioRdma::new(opts, attr, port);
    (f, guest_peer, uplink_peer)
}

/// The guest NIC's MAC in [`eth_function`].
pub const MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

/// Whether to say what each step did (`VRDMA_FUZZ_TRACE=1`, for checking
/// that a seed does what it was written to do).
pub fn trace() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("VRDMA_FUZZ_TRACE").is_some())
}
