//! The virtio-rdma device end to end, through the real vhost-user
//! protocol: two devices served on UDP ports, a front-end playing QEMU and
//! the guest driver on each (`vrdma_testkit::virtio`), every operation of
//! every QP type, data checked byte for byte.

use vrdma_testkit::virtio::*;
use vrdma_virtio::abi::{self, qp_type};

static NET: Net = Net::new(25);

#[test]
fn the_device_negotiates_and_answers_queries() {
    let dev = NET.device("negotiate");
    let mut fe = dev.connect(16 << 20);
    assert_eq!(
        fe.features & abi::feature::VERSION_1,
        abi::feature::VERSION_1
    );
    assert_eq!(
        fe.offered
            & (abi::feature::INDIRECT_PAGES
                | abi::feature::MIGRATION
                | abi::feature::ACCESS_PLATFORM),
        0,
        "DEV-2"
    );
    assert_eq!(fe.config.max_request.get(), (4 << 20) + 4096);
    assert!(
        fe.config.max_qp.get() >= 16384 && fe.config.max_cq.get() >= 16384,
        "DEV-4"
    );
    let d = fe.query_device();
    assert_eq!(
        d.max_qp.get(),
        fe.config.max_qp.get(),
        "config and QUERY_DEVICE agree (DEV-4)"
    );
    assert_eq!(
        d.max_cq.get(),
        fe.config.max_cq.get(),
        "config and QUERY_DEVICE agree (DEV-4)"
    );
    assert_eq!(d.phys_port_cnt, 1);
    let p = fe.query_port();
    assert_eq!(p.max_mtu.get(), 5);
    assert!(
        p.gid_tbl_len.get() >= 1,
        "a GID table the driver can fill (§6.30)"
    );
}

#[test]
fn rc_send_between_two_devices() {
    let da = NET.device("rc-send-a");
    let db = NET.device("rc-send-b");
    let mut a = Side::new(&da);
    let mut b = Side::new(&db);
    let mut qa = a.qp(qp_type::RC);
    let mut qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 1, 3000);
}

/// Two devices, a side on each, a QP of `ty` on each, connected.
fn pair(name: &str, ty: u8) -> (Device, Device, Side, Side, Qp, Qp) {
    let da = NET.device(&format!("{name}-a"));
    let db = NET.device(&format!("{name}-b"));
    let mut a = Side::new(&da);
    let mut b = Side::new(&db);
    let qa = a.qp(ty);
    let qb = b.qp(ty);
    connect(&mut a, &qa, &mut b, &qb);
    (da, db, a, b, qa, qb)
}

const SRC: u64 = 0;
const DST: u64 = 64 << 10;

