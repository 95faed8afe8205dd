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
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
};

use vrdma_device::transport::SameHost;
use vrdma_engine::attr::Mtu;
use vrdma_fabric::{shm::Switch, udp::UdpPort};
use vrdma_pvrdma::{
    Server,
    abi::{PAGE_SIZE, qp_type, send_flags, wr_opcode},
};
use vrdma_testkit::pvrdma::{Guest, GuestCq, GuestQp, function, mac_of, rc_up_mtu, sge, wqe};
use vrdma_wire::Gid;

use crate::port::{Port, layout};

/// Guest RAM of each side.
const RAM: u64 = 32 << 20;
/// The virtual address of each side's buffer MR.
const VA: u64 = 0x7f00_0000_0000;

/// A device served on a vfio-user socket in a thread of its own, at MTU
/// 4096; stopped when dropped.
pub struct Device {
    pub addr: IpAddr,
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The device thread's id.
    pub tid: i32,
}

impl Device {
    /// A device at `addr` (on `switch`, when given) with shared doorbells
    /// (`shared`) or trapped.
    pub fn new(addr: IpAddr, name: &str, shared: bool, switch: Option<Switch>) -> Self {
        let socket =
            std::env::temp_dir().join(format!("vrdma-faces-{}-{name}.sock", std::process::id()));
        let _ = std::fs::remove_file(&socket);
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let (path, halt, name) = (socket.clone(), stop.clone(), name.to_owned());
        let thread = std::thread::Builder::new()
            .name(format!("vfio-{name}"))
            .spawn(move || {
                let port = UdpPort::bind(vrdma_fabric::udp::Config::new(addr))
                    .expect("binding the UDP port");
                let port = SameHost::with(switch.as_ref(), port).expect("joining the switch");
                let mut f = function(port, mac_of(addr), Mtu::Mtu4096);
                if shared {
                    f.share_doorbells().expect("sharing the doorbell pages");
                }
                let mut server = Server::bind_with(&path, f, &name, &Default::default())
                    .expect("binding the device's socket");
                let _ = tx.send(crate::threads::tid());
                server.run(&halt).expect("the device's loop");
                if std::env::var_os("FACES_SPIN").is_some() {
                    let c: Vec<_> = server
                        .counters()
                        .into_iter()
                        .filter(|(k, _)| k.starts_with("spin."))
                        .collect();
                    eprintln!("{name}: {c:?}");
                }
            })
            .expect("a device thread");
        let tid = rx.recv().expect("the device thread bound its socket");
        Device {
            addr,
            socket,
            stop,
            thread: Some(thread),
            tid,
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
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
    /// Trapped doorbells: each post is a doorbell write (a vfio-user
    /// message and its reply).
    trapped: bool,
}

/// A guest on `dev`: the driver's probe, the device's address as GID 0, a
/// PD, the DMA MR, a CQ of 256, an RC QP 256 deep, the buffer and a user
/// MR over it.
fn side(dev: &Device, trapped: bool) -> PvrdmaPort {
    let mut g = Guest::connect(&dev.socket, RAM);
    assert_eq!(g.probe(), 0, "ACTIVATE");
    g.bind_gid(0, Gid::from(dev.addr));
    let pd = g.create_pd(0);
    let (_, lkey) = g.dma_mr(pd);
    let cq = g.create_cq(256, 0);
    let qp = g.create_qp(qp_type::RC, pd, cq.handle, cq.handle, 256);
    let pages = layout::LEN / PAGE_SIZE;
    let buf = g.alloc(pages);
    let list: Vec<u64> = (0..pages).map(|i| buf + i * PAGE_SIZE).collect();
    let (_, _, rkey) = g.user_mr(pd, VA, &list, 1 | 2 | 4 | 8);
    PvrdmaPort {
        g,
        cq,
        qp,
        lkey,
        buf,
        rkey,
        peer_rkey: 0,
        trapped,
    }
}

/// Guests on `da` and `db`, their QPs connected at MTU 4096.
pub fn pair(da: &Device, db: &Device, trapped: bool) -> (PvrdmaPort, PvrdmaPort) {
    let (mut a, mut b) = (side(da, trapped), side(db, trapped));
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

    fn ring(&mut self) {
        if self.trapped {
            self.g.ring_qp(&self.qp, vrdma_pvrdma::abi::uar::QP_SEND);
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
