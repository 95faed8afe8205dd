//! QPs as the guest sees them: a send and a receive ring of PVRDMA WQEs
//! in guest memory (`pvrdma_sq_wqe_hdr`, `pvrdma_rq_wqe_hdr`, their SGEs),
//! taken into the engine by the face core ([`QpQueues`]: each WQE copied
//! out once, decoded here, posted as far as the engine has room, its slot
//! given back at once).
//!
//! A WQE that cannot be decoded (an opcode the QP type has no use for, too
//! many SGEs, inline data, a fast registration with a bad page list)
//! completes with LOC_QP_OP_ERR or LOC_LEN_ERR in its turn and takes the
//! QP to ERR, as a hardware device does with a malformed descriptor.

use vrdma_engine::{
    mr::Access,
    qp::AhAttr,
    wc::WcStatus,
    wr::{Av, SendFlags, SendOp, UdDest},
};
pub use vrdma_face::wq::SendWqe;
use vrdma_face::{
    Malformed, PageList, RingQp, WqeIdentity,
    ring::WrapBit,
    wq::{self, FastReg, ListAt, Payload, QpQueues, RecvWqe},
};
use vrdma_wire::{Gid, QKey, Qpn, Rkey};
use zerocopy::{FromBytes, IntoBytes};

use crate::{
    abi::{self, PAGE_SIZE, RqWqeHdr, SqWqeHdr, qp_type, send_flags, wr_opcode},
    ring::{self, Ring},
};

/// A send WQE's header bytes.
pub const SQ_WQE_HDR: u64 = size_of::<SqWqeHdr>() as u64;
/// A receive WQE's header bytes.
pub const RQ_WQE_HDR: u64 = size_of::<RqWqeHdr>() as u64;
/// An SGE's bytes.
pub const SGE: u64 = size_of::<abi::Sge>() as u64;

/// The WQE stride the driver and provider use for `max_sge` SGEs.
pub fn sq_stride(max_sge: u32) -> u64 {
    (SQ_WQE_HDR + SGE * u64::from(max_sge)).next_power_of_two()
}

pub fn rq_stride(max_sge: u32) -> u64 {
    (RQ_WQE_HDR + SGE * u64::from(max_sge)).next_power_of_two()
}

/// The QP a WQE is decoded for.
#[derive(Clone, Copy, Debug)]
pub struct QpContext {
    pub ty: u8,
    pub pd: u32,
    pub max_send_sge: u32,
    pub stride: u64,
}

/// Decodes a send WQE from its copy `wqe` (a stride of the ring), reading
/// nothing else: `Err`, the WQE is malformed, completes with the status it
/// says (the QP then goes to ERR), and says why. A fast registration names
/// its MR by the key it takes and its page directory by address; the face
/// core resolves both ([`wq::resolve`]).
pub fn decode_send(wqe: &[u8], qp: &QpContext) -> Result<SendWqe, Malformed> {
    // A copy shorter than a header: never from a ring, whose stride holds
    // one.
    let Ok((header, _)) = SqWqeHdr::read_from_prefix(wqe) else {
        return Err(Malformed {
            wr_id: 0,
            status: WcStatus::LocLenErr,
            opcode: 0,
            rule: "a WQE shorter than its header",
            field: "stride",
            value: wqe.len() as u64,
        });
    };
    let identity = WqeIdentity {
        wr_id: header.wr_id.get(),
        opcode: header.opcode.get(),
    };
    let num_sge = header.num_sge.get();
    let room = qp.stride.min(wqe.len() as u64);
    if num_sge > qp.max_send_sge {
        return identity.refuse(
            WcStatus::LocLenErr,
            "more SGEs than the queue takes",
            "num_sge",
            num_sge.into(),
        );
    }
    if SQ_WQE_HDR + SGE * u64::from(num_sge) > room {
        return identity.refuse(
            WcStatus::LocLenErr,
            "more SGEs than the slot holds",
            "num_sge",
            num_sge.into(),
        );
    }
    let flags = wqe_flags(header.send_flags.get(), identity)?;
    let Some(sges) = wq::sges(&wqe[SQ_WQE_HDR as usize..], num_sge as usize) else {
        return identity.refuse(
            WcStatus::LocLenErr,
            "more SGEs than the slot holds",
            "num_sge",
            num_sge.into(),
        );
    };
    let wr: &[u8] = header.wr.as_bytes();
    let datagram = matches!(qp.ty, qp_type::UD | qp_type::GSI);
    let op = match identity.opcode {
        // A fast registration is decoded whole from its `wr` union; it sends
        // no data.
        wr_opcode::FAST_REG_MR if !datagram => return fast_reg(identity.wr_id, flags, wr),
        _ => send_operation(&header, qp.ty, identity)?,
    };
    let ud = if datagram {
        Some(ud_destination(wr, qp.pd, identity)?)
    } else {
        None
    };
    Ok(SendWqe {
        wr_id: identity.wr_id,
        opcode: identity.opcode,
        op,
        flags,
        // PVRDMA announces no inline data.
        payload: Payload::Sges(sges),
        ud,
        fast_reg: None,
    })
}

