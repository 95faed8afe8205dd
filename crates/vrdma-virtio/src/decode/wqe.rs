//! Work requests: send and receive WQEs from their copies into the face
//! core's decoded types.

use vrdma_engine::{
    mr::Access,
    qp::QpType,
    wc::WcStatus,
    wr::{Av, SendFlags, SendOp, Sge, UdDest},
};
use vrdma_wire::{Lkey, QKey, Qpn, Rkey};
use zerocopy::FromBytes;

use super::{SGE, ah_attr};
use crate::abi;

// --- work requests --------------------------------------------------------

/// What a send WQE is decoded against: its QP's type and limits.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct SendShape {
    pub qp_type: QpType,
    pub max_sge: u32,
    pub max_inline: u32,
}

/// A send WQE, typed: the face core's one decoded-send type (keys and
/// the page list still as the WQE names them, resolved by the core).
pub use vrdma_face::wq::{FastReg, ListAt, Payload, SendWqe};

/// Decodes a send WQE from its copy (`wqe`: the whole stride). `Err`:
/// the WQE is malformed and completes with that status (the QP then goes
/// to ERR), carrying its wr_id.
pub fn decode_send(wqe: &[u8], qp: &SendShape) -> Result<SendWqe, (u64, WcStatus)> {
    decode_send_why(wqe, qp).map_err(|m| (m.wr_id, m.status))
}

/// A malformed WQE: its wr_id, the status it completes with, its opcode,
/// and why (the rule broken, the field and its value).
pub use vrdma_face::Malformed;

