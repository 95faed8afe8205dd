//! One client's session with a PCI function: the protocol's state (the
//! version handshake, the DMA maps, the interrupt eventfds) and the answer
//! to each command. It does no I/O: a message goes in with the descriptors
//! that came with it, a reply (and the descriptor to send with it) comes
//! out, so that tests and the fuzzer drive it without a socket.

use std::{os::fd::OwnedFd, sync::Arc};

use nix::errno::Errno;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap};
use zerocopy::IntoBytes;

use crate::{
    dma::{DmaConfig, DmaTable},
    irq::Irqs,
    pci::ConfigSpace,
    proto::{
        self, CapHeader, DeviceInfo, Header, IrqInfo, RegionAccess, RegionInfo, Request,
        SparseArea, SparseMmapHead, VersionHead, info, region,
    },
};

/// A region of a function that is mapped into the client (its pages are
/// shared: the client maps `areas` of the descriptor at `offset`).
#[derive(Clone, Debug)]
pub struct Mmap {
    pub fd: Arc<OwnedFd>,
    /// Where the region starts in the descriptor.
    pub offset: u64,
    /// The parts of the region that are mapped, (offset, size) in the
    /// region; the rest traps.
    pub areas: Vec<(u64, u64)>,
}

/// A BAR, the ROM or the VGA region (the config region is the
/// [`ConfigSpace`]).
#[derive(Clone, Debug, Default)]
pub struct Region {
    /// Bytes; 0 for a region the function does not have.
    pub size: u64,
    pub mmap: Option<Mmap>,
}

/// What a function reaches while it handles an access: the guest memory
/// it may use and the interrupts it may raise.
#[derive(Debug)]
pub struct Bus<'a> {
    /// The client's DMA maps (empty until it maps memory, or while bus
    /// mastering is off).
    pub mem: &'a GuestMemoryMmap<()>,
    pub irqs: &'a mut Irqs,
}

/// A PCI function served over vfio-user.
pub trait Function {
    /// Regions 0..=8 (index 7, the config space, is not asked for).
    fn region(&self, index: u32) -> Region;

    /// Vectors per interrupt index (INTx, MSI, MSI-X, ...).
    fn irq_counts(&self) -> Vec<u32>;

    fn config(&self) -> &ConfigSpace;

    fn config_mut(&mut self) -> &mut ConfigSpace;

    /// A read of `data.len()` bytes (1, 2, 4 or 8, or a bulk read) at
    /// `offset` of region `index`, inside the region.
    fn region_read(
        &mut self,
        bus: &mut Bus<'_>,
        index: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), Errno>;

    /// A write at `offset` of region `index`, inside the region.
    fn region_write(
        &mut self,
        bus: &mut Bus<'_>,
        index: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), Errno>;

    /// A read of the config space (inside it). By default its bytes; a
    /// function whose capabilities read through to its state (virtio's
    /// PCI configuration access window) answers itself.
    fn config_read(&mut self, bus: &mut Bus<'_>, offset: u64, data: &mut [u8]) {
        let _ = bus;
        self.config().read(offset, data);
    }

    /// A write of the config space (inside it), through its masks by
    /// default.
    fn config_write(&mut self, bus: &mut Bus<'_>, offset: u64, data: &[u8]) {
        let _ = bus;
        self.config_mut().write(offset, data);
    }

