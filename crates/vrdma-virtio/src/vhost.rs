//! The virtio-rdma device over vhost-user (spec §13.1): a backend on
//! rust-vmm's `vhost-user-backend`, moving the spec's requests, events and
//! notifications between the virtqueues and the face ([`VirtioRdma`]), and
//! running the device's turns in the backend's worker thread — busy-polling
//! the doorbell areas while work flows, sleeping on the doorbell queue's
//! kick, the network and the engine's next deadline when it does not.
//!
//! A connection ends; the device does not: its state waits, paused (no
//! guest memory touched, the engine's clock stopped), for the next
//! connection, which resumes it if it brings back the same memory and the
//! same control queue, and resets it otherwise (§13.1).
//!
//! Guest memory is held to the vfio-user server's DMA-map rules
//! ([`MemoryLimits`], through `vrdma_vfio_user::dma::MemoryTable`):
//! rust-vmm's handler maps each region of a SET_MEM_TABLE or ADD_MEM_REG
//! itself and publishes the table to its vrings before it calls
//! [`VhostUserBackend::update_memory`] — the first the backend hears of it,
//! and before anything touches it (the next touch is SET_VRING_ADDR's read
//! of the used index, a later message). There each new region's file is
//! checked, hugetlbfs and (allowed) unsealed regions are registered with
//! the SIGBUS guard, and the regions and bytes are counted; a table
//! refused is taken back from the vrings (they see the last one adopted
//! again) and the VMM gets the protocol's error. The device's own turns
//! never read the table rust-vmm publishes, only the one adopted.

use std::{
    io,
    os::fd::AsRawFd,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringEpollHandler, VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{
    GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};
use vmm_sys_util::{
    epoll::EventSet,
    event::{EventConsumer, EventFlag, EventNotifier, new_event_consumer_and_notifier},
};
use vrdma_device::Transport;
use vrdma_face::spin::{Next, Spinner};
use vrdma_vfio_user::dma::{self, DmaConfig, MemoryTable};
use zerocopy::IntoBytes;

use crate::{
    abi::{feature, vq},
    face::VirtioRdma,
    queues,
};

/// Sends a used-buffer notification when the queue's work said so.
fn signal(vring: &Vring, wanted: bool) -> io::Result<()> {
    if wanted {
        vring.signal_used_queue()?;
    }
    Ok(())
}

/// A virtqueue the device cannot use (a used ring it cannot write, an index
/// out of range): the driver's or the VMM's doing, never the daemon's —
/// the device fails (DEVICE_FATAL, everything it made gone) and takes the
/// queues again once they are set up anew.
#[derive(Debug, thiserror::Error)]
#[error("virtqueue: {0}")]
struct BrokenQueue(virtio_queue::Error);

fn queue_error(e: virtio_queue::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, BrokenQueue(e))
}

fn is_broken_queue(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|i| i.is::<BrokenQueue>())
}

type Mem = GuestMemoryAtomic<GuestMemoryMmap<()>>;
type Vring = VringRwLock<Mem>;

/// Listener tokens past the queues and the exit event.
const TRANSPORT: u16 = vq::COUNT as u16 + 1;
const TIMER: u16 = TRANSPORT + 1;
const SPIN: u16 = TIMER + 1;

/// The largest queue the device takes.
const QUEUE_SIZE: usize = 1024;

/// How long the device keeps polling after its last work, by default.
pub const DEFAULT_SPIN: Duration = vrdma_face::spin::DEFAULT_WINDOW;
/// How often a paused device looks whether its queues came back.
const PAUSED_TICK: Duration = Duration::from_millis(10);

/// What rust-vmm's handler answers VHOST_USER_GET_MAX_MEM_SLOTS (its
/// `MAX_MEM_SLOTS`, which it does not export; a test holds the two equal):
/// a VMM may be refused a region before, never offered more.
pub const ANNOUNCED_MEM_SLOTS: usize = 509;

