//! The driver's verbs over a [`Frontend`]: what a guest kernel driver and
//! its provider do with the device's commands, rings and doorbells —
//! contexts with doorbell areas in guest memory, PDs, MRs (page lists,
//! DMA, fast registration), windows, CQs (polled from their rings, armed
//! through their arm words), QPs (WQEs written into their rings, producer
//! indices published, doorbells rung), SRQs — and a side of a test (a
//! guest with its objects) with two sides' QPs connected.

use std::{
    sync::{
        Arc,
        atomic::{Ordering, fence},
    },
    time::{Duration, Instant},
};

use vrdma_virtio::abi::{self, access, cq_header, doorbell as db, op, qp_type, wq_header, wr};
use vrdma_wire::Gid;
use zerocopy::{FromZeros, IntoBytes};

use super::{
    GuestDevice,
    frontend::{Frontend, Kicker, Status, WAIT},
    ram::{PAGE, Ram},
};

/// `ibv_qp_attr_mask` bits.
pub mod mask {
    pub const STATE: u32 = 1 << 0;
    pub const CUR_STATE: u32 = 1 << 1;
    pub const EN_SQD_ASYNC_NOTIFY: u32 = 1 << 2;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const QKEY: u32 = 1 << 6;
    pub const AV: u32 = 1 << 7;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const ALT_PATH: u32 = 1 << 14;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const CAP: u32 = 1 << 19;
    pub const DEST_QPN: u32 = 1 << 20;
}

/// `ibv_qp_state`.
pub mod state {
    pub const RESET: u32 = 0;
    pub const INIT: u32 = 1;
    pub const RTR: u32 = 2;
    pub const RTS: u32 = 3;
    pub const ERR: u32 = 6;
}

/// `ibv_wc_status` values the tests meet.
pub mod wc {
    pub const SUCCESS: u8 = 0;
    pub const LOC_LEN_ERR: u8 = 1;
    pub const LOC_QP_OP_ERR: u8 = 2;
    pub const LOC_PROT_ERR: u8 = 4;
    pub const WR_FLUSH_ERR: u8 = 5;
    pub const MW_BIND_ERR: u8 = 6;
    pub const REM_INV_REQ_ERR: u8 = 9;
    pub const REM_ACCESS_ERR: u8 = 10;
    pub const REM_OP_ERR: u8 = 11;

    /// Completion opcodes.
    pub const SEND: u8 = 0;
    pub const RDMA_WRITE: u8 = 1;
    pub const RDMA_READ: u8 = 2;
    pub const COMP_SWAP: u8 = 3;
    pub const FETCH_ADD: u8 = 4;
    pub const BIND_MW: u8 = 5;
    pub const LOCAL_INV: u8 = 6;
    pub const REG_MR: u8 = 8;
    pub const RECV: u8 = 128;
    pub const RECV_RDMA_WITH_IMM: u8 = 129;
}

/// Every remote access and local write.
pub const ALL_ACCESS: u32 =
    access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

/// A context's doorbell area, and how to ring it (§8.3).
#[derive(Debug)]
pub struct Door {
    ram: Arc<Ram>,
    pub ctx: u32,
    /// The area's first byte (its pages are contiguous here).
    pub area: u64,
    pub bits: u32,
    kicker: Arc<Kicker>,
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

/// An SGE.
pub fn sge(addr: u64, length: u32, lkey: u32) -> abi::Sge {
    abi::Sge {
        addr: addr.into(),
        length: length.into(),
        lkey: lkey.into(),
    }
}

/// A CQ and the driver's side of its ring.
#[derive(Debug)]
pub struct Cq {
    ram: Arc<Ram>,
    pub door: Arc<Door>,
    pub handle: u32,
    pub entries: u32,
    pub doorbell: u32,
    pub header: u64,
    pub ring: u64,
    pub stride: u32,
    /// The driver's consumer index.
    pub cons: u32,
    seq: u64,
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

/// A receive WQE's bytes.
pub fn recv_wqe(wr_id: u64, sges: &[abi::Sge]) -> Vec<u8> {
    let h = abi::RecvWqeHdr {
        wr_id: wr_id.into(),
        count: u16::try_from(sges.len()).expect("SGEs").into(),
        reserved: [0; 6],
    };
    let mut b = h.as_bytes().to_vec();
    for s in sges {
        b.extend_from_slice(s.as_bytes());
    }
    b
}

/// A send WQE, built field by field from the ABI's layouts.
#[derive(Clone, Debug)]
pub struct Wqe {
    pub wr_id: u64,
    pub opcode: u8,
    pub flags: u8,
    pub ex: u32,
    pub op: [u8; 48],
    pub sges: Vec<abi::Sge>,
    pub inline: Option<Vec<u8>>,
    /// A `count` other than the SGEs' or inline bytes' (hostile WQEs).
    pub count: Option<u16>,
}

impl Wqe {
    /// A signaled WQE of `opcode` with nothing else.
    pub fn new(opcode: u8, wr_id: u64) -> Self {
        Wqe {
            wr_id,
            opcode,
            flags: wr::SIGNALED,
            ex: 0,
            op: [0; 48],
            sges: Vec::new(),
            inline: None,
            count: None,
        }
    }

