//! Control requests: a command's header, body and trailing arrays decoded
//! into a typed [`Command`], rings and page lists checked for shape.

use vrdma_engine::{
    mr::{Access, MwType},
    qp::{AttrMask, QpType},
};
use vrdma_face::Refused;
use vrdma_wire::Gid;
use zerocopy::FromBytes;

use super::{fault, length};
use crate::abi::{self, PAGE_SIZE, op};

/// A ring a create command describes, checked for shape (not yet for
/// being inside guest memory).
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct RingSpec {
    /// Guest address of the 64-byte header.
    pub header: u64,
    pub entries: u32,
    pub stride: u32,
    /// Page addresses, in ring order.
    pub pages: Vec<u64>,
}

impl RingSpec {
    /// Bytes of entries.
    pub fn bytes(&self) -> u64 {
        u64::from(self.entries) * u64::from(self.stride)
    }

    /// Guest address of entry `slot` (< entries).
    pub fn entry(&self, slot: u32) -> u64 {
        let off = u64::from(slot) * u64::from(self.stride);
        let page = (off / PAGE_SIZE) as usize;
        self.pages[page] + off % PAGE_SIZE
    }
}

/// A decoded request.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct Request {
    pub opcode: u16,
    pub context: u32,
    pub command: Command,
}

/// Every command, typed.
#[derive(Clone, Debug, Eq, PartialEq)]
pub enum Command {
    QueryDevice,
    QueryStats,
    QueryPort {
        port: u8,
    },
    CreateContext {
        doorbell_bits: u32,
        pages: Vec<u64>,
    },
    DestroyContext,
    AllocPd,
    DeallocPd {
        pd: u32,
    },
    CreateCq {
        ring: RingSpec,
    },
    DestroyCq {
        cq: u32,
    },
    ResizeCq {
        cq: u32,
        ring: RingSpec,
    },
    RegMr(RegMr),
    RegDmaMr {
        pd: u32,
        access: Access,
    },
    AllocMr {
        pd: u32,
        max_pages: u32,
    },
    DeregMr {
        lkey: u32,
    },
    AllocMw {
        pd: u32,
        ty: MwType,
    },
    DeallocMw {
        rkey: u32,
    },
    CreateSrq {
        pd: u32,
        max_sge: u32,
        srq_limit: u32,
        ring: RingSpec,
    },
    ModifySrq {
        srq: u32,
        srq_limit: u32,
    },
    QuerySrq {
        srq: u32,
    },
    DestroySrq {
        srq: u32,
    },
    CreateQp(CreateQp),
    ModifyQp {
        qpn: u32,
        mask: AttrMask,
        attrs: Box<abi::QpAttrs>,
    },
    QueryQp {
        qpn: u32,
    },
    DestroyQp {
        qpn: u32,
    },
    SetGid {
        index: u8,
        gid: Option<Gid>,
    },
}

/// CREATE_QP, typed.
/// REG_MR's request, checked (§6.16): the page list of `1 << page_shift`
/// byte pages, the MR's first byte `offset` bytes into the first.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct RegMr {
    pub pd: u32,
    pub access: Access,
    pub iova: u64,
    pub length: u64,
    pub page_shift: u8,
    pub offset: u64,
    pub pages: Vec<u64>,
}

#[derive(Clone, Debug, Eq, PartialEq)]
pub struct CreateQp {
    pub pd: u32,
    pub qp_type: QpType,
    pub sq_sig_all: bool,
    pub send_cq: u32,
    pub recv_cq: u32,
    pub srq: Option<u32>,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
    pub sq: RingSpec,
    /// None with an SRQ.
    pub rq: Option<RingSpec>,
}

/// The fixed part of a send WQE.
pub const SEND_WQE_HDR: u32 = size_of::<abi::SendWqeHdr>() as u32;
/// The fixed part of a receive WQE.
pub const RECV_WQE_HDR: u32 = size_of::<abi::RecvWqeHdr>() as u32;
/// An SGE.
pub const SGE: u32 = size_of::<abi::Sge>() as u32;

