//! The commands (spec §6): a request decoded, checked against the
//! context that sent it, and carried out on the device; the queries, the
//! context, PD, MR, MW, GID and QP-attribute commands.

use std::collections::BTreeMap;

use vrdma_device::Transport;
use vrdma_engine::{
    CqHandle, PdHandle, SrqHandle,
    attr::PortState,
    errno,
    mr::{Access, MrRequest, MwType, Translation},
    objects::{SrqAttr, SrqAttrMask},
    qp::AttrMask,
};
use vrdma_face::{Owner, Refusal, Refused, refusals, status::OrRefuse};
use vrdma_wire::{Gid, Lkey, Qpn, Rkey};
use zerocopy::IntoBytes;

use super::state::{Context, VirtioRdma, device_name};
use crate::{
    abi::{self, op, status},
    decode::{self, Command, RegMr, fault, noent},
    doorbell,
};

impl<T: Transport> VirtioRdma<T> {
    /// Carries out one request (the concatenation of a chain's
    /// driver-readable buffers) and returns the response (header and
    /// body). `room`: the bytes the chain lets the device write.
    pub fn command(&mut self, req: &[u8], room: usize) -> Vec<u8> {
        self.stats.commands += 1;
        // After DEVICE_FATAL every request of a header's length but the
        // queries is ERR_DEVICE, whatever else is wrong with it (§6.4).
        let opcode = req.get(..2).map(|o| u16::from_le_bytes([o[0], o[1]]));
        let dead = self.fatal
            && req.len() >= size_of::<abi::CmdHdr>()
            && !matches!(
                opcode,
                Some(op::QUERY_DEVICE | op::QUERY_PORT | op::QUERY_STATS)
            );
        let hdr_len = size_of::<abi::RespHdr>();
        let done = if dead {
            Err(Refused::new(
                errno::EIO.unsigned_abs(),
                "the device failed: reset it",
            ))
        } else {
            decode::decode_request(req).and_then(|r| {
                // Room for the response before anything is done: a command
                // that succeeds must be able to say so (DEV-16).
                if hdr_len + decode::response_len(r.opcode) > room {
                    return Err(decode::length("response room"));
                }
                self.execute(r)
            })
        };
        let (code, body) = match done {
            Ok(body) => (None, body),
            Err(e) => {
                self.stats.refused += 1;
                let answer = format!("errno {}", e.errno);
                let r = Refusal {
                    kind: refusals::Kind::Command,
                    rule: e.what,
                    opcode: opcode.map_or(0, u32::from),
                    object: 0,
                    field: None,
                    answer: &answer,
                };
                let now = self.dev.device.now();
                self.dev.refusals.note(now, &device_name(), &r);
                (Some(e), Vec::new())
            }
        };
        let (code, body) = match code {
            None if hdr_len + body.len() > room => {
                self.stats.refused += 1;
                (Some(decode::length("response room")), Vec::new())
            }
            c => (c, body),
        };
        let hdr = abi::RespHdr {
            status: code.as_ref().map_or(status::OK, decode::status_of).into(),
            reserved: 0.into(),
            detail: code.map_or(0, |e| e.errno).into(),
        };
        let mut out = hdr.as_bytes().to_vec();
        out.extend_from_slice(&body);
        out
    }

