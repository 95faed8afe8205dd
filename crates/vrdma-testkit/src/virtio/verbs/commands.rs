//! The device's commands as the driver sends them on the controlq:
//! contexts and GIDs, PDs, MRs (page lists, DMA, fast registration),
//! windows, CQs, SRQs, QPs made and modified (INIT, RTR along a
//! [`Path`], RTS), each as a method of the [`Frontend`].

use std::sync::Arc;

use vrdma_virtio::abi::{self, doorbell as db, op, qp_type};
use vrdma_wire::Gid;
use zerocopy::{FromZeros, IntoBytes};

use super::{
    codes::{PSN, QKEY, mask, state},
    objects::{Cq, Ctx, Door, Mr, Qp, QpSpec, Srq, WqRing},
    wqe::av,
};
use crate::virtio::{
    frontend::{Frontend, Status},
    ram::PAGE,
};

fn handle_req(h: u32) -> abi::HandleReq {
    abi::HandleReq {
        handle: h.into(),
        reserved: 0.into(),
    }
}

impl Frontend {
    /// CREATE_CONTEXT with a zeroed area of `bits` doorbells.
    pub fn try_context(&mut self, bits: u32) -> Result<Ctx, Status> {
        let n = db::area_pages(bits);
        let area = self.ram.pages(n);
        let pages: Vec<u64> = (0..n).map(|i| area + i * PAGE).collect();
        let req = abi::CreateContextReq {
            doorbell_bits: bits.into(),
            npages: u32::try_from(n).expect("pages").into(),
        };
        let r: abi::HandleResp = self.call(op::CREATE_CONTEXT, 0, req.as_bytes(), &pages)?;
        Ok(Ctx {
            handle: r.handle.get(),
            door: Arc::new(Door {
                ram: self.ram.clone(),
                ctx: r.handle.get(),
                area,
                bits,
                kicker: self.kicker.clone(),
            }),
        })
    }

    pub fn context(&mut self, bits: u32) -> Ctx {
        self.try_context(bits)
            .unwrap_or_else(|s| panic!("CREATE_CONTEXT refused: {s:?}"))
    }

    /// SET_GID of `gid` at `index`.
    pub fn set_gid(&mut self, ctx: &Ctx, index: u32, gid: Gid) -> Result<(), Status> {
        let req = abi::SetGidReq {
            index: index.into(),
            gid_type: abi::gid_type::ROCE_V2.into(),
            gid: gid.0,
        };
        self.command(op::SET_GID, ctx.handle, req.as_bytes(), &[])
            .map(|_| ())
    }

    pub fn pd(&mut self, ctx: &Ctx) -> u32 {
        let r: abi::HandleResp = self.ok(op::ALLOC_PD, ctx.handle, &[], &[]);
        r.handle.get()
    }

    /// A command naming one handle (DEALLOC_PD, DESTROY_CQ, …).
    pub fn destroy(&mut self, opcode: u16, ctx: &Ctx, h: u32) -> Result<(), Status> {
        self.command(opcode, ctx.handle, handle_req(h).as_bytes(), &[])
            .map(|_| ())
    }

    /// REG_MR over `len` fresh bytes (whole pages), addressed from `iova`
    /// (page-aligned here: offset 0).
    pub fn reg_mr(&mut self, ctx: &Ctx, pd: u32, len: u64, acc: u32) -> Mr {
        let npages = len.div_ceil(PAGE);
        let gpa = self.ram.pages(npages);
        let iova = 0x7f00_0000_0000 + gpa;
        self.reg_mr_at(ctx, pd, gpa, len, iova, acc)
            .unwrap_or_else(|s| panic!("REG_MR refused: {s:?}"))
    }

    /// REG_MR of `len` bytes of guest memory from `gpa` (page-aligned).
    pub fn reg_mr_at(
        &mut self,
        ctx: &Ctx,
        pd: u32,
        gpa: u64,
        len: u64,
        iova: u64,
        acc: u32,
    ) -> Result<Mr, Status> {
        let npages = len.div_ceil(PAGE);
        let pages: Vec<u64> = (0..npages).map(|i| gpa + i * PAGE).collect();
        let req = abi::RegMrReq {
            pd: pd.into(),
            access: acc.into(),
            iova: iova.into(),
            length: len.into(),
            page_shift: 12.into(),
            offset: 0.into(),
            npages: u32::try_from(npages).expect("pages").into(),
            reserved: 0.into(),
        };
        let r: abi::MrResp = self.call(op::REG_MR, ctx.handle, req.as_bytes(), &pages)?;
        Ok(Mr {
            gpa,
            len,
            iova,
            lkey: r.lkey.get(),
            rkey: r.rkey.get(),
        })
    }

    pub fn reg_dma_mr(&mut self, ctx: &Ctx, pd: u32, acc: u32) -> abi::MrResp {
        let req = abi::RegDmaMrReq {
            pd: pd.into(),
            access: acc.into(),
        };
        self.ok(op::REG_DMA_MR, ctx.handle, req.as_bytes(), &[])
    }