/// The default [`MemoryLimits::max_regions`]. QEMU sends a region per
/// section of guest RAM with a descriptor (RAM below and above 4 GiB: two;
/// a few more with DIMMs or virtio-mem); each holds a descriptor and a
/// mapping, and `RLIMIT_NOFILE` and `vm.max_map_count` are the process's.
pub const DEFAULT_MAX_REGIONS: usize = 64;

/// What a VMM may map for one device (SET_MEM_TABLE, ADD_MEM_REG): a DMA
/// map's rules on the vfio-user server ([`DmaConfig`]), per device. Past a
/// limit, the message is refused with the protocol's error and the device
/// keeps the memory it had.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct MemoryLimits {
    /// Take regions whose file is not sealed against shrinking, guarded by
    /// the SIGBUS guard (their lost pages read zeros); off by default:
    /// such a table is refused.
    pub allow_unsealed: bool,
    /// Regions mapped at most (taken as [`ANNOUNCED_MEM_SLOTS`] when
    /// larger).
    pub max_regions: usize,
    /// Bytes mapped at most, over all regions.
    pub max_bytes: u64,
}

impl MemoryLimits {
    /// The limits for a guest of `guest` bytes of RAM (with memory
    /// hot-plug, the most it may have), or of unknown size: at most
    /// [`DEFAULT_MAX_REGIONS`] regions of at most the guest's size in all
    /// (a VMM shares its guest's RAM and nothing more), or
    /// [`dma::DEFAULT_MAX_BYTES`] when the size is not configured; sealed
    /// memory only.
    pub fn for_guest(guest: Option<u64>) -> Self {
        MemoryLimits {
            allow_unsealed: false,
            max_regions: DEFAULT_MAX_REGIONS,
            max_bytes: guest.unwrap_or(dma::DEFAULT_MAX_BYTES),
        }
    }

    /// The same as a DMA map's budget.
    fn dma(&self) -> DmaConfig {
        DmaConfig {
            allow_unsealed: self.allow_unsealed,
            max_maps: self.max_regions.min(ANNOUNCED_MEM_SLOTS),
            max_bytes: self.max_bytes,
        }
    }
}

impl Default for MemoryLimits {
    fn default() -> Self {
        Self::for_guest(None)
    }
}

/// Where a guest's memory came from: each region's place and file, to tell
/// the same VM coming back from another.
#[derive(Clone, Debug, Eq, PartialEq)]
struct Region {
    gpa: u64,
    len: u64,
    dev: u64,
    ino: u64,
    offset: u64,
}

fn regions(mem: &GuestMemoryMmap<()>) -> Vec<Region> {
    use std::os::unix::fs::MetadataExt;
    mem.iter()
        .map(|r| {
            let (dev, ino, offset) = r
                .file_offset()
                .and_then(|f| {
                    f.file()
                        .metadata()
                        .ok()
                        .map(|m| (m.dev(), m.ino(), f.start()))
                })
                .unwrap_or((0, 0, 0));
            Region {
                gpa: r.start_addr().0,
                len: r.len(),
                dev,
                ino,
                offset,
            }
        })
        .collect()
}

/// A non-blocking timerfd on the monotonic clock.
#[derive(Debug)]
struct Timer(nix::sys::timerfd::TimerFd);

impl Timer {
    fn new() -> io::Result<Self> {
        use nix::sys::timerfd::{ClockId, TimerFd, TimerFlags};
        let t = TimerFd::new(
            ClockId::CLOCK_MONOTONIC,
            TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC,
        )?;
        Ok(Timer(t))
    }

    /// Fires after `after`, and every `every` after that when given.
    fn reset(&mut self, after: Duration, every: Option<Duration>) -> io::Result<()> {
        use nix::sys::{
            time::TimeSpec,
            timerfd::{Expiration, TimerSetTimeFlags},
        };
        let e = match every {
            Some(i) => Expiration::IntervalDelayed(TimeSpec::from(after), TimeSpec::from(i)),
            None => Expiration::OneShot(TimeSpec::from(after)),
        };
        self.0.set(e, TimerSetTimeFlags::empty())?;
        Ok(())
    }

    fn clear(&mut self) -> io::Result<()> {
        self.0.unset()?;
        Ok(())
    }

