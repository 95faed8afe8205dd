//! Requests and ring entries decoded from copies into typed values: the
//! only way anything the driver wrote reaches the device. Pure functions of
//! bytes (no guest memory, no device state), so every rule here is
//! exercised by unit tests, property tests and the fuzz targets.
//!
//! What needs the device (does a handle exist, is a page inside guest
//! memory, does the engine accept the attributes) is checked later, on the
//! typed values.

use vrdma_engine::{
    mr::{Access, MwType},
    qp::{AhAttr, AttrMask, QpAttr, QpState, QpType},
    wc::{NetworkHdr, Wc, WcFlags, WcStatus},
    wr::{Av, SendFlags, SendOp, Sge, UdDest},
};
use vrdma_wire::{Gid, Lkey, Psn, QKey, Qpn, Rkey};
use zerocopy::FromBytes;

use vrdma_engine::errno;
use vrdma_face::Refused;

use crate::abi::{self, PAGE_SIZE, op, status};

/// A request shorter or longer than its command, or a trailing array not
/// the length it names (EMSGSIZE: status LENGTH).
pub const fn length(what: &'static str) -> Refused {
    Refused::new(errno::EMSGSIZE.unsigned_abs(), what)
}

/// A guest address misaligned or outside guest memory (EFAULT: status
/// FAULT).
pub const fn fault(what: &'static str) -> Refused {
    Refused::new(errno::EFAULT.unsigned_abs(), what)
}

/// A handle that names no object of the command's context (ENOENT).
pub const fn noent(what: &'static str) -> Refused {
    Refused::new(errno::ENOENT.unsigned_abs(), what)
}

