//! CQs and QPs as the driver holds them: their rings laid out in guest
//! pages, completions polled and CQs armed, WQEs posted and doorbells
//! rung, QPs modified and brought up (RC to RTS), WQE headers and SGEs
//! built.

use std::time::Duration;

use vrdma_pvrdma::abi::{self, PAGE_SIZE, cmd};
use vrdma_wire::Gid;
use zerocopy::{FromBytes, IntoBytes};

use super::{driver::hdr, vmm::Guest};

/// A CQ as the guest holds it.
#[derive(Debug)]
pub struct GuestCq {
    pub handle: u32,
    pub state: u64,
    pub data: Vec<u64>,
    pub cqe: u32,
    pub head: u32,
    /// The doorbell page (0: the kernel's; a user context's otherwise).
    pub uar: u64,
}

/// A QP as the guest holds it.
#[derive(Debug)]
pub struct GuestQp {
    pub qpn: u32,
    pub handle: u32,
    pub state: u64,
    pub sq: Vec<u64>,
    pub rq: Vec<u64>,
    pub sq_stride: u64,
    pub rq_stride: u64,
    pub sq_wr: u32,
    pub rq_wr: u32,
    pub sq_tail: u32,
    pub rq_tail: u32,
    /// The doorbell page.
    pub uar: u64,
}

impl Guest {
    pub fn create_cq(&mut self, cqe: u32, ctx: u32) -> GuestCq {
        let n = 1 + (u64::from(cqe) * 64).div_ceil(PAGE_SIZE);
        let (pages, dir) = self.pages(n);
        let r = self
            .command(&abi::CreateCq {
                hdr: hdr(cmd::CREATE_CQ),
                pdir_dma: dir.into(),
                ctx_handle: ctx.into(),
                cqe: cqe.into(),
                nchunks: (n as u32).into(),
                reserved: [0; 4],
            })
            .expect("CREATE_CQ");
        let resp = abi::CreateCqResp::read_from_bytes(&r[..24]).expect("24 bytes");
        assert_eq!(resp.cqe.get(), cqe);
        GuestCq {
            handle: resp.cq_handle.get(),
            state: pages[0],
            data: pages[1..].to_vec(),
            cqe,
            head: 0,
            uar: 0,
        }
    }

    /// The completions waiting in `cq`, consumed.
    pub fn poll(&mut self, cq: &mut GuestCq) -> Vec<abi::Cqe> {
        let mut out = Vec::new();
        loop {
            let tail = self.get32(cq.state + 8);
            if tail == cq.head {
                return out;
            }
            let slot = u64::from(cq.head & (cq.cqe - 1));
            let off = slot * 64;
            let page = cq.data[(off / PAGE_SIZE) as usize];
            let e =
                abi::Cqe::read_from_bytes(&self.get(page + off % PAGE_SIZE, 64)).expect("64 bytes");
            out.push(e);
            cq.head = (cq.head + 1) & (2 * cq.cqe - 1);
            self.put32(cq.state + 12, cq.head);
        }
    }

    /// Polls `cq` until `n` completions came (5 s at most).
    pub fn poll_n(&mut self, cq: &mut GuestCq, n: usize) -> Vec<abi::Cqe> {
        self.poll_n_for(cq, n, Duration::from_secs(5))
    }

