//! The VMM's part of the guest, as QEMU plays it: a vfio-user client
//! (version, DMA maps, interrupts, region reads and writes, the doorbell
//! pages mapped) and the guest's RAM in a sealed memfd between guard
//! pages — allocated page by page, page directories written into it,
//! canary pages checked.

use std::{
    fs::File,
    io::Read,
    os::{
        fd::{AsFd, OwnedFd},
        unix::net::UnixStream,
    },
    path::Path,
    time::Duration,
};

use nix::sys::eventfd::{EfdFlags, EventFd};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};
use vrdma_pvrdma::abi::{self, PAGE_SIZE};
use vrdma_vfio_user::{
    proto::{
        self, DmaMap, Header, IrqSet, RegionAccess, VersionHead, cmd as vcmd, flags, irq, irq_index,
    },
    socket::Client,
};
use zerocopy::{FromBytes, IntoBytes};

/// Where the guest's RAM starts (guest-physical).
pub const RAM_BASE: u64 = 0x10_0000;

/// The frame number of doorbell page 0 the probe announces.
pub const UAR_PFN: u64 = 0xfe000;

/// A little-endian `u32` from the first 4 bytes of `b` (a slice of a
/// reply or of guest memory the caller sized).
pub fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// The vfio-user client and the guest's RAM.
///
/// The RAM the device is given (`ram_size` bytes at [`RAM_BASE`]) sits in
/// a memfd between two guard pages the device is never given: the test
/// sees them at `RAM_BASE - PAGE_SIZE` and `RAM_BASE + ram_size` (an
/// address the device has no map for) and checks that they keep their
/// canary bytes, as it checks the canary pages it allocates inside RAM and
/// never hands to the device ([`Guest::canary`], [`Guest::guarded`]).
#[derive(Debug)]
pub struct Guest {
    pub conn: Client,
    /// The test's view: the RAM and the two guard pages.
    pub ram: GuestMemoryMmap<()>,
    memfd: OwnedFd,
    pub ram_size: u64,
    next: u64,
    id: u16,
    /// The MSI-X vectors' eventfds (read ends).
    pub irq: Vec<File>,
    pub dsr: u64,
    pub cmd_slot: u64,
    pub resp_slot: u64,
    pub caps: abi::Caps,
    pub async_ring: u64,
    pub cq_ring: u64,
    pub async_head: u32,
    pub cqn_head: u32,
    /// Pages that must keep their canary bytes.
    canaries: Vec<u64>,
    /// Each allocation is followed by a canary page.
    pub guarded: bool,
}

/// The canary bytes of the page at `page`.
fn canary_bytes(page: u64) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|i| (i as u8).wrapping_mul(31) ^ (page >> 12) as u8 ^ 0x5a)
        .collect()
}

/// A REGION_WRITE's payload: 4 bytes at `off` of `region`.
fn write32_payload(region: u32, off: u64, v: u32) -> Vec<u8> {
    let mut p = RegionAccess {
        offset: off,
        region,
        count: 4,
    }
    .as_bytes()
    .to_vec();
    p.extend_from_slice(&v.to_le_bytes());
    p
}

/// A memfd of `len` bytes sealed as QEMU's `memory-backend-memfd` seals
/// guest RAM (it can neither shrink nor grow).
pub fn sealed_memfd(name: &std::ffi::CStr, len: u64) -> OwnedFd {
    use nix::fcntl::{FcntlArg, SealFlag, fcntl};
    let fd = nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING)
        .expect("memfd_create");
    nix::unistd::ftruncate(&fd, i64::try_from(len).expect("a memfd's size")).expect("ftruncate");
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
    fcntl(&fd, FcntlArg::F_ADD_SEALS(seals)).expect("F_ADD_SEALS");
    fd
}

/// A memfd of one page with no seal (what the daemon refuses as guest
/// memory unless told to allow it).
pub fn unsealed_page() -> OwnedFd {
    let fd = nix::sys::memfd::memfd_create(c"unsealed", nix::sys::memfd::MFdFlags::empty())
        .expect("memfd_create");
    nix::unistd::ftruncate(&fd, PAGE_SIZE.cast_signed()).expect("ftruncate");
    fd
}

