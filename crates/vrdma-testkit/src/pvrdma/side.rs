//! A well-behaved guest's objects on a device ([`Endpoint`]), two of them
//! connected ([`connect`]), a good exchange both ways checked to the byte
//! ([`exchange`]), and one going on throughout a test in a thread of its
//! own ([`Steady`]); the waits the tests share ([`wait_event`],
//! [`eventually`], [`completion`]).

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use vrdma_pvrdma::abi::{self, PAGE_SIZE, cmd, qp_type, send_flags, wc_opcode, wr_opcode};
use vrdma_wire::Gid;

use super::{
    Device, Served,
    guest::{Guest, GuestCq, GuestQp, hdr, rc_up, sge, wqe},
};

/// The guest RAM of a side.
pub const RAM: u64 = 16 << 20;

/// The virtual address of each side's user MR.
pub const MR_VA: u64 = 0x7f00_0000_0000;

/// Completion status: success.
const WC_SUCCESS: u32 = 0;

/// A well-behaved guest's objects: a PD, the DMA MR, a CQ, an RC QP, a
/// buffer and a user MR others write into.
#[derive(Debug)]
pub struct Endpoint {
    pub g: Guest,
    /// The device's address (bound at GID index 0) and MAC: where a peer
    /// connects to.
    pub gid: Gid,
    pub mac: [u8; 6],
    pub pd: u32,
    pub lkey: u32,
    pub cq: GuestCq,
    pub qp: GuestQp,
    /// 4 pages.
    pub buf: u64,
    /// The user MR's 2 pages, at [`MR_VA`].
    pub mr: u64,
    pub rkey: u32,
    /// Exchanges this side sent (each one's bytes differ).
    round: u32,
}

impl Endpoint {
    /// A guest on `device` with [`RAM`] of RAM, every allocation followed
    /// by a canary page: the driver's probe (its capabilities checked),
    /// the device's address bound as GID 0, a PD, the DMA MR, a CQ of 64,
    /// an RC QP 16 deep, a buffer and a user MR.
    pub fn new(device: &Device) -> Self {
        Self::with_ram(device, RAM)
    }

    /// [`Endpoint::new`] with `ram` bytes of RAM.
    pub fn with_ram(device: &Device, ram: u64) -> Self {
        Self::on(&device.socket, device.gid(), device.mac, ram)
    }

    /// [`Endpoint::new`] for the device served at `socket` (in this process or
    /// not) whose address is `gid` and MAC `mac`, with `ram` bytes of RAM.
    pub fn on(socket: &Path, gid: Gid, mac: [u8; 6], ram: u64) -> Self {
        let mut g = Guest::connect(socket, ram);
        g.guarded = true;
        assert_eq!(g.probe(), 0, "ACTIVATE");
        assert_eq!(g.caps.mode, 0);
        assert_eq!(g.caps.gid_types, abi::GID_TYPE_ROCE_V2);
        assert!(g.caps.max_qp.get() > 17);
        g.bind_gid(0, gid);
        let pd = g.create_pd(0);
        let (_, lkey) = g.dma_mr(pd);
        let cq = g.create_cq(64, 0);
        let qp = g.create_qp(qp_type::RC, pd, cq.handle, cq.handle, 16);
        assert!(qp.qpn >= 17, "regular QPNs start at 17");
        let buf = g.alloc(4);
        let mr = g.alloc(2);
        let (_, _, rkey) = g.user_mr(pd, MR_VA, &[mr, mr + PAGE_SIZE], 1 | 2 | 4 | 8);
        Endpoint {
            g,
            gid,
            mac,
            pd,
            lkey,
            cq,
            qp,
            buf,
            mr,
            rkey,
            round: 0,
        }
    }

    /// A fresh RC QP on the side's PD and CQ (its old one stays), for a
    /// new connection.
    pub fn new_qp(&mut self) {
        self.qp = self
            .g
            .create_qp(qp_type::RC, self.pd, self.cq.handle, self.cq.handle, 16);
    }
}

