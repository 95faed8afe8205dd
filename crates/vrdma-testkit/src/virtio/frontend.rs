//! The VMM and the guest driver's virtio half, as a virtio-rdma device
//! sees them: a vhost-user front-end (rust-vmm's `vhost` crate) that
//! negotiates features, reads the configuration, gives the device the
//! guest's memory and its four virtqueues, and then — as the driver —
//! sends the spec's commands on the controlq, keeps the eventq and the
//! notifyq stocked and reads what the device puts there, and kicks the
//! doorbellq.

use std::{
    collections::{HashMap, VecDeque},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use vhost::{
    VhostBackend, VhostUserMemoryRegionInfo, VringConfigData,
    vhost_user::{
        Frontend as Conn, VhostUserFrontend,
        message::{VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserProtocolFeatures},
    },
};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
use vrdma_virtio::abi::{self, feature, op, status, vq as vqi};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use super::{
    pci::PciLink,
    ram::{PAGE, Ram},
    vq::{Buf, Vq},
};

/// How long a test waits for anything the device does by default.
pub const WAIT: Duration = Duration::from_secs(10);

/// `VHOST_USER_F_PROTOCOL_FEATURES`.
const PROTOCOL_FEATURES: u64 = 1 << 30;

/// What a front-end asks for.
#[derive(Clone, Debug)]
pub struct Options {
    /// Accept VIRTIO_RDMA_F_DOORBELL_POLL when offered.
    pub poll: bool,
    /// Accept VIRTIO_F_RING_EVENT_IDX when offered.
    pub event_idx: bool,
    /// Buffers kept posted on the eventq and on the notifyq.
    pub buffers: u16,
    /// Accept VIRTIO_F_VERSION_1 (a legacy driver does not).
    pub version_1: bool,
    /// Accept VIRTIO_RDMA_F_STATS when offered.
    pub stats: bool,
    /// Negotiate VHOST_USER_PROTOCOL_F_CONFIGURE_MEM_SLOTS (memory
    /// regions added and removed one at a time: ADD_MEM_REG, REM_MEM_REG).
    pub mem_slots: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            poll: true,
            event_idx: true,
            buffers: 64,
            version_1: true,
            stats: true,
            mem_slots: false,
        }
    }
}

/// How the driver kicks the doorbellq: shared with every context, and
/// replaced when the front-end reconnects.
#[derive(Debug)]
pub struct Kicker {
    fd: Mutex<EventFd>,
    /// VIRTIO_RDMA_F_DOORBELL_POLL was negotiated.
    pub poll: AtomicBool,
    /// Kicks so far.
    pub kicks: AtomicU64,
}

impl Kicker {
    pub fn kick(&self) {
        self.kicks.fetch_add(1, Ordering::Relaxed);
        self.fd
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .write(1)
            .expect("kicking the doorbellq");
    }
}

/// A refused command: the response's status and detail (errno).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Status {
    pub status: u16,
    pub detail: u32,
}

/// How the front-end reaches the device.
pub enum Link {
    /// A vhost-user connection (QEMU's `vhost-user-test-device-pci`).
    VhostUser(Conn),
    /// A virtio-pci function over vfio-user (QEMU's `vfio-user-pci`).
    Pci(PciLink),
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Link::VhostUser(_) => f.write_str("VhostUser"),
            Link::Pci(p) => f.debug_tuple("Pci").field(&p.layout).finish(),
        }
    }
}

/// The front-end: its link to the device, the guest's memory and its
/// four virtqueues.
pub struct Frontend {
    pub socket: PathBuf,
    pub ram: Arc<Ram>,
    pub link: Link,
    pub opts: Options,
    /// Features the device offered and those negotiated.
    pub offered: u64,
    pub features: u64,
    pub protocol: VhostUserProtocolFeatures,
    pub config: abi::Config,
    pub control: Vq,
    pub eventq: Vq,
    pub notifyq: Vq,
    pub doorbellq: Vq,
    pub kicker: Arc<Kicker>,
    req: u64,
    req_room: u64,
    resp: u64,
    event_bufs: HashMap<u16, u64>,
    notify_bufs: HashMap<u16, u64>,
    /// Events and notifications read and not yet taken by the test.
    pub events: VecDeque<abi::Event>,
    pub notifications: VecDeque<abi::Notification>,
    /// Used buffers of the eventq or notifyq with `len` other than the
    /// item's size.
    pub short_items: u64,
}

