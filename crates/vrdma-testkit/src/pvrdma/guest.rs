//! The guest, as far as a PVRDMA device can tell: a vfio-user client (as
//! QEMU is) with "RAM" in a memfd it shares, and a model of the Linux
//! `vmw_pvrdma` driver on top — the probe handshake, commands, page
//! directories, rings, doorbells — that the tests drive directly,
//! well-behaved or not.

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
use vrdma_pvrdma::abi::{self, PAGE_SIZE, cmd, reg};
use vrdma_vfio_user::{
    proto::{
        self, DmaMap, Header, IrqSet, RegionAccess, VersionHead, cmd as vcmd, flags, irq, irq_index,
    },
    socket::Client,
};
use vrdma_wire::Gid;
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

    /// Sends a message and returns the reply's header and payload.
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

    /// The driver's probe: the shared region, its rings and slots,
    /// DSRLOW/DSRHIGH, then IMR and ACTIVATE. Returns ERR after ACTIVATE.
    pub fn probe(&mut self) -> u32 {
        assert_eq!(self.read32(1, reg::VERSION), abi::VERSION);
        let dsr = self.dsr_template();
        self.load_dsr(&dsr);
        self.write32(1, reg::IMR, 0);
        self.write32(1, reg::CTL, reg::CTL_ACTIVATE);
        self.read32(1, reg::ERR)
    }

    /// Writes `dsr` at `self.dsr` and hands it over (DSRLOW, DSRHIGH);
    /// reads back the capabilities. Returns ERR.
    pub fn load_dsr(&mut self, dsr: &abi::Dsr) -> u32 {
        self.put(self.dsr, dsr.as_bytes());
        self.write32(1, reg::DSRLOW, self.dsr as u32);
        self.write32(1, reg::DSRHIGH, (self.dsr >> 32) as u32);
        let d = abi::Dsr::read_from_bytes(&self.get(self.dsr, 280)).expect("280 bytes");
        self.caps = d.caps;
        self.read32(1, reg::ERR)
    }

    /// A shared region as the driver makes it (in fresh pages, not yet
    /// handed over).
    pub fn dsr_template(&mut self) -> abi::Dsr {
        self.async_head = 0;
        self.cqn_head = 0;
        self.dsr = self.alloc(1);
        self.cmd_slot = self.alloc(1);
        self.resp_slot = self.alloc(1);
        let (apages, apdir) = self.pages(4);
        let (cpages, cpdir) = self.pages(4);
        self.async_ring = apages[0];
        self.cq_ring = cpages[0];
        abi::Dsr {
            driver_version: 20.into(),
            gos_info: 0x46.into(),
            cmd_slot_dma: self.cmd_slot.into(),
            resp_slot_dma: self.resp_slot.into(),
            async_ring_pages: abi::RingPages {
                num_pages: 4.into(),
                reserved: 0.into(),
                pdir_dma: apdir.into(),
            },
            cq_ring_pages: abi::RingPages {
                num_pages: 4.into(),
                reserved: 0.into(),
                pdir_dma: cpdir.into(),
            },
            // BAR2 at an address of the firmware's choosing.
            uar_pfn64: UAR_PFN.into(),
            ..abi::Dsr::default()
        }
    }

    /// Runs a command (`req` is its request structure, the command code in
    /// its header): Ok(response bytes) or Err(ERR). Waits for the response
    /// interrupt when the driver would.
    pub fn command<T: IntoBytes + zerocopy::Immutable>(&mut self, req: &T) -> Result<Vec<u8>, u32> {
        let bytes = req.as_bytes();
        let code = le32(&bytes[8..12]);
        let mut slot = vec![0u8; abi::MAX_REQUEST];
        slot[..bytes.len()].copy_from_slice(bytes);
        self.put(self.cmd_slot, &slot);
        self.write32(1, reg::REQUEST, 0);
        let err = self.read32(1, reg::ERR);
        if err != 0 {
            return Err(err);
        }
        let waits = !matches!(
            code,
            cmd::DESTROY_PD
                | cmd::DESTROY_MR
                | cmd::DESTROY_CQ
                | cmd::DESTROY_QP
                | cmd::DESTROY_UC
                | cmd::CREATE_BIND
                | cmd::DESTROY_BIND
                | cmd::MODIFY_SRQ
                | cmd::DESTROY_SRQ
        );
        if waits {
            assert!(self.wait_irq(0), "no response interrupt for command {code}");
            let resp = self.get(self.resp_slot, abi::MAX_RESPONSE);
            let ack = le32(&resp[8..12]);
            assert_eq!(ack, cmd::ACK | code, "ack");
            Ok(resp)
        } else {
            Ok(Vec::new())
        }
    }

    /// Runs a command the device must refuse: returns ERR, after checking
    /// that the response header answers this command with ERR's low byte
    /// as its `err` (what QEMU's PVRDMA and the driver read) and that no
    /// response interrupt came (the driver does not wait for a refused
    /// command).
    pub fn refused<T: IntoBytes + zerocopy::Immutable>(&mut self, req: &T) -> u32 {
        let code = le32(&req.as_bytes()[8..12]);
        self.put(self.resp_slot, &[0u8; 16]);
        let err = match self.command(req) {
            Ok(_) => panic!("command {code} was accepted"),
            Err(e) => e,
        };
        let h = abi::RespHdr::read_from_bytes(&self.get(self.resp_slot, 16)).expect("16 bytes");
        assert_eq!(h.ack.get(), cmd::ACK | code, "the refusal's ack");
        assert_eq!(h.response.get(), 0x1234, "the refusal's response key");
        assert!(
            !self.irq_fired(0),
            "a response interrupt for a refused command"
        );
        assert_eq!(h.err, err as u8, "the header's err: ERR's low byte");
        err
    }

    /// Rings a QP's doorbell with `bits` (QP_SEND, QP_RECV) on its page.
    pub fn ring_qp(&mut self, qp: &GuestQp, bits: u32) {
        self.write32(2, qp.uar * PAGE_SIZE, qp.handle | bits);
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

    /// The async events the device wrote since the last call.
    pub fn events(&mut self) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        loop {
            let tail = self.get32(self.async_ring + 8);
            if tail == self.async_head {
                return out;
            }
            let slot = (self.async_head & 1535) as u64;
            let e = self.get(self.async_ring + PAGE_SIZE + slot * 8, 8);
            out.push((le32(&e[0..4]), le32(&e[4..8])));
            self.async_head = (self.async_head + 1) & (2 * 1536 - 1);
            self.put32(self.async_ring + 12, self.async_head);
        }
    }

    /// The CQ notifications the device wrote since the last call.
    pub fn notifications(&mut self) -> Vec<u32> {
        let mut out = Vec::new();
        loop {
            let tail = self.get32(self.cq_ring + 8);
            if tail == self.cqn_head {
                return out;
            }
            let slot = (self.cqn_head & 3071) as u64;
            out.push(self.get32(self.cq_ring + PAGE_SIZE + slot * 4));
            self.cqn_head = (self.cqn_head + 1) & (2 * 3072 - 1);
            self.put32(self.cq_ring + 12, self.cqn_head);
        }
    }

    /// Binds `gid` at `index` (RoCEv2).
    pub fn bind_gid(&mut self, index: u32, gid: Gid) {
        let req = abi::CreateBind {
            hdr: hdr(cmd::CREATE_BIND),
            mtu: 1024.into(),
            vlan: 0xfff.into(),
            index: index.into(),
            new_gid: gid.0,
            gid_type: abi::GID_TYPE_ROCE_V2,
            reserved: [0; 3],
        };
        self.command(&req).expect("CREATE_BIND");
    }

    pub fn create_pd(&mut self, ctx: u32) -> u32 {
        let r = self
            .command(&abi::Handle {
                hdr: hdr(cmd::CREATE_PD),
                handle: ctx.into(),
                reserved: [0; 4],
            })
            .expect("CREATE_PD");
        le32(&r[16..20])
    }

    /// A DMA MR of `pd` (the kernel's local_dma_lkey): (handle, lkey).
    pub fn dma_mr(&mut self, pd: u32) -> (u32, u32) {
        let r = self
            .command(&abi::CreateMr {
                hdr: hdr(cmd::CREATE_MR),
                pd_handle: pd.into(),
                access_flags: 1.into(),
                flags: abi::MR_FLAG_DMA.into(),
                ..abi::CreateMr::default()
            })
            .expect("CREATE_MR (DMA)");
        let resp = abi::CreateMrResp::read_from_bytes(&r[..32]).expect("32 bytes");
        (resp.mr_handle.get(), resp.lkey.get())
    }

    /// A user MR over `pages` at virtual address `va` (page-aligned here):
    /// (handle, lkey, rkey).
    pub fn user_mr(&mut self, pd: u32, va: u64, pages: &[u64], access: u32) -> (u32, u32, u32) {
        let dir = self.pdir(pages);
        let r = self
            .command(&abi::CreateMr {
                hdr: hdr(cmd::CREATE_MR),
                start: va.into(),
                length: (pages.len() as u64 * PAGE_SIZE).into(),
                pdir_dma: dir.into(),
                pd_handle: pd.into(),
                access_flags: access.into(),
                flags: 0.into(),
                nchunks: (pages.len() as u32).into(),
            })
            .expect("CREATE_MR");
        let resp = abi::CreateMrResp::read_from_bytes(&r[..32]).expect("32 bytes");
        (resp.mr_handle.get(), resp.lkey.get(), resp.rkey.get())
    }
}

