//! Both faces on one engine, interoperating on the wire: a virtio-rdma
//! device (this crate, driven by the `virtio` kit's front-end and driver)
//! and a PVRDMA device (`vrdma-pvrdma`, driven by the `pvrdma` kit's
//! vfio-user client and Linux driver model), each served on a UDP port of
//! the loopback, their RC QPs connected to each other: SENDs, WRITEs and
//! READs both ways, every byte checked.

use std::net::IpAddr;

use vrdma_pvrdma::abi::{send_flags, wc_opcode, wr_opcode};
use vrdma_testkit::{pvrdma, virtio::*};
use vrdma_virtio::abi::qp_type;
use vrdma_wire::Gid;

/// This binary's block of addresses (both faces' devices take theirs
/// from it).
static NET: Net = Net::new(28);

/// The PSN both sides start at (the `pvrdma` kit's `rc_up` uses 0x100).
const PVRDMA_PSN: u32 = 0x100;

/// A PVRDMA device on a UDP port at an address of this binary's block.
fn pvrdma_device(name: &str) -> (pvrdma::Served, IpAddr, [u8; 6]) {
    let addr = NET.addr();
    let mac = pvrdma::mac_of(addr);
    let served = pvrdma::Served::start(name, move || pvrdma::udp_function(addr, mac));
    (served, addr, mac)
}

/// The virtio side's QP to RTS towards `dest` at `dgid`, with the PSNs
/// the PVRDMA kit's QPs use.
fn rc_to_rts(v: &mut Endpoint, q: &Qp, dest: u32, dgid: Gid, dmac: [u8; 6]) {
    v.fe.qp_init(&v.ctx, q, ALL_ACCESS);
    let path = Path {
        psn: PVRDMA_PSN,
        dmac: Some(dmac),
        ..Path::new(dest, dgid)
    };
    v.fe.try_qp_rtr_to(&v.ctx, q, &path).expect("to RTR");
    v.fe.try_qp_rts_at(&v.ctx, q, PVRDMA_PSN).expect("to RTS");
}

/// One completion of the PVRDMA side, which must succeed with `opcode`.
fn pvrdma_ok(p: &mut pvrdma::Endpoint, wr_id: u64, opcode: u32) -> vrdma_pvrdma::abi::Cqe {
    let c = p.g.poll_n(&mut p.cq, 1);
    assert_eq!(c.len(), 1, "the PVRDMA side's completion {wr_id}");
    assert_eq!(
        (c[0].wr_id.get(), c[0].status.get(), c[0].opcode.get()),
        (wr_id, 0, opcode),
        "{:?}",
        c[0]
    );
    c[0]
}

