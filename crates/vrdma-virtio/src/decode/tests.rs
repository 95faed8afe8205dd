use proptest::prelude::*;
use zerocopy::{FromZeros, IntoBytes};

use vrdma_engine::{
    qp::QpType,
    wc::WcStatus,
    wr::{Av, SendFlags, SendOp, Sge},
};
use vrdma_wire::{Gid, Lkey, QKey, Rkey};

use super::*;
use crate::abi::{self, PAGE_SIZE, op, status};

fn request(opcode: u16, body: &[u8], trailing: &[u64]) -> Vec<u8> {
    let mut r = abi::CmdHdr {
        opcode: opcode.into(),
        flags: 0.into(),
        context: 7.into(),
    }
    .as_bytes()
    .to_vec();
    r.extend_from_slice(body);
    for p in trailing {
        r.extend_from_slice(&p.to_le_bytes());
    }
    r
}

fn ring_desc(entries: u32, stride: u32) -> abi::RingDesc {
    abi::RingDesc {
        header: 0x10_0040.into(),
        entries: entries.into(),
        stride: stride.into(),
        npages: ((u64::from(entries) * u64::from(stride)).div_ceil(PAGE_SIZE) as u32).into(),
        reserved: 0.into(),
    }
}

fn pages(n: u64) -> Vec<u64> {
    (0..n).map(|i| 0x20_0000 + i * PAGE_SIZE).collect()
}

#[test]
fn a_cq_ring_is_checked_for_shape() {
    let d = ring_desc(256, 32);
    let r = decode_request(&request(op::CREATE_CQ, d.as_bytes(), &pages(2))).unwrap();
    assert_eq!(r.context, 7);
    let Command::CreateCq { ring } = r.command else {
        panic!("{:?}", r.command)
    };
    assert_eq!((ring.entries, ring.stride, ring.pages.len()), (256, 32, 2));
    assert_eq!(ring.entry(128), 0x20_1000);
    assert_eq!(ring.entry(129), 0x20_1020);
    // One page too few, one too many: the trailing array is not what
    // the command names.
    let e = decode_request(&request(op::CREATE_CQ, d.as_bytes(), &pages(1))).unwrap_err();
    assert_eq!(status_of(&e), status::LENGTH);
    let e = decode_request(&request(op::CREATE_CQ, d.as_bytes(), &pages(3))).unwrap_err();
    assert_eq!(status_of(&e), status::LENGTH);
    // Entries not a power of two; a stride below a CQE; a header not
    // 64-byte aligned; a page not aligned; a count that does not hold
    // entries × stride.
    for (d, p, want) in [
        (ring_desc(255, 32), pages(2), status::INVALID),
        (ring_desc(512, 16), pages(2), status::INVALID),
        (
            abi::RingDesc {
                header: 0x10_0020.into(),
                ..ring_desc(256, 32)
            },
            pages(2),
            status::FAULT,
        ),
        (
            ring_desc(256, 32),
            vec![0x20_0000, 0x20_1800],
            status::FAULT,
        ),
        (
            abi::RingDesc {
                npages: 1.into(),
                ..ring_desc(256, 32)
            },
            pages(1),
            status::INVALID,
        ),
    ] {
        let e = decode_request(&request(op::CREATE_CQ, d.as_bytes(), &p)).unwrap_err();
        assert_eq!(status_of(&e), want, "{e}");
    }
}

#[test]
fn fixed_size_commands_must_end_where_they_do() {
    let body = abi::HandleReq {
        handle: 3.into(),
        reserved: 0.into(),
    };
    let ok = request(op::DESTROY_QP, body.as_bytes(), &[]);
    assert_eq!(
        decode_request(&ok).unwrap().command,
        Command::DestroyQp { qpn: 3 }
    );
    let e = decode_request(&ok[..ok.len() - 1]).unwrap_err();
    assert_eq!(status_of(&e), status::LENGTH);
    let mut long = ok.clone();
    long.push(0);
    assert_eq!(
        status_of(&decode_request(&long).unwrap_err()),
        status::LENGTH
    );
    let reserved = abi::HandleReq {
        handle: 3.into(),
        reserved: 1.into(),
    };
    let e = decode_request(&request(op::DESTROY_QP, reserved.as_bytes(), &[])).unwrap_err();
    assert_eq!(status_of(&e), status::INVALID);
    let e = decode_request(&request(999, &[], &[])).unwrap_err();
    assert_eq!(status_of(&e), status::UNSUPPORTED);
    let mut flags = request(op::ALLOC_PD, &[], &[]);
    flags[2] = 1;
    assert_eq!(
        status_of(&decode_request(&flags).unwrap_err()),
        status::INVALID
    );
    assert_eq!(
        status_of(&decode_request(&[1]).unwrap_err()),
        status::LENGTH
    );
}

