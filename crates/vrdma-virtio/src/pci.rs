//! The virtio-rdma device as a whole virtio-pci function served over
//! vfio-user (docs/virtio-rdma.md §13.3): QEMU attaches it with
//! `vfio-user-pci`, which knows nothing of virtio (so has no table of
//! device IDs to end short of 42), and the guest's stock `virtio_pci`
//! driver finds 1af4:106a, a modern (VIRTIO 1.x) function. Above the
//! transport the specification applies unchanged: the same face
//! ([`VirtioRdma`]), the same virtqueue work (`queues`) as over vhost-user.
//!
//! What this module carries that QEMU carries for a vhost-user device:
//!
//! - the configuration space with the virtio capabilities (VIRTIO 1.2
//!   §4.1.4): common configuration, notifications, ISR status, the
//!   device's configuration (§3's 64 bytes) and the PCI configuration
//!   access window, and MSI-X (QEMU emulates the table; vectors are raised
//!   through the eventfds the client gives);
//! - BAR0: the MSI-X table and pending bits; BAR2: the virtio structures,
//!   every queue's notify address alone in its 4096-byte page
//!   (`notify_off_multiplier` 4096, as QEMU's `page-per-vq`), so that a
//!   driver may map the doorbellq's page, and no other, into a process
//!   (§8.7);
//! - `device_status`: FEATURES_OK only for features offered and
//!   VERSION_1; DRIVER_OK starts the device only with every queue set up
//!   inside guest memory, and otherwise sets DEVICE_NEEDS_RESET; 0 resets
//!   it — unlike vhost-user, the transport tells a reset from a pause;
//! - the virtqueues, read through the client's DMA maps with
//!   `virtio-queue`.
//!
//! Every access is checked: a field is reached only at its own offset and
//! width (a 64-bit field also in 32-bit halves); anything else reads 0 and
//! writes nothing, and is counted (`pci.bad_accesses`).

use std::{io, os::fd::BorrowedFd, time::Duration};

use nix::errno::Errno;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap};
use vrdma_device::{Progress, Transport};
use vrdma_face::{
    spin::{Next, Spinner},
    vfio::Served,
};
use vrdma_vfio_user::{
    Bus, Function, Region,
    pci::{Bar, ConfigSpace},
    proto::irq_index,
};
use zerocopy::IntoBytes;

use crate::{
    abi::{feature, vq},
    face::VirtioRdma,
    queues,
};

/// Red Hat's virtio vendor ID, and a modern device's ID: 0x1040 + 42.
pub const VENDOR_ID: u16 = 0x1af4;
pub const DEVICE_ID: u16 = 0x1040 + 42;
/// A modern (non-transitional) device has revision 1 or more.
const REVISION: u8 = 1;
/// Network controller, other (as the PVRDMA function).
const CLASS: u32 = 0x02_8000;

/// MSI-X vectors: one for configuration changes and one per virtqueue
/// that interrupts (the controlq, the eventq, the notifyq); a driver may
/// also share one among all (§4.1).
pub const VECTORS: u32 = 4;
/// "No vector" in the common configuration.
pub const NO_VECTOR: u16 = 0xffff;

/// BAR0: the MSI-X table at 0 (QEMU emulates it), its pending bits here.
pub const BAR0_SIZE: u64 = 0x1000;
const MSIX_PBA: u64 = 0x800;
/// BAR2: the virtio structures.
pub const BAR2_SIZE: u64 = 0x8000;
/// Where each structure is in BAR2.
pub mod layout {
    pub const COMMON: u64 = 0x0000;
    /// The common configuration's length: VIRTIO 1.2's structure with
    /// `queue_notify_data` and `queue_reset` (which read 0: neither
    /// feature is offered), so that a driver that maps the longer one
    /// finds it whole.
    pub const COMMON_LEN: u64 = 0x40;
    pub const ISR: u64 = 0x1000;
    pub const ISR_LEN: u64 = 4;
    pub const DEVICE: u64 = 0x2000;
    pub const DEVICE_LEN: u64 = 64;
    pub const NOTIFY: u64 = 0x3000;
    /// A queue's notify address is `NOTIFY + index * NOTIFY_MULTIPLIER`.
    pub const NOTIFY_MULTIPLIER: u64 = 0x1000;
    pub const NOTIFY_LEN: u64 = super::vq::COUNT as u64 * NOTIFY_MULTIPLIER;
}