#[test]
fn rc_every_operation_byte_for_byte() {
    let (_da, _db, mut a, mut b, mut qa, mut qb) = pair("rc-all", qp_type::RC);
    // SEND over two SGEs, with immediate, solicited.
    let d1 = pattern(1, 1500);
    let d2 = pattern(2, 2700);
    a.put(SRC, &d1);
    a.put(SRC + 8192, &d2);
    qb.post_recv(10, &[b.mr.sge(DST, 8192)]);
    let w = Wqe::send(11, &[a.mr.sge(SRC, 1500), a.mr.sge(SRC + 8192, 2700)]).imm(0x1234_5678);
    qa.post_send(&w);
    a.cq.expect_ok(wc::SEND, 11);
    let c = b.cq.expect_ok(wc::RECV, 10);
    assert_eq!(c.byte_len.get(), 4200);
    assert_eq!(
        c.wc_flags.get() & abi::wc_flags::WITH_IMM,
        abi::wc_flags::WITH_IMM
    );
    assert_eq!(c.ex.get(), 0x1234_5678, "the immediate as sent");
    assert_eq!(b.get(DST, 4200), [d1, d2].concat());

    // An inline SEND (the data copied from the WQE).
    let d = pattern(3, 100);
    qb.post_recv(12, &[b.mr.sge(DST, 4096)]);
    qa.post_send(&Wqe::send(13, &[]).inline(&d));
    a.cq.expect_ok(wc::SEND, 13);
    assert_eq!(b.cq.expect_ok(wc::RECV, 12).byte_len.get(), 100);
    assert_eq!(b.get(DST, 100), d);

    // RDMA WRITE, several packets.
    let d = pattern(4, 10_000);
    a.put(SRC, &d);
    qa.post_send(&Wqe::write(
        14,
        &[a.mr.sge(SRC, 10_000)],
        b.mr.addr(DST + 100),
        b.mr.rkey,
    ));
    a.cq.expect_ok(wc::RDMA_WRITE, 14);
    assert_eq!(b.get(DST + 100, 10_000), d);

    // RDMA WRITE with immediate: consumes a receive, not its buffer.
    let d = pattern(5, 333);
    a.put(SRC, &d);
    qb.post_recv(15, &[b.mr.sge(DST + 32768, 16)]);
    qa.post_send(&Wqe::write_imm(
        16,
        &[a.mr.sge(SRC, 333)],
        b.mr.addr(DST),
        b.mr.rkey,
        0xcafe_f00d,
    ));
    a.cq.expect_ok(wc::RDMA_WRITE, 16);
    let c = b.cq.expect_ok(wc::RECV_RDMA_WITH_IMM, 15);
    assert_eq!((c.byte_len.get(), c.ex.get()), (333, 0xcafe_f00d));
    assert_eq!(b.get(DST, 333), d);

    // RDMA READ.
    let d = pattern(6, 9000);
    b.put(DST, &d);
    qa.post_send(&Wqe::read(
        17,
        &[a.mr.sge(SRC, 9000)],
        b.mr.addr(DST),
        b.mr.rkey,
    ));
    assert_eq!(a.cq.expect_ok(wc::RDMA_READ, 17).byte_len.get(), 9000);
    assert_eq!(a.get(SRC, 9000), d);

    // Atomics on an aligned word of b's MR.
    b.put(DST + 512, &41u64.to_le_bytes());
    qa.post_send(&Wqe::fetch_add(
        18,
        a.mr.sge(SRC, 8),
        b.mr.addr(DST + 512),
        b.mr.rkey,
        1,
    ));
    a.cq.expect_ok(wc::FETCH_ADD, 18);
    assert_eq!(
        a.get(SRC, 8),
        41u64.to_le_bytes(),
        "FETCH_ADD returns the old value"
    );
    qa.post_send(&Wqe::cmp_swap(
        19,
        a.mr.sge(SRC + 8, 8),
        b.mr.addr(DST + 512),
        b.mr.rkey,
        42,
        0xdead,
    ));
    a.cq.expect_ok(wc::COMP_SWAP, 19);
    assert_eq!(a.get(SRC + 8, 8), 42u64.to_le_bytes());
    assert_eq!(
        b.get(DST + 512, 8),
        0xdeadu64.to_le_bytes(),
        "the swap happened"
    );
    qa.post_send(&Wqe::cmp_swap(
        20,
        a.mr.sge(SRC, 8),
        b.mr.addr(DST + 512),
        b.mr.rkey,
        1,
        2,
    ));
    a.cq.expect_ok(wc::COMP_SWAP, 20);
    assert_eq!(
        b.get(DST + 512, 8),
        0xdeadu64.to_le_bytes(),
        "a failed compare swaps nothing"
    );

    // Unsignaled WQEs complete silently; a signaled one after them
    // retires them.
    let d = pattern(7, 64);
    a.put(SRC, &d);
    qa.post_sends(&[
        Wqe::write(21, &[a.mr.sge(SRC, 64)], b.mr.addr(DST), b.mr.rkey).unsignaled(),
        Wqe::write(22, &[a.mr.sge(SRC, 64)], b.mr.addr(DST + 64), b.mr.rkey),
    ]);
    a.cq.expect_ok(wc::RDMA_WRITE, 22);
    assert_eq!(b.get(DST, 128), [d.clone(), d].concat());
    a.cq.expect_none(std::time::Duration::from_millis(20));
}