#[test]
fn an_mr_names_exactly_the_pages_that_hold_it() {
    let mr = |offset: u32, length: u64, npages: u32, shift: u32| abi::RegMrReq {
        pd: 1.into(),
        access: (abi::access::LOCAL_WRITE | abi::access::REMOTE_READ).into(),
        iova: 0x7000_0100.into(),
        length: length.into(),
        page_shift: shift.into(),
        offset: offset.into(),
        npages: npages.into(),
        reserved: 0.into(),
    };
    // 0x100 + 0x2000 bytes from offset 0x100 span three 4 KiB pages.
    let r = decode_request(&request(
        op::REG_MR,
        mr(0x100, 0x2000, 3, 12).as_bytes(),
        &pages(3),
    ))
    .unwrap();
    let Command::RegMr(RegMr {
        pages: p, offset, ..
    }) = r.command
    else {
        panic!()
    };
    assert_eq!((p.len(), offset), (3, 0x100));
    for (m, n) in [
        (mr(0x100, 0x2000, 2, 12), 2),
        (mr(0x1000, 0x10, 1, 12), 1),
        (mr(0, 0x10, 1, 11), 1),
        (mr(0, 0x10, 1, 31), 1),
        (mr(0, 0, 0, 12), 0),
        (mr(0, u64::MAX, 1, 12), 1),
    ] {
        let e = decode_request(&request(op::REG_MR, m.as_bytes(), &pages(n))).unwrap_err();
        assert_eq!(status_of(&e), status::INVALID, "{m:?}: {e}");
    }
    // A 2 MiB page list must be 2 MiB aligned.
    let e = decode_request(&request(
        op::REG_MR,
        mr(0, 0x1000, 1, 21).as_bytes(),
        &[0x1000],
    ))
    .unwrap_err();
    assert_eq!(status_of(&e), status::FAULT);
    // Access bits the device does not implement are refused.
    let odd = abi::RegMrReq {
        access: (1u32 << 20).into(),
        ..mr(0, 0x10, 1, 12)
    };
    let e = decode_request(&request(op::REG_MR, odd.as_bytes(), &pages(1))).unwrap_err();
    assert_eq!(status_of(&e), status::UNSUPPORTED);
}

#[test]
fn a_qp_on_an_srq_has_no_receive_ring_and_strides_fit_the_sges() {
    let qp = |srq: u32, rq: abi::RingDesc, max_recv_sge: u32| abi::CreateQpReq {
        pd: 1.into(),
        qp_type: abi::qp_type::RC,
        send_cq: 1.into(),
        recv_cq: 1.into(),
        srq: srq.into(),
        max_send_sge: 4.into(),
        max_recv_sge: max_recv_sge.into(),
        max_inline_data: 64.into(),
        sq: ring_desc(64, 128),
        rq,
        ..abi::CreateQpReq::new_zeroed()
    };
    let r = decode_request(&request(
        op::CREATE_QP,
        qp(0, ring_desc(64, 64), 3).as_bytes(),
        &pages(3),
    ))
    .unwrap();
    let Command::CreateQp(c) = r.command else {
        panic!()
    };
    assert_eq!(c.sq.pages, pages(2));
    assert_eq!(c.rq.unwrap().pages, pages(3)[2..]);
    let r = decode_request(&request(
        op::CREATE_QP,
        qp(5, abi::RingDesc::default(), 0).as_bytes(),
        &pages(2),
    ))
    .unwrap();
    let Command::CreateQp(c) = r.command else {
        panic!()
    };
    assert_eq!((c.srq, c.rq), (Some(5), None));
    // A receive ring beside an SRQ; receive WQEs of 4 SGEs in 64 bytes;
    // send WQEs of 4 SGEs in 64 bytes.
    let e = decode_request(&request(
        op::CREATE_QP,
        qp(5, ring_desc(64, 64), 3).as_bytes(),
        &pages(3),
    ))
    .unwrap_err();
    assert_eq!(status_of(&e), status::INVALID);
    let e = decode_request(&request(
        op::CREATE_QP,
        qp(0, ring_desc(64, 64), 4).as_bytes(),
        &pages(3),
    ))
    .unwrap_err();
    assert_eq!(status_of(&e), status::INVALID);
    let small = abi::CreateQpReq {
        sq: ring_desc(64, 64),
        ..qp(0, ring_desc(64, 64), 3)
    };
    let e = decode_request(&request(op::CREATE_QP, small.as_bytes(), &pages(2))).unwrap_err();
    assert_eq!(status_of(&e), status::INVALID);
}