    /// Polls `cq` until `n` completions came (`limit` at most).
    pub fn poll_n_for(&mut self, cq: &mut GuestCq, n: usize, limit: Duration) -> Vec<abi::Cqe> {
        let deadline = std::time::Instant::now() + limit;
        let mut out = Vec::new();
        while out.len() < n && std::time::Instant::now() < deadline {
            out.extend(self.poll(cq));
            if out.len() < n {
                // The POLL doorbell, as the driver rings it on an empty CQ.
                self.write32(2, cq.uar * PAGE_SIZE + 4, cq.handle | abi::uar::CQ_POLL);
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        out
    }

    /// Arms `cq` for its next completion.
    pub fn arm(&mut self, cq: &GuestCq, uar: u64, solicited: bool) {
        let bit = if solicited {
            abi::uar::CQ_ARM_SOL
        } else {
            abi::uar::CQ_ARM
        };
        self.write32(2, uar * PAGE_SIZE + 4, cq.handle | bit);
    }

    /// A QP of `ty` (abi qp_type) on `pd` with these CQs and depths, 2 SGEs
    /// each way: its rings in guest pages laid out as the driver lays them.
    pub fn create_qp(&mut self, ty: u8, pd: u32, scq: u32, rcq: u32, depth: u32) -> GuestQp {
        self.create_qp_uar(ty, pd, scq, rcq, depth, 0)
    }

    pub fn create_qp_uar(
        &mut self,
        ty: u8,
        pd: u32,
        scq: u32,
        rcq: u32,
        depth: u32,
        uar: u64,
    ) -> GuestQp {
        let sges = 2u32;
        let sq_stride = (80 + 16 * u64::from(sges)).next_power_of_two();
        let rq_stride = (16 + 16 * u64::from(sges)).next_power_of_two();
        let sq_pages = (u64::from(depth) * sq_stride).div_ceil(PAGE_SIZE);
        let rq_pages = (u64::from(depth) * rq_stride).div_ceil(PAGE_SIZE);
        let total = 1 + sq_pages + rq_pages;
        let (pages, dir) = self.pages(total);
        let r = self
            .command(&abi::CreateQp {
                hdr: hdr(cmd::CREATE_QP),
                pdir_dma: dir.into(),
                pd_handle: pd.into(),
                send_cq_handle: scq.into(),
                recv_cq_handle: rcq.into(),
                max_send_wr: depth.into(),
                max_recv_wr: depth.into(),
                max_send_sge: sges.into(),
                max_recv_sge: sges.into(),
                access_flags: 1.into(),
                total_chunks: (total as u16).into(),
                send_chunks: (sq_pages as u16).into(),
                qp_type: ty,
                ..abi::CreateQp::default()
            })
            .expect("CREATE_QP");
        let resp = abi::CreateQpRespV2::read_from_bytes(&r[..48]).expect("48 bytes");
        GuestQp {
            qpn: resp.qpn.get(),
            handle: resp.qp_handle.get(),
            state: pages[0],
            sq: pages[1..1 + sq_pages as usize].to_vec(),
            rq: pages[1 + sq_pages as usize..].to_vec(),
            sq_stride,
            rq_stride,
            sq_wr: depth,
            rq_wr: depth,
            sq_tail: 0,
            rq_tail: 0,
            uar,
        }
    }

    /// Posts a send WQE (its 80-byte header and SGEs) and rings the SEND
    /// doorbell.
    pub fn post_send(&mut self, qp: &mut GuestQp, wqe: &abi::SqWqeHdr, sges: &[abi::Sge]) {
        self.write_send(qp, wqe, sges);
        self.write32(2, qp.uar * PAGE_SIZE, qp.handle | abi::uar::QP_SEND);
    }

    /// Writes a send WQE and moves prod_tail, without the doorbell.
    pub fn write_send(&mut self, qp: &mut GuestQp, wqe: &abi::SqWqeHdr, sges: &[abi::Sge]) -> u64 {
        let slot = u64::from(qp.sq_tail & (qp.sq_wr - 1));
        let off = slot * qp.sq_stride;
        let at = qp.sq[(off / PAGE_SIZE) as usize] + off % PAGE_SIZE;
        self.put(at, wqe.as_bytes());
        for (i, s) in sges.iter().enumerate() {
            self.put(at + 80 + 16 * i as u64, s.as_bytes());
        }
        qp.sq_tail = (qp.sq_tail + 1) & (2 * qp.sq_wr - 1);
        self.put32(qp.state, qp.sq_tail);
        at
    }

    /// Posts a receive WQE and rings the RECV doorbell.
    pub fn post_recv(&mut self, qp: &mut GuestQp, wr_id: u64, sges: &[abi::Sge]) {
        let slot = u64::from(qp.rq_tail & (qp.rq_wr - 1));
        let off = slot * qp.rq_stride;
        let at = qp.rq[(off / PAGE_SIZE) as usize] + off % PAGE_SIZE;
        let h = abi::RqWqeHdr {
            wr_id: wr_id.into(),
            num_sge: (sges.len() as u32).into(),
            total_len: 0.into(),
        };
        self.put(at, h.as_bytes());
        for (i, s) in sges.iter().enumerate() {
            self.put(at + 16 + 16 * i as u64, s.as_bytes());
        }
        qp.rq_tail = (qp.rq_tail + 1) & (2 * qp.rq_wr - 1);
        self.put32(qp.state + 8, qp.rq_tail);
        self.write32(2, qp.uar * PAGE_SIZE, qp.handle | abi::uar::QP_RECV);
    }

    /// Rings a QP's doorbell with `bits` (QP_SEND, QP_RECV) on its page.
    pub fn ring_qp(&mut self, qp: &GuestQp, bits: u32) {
        self.write32(2, qp.uar * PAGE_SIZE, qp.handle | bits);
    }

    /// MODIFY_QP; Err(ERR) if refused.
    pub fn modify_qp(&mut self, qp: &GuestQp, attrs: abi::QpAttr, mask: u32) -> Result<(), u32> {
        self.command(&abi::ModifyQp {
            hdr: hdr(cmd::MODIFY_QP),
            qp_handle: qp.handle.into(),
            attr_mask: mask.into(),
            attrs,
        })
        .map(|_| ())
    }

    /// The QP's state as QUERY_QP reports it.
    pub fn qp_state(&mut self, qp: &GuestQp) -> u32 {
        let r = self
            .command(&abi::QueryQp {
                hdr: hdr(cmd::QUERY_QP),
                qp_handle: qp.handle.into(),
                attr_mask: 0.into(),
            })
            .expect("QUERY_QP");
        let a = abi::QpAttr::read_from_bytes(&r[16..176]).expect("160 bytes");
        a.qp_state.get()
    }

    /// The consumer index of the QP's send ring, as the device left it.
    pub fn sq_cons(&self, qp: &GuestQp) -> u32 {
        self.get32(qp.state + 4)
    }

    /// The receive ring's consumer index (the second ring state).
    pub fn rq_cons(&self, qp: &GuestQp) -> u32 {
        self.get32(qp.state + 12)
    }
}

/// RC bring-up to RTS towards `dest_qpn` at `dgid`, the way perftest sets
/// it (MTU 1024, timeout 14, retries 7).
pub fn rc_up(g: &mut Guest, qp: &GuestQp, dgid: Gid, dest_qpn: u32, dmac: [u8; 6]) {
    rc_up_mtu(g, qp, dgid, dest_qpn, dmac, 3);
}

/// [`rc_up`] with the path MTU `mtu` (the verbs' code: 3 for 1024, 5 for
/// 4096).
pub fn rc_up_mtu(g: &mut Guest, qp: &GuestQp, dgid: Gid, dest_qpn: u32, dmac: [u8; 6], mtu: u32) {
    use vrdma_engine::qp::AttrMask as M;
    let mut a = abi::QpAttr {
        qp_state: 1.into(),
        pkey_index: 0.into(),
        port_num: 1,
        qp_access_flags: (2 | 4 | 8).into(),
        ..abi::QpAttr::default()
    };
    g.modify_qp(
        qp,
        a,
        (M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS).0,
    )
    .expect("MODIFY_QP to INIT");
    a.qp_state = 2.into();
    a.path_mtu = mtu.into();
    a.dest_qp_num = dest_qpn.into();
    a.rq_psn = 0x100.into();
    a.max_dest_rd_atomic = 4;
    a.min_rnr_timer = 12;
    a.ah_attr.dgid = dgid.0;
    a.ah_attr.port_num = 1;
    a.ah_attr.hop_limit = 64;
    a.ah_attr.ah_flags = 1;
    a.ah_attr.dmac = dmac;
    g.modify_qp(
        qp,
        a,
        (M::STATE
            | M::AV
            | M::PATH_MTU
            | M::DEST_QPN
            | M::RQ_PSN
            | M::MAX_DEST_RD_ATOMIC
            | M::MIN_RNR_TIMER)
            .0,
    )
    .expect("MODIFY_QP to RTR");
    a.qp_state = 3.into();
    a.sq_psn = 0x100.into();
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 4;
    g.modify_qp(
        qp,
        a,
        (M::STATE | M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC).0,
    )
    .expect("MODIFY_QP to RTS");
}

/// A send WQE header.
pub fn wqe(wr_id: u64, opcode: u32, flags: u32, nsge: u32) -> abi::SqWqeHdr {
    abi::SqWqeHdr {
        wr_id: wr_id.into(),
        num_sge: nsge.into(),
        opcode: opcode.into(),
        send_flags: flags.into(),
        ..abi::SqWqeHdr::default()
    }
}

/// An SGE.
pub fn sge(addr: u64, len: u32, lkey: u32) -> abi::Sge {
    abi::Sge {
        addr: addr.into(),
        length: len.into(),
        lkey: lkey.into(),
    }
}
