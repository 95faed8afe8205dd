//! The virtio-rdma face: two devices, each on a UDP port and served over
//! vhost-user by `vrdma_virtio::server::Server` in a thread of its own (as
//! `vrdma serve --device kind=virtio` serves one), or as virtio-pci
//! functions over vfio-user (`kind=virtio-pci`), and on each a guest
//! played by the test kit's front-end and driver (`vrdma_testkit::virtio`):
//! WQEs written into the QP's ring in guest memory, the doorbell rung as
//! the spec says, completions read from the CQ's ring.

use std::{net::IpAddr, sync::Arc};

use vm_memory::{Bytes, GuestAddress};
use vrdma_device::transport::SameHost;
use vrdma_engine::attr::Mtu;
use vrdma_fabric::{shm::Switch, udp::UdpPort};
use vrdma_testkit::virtio::{
    ALL_ACCESS, Endpoint, Frontend, Mr, Options as FrontendOptions, Path, Qp, QpSpec, Ram, Wqe,
    mac_of, serve, serve_pci,
};
use vrdma_virtio::{abi::qp_type, face::Options, vhost::DEFAULT_SPIN};
use vrdma_wire::Gid;

use crate::{
    port::{Port, layout},
    threads,
};

/// Guest memory of each side (and [`IDLE_QP_RAM`] for each idle QP).
const RAM: u64 = 64 << 20;
const IDLE_QP_RAM: u64 = 48 << 10;

/// A device served on a vhost-user socket in a thread of its own (the
/// kit's), at MTU 4096 (the kit's suites' devices are at 1024); stopped
/// when dropped.
pub type Device = vrdma_testkit::virtio::Device<SameHost<UdpPort>>;

/// The same device as a virtio-pci function served over vfio-user (its
/// loop in a thread of its own, as `vrdma serve --device kind=virtio-pci`).
pub type PciDevice = vrdma_testkit::virtio::PciDevice<SameHost<UdpPort>>;

/// A device at `addr` (on `switch`, when given) whose doorbells are
/// polled (`poll`) or kicked.
pub fn device(addr: IpAddr, name: &str, poll: bool, switch: Option<&Switch>) -> Device {
    let (port, opts) = port(addr, poll, switch);
    serve(name, addr, Mtu::Mtu4096, opts, DEFAULT_SPIN, port)
}

/// [`device`] as a virtio-pci function.
pub fn pci_device(addr: IpAddr, name: &str, poll: bool, switch: Option<&Switch>) -> Arc<PciDevice> {
    let (port, opts) = port(addr, poll, switch);
    let dev = serve_pci(name, addr, Mtu::Mtu4096, opts, DEFAULT_SPIN, port);
    // The engine's memory for objects is not what is measured (the idle
    // QPs of `--idle-qps` are more than a small guest's share).
    dev.with_face(|f| f.set_budget(vrdma_device::ObjectBudget::Unlimited));
    Arc::new(dev)
}

fn port(addr: IpAddr, poll: bool, switch: Option<&Switch>) -> (SameHost<UdpPort>, Options) {
    let port = UdpPort::bind(vrdma_fabric::udp::Config::new(addr)).expect("binding the UDP port");
    let port = SameHost::with(switch, port).expect("joining the switch");
    let opts = Options {
        mac: mac_of(addr),
        poll,
        ..Options::default()
    };
    (port, opts)
}

/// A device's counters, however it is served.
type Counters = Box<dyn Fn() -> Vec<(String, u64)> + Send>;

/// One side: the guest's objects, its QP, the buffer's MR and the peer's.
pub struct VirtioPort {
    side: Endpoint,
    qp: Qp,
    mr: Mr,
    peer: Mr,
    ram: Arc<Ram>,
    /// The device's counters (`vrdma stat`'s).
    counters: Counters,
    /// With nothing to post, ring the QP's doorbell once a millisecond
    /// (which keeps the device polling) instead of staying silent.
    ring_idle: bool,
}

/// A guest on `dev`: a context, PD, CQ (the kit's [`Endpoint`]), an MR over
/// the buffer and an RC QP 256 deep; and the device's worker threads
/// (the vhost-user backend's `vring_worker`, which runs its turns).
fn side(dev: &Device) -> (Endpoint, Qp, Mr, Vec<i32>) {
    let before = threads::snapshot().named("vring_worker");
    let fe = Frontend::connect(&dev.socket, Arc::new(Ram::new(0, RAM)));
    let workers = threads::snapshot()
        .named("vring_worker")
        .into_iter()
        .filter(|t| !before.contains(t))
        .collect();
    let (side, qp, mr) = objects(fe, dev.addr, 0);
    (side, qp, mr, workers)
}

/// A guest on a virtio-pci device with `idle` QPs more, never used, and
/// the device's thread.
fn pci_side(dev: &PciDevice, name: &str, idle: u32) -> (Endpoint, Qp, Mr, Vec<i32>) {
    let fe = Frontend::connect_pci(
        &dev.socket,
        Arc::new(Ram::new(0, RAM + u64::from(idle) * IDLE_QP_RAM)),
        FrontendOptions::default(),
    );
    let workers = threads::snapshot().named(&format!("dev-{name}"));
    let (side, qp, mr) = objects(fe, dev.addr, idle);
    (side, qp, mr, workers)
}

