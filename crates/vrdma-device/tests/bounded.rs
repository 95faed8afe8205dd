//! What a long message costs the daemon: two RC QPs of one device on the
//! Ethernet port (a guest talking to itself: every packet loops back
//! through the port), a 64 MiB RDMA READ and a 256 MiB UC WRITE. The
//! process's memory may grow by a bounded amount — the port's loopback
//! queue, the engine's window — never by the message's length. The device
//! memory is a shared file mapping (as a guest's RAM is), every page of it
//! touched before the transfer, so what grows during it is the daemon's
//! own (anonymous) memory. The peak is the kernel's (`VmHWM`, reset
//! through `/proc/self/clear_refs` before each transfer): a queue that
//! fills and drains within one progress step counts.
//!
//! One test in its own binary: the process's memory is this test's alone.

use std::{
    fs::File,
    net::{IpAddr, Ipv4Addr},
    os::unix::net::UnixStream,
    time::{Duration, Instant},
};

use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};
use vrdma_device::{Device, GuestMem};
use vrdma_engine::{
    Engine,
    attr::{DeviceAttr, Mtu, PortAttr},
    mr::{Access, MrRequest, Translation},
    qp::{QpCap, QpInitAttr, QpType},
    wc::{Wc, WcOpcode, WcStatus},
    wr::{Payload, SendFlags, SendOp, SendWr, Sge},
};
use vrdma_fabric::eth::{EthPort, Link, Stream};
use vrdma_testkit::setup::Connection;
use vrdma_wire::{Gid, Psn, Qpn};

const BASE: u64 = 0x10_0000;
const READ_LEN: u64 = 64 << 20;
const UC_LEN: u64 = 256 << 20;
/// The source of each transfer, then its destination.
const MEM: u64 = 2 * UC_LEN;

/// How far the daemon's anonymous memory may grow during a transfer.
const GROWTH_LIMIT: u64 = 32 << 20;

/// A field of `/proc/self/status` counted in kB, in bytes.
fn status(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("status");
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"));
    kb << 10
}

/// Resets the process's peak resident size (`VmHWM`) to its current one.
fn reset_peak() {
    std::fs::write("/proc/self/clear_refs", "5").expect("clear_refs");
}

/// `len` bytes of memory at `BASE`, shared with a file (a guest's RAM).
fn shared_memory(len: u64) -> GuestMem {
    let fd = nix::sys::memfd::memfd_create(c"vrdma-bounded", nix::sys::memfd::MFdFlags::empty())
        .expect("memfd");
    let file = File::from(fd);
    file.set_len(len).expect("size");
    let map = GuestMemoryMmap::<()>::from_ranges_with_files([(
        GuestAddress(BASE),
        len as usize,
        Some(FileOffset::new(file, 0)),
    )])
    .expect("map");
    GuestMem::from_map(map)
}

type EthDevice = Device<GuestMem, EthPort>;

struct Setup {
    dev: EthDevice,
    /// The far ends of the guest's NIC and of the uplink (kept open).
    _peers: (UnixStream, UnixStream),
    pd: vrdma_engine::PdHandle,
    cq: vrdma_engine::CqHandle,
    lkey: vrdma_wire::Lkey,
    rkey: vrdma_wire::Rkey,
}

fn setup() -> Setup {
    let gid = gid();
    let (guest, guest_peer) = UnixStream::pair().expect("pair");
    let (uplink, uplink_peer) = UnixStream::pair().expect("pair");
    let port = EthPort::with_stream(
        guest,
        Link::Stream(Stream::new(uplink).expect("stream")),
        [0x52, 0x54, 0, 0, 0, 1],
    )
    .expect("port");
    let mut attr = PortAttr::with_gids(&[gid]);
    attr.active_mtu = Mtu::Mtu4096;
    let mut dev = Device::new(
        Engine::new(DeviceAttr::default(), attr),
        shared_memory(MEM),
        port,
    );
    dev.transport_mut().set_local(&[gid]);
    let e = dev.engine_mut();
    let pd = e.alloc_pd().expect("pd");
    let (cq, _) = e.create_cq(64, 0).expect("cq");
    let (lkey, rkey) = e
        .reg_mr(MrRequest {
            pd,
            iova: BASE,
            length: MEM,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            translation: Translation::Identity,
        })
        .expect("mr");
    Setup {
        dev,
        _peers: (guest_peer, uplink_peer),
        pd,
        cq,
        lkey,
        rkey,
    }
}

/// Writes a pattern that depends on `seed` over `len` bytes at `at`, a
/// mebibyte at a time.
fn fill(mem: &GuestMem, at: u64, len: u64, seed: u64) {
    let mut chunk = vec![0u8; 1 << 20];
    for off in (0..len).step_by(chunk.len()) {
        for (i, b) in chunk.iter_mut().enumerate() {
            *b = ((off + i as u64 + seed) * 13 / 7) as u8;
        }
        mem.map()
            .write_slice(&chunk, GuestAddress(at + off))
            .expect("fill");
    }
}

