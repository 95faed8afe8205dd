//! Work requests: send and receive WQEs from their copies into the face
//! core's decoded types.

use vrdma_engine::{
    mr::Access,
    qp::QpType,
    wc::WcStatus,
    wr::{Av, SendFlags, SendOp, UdDest},
};
use vrdma_face::WqeIdentity;
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
    let Ok((header, rest)) = abi::SendWqeHdr::read_from_prefix(wqe) else {
        return Err(Malformed {
            wr_id: 0,
            status: WcStatus::LocQpOpErr,
            opcode: 0,
            rule: "a WQE shorter than its header",
            field: "stride",
            value: wqe.len() as u64,
        });
    };
    let identity = WqeIdentity {
        wr_id: header.wr_id.get(),
        opcode: header.opcode.into(),
    };
    let flags = wqe_flags(header.flags, identity)?;
    let count = usize::from(header.count.get());
    let inline = header.flags & abi::wr::INLINE != 0;
    let datagram = qp.qp_type.is_datagram();
    let rc = qp.qp_type == QpType::Rc;
    let connected = matches!(qp.qp_type, QpType::Rc | QpType::Uc);
    // The immediate as the wire carries it: the four bytes the consumer
    // stored.
    let imm = u32::from_be_bytes(header.ex.to_bytes());
    let ex = header.ex.get();
    let segment = &header.op;
    let op = match header.opcode {
        abi::wr::SEND => SendOp::Send,
        abi::wr::SEND_WITH_IMM => SendOp::SendWithImm { imm },
        abi::wr::SEND_WITH_INV if rc => SendOp::SendWithInv {
            invalidate: Rkey(ex),
        },
        abi::wr::RDMA_WRITE | abi::wr::RDMA_WRITE_WITH_IMM | abi::wr::RDMA_READ if connected => {
            rdma_operation(segment, imm, qp.qp_type, identity)?
        }
        abi::wr::ATOMIC_CMP_AND_SWP | abi::wr::ATOMIC_FETCH_AND_ADD if rc => {
            atomic_operation(segment, identity)?
        }
        abi::wr::LOCAL_INV if !datagram => SendOp::LocalInv {
            invalidate: Rkey(ex),
        },
        abi::wr::BIND_MW if !datagram => bind_mw_operation(segment, identity)?,
        // A REG_MR is decoded whole: it carries a page list and no data.
        abi::wr::REG_MR if !datagram => {
            return reg_mr(segment, flags, count, inline, identity);
        }
        _ => return identity.refuse_opcode("an opcode the QP type takes"),
    };
    // A local operation carries no data: its count is 0 (§7.9).
    if op.is_local() && count != 0 {
        return identity.refuse(
            WcStatus::LocQpOpErr,
            "no data with a local operation",
            "count",
            count as u64,
        );
    }
    let payload = send_payload(rest, count, inline, &op, qp, identity)?;
    let ud = if datagram {
        Some(ud_destination(segment, identity)?)
    } else {
        None
    };
    Ok(SendWqe {
        wr_id: identity.wr_id,
        opcode: identity.opcode,
        op,
        flags,
        payload,
        ud,
        fast_reg: None,
    })
}

/// The header's send flags as the engine names them, refusing a reserved
/// bit.
fn wqe_flags(bits: u8, identity: WqeIdentity) -> Result<SendFlags, Malformed> {
    if bits & !(abi::wr::FENCE | abi::wr::SIGNALED | abi::wr::SOLICITED | abi::wr::INLINE) != 0 {
        return identity.refuse(
            WcStatus::LocQpOpErr,
            "a reserved flag",
            "flags",
            bits.into(),
        );
    }
    let mut flags = SendFlags(0);
    for (bit, flag) in [
        (abi::wr::FENCE, SendFlags::FENCE),
        (abi::wr::SIGNALED, SendFlags::SIGNALED),
        (abi::wr::SOLICITED, SendFlags::SOLICITED),
        (abi::wr::INLINE, SendFlags::INLINE),
    ] {
        if bits & bit != 0 {
            flags = flags | flag;
        }
    }
    Ok(flags)
}