/// The smallest send stride for `max_sge` SGEs and `max_inline` bytes.
pub fn min_send_stride(max_sge: u32, max_inline: u32) -> u64 {
    u64::from(SEND_WQE_HDR) + (u64::from(SGE) * u64::from(max_sge)).max(u64::from(max_inline))
}

/// The smallest receive stride for `max_sge` SGEs.
pub fn min_recv_stride(max_sge: u32) -> u64 {
    u64::from(RECV_WQE_HDR) + u64::from(SGE) * u64::from(max_sge)
}

/// Reads a fixed body at `at`, or refuses a request too short for it.
fn body<T: FromBytes>(req: &[u8], at: usize, what: &'static str) -> Result<T, Refused> {
    req.get(at..)
        .and_then(|b| T::read_from_prefix(b).ok())
        .map(|(t, _)| t)
        .ok_or(length(what))
}

/// The trailing array of `n` le64 page addresses after `at`: exactly `n`,
/// each 4 KiB aligned (or `align`).
fn pages(req: &[u8], at: usize, n: u64, align: u64) -> Result<Vec<u64>, Refused> {
    let rest = req.get(at..).unwrap_or_default();
    let want = n.checked_mul(8).ok_or(length("page list"))?;
    if rest.len() as u64 != want {
        return Err(length("page list: not the count the command names"));
    }
    let mut out = Vec::with_capacity(n as usize);
    for c in rest.chunks_exact(8) {
        let a = u64::from_le_bytes(c.try_into().unwrap_or_default());
        if !a.is_multiple_of(align) {
            return Err(fault("page list: a page not aligned"));
        }
        out.push(a);
    }
    Ok(out)
}

/// A ring's shape: `min_stride` is the smallest entry the object needs.
fn ring(d: &abi::RingDesc, pages: Vec<u64>, min_stride: u64) -> Result<RingSpec, Refused> {
    let entries = d.entries.get();
    let stride = d.stride.get();
    if d.reserved.get() != 0 {
        return Err(Refused::invalid("ring: reserved field"));
    }
    if !entries.is_power_of_two() || entries < 2 {
        return Err(Refused::invalid("ring: entries not a power of two"));
    }
    if !stride.is_power_of_two() || u64::from(stride) < min_stride || u64::from(stride) > PAGE_SIZE
    {
        return Err(Refused::invalid("ring: stride"));
    }
    let header = d.header.get();
    if !header.is_multiple_of(abi::RING_HEADER_SIZE) {
        return Err(fault("ring: header not 64-byte aligned"));
    }
    let bytes = u64::from(entries) * u64::from(stride);
    if !bytes.is_multiple_of(PAGE_SIZE) || bytes / PAGE_SIZE != pages.len() as u64 {
        return Err(Refused::invalid("ring: pages do not hold entries × stride"));
    }
    Ok(RingSpec {
        header,
        entries,
        stride,
        pages,
    })
}

/// The MR access bits (no on-demand paging or relaxed ordering: a bit
/// the device does not implement is refused, not ignored).
fn mr_access(v: u32) -> Result<Access, Refused> {
    if v & !abi::access::MR_BITS != 0 {
        return Err(Refused::unsupported("access: unknown bits"));
    }
    Ok(Access(v))
}

/// The most pages any one list may name (a 4 MiB trailing array).
pub const MAX_LIST_PAGES: u64 = 1 << 19;

