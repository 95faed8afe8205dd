//! The command channel: each request is copied out of the command slot
//! (all 184 bytes, once), decoded by its command code into the driver's
//! structure, checked field by field, and run on the face's state; the
//! response goes into the response slot. A command refused (the face
//! core's `Refused`: the errno the engine gives, EINVAL for what the face
//! refused itself) is an ERR value and a response header with `err` set.

use vm_memory::GuestMemoryMmap;
use vrdma_device::Transport;
use vrdma_engine::{
    CqHandle, PdHandle, SrqHandle,
    attr::{Mtu, PortState},
    mr::{Access, MrRequest, Translation},
    objects::{SrqAttr, SrqAttrMask},
    qp::{AhAttr, AttrMask, QpAttr, QpCap, QpInitAttr, QpState, QpType},
};
use vrdma_face::{OrRefuse, Owner, PageList, Refused, Rings};
use vrdma_wire::{Gid, PKey, Psn, QKey, Qpn};
use zerocopy::{FromBytes, Immutable, IntoBytes};

use crate::{
    abi::{self, PAGE_SIZE, RespHdr, cmd, err},
    cq::{self, GuestCq},
    qp::{self, QpContext, QpFace},
    ring,
    srq::SrqFace,
    state::{CqInfo, State},
};

/// A command that ran: its response, and whether the driver waits for it
/// (and so gets an interrupt).
#[derive(Debug)]
pub(crate) struct Done {
    pub response: Vec<u8>,
    pub wait: bool,
}

/// A command that failed.
#[derive(Debug)]
pub(crate) struct Failure {
    pub cmd: u32,
    pub key: u64,
    /// The ERR register's value (non-zero): the errno, or what no errno
    /// says (an unknown command).
    pub err: u32,
    pub what: &'static str,
}

impl Failure {
    /// The response header that says so: `err` is the errno, as QEMU's
    /// device puts it there (0xff for what no errno fits, never 0: the
    /// driver's MODIFY_QP tests `err > 0`).
    pub fn response(&self) -> Vec<u8> {
        RespHdr {
            response: self.key.into(),
            ack: (cmd::ACK | self.cmd).into(),
            err: u8::try_from(self.err).unwrap_or(u8::MAX).max(1),
            reserved: [0; 3],
        }
        .as_bytes()
        .to_vec()
    }
}

/// Runs one command (`req` is the slot's copy) on `s`; `uar_pfn` is the
/// page frame of doorbell page 0, as the shared region gave it.
pub(crate) fn run<T: Transport>(
    s: &mut State<T>,
    mem: &GuestMemoryMmap<()>,
    req: &[u8],
    uar_pfn: u64,
) -> Result<Done, Failure> {
    // The answers to packets already received (the engine sends them in
    // its next round) go out before the command acts: the guest may have
    // read a message's completion and be destroying its QP, which would
    // take the message's ACK with it and leave the peer resending into
    // the void (ibv_rc_pingpong's client does exactly that).
    s.dev.device.send_pending();
    let hdr: abi::CmdHdr = decode(req);
    let (code, key) = (hdr.cmd.get(), hdr.response.get());
    let reply = Reply { code, key };
    let outcome = match code {
        cmd::QUERY_PORT => query_port(s, req, reply),
        cmd::QUERY_PKEY => query_pkey(req, reply),
        cmd::CREATE_UC => create_uc(s, req, reply, uar_pfn),
        cmd::DESTROY_UC => destroy_uc(s, req, reply),
        cmd::CREATE_PD => create_pd(s, req, reply),
        cmd::DESTROY_PD => destroy_pd(s, req, reply),
        cmd::CREATE_MR => create_mr(s, mem, req, reply),
        cmd::DESTROY_MR => destroy_mr(s, req, reply),
        cmd::CREATE_CQ => create_cq(s, mem, req, reply),
        cmd::RESIZE_CQ => Err(Refused::unsupported(
            "RESIZE_CQ (the driver never issues it)",
        )),
        cmd::DESTROY_CQ => destroy_cq(s, req, reply),
        cmd::CREATE_QP => create_qp(s, mem, req, reply),
        cmd::MODIFY_QP => modify_qp(s, req, reply),
        cmd::QUERY_QP => query_qp(s, req, reply),
        cmd::DESTROY_QP => destroy_qp(s, req, reply),
        cmd::CREATE_BIND => create_bind(s, req, reply),
        cmd::DESTROY_BIND => destroy_bind(s, req, reply),
        cmd::CREATE_SRQ => create_srq(s, mem, req, reply),
        cmd::MODIFY_SRQ => modify_srq(s, req, reply),
        cmd::QUERY_SRQ => query_srq(s, req, reply),
        cmd::DESTROY_SRQ => destroy_srq(s, req, reply),
        _ => {
            return Err(Failure {
                cmd: code,
                key,
                err: err::BAD_COMMAND,
                what: "unknown command",
            });
        }
    };
    outcome.map_err(|r| Failure {
        cmd: code,
        key,
        err: r.errno,
        what: r.what,
    })
}