/// The header's send flags as the engine names them, refusing inline data.
fn wqe_flags(bits: u32, identity: WqeIdentity) -> Result<SendFlags, Malformed> {
    if bits & send_flags::INLINE != 0 {
        // No inline data: the device announces max_inline_data 0.
        return identity.refuse(
            WcStatus::LocQpOpErr,
            "inline data (max_inline_data is 0)",
            "send_flags",
            bits.into(),
        );
    }
    let mut flags = SendFlags(0);
    for (bit, flag) in [
        (send_flags::FENCE, SendFlags::FENCE),
        (send_flags::SIGNALED, SendFlags::SIGNALED),
        (send_flags::SOLICITED, SendFlags::SOLICITED),
    ] {
        if bits & bit != 0 {
            flags = flags | flag;
        }
    }
    Ok(flags)
}

/// The operation a send WQE asks for, from its opcode and the `wr` union,
/// refusing an opcode the QP type `ty` has no use for. A FAST_REG_MR on a
/// connected QP is not decoded here but by [`fast_reg`].
fn send_operation(header: &SqWqeHdr, ty: u8, identity: WqeIdentity) -> Result<SendOp, Malformed> {
    let wr: &[u8] = header.wr.as_bytes();
    // The immediate as the wire carries it: the four bytes the consumer
    // stored.
    let imm = u32::from_be_bytes(header.ex.to_bytes());
    let connected = matches!(ty, qp_type::RC | qp_type::UC);
    let rc = ty == qp_type::RC;
    let datagram = matches!(ty, qp_type::UD | qp_type::GSI);
    Ok(match identity.opcode {
        wr_opcode::SEND => SendOp::Send,
        wr_opcode::SEND_WITH_IMM => SendOp::SendWithImm { imm },
        wr_opcode::RDMA_WRITE if connected => SendOp::RdmaWrite {
            remote_addr: u64_at(wr, 0),
            rkey: Rkey(u32_at(wr, 8)),
        },
        wr_opcode::RDMA_WRITE_WITH_IMM if connected => SendOp::RdmaWriteWithImm {
            remote_addr: u64_at(wr, 0),
            rkey: Rkey(u32_at(wr, 8)),
            imm,
        },
        wr_opcode::RDMA_READ if rc => SendOp::RdmaRead {
            remote_addr: u64_at(wr, 0),
            rkey: Rkey(u32_at(wr, 8)),
        },
        wr_opcode::ATOMIC_CMP_AND_SWP if rc => SendOp::CompareSwap {
            remote_addr: u64_at(wr, 0),
            compare: u64_at(wr, 8),
            swap: u64_at(wr, 16),
            rkey: Rkey(u32_at(wr, 24)),
        },
        wr_opcode::ATOMIC_FETCH_AND_ADD if rc => SendOp::FetchAdd {
            remote_addr: u64_at(wr, 0),
            add: u64_at(wr, 8),
            rkey: Rkey(u32_at(wr, 24)),
        },
        wr_opcode::SEND_WITH_INV if rc => SendOp::SendWithInv {
            invalidate: Rkey(header.ex.get()),
        },
        wr_opcode::LOCAL_INV if !datagram => SendOp::LocalInv {
            invalidate: Rkey(header.ex.get()),
        },
        _ => {
            return identity.refuse(
                WcStatus::LocQpOpErr,
                "an opcode the QP type has no use for",
                "opcode",
                identity.opcode.into(),
            );
        }
    })
}

