//! The objects a test holds, the driver's side of each: a context's
//! doorbell area ([`Door`]) and the context, MRs, CQs (polled from their
//! rings, armed through their arm words), work rings, QPs and SRQs (WQEs
//! written into their rings, producer indices published, doorbells rung).

use std::{
    sync::{
        Arc,
        atomic::{Ordering, fence},
    },
    time::{Duration, Instant},
};

use vrdma_virtio::abi::{self, cq_header, doorbell as db, wq_header};

use super::{
    codes::wc,
    wqe::{Wqe, recv_wqe, sge},
};
use crate::virtio::{
    frontend::{Kicker, WAIT},
    ram::{PAGE, Ram},
};

/// A context's doorbell area, and how to ring it (§8.3).
#[derive(Debug)]
pub struct Door {
    pub(super) ram: Arc<Ram>,
    pub ctx: u32,
    /// The area's first byte (its pages are contiguous here).
    pub area: u64,
    pub bits: u32,
    pub(super) kicker: Arc<Kicker>,
}

impl Door {
    /// Rings doorbell `i` with the five steps of §8.3; returns whether it
    /// kicked the doorbellq.
    pub fn ring(&self, i: u32) -> bool {
        let w = u64::from(i / 64);
        self.ram
            .or_u64(self.area + db::BITMAP + 8 * w, 1 << (i % 64));
        self.ram
            .or_u64(self.area + db::SUMMARY + 8 * (w / 64), 1 << (w % 64));
        fence(Ordering::SeqCst);
        let kick = !self.kicker.poll.load(Ordering::Relaxed) || self.poll() == 0;
        if kick {
            self.kicker.kick();
        }
        kick
    }

    /// Sets doorbell `i`'s bits without kicking (a doorbell the device
    /// must find by polling, or a hostile one).
    pub fn set_bits(&self, i: u32) {
        let w = u64::from(i / 64);
        self.ram
            .or_u64(self.area + db::BITMAP + 8 * w, 1 << (i % 64));
        self.ram
            .or_u64(self.area + db::SUMMARY + 8 * (w / 64), 1 << (w % 64));
        fence(Ordering::SeqCst);
    }

    /// The area's `poll` word.
    pub fn poll(&self) -> u32 {
        self.ram.load_acquire(self.area + db::POLL)
    }

    /// Kicks the doorbellq.
    pub fn kick(&self) {
        self.kicker.kick();
    }

    /// Waits until the device says it polls (or no longer does).
    pub fn wait_poll(&self, want: u32, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.poll() == want {
                return true;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        self.poll() == want
    }
}

/// A context: its handle and doorbell area.
#[derive(Clone, Debug)]
pub struct Ctx {
    pub handle: u32,
    pub door: Arc<Door>,
}

/// An MR over guest memory the test allocated: where it is (GPA), its
/// address space (`iova`) and keys.
#[derive(Clone, Copy, Debug)]
pub struct Mr {
    pub gpa: u64,
    pub len: u64,
    pub iova: u64,
    pub lkey: u32,
    pub rkey: u32,
}

impl Mr {
    /// An SGE over `len` bytes at `off`.
    pub fn sge(&self, off: u64, len: u32) -> abi::Sge {
        assert!(off + u64::from(len) <= self.len, "an SGE inside the MR");
        sge(self.iova + off, len, self.lkey)
    }

    /// The MR's address of byte `off`.
    pub fn addr(&self, off: u64) -> u64 {
        self.iova + off
    }
}

/// A CQ and the driver's side of its ring.
#[derive(Debug)]
pub struct Cq {
    pub(super) ram: Arc<Ram>,
    pub door: Arc<Door>,
    pub handle: u32,
    pub entries: u32,
    pub doorbell: u32,
    pub header: u64,
    pub ring: u64,
    pub stride: u32,
    /// The driver's consumer index.
    pub cons: u32,
    pub(super) seq: u64,
}

impl Cq {
    /// The device's producer index (acquire).
    pub fn producer(&self) -> u32 {
        self.ram.load_acquire(self.header + cq_header::PRODUCER)
    }