#[test]
fn uc_sends_and_writes() {
    let (_da, _db, mut a, mut b, mut qa, mut qb) = pair("uc", qp_type::UC);
    let d = pattern(8, 5000);
    a.put(SRC, &d);
    qb.post_recv(1, &[b.mr.sge(DST, 8192)]);
    qa.post_send(&Wqe::send(2, &[a.mr.sge(SRC, 5000)]).imm(7));
    a.cq.expect_ok(wc::SEND, 2);
    let c = b.cq.expect_ok(wc::RECV, 1);
    assert_eq!((c.byte_len.get(), c.ex.get()), (5000, 7));
    assert_eq!(b.get(DST, 5000), d);
    qa.post_send(&Wqe::write(
        3,
        &[a.mr.sge(SRC, 5000)],
        b.mr.addr(DST + 8192),
        b.mr.rkey,
    ));
    a.cq.expect_ok(wc::RDMA_WRITE, 3);
    // UC completes at send: the bytes land shortly after.
    let deadline = std::time::Instant::now() + WAIT;
    while b.get(DST + 8192, 5000) != d {
        assert!(std::time::Instant::now() < deadline, "the UC WRITE's bytes");
        std::thread::yield_now();
    }
    qb.post_recv(4, &[b.mr.sge(DST, 16)]);
    qa.post_send(&Wqe::write_imm(5, &[], b.mr.addr(DST), b.mr.rkey, 9));
    a.cq.expect_ok(wc::RDMA_WRITE, 5);
    let c = b.cq.expect_ok(wc::RECV_RDMA_WITH_IMM, 4);
    assert_eq!(
        (c.byte_len.get(), c.ex.get()),
        (0, 9),
        "a zero-length WRITE with immediate"
    );
}

#[test]
fn ud_datagrams_carry_the_grh() {
    let (_da, _db, mut a, mut b, mut qa, mut qb) = pair("ud", qp_type::UD);
    let d = pattern(9, 1000);
    a.put(SRC, &d);
    qb.post_recv(1, &[b.mr.sge(DST, 2048)]);
    qa.post_send(
        &Wqe::send(2, &[a.mr.sge(SRC, 1000)])
            .imm(0x55)
            .ud(av(b.gid), qb.qpn, QKEY),
    );
    a.cq.expect_ok(wc::SEND, 2);
    let c = b.cq.expect_ok(wc::RECV, 1);
    assert_eq!(c.byte_len.get(), 1040, "the 40-byte GRH and the data");
    assert_eq!(c.src_qp.get(), qa.qpn);
    assert_eq!(c.network_hdr_type, 2, "IPv4");
    let f = c.wc_flags.get();
    assert_eq!(
        f & (abi::wc_flags::GRH | abi::wc_flags::WITH_IMM),
        abi::wc_flags::GRH | abi::wc_flags::WITH_IMM
    );
    assert_eq!(b.get(DST + 40, 1000), d);
    // The IPv4 header in bytes 20..40: the source address is a's.
    let grh = b.get(DST, 40);
    assert_eq!(&grh[20 + 12..20 + 16], &a.gid.0[12..16]);
    // An inline datagram.
    qb.post_recv(3, &[b.mr.sge(DST, 2048)]);
    qa.post_send(
        &Wqe::send(4, &[])
            .inline(b"hello")
            .ud(av(b.gid), qb.qpn, QKEY),
    );
    a.cq.expect_ok(wc::SEND, 4);
    assert_eq!(b.cq.expect_ok(wc::RECV, 3).byte_len.get(), 45);
    assert_eq!(b.get(DST + 40, 5), b"hello");
}

