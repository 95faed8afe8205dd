//! The PVRDMA PCI function: its config space and BARs (MSI-X in BAR0, the
//! registers in BAR1, doorbell pages in BAR2), the shared-region handshake,
//! the command channel, doorbells, the device rings it produces into and
//! its interrupts — a thin translation of VMware's device ABI onto a vrdma
//! device. What the guest made on the device is the face's state
//! (`state`), which commands (`cmd`) and doorbells act on.
//!
//! Everything the guest writes is copied out of guest memory and checked
//! before it is used: the shared region when its address is written, a
//! command when REQUEST is written, page directories when an object is
//! made, ring indices and WQEs as they are taken. The device touches guest
//! memory only through the client's DMA maps, and guest data only through
//! the engine's MR checks.

use std::time::Duration;

use nix::errno::Errno;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap};
use vrdma_device::{Device, GuestMem, ObjectBudget, Transport};
use vrdma_engine::{attr::PortAttr, event::AsyncEvent};
use vrdma_face::{
    Claims, GuestError, Owner, PageList, guest,
    spin::{self, Looks, SpinStats, Spinner},
};
use vrdma_vfio_user::{
    Bus, Function, Region,
    irq::Irqs,
    pci::{Bar, ConfigSpace},
    proto::irq_index,
};
use zerocopy::IntoBytes;

use crate::{
    abi::{self, Caps, Dsr, PAGE_SIZE, eqe, err, intr, reg},
    caps::Limits,
    cmd,
    cq::{CQNE_SIZE, DeviceRing, EQE_SIZE},
    doorbells::SharedDoorbells,
    ring,
    state::{FaceStats, State},
};

/// BAR0: the MSI-X table at 0, its pending bits at 0x2000 (QEMU emulates
/// the table; the pending bits are read here).
pub const BAR0_SIZE: u64 = 0x4000;
pub const MSIX_PBA: u64 = 0x2000;
/// BAR1: the registers.
pub const BAR1_SIZE: u64 = 0x1000;

/// The rings and slots a loaded shared region names.
#[derive(Debug)]
struct Loaded {
    cmd_slot: u64,
    resp_slot: u64,
    async_ring: DeviceRing,
    cq_ring: DeviceRing,
    /// The page frame of doorbell page 0 (BAR2's first page).
    uar_pfn: u64,
    /// The two rings' pages.
    pages: Vec<u64>,
}

/// The function.
#[derive(Debug)]
pub struct Pvrdma<T: Transport> {
    config: ConfigSpace,
    mac: [u8; 6],
    // Registers.
    dsr_low: u32,
    dsr_high: u32,
    err: u32,
    icr: u32,
    imr: u32,
    active: bool,
    loaded: Option<Loaded>,
    /// The device and what the guest made on it.
    state: State<T>,
    /// Poll every ring instead of waiting for doorbells; with
    /// `doorbell_pages`, the doorbell pages are shared memory the device
    /// reads (no exit per post). Nothing kicks such a device: it spins
    /// while that pays and looks at intervals between
    /// (`vrdma_face::spin`).
    polling: bool,
    spinner: Spinner,
    looks: Looks,
    /// The interval until the next look, while not spinning.
    next_look: Duration,
    doorbell_pages: Option<SharedDoorbells>,
}

impl<T: Transport> Pvrdma<T> {
    /// A function whose device reaches the network through `transport`,
    /// with `limits`, the port's Ethernet address `mac` and its path MTU.
    pub fn new(
        limits: Limits,
        mac: [u8; 6],
        mut port: PortAttr,
        transport: T,
    ) -> Result<Self, crate::caps::LimitError> {
        limits.validate()?;
        // The GID table the guest fills with CREATE_BIND: empty, its
        // announced length.
        port.gids = vec![None; limits.gid_tbl_len as usize];
        let mut config = ConfigSpace::new(abi::VENDOR_ID, abi::DEVICE_ID, 0x02_8000, 0);
        config.set_bar(0, Bar::Mem32);
        config.set_bar(1, Bar::Mem32);
        config.set_bar(2, Bar::Mem32);
        config.add_msix(intr::VECTORS as u16, 0, 0, 0, MSIX_PBA as u32);
        let node_guid = crate::caps::node_guid(mac);
        Ok(Pvrdma {
            config,
            mac,
            dsr_low: 0,
            dsr_high: 0,
            err: err::NO_DSR,
            icr: 0,
            imr: u32::MAX,
            active: false,
            loaded: None,
            state: State::new(limits, node_guid, port, transport),
            polling: false,
            spinner: Spinner::new(spin::DEFAULT_WINDOW),
            looks: Looks::default(),
            next_look: Duration::ZERO,
            doorbell_pages: None,
        })
    }