/// A DMA_MAP of one page at guest address `addr`, readable and writable,
/// from offset 0 of the descriptor that goes with it.
pub fn one_page(addr: u64) -> DmaMap {
    DmaMap {
        argsz: 32,
        flags: proto::dma::READ | proto::dma::WRITE,
        offset: 0,
        addr,
        size: PAGE_SIZE,
    }
}

fn eventfd() -> (OwnedFd, File) {
    let e: OwnedFd = EventFd::from_flags(EfdFlags::EFD_NONBLOCK)
        .expect("eventfd")
        .into();
    let r = File::from(e.try_clone().expect("dup"));
    (e, r)
}

impl Guest {
    /// Connects to `socket` with `ram_size` bytes of RAM and sets the
    /// device up as QEMU does: version, DMA map, interrupts, bus master.
    pub fn connect(socket: &Path, ram_size: u64) -> Self {
        let stream = UnixStream::connect(socket).expect("connecting to the device");
        let memfd = sealed_memfd(c"guest-ram", ram_size + 2 * PAGE_SIZE);
        let file = File::from(memfd.try_clone().expect("dup"));
        let ram = GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(RAM_BASE - PAGE_SIZE),
            (ram_size + 2 * PAGE_SIZE) as usize,
            Some(FileOffset::new(file, 0)),
        )])
        .expect("mapping guest RAM");
        let mut g = Guest {
            conn: Client::new(stream).expect("the client"),
            ram,
            memfd,
            ram_size,
            next: RAM_BASE,
            id: 0,
            irq: Vec::new(),
            dsr: 0,
            cmd_slot: 0,
            resp_slot: 0,
            caps: abi::Caps::default(),
            async_ring: 0,
            cq_ring: 0,
            async_head: 0,
            cqn_head: 0,
            canaries: vec![RAM_BASE - PAGE_SIZE, RAM_BASE + ram_size],
            guarded: false,
        };
        for page in g.canaries.clone() {
            g.put(page, &canary_bytes(page));
        }
        let mut v = VersionHead { major: 0, minor: 0 }.as_bytes().to_vec();
        v.extend_from_slice(b"{\"capabilities\":{\"max_msg_fds\":16}}\0");
        g.ok(vcmd::VERSION, &v, &[]);
        // The RAM between the guard pages.
        let m = DmaMap {
            argsz: 32,
            flags: proto::dma::READ | proto::dma::WRITE,
            offset: PAGE_SIZE,
            addr: RAM_BASE,
            size: ram_size,
        };
        let fd = g.memfd.try_clone().expect("dup");
        g.ok(vcmd::DMA_MAP, m.as_bytes(), &[fd.as_fd()]);
        // Memory space and bus mastering on.
        g.config_write(4, &6u16.to_le_bytes());
        let mut fds = Vec::new();
        for _ in 0..3 {
            let (w, r) = eventfd();
            fds.push(w);
            g.irq.push(r);
        }
        let set = IrqSet {
            argsz: 20,
            flags: irq::DATA_EVENTFD | irq::ACTION_TRIGGER,
            index: irq_index::MSIX,
            start: 0,
            count: 3,
        };
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        g.ok(vcmd::DEVICE_SET_IRQS, set.as_bytes(), &borrowed);
        g
    }

    /// Maps the doorbell pages (BAR2) as QEMU does when the region info
    /// offers a sparse mmap: the reply's descriptor, at guest-physical
    /// `at`. None when the region is not mappable (trapped doorbells).
    pub fn map_doorbells(&mut self, at: u64) -> Option<GuestMemoryMmap<()>> {
        self.id = self.id.wrapping_add(1);
        let ri = proto::RegionInfo {
            argsz: 256,
            flags: 0,
            index: 2,
            cap_offset: 0,
            size: 0,
            offset: 0,
        };
        // As QEMU sends it: the fixed part, argsz the room for the reply.
        let payload = ri.as_bytes().to_vec();
        let h = Header {
            id: self.id,
            command: vcmd::DEVICE_GET_REGION_INFO,
            size: (proto::HEADER_LEN + payload.len()) as u32,
            flags: 0,
            error: 0,
        };
        let mut msg = h.as_bytes().to_vec();
        msg.extend_from_slice(&payload);
        self.conn.send(&msg, &[]).expect("sending");
        let mut r = self.conn.receive().expect("receiving").expect("a reply");
        assert_eq!(r.header.error, 0);
        let (info, _) = proto::RegionInfo::read_from_prefix(&r.payload).expect("a region info");
        if info.flags & proto::info::REGION_MMAP == 0 {
            return None;
        }
        let fd = r.fds.pop().expect("the region's descriptor");
        Some(
            GuestMemoryMmap::<()>::from_ranges_with_files([(
                vm_memory::GuestAddress(at),
                info.size as usize,
                Some(FileOffset::new(File::from(fd), info.offset)),
            )])
            .expect("mapping the doorbell pages"),
        )
    }

    /// Sends a message and returns the reply's header and payload.
    pub fn request(
        &mut self,
        command: u16,
        payload: &[u8],
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> (Header, Vec<u8>) {
        self.send(command, payload, fds);
        let r = self.conn.receive().expect("receiving").expect("a reply");
        assert_eq!(r.header.id, self.id);
        (r.header, r.payload)
    }

    /// Sends a message (its reply is the caller's to take).
    fn send(&mut self, command: u16, payload: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) {
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
    }

    /// Sends a message that must succeed.
    pub fn ok(
        &mut self,
        command: u16,
        payload: &[u8],
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Vec<u8> {
        let (h, p) = self.request(command, payload, fds);
        assert_eq!(
            h.flags & flags::ERROR,
            0,
            "command {command}: error {}",
            h.error
        );
        p
    }

    pub fn config_write(&mut self, off: u64, data: &[u8]) {
        let mut p = RegionAccess {
            offset: off,
            region: proto::region::CONFIG,
            count: data.len() as u32,
        }
        .as_bytes()
        .to_vec();
        p.extend_from_slice(data);
        self.ok(vcmd::REGION_WRITE, &p, &[]);
    }

    /// A 32-bit register write sent without waiting for the device's reply
    /// (which [`Guest::finish_write`] takes): as a vCPU's store that the
    /// device has not handled yet.
    pub fn start_write32(&mut self, region: u32, off: u64, v: u32) {
        self.send(vcmd::REGION_WRITE, &write32_payload(region, off, v), &[]);
    }

    /// The reply to [`Guest::start_write32`]'s write.
    pub fn finish_write(&mut self) {
        let r = self.conn.receive().expect("receiving").expect("a reply");
        assert_eq!(r.header.id, self.id);
        assert_eq!(
            r.header.flags & flags::ERROR,
            0,
            "write: {}",
            r.header.error
        );
    }

    /// A 32-bit register write, waiting for the device to take it.
    pub fn write32(&mut self, region: u32, off: u64, v: u32) {
        self.ok(vcmd::REGION_WRITE, &write32_payload(region, off, v), &[]);
    }

    pub fn read32(&mut self, region: u32, off: u64) -> u32 {
        let p = RegionAccess {
            offset: off,
            region,
            count: 4,
        };
        let r = self.ok(vcmd::REGION_READ, p.as_bytes(), &[]);
        le32(&r[16..20])
    }

    /// Shares `size` more bytes of memory at `addr` (a memfd of their
    /// own): the test's view of them.
    pub fn map_extra(&mut self, addr: u64, size: u64) -> GuestMemoryMmap<()> {
        let fd = sealed_memfd(c"guest-extra", size);
        let view = GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(addr),
            size as usize,
            Some(FileOffset::new(File::from(fd.try_clone().expect("dup")), 0)),
        )])
        .expect("mapping the extra memory");
        let m = DmaMap {
            argsz: 32,
            flags: proto::dma::READ | proto::dma::WRITE,
            offset: 0,
            addr,
            size,
        };
        self.ok(vcmd::DMA_MAP, m.as_bytes(), &[fd.as_fd()]);
        view
    }

    /// Takes back the map made at `addr`.
    pub fn unmap(&mut self, addr: u64, size: u64) {
        let u = proto::DmaUnmap {
            argsz: 24,
            flags: 0,
            addr,
            size,
        };
        self.ok(vcmd::DMA_UNMAP, u.as_bytes(), &[]);
    }

    /// Waits (at most 5 s) for MSI-X vector `v`; true if it fired.
    pub fn wait_irq(&mut self, v: usize) -> bool {
        self.wait_irq_for(v, Duration::from_secs(5))
    }

    pub fn wait_irq_for(&mut self, v: usize, limit: Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let mut b = [0u8; 8];
            if self.irq[v].read(&mut b).is_ok() {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Whether vector `v` fired since last asked (no waiting).
    pub fn irq_fired(&mut self, v: usize) -> bool {
        let mut b = [0u8; 8];
        self.irq[v].read(&mut b).is_ok()
    }

    /// `n` zeroed pages of RAM (followed by a canary page when guarded).
    pub fn alloc(&mut self, n: u64) -> u64 {
        let at = self.next;
        self.next += n * PAGE_SIZE;
        assert!(self.next <= RAM_BASE + self.ram_size, "guest RAM exhausted");
        self.ram
            .write_slice(&vec![0u8; (n * PAGE_SIZE) as usize], GuestAddress(at))
            .expect("zeroing guest RAM");
        if self.guarded {
            self.canary(1);
        }
        at
    }

    /// `n` pages of RAM the device is never told about, filled with
    /// canary bytes that [`Guest::check_canaries`] checks.
    pub fn canary(&mut self, n: u64) -> u64 {
        let at = self.next;
        self.next += n * PAGE_SIZE;
        assert!(self.next <= RAM_BASE + self.ram_size, "guest RAM exhausted");
        for i in 0..n {
            let page = at + i * PAGE_SIZE;
            self.put(page, &canary_bytes(page));
            self.canaries.push(page);
        }
        at
    }

    /// Every canary page (and both guard pages) as it was written.
    pub fn check_canaries(&self) {
        for &page in &self.canaries {
            assert!(
                self.get(page, PAGE_SIZE as usize) == canary_bytes(page),
                "canary page {page:#x} was touched"
            );
        }
    }

    /// Writes every page of the RAM (zeros where nothing was allocated
    /// yet), so that all of it is resident before a test measures what
    /// the device's process holds: what grows after is the device's own.
    pub fn touch_ram(&self) {
        let chunk = vec![0u8; 1 << 20];
        let mut at = self.next;
        let end = RAM_BASE + self.ram_size;
        while at < end {
            let n = chunk.len().min((end - at) as usize);
            self.put(at, &chunk[..n]);
            at += n as u64;
        }
    }

    /// The first page past the RAM the device was given (a guard page).
    pub fn ram_end(&self) -> u64 {
        RAM_BASE + self.ram_size
    }

    /// A page directory naming `pages`.
    pub fn pdir(&mut self, pages: &[u64]) -> u64 {
        let dir = self.alloc(1);
        for (t, chunk) in pages.chunks(512).enumerate() {
            let table = self.alloc(1);
            self.put(dir + 8 * t as u64, &table.to_le_bytes());
            for (i, p) in chunk.iter().enumerate() {
                self.put(table + 8 * i as u64, &p.to_le_bytes());
            }
        }
        dir
    }

    /// `n` pages and their directory.
    pub fn pages(&mut self, n: u64) -> (Vec<u64>, u64) {
        let base = self.alloc(n);
        let pages: Vec<u64> = (0..n).map(|i| base + i * PAGE_SIZE).collect();
        let dir = self.pdir(&pages);
        (pages, dir)
    }

    pub fn put(&self, addr: u64, data: &[u8]) {
        self.ram
            .write_slice(data, GuestAddress(addr))
            .expect("a write into guest RAM");
    }

    pub fn get(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.ram
            .read_slice(&mut v, GuestAddress(addr))
            .expect("a read of guest RAM");
        v
    }

    pub fn get32(&self, addr: u64) -> u32 {
        le32(&self.get(addr, 4))
    }

    pub fn put32(&self, addr: u64, v: u32) {
        self.put(addr, &v.to_le_bytes());
    }
}
