//! The virtio-rdma face's test kit (feature `virtio`): a guest as a
//! virtio-rdma device sees it, with no QEMU — a vhost-user front-end
//! playing the VMM, and the driver on top — and devices served on UDP
//! ports, as `vrdma serve` serves them, each in a thread of its own.
//!
//! | module | what |
//! |---|---|
//! | [`ram`] | guest memory: a sealed memfd mapped here and given to the device, pages handed out once |
//! | [`vq`] | a split virtqueue in guest memory, the driver's side: chains, kicks, used entries waited for against a deadline |
//! | [`frontend`] | the vhost-user front-end (rust-vmm `vhost`): negotiation, configuration, memory table, the four virtqueues, reconnection; the controlq's commands, the eventq's events and the notifyq's notifications |
//! | [`verbs`] | the driver's verbs over it: contexts and doorbells, PDs, MRs, windows, CQs (poll, arm), QPs (post, modify), SRQs; WQEs built from the ABI's structures; two QPs connected, an exchange checked byte for byte |
//! | `verbs::codes` | the verbs' numbers: attribute-mask bits, QP states, completion statuses and opcodes, the kit's access, Q_Key and PSN |
//! | `verbs::wqe` | WQEs built from the ABI's structures: SGEs, receive and send WQEs, address vectors |
//! | `verbs::objects` | the driver's side of the objects: doorbell areas and contexts, MRs, CQs (poll, arm), work rings, QPs and SRQs (post) |
//! | `verbs::commands` | the controlq's commands as front-end methods: contexts, PDs, MRs, windows, CQs, SRQs, QPs (make, modify) |
//! | `verbs::endpoint` | a side of a test ([`Endpoint`]), two QPs connected, an exchange checked byte for byte |
//!
//! Devices are made through a test binary's [`Net`] (`static NET: Net =
//! Net::new(N)`, addresses 127.N.x.y), as the PVRDMA kit's are; the blocks
//! taken are listed in `pvrdma`'s doc too (25 and up are this kit's suites):
//!
//! | block | binary |
//! |---|---|
//! | 127.25 | `vrdma-virtio/tests/operations.rs` |
//! | 127.26 | `vrdma-virtio/tests/lifecycle.rs` |
//! | 127.27 | `vrdma-virtio/tests/hostile.rs` |
//! | 127.28 | `vrdma-tools/tests/faces_interop.rs` (its PVRDMA devices too) |
//! | 127.29, 127.30 | `vrdma-virtio/tests/{operations_pci,pci}.rs` (a [`PciNet`]) |
//! | 127.31–33 | `vrdma-virtio/tests/memory.rs` (32 and 33: its children's) |
//!
//! This is test code: a failure is the test's, so it panics, saying what
//! failed.

pub mod frontend;
pub mod pci;
pub mod ram;
pub mod verbs;
pub mod vq;

