//! QPs as the guest sees them: a send and a receive ring of WQEs in guest
//! memory, which the device takes into the engine — a copy of each WQE,
//! decoded and checked, never a reference to the guest's — and whose
//! consumer index it moves as the engine retires what it took.
//!
//! The device takes a WQE only when the engine's queue has room for it,
//! and reports a ring slot free (its consumer index) only when the engine
//! has retired the WQE taken from it: the guest's ring and the engine's
//! queue have the same depth, so a full ring means WRs outstanding, as a
//! verbs consumer expects, and the engine never refuses a WQE for room.
//!
//! A WQE that cannot be decoded (an opcode the QP type has no use for, too
//! many SGEs, inline data, a fast registration with a bad page list)
//! completes with LOC_QP_OP_ERR or LOC_LEN_ERR in its turn and takes the
//! QP to ERR, as a hardware device does with a malformed descriptor.

use vm_memory::GuestMemoryMmap;
use vrdma_engine::{
    Engine,
    mr::{Access, Translation},
    qp::{AhAttr, QpState},
    wc::WcStatus,
    wr::{Av, Payload, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest},
};
use vrdma_wire::{Gid, Lkey, QKey, Qpn, Rkey};
use zerocopy::{FromBytes, IntoBytes};

use crate::{
    abi::{self, PAGE_SIZE, RqWqeHdr, SqWqeHdr, qp_type, send_flags, wr_opcode},
    ring::{self, GuestError, GuestRing, PageList},
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

/// A decoded send WQE, ready for the engine.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct SendWqe {
    pub wr_id: u64,
    pub op: SendOp,
    pub flags: SendFlags,
    pub sges: Vec<Sge>,
    pub ud: Option<UdDest>,
    /// A fast registration's page list, for the MR before it runs.
    pub fast_reg: Option<(Lkey, Translation)>,
}

/// The QP a WQE is decoded for.
#[derive(Clone, Copy, Debug)]
pub struct QpContext {
    pub ty: u8,
    pub pd: u32,
    pub max_send_sge: u32,
    pub stride: u64,
}

/// Why a WQE could not be taken: the status its completion carries.
fn malformed(status: WcStatus) -> WcStatus {
    status
}