    /// What the guest's objects may make the engine hold (by default,
    /// [`ObjectBudget::Derived`] from the guest's size; applied
    /// again whenever that memory changes and after each reset).
    pub fn set_object_budget(&mut self, budget: ObjectBudget) {
        self.state.dev.set_budget(budget);
    }

    /// The guest has `guest` bytes of RAM (with memory hot-plug, the most
    /// it may have), or a size not configured: a derived object budget
    /// comes from it, never from more than the guest shares
    /// ([`ObjectBudget::Derived`]). Its VMM's DMA maps are held to the
    /// same size by the server's configuration
    /// (`vrdma_vfio_user::dma::DmaConfig::for_guest`).
    pub fn set_guest_size(&mut self, guest: Option<u64>) {
        self.state.dev.set_guest_size(guest);
    }

    pub fn device(&self) -> &Device<GuestMem, T> {
        &self.state.dev.device
    }

    pub fn device_mut(&mut self) -> &mut Device<GuestMem, T> {
        &mut self.state.dev.device
    }

    pub fn stats(&self) -> FaceStats {
        self.state.stats()
    }

    /// The device's counters (port, engine, objects) and the face's, for
    /// `vrdma stat`.
    pub fn counters(&self) -> Vec<(String, u64)> {
        let mut v = self.state.dev.device.counters();
        let s = self.state.stats();
        let ring_drops = s.ring_drops
            + self
                .loaded
                .as_ref()
                .map_or(0, |l| l.async_ring.dropped + l.cq_ring.dropped);
        for (k, n) in [
            ("commands", s.commands),
            ("command_errors", s.command_errors),
            ("doorbells", s.doorbells),
            ("doorbells_refused", s.doorbells_refused),
            ("sweep_found", s.sweep_found),
            ("events", s.events),
            ("notifications", s.notifications),
            ("ring_drops", ring_drops),
            ("resets", s.resets),
            ("gids_refused", s.gids_refused),
            ("panics", s.panics),
            ("active", u64::from(self.active)),
        ]
        .into_iter()
        .chain(s.rings.fields())
        {
            v.push((format!("pvrdma.{k}"), n));
        }
        if self.polling {
            v.extend(self.spin_stats().counters());
        }
        v.extend(
            self.state
                .dev
                .refusals
                .fields()
                .into_iter()
                .map(|(k, n)| (format!("pvrdma.{k}"), n)),
        );
        v
    }

    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// Whether the driver activated the device.
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// Doorbell pages (BAR2).
    pub fn uar_pages(&self) -> u32 {
        self.state.limits.max_uar
    }

    /// Raises interrupt cause `vector` (0 response, 1 async, 2 CQ): through
    /// its MSI-X vector unless IMR masks it, when it waits in ICR until
    /// unmasked.
    fn raise(&mut self, irqs: &mut Irqs, vector: u32) {
        if self.imr & (1 << vector) != 0 {
            self.icr |= 1 << vector;
            return;
        }
        irqs.raise(irq_index::MSIX, vector);
    }

    /// The mode with no exit per post: the doorbell pages (BAR2) become
    /// memory shared with the client, which maps them, and the device reads
    /// them and every ring each round (its thread busy-polls). Before the
    /// client connects: the region's layout is what the client is told.
    pub fn share_doorbells(&mut self) -> std::io::Result<()> {
        self.doorbell_pages = Some(SharedDoorbells::new(self.state.limits.max_uar)?);
        self.polling = true;
        Ok(())
    }

    /// Everything the guest made goes, the shared region is forgotten
    /// (CTL RESET, a function reset, a new shared region, the client gone).
    pub fn reset_device(&mut self) {
        self.state.reset();
        self.loaded = None;
        self.active = false;
        self.err = err::NO_DSR;
        self.icr = 0;
        self.imr = u32::MAX;
        self.dsr_low = 0;
        self.dsr_high = 0;
        if let Some(d) = &self.doorbell_pages {
            d.clear();
        }
        self.state.stats.resets += 1;
    }