    pub fn alloc_mr(&mut self, ctx: &Ctx, pd: u32, max_pages: u32) -> abi::MrResp {
        let req = abi::AllocMrReq {
            pd: pd.into(),
            max_pages: max_pages.into(),
        };
        self.ok(op::ALLOC_MR, ctx.handle, req.as_bytes(), &[])
    }

    /// ALLOC_MW of `mw_type` (1 or 2): the window's rkey.
    pub fn alloc_mw(&mut self, ctx: &Ctx, pd: u32, mw_type: u32) -> u32 {
        let req = abi::AllocMwReq {
            pd: pd.into(),
            mw_type: mw_type.into(),
        };
        let r: abi::HandleResp = self.ok(op::ALLOC_MW, ctx.handle, req.as_bytes(), &[]);
        r.handle.get()
    }

    /// CREATE_CQ with a ring of `entries` 32-byte slots.
    pub fn try_cq(&mut self, ctx: &Ctx, entries: u32) -> Result<Cq, Status> {
        let ring = WqRing::new(&self.ram, entries, 32);
        let req = abi::CreateCqReq { ring: ring.desc() };
        let r: abi::CreateCqResp =
            self.call(op::CREATE_CQ, ctx.handle, req.as_bytes(), &ring.pages())?;
        assert_eq!(r.entries.get(), entries, "a CQ holds its ring's entries");
        Ok(Cq {
            ram: self.ram.clone(),
            door: ctx.door.clone(),
            handle: r.cq.get(),
            entries,
            doorbell: r.doorbell.get(),
            header: ring.header,
            ring: ring.base,
            stride: 32,
            cons: 0,
            seq: 0,
        })
    }

    pub fn cq(&mut self, ctx: &Ctx, entries: u32) -> Cq {
        self.try_cq(ctx, entries)
            .unwrap_or_else(|s| panic!("CREATE_CQ refused: {s:?}"))
    }

    /// CREATE_SRQ with `entries` slots of `max_sge` SGEs.
    pub fn srq(&mut self, ctx: &Ctx, pd: u32, entries: u32, max_sge: u32, limit: u32) -> Srq {
        let stride = (16 + 16 * max_sge)
            .next_power_of_two()
            .max(PAGE as u32 / entries);
        let ring = WqRing::new(&self.ram, entries, stride);
        let req = abi::CreateSrqReq {
            pd: pd.into(),
            max_sge: max_sge.into(),
            srq_limit: limit.into(),
            reserved: 0.into(),
            ring: ring.desc(),
        };
        let r: abi::CreateSrqResp =
            self.ok(op::CREATE_SRQ, ctx.handle, req.as_bytes(), &ring.pages());
        Srq {
            ram: self.ram.clone(),
            door: ctx.door.clone(),
            handle: r.srq.get(),
            doorbell: r.doorbell.get(),
            ring,
        }
    }

    /// CREATE_QP as `spec` says, its rings in fresh guest memory.
    pub fn try_qp(&mut self, ctx: &Ctx, pd: u32, spec: &QpSpec) -> Result<Qp, Status> {
        let ss = spec.send_stride();
        let sq = WqRing::new(&self.ram, spec.sq_entries.max(PAGE as u32 / ss), ss);
        let rq = (spec.srq == 0).then(|| {
            let rs = spec.recv_stride();
            WqRing::new(&self.ram, spec.rq_entries.max(PAGE as u32 / rs), rs)
        });
        let req = abi::CreateQpReq {
            pd: pd.into(),
            qp_type: spec.qp_type,
            sq_sig_all: u8::from(spec.sq_sig_all),
            reserved0: 0.into(),
            send_cq: spec.send_cq.into(),
            recv_cq: spec.recv_cq.into(),
            srq: spec.srq.into(),
            max_send_sge: spec.max_send_sge.into(),
            max_recv_sge: if spec.srq == 0 { spec.max_recv_sge } else { 0 }.into(),
            max_inline_data: spec.max_inline.into(),
            sq: sq.desc(),
            rq: rq.as_ref().map(WqRing::desc).unwrap_or_default(),
        };
        let mut pages = sq.pages();
        if let Some(r) = &rq {
            pages.extend(r.pages());
        }
        let r: abi::CreateQpResp = self.call(op::CREATE_QP, ctx.handle, req.as_bytes(), &pages)?;
        Ok(Qp {
            ram: self.ram.clone(),
            door: ctx.door.clone(),
            qpn: r.qpn.get(),
            doorbell: r.doorbell.get(),
            qp_type: spec.qp_type,
            sq,
            rq,
            resp: r,
        })
    }

    pub fn qp(&mut self, ctx: &Ctx, pd: u32, spec: &QpSpec) -> Qp {
        self.try_qp(ctx, pd, spec)
            .unwrap_or_else(|s| panic!("CREATE_QP refused: {s:?}"))
    }

    /// MODIFY_QP.
    pub fn modify_qp(
        &mut self,
        ctx: &Ctx,
        qpn: u32,
        attr_mask: u32,
        attrs: &abi::QpAttrs,
    ) -> Result<(), Status> {
        let req = abi::ModifyQpReq {
            qpn: qpn.into(),
            attr_mask: attr_mask.into(),
            attrs: *attrs,
        };
        self.command(op::MODIFY_QP, ctx.handle, req.as_bytes(), &[])
            .map(|_| ())
    }