impl Endpoint {
    /// A CREATE_MR for a 1 GiB MR whose page directory is two of this
    /// guest's pages: a directory whose 512 entries all point at one
    /// table, whose 512 entries all point at the side's MR page. Each one
    /// made holds 2 MiB of page list in the daemon (unbounded, 4096 of
    /// them: 8 GiB for one guest) — what the object budget must refuse.
    pub fn giant_mr_request(&mut self) -> abi::CreateMr {
        let dir = self.g.alloc(2);
        let table = dir + PAGE_SIZE;
        self.g.put(dir, [table.to_le_bytes(); 512].as_flattened());
        self.g
            .put(table, [self.mr.to_le_bytes(); 512].as_flattened());
        let gib: u64 = 1 << 30;
        abi::CreateMr {
            hdr: hdr(cmd::CREATE_MR),
            start: MR_VA.into(),
            length: gib.into(),
            pdir_dma: dir.into(),
            pd_handle: self.pd.into(),
            access_flags: 1.into(),
            flags: 0.into(),
            nchunks: ((gib / PAGE_SIZE) as u32).into(),
        }
    }
}

/// Makes [`Endpoint::giant_mr_request`]'s MRs on `a` until the device refuses
/// one, which must be with ENOMEM, counted, before 64 (a budget holds)
/// and after 16 (it leaves room for real MRs), the memory held within the
/// budget; then `a` and `b` still exchange and a small MR still fits.
/// The device's counters are `served`'s.
pub fn page_lists_past_the_budget(served: &Served, a: &mut Endpoint, b: &mut Endpoint) {
    let req = a.giant_mr_request();
    let mut made = 0;
    let refusal = loop {
        match a.g.command(&req) {
            Ok(_) => made += 1,
            Err(_) => break a.g.refused(&req),
        }
        assert!(made < 64, "{made} MRs of 1 GiB: no budget");
    };
    assert_eq!(refusal, 12, "ENOMEM");
    let limit = served.counter_when("budget.limit", |n| n > 0);
    let refused = served.counter_when("budget.refused", |n| n >= 2);
    assert!(refused >= 2, "refusals counted: {refused}");
    let bytes = served.counter_when("objects.bytes", |_| true);
    assert!(bytes <= limit, "{bytes} held over a limit of {limit}");
    assert!(made >= 16, "the budget leaves room for real MRs: {made}");
    exchange(a, b);
    let (_, _, _) = a.g.user_mr(a.pd, MR_VA, &[a.mr], 1);
}

/// Connects the two sides' QPs to each other (RC, in RTS).
pub fn connect(a: &mut Endpoint, b: &mut Endpoint) {
    rc_up(&mut a.g, &a.qp, b.gid, b.qp.qpn, b.mac);
    rc_up(&mut b.g, &b.qp, a.gid, a.qp.qpn, a.mac);
}

/// A good exchange both ways: a 4 KiB SEND and a WRITE across the user
/// MR's page boundary, every byte checked, then every canary.
pub fn exchange(a: &mut Endpoint, b: &mut Endpoint) {
    one_way(a, b);
    one_way(b, a);
}