/// The command being answered: its code and the driver's key for the
/// response.
#[derive(Clone, Copy, Debug)]
struct Reply {
    code: u32,
    key: u64,
}

impl Reply {
    /// The header of a response that says the command ran.
    fn hdr(self) -> RespHdr {
        RespHdr {
            response: self.key.into(),
            ack: (cmd::ACK | self.code).into(),
            err: 0,
            reserved: [0; 3],
        }
    }

    /// A response the driver waits for: the header, then `body`.
    fn done<B: IntoBytes + Immutable + ?Sized>(self, body: &B) -> Result<Done, Refused> {
        let mut response = self.hdr().as_bytes().to_vec();
        response.extend_from_slice(body.as_bytes());
        Ok(Done {
            response,
            wait: true,
        })
    }

    /// A response the driver waits for, whole (its header included).
    fn whole<B: IntoBytes + Immutable>(self, response: &B) -> Result<Done, Refused> {
        Ok(Done {
            response: response.as_bytes().to_vec(),
            wait: true,
        })
    }

    /// The response of a command the driver does not wait for (no
    /// interrupt): the header alone.
    fn quiet(self) -> Result<Done, Refused> {
        Ok(Done {
            response: self.hdr().as_bytes().to_vec(),
            wait: false,
        })
    }
}

/// The request structure a command carries, read from its copy.
fn decode<T: FromBytes + Immutable + Default>(req: &[u8]) -> T {
    // Every request type fits the slot's copy (MAX_REQUEST bytes, the
    // largest request's size); a shorter copy reads as zeros.
    T::read_from_prefix(req).map(|(v, _)| v).unwrap_or_default()
}

/// A handle answered in an 8-byte body.
fn handle_body(handle: u32) -> [u8; 8] {
    let mut body = [0u8; 8];
    body[..4].copy_from_slice(&handle.to_le_bytes());
    body
}

/// The MR access bits the device implements (no on-demand paging, no
/// relaxed ordering: those bits are ignored, as the driver passes them
/// through unchecked).
fn access(v: u32) -> Access {
    Access(v & 0x3f)
}

fn query_port<T: Transport>(s: &State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::QueryPort = decode(req);
    if r.port_num != 1 {
        return Err(Refused::invalid("port number"));
    }
    let port = s.dev.device.engine().query_port(1).or_refuse("port")?;
    let active = port.state == PortState::Active;
    let attrs = abi::PortAttr {
        state: (port.state as u32).into(),
        max_mtu: (port.max_mtu as u32).into(),
        active_mtu: (port.active_mtu as u32).into(),
        gid_tbl_len: s.limits.gid_tbl_len.into(),
        port_cap_flags: 0.into(),
        max_msg_sz: 0x8000_0000.into(),
        pkey_tbl_len: 1.into(),
        // 1X EDR, as rxe reports.
        active_width: 1,
        active_speed: 32,
        // LinkUp or Disabled.
        phys_state: if active { 5 } else { 3 },
        max_vl_num: 1,
        ..abi::PortAttr::default()
    };
    reply.done(&attrs)
}

