//! The operations suite's cases, run over each transport by
//! `operations.rs` (vhost-user) and `operations_pci.rs` (virtio-pci over
//! vfio-user).
use super::{Dev, NET};
use vrdma_testkit::virtio::*;
use vrdma_virtio::abi::{self, qp_type};
use zerocopy::IntoBytes;

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

/// §6.5/§7.2: a CQ ring holds 2 ..= `max_cqe` + 1 entries — the largest
/// QUERY_DEVICE allows is made and takes completions, one twice as large
/// is refused.
#[test]
fn a_cq_as_large_as_max_cqe_allows() {
    let dev = NET.device("big-cq");
    // the largest ring (2^22 CQEs, 128 MiB) and the refused one twice its size
    let mut s = Endpoint::with_memory(&dev, 512 << 20);
    let max = s.fe.query_device().max_cqe.get();
    assert!(max >= (1 << 16) - 1, "max_cqe {max}");
    let entries = (max + 1).next_power_of_two();
    assert_eq!(entries, max + 1, "max_cqe + 1 is a power of two");
    let cq = s.fe.cq(&s.ctx, entries);
    assert_eq!(cq.entries, entries);
    assert_eq!(
        s.fe.try_cq(&s.ctx, entries * 2).err().map(|e| e.status),
        Some(abi::status::INVALID)
    );
    // A QP on it WRITEs to another device's QP: the completion lands.
    let db = NET.device("big-cq-b");
    let mut b = Endpoint::new(&db);
    let spec = QpSpec::new(qp_type::RC, cq.handle);
    let mut qa = s.fe.qp(&s.ctx, s.pd, &spec);
    let qb = b.qp(qp_type::RC);
    connect(&mut s, &qa, &mut b, &qb);
    let mut cq = cq;
    qa.post_send(&Wqe::write(7, &[s.mr.sge(0, 64)], b.mr.iova, b.mr.rkey));
    let c = cq.wait(1, "a WRITE's completion on the large CQ");
    assert_eq!((c[0].wr_id.get(), c[0].status), (7, wc::SUCCESS));
}

#[test]
fn rc_send_between_two_devices() {
    let da = NET.device("rc-send-a");
    let db = NET.device("rc-send-b");
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    let mut qa = a.qp(qp_type::RC);
    let mut qb = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb);
    send_checked(&mut a, &mut qa, &mut b, &mut qb, 1, 3000);
}