    pub fn send(wr_id: u64, sges: &[abi::Sge]) -> Self {
        Wqe {
            sges: sges.to_vec(),
            ..Self::new(wr::SEND, wr_id)
        }
    }

    fn rdma(mut self, remote: u64, rkey: u32) -> Self {
        let r = abi::WqeRdma {
            remote_addr: remote.into(),
            rkey: rkey.into(),
            reserved: [0; 36],
        };
        self.op.copy_from_slice(r.as_bytes());
        self
    }

    pub fn write(wr_id: u64, sges: &[abi::Sge], remote: u64, rkey: u32) -> Self {
        Wqe {
            sges: sges.to_vec(),
            ..Self::new(wr::RDMA_WRITE, wr_id)
        }
        .rdma(remote, rkey)
    }

    pub fn write_imm(wr_id: u64, sges: &[abi::Sge], remote: u64, rkey: u32, imm: u32) -> Self {
        Wqe {
            sges: sges.to_vec(),
            ex: imm,
            ..Self::new(wr::RDMA_WRITE_WITH_IMM, wr_id)
        }
        .rdma(remote, rkey)
    }

    pub fn read(wr_id: u64, sges: &[abi::Sge], remote: u64, rkey: u32) -> Self {
        Wqe {
            sges: sges.to_vec(),
            ..Self::new(wr::RDMA_READ, wr_id)
        }
        .rdma(remote, rkey)
    }

    fn atomic(
        opcode: u8,
        wr_id: u64,
        s: abi::Sge,
        remote: u64,
        rkey: u32,
        ca: u64,
        swap: u64,
    ) -> Self {
        let mut w = Wqe {
            sges: vec![s],
            ..Self::new(opcode, wr_id)
        };
        let a = abi::WqeAtomic {
            remote_addr: remote.into(),
            compare_add: ca.into(),
            swap: swap.into(),
            rkey: rkey.into(),
            reserved: [0; 20],
        };
        w.op.copy_from_slice(a.as_bytes());
        w
    }

    pub fn cmp_swap(
        wr_id: u64,
        s: abi::Sge,
        remote: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    ) -> Self {
        Self::atomic(
            wr::ATOMIC_CMP_AND_SWP,
            wr_id,
            s,
            remote,
            rkey,
            compare,
            swap,
        )
    }

    pub fn fetch_add(wr_id: u64, s: abi::Sge, remote: u64, rkey: u32, add: u64) -> Self {
        Self::atomic(wr::ATOMIC_FETCH_AND_ADD, wr_id, s, remote, rkey, add, 0)
    }

    pub fn local_inv(wr_id: u64, key: u32) -> Self {
        Wqe {
            ex: key,
            ..Self::new(wr::LOCAL_INV, wr_id)
        }
    }

    pub fn send_inv(wr_id: u64, sges: &[abi::Sge], rkey: u32) -> Self {
        Wqe {
            sges: sges.to_vec(),
            ex: rkey,
            ..Self::new(wr::SEND_WITH_INV, wr_id)
        }
    }

    /// A fast registration of `key` over the `npages` page addresses at
    /// GPA `page_list`.
    #[allow(clippy::too_many_arguments)]
    pub fn reg_mr(
        wr_id: u64,
        key: u32,
        iova: u64,
        length: u64,
        page_list: u64,
        npages: u32,
        page_shift: u8,
        access: u32,
    ) -> Self {
        let mut w = Self::new(wr::REG_MR, wr_id);
        let r = abi::WqeRegMr {
            iova: iova.into(),
            length: length.into(),
            page_list: page_list.into(),
            key: key.into(),
            access: access.into(),
            npages: npages.into(),
            page_shift,
            reserved: [0; 11],
        };
        w.op.copy_from_slice(r.as_bytes());
        w
    }