/// The status a refusal answers with: a function of its errno.
pub const fn status_of(r: &Refused) -> u16 {
    const fn is(r: &Refused, e: i32) -> bool {
        r.errno == e.unsigned_abs()
    }
    if is(r, errno::ENOENT) {
        status::NOENT
    } else if is(r, errno::ENOMEM) || is(r, errno::ENOSPC) {
        status::NOMEM
    } else if is(r, errno::EBUSY) {
        status::BUSY
    } else if is(r, errno::EOPNOTSUPP) {
        status::UNSUPPORTED
    } else if is(r, errno::EFAULT) {
        status::FAULT
    } else if is(r, errno::EMSGSIZE) {
        status::LENGTH
    } else if is(r, errno::EIO) {
        status::DEVICE
    } else {
        status::INVALID
    }
}

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
    let handle = |what| -> Result<u32, Refused> {
        let b: abi::HandleReq = body(req, at, what)?;
        if b.reserved.get() != 0 {
            return Err(Refused::invalid("reserved field"));
        }
        exact(req, at + 8)?;
        Ok(b.handle.get())
    };
    let command = match opcode {
        op::QUERY_DEVICE => {
            exact(req, at)?;
            Command::QueryDevice
        }
        op::QUERY_STATS => {
            exact(req, at)?;
            Command::QueryStats
        }
        op::QUERY_PORT => {
            let b: abi::PortReq = body(req, at, "QUERY_PORT")?;
            exact(req, at + 8)?;
            if b.port.get() != 1 || b.reserved.get() != 0 {
                return Err(Refused::invalid("port"));
            }
            Command::QueryPort { port: 1 }
        }
        op::CREATE_CONTEXT => {
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
            Command::CreateContext {
                doorbell_bits: bits,
                pages: pages(req, at + 8, n, PAGE_SIZE)?,
            }
        }
        op::DESTROY_CONTEXT => {
            exact(req, at)?;
            Command::DestroyContext
        }
        op::ALLOC_PD => {
            exact(req, at)?;
            Command::AllocPd
        }
        op::DEALLOC_PD => Command::DeallocPd { pd: handle("PD")? },
        op::CREATE_CQ => {
            let b: abi::CreateCqReq = body(req, at, "CREATE_CQ")?;
            let n = u64::from(b.ring.npages.get());
            let p = pages(req, at + 24, n, PAGE_SIZE)?;
            Command::CreateCq {
                ring: ring(&b.ring, p, u64::from(size_of::<abi::Cqe>() as u32))?,
            }
        }
        op::DESTROY_CQ => Command::DestroyCq { cq: handle("CQ")? },
        op::RESIZE_CQ => {
            let b: abi::ResizeCqReq = body(req, at, "RESIZE_CQ")?;
            if b.reserved.get() != 0 {
                return Err(Refused::invalid("reserved field"));
            }
            let n = u64::from(b.ring.npages.get());
            let p = pages(req, at + 32, n, PAGE_SIZE)?;
            Command::ResizeCq {
                cq: b.cq.get(),
                ring: ring(&b.ring, p, u64::from(size_of::<abi::Cqe>() as u32))?,
            }
        }
        op::REG_MR => {
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
            Command::RegMr(RegMr {
                pd: b.pd.get(),
                access,
                iova,
                length,
                page_shift: shift as u8,
                offset,
                pages: pages(req, at + 40, n, page)?,
            })
        }
        op::REG_DMA_MR => {
            let b: abi::RegDmaMrReq = body(req, at, "REG_DMA_MR")?;
            exact(req, at + 8)?;
            let access = mr_access(b.access.get())?;
            if access.contains(Access::ZERO_BASED) || access.contains(Access::MW_BIND) {
                return Err(Refused::invalid("access of a DMA MR"));
            }
            Command::RegDmaMr {
                pd: b.pd.get(),
                access,
            }
        }
        op::ALLOC_MR => {
            let b: abi::AllocMrReq = body(req, at, "ALLOC_MR")?;
            exact(req, at + 8)?;
            Command::AllocMr {
                pd: b.pd.get(),
                max_pages: b.max_pages.get(),
            }
        }
        op::DEREG_MR => Command::DeregMr {
            lkey: handle("MR")?,
        },
        op::ALLOC_MW => {
            let b: abi::AllocMwReq = body(req, at, "ALLOC_MW")?;
            exact(req, at + 8)?;
            let ty = match b.mw_type.get() {
                1 => MwType::One,
                2 => MwType::Two,
                _ => return Err(Refused::invalid("window type")),
            };
            Command::AllocMw { pd: b.pd.get(), ty }
        }
        op::DEALLOC_MW => Command::DeallocMw {
            rkey: handle("MW")?,
        },
        op::CREATE_SRQ => {
            let b: abi::CreateSrqReq = body(req, at, "CREATE_SRQ")?;
            if b.reserved.get() != 0 {
                return Err(Refused::invalid("reserved field"));
            }
            let n = u64::from(b.ring.npages.get());
            let p = pages(req, at + 40, n, PAGE_SIZE)?;
            let max_sge = b.max_sge.get();
            Command::CreateSrq {
                pd: b.pd.get(),
                max_sge,
                srq_limit: b.srq_limit.get(),
                ring: ring(&b.ring, p, min_recv_stride(max_sge))?,
            }
        }
        op::MODIFY_SRQ => {
            let b: abi::ModifySrqReq = body(req, at, "MODIFY_SRQ")?;
            exact(req, at + 16)?;
            let mask = b.mask.get();
            if mask & 1 != 0 {
                return Err(Refused::unsupported("SRQ resize: the ring is the driver's"));
            }
            if mask != 2 {
                return Err(Refused::invalid("SRQ attribute mask"));
            }
            Command::ModifySrq {
                srq: b.srq.get(),
                srq_limit: b.srq_limit.get(),
            }
        }
        op::QUERY_SRQ => Command::QuerySrq {
            srq: handle("SRQ")?,
        },
        op::DESTROY_SRQ => Command::DestroySrq {
            srq: handle("SRQ")?,
        },
        op::CREATE_QP => Command::CreateQp(create_qp(req, at)?),
        op::MODIFY_QP => {
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
            Command::ModifyQp {
                qpn: b.qpn.get(),
                mask: AttrMask(mask),
                attrs: Box::new(b.attrs),
            }
        }
        op::QUERY_QP => Command::QueryQp { qpn: handle("QP")? },
        op::DESTROY_QP => Command::DestroyQp { qpn: handle("QP")? },
        op::SET_GID => {
            let b: abi::SetGidReq = body(req, at, "SET_GID")?;
            exact(req, at + 24)?;
            let index = u8::try_from(b.index.get()).map_err(|_| Refused::invalid("GID index"))?;
            let gid = match b.gid_type.get() {
                abi::gid_type::NONE => None,
                abi::gid_type::ROCE_V2 => Some(Gid(b.gid)),
                _ => return Err(Refused::unsupported("GID type: RoCEv2 only")),
            };
            Command::SetGid { index, gid }
        }
        _ => return Err(Refused::unsupported("opcode")),
    };
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