fn query_pkey(req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::QueryPkey = decode(req);
    if r.port_num != 1 || r.index != 0 {
        return Err(Refused::invalid("P_Key index"));
    }
    let mut body = [0u8; 8];
    body[..2].copy_from_slice(&PKey::DEFAULT.0.to_le_bytes());
    reply.done(&body)
}

fn create_uc<T: Transport>(
    s: &mut State<T>,
    req: &[u8],
    reply: Reply,
    uar_pfn: u64,
) -> Result<Done, Refused> {
    let r: abi::CreateUc = decode(req);
    // The context's doorbell page: its frame number relative to page 0's,
    // never page 0 (the kernel's) and inside BAR2.
    let page = r.pfn64.get().wrapping_sub(uar_pfn);
    if page == 0 || page >= u64::from(s.limits.max_uar) {
        return Err(Refused::invalid("UAR page"));
    }
    if s.ucs.values().any(|&p| u64::from(p) == page) {
        return Err(Refused::invalid("UAR page in use"));
    }
    let handle = s.next_uc;
    s.next_uc = s.next_uc.wrapping_add(1).max(1);
    s.ucs.insert(handle, page as u32);
    reply.done(&handle_body(handle))
}

fn destroy_uc<T: Transport>(s: &mut State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::Handle = decode(req);
    let h = r.handle.get();
    // (0, the kernel's, is no context: EINVAL, not EBUSY.)
    let page = *s.ucs.get(&h).or_refuse("context")?;
    if s.pds.values().any(|&c| c == h) {
        return Err(Refused::busy("context still has PDs"));
    }
    // Its CQs too (they hold no PD): gone with the context, their doorbell
    // page would ring them for the next context given that page.
    if s.cqs.values().any(|c| c.uar == page) {
        return Err(Refused::busy("context still has CQs"));
    }
    s.ucs.remove(&h);
    reply.quiet()
}

fn create_pd<T: Transport>(s: &mut State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::Handle = decode(req);
    let ctx = r.handle.get();
    if ctx != 0 && !s.ucs.contains_key(&ctx) {
        return Err(Refused::invalid("context"));
    }
    let pd = s.dev.device.engine_mut().alloc_pd().or_refuse("PD")?;
    s.pds.insert(pd.0, ctx);
    reply.done(&handle_body(pd.0))
}

fn destroy_pd<T: Transport>(s: &mut State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::Handle = decode(req);
    let pd = r.handle.get();
    if !s.pds.contains_key(&pd) {
        return Err(Refused::invalid("PD"));
    }
    s.dev
        .device
        .engine_mut()
        .dealloc_pd(PdHandle(pd))
        .or_refuse("PD")?;
    s.pds.remove(&pd);
    reply.quiet()
}

fn destroy_mr<T: Transport>(s: &mut State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::Handle = decode(req);
    let engine = s.dev.device.engine_mut();
    let lkey = engine.current_lkey(r.handle.get()).or_refuse("MR")?;
    engine.dereg_mr(lkey).or_refuse("MR")?;
    reply.quiet()
}

fn destroy_cq<T: Transport>(s: &mut State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::Handle = decode(req);
    let cq = r.handle.get();
    if !s.cqs.contains_key(&cq) {
        return Err(Refused::invalid("CQ"));
    }
    s.dev
        .device
        .engine_mut()
        .destroy_cq(CqHandle(cq))
        .or_refuse("CQ")?;
    s.cqs.remove(&cq);
    s.dev.claims.release(Owner::Cq(cq));
    reply.quiet()
}

fn destroy_qp<T: Transport>(s: &mut State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::Handle = decode(req);
    let h = r.handle.get();
    let qpn = s.dev.qps.get(&h).or_refuse("QP")?.qpn();
    s.dev.device.engine_mut().destroy_qp(qpn).or_refuse("QP")?;
    s.dev.remove_qp(h);
    s.dev.claims.release(Owner::Qp(h));
    reply.quiet()
}