    pub fn bind_mw(wr_id: u64, mw: u32, mr: u32, addr: u64, length: u64, access: u32) -> Self {
        let mut w = Self::new(wr::BIND_MW, wr_id);
        let b = abi::WqeBindMw {
            addr: addr.into(),
            length: length.into(),
            mw: mw.into(),
            mr: mr.into(),
            access: access.into(),
            reserved: [0; 20],
        };
        w.op.copy_from_slice(b.as_bytes());
        w
    }

    /// The UD part: where the datagram goes.
    pub fn ud(mut self, av: abi::Av, qpn: u32, qkey: u32) -> Self {
        let u = abi::WqeUd {
            av,
            remote_qpn: qpn.into(),
            remote_qkey: qkey.into(),
            reserved: [0; 8],
        };
        self.op.copy_from_slice(u.as_bytes());
        self
    }

    pub fn imm(mut self, imm: u32) -> Self {
        if self.opcode == wr::SEND {
            self.opcode = wr::SEND_WITH_IMM;
        }
        self.ex = imm;
        self
    }

    /// The data inline instead of SGEs.
    pub fn inline(mut self, data: &[u8]) -> Self {
        self.sges.clear();
        self.inline = Some(data.to_vec());
        self.flags |= wr::INLINE;
        self
    }

    pub fn flags(mut self, f: u8) -> Self {
        self.flags = f;
        self
    }

    pub fn unsignaled(mut self) -> Self {
        self.flags &= !wr::SIGNALED;
        self
    }

    /// The WQE's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let count = match (&self.inline, self.count) {
            (_, Some(c)) => c,
            (Some(d), None) => u16::try_from(d.len()).expect("inline bytes"),
            (None, None) => u16::try_from(self.sges.len()).expect("SGEs"),
        };
        let h = abi::SendWqeHdr {
            wr_id: self.wr_id.into(),
            opcode: self.opcode,
            flags: self.flags,
            count: count.into(),
            ex: self.ex.into(),
            op: self.op,
        };
        let mut b = h.as_bytes().to_vec();
        match &self.inline {
            Some(d) => b.extend_from_slice(d),
            None => {
                for s in &self.sges {
                    b.extend_from_slice(s.as_bytes());
                }
            }
        }
        b
    }
}

