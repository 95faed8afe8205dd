//! The VMM and the guest's virtio-pci transport, as a virtio-rdma device
//! served as a PCI function over vfio-user sees them (docs/virtio-rdma.md
//! §13.3): a vfio-user client, as QEMU's `vfio-user-pci`, that maps the
//! guest's memory and hands the MSI-X vectors' eventfds, and the transport
//! half of Linux's `virtio_pci_modern` — the virtio capabilities found in
//! config space, the status handshake, the features, each queue set up
//! through the common configuration.
//!
//! A "VMM" thread carries what KVM and QEMU carry for a guest: a store to a
//! queue's notify address (here, a write to the queue's kick eventfd, which
//! the driver half of the kit writes as over vhost-user) becomes a
//! REGION_WRITE to that address, and an MSI-X vector the device raises
//! becomes the used-buffer interrupt of the queues bound to it (the
//! queue's call eventfd, which the kit's virtqueues wait on).

use std::{
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    os::unix::net::UnixStream,
    path::Path,
    sync::{Arc, Mutex},
    thread::JoinHandle,
};

use nix::sys::eventfd::{EfdFlags, EventFd as NixEventFd};
use vmm_sys_util::{
    epoll::{ControlOperation, Epoll, EpollEvent, EventSet},
    eventfd::{EFD_NONBLOCK, EventFd},
};
use vrdma_vfio_user::{
    pci::CAP_VENDOR,
    proto::{
        self, DmaMap, Header, IrqSet, RegionAccess, VersionHead, cmd as vcmd, flags, irq,
        irq_index, region,
    },
    socket::Client,
};
use vrdma_virtio::pci::{NO_VECTOR, VECTORS, device_status as st};
use zerocopy::{FromBytes, IntoBytes};

use super::{ram::Ram, vq::Vq};

/// A vfio-user client: one request at a time, each answered.
#[derive(Debug)]
pub struct VfioClient {
    conn: Client,
    id: u16,
}

impl VfioClient {
    /// Connects to `socket` and agrees on the protocol's version.
    pub fn connect(socket: &Path) -> Self {
        let stream = UnixStream::connect(socket).expect("connecting to the device");
        let mut c = VfioClient {
            conn: Client::new(stream).expect("the client"),
            id: 0,
        };
        let mut v = VersionHead { major: 0, minor: 0 }.as_bytes().to_vec();
        v.extend_from_slice(b"{\"capabilities\":{\"max_msg_fds\":16}}\0");
        c.ok(vcmd::VERSION, &v, &[]);
        c
    }