/// Decodes the send WQE at `addr`. `Err(status)`: the WQE is malformed
/// and completes with `status` (the QP then goes to ERR); a WQE that
/// cannot even be read is an access error of the QP's ring.
pub fn decode_send(
    mem: &GuestMemoryMmap<()>,
    addr: u64,
    qp: &QpContext,
    engine: &Engine,
) -> Result<Result<SendWqe, (u64, WcStatus)>, GuestError> {
    let h: SqWqeHdr = ring::read(mem, addr)?;
    let wr_id = h.wr_id.get();
    let bad = |s| Ok(Err((wr_id, malformed(s))));
    let num_sge = h.num_sge.get();
    if num_sge > qp.max_send_sge || SQ_WQE_HDR + SGE * u64::from(num_sge) > qp.stride {
        return bad(WcStatus::LocLenErr);
    }
    let flags_in = h.send_flags.get();
    if flags_in & send_flags::INLINE != 0 {
        // No inline data: the device announces max_inline_data 0.
        return bad(WcStatus::LocQpOpErr);
    }
    let mut flags = SendFlags(0);
    for (bit, f) in [
        (send_flags::FENCE, SendFlags::FENCE),
        (send_flags::SIGNALED, SendFlags::SIGNALED),
        (send_flags::SOLICITED, SendFlags::SOLICITED),
    ] {
        if flags_in & bit != 0 {
            flags = flags | f;
        }
    }
    let mut sges = Vec::with_capacity(num_sge as usize);
    for i in 0..u64::from(num_sge) {
        let s: abi::Sge = ring::read(mem, addr + SQ_WQE_HDR + i * SGE)?;
        sges.push(Sge {
            addr: s.addr.get(),
            length: s.length.get(),
            lkey: Lkey(s.lkey.get()),
        });
    }
    let wr: &[u8] = h.wr.as_bytes();
    let u64_at = |o: usize| u64::from_le_bytes(wr[o..o + 8].try_into().unwrap_or_default());
    let u32_at = |o: usize| u32::from_le_bytes(wr[o..o + 4].try_into().unwrap_or_default());
    // The immediate as the wire carries it: the four bytes the consumer
    // stored.
    let imm = u32::from_be_bytes(h.ex.to_bytes());
    let connected = matches!(qp.ty, qp_type::RC | qp_type::UC);
    let rc = qp.ty == qp_type::RC;
    let datagram = matches!(qp.ty, qp_type::UD | qp_type::GSI);
    let op = match h.opcode.get() {
        wr_opcode::SEND => SendOp::Send,
        wr_opcode::SEND_WITH_IMM => SendOp::SendWithImm { imm },
        wr_opcode::RDMA_WRITE if connected => SendOp::RdmaWrite {
            remote_addr: u64_at(0),
            rkey: Rkey(u32_at(8)),
        },
        wr_opcode::RDMA_WRITE_WITH_IMM if connected => SendOp::RdmaWriteWithImm {
            remote_addr: u64_at(0),
            rkey: Rkey(u32_at(8)),
            imm,
        },
        wr_opcode::RDMA_READ if rc => SendOp::RdmaRead {
            remote_addr: u64_at(0),
            rkey: Rkey(u32_at(8)),
        },
        wr_opcode::ATOMIC_CMP_AND_SWP if rc => SendOp::CompareSwap {
            remote_addr: u64_at(0),
            compare: u64_at(8),
            swap: u64_at(16),
            rkey: Rkey(u32_at(24)),
        },
        wr_opcode::ATOMIC_FETCH_AND_ADD if rc => SendOp::FetchAdd {
            remote_addr: u64_at(0),
            add: u64_at(8),
            rkey: Rkey(u32_at(24)),
        },
        wr_opcode::SEND_WITH_INV if rc => SendOp::SendWithInv {
            invalidate: Rkey(h.ex.get()),
        },
        wr_opcode::LOCAL_INV if !datagram => SendOp::LocalInv {
            invalidate: Rkey(h.ex.get()),
        },
        wr_opcode::FAST_REG_MR if !datagram => {
            return fast_reg(mem, wr_id, flags, wr, qp, engine);
        }
        _ => return bad(WcStatus::LocQpOpErr),
    };
    let ud = if datagram {
        // remote_qpn, remote_qkey, then the address vector.
        let remote_qpn = u32_at(0);
        let remote_qkey = u32_at(4);
        let Ok((av, _)) = abi::Av::read_from_prefix(&wr[8..]) else {
            return bad(WcStatus::LocQpOpErr);
        };
        // The AV's PD must be the QP's (IBTA Vol1 §10.2.3); the provider
        // builds AVs in userspace, so nothing else has checked it.
        if av.port_pd.get() & 0x00ff_ffff != qp.pd {
            return bad(WcStatus::LocQpOpErr);
        }
        let Ok(qpn) = Qpn::try_from(remote_qpn) else {
            return bad(WcStatus::LocQpOpErr);
        };
        let stf = av.sl_tclass_flowlabel.get();
        let attr = AhAttr {
            dgid: Gid(av.dgid),
            flow_label: stf & 0xf_ffff,
            sgid_index: av.gid_index,
            hop_limit: av.hop_limit,
            traffic_class: (stf >> 20) as u8,
            sl: 0,
            port_num: 1,
            dmac: Some(av.dmac),
        };
        Some(UdDest {
            av: Av::Inline(attr),
            remote_qpn: qpn,
            remote_qkey: QKey(remote_qkey),
        })
    } else {
        None
    };
    Ok(Ok(SendWqe {
        wr_id,
        op,
        flags,
        sges,
        ud,
        fast_reg: None,
    }))
}

