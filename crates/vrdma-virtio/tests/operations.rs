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