    pub(super) fn execute(&mut self, r: decode::Request) -> Result<Vec<u8>, Refused> {
        let ctx = r.context;
        let query = matches!(
            r.command,
            Command::QueryDevice | Command::QueryPort { .. } | Command::QueryStats
        );
        if self.fatal && !query {
            return Err(Refused::new(
                errno::EIO.unsigned_abs(),
                "the device failed: reset it",
            ));
        }
        let needs_context = !matches!(
            r.command,
            Command::QueryDevice
                | Command::QueryPort { .. }
                | Command::QueryStats
                | Command::CreateContext { .. }
        );
        if needs_context && !self.contexts.contains_key(&ctx) {
            return Err(noent("context"));
        }
        match r.command {
            Command::QueryDevice => Ok(self.query_device().as_bytes().to_vec()),
            Command::QueryStats if self.features & abi::feature::STATS == 0 => Err(
                Refused::unsupported("QUERY_STATS without VIRTIO_RDMA_F_STATS"),
            ),
            Command::QueryStats => Ok(self.query_stats().as_bytes().to_vec()),
            Command::QueryPort { port } => self.query_port(port),
            Command::CreateContext {
                doorbell_bits,
                pages,
            } => self.create_context(doorbell_bits, pages),
            Command::DestroyContext => {
                self.destroy_context(ctx);
                Ok(Vec::new())
            }
            Command::AllocPd => self.alloc_pd(ctx),
            Command::DeallocPd { pd } => self.dealloc_pd(ctx, pd),
            Command::CreateCq { ring } => self.create_cq(ctx, ring),
            Command::DestroyCq { cq } => self.destroy_cq(ctx, cq),
            Command::ResizeCq { cq, ring } => self.resize_cq(ctx, cq, ring),
            Command::RegMr(m) => self.reg_mr(ctx, m),
            Command::RegDmaMr { pd, access } => self.reg_dma_mr(ctx, pd, access),
            Command::AllocMr { pd, max_pages } => self.alloc_mr(ctx, pd, max_pages),
            Command::DeregMr { lkey } => self.dereg_mr(ctx, lkey),
            Command::AllocMw { pd, ty } => self.alloc_mw(ctx, pd, ty),
            Command::DeallocMw { rkey } => self.dealloc_mw(ctx, rkey),
            Command::CreateSrq {
                pd,
                max_sge,
                srq_limit,
                ring,
            } => self.create_srq(ctx, pd, max_sge, srq_limit, ring),
            Command::ModifySrq { srq, srq_limit } => self.modify_srq(ctx, srq, srq_limit),
            Command::QuerySrq { srq } => self.query_srq(ctx, srq),
            Command::DestroySrq { srq } => self.destroy_srq(ctx, srq),
            Command::CreateQp(c) => self.create_qp(ctx, c),
            Command::ModifyQp { qpn, mask, attrs } => self.modify_qp(ctx, qpn, mask, &attrs),
            Command::QueryQp { qpn } => self.query_qp(ctx, qpn),
            Command::DestroyQp { qpn } => {
                self.qp_of(ctx, qpn)?;
                self.destroy_qp(qpn)?;
                Ok(Vec::new())
            }
            Command::SetGid { index, gid } => self.set_gid(index, gid),
        }
    }

    /// ALLOC_PD (§6.12).
    pub(super) fn alloc_pd(&mut self, ctx: u32) -> Result<Vec<u8>, Refused> {
        let pd = self.dev.device.engine_mut().alloc_pd().or_refuse("PD")?;
        self.pds.insert(pd.0, ctx);
        Ok(handle_resp(pd.0))
    }

    /// DEALLOC_PD.
    pub(super) fn dealloc_pd(&mut self, ctx: u32, pd: u32) -> Result<Vec<u8>, Refused> {
        self.owned(&self.pds, pd, ctx, "PD")?;
        self.dev
            .device
            .engine_mut()
            .dealloc_pd(PdHandle(pd))
            .or_refuse("PD")?;
        self.pds.remove(&pd);
        Ok(Vec::new())
    }

    /// REG_DMA_MR.
    pub(super) fn reg_dma_mr(
        &mut self,
        ctx: u32,
        pd: u32,
        access: Access,
    ) -> Result<Vec<u8>, Refused> {
        self.owned(&self.pds, pd, ctx, "PD")?;
        let (lkey, rkey) = self
            .dev
            .device
            .engine_mut()
            .reg_dma_mr(PdHandle(pd), access)
            .or_refuse("DMA MR")?;
        self.mrs.insert(lkey.0 >> 8, ctx);
        Ok(mr_resp(lkey, rkey))
    }

    /// ALLOC_MR: a fast-registration MR.
    pub(super) fn alloc_mr(
        &mut self,
        ctx: u32,
        pd: u32,
        max_pages: u32,
    ) -> Result<Vec<u8>, Refused> {
        self.owned(&self.pds, pd, ctx, "PD")?;
        let lkey = self
            .dev
            .device
            .engine_mut()
            .alloc_mr(PdHandle(pd), max_pages)
            .or_refuse("fast-registration MR")?;
        self.mrs.insert(lkey.0 >> 8, ctx);
        Ok(mr_resp(lkey, Rkey(lkey.0)))
    }

