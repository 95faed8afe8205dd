//! The command channel: each request is copied out of the command slot
//! (all 184 bytes, once), decoded by its command code into the driver's
//! structure, checked field by field, and run on the device; the response
//! goes into the response slot. A failure is an ERR value (the errno the
//! engine gives, EINVAL for what the face refused itself) and a response
//! header with `err` set.

use vrdma_device::Transport;
use vrdma_engine::{
    CqHandle, PdHandle, SrqHandle, VerbsError,
    attr::{GidEntry, GidType, Mtu, PortState},
    mr::{Access, MrRequest, Translation},
    objects::{SrqAttr, SrqAttrMask},
    qp::{AhAttr, AttrMask, QpAttr, QpCap, QpInitAttr, QpState, QpType},
};
use vrdma_vfio_user::Bus;
use vrdma_wire::{Gid, PKey, Psn, QKey, Qpn};
use zerocopy::{FromBytes, IntoBytes};

use crate::{
    abi::{self, PAGE_SIZE, RespHdr, cmd},
    cq::GuestCq,
    function::{CqInfo, Pvrdma},
    qp::{self, QpContext, QpFace},
    ring,
    srq::SrqFace,
};
use vrdma_face::Owner;

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
    /// The ERR register's value (non-zero).
    pub err: u32,
    pub what: &'static str,
}

