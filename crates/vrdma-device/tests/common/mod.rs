//! Set-up shared by the tests that run devices on real sockets: a
//! device with a PD, a CQ and one MR over all its memory, and posting,
//! filling and comparing that memory.

#![allow(dead_code)] // each test file uses its own part

use std::net::IpAddr;

use vrdma_device::{GuestMem, UdpDevice, udp_device};
use vrdma_engine::{
    CqHandle, Memory, PdHandle,
    attr::{DeviceAttr, Mtu},
    mr::{Access, MrRequest, Translation},
    wr::{Payload, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_fabric::udp::Config;
use vrdma_wire::{Lkey, Qpn, Rkey};

/// Where each device's memory starts, and how much it has.
pub const BASE: u64 = 0x10_0000;
pub const MEM: usize = 4 << 20;

/// A device on a socket, with a PD, a CQ and an MR over all its memory.
pub struct End {
    pub dev: UdpDevice<GuestMem>,
    pub pd: PdHandle,
    pub cq: CqHandle,
    pub lkey: Lkey,
    pub rkey: Rkey,
}

/// A device bound to `addr` whose port runs at `mtu`.
pub fn end(addr: IpAddr, mtu: Mtu) -> End {
    end_with(Config::new(addr), Some(mtu))
}

/// A device set up as `config` says, its port at `mtu` (`None`: the
/// interface's).
pub fn end_with(config: Config, mtu: Option<Mtu>) -> End {
    let mem = GuestMem::anonymous(BASE, MEM).expect("memory");
    let mut dev = udp_device(config, DeviceAttr::default(), mtu, mem).expect("bind");
    let e = dev.engine_mut();
    let pd = e.alloc_pd().unwrap();
    let (cq, _) = e.create_cq(1024, 0).unwrap();
    let (lkey, rkey) = e
        .reg_mr(MrRequest {
            pd,
            iova: BASE,
            length: MEM as u64,
            access: Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC,
            translation: Translation::Identity,
        })
        .unwrap();
    End {
        dev,
        pd,
        cq,
        lkey,
        rkey,
    }
}

/// A signaled send WR of `len` bytes at `at`.
pub fn send(e: &mut End, qpn: Qpn, wr_id: u64, op: SendOp, at: u64, len: u32) {
    send_to(e, qpn, wr_id, op, (at, len), None);
}

/// A signaled send WR of the `len` bytes at `at`, to `ud` on a UD QP.
pub fn send_to(
    e: &mut End,
    qpn: Qpn,
    wr_id: u64,
    op: SendOp,
    (at, len): (u64, u32),
    ud: Option<UdDest>,
) {
    let sge = [Sge {
        addr: at,
        length: len,
        lkey: e.lkey,
    }];
    e.dev
        .engine_mut()
        .post_send(
            qpn,
            &SendWr {
                wr_id,
                op,
                payload: Payload::Sges(&sge),
                flags: SendFlags::SIGNALED,
                ud,
            },
        )
        .unwrap();
}

/// A receive of `len` bytes at `at`.
pub fn recv(e: &mut End, qpn: Qpn, wr_id: u64, at: u64, len: u32) {
    let sge = [Sge {
        addr: at,
        length: len,
        lkey: e.lkey,
    }];
    e.dev
        .engine_mut()
        .post_recv(
            qpn,
            &RecvWr {
                wr_id,
                sg_list: &sge,
            },
        )
        .unwrap();
}

/// Fills `len` bytes at `at` with a pattern that depends on `seed`.
pub fn fill(e: &mut End, at: u64, len: usize, seed: u8) {
    let data: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    e.dev
        .mem_mut()
        .write(at, &data)
        .expect("in the device's memory");
}

/// A copy of the `len` bytes at `at`.
pub fn bytes(e: &End, at: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    e.dev
        .mem()
        .read(at, &mut v)
        .expect("in the device's memory");
    v
}

/// Byte-exact, reporting the first difference instead of the buffers.
pub fn same(got: impl AsRef<[u8]>, want: impl AsRef<[u8]>, what: &str) {
    let (got, want) = (got.as_ref(), want.as_ref());
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: byte {i} is {:#04x}, expected {:#04x}",
            got[i], want[i]
        );
    }
}
