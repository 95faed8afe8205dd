//! The PVRDMA face: two devices, each on a UDP port and served over
//! vfio-user by `vrdma_pvrdma::Server` in a thread of its own (as `vrdma
//! serve` serves one), with shared doorbells (`doorbells=shared`: BAR2 is
//! memory and the device thread polls every ring each round, so a post is
//! the WQE and the ring's producer index, no doorbell write); on each a
//! guest played by the test kit's model of the Linux driver
//! (`vrdma_testkit::pvrdma::Guest`).

use std::{
    net::IpAddr,
    path::PathBuf,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
};

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vrdma_device::{ObjectBudget, transport::SameHost};
use vrdma_engine::attr::{Mtu, PortAttr};
use vrdma_fabric::{shm::Switch, udp::UdpPort};
use vrdma_face::vfio::Waker;
use vrdma_pvrdma::{
    Pvrdma, Server,
    abi::{PAGE_SIZE, qp_type, send_flags, uar, wr_opcode},
    caps::Limits,
};
use vrdma_testkit::pvrdma::{Guest, GuestCq, GuestQp, mac_of, rc_up_mtu, sge, wqe};
use vrdma_wire::Gid;

use crate::port::{Port, layout};

/// Guest RAM of each side (and [`IDLE_QP_RAM`] for each idle QP).
const RAM: u64 = 32 << 20;
const IDLE_QP_RAM: u64 = 8 * PAGE_SIZE;
/// The QPs a device has room for unless more are asked for (the PVRDMA
/// face's default).
pub const MAX_QP: u32 = 1024;
/// The virtual address of each side's buffer MR.
const VA: u64 = 0x7f00_0000_0000;

/// A device served on a vfio-user socket in a thread of its own, at MTU
/// 4096; stopped when dropped. [`Device::hold`] ends the thread, and the
/// device then moves only when [`Device::step`] is called (the stepped
/// mode).
pub struct Device {
    pub addr: IpAddr,
    socket: PathBuf,
    server: Arc<Mutex<Served>>,
    waker: Waker,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The device thread's id.
    pub tid: i32,
    name: String,
}

type Served = Server<SameHost<UdpPort>>;

fn lock(m: &Mutex<Served>) -> MutexGuard<'_, Served> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Device {
    /// A device at `addr` (on `switch`, when given) with shared doorbells
    /// (`shared`) or trapped, and room for `max_qp` QPs.
    pub fn new(
        addr: IpAddr,
        name: &str,
        shared: bool,
        switch: Option<Switch>,
        max_qp: u32,
    ) -> Self {
        let socket =
            std::env::temp_dir().join(format!("vrdma-faces-{}-{name}.sock", std::process::id()));
        let _ = std::fs::remove_file(&socket);
        let port =
            UdpPort::bind(vrdma_fabric::udp::Config::new(addr)).expect("binding the UDP port");
        let port = SameHost::with(switch.as_ref(), port).expect("joining the switch");
        let limits = Limits {
            max_qp,
            ..Limits::default()
        };
        let mut attr = PortAttr::with_gids(&[]);
        attr.active_mtu = Mtu::Mtu4096;
        let mut f = Pvrdma::new(limits, mac_of(addr), attr, port).expect("the device's limits");
        if shared {
            f.share_doorbells().expect("sharing the doorbell pages");
        }
        // The engine's memory for objects is not what is measured (the
        // idle QPs of `--idle-qps` are more than a small guest's share).
        f.set_object_budget(ObjectBudget::Unlimited);
        let server = Server::bind_with(&socket, f, name, &Default::default())
            .expect("binding the device's socket");
        let waker = server.waker();
        let server = Arc::new(Mutex::new(server));
        let stop = Arc::new(AtomicBool::new(false));
        let (thread, tid) = device_loop(name, &server, &stop);
        Device {
            addr,
            socket,
            server,
            waker,
            stop,
            thread: Some(thread),
            tid,
            name: name.to_owned(),
        }
    }

    /// Ends the device's thread (its turns from now on are
    /// [`Device::step`]'s).
    pub fn hold(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.waker.wake();
        if let Some(t) = self.thread.take() {
            t.join().expect("the device thread");
        }
    }

    /// The held device's thread again (the guest's goodbye needs a device
    /// that answers).
    pub fn resume(&mut self) {
        if self.thread.is_none() {
            self.stop.store(false, Ordering::Relaxed);
            let (thread, tid) = device_loop(&self.name, &self.server, &self.stop);
            self.thread = Some(thread);
            self.tid = tid;
        }
    }

    /// A stepping of the held device: each call one turn that never
    /// sleeps; whether it did work.
    pub fn stepper(&self) -> Box<dyn FnMut() -> bool + Send> {
        let server = self.server.clone();
        Box::new(move || lock(&server).step().expect("the device's step"))
    }
}

/// The device's thread, serving until `stop`, and its id.
fn device_loop(
    name: &str,
    server: &Arc<Mutex<Served>>,
    stop: &Arc<AtomicBool>,
) -> (JoinHandle<()>, i32) {
    let (tx, rx) = mpsc::channel();
    let (served, halt) = (server.clone(), stop.clone());
    let thread = std::thread::Builder::new()
        .name(format!("vfio-{name}"))
        .spawn(move || {
            let _ = tx.send(crate::threads::tid());
            // As `Server::run`: its looks at the guest's memory keep
            // their intervals.
            vrdma_face::spin::precise_timers();
            while !halt.load(Ordering::Relaxed) {
                lock(&served).turn().expect("the device's turn");
            }
        })
        .expect("a device thread");
    (thread, rx.recv().expect("the device thread started"))
}