/// The BAR of the virtio structures (a region index).
const VIRTIO_BAR: u8 = 2;

/// `struct virtio_pci_cap`'s `cfg_type`.
mod cap {
    pub const COMMON: u8 = 1;
    pub const NOTIFY: u8 = 2;
    pub const ISR: u8 = 3;
    pub const DEVICE: u8 = 4;
    pub const PCI_CFG: u8 = 5;
}

/// The common configuration's fields (offsets).
mod common {
    pub const DEVICE_FEATURE_SELECT: u64 = 0x00;
    pub const DEVICE_FEATURE: u64 = 0x04;
    pub const DRIVER_FEATURE_SELECT: u64 = 0x08;
    pub const DRIVER_FEATURE: u64 = 0x0c;
    pub const CONFIG_MSIX_VECTOR: u64 = 0x10;
    pub const NUM_QUEUES: u64 = 0x12;
    pub const DEVICE_STATUS: u64 = 0x14;
    pub const CONFIG_GENERATION: u64 = 0x15;
    pub const QUEUE_SELECT: u64 = 0x16;
    pub const QUEUE_SIZE: u64 = 0x18;
    pub const QUEUE_MSIX_VECTOR: u64 = 0x1a;
    pub const QUEUE_ENABLE: u64 = 0x1c;
    pub const QUEUE_NOTIFY_OFF: u64 = 0x1e;
    pub const QUEUE_DESC: u64 = 0x20;
    pub const QUEUE_DRIVER: u64 = 0x28;
    pub const QUEUE_DEVICE: u64 = 0x30;
    pub const QUEUE_NOTIFY_DATA: u64 = 0x38;
    pub const QUEUE_RESET: u64 = 0x3a;

    /// The field at `offset` of the given width: its offset and its own
    /// width, when `offset`/`len` name it whole (or a 32-bit half of a
    /// 64-bit field).
    pub fn field(offset: u64, len: usize) -> Option<(u64, usize)> {
        let width = match offset {
            DEVICE_FEATURE_SELECT | DEVICE_FEATURE | DRIVER_FEATURE_SELECT | DRIVER_FEATURE => 4,
            CONFIG_MSIX_VECTOR | NUM_QUEUES | QUEUE_SELECT | QUEUE_SIZE | QUEUE_MSIX_VECTOR
            | QUEUE_ENABLE | QUEUE_NOTIFY_OFF | QUEUE_NOTIFY_DATA | QUEUE_RESET => 2,
            DEVICE_STATUS | CONFIG_GENERATION => 1,
            QUEUE_DESC | QUEUE_DRIVER | QUEUE_DEVICE => {
                return match len {
                    8 => Some((offset, 8)),
                    4 => Some((offset, 4)),
                    _ => None,
                };
            }
            o if [QUEUE_DESC, QUEUE_DRIVER, QUEUE_DEVICE].contains(&o.wrapping_sub(4)) => {
                return (len == 4).then_some((offset, 4));
            }
            _ => return None,
        };
        (len == width).then_some((offset, width))
    }
}

/// `device_status` bits (VIRTIO 1.2 §2.1).
pub mod device_status {
    pub const ACKNOWLEDGE: u8 = 1;
    pub const DRIVER: u8 = 2;
    pub const DRIVER_OK: u8 = 4;
    pub const FEATURES_OK: u8 = 8;
    pub const NEEDS_RESET: u8 = 0x40;
    pub const FAILED: u8 = 0x80;
}

/// The ISR status bits.
const ISR_QUEUE: u8 = 1;
const ISR_CONFIG: u8 = 2;

/// The largest queue the device takes.
const QUEUE_SIZE: u16 = 1024;

/// A virtqueue and the vector it interrupts through.
#[derive(Debug)]
struct PciQueue {
    queue: Queue,
    vector: u16,
}

impl PciQueue {
    fn new() -> Self {
        PciQueue {
            queue: Queue::new(QUEUE_SIZE).expect("a valid maximum queue size"),
            vector: NO_VECTOR,
        }
    }
}