fn create_bind<T: Transport>(s: &mut State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::CreateBind = decode(req);
    let index = r.index.get();
    if index >= s.limits.gid_tbl_len {
        return Err(Refused::invalid("GID index"));
    }
    if r.gid_type != abi::GID_TYPE_ROCE_V2 {
        return Err(Refused::invalid("GID type (RoCEv2 only)"));
    }
    // An address the guest was not given (spoofing another tenant's,
    // through the device) is refused, and counted.
    s.dev.set_gid(index as u8, Some(Gid(r.new_gid)))?;
    reply.quiet()
}

fn destroy_bind<T: Transport>(s: &mut State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::DestroyBind = decode(req);
    let index = r.index.get();
    if index >= s.limits.gid_tbl_len {
        return Err(Refused::invalid("GID index"));
    }
    s.dev.set_gid(index as u8, None)?;
    reply.quiet()
}

fn modify_srq<T: Transport>(s: &mut State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::ModifySrq = decode(req);
    let srq = r.srq_handle.get();
    if !s.dev.srqs.contains_key(&srq) {
        return Err(Refused::invalid("SRQ"));
    }
    let mask = SrqAttrMask(r.attr_mask.get() & 3);
    let attr = SrqAttr {
        max_wr: r.attrs.max_wr.get(),
        max_sge: r.attrs.max_sge.get(),
        srq_limit: r.attrs.srq_limit.get(),
    };
    s.dev
        .device
        .engine_mut()
        .modify_srq(SrqHandle(srq), attr, mask)
        .or_refuse("SRQ")?;
    reply.quiet()
}

fn query_srq<T: Transport>(s: &State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::Handle = decode(req);
    let srq = r.handle.get();
    if !s.dev.srqs.contains_key(&srq) {
        return Err(Refused::invalid("SRQ"));
    }
    let a = s
        .dev
        .device
        .engine()
        .query_srq(SrqHandle(srq))
        .or_refuse("SRQ")?;
    let attrs = abi::SrqAttr {
        max_wr: a.max_wr.into(),
        max_sge: a.max_sge.into(),
        srq_limit: a.srq_limit.into(),
        reserved: 0.into(),
    };
    reply.done(&attrs)
}

fn destroy_srq<T: Transport>(s: &mut State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::Handle = decode(req);
    let srq = r.handle.get();
    if !s.dev.srqs.contains_key(&srq) {
        return Err(Refused::invalid("SRQ"));
    }
    s.dev
        .device
        .engine_mut()
        .destroy_srq(SrqHandle(srq))
        .or_refuse("SRQ")?;
    s.dev.remove_srq(srq);
    s.dev.claims.release(Owner::Srq(srq));
    reply.quiet()
}