    /// DEREG_MR.
    pub(super) fn dereg_mr(&mut self, ctx: u32, lkey: u32) -> Result<Vec<u8>, Refused> {
        self.owned(&self.mrs, lkey >> 8, ctx, "MR")?;
        let engine = self.dev.device.engine_mut();
        // By index; the key byte (which fast registration changes)
        // is ignored (§6.19).
        let cur = engine.current_lkey(lkey >> 8).or_refuse("MR")?;
        engine.dereg_mr(cur).or_refuse("MR")?;
        self.mrs.remove(&(lkey >> 8));
        Ok(Vec::new())
    }

    /// ALLOC_MW.
    pub(super) fn alloc_mw(&mut self, ctx: u32, pd: u32, ty: MwType) -> Result<Vec<u8>, Refused> {
        self.owned(&self.pds, pd, ctx, "PD")?;
        let rkey = self
            .dev
            .device
            .engine_mut()
            .alloc_mw(PdHandle(pd), ty)
            .or_refuse("MW")?;
        self.mws.insert(rkey.0 >> 8, ctx);
        Ok(handle_resp(rkey.0))
    }

    /// DEALLOC_MW.
    pub(super) fn dealloc_mw(&mut self, ctx: u32, rkey: u32) -> Result<Vec<u8>, Refused> {
        self.owned(&self.mws, rkey >> 8, ctx, "MW")?;
        let engine = self.dev.device.engine_mut();
        // Named by its index; the key byte, which binds change,
        // is ignored (§6.21, §6.19).
        let cur = engine.current_rkey(rkey >> 8).or_refuse("MW")?;
        engine.dealloc_mw(cur).or_refuse("MW")?;
        self.mws.remove(&(rkey >> 8));
        Ok(Vec::new())
    }

    /// MODIFY_SRQ: its limit.
    pub(super) fn modify_srq(
        &mut self,
        ctx: u32,
        srq: u32,
        srq_limit: u32,
    ) -> Result<Vec<u8>, Refused> {
        self.srq_of(ctx, srq)?;
        let engine = self.dev.device.engine_mut();
        let cur = engine.query_srq(SrqHandle(srq)).or_refuse("SRQ")?;
        engine
            .modify_srq(
                SrqHandle(srq),
                SrqAttr { srq_limit, ..cur },
                SrqAttrMask::LIMIT,
            )
            .or_refuse("SRQ limit")?;
        Ok(Vec::new())
    }

    /// QUERY_SRQ.
    pub(super) fn query_srq(&self, ctx: u32, srq: u32) -> Result<Vec<u8>, Refused> {
        self.srq_of(ctx, srq)?;
        let a = self
            .dev
            .device
            .engine()
            .query_srq(SrqHandle(srq))
            .or_refuse("SRQ")?;
        Ok(abi::SrqAttrResp {
            max_wr: a.max_wr.into(),
            max_sge: a.max_sge.into(),
            srq_limit: a.srq_limit.into(),
            reserved: 0.into(),
        }
        .as_bytes()
        .to_vec())
    }

    /// MODIFY_QP: the engine's transition; to RESET the rings' indices go back to 0.
    pub(super) fn modify_qp(
        &mut self,
        ctx: u32,
        qpn: u32,
        mask: AttrMask,
        attrs: &abi::QpAttrs,
    ) -> Result<Vec<u8>, Refused> {
        self.qp_of(ctx, qpn)?;
        let q = Qpn::from_masked(qpn);
        let engine = self.dev.device.engine_mut();
        let cur = *engine.query_qp(q).or_refuse("QP")?.0;
        let attr = decode::qp_attr(&cur, mask, attrs)?;
        engine
            .modify_qp(q, &attr, mask)
            .or_refuse("QP attributes")?;
        let now = engine.query_qp(q).map(|(a, _)| a.qp_state).ok();
        if let Some(f) = self.dev.qps.get_mut(&qpn)
            && now == Some(vrdma_engine::qp::QpState::Reset)
        {
            // The driver zeroes the rings' indices; so does the
            // device's view of them.
            f.queues.reset();
        }
        // WQEs that waited for RTS (or receives for INIT).
        self.take_qp(qpn);
        Ok(Vec::new())
    }

