//! A split virtqueue (VIRTIO 1.3 §2.7) as a guest driver keeps it, laid out
//! in guest memory: the descriptor table, the available ring (with
//! `used_event`) and the used ring (with `avail_event`), a free list of
//! descriptors, the kick and call eventfds. Waiting for a used buffer polls
//! the used ring and sleeps on the call eventfd in between, always against
//! a deadline.

use std::{
    collections::HashMap,
    os::fd::AsRawFd,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use vmm_sys_util::{
    epoll::{ControlOperation, Epoll, EpollEvent, EventSet},
    eventfd::{EFD_NONBLOCK, EventFd},
};

use super::ram::{PAGE, Ram};

/// `VIRTQ_DESC_F_NEXT`, `VIRTQ_DESC_F_WRITE`.
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

/// A buffer of a chain: its address, length and whether the device writes
/// it.
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    pub addr: u64,
    pub len: u32,
    pub writable: bool,
}

impl Buf {
    pub fn r(addr: u64, len: u32) -> Self {
        Buf {
            addr,
            len,
            writable: false,
        }
    }

    pub fn w(addr: u64, len: u32) -> Self {
        Buf {
            addr,
            len,
            writable: true,
        }
    }
}

/// One split virtqueue of the driver.
#[derive(Debug)]
pub struct Vq {
    ram: Arc<Ram>,
    pub index: u16,
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    free: Vec<u16>,
    /// The driver's available index (what it published).
    pub avail_idx: u16,
    /// The used entries the driver has read.
    pub last_used: u16,
    chains: HashMap<u16, Vec<u16>>,
    pub kick: EventFd,
    pub call: EventFd,
    epoll: Epoll,
}

impl Vq {
    /// A queue of `size` entries (a power of two, at most 256) in fresh
    /// guest memory.
    pub fn new(ram: &Arc<Ram>, index: u16, size: u16) -> Self {
        assert!(size.is_power_of_two() && size <= 256);
        let desc = ram.pages(1);
        let avail = ram.pages(1);
        let used = ram.pages(1);
        let call = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let epoll = Epoll::new().expect("epoll");
        epoll
            .ctl(
                ControlOperation::Add,
                call.as_raw_fd(),
                EpollEvent::new(EventSet::IN, 0),
            )
            .expect("epoll_ctl");
        Vq {
            ram: ram.clone(),
            index,
            size,
            desc,
            avail,
            used,
            free: (0..size).rev().collect(),
            avail_idx: 0,
            last_used: 0,
            chains: HashMap::new(),
            kick: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
            call,
            epoll,
        }
    }

    /// The same queue's layout and indices in `ram`, with new eventfds (a
    /// VMM that reconnects keeps the guest's rings as they are). Chains
    /// the device had not used stay outstanding.
    pub fn reattach(&self, ram: &Arc<Ram>) -> Self {
        let call = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let epoll = Epoll::new().expect("epoll");
        epoll
            .ctl(
                ControlOperation::Add,
                call.as_raw_fd(),
                EpollEvent::new(EventSet::IN, 0),
            )
            .expect("epoll_ctl");
        Vq {
            ram: ram.clone(),
            index: self.index,
            size: self.size,
            desc: self.desc,
            avail: self.avail,
            used: self.used,
            free: self.free.clone(),
            avail_idx: self.avail_idx,
            last_used: self.last_used,
            chains: self.chains.clone(),
            kick: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
            call,
            epoll,
        }
    }

    /// Free descriptors.
    pub fn room(&self) -> usize {
        self.free.len()
    }

    /// Chains made available and not yet used.
    pub fn outstanding(&self) -> usize {
        self.chains.len()
    }

    /// Writes a chain of `bufs` and makes it available (no kick). Returns
    /// its head.
    pub fn add(&mut self, bufs: &[Buf]) -> u16 {
        assert!(
            !bufs.is_empty() && bufs.len() <= self.free.len(),
            "virtqueue {} full",
            self.index
        );
        let ids: Vec<u16> = (0..bufs.len())
            .map(|_| self.free.pop().expect("room checked"))
            .collect();
        for (k, (b, id)) in bufs.iter().zip(&ids).enumerate() {
            let mut flags = if b.writable { F_WRITE } else { 0 };
            let next = ids.get(k + 1).copied().unwrap_or(0);
            if k + 1 < ids.len() {
                flags |= F_NEXT;
            }
            let mut d = [0u8; 16];
            d[0..8].copy_from_slice(&b.addr.to_le_bytes());
            d[8..12].copy_from_slice(&b.len.to_le_bytes());
            d[12..14].copy_from_slice(&flags.to_le_bytes());
            d[14..16].copy_from_slice(&next.to_le_bytes());
            self.ram.write(self.desc + 16 * u64::from(*id), &d);
        }
        let head = ids[0];
        let slot = u64::from(self.avail_idx % self.size);
        self.ram
            .store_u16(self.avail + 4 + 2 * slot, head, Ordering::Relaxed);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.ram
            .store_u16(self.avail + 2, self.avail_idx, Ordering::Release);
        self.chains.insert(head, ids);
        head
    }

    /// Notifies the device (writes the kick eventfd, as KVM's ioeventfd
    /// does for a guest's notify write).
    pub fn notify(&self) {
        self.kick.write(1).expect("kick");
    }

    /// The next used entry, if the device used one: (head, len).
    pub fn poll_used(&mut self) -> Option<(u16, u32)> {
        let idx = self.ram.load_u16(self.used + 2, Ordering::Acquire);
        if idx == self.last_used {
            // Asks for a notification at the next one (EVENT_IDX's
            // used_event), then looks again (the device may have used one
            // before it could see the request).
            self.ram.store_u16(
                self.avail + 4 + 2 * u64::from(self.size),
                self.last_used,
                Ordering::SeqCst,
            );
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.ram.load_u16(self.used + 2, Ordering::Acquire) == self.last_used {
                return None;
            }
        }
        let slot = u64::from(self.last_used % self.size);
        let e: [u8; 8] = self.ram.read(self.used + 4 + 8 * slot);
        let head = u16::from_le_bytes([e[0], e[1]]);
        let len = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
        self.last_used = self.last_used.wrapping_add(1);
        let ids = self.chains.remove(&head).unwrap_or_else(|| {
            panic!(
                "virtqueue {}: the device used head {head}, which is not outstanding",
                self.index
            )
        });
        self.free.extend(ids);
        Some((head, len))
    }

    /// Waits until the device uses a chain, or panics at `deadline` saying
    /// `what` was waited for.
    pub fn wait_used(&mut self, deadline: Instant, what: &str) -> (u16, u32) {
        loop {
            if let Some(u) = self.poll_used() {
                return u;
            }
            self.sleep(deadline, what);
        }
    }

    /// Sleeps on the call eventfd for at most 20 ms and until `deadline`
    /// (panicking past it).
    pub fn sleep(&self, deadline: Instant, what: &str) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "virtqueue {}: timed out waiting for {what}",
            self.index
        );
        let ms = left.min(Duration::from_millis(20)).as_millis().max(1);
        let mut ev = [EpollEvent::default(); 1];
        let _ = self.epoll.wait(i32::try_from(ms).unwrap_or(20), &mut ev);
        let _ = self.call.read();
    }

    /// Bytes the queue's rings take (for checks that name them).
    pub fn span() -> u64 {
        PAGE
    }
}