fn create_mr<T: Transport>(
    s: &mut State<T>,
    mem: &GuestMemoryMmap<()>,
    req: &[u8],
    reply: Reply,
) -> Result<Done, Refused> {
    let r: abi::CreateMr = decode(req);
    let pd = r.pd_handle.get();
    if !s.pds.contains_key(&pd) {
        return Err(Refused::invalid("PD"));
    }
    let pd = PdHandle(pd);
    let acc = access(r.access_flags.get());
    let (lkey, rkey) = match r.flags.get() {
        abi::MR_FLAG_DMA => s
            .dev
            .device
            .engine_mut()
            .reg_dma_mr(pd, acc)
            .or_refuse("MR")?,
        abi::MR_FLAG_FRMR => {
            let n = r.nchunks.get();
            if n == 0 || n > abi::MAX_FAST_REG_PAGES {
                return Err(Refused::invalid("fast-registration pages"));
            }
            let l = s.dev.device.engine_mut().alloc_mr(pd, n).or_refuse("MR")?;
            (l, vrdma_wire::Rkey(l.0))
        }
        0 => {
            let start = r.start.get();
            let length = r.length.get();
            if length == 0 || length > s.limits.max_mr_size {
                return Err(Refused::invalid("MR length"));
            }
            if acc.contains(Access::ZERO_BASED) {
                // The driver does not pass an IOVA; a zero-based MR
                // cannot be honoured.
                return Err(Refused::invalid("zero-based MR"));
            }
            let Some(last) = start.checked_add(length - 1) else {
                return Err(Refused::invalid("MR range"));
            };
            // The pages the range spans, in 64-bit arithmetic
            // (CVE-2021-3582): exactly what the directory must list.
            let span = (last / PAGE_SIZE) - (start / PAGE_SIZE) + 1;
            if u64::from(r.nchunks.get()) != span {
                return Err(Refused::invalid("MR page count"));
            }
            // The page list is read only if the guest's objects have
            // room for it: a short directory can name a long one.
            s.dev
                .device
                .engine_mut()
                .check_mr_pages(span as usize)
                .or_refuse("MR")?;
            let pages = PageList::read_directory(mem, r.pdir_dma.get(), span)
                .or_refuse("MR page directory")?;
            s.dev
                .device
                .engine_mut()
                .reg_mr(MrRequest {
                    pd,
                    iova: start,
                    length,
                    access: acc,
                    translation: Translation::Pages {
                        page_shift: 12,
                        offset: start % PAGE_SIZE,
                        pages: pages.into_pages(),
                    },
                })
                .or_refuse("MR")?
        }
        _ => return Err(Refused::invalid("MR flags")),
    };
    let body = abi::CreateMrResp {
        hdr: reply.hdr(),
        mr_handle: (lkey.0 >> 8).into(),
        lkey: lkey.0.into(),
        rkey: rkey.0.into(),
        reserved: [0; 4],
    };
    reply.whole(&body)
}

fn create_cq<T: Transport>(
    s: &mut State<T>,
    mem: &GuestMemoryMmap<()>,
    req: &[u8],
    reply: Reply,
) -> Result<Done, Refused> {
    let r: abi::CreateCq = decode(req);
    let ctx = r.ctx_handle.get();
    let page = if ctx == 0 {
        0
    } else {
        *s.ucs.get(&ctx).or_refuse("context")?
    };
    let cqe = r.cqe.get();
    if !cqe.is_power_of_two() || cqe > s.limits.max_cqe {
        return Err(Refused::invalid("CQ size"));
    }
    let n = u64::from(r.nchunks.get());
    let need = 1 + (u64::from(cqe) * size_of::<abi::Cqe>() as u64).div_ceil(PAGE_SIZE);
    // The state page and the entries; a user buffer may have a page
    // more, nothing like twice as many (CVE-2018-20125).
    if n < need || n > need + 1 {
        return Err(Refused::invalid("CQ pages"));
    }
    let pages =
        PageList::read_directory(mem, r.pdir_dma.get(), n).or_refuse("CQ page directory")?;
    if s.dev.claims.conflict(pages.pages()).is_some() {
        return Err(Refused::invalid("CQ pages (another ring's)"));
    }
    let ring = ring::ring(
        cqe,
        size_of::<abi::Cqe>() as u64,
        pages.pages()[0] + abi::ring_state::RX,
        pages.skip(1),
    )
    .or_refuse("CQ ring")?;
    let sink = GuestCq::new(s.dev.shared.clone(), ring, cq::cqe).or_refuse("CQ ring state")?;
    let (cq, granted) = s
        .dev
        .device
        .engine_mut()
        .create_cq_with_sink(cqe, 0, Box::new(sink))
        .or_refuse("CQ")?;
    s.cqs.insert(cq.0, CqInfo { uar: page });
    s.dev.claims.claim(Owner::Cq(cq.0), pages.pages(), &[]);
    let body = abi::CreateCqResp {
        hdr: reply.hdr(),
        cq_handle: cq.0.into(),
        cqe: granted.into(),
    };
    reply.whole(&body)
}