    /// QUERY_QP: the attributes and the capacities.
    pub(super) fn query_qp(&self, ctx: u32, qpn: u32) -> Result<Vec<u8>, Refused> {
        self.qp_of(ctx, qpn)?;
        let (a, init) = self
            .dev
            .device
            .engine()
            .query_qp(Qpn::from_masked(qpn))
            .or_refuse("QP")?;
        let resp = abi::QueryQpResp {
            attrs: decode::qp_attrs(a),
            max_send_wr: init.cap.max_send_wr.into(),
            max_recv_wr: init.cap.max_recv_wr.into(),
            max_send_sge: init.cap.max_send_sge.into(),
            max_recv_sge: init.cap.max_recv_sge.into(),
            max_inline_data: init.cap.max_inline_data.into(),
            qp_type: qp_type_code(init.qp_type),
            sq_sig_all: u8::from(init.sq_sig_all),
            reserved: 0.into(),
        };
        Ok(resp.as_bytes().to_vec())
    }

    /// SET_GID: only an address of the port's own (its operator's).
    pub(super) fn set_gid(&mut self, index: u8, gid: Option<Gid>) -> Result<Vec<u8>, Refused> {
        self.dev.set_gid(index, gid)?;
        Ok(Vec::new())
    }

    /// REG_MR: every page wholly inside guest memory (§6.16 step 6), the
    /// page list within the engine's limit.
    pub(super) fn reg_mr(&mut self, ctx: u32, m: RegMr) -> Result<Vec<u8>, Refused> {
        self.owned(&self.pds, m.pd, ctx, "PD")?;
        let page = 1usize << m.page_shift;
        if m.pages.iter().any(|&p| !self.in_memory(p, page)) {
            return Err(fault("MR page outside guest memory"));
        }
        let engine = self.dev.device.engine_mut();
        engine.check_mr_pages(m.pages.len()).or_refuse("MR pages")?;
        let (lkey, rkey) = engine
            .reg_mr(MrRequest {
                pd: PdHandle(m.pd),
                iova: m.iova,
                length: m.length,
                access: m.access,
                translation: Translation::Pages {
                    page_shift: m.page_shift,
                    offset: m.offset,
                    pages: m.pages,
                },
            })
            .or_refuse("MR")?;
        self.mrs.insert(lkey.0 >> 8, ctx);
        Ok(mr_resp(lkey, rkey))
    }

    pub(super) fn query_device(&self) -> abi::DeviceAttrResp {
        let a = self.dev.device.engine().query_device();
        abi::DeviceAttrResp {
            node_guid: a.node_guid.into(),
            sys_image_guid: a.sys_image_guid.into(),
            max_mr_size: a.max_mr_size.into(),
            page_size_cap: a.page_size_cap.into(),
            device_cap_flags: (abi::cap::RC_RNR_NAK_GEN
                | abi::cap::CURR_QP_STATE_MOD
                | abi::cap::PORT_ACTIVE_EVENT
                | abi::cap::SYS_IMAGE_GUID
                | abi::cap::MEM_WINDOW
                | abi::cap::MEM_WINDOW_TYPE_2B
                | abi::cap::MEM_MGT_EXTENSIONS)
                .into(),
            vendor_id: a.vendor_id.into(),
            vendor_part_id: a.vendor_part_id.into(),
            hw_ver: a.hw_ver.into(),
            max_qp: a.max_qp.into(),
            max_qp_wr: a.max_qp_wr.into(),
            max_sge: a.max_sge.into(),
            max_sge_rd: a.max_sge_rd.into(),
            max_cq: a.max_cq.into(),
            max_cqe: a.max_cqe.into(),
            max_mr: a.max_mr.into(),
            max_pd: a.max_pd.into(),
            max_qp_rd_atom: a.max_qp_rd_atom.into(),
            max_qp_init_rd_atom: a.max_qp_init_rd_atom.into(),
            max_res_rd_atom: a.max_res_rd_atom.into(),
            max_mw: a.max_mw.into(),
            max_srq: a.max_srq.into(),
            max_srq_wr: a.max_srq_wr.into(),
            max_srq_sge: a.max_srq_sge.into(),
            max_inline_data: a.max_inline_data.into(),
            max_fast_reg_page_list_len: a.max_fast_reg_page_list_len.into(),
            max_pkeys: a.max_pkeys.into(),
            atomic_cap: match a.atomic_cap {
                vrdma_engine::attr::AtomicCap::None => 0,
                vrdma_engine::attr::AtomicCap::Hca => 1,
                vrdma_engine::attr::AtomicCap::Global => 2,
            },
            local_ca_ack_delay: a.local_ca_ack_delay,
            phys_port_cnt: a.phys_port_cnt,
            reserved: [0; 3],
        }
    }