    /// The next completion, if one is there (its slot copied, the consumer
    /// index published).
    pub fn poll(&mut self) -> Option<abi::Cqe> {
        if self.producer() == self.cons {
            return None;
        }
        let slot = u64::from(self.cons & (self.entries - 1));
        let c: abi::Cqe = self.ram.read(self.ring + slot * u64::from(self.stride));
        self.cons = self.cons.wrapping_add(1);
        self.ram
            .store_release(self.header + cq_header::CONSUMER, self.cons);
        Some(c)
    }

    /// `n` completions, or a panic at the deadline.
    pub fn wait(&mut self, n: usize, what: &str) -> Vec<abi::Cqe> {
        self.wait_for(n, WAIT, what)
    }

    pub fn wait_for(&mut self, n: usize, limit: Duration, what: &str) -> Vec<abi::Cqe> {
        let start = Instant::now();
        let mut out = Vec::new();
        let mut spins = 0u32;
        while out.len() < n {
            match self.poll() {
                Some(c) => out.push(c),
                None => {
                    assert!(
                        start.elapsed() < limit,
                        "CQ {}: {} of {n} completions ({what}) within {limit:?}: {out:?}",
                        self.handle,
                        out.len()
                    );
                    spins += 1;
                    if spins < 1000 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
            }
        }
        out
    }

    /// One completion, which must succeed with `opcode` and `wr_id`.
    pub fn expect_ok(&mut self, opcode: u8, wr_id: u64) -> abi::Cqe {
        let c = self.wait(1, "one completion")[0];
        assert_eq!(
            (c.status, c.opcode, c.wr_id.get()),
            (wc::SUCCESS, opcode, wr_id),
            "completion {c:?}"
        );
        c
    }

    /// Nothing more for `d` (a completion that must not come).
    pub fn expect_none(&mut self, d: Duration) {
        let deadline = Instant::now() + d;
        while Instant::now() < deadline {
            if let Some(c) = self.poll() {
                panic!("CQ {}: unexpected completion {c:?}", self.handle);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Arms the CQ (§9.1: the consumer snapshot, the mode, a new
    /// sequence) and rings its doorbell. `mode`: `cq_header::ARM_NEXT` or
    /// `ARM_SOLICITED`.
    pub fn arm(&mut self, mode: u64) -> bool {
        self.seq = (self.seq + 1) & ((1 << 30) - 1);
        self.arm_word(u64::from(self.cons) | (mode << 32) | (self.seq << 34))
    }

    /// Stores `word` as the arm word and rings the doorbell.
    pub fn arm_word(&mut self, word: u64) -> bool {
        self.ram.store_u64(self.header + cq_header::ARM, word);
        self.door.ring(self.doorbell)
    }
}

/// A send, receive or SRQ ring, the driver's side.
#[derive(Clone, Debug)]
pub struct WqRing {
    pub header: u64,
    pub base: u64,
    pub entries: u32,
    pub stride: u32,
    /// The driver's producer index.
    pub prod: u32,
}

impl WqRing {
    /// A ring of `entries` × `stride` bytes (whole pages) with its header.
    pub fn new(ram: &Ram, entries: u32, stride: u32) -> Self {
        let bytes = u64::from(entries) * u64::from(stride);
        assert!(bytes.is_multiple_of(PAGE), "a ring is whole pages");
        WqRing {
            header: ram.header(),
            base: ram.pages(bytes / PAGE),
            entries,
            stride,
            prod: 0,
        }
    }

    pub fn desc(&self) -> abi::RingDesc {
        abi::RingDesc {
            header: self.header.into(),
            entries: self.entries.into(),
            stride: self.stride.into(),
            npages: self.npages().into(),
            reserved: 0.into(),
        }
    }

    pub fn npages(&self) -> u32 {
        u32::try_from(u64::from(self.entries) * u64::from(self.stride) / PAGE).expect("pages")
    }

    pub fn pages(&self) -> Vec<u64> {
        (0..u64::from(self.npages()))
            .map(|i| self.base + i * PAGE)
            .collect()
    }

    /// The slot of index `idx`.
    pub fn slot(&self, idx: u32) -> u64 {
        self.base + u64::from(idx & (self.entries - 1)) * u64::from(self.stride)
    }

    /// The device's consumer index.
    pub fn consumer(&self, ram: &Ram) -> u32 {
        ram.load_acquire(self.header + wq_header::CONSUMER)
    }

    /// Writes `entry` into the next slot (waiting for the device to free
    /// one) and publishes the producer index (release).
    pub fn push(&mut self, ram: &Ram, entry: &[u8]) {
        assert!(
            entry.len() <= self.stride as usize,
            "an entry fits its slot"
        );
        let deadline = Instant::now() + WAIT;
        while self.prod.wrapping_sub(self.consumer(ram)) >= self.entries {
            assert!(
                Instant::now() < deadline,
                "ring at {:#x}: no free slot within {WAIT:?}",
                self.header
            );
            std::thread::sleep(Duration::from_micros(100));
        }
        ram.write(self.slot(self.prod), entry);
        self.prod = self.prod.wrapping_add(1);
        self.publish(ram);
    }

    /// Stores the producer index (release).
    pub fn publish(&self, ram: &Ram) {
        ram.store_release(self.header + wq_header::PRODUCER, self.prod);
    }
}

/// What a QP is made with.
#[derive(Clone, Debug)]
pub struct QpSpec {
    pub qp_type: u8,
    pub send_cq: u32,
    pub recv_cq: u32,
    pub srq: u32,
    pub sq_entries: u32,
    pub rq_entries: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline: u32,
    pub sq_sig_all: bool,
}

impl QpSpec {
    /// A QP of `qp_type` on `cq` (both directions): 64 send and receive
    /// slots of 4 SGEs, 128 inline bytes.
    pub fn new(qp_type: u8, cq: u32) -> Self {
        QpSpec {
            qp_type,
            send_cq: cq,
            recv_cq: cq,
            srq: 0,
            sq_entries: 64,
            rq_entries: 64,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline: 128,
            sq_sig_all: false,
        }
    }

    /// The smallest rings: one page each.
    pub fn small(qp_type: u8, cq: u32) -> Self {
        QpSpec {
            sq_entries: 32,
            rq_entries: 64,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline: 0,
            ..Self::new(qp_type, cq)
        }
    }

    pub fn send_stride(&self) -> u32 {
        (64 + (16 * self.max_send_sge).max(self.max_inline)).next_power_of_two()
    }

    pub fn recv_stride(&self) -> u32 {
        (16 + 16 * self.max_recv_sge).next_power_of_two()
    }
}

/// A QP and the driver's side of its rings.
#[derive(Debug)]
pub struct Qp {
    pub(super) ram: Arc<Ram>,
    pub door: Arc<Door>,
    pub qpn: u32,
    pub doorbell: u32,
    pub qp_type: u8,
    pub sq: WqRing,
    pub rq: Option<WqRing>,
    pub resp: abi::CreateQpResp,
}

impl Qp {
    /// Posts one send WQE and rings the doorbell; returns whether it
    /// kicked.
    pub fn post_send(&mut self, w: &Wqe) -> bool {
        self.sq.push(&self.ram, &w.bytes());
        self.door.ring(self.doorbell)
    }

    /// Posts several, then rings once.
    pub fn post_sends(&mut self, ws: &[Wqe]) -> bool {
        for w in ws {
            self.sq.push(&self.ram, &w.bytes());
        }
        self.door.ring(self.doorbell)
    }

    /// Posts a receive WQE and rings the doorbell.
    pub fn post_recv(&mut self, wr_id: u64, sges: &[abi::Sge]) -> bool {
        let rq = self.rq.as_mut().expect("a QP with its own receive ring");
        rq.push(&self.ram, &recv_wqe(wr_id, sges));
        self.door.ring(self.doorbell)
    }
}

/// An SRQ and the driver's side of its ring.
#[derive(Debug)]
pub struct Srq {
    pub(super) ram: Arc<Ram>,
    pub door: Arc<Door>,
    pub handle: u32,
    pub doorbell: u32,
    pub ring: WqRing,
}

impl Srq {
    pub fn post_recv(&mut self, wr_id: u64, sges: &[abi::Sge]) -> bool {
        self.ring.push(&self.ram, &recv_wqe(wr_id, sges));
        self.door.ring(self.doorbell)
    }
}