/// A FAST_REG_MR WQE: the page list (read now, a copy) and the REG_MR.
fn fast_reg(
    mem: &GuestMemoryMmap<()>,
    wr_id: u64,
    flags: SendFlags,
    wr: &[u8],
    qp: &QpContext,
    engine: &Engine,
) -> Result<Result<SendWqe, (u64, WcStatus)>, GuestError> {
    let u64_at = |o: usize| u64::from_le_bytes(wr[o..o + 8].try_into().unwrap_or_default());
    let u32_at = |o: usize| u32::from_le_bytes(wr[o..o + 4].try_into().unwrap_or_default());
    let iova = u64_at(0);
    let pl_pdir = u64_at(8);
    let page_shift = u32_at(16);
    let list_len = u32_at(20);
    let length = u64::from(u32_at(24));
    let access = u32_at(28);
    let rkey = u32_at(32);
    let bad = Ok(Err((wr_id, WcStatus::LocQpOpErr)));
    if page_shift != 12 || list_len == 0 || list_len > abi::MAX_FAST_REG_PAGES {
        return bad;
    }
    // The MR by its index; the engine checks that it is a
    // fast-registration MR of the QP's PD when the REG_MR runs.
    let Some(mr) = engine.current_lkey(rkey >> 8) else {
        return bad;
    };
    let pages = match PageList::read(mem, pl_pdir, u64::from(list_len)) {
        Ok(p) => p,
        Err(GuestError::Unmapped(_) | GuestError::Unaligned(_) | GuestError::PageCount(_)) => {
            return bad;
        }
        Err(e) => return Err(e),
    };
    let offset = iova % PAGE_SIZE;
    let translation = Translation::Pages {
        page_shift: 12,
        offset,
        pages: pages.pages().to_vec(),
    };
    let _ = qp;
    Ok(Ok(SendWqe {
        wr_id,
        op: SendOp::RegMr {
            mr,
            key: rkey as u8,
            iova,
            length,
            // The rights the device implements; relaxed ordering and
            // the like are ignored, as the driver passes them unchecked.
            access: Access(access & 0x3f),
        },
        flags,
        sges: Vec::new(),
        ud: None,
        fast_reg: Some((mr, translation)),
    }))
}

/// Decodes the receive WQE at `addr`: its wr_id and SGEs, or `Err(wr_id)`
/// when it has more SGEs than the queue allows.
pub fn decode_recv(
    mem: &GuestMemoryMmap<()>,
    addr: u64,
    max_sge: u32,
    stride: u64,
) -> Result<Result<(u64, Vec<Sge>), u64>, GuestError> {
    let h: RqWqeHdr = ring::read(mem, addr)?;
    let n = h.num_sge.get();
    if n > max_sge || RQ_WQE_HDR + SGE * u64::from(n) > stride {
        return Ok(Err(h.wr_id.get()));
    }
    let mut sges = Vec::with_capacity(n as usize);
    for i in 0..u64::from(n) {
        let s: abi::Sge = ring::read(mem, addr + RQ_WQE_HDR + i * SGE)?;
        sges.push(Sge {
            addr: s.addr.get(),
            length: s.length.get(),
            lkey: Lkey(s.lkey.get()),
        });
    }
    Ok(Ok((h.wr_id.get(), sges)))
}

/// A QP's face: its rings and how far the device has taken them.
#[derive(Debug)]
pub struct QpFace {
    pub qpn: Qpn,
    pub ctx: QpContext,
    /// The doorbell page that may ring it (its context's; 0 for the
    /// kernel's).
    pub uar: u32,
    pub sq: GuestRing,
    /// None when the QP uses an SRQ.
    pub rq: Option<GuestRing>,
    pub max_recv_sge: u32,
    /// The next send WQE to take.
    sq_next: u32,
    rq_next: u32,
    /// The consumer indexes last written to the guest.
    sq_cons: u32,
    rq_cons: u32,
    /// WQEs taken from this QP, malformed or not.
    pub taken: u64,
    pub malformed: u64,
    /// The guest broke a ring (an index the driver could never have
    /// written, unmapped memory): nothing more is taken from either ring
    /// until the QP goes back to RESET, so the QP_FATAL the break raised is
    /// raised once, not on every doorbell or round.
    broken: bool,
}