fn wqe(opcode: u8, flags: u8, count: u16, op: &[u8], tail: &[u8]) -> Vec<u8> {
    let mut h = abi::SendWqeHdr::new_zeroed();
    h.wr_id = 0xabcd.into();
    h.opcode = opcode;
    h.flags = flags;
    h.count = count.into();
    h.ex = U32::from_bytes([1, 2, 3, 4]);
    h.op[..op.len()].copy_from_slice(op);
    let mut w = h.as_bytes().to_vec();
    w.extend_from_slice(tail);
    w.resize(256, 0);
    w
}

use zerocopy::little_endian::U32;

const RC: SendShape = SendShape {
    qp_type: QpType::Rc,
    max_sge: 4,
    max_inline: 64,
};
const UD: SendShape = SendShape {
    qp_type: QpType::Ud,
    ..RC
};
const UC: SendShape = SendShape {
    qp_type: QpType::Uc,
    ..RC
};

fn sge(addr: u64, length: u32, lkey: u32) -> Vec<u8> {
    abi::Sge {
        addr: addr.into(),
        length: length.into(),
        lkey: lkey.into(),
    }
    .as_bytes()
    .to_vec()
}

#[test]
fn send_wqes_decode_per_qp_type() {
    let rdma = abi::WqeRdma {
        remote_addr: 0x1000.into(),
        rkey: 0x77.into(),
        reserved: [0; 36],
    };
    let w = wqe(
        abi::wr::RDMA_WRITE_WITH_IMM,
        abi::wr::SIGNALED,
        1,
        rdma.as_bytes(),
        &sge(0x2000, 8, 5),
    );
    let d = decode_send(&w, &RC).unwrap();
    assert_eq!(
        d.op,
        SendOp::RdmaWriteWithImm {
            remote_addr: 0x1000,
            rkey: Rkey(0x77),
            imm: 0x0102_0304
        }
    );
    assert!(d.flags.contains(SendFlags::SIGNALED));
    assert_eq!(
        d.payload,
        Payload::Sges(
            vec![Sge {
                addr: 0x2000,
                length: 8,
                lkey: Lkey(5)
            }]
            .into()
        )
    );
    // READ on UC, atomics on UC, WRITE on UD: not that QP's operation.
    let r = wqe(abi::wr::RDMA_READ, 0, 0, rdma.as_bytes(), &[]);
    assert_eq!(decode_send(&r, &UC), Err((0xabcd, WcStatus::LocQpOpErr)));
    assert!(decode_send(&r, &RC).is_ok());
    let a = wqe(abi::wr::ATOMIC_FETCH_AND_ADD, 0, 1, &[0; 48], &sge(0, 8, 1));
    assert_eq!(decode_send(&a, &UC), Err((0xabcd, WcStatus::LocQpOpErr)));
    let w = wqe(abi::wr::RDMA_WRITE, 0, 0, rdma.as_bytes(), &[]);
    assert_eq!(decode_send(&w, &UD), Err((0xabcd, WcStatus::LocQpOpErr)));
    // Five SGEs on a QP of four; inline past its limit; inline READ.
    let five = wqe(abi::wr::SEND, 0, 5, &[], &[]);
    assert_eq!(decode_send(&five, &RC), Err((0xabcd, WcStatus::LocLenErr)));
    let inl = wqe(abi::wr::SEND, abi::wr::INLINE, 65, &[], &[]);
    assert_eq!(decode_send(&inl, &RC), Err((0xabcd, WcStatus::LocLenErr)));
    let inl = wqe(abi::wr::SEND, abi::wr::INLINE, 5, &[], b"hello");
    assert_eq!(
        decode_send(&inl, &RC).unwrap().payload,
        Payload::Inline(b"hello".to_vec())
    );
    let inr = wqe(
        abi::wr::RDMA_READ,
        abi::wr::INLINE,
        5,
        rdma.as_bytes(),
        b"hello",
    );
    assert_eq!(decode_send(&inr, &RC), Err((0xabcd, WcStatus::LocQpOpErr)));
    // Unknown flags and opcodes.
    assert!(decode_send(&wqe(abi::wr::SEND, 0x80, 0, &[], &[]), &RC).is_err());
    assert!(decode_send(&wqe(42, 0, 0, &[], &[]), &RC).is_err());
    // A UD send carries its address vector.
    let ud = abi::WqeUd {
        av: abi::Av {
            dgid: [9; 16],
            hop_limit: 64,
            dmac: [2, 0, 0, 0, 0, 1],
            ..abi::Av::default()
        },
        remote_qpn: 0x12.into(),
        remote_qkey: 0x1111.into(),
        reserved: [0; 8],
    };
    let d = decode_send(&wqe(abi::wr::SEND, 0, 0, ud.as_bytes(), &[]), &UD).unwrap();
    let u = d.ud.unwrap();
    assert_eq!((u.remote_qpn.value(), u.remote_qkey), (0x12, QKey(0x1111)));
    let Av::Inline(attr) = u.av else { panic!() };
    assert_eq!(
        (attr.dgid, attr.dmac),
        (Gid([9; 16]), Some([2, 0, 0, 0, 0, 1]))
    );
    // A QPN past 24 bits is no QPN.
    let bad = abi::WqeUd {
        remote_qpn: 0x100_0000.into(),
        ..ud
    };
    assert!(decode_send(&wqe(abi::wr::SEND, 0, 0, bad.as_bytes(), &[]), &UD).is_err());
    // A zero dgid names no destination.
    let zero = abi::WqeUd {
        av: abi::Av {
            dgid: [0; 16],
            ..ud.av
        },
        ..ud
    };
    assert_eq!(
        decode_send(&wqe(abi::wr::SEND, 0, 0, zero.as_bytes(), &[]), &UD),
        Err((0xabcd, WcStatus::LocQpOpErr))
    );
}