    /// DSRHIGH: the driver handed over its shared region. Read it, check
    /// the rings it names, and write the capabilities back.
    fn load_dsr(&mut self, mem: &GuestMemoryMmap<()>) {
        let (low, high) = (self.dsr_low, self.dsr_high);
        if self.loaded.is_some() || self.active {
            // A new region replaces everything.
            self.reset_device();
            (self.dsr_low, self.dsr_high) = (low, high);
        }
        let addr = u64::from(high) << 32 | u64::from(low);
        match self.try_load(mem, addr) {
            Ok(l) => {
                let caps: Caps = self.state.limits.caps(self.state.dev.attr().node_guid);
                if guest::write(mem, addr + abi::DSR_CAPS_OFFSET, &caps).is_err() {
                    self.err = err::INVALID;
                    return;
                }
                self.state.dev.claims.claim(Owner::Device, &l.pages, &[]);
                self.loaded = Some(l);
                self.err = 0;
            }
            Err(e) => {
                tracing::warn!(addr, error = %e, "PVRDMA: shared region refused");
                self.err = err::INVALID;
            }
        }
    }

    fn try_load(&self, mem: &GuestMemoryMmap<()>, addr: u64) -> Result<Loaded, GuestError> {
        let dsr: Dsr = guest::read(mem, addr)?;
        let slot = |a: u64| -> Result<u64, GuestError> {
            if !a.is_multiple_of(PAGE_SIZE) {
                return Err(GuestError::Unaligned(a));
            }
            // Both slots must be there now (they are checked again on
            // each use).
            guest::read::<[u8; 8], _>(mem, a).map(|_| a)
        };
        let cmd_slot = slot(dsr.cmd_slot_dma.get())?;
        let resp_slot = slot(dsr.resp_slot_dma.get())?;
        let mut all = Vec::new();
        let mut device_ring =
            |pages: &abi::RingPages, stride: u64| -> Result<DeviceRing, GuestError> {
                let n = u64::from(pages.num_pages.get());
                // The state page and at least one data page; the driver uses
                // 4 (CVE-2021-3607, CVE-2023-1544: bounded, never 0).
                if !(2..=512).contains(&n) {
                    return Err(GuestError::PageCount(n));
                }
                let list = PageList::read_directory(mem, pages.pdir_dma.get(), n)?;
                let count = ((n - 1) * PAGE_SIZE / stride) as u32;
                let state = list.pages()[0] + abi::ring_state::RX;
                let ring = ring::ring(count, stride, state, list.skip(1))
                    .ok_or(GuestError::PageCount(n))?;
                all.extend_from_slice(list.pages());
                Ok(DeviceRing::new(ring))
            };
        let async_ring = device_ring(&dsr.async_ring_pages, EQE_SIZE)?;
        let cq_ring = device_ring(&dsr.cq_ring_pages, CQNE_SIZE)?;
        // Each ring on pages of its own (see Claims).
        if let Some(page) = Claims::default().conflict(&all) {
            return Err(GuestError::Shared(page));
        }
        Ok(Loaded {
            cmd_slot,
            resp_slot,
            async_ring,
            cq_ring,
            uar_pfn: dsr.uar_pfn64.get(),
            pages: all,
        })
    }

    fn read_register(&mut self, offset: u64) -> u32 {
        match offset {
            reg::VERSION => abi::VERSION,
            reg::DSRLOW => self.dsr_low,
            reg::DSRHIGH => self.dsr_high,
            reg::ERR => self.err,
            reg::ICR => std::mem::take(&mut self.icr),
            reg::IMR => self.imr,
            reg::MACL => u32::from_le_bytes([self.mac[0], self.mac[1], self.mac[2], self.mac[3]]),
            reg::MACH => u32::from(u16::from_le_bytes([self.mac[4], self.mac[5]])),
            _ => 0,
        }
    }