/// An address vector, typed.
pub fn ah_attr(av: &abi::Av, port: u8) -> Result<AhAttr, Refused> {
    // A zero GID names no port (RoCEv2 has no address 0.0.0.0 or ::).
    if av.reserved.get() != 0 || av.dgid == [0; 16] {
        return Err(Refused::invalid("address vector"));
    }
    // §6.27: the device uses a flow label's low 20 bits and ignores the
    // rest, as hardware whose field is 20 bits does.
    Ok(AhAttr {
        dgid: Gid(av.dgid),
        flow_label: av.flow_label.get() & AhAttr::FLOW_LABEL_MASK,
        sgid_index: av.sgid_index,
        hop_limit: av.hop_limit,
        traffic_class: av.traffic_class,
        sl: av.sl,
        port_num: port,
        dmac: Some(av.dmac),
    })
}

/// The attributes a MODIFY_QP asks for: the masked fields from the
/// request, the rest from `cur` (the QP as it is). The engine then checks
/// the transition and the ranges.
pub fn qp_attr(cur: &QpAttr, mask: AttrMask, a: &abi::QpAttrs) -> Result<QpAttr, Refused> {
    let m = |bit: AttrMask| mask.contains(bit);
    let state = |v: u32| QpState::from_code(v).ok_or(Refused::invalid("QP state"));
    if a.sq_draining != 0 || a.reserved != 0 {
        return Err(Refused::invalid("reserved field"));
    }
    let port = if m(AttrMask::PORT) {
        a.port_num
    } else {
        cur.port_num
    };
    Ok(QpAttr {
        qp_state: if m(AttrMask::STATE) {
            state(a.qp_state.get())?
        } else {
            cur.qp_state
        },
        cur_qp_state: if m(AttrMask::CUR_STATE) {
            state(a.cur_qp_state.get())?
        } else {
            cur.qp_state
        },
        path_mtu: if m(AttrMask::PATH_MTU) {
            vrdma_engine::attr::Mtu::from_code(a.path_mtu.get())
                .ok_or(Refused::invalid("path MTU"))?
        } else {
            cur.path_mtu
        },
        qkey: if m(AttrMask::QKEY) {
            QKey(a.qkey.get())
        } else {
            cur.qkey
        },
        rq_psn: if m(AttrMask::RQ_PSN) {
            Psn::from_masked(a.rq_psn.get())
        } else {
            cur.rq_psn
        },
        sq_psn: if m(AttrMask::SQ_PSN) {
            Psn::from_masked(a.sq_psn.get())
        } else {
            cur.sq_psn
        },
        dest_qp_num: if m(AttrMask::DEST_QPN) {
            Qpn::try_from(a.dest_qp_num.get()).map_err(|_| Refused::invalid("destination QPN"))?
        } else {
            cur.dest_qp_num
        },
        qp_access_flags: if m(AttrMask::ACCESS_FLAGS) {
            let v = a.qp_access_flags.get();
            if v & !0xf != 0 {
                return Err(Refused::invalid("QP access flags"));
            }
            Access(v)
        } else {
            cur.qp_access_flags
        },
        cap: cur.cap,
        ah_attr: if m(AttrMask::AV) {
            ah_attr(&a.ah, port)?
        } else {
            cur.ah_attr
        },
        pkey_index: if m(AttrMask::PKEY_INDEX) {
            a.pkey_index.get()
        } else {
            cur.pkey_index
        },
        en_sqd_async_notify: if m(AttrMask::EN_SQD_ASYNC_NOTIFY) {
            a.en_sqd_async_notify != 0
        } else {
            cur.en_sqd_async_notify
        },
        sq_draining: false,
        max_rd_atomic: if m(AttrMask::MAX_QP_RD_ATOMIC) {
            a.max_rd_atomic
        } else {
            cur.max_rd_atomic
        },
        max_dest_rd_atomic: if m(AttrMask::MAX_DEST_RD_ATOMIC) {
            a.max_dest_rd_atomic
        } else {
            cur.max_dest_rd_atomic
        },
        min_rnr_timer: if m(AttrMask::MIN_RNR_TIMER) {
            a.min_rnr_timer
        } else {
            cur.min_rnr_timer
        },
        port_num: port,
        timeout: if m(AttrMask::TIMEOUT) {
            a.timeout
        } else {
            cur.timeout
        },
        retry_cnt: if m(AttrMask::RETRY_CNT) {
            a.retry_cnt
        } else {
            cur.retry_cnt
        },
        rnr_retry: if m(AttrMask::RNR_RETRY) {
            a.rnr_retry
        } else {
            cur.rnr_retry
        },
    })
}