    /// The config space was written (Bus Master or Memory Space may have
    /// changed).
    fn config_written(&mut self, bus: &mut Bus<'_>);

    /// A function-level reset: back to the state after power-up.
    fn reset(&mut self, bus: &mut Bus<'_>);

    /// The DMA maps changed: drop every reference into the old memory
    /// (the unmapped pages go when the last one does).
    fn memory_changed(&mut self, bus: &mut Bus<'_>);
}

/// A reply and the descriptor to send with it.
#[derive(Debug)]
pub struct Reply {
    pub bytes: Vec<u8>,
    pub fd: Option<Arc<OwnedFd>>,
}

/// Counters of a session.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct SessionStats {
    pub messages: u64,
    /// Commands answered with an error.
    pub errors: u64,
    pub dma_maps: u64,
    pub dma_unmaps: u64,
    /// DMA maps refused (a bad file, over a budget, a bad range, ...).
    pub dma_refused: u64,
}

/// What a session holds of the process's resources now.
///
/// Its descriptors are at most [`DmaConfig::max_maps`] (one per mapping)
/// plus the function's interrupt vectors (one eventfd each), and the
/// connection's at most [`proto::MAX_FDS`] of a message being received.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Holdings {
    /// DMA maps, accessible or not (and those taken back but still held).
    pub dma_maps: usize,
    /// Bytes of the client's memory mapped into this process.
    pub dma_bytes: u64,
    /// Descriptors: the mappings' files and the interrupt eventfds.
    pub fds: usize,
    /// Pages of unsealed memory the client took away while they were
    /// mapped (faults the SIGBUS guard repaired), since the start.
    pub dma_faults: u64,
}

/// A client's session.
#[derive(Debug)]
pub struct Session {
    versioned: bool,
    dma: DmaTable,
    irqs: Irqs,
    /// Memory seen by the function: the DMA maps while bus mastering is
    /// on, nothing otherwise.
    visible: GuestMemoryMmap<()>,
    stats: SessionStats,
}

impl Session {
    /// A session for `f` with the default [`DmaConfig`].
    pub fn new(f: &impl Function) -> Self {
        Self::with_config(f, DmaConfig::default())
    }

    /// A session for `f` whose client maps memory as `dma` allows.
    pub fn with_config(f: &impl Function, dma: DmaConfig) -> Self {
        Session {
            versioned: false,
            dma: DmaTable::new(dma),
            irqs: Irqs::new(&f.irq_counts()),
            visible: GuestMemoryMmap::default(),
            stats: SessionStats::default(),
        }
    }

    pub fn stats(&self) -> SessionStats {
        self.stats
    }

    /// What the function reaches now.
    pub fn bus(&mut self) -> Bus<'_> {
        Bus {
            mem: &self.visible,
            irqs: &mut self.irqs,
        }
    }

    /// DMA maps the client made.
    pub fn dma_maps(&self) -> usize {
        self.dma.len()
    }

    /// What the session holds now.
    pub fn holdings(&self) -> Holdings {
        let u = self.dma.usage();
        Holdings {
            dma_maps: u.maps,
            dma_bytes: u.bytes,
            fds: u.fds + self.irqs.fds(),
            dma_faults: self.dma.faults(),
        }
    }

    /// Recomputes the memory the function sees; tells it if it changed.
    fn refresh(&mut self, f: &mut impl Function) {
        let next = if f.config().bus_master() {
            self.dma.mem().clone()
        } else {
            GuestMemoryMmap::default()
        };
        let same = next.iter().count() == self.visible.iter().count()
            && next
                .iter()
                .zip(self.visible.iter())
                .all(|(a, b)| std::ptr::eq(a, b));
        if !same {
            self.visible = next;
            let mut bus = self.bus();
            f.memory_changed(&mut bus);
        }
        // The function let go of the old memory: the maps taken back go.
        self.dma.reap();
    }

    /// The client went away: every map and eventfd goes; the function
    /// keeps its state for the next client (which will reset it).
    pub fn disconnect(&mut self, f: &mut impl Function) {
        self.dma.clear();
        self.irqs.clear();
        self.versioned = false;
        self.refresh(f);
    }