/// What taking WQEs did.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Taken {
    pub wqes: u32,
    /// Of those, WQEs that could not be decoded.
    pub malformed: u32,
    /// The ring itself was unusable (a bad index, unmapped memory): the
    /// QP is to be taken to ERR with a fatal event.
    pub broken: bool,
}

impl QpFace {
    pub fn new(
        qpn: Qpn,
        ctx: QpContext,
        uar: u32,
        sq: GuestRing,
        rq: Option<GuestRing>,
        max_recv_sge: u32,
    ) -> Self {
        QpFace {
            qpn,
            ctx,
            uar,
            sq,
            rq,
            max_recv_sge,
            sq_next: 0,
            rq_next: 0,
            sq_cons: 0,
            rq_cons: 0,
            taken: 0,
            malformed: 0,
            broken: false,
        }
    }

    /// After a transition to RESET: the driver zeroes both rings; so does
    /// the device's view of them.
    pub fn reset(&mut self) {
        self.sq_next = 0;
        self.rq_next = 0;
        self.sq_cons = 0;
        self.rq_cons = 0;
        self.broken = false;
    }

    /// The ring is broken: says so once (the caller raises QP_FATAL).
    fn break_ring(&mut self, t: &mut Taken) {
        t.broken = !self.broken;
        self.broken = true;
    }

    /// Takes the send WQEs the guest posted, as far as the engine has room.
    pub fn take_sends(&mut self, mem: &GuestMemoryMmap<()>, engine: &mut Engine) -> Taken {
        let mut t = Taken::default();
        if self.broken {
            return t;
        }
        let Ok((attr, init)) = engine.query_qp(self.qpn) else {
            return t;
        };
        // Nothing is taken before RTS (the WQEs wait in the ring, as the
        // driver refuses to post them anyway), nor in RESET.
        if !matches!(attr.qp_state, QpState::Rts | QpState::Sqd | QpState::Err) {
            return t;
        }
        let depth = init.cap.max_send_wr;
        let ring = self.sq.ring;
        let prod = match self.sq.prod_tail(mem) {
            // The driver posts only into free slots: it never gets more
            // than a ring ahead of the consumer index the device last
            // gave it. A producer further on would have the device take
            // slots again that it has not given back.
            Ok(p) if ring.used(p, self.sq_cons) <= ring.capacity() => p,
            _ => {
                self.break_ring(&mut t);
                return t;
            }
        };
        while self.sq_next != prod {
            let queued = engine.sq_len(self.qpn).unwrap_or(u32::MAX);
            if queued >= depth {
                break;
            }
            let addr = self.sq.element(self.sq_next);
            let wqe = match decode_send(mem, addr, &self.ctx, engine) {
                Ok(w) => w,
                Err(_) => {
                    self.break_ring(&mut t);
                    break;
                }
            };
            self.sq_next = ring.next(self.sq_next);
            self.taken += 1;
            t.wqes += 1;
            let posted = match wqe {
                Ok(w) => {
                    let wr = SendWr {
                        wr_id: w.wr_id,
                        op: w.op,
                        payload: Payload::Sges(&w.sges),
                        flags: w.flags,
                        ud: w.ud,
                    };
                    match w.fast_reg {
                        // The page list goes with the REG_MR and is mapped
                        // when it runs, in its turn (a list the MR cannot
                        // take fails the REG_MR itself).
                        Some((_, pages)) => engine.post_reg_mr(self.qpn, &wr, pages),
                        None => engine.post_send(self.qpn, &wr),
                    }
                    .map_err(|_| (w.wr_id, WcStatus::LocQpOpErr))
                }
                Err(e) => Err(e),
            };
            if let Err((wr_id, status)) = posted {
                self.malformed += 1;
                t.malformed += 1;
                // In its turn: completes in error, takes the QP to ERR.
                let _ = engine.post_send(
                    self.qpn,
                    &SendWr {
                        wr_id,
                        op: SendOp::Malformed { status },
                        payload: Payload::Sges(&[]),
                        flags: SendFlags::SIGNALED,
                        ud: None,
                    },
                );
            }
        }
        t
    }