/// Counters of the transport.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct PciStats {
    /// Accesses at no field, or at a field with the wrong width.
    pub bad_accesses: u64,
    /// Notifications (kicks), by any queue.
    pub kicks: u64,
    /// Kicks of a queue that was not running (before DRIVER_OK, a queue
    /// not enabled, a device that needs a reset).
    pub idle_kicks: u64,
    /// FEATURES_OK refused (features not offered, or no VERSION_1).
    pub features_refused: u64,
    /// DRIVER_OK refused (DEVICE_NEEDS_RESET set instead): no
    /// FEATURES_OK, or a queue outside guest memory.
    pub start_refused: u64,
    /// Requests whose chains could carry no status, and eventq/notifyq
    /// buffers returned empty.
    pub bad_chains: u64,
    /// Interrupts raised (MSI-X).
    pub interrupts: u64,
    /// Device resets (status 0, function reset, client gone).
    pub resets: u64,
    /// Panics caught in the device's turns.
    pub panics: u64,
}

/// The function.
#[derive(Debug)]
pub struct VirtioPci<T: Transport> {
    face: VirtioRdma<T>,
    config: ConfigSpace,
    /// The PCI configuration access capability's offset.
    pci_cfg: usize,
    offered: u64,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    /// The features accepted with FEATURES_OK.
    acked: u64,
    status: u8,
    config_vector: u16,
    queue_select: u16,
    queues: [PciQueue; vq::COUNT],
    isr: u8,
    /// The queues cannot be served until a reset (DRIVER_OK refused, a
    /// used ring that could not be written).
    broken: bool,
    /// When the device polls the doorbells and when it sleeps (the face
    /// core's policy, as over vhost-user).
    spinner: Spinner,
    pub stats: PciStats,
}

impl<T: Transport> VirtioPci<T> {
    /// The function presenting `face`, polling doorbells for `spin` after
    /// its last work (when the face polls at all).
    pub fn new(face: VirtioRdma<T>, spin: Duration) -> Self {
        let mut config = ConfigSpace::new(VENDOR_ID, DEVICE_ID, CLASS, REVISION);
        config.set_bar(0, Bar::Mem32);
        config.set_bar(usize::from(VIRTIO_BAR), Bar::Mem32);
        config.add_msix(VECTORS as u16, 0, 0, 0, MSIX_PBA as u32);
        let structure = |kind: u8, offset: u64, length: u64| -> Vec<u8> {
            let mut b = vec![16, kind, VIRTIO_BAR, 0, 0, 0];
            b.extend_from_slice(&(offset as u32).to_le_bytes());
            b.extend_from_slice(&(length as u32).to_le_bytes());
            b
        };
        config.add_vendor(&structure(cap::COMMON, layout::COMMON, layout::COMMON_LEN));
        let mut notify = structure(cap::NOTIFY, layout::NOTIFY, layout::NOTIFY_LEN);
        notify[0] = 20;
        notify.extend_from_slice(&(layout::NOTIFY_MULTIPLIER as u32).to_le_bytes());
        config.add_vendor(&notify);
        config.add_vendor(&structure(cap::ISR, layout::ISR, layout::ISR_LEN));
        config.add_vendor(&structure(cap::DEVICE, layout::DEVICE, layout::DEVICE_LEN));
        // The access window: bar, offset, length and data are the
        // driver's to write.
        let mut window = structure(cap::PCI_CFG, 0, 0);
        window[0] = 20;
        window[2] = 0;
        window.extend_from_slice(&[0; 4]);
        let pci_cfg = config.add_vendor(&window);
        config.make_writable(pci_cfg + 4, 1);
        config.make_writable(pci_cfg + 8, 12);
        let poll = if face.options().poll {
            feature::DOORBELL_POLL
        } else {
            0
        };
        let offered = feature::VERSION_1
            | feature::RING_INDIRECT_DESC
            | feature::RING_EVENT_IDX
            | feature::STATS
            | poll;
        VirtioPci {
            face,
            config,
            pci_cfg,
            offered,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            acked: 0,
            status: 0,
            config_vector: NO_VECTOR,
            queue_select: 0,
            queues: std::array::from_fn(|_| PciQueue::new()),
            isr: 0,
            broken: false,
            spinner: Spinner::new(spin),
            stats: PciStats::default(),
        }
    }

    pub fn face(&self) -> &VirtioRdma<T> {
        &self.face
    }