#[test]
fn a_local_operation_carries_no_data() {
    let inv = wqe(abi::wr::LOCAL_INV, 0, 0, &[], &[]);
    assert!(decode_send(&inv, &RC).is_ok());
    for count in [1, 4] {
        let inv = wqe(abi::wr::LOCAL_INV, 0, count, &[], &sge(0, 8, 1));
        assert_eq!(
            decode_send(&inv, &RC),
            Err((0xabcd, WcStatus::LocQpOpErr)),
            "LOCAL_INV with {count} SGEs"
        );
    }
    let bind = abi::WqeBindMw {
        mw: 0x0000_0201.into(),
        mr: 0x0000_0301.into(),
        addr: 0x1000.into(),
        length: 0x1000.into(),
        access: abi::access::REMOTE_WRITE.into(),
        ..abi::WqeBindMw::new_zeroed()
    };
    assert!(decode_send(&wqe(abi::wr::BIND_MW, 0, 0, bind.as_bytes(), &[]), &RC).is_ok());
    let w = wqe(abi::wr::BIND_MW, 0, 1, bind.as_bytes(), &sge(0, 8, 1));
    assert_eq!(decode_send(&w, &RC), Err((0xabcd, WcStatus::LocQpOpErr)));
    let r = abi::WqeRegMr {
        iova: 0x1000.into(),
        length: 0x1000.into(),
        page_list: 0x9000.into(),
        key: 0x0000_0501.into(),
        access: 0.into(),
        npages: 1.into(),
        page_shift: 12,
        reserved: [0; 11],
    };
    assert!(decode_send(&wqe(abi::wr::REG_MR, 0, 0, r.as_bytes(), &[]), &RC).is_ok());
    for (flags, count) in [(0, 1), (abi::wr::INLINE, 0)] {
        let w = wqe(abi::wr::REG_MR, flags, count, r.as_bytes(), &sge(0, 8, 1));
        assert_eq!(
            decode_send(&w, &RC),
            Err((0xabcd, WcStatus::LocQpOpErr)),
            "REG_MR with flags {flags:#x}, count {count}"
        );
    }
}