/// [`exchange`]'s one way, `s` to `r`.
pub fn one_way(s: &mut Endpoint, r: &mut Endpoint) {
    s.round += 1;
    let round = s.round;
    let seed = u32::from(s.gid.0[15]);
    let data: Vec<u8> = (0..4096u32)
        .map(|i| (i * 13 + round * 7 + seed) as u8)
        .collect();
    s.g.put(s.buf, &data);
    r.g.put(r.buf, &[0u8; 4096]);
    let recv_id = 1000 + u64::from(round);
    r.g.post_recv(&mut r.qp, recv_id, &[sge(r.buf, 4096, r.lkey)]);
    let send_id = 2000 + u64::from(round);
    s.g.post_send(
        &mut s.qp,
        &wqe(send_id, wr_opcode::SEND, send_flags::SIGNALED, 1),
        &[sge(s.buf, 4096, s.lkey)],
    );
    let c = s.g.poll_n(&mut s.cq, 1);
    assert_eq!(c.len(), 1, "the SEND's completion");
    assert_eq!(
        (c[0].wr_id.get(), c[0].status.get(), c[0].opcode.get()),
        (send_id, WC_SUCCESS, wc_opcode::SEND)
    );
    let c = r.g.poll_n(&mut r.cq, 1);
    assert_eq!(c.len(), 1, "the receive's completion");
    assert_eq!(
        (c[0].wr_id.get(), c[0].status.get(), c[0].byte_len.get()),
        (recv_id, WC_SUCCESS, 4096)
    );
    assert_eq!(r.g.get(r.buf, 4096), data, "the SEND's bytes");

    let write_id = 3000 + u64::from(round);
    s.g.put(s.buf + 2 * PAGE_SIZE, &data[..200]);
    let mut w = wqe(write_id, wr_opcode::RDMA_WRITE, send_flags::SIGNALED, 1);
    w.wr[0] = (MR_VA + 4000).into();
    w.wr[1] = u64::from(r.rkey).into();
    s.g.post_send(&mut s.qp, &w, &[sge(s.buf + 2 * PAGE_SIZE, 200, s.lkey)]);
    let c = s.g.poll_n(&mut s.cq, 1);
    assert_eq!(c.len(), 1, "the WRITE's completion");
    assert_eq!(
        (c[0].wr_id.get(), c[0].status.get()),
        (write_id, WC_SUCCESS)
    );
    assert_eq!(r.g.get(r.mr + 4000, 200), &data[..200], "the WRITE's bytes");
    s.g.check_canaries();
    r.g.check_canaries();
}

/// `s` READs 200 bytes across `r`'s user MR's page boundary, then
/// FETCH_ADDs and COMP_SWAPs a word of it: every completion, byte and
/// returned value checked, then every canary.
pub fn read_and_atomics(s: &mut Endpoint, r: &mut Endpoint) {
    s.round += 1;
    let round = s.round;
    let seed = u32::from(s.gid.0[15]);
    let data: Vec<u8> = (0..200u32)
        .map(|i| (i * 31 + round * 3 + seed) as u8)
        .collect();
    r.g.put(r.mr + 4000, &data);
    let local = s.buf + 3 * PAGE_SIZE;
    s.g.put(local, &[0u8; 512]);
    let read_id = 4000 + u64::from(round);
    let mut w = wqe(read_id, wr_opcode::RDMA_READ, send_flags::SIGNALED, 1);
    w.wr[0] = (MR_VA + 4000).into();
    w.wr[1] = u64::from(r.rkey).into();
    s.g.post_send(&mut s.qp, &w, &[sge(local, 200, s.lkey)]);
    let c = completion(&mut s.g, &mut s.cq, read_id);
    assert_eq!(
        (c.status.get(), c.opcode.get(), c.byte_len.get()),
        (WC_SUCCESS, wc_opcode::RDMA_READ, 200)
    );
    assert_eq!(s.g.get(local, 200), data, "the READ's bytes");

    // A word of the MR's second page.
    let (word, remote) = (r.mr + PAGE_SIZE + 512, MR_VA + PAGE_SIZE + 512);
    let old = 0x1000_0000_0000_0000 | (u64::from(seed) << 32) | u64::from(round);
    r.g.put(word, &old.to_le_bytes());
    let add_id = 5000 + u64::from(round);
    let mut w = wqe(
        add_id,
        wr_opcode::ATOMIC_FETCH_AND_ADD,
        send_flags::SIGNALED,
        1,
    );
    w.wr[0] = remote.into();
    w.wr[1] = 7u64.into();
    w.wr[3] = u64::from(r.rkey).into();
    s.g.post_send(&mut s.qp, &w, &[sge(local + 256, 8, s.lkey)]);
    let c = completion(&mut s.g, &mut s.cq, add_id);
    assert_eq!(
        (c.status.get(), c.opcode.get()),
        (WC_SUCCESS, wc_opcode::FETCH_ADD)
    );
    assert_eq!(s.g.get(local + 256, 8), old.to_le_bytes(), "FETCH_ADD's");
    assert_eq!(r.g.get(word, 8), (old + 7).to_le_bytes(), "added");
    let swap_id = 6000 + u64::from(round);
    let mut w = wqe(
        swap_id,
        wr_opcode::ATOMIC_CMP_AND_SWP,
        send_flags::SIGNALED,
        1,
    );
    w.wr[0] = remote.into();
    w.wr[1] = (old + 7).into();
    w.wr[2] = (!old).into();
    w.wr[3] = u64::from(r.rkey).into();
    s.g.post_send(&mut s.qp, &w, &[sge(local + 264, 8, s.lkey)]);
    let c = completion(&mut s.g, &mut s.cq, swap_id);
    assert_eq!(
        (c.status.get(), c.opcode.get()),
        (WC_SUCCESS, wc_opcode::COMP_SWAP)
    );
    assert_eq!(
        s.g.get(local + 264, 8),
        (old + 7).to_le_bytes(),
        "COMP_SWAP's"
    );
    assert_eq!(r.g.get(word, 8), (!old).to_le_bytes(), "swapped");
    s.g.check_canaries();
    r.g.check_canaries();
}