/// An RDMA WRITE, WRITE with immediate or READ from the WQE's operation
/// segment; a READ is refused on a QP that is not RC.
fn rdma_operation(
    segment: &[u8],
    imm: u32,
    qp_type: QpType,
    identity: WqeIdentity,
) -> Result<SendOp, Malformed> {
    let Ok(rdma) = abi::WqeRdma::read_from_bytes(segment) else {
        return identity.refuse_opcode("an RDMA segment");
    };
    let (remote_addr, rkey) = (rdma.remote_addr.get(), Rkey(rdma.rkey.get()));
    let opcode = identity.opcode;
    Ok(if opcode == u32::from(abi::wr::RDMA_WRITE) {
        SendOp::RdmaWrite { remote_addr, rkey }
    } else if opcode == u32::from(abi::wr::RDMA_WRITE_WITH_IMM) {
        SendOp::RdmaWriteWithImm {
            remote_addr,
            rkey,
            imm,
        }
    } else if qp_type == QpType::Rc {
        SendOp::RdmaRead { remote_addr, rkey }
    } else {
        return identity.refuse_opcode("an opcode the QP type takes");
    })
}

/// A compare-and-swap or fetch-and-add from the WQE's operation segment.
fn atomic_operation(segment: &[u8], identity: WqeIdentity) -> Result<SendOp, Malformed> {
    let Ok(atomic) = abi::WqeAtomic::read_from_bytes(segment) else {
        return identity.refuse_opcode("an atomic segment");
    };
    let (remote_addr, rkey) = (atomic.remote_addr.get(), Rkey(atomic.rkey.get()));
    Ok(
        if identity.opcode == u32::from(abi::wr::ATOMIC_CMP_AND_SWP) {
            SendOp::CompareSwap {
                remote_addr,
                rkey,
                compare: atomic.compare_add.get(),
                swap: atomic.swap.get(),
            }
        } else {
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add: atomic.compare_add.get(),
            }
        },
    )
}

/// A BIND_MW from the WQE's operation segment, refusing access bits an MR
/// does not have.
fn bind_mw_operation(segment: &[u8], identity: WqeIdentity) -> Result<SendOp, Malformed> {
    let Ok(bind) = abi::WqeBindMw::read_from_bytes(segment) else {
        return identity.refuse_opcode("a BIND_MW segment");
    };
    let mw = bind.mw.get();
    let access = bind.access.get();
    if access & !abi::access::MR_BITS != 0 {
        return identity.refuse(
            WcStatus::LocQpOpErr,
            "access bits of an MR",
            "access",
            access.into(),
        );
    }
    Ok(SendOp::BindMw {
        mw: Rkey(mw),
        key: mw as u8,
        mr: Lkey(bind.mr.get()),
        addr: bind.addr.get(),
        length: bind.length.get(),
        access: Access(access),
    })
}