    /// Handles one message. `None`: no reply (a posted write).
    pub fn handle(
        &mut self,
        f: &mut impl Function,
        h: &Header,
        payload: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Option<Reply> {
        self.stats.messages += 1;
        let result = self.dispatch(f, h, payload, fds);
        if h.no_reply() {
            if let Err(e) = result {
                self.stats.errors += 1;
                tracing::debug!(command = h.command, error = %e, "posted command failed");
            }
            return None;
        }
        Some(match result {
            Ok(r) => r,
            Err(e) => {
                self.stats.errors += 1;
                tracing::debug!(command = h.command, error = %e, "command failed");
                Reply {
                    bytes: proto::error_reply(h, e),
                    fd: None,
                }
            }
        })
    }

    fn dispatch(
        &mut self,
        f: &mut impl Function,
        h: &Header,
        payload: &[u8],
        mut fds: Vec<OwnedFd>,
    ) -> Result<Reply, Errno> {
        let req = proto::parse(h, payload)?;
        let ok = |bytes| Ok(Reply { bytes, fd: None });
        if !self.versioned && !matches!(req, Request::Version { .. }) {
            return Err(Errno::EINVAL);
        }
        // Only DMA_MAP (one) and SET_IRQS (eventfds) carry descriptors.
        let takes = match req {
            Request::DmaMap(_) => 1,
            Request::SetIrqs(_) => proto::MAX_FDS,
            _ => 0,
        };
        if fds.len() > takes {
            return Err(Errno::EINVAL);
        }
        match req {
            Request::Version { major, caps, .. } => {
                if major != 0 {
                    return Err(Errno::ENOTSUP);
                }
                if !caps.is_empty() && serde_json::from_slice::<serde_json::Value>(caps).is_err() {
                    return Err(Errno::EINVAL);
                }
                self.versioned = true;
                let head = VersionHead { major: 0, minor: 0 };
                let caps = proto::server_caps(self.dma.config().max_maps);
                ok(proto::reply(h, &[head.as_bytes(), &caps]))
            }
            Request::DmaMap(m) => {
                if let Err(e) = self.dma.map(&m, fds.pop()) {
                    self.stats.dma_refused += 1;
                    return Err(e);
                }
                self.stats.dma_maps += 1;
                self.refresh(f);
                ok(proto::reply(h, &[]))
            }
            Request::DmaUnmap(u) => {
                self.dma.unmap(&u)?;
                self.stats.dma_unmaps += 1;
                self.refresh(f);
                ok(proto::reply(h, &[u.as_bytes()]))
            }
            Request::DeviceGetInfo { .. } => {
                let i = DeviceInfo {
                    argsz: size_of::<DeviceInfo>() as u32,
                    flags: info::DEVICE_PCI | info::DEVICE_RESET,
                    num_regions: region::COUNT,
                    num_irqs: f.irq_counts().len() as u32,
                };
                ok(proto::reply(h, &[i.as_bytes()]))
            }
            Request::RegionInfo { argsz, index } => self.region_info(f, h, argsz, index),
            Request::IrqInfo { index, .. } => {
                let counts = f.irq_counts();
                let count = *counts.get(index as usize).ok_or(Errno::EINVAL)?;
                let i = IrqInfo {
                    argsz: size_of::<IrqInfo>() as u32,
                    flags: info::IRQ_EVENTFD,
                    index,
                    count,
                };
                ok(proto::reply(h, &[i.as_bytes()]))
            }
            Request::SetIrqs(s) => {
                self.irqs.set(&s, fds)?;
                ok(proto::reply(h, &[]))
            }
            Request::RegionRead {
                region: index,
                offset,
                count,
            } => {
                let mut data = vec![0u8; count as usize];
                self.access(f, index, offset, count as usize)?;
                let mut bus = Bus {
                    mem: &self.visible,
                    irqs: &mut self.irqs,
                };
                if index == region::CONFIG {
                    f.config_read(&mut bus, offset, &mut data);
                } else {
                    f.region_read(&mut bus, index, offset, &mut data)?;
                }
                let a = RegionAccess {
                    offset,
                    region: index,
                    count,
                };
                ok(proto::reply(h, &[a.as_bytes(), &data]))
            }
            Request::RegionWrite {
                region: index,
                offset,
                data,
            } => {
                self.access(f, index, offset, data.len())?;
                if index == region::CONFIG {
                    let mut bus = Bus {
                        mem: &self.visible,
                        irqs: &mut self.irqs,
                    };
                    f.config_write(&mut bus, offset, data);
                    self.refresh(f);
                    let mut bus = self.bus();
                    f.config_written(&mut bus);
                } else {
                    let mut bus = Bus {
                        mem: &self.visible,
                        irqs: &mut self.irqs,
                    };
                    f.region_write(&mut bus, index, offset, data)?;
                }
                let a = RegionAccess {
                    offset,
                    region: index,
                    count: data.len() as u32,
                };
                ok(proto::reply(h, &[a.as_bytes()]))
            }
            Request::Reset => {
                let mut bus = self.bus();
                f.reset(&mut bus);
                f.config_mut().reset();
                self.refresh(f);
                ok(proto::reply(h, &[]))
            }
            Request::Unsupported(_) => Err(Errno::ENOTSUP),
        }
    }

    /// Checks that `len` bytes at `offset` lie inside region `index`.
    fn access(&self, f: &impl Function, index: u32, offset: u64, len: usize) -> Result<(), Errno> {
        if index >= region::COUNT || len == 0 {
            return Err(Errno::EINVAL);
        }
        let size = if index == region::CONFIG {
            crate::pci::SIZE as u64
        } else {
            f.region(index).size
        };
        let end = offset.checked_add(len as u64).ok_or(Errno::EINVAL)?;
        if end > size {
            return Err(Errno::EINVAL);
        }
        Ok(())
    }

    /// `DEVICE_GET_REGION_INFO`. A mapped region's sparse-mmap list and
    /// its descriptor go only in a reply the client made room for (QEMU
    /// asks with 32 bytes first, then again with the size the first reply
    /// named).
    fn region_info(
        &self,
        f: &impl Function,
        h: &Header,
        argsz: u32,
        index: u32,
    ) -> Result<Reply, Errno> {
        if index >= region::COUNT {
            return Err(Errno::EINVAL);
        }
        let (size, mmap) = if index == region::CONFIG {
            (crate::pci::SIZE as u64, None)
        } else {
            let r = f.region(index);
            (r.size, r.mmap.filter(|_| r.size > 0))
        };
        let base = size_of::<RegionInfo>();
        let mut flags = if size > 0 {
            info::REGION_READ | info::REGION_WRITE
        } else {
            0
        };
        let mut caps = Vec::new();
        if let Some(m) = &mmap {
            flags |= info::REGION_MMAP | info::REGION_CAPS;
            caps.extend_from_slice(
                CapHeader {
                    id: info::CAP_SPARSE_MMAP,
                    version: 1,
                    next: 0,
                }
                .as_bytes(),
            );
            caps.extend_from_slice(
                SparseMmapHead {
                    nr_areas: m.areas.len() as u32,
                    reserved: 0,
                }
                .as_bytes(),
            );
            for &(offset, size) in &m.areas {
                caps.extend_from_slice(SparseArea { offset, size }.as_bytes());
            }
        }
        let full = (base + caps.len()) as u32;
        let mut ri = RegionInfo {
            argsz: full,
            flags,
            index,
            cap_offset: if caps.is_empty() { 0 } else { base as u32 },
            size,
            offset: mmap.as_ref().map_or(0, |m| m.offset),
        };
        if argsz < full {
            // Room for the fixed part only: say how much is needed, and
            // claim no capabilities in this reply (QEMU refuses one whose
            // CAPS flag points inside the fixed part before it asks again
            // with the room named here).
            ri.cap_offset = 0;
            ri.flags &= !info::REGION_CAPS;
            return Ok(Reply {
                bytes: proto::reply(h, &[ri.as_bytes()]),
                fd: None,
            });
        }
        Ok(Reply {
            bytes: proto::reply(h, &[ri.as_bytes(), &caps]),
            fd: mmap.map(|m| m.fd),
        })
    }
}

#[cfg(test)]
mod tests {
    use zerocopy::FromBytes;