/// A request header.
pub fn hdr(code: u32) -> abi::CmdHdr {
    abi::CmdHdr {
        response: 0x1234.into(),
        cmd: code.into(),
        reserved: 0.into(),
    }
}

/// A CQ as the guest holds it.
#[derive(Debug)]
pub struct GuestCq {
    pub handle: u32,
    pub state: u64,
    pub data: Vec<u64>,
    pub cqe: u32,
    pub head: u32,
    /// The doorbell page (0: the kernel's; a user context's otherwise).
    pub uar: u64,
}

/// A QP as the guest holds it.
#[derive(Debug)]
pub struct GuestQp {
    pub qpn: u32,
    pub handle: u32,
    pub state: u64,
    pub sq: Vec<u64>,
    pub rq: Vec<u64>,
    pub sq_stride: u64,
    pub rq_stride: u64,
    pub sq_wr: u32,
    pub rq_wr: u32,
    pub sq_tail: u32,
    pub rq_tail: u32,
    /// The doorbell page.
    pub uar: u64,
}

impl Guest {
    pub fn create_cq(&mut self, cqe: u32, ctx: u32) -> GuestCq {
        let n = 1 + (u64::from(cqe) * 64).div_ceil(PAGE_SIZE);
        let (pages, dir) = self.pages(n);
        let r = self
            .command(&abi::CreateCq {
                hdr: hdr(cmd::CREATE_CQ),
                pdir_dma: dir.into(),
                ctx_handle: ctx.into(),
                cqe: cqe.into(),
                nchunks: (n as u32).into(),
                reserved: [0; 4],
            })
            .expect("CREATE_CQ");
        let resp = abi::CreateCqResp::read_from_bytes(&r[..24]).expect("24 bytes");
        assert_eq!(resp.cqe.get(), cqe);
        GuestCq {
            handle: resp.cq_handle.get(),
            state: pages[0],
            data: pages[1..].to_vec(),
            cqe,
            head: 0,
            uar: 0,
        }
    }