/// Two devices, a side on each, a QP of `ty` on each, connected.
fn pair(name: &str, ty: u8) -> (Dev, Dev, Endpoint, Endpoint, Qp, Qp) {
    let da = NET.device(&format!("{name}-a"));
    let db = NET.device(&format!("{name}-b"));
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
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
    let c = a.cq.expect_ok(wc::SEND, 11);
    assert_eq!(c.src_qp.get(), 1, "a send's CQE: the WQEs retired (§7.8)");
    let c = b.cq.expect_ok(wc::RECV, 10);
    assert_eq!(c.src_qp.get(), 0, "an RC receive names no source QP");
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
    let c = a.cq.expect_ok(wc::RDMA_WRITE, 22);
    assert_eq!(
        c.src_qp.get(),
        10,
        "ten send WQEs retired, the unsignaled one counted (§7.8)"
    );
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

/// §6.27: a flow label's bits 20–31 are ignored, not refused. UCX 1.13
/// builds its AVs with `0xffffffff` and the complement of a path index
/// (`!1`, `!2`) and leaves the cut to the driver and device, as rxe and
/// hardware make it: a UD send through such an AV completes, an RC QP's
/// move to RTR with one is accepted and QUERY_QP reports the 20 bits.
#[test]
fn flow_labels_wider_than_20_bits_are_cut_not_refused() {
    for label in [u32::MAX, !1, !2] {
        let (_da, _db, mut a, mut b, mut qa, mut qb) =
            pair(&format!("ud-flow-{label:x}"), qp_type::UD);
        let mut to_b = av(b.gid);
        to_b.flow_label = label.into();
        a.put(SRC, b"datagram");
        qb.post_recv(1, &[b.mr.sge(DST, 2048)]);
        qa.post_send(&Wqe::send(2, &[a.mr.sge(SRC, 8)]).ud(to_b, qb.qpn, QKEY));
        a.cq.expect_ok(wc::SEND, 2);
        assert_eq!(b.cq.expect_ok(wc::RECV, 1).byte_len.get(), 48);
        assert_eq!(b.get(DST + 40, 8), b"datagram");

        let da = NET.device(&format!("rc-flow-{label:x}-a"));
        let db = NET.device(&format!("rc-flow-{label:x}-b"));
        let mut a = Endpoint::new(&da);
        let mut b = Endpoint::new(&db);
        let mut qa = a.qp(qp_type::RC);
        let mut qb = b.qp(qp_type::RC);
        let (ga, gb) = (a.gid, b.gid);
        for (s, q, peer, gid) in [(&mut a, &qa, qb.qpn, gb), (&mut b, &qb, qa.qpn, ga)] {
            s.fe.qp_init(&s.ctx, q, ALL_ACCESS);
            let path = Path {
                flow_label: label,
                ..Path::new(peer, gid)
            };
            s.fe.try_qp_rtr_to(&s.ctx, q, &path)
                .unwrap_or_else(|st| panic!("RTR with flow label {label:#x}: {st:?}"));
            s.fe.qp_rts(&s.ctx, q);
            let kept = s.fe.query_qp(&s.ctx, q.qpn).attrs.ah.flow_label.get();
            assert_eq!(kept, label & 0xf_ffff, "QUERY_QP reports the 20 bits");
        }
        send_checked(&mut a, &mut qa, &mut b, &mut qb, 3, 3000);
    }
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
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
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

/// The engine's live objects of `dev`.
fn counts(dev: &Dev) -> vrdma_engine::Counts {
    dev.with_face(|f| f.device().engine().counts())
}

/// DESTROY_CONTEXT (§6.10): every object of the context goes — QPs (one
/// connected with windows bound through it, one on an SRQ, one UD), the
/// SRQ, CQs (one armed, its notification pending), windows of both types,
/// MRs (paged, DMA, fast registration), PDs — and its pending events and
/// notifications with them (§10.3); its doorbell area is no longer scanned
/// (§8.4: the bits stay set), its ring pages are free for a new object
/// (§6.5 step 7), and a new context works.
#[test]
fn destroy_context_takes_every_object_of_the_context() {
    let da = NET.device("destroy-ctx-a");
    let db = NET.device("destroy-ctx-b");
    // No eventq or notifyq buffers yet: what the device raises waits.
    let opts = vrdma_testkit::virtio::Options {
        buffers: 0,
        ..Default::default()
    };
    let fe = da.connect_with(std::sync::Arc::new(Ram::new(0, 64 << 20)), opts);
    let mut a = Endpoint::on(fe, da.gid());
    let mut b = Endpoint::new(&db);
    let before = counts(&da);

    let fe = &mut a.fe;
    let c = fe.context(64);
    let pd = fe.pd(&c);
    let pd2 = fe.pd(&c);
    let mut cq = fe.cq(&c, 128);
    let cq2 = fe.cq(&c, 128);
    let srq = fe.srq(&c, pd, 64, 1, 0);
    let mr = fe.reg_mr(&c, pd, 8192, ALL_ACCESS | abi::access::MW_BIND);
    let _dma = fe.reg_dma_mr(&c, pd2, abi::access::LOCAL_WRITE);
    let _fr = fe.alloc_mr(&c, pd, 4);
    let mw1 = fe.alloc_mw(&c, pd, 1);
    let mw2 = fe.alloc_mw(&c, pd, 2);
    let mut q1 = fe.qp(&c, pd, &QpSpec::new(qp_type::RC, cq.handle));
    let mut spec = QpSpec::new(qp_type::RC, cq2.handle);
    spec.srq = srq.handle;
    let q2 = fe.qp(&c, pd, &spec);
    let q3 = fe.qp(&c, pd2, &QpSpec::new(qp_type::UD, cq.handle));
    fe.qp_init(&c, &q3, 0);
    // q1 connected to a QP of b's, both windows bound through it.
    let qb = b.qp(qp_type::RC);
    fe.qp_init(&c, &q1, ALL_ACCESS);
    fe.qp_rtr(&c, &q1, qb.qpn, b.gid);
    fe.qp_rts(&c, &q1);
    b.fe.qp_init(&b.ctx, &qb, ALL_ACCESS);
    b.fe.qp_rtr(&b.ctx, &qb, q1.qpn, a.gid);
    b.fe.qp_rts(&b.ctx, &qb);
    let k1 = (mw1 & !0xff) | ((mw1 + 1) & 0xff);
    let k2 = (mw2 & !0xff) | ((mw2 + 1) & 0xff);
    // cq armed: the first bind's completion leaves a notification pending.
    cq.arm(abi::cq_header::ARM_NEXT);
    let rr = abi::access::REMOTE_READ;
    q1.post_send(&Wqe::bind_mw(1, k1, mr.lkey, mr.addr(0), 4096, rr));
    q1.post_send(&Wqe::bind_mw(2, k2, mr.lkey, mr.addr(4096), 4096, rr));
    cq.expect_ok(wc::BIND_MW, 1);
    cq.expect_ok(wc::BIND_MW, 2);
    // An event of the context waiting: q2 (on the SRQ) to ERR raises
    // QP_LAST_WQE_REACHED.
    fe.qp_init(&c, &q2, ALL_ACCESS);
    fe.qp_state(&c, q2.qpn, state::ERR).expect("q2 to ERR");
    let made = counts(&da);
    assert_eq!(
        (made.pds, made.cqs, made.qps, made.srqs),
        (
            before.pds + 2,
            before.cqs + 2,
            before.qps + 3,
            before.srqs + 1
        )
    );
    assert!(made.mrs >= before.mrs + 5, "3 MRs and 2 windows: {made:?}");

    fe.command(abi::op::DESTROY_CONTEXT, c.handle, &[], &[])
        .expect("DESTROY_CONTEXT never fails on a live context");
    assert_eq!(counts(&da), before, "every object of the context gone");
    // Its handles name nothing: the context (§6.3), hence every object.
    fe.refused(abi::status::NOENT, abi::op::ALLOC_PD, c.handle, &[], &[]);
    fe.refused(
        abi::status::NOENT,
        abi::op::DESTROY_CONTEXT,
        c.handle,
        &[],
        &[],
    );
    assert_eq!(
        fe.destroy(abi::op::DESTROY_QP, &a.ctx, q1.qpn)
            .map_err(|s| s.status),
        Err(abi::status::NOENT)
    );

    // The keeper context raises an event of its own (after the dead
    // context's), and its CQ notifies; buffers come: only the keeper's
    // arrive (§6.10: the destroyed context's are dropped).
    let mut ks = a.fe.srq(&a.ctx, a.pd, 64, 1, 0);
    let mut kspec = QpSpec::new(qp_type::RC, a.cq.handle);
    kspec.srq = ks.handle;
    let kq = a.fe.qp(&a.ctx, a.pd, &kspec);
    a.fe.qp_init(&a.ctx, &kq, ALL_ACCESS);
    a.fe.qp_state(&a.ctx, kq.qpn, state::ERR).expect("to ERR");
    a.fe.stock(16, 16);
    let e = a.fe.wait_event_of(abi::event::QP_LAST_WQE_REACHED, kq.qpn);
    assert_eq!(e.context.get(), a.ctx.handle);
    a.fe.drain();
    assert!(
        a.fe.events.iter().all(|e| e.context.get() != c.handle),
        "an event of the destroyed context delivered: {:?}",
        a.fe.events
    );
    assert!(
        a.fe.notifications.iter().all(|n| n.cq.get() != cq.handle),
        "a notification of the destroyed context delivered: {:?}",
        a.fe.notifications
    );
    let _ = ks.post_recv(1, &[a.mr.sge(0, 64)]);

    // Its doorbell area is not scanned: bits set and kicked stay set,
    // while the keeper's doorbells are taken (an exchange needs them).
    c.door.set_bits(q1.doorbell);
    c.door.kick();
    let mut qa = a.qp(qp_type::RC);
    let mut qb2 = b.qp(qp_type::RC);
    connect(&mut a, &qa, &mut b, &qb2);
    send_checked(&mut a, &mut qa, &mut b, &mut qb2, 1, 2000);
    let summary = a.fe.ram.load_u64(c.door.area + abi::doorbell::SUMMARY);
    assert_ne!(summary, 0, "the destroyed context's area was scanned");

    // The dead CQ's ring pages and header are free: a CQ of a new
    // context takes them; the new context exchanges.
    let fe = &mut a.fe;
    let c2 = fe.context(64);
    fe.ram.fill(cq.header, 64, 0);
    let req = abi::CreateCqReq {
        ring: abi::RingDesc {
            header: cq.header.into(),
            entries: 128.into(),
            stride: 32.into(),
            npages: 1.into(),
            reserved: 0.into(),
        },
    };
    let _: abi::CreateCqResp = fe.ok(abi::op::CREATE_CQ, c2.handle, req.as_bytes(), &[cq.ring]);
    let pd = fe.pd(&c2);
    let mut cq3 = fe.cq(&c2, 128);
    let mr = fe.reg_mr(&c2, pd, 8192, ALL_ACCESS);
    let mut q = fe.qp(&c2, pd, &QpSpec::new(qp_type::RC, cq3.handle));
    let qb3 = b.qp(qp_type::RC);
    fe.qp_init(&c2, &q, ALL_ACCESS);
    fe.qp_rtr(&c2, &q, qb3.qpn, b.gid);
    fe.qp_rts(&c2, &q);
    b.fe.qp_init(&b.ctx, &qb3, ALL_ACCESS);
    b.fe.qp_rtr(&b.ctx, &qb3, q.qpn, a.gid);
    b.fe.qp_rts(&b.ctx, &qb3);
    let d = pattern(42, 3000);
    fe.ram.write(mr.gpa, &d[..]);
    q.post_send(&Wqe::write(
        7,
        &[mr.sge(0, 3000)],
        b.mr.addr(DST),
        b.mr.rkey,
    ));
    cq3.expect_ok(wc::RDMA_WRITE, 7);
    assert_eq!(b.get(DST, 3000), d);
}

/// A CQ ring of `entries` 32-byte slots in fresh guest memory, described
/// for RESIZE_CQ of `cq`: (the request, its header, its first page).
fn resize_req(ram: &Ram, cq: u32, entries: u32) -> (abi::ResizeCqReq, Vec<u64>, u64) {
    let ring = WqRing::new(ram, entries, 32);
    let req = abi::ResizeCqReq {
        cq: cq.into(),
        reserved: 0.into(),
        ring: ring.desc(),
    };
    (req, ring.pages(), ring.header)
}

/// RESIZE_CQ (§6.15): the completions the driver has not consumed move,
/// oldest first, to the new ring's entries 0, 1, … with their number as
/// its producer; later ones go to the new ring only; the old ring is not
/// touched again. A new ring smaller than the completions waiting, and a
/// CQ in error (§10.2), are refused with ERR_INVALID, changing nothing.
#[test]
fn resize_cq_moves_unconsumed_completions_in_order() {
    let (_da, _db, mut a, mut b, mut qa, _qb) = pair("resize-cq", qp_type::RC);
    // 130 signaled WRITEs into a's CQ of 256, none consumed.
    for i in 0..130u64 {
        qa.post_send(&Wqe::write(i, &[a.mr.sge(0, 8)], b.mr.addr(0), b.mr.rkey));
    }
    let deadline = std::time::Instant::now() + WAIT;
    while a.cq.producer() != 130 {
        assert!(std::time::Instant::now() < deadline, "130 completions");
        std::thread::yield_now();
    }
    let first = a.cq.poll().expect("a completion");
    assert_eq!(first.wr_id.get(), 0);
    // 129 wait: a ring of 128 is too small.
    let (req, pages, hdr) = resize_req(&a.fe.ram, a.cq.handle, 128);
    a.fe.refused(
        abi::status::INVALID,
        abi::op::RESIZE_CQ,
        a.ctx.handle,
        req.as_bytes(),
        &pages,
    );
    assert_eq!(
        a.fe.ram.read_bytes(hdr, 64),
        vec![0; 64],
        "a refused RESIZE_CQ writes nothing (DEV-16)"
    );
    // 128 wait: a ring of 128 holds them exactly.
    assert_eq!(a.cq.poll().expect("a completion").wr_id.get(), 1);
    let resp: abi::HandleResp =
        a.fe.ok(abi::op::RESIZE_CQ, a.ctx.handle, req.as_bytes(), &pages);
    assert_eq!(resp.handle.get(), 128, "the response's entries");
    let old_header = a.cq.header;
    a.cq.header = hdr;
    a.cq.ring = pages[0];
    a.cq.entries = 128;
    a.cq.cons = 0;
    assert_eq!(a.cq.producer(), 128, "the new ring's producer");
    let moved = a.cq.wait(128, "the moved completions");
    let ids: Vec<u64> = moved.iter().map(|c| c.wr_id.get()).collect();
    assert_eq!(ids, (2..130).collect::<Vec<_>>(), "oldest first, in order");
    assert!(
        moved.iter().all(|c| c.status == wc::SUCCESS
            && c.opcode == wc::RDMA_WRITE
            && c.qpn.get() == qa.qpn)
    );
    // The next completion goes to the new ring; the old is left alone.
    qa.post_send(&Wqe::write(500, &[a.mr.sge(0, 8)], b.mr.addr(0), b.mr.rkey));
    a.cq.expect_ok(wc::RDMA_WRITE, 500);
    assert_eq!(a.fe.ram.load_acquire(old_header), 130, "the old producer");

    // A CQ in error cannot be resized.
    let mut small = a.fe.cq(&a.ctx, 128);
    let mut q =
        a.fe.qp(&a.ctx, a.pd, &QpSpec::new(qp_type::RC, small.handle));
    let qb2 = b.qp(qp_type::RC);
    connect(&mut a, &q, &mut b, &qb2);
    for i in 0..140 {
        q.post_send(&Wqe::write(i, &[a.mr.sge(0, 8)], b.mr.addr(0), b.mr.rkey));
    }
    a.fe.wait_event_of(abi::event::CQ_ERR, small.handle);
    let _ = small.wait(128, "the completions that fitted");
    let (req, pages, _) = resize_req(&a.fe.ram, small.handle, 256);
    a.fe.refused(
        abi::status::INVALID,
        abi::op::RESIZE_CQ,
        a.ctx.handle,
        req.as_bytes(),
        &pages,
    );
}

/// MODIFY_SRQ (§6.23): LIMIT arms the SRQ limit; SRQ_LIMIT_REACHED
/// (§10.1) comes when a receive is consumed and fewer than the limit
/// remain, once, the limit then 0 (QUERY_SRQ, §6.24); MAX_WR is
/// ERR_UNSUPPORTED, any other mask and a limit ≥ the ring's entries
/// ERR_INVALID.
#[test]
fn modify_srq_limit_raises_srq_limit_reached_once() {
    let da = NET.device("srq-limit-a");
    let db = NET.device("srq-limit-b");
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    let mut srq = b.fe.srq(&b.ctx, b.pd, 64, 1, 0);
    let mut spec = QpSpec::new(qp_type::RC, b.cq.handle);
    spec.srq = srq.handle;
    let mut qa = a.qp(qp_type::RC);
    let qb = b.fe.qp(&b.ctx, b.pd, &spec);
    connect(&mut a, &qa, &mut b, &qb);
    let query = |s: &mut Endpoint, h: u32| -> abi::SrqAttrResp {
        let r = abi::HandleReq {
            handle: h.into(),
            reserved: 0.into(),
        };
        s.fe.ok(abi::op::QUERY_SRQ, s.ctx.handle, r.as_bytes(), &[])
    };
    let srq_handle = srq.handle;
    let modify = |s: &mut Endpoint, mask: u32, limit: u32| {
        let r = abi::ModifySrqReq {
            srq: srq_handle.into(),
            mask: mask.into(),
            max_wr: 128.into(),
            srq_limit: limit.into(),
        };
        s.fe.command(abi::op::MODIFY_SRQ, s.ctx.handle, r.as_bytes(), &[])
            .map(|_| ())
            .map_err(|e| e.status)
    };
    // An empty SRQ is armed as any (§6.23 refuses only a limit ≥ the
    // ring's entries, as rxe compares with the SRQ's size), and 0 disarms.
    assert_eq!(modify(&mut b, 2, 10), Ok(()));
    assert_eq!(query(&mut b, srq.handle).srq_limit.get(), 10);
    assert_eq!(modify(&mut b, 2, 0), Ok(()));
    assert_eq!(query(&mut b, srq.handle).srq_limit.get(), 0);
    for i in 0..8u64 {
        srq.post_recv(100 + i, &[b.mr.sge(DST + i * 4096, 4096)]);
    }
    let deadline = std::time::Instant::now() + WAIT;
    while srq.ring.consumer(&b.fe.ram) != 8 {
        assert!(std::time::Instant::now() < deadline, "the SRQ's WQEs taken");
        std::thread::yield_now();
    }
    let q = query(&mut b, srq.handle);
    assert_eq!(
        (q.max_wr.get(), q.max_sge.get(), q.srq_limit.get()),
        (64, 1, 0)
    );
    assert_eq!(
        modify(&mut b, 1, 4),
        Err(abi::status::UNSUPPORTED),
        "MAX_WR"
    );
    assert_eq!(
        modify(&mut b, 3, 4),
        Err(abi::status::UNSUPPORTED),
        "MAX_WR|LIMIT"
    );
    assert_eq!(
        modify(&mut b, 0, 4),
        Err(abi::status::INVALID),
        "no attribute"
    );
    assert_eq!(
        modify(&mut b, 2, 64),
        Err(abi::status::INVALID),
        "limit ≥ entries"
    );
    assert_eq!(
        query(&mut b, srq.handle).srq_limit.get(),
        0,
        "refusals change nothing"
    );
    assert_eq!(modify(&mut b, 2, 4), Ok(()));
    assert_eq!(query(&mut b, srq.handle).srq_limit.get(), 4);

    let mut send = |a: &mut Endpoint, b: &mut Endpoint, i: u64| {
        qa.post_send(&Wqe::send(i, &[a.mr.sge(SRC, 100)]));
        a.cq.expect_ok(wc::SEND, i);
        b.cq.expect_ok(wc::RECV, 100 + i);
    };
    // 4 consumed, 4 left: not fewer than the limit.
    for i in 0..4 {
        send(&mut a, &mut b, i);
    }
    // (A command's response comes after the turn that consumed them.)
    assert_eq!(query(&mut b, srq.handle).srq_limit.get(), 4, "still armed");
    b.fe.drain();
    assert!(
        b.fe.events
            .iter()
            .all(|e| e.event_type.get() != abi::event::SRQ_LIMIT_REACHED),
        "no limit event with 4 of 8 left: {:?}",
        b.fe.events
    );
    // The 5th leaves 3: the event, once, and the limit disarmed.
    send(&mut a, &mut b, 4);
    let e =
        b.fe.wait_event_of(abi::event::SRQ_LIMIT_REACHED, srq.handle);
    assert_eq!(e.context.get(), b.ctx.handle);
    assert_eq!(query(&mut b, srq.handle).srq_limit.get(), 0, "disarmed");
    for i in 5..8 {
        send(&mut a, &mut b, i);
    }
    let _ = query(&mut b, srq.handle);
    b.fe.drain();
    assert!(
        b.fe.events
            .iter()
            .all(|e| e.event_type.get() != abi::event::SRQ_LIMIT_REACHED),
        "a second limit event: {:?}",
        b.fe.events
    );
}

/// The GSI QP (§6.26): QPN 1, once per device (a second one, in any
/// context, or one on an SRQ, ERR_INVALID; QPN 1 again once destroyed);
/// its transitions are UD's without PORT (§6.27); two devices' GSI QPs
/// exchange datagrams (a UD receive: the GRH, then the data; the
/// sender's QPN 1).
#[test]
fn the_gsi_qp_is_qpn_1_once_and_exchanges_datagrams() {
    const GSI_QKEY: u32 = 0x8001_0000;
    let da = NET.device("gsi-a");
    let db = NET.device("gsi-b");
    let mut a = Endpoint::new(&da);
    let mut b = Endpoint::new(&db);
    let spec = QpSpec::new(qp_type::GSI, a.cq.handle);
    let g = a.fe.qp(&a.ctx, a.pd, &spec);
    assert_eq!(g.qpn, 1, "the GSI QP is QPN 1");
    let again = a.fe.try_qp(&a.ctx, a.pd, &spec).map(|q| q.qpn);
    assert_eq!(again.map_err(|s| s.status), Err(abi::status::INVALID));
    let other = a.fe.context(64);
    let opd = a.fe.pd(&other);
    let ocq = a.fe.cq(&other, 128);
    let again =
        a.fe.try_qp(&other, opd, &QpSpec::new(qp_type::GSI, ocq.handle))
            .map(|q| q.qpn);
    assert_eq!(
        again.map_err(|s| s.status),
        Err(abi::status::INVALID),
        "once per device, not per context"
    );
    a.fe.destroy(abi::op::DESTROY_QP, &a.ctx, 1)
        .expect("DESTROY_QP of the GSI QP");
    let srq = b.fe.srq(&b.ctx, b.pd, 64, 1, 0);
    let mut on_srq = QpSpec::new(qp_type::GSI, b.cq.handle);
    on_srq.srq = srq.handle;
    let r = b.fe.try_qp(&b.ctx, b.pd, &on_srq).map(|q| q.qpn);
    assert_eq!(
        r.map_err(|s| s.status),
        Err(abi::status::INVALID),
        "GSI on an SRQ"
    );

    let mut ga = a.fe.qp(&a.ctx, a.pd, &spec);
    assert_eq!(ga.qpn, 1, "QPN 1 again");
    let mut gb =
        b.fe.qp(&b.ctx, b.pd, &QpSpec::new(qp_type::GSI, b.cq.handle));
    assert_eq!(gb.qpn, 1);
    for s in [&mut a, &mut b] {
        let at = abi::QpAttrs {
            qp_state: state::INIT.into(),
            qkey: GSI_QKEY.into(),
            port_num: 1,
            ..Default::default()
        };
        let with_port = mask::STATE | mask::PKEY_INDEX | mask::QKEY | mask::PORT;
        assert_eq!(
            s.fe.modify_qp(&s.ctx, 1, with_port, &at)
                .map_err(|e| e.status),
            Err(abi::status::INVALID),
            "the GSI column has no PORT"
        );
        s.fe.modify_qp(&s.ctx, 1, mask::STATE | mask::PKEY_INDEX | mask::QKEY, &at)
            .expect("GSI to INIT");
        let mut at = abi::QpAttrs {
            qp_state: state::RTR.into(),
            ..Default::default()
        };
        s.fe.modify_qp(&s.ctx, 1, mask::STATE, &at)
            .expect("GSI to RTR");
        at.qp_state = state::RTS.into();
        at.sq_psn = PSN.into();
        s.fe.modify_qp(&s.ctx, 1, mask::STATE | mask::SQ_PSN, &at)
            .expect("GSI to RTS");
    }
    let d = pattern(21, 256);
    a.put(SRC, &d);
    gb.post_recv(1, &[b.mr.sge(DST, 2048)]);
    ga.post_send(&Wqe::send(2, &[a.mr.sge(SRC, 256)]).ud(av(b.gid), 1, GSI_QKEY));
    a.cq.expect_ok(wc::SEND, 2);
    let c = b.cq.expect_ok(wc::RECV, 1);
    assert_eq!((c.byte_len.get(), c.src_qp.get(), c.qpn.get()), (296, 1, 1));
    assert_eq!(c.wc_flags.get() & abi::wc_flags::GRH, abi::wc_flags::GRH);
    assert_eq!(b.get(DST + 40, 256), d);
    // And back.
    let d = pattern(22, 100);
    b.put(SRC, &d);
    ga.post_recv(3, &[a.mr.sge(DST, 2048)]);
    gb.post_send(&Wqe::send(4, &[b.mr.sge(SRC, 100)]).ud(av(a.gid), 1, GSI_QKEY));
    b.cq.expect_ok(wc::SEND, 4);
    let c = a.cq.expect_ok(wc::RECV, 3);
    assert_eq!((c.byte_len.get(), c.src_qp.get()), (140, 1));
    assert_eq!(a.get(DST + 40, 100), d);
}

/// The named counter of `dev`'s device (`vrdma stat`'s names).
fn counter<T: vrdma_device::Transport + Send + 'static>(dev: &Dev<T>, name: &str) -> u64 {
    dev.with_face(|f| {
        f.device()
            .counters()
            .into_iter()
            .find(|(k, _)| k == name)
            .map_or_else(|| panic!("no counter {name}"), |(_, n)| n)
    })
}

/// Two devices of one process on a same-host switch (as `vrdma serve`
/// puts its devices): an RC exchange — SEND, WRITE, READ, an atomic —
/// goes through shared memory, nothing on their UDP ports; with doorbells
/// polled, and in event mode, where each device's worker sleeps between
/// kicks and must be woken by a packet from shm (it arms before it
/// sleeps).
#[test]
fn two_devices_on_one_switch_exchange_over_shm() {
    use vrdma_device::transport::SameHost;
    use vrdma_fabric::shm::Switch;

    for (mode, poll) in [("poll", true), ("event", false)] {
        let sw = Switch::new();
        let opts = vrdma_virtio::face::Options {
            poll,
            ..Default::default()
        };
        let on_switch = |name: &str| {
            NET.device_on(
                &format!("shm-{mode}-{name}"),
                opts.clone(),
                std::time::Duration::ZERO,
                |p| SameHost::new(&sw, p).expect("joining the switch"),
            )
        };
        let (da, db) = (on_switch("a"), on_switch("b"));
        let mut a = Endpoint::new(&da);
        let mut b = Endpoint::new(&db);
        let mut qa = a.qp(qp_type::RC);
        let mut qb = b.qp(qp_type::RC);
        connect(&mut a, &qa, &mut b, &qb);
        for round in 0..20u8 {
            send_checked(&mut a, &mut qa, &mut b, &mut qb, round, 3000);
            let d = pattern(round, 10_000);
            a.put(SRC, &d);
            qa.post_send(&Wqe::write(
                1,
                &[a.mr.sge(SRC, 10_000)],
                b.mr.addr(DST),
                b.mr.rkey,
            ));
            a.cq.expect_ok(wc::RDMA_WRITE, 1);
            assert_eq!(b.get(DST, 10_000), d, "{mode}: the WRITE's bytes");
            qa.post_send(&Wqe::read(
                2,
                &[a.mr.sge(SRC + 16384, 10_000)],
                b.mr.addr(DST),
                b.mr.rkey,
            ));
            a.cq.expect_ok(wc::RDMA_READ, 2);
            assert_eq!(a.get(SRC + 16384, 10_000), d, "{mode}: the READ's bytes");
            qa.post_send(&Wqe::fetch_add(
                3,
                a.mr.sge(SRC, 8),
                b.mr.addr(DST + 32768),
                b.mr.rkey,
                1,
            ));
            a.cq.expect_ok(wc::FETCH_ADD, 3);
            assert_eq!(a.get(SRC, 8), u64::from(round).to_le_bytes(), "{mode}");
        }
        for d in [&da, &db] {
            assert_eq!(counter(d, "udp.tx_datagrams"), 0, "{mode}");
            assert!(counter(d, "shm.rx_packets") >= 60, "{mode}");
            assert_eq!(
                counter(d, "engine.tx_retransmitted"),
                0,
                "{mode}: a wake-up missed"
            );
        }
    }
}