    pub fn face_mut(&mut self) -> &mut VirtioRdma<T> {
        &mut self.face
    }

    /// The device status the driver reads.
    pub fn status(&self) -> u8 {
        self.status
    }

    /// The features accepted with FEATURES_OK.
    pub fn acked(&self) -> u64 {
        self.acked
    }

    /// Whether the device serves its queues: DRIVER_OK, queues it can
    /// use, and guest memory to serve them in (bus mastering on). A device
    /// that failed inside (DEVICE_NEEDS_RESET after DEVICE_FATAL) still
    /// answers its controlq, ERR_DEVICE but for the queries (§10.4).
    fn running(&self, mem: &GuestMemoryMmap<()>) -> bool {
        self.status & device_status::DRIVER_OK != 0 && !self.broken && mem.num_regions() > 0
    }

    fn event_idx(&self) -> bool {
        self.acked & feature::RING_EVENT_IDX != 0
    }

    /// Back to the state after power-up: everything the driver made goes
    /// (§11.1), the queues and the transport's registers are reset.
    fn reset_virtio(&mut self) {
        self.face.set_polling(false);
        self.spinner.stop();
        self.face.reset();
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.driver_features = 0;
        self.acked = 0;
        self.face.set_features(0);
        self.status = 0;
        self.config_vector = NO_VECTOR;
        self.queue_select = 0;
        self.queues = std::array::from_fn(|_| PciQueue::new());
        self.isr = 0;
        self.broken = false;
        self.stats.resets += 1;
    }

    /// Interrupts the driver through `vector` (the ISR says why, for a
    /// driver that reads it).
    fn interrupt(&mut self, bus: &mut Bus<'_>, vector: u16, why: u8) {
        self.isr |= why;
        if vector != NO_VECTOR && bus.irqs.raise(irq_index::MSIX, u32::from(vector)) {
            self.stats.interrupts += 1;
        }
    }

    fn queue_interrupt(&mut self, bus: &mut Bus<'_>, q: u16) {
        let v = self.queues[usize::from(q)].vector;
        self.interrupt(bus, v, ISR_QUEUE);
    }

    /// The device cannot go on without a reset: DEVICE_NEEDS_RESET and a
    /// configuration change interrupt (VIRTIO 1.2 §2.1.2).
    fn needs_reset(&mut self, bus: &mut Bus<'_>) {
        if self.status & device_status::NEEDS_RESET != 0 {
            return;
        }
        self.status |= device_status::NEEDS_RESET;
        let v = self.config_vector;
        self.interrupt(bus, v, ISR_CONFIG);
    }

    fn write_status(&mut self, bus: &mut Bus<'_>, v: u8) {
        use device_status::*;
        if v == 0 {
            self.reset_virtio();
            return;
        }
        let old = self.status;
        // The driver sets bits; it clears them only by a reset.
        let mut new = old | v;
        if new & FEATURES_OK != 0 && old & FEATURES_OK == 0 {
            let f = self.driver_features;
            if old & DRIVER_OK != 0 || f & !self.offered != 0 || f & feature::VERSION_1 == 0 {
                // Read back without FEATURES_OK: the driver gives up.
                new &= !FEATURES_OK;
                self.stats.features_refused += 1;
            } else {
                self.acked = f;
                self.face.set_features(f);
                let event_idx = self.event_idx();
                for q in &mut self.queues {
                    q.queue.set_event_idx(event_idx);
                }
            }
        }
        self.status = new;
        if new & DRIVER_OK != 0 && old & DRIVER_OK == 0 {
            let whole = self
                .queues
                .iter()
                .all(|q| q.queue.ready() && q.queue.is_valid(bus.mem));
            if new & FEATURES_OK == 0 || !whole {
                self.stats.start_refused += 1;
                self.broken = true;
                self.needs_reset(bus);
            } else {
                // What waits (PORT_ACTIVE) goes into the buffers the
                // driver posted before DRIVER_OK.
                self.deliver(bus);
            }
        }
    }