use std::{
    net::IpAddr,
    os::unix::net::UnixListener,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

pub use crate::addrs::mac_of;
pub use frontend::{Frontend, Options, Status, WAIT};
pub use ram::{PAGE, Ram};
pub use verbs::*;
use vrdma_device::Transport;
use vrdma_engine::attr::{Mtu, PortAttr};
use vrdma_fabric::udp::UdpPort;
use vrdma_virtio::{
    face::{FaceStats, VirtioRdma},
    pci::VirtioPci,
    server::{Server, Stop},
    vhost::Backend,
};
use vrdma_wire::Gid;

/// A test binary's block of loopback addresses, 127.N.0.0/16.
#[derive(Debug)]
pub struct Net {
    block: crate::addrs::Block,
}

impl Net {
    pub const fn new(block: u8) -> Self {
        assert!(block >= 25, "blocks below 25 are the PVRDMA suites'");
        Net {
            block: crate::addrs::Block::new(block),
        }
    }

    /// An address no other device of this binary has.
    pub fn addr(&self) -> IpAddr {
        self.block.addr()
    }

    /// A device with the default options (polling doorbells, spinning
    /// 200 µs).
    pub fn device(&self, name: &str) -> Device {
        self.device_with(
            name,
            vrdma_virtio::face::Options::default(),
            vrdma_virtio::vhost::DEFAULT_SPIN,
        )
    }

    /// A device with face options `opts` and spin period `spin`.
    pub fn device_with(
        &self,
        name: &str,
        opts: vrdma_virtio::face::Options,
        spin: Duration,
    ) -> Device {
        self.device_on(name, opts, spin, |port| port)
    }

    /// A device with face options `opts` and spin period `spin` whose
    /// transport `wrap` makes of its UDP port (a wrapper such as the
    /// PVRDMA kit's `Tripwire`).
    pub fn device_on<T: Transport + Send + 'static>(
        &self,
        name: &str,
        mut opts: vrdma_virtio::face::Options,
        spin: Duration,
        wrap: impl FnOnce(UdpPort) -> T,
    ) -> Device<T> {
        let (addr, port) = self.port(&mut opts);
        serve(name, addr, Mtu::Mtu1024, opts, spin, wrap(port))
    }

    /// A device with the default options whose VMM's memory is held to
    /// `limits`, and whose face `setup` configures (a guest size, a budget)
    /// before it is served.
    pub fn device_limited(
        &self,
        name: &str,
        limits: vrdma_virtio::vhost::MemoryLimits,
        setup: impl FnOnce(&mut VirtioRdma<UdpPort>),
    ) -> Device {
        let mut opts = vrdma_virtio::face::Options::default();
        let (addr, port) = self.port(&mut opts);
        let mut attr = PortAttr::with_gids(&[]);
        attr.active_mtu = Mtu::Mtu1024;
        let mut face = VirtioRdma::new(opts, attr, port);
        setup(&mut face);
        let backend = Backend::with_limits(face, vrdma_virtio::vhost::DEFAULT_SPIN, limits)
            .expect("a backend");
        serve_backend(name, addr, backend)
    }

    /// A fresh address, its UDP port, and the MAC in `opts` made its.
    fn port(&self, opts: &mut vrdma_virtio::face::Options) -> (IpAddr, UdpPort) {
        let addr = self.addr();
        opts.mac = crate::virtio::mac_of(addr);
        let port =
            UdpPort::bind(vrdma_fabric::udp::Config::new(addr)).expect("binding the UDP port");
        (addr, port)
    }
}

/// A device on `port` (a UDP port at `addr`, or what wraps one) with
/// active MTU `mtu`, served on a vhost-user socket of a fresh directory
/// in a thread of its own: the test suites' devices, and a device at an
/// address outside the loopback blocks (the interop example's).
pub fn serve<T: Transport + Send + 'static>(
    name: &str,
    addr: IpAddr,
    mtu: Mtu,
    opts: vrdma_virtio::face::Options,
    spin: Duration,
    port: T,
) -> Device<T> {
    let mut attr = PortAttr::with_gids(&[]);
    attr.active_mtu = mtu;
    let face = VirtioRdma::new(opts, attr, port);
    let backend = Backend::new(face, spin).expect("a backend");
    serve_backend(name, addr, backend)
}

/// `backend`, served as [`serve`] serves a device's.
pub fn serve_backend<T: Transport + Send + 'static>(
    name: &str,
    addr: IpAddr,
    backend: Arc<Backend<T>>,
) -> Device<T> {
    let dir = std::env::temp_dir().join(format!("vrdma-virtio-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a socket directory");
    let socket = dir.join("rdma.sock");
    let listener = UnixListener::bind(&socket).expect("binding the device's socket");
    let server = Server::new(name, listener, backend.clone()).expect("a server");
    let stop = server.stopper();
    let thread = std::thread::Builder::new()
        .name(format!("dev-{name}"))
        .spawn(move || server.run())
        .expect("a device thread");
    Device {
        addr,
        socket,
        dir,
        backend,
        stop,
        thread: Some(thread),
    }
}

/// A test binary's block of loopback addresses whose devices are served
/// as virtio-pci functions over vfio-user (§13.3) instead of over
/// vhost-user: the same suites run on either transport.
#[derive(Debug)]
pub struct PciNet(Net);

impl PciNet {
    pub const fn new(block: u8) -> Self {
        PciNet(Net::new(block))
    }

    pub fn addr(&self) -> IpAddr {
        self.0.addr()
    }

    /// A device with the default options.
    pub fn device(&self, name: &str) -> PciDevice {
        self.device_with(
            name,
            vrdma_virtio::face::Options::default(),
            vrdma_virtio::vhost::DEFAULT_SPIN,
        )
    }

    pub fn device_with(
        &self,
        name: &str,
        opts: vrdma_virtio::face::Options,
        spin: Duration,
    ) -> PciDevice {
        self.device_on(name, opts, spin, |port| port)
    }

    /// As [`Net::device_on`].
    pub fn device_on<T: Transport + Send + 'static>(
        &self,
        name: &str,
        mut opts: vrdma_virtio::face::Options,
        spin: Duration,
        wrap: impl FnOnce(UdpPort) -> T,
    ) -> PciDevice<T> {
        let (addr, port) = self.0.port(&mut opts);
        serve_pci(name, addr, Mtu::Mtu1024, opts, spin, wrap(port))
    }
}