    /// Sends a message and returns the reply's header and payload.
    pub fn request(
        &mut self,
        command: u16,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> (Header, Vec<u8>) {
        self.id = self.id.wrapping_add(1);
        let h = Header {
            id: self.id,
            command,
            size: (proto::HEADER_LEN + payload.len()) as u32,
            flags: 0,
            error: 0,
        };
        let mut msg = h.as_bytes().to_vec();
        msg.extend_from_slice(payload);
        self.conn.send(&msg, fds).expect("sending");
        let r = self.conn.receive().expect("receiving").expect("a reply");
        assert_eq!(r.header.id, self.id, "the reply to the request sent");
        (r.header, r.payload)
    }

    /// A message that must succeed; its reply's payload.
    pub fn ok(&mut self, command: u16, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Vec<u8> {
        let (h, p) = self.request(command, payload, fds);
        assert_eq!(
            h.flags & flags::ERROR,
            0,
            "command {command}: error {}",
            h.error
        );
        p
    }

    /// `len` bytes at `offset` of region `index`.
    pub fn read(&mut self, index: u32, offset: u64, len: usize) -> Vec<u8> {
        let a = RegionAccess {
            offset,
            region: index,
            count: len as u32,
        };
        let r = self.ok(vcmd::REGION_READ, a.as_bytes(), &[]);
        r[size_of::<RegionAccess>()..].to_vec()
    }

    /// Writes `data` at `offset` of region `index`, waiting for the
    /// device to take it.
    pub fn write(&mut self, index: u32, offset: u64, data: &[u8]) {
        let mut p = RegionAccess {
            offset,
            region: index,
            count: data.len() as u32,
        }
        .as_bytes()
        .to_vec();
        p.extend_from_slice(data);
        self.ok(vcmd::REGION_WRITE, &p, &[]);
    }

    pub fn read_u(&mut self, index: u32, offset: u64, len: usize) -> u64 {
        let b = self.read(index, offset, len);
        let mut w = [0u8; 8];
        w[..len].copy_from_slice(&b);
        u64::from_le_bytes(w)
    }

    pub fn write_u(&mut self, index: u32, offset: u64, len: usize, v: u64) {
        self.write(index, offset, &v.to_le_bytes()[..len]);
    }
}

/// Where the virtio structures are (found from the capabilities): BAR and
/// offsets, and the notify multiplier.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Layout {
    pub bar: u32,
    pub common: u64,
    pub notify: u64,
    pub multiplier: u64,
    pub isr: u64,
    pub device: u64,
    /// The PCI configuration access capability's offset in config space.
    pub pci_cfg: u64,
}

/// Common configuration offsets (VIRTIO 1.2 §4.1.4.3).
pub mod common {
    pub const DEVICE_FEATURE_SELECT: u64 = 0x00;
    pub const DEVICE_FEATURE: u64 = 0x04;
    pub const DRIVER_FEATURE_SELECT: u64 = 0x08;
    pub const DRIVER_FEATURE: u64 = 0x0c;
    pub const CONFIG_MSIX_VECTOR: u64 = 0x10;
    pub const NUM_QUEUES: u64 = 0x12;
    pub const DEVICE_STATUS: u64 = 0x14;
    pub const QUEUE_SELECT: u64 = 0x16;
    pub const QUEUE_SIZE: u64 = 0x18;
    pub const QUEUE_MSIX_VECTOR: u64 = 0x1a;
    pub const QUEUE_ENABLE: u64 = 0x1c;
    pub const QUEUE_NOTIFY_OFF: u64 = 0x1e;
    pub const QUEUE_DESC: u64 = 0x20;
    pub const QUEUE_DRIVER: u64 = 0x28;
    pub const QUEUE_DEVICE: u64 = 0x30;
}

/// The guest's side of the function: the client (shared with the VMM
/// thread), the structures' layout, the MSI-X vectors.
#[derive(Debug)]
pub struct PciLink {
    pub client: Arc<Mutex<VfioClient>>,
    pub layout: Layout,
    /// The MSI-X vectors' eventfds (the device raises them).
    vectors: Vec<Arc<NixEventFd>>,
    /// Configuration-change interrupts seen (vector 0).
    pub config_interrupts: Arc<std::sync::atomic::AtomicU64>,
    vmm: Option<(EventFd, JoinHandle<()>)>,
}

/// The MSI-X vector the kit binds each queue to: the configuration's is
/// 0, the controlq's 1, the eventq's 2, the notifyq's 3; the doorbellq
/// interrupts never.
pub const QUEUE_VECTORS: [u16; 4] = [1, 2, 3, NO_VECTOR];

impl PciLink {
    /// Connects as QEMU's `vfio-user-pci` does: the guest's memory mapped
    /// at its address, an eventfd per MSI-X vector, memory space and bus
    /// mastering on; then finds the virtio capabilities.
    pub fn connect(socket: &Path, ram: &Ram) -> Self {
        let mut c = VfioClient::connect(socket);
        let m = DmaMap {
            argsz: 32,
            flags: proto::dma::READ | proto::dma::WRITE,
            offset: 0,
            addr: ram.base,
            size: ram.size,
        };
        c.ok(vcmd::DMA_MAP, m.as_bytes(), &[ram.file.as_fd()]);
        let vectors: Vec<Arc<NixEventFd>> = (0..VECTORS)
            .map(|_| Arc::new(NixEventFd::from_flags(EfdFlags::EFD_NONBLOCK).expect("eventfd")))
            .collect();
        let set = IrqSet {
            argsz: 20,
            flags: irq::DATA_EVENTFD | irq::ACTION_TRIGGER,
            index: irq_index::MSIX,
            start: 0,
            count: VECTORS,
        };
        let fds: Vec<BorrowedFd<'_>> = vectors.iter().map(|v| v.as_fd()).collect();
        c.ok(vcmd::DEVICE_SET_IRQS, set.as_bytes(), &fds);
        // Memory space and bus mastering.
        c.write(region::CONFIG, 4, &6u16.to_le_bytes());
        let layout = find_layout(&mut c);
        PciLink {
            client: Arc::new(Mutex::new(c)),
            layout,
            vectors,
            config_interrupts: Arc::default(),
            vmm: None,
        }
    }