/// The guest's objects on a started front-end, and `idle` QPs more.
fn objects(fe: Frontend, addr: IpAddr, idle: u32) -> (Endpoint, Qp, Mr) {
    let mut side = Endpoint::on(fe, Gid::from(addr));
    let mr = side.fe.reg_mr(&side.ctx, side.pd, layout::LEN, ALL_ACCESS);
    let spec = QpSpec {
        sq_entries: 256,
        rq_entries: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline: 0,
        ..QpSpec::new(qp_type::RC, side.cq.handle)
    };
    let qp = side.fe.qp(&side.ctx, side.pd, &spec);
    // The idle QPs in contexts of their own, 1024 a context (a context's
    // doorbell area has room for 4096 doorbells), as many processes'
    // would be.
    let mut left = idle;
    while left > 0 {
        let ctx = side.fe.context(4096);
        let pd = side.fe.pd(&ctx);
        let cq = side.fe.cq(&ctx, 128);
        // Rings of one page each (128-byte send WQEs, 32-byte receives).
        let small = QpSpec {
            sq_entries: 32,
            rq_entries: 128,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline: 0,
            ..QpSpec::new(qp_type::RC, cq.handle)
        };
        let n = left.min(1024);
        for _ in 0..n {
            let _ = side.fe.qp(&ctx, pd, &small);
        }
        left -= n;
    }
    (side, qp, mr)
}

/// INIT → RTR → RTS towards `dest` at `dgid`, as the kit's `connect` but
/// at MTU 4096.
fn bring_up(s: &mut Endpoint, qp: &Qp, dest: u32, dgid: Gid) {
    s.fe.qp_init(&s.ctx, qp, ALL_ACCESS);
    let path = Path {
        mtu: 5,
        ..Path::new(dest, dgid)
    };
    s.fe.try_qp_rtr_to(&s.ctx, qp, &path)
        .unwrap_or_else(|st| panic!("QP {} to RTR refused: {st:?}", qp.qpn));
    s.fe.qp_rts(&s.ctx, qp);
}

/// Guests on `da` and `db`, their QPs connected; and each device's worker
/// threads.
pub fn pair(
    da: &Device,
    db: &Device,
    ring_idle: bool,
) -> ((VirtioPort, Vec<i32>), (VirtioPort, Vec<i32>)) {
    let counters = |d: &Device| -> Counters {
        let b = d.backend.clone();
        Box::new(move || b.counters())
    };
    connected(side(da), side(db), [counters(da), counters(db)], ring_idle)
}

/// Guests on virtio-pci devices `da` and `db` (named `na`, `nb`), their
/// QPs connected, and `idle` QPs more on each; and each device's thread.
pub fn pci_pair(
    da: &Arc<PciDevice>,
    db: &Arc<PciDevice>,
    names: [&str; 2],
    idle: u32,
) -> ((VirtioPort, Vec<i32>), (VirtioPort, Vec<i32>)) {
    let counters = |d: &Arc<PciDevice>| -> Counters {
        let d = d.clone();
        Box::new(move || d.counters())
    };
    connected(
        pci_side(da, names[0], idle),
        pci_side(db, names[1], idle),
        [counters(da), counters(db)],
        false,
    )
}

type SideParts = (Endpoint, Qp, Mr, Vec<i32>);

fn connected(
    (mut a, qa, ma, wa): SideParts,
    (mut b, qb, mb, wb): SideParts,
    [ca, cb]: [Counters; 2],
    ring_idle: bool,
) -> ((VirtioPort, Vec<i32>), (VirtioPort, Vec<i32>)) {
    let (ga, gb) = (a.gid, b.gid);
    bring_up(&mut a, &qa, qb.qpn, gb);
    bring_up(&mut b, &qb, qa.qpn, ga);
    let port = |side: Endpoint, qp, mr, peer, counters| VirtioPort {
        ram: side.fe.ram.clone(),
        counters,
        side,
        qp,
        mr,
        peer,
        ring_idle,
    };
    ((port(a, qa, ma, mb, ca), wa), (port(b, qb, mb, ma, cb), wb))
}

impl Port for VirtioPort {
    fn post_write(&mut self, wr_id: u64, src: u64, len: u32, dst: u64, signaled: bool) {
        let mut w = Wqe::write(
            wr_id,
            &[self.mr.sge(src, len)],
            self.peer.addr(dst),
            self.peer.rkey,
        );
        if !signaled {
            w = w.unsignaled();
        }
        self.qp.sq.push(&self.ram, &w.bytes());
    }

    fn ring(&mut self) {
        self.qp.door.ring(self.qp.doorbell);
    }

    fn idle(&mut self) {
        self.ring();
        std::thread::sleep(std::time::Duration::from_millis(1));
    }

    fn needs_thread(&self) -> bool {
        self.ring_idle
    }

    fn poll(&mut self, out: &mut Vec<(u64, u32)>) {
        while let Some(c) = self.side.cq.poll() {
            out.push((c.wr_id.get(), u32::from(c.status)));
        }
    }

    fn put(&mut self, off: u64, data: &[u8]) {
        self.ram.write(self.mr.gpa + off, data);
    }

    fn get(&self, off: u64, len: usize) -> Vec<u8> {
        self.ram.read_bytes(self.mr.gpa + off, len)
    }

    fn byte(&self, off: u64) -> u8 {
        let mut b = [0u8];
        self.ram
            .mem
            .read_slice(&mut b, GuestAddress(self.mr.gpa + off))
            .expect("reading guest memory");
        b[0]
    }

    fn retry_timeouts(&self) -> Option<u64> {
        (self.counters)()
            .into_iter()
            .find(|(k, _)| k == "engine.retry_timeout")
            .map(|(_, n)| n)
    }

    fn kick(&mut self) {
        self.qp.door.kick();
    }

    fn kicks(&self) -> Option<u64> {
        Some(
            self.side
                .fe
                .kicker
                .kicks
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }
}