    /// Takes the expirations, if any (never waits).
    fn take(&mut self) {
        let _ = self.0.wait();
    }

    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsFd;
        self.0.as_fd().as_raw_fd()
    }
}

/// The control queue as it was when the device paused.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
struct ControlQueue {
    desc: u64,
    avail: u64,
    used: u64,
    next_avail: u16,
}

/// What a paused device compares a new start with.
#[derive(Clone, Debug)]
struct Paused {
    memory: Vec<Region>,
    control: Option<ControlQueue>,
}

/// The backend's state (behind its lock).
#[derive(Debug)]
struct Inner<T: Transport> {
    face: VirtioRdma<T>,
    memory: Option<Vec<Region>>,
    /// Guest memory as the device's turns see it: the table adopted last
    /// (never the one rust-vmm publishes to the vrings before
    /// [`MemoryTable::adopt`] took it).
    mem: Option<Arc<GuestMemoryMmap<()>>>,
    /// Every region's mapping, its guard, the limits (after the face and
    /// the memory above, which drop first: the table then holds the last
    /// reference to what it guards).
    table: MemoryTable,
    /// Memory tables refused.
    memory_refused: u64,
    acked: u64,
    event_idx: bool,
    stopped: [bool; vq::COUNT],
    /// A virtqueue failed: nothing is served until the queues are set up
    /// anew (a queue stopped: the driver's reset, or the VMM's restart).
    queues_broken: bool,
    /// Virtqueues that failed so far (`virtio.broken_queues`).
    broken_queues: u64,
    paused: Option<Paused>,
    control: Option<ControlQueue>,
    /// When the device polls the doorbells and when it sleeps (the face
    /// core's policy, as over vfio-user).
    spinner: Spinner,
    /// Whether the spin event is raised (the worker's epoll returns at once).
    spinning: bool,
    /// The engine's next deadline (and a paused device's tick): never
    /// blocking — a reset or a clear between epoll's word and the read
    /// would otherwise hold the worker, and the lock, for good.
    timer: Timer,
    spin: (EventConsumer, EventNotifier),
    /// Requests whose chain could carry no status.
    bad_chains: u64,
    /// Counters for `vrdma stat`, published from the worker's turns.
    publisher: Option<vrdma_device::publish::Publisher>,
    /// Panics caught in the device's turns.
    panics: u64,
    /// The device just resumed: requests that came while it was paused
    /// are taken.
    resumed: bool,
    /// Worker wake-ups while the driver had not negotiated VERSION_1
    /// (each a kick, a tick or a packet the device did not serve).
    unversioned_events: u64,
}

/// Watches or stops watching the network's descriptor in the current
/// connection's worker (a paused device must not take packets).
type Watch = Box<dyn Fn(bool) -> io::Result<()> + Send>;

/// The vhost-user backend of one virtio-rdma device.
pub struct Backend<T: Transport> {
    inner: Mutex<Inner<T>>,
    /// The protocol thread waits for the lock: the worker lets it in.
    waiting: AtomicUsize,
    exit: Mutex<Option<(EventConsumer, EventNotifier)>>,
    /// Exit-event descriptors handed to workers that will not close them.
    handed_out: Mutex<Vec<std::os::fd::RawFd>>,
    watch: Mutex<Option<Watch>>,
    /// The device failed (its network is gone): why, and who to tell.
    failure: Mutex<Option<String>>,
    on_failure: Mutex<Option<Box<dyn Fn() + Send>>>,
}

impl<T: Transport> std::fmt::Debug for Backend<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend").finish_non_exhaustive()
    }
}