    pub(super) fn query_port(&self, port: u8) -> Result<Vec<u8>, Refused> {
        let p = self
            .dev
            .device
            .engine()
            .query_port(port)
            .or_refuse("port")?;
        let active = p.state == PortState::Active;
        Ok(abi::PortAttrResp {
            state: (p.state as u32).into(),
            max_mtu: (p.max_mtu as u32).into(),
            active_mtu: (p.active_mtu as u32).into(),
            gid_tbl_len: (p.gids.len() as u32).into(),
            // IB_PORT_CM_SUP | IB_PORT_IP_BASED_GIDS.
            port_cap_flags: ((1u32 << 16) | (1 << 26)).into(),
            max_msg_sz: (1u32 << 31).into(),
            pkey_tbl_len: (p.pkeys.len() as u16).into(),
            // 4X at 25 Gb/s (EDR), what rxe reports.
            active_width: 2,
            active_speed: 32,
            phys_state: if active { 5 } else { 3 },
            reserved: [0; 3],
        }
        .as_bytes()
        .to_vec())
    }

    /// QUERY_STATS: the data path's counters, then the refusals (the
    /// order of [`abi::STATS_NAMES`]).
    pub(super) fn query_stats(&self) -> abi::StatsResp {
        let mut r = abi::StatsResp::default();
        let engine = self.dev.device.engine().stats().fields();
        let kind = refusals::Kind::Command;
        let own = [
            self.dev.refusals.total(kind),
            self.dev.refusals.total(refusals::Kind::SendWqe),
            self.dev.refusals.total(refusals::Kind::RecvWqe),
            self.dev.taken.broken_rings,
        ];
        let values = engine.iter().map(|&(_, v)| v).chain(own);
        for (slot, v) in r.value.iter_mut().zip(values) {
            *slot = v.into();
        }
        r
    }

    pub(super) fn owned(
        &self,
        table: &BTreeMap<u32, u32>,
        h: u32,
        ctx: u32,
        what: &'static str,
    ) -> Result<(), Refused> {
        match table.get(&h) {
            Some(&c) if c == ctx => Ok(()),
            _ => Err(noent(what)),
        }
    }

    pub(super) fn cq_of(&self, ctx: u32, cq: u32) -> Result<(), Refused> {
        match self.cqs.get(&cq) {
            Some(c) if c.context == ctx => Ok(()),
            _ => Err(noent("CQ")),
        }
    }

    pub(super) fn srq_of(&self, ctx: u32, srq: u32) -> Result<(), Refused> {
        match self.dev.srqs.get(&srq) {
            Some(s) if s.context == ctx => Ok(()),
            _ => Err(noent("SRQ")),
        }
    }

    pub(super) fn qp_of(&self, ctx: u32, qpn: u32) -> Result<(), Refused> {
        match self.dev.qps.get(&qpn) {
            Some(q) if q.context == ctx => Ok(()),
            _ => Err(noent("QP")),
        }
    }