    fn write_register(&mut self, bus: &mut Bus<'_>, offset: u64, v: u32) {
        match offset {
            reg::DSRLOW => self.dsr_low = v,
            reg::DSRHIGH => {
                self.dsr_high = v;
                self.load_dsr(bus.mem);
            }
            reg::CTL => match v {
                reg::CTL_ACTIVATE => {
                    self.active = self.loaded.is_some();
                    self.err = if self.active { 0 } else { err::NO_DSR };
                }
                reg::CTL_UNQUIESCE => {
                    self.err = if self.active { 0 } else { err::NO_DSR };
                }
                reg::CTL_RESET => {
                    self.reset_device();
                    self.err = 0;
                }
                _ => self.err = err::INVALID,
            },
            reg::REQUEST => self.request(bus),
            reg::IMR => {
                self.imr = v;
                // Causes that waited while masked.
                let pending = self.icr & !v;
                for vector in 0..intr::VECTORS {
                    if pending & (1 << vector) != 0 {
                        self.icr &= !(1 << vector);
                        bus.irqs.raise(irq_index::MSIX, vector);
                    }
                }
            }
            // ICR is read to clear; VERSION, ERR and the MAC are read-only.
            _ => {}
        }
    }

    /// REQUEST: runs the command in the command slot, writes its response
    /// and sets ERR before the write returns (QEMU holds the vCPU until the
    /// reply: its `x-no-posted-writes`), and interrupts for a response the
    /// driver waits for. A command the driver does not wait for (a destroy,
    /// a GID bind, MODIFY_SRQ) or one that failed gets no interrupt: the
    /// driver never waits for those, and a late interrupt would complete
    /// its next command early.
    fn request(&mut self, bus: &mut Bus<'_>) {
        let Some(loaded) = &self.loaded else {
            // No shared region: nothing to read the command from
            // (CVE-2022-1050).
            self.err = err::NO_DSR;
            return;
        };
        if !self.active {
            self.err = err::NO_DSR;
            return;
        }
        let (cmd_slot, resp_slot, uar_pfn) = (loaded.cmd_slot, loaded.resp_slot, loaded.uar_pfn);
        self.state.stats.commands += 1;
        let mut req = [0u8; abi::MAX_REQUEST];
        // The response slot must be there before the command runs: a
        // command that made an object and could not say so would leave
        // the object behind, the driver told it failed. (Nothing unmaps
        // it in between: maps change only between messages.)
        if guest::read_into(bus.mem, cmd_slot, &mut req).is_err()
            || !bus
                .mem
                .check_range(vm_memory::GuestAddress(resp_slot), abi::MAX_RESPONSE)
        {
            self.err = err::INVALID;
            self.state.stats.command_errors += 1;
            return;
        }
        match cmd::run(&mut self.state, bus.mem, &req, uar_pfn) {
            Ok(cmd::Done { response, wait }) => {
                if guest::write_bytes(bus.mem, resp_slot, &response).is_err() {
                    self.err = err::INVALID;
                    self.state.stats.command_errors += 1;
                    return;
                }
                self.err = 0;
                if wait {
                    self.raise(bus.irqs, intr::RESPONSE);
                }
            }
            Err(f) => {
                self.state.stats.command_errors += 1;
                let answer = format!("errno {}", f.err);
                let r = vrdma_face::Refusal {
                    kind: vrdma_face::refusals::Kind::Command,
                    rule: f.what,
                    opcode: f.cmd,
                    object: 0,
                    field: None,
                    answer: &answer,
                };
                let now = self.state.dev.device.now();
                let name = std::thread::current().name().unwrap_or("pvrdma").to_owned();
                self.state.dev.refusals.note(now, &name, &r);
                // The response header says it too (MODIFY_QP reads it).
                let _ = guest::write_bytes(bus.mem, resp_slot, &f.response());
                self.err = f.err;
            }
        }
    }

    /// A doorbell: a 32-bit write at `offset` of BAR2 (doorbell page
    /// `offset / PAGE_SIZE`).
    fn doorbell(&mut self, offset: u64, v: u32) {
        self.state.stats.doorbells += 1;
        let page = (offset / PAGE_SIZE) as u32;
        self.state.doorbell(page, offset % PAGE_SIZE, v);
    }