impl<T: Transport + Send + 'static> Backend<T> {
    /// A backend for `face`, polling doorbells for `spin` after its last
    /// work (when the face polls at all), its VMM held to the default
    /// [`MemoryLimits`] (a guest of unknown size).
    pub fn new(face: VirtioRdma<T>, spin: Duration) -> io::Result<Arc<Self>> {
        Self::with_limits(face, spin, MemoryLimits::default())
    }

    /// [`Backend::new`], with the VMM's memory held to `limits`.
    pub fn with_limits(
        face: VirtioRdma<T>,
        spin: Duration,
        limits: MemoryLimits,
    ) -> io::Result<Arc<Self>> {
        let inner = Inner {
            face,
            memory: None,
            mem: None,
            table: MemoryTable::new(limits.dma()),
            memory_refused: 0,
            acked: 0,
            event_idx: false,
            stopped: [false; vq::COUNT],
            queues_broken: false,
            broken_queues: 0,
            paused: None,
            control: None,
            spinner: Spinner::new(spin),
            spinning: false,
            timer: Timer::new()?,
            spin: new_event_consumer_and_notifier(EventFlag::NONBLOCK)?,
            bad_chains: 0,
            publisher: None,
            panics: 0,
            resumed: false,
            unversioned_events: 0,
        };
        Ok(Arc::new(Backend {
            inner: Mutex::new(inner),
            waiting: AtomicUsize::new(0),
            exit: Mutex::new(None),
            handed_out: Mutex::new(Vec::new()),
            watch: Mutex::new(None),
            failure: Mutex::new(None),
            on_failure: Mutex::new(None),
        }))
    }

    /// The state, for the protocol thread: the worker yields to it.
    fn lock(&self) -> MutexGuard<'_, Inner<T>> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        g
    }

    /// The state, for the worker: after any protocol message waiting.
    fn lock_worker(&self) -> MutexGuard<'_, Inner<T>> {
        while self.waiting.load(Ordering::SeqCst) > 0 {
            std::thread::yield_now();
        }
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the face (for counters, tests, the daemon).
    pub fn with_face<R>(&self, f: impl FnOnce(&mut VirtioRdma<T>) -> R) -> R {
        f(&mut self.lock().face)
    }

    /// A new connection's worker: the device's file descriptors
    /// registered with its epoll handler.
    pub(crate) fn attach(
        self: &Arc<Self>,
        handler: Arc<VringEpollHandler<Arc<Backend<T>>>>,
    ) -> io::Result<()> {
        let g = self.lock();
        let net = g.face.dev.device.fd().as_raw_fd();
        handler.register_listener(g.timer.as_raw_fd(), EventSet::IN, u64::from(TIMER))?;
        handler.register_listener(g.spin.0.as_raw_fd(), EventSet::IN, u64::from(SPIN))?;
        let paused = g.paused.is_some();
        drop(g);
        if !paused {
            handler.register_listener(net, EventSet::IN, u64::from(TRANSPORT))?;
        }
        let watching = std::sync::atomic::AtomicBool::new(!paused);
        let watch: Watch = Box::new(move |on| {
            if watching.swap(on, Ordering::SeqCst) == on {
                return Ok(());
            }
            if on {
                handler.register_listener(net, EventSet::IN, u64::from(TRANSPORT))
            } else {
                handler.unregister_listener(net, EventSet::IN, u64::from(TRANSPORT))
            }
        });
        *self.watch.lock().unwrap_or_else(|p| p.into_inner()) = Some(watch);
        Ok(())
    }

    fn watch_network(&self, on: bool) {
        if let Some(w) = self
            .watch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            && let Err(e) = w(on)
        {
            tracing::warn!(error = %e, "virtio-rdma: cannot watch the network");
        }
    }

    /// A fresh exit event for the next connection's worker.
    pub(crate) fn rearm_exit(&self) -> io::Result<EventNotifier> {
        let pair = new_event_consumer_and_notifier(EventFlag::NONBLOCK)?;
        let notifier = pair.1.try_clone()?;
        *self.exit.lock().unwrap_or_else(|p| p.into_inner()) = Some(pair);
        Ok(notifier)
    }

    /// The connection's daemon is dropped (its workers joined): the exit
    /// descriptors they were handed are closed.
    pub(crate) fn close_handed_out(&self) {
        let fds = std::mem::take(&mut *self.handed_out.lock().unwrap_or_else(|p| p.into_inner()));
        for fd in fds {
            let _ = nix::unistd::close(fd);
        }
    }

    /// The connection is gone: the device pauses.
    pub(crate) fn disconnected(&self) {
        *self.watch.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let mut g = self.lock();
        g.pause();
        g.stopped = [true; vq::COUNT];
        // The connection's tables went with its daemon.
        g.table.reap();
    }

    /// Publishes the device's counters as `name` for `vrdma stat`, once a
    /// second from its turns.
    pub fn publish_as(&self, name: &str) {
        self.lock().publisher = vrdma_device::publish::Publisher::new(name);
    }

    /// Names the device's network in its `vrdma stat` snapshots.
    pub fn set_network(&self, label: &str) {
        if let Some(p) = &mut self.lock().publisher {
            p.set_network(label);
        }
    }

    /// The last publication (the daemon stops).
    pub fn publish_last(&self) {
        let mut g = self.lock();
        g.publish(true);
    }

    /// Why the device failed, if it did (its network went away: the
    /// device stops, as a PVRDMA device does).
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// What to call when the device fails (the server stops).
    pub fn set_on_failure(&self, f: Box<dyn Fn() + Send>) {
        *self.on_failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
    }

    fn fail(&self, e: &io::Error) {
        let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_some() {
            return;
        }
        tracing::error!(error = %e, "virtio-rdma device: its network failed; the device stops");
        *f = Some(e.to_string());
        drop(f);
        self.watch_network(false);
        if let Some(cb) = self
            .on_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            cb();
        }
    }

    /// Requests whose chains could carry no status, so far.
    pub fn bad_chains(&self) -> u64 {
        self.lock().bad_chains
    }

    /// What the VMM's memory makes the device hold now: regions (and their
    /// descriptors) and bytes, of the table adopted and of those replaced
    /// that something still holds.
    pub fn memory_usage(&self) -> dma::Usage {
        self.lock().table.usage()
    }

    /// Faults the SIGBUS guard repaired in the VMM's memory (pages its
    /// hugetlbfs or unsealed files could not supply).
    pub fn memory_faults(&self) -> u64 {
        self.lock().table.faults()
    }

    /// Memory tables refused (SET_MEM_TABLE, ADD_MEM_REG), so far.
    pub fn memory_refused(&self) -> u64 {
        self.lock().memory_refused
    }

    /// Counters for `vrdma stat`.
    pub fn counters(&self) -> Vec<(String, u64)> {
        self.lock().counters()
    }
}

