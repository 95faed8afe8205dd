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

use std::{
    io,
    os::fd::AsRawFd,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
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

fn queue_error(e: virtio_queue::Error) -> io::Error {
    io::Error::other(format!("virtqueue: {e}"))
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
pub const DEFAULT_SPIN: Duration = Duration::from_micros(200);
/// How often a paused device looks whether its queues came back.
const PAUSED_TICK: Duration = Duration::from_millis(10);

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

/// Guest memory the device may map: every region a file sealed against
/// shrinking (QEMU's memory-backend-memfd seals by default) and at least
/// as long as the region. A file another process can truncate would turn
/// the device's next access into a SIGBUS that kills the daemon and every
/// device in it.
fn check_memory(mem: &GuestMemoryMmap<()>) -> io::Result<()> {
    use nix::fcntl::{FcntlArg, fcntl};
    for r in mem.iter() {
        let Some(fo) = r.file_offset() else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a guest memory region with no file",
            ));
        };
        let seals = fcntl(fo.file(), FcntlArg::F_GET_SEALS).unwrap_or(0);
        if seals & nix::libc::F_SEAL_SHRINK == 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "guest memory not sealed against shrinking (memory-backend-memfd seals it)",
            ));
        }
        let len = fo.file().metadata()?.len();
        if len < fo.start().saturating_add(r.len()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a guest memory file shorter than its region",
            ));
        }
    }
    Ok(())
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
    /// Guest memory as the vrings see it.
    mem: Option<Mem>,
    acked: u64,
    event_idx: bool,
    stopped: [bool; vq::COUNT],
    paused: Option<Paused>,
    control: Option<ControlQueue>,
    spin_for: Duration,
    last_busy: Instant,
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
    /// work (when the face polls at all).
    pub fn new(face: VirtioRdma<T>, spin: Duration) -> io::Result<Arc<Self>> {
        let inner = Inner {
            face,
            memory: None,
            mem: None,
            acked: 0,
            event_idx: false,
            stopped: [false; vq::COUNT],
            paused: None,
            control: None,
            spin_for: spin,
            last_busy: Instant::now(),
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
        let net = g.face.device.fd().as_raw_fd();
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
    }

    /// Publishes the device's counters as `name` for `vrdma stat`, once a
    /// second from its turns.
    pub fn publish_as(&self, name: &str) {
        self.lock().publisher = vrdma_device::publish::Publisher::new(name);
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
        c.push(("virtio.unversioned_events".into(), self.unversioned_events));
        c
    }

    fn publish(&mut self, last: bool) {
        let now = self.face.device.clock();
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
        let Some(atomic) = self.mem.clone() else {
            return Ok(());
        };
        let wanted = {
            let mut state = vring.get_mut();
            queues::control(
                &mut self.face,
                state.get_queue_mut(),
                &*atomic.memory(),
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
        let Some(atomic) = self.mem.clone() else {
            return Ok(());
        };
        let mem = atomic.memory();
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
        if kicked && poll && !self.face.polling() {
            self.face.set_polling(true);
        }
        let turn = self.face.turn(true)?;
        let now = Instant::now();
        if turn.busy {
            self.last_busy = now;
        }
        self.deliver_all(vrings)?;
        // Poll on while work flows; past the spin period, tell the drivers
        // to kick, look once more (a doorbell rung before they read the
        // word), and sleep.
        if self.face.polling() && now.duration_since(self.last_busy) >= self.spin_for {
            self.face.set_polling(false);
            if self.face.doorbells() > 0 {
                self.face.set_polling(true);
                self.last_busy = now;
            }
        }
        let spin = self.face.polling();
        if !spin {
            // The worker sleeps in epoll after this turn, the device's
            // descriptor among those it waits on.
            self.face.device.transport_mut().arm();
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
                let now_ns = self.face.device.clock();
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
        self.lock().acked = features;
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

    fn update_memory(&self, mem: Mem) -> io::Result<()> {
        let mut g = self.lock();
        let m = mem.memory();
        if let Err(e) = check_memory(&m) {
            // The vrings already see it: nothing touches guest memory
            // until a connection brings memory that is whole.
            tracing::warn!(error = %e, "virtio-rdma: guest memory refused");
            g.pause();
            g.mem = None;
            g.memory = None;
            return Err(e);
        }
        g.memory = Some(regions(&m));
        g.face.set_memory(&m);
        g.mem = Some(mem.clone());
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
                let _ = g.spin.0.consume();
                g.spinning = false;
            }
            drop(g);
            // Nor is its network read: packets left in a watched socket
            // would wake the worker again at once, for good.
            self.watch_network(false);
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
        let running = g.paused.is_none();
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