    fn read_common(&self, offset: u64, width: usize) -> u64 {
        let q = self.queues.get(usize::from(self.queue_select));
        let half = |v: u64, at: u64| {
            if width == 8 {
                v
            } else if offset == at {
                v & 0xffff_ffff
            } else {
                v >> 32
            }
        };
        match offset {
            common::DEVICE_FEATURE_SELECT => u64::from(self.device_feature_select),
            common::DEVICE_FEATURE => match self.device_feature_select {
                0 => self.offered & 0xffff_ffff,
                1 => self.offered >> 32,
                _ => 0,
            },
            common::DRIVER_FEATURE_SELECT => u64::from(self.driver_feature_select),
            common::DRIVER_FEATURE => match self.driver_feature_select {
                0 => self.driver_features & 0xffff_ffff,
                1 => self.driver_features >> 32,
                _ => 0,
            },
            common::CONFIG_MSIX_VECTOR => u64::from(self.config_vector),
            common::NUM_QUEUES => vq::COUNT as u64,
            common::DEVICE_STATUS => u64::from(self.status),
            common::CONFIG_GENERATION => 0,
            common::QUEUE_SELECT => u64::from(self.queue_select),
            _ => {
                // A queue's field: 0 for a queue that does not exist.
                let Some(q) = q else {
                    return 0;
                };
                match offset {
                    common::QUEUE_SIZE => u64::from(q.queue.size()),
                    common::QUEUE_MSIX_VECTOR => u64::from(q.vector),
                    common::QUEUE_ENABLE => u64::from(q.queue.ready()),
                    common::QUEUE_NOTIFY_OFF => u64::from(self.queue_select),
                    o if o & !7 == common::QUEUE_DESC => half(q.queue.desc_table(), o),
                    o if o & !7 == common::QUEUE_DRIVER => half(q.queue.avail_ring(), o),
                    o if o & !7 == common::QUEUE_DEVICE => half(q.queue.used_ring(), o),
                    _ => 0,
                }
            }
        }
    }

    fn write_common(&mut self, bus: &mut Bus<'_>, offset: u64, width: usize, v: u64) {
        let vector = |v: u64| {
            if v < u64::from(VECTORS) {
                v as u16
            } else {
                NO_VECTOR
            }
        };
        match offset {
            common::DEVICE_FEATURE_SELECT => self.device_feature_select = v as u32,
            common::DRIVER_FEATURE_SELECT => self.driver_feature_select = v as u32,
            common::DRIVER_FEATURE => {
                // Features are the driver's to change until FEATURES_OK.
                if self.status & device_status::FEATURES_OK == 0 {
                    match self.driver_feature_select {
                        0 => {
                            self.driver_features =
                                (self.driver_features & !0xffff_ffff) | (v & 0xffff_ffff)
                        }
                        1 => {
                            self.driver_features =
                                (self.driver_features & 0xffff_ffff) | ((v & 0xffff_ffff) << 32)
                        }
                        _ => {}
                    }
                }
            }
            common::CONFIG_MSIX_VECTOR => self.config_vector = vector(v),
            common::DEVICE_STATUS => self.write_status(bus, v as u8),
            common::QUEUE_SELECT => self.queue_select = v as u16,
            common::DEVICE_FEATURE
            | common::NUM_QUEUES
            | common::CONFIG_GENERATION
            | common::QUEUE_NOTIFY_OFF
            | common::QUEUE_NOTIFY_DATA => self.stats.bad_accesses += 1,
            _ => {
                let started = self.status & device_status::DRIVER_OK != 0;
                let Some(q) = self.queues.get_mut(usize::from(self.queue_select)) else {
                    self.stats.bad_accesses += 1;
                    return;
                };
                // An enabled queue's set-up is fixed until a reset (and
                // queue_reset is not offered).
                let fixed = q.queue.ready() || started;
                match offset {
                    common::QUEUE_MSIX_VECTOR => q.vector = vector(v),
                    common::QUEUE_SIZE if !fixed => {
                        // A power of two up to the maximum, or nothing.
                        if q.queue.try_set_size(v as u16).is_err() {
                            self.stats.bad_accesses += 1;
                        }
                    }
                    common::QUEUE_ENABLE if !fixed && v == 1 => q.queue.set_ready(true),
                    o if !fixed && o & !7 == common::QUEUE_DESC => {
                        let (lo, hi) = halves(o, width, v);
                        q.queue.set_desc_table_address(lo, hi);
                    }
                    o if !fixed && o & !7 == common::QUEUE_DRIVER => {
                        let (lo, hi) = halves(o, width, v);
                        q.queue.set_avail_ring_address(lo, hi);
                    }
                    o if !fixed && o & !7 == common::QUEUE_DEVICE => {
                        let (lo, hi) = halves(o, width, v);
                        q.queue.set_used_ring_address(lo, hi);
                    }
                    _ => self.stats.bad_accesses += 1,
                }
            }
        }
    }