impl<T: Transport> Inner<T> {
    fn counters(&self) -> Vec<(String, u64)> {
        let mut c = self.face.counters();
        c.push(("virtio.bad_chains".into(), self.bad_chains));
        c.push(("virtio.paused".into(), u64::from(self.paused.is_some())));
        c.push(("virtio.panics".into(), self.panics));
        c.push(("virtio.broken_queues".into(), self.broken_queues));
        c.push(("virtio.unversioned_events".into(), self.unversioned_events));
        let u = self.table.usage();
        c.push(("virtio.memory_regions".into(), u.maps as u64));
        c.push(("virtio.memory_bytes".into(), u.bytes));
        c.push(("virtio.memory_faults".into(), self.table.faults()));
        c.push(("virtio.memory_refused".into(), self.memory_refused));
        c.extend(self.spinner.policy().stats().counters());
        c
    }

    fn publish(&mut self, last: bool) {
        let now = self.face.dev.device.clock();
        let Some(mut p) = self.publisher.take() else {
            return;
        };
        p.publish(now, || self.counters(), last);
        self.publisher = Some(p);
    }

    /// No more guest memory access until the queues come back: the
    /// drivers are told to kick (the device stops polling), and what to
    /// compare a new start with is kept.
    fn pause(&mut self) {
        if self.paused.is_some() {
            return;
        }
        self.face.set_polling(false);
        self.spinner.stop();
        let _ = self.spin.0.consume();
        self.spinning = false;
        self.paused = Some(Paused {
            memory: self.memory.clone().unwrap_or_default(),
            control: self.control,
        });
        let _ = self.timer.reset(PAUSED_TICK, Some(PAUSED_TICK));
    }