    /// The completions waiting in `cq`, consumed.
    pub fn poll(&mut self, cq: &mut GuestCq) -> Vec<abi::Cqe> {
        let mut out = Vec::new();
        loop {
            let tail = self.get32(cq.state + 8);
            if tail == cq.head {
                return out;
            }
            let slot = u64::from(cq.head & (cq.cqe - 1));
            let off = slot * 64;
            let page = cq.data[(off / PAGE_SIZE) as usize];
            let e =
                abi::Cqe::read_from_bytes(&self.get(page + off % PAGE_SIZE, 64)).expect("64 bytes");
            out.push(e);
            cq.head = (cq.head + 1) & (2 * cq.cqe - 1);
            self.put32(cq.state + 12, cq.head);
        }
    }

    /// Polls `cq` until `n` completions came (5 s at most).
    pub fn poll_n(&mut self, cq: &mut GuestCq, n: usize) -> Vec<abi::Cqe> {
        self.poll_n_for(cq, n, Duration::from_secs(5))
    }

    /// Polls `cq` until `n` completions came (`limit` at most).
    pub fn poll_n_for(&mut self, cq: &mut GuestCq, n: usize, limit: Duration) -> Vec<abi::Cqe> {
        let deadline = std::time::Instant::now() + limit;
        let mut out = Vec::new();
        while out.len() < n && std::time::Instant::now() < deadline {
            out.extend(self.poll(cq));
            if out.len() < n {
                // The POLL doorbell, as the driver rings it on an empty CQ.
                self.write32(2, cq.uar * PAGE_SIZE + 4, cq.handle | abi::uar::CQ_POLL);
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        out
    }

    /// Arms `cq` for its next completion.
    pub fn arm(&mut self, cq: &GuestCq, uar: u64, solicited: bool) {
        let bit = if solicited {
            abi::uar::CQ_ARM_SOL
        } else {
            abi::uar::CQ_ARM
        };
        self.write32(2, uar * PAGE_SIZE + 4, cq.handle | bit);
    }

    /// A QP of `ty` (abi qp_type) on `pd` with these CQs and depths, 2 SGEs
    /// each way: its rings in guest pages laid out as the driver lays them.
    pub fn create_qp(&mut self, ty: u8, pd: u32, scq: u32, rcq: u32, depth: u32) -> GuestQp {
        self.create_qp_uar(ty, pd, scq, rcq, depth, 0)
    }

    pub fn create_qp_uar(
        &mut self,
        ty: u8,
        pd: u32,
        scq: u32,
        rcq: u32,
        depth: u32,
        uar: u64,
    ) -> GuestQp {
        let sges = 2u32;
        let sq_stride = (80 + 16 * u64::from(sges)).next_power_of_two();
        let rq_stride = (16 + 16 * u64::from(sges)).next_power_of_two();
        let sq_pages = (u64::from(depth) * sq_stride).div_ceil(PAGE_SIZE);
        let rq_pages = (u64::from(depth) * rq_stride).div_ceil(PAGE_SIZE);
        let total = 1 + sq_pages + rq_pages;
        let (pages, dir) = self.pages(total);
        let r = self
            .command(&abi::CreateQp {
                hdr: hdr(cmd::CREATE_QP),
                pdir_dma: dir.into(),
                pd_handle: pd.into(),
                send_cq_handle: scq.into(),
                recv_cq_handle: rcq.into(),
                max_send_wr: depth.into(),
                max_recv_wr: depth.into(),
                max_send_sge: sges.into(),
                max_recv_sge: sges.into(),
                access_flags: 1.into(),
                total_chunks: (total as u16).into(),
                send_chunks: (sq_pages as u16).into(),
                qp_type: ty,
                ..abi::CreateQp::default()
            })
            .expect("CREATE_QP");
        let resp = abi::CreateQpRespV2::read_from_bytes(&r[..48]).expect("48 bytes");
        GuestQp {
            qpn: resp.qpn.get(),
            handle: resp.qp_handle.get(),
            state: pages[0],
            sq: pages[1..1 + sq_pages as usize].to_vec(),
            rq: pages[1 + sq_pages as usize..].to_vec(),
            sq_stride,
            rq_stride,
            sq_wr: depth,
            rq_wr: depth,
            sq_tail: 0,
            rq_tail: 0,
            uar,
        }
    }

    /// Posts a send WQE (its 80-byte header and SGEs) and rings the SEND
    /// doorbell.
    pub fn post_send(&mut self, qp: &mut GuestQp, wqe: &abi::SqWqeHdr, sges: &[abi::Sge]) {
        self.write_send(qp, wqe, sges);
        self.write32(2, qp.uar * PAGE_SIZE, qp.handle | abi::uar::QP_SEND);
    }

    /// Writes a send WQE and moves prod_tail, without the doorbell.
    pub fn write_send(&mut self, qp: &mut GuestQp, wqe: &abi::SqWqeHdr, sges: &[abi::Sge]) -> u64 {
        let slot = u64::from(qp.sq_tail & (qp.sq_wr - 1));
        let off = slot * qp.sq_stride;
        let at = qp.sq[(off / PAGE_SIZE) as usize] + off % PAGE_SIZE;
        self.put(at, wqe.as_bytes());
        for (i, s) in sges.iter().enumerate() {
            self.put(at + 80 + 16 * i as u64, s.as_bytes());
        }
        qp.sq_tail = (qp.sq_tail + 1) & (2 * qp.sq_wr - 1);
        self.put32(qp.state, qp.sq_tail);
        at
    }

    /// Posts a receive WQE and rings the RECV doorbell.
    pub fn post_recv(&mut self, qp: &mut GuestQp, wr_id: u64, sges: &[abi::Sge]) {
        let slot = u64::from(qp.rq_tail & (qp.rq_wr - 1));
        let off = slot * qp.rq_stride;
        let at = qp.rq[(off / PAGE_SIZE) as usize] + off % PAGE_SIZE;
        let h = abi::RqWqeHdr {
            wr_id: wr_id.into(),
            num_sge: (sges.len() as u32).into(),
            total_len: 0.into(),
        };
        self.put(at, h.as_bytes());
        for (i, s) in sges.iter().enumerate() {
            self.put(at + 16 + 16 * i as u64, s.as_bytes());
        }
        qp.rq_tail = (qp.rq_tail + 1) & (2 * qp.rq_wr - 1);
        self.put32(qp.state + 8, qp.rq_tail);
        self.write32(2, qp.uar * PAGE_SIZE, qp.handle | abi::uar::QP_RECV);
    }

    /// MODIFY_QP; Err(ERR) if refused.
    pub fn modify_qp(&mut self, qp: &GuestQp, attrs: abi::QpAttr, mask: u32) -> Result<(), u32> {
        self.command(&abi::ModifyQp {
            hdr: hdr(cmd::MODIFY_QP),
            qp_handle: qp.handle.into(),
            attr_mask: mask.into(),
            attrs,
        })
        .map(|_| ())
    }

    /// The QP's state as QUERY_QP reports it.
    pub fn qp_state(&mut self, qp: &GuestQp) -> u32 {
        let r = self
            .command(&abi::QueryQp {
                hdr: hdr(cmd::QUERY_QP),
                qp_handle: qp.handle.into(),
                attr_mask: 0.into(),
            })
            .expect("QUERY_QP");
        let a = abi::QpAttr::read_from_bytes(&r[16..176]).expect("160 bytes");
        a.qp_state.get()
    }

    /// The consumer index of the QP's send ring, as the device left it.
    pub fn sq_cons(&self, qp: &GuestQp) -> u32 {
        self.get32(qp.state + 4)
    }

    /// The receive ring's consumer index (the second ring state).
    pub fn rq_cons(&self, qp: &GuestQp) -> u32 {
        self.get32(qp.state + 12)
    }
}

/// RC bring-up to RTS towards `dest_qpn` at `dgid`, the way perftest sets
/// it (MTU 1024, timeout 14, retries 7).
pub fn rc_up(g: &mut Guest, qp: &GuestQp, dgid: Gid, dest_qpn: u32, dmac: [u8; 6]) {
    rc_up_mtu(g, qp, dgid, dest_qpn, dmac, 3);
}

/// [`rc_up`] with the path MTU `mtu` (the verbs' code: 3 for 1024, 5 for
/// 4096).
pub fn rc_up_mtu(g: &mut Guest, qp: &GuestQp, dgid: Gid, dest_qpn: u32, dmac: [u8; 6], mtu: u32) {
    use vrdma_engine::qp::AttrMask as M;
    let mut a = abi::QpAttr {
        qp_state: 1.into(),
        pkey_index: 0.into(),
        port_num: 1,
        qp_access_flags: (2 | 4 | 8).into(),
        ..abi::QpAttr::default()
    };
    g.modify_qp(
        qp,
        a,
        (M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS).0,
    )
    .expect("MODIFY_QP to INIT");
    a.qp_state = 2.into();
    a.path_mtu = mtu.into();
    a.dest_qp_num = dest_qpn.into();
    a.rq_psn = 0x100.into();
    a.max_dest_rd_atomic = 4;
    a.min_rnr_timer = 12;
    a.ah_attr.dgid = dgid.0;
    a.ah_attr.port_num = 1;
    a.ah_attr.hop_limit = 64;
    a.ah_attr.ah_flags = 1;
    a.ah_attr.dmac = dmac;
    g.modify_qp(
        qp,
        a,
        (M::STATE
            | M::AV
            | M::PATH_MTU
            | M::DEST_QPN
            | M::RQ_PSN
            | M::MAX_DEST_RD_ATOMIC
            | M::MIN_RNR_TIMER)
            .0,
    )
    .expect("MODIFY_QP to RTR");
    a.qp_state = 3.into();
    a.sq_psn = 0x100.into();
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 4;
    g.modify_qp(
        qp,
        a,
        (M::STATE | M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC).0,
    )
    .expect("MODIFY_QP to RTS");
}

/// A send WQE header.
pub fn wqe(wr_id: u64, opcode: u32, flags: u32, nsge: u32) -> abi::SqWqeHdr {
    abi::SqWqeHdr {
        wr_id: wr_id.into(),
        num_sge: nsge.into(),
        opcode: opcode.into(),
        send_flags: flags.into(),
        ..abi::SqWqeHdr::default()
    }
}

/// An SGE.
pub fn sge(addr: u64, len: u32, lkey: u32) -> abi::Sge {
    abi::Sge {
        addr: addr.into(),
        length: len.into(),
        lkey: lkey.into(),
    }
}