    /// A queue's notification.
    fn kick(&mut self, bus: &mut Bus<'_>, q: u16) {
        self.stats.kicks += 1;
        if !self.running(bus.mem) || !self.queues[usize::from(q)].queue.ready() {
            self.stats.idle_kicks += 1;
            return;
        }
        match q {
            vq::CONTROL => {
                let event_idx = self.event_idx();
                let wanted = queues::control(
                    &mut self.face,
                    &mut self.queues[usize::from(vq::CONTROL)].queue,
                    bus.mem,
                    event_idx,
                    &mut self.stats.bad_chains,
                );
                match wanted {
                    Ok(true) => self.queue_interrupt(bus, vq::CONTROL),
                    Ok(false) => {}
                    Err(e) => self.queue_broken(bus, e),
                }
            }
            vq::DOORBELL => {
                let poll = self.acked & feature::DOORBELL_POLL != 0 && self.face.options().poll;
                if poll && !self.face.polling() && self.spinner.wake(self.face.dev.device.clock()) {
                    self.face.set_polling(true);
                }
                self.face.doorbells();
            }
            // New buffers on the eventq or the notifyq: what waits goes
            // into them below.
            _ => {}
        }
        self.deliver(bus);
    }

    /// A virtqueue the device cannot use any more (a used ring outside
    /// guest memory): the device needs a reset.
    fn queue_broken(&mut self, bus: &mut Bus<'_>, e: virtio_queue::Error) {
        tracing::warn!(error = %e, "virtio-rdma (pci): a virtqueue is broken; the device needs a reset");
        self.broken = true;
        self.needs_reset(bus);
    }

    /// Hands what waits to the driver's eventq and notifyq buffers.
    fn deliver(&mut self, bus: &mut Bus<'_>) {
        if !self.running(bus.mem) {
            return;
        }
        let event_idx = self.event_idx();
        let cell = std::cell::RefCell::new(&mut self.face);
        let mut bad = 0;
        let [_, eventq, notifyq, _] = &mut self.queues;
        let events = queues::deliver(
            &mut eventq.queue,
            bus.mem,
            event_idx,
            || cell.borrow_mut().next_event(),
            |e| cell.borrow_mut().unget_event(e),
            &mut bad,
        );
        let notifications = queues::deliver(
            &mut notifyq.queue,
            bus.mem,
            event_idx,
            || cell.borrow_mut().next_notification(),
            |n| cell.borrow_mut().unget_notification(n),
            &mut bad,
        );
        self.stats.bad_chains += bad;
        for (q, r) in [(vq::EVENT, events), (vq::NOTIFY, notifications)] {
            match r {
                Ok(true) => self.queue_interrupt(bus, q),
                Ok(false) => {}
                Err(e) => self.queue_broken(bus, e),
            }
        }
    }

    fn bar2_read(&mut self, offset: u64, data: &mut [u8]) {
        use layout::*;
        data.fill(0);
        if (COMMON..COMMON + COMMON_LEN).contains(&offset) {
            match common::field(offset, data.len()) {
                Some((o, w)) => {
                    let v = self.read_common(o, w);
                    data.copy_from_slice(&v.to_le_bytes()[..w]);
                }
                None => self.stats.bad_accesses += 1,
            }
        } else if (ISR..ISR + ISR_LEN).contains(&offset) {
            // Reading the ISR status clears it.
            if offset == ISR {
                data[0] = std::mem::take(&mut self.isr);
            }
        } else if (DEVICE..DEVICE + DEVICE_LEN).contains(&offset) {
            let cfg = self.face.config();
            let bytes = cfg.as_bytes();
            let at = (offset - DEVICE) as usize;
            let n = data.len().min(bytes.len() - at);
            data[..n].copy_from_slice(&bytes[at..at + n]);
        } else {
            // The notify pages read as 0; the rest of the BAR is nothing.
            if !(NOTIFY..NOTIFY + NOTIFY_LEN).contains(&offset) {
                self.stats.bad_accesses += 1;
            }
        }
    }