/// An address vector to `dgid` from GID index 0.
pub fn av(dgid: Gid) -> abi::Av {
    abi::Av {
        dgid: dgid.0,
        flow_label: 0.into(),
        sgid_index: 0,
        hop_limit: 64,
        traffic_class: 0,
        sl: 0,
        dmac: [2, 0, 0, 0, 0, 1],
        reserved: 0.into(),
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
    ram: Arc<Ram>,
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
    ram: Arc<Ram>,
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

fn handle_req(h: u32) -> abi::HandleReq {
    abi::HandleReq {
        handle: h.into(),
        reserved: 0.into(),
    }
}

impl Frontend {
    /// CREATE_CONTEXT with a zeroed area of `bits` doorbells.
    pub fn try_context(&mut self, bits: u32) -> Result<Ctx, Status> {
        let n = db::area_pages(bits);
        let area = self.ram.pages(n);
        let pages: Vec<u64> = (0..n).map(|i| area + i * PAGE).collect();
        let req = abi::CreateContextReq {
            doorbell_bits: bits.into(),
            npages: u32::try_from(n).expect("pages").into(),
        };
        let r: abi::HandleResp = self.call(op::CREATE_CONTEXT, 0, req.as_bytes(), &pages)?;
        Ok(Ctx {
            handle: r.handle.get(),
            door: Arc::new(Door {
                ram: self.ram.clone(),
                ctx: r.handle.get(),
                area,
                bits,
                kicker: self.kicker.clone(),
            }),
        })
    }

    pub fn context(&mut self, bits: u32) -> Ctx {
        self.try_context(bits)
            .unwrap_or_else(|s| panic!("CREATE_CONTEXT refused: {s:?}"))
    }

    /// SET_GID of `gid` at `index`.
    pub fn set_gid(&mut self, ctx: &Ctx, index: u32, gid: Gid) -> Result<(), Status> {
        let req = abi::SetGidReq {
            index: index.into(),
            gid_type: abi::gid_type::ROCE_V2.into(),
            gid: gid.0,
        };
        self.command(op::SET_GID, ctx.handle, req.as_bytes(), &[])
            .map(|_| ())
    }

    pub fn pd(&mut self, ctx: &Ctx) -> u32 {
        let r: abi::HandleResp = self.ok(op::ALLOC_PD, ctx.handle, &[], &[]);
        r.handle.get()
    }

    /// A command naming one handle (DEALLOC_PD, DESTROY_CQ, …).
    pub fn destroy(&mut self, opcode: u16, ctx: &Ctx, h: u32) -> Result<(), Status> {
        self.command(opcode, ctx.handle, handle_req(h).as_bytes(), &[])
            .map(|_| ())
    }

    /// REG_MR over `len` fresh bytes (whole pages), addressed from `iova`
    /// (page-aligned here: offset 0).
    pub fn reg_mr(&mut self, ctx: &Ctx, pd: u32, len: u64, acc: u32) -> Mr {
        let npages = len.div_ceil(PAGE);
        let gpa = self.ram.pages(npages);
        let iova = 0x7f00_0000_0000 + gpa;
        self.reg_mr_at(ctx, pd, gpa, len, iova, acc)
            .unwrap_or_else(|s| panic!("REG_MR refused: {s:?}"))
    }

    /// REG_MR of `len` bytes of guest memory from `gpa` (page-aligned).
    pub fn reg_mr_at(
        &mut self,
        ctx: &Ctx,
        pd: u32,
        gpa: u64,
        len: u64,
        iova: u64,
        acc: u32,
    ) -> Result<Mr, Status> {
        let npages = len.div_ceil(PAGE);
        let pages: Vec<u64> = (0..npages).map(|i| gpa + i * PAGE).collect();
        let req = abi::RegMrReq {
            pd: pd.into(),
            access: acc.into(),
            iova: iova.into(),
            length: len.into(),
            page_shift: 12.into(),
            offset: 0.into(),
            npages: u32::try_from(npages).expect("pages").into(),
            reserved: 0.into(),
        };
        let r: abi::MrResp = self.call(op::REG_MR, ctx.handle, req.as_bytes(), &pages)?;
        Ok(Mr {
            gpa,
            len,
            iova,
            lkey: r.lkey.get(),
            rkey: r.rkey.get(),
        })
    }

    pub fn reg_dma_mr(&mut self, ctx: &Ctx, pd: u32, acc: u32) -> abi::MrResp {
        let req = abi::RegDmaMrReq {
            pd: pd.into(),
            access: acc.into(),
        };
        self.ok(op::REG_DMA_MR, ctx.handle, req.as_bytes(), &[])
    }

    pub fn alloc_mr(&mut self, ctx: &Ctx, pd: u32, max_pages: u32) -> abi::MrResp {
        let req = abi::AllocMrReq {
            pd: pd.into(),
            max_pages: max_pages.into(),
        };
        self.ok(op::ALLOC_MR, ctx.handle, req.as_bytes(), &[])
    }

    /// ALLOC_MW of `mw_type` (1 or 2): the window's rkey.
    pub fn alloc_mw(&mut self, ctx: &Ctx, pd: u32, mw_type: u32) -> u32 {
        let req = abi::AllocMwReq {
            pd: pd.into(),
            mw_type: mw_type.into(),
        };
        let r: abi::HandleResp = self.ok(op::ALLOC_MW, ctx.handle, req.as_bytes(), &[]);
        r.handle.get()
    }

    /// CREATE_CQ with a ring of `entries` 32-byte slots.
    pub fn try_cq(&mut self, ctx: &Ctx, entries: u32) -> Result<Cq, Status> {
        let ring = WqRing::new(&self.ram, entries, 32);
        let req = abi::CreateCqReq { ring: ring.desc() };
        let r: abi::CreateCqResp =
            self.call(op::CREATE_CQ, ctx.handle, req.as_bytes(), &ring.pages())?;
        assert_eq!(r.entries.get(), entries, "a CQ holds its ring's entries");
        Ok(Cq {
            ram: self.ram.clone(),
            door: ctx.door.clone(),
            handle: r.cq.get(),
            entries,
            doorbell: r.doorbell.get(),
            header: ring.header,
            ring: ring.base,
            stride: 32,
            cons: 0,
            seq: 0,
        })
    }

    pub fn cq(&mut self, ctx: &Ctx, entries: u32) -> Cq {
        self.try_cq(ctx, entries)
            .unwrap_or_else(|s| panic!("CREATE_CQ refused: {s:?}"))
    }

    /// CREATE_SRQ with `entries` slots of `max_sge` SGEs.
    pub fn srq(&mut self, ctx: &Ctx, pd: u32, entries: u32, max_sge: u32, limit: u32) -> Srq {
        let stride = (16 + 16 * max_sge)
            .next_power_of_two()
            .max(PAGE as u32 / entries);
        let ring = WqRing::new(&self.ram, entries, stride);
        let req = abi::CreateSrqReq {
            pd: pd.into(),
            max_sge: max_sge.into(),
            srq_limit: limit.into(),
            reserved: 0.into(),
            ring: ring.desc(),
        };
        let r: abi::CreateSrqResp =
            self.ok(op::CREATE_SRQ, ctx.handle, req.as_bytes(), &ring.pages());
        Srq {
            ram: self.ram.clone(),
            door: ctx.door.clone(),
            handle: r.srq.get(),
            doorbell: r.doorbell.get(),
            ring,
        }
    }

    /// CREATE_QP as `spec` says, its rings in fresh guest memory.
    pub fn try_qp(&mut self, ctx: &Ctx, pd: u32, spec: &QpSpec) -> Result<Qp, Status> {
        let ss = spec.send_stride();
        let sq = WqRing::new(&self.ram, spec.sq_entries.max(PAGE as u32 / ss), ss);
        let rq = (spec.srq == 0).then(|| {
            let rs = spec.recv_stride();
            WqRing::new(&self.ram, spec.rq_entries.max(PAGE as u32 / rs), rs)
        });
        let req = abi::CreateQpReq {
            pd: pd.into(),
            qp_type: spec.qp_type,
            sq_sig_all: u8::from(spec.sq_sig_all),
            reserved0: 0.into(),
            send_cq: spec.send_cq.into(),
            recv_cq: spec.recv_cq.into(),
            srq: spec.srq.into(),
            max_send_sge: spec.max_send_sge.into(),
            max_recv_sge: if spec.srq == 0 { spec.max_recv_sge } else { 0 }.into(),
            max_inline_data: spec.max_inline.into(),
            sq: sq.desc(),
            rq: rq.as_ref().map(WqRing::desc).unwrap_or_default(),
        };
        let mut pages = sq.pages();
        if let Some(r) = &rq {
            pages.extend(r.pages());
        }
        let r: abi::CreateQpResp = self.call(op::CREATE_QP, ctx.handle, req.as_bytes(), &pages)?;
        Ok(Qp {
            ram: self.ram.clone(),
            door: ctx.door.clone(),
            qpn: r.qpn.get(),
            doorbell: r.doorbell.get(),
            qp_type: spec.qp_type,
            sq,
            rq,
            resp: r,
        })
    }

    pub fn qp(&mut self, ctx: &Ctx, pd: u32, spec: &QpSpec) -> Qp {
        self.try_qp(ctx, pd, spec)
            .unwrap_or_else(|s| panic!("CREATE_QP refused: {s:?}"))
    }

    /// MODIFY_QP.
    pub fn modify_qp(
        &mut self,
        ctx: &Ctx,
        qpn: u32,
        attr_mask: u32,
        attrs: &abi::QpAttrs,
    ) -> Result<(), Status> {
        let req = abi::ModifyQpReq {
            qpn: qpn.into(),
            attr_mask: attr_mask.into(),
            attrs: *attrs,
        };
        self.command(op::MODIFY_QP, ctx.handle, req.as_bytes(), &[])
            .map(|_| ())
    }

    pub fn query_qp(&mut self, ctx: &Ctx, qpn: u32) -> abi::QueryQpResp {
        self.ok(op::QUERY_QP, ctx.handle, handle_req(qpn).as_bytes(), &[])
    }

    /// RESET → INIT (and for UD: → RTR → RTS).
    pub fn qp_init(&mut self, ctx: &Ctx, qp: &Qp, acc: u32) {
        let mut a = abi::QpAttrs::new_zeroed();
        a.qp_state = state::INIT.into();
        a.port_num = 1;
        let m = if qp.qp_type == qp_type::UD {
            a.qkey = QKEY.into();
            mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY
        } else {
            a.qp_access_flags = acc.into();
            mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS
        };
        self.modify_qp(ctx, qp.qpn, m, &a)
            .unwrap_or_else(|s| panic!("QP {} to INIT refused: {s:?}", qp.qpn));
    }

    /// INIT → RTR towards `dest` at `dgid` (connected QPs), or plain RTR
    /// (UD): MTU 1024, both sides starting at [`PSN`].
    pub fn qp_rtr(&mut self, ctx: &Ctx, qp: &Qp, dest: u32, dgid: Gid) {
        self.try_qp_rtr_to(ctx, qp, &Path::new(dest, dgid))
            .unwrap_or_else(|s| panic!("QP {} to RTR refused: {s:?}", qp.qpn));
    }

    /// INIT → RTR along `p` (connected QPs), or plain RTR (UD).
    pub fn try_qp_rtr_to(&mut self, ctx: &Ctx, qp: &Qp, p: &Path) -> Result<(), Status> {
        let mut a = abi::QpAttrs::new_zeroed();
        a.qp_state = state::RTR.into();
        let m = match qp.qp_type {
            qp_type::UD => mask::STATE,
            t => {
                a.ah = av(p.gid);
                a.ah.flow_label = p.flow_label.into();
                if let Some(dmac) = p.dmac {
                    a.ah.dmac = dmac;
                }
                a.path_mtu = p.mtu.into();
                a.dest_qp_num = p.qpn.into();
                a.rq_psn = p.psn.into();
                let mut m = mask::STATE | mask::AV | mask::PATH_MTU | mask::DEST_QPN | mask::RQ_PSN;
                if t == qp_type::RC {
                    a.max_dest_rd_atomic = 4;
                    a.min_rnr_timer = 1;
                    m |= mask::MAX_DEST_RD_ATOMIC | mask::MIN_RNR_TIMER;
                }
                m
            }
        };
        self.modify_qp(ctx, qp.qpn, m, &a)
    }

    /// RTR → RTS, sending from [`PSN`].
    pub fn qp_rts(&mut self, ctx: &Ctx, qp: &Qp) {
        self.try_qp_rts_at(ctx, qp, PSN)
            .unwrap_or_else(|s| panic!("QP {} to RTS refused: {s:?}", qp.qpn));
    }

    /// RTR → RTS, sending from `psn` (RC: timeout 14, 7 retries, 7 RNR
    /// retries, 4 READs/atomics in flight).
    pub fn try_qp_rts_at(&mut self, ctx: &Ctx, qp: &Qp, psn: u32) -> Result<(), Status> {
        let mut a = abi::QpAttrs::new_zeroed();
        a.qp_state = state::RTS.into();
        a.sq_psn = psn.into();
        let mut m = mask::STATE | mask::SQ_PSN;
        if qp.qp_type == qp_type::RC {
            a.timeout = 14;
            a.retry_cnt = 7;
            a.rnr_retry = 7;
            a.max_rd_atomic = 4;
            m |= mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC;
        }
        self.modify_qp(ctx, qp.qpn, m, &a)
    }

    /// To `st` with nothing else (ERR, RESET).
    pub fn qp_state(&mut self, ctx: &Ctx, qpn: u32, st: u32) -> Result<(), Status> {
        let mut a = abi::QpAttrs::new_zeroed();
        a.qp_state = st.into();
        self.modify_qp(ctx, qpn, mask::STATE, &a)
    }
}

/// Where a connected QP's RTR points: the peer QP, the PSN it starts at,
/// its GID, the path MTU (`ibv_mtu`: 1 = 256 … 5 = 4096) and, when not the
/// kit's placeholder, the next hop's MAC.
#[derive(Clone, Copy, Debug)]
pub struct Path {
    pub qpn: u32,
    pub psn: u32,
    pub gid: Gid,
    pub mtu: u32,
    pub dmac: Option<[u8; 6]>,
    /// The AV's flow label word, as the driver writes it.
    pub flow_label: u32,
}

impl Path {
    /// To `qpn` at `gid`, MTU 1024, from [`PSN`].
    pub fn new(qpn: u32, gid: Gid) -> Self {
        Path {
            qpn,
            psn: PSN,
            gid,
            mtu: 3,
            dmac: None,
            flow_label: 0,
        }
    }
}

/// The Q_Key of the tests' UD QPs, and the PSN every QP starts at.
pub const QKEY: u32 = 0x1111_1111;
pub const PSN: u32 = 0x00ab_cd00;

/// A guest on a device with what most tests need: a context (4096
/// doorbells) with the device's address as GID 0, a PD, a CQ of 256
/// entries and a 1 MiB MR with every access.
#[derive(Debug)]
pub struct Endpoint {
    pub fe: Frontend,
    pub ctx: Ctx,
    pub pd: u32,
    pub cq: Cq,
    pub mr: Mr,
    pub gid: Gid,
}

impl Endpoint {
    /// On `dev` with 64 MiB of guest memory.
    pub fn new(dev: &impl GuestDevice) -> Self {
        Self::with_memory(dev, 64 << 20)
    }

    pub fn with_memory(dev: &impl GuestDevice, size: u64) -> Self {
        Self::on(dev.connect(size), dev.gid())
    }

    /// On a connected front-end, binding `gid`.
    pub fn on(mut fe: Frontend, gid: Gid) -> Self {
        let ctx = fe.context(4096);
        fe.set_gid(&ctx, 0, gid)
            .unwrap_or_else(|s| panic!("SET_GID refused: {s:?}"));
        let pd = fe.pd(&ctx);
        let cq = fe.cq(&ctx, 256);
        let mr = fe.reg_mr(&ctx, pd, 1 << 20, ALL_ACCESS | access::MW_BIND);
        Endpoint {
            fe,
            ctx,
            pd,
            cq,
            mr,
            gid,
        }
    }

    /// A QP of `qp_type` on the side's CQ.
    pub fn qp(&mut self, qp_type: u8) -> Qp {
        let spec = QpSpec::new(qp_type, self.cq.handle);
        self.fe.qp(&self.ctx, self.pd, &spec)
    }

    /// Guest memory of the MR: writes `data` at `off`.
    pub fn put(&self, off: u64, data: &[u8]) {
        self.fe.ram.write(self.mr.gpa + off, data);
    }

    /// Reads `len` bytes of the MR at `off`.
    pub fn get(&self, off: u64, len: usize) -> Vec<u8> {
        self.fe.ram.read_bytes(self.mr.gpa + off, len)
    }
}

/// Brings `qa` (of side `a`) and `qb` (of `b`) to RTS, connected to each
/// other (UD QPs: each to RTS).
pub fn connect(a: &mut Endpoint, qa: &Qp, b: &mut Endpoint, qb: &Qp) {
    let (ga, gb) = (a.gid, b.gid);
    for (s, q, peer, pgid) in [(&mut *a, qa, qb.qpn, gb), (&mut *b, qb, qa.qpn, ga)] {
        s.fe.qp_init(&s.ctx, q, ALL_ACCESS);
        s.fe.qp_rtr(&s.ctx, q, peer, pgid);
        s.fe.qp_rts(&s.ctx, q);
    }
}

/// A deterministic pattern of `len` bytes from `seed`.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// A SEND of `len` bytes from `a` to `b` on connected RC QPs, checked
/// byte for byte: the receive posted, the send posted, both completions,
/// the bytes in `b`'s MR. `tag` makes the data and wr_ids differ.
pub fn send_checked(
    a: &mut Endpoint,
    qa: &mut Qp,
    b: &mut Endpoint,
    qb: &mut Qp,
    tag: u8,
    len: u32,
) {
    let data = pattern(tag, len as usize);
    a.put(0, &data);
    b.fe.ram.fill(b.mr.gpa + 4096, len as usize, 0);
    qb.post_recv(u64::from(tag) << 8 | 1, &[b.mr.sge(4096, len)]);
    qa.post_send(&Wqe::send(u64::from(tag) << 8 | 2, &[a.mr.sge(0, len)]));
    a.cq.expect_ok(wc::SEND, u64::from(tag) << 8 | 2);
    let c = b.cq.expect_ok(wc::RECV, u64::from(tag) << 8 | 1);
    assert_eq!(c.byte_len.get(), len);
    assert_eq!(c.qpn.get(), qb.qpn);
    assert_eq!(b.get(4096, len as usize), data, "the SEND's bytes");
}