    /// One round of the device: the network and the engine's timers, then
    /// what that produced for the guest — completions are already in its
    /// CQs; CQ notifications and async events go into the device rings
    /// with their interrupts, WQEs waiting for room are taken, and the
    /// rings' consumer indices follow what the engine retired. Returns the
    /// device's progress (its next deadline).
    pub fn progress(&mut self, bus: &mut Bus<'_>) -> std::io::Result<vrdma_device::Progress> {
        let before = (self.state.stats.doorbells, self.state.dev.taken.wqes);
        // What the guest posted goes into the engine before the round, so
        // that the round sends it (taken after, it waited a whole turn:
        // another receive and another look at the sockets for every hop).
        self.look();
        let mut p = self.state.dev.device.progress()?;
        self.deliver(bus);
        // What the rings gave once the round made room, and the round's
        // answers, go now rather than in the next round (measured in the
        // faces bench's stepped mode: a round later costs more rounds per
        // operation than the system call saves).
        p.sent += self.state.dev.device.send_pending();
        if self.polling {
            // Work: packets in or out, a doorbell rung, a WQE taken.
            let found =
                !p.is_idle() || (self.state.stats.doorbells, self.state.dev.taken.wqes) != before;
            let now = self.state.dev.device.clock();
            if self.spinner.spinning() {
                let _ = self.spinner.round(now, found);
            } else if found {
                let _ = self.spinner.wake(now);
            }
            self.next_look = self.looks.after(found);
        }
        Ok(p)
    }

    /// When the loop must come back (`vrdma_face::vfio::Served::recheck`):
    /// at once while spinning, at the next look while polling without a
    /// spin, and only when something comes when doorbells trap (or no
    /// driver has activated the device).
    pub fn recheck(&self) -> Option<Duration> {
        if !self.polling || !self.active {
            // Nothing to look at before the driver activates the device.
            None
        } else if self.spinner.spinning() {
            Some(Duration::ZERO)
        } else {
            Some(self.next_look)
        }
    }

    /// The longest the device spins after its last work (with shared
    /// doorbells; `vrdma_face::spin`), by default [`spin::DEFAULT_WINDOW`].
    pub fn set_spin(&mut self, max: Duration) {
        self.spinner = Spinner::new(max);
    }

    /// Whether the device polls the guest's memory (shared doorbells).
    pub fn polling(&self) -> bool {
        self.polling
    }

    /// What the polling policy did.
    pub fn spin_stats(&self) -> SpinStats {
        self.spinner.policy().stats()
    }

    /// With shared doorbells, the look at the guest's memory: the
    /// doorbell pages, then the rings.
    fn look(&mut self) {
        if !self.active || !self.polling {
            return;
        }
        match &self.doorbell_pages {
            Some(d) => self.state.shared_look(d),
            // Polling without the pages (not a mode the function offers):
            // every ring.
            None => self.state.dev.take_all(),
        }
    }

    /// The guest-facing half of a round (also after a doorbell, which can
    /// complete work at once): the rings that waited for room, then the
    /// completions' notifications and the events.
    pub fn deliver(&mut self, bus: &mut Bus<'_>) {
        if !self.active {
            return;
        }
        let mem = bus.mem;
        let _ = self.state.dev.progress_rings();
        // CQ notifications: one entry per armed CQ that completed, one
        // interrupt for the lot.
        let mut notified = false;
        while let Some(cq) = self.state.dev.device.engine_mut().poll_notification() {
            let Some(l) = self.loaded.as_mut() else {
                break;
            };
            if l.cq_ring.push(mem, &abi::Cqne { info: cq.0.into() }) {
                self.state.stats.notifications += 1;
                notified = true;
            } else {
                self.state.stats.ring_drops += 1;
            }
        }
        if notified {
            self.raise(bus.irqs, intr::CQ);
        }
        let mut evented = false;
        let mut own = self.state.take_face_events().into_iter();
        while let Some((kind, info)) = self
            .state
            .dev
            .device
            .engine_mut()
            .poll_event()
            .map(event_code)
            .or_else(|| own.next())
        {
            let Some(l) = self.loaded.as_mut() else {
                break;
            };
            if l.async_ring.push(
                mem,
                &abi::Eqe {
                    kind: kind.into(),
                    info: info.into(),
                },
            ) {
                self.state.stats.events += 1;
                evented = true;
            } else {
                self.state.stats.ring_drops += 1;
            }
        }
        if evented {
            self.raise(bus.irqs, intr::ASYNC);
        }
    }