/// [`decode_send`], saying why a WQE is malformed.
pub fn decode_send_why(wqe: &[u8], qp: &SendShape) -> Result<SendWqe, Malformed> {
    let Ok((h, rest)) = abi::SendWqeHdr::read_from_prefix(wqe) else {
        return Err(Malformed {
            wr_id: 0,
            status: WcStatus::LocQpOpErr,
            opcode: 0,
            rule: "a WQE shorter than its header",
            field: "stride",
            value: wqe.len() as u64,
        });
    };
    let wr_id = h.wr_id.get();
    let opcode = h.opcode;
    let bad = |status, rule, field, value| {
        Err(Malformed {
            wr_id,
            status,
            opcode: opcode.into(),
            rule,
            field,
            value,
        })
    };
    if h.flags & !(abi::wr::FENCE | abi::wr::SIGNALED | abi::wr::SOLICITED | abi::wr::INLINE) != 0 {
        return bad(
            WcStatus::LocQpOpErr,
            "a reserved flag",
            "flags",
            h.flags.into(),
        );
    }
    let mut flags = SendFlags(0);
    for (bit, f) in [
        (abi::wr::FENCE, SendFlags::FENCE),
        (abi::wr::SIGNALED, SendFlags::SIGNALED),
        (abi::wr::SOLICITED, SendFlags::SOLICITED),
        (abi::wr::INLINE, SendFlags::INLINE),
    ] {
        if h.flags & bit != 0 {
            flags = flags | f;
        }
    }
    let count = usize::from(h.count.get());
    let inline = h.flags & abi::wr::INLINE != 0;
    let datagram = qp.qp_type.is_datagram();
    let rc = qp.qp_type == QpType::Rc;
    let connected = matches!(qp.qp_type, QpType::Rc | QpType::Uc);
    // The immediate as the wire carries it: the four bytes the consumer
    // stored.
    let imm = u32::from_be_bytes(h.ex.to_bytes());
    let ex = h.ex.get();
    let o = &h.op;
    let rdma = || abi::WqeRdma::read_from_bytes(o).ok();
    let atomic = || abi::WqeAtomic::read_from_bytes(o).ok();
    let op = match opcode {
        abi::wr::SEND => SendOp::Send,
        abi::wr::SEND_WITH_IMM => SendOp::SendWithImm { imm },
        abi::wr::SEND_WITH_INV if rc => SendOp::SendWithInv {
            invalidate: Rkey(ex),
        },
        abi::wr::RDMA_WRITE | abi::wr::RDMA_WRITE_WITH_IMM | abi::wr::RDMA_READ if connected => {
            let Some(r) = rdma() else {
                return bad(
                    WcStatus::LocQpOpErr,
                    "an RDMA segment",
                    "opcode",
                    opcode.into(),
                );
            };
            let (remote_addr, rkey) = (r.remote_addr.get(), Rkey(r.rkey.get()));
            match opcode {
                abi::wr::RDMA_WRITE => SendOp::RdmaWrite { remote_addr, rkey },
                abi::wr::RDMA_WRITE_WITH_IMM => SendOp::RdmaWriteWithImm {
                    remote_addr,
                    rkey,
                    imm,
                },
                _ if rc => SendOp::RdmaRead { remote_addr, rkey },
                _ => {
                    return bad(
                        WcStatus::LocQpOpErr,
                        "an opcode the QP type takes",
                        "opcode",
                        opcode.into(),
                    );
                }
            }
        }
        abi::wr::ATOMIC_CMP_AND_SWP | abi::wr::ATOMIC_FETCH_AND_ADD if rc => {
            let Some(a) = atomic() else {
                return bad(
                    WcStatus::LocQpOpErr,
                    "an atomic segment",
                    "opcode",
                    opcode.into(),
                );
            };
            let (remote_addr, rkey) = (a.remote_addr.get(), Rkey(a.rkey.get()));
            if opcode == abi::wr::ATOMIC_CMP_AND_SWP {
                SendOp::CompareSwap {
                    remote_addr,
                    rkey,
                    compare: a.compare_add.get(),
                    swap: a.swap.get(),
                }
            } else {
                SendOp::FetchAdd {
                    remote_addr,
                    rkey,
                    add: a.compare_add.get(),
                }
            }
        }
        abi::wr::LOCAL_INV if !datagram => SendOp::LocalInv {
            invalidate: Rkey(ex),
        },
        abi::wr::BIND_MW if !datagram => {
            let Ok(b) = abi::WqeBindMw::read_from_bytes(o) else {
                return bad(
                    WcStatus::LocQpOpErr,
                    "a BIND_MW segment",
                    "opcode",
                    opcode.into(),
                );
            };
            let mw = b.mw.get();
            let access = b.access.get();
            if access & !abi::access::MR_BITS != 0 {
                return bad(
                    WcStatus::LocQpOpErr,
                    "access bits of an MR",
                    "access",
                    access.into(),
                );
            }
            SendOp::BindMw {
                mw: Rkey(mw),
                key: mw as u8,
                mr: Lkey(b.mr.get()),
                addr: b.addr.get(),
                length: b.length.get(),
                access: Access(access),
            }
        }
        abi::wr::REG_MR if !datagram => {
            let Ok(r) = abi::WqeRegMr::read_from_bytes(o) else {
                return bad(
                    WcStatus::LocQpOpErr,
                    "a REG_MR segment",
                    "opcode",
                    opcode.into(),
                );
            };
            let key = r.key.get();
            let access = r.access.get();
            let shift = r.page_shift;
            let npages = r.npages.get();
            let refuse = |rule, field, value: u64| bad(WcStatus::LocQpOpErr, rule, field, value);
            if access & !abi::access::MR_BITS != 0 {
                return refuse("access bits of an MR", "access", access.into());
            }
            if !(12..=30).contains(&shift) {
                return refuse("a page shift of 12 to 30", "page_shift", shift.into());
            }
            if npages == 0 {
                return refuse("a page list of one page or more", "npages", 0);
            }
            if !r.page_list.get().is_multiple_of(8) {
                return refuse(
                    "an 8-byte aligned page list",
                    "page_list",
                    r.page_list.get(),
                );
            }
            if count != 0 || inline {
                return refuse("no data with a local operation", "count", count as u64);
            }
            let iova = r.iova.get();
            return Ok(SendWqe {
                wr_id,
                opcode: opcode.into(),
                op: SendOp::RegMr {
                    mr: Lkey(key),
                    key: key as u8,
                    iova,
                    length: r.length.get(),
                    access: Access(access),
                },
                flags,
                payload: Payload::Sges(Vec::new()),
                ud: None,
                fast_reg: Some(FastReg {
                    list: ListAt::Flat(r.page_list.get()),
                    npages,
                    page_shift: shift,
                    offset: iova % (1u64 << shift),
                }),
            });
        }
        _ => {
            return bad(
                WcStatus::LocQpOpErr,
                "an opcode the QP type takes",
                "opcode",
                opcode.into(),
            );
        }
    };
    // A local operation carries no data: its count is 0 (§7.9).
    if op.is_local() && count != 0 {
        return bad(
            WcStatus::LocQpOpErr,
            "no data with a local operation",
            "count",
            count as u64,
        );
    }
    let payload = if inline {
        if op.is_local() || op.is_read_or_atomic() {
            return bad(
                WcStatus::LocQpOpErr,
                "INLINE only with a SEND or WRITE",
                "opcode",
                opcode.into(),
            );
        }
        if count as u64 > u64::from(qp.max_inline) || count > rest.len() {
            return bad(
                WcStatus::LocLenErr,
                "inline data within max_inline_data and the stride",
                "count",
                count as u64,
            );
        }
        Payload::Inline(rest[..count].to_vec())
    } else {
        if count as u64 > u64::from(qp.max_sge) || count * SGE as usize > rest.len() {
            return bad(
                WcStatus::LocLenErr,
                "SGEs within max_send_sge and the stride",
                "count",
                count as u64,
            );
        }
        match vrdma_face::wq::sges(rest, count) {
            Some(s) => Payload::Sges(s),
            None => {
                return bad(
                    WcStatus::LocLenErr,
                    "SGEs whose lengths add up to 2^32 at most",
                    "count",
                    count as u64,
                );
            }
        }
    };
    let ud = if datagram {
        let Ok(u) = abi::WqeUd::read_from_bytes(o) else {
            return bad(
                WcStatus::LocQpOpErr,
                "a UD segment",
                "opcode",
                opcode.into(),
            );
        };
        if u.av.reserved.get() != 0 {
            return bad(
                WcStatus::LocQpOpErr,
                "an address vector's reserved field 0",
                "av.reserved",
                u.av.reserved.get().into(),
            );
        }
        let Ok(attr) = ah_attr(&u.av, 1) else {
            return bad(
                WcStatus::LocQpOpErr,
                "an address vector with a destination GID",
                "av.dgid",
                0,
            );
        };
        let Ok(remote_qpn) = Qpn::try_from(u.remote_qpn.get()) else {
            return bad(
                WcStatus::LocQpOpErr,
                "a remote QPN below 2^24",
                "remote_qpn",
                u.remote_qpn.get().into(),
            );
        };
        Some(UdDest {
            av: Av::Inline(attr),
            remote_qpn,
            remote_qkey: QKey(u.remote_qkey.get()),
        })
    } else {
        None
    };
    Ok(SendWqe {
        wr_id,
        opcode: opcode.into(),
        op,
        flags,
        payload,
        ud,
        fast_reg: None,
    })
}

/// Decodes a receive WQE from its copy: its wr_id and SGEs, or why it is
/// malformed — it names more SGEs than its queue allows or its slot holds
/// (its completion: a local length error).
pub fn decode_recv(wqe: &[u8], max_sge: u32) -> Result<(u64, Vec<Sge>), Malformed> {
    let Ok((h, rest)) = abi::RecvWqeHdr::read_from_prefix(wqe) else {
        return Err(Malformed {
            wr_id: 0,
            status: WcStatus::LocLenErr,
            opcode: 0,
            rule: "a WQE shorter than its header",
            field: "stride",
            value: wqe.len() as u64,
        });
    };
    let wr_id = h.wr_id.get();
    let n = usize::from(h.count.get());
    let bad = |rule| Malformed {
        wr_id,
        status: WcStatus::LocLenErr,
        opcode: 0,
        rule,
        field: "count",
        value: n as u64,
    };
    if n as u64 > u64::from(max_sge) {
        return Err(bad("more SGEs than the queue takes"));
    }
    vrdma_face::wq::sges(rest, n)
        .map(|s| (wr_id, s))
        .ok_or_else(|| bad("more SGEs than the slot holds"))
}