#[test]
fn a_virtio_rdma_device_and_a_pvrdma_device_exchange_rc_byte_exact() {
    let dv = NET.device("interop-virtio");
    let (served, paddr, pmac) = pvrdma_device("interop-pvrdma");
    let mut v = Endpoint::new(&dv);
    let mut p = pvrdma::Endpoint::on(&served.socket, Gid::from(paddr), pmac, pvrdma::side::RAM);
    let mut qv = v.qp(qp_type::RC);
    rc_to_rts(&mut v, &qv, p.qp.qpn, p.gid, pmac);
    pvrdma::rc_up(&mut p.g, &p.qp, v.gid, qv.qpn, mac_of(dv.addr));
    let (va, pva) = (pvrdma::side::MR_VA, p.mr);

    for round in 0..3u8 {
        // SEND, virtio → PVRDMA (3 packets of 1024).
        let d = pattern(round, 3000);
        v.put(0, &d);
        p.g.put(p.buf, &[0; 4096]);
        p.g.post_recv(&mut p.qp, 1, &[pvrdma::sge(p.buf, 4096, p.lkey)]);
        qv.post_send(&Wqe::send(2, &[v.mr.sge(0, 3000)]));
        v.cq.expect_ok(wc::SEND, 2);
        let c = pvrdma_ok(&mut p, 1, wc_opcode::RECV);
        assert_eq!(c.byte_len.get(), 3000);
        assert_eq!(c.qp.get(), u64::from(p.qp.handle));
        assert_eq!(p.g.get(p.buf, 3000), d, "virtio → PVRDMA SEND bytes");

        // SEND, PVRDMA → virtio.
        let d = pattern(round ^ 0x40, 2500);
        p.g.put(p.buf + 8192, &d);
        v.fe.ram.fill(v.mr.gpa + 4096, 4096, 0);
        qv.post_recv(3, &[v.mr.sge(4096, 4096)]);
        p.g.post_send(
            &mut p.qp,
            &pvrdma::wqe(4, wr_opcode::SEND, send_flags::SIGNALED, 1),
            &[pvrdma::sge(p.buf + 8192, 2500, p.lkey)],
        );
        pvrdma_ok(&mut p, 4, wc_opcode::SEND);
        let c = v.cq.expect_ok(wc::RECV, 3);
        assert_eq!((c.byte_len.get(), c.qpn.get()), (2500, qv.qpn));
        assert_eq!(v.get(4096, 2500), d, "PVRDMA → virtio SEND bytes");

        // WRITE, virtio → the PVRDMA side's MR, across its page boundary.
        let d = pattern(round ^ 0x20, 6000);
        v.put(16384, &d);
        qv.post_send(&Wqe::write(5, &[v.mr.sge(16384, 6000)], va + 100, p.rkey));
        v.cq.expect_ok(wc::RDMA_WRITE, 5);
        assert_eq!(p.g.get(pva + 100, 6000), d, "virtio → PVRDMA WRITE bytes");

        // READ by virtio from the PVRDMA side's MR.
        let d = pattern(round ^ 0x10, 7000);
        p.g.put(pva + 50, &d);
        v.fe.ram.fill(v.mr.gpa + 65536, 8192, 0);
        qv.post_send(&Wqe::read(6, &[v.mr.sge(65536, 7000)], va + 50, p.rkey));
        assert_eq!(v.cq.expect_ok(wc::RDMA_READ, 6).byte_len.get(), 7000);
        assert_eq!(v.get(65536, 7000), d, "virtio ← PVRDMA READ bytes");

        // WRITE, PVRDMA → the virtio side's MR.
        let d = pattern(round ^ 0x08, 4000);
        p.g.put(p.buf, &d);
        let mut w = pvrdma::wqe(7, wr_opcode::RDMA_WRITE, send_flags::SIGNALED, 1);
        w.wr[0] = v.mr.addr(200_000).into();
        w.wr[1] = u64::from(v.mr.rkey).into();
        p.g.post_send(&mut p.qp, &w, &[pvrdma::sge(p.buf, 4000, p.lkey)]);
        pvrdma_ok(&mut p, 7, wc_opcode::RDMA_WRITE);
        assert_eq!(v.get(200_000, 4000), d, "PVRDMA → virtio WRITE bytes");

        // READ by PVRDMA from the virtio side's MR.
        let d = pattern(round ^ 0x04, 5000);
        v.put(300_000, &d);
        p.g.put(p.buf + 4096, &[0; 8192]);
        let mut r = pvrdma::wqe(8, wr_opcode::RDMA_READ, send_flags::SIGNALED, 1);
        r.wr[0] = v.mr.addr(300_000).into();
        r.wr[1] = u64::from(v.mr.rkey).into();
        p.g.post_send(&mut p.qp, &r, &[pvrdma::sge(p.buf + 4096, 5000, p.lkey)]);
        let c = pvrdma_ok(&mut p, 8, wc_opcode::RDMA_READ);
        assert_eq!(c.byte_len.get(), 5000);
        assert_eq!(p.g.get(p.buf + 4096, 5000), d, "PVRDMA ← virtio READ bytes");
    }
    p.g.check_canaries();
}