fn create_qp<T: Transport>(
    s: &mut State<T>,
    mem: &GuestMemoryMmap<()>,
    req: &[u8],
    reply: Reply,
) -> Result<Done, Refused> {
    let r: abi::CreateQp = decode(req);
    let ty = match r.qp_type {
        abi::qp_type::GSI => QpType::Gsi,
        abi::qp_type::RC => QpType::Rc,
        abi::qp_type::UC => QpType::Uc,
        abi::qp_type::UD => QpType::Ud,
        _ => return Err(Refused::invalid("QP type")),
    };
    let pd = r.pd_handle.get();
    let page = s.pd_page(pd).or_refuse("PD")?;
    // The CQs and the SRQ must be the PD's context's (their doorbell
    // page says whose), as the driver's own tables ensure: another
    // context's CQ would see this QP's completions.
    for cq in [r.send_cq_handle.get(), r.recv_cq_handle.get()] {
        if s.cqs.get(&cq).is_none_or(|c| c.uar != page) {
            return Err(Refused::invalid("CQ"));
        }
    }
    let is_srq = r.is_srq != 0;
    let srq = if is_srq {
        let h = r.srq_handle.get();
        if s.dev.srqs.get(&h).is_none_or(|f| f.uar != page) {
            return Err(Refused::invalid("SRQ"));
        }
        Some(SrqHandle(h))
    } else {
        None
    };
    let (sw, rw) = (r.max_send_wr.get(), r.max_recv_wr.get());
    let (ss, rs) = (r.max_send_sge.get(), r.max_recv_sge.get());
    // Ring sizes are powers of two, as the driver and the provider
    // round them (and as CQs and SRQs must be).
    if !sw.is_power_of_two() || sw > s.limits.max_qp_wr || ss > s.limits.max_sge {
        return Err(Refused::invalid("send queue size"));
    }
    if !is_srq && (!rw.is_power_of_two() || rw > s.limits.max_qp_wr || rs > s.limits.max_sge) {
        return Err(Refused::invalid("receive queue size"));
    }
    if r.max_inline_data.get() != 0 {
        return Err(Refused::invalid("inline data"));
    }
    // The rings' strides and pages, as the driver and provider lay
    // them out; the page counts must be exactly enough, never a huge
    // count to chew on (CVE-2018-20125).
    let sstride = qp::sq_stride(ss.max(1));
    let rstride = qp::rq_stride(rs.max(1));
    let total = u64::from(r.total_chunks.get());
    let send_chunks = u64::from(r.send_chunks.get());
    let send_need = (u64::from(sw) * sstride).div_ceil(PAGE_SIZE);
    let recv_need = if is_srq {
        0
    } else {
        (u64::from(rw) * rstride).div_ceil(PAGE_SIZE)
    };
    let recv_pages = total.checked_sub(1 + send_chunks).or_refuse("QP pages")?;
    if send_chunks < send_need
        || send_chunks > send_need + 1
        || recv_pages < recv_need
        || recv_pages > recv_need + 1
    {
        return Err(Refused::invalid("QP pages"));
    }
    let pages =
        PageList::read_directory(mem, r.pdir_dma.get(), total).or_refuse("QP page directory")?;
    if s.dev.claims.conflict(pages.pages()).is_some() {
        return Err(Refused::invalid("QP pages (another ring's)"));
    }
    let (sq, rq) = qp::rings(
        &pages,
        send_chunks as u32,
        sw,
        sstride,
        rw,
        rstride,
        !is_srq,
    )
    .or_refuse("QP rings")?;
    let init = QpInitAttr {
        pd: PdHandle(pd),
        send_cq: CqHandle(r.send_cq_handle.get()),
        recv_cq: CqHandle(r.recv_cq_handle.get()),
        srq,
        cap: QpCap {
            max_send_wr: sw,
            max_recv_wr: if is_srq { 0 } else { rw },
            max_send_sge: ss,
            max_recv_sge: if is_srq { 0 } else { rs },
            max_inline_data: 0,
        },
        qp_type: ty,
        sq_sig_all: r.sq_sig_all != 0,
    };
    let (qpn, _) = s.dev.device.engine_mut().create_qp(init).or_refuse("QP")?;
    let ctx = QpContext {
        ty: r.qp_type,
        pd,
        max_send_sge: ss,
        stride: sstride,
    };
    s.dev
        .qps
        .insert(qpn.value(), QpFace::new(qpn, ctx, page, sq, rq, rs));
    s.dev
        .claims
        .claim(Owner::Qp(qpn.value()), pages.pages(), &[]);
    let body = abi::CreateQpRespV2 {
        hdr: reply.hdr(),
        qpn: qpn.value().into(),
        // The handle is the QP number.
        qp_handle: qpn.value().into(),
        max_send_wr: sw.into(),
        max_recv_wr: rw.into(),
        max_send_sge: ss.into(),
        max_recv_sge: rs.into(),
        max_inline_data: 0.into(),
        reserved: [0; 4],
    };
    reply.whole(&body)
}