    /// The queues are back: the same VM resumes, anything else is a
    /// reset first.
    fn resume(&mut self, control: ControlQueue) {
        let Some(p) = self.paused.take() else {
            return;
        };
        let same_memory = match &self.memory {
            Some(now) => p.memory.iter().all(|r| r.dev != 0 && now.contains(r)),
            None => false,
        };
        let same_queue = p.control == Some(control);
        let resumes = same_memory && same_queue;
        // Not the same VM coming back: everything of the old one goes,
        // a failed device's ERR_DEVICE and GIDs included.
        if !resumes {
            tracing::info!("virtio-rdma: a new driver or another VM: device reset");
            self.face.reset();
        }
        let _ = self.timer.clear();
        self.control = Some(control);
        self.resumed = true;
    }

    fn process_control(&mut self, vring: &Vring) -> io::Result<()> {
        let Some(mem) = self.mem.clone() else {
            return Ok(());
        };
        let wanted = {
            let mut state = vring.get_mut();
            queues::control(
                &mut self.face,
                state.get_queue_mut(),
                &*mem,
                self.event_idx,
                &mut self.bad_chains,
            )
            .map_err(queue_error)?
        };
        signal(vring, wanted)?;
        let q = vring.get_ref();
        let queue = q.get_queue();
        self.control = Some(ControlQueue {
            desc: queue.desc_table(),
            avail: queue.avail_ring(),
            used: queue.used_ring(),
            next_avail: queue.next_avail(),
        });
        Ok(())
    }

    /// Hands what waits to the driver's eventq and notifyq buffers.
    fn deliver_all(&mut self, vrings: &[Vring]) -> io::Result<()> {
        let Some(mem) = self.mem.clone() else {
            return Ok(());
        };
        let mut bad = 0;
        let cell = std::cell::RefCell::new(&mut self.face);
        let wanted = queues::deliver(
            vrings[vq::EVENT as usize].get_mut().get_queue_mut(),
            &*mem,
            self.event_idx,
            || cell.borrow_mut().next_event(),
            |e| cell.borrow_mut().unget_event(e),
            &mut bad,
        )
        .map_err(queue_error)?;
        signal(&vrings[vq::EVENT as usize], wanted)?;
        let wanted = queues::deliver(
            vrings[vq::NOTIFY as usize].get_mut().get_queue_mut(),
            &*mem,
            self.event_idx,
            || cell.borrow_mut().next_notification(),
            |n| cell.borrow_mut().unget_notification(n),
            &mut bad,
        )
        .map_err(queue_error)?;
        signal(&vrings[vq::NOTIFY as usize], wanted)?;
        self.bad_chains += bad;
        Ok(())
    }

    /// A turn of the device and what follows from it: deliveries, polling,
    /// the timer.
    fn run(&mut self, vrings: &[Vring], kicked: bool) -> io::Result<()> {
        self.publish(false);
        if self.paused.is_some() {
            let ready = vrings.iter().all(|v| v.get_ref().get_queue().ready())
                && self.memory.is_some()
                && self.stopped.iter().all(|s| !s);
            if !ready {
                return Ok(());
            }
            let q = vrings[vq::CONTROL as usize].get_ref();
            let queue = q.get_queue();
            let control = ControlQueue {
                desc: queue.desc_table(),
                avail: queue.avail_ring(),
                used: queue.used_ring(),
                next_avail: queue.next_avail(),
            };
            drop(q);
            self.resume(control);
        }
        let poll = self.acked & feature::DOORBELL_POLL != 0 && self.face.options().poll;
        if kicked && poll && !self.face.polling() && self.spinner.wake(self.face.dev.device.clock())
        {
            self.face.set_polling(true);
        }
        let turn = self.face.turn(true)?;
        self.deliver_all(vrings)?;
        // A turn that moved packets is followed by another at once,
        // polling or not: a round sends a budget of packets, and what is
        // left of a long message (a UC SEND, which no ACK comes back for)
        // would otherwise wait for whatever woke the worker next.
        let mut again = turn.moved;
        // The policy (vrdma_face::spin): poll on while it pays; when it
        // says stop, tell the drivers to kick, look once more (a doorbell
        // rung before they read the word), and sleep — or, when that look
        // found work, take it in one more turn at once.
        if self.face.polling() {
            let now = self.face.dev.device.clock();
            if self.spinner.round(now, turn.busy) == Next::Sleep {
                self.face.set_polling(false);
                if self.face.doorbells() > 0 {
                    again = true;
                    if self.spinner.wake(now) {
                        self.face.set_polling(true);
                    }
                }
            }
        }
        let spin = self.face.polling() || again;
        if !spin {
            // The worker sleeps in epoll after this turn, the device's
            // descriptor among those it waits on.
            self.face.dev.device.transport_mut().arm();
        }
        if spin != self.spinning {
            if spin {
                self.spin.1.notify()?;
            } else {
                let _ = self.spin.0.consume();
            }
            self.spinning = spin;
        }
        // The engine's next deadline.
        match turn.deadline {
            Some(at) => {
                let now_ns = self.face.dev.device.clock();
                let wait =
                    Duration::from_nanos(at.saturating_sub(now_ns)).max(Duration::from_micros(1));
                self.timer.reset(wait, None)?;
            }
            None => {
                let _ = self.timer.clear();
            }
        }
        Ok(())
    }
}