    /// The client, for one request or several.
    pub fn client(&self) -> std::sync::MutexGuard<'_, VfioClient> {
        self.client
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A common configuration field of `len` bytes.
    pub fn common_read(&self, field: u64, len: usize) -> u64 {
        let l = self.layout;
        self.client().read_u(l.bar, l.common + field, len)
    }

    pub fn common_write(&self, field: u64, len: usize, v: u64) {
        let l = self.layout;
        self.client().write_u(l.bar, l.common + field, len, v);
    }

    pub fn status(&self) -> u8 {
        self.common_read(common::DEVICE_STATUS, 1) as u8
    }

    pub fn set_status(&self, v: u8) {
        self.common_write(common::DEVICE_STATUS, 1, u64::from(v));
    }

    /// The 64 features the device offers.
    pub fn device_features(&self) -> u64 {
        let mut f = 0;
        for sel in 0..2u64 {
            self.common_write(common::DEVICE_FEATURE_SELECT, 4, sel);
            f |= self.common_read(common::DEVICE_FEATURE, 4) << (32 * sel);
        }
        f
    }

    pub fn set_driver_features(&self, f: u64) {
        for sel in 0..2u64 {
            self.common_write(common::DRIVER_FEATURE_SELECT, 4, sel);
            self.common_write(common::DRIVER_FEATURE, 4, (f >> (32 * sel)) & 0xffff_ffff);
        }
    }

    /// The device configuration's `len` bytes at `offset`, read as the
    /// driver reads it (4 bytes at a time).
    pub fn device_config(&self, len: usize) -> Vec<u8> {
        let l = self.layout;
        let mut out = Vec::new();
        for at in (0..len).step_by(4) {
            out.extend(self.client().read(l.bar, l.device + at as u64, 4));
        }
        out.truncate(len);
        out
    }

    /// Resets the device (status 0) and waits until it reads 0 again.
    pub fn reset(&self) {
        self.set_status(0);
        assert_eq!(self.status(), 0, "a reset completes when status reads 0");
    }

    /// Features: ACKNOWLEDGE, DRIVER, the driver's features, FEATURES_OK.
    /// Returns whether the device kept FEATURES_OK.
    pub fn negotiate(&self, features: u64) -> bool {
        self.set_status(st::ACKNOWLEDGE);
        self.set_status(st::ACKNOWLEDGE | st::DRIVER);
        self.set_driver_features(features);
        self.set_status(st::ACKNOWLEDGE | st::DRIVER | st::FEATURES_OK);
        self.status() & st::FEATURES_OK != 0
    }

    /// Sets queue `q` up with `vq`'s rings and the kit's vector for it,
    /// and enables it.
    pub fn setup_queue(&self, vq: &Vq) {
        let q = u64::from(vq.index);
        self.common_write(common::QUEUE_SELECT, 2, q);
        let max = self.common_read(common::QUEUE_SIZE, 2);
        assert!(
            u64::from(vq.size) <= max,
            "queue {q}: size {} over the device's {max}",
            vq.size
        );
        assert_eq!(
            self.common_read(common::QUEUE_NOTIFY_OFF, 2),
            q,
            "queue {q}'s notify page"
        );
        self.common_write(common::QUEUE_SIZE, 2, u64::from(vq.size));
        for (field, addr) in [
            (common::QUEUE_DESC, vq.desc),
            (common::QUEUE_DRIVER, vq.avail),
            (common::QUEUE_DEVICE, vq.used),
        ] {
            // As Linux writes them: two 32-bit halves.
            self.common_write(field, 4, addr & 0xffff_ffff);
            self.common_write(field + 4, 4, addr >> 32);
        }
        let v = QUEUE_VECTORS[usize::from(vq.index)];
        self.common_write(common::QUEUE_MSIX_VECTOR, 2, u64::from(v));
        assert_eq!(
            self.common_read(common::QUEUE_MSIX_VECTOR, 2),
            u64::from(v),
            "queue {q}'s vector taken"
        );
        self.common_write(common::QUEUE_ENABLE, 2, 1);
    }