/// Decodes a request (the concatenation of a chain's driver-readable
/// buffers).
pub fn decode_request(req: &[u8]) -> Result<Request, Refused> {
    let hdr: abi::CmdHdr = body(req, 0, "header")?;
    let at = size_of::<abi::CmdHdr>();
    let opcode = hdr.opcode.get();
    if hdr.flags.get() != 0 {
        return Err(Refused::invalid("header: flags"));
    }
    let command = match opcode {
        op::QUERY_DEVICE => without_body(req, at, Command::QueryDevice),
        op::QUERY_STATS => without_body(req, at, Command::QueryStats),
        op::QUERY_PORT => query_port(req, at),
        op::CREATE_CONTEXT => create_context(req, at),
        op::DESTROY_CONTEXT => without_body(req, at, Command::DestroyContext),
        op::ALLOC_PD => without_body(req, at, Command::AllocPd),
        op::DEALLOC_PD => handle(req, at, "PD").map(|pd| Command::DeallocPd { pd }),
        op::CREATE_CQ => create_cq(req, at),
        op::DESTROY_CQ => handle(req, at, "CQ").map(|cq| Command::DestroyCq { cq }),
        op::RESIZE_CQ => resize_cq(req, at),
        op::REG_MR => reg_mr(req, at).map(Command::RegMr),
        op::REG_DMA_MR => reg_dma_mr(req, at),
        op::ALLOC_MR => alloc_mr(req, at),
        op::DEREG_MR => handle(req, at, "MR").map(|lkey| Command::DeregMr { lkey }),
        op::ALLOC_MW => alloc_mw(req, at),
        op::DEALLOC_MW => handle(req, at, "MW").map(|rkey| Command::DeallocMw { rkey }),
        op::CREATE_SRQ => create_srq(req, at),
        op::MODIFY_SRQ => modify_srq(req, at),
        op::QUERY_SRQ => handle(req, at, "SRQ").map(|srq| Command::QuerySrq { srq }),
        op::DESTROY_SRQ => handle(req, at, "SRQ").map(|srq| Command::DestroySrq { srq }),
        op::CREATE_QP => create_qp(req, at).map(Command::CreateQp),
        op::MODIFY_QP => modify_qp(req, at),
        op::QUERY_QP => handle(req, at, "QP").map(|qpn| Command::QueryQp { qpn }),
        op::DESTROY_QP => handle(req, at, "QP").map(|qpn| Command::DestroyQp { qpn }),
        op::SET_GID => set_gid(req, at),
        _ => Err(Refused::unsupported("opcode")),
    }?;
    Ok(Request {
        opcode,
        context: hdr.context.get(),
        command,
    })
}

/// Bytes of the response body a command answers with on success.
pub const fn response_len(opcode: u16) -> usize {
    match opcode {
        op::QUERY_DEVICE => size_of::<abi::DeviceAttrResp>(),
        op::QUERY_STATS => size_of::<abi::StatsResp>(),
        op::QUERY_PORT => size_of::<abi::PortAttrResp>(),
        op::CREATE_CONTEXT | op::ALLOC_PD | op::ALLOC_MW | op::RESIZE_CQ => {
            size_of::<abi::HandleResp>()
        }
        op::REG_MR | op::REG_DMA_MR | op::ALLOC_MR => size_of::<abi::MrResp>(),
        op::CREATE_CQ => size_of::<abi::CreateCqResp>(),
        op::CREATE_SRQ => size_of::<abi::CreateSrqResp>(),
        op::QUERY_SRQ => size_of::<abi::SrqAttrResp>(),
        op::CREATE_QP => size_of::<abi::CreateQpResp>(),
        op::QUERY_QP => size_of::<abi::QueryQpResp>(),
        _ => 0,
    }
}

/// A request must end where its command does.
fn exact(req: &[u8], len: usize) -> Result<(), Refused> {
    match req.len().cmp(&len) {
        std::cmp::Ordering::Less => Err(length("request shorter than its command")),
        std::cmp::Ordering::Greater => Err(length("request longer than its command")),
        std::cmp::Ordering::Equal => Ok(()),
    }
}