/// A device a test's guest connects to, over either transport.
pub trait GuestDevice {
    /// A front-end on guest memory of `size` bytes, the device started.
    fn connect(&self, size: u64) -> Frontend;
    /// The device's address as a GID.
    fn gid(&self) -> Gid;
}

impl<T: Transport + Send + 'static> GuestDevice for Device<T> {
    fn connect(&self, size: u64) -> Frontend {
        Device::connect(self, size)
    }

    fn gid(&self) -> Gid {
        Device::gid(self)
    }
}

impl<T: Transport + Send + 'static> GuestDevice for PciDevice<T> {
    fn connect(&self, size: u64) -> Frontend {
        PciDevice::connect(self, size)
    }

    fn gid(&self) -> Gid {
        PciDevice::gid(self)
    }
}

type PciServer<T> = vrdma_face::vfio::Server<VirtioPci<T>>;

/// A device on `port` served as a virtio-pci function on a vfio-user
/// socket of a fresh directory, in a thread of its own (the loop `vrdma
/// serve` runs for it).
pub fn serve_pci<T: Transport + Send + 'static>(
    name: &str,
    addr: IpAddr,
    mtu: Mtu,
    opts: vrdma_virtio::face::Options,
    spin: Duration,
    port: T,
) -> PciDevice<T> {
    let mut attr = PortAttr::with_gids(&[]);
    attr.active_mtu = mtu;
    let face = VirtioRdma::new(opts, attr, port);
    let function = VirtioPci::new(face, spin);
    let dir = std::env::temp_dir().join(format!("vrdma-vpci-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a socket directory");
    let socket = dir.join("rdma.sock");
    let server = PciServer::bind(&socket, function, name).expect("binding the device's socket");
    let waker = server.waker();
    let server = Arc::new(Mutex::new(server));
    let stop = Arc::new(AtomicBool::new(false));
    let waiting = Arc::new(AtomicU32::new(0));
    let thread = pci_loop(name, &server, &stop, &waiting);
    PciDevice {
        name: name.to_owned(),
        addr,
        socket,
        dir,
        server,
        waker,
        waiting,
        stop,
        thread: Mutex::new(Some(thread)),
    }
}

/// The device's thread: its server's turns until `stop`.
fn pci_loop<T: Transport + Send + 'static>(
    name: &str,
    server: &Arc<Mutex<PciServer<T>>>,
    stop: &Arc<AtomicBool>,
    waiting: &Arc<AtomicU32>,
) -> JoinHandle<std::io::Result<()>> {
    let (s, st, w) = (server.clone(), stop.clone(), waiting.clone());
    std::thread::Builder::new()
        .name(format!("dev-{name}"))
        .spawn(move || {
            while !st.load(Ordering::Relaxed) {
                // A test thread that wants the device goes first.
                while w.load(Ordering::SeqCst) > 0 {
                    std::thread::yield_now();
                }
                lock(&s).turn()?;
            }
            Ok(())
        })
        .expect("a device thread")
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A device served as a virtio-pci function in a thread of its own;
/// stopped (and its thread joined) when dropped.
#[derive(Debug)]
pub struct PciDevice<T: Transport + Send + 'static = UdpPort> {
    name: String,
    pub addr: IpAddr,
    pub socket: PathBuf,
    dir: PathBuf,
    server: Arc<Mutex<PciServer<T>>>,
    waker: vrdma_face::vfio::Waker,
    /// Test threads waiting for the device between two of its turns.
    waiting: Arc<AtomicU32>,
    stop: Arc<AtomicBool>,
    /// The server's thread, until it is stopped (or the device is
    /// [`PciDevice::hold`]: then whoever holds it steps it).
    thread: Mutex<Option<JoinHandle<std::io::Result<()>>>>,
}