    use super::*;
    use crate::{
        pci::Bar,
        proto::{DmaMap, IrqSet, cmd, flags, irq, irq_index},
    };

    /// A function with one 4 KiB BAR of plain registers and 2 MSI-X
    /// vectors; it records what it was told.
    #[derive(Debug)]
    struct Toy {
        config: ConfigSpace,
        regs: [u8; 4096],
        resets: u32,
        memory_changes: u32,
        /// Region 2, when set: 8 KiB, mapped into the client.
        mapped: Option<Mmap>,
    }

    impl Toy {
        fn new() -> Self {
            let mut config = ConfigSpace::new(0x1234, 0x5678, 0x020000, 0);
            config.set_bar(0, Bar::Mem32);
            config.add_msix(2, 1, 0, 1, 0x800);
            Toy {
                config,
                regs: [0; 4096],
                resets: 0,
                memory_changes: 0,
                mapped: None,
            }
        }
    }

    impl Function for Toy {
        fn region(&self, index: u32) -> Region {
            match index {
                0 | 1 => Region {
                    size: 4096,
                    mmap: None,
                },
                2 => match &self.mapped {
                    Some(m) => Region {
                        size: 8192,
                        mmap: Some(m.clone()),
                    },
                    None => Region::default(),
                },
                _ => Region::default(),
            }
        }