fn modify_qp<T: Transport>(s: &mut State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::ModifyQp = decode(req);
    let h = r.qp_handle.get();
    let qpn = s.dev.qps.get(&h).or_refuse("QP")?.qpn();
    let mask = AttrMask(r.attr_mask.get() & 0x1f_ffff);
    let a = &r.attrs;
    let m = |bit: AttrMask| mask.contains(bit);
    // Only the masked fields are the consumer's; the rest may be
    // anything and are not looked at.
    let cur = *s.dev.device.engine().query_qp(qpn).or_refuse("QP")?.0;
    let state = |v: u32| QpState::from_code(v).or_refuse("QP state");
    let attr = QpAttr {
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
            Mtu::from_code(a.path_mtu.get()).or_refuse("path MTU")?
        } else {
            cur.path_mtu
        },
        qkey: QKey(a.qkey.get()),
        rq_psn: Psn::from_masked(a.rq_psn.get()),
        sq_psn: Psn::from_masked(a.sq_psn.get()),
        dest_qp_num: Qpn::from_masked(a.dest_qp_num.get()),
        qp_access_flags: Access(a.qp_access_flags.get() & 0xf),
        cap: cur.cap,
        ah_attr: AhAttr {
            dgid: Gid(a.ah_attr.dgid),
            flow_label: a.ah_attr.flow_label.get() & AhAttr::FLOW_LABEL_MASK,
            sgid_index: a.ah_attr.sgid_index,
            hop_limit: a.ah_attr.hop_limit,
            traffic_class: a.ah_attr.traffic_class,
            sl: a.ah_attr.sl,
            port_num: a.ah_attr.port_num,
            dmac: Some(a.ah_attr.dmac),
        },
        pkey_index: a.pkey_index.get(),
        en_sqd_async_notify: a.en_sqd_async_notify != 0,
        sq_draining: false,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
    };
    // A change of queue sizes is not supported (the driver never asks).
    let mask = mask.without(AttrMask::CAP);
    let engine = s.dev.device.engine_mut();
    engine.modify_qp(qpn, &attr, mask).map_err(|e| {
        tracing::debug!(error = %e, mask = mask.0, "MODIFY_QP refused by the engine");
        Refused::verbs(&e, "QP attributes")
    })?;
    let now = engine
        .query_qp(qpn)
        .map(|(a, _)| a.qp_state)
        .unwrap_or(QpState::Err);
    if let Some(q) = s.dev.qps.get_mut(&h)
        && now == QpState::Reset
    {
        // The driver zeroes the rings' indices; so does the device.
        q.queues.reset();
    }
    // WQEs that waited for RTS (or for INIT, receives).
    s.dev.take_qp(h, Rings::BOTH);
    reply.done(&[0u8; 0])
}