/// The virtqueue sizes: the controlq's, the eventq's and notifyq's, the
/// doorbellq's (the smallest: it never holds a buffer).
const CONTROL_SIZE: u16 = 64;
const ITEM_SIZE: u16 = 128;
const DOORBELL_SIZE: u16 = 2;

impl Frontend {
    /// Connects to the device at `socket` with guest memory `ram`, set up
    /// as QEMU and the driver set a device up.
    pub fn connect(socket: &Path, ram: Arc<Ram>) -> Self {
        Self::connect_with(socket, ram, Options::default())
    }

    pub fn connect_with(socket: &Path, ram: Arc<Ram>, opts: Options) -> Self {
        let mut fe = Self::negotiated(socket, ram, opts);
        fe.start_queues([0; 4]);
        // The eventq and the notifyq stocked before DRIVER_OK (§5 step 4).
        let n = fe.opts.buffers;
        fe.stock(n, n);
        fe
    }

    /// Connected and negotiated (features, protocol features,
    /// configuration), with no memory table and no queue yet: what a VMM
    /// has done before SET_MEM_TABLE.
    pub fn negotiated(socket: &Path, ram: Arc<Ram>, opts: Options) -> Self {
        let link = Link::VhostUser(
            Conn::connect(socket, vqi::COUNT as u64).expect("connecting to the device"),
        );
        let mut fe = Self::assemble(socket, ram, opts, link);
        fe.negotiate();
        fe
    }

    /// A front-end on `link`: fresh queues and command buffers in `ram`,
    /// nothing negotiated yet.
    fn assemble(socket: &Path, ram: Arc<Ram>, opts: Options, link: Link) -> Self {
        let [control, eventq, notifyq, doorbellq] = fresh_queues(&ram);
        let req_room = 64 * 1024;
        let req = ram.alloc(req_room, PAGE);
        let resp = ram.pages(1);
        let kicker = Arc::new(Kicker {
            fd: Mutex::new(doorbellq.kick.try_clone().expect("dup")),
            poll: AtomicBool::new(false),
            kicks: AtomicU64::new(0),
        });
        Frontend {
            socket: socket.to_path_buf(),
            ram,
            link,
            opts,
            offered: 0,
            features: 0,
            protocol: VhostUserProtocolFeatures::empty(),
            config: abi::Config::new_zeroed(),
            control,
            eventq,
            notifyq,
            doorbellq,
            kicker,
            req,
            req_room,
            resp,
            event_bufs: HashMap::new(),
            notify_bufs: HashMap::new(),
            events: VecDeque::new(),
            notifications: VecDeque::new(),
            short_items: 0,
        }
    }

    /// The vhost-user connection (a test of that transport's messages).
    pub fn conn(&mut self) -> &mut Conn {
        match &mut self.link {
            Link::VhostUser(c) => c,
            Link::Pci(_) => panic!("a vhost-user message on a virtio-pci front-end"),
        }
    }

    /// The virtio-pci link (a test of that transport).
    pub fn pci(&self) -> &PciLink {
        match &self.link {
            Link::Pci(p) => p,
            Link::VhostUser(_) => panic!("a virtio-pci access on a vhost-user front-end"),
        }
    }

    /// Posts `events` more buffers of 16 bytes on the eventq and
    /// `notifications` on the notifyq, and notifies each queue given
    /// some.
    pub fn stock(&mut self, events: u16, notifications: u16) {
        let page = self.ram.pages(u64::from(events).div_ceil(256).max(1));
        for k in 0..events {
            let at = page + 16 * u64::from(k);
            let h = self.eventq.add(&[Buf::w(at, 16)]);
            self.event_bufs.insert(h, at);
        }
        let page = self
            .ram
            .pages(u64::from(notifications).div_ceil(256).max(1));
        for k in 0..notifications {
            let at = page + 16 * u64::from(k);
            let h = self.notifyq.add(&[Buf::w(at, 16)]);
            self.notify_bufs.insert(h, at);
        }
        if events > 0 {
            self.eventq.notify();
        }
        if notifications > 0 {
            self.notifyq.notify();
        }
    }

    /// Features, protocol features, queues, configuration: what QEMU's
    /// vhost_dev_init and the driver's probe do.
    fn negotiate(&mut self) {
        self.conn().set_owner().expect("SET_OWNER");
        self.negotiate_features();
    }