/// A UD WQE's destination from the `wr` union (remote_qpn, remote_qkey,
/// then the address vector), refusing an address vector of a PD other than
/// the QP's `pd` or a remote QPN wider than 24 bits.
fn ud_destination(wr: &[u8], pd: u32, identity: WqeIdentity) -> Result<UdDest, Malformed> {
    let remote_qpn = u32_at(wr, 0);
    let remote_qkey = u32_at(wr, 4);
    let Ok((av, _)) = abi::Av::read_from_prefix(&wr[8..]) else {
        return identity.refuse(
            WcStatus::LocQpOpErr,
            "an address vector",
            "wr",
            wr.len() as u64,
        );
    };
    // The AV's PD must be the QP's (IBTA Vol1 §10.2.3); the provider
    // builds AVs in userspace, so nothing else has checked it.
    if av.port_pd.get() & 0x00ff_ffff != pd {
        return identity.refuse(
            WcStatus::LocQpOpErr,
            "an address vector of the QP's PD",
            "av.port_pd",
            av.port_pd.get().into(),
        );
    }
    let Ok(qpn) = Qpn::try_from(remote_qpn) else {
        return identity.refuse(
            WcStatus::LocQpOpErr,
            "a 24-bit remote QPN",
            "remote_qpn",
            remote_qpn.into(),
        );
    };
    let sl_tclass_flowlabel = av.sl_tclass_flowlabel.get();
    let attr = AhAttr {
        dgid: Gid(av.dgid),
        flow_label: sl_tclass_flowlabel & AhAttr::FLOW_LABEL_MASK,
        sgid_index: av.gid_index,
        hop_limit: av.hop_limit,
        traffic_class: (sl_tclass_flowlabel >> 20) as u8,
        sl: 0,
        port_num: 1,
        dmac: Some(av.dmac),
    };
    Ok(UdDest {
        av: Av::Inline(attr),
        remote_qpn: qpn,
        remote_qkey: QKey(remote_qkey),
    })
}

/// The little-endian u64 at byte `offset` of a WQE's `wr` union.
fn u64_at(wr: &[u8], offset: usize) -> u64 {
    u64::from_le_bytes(wr[offset..offset + 8].try_into().unwrap_or_default())
}

/// The little-endian u32 at byte `offset` of a WQE's `wr` union.
fn u32_at(wr: &[u8], offset: usize) -> u32 {
    u32::from_le_bytes(wr[offset..offset + 4].try_into().unwrap_or_default())
}

/// A FAST_REG_MR WQE: the REG_MR and where its page directory is.
fn fast_reg(wr_id: u64, flags: SendFlags, wr: &[u8]) -> Result<SendWqe, Malformed> {
    let iova = u64_at(wr, 0);
    let pl_pdir = u64_at(wr, 8);
    let page_shift = u32_at(wr, 16);
    let list_len = u32_at(wr, 20);
    let length = u64::from(u32_at(wr, 24));
    let access = u32_at(wr, 28);
    let rkey = u32_at(wr, 32);
    let bad = |rule, field, value| {
        Err(Malformed {
            wr_id,
            status: WcStatus::LocQpOpErr,
            opcode: wr_opcode::FAST_REG_MR,
            rule,
            field,
            value,
        })
    };
    if page_shift != 12 {
        return bad(
            "4 KiB pages in a fast registration",
            "page_shift",
            page_shift.into(),
        );
    }
    if list_len == 0 || list_len > abi::MAX_FAST_REG_PAGES {
        return bad(
            "1 to MAX_FAST_REG_PAGES pages in a fast registration",
            "page_list_len",
            list_len.into(),
        );
    }
    Ok(SendWqe {
        wr_id,
        opcode: wr_opcode::FAST_REG_MR,
        op: SendOp::RegMr {
            // The MR by the key it takes (the core finds it by its index;
            // the engine checks that it is a fast-registration MR of the
            // QP's PD when the REG_MR runs).
            mr: vrdma_wire::Lkey(rkey),
            key: rkey as u8,
            iova,
            length,
            // The rights the device implements; relaxed ordering and
            // the like are ignored, as the driver passes them unchecked.
            access: Access(access & 0x3f),
        },
        flags,
        payload: Payload::Sges(wq::SgeList::default()),
        ud: None,
        fast_reg: Some(FastReg {
            list: ListAt::Directory(pl_pdir),
            npages: list_len,
            page_shift: 12,
            offset: iova % PAGE_SIZE,
        }),
    })
}