    pub fn query_qp(&mut self, ctx: &Ctx, qpn: u32) -> abi::QueryQpResp {
        self.ok(op::QUERY_QP, ctx.handle, handle_req(qpn).as_bytes(), &[])
    }

    /// RESET → INIT (and for UD: → RTR → RTS).
    pub fn qp_init(&mut self, ctx: &Ctx, qp: &Qp, acc: u32) {
        let mut a = abi::QpAttrs::new_zeroed();
        a.qp_state = state::INIT.into();
        a.port_num = 1;
        let m = if qp.qp_type == qp_type::UD {
            a.qkey = QKEY.into();
            mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY
        } else {
            a.qp_access_flags = acc.into();
            mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS
        };
        self.modify_qp(ctx, qp.qpn, m, &a)
            .unwrap_or_else(|s| panic!("QP {} to INIT refused: {s:?}", qp.qpn));
    }

    /// INIT → RTR towards `dest` at `dgid` (connected QPs), or plain RTR
    /// (UD): MTU 1024, both sides starting at [`PSN`].
    pub fn qp_rtr(&mut self, ctx: &Ctx, qp: &Qp, dest: u32, dgid: Gid) {
        self.try_qp_rtr_to(ctx, qp, &Path::new(dest, dgid))
            .unwrap_or_else(|s| panic!("QP {} to RTR refused: {s:?}", qp.qpn));
    }

    /// INIT → RTR along `p` (connected QPs), or plain RTR (UD).
    pub fn try_qp_rtr_to(&mut self, ctx: &Ctx, qp: &Qp, p: &Path) -> Result<(), Status> {
        let mut a = abi::QpAttrs::new_zeroed();
        a.qp_state = state::RTR.into();
        let m = match qp.qp_type {
            qp_type::UD => mask::STATE,
            t => {
                a.ah = av(p.gid);
                a.ah.flow_label = p.flow_label.into();
                if let Some(dmac) = p.dmac {
                    a.ah.dmac = dmac;
                }
                a.path_mtu = p.mtu.into();
                a.dest_qp_num = p.qpn.into();
                a.rq_psn = p.psn.into();
                let mut m = mask::STATE | mask::AV | mask::PATH_MTU | mask::DEST_QPN | mask::RQ_PSN;
                if t == qp_type::RC {
                    a.max_dest_rd_atomic = 4;
                    a.min_rnr_timer = 1;
                    m |= mask::MAX_DEST_RD_ATOMIC | mask::MIN_RNR_TIMER;
                }
                m
            }
        };
        self.modify_qp(ctx, qp.qpn, m, &a)
    }

    /// RTR → RTS, sending from [`PSN`].
    pub fn qp_rts(&mut self, ctx: &Ctx, qp: &Qp) {
        self.try_qp_rts_at(ctx, qp, PSN)
            .unwrap_or_else(|s| panic!("QP {} to RTS refused: {s:?}", qp.qpn));
    }

    /// RTR → RTS, sending from `psn` (RC: timeout 14, 7 retries, 7 RNR
    /// retries, 4 READs/atomics in flight).
    pub fn try_qp_rts_at(&mut self, ctx: &Ctx, qp: &Qp, psn: u32) -> Result<(), Status> {
        let mut a = abi::QpAttrs::new_zeroed();
        a.qp_state = state::RTS.into();
        a.sq_psn = psn.into();
        let mut m = mask::STATE | mask::SQ_PSN;
        if qp.qp_type == qp_type::RC {
            a.timeout = 14;
            a.retry_cnt = 7;
            a.rnr_retry = 7;
            a.max_rd_atomic = 4;
            m |= mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC;
        }
        self.modify_qp(ctx, qp.qpn, m, &a)
    }

    /// To `st` with nothing else (ERR, RESET).
    pub fn qp_state(&mut self, ctx: &Ctx, qpn: u32, st: u32) -> Result<(), Status> {
        let mut a = abi::QpAttrs::new_zeroed();
        a.qp_state = st.into();
        self.modify_qp(ctx, qpn, mask::STATE, &a)
    }
}

/// Where a connected QP's RTR points: the peer QP, the PSN it starts at,
/// its GID, the path MTU (`ibv_mtu`: 1 = 256 … 5 = 4096) and, when not the
/// kit's placeholder, the next hop's MAC.
#[derive(Clone, Copy, Debug)]
pub struct Path {
    pub qpn: u32,
    pub psn: u32,
    pub gid: Gid,
    pub mtu: u32,
    pub dmac: Option<[u8; 6]>,
    /// The AV's flow label word, as the driver writes it.
    pub flow_label: u32,
}

impl Path {
    /// To `qpn` at `gid`, MTU 1024, from [`PSN`].
    pub fn new(qpn: u32, gid: Gid) -> Self {
        Path {
            qpn,
            psn: PSN,
            gid,
            mtu: 3,
            dmac: None,
            flow_label: 0,
        }
    }
}