    /// [`Frontend::negotiate`] past SET_OWNER.
    fn negotiate_features(&mut self) {
        self.offered = self.conn().get_features().expect("GET_FEATURES");
        assert!(
            self.offered & feature::VERSION_1 != 0,
            "the device must offer VERSION_1 (DEV-1)"
        );
        assert!(
            self.offered & PROTOCOL_FEATURES != 0,
            "the backend must offer VHOST_USER_F_PROTOCOL_FEATURES"
        );
        let offered = self
            .conn()
            .get_protocol_features()
            .expect("GET_PROTOCOL_FEATURES");
        let mut want = VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::RESET_DEVICE;
        if self.opts.mem_slots {
            want |= VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS;
        }
        assert!(
            offered.contains(want),
            "protocol features offered: {offered:?}"
        );
        self.protocol = want;
        self.conn()
            .set_protocol_features(want)
            .expect("SET_PROTOCOL_FEATURES");
        let queues = self.conn().get_queue_num().expect("GET_QUEUE_NUM");
        assert_eq!(queues, vqi::COUNT as u64, "GET_QUEUE_NUM (§13.1: 4)");
        // 64 bytes (never an offset or size the device would refuse: the
        // vhost crate's get_config never returns on the zero-size error
        // reply).
        let (_, cfg) = self
            .conn()
            .get_config(0, 64, VhostUserConfigFlags::WRITABLE, &[0; 64])
            .expect("GET_CONFIG");
        self.config = abi::Config::read_from_bytes(&cfg).expect("64 bytes");
        let f = PROTOCOL_FEATURES | self.wanted_features();
        self.features = f;
        self.kicker
            .poll
            .store(f & feature::DOORBELL_POLL != 0, Ordering::Relaxed);
        self.acked(|c| c.set_features(f)).expect("SET_FEATURES");
    }

    /// The features the driver accepts of those offered.
    fn wanted_features(&self) -> u64 {
        let mut f = 0;
        if self.opts.version_1 {
            f |= feature::VERSION_1;
        }
        if self.opts.event_idx {
            f |= self.offered & feature::RING_EVENT_IDX;
        }
        if self.opts.poll {
            f |= self.offered & feature::DOORBELL_POLL;
        }
        if self.opts.stats {
            f |= self.offered & feature::STATS;
        }
        f
    }

    /// Connects to a virtio-rdma device served as a virtio-pci function
    /// over vfio-user at `socket`, and starts it as Linux's
    /// `virtio_pci_modern` and the driver do: reset, features, the
    /// configuration, the four queues with their vectors, the eventq and
    /// the notifyq stocked, DRIVER_OK.
    pub fn connect_pci(socket: &Path, ram: Arc<Ram>, opts: Options) -> Self {
        let link = Link::Pci(PciLink::connect(socket, &ram));
        let mut fe = Self::assemble(socket, ram, opts, link);
        fe.start_pci();
        fe
    }

    /// The virtio-pci start-up, from a reset to DRIVER_OK.
    fn start_pci(&mut self) {
        use vrdma_virtio::pci::device_status as st;
        self.pci().reset();
        self.offered = self.pci().device_features();
        assert!(
            self.offered & feature::VERSION_1 != 0,
            "the device must offer VERSION_1 (DEV-1)"
        );
        let f = self.wanted_features();
        assert!(self.pci().negotiate(f), "FEATURES_OK refused for {f:#x}");
        self.features = f;
        self.kicker
            .poll
            .store(f & feature::DOORBELL_POLL != 0, Ordering::Relaxed);
        self.config =
            abi::Config::read_from_bytes(&self.pci().device_config(64)).expect("64 bytes");
        self.pci().setup_config_vector();
        for q in [&self.control, &self.eventq, &self.notifyq, &self.doorbellq] {
            self.pci().setup_queue(q);
        }
        let Link::Pci(p) = &mut self.link else {
            unreachable!("a virtio-pci front-end");
        };
        p.start_vmm([&self.control, &self.eventq, &self.notifyq, &self.doorbellq]);
        let n = self.opts.buffers;
        self.stock(n, n);
        self.pci()
            .set_status(st::ACKNOWLEDGE | st::DRIVER | st::FEATURES_OK | st::DRIVER_OK);
        let now = self.pci().status();
        assert_eq!(
            now & (st::DRIVER_OK | st::NEEDS_RESET),
            st::DRIVER_OK,
            "DRIVER_OK taken (status {now:#x})"
        );
    }