    /// The configuration's vector.
    pub fn setup_config_vector(&self) {
        self.common_write(common::CONFIG_MSIX_VECTOR, 2, 0);
        assert_eq!(self.common_read(common::CONFIG_MSIX_VECTOR, 2), 0);
    }

    /// (Re)starts the VMM thread for these queues: kicks to notify
    /// addresses, vectors to the queues' call eventfds.
    pub fn start_vmm(&mut self, queues: [&Vq; 4]) {
        self.stop_vmm();
        let stop = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let epoll = Epoll::new().expect("epoll");
        let add = |fd: i32, token: u64| {
            epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, token),
                )
                .expect("epoll_ctl");
        };
        let kicks: Vec<EventFd> = queues
            .iter()
            .map(|q| q.kick.try_clone().expect("dup"))
            .collect();
        let calls: Vec<EventFd> = queues
            .iter()
            .map(|q| q.call.try_clone().expect("dup"))
            .collect();
        for (i, k) in kicks.iter().enumerate() {
            add(k.as_raw_fd(), i as u64);
        }
        for (v, e) in self.vectors.iter().enumerate() {
            add(e.as_fd().as_raw_fd(), 16 + v as u64);
        }
        add(stop.as_raw_fd(), 99);
        let vectors = self.vectors.clone();
        let client = self.client.clone();
        let layout = self.layout;
        let config = self.config_interrupts.clone();
        let t = std::thread::Builder::new()
            .name("vmm".into())
            .spawn(move || {
                let mut ev = [EpollEvent::default(); 16];
                loop {
                    let n = match epoll.wait(-1, &mut ev) {
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => panic!("the VMM thread's epoll: {e}"),
                    };
                    for e in &ev[..n] {
                        match e.data() {
                            99 => return,
                            q @ 0..4 => {
                                let _ = kicks[q as usize].read();
                                let at = layout.notify + q * layout.multiplier;
                                client
                                    .lock()
                                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                                    .write_u(layout.bar, at, 2, q);
                            }
                            t => {
                                let v = (t - 16) as usize;
                                let _ = vectors[v].read();
                                if v == 0 {
                                    config.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                }
                                for (q, &qv) in QUEUE_VECTORS.iter().enumerate() {
                                    if usize::from(qv) == v {
                                        let _ = calls[q].write(1);
                                    }
                                }
                            }
                        }
                    }
                }
            })
            .expect("the VMM thread");
        self.vmm = Some((stop, t));
    }

    fn stop_vmm(&mut self) {
        if let Some((stop, t)) = self.vmm.take() {
            stop.write(1).expect("stopping the VMM thread");
            t.join().expect("the VMM thread");
        }
    }

    /// Whether MSI-X vector `v` was raised since last asked (taken).
    pub fn take_vector(&self, v: usize) -> bool {
        self.vectors[v].read().is_ok()
    }
}

impl Drop for PciLink {
    fn drop(&mut self) {
        self.stop_vmm();
    }
}

/// Walks the capability list for the virtio structures.
fn find_layout(c: &mut VfioClient) -> Layout {
    let cfg = c.read(region::CONFIG, 0, 256);
    let mut l = Layout::default();
    let mut at = cfg[0x34] as usize;
    let mut seen = 0;
    while at != 0 {
        assert!(at + 16 <= 256 && seen < 48, "a capability list that ends");
        seen += 1;
        if cfg[at] == CAP_VENDOR {
            let kind = cfg[at + 3];
            let bar = u32::from(cfg[at + 4]);
            let off = u64::from(u32::read_from_bytes(&cfg[at + 8..at + 12]).expect("4"));
            match kind {
                1 => (l.bar, l.common) = (bar, off),
                2 => {
                    l.notify = off;
                    l.multiplier =
                        u64::from(u32::read_from_bytes(&cfg[at + 16..at + 20]).expect("4"));
                }
                3 => l.isr = off,
                4 => l.device = off,
                5 => l.pci_cfg = at as u64,
                _ => {}
            }
        }
        at = cfg[at + 1] as usize;
    }
    l
}