impl<T: Transport + Send + 'static> VhostUserBackend for Backend<T> {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        vq::COUNT
    }

    fn max_queue_size(&self) -> usize {
        QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        let poll = if self.lock().face.options().poll {
            feature::DOORBELL_POLL
        } else {
            0
        };
        feature::VERSION_1
            | feature::RING_INDIRECT_DESC
            | feature::RING_EVENT_IDX
            | poll
            | feature::STATS
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn acked_features(&self, features: u64) {
        if features & feature::VERSION_1 == 0 {
            // The backend library has already accepted the message (its
            // trait cannot refuse it); what the device can do is serve
            // nothing (§13).
            tracing::warn!(
                features,
                "virtio-rdma: features without VIRTIO_F_VERSION_1: the device serves nothing"
            );
        }
        let mut g = self.lock();
        g.acked = features;
        g.face.set_features(features);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::RESET_DEVICE
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn reset_device(&self) {
        let mut g = self.lock();
        g.face.reset();
        g.paused = None;
        g.control = None;
        g.queues_broken = false;
    }

    fn set_event_idx(&self, enabled: bool) {
        self.lock().event_idx = enabled;
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let cfg = self.lock().face.config();
        let bytes = cfg.as_bytes();
        let (o, n) = (offset as usize, size as usize);
        // Past the 64 bytes: zeros (QEMU reads its config_size whole).
        let mut out = vec![0u8; n];
        if o < bytes.len() {
            let k = n.min(bytes.len() - o);
            out[..k].copy_from_slice(&bytes[o..o + k]);
        }
        out
    }

    fn set_config(&self, _offset: u32, _buf: &[u8]) -> io::Result<()> {
        // The configuration is read-only (§3).
        Err(io::Error::from(io::ErrorKind::PermissionDenied))
    }

    /// rust-vmm's handler mapped a new table (SET_MEM_TABLE, ADD_MEM_REG,
    /// REM_MEM_REG) and published it to the vrings; nothing has touched it
    /// yet. It is adopted — checked, guarded, counted — or refused, and
    /// then the vrings see the last table adopted again: the handler keeps
    /// its previous address translations on an error, so the two agree.
    fn update_memory(&self, mem: Mem) -> io::Result<()> {
        let mut g = self.lock();
        let table: GuestMemoryMmap<()> = (*mem.memory()).clone();
        if let Err(e) = g.table.adopt(&table) {
            tracing::warn!(error = %e, "virtio-rdma: guest memory refused");
            g.memory_refused += 1;
            let kept = g.table.mem().clone();
            // What the refused table mapped goes with the handler's
            // message (nothing here holds it).
            mem.lock().unwrap_or_else(|p| p.into_inner()).replace(kept);
            let kind = io::Error::from(e.errno()).kind();
            return Err(io::Error::new(kind, format!("guest memory refused: {e}")));
        }
        g.memory = Some(regions(&table));
        g.face.set_memory(&table);
        g.mem = Some(Arc::new(table));
        // The mappings of the table replaced, which the device let go.
        g.table.reap();
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        vec![(1 << vq::COUNT) - 1]
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let g = self.exit.lock().unwrap_or_else(|p| p.into_inner());
        let (c, n) = g.as_ref()?;
        let (c, n) = (c.try_clone().ok()?, n.try_clone().ok()?);
        // rust-vmm's worker takes the consumer as a raw descriptor for its
        // epoll and never closes it: one descriptor lost per connection
        // (20 000 connections exhausted the process's table under the
        // fuzzer). Remembered here, closed once the worker is joined.
        self.handed_out
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(c.as_raw_fd());
        Some((c, n))
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        let mut g = self.lock();
        if let Some(s) = g.stopped.get_mut(queue_index as usize) {
            *s = true;
        }
        // Set up anew from here: a queue that failed is served again.
        g.queues_broken = false;
        if queue_index == u32::from(vq::CONTROL) || g.stopped.iter().all(|s| *s) {
            g.pause();
        }
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        let mut g = self.lock_worker();
        // A legacy driver (no VIRTIO_F_VERSION_1) is served nothing: no
        // command taken, no ring or doorbell read (DEV-1).
        if g.acked & feature::VERSION_1 == 0 {
            g.unversioned_events += 1;
            if device_event == TIMER {
                g.timer.take();
            }
            if g.spinning {
                // Features set anew on a device that was polling.
                g.face.set_polling(false);
                g.spinner.stop();
                let _ = g.spin.0.consume();
                g.spinning = false;
            }
            drop(g);
            // Nor is its network read: packets left in a watched socket
            // would wake the worker again at once, for good.
            self.watch_network(false);
            return Ok(());
        }
        if g.queues_broken {
            if device_event == TIMER {
                g.timer.take();
            }
            return Ok(());
        }
        // A queue that is ready again is started.
        for (i, v) in vrings.iter().enumerate() {
            if v.get_ref().get_queue().ready() {
                g.stopped[i] = false;
            }
        }
        let mut kicked = false;
        match device_event {
            vq::DOORBELL => kicked = true,
            TIMER => {
                g.timer.take();
            }
            _ => {}
        }
        // A panic in the device's turn fails this device — DEVICE_FATAL
        // for its driver, everything it made gone — and the worker, the
        // daemon and its other devices go on (the lock is not poisoned:
        // the panic is caught before it unwinds past the guard).
        let turn = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if device_event == vq::CONTROL && g.paused.is_none() {
                g.process_control(&vrings[vq::CONTROL as usize])?;
            }
            g.run(vrings, kicked)
        }));
        let r = match turn {
            Ok(Err(e)) if is_broken_queue(&e) => {
                tracing::warn!(
                    error = %e,
                    "virtio-rdma device: a virtqueue it cannot use; the device fails and resets, \
                     and serves again once its queues are set up anew"
                );
                g.broken_queues += 1;
                g.queues_broken = true;
                g.face.fail();
                Ok(())
            }
            Ok(r) => r,
            Err(_) => {
                tracing::error!(
                    "virtio-rdma device: a panic in its turn; the device fails and resets"
                );
                g.panics += 1;
                g.face.fail();
                Ok(())
            }
        };
        let running = g.paused.is_none() && !g.queues_broken;
        drop(g);
        if let Err(e) = &r {
            self.fail(e);
            return Ok(());
        }
        // A paused device takes no packets (they would reach guest memory
        // the driver may have given to others): the network is not
        // watched until it resumes.
        self.watch_network(running && self.failure().is_none());
        let mut g = self.lock_worker();
        if g.paused.is_none() && g.resumed {
            // Commands that came while paused, now that it resumed.
            g.resumed = false;
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                g.process_control(&vrings[vq::CONTROL as usize])
            }));
            if r.is_err() {
                g.panics += 1;
                g.face.fail();
            }
        }
        Ok(())
    }
}