    /// Runs a message that has no reply of its own with NEED_REPLY set,
    /// so that the backend's refusal reaches the test.
    pub fn acked<R>(&mut self, f: impl FnOnce(&mut Conn) -> vhost::Result<R>) -> vhost::Result<R> {
        self.conn().set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        let r = f(self.conn());
        self.conn().set_hdr_flags(VhostUserHeaderFlag::empty());
        r
    }

    /// The memory table: the guest's one region.
    pub fn set_mem_table(&mut self) -> vhost::Result<()> {
        let region = VhostUserMemoryRegionInfo::from_guest_region(self.ram.region())
            .expect("a file-backed region");
        self.acked(|c| c.set_mem_table(&[region]).map(|_| ()))
    }

    /// A memory table of `view`'s one region instead (a VMM that
    /// replaced the guest's memory; `view` may map the same file or
    /// another). The test's own view stays `ram`.
    pub fn set_mem_table_to(&mut self, view: &Ram) -> vhost::Result<()> {
        let region = VhostUserMemoryRegionInfo::from_guest_region(view.region())
            .expect("a file-backed region");
        self.acked(|c| c.set_mem_table(&[region]).map(|_| ()))
    }

    /// A memory table of one region: `size` bytes at guest address `gpa`
    /// from `file` (at its start), which the VMM maps at `vmm` (the address
    /// vring messages name it by).
    pub fn set_mem_table_of(
        &mut self,
        gpa: u64,
        size: u64,
        vmm: u64,
        file: &impl std::os::fd::AsRawFd,
    ) -> vhost::Result<()> {
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: gpa,
            memory_size: size,
            userspace_addr: vmm,
            mmap_offset: 0,
            mmap_handle: file.as_raw_fd(),
        };
        self.acked(|c| c.set_mem_table(&[region]).map(|_| ()))
    }

    /// ADD_MEM_REG (with [`Options::mem_slots`]): `size` bytes at guest
    /// address `gpa` from `file`, which the VMM maps at `vmm`.
    pub fn add_mem_region(
        &mut self,
        gpa: u64,
        size: u64,
        vmm: u64,
        file: &impl std::os::fd::AsRawFd,
    ) -> vhost::Result<()> {
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: gpa,
            memory_size: size,
            userspace_addr: vmm,
            mmap_offset: 0,
            mmap_handle: file.as_raw_fd(),
        };
        self.acked(|c| c.add_mem_region(&region).map(|_| ()))
    }

    /// A guest address as the VMM's address the vring messages carry.
    pub fn vmm_addr(&self, gpa: u64) -> u64 {
        self.ram.region().as_ptr() as u64 + (gpa - self.ram.base)
    }

    /// The memory table and every queue, each from `base` (QEMU's
    /// vhost_dev_start and vhost_virtqueue_start).
    fn start_queues(&mut self, bases: [u16; 4]) {
        self.set_mem_table().expect("SET_MEM_TABLE");
        self.try_start_vrings(bases)
            .unwrap_or_else(|e| panic!("starting the virtqueues: {e}"));
    }

    /// Every queue set up and enabled from `base` (each message acked),
    /// stopping at the first the device refuses.
    pub fn try_start_vrings(&mut self, bases: [u16; 4]) -> vhost::Result<()> {
        for (i, base) in bases.into_iter().enumerate() {
            let (size, desc, avail, used) = {
                let q = self.queue(i);
                (q.size, q.desc, q.avail, q.used)
            };
            let addr = VringConfigData {
                queue_max_size: size,
                queue_size: size,
                flags: 0,
                desc_table_addr: self.vmm_addr(desc),
                used_ring_addr: self.vmm_addr(used),
                avail_ring_addr: self.vmm_addr(avail),
                log_addr: None,
            };
            self.acked(|c| c.set_vring_num(i, size))?;
            self.acked(|c| c.set_vring_base(i, base))?;
            self.acked(|c| c.set_vring_addr(i, &addr))?;
            let kick = self.queue(i).kick.try_clone().expect("dup");
            let call = self.queue(i).call.try_clone().expect("dup");
            self.acked(|c| c.set_vring_kick(i, &kick))?;
            self.acked(|c| c.set_vring_call(i, &call))?;
            self.acked(|c| c.set_vring_enable(i, true))?;
        }
        Ok(())
    }

    fn queue(&self, i: usize) -> &Vq {
        [&self.control, &self.eventq, &self.notifyq, &self.doorbellq][i]
    }

    /// The connection goes away (a VMM that died or was restarted) and a
    /// new one comes with the same guest memory and the same virtqueues,
    /// each resumed from what the device used (its used index: every
    /// chain before it was taken, in order).
    pub fn reconnect(&mut self) {
        self.control = self.control.reattach(&self.ram);
        self.eventq = self.eventq.reattach(&self.ram);
        self.notifyq = self.notifyq.reattach(&self.ram);
        self.doorbellq = self.doorbellq.reattach(&self.ram);
        *self
            .kicker
            .fd
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            self.doorbellq.kick.try_clone().expect("dup");
        let conn =
            Conn::connect(&self.socket, vqi::COUNT as u64).expect("reconnecting to the device");
        // The old connection closes: the device pauses, then serves this
        // one.
        drop(std::mem::replace(&mut self.link, Link::VhostUser(conn)));
        let used = |q: &Vq| self.ram.load_u16(q.used + 2, Ordering::Acquire);
        let bases = [
            used(&self.control),
            used(&self.eventq),
            used(&self.notifyq),
            0,
        ];
        self.negotiate();
        self.start_queues(bases);
    }

    /// Stops every queue as QEMU stops a vhost device (GET_VRING_BASE
    /// each): the device pauses. Returns the bases it reported.
    pub fn stop(&mut self) -> [u32; 4] {
        let mut b = [0; 4];
        for (i, v) in b.iter_mut().enumerate() {
            *v = self.conn().get_vring_base(i).expect("GET_VRING_BASE");
        }
        b
    }

    /// RESET_DEVICE (a system reset QEMU passes on); over virtio-pci,
    /// device status 0.
    pub fn reset_device(&mut self) {
        if let Link::Pci(p) = &self.link {
            p.reset();
            return;
        }
        self.acked(|c| c.reset_device()).expect("RESET_DEVICE");
    }

    /// RESET_DEVICE, then the device set up again as after a system
    /// reset: the features negotiated again, the four virtqueues fresh
    /// (new rings in guest memory, from index 0), the eventq and the
    /// notifyq stocked. Events and notifications read and not taken are
    /// forgotten.
    pub fn reset_and_restart(&mut self) {
        self.reset_device();
        [self.control, self.eventq, self.notifyq, self.doorbellq] = fresh_queues(&self.ram);
        *self
            .kicker
            .fd
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            self.doorbellq.kick.try_clone().expect("dup");
        self.event_bufs.clear();
        self.notify_bufs.clear();
        self.events.clear();
        self.notifications.clear();
        if matches!(self.link, Link::Pci(_)) {
            self.start_pci();
            return;
        }
        self.negotiate_features();
        self.start_queues([0; 4]);
        let n = self.opts.buffers;
        self.stock(n, n);
    }

    // --- the controlq ----------------------------------------------------

    /// One request as the device sees it: `req` in one driver-readable
    /// buffer, `room` device-writable bytes. Returns `used.len` and the
    /// bytes written.
    pub fn raw(&mut self, req: &[u8], room: u32) -> (u32, Vec<u8>) {
        self.raw_chain(req, &[room])
    }

    /// A request split over the buffers given (readable ones, then
    /// writable ones of the sizes `rooms` gives).
    pub fn raw_chain(&mut self, req: &[u8], rooms: &[u32]) -> (u32, Vec<u8>) {
        let n = req.len() as u64;
        if n > self.req_room {
            self.req_room = n.next_multiple_of(PAGE);
            self.req = self.ram.alloc(self.req_room, PAGE);
        }
        let total: u32 = rooms.iter().sum();
        let resp = if u64::from(total) > PAGE {
            self.ram.alloc(u64::from(total), PAGE)
        } else {
            self.resp
        };
        self.ram.write(self.req, req);
        self.ram.fill(resp, total as usize, 0xee);
        let mut bufs = Vec::new();
        if !req.is_empty() {
            bufs.push(Buf::r(
                self.req,
                u32::try_from(req.len()).expect("a request under 4 GiB"),
            ));
        }
        let mut at = resp;
        for &r in rooms {
            bufs.push(Buf::w(at, r));
            at += u64::from(r);
        }
        self.chain(&bufs)
    }

    /// Any chain on the controlq; waits for it to be used.
    pub fn chain(&mut self, bufs: &[Buf]) -> (u32, Vec<u8>) {
        let head = self.control.add(bufs);
        self.control.notify();
        let (h, len) = self
            .control
            .wait_used(Instant::now() + WAIT, "a command's response");
        assert_eq!(h, head, "the controlq uses requests in order (DEV-17)");
        let first = bufs.iter().find(|b| b.writable);
        let resp = match first {
            Some(b) => {
                let total: u32 = bufs.iter().filter(|b| b.writable).map(|b| b.len).sum();
                self.ram.read_bytes(b.addr, total as usize)
            }
            None => Vec::new(),
        };
        (len, resp)
    }

    /// A command: the header, `body`, the trailing array. Returns the
    /// response body on OK, the status otherwise; checks `used.len` (8 +
    /// the body on OK, 8 on an error: DEV-11).
    pub fn command(
        &mut self,
        opcode: u16,
        context: u32,
        body: &[u8],
        trailing: &[u64],
    ) -> Result<Vec<u8>, Status> {
        let req = request(opcode, context, body, trailing);
        let (len, resp) = self.raw(&req, 4096);
        let hdr = abi::RespHdr::read_from_prefix(&resp).expect("8 bytes").0;
        let st = hdr.status.get();
        if st != status::OK {
            assert_eq!(len, 8, "an error's used.len is 8 (DEV-11), opcode {opcode}");
            assert_eq!(hdr.reserved.get(), 0);
            return Err(Status {
                status: st,
                detail: hdr.detail.get(),
            });
        }
        let body = resp[8..len as usize].to_vec();
        assert_eq!(hdr.detail.get(), 0, "OK has detail 0");
        Ok(body)
    }

    /// A command whose response body is a `T`.
    pub fn call<T: FromBytes>(
        &mut self,
        opcode: u16,
        context: u32,
        body: &[u8],
        trailing: &[u64],
    ) -> Result<T, Status> {
        let b = self.command(opcode, context, body, trailing)?;
        assert_eq!(
            b.len(),
            size_of::<T>(),
            "opcode {opcode}: the response body's size"
        );
        Ok(T::read_from_bytes(&b).expect("sized"))
    }

    /// A command that must succeed.
    pub fn ok<T: FromBytes>(
        &mut self,
        opcode: u16,
        context: u32,
        body: &[u8],
        trailing: &[u64],
    ) -> T {
        self.call(opcode, context, body, trailing)
            .unwrap_or_else(|s| panic!("opcode {opcode} refused: {s:?}"))
    }

    /// A command that must fail with `want`.
    pub fn refused(&mut self, want: u16, opcode: u16, context: u32, body: &[u8], trailing: &[u64]) {
        match self.command(opcode, context, body, trailing) {
            Ok(b) => panic!("opcode {opcode}: accepted (body {b:?}), expected status {want}"),
            Err(s) => assert_eq!(
                s.status, want,
                "opcode {opcode}: status {} (detail {}), expected {want}",
                s.status, s.detail
            ),
        }
    }

    pub fn query_device(&mut self) -> abi::DeviceAttrResp {
        self.ok(op::QUERY_DEVICE, 0, &[], &[])
    }

    pub fn query_port(&mut self) -> abi::PortAttrResp {
        let req = abi::PortReq {
            port: 1.into(),
            reserved: 0.into(),
        };
        self.ok(op::QUERY_PORT, 0, req.as_bytes(), &[])
    }

    // --- the eventq and the notifyq -------------------------------------

    /// Reads what the device put in the eventq and the notifyq, reposting
    /// each buffer.
    pub fn drain(&mut self) {
        let mut repost = false;
        while let Some((h, len)) = self.eventq.poll_used() {
            let at = self.event_bufs[&h];
            if len as usize == size_of::<abi::Event>() {
                self.events.push_back(self.ram.read(at));
            } else {
                self.short_items += 1;
            }
            let nh = self.eventq.add(&[Buf::w(at, 16)]);
            self.event_bufs.remove(&h);
            self.event_bufs.insert(nh, at);
            repost = true;
        }
        if repost {
            self.eventq.notify();
        }
        let mut repost = false;
        while let Some((h, len)) = self.notifyq.poll_used() {
            let at = self.notify_bufs[&h];
            if len as usize == size_of::<abi::Notification>() {
                self.notifications.push_back(self.ram.read(at));
            } else {
                self.short_items += 1;
            }
            let nh = self.notifyq.add(&[Buf::w(at, 16)]);
            self.notify_bufs.remove(&h);
            self.notify_bufs.insert(nh, at);
            repost = true;
        }
        if repost {
            self.notifyq.notify();
        }
    }

    /// Waits for an event `pick` accepts (taking it), or panics at the
    /// deadline with the events seen.
    pub fn wait_event(&mut self, what: &str, pick: impl Fn(&abi::Event) -> bool) -> abi::Event {
        let deadline = Instant::now() + WAIT;
        loop {
            self.drain();
            if let Some(i) = self.events.iter().position(&pick) {
                return self.events.remove(i).expect("found");
            }
            if Instant::now() >= deadline {
                panic!("no event {what} within {WAIT:?}; seen: {:?}", self.events);
            }
            self.eventq.sleep(deadline, what);
        }
    }

    /// An event of `kind` about `object`.
    pub fn wait_event_of(&mut self, kind: u32, object: u32) -> abi::Event {
        self.wait_event(&format!("type {kind} object {object}"), |e| {
            e.event_type.get() == kind && e.object.get() == object
        })
    }

    /// Waits for events of these (type, object), which must come in this
    /// order among the events read; takes them and returns them.
    pub fn wait_events_in_order(&mut self, want: &[(u32, u32)]) -> Vec<abi::Event> {
        let deadline = Instant::now() + WAIT;
        loop {
            self.drain();
            let at: Vec<Option<usize>> = want
                .iter()
                .map(|&(k, o)| {
                    self.events
                        .iter()
                        .position(|e| e.event_type.get() == k && e.object.get() == o)
                })
                .collect();
            if at.iter().all(Option::is_some) {
                let at: Vec<usize> = at.into_iter().flatten().collect();
                assert!(
                    at.windows(2).all(|w| w[0] < w[1]),
                    "events {want:?} out of order: {:?}",
                    self.events
                );
                let mut taken: Vec<abi::Event> = at
                    .into_iter()
                    .rev()
                    .filter_map(|i| self.events.remove(i))
                    .collect();
                taken.reverse();
                return taken;
            }
            assert!(
                Instant::now() < deadline,
                "no events {want:?} within {WAIT:?}; seen: {:?}",
                self.events
            );
            self.eventq.sleep(deadline, "events");
        }
    }

    /// Waits for a notification of `cq`, taking it.
    pub fn wait_notification(&mut self, cq: u32) -> abi::Notification {
        let deadline = Instant::now() + WAIT;
        loop {
            self.drain();
            if let Some(i) = self.notifications.iter().position(|n| n.cq.get() == cq) {
                return self.notifications.remove(i).expect("found");
            }
            if Instant::now() >= deadline {
                panic!(
                    "no notification for CQ {cq} within {WAIT:?}; seen: {:?}",
                    self.notifications
                );
            }
            self.notifyq.sleep(deadline, "a notification");
        }
    }
}