    fn bar2_write(&mut self, bus: &mut Bus<'_>, offset: u64, data: &[u8]) {
        use layout::*;
        let value = || {
            let mut b = [0u8; 8];
            b[..data.len().min(8)].copy_from_slice(&data[..data.len().min(8)]);
            u64::from_le_bytes(b)
        };
        if (COMMON..COMMON + COMMON_LEN).contains(&offset) {
            match common::field(offset, data.len()) {
                Some((o, w)) => self.write_common(bus, o, w, value()),
                None => self.stats.bad_accesses += 1,
            }
        } else if (NOTIFY..NOTIFY + NOTIFY_LEN).contains(&offset) {
            // A queue's notify address, written with its index (16 bits;
            // VIRTIO_F_NOTIFICATION_DATA is not offered).
            let q = (offset - NOTIFY) / NOTIFY_MULTIPLIER;
            if (offset - NOTIFY).is_multiple_of(NOTIFY_MULTIPLIER) && matches!(data.len(), 2 | 4) {
                self.kick(bus, q as u16);
            } else {
                self.stats.bad_accesses += 1;
            }
        } else {
            // The ISR and the device configuration are read-only.
            self.stats.bad_accesses += 1;
        }
    }

    /// The PCI configuration access window's BAR, offset and length, if
    /// they name an access the window may make (VIRTIO 1.2 §4.1.4.9: a
    /// BAR of the function, 1, 2 or 4 bytes aligned to their size).
    fn window(&self) -> Option<(u32, u64, usize)> {
        let mut b = [0u8; 12];
        self.config.read(self.pci_cfg as u64 + 4, &mut b[..1]);
        self.config.read(self.pci_cfg as u64 + 8, &mut b[4..12]);
        let bar = u32::from(b[0]);
        let offset = u64::from(u32::from_le_bytes([b[4], b[5], b[6], b[7]]));
        let len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize;
        let ok = matches!(len, 1 | 2 | 4)
            && offset.is_multiple_of(len as u64)
            && offset + len as u64 <= self.region(bar).size;
        ok.then_some((bar, offset, len))
    }

    fn counters_of(&self) -> Vec<(String, u64)> {
        let mut c = self.face.counters();
        let s = &self.stats;
        for (k, v) in [
            ("bad_accesses", s.bad_accesses),
            ("kicks", s.kicks),
            ("idle_kicks", s.idle_kicks),
            ("features_refused", s.features_refused),
            ("start_refused", s.start_refused),
            ("bad_chains", s.bad_chains),
            ("interrupts", s.interrupts),
            ("resets", s.resets),
            ("panics", s.panics),
            ("status", u64::from(self.status)),
        ] {
            c.push((format!("pci.{k}"), v));
        }
        c.extend(self.spinner.policy().stats().counters());
        c
    }
}

/// The low and high halves a write of `width` bytes at `offset` of a
/// 64-bit field sets.
fn halves(offset: u64, width: usize, v: u64) -> (Option<u32>, Option<u32>) {
    if width == 8 {
        (Some(v as u32), Some((v >> 32) as u32))
    } else if offset.is_multiple_of(8) {
        (Some(v as u32), None)
    } else {
        (None, Some(v as u32))
    }
}

impl<T: Transport> Function for VirtioPci<T> {
    fn region(&self, index: u32) -> Region {
        let size = match index {
            0 => BAR0_SIZE,
            i if i == u32::from(VIRTIO_BAR) => BAR2_SIZE,
            _ => 0,
        };
        Region { size, mmap: None }
    }

    fn irq_counts(&self) -> Vec<u32> {
        vec![0, 0, VECTORS]
    }