impl Drop for Device {
    fn drop(&mut self) {
        self.hold();
        if std::env::var_os("FACES_SPIN").is_some() {
            let c: Vec<_> = lock(&self.server)
                .counters()
                .into_iter()
                .filter(|(k, _)| k.starts_with("spin."))
                .collect();
            eprintln!("{}: {c:?}", self.name);
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// One side: the guest, its CQ and QP, the buffer (guest-physical, reached
/// locally through the DMA MR's lkey) and the peer's buffer MR's rkey.
pub struct PvrdmaPort {
    g: Guest,
    cq: GuestCq,
    qp: GuestQp,
    lkey: u32,
    buf: u64,
    rkey: u32,
    peer_rkey: u32,
    /// Shared doorbells: the doorbell pages as the guest maps them (BAR2 at
    /// [`BELLS`]), where the driver's doorbell stores land; none when they
    /// trap (each post a doorbell write: a vfio-user message and its
    /// reply).
    bells: Option<GuestMemoryMmap<()>>,
}

/// Where the guest maps the doorbell pages (only their offsets matter).
const BELLS: u64 = 0x8000_0000;

/// A guest on `dev`: the driver's probe, the device's address as GID 0, a
/// PD, the DMA MR, a CQ of 256, an RC QP 256 deep, the buffer and a user
/// MR over it.
fn side(dev: &Device, trapped: bool, idle: u32) -> PvrdmaPort {
    let mut g = Guest::connect(&dev.socket, RAM + u64::from(idle) * IDLE_QP_RAM);
    assert_eq!(g.probe(), 0, "ACTIVATE");
    g.bind_gid(0, Gid::from(dev.addr));
    let pd = g.create_pd(0);
    let (_, lkey) = g.dma_mr(pd);
    let cq = g.create_cq(256, 0);
    let qp = g.create_qp(qp_type::RC, pd, cq.handle, cq.handle, 256);
    // QPs that are made and never used: each a ring the device would
    // look at if it read every ring.
    for _ in 0..idle {
        let _ = g.create_qp(qp_type::RC, pd, cq.handle, cq.handle, 1);
    }
    let pages = layout::LEN / PAGE_SIZE;
    let buf = g.alloc(pages);
    let list: Vec<u64> = (0..pages).map(|i| buf + i * PAGE_SIZE).collect();
    let (_, _, rkey) = g.user_mr(pd, VA, &list, 1 | 2 | 4 | 8);
    let bells = if trapped {
        None
    } else {
        Some(
            g.map_doorbells(BELLS)
                .expect("the doorbell pages are shared"),
        )
    };
    PvrdmaPort {
        g,
        cq,
        qp,
        lkey,
        buf,
        rkey,
        peer_rkey: 0,
        bells,
    }
}

/// Guests on `da` and `db`, their QPs connected at MTU 4096, and `idle`
/// QPs more on each, never used.
pub fn pair(da: &Device, db: &Device, trapped: bool, idle: u32) -> (PvrdmaPort, PvrdmaPort) {
    let (mut a, mut b) = (side(da, trapped, idle), side(db, trapped, idle));
    a.peer_rkey = b.rkey;
    b.peer_rkey = a.rkey;
    let (ga, gb) = (Gid::from(da.addr), Gid::from(db.addr));
    rc_up_mtu(&mut a.g, &a.qp, gb, b.qp.qpn, mac_of(db.addr), 5);
    rc_up_mtu(&mut b.g, &b.qp, ga, a.qp.qpn, mac_of(da.addr), 5);
    (a, b)
}

impl Port for PvrdmaPort {
    fn post_write(&mut self, wr_id: u64, src: u64, len: u32, dst: u64, signaled: bool) {
        let flags = if signaled { send_flags::SIGNALED } else { 0 };
        let mut w = wqe(wr_id, wr_opcode::RDMA_WRITE, flags, 1);
        w.wr[0] = (VA + dst).into();
        w.wr[1] = u64::from(self.peer_rkey).into();
        let s = sge(self.buf + src, len, self.lkey);
        self.g.write_send(&mut self.qp, &w, &[s]);
    }

    /// The doorbell as Linux's vmw_pvrdma rings it after a post (a 32-bit
    /// store of the QP's handle and SEND at offset 0 of its page): trapped,
    /// a vfio-user message; shared, a store into the page.
    fn ring(&mut self) {
        let bell = self.qp.handle | uar::QP_SEND;
        match &self.bells {
            None => self.g.ring_qp(&self.qp, uar::QP_SEND),
            Some(m) => m
                .write_obj(bell, GuestAddress(BELLS + self.qp.uar * PAGE_SIZE))
                .expect("a store into the doorbell page"),
        }
    }

    fn poll(&mut self, out: &mut Vec<(u64, u32)>) {
        for c in self.g.poll(&mut self.cq) {
            out.push((c.wr_id.get(), c.status.get()));
        }
    }

    fn put(&mut self, off: u64, data: &[u8]) {
        self.g.put(self.buf + off, data);
    }

    fn get(&self, off: u64, len: usize) -> Vec<u8> {
        self.g.get(self.buf + off, len)
    }

    fn byte(&self, off: u64) -> u8 {
        self.g.get(self.buf + off, 1)[0]
    }
}