#[test]
fn fast_registration_invalidation_and_send_with_invalidate() {
    let (_da, _db, mut a, mut b, mut qa, mut qb) = pair("frmr", qp_type::RC);
    // a makes an MR for fast registration and registers two fresh pages.
    let k = a.fe.alloc_mr(&a.ctx, a.pd, 4);
    let lkey = k.lkey.get();
    let pages = a.fe.ram.page_list(2);
    let list = a.fe.ram.alloc(16, 8);
    a.fe.ram.write(list, &pages[..]);
    let key1 = (lkey & !0xff) | ((lkey + 1) & 0xff);
    let iova = 0x5000_0000;
    qa.post_send(&Wqe::reg_mr(1, key1, iova, 8192, list, 2, 12, ALL_ACCESS));
    a.cq.expect_ok(wc::REG_MR, 1);
    // b writes through the new key across both pages.
    let d = pattern(10, 6000);
    b.put(SRC, &d);
    qb.post_send(&Wqe::write(2, &[b.mr.sge(SRC, 6000)], iova + 1000, key1));
    b.cq.expect_ok(wc::RDMA_WRITE, 2);
    let got = [
        a.fe.ram.read_bytes(pages[0], 4096),
        a.fe.ram.read_bytes(pages[1], 4096),
    ]
    .concat();
    assert_eq!(&got[1000..7000], &d[..]);
    // LOCAL_INV, then register again under another key byte.
    qa.post_send(&Wqe::local_inv(3, key1));
    a.cq.expect_ok(wc::LOCAL_INV, 3);
    let key2 = (lkey & !0xff) | ((lkey + 2) & 0xff);
    qa.post_send(&Wqe::reg_mr(4, key2, iova, 8192, list, 2, 12, ALL_ACCESS));
    a.cq.expect_ok(wc::REG_MR, 4);
    // b's SEND_WITH_INV invalidates it at a.
    qa.post_recv(5, &[a.mr.sge(DST, 64)]);
    b.put(SRC, b"inv");
    qb.post_send(&Wqe::send_inv(6, &[b.mr.sge(SRC, 3)], key2));
    b.cq.expect_ok(wc::SEND, 6);
    let c = a.cq.expect_ok(wc::RECV, 5);
    assert_eq!(
        c.wc_flags.get() & abi::wc_flags::WITH_INV,
        abi::wc_flags::WITH_INV
    );
    assert_eq!(c.ex.get(), key2, "the invalidated rkey");
    // The invalidated key resolves nothing: b's WRITE through it fails.
    qb.post_send(&Wqe::write(7, &[b.mr.sge(SRC, 16)], iova, key2));
    let c = b.cq.wait(1, "a WRITE through an invalidated key")[0];
    assert_eq!((c.wr_id.get(), c.status), (7, wc::REM_ACCESS_ERR));
}

#[test]
fn memory_windows_of_both_types() {
    let (_da, _db, mut a, mut b, mut qa, mut qb) = pair("mw", qp_type::RC);
    let d = pattern(11, 4096);
    a.put(8192, &d);
    // Type 1: bound by a BIND_MW WQE, read by b through its key.
    let mw1 = a.fe.alloc_mw(&a.ctx, a.pd, 1);
    let k1 = (mw1 & !0xff) | ((mw1 + 1) & 0xff);
    qa.post_send(&Wqe::bind_mw(
        1,
        k1,
        a.mr.lkey,
        a.mr.addr(8192),
        4096,
        abi::access::REMOTE_READ | abi::access::REMOTE_WRITE,
    ));
    a.cq.expect_ok(wc::BIND_MW, 1);
    qb.post_send(&Wqe::read(2, &[b.mr.sge(DST, 4096)], a.mr.addr(8192), k1));
    b.cq.expect_ok(wc::RDMA_READ, 2);
    assert_eq!(b.get(DST, 4096), d);
    // Type 2: bound to qa, written by b, invalidated by a.
    let mw2 = a.fe.alloc_mw(&a.ctx, a.pd, 2);
    let k2 = (mw2 & !0xff) | ((mw2 + 1) & 0xff);
    qa.post_send(&Wqe::bind_mw(
        3,
        k2,
        a.mr.lkey,
        a.mr.addr(16384),
        4096,
        abi::access::REMOTE_WRITE,
    ));
    a.cq.expect_ok(wc::BIND_MW, 3);
    let w = pattern(12, 4096);
    b.put(SRC, &w);
    qb.post_send(&Wqe::write(4, &[b.mr.sge(SRC, 4096)], a.mr.addr(16384), k2));
    b.cq.expect_ok(wc::RDMA_WRITE, 4);
    assert_eq!(a.get(16384, 4096), w);
    qa.post_send(&Wqe::local_inv(5, k2));
    a.cq.expect_ok(wc::LOCAL_INV, 5);
    // The window refuses what it does not allow: a READ through k2 (a
    // write-only window, now invalid) fails.
    qb.post_send(&Wqe::read(6, &[b.mr.sge(DST, 16)], a.mr.addr(16384), k2));
    let c = b.cq.wait(1, "a READ through an invalidated window")[0];
    assert_eq!((c.wr_id.get(), c.status), (6, wc::REM_ACCESS_ERR));
    // DEALLOC_MW names a window by its index: the handle ALLOC_MW gave
    // still names it after binds changed its key byte (§6.21, §6.19).
    for mw in [mw1, mw2] {
        a.fe.destroy(abi::op::DEALLOC_MW, &a.ctx, mw)
            .unwrap_or_else(|s| panic!("DEALLOC_MW {mw:#x}: {s:?}"));
        assert_eq!(
            a.fe.destroy(abi::op::DEALLOC_MW, &a.ctx, mw)
                .map_err(|s| s.status),
            Err(abi::status::NOENT),
            "a window deallocated is no more"
        );
    }
}