/// The async events until `want` came (2 s at most; panics without it).
pub fn wait_event(g: &mut Guest, want: (u32, u32)) -> Vec<(u32, u32)> {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        seen.extend(g.events());
        if seen.contains(&want) {
            return seen;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    panic!("no event {want:?}; saw {seen:?}");
}

/// Whether `ok` comes to hold within 2 s.
pub fn eventually(ok: impl FnMut() -> bool) -> bool {
    eventually_within(Duration::from_secs(2), ok)
}

/// Whether `ok` comes to hold within `limit`.
pub fn eventually_within(limit: Duration, mut ok: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !ok() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// The one completion `wr_id` on `cq` (5 s at most).
pub fn completion(g: &mut Guest, cq: &mut GuestCq, wr_id: u64) -> abi::Cqe {
    let c = g.poll_n(cq, 1);
    assert_eq!(c.len(), 1, "completion of {wr_id}");
    assert_eq!(c[0].wr_id.get(), wr_id);
    c[0]
}

/// Two connected sides exchanging ([`exchange`]) over and over in a
/// thread of their own, from [`Steady::start`] to [`Steady::finish`]: the
/// well-behaved tenant that must go on, byte-exact, whatever another
/// tenant does meanwhile.
#[derive(Debug)]
pub struct Steady {
    stop: Arc<AtomicBool>,
    rounds: Arc<AtomicU64>,
    thread: Option<JoinHandle<(Endpoint, Endpoint)>>,
}

impl Steady {
    /// Starts exchanging between `a` and `b` (connected to each other).
    pub fn start(mut a: Endpoint, mut b: Endpoint) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicU64::new(0));
        let (halt, count) = (stop.clone(), rounds.clone());
        let thread = std::thread::spawn(move || {
            while !halt.load(Ordering::Relaxed) {
                exchange(&mut a, &mut b);
                count.fetch_add(1, Ordering::Relaxed);
            }
            (a, b)
        });
        let s = Steady {
            stop,
            rounds,
            thread: Some(thread),
        };
        s.check();
        s
    }

    /// Exchanges completed so far.
    pub fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::Relaxed)
    }

    /// Waits until two more exchanges have completed (10 s at most): the
    /// pair is exchanging now.
    pub fn check(&self) {
        let from = self.rounds();
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.rounds() < from + 2 {
            let done = self.thread.as_ref().is_none_or(JoinHandle::is_finished);
            assert!(
                !done,
                "the steady pair stopped exchanging (its thread ended)"
            );
            assert!(
                Instant::now() < deadline,
                "the steady pair made no progress in 10 s ({from} exchanges)"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Checks that the pair is still exchanging, stops it and gives its
    /// sides back with the exchanges it made; panics if one failed.
    pub fn finish(mut self) -> (Endpoint, Endpoint, u64) {
        self.check();
        self.stop.store(true, Ordering::Relaxed);
        let thread = self.thread.take().expect("a running pair");
        match thread.join() {
            Ok((a, b)) => (a, b, self.rounds()),
            Err(e) => std::panic::resume_unwind(e),
        }
    }
}

impl Drop for Steady {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take()
            && t.join().is_err()
            && !std::thread::panicking()
        {
            panic!("the steady pair failed an exchange");
        }
    }
}