/// Whether `len` bytes at `a` and `b` are equal, compared a mebibyte at a
/// time.
fn same(mem: &GuestMem, a: u64, b: u64, len: u64) -> bool {
    let (mut x, mut y) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    (0..len).step_by(x.len()).all(|off| {
        mem.map().read_slice(&mut x, GuestAddress(a + off)).is_ok()
            && mem.map().read_slice(&mut y, GuestAddress(b + off)).is_ok()
            && x == y
    })
}

/// Posts `op` on `qp` (`len` bytes at `local`, remote `remote`), then
/// runs the device until it completes and what it sent has arrived;
/// returns the completion and how far the process's resident memory grew
/// meanwhile at its peak.
fn transfer(s: &mut Setup, qp: Qpn, op: SendOp, local: u64, len: u64) -> (Wc, u64) {
    let sge = [Sge {
        addr: local,
        length: len as u32,
        lkey: s.lkey,
    }];
    reset_peak();
    let before = status("VmRSS");
    s.dev
        .engine_mut()
        .post_send(
            qp,
            &SendWr {
                wr_id: 1,
                op,
                payload: Payload::Sges(&sge),
                flags: SendFlags::SIGNALED,
                ud: None,
            },
        )
        .expect("post");
    let limit = Instant::now() + Duration::from_secs(120);
    let mut wc = Vec::new();
    for round in 0u64.. {
        s.dev.progress().expect("progress");
        s.dev.engine_mut().poll_cq(s.cq, 1, &mut wc).expect("poll");
        if let Some(w) = wc.pop() {
            // A UC requester completes when its last packet left: let
            // the receiving side take what is still on its way.
            while !s.dev.progress().expect("progress").is_idle() {}
            return (w, status("VmHWM").saturating_sub(before));
        }
        assert!(Instant::now() < limit, "no completion after {round} rounds");
    }
    unreachable!()
}

#[test]
fn a_long_message_looped_back_costs_its_window_not_its_length() {
    let mut s = setup();
    let rkey = s.rkey;

    // RC READ: QP a reads 64 MiB from the first half into the second; its
    // responder (QP b, the same device) answers with 16 384 packets.
    fill(s.dev.mem(), BASE, READ_LEN, 0);
    fill(s.dev.mem(), BASE + UC_LEN, READ_LEN, 1);
    let read = SendOp::RdmaRead {
        remote_addr: BASE,
        rkey,
    };
    let a = qp_pair(&mut s, QpType::Rc);
    let (wc, growth) = transfer(&mut s, a, read, BASE + UC_LEN, READ_LEN);
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::RdmaRead)
    );
    assert!(same(s.dev.mem(), BASE, BASE + UC_LEN, READ_LEN));
    assert!(
        growth < GROWTH_LIMIT,
        "a {READ_LEN}-byte READ grew the process's memory by {growth} bytes"
    );
    let read_growth = growth;

    // UC WRITE: no window at all on the requester; 256 MiB.
    let a = qp_pair(&mut s, QpType::Uc);
    fill(s.dev.mem(), BASE, UC_LEN, 2);
    fill(s.dev.mem(), BASE + UC_LEN, UC_LEN, 3);
    let write = SendOp::RdmaWrite {
        remote_addr: BASE + UC_LEN,
        rkey,
    };
    let (wc, growth) = transfer(&mut s, a, write, BASE, UC_LEN);
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::RdmaWrite)
    );
    assert!(same(s.dev.mem(), BASE, BASE + UC_LEN, UC_LEN));
    assert!(
        growth < GROWTH_LIMIT,
        "a {UC_LEN}-byte UC WRITE grew the process's memory by {growth} bytes"
    );
    let stats = s.dev.transport().stats();
    assert!(
        stats.tx_paused > 0,
        "the loopback queue never filled: {stats:?}"
    );
    eprintln!("peak growth: READ {read_growth} B, UC WRITE {growth} B");
}

/// The device's own address.
fn gid() -> Gid {
    Gid::from(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)))
}

/// Two QPs of type `ty` on the device, connected to each other (at MTU
/// 4096, 16 READs outstanding); the first.
fn qp_pair(s: &mut Setup, ty: QpType) -> Qpn {
    let (pd, cq) = (s.pd, s.cq);
    let e = s.dev.engine_mut();
    let mut qp = || {
        e.create_qp(QpInitAttr {
            pd,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap: QpCap {
                max_send_wr: 16,
                max_recv_wr: 16,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ty,
            sq_sig_all: false,
        })
        .expect("qp")
        .0
    };
    let (a, b) = (qp(), qp());
    let c = Connection {
        mtu: Mtu::Mtu4096,
        psn: Psn::from_masked(0x00ff_ff00),
        max_rd_atomic: 16,
        max_dest_rd_atomic: 16,
        ..Connection::default()
    };
    c.join(e, a, gid(), b);
    c.join(e, b, gid(), a);
    a
}