#[test]
fn a_shared_receive_queue_feeds_two_qps() {
    let da = NET.device("srq-a");
    let db = NET.device("srq-b");
    let mut a = Side::new(&da);
    let mut b = Side::new(&db);
    let mut srq = b.fe.srq(&b.ctx, b.pd, 64, 2, 0);
    let mut spec = QpSpec::new(qp_type::RC, b.cq.handle);
    spec.srq = srq.handle;
    let mut qa1 = a.qp(qp_type::RC);
    let mut qa2 = a.qp(qp_type::RC);
    let qb1 = b.fe.qp(&b.ctx, b.pd, &spec);
    let qb2 = b.fe.qp(&b.ctx, b.pd, &spec);
    connect(&mut a, &qa1, &mut b, &qb1);
    connect(&mut a, &qa2, &mut b, &qb2);
    for i in 0..4u64 {
        srq.post_recv(100 + i, &[b.mr.sge(DST + i * 4096, 4096)]);
    }
    let d1 = pattern(13, 3000);
    let d2 = pattern(14, 2000);
    a.put(SRC, &d1);
    a.put(SRC + 4096, &d2);
    qa1.post_send(&Wqe::send(1, &[a.mr.sge(SRC, 3000)]));
    a.cq.expect_ok(wc::SEND, 1);
    qa2.post_send(&Wqe::send(2, &[a.mr.sge(SRC + 4096, 2000)]));
    a.cq.expect_ok(wc::SEND, 2);
    let cs = b.cq.wait(2, "two receives from the SRQ");
    assert_eq!(
        (cs[0].wr_id.get(), cs[0].qpn.get(), cs[0].byte_len.get()),
        (100, qb1.qpn, 3000)
    );
    assert_eq!(
        (cs[1].wr_id.get(), cs[1].qpn.get(), cs[1].byte_len.get()),
        (101, qb2.qpn, 2000)
    );
    assert_eq!(b.get(DST, 3000), d1);
    assert_eq!(b.get(DST + 4096, 2000), d2);
}

#[test]
fn a_dma_mr_addresses_guest_memory_by_gpa() {
    let (_da, _db, mut a, mut b, mut qa, mut qb) = pair("dma", qp_type::RC);
    let dma = a.fe.reg_dma_mr(&a.ctx, a.pd, ALL_ACCESS);
    let page = a.fe.ram.pages(1);
    let d = pattern(15, 2048);
    a.fe.ram.write(page, &d[..]);
    qb.post_recv(1, &[b.mr.sge(DST, 4096)]);
    qa.post_send(&Wqe::send(2, &[sge(page, 2048, dma.lkey.get())]));
    a.cq.expect_ok(wc::SEND, 2);
    b.cq.expect_ok(wc::RECV, 1);
    assert_eq!(b.get(DST, 2048), d);
}