/// A command without a body: the request must end with its header at `at`.
fn without_body(req: &[u8], at: usize, command: Command) -> Result<Command, Refused> {
    exact(req, at)?;
    Ok(command)
}

/// The one handle a command that names an object carries (`what` names
/// the object for a request too short for it), refusing a nonzero reserved
/// field.
fn handle(req: &[u8], at: usize, what: &'static str) -> Result<u32, Refused> {
    let b: abi::HandleReq = body(req, at, what)?;
    if b.reserved.get() != 0 {
        return Err(Refused::invalid("reserved field"));
    }
    exact(req, at + 8)?;
    Ok(b.handle.get())
}

/// QUERY_PORT: the device has the one port, port 1.
fn query_port(req: &[u8], at: usize) -> Result<Command, Refused> {
    let b: abi::PortReq = body(req, at, "QUERY_PORT")?;
    exact(req, at + 8)?;
    if b.port.get() != 1 || b.reserved.get() != 0 {
        return Err(Refused::invalid("port"));
    }
    Ok(Command::QueryPort { port: 1 })
}

/// CREATE_CONTEXT: the doorbell width, and the pages of a doorbell area
/// exactly that wide.
fn create_context(req: &[u8], at: usize) -> Result<Command, Refused> {
    let b: abi::CreateContextReq = body(req, at, "CREATE_CONTEXT")?;
    let bits = b.doorbell_bits.get();
    if !bits.is_power_of_two()
        || !(abi::doorbell::MIN_BITS..=abi::doorbell::MAX_BITS).contains(&bits)
    {
        return Err(Refused::invalid("doorbell bits"));
    }
    let n = u64::from(b.npages.get());
    if n != abi::doorbell::area_pages(bits) {
        return Err(Refused::invalid("doorbell area: page count"));
    }
    Ok(Command::CreateContext {
        doorbell_bits: bits,
        pages: pages(req, at + 8, n, PAGE_SIZE)?,
    })
}

/// CREATE_CQ: the CQ's ring of CQEs and its pages.
fn create_cq(req: &[u8], at: usize) -> Result<Command, Refused> {
    let b: abi::CreateCqReq = body(req, at, "CREATE_CQ")?;
    let n = u64::from(b.ring.npages.get());
    let p = pages(req, at + 24, n, PAGE_SIZE)?;
    Ok(Command::CreateCq {
        ring: ring(&b.ring, p, u64::from(size_of::<abi::Cqe>() as u32))?,
    })
}

/// RESIZE_CQ: the CQ and the new ring of CQEs that replaces its old one.
fn resize_cq(req: &[u8], at: usize) -> Result<Command, Refused> {
    let b: abi::ResizeCqReq = body(req, at, "RESIZE_CQ")?;
    if b.reserved.get() != 0 {
        return Err(Refused::invalid("reserved field"));
    }
    let n = u64::from(b.ring.npages.get());
    let p = pages(req, at + 32, n, PAGE_SIZE)?;
    Ok(Command::ResizeCq {
        cq: b.cq.get(),
        ring: ring(&b.ring, p, u64::from(size_of::<abi::Cqe>() as u32))?,
    })
}

/// REG_MR: the MR's pages of `1 << page_shift` bytes must hold exactly its
/// offset and length, and its iova plus length must not overflow.
fn reg_mr(req: &[u8], at: usize) -> Result<RegMr, Refused> {
    let b: abi::RegMrReq = body(req, at, "REG_MR")?;
    if b.reserved.get() != 0 {
        return Err(Refused::invalid("reserved field"));
    }
    let shift = b.page_shift.get();
    if !(12..=30).contains(&shift) {
        return Err(Refused::invalid("page shift"));
    }
    let page = 1u64 << shift;
    let offset = u64::from(b.offset.get());
    let length = b.length.get();
    if offset >= page {
        return Err(Refused::invalid("offset in the first page"));
    }
    let n = offset
        .checked_add(length)
        .map(|end| end.div_ceil(page))
        .ok_or(Refused::invalid("length"))?;
    if n == 0 || n > MAX_LIST_PAGES || n != u64::from(b.npages.get()) {
        return Err(Refused::invalid("page count"));
    }
    let access = mr_access(b.access.get())?;
    let iova = if access.contains(Access::ZERO_BASED) {
        0
    } else {
        b.iova.get()
    };
    if iova.checked_add(length).is_none() {
        return Err(Refused::invalid("iova + length"));
    }
    Ok(RegMr {
        pd: b.pd.get(),
        access,
        iova,
        length,
        page_shift: shift as u8,
        offset,
        pages: pages(req, at + 40, n, page)?,
    })
}