    /// Takes the receive WQEs the guest posted, as far as the engine has
    /// room.
    pub fn take_recvs(&mut self, mem: &GuestMemoryMmap<()>, engine: &mut Engine) -> Taken {
        let mut t = Taken::default();
        if self.broken {
            return t;
        }
        let Some(rq) = self.rq.clone() else {
            return t;
        };
        let Ok((attr, init)) = engine.query_qp(self.qpn) else {
            return t;
        };
        if attr.qp_state == QpState::Reset {
            return t;
        }
        let depth = init.cap.max_recv_wr;
        let prod = match rq.prod_tail(mem) {
            // Never more than a ring ahead (see take_sends).
            Ok(p) if rq.ring.used(p, self.rq_cons) <= rq.ring.capacity() => p,
            _ => {
                self.break_ring(&mut t);
                return t;
            }
        };
        while self.rq_next != prod {
            if engine.rq_len(self.qpn).unwrap_or(u32::MAX) >= depth {
                break;
            }
            let addr = rq.element(self.rq_next);
            let wqe = match decode_recv(mem, addr, self.max_recv_sge, rq.stride()) {
                Ok(w) => w,
                Err(_) => {
                    self.break_ring(&mut t);
                    break;
                }
            };
            self.rq_next = rq.ring.next(self.rq_next);
            self.taken += 1;
            t.wqes += 1;
            match wqe {
                Ok((wr_id, sges)) => {
                    let _ = engine.post_recv(
                        self.qpn,
                        &RecvWr {
                            wr_id,
                            sg_list: &sges,
                        },
                    );
                }
                Err(wr_id) => {
                    // Too many SGEs: the QP fails, and this WQE is flushed
                    // with the others.
                    self.malformed += 1;
                    t.malformed += 1;
                    let _ = engine.qp_fatal(self.qpn);
                    let _ = engine.post_recv(
                        self.qpn,
                        &RecvWr {
                            wr_id,
                            sg_list: &[],
                        },
                    );
                }
            }
        }
        t
    }

    /// Moves the guest's consumer indexes to what the device has taken: a
    /// WQE's slot is free once the device has copied it out. Not later,
    /// when the engine retires it: the provider posts into a slot as soon
    /// as its ring has room, and a latency test's one-slot ring would find
    /// no room between the completion it just polled and an index the
    /// device publishes a moment after the completion was written. The
    /// device takes only as many WQEs as the engine has room for, so a
    /// guest has at most a ring of WQEs waiting beside those in flight.
    pub fn publish(&mut self, mem: &GuestMemoryMmap<()>) {
        if self.sq_next != self.sq_cons && self.sq.set_cons_head(mem, self.sq_next).is_ok() {
            self.sq_cons = self.sq_next;
        }
        if let Some(rq) = &self.rq
            && self.rq_next != self.rq_cons
            && rq.set_cons_head(mem, self.rq_next).is_ok()
        {
            self.rq_cons = self.rq_next;
        }
    }

    /// Whether the guest has posted WQEs the device has not taken.
    pub fn pending(&self, mem: &GuestMemoryMmap<()>) -> bool {
        if self.broken {
            return false;
        }
        self.sq.prod_tail(mem).is_ok_and(|p| p != self.sq_next)
            || self
                .rq
                .as_ref()
                .is_some_and(|rq| rq.prod_tail(mem).is_ok_and(|p| p != self.rq_next))
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
) -> Option<(GuestRing, Option<GuestRing>)> {
    let state = *pages.pages().first()?;
    let sc = send_chunks as usize;
    if pages.len() < 1 + sc {
        return None;
    }
    let sq = GuestRing::new(
        max_send_wr,
        send_stride,
        state + abi::ring_state::SQ,
        pages.skip(1).take(sc),
    )?;
    let rq = if has_rq {
        Some(GuestRing::new(
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