/// The failures of command `cmd`, answered under `key`: an errno and
/// what was wrong.
fn failer(cmd: u32, key: u64) -> impl Fn(u32, &'static str) -> Failure {
    move |err, what| Failure {
        cmd,
        key,
        err,
        what,
    }
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

const EINVAL: u32 = 22;

/// The request structure a command carries, read from its copy.
fn decode<T: FromBytes + zerocopy::Immutable + Default>(req: &[u8]) -> T {
    // Every request type fits the slot's copy (MAX_REQUEST bytes, the
    // largest request's size); a shorter copy reads as zeros.
    T::read_from_prefix(req).map(|(v, _)| v).unwrap_or_default()
}

/// A response: the header then `body`.
fn respond<B: IntoBytes + zerocopy::Immutable>(key: u64, code: u32, body: &B) -> Vec<u8> {
    let mut v = RespHdr {
        response: key.into(),
        ack: (cmd::ACK | code).into(),
        err: 0,
        reserved: [0; 3],
    }
    .as_bytes()
    .to_vec();
    v.extend_from_slice(body.as_bytes());
    v
}

/// The face's QP state numbering is the verbs one.
pub(crate) fn qp_state(v: u32) -> Option<QpState> {
    Some(match v {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 => QpState::Rts,
        4 => QpState::Sqd,
        5 => QpState::Sqe,
        6 => QpState::Err,
        _ => return None,
    })
}

pub(crate) fn qp_state_code(s: QpState) -> u32 {
    match s {
        QpState::Reset => 0,
        QpState::Init => 1,
        QpState::Rtr => 2,
        QpState::Rts => 3,
        QpState::Sqd => 4,
        QpState::Sqe => 5,
        QpState::Err => 6,
    }
}

/// The MR access bits the device implements (no on-demand paging, no
/// relaxed ordering: those bits are ignored, as the driver passes them
/// through unchecked).
fn access(v: u32) -> Access {
    Access(v & 0x3f)
}

impl<T: Transport> Pvrdma<T> {
    /// Runs one command (`req` is the slot's copy).
    pub(crate) fn command(&mut self, bus: &mut Bus<'_>, req: &[u8]) -> Result<Done, Failure> {
        // The answers to packets already received (the engine sends them
        // in its next round) go out before the command acts: the guest may
        // have read a message's completion and be destroying its QP, which
        // would take the message's ACK with it and leave the peer resending
        // into the void (ibv_rc_pingpong's client does exactly that).
        self.device.send_pending();
        let hdr: abi::CmdHdr = decode(req);
        let code = hdr.cmd.get();
        let key = hdr.response.get();
        let fail = failer(code, key);
        let engine_err = |e: VerbsError, what: &'static str| Failure {
            cmd: code,
            key,
            err: e.errno().unsigned_abs(),
            what,
        };
        let done = |response: Vec<u8>| {
            Ok(Done {
                response,
                wait: true,
            })
        };
        let quiet = || {
            Ok(Done {
                response: respond(key, code, &[0u8; 0]),
                wait: false,
            })
        };
        match code {
            cmd::QUERY_PORT => {
                let r: abi::QueryPort = decode(req);
                if r.port_num != 1 {
                    return Err(fail(EINVAL, "port number"));
                }
                let port = self
                    .device
                    .engine()
                    .query_port(1)
                    .map_err(|e| engine_err(e, "port"))?;
                let active = port.state == PortState::Active;
                let attrs = abi::PortAttr {
                    state: (port.state as u32).into(),
                    max_mtu: (port.max_mtu as u32).into(),
                    active_mtu: (port.active_mtu as u32).into(),
                    gid_tbl_len: self.limits.gid_tbl_len.into(),
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
                done(respond(key, code, &attrs))
            }
            cmd::QUERY_PKEY => {
                let r: abi::QueryPkey = decode(req);
                if r.port_num != 1 || r.index != 0 {
                    return Err(fail(EINVAL, "P_Key index"));
                }
                let mut body = [0u8; 8];
                body[..2].copy_from_slice(&PKey::DEFAULT.0.to_le_bytes());
                done(respond(key, code, &body))
            }
            cmd::CREATE_UC => {
                let r: abi::CreateUc = decode(req);
                let Some(l) = &self.loaded else {
                    return Err(fail(EINVAL, "no shared region"));
                };
                // The context's doorbell page: its frame number relative to
                // page 0's, never page 0 (the kernel's) and inside BAR2.
                let page = r.pfn64.get().wrapping_sub(l.uar_pfn);
                if page == 0 || page >= u64::from(self.limits.max_uar) {
                    return Err(fail(EINVAL, "UAR page"));
                }
                if self.ucs.values().any(|&p| u64::from(p) == page) {
                    return Err(fail(EINVAL, "UAR page in use"));
                }
                let handle = self.next_uc;
                self.next_uc = self.next_uc.wrapping_add(1).max(1);
                self.ucs.insert(handle, page as u32);
                let mut body = [0u8; 8];
                body[..4].copy_from_slice(&handle.to_le_bytes());
                done(respond(key, code, &body))
            }
            cmd::DESTROY_UC => {
                let r: abi::Handle = decode(req);
                let h = r.handle.get();
                // (0, the kernel's, is no context: EINVAL, not EBUSY.)
                let page = *self.ucs.get(&h).ok_or(fail(EINVAL, "context"))?;
                if self.pds.values().any(|&c| c == h) {
                    return Err(fail(16, "context still has PDs"));
                }
                // Its CQs too (they hold no PD): gone with the context,
                // their doorbell page would ring them for the next
                // context given that page.
                if self.cqs.values().any(|c| c.uar == page) {
                    return Err(fail(16, "context still has CQs"));
                }
                self.ucs.remove(&h);
                quiet()
            }
            cmd::CREATE_PD => {
                let r: abi::Handle = decode(req);
                let ctx = r.handle.get();
                if ctx != 0 && !self.ucs.contains_key(&ctx) {
                    return Err(fail(EINVAL, "context"));
                }
                let pd = self
                    .device
                    .engine_mut()
                    .alloc_pd()
                    .map_err(|e| engine_err(e, "PD"))?;
                self.pds.insert(pd.0, ctx);
                let mut body = [0u8; 8];
                body[..4].copy_from_slice(&pd.0.to_le_bytes());
                done(respond(key, code, &body))
            }
            cmd::DESTROY_PD => {
                let r: abi::Handle = decode(req);
                let pd = r.handle.get();
                if !self.pds.contains_key(&pd) {
                    return Err(fail(EINVAL, "PD"));
                }
                self.device
                    .engine_mut()
                    .dealloc_pd(PdHandle(pd))
                    .map_err(|e| engine_err(e, "PD"))?;
                self.pds.remove(&pd);
                quiet()
            }
            cmd::CREATE_MR => self.create_mr(bus, req, key),
            cmd::DESTROY_MR => {
                let r: abi::Handle = decode(req);
                let engine = self.device.engine_mut();
                let lkey = engine
                    .current_lkey(r.handle.get())
                    .ok_or(fail(EINVAL, "MR"))?;
                engine.dereg_mr(lkey).map_err(|e| engine_err(e, "MR"))?;
                quiet()
            }
            cmd::CREATE_CQ => self.create_cq(bus, req, key),
            cmd::RESIZE_CQ => Err(fail(95, "RESIZE_CQ (the driver never issues it)")),
            cmd::DESTROY_CQ => {
                let r: abi::Handle = decode(req);
                let cq = r.handle.get();
                if !self.cqs.contains_key(&cq) {
                    return Err(fail(EINVAL, "CQ"));
                }
                self.device
                    .engine_mut()
                    .destroy_cq(CqHandle(cq))
                    .map_err(|e| engine_err(e, "CQ"))?;
                self.cqs.remove(&cq);
                self.ring_pages.release(Owner::Cq(cq));
                quiet()
            }
            cmd::CREATE_QP => self.create_qp(bus, req, key),
            cmd::MODIFY_QP => self.modify_qp(bus, req, key),
            cmd::QUERY_QP => self.query_qp(req, key),
            cmd::DESTROY_QP => {
                let r: abi::Handle = decode(req);
                let h = r.handle.get();
                let Some(q) = self.qps.get(&h) else {
                    return Err(fail(EINVAL, "QP"));
                };
                let qpn = q.qpn();
                self.device
                    .engine_mut()
                    .destroy_qp(qpn)
                    .map_err(|e| engine_err(e, "QP"))?;
                self.qps.remove(&h);
                self.busy_qps.remove(&h);
                self.ring_pages.release(Owner::Qp(h));
                quiet()
            }
            cmd::CREATE_BIND => {
                let r: abi::CreateBind = decode(req);
                let index = r.index.get();
                if index >= self.limits.gid_tbl_len {
                    return Err(fail(EINVAL, "GID index"));
                }
                if r.gid_type != abi::GID_TYPE_ROCE_V2 {
                    return Err(fail(EINVAL, "GID type (RoCEv2 only)"));
                }
                let gid = Gid(r.new_gid);
                if !self.device.transport().admits_gid(&gid) {
                    // An address the guest was not given (spoofing
                    // another tenant's, through the device).
                    self.stats.gids_refused += 1;
                    return Err(fail(EINVAL, "GID (not one of the port's addresses)"));
                }
                let entry = GidEntry {
                    gid,
                    ty: GidType::RoceV2,
                };
                self.device
                    .engine_mut()
                    .set_gid(index as u8, Some(entry))
                    .map_err(|e| engine_err(e, "GID"))?;
                self.rebind();
                quiet()
            }
            cmd::DESTROY_BIND => {
                let r: abi::DestroyBind = decode(req);
                let index = r.index.get();
                if index >= self.limits.gid_tbl_len {
                    return Err(fail(EINVAL, "GID index"));
                }
                self.device
                    .engine_mut()
                    .set_gid(index as u8, None)
                    .map_err(|e| engine_err(e, "GID"))?;
                self.rebind();
                quiet()
            }
            cmd::CREATE_SRQ => self.create_srq(bus, req, key),
            cmd::MODIFY_SRQ => {
                let r: abi::ModifySrq = decode(req);
                let srq = r.srq_handle.get();
                if !self.srqs.contains_key(&srq) {
                    return Err(fail(EINVAL, "SRQ"));
                }
                let mask = SrqAttrMask(r.attr_mask.get() & 3);
                let attr = SrqAttr {
                    max_wr: r.attrs.max_wr.get(),
                    max_sge: r.attrs.max_sge.get(),
                    srq_limit: r.attrs.srq_limit.get(),
                };
                self.device
                    .engine_mut()
                    .modify_srq(SrqHandle(srq), attr, mask)
                    .map_err(|e| engine_err(e, "SRQ"))?;
                quiet()
            }
            cmd::QUERY_SRQ => {
                let r: abi::Handle = decode(req);
                let srq = r.handle.get();
                if !self.srqs.contains_key(&srq) {
                    return Err(fail(EINVAL, "SRQ"));
                }
                let a = self
                    .device
                    .engine()
                    .query_srq(SrqHandle(srq))
                    .map_err(|e| engine_err(e, "SRQ"))?;
                let attrs = abi::SrqAttr {
                    max_wr: a.max_wr.into(),
                    max_sge: a.max_sge.into(),
                    srq_limit: a.srq_limit.into(),
                    reserved: 0.into(),
                };
                done(respond(key, code, &attrs))
            }
            cmd::DESTROY_SRQ => {
                let r: abi::Handle = decode(req);
                let srq = r.handle.get();
                if !self.srqs.contains_key(&srq) {
                    return Err(fail(EINVAL, "SRQ"));
                }
                self.device
                    .engine_mut()
                    .destroy_srq(SrqHandle(srq))
                    .map_err(|e| engine_err(e, "SRQ"))?;
                self.srqs.remove(&srq);
                self.busy_srqs.remove(&srq);
                self.ring_pages.release(Owner::Srq(srq));
                quiet()
            }
            _ => Err(Failure {
                cmd: code,
                key,
                err: crate::function::err::BAD_COMMAND,
                what: "unknown command",
            }),
        }
    }

    /// The port steers to the engine what is addressed to the GIDs bound
    /// now.
    fn rebind(&mut self) {
        let gids: Vec<Gid> = self
            .device
            .engine()
            .query_port(1)
            .map(|p| p.gids.iter().flatten().map(|e| e.gid).collect())
            .unwrap_or_default();
        self.device.transport_mut().set_local(&gids);
    }

    /// The doorbell page of the context that owns PD `pd` (0: the
    /// kernel's).
    fn pd_page(&self, pd: u32) -> Option<u32> {
        let ctx = *self.pds.get(&pd)?;
        if ctx == 0 {
            return Some(0);
        }
        self.ucs.get(&ctx).copied()
    }

    fn create_mr(&mut self, bus: &mut Bus<'_>, req: &[u8], key: u64) -> Result<Done, Failure> {
        let r: abi::CreateMr = decode(req);
        let code = cmd::CREATE_MR;
        let fail = failer(code, key);
        let pd = r.pd_handle.get();
        if !self.pds.contains_key(&pd) {
            return Err(fail(EINVAL, "PD"));
        }
        let pd = PdHandle(pd);
        let acc = access(r.access_flags.get());
        let engine_err = |e: VerbsError| fail(e.errno().unsigned_abs(), "MR");
        let (lkey, rkey) = match r.flags.get() {
            abi::MR_FLAG_DMA => self
                .device
                .engine_mut()
                .reg_dma_mr(pd, acc)
                .map_err(engine_err)?,
            abi::MR_FLAG_FRMR => {
                let n = r.nchunks.get();
                if n == 0 || n > abi::MAX_FAST_REG_PAGES {
                    return Err(fail(EINVAL, "fast-registration pages"));
                }
                let l = self
                    .device
                    .engine_mut()
                    .alloc_mr(pd, n)
                    .map_err(engine_err)?;
                (l, vrdma_wire::Rkey(l.0))
            }
            0 => {
                let start = r.start.get();
                let length = r.length.get();
                if length == 0 || length > self.limits.max_mr_size {
                    return Err(fail(EINVAL, "MR length"));
                }
                if acc.contains(Access::ZERO_BASED) {
                    // The driver does not pass an IOVA; a zero-based MR
                    // cannot be honoured.
                    return Err(fail(EINVAL, "zero-based MR"));
                }
                let Some(last) = start.checked_add(length - 1) else {
                    return Err(fail(EINVAL, "MR range"));
                };
                // The pages the range spans, in 64-bit arithmetic
                // (CVE-2021-3582): exactly what the directory must list.
                let span = (last / PAGE_SIZE) - (start / PAGE_SIZE) + 1;
                if u64::from(r.nchunks.get()) != span {
                    return Err(fail(EINVAL, "MR page count"));
                }
                // The page list is read only if the guest's objects have
                // room for it: a short directory can name a long one.
                self.device
                    .engine_mut()
                    .check_mr_pages(span as usize)
                    .map_err(engine_err)?;
                let pages = ring::read_pdir(bus.mem, r.pdir_dma.get(), span)
                    .map_err(|_| fail(EINVAL, "MR page directory"))?;
                self.device
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
                    .map_err(engine_err)?
            }
            _ => return Err(fail(EINVAL, "MR flags")),
        };
        let body = abi::CreateMrResp {
            hdr: RespHdr {
                response: key.into(),
                ack: (cmd::ACK | code).into(),
                err: 0,
                reserved: [0; 3],
            },
            mr_handle: (lkey.0 >> 8).into(),
            lkey: lkey.0.into(),
            rkey: rkey.0.into(),
            reserved: [0; 4],
        };
        Ok(Done {
            response: body.as_bytes().to_vec(),
            wait: true,
        })
    }

    fn create_cq(&mut self, bus: &mut Bus<'_>, req: &[u8], key: u64) -> Result<Done, Failure> {
        let r: abi::CreateCq = decode(req);
        let code = cmd::CREATE_CQ;
        let fail = failer(code, key);
        let ctx = r.ctx_handle.get();
        let page = if ctx == 0 {
            0
        } else {
            *self.ucs.get(&ctx).ok_or(fail(EINVAL, "context"))?
        };
        let cqe = r.cqe.get();
        if !cqe.is_power_of_two() || cqe > self.limits.max_cqe {
            return Err(fail(EINVAL, "CQ size"));
        }
        let n = u64::from(r.nchunks.get());
        let need = 1 + (u64::from(cqe) * size_of::<abi::Cqe>() as u64).div_ceil(PAGE_SIZE);
        // The state page and the entries; a user buffer may have a page
        // more, nothing like twice as many (CVE-2018-20125).
        if n < need || n > need + 1 {
            return Err(fail(EINVAL, "CQ pages"));
        }
        let pages = ring::read_pdir(bus.mem, r.pdir_dma.get(), n)
            .map_err(|_| fail(EINVAL, "CQ page directory"))?;
        if self.ring_pages.conflict(pages.pages()).is_some() {
            return Err(fail(EINVAL, "CQ pages (another ring's)"));
        }
        let ring = ring::ring(
            cqe,
            size_of::<abi::Cqe>() as u64,
            pages.pages()[0] + abi::ring_state::RX,
            pages.skip(1),
        )
        .ok_or(fail(EINVAL, "CQ ring"))?;
        let sink = GuestCq::new(self.shared.clone(), ring, crate::cq::cqe)
            .map_err(|_| fail(EINVAL, "CQ ring state"))?;
        let (cq, granted) = self
            .device
            .engine_mut()
            .create_cq_with_sink(cqe, 0, Box::new(sink))
            .map_err(|e| fail(e.errno().unsigned_abs(), "CQ"))?;
        self.cqs.insert(cq.0, CqInfo { uar: page });
        self.ring_pages.claim(Owner::Cq(cq.0), pages.pages());
        let body = abi::CreateCqResp {
            hdr: RespHdr {
                response: key.into(),
                ack: (cmd::ACK | code).into(),
                err: 0,
                reserved: [0; 3],
            },
            cq_handle: cq.0.into(),
            cqe: granted.into(),
        };
        Ok(Done {
            response: body.as_bytes().to_vec(),
            wait: true,
        })
    }

    fn create_qp(&mut self, bus: &mut Bus<'_>, req: &[u8], key: u64) -> Result<Done, Failure> {
        let r: abi::CreateQp = decode(req);
        let code = cmd::CREATE_QP;
        let fail = failer(code, key);
        let ty = match r.qp_type {
            abi::qp_type::GSI => QpType::Gsi,
            abi::qp_type::RC => QpType::Rc,
            abi::qp_type::UC => QpType::Uc,
            abi::qp_type::UD => QpType::Ud,
            _ => return Err(fail(EINVAL, "QP type")),
        };
        let pd = r.pd_handle.get();
        let page = self.pd_page(pd).ok_or(fail(EINVAL, "PD"))?;
        // The CQs and the SRQ must be the PD's context's (their doorbell
        // page says whose), as the driver's own tables ensure: another
        // context's CQ would see this QP's completions.
        for cq in [r.send_cq_handle.get(), r.recv_cq_handle.get()] {
            if self.cqs.get(&cq).is_none_or(|c| c.uar != page) {
                return Err(fail(EINVAL, "CQ"));
            }
        }
        let is_srq = r.is_srq != 0;
        let srq = if is_srq {
            let s = r.srq_handle.get();
            if self.srqs.get(&s).is_none_or(|f| f.uar != page) {
                return Err(fail(EINVAL, "SRQ"));
            }
            Some(SrqHandle(s))
        } else {
            None
        };
        let (sw, rw) = (r.max_send_wr.get(), r.max_recv_wr.get());
        let (ss, rs) = (r.max_send_sge.get(), r.max_recv_sge.get());
        // Ring sizes are powers of two, as the driver and the provider
        // round them (and as CQs and SRQs must be).
        if !sw.is_power_of_two() || sw > self.limits.max_qp_wr || ss > self.limits.max_sge {
            return Err(fail(EINVAL, "send queue size"));
        }
        if !is_srq
            && (!rw.is_power_of_two() || rw > self.limits.max_qp_wr || rs > self.limits.max_sge)
        {
            return Err(fail(EINVAL, "receive queue size"));
        }
        if r.max_inline_data.get() != 0 {
            return Err(fail(EINVAL, "inline data"));
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
        let recv_pages = total
            .checked_sub(1 + send_chunks)
            .ok_or(fail(EINVAL, "QP pages"))?;
        if send_chunks < send_need
            || send_chunks > send_need + 1
            || recv_pages < recv_need
            || recv_pages > recv_need + 1
        {
            return Err(fail(EINVAL, "QP pages"));
        }
        let pages = ring::read_pdir(bus.mem, r.pdir_dma.get(), total)
            .map_err(|_| fail(EINVAL, "QP page directory"))?;
        if self.ring_pages.conflict(pages.pages()).is_some() {
            return Err(fail(EINVAL, "QP pages (another ring's)"));
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
        .ok_or(fail(EINVAL, "QP rings"))?;
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
        let (qpn, _) = self
            .device
            .engine_mut()
            .create_qp(init)
            .map_err(|e| fail(e.errno().unsigned_abs(), "QP"))?;
        let ctx = QpContext {
            ty: r.qp_type,
            pd,
            max_send_sge: ss,
            stride: sstride,
        };
        self.qps
            .insert(qpn.value(), QpFace::new(qpn, ctx, page, sq, rq, rs));
        self.ring_pages.claim(Owner::Qp(qpn.value()), pages.pages());
        let body = abi::CreateQpRespV2 {
            hdr: RespHdr {
                response: key.into(),
                ack: (cmd::ACK | code).into(),
                err: 0,
                reserved: [0; 3],
            },
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
        Ok(Done {
            response: body.as_bytes().to_vec(),
            wait: true,
        })
    }

    fn modify_qp(&mut self, bus: &mut Bus<'_>, req: &[u8], key: u64) -> Result<Done, Failure> {
        let r: abi::ModifyQp = decode(req);
        let code = cmd::MODIFY_QP;
        let fail = failer(code, key);
        let h = r.qp_handle.get();
        let qpn = self.qps.get(&h).ok_or(fail(EINVAL, "QP"))?.qpn();
        let mask = AttrMask(r.attr_mask.get() & 0x1f_ffff);
        let a = &r.attrs;
        let m = |bit: AttrMask| mask.contains(bit);
        // Only the masked fields are the consumer's; the rest may be
        // anything and are not looked at.
        let cur = *self
            .device
            .engine()
            .query_qp(qpn)
            .map_err(|e| fail(e.errno().unsigned_abs(), "QP"))?
            .0;
        let state = |v: u32| qp_state(v).ok_or(fail(EINVAL, "QP state"));
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
                Mtu::from_code(a.path_mtu.get()).ok_or(fail(EINVAL, "path MTU"))?
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
                flow_label: a.ah_attr.flow_label.get() & 0xf_ffff,
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
        let engine = self.device.engine_mut();
        engine.modify_qp(qpn, &attr, mask).map_err(|e| {
            tracing::debug!(error = %e, mask = mask.0, "MODIFY_QP refused by the engine");
            fail(e.errno().unsigned_abs(), "QP attributes")
        })?;
        let now = engine
            .query_qp(qpn)
            .map(|(a, _)| a.qp_state)
            .unwrap_or(QpState::Err);
        if let Some(q) = self.qps.get_mut(&h)
            && now == QpState::Reset
        {
            // The driver zeroes the rings' indices; so does the device.
            q.queues.reset();
        }
        // WQEs that waited for RTS (or for INIT, receives).
        self.take_sends(bus.mem, h);
        self.take_recvs(bus.mem, h);
        Ok(Done {
            response: respond(key, code, &[0u8; 0]),
            wait: true,
        })
    }

    fn query_qp(&mut self, req: &[u8], key: u64) -> Result<Done, Failure> {
        let r: abi::QueryQp = decode(req);
        let code = cmd::QUERY_QP;
        let fail = failer(code, key);
        let h = r.qp_handle.get();
        let qpn = self.qps.get(&h).ok_or(fail(EINVAL, "QP"))?.qpn();
        let (a, init) = self
            .device
            .engine()
            .query_qp(qpn)
            .map_err(|e| fail(e.errno().unsigned_abs(), "QP"))?;
        let attrs = abi::QpAttr {
            qp_state: qp_state_code(a.qp_state).into(),
            cur_qp_state: qp_state_code(a.cur_qp_state).into(),
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
        Ok(Done {
            response: respond(key, code, &attrs),
            wait: true,
        })
    }

    fn create_srq(&mut self, bus: &mut Bus<'_>, req: &[u8], key: u64) -> Result<Done, Failure> {
        let r: abi::CreateSrq = decode(req);
        let code = cmd::CREATE_SRQ;
        let fail = failer(code, key);
        if self.limits.max_srq == 0 {
            return Err(fail(95, "SRQs are disabled"));
        }
        if r.srq_type != 0 {
            return Err(fail(EINVAL, "SRQ type"));
        }
        let pd = r.pd_handle.get();
        let page = self.pd_page(pd).ok_or(fail(EINVAL, "PD"))?;
        let (wr, sge) = (r.attrs.max_wr.get(), r.attrs.max_sge.get());
        if !wr.is_power_of_two() || wr > self.limits.max_srq_wr {
            return Err(fail(EINVAL, "SRQ size"));
        }
        if sge == 0 || sge > self.limits.max_srq_sge {
            return Err(fail(EINVAL, "SRQ SGEs"));
        }
        let stride = qp::rq_stride(sge);
        let need = 1 + (u64::from(wr) * stride).div_ceil(PAGE_SIZE);
        let n = u64::from(r.nchunks.get());
        // The provider allocates twice the ring (and a page for the state).
        if n < need || n > 2 * need + 1 {
            return Err(fail(EINVAL, "SRQ pages"));
        }
        let pages = ring::read_pdir(bus.mem, r.pdir_dma.get(), n)
            .map_err(|_| fail(EINVAL, "SRQ page directory"))?;
        if self.ring_pages.conflict(pages.pages()).is_some() {
            return Err(fail(EINVAL, "SRQ pages (another ring's)"));
        }
        let ring = ring::ring(
            wr,
            stride,
            pages.pages()[0] + abi::ring_state::RX,
            pages.skip(1),
        )
        .ok_or(fail(EINVAL, "SRQ ring"))?;
        let (srq, granted) = self
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
            .map_err(|e| fail(e.errno().unsigned_abs(), "SRQ"))?;
        self.srqs
            .insert(srq.0, SrqFace::new(srq, page, ring, sge, granted.max_wr));
        self.ring_pages.claim(Owner::Srq(srq.0), pages.pages());
        let mut body = [0u8; 8];
        body[..4].copy_from_slice(&srq.0.to_le_bytes());
        Ok(Done {
            response: respond(key, code, &body),
            wait: true,
        })
    }
}