impl<T: Transport + Send + 'static> PciDevice<T> {
    pub fn gid(&self) -> Gid {
        Gid::from(self.addr)
    }

    /// The server, between two of the device's turns.
    fn server(&self) -> std::sync::MutexGuard<'_, PciServer<T>> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        self.waker.wake();
        let g = lock(&self.server);
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        g
    }

    /// Runs `f` on the face (between two of the device's turns).
    pub fn with_face<R>(&self, f: impl FnOnce(&mut VirtioRdma<T>) -> R) -> R {
        f(self.server().function_mut().face_mut())
    }

    /// Runs `f` on the function.
    pub fn with_function<R>(&self, f: impl FnOnce(&mut VirtioPci<T>) -> R) -> R {
        f(self.server().function_mut())
    }

    /// The face's counters now.
    pub fn stats(&self) -> FaceStats {
        self.with_face(|f| f.stats())
    }

    /// The transport's counters now.
    pub fn pci_stats(&self) -> vrdma_virtio::pci::PciStats {
        self.with_function(|f| f.stats)
    }

    /// The device's counters for `vrdma stat`, the server's included.
    pub fn counters(&self) -> Vec<(String, u64)> {
        self.server().counters()
    }

    /// A front-end on guest memory of `size` bytes, the device started.
    pub fn connect(&self, size: u64) -> Frontend {
        self.connect_with(Arc::new(Ram::new(0, size)), Options::default())
    }

    pub fn connect_with(&self, ram: Arc<Ram>, opts: Options) -> Frontend {
        Frontend::connect_pci(&self.socket, ram, opts)
    }

    /// Whether the server thread still runs.
    pub fn alive(&self) -> bool {
        lock(&self.thread)
            .as_ref()
            .is_some_and(|t| !t.is_finished())
    }

    /// Ends the server's thread: from now on the device moves only when
    /// [`PciDevice::step`] is called (a bench advancing driver and device
    /// in turn on one thread).
    pub fn hold(&self) -> std::io::Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        self.waker.wake();
        let thread = lock(&self.thread).take();
        match thread {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the device thread panicked"))),
            None => Ok(()),
        }
    }

    /// A held device's thread again (its client's goodbye needs a device
    /// that answers).
    pub fn resume(&self) {
        let mut thread = lock(&self.thread);
        if thread.is_none() {
            self.stop.store(false, Ordering::Relaxed);
            *thread = Some(pci_loop(
                &self.name,
                &self.server,
                &self.stop,
                &self.waiting,
            ));
        }
    }

    /// One turn of a held device that never sleeps
    /// ([`vrdma_face::vfio::Server::step`]): whether it did work.
    pub fn step(&self) -> std::io::Result<bool> {
        lock(&self.server).step()
    }

    /// Stops the server and returns what its thread returned.
    pub fn stop(mut self) -> std::io::Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> std::io::Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        self.waker.wake();
        let thread = self
            .thread
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let r = match thread {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the device thread panicked"))),
            None => Ok(()),
        };
        let _ = std::fs::remove_dir_all(&self.dir);
        r
    }
}

impl<T: Transport + Send + 'static> Drop for PciDevice<T> {
    fn drop(&mut self) {
        // Held or stopped already: the socket's directory still goes.
        let _ = self.finish();
    }
}

/// A device served on a vhost-user socket in a thread of its own; stopped
/// (and its thread joined) when dropped. Its transport is a UDP port, or
/// what [`Net::device_on`] made of one.
#[derive(Debug)]
pub struct Device<T: Transport + Send + 'static = UdpPort> {
    pub addr: IpAddr,
    pub socket: PathBuf,
    dir: PathBuf,
    pub backend: Arc<Backend<T>>,
    stop: Arc<Stop>,
    thread: Option<JoinHandle<std::io::Result<()>>>,
}

impl<T: Transport + Send + 'static> Device<T> {
    pub fn gid(&self) -> Gid {
        Gid::from(self.addr)
    }

    /// The face's counters now.
    pub fn stats(&self) -> FaceStats {
        self.backend.with_face(|f| f.stats())
    }

    /// A front-end on guest memory of `size` bytes.
    pub fn connect(&self, size: u64) -> Frontend {
        Frontend::connect(&self.socket, Arc::new(Ram::new(0, size)))
    }

    /// A front-end on `ram` asking for `opts`.
    pub fn connect_with(&self, ram: Arc<Ram>, opts: Options) -> Frontend {
        Frontend::connect_with(&self.socket, ram, opts)
    }

    /// Runs `f` on the face.
    pub fn with_face<R>(&self, f: impl FnOnce(&mut VirtioRdma<T>) -> R) -> R {
        self.backend.with_face(f)
    }

    /// Ends the current connection only, as a VMM that goes away.
    pub fn drop_connection(&self) {
        self.stop.drop_connection();
    }

    /// Whether the server thread still runs.
    pub fn alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops the server and returns what its thread returned.
    pub fn stop(mut self) -> std::io::Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> std::io::Result<()> {
        self.stop.stop();
        let r = match self.thread.take() {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the device thread panicked"))),
            None => Ok(()),
        };
        let _ = std::fs::remove_dir_all(&self.dir);
        r
    }
}

impl<T: Transport + Send + 'static> Drop for Device<T> {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.finish();
        }
    }
}