/// REG_DMA_MR: an MR over all of memory, which can be neither zero-based
/// nor bound to windows.
fn reg_dma_mr(req: &[u8], at: usize) -> Result<Command, Refused> {
    let b: abi::RegDmaMrReq = body(req, at, "REG_DMA_MR")?;
    exact(req, at + 8)?;
    let access = mr_access(b.access.get())?;
    if access.contains(Access::ZERO_BASED) || access.contains(Access::MW_BIND) {
        return Err(Refused::invalid("access of a DMA MR"));
    }
    Ok(Command::RegDmaMr {
        pd: b.pd.get(),
        access,
    })
}

/// ALLOC_MR: a fast-registration MR's PD and the most pages it may map.
fn alloc_mr(req: &[u8], at: usize) -> Result<Command, Refused> {
    let b: abi::AllocMrReq = body(req, at, "ALLOC_MR")?;
    exact(req, at + 8)?;
    Ok(Command::AllocMr {
        pd: b.pd.get(),
        max_pages: b.max_pages.get(),
    })
}

/// ALLOC_MW: a memory window of type 1 or 2 on a PD.
fn alloc_mw(req: &[u8], at: usize) -> Result<Command, Refused> {
    let b: abi::AllocMwReq = body(req, at, "ALLOC_MW")?;
    exact(req, at + 8)?;
    let ty = match b.mw_type.get() {
        1 => MwType::One,
        2 => MwType::Two,
        _ => return Err(Refused::invalid("window type")),
    };
    Ok(Command::AllocMw { pd: b.pd.get(), ty })
}

/// CREATE_SRQ: the SRQ's limits and its ring of receive WQEs, each entry
/// large enough for `max_sge` SGEs.
fn create_srq(req: &[u8], at: usize) -> Result<Command, Refused> {
    let b: abi::CreateSrqReq = body(req, at, "CREATE_SRQ")?;
    if b.reserved.get() != 0 {
        return Err(Refused::invalid("reserved field"));
    }
    let n = u64::from(b.ring.npages.get());
    let p = pages(req, at + 40, n, PAGE_SIZE)?;
    let max_sge = b.max_sge.get();
    Ok(Command::CreateSrq {
        pd: b.pd.get(),
        max_sge,
        srq_limit: b.srq_limit.get(),
        ring: ring(&b.ring, p, min_recv_stride(max_sge))?,
    })
}

/// MODIFY_SRQ: only the limit may change; a resize is refused, as the ring
/// is the driver's.
fn modify_srq(req: &[u8], at: usize) -> Result<Command, Refused> {
    let b: abi::ModifySrqReq = body(req, at, "MODIFY_SRQ")?;
    exact(req, at + 16)?;
    let mask = b.mask.get();
    if mask & 1 != 0 {
        return Err(Refused::unsupported("SRQ resize: the ring is the driver's"));
    }
    if mask != 2 {
        return Err(Refused::invalid("SRQ attribute mask"));
    }
    Ok(Command::ModifySrq {
        srq: b.srq.get(),
        srq_limit: b.srq_limit.get(),
    })
}