/// The attribute block QUERY_QP returns.
pub fn qp_attrs(a: &QpAttr) -> abi::QpAttrs {
    abi::QpAttrs {
        qp_state: a.qp_state.code().into(),
        cur_qp_state: a.cur_qp_state.code().into(),
        path_mtu: (a.path_mtu as u32).into(),
        qkey: a.qkey.0.into(),
        rq_psn: a.rq_psn.value().into(),
        sq_psn: a.sq_psn.value().into(),
        dest_qp_num: a.dest_qp_num.value().into(),
        qp_access_flags: a.qp_access_flags.0.into(),
        pkey_index: a.pkey_index.into(),
        en_sqd_async_notify: u8::from(a.en_sqd_async_notify),
        sq_draining: u8::from(a.sq_draining),
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        reserved: 0,
        ah: abi::Av {
            dgid: a.ah_attr.dgid.0,
            flow_label: a.ah_attr.flow_label.into(),
            sgid_index: a.ah_attr.sgid_index,
            hop_limit: a.ah_attr.hop_limit,
            traffic_class: a.ah_attr.traffic_class,
            sl: a.ah_attr.sl,
            dmac: a.ah_attr.dmac.unwrap_or_default(),
            reserved: 0.into(),
        },
    }
}

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

/// The CQE a work completion becomes.
pub fn cqe(wc: &Wc) -> abi::Cqe {
    let mut flags = 0u16;
    if wc.wc_flags.contains(WcFlags::GRH) {
        flags |= abi::wc_flags::GRH;
    }
    if wc.wc_flags.contains(WcFlags::WITH_IMM) {
        flags |= abi::wc_flags::WITH_IMM;
    }
    if wc.wc_flags.contains(WcFlags::WITH_INV) {
        flags |= abi::wc_flags::WITH_INV;
    }
    // The immediate travels as its wire bytes; an invalidated rkey as a
    // number.
    let ex = if wc.wc_flags.contains(WcFlags::WITH_IMM) {
        u32::from_le_bytes(wc.imm_data.to_be_bytes())
    } else {
        wc.imm_data
    };
    abi::Cqe {
        wr_id: wc.wr_id.into(),
        status: wc.status as u8,
        opcode: wc.opcode as u8,
        wc_flags: flags.into(),
        qpn: wc.qp_num.into(),
        byte_len: wc.byte_len.into(),
        ex: ex.into(),
        // A send queue's completion carries the QP's count of send WQEs
        // retired through it (§7.8): with it a driver counts outstanding
        // WQEs as verbs do, unsignaled ones included.
        src_qp: if (wc.opcode as u8) & abi::OPCODE_RECV_BIT == 0 {
            wc.sq_retired
        } else {
            wc.src_qp
        }
        .into(),
        pkey_index: wc.pkey_index.into(),
        sl: wc.sl,
        network_hdr_type: match wc.network_hdr {
            None => 0,
            Some(NetworkHdr::Ipv4) => 2,
            Some(NetworkHdr::Ipv6) => 3,
        },
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use zerocopy::{FromZeros, IntoBytes};

    use super::*;

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
            Payload::Sges(vec![Sge {
                addr: 0x2000,
                length: 8,
                lkey: Lkey(5)
            }])
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
}