    /// The device failed inside (its thread panicked while serving it):
    /// the guest is told (DEVICE_FATAL, if its async ring is there), then
    /// everything it made goes as in a reset. Its driver must probe the
    /// device again, as after any reset; the daemon and its other devices
    /// go on.
    pub fn fail(&mut self, bus: &mut Bus<'_>) {
        self.state.stats.panics += 1;
        if let Some(l) = self.loaded.as_mut() {
            let fatal = abi::Eqe {
                kind: eqe::DEVICE_FATAL.into(),
                info: 1.into(),
            };
            if l.async_ring.push(bus.mem, &fatal) {
                self.state.stats.events += 1;
                self.raise(bus.irqs, intr::ASYNC);
            }
        }
        self.reset_device();
    }
}

/// The async event entry for an engine event.
fn event_code(ev: AsyncEvent) -> (u32, u32) {
    match ev {
        AsyncEvent::CqErr { cq } => (eqe::CQ_ERR, cq.0),
        AsyncEvent::QpFatal { qp } => (eqe::QP_FATAL, qp.value()),
        AsyncEvent::QpReqErr { qp } => (eqe::QP_REQ_ERR, qp.value()),
        AsyncEvent::QpAccessErr { qp } => (eqe::QP_ACCESS_ERR, qp.value()),
        AsyncEvent::QpLastWqeReached { qp } => (eqe::QP_LAST_WQE_REACHED, qp.value()),
        AsyncEvent::SqDrained { qp } => (eqe::SQ_DRAINED, qp.value()),
        AsyncEvent::SrqLimitReached { srq } => (eqe::SRQ_LIMIT_REACHED, srq.0),
        AsyncEvent::PortActive { port } => (eqe::PORT_ACTIVE, u32::from(port)),
    }
}

impl<T: Transport> Function for Pvrdma<T> {
    fn region(&self, index: u32) -> Region {
        let size = match index {
            0 => BAR0_SIZE,
            1 => BAR1_SIZE,
            2 => u64::from(self.state.limits.max_uar) * PAGE_SIZE,
            _ => 0,
        };
        let mmap = match index {
            2 => self.doorbell_pages.as_ref().map(|d| d.region()),
            _ => None,
        };
        Region { size, mmap }
    }

    fn irq_counts(&self) -> Vec<u32> {
        vec![0, 0, intr::VECTORS]
    }

    fn config(&self) -> &ConfigSpace {
        &self.config
    }

    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.config
    }

    fn region_read(
        &mut self,
        _bus: &mut Bus<'_>,
        index: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), Errno> {
        data.fill(0);
        match index {
            // The pending bits (nothing is held here: QEMU keeps a masked
            // vector's interrupt itself).
            0 => {}
            1 => {
                if data.len() == 4 && offset.is_multiple_of(4) {
                    data.copy_from_slice(&self.read_register(offset).to_le_bytes());
                }
            }
            // Doorbell pages read as 0 (the driver never reads them).
            2 => {}
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
        if data.len() != 4 || !offset.is_multiple_of(4) {
            // The driver only does 32-bit accesses.
            return if index <= 2 {
                Ok(())
            } else {
                Err(Errno::EINVAL)
            };
        }
        let v = u32::from_le_bytes(data.try_into().unwrap_or_default());
        match index {
            0 => {}
            1 => self.write_register(bus, offset, v),
            2 => {
                if self.active && bus.mem.num_regions() > 0 {
                    self.doorbell(offset, v);
                    self.deliver(bus);
                }
            }
            _ => return Err(Errno::EINVAL),
        }
        Ok(())
    }

    fn config_written(&mut self, _bus: &mut Bus<'_>) {}

    fn reset(&mut self, _bus: &mut Bus<'_>) {
        self.reset_device();
    }

    /// The DMA maps changed: the engine, the CQ sinks and the transport's
    /// lent pieces move to the new memory at once.
    fn memory_changed(&mut self, bus: &mut Bus<'_>) {
        self.state.dev.remap(bus.mem);
    }
}

/// Bytes of a response (for tests).
pub fn as_bytes<T: IntoBytes + zerocopy::Immutable>(v: &T) -> &[u8] {
    v.as_bytes()
}