fn query_qp<T: Transport>(s: &State<T>, req: &[u8], reply: Reply) -> Result<Done, Refused> {
    let r: abi::QueryQp = decode(req);
    let h = r.qp_handle.get();
    let qpn = s.dev.qps.get(&h).or_refuse("QP")?.qpn();
    let (a, init) = s.dev.device.engine().query_qp(qpn).or_refuse("QP")?;
    let attrs = abi::QpAttr {
        qp_state: a.qp_state.code().into(),
        cur_qp_state: a.cur_qp_state.code().into(),
        path_mtu: (a.path_mtu as u32).into(),
        path_mig_state: 0.into(),
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
        cap: abi::QpCap {
            max_send_wr: init.cap.max_send_wr.into(),
            max_recv_wr: init.cap.max_recv_wr.into(),
            max_send_sge: init.cap.max_send_sge.into(),
            max_recv_sge: init.cap.max_recv_sge.into(),
            max_inline_data: 0.into(),
            reserved: 0.into(),
        },
        ah_attr: abi::AhAttr {
            dgid: a.ah_attr.dgid.0,
            flow_label: a.ah_attr.flow_label.into(),
            sgid_index: a.ah_attr.sgid_index,
            hop_limit: a.ah_attr.hop_limit,
            traffic_class: a.ah_attr.traffic_class,
            sl: a.ah_attr.sl,
            port_num: a.ah_attr.port_num,
            // RoCE: the GRH is always there.
            ah_flags: 1,
            dmac: a.ah_attr.dmac.unwrap_or_default(),
            ..abi::AhAttr::default()
        },
        ..abi::QpAttr::default()
    };
    reply.done(&attrs)
}

fn create_srq<T: Transport>(
    s: &mut State<T>,
    mem: &GuestMemoryMmap<()>,
    req: &[u8],
    reply: Reply,
) -> Result<Done, Refused> {
    let r: abi::CreateSrq = decode(req);
    if s.limits.max_srq == 0 {
        return Err(Refused::unsupported("SRQs are disabled"));
    }
    if r.srq_type != 0 {
        return Err(Refused::invalid("SRQ type"));
    }
    let pd = r.pd_handle.get();
    let page = s.pd_page(pd).or_refuse("PD")?;
    let (wr, sge) = (r.attrs.max_wr.get(), r.attrs.max_sge.get());
    if !wr.is_power_of_two() || wr > s.limits.max_srq_wr {
        return Err(Refused::invalid("SRQ size"));
    }
    if sge == 0 || sge > s.limits.max_srq_sge {
        return Err(Refused::invalid("SRQ SGEs"));
    }
    let stride = qp::rq_stride(sge);
    let need = 1 + (u64::from(wr) * stride).div_ceil(PAGE_SIZE);
    let n = u64::from(r.nchunks.get());
    // The provider allocates twice the ring (and a page for the state).
    if n < need || n > 2 * need + 1 {
        return Err(Refused::invalid("SRQ pages"));
    }
    let pages =
        PageList::read_directory(mem, r.pdir_dma.get(), n).or_refuse("SRQ page directory")?;
    if s.dev.claims.conflict(pages.pages()).is_some() {
        return Err(Refused::invalid("SRQ pages (another ring's)"));
    }
    let ring = ring::ring(
        wr,
        stride,
        pages.pages()[0] + abi::ring_state::RX,
        pages.skip(1),
    )
    .or_refuse("SRQ ring")?;
    let (srq, granted) = s
        .dev
        .device
        .engine_mut()
        .create_srq(
            PdHandle(pd),
            SrqAttr {
                max_wr: wr,
                max_sge: sge,
                srq_limit: r.attrs.srq_limit.get(),
            },
        )
        .or_refuse("SRQ")?;
    s.dev
        .srqs
        .insert(srq.0, SrqFace::new(srq, page, ring, sge, granted.max_wr));
    s.dev.claims.claim(Owner::Srq(srq.0), pages.pages(), &[]);
    reply.done(&handle_body(srq.0))
}