fn create_qp(req: &[u8], at: usize) -> Result<CreateQp, Refused> {
    let b: abi::CreateQpReq = body(req, at, "CREATE_QP")?;
    let qp_type = match b.qp_type {
        abi::qp_type::GSI => QpType::Gsi,
        abi::qp_type::RC => QpType::Rc,
        abi::qp_type::UC => QpType::Uc,
        abi::qp_type::UD => QpType::Ud,
        _ => return Err(Refused::unsupported("QP type")),
    };
    if b.reserved0.get() != 0 || b.sq_sig_all > 1 {
        return Err(Refused::invalid("reserved field"));
    }
    let srq = match b.srq.get() {
        0 => None,
        h => Some(h),
    };
    if qp_type == QpType::Gsi && srq.is_some() {
        return Err(Refused::invalid("the GSI QP on an SRQ"));
    }
    let sq_pages = u64::from(b.sq.npages.get());
    let rq_pages = u64::from(b.rq.npages.get());
    let all = pages(
        req,
        at + size_of::<abi::CreateQpReq>(),
        sq_pages.checked_add(rq_pages).ok_or(length("page list"))?,
        PAGE_SIZE,
    )?;
    let (sqp, rqp) = all.split_at(sq_pages as usize);
    let max_send_sge = b.max_send_sge.get();
    let max_recv_sge = b.max_recv_sge.get();
    let max_inline_data = b.max_inline_data.get();
    let sq = ring(
        &b.sq,
        sqp.to_vec(),
        min_send_stride(max_send_sge, max_inline_data),
    )?;
    let rq = match srq {
        Some(_) => {
            if b.rq != abi::RingDesc::default() || max_recv_sge != 0 {
                return Err(Refused::invalid("a QP on an SRQ has no receive ring"));
            }
            None
        }
        None => Some(ring(&b.rq, rqp.to_vec(), min_recv_stride(max_recv_sge))?),
    };
    Ok(CreateQp {
        pd: b.pd.get(),
        qp_type,
        sq_sig_all: b.sq_sig_all == 1,
        send_cq: b.send_cq.get(),
        recv_cq: b.recv_cq.get(),
        srq,
        max_send_sge,
        max_recv_sge,
        max_inline_data,
        sq,
        rq,
    })
}

/// MODIFY_QP: the QP, its attribute mask and the attributes, refusing an
/// attribute the device does not have or a bit outside the mask.
fn modify_qp(req: &[u8], at: usize) -> Result<Command, Refused> {
    let b: abi::ModifyQpReq = body(req, at, "MODIFY_QP")?;
    exact(req, at + size_of::<abi::ModifyQpReq>())?;
    let mask = b.attr_mask.get();
    let unsupported = AttrMask::ALT_PATH.0
        | AttrMask::PATH_MIG_STATE.0
        | AttrMask::RATE_LIMIT.0
        | AttrMask::CAP.0;
    if mask & unsupported != 0 {
        return Err(Refused::unsupported(
            "QP attribute the device does not have",
        ));
    }
    if mask & !0x1f_ffff != 0 {
        return Err(Refused::invalid("QP attribute mask"));
    }
    Ok(Command::ModifyQp {
        qpn: b.qpn.get(),
        mask: AttrMask(mask),
        attrs: Box::new(b.attrs),
    })
}

/// SET_GID: a GID table entry, set to a RoCEv2 GID or cleared.
fn set_gid(req: &[u8], at: usize) -> Result<Command, Refused> {
    let b: abi::SetGidReq = body(req, at, "SET_GID")?;
    exact(req, at + 24)?;
    let index = u8::try_from(b.index.get()).map_err(|_| Refused::invalid("GID index"))?;
    let gid = match b.gid_type.get() {
        abi::gid_type::NONE => None,
        abi::gid_type::ROCE_V2 => Some(Gid(b.gid)),
        _ => return Err(Refused::unsupported("GID type: RoCEv2 only")),
    };
    Ok(Command::SetGid { index, gid })
}