/// Decodes a receive WQE from its copy `wqe` (a stride of the ring).
/// `Err`: it has more SGEs than the queue allows or the stride holds (its
/// completion: a local length error), and says which.
pub fn decode_recv(wqe: &[u8], max_sge: u32) -> Result<RecvWqe, Malformed> {
    let Ok((h, rest)) = RqWqeHdr::read_from_prefix(wqe) else {
        // Shorter than a header: never from a ring.
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
    let n = h.num_sge.get();
    let bad = |rule| Malformed {
        wr_id,
        status: WcStatus::LocLenErr,
        opcode: 0,
        rule,
        field: "num_sge",
        value: n.into(),
    };
    if n > max_sge {
        return Err(bad("more SGEs than the queue takes"));
    }
    if RQ_WQE_HDR + SGE * u64::from(n) > wqe.len() as u64 {
        return Err(bad("more SGEs than the slot holds"));
    }
    let sges = wq::sges(rest, n as usize).ok_or_else(|| bad("more SGEs than the slot holds"))?;
    Ok(RecvWqe { wr_id, sges })
}

/// A QP's face: its rings, and what its WQEs are decoded for.
#[derive(Debug)]
pub struct QpFace {
    pub queues: QpQueues<WrapBit>,
    pub ctx: QpContext,
    /// The doorbell page that may ring it (its context's; 0 for the
    /// kernel's).
    pub uar: u32,
    pub max_recv_sge: u32,
}

impl QpFace {
    pub fn new(
        qpn: Qpn,
        ctx: QpContext,
        uar: u32,
        sq: Ring,
        rq: Option<Ring>,
        max_recv_sge: u32,
    ) -> Self {
        QpFace {
            queues: QpQueues::new(qpn, sq, rq),
            ctx,
            uar,
            max_recv_sge,
        }
    }

    pub fn qpn(&self) -> Qpn {
        self.queues.qpn()
    }
}

impl RingQp for QpFace {
    type Indices = WrapBit;
    /// The send queue's context, and the receive queue's SGE limit.
    type Shape = (QpContext, u32);

    fn queues(&mut self) -> &mut QpQueues<WrapBit> {
        &mut self.queues
    }

    fn shape(&self) -> Self::Shape {
        (self.ctx, self.max_recv_sge)
    }

    fn decode_send(shape: &Self::Shape, entry: &[u8]) -> Result<SendWqe, Malformed> {
        decode_send(entry, &shape.0)
    }

    fn decode_recv(shape: &Self::Shape, entry: &[u8]) -> Result<RecvWqe, Malformed> {
        decode_recv(entry, shape.1)
    }
}

/// The rings of a QP, from its pages: page 0 holds both rings' indices,
/// `send_chunks` pages of send WQEs follow, then the receive WQEs.
#[allow(clippy::too_many_arguments)]
pub fn rings(
    pages: &PageList,
    send_chunks: u32,
    max_send_wr: u32,
    send_stride: u64,
    max_recv_wr: u32,
    recv_stride: u64,
    has_rq: bool,
) -> Option<(Ring, Option<Ring>)> {
    let state = *pages.pages().first()?;
    let sc = send_chunks as usize;
    if pages.len() < 1 + sc {
        return None;
    }
    let sq = ring::ring(
        max_send_wr,
        send_stride,
        state + abi::ring_state::SQ,
        pages.skip(1).take(sc),
    )?;
    let rq = if has_rq {
        Some(ring::ring(
            max_recv_wr,
            recv_stride,
            state + abi::ring_state::RX,
            pages.skip(1 + sc),
        )?)
    } else {
        None
    };
    Some((sq, rq))
}