    pub(super) fn create_context(
        &mut self,
        bits: u32,
        pages: Vec<u64>,
    ) -> Result<Vec<u8>, Refused> {
        if bits > self.opts.max_doorbell_bits {
            return Err(Refused::invalid("doorbell bits past the device's"));
        }
        if self.contexts.len() as u32 >= self.opts.max_contexts {
            return Err(Refused::new(errno::ENOMEM.unsigned_abs(), "contexts"));
        }
        if pages
            .iter()
            .any(|&p| !self.in_memory(p, abi::PAGE_SIZE as usize))
        {
            return Err(fault("doorbell page outside guest memory"));
        }
        self.dev.claims.check(&pages, &[], None)?;
        let claimed = pages.clone();
        let area = doorbell::Area::new(bits, pages);
        area.set_poll(self.dev.device.mem(), self.polling)
            .map_err(|_| fault("doorbell area"))?;
        // Handles are not reused until the counter wraps (a stale handle
        // of a destroyed context names nothing for 2^32 contexts).
        let mut h = self.next_context;
        while h == 0 || self.contexts.contains_key(&h) {
            h = h.wrapping_add(1);
        }
        self.next_context = h.wrapping_add(1);
        self.dev.claims.claim(Owner::Context(h), &claimed, &[]);
        self.contexts.insert(
            h,
            Context {
                area,
                indices: doorbell::Indices::new(bits),
                doorbells: BTreeMap::new(),
            },
        );
        Ok(handle_resp(h))
    }

    /// Everything context `ctx` owns goes, as at a process's exit: QPs,
    /// SRQs, CQs, windows, MRs, PDs.
    pub(super) fn destroy_context(&mut self, ctx: u32) {
        let of = |m: &BTreeMap<u32, u32>| -> Vec<u32> {
            m.iter()
                .filter(|(_, c)| **c == ctx)
                .map(|(h, _)| *h)
                .collect()
        };
        let qps: Vec<u32> = self
            .dev
            .qps
            .iter()
            .filter(|(_, q)| q.context == ctx)
            .map(|(h, _)| *h)
            .collect();
        for qpn in qps {
            let _ = self.destroy_qp(qpn);
        }
        let srqs: Vec<u32> = self
            .dev
            .srqs
            .iter()
            .filter(|(_, s)| s.context == ctx)
            .map(|(h, _)| *h)
            .collect();
        for srq in srqs {
            let _ = self.dev.device.engine_mut().destroy_srq(SrqHandle(srq));
            self.dev.remove_srq(srq);
            self.dev.claims.release(Owner::Srq(srq));
        }
        let engine = self.dev.device.engine_mut();
        let cqs: Vec<u32> = self
            .cqs
            .iter()
            .filter(|(_, c)| c.context == ctx)
            .map(|(h, _)| *h)
            .collect();
        for cq in cqs {
            let _ = engine.destroy_cq(CqHandle(cq));
            self.cqs.remove(&cq);
            self.dev.claims.release(Owner::Cq(cq));
            self.notified.remove(&cq);
        }
        self.notifications.retain(|n| n.context.get() != ctx);
        for w in of(&self.mws) {
            if let Some(k) = engine.current_rkey(w) {
                let _ = engine.dealloc_mw(k);
            }
            self.mws.remove(&w);
        }
        for m in of(&self.mrs) {
            if let Some(k) = engine.current_lkey(m) {
                let _ = engine.dereg_mr(k);
            }
            self.mrs.remove(&m);
        }
        for pd in of(&self.pds) {
            let _ = engine.dealloc_pd(PdHandle(pd));
            self.pds.remove(&pd);
        }
        self.drop_events(|e| e.context.get() == ctx);
        self.dev.claims.release(Owner::Context(ctx));
        self.contexts.remove(&ctx);
    }
}

pub(super) fn handle_resp(h: u32) -> Vec<u8> {
    abi::HandleResp {
        handle: h.into(),
        reserved: 0.into(),
    }
    .as_bytes()
    .to_vec()
}

pub(super) fn mr_resp(lkey: Lkey, rkey: Rkey) -> Vec<u8> {
    abi::MrResp {
        lkey: lkey.0.into(),
        rkey: rkey.0.into(),
    }
    .as_bytes()
    .to_vec()
}

pub(super) fn qp_type_code(t: vrdma_engine::qp::QpType) -> u8 {
    use vrdma_engine::qp::QpType;
    match t {
        QpType::Gsi => abi::qp_type::GSI,
        QpType::Rc => abi::qp_type::RC,
        QpType::Uc => abi::qp_type::UC,
        QpType::Ud => abi::qp_type::UD,
    }
}