#[test]
fn a_fast_registration_names_its_page_list() {
    let r = abi::WqeRegMr {
        iova: 0x1234_5100.into(),
        length: 0x3000.into(),
        page_list: 0x9000.into(),
        key: 0x0000_0501.into(),
        access: abi::access::REMOTE_WRITE.into(),
        npages: 4.into(),
        page_shift: 12,
        reserved: [0; 11],
    };
    let d = decode_send(&wqe(abi::wr::REG_MR, 0, 0, r.as_bytes(), &[]), &RC).unwrap();
    assert_eq!(
        d.fast_reg,
        Some(FastReg {
            list: ListAt::Flat(0x9000),
            npages: 4,
            page_shift: 12,
            offset: 0x100
        })
    );
    assert!(
        matches!(
            d.op,
            SendOp::RegMr {
                mr: Lkey(0x501),
                key: 1,
                ..
            }
        ),
        "the MR by the key it takes: {:?}",
        d.op
    );
    let odd = abi::WqeRegMr {
        page_list: 0x9004.into(),
        ..r
    };
    assert!(decode_send(&wqe(abi::wr::REG_MR, 0, 0, odd.as_bytes(), &[]), &RC).is_err());
    assert!(decode_send(&wqe(abi::wr::REG_MR, 0, 0, r.as_bytes(), &[]), &UD).is_err());
}

#[test]
fn receive_wqes_keep_to_their_queue() {
    let mut w = abi::RecvWqeHdr {
        wr_id: 9.into(),
        count: 2.into(),
        reserved: [0; 6],
    }
    .as_bytes()
    .to_vec();
    w.extend(sge(0x1000, 64, 3));
    w.extend(sge(0x2000, 64, 3));
    let (id, s) = decode_recv(&w, 2).unwrap();
    assert_eq!((id, s.len(), s[1].addr), (9, 2, 0x2000));
    let m = decode_recv(&w, 1).unwrap_err();
    assert_eq!(
        (m.wr_id, m.status, m.field, m.value),
        (9, WcStatus::LocLenErr, "count", 2)
    );
    assert_eq!(m.rule, "more SGEs than the queue takes");
    let m = decode_recv(&w[..40], 2).unwrap_err();
    assert_eq!((m.wr_id, m.rule), (9, "more SGEs than the slot holds"));
}

proptest! {
    #[test]
    fn any_request_decodes_or_is_refused(bytes in proptest::collection::vec(any::<u8>(), 0..512),
                                         opcode in 0u16..30) {
        let mut r = bytes;
        if r.len() >= 2 {
            r[..2].copy_from_slice(&opcode.to_le_bytes());
        }
        match decode_request(&r) {
            Ok(req) => prop_assert_eq!(req.opcode, opcode),
            Err(e) => prop_assert!(status_of(&e) != status::OK),
        }
    }

    #[test]
    fn any_wqe_decodes_or_completes_in_error(bytes in proptest::collection::vec(any::<u8>(), 0..600),
                                             ty in 0usize..4) {
        let shape = SendShape {
            qp_type: [QpType::Rc, QpType::Uc, QpType::Ud, QpType::Gsi][ty],
            max_sge: 8,
            max_inline: 128,
        };
        if let Ok(w) = decode_send(&bytes, &shape) {
            match w.payload {
                Payload::Sges(s) => prop_assert!(s.len() <= 8),
                Payload::Inline(d) => prop_assert!(d.len() <= 128),
            }
        }
        let _ = decode_recv(&bytes, 4);
    }
}