/// A whole REG_MR WQE from its operation segment: the MR, its rights and
/// where its flat page list is. It is refused for a bad page shift or page
/// list, or for carrying any data.
fn reg_mr(
    segment: &[u8],
    flags: SendFlags,
    count: usize,
    inline: bool,
    identity: WqeIdentity,
) -> Result<SendWqe, Malformed> {
    let Ok(registration) = abi::WqeRegMr::read_from_bytes(segment) else {
        return identity.refuse_opcode("a REG_MR segment");
    };
    let key = registration.key.get();
    let access = registration.access.get();
    let shift = registration.page_shift;
    let npages = registration.npages.get();
    let page_list = registration.page_list.get();
    let refuse =
        |rule, field, value: u64| identity.refuse(WcStatus::LocQpOpErr, rule, field, value);
    if access & !abi::access::MR_BITS != 0 {
        return refuse("access bits of an MR", "access", access.into());
    }
    if !(12..=30).contains(&shift) {
        return refuse("a page shift of 12 to 30", "page_shift", shift.into());
    }
    if npages == 0 {
        return refuse("a page list of one page or more", "npages", 0);
    }
    if !page_list.is_multiple_of(8) {
        return refuse("an 8-byte aligned page list", "page_list", page_list);
    }
    if count != 0 || inline {
        return refuse("no data with a local operation", "count", count as u64);
    }
    let iova = registration.iova.get();
    Ok(SendWqe {
        wr_id: identity.wr_id,
        opcode: identity.opcode,
        op: SendOp::RegMr {
            mr: Lkey(key),
            key: key as u8,
            iova,
            length: registration.length.get(),
            access: Access(access),
        },
        flags,
        payload: Payload::Sges(vrdma_face::wq::SgeList::default()),
        ud: None,
        fast_reg: Some(FastReg {
            list: ListAt::Flat(page_list),
            npages,
            page_shift: shift,
            offset: iova % (1u64 << shift),
        }),
    })
}

/// The data a WQE sends: `count` inline bytes, or `count` SGEs, from what
/// follows its header. Either must fit the QP's limits and the stride.
fn send_payload(
    rest: &[u8],
    count: usize,
    inline: bool,
    op: &SendOp,
    qp: &SendShape,
    identity: WqeIdentity,
) -> Result<Payload, Malformed> {
    if inline {
        if op.is_local() || op.is_read_or_atomic() {
            return identity.refuse_opcode("INLINE only with a SEND or WRITE");
        }
        if count as u64 > u64::from(qp.max_inline) || count > rest.len() {
            return identity.refuse(
                WcStatus::LocLenErr,
                "inline data within max_inline_data and the stride",
                "count",
                count as u64,
            );
        }
        return Ok(Payload::Inline(rest[..count].to_vec()));
    }
    if count as u64 > u64::from(qp.max_sge) || count * SGE as usize > rest.len() {
        return identity.refuse(
            WcStatus::LocLenErr,
            "SGEs within max_send_sge and the stride",
            "count",
            count as u64,
        );
    }
    match vrdma_face::wq::sges(rest, count) {
        Some(sges) => Ok(Payload::Sges(sges)),
        None => identity.refuse(
            WcStatus::LocLenErr,
            "SGEs whose lengths add up to 2^32 at most",
            "count",
            count as u64,
        ),
    }
}

/// A UD WQE's destination from its operation segment: the inline address
/// vector, the remote QPN and its Q_Key.
fn ud_destination(segment: &[u8], identity: WqeIdentity) -> Result<UdDest, Malformed> {
    let Ok(ud) = abi::WqeUd::read_from_bytes(segment) else {
        return identity.refuse_opcode("a UD segment");
    };
    if ud.av.reserved.get() != 0 {
        return identity.refuse(
            WcStatus::LocQpOpErr,
            "an address vector's reserved field 0",
            "av.reserved",
            ud.av.reserved.get().into(),
        );
    }
    let Ok(attr) = ah_attr(&ud.av, 1) else {
        return identity.refuse(
            WcStatus::LocQpOpErr,
            "an address vector with a destination GID",
            "av.dgid",
            0,
        );
    };
    let Ok(remote_qpn) = Qpn::try_from(ud.remote_qpn.get()) else {
        return identity.refuse(
            WcStatus::LocQpOpErr,
            "a remote QPN below 2^24",
            "remote_qpn",
            ud.remote_qpn.get().into(),
        );
    };
    Ok(UdDest {
        av: Av::Inline(attr),
        remote_qpn,
        remote_qkey: QKey(ud.remote_qkey.get()),
    })
}

/// Decodes a receive WQE from its copy: its wr_id and SGEs, or why it is
/// malformed — it names more SGEs than its queue allows or its slot holds
/// (its completion: a local length error).
pub fn decode_recv(wqe: &[u8], max_sge: u32) -> Result<(u64, vrdma_face::wq::SgeList), Malformed> {
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