    fn config(&self) -> &ConfigSpace {
        &self.config
    }

    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.config
    }

    fn config_read(&mut self, bus: &mut Bus<'_>, offset: u64, data: &mut [u8]) {
        self.config.read(offset, data);
        // The window's data: read through to the BAR it names; a window
        // that names no access reads 0 (never what an earlier access
        // left).
        let at = self.pci_cfg as u64 + 16;
        if offset == at {
            let n = data.len().min(4);
            data[..n].fill(0);
            if let Some((bar, off, len)) = self.window()
                && n >= len
            {
                let mut b = [0u8; 4];
                if self.region_read(bus, bar, off, &mut b[..len]).is_ok() {
                    data[..len].copy_from_slice(&b[..len]);
                }
            }
        }
    }

    fn config_write(&mut self, bus: &mut Bus<'_>, offset: u64, data: &[u8]) {
        self.config.write(offset, data);
        let at = self.pci_cfg as u64 + 16;
        if offset == at
            && let Some((bar, off, len)) = self.window()
            && data.len() >= len
        {
            let _ = self.region_write(bus, bar, off, &data[..len]);
        }
    }

    fn region_read(
        &mut self,
        _bus: &mut Bus<'_>,
        index: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), Errno> {
        match index {
            // The pending bits: QEMU keeps a masked vector's interrupt.
            0 => data.fill(0),
            i if i == u32::from(VIRTIO_BAR) => self.bar2_read(offset, data),
            _ => return Err(Errno::EINVAL),
        }
        Ok(())
    }

    fn region_write(
        &mut self,
        bus: &mut Bus<'_>,
        index: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), Errno> {
        match index {
            0 => {}
            i if i == u32::from(VIRTIO_BAR) => self.bar2_write(bus, offset, data),
            _ => return Err(Errno::EINVAL),
        }
        Ok(())
    }

    fn config_written(&mut self, _bus: &mut Bus<'_>) {}

    fn reset(&mut self, _bus: &mut Bus<'_>) {
        self.reset_virtio();
    }

    /// The DMA maps changed (or bus mastering): the engine, the sinks and
    /// the doorbell scans see the new memory at once.
    fn memory_changed(&mut self, bus: &mut Bus<'_>) {
        self.face.set_memory(bus.mem);
    }
}

impl<T: Transport> Served for VirtioPci<T> {
    /// One turn: doorbells (while polling), the engine, and what that
    /// produced for the driver; polling stops after the spin period.
    fn progress(&mut self, bus: &mut Bus<'_>) -> io::Result<Progress> {
        let running = self.running(bus.mem);
        // Doorbells are looked at in every turn, polling or not (as over
        // vhost-user): a packet that wakes the device may need a receive
        // whose doorbell was rung in a kick still on its way.
        let turn = self.face.turn(running)?;
        self.deliver(bus);
        // The policy (vrdma_face::spin): poll on while it pays; when it
        // says stop, tell the drivers to kick, look once more (a doorbell
        // rung before they read the word), and sleep — or, when that look
        // found work, take it in one more turn at once.
        let mut again = false;
        if self.face.polling() {
            let now = self.face.dev.device.clock();
            if self.spinner.round(now, turn.busy) == Next::Sleep {
                self.face.set_polling(false);
                if running && self.face.doorbells() > 0 {
                    again = true;
                    if self.spinner.wake(now) {
                        self.face.set_polling(true);
                    }
                    self.deliver(bus);
                }
            }
        }
        Ok(Progress {
            // Moved packets: another round at once (a long message leaves
            // a budget a round); rings only waiting for room: the ACKs that
            // make it wake the loop.
            received: usize::from(turn.moved || again),
            sent: 0,
            deadline: turn.deadline,
        })
    }

    fn recheck(&self) -> Option<Duration> {
        // Spinning, or waiting for kicks (the doorbell queue's).
        self.face.polling().then_some(Duration::ZERO)
    }

    fn now(&self) -> u64 {
        self.face.dev.device.clock()
    }

    fn quiet_socket(&self) -> bool {
        // Drivers told not to kick: doorbells in the areas; the socket
        // brings the control queue's notifications and maps.
        self.face.polling()
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.face.dev.device.fd()
    }

    fn arm(&mut self) {
        self.face.dev.device.transport_mut().arm();
    }

    fn client_gone(&mut self) {
        self.reset_virtio();
    }

    /// DEVICE_FATAL for the driver (on the eventq, if it can take it),
    /// everything it made gone, and DEVICE_NEEDS_RESET (§10.4).
    fn fail(&mut self, bus: &mut Bus<'_>) {
        self.stats.panics += 1;
        self.face.fail();
        self.deliver(bus);
        self.needs_reset(bus);
    }

    fn counters(&self) -> Vec<(String, u64)> {
        self.counters_of()
    }
}