impl std::fmt::Debug for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frontend")
            .field("socket", &self.socket)
            .field("features", &self.features)
            .finish_non_exhaustive()
    }
}

/// The four virtqueues, fresh in guest memory.
fn fresh_queues(ram: &Arc<Ram>) -> [Vq; 4] {
    [
        Vq::new(ram, vqi::CONTROL, CONTROL_SIZE),
        Vq::new(ram, vqi::EVENT, ITEM_SIZE),
        Vq::new(ram, vqi::NOTIFY, ITEM_SIZE),
        Vq::new(ram, vqi::DOORBELL, DOORBELL_SIZE),
    ]
}

/// A request's bytes: header, body, trailing array.
pub fn request(opcode: u16, context: u32, body: &[u8], trailing: &[u64]) -> Vec<u8> {
    let hdr = abi::CmdHdr {
        opcode: opcode.into(),
        flags: 0.into(),
        context: context.into(),
    };
    let mut r = hdr.as_bytes().to_vec();
    r.extend_from_slice(body);
    for p in trailing {
        r.extend_from_slice(&p.to_le_bytes());
    }
    r
}

/// A fresh eventfd (for tests that hand the device odd ones).
pub fn eventfd() -> EventFd {
    EventFd::new(EFD_NONBLOCK).expect("eventfd")
}