        fn irq_counts(&self) -> Vec<u32> {
            vec![0, 0, 2]
        }

        fn config(&self) -> &ConfigSpace {
            &self.config
        }

        fn config_mut(&mut self) -> &mut ConfigSpace {
            &mut self.config
        }

        fn region_read(
            &mut self,
            _: &mut Bus<'_>,
            _: u32,
            offset: u64,
            data: &mut [u8],
        ) -> Result<(), Errno> {
            let o = offset as usize;
            data.copy_from_slice(&self.regs[o..o + data.len()]);
            Ok(())
        }

        fn region_write(
            &mut self,
            _: &mut Bus<'_>,
            _: u32,
            offset: u64,
            data: &[u8],
        ) -> Result<(), Errno> {
            let o = offset as usize;
            self.regs[o..o + data.len()].copy_from_slice(data);
            Ok(())
        }

        fn config_written(&mut self, _: &mut Bus<'_>) {}

        fn reset(&mut self, _: &mut Bus<'_>) {
            self.resets += 1;
            self.regs = [0; 4096];
        }

        fn memory_changed(&mut self, _: &mut Bus<'_>) {
            self.memory_changes += 1;
        }
    }

    fn send(
        s: &mut Session,
        f: &mut Toy,
        command: u16,
        payload: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Option<Reply> {
        send_flags(s, f, command, 0, payload, fds)
    }

    fn send_flags(
        s: &mut Session,
        f: &mut Toy,
        command: u16,
        flags: u32,
        payload: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Option<Reply> {
        let h = Header {
            id: 1,
            command,
            size: (proto::HEADER_LEN + payload.len()) as u32,
            flags,
            error: 0,
        };
        s.handle(f, &h, payload, fds)
    }

    fn header(r: &Reply) -> Header {
        Header::read_from_prefix(&r.bytes).unwrap().0
    }

    fn versioned() -> (Session, Toy) {
        versioned_with(DmaConfig::default())
    }

    fn versioned_with(config: DmaConfig) -> (Session, Toy) {
        let mut f = Toy::new();
        let mut s = Session::with_config(&f, config);
        let mut p = VersionHead { major: 0, minor: 0 }.as_bytes().to_vec();
        p.extend_from_slice(b"{\"capabilities\":{}}\0");
        let r = send(&mut s, &mut f, cmd::VERSION, &p, vec![]).unwrap();
        assert_eq!(header(&r).flags, flags::TYPE_REPLY);
        (s, f)
    }

    fn access(region: u32, offset: u64, count: u32) -> Vec<u8> {
        RegionAccess {
            offset,
            region,
            count,
        }
        .as_bytes()
        .to_vec()
    }

    #[test]
    fn nothing_before_the_version_handshake() {
        let mut f = Toy::new();
        let mut s = Session::new(&f);
        let r = send(&mut s, &mut f, cmd::REGION_READ, &access(0, 0, 4), vec![]).unwrap();
        assert_eq!(header(&r).flags, flags::TYPE_REPLY | flags::ERROR);
        assert_eq!(header(&r).error, Errno::EINVAL as u32);
    }

    #[test]
    fn region_accesses_stay_inside_their_region() {
        let (mut s, mut f) = versioned();
        let mut w = access(0, 4092, 4);
        w.extend_from_slice(&[1, 2, 3, 4]);
        let r = send(&mut s, &mut f, cmd::REGION_WRITE, &w, vec![]).unwrap();
        assert_eq!(header(&r).flags, flags::TYPE_REPLY);
        let r = send(
            &mut s,
            &mut f,
            cmd::REGION_READ,
            &access(0, 4092, 4),
            vec![],
        )
        .unwrap();
        assert_eq!(&r.bytes[32..], &[1, 2, 3, 4]);
        for (region, offset, count) in [(0, 4093, 4), (0, u64::MAX, 4), (2, 0, 4), (9, 0, 1)] {
            let r = send(
                &mut s,
                &mut f,
                cmd::REGION_READ,
                &access(region, offset, count),
                vec![],
            )
            .unwrap();
            assert_eq!(header(&r).error, Errno::EINVAL as u32, "{region} {offset}");
        }
    }

    #[test]
    fn posted_writes_get_no_reply_even_when_they_fail() {
        let (mut s, mut f) = versioned();
        let mut w = access(0, 8, 4);
        w.extend_from_slice(&[9; 4]);
        assert!(
            send_flags(
                &mut s,
                &mut f,
                cmd::REGION_WRITE,
                flags::NO_REPLY,
                &w,
                vec![]
            )
            .is_none()
        );
        assert_eq!(&f.regs[8..12], &[9; 4]);
        let mut bad = access(0, 4095, 4);
        bad.extend_from_slice(&[9; 4]);
        assert!(
            send_flags(
                &mut s,
                &mut f,
                cmd::REGION_WRITE,
                flags::NO_REPLY,
                &bad,
                vec![]
            )
            .is_none()
        );
        assert_eq!(s.stats().errors, 1);
    }

    #[test]
    fn config_space_goes_through_its_masks_and_bus_master_gates_memory() {
        let (mut s, mut f) = versioned();
        let fd = crate::dma::tests::memfd(0x1000);
        let m = DmaMap {
            argsz: 32,
            flags: proto::dma::READ | proto::dma::WRITE,
            offset: 0,
            addr: 0x1000,
            size: 0x1000,
        };
        let r = send(&mut s, &mut f, cmd::DMA_MAP, m.as_bytes(), vec![fd]).unwrap();
        assert_eq!(header(&r).flags, flags::TYPE_REPLY);
        assert_eq!(s.bus().mem.iter().count(), 0, "bus mastering is off");
        let mut w = access(region::CONFIG, 4, 2);
        w.extend_from_slice(&crate::pci::command::BUS_MASTER.to_le_bytes());
        send(&mut s, &mut f, cmd::REGION_WRITE, &w, vec![]).unwrap();
        assert_eq!(s.bus().mem.iter().count(), 1);
        assert_eq!(f.memory_changes, 1);
        // A reset clears the Command register: memory is out of reach
        // again.
        send(&mut s, &mut f, cmd::DEVICE_RESET, &[], vec![]).unwrap();
        assert_eq!(f.resets, 1);
        assert_eq!(s.bus().mem.iter().count(), 0);
        let r = send(
            &mut s,
            &mut f,
            cmd::REGION_READ,
            &access(region::CONFIG, 0, 4),
            vec![],
        )
        .unwrap();
        assert_eq!(&r.bytes[32..], &[0x34, 0x12, 0x78, 0x56]);
    }

    #[test]
    fn descriptors_only_where_a_command_takes_them() {
        let (mut s, mut f) = versioned();
        let fd = nix::sys::memfd::memfd_create(c"t", nix::sys::memfd::MFdFlags::empty()).unwrap();
        let r = send(&mut s, &mut f, cmd::REGION_READ, &access(0, 0, 4), vec![fd]).unwrap();
        assert_eq!(header(&r).error, Errno::EINVAL as u32);
        let set = IrqSet {
            argsz: 20,
            flags: irq::DATA_EVENTFD | irq::ACTION_TRIGGER,
            index: irq_index::MSIX,
            start: 0,
            count: 2,
        };
        let e = |_| -> OwnedFd {
            nix::sys::eventfd::EventFd::from_flags(nix::sys::eventfd::EfdFlags::empty())
                .unwrap()
                .into()
        };
        let r = send(
            &mut s,
            &mut f,
            cmd::DEVICE_SET_IRQS,
            set.as_bytes(),
            (0..2).map(e).collect(),
        )
        .unwrap();
        assert_eq!(header(&r).flags, flags::TYPE_REPLY);
        assert!(s.bus().irqs.raise(irq_index::MSIX, 1));
    }

    #[test]
    fn a_mapped_region_sends_its_list_and_descriptor_only_when_there_is_room() {
        let (mut s, mut f) = versioned();
        let fd = Arc::new(
            nix::sys::memfd::memfd_create(c"t", nix::sys::memfd::MFdFlags::empty()).unwrap(),
        );
        f.mapped = Some(Mmap {
            fd,
            offset: 0x10000,
            areas: vec![(4096, 4096)],
        });
        let ask = |s: &mut Session, f: &mut Toy, argsz: u32| {
            let q = RegionInfo {
                argsz,
                index: 2,
                ..RegionInfo::default()
            };
            let mut p = q.as_bytes().to_vec();
            p.resize(argsz.max(32) as usize, 0);
            send(s, f, cmd::DEVICE_GET_REGION_INFO, &p, vec![]).unwrap()
        };
        let small = ask(&mut s, &mut f, 32);
        let ri = RegionInfo::read_from_prefix(&small.bytes[16..]).unwrap().0;
        assert_eq!(
            (ri.argsz, ri.cap_offset, ri.size),
            (32 + 8 + 8 + 16, 0, 8192)
        );
        assert!(small.fd.is_none());
        assert_eq!(small.bytes.len(), 16 + 32);
        // No CAPS flag without the capabilities (QEMU refuses the reply).
        assert_eq!(ri.flags & info::REGION_CAPS, 0);
        let full = ask(&mut s, &mut f, ri.argsz);
        let ri = RegionInfo::read_from_prefix(&full.bytes[16..]).unwrap().0;
        assert_eq!(ri.cap_offset, 32);
        assert_eq!(ri.offset, 0x10000);
        assert_eq!(
            ri.flags,
            info::REGION_READ | info::REGION_WRITE | info::REGION_MMAP | info::REGION_CAPS
        );
        let area = SparseArea::read_from_prefix(&full.bytes[16 + 32 + 16..])
            .unwrap()
            .0;
        assert_eq!((area.offset, area.size), (4096, 4096));
        assert!(full.fd.is_some());
    }

    fn dma_map(addr: u64, size: u64) -> DmaMap {
        DmaMap {
            argsz: 32,
            flags: proto::dma::READ | proto::dma::WRITE,
            offset: 0,
            addr,
            size,
        }
    }

    fn bus_master(s: &mut Session, f: &mut Toy) {
        let mut w = access(region::CONFIG, 4, 2);
        w.extend_from_slice(&crate::pci::command::BUS_MASTER.to_le_bytes());
        send(s, f, cmd::REGION_WRITE, &w, vec![]).unwrap();
    }

    #[test]
    fn refused_maps_are_counted_and_the_session_goes_on() {
        let (mut s, mut f) = versioned_with(DmaConfig {
            max_maps: 2,
            ..DmaConfig::default()
        });
        let unsealed = crate::dma::tests::unsealed(0x1000);
        let r = send(
            &mut s,
            &mut f,
            cmd::DMA_MAP,
            dma_map(0x1000, 0x1000).as_bytes(),
            vec![unsealed],
        );
        assert_eq!(header(&r.unwrap()).error, Errno::EPERM as u32);
        for addr in [0x1000, 0x2000, 0x3000] {
            let fd = crate::dma::tests::memfd(0x1000);
            send(
                &mut s,
                &mut f,
                cmd::DMA_MAP,
                dma_map(addr, 0x1000).as_bytes(),
                vec![fd],
            );
        }
        assert_eq!(s.stats().dma_refused, 2);
        assert_eq!(s.stats().dma_maps, 2);
        let set = IrqSet {
            argsz: 20,
            flags: irq::DATA_EVENTFD | irq::ACTION_TRIGGER,
            index: irq_index::MSIX,
            start: 0,
            count: 1,
        };
        let e: OwnedFd = nix::sys::eventfd::EventFd::new().unwrap().into();
        send(
            &mut s,
            &mut f,
            cmd::DEVICE_SET_IRQS,
            set.as_bytes(),
            vec![e],
        )
        .unwrap();
        assert_eq!(
            s.holdings(),
            Holdings {
                dma_maps: 2,
                dma_bytes: 0x2000,
                fds: 3,
                dma_faults: 0
            }
        );
        let r = send(&mut s, &mut f, cmd::REGION_READ, &access(0, 0, 4), vec![]).unwrap();
        assert_eq!(header(&r).flags, flags::TYPE_REPLY);
        s.disconnect(&mut f);
        assert_eq!(s.holdings(), Holdings::default());
    }

    #[test]
    fn unsealed_memory_when_allowed_survives_the_client_shrinking_it() {
        const NAME: &str =
            "session::tests::unsealed_memory_when_allowed_survives_the_client_shrinking_it";
        if !crate::child::is(NAME) {
            let st = crate::child::run(NAME);
            assert!(st.success(), "the child: {st:?}");
            return;
        }
        use vm_memory::{Bytes, GuestAddress};
        let (mut s, mut f) = versioned_with(DmaConfig {
            allow_unsealed: true,
            ..DmaConfig::default()
        });
        let fd = crate::dma::tests::unsealed(0x2000);
        let client = fd.try_clone().unwrap();
        let r = send(
            &mut s,
            &mut f,
            cmd::DMA_MAP,
            dma_map(0x10000, 0x2000).as_bytes(),
            vec![fd],
        );
        assert_eq!(header(&r.unwrap()).flags, flags::TYPE_REPLY);
        bus_master(&mut s, &mut f);
        let mem = s.bus().mem.clone();
        mem.write_obj(0x1234_u64, GuestAddress(0x11000)).unwrap();
        // The client takes its memory away.
        nix::unistd::ftruncate(&client, 0).unwrap();
        assert_eq!(mem.read_obj::<u64>(GuestAddress(0x11000)).unwrap(), 0);
        mem.write_obj(0x5678_u64, GuestAddress(0x10008)).unwrap();
        assert_eq!(mem.read_obj::<u64>(GuestAddress(0x10008)).unwrap(), 0x5678);
        assert_eq!(s.holdings().dma_faults, 2);
        // Nothing reached the file.
        nix::unistd::ftruncate(&client, 0x2000).unwrap();
        let mut b = [0u8; 8];
        nix::sys::uio::pread(&client, &mut b, 8).unwrap();
        assert_eq!(b, [0; 8]);
        // The guard goes with the last user of the memory.
        drop(mem);
        s.disconnect(&mut f);
        assert_eq!(crate::sigbus::registered(), 0);
        assert_eq!(s.holdings().dma_faults, 2, "counted since the start");
    }
}
