//! The virtio-rdma device's state, transport-neutral: the spec's commands
//! carried out on a vrdma device, contexts and their doorbell areas, the
//! objects each context owns, rings taken into the engine, CQs armed
//! through guest memory, and the events and notifications waiting for the
//! driver's buffers. The vhost-user backend (`vhost`) moves bytes between
//! virtqueues and this; nothing here knows a virtqueue.

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
};

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vrdma_device::{Device, GuestMem, ObjectBudget, Transport};
use vrdma_engine::{
    CqHandle, Engine, PdHandle, SrqHandle,
    attr::{DeviceAttr, GidEntry, GidType, PortAttr, PortState},
    cq::CqSink,
    event::AsyncEvent,
    mr::{MrRequest, Translation},
    objects::{SrqAttr, SrqAttrMask},
    qp::{QpCap, QpInitAttr},
    wc::{Wc, WcStatus},
};
use vrdma_face::{
    Budget, GuestRing, PageList, Refusal, Refusals, Refused,
    cq::{GuestCq, SharedMem},
    refusals,
    ring::{FreeRunning, Indices},
    status::OrRefuse,
    wq::{self, QpQueues, SrqQueue},
};
use vrdma_wire::{Lkey, Qpn, Rkey};
use zerocopy::{FromZeros, IntoBytes};

use crate::{
    abi::{self, cq_header, event as ev, op, status, wq_header},
    decode::{self, Command, CreateQp, Payload, RingSpec, SendShape, fault, noent},
    doorbell,
};

/// What a device is made with.
#[derive(Clone, Debug)]
pub struct Options {
    /// The sibling NIC's MAC, named in the configuration.
    pub mac: [u8; 6],
    pub max_contexts: u32,
    pub max_doorbell_bits: u32,
    /// The device polls doorbell areas (VIRTIO_RDMA_F_DOORBELL_POLL).
    pub poll: bool,
    /// Events held while the driver has posted no eventq buffer.
    pub max_pending_events: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            mac: [0; 6],
            max_contexts: 256,
            max_doorbell_bits: 1 << 16,
            poll: true,
            max_pending_events: 4096,
        }
    }
}

/// The device attributes a virtio-rdma device announces: the engine's
/// defaults (≥ 16 384 QPs and CQs, 16 384 WRs per QP and SRQ: UCX asks
/// for 4 096-entry receive queues and SRQs), inline data, a RoCE port.
pub fn device_attr(mac: [u8; 6]) -> DeviceAttr {
    // The node GUID from the MAC (EUI-64, as RoCE devices derive it).
    let [a, b, c, d, e, f] = mac;
    let guid = u64::from_be_bytes([a ^ 2, b, c, 0xff, 0xfe, d, e, f]);
    DeviceAttr {
        node_guid: guid,
        sys_image_guid: guid,
        vendor_id: 0x1af4,
        vendor_part_id: u32::from(abi::PCI_DEVICE_ID),
        max_qp: 1 << 16,
        max_cq: 1 << 15,
        // A ring of 2^22 entries (128 MiB of guest memory, a page list of
        // 32 768 pages) is the largest, as on ConnectX (4 194 303 CQEs):
        // libfabric's rxm asks for 135 168 CQEs by default in 1.17 and
        // 262 144 in 2.1 (rxe offers 32 767). What a CQ costs the daemon
        // does not grow with it: its ring is the guest's.
        max_cqe: (1 << 22) - 1,
        max_srq: 1 << 14,
        // REG_MR takes page shifts 12 ..= 30.
        page_size_cap: 0x7fff_f000,
        ..DeviceAttr::default()
    }
}

/// Counters of what the face did (`virtio.*` in `vrdma stat`).
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct FaceStats {
    pub commands: u64,
    pub refused: u64,
    pub doorbells: u64,
    /// Doorbell bits that named no object (stale or the guest's noise).
    pub stale_doorbells: u64,
    pub wqes: u64,
    pub malformed_wqes: u64,
    pub broken_rings: u64,
    pub arms: u64,
    pub notifications: u64,
    pub events: u64,
    pub events_lost: u64,
    /// Doorbell areas the device could not read or write (outside memory).
    pub area_faults: u64,
    pub resets: u64,
}

/// What the driver's CQ ring has received, for arming: the producer index
/// after the last completion, and after the last one a solicited-only arm
/// wakes for (solicited, or in error).
#[derive(Debug, Default)]
struct Track {
    tail: AtomicU32,
    due: AtomicU32,
}

/// The engine's sink for a CQ ring: the face core's, counting as it goes.
#[derive(Debug)]
struct Sink {
    inner: GuestCq<FreeRunning, abi::Cqe>,
    track: Arc<Track>,
}

impl CqSink for Sink {
    fn push(&mut self, wc: &Wc) -> bool {
        self.push_with(wc, false)
    }

    fn push_with(&mut self, wc: &Wc, solicited: bool) -> bool {
        if !self.inner.push(wc) {
            return false;
        }
        let tail = self.track.tail.load(Ordering::Relaxed).wrapping_add(1);
        self.track.tail.store(tail, Ordering::Relaxed);
        if solicited || wc.status != WcStatus::Success {
            self.track.due.store(tail, Ordering::Relaxed);
        }
        true
    }
}

/// An object a doorbell index names.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Obj {
    Qp(u32),
    Srq(u32),
    Cq(u32),
}

/// What owns guest pages the device writes or reads as structures.
#[derive(Clone, Copy, Debug, Eq, Ord, PartialEq, PartialOrd)]
enum Owner {
    Context(u32),
    Cq(u32),
    Qp(u32),
    Srq(u32),
}

/// The pages of every live ring and doorbell area, and every live ring
/// header (spec §6.5 step 7): each ring on pages of its own, so a device
/// write (a CQE, a consumer index) never lands on a producer index or WQE
/// the device reads — a driver cannot make the device feed itself work.
#[derive(Debug, Default)]
struct Claims {
    pages: BTreeMap<u64, Owner>,
    headers: BTreeMap<u64, Owner>,
    /// What each owner claimed, to give it back without a scan.
    by_owner: BTreeMap<Owner, (Vec<u64>, Vec<u64>)>,
}

impl Claims {
    /// Whether `pages` and `headers` may be claimed (by `owner`, whose own
    /// headers may be given again: a CQ resized in place).
    fn check(&self, pages: &[u64], headers: &[u64], owner: Option<Owner>) -> Result<(), Refused> {
        let clash = Refused::invalid("pages or a header another ring or area uses");
        let mut new = BTreeSet::new();
        for &p in pages {
            if !new.insert(p) || self.pages.contains_key(&p) {
                return Err(clash);
            }
            let held = self
                .headers
                .range(p..p + abi::PAGE_SIZE)
                .any(|(_, o)| Some(*o) != owner);
            if held {
                return Err(clash);
            }
        }
        let mut seen = BTreeSet::new();
        for &h in headers {
            let page = h & !(abi::PAGE_SIZE - 1);
            let taken = self.headers.get(&h).is_some_and(|o| Some(*o) != owner);
            if !seen.insert(h) || taken || new.contains(&page) || self.pages.contains_key(&page) {
                return Err(clash);
            }
        }
        Ok(())
    }

    fn claim(&mut self, owner: Owner, pages: &[u64], headers: &[u64]) {
        for &p in pages {
            self.pages.insert(p, owner);
        }
        for &h in headers {
            self.headers.insert(h, owner);
        }
        let e = self.by_owner.entry(owner).or_default();
        e.0.extend_from_slice(pages);
        e.1.extend_from_slice(headers);
    }

    fn release(&mut self, owner: Owner) {
        let Some((pages, headers)) = self.by_owner.remove(&owner) else {
            return;
        };
        for p in pages {
            self.pages.remove(&p);
        }
        for h in headers {
            if self.headers.get(&h) == Some(&owner) {
                self.headers.remove(&h);
            }
        }
    }
}

#[derive(Debug)]
struct Context {
    area: doorbell::Area,
    indices: doorbell::Indices,
    doorbells: BTreeMap<u32, Obj>,
}

#[derive(Debug)]
struct CqFace {
    context: u32,
    doorbell: u32,
    ring: GuestRing<FreeRunning>,
    header: u64,
    /// The last arm's sequence number taken.
    arm_seq: u64,
    track: Arc<Track>,
    /// CQ_ERR was raised: the CQ is in error until destroyed (§10.2).
    in_error: bool,
}

#[derive(Debug)]
struct QpFace {
    context: u32,
    doorbell: u32,
    queues: QpQueues<FreeRunning>,
    shape: SendShape,
    max_recv_sge: u32,
}

#[derive(Debug)]
struct SrqFace {
    context: u32,
    doorbell: u32,
    queue: SrqQueue<FreeRunning>,
    max_sge: u32,
}

/// The face's state.
#[derive(Debug)]
pub struct VirtioRdma<T: Transport> {
    opts: Options,
    attr: DeviceAttr,
    port: PortAttr,
    pub device: Device<GuestMem, T>,
    /// Guest memory as the CQ sinks see it (replaced in place when the
    /// maps change).
    shared: SharedMem,
    budget: Budget,
    contexts: BTreeMap<u32, Context>,
    next_context: u32,
    /// Owners (context) of PDs by handle, MRs and MWs by key index.
    pds: BTreeMap<u32, u32>,
    mrs: BTreeMap<u32, u32>,
    mws: BTreeMap<u32, u32>,
    cqs: BTreeMap<u32, CqFace>,
    qps: BTreeMap<u32, QpFace>,
    srqs: BTreeMap<u32, SrqFace>,
    claims: Claims,
    /// QPs and SRQs whose WQEs wait (in the engine or in their ring).
    busy_qps: BTreeSet<u32>,
    busy_srqs: BTreeSet<u32>,
    events: VecDeque<abi::Event>,
    lost_events: u32,
    /// Events queued ahead of the EVENTS_LOST that reports the drops
    /// (those queued when the first of them was dropped, §10.3).
    lost_behind: usize,
    notifications: VecDeque<abi::Notification>,
    notified: BTreeSet<u32>,
    polling: bool,
    /// DEVICE_FATAL was raised: every command but the queries is
    /// ERR_DEVICE until a reset.
    fatal: bool,
    /// The feature bits the driver accepted.
    features: u64,
    scratch: Vec<u32>,
    pub stats: FaceStats,
    /// Refused commands and WQEs, by reason, and their log.
    refusals: Refusals,
}

/// The device's name in the log when its thread has none.
const FACE: &str = "virtio-rdma";

/// The name the device's thread carries (its `--device` name), for logs.
fn device_name() -> String {
    std::thread::current().name().unwrap_or(FACE).to_owned()
}

impl<T: Transport> VirtioRdma<T> {
    /// A device reaching the network through `transport`, its port with
    /// `port`'s GIDs; nothing made yet, no memory mapped.
    pub fn new(opts: Options, mut port: PortAttr, transport: T) -> Self {
        // Room for the GIDs the driver sets (§6.30), past any configured.
        if port.gids.len() < GID_TABLE_LEN {
            port.gids.resize(GID_TABLE_LEN, None);
        }
        let attr = device_attr(opts.mac);
        let engine = Engine::new(attr.clone(), port.clone());
        let mut device = Device::new(engine, GuestMem::default(), transport);
        let budget = Budget::new(ObjectBudget::Derived);
        budget.apply(&mut device);
        VirtioRdma {
            opts,
            attr,
            port,
            device,
            shared: SharedMem::new(GuestMemoryMmap::default()),
            budget,
            contexts: BTreeMap::new(),
            next_context: 1,
            pds: BTreeMap::new(),
            mrs: BTreeMap::new(),
            mws: BTreeMap::new(),
            cqs: BTreeMap::new(),
            qps: BTreeMap::new(),
            srqs: BTreeMap::new(),
            claims: Claims::default(),
            busy_qps: BTreeSet::new(),
            busy_srqs: BTreeSet::new(),
            events: VecDeque::new(),
            lost_events: 0,
            lost_behind: 0,
            notifications: VecDeque::new(),
            notified: BTreeSet::new(),
            polling: false,
            fatal: false,
            features: 0,
            scratch: Vec::new(),
            stats: FaceStats::default(),
            refusals: Refusals::default(),
        }
    }

    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// The configuration space the driver reads.
    pub fn config(&self) -> abi::Config {
        abi::Config {
            mac: self.opts.mac,
            max_contexts: self.opts.max_contexts.into(),
            max_doorbell_bits: self.opts.max_doorbell_bits.into(),
            max_qp: self.attr.max_qp.into(),
            max_cq: self.attr.max_cq.into(),
            max_request: MAX_REQUEST.into(),
            ..abi::Config::new_zeroed()
        }
    }

    /// What the guest's objects may make the engine hold.
    pub fn set_budget(&mut self, budget: ObjectBudget) {
        self.budget.set(budget, &mut self.device);
    }

    /// The guest has `guest` bytes of RAM (with memory hot-plug, the most
    /// it may have), or a size not configured: a derived object budget
    /// comes from it, never from more than the device maps
    /// ([`ObjectBudget::Derived`]).
    pub fn set_guest_size(&mut self, guest: Option<u64>) {
        self.budget.set_guest_size(guest, &mut self.device);
    }

    /// The guest's configured size ([`VirtioRdma::set_guest_size`]).
    pub fn guest_size(&self) -> Option<u64> {
        self.budget.guest_size()
    }

    /// The guest's memory maps changed: the engine, the sinks and the
    /// doorbell scans see the new ones at once.
    pub fn set_memory(&mut self, mem: &GuestMemoryMmap<()>) {
        self.budget.remap(&mut self.device, &self.shared, mem);
    }

    /// Everything the driver made goes (a device reset): a new engine,
    /// whose objects reach no guest memory, empty tables.
    pub fn reset(&mut self) {
        let fresh = Engine::new(self.attr.clone(), self.port.clone());
        self.budget.replace_engine(&mut self.device, fresh);
        self.contexts.clear();
        self.claims = Claims::default();
        self.next_context = 1;
        self.pds.clear();
        self.mrs.clear();
        self.mws.clear();
        self.cqs.clear();
        self.qps.clear();
        self.srqs.clear();
        self.busy_qps.clear();
        self.busy_srqs.clear();
        self.events.clear();
        self.lost_events = 0;
        self.lost_behind = 0;
        self.notifications.clear();
        self.notified.clear();
        self.device.transport_mut().set_local(&[]);
        self.fatal = false;
        self.stats.resets += 1;
    }

    /// Whether anything is made (a device in use).
    pub fn is_empty(&self) -> bool {
        self.contexts.is_empty()
    }

    // --- commands ----------------------------------------------------------

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
                decode::errno::EIO,
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
                let errno = format!("errno {}", e.errno);
                let r = Refusal {
                    kind: refusals::Kind::Command,
                    rule: e.what,
                    opcode: opcode.map_or(0, u32::from),
                    object: 0,
                    field: None,
                    answer: &errno,
                };
                let now = self.device.now();
                self.refusals.note(now, &device_name(), &r);
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

    fn execute(&mut self, r: decode::Request) -> Result<Vec<u8>, Refused> {
        let ctx = r.context;
        let query = matches!(
            r.command,
            Command::QueryDevice | Command::QueryPort { .. } | Command::QueryStats
        );
        if self.fatal && !query {
            return Err(Refused::new(
                decode::errno::EIO,
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
            Command::AllocPd => {
                let pd = self.device.engine_mut().alloc_pd().or_refuse("PD")?;
                self.pds.insert(pd.0, ctx);
                Ok(handle_resp(pd.0))
            }
            Command::DeallocPd { pd } => {
                self.owned(&self.pds, pd, ctx, "PD")?;
                self.device
                    .engine_mut()
                    .dealloc_pd(PdHandle(pd))
                    .or_refuse("PD")?;
                self.pds.remove(&pd);
                Ok(Vec::new())
            }
            Command::CreateCq { ring } => self.create_cq(ctx, ring),
            Command::DestroyCq { cq } => {
                self.cq_of(ctx, cq)?;
                self.device
                    .engine_mut()
                    .destroy_cq(CqHandle(cq))
                    .or_refuse("CQ")?;
                if let Some(c) = self.cqs.remove(&cq) {
                    self.free_doorbell(c.context, c.doorbell);
                }
                self.claims.release(Owner::Cq(cq));
                self.notified.remove(&cq);
                self.notifications.retain(|n| n.cq.get() != cq);
                self.drop_events(|e| e.event_type.get() == ev::CQ_ERR && e.object.get() == cq);
                Ok(Vec::new())
            }
            Command::ResizeCq { cq, ring } => self.resize_cq(ctx, cq, ring),
            Command::RegMr {
                pd,
                access,
                iova,
                length,
                page_shift,
                offset,
                pages,
            } => {
                self.owned(&self.pds, pd, ctx, "PD")?;
                // Step 6: every page wholly inside guest memory (§6.16).
                let page = 1usize << page_shift;
                if pages.iter().any(|&p| !self.in_memory(p, page)) {
                    return Err(fault("MR page outside guest memory"));
                }
                let engine = self.device.engine_mut();
                engine.check_mr_pages(pages.len()).or_refuse("MR pages")?;
                let (lkey, rkey) = engine
                    .reg_mr(MrRequest {
                        pd: PdHandle(pd),
                        iova,
                        length,
                        access,
                        translation: Translation::Pages {
                            page_shift,
                            offset,
                            pages,
                        },
                    })
                    .or_refuse("MR")?;
                self.mrs.insert(lkey.0 >> 8, ctx);
                Ok(mr_resp(lkey, rkey))
            }
            Command::RegDmaMr { pd, access } => {
                self.owned(&self.pds, pd, ctx, "PD")?;
                let (lkey, rkey) = self
                    .device
                    .engine_mut()
                    .reg_dma_mr(PdHandle(pd), access)
                    .or_refuse("DMA MR")?;
                self.mrs.insert(lkey.0 >> 8, ctx);
                Ok(mr_resp(lkey, rkey))
            }
            Command::AllocMr { pd, max_pages } => {
                self.owned(&self.pds, pd, ctx, "PD")?;
                let lkey = self
                    .device
                    .engine_mut()
                    .alloc_mr(PdHandle(pd), max_pages)
                    .or_refuse("fast-registration MR")?;
                self.mrs.insert(lkey.0 >> 8, ctx);
                Ok(mr_resp(lkey, Rkey(lkey.0)))
            }
            Command::DeregMr { lkey } => {
                self.owned(&self.mrs, lkey >> 8, ctx, "MR")?;
                let engine = self.device.engine_mut();
                // By index; the key byte (which fast registration changes)
                // is ignored (§6.19).
                let cur = engine.current_lkey(lkey >> 8).or_refuse("MR")?;
                engine.dereg_mr(cur).or_refuse("MR")?;
                self.mrs.remove(&(lkey >> 8));
                Ok(Vec::new())
            }
            Command::AllocMw { pd, ty } => {
                self.owned(&self.pds, pd, ctx, "PD")?;
                let rkey = self
                    .device
                    .engine_mut()
                    .alloc_mw(PdHandle(pd), ty)
                    .or_refuse("MW")?;
                self.mws.insert(rkey.0 >> 8, ctx);
                Ok(handle_resp(rkey.0))
            }
            Command::DeallocMw { rkey } => {
                self.owned(&self.mws, rkey >> 8, ctx, "MW")?;
                let engine = self.device.engine_mut();
                // Named by its index; the key byte, which binds change,
                // is ignored (§6.21, §6.19).
                let cur = engine.current_rkey(rkey >> 8).or_refuse("MW")?;
                engine.dealloc_mw(cur).or_refuse("MW")?;
                self.mws.remove(&(rkey >> 8));
                Ok(Vec::new())
            }
            Command::CreateSrq {
                pd,
                max_sge,
                srq_limit,
                ring,
            } => self.create_srq(ctx, pd, max_sge, srq_limit, ring),
            Command::ModifySrq { srq, srq_limit } => {
                self.srq_of(ctx, srq)?;
                let engine = self.device.engine_mut();
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
            Command::QuerySrq { srq } => {
                self.srq_of(ctx, srq)?;
                let a = self
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
            Command::DestroySrq { srq } => {
                self.srq_of(ctx, srq)?;
                self.device
                    .engine_mut()
                    .destroy_srq(SrqHandle(srq))
                    .or_refuse("SRQ")?;
                if let Some(s) = self.srqs.remove(&srq) {
                    self.free_doorbell(s.context, s.doorbell);
                }
                self.claims.release(Owner::Srq(srq));
                self.busy_srqs.remove(&srq);
                self.drop_events(|e| {
                    matches!(e.event_type.get(), ev::SRQ_LIMIT_REACHED | ev::SRQ_ERR)
                        && e.object.get() == srq
                });
                Ok(Vec::new())
            }
            Command::CreateQp(c) => self.create_qp(ctx, c),
            Command::ModifyQp { qpn, mask, attrs } => {
                self.qp_of(ctx, qpn)?;
                let q = Qpn::from_masked(qpn);
                let engine = self.device.engine_mut();
                let cur = *engine.query_qp(q).or_refuse("QP")?.0;
                let attr = decode::qp_attr(&cur, mask, &attrs)?;
                engine
                    .modify_qp(q, &attr, mask)
                    .or_refuse("QP attributes")?;
                let now = engine.query_qp(q).map(|(a, _)| a.qp_state).ok();
                if let Some(f) = self.qps.get_mut(&qpn)
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
            Command::QueryQp { qpn } => {
                self.qp_of(ctx, qpn)?;
                let (a, init) = self
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
            Command::DestroyQp { qpn } => {
                self.qp_of(ctx, qpn)?;
                self.destroy_qp(qpn)?;
                Ok(Vec::new())
            }
            Command::SetGid { index, gid } => {
                let entry = match gid {
                    Some(g) => {
                        if !self.device.transport().admits_gid(&g) {
                            return Err(Refused::invalid("GID: not one of the port's addresses"));
                        }
                        Some(GidEntry {
                            gid: g,
                            ty: GidType::RoceV2,
                        })
                    }
                    None => None,
                };
                self.device
                    .engine_mut()
                    .set_gid(index, entry)
                    .or_refuse("GID index")?;
                self.rebind();
                Ok(Vec::new())
            }
        }
    }

    /// The port steers to the engine what is addressed to the GIDs bound
    /// now.
    fn rebind(&mut self) {
        let gids: Vec<_> = self
            .device
            .engine()
            .query_port(1)
            .map(|p| p.gids.iter().flatten().map(|e| e.gid).collect())
            .unwrap_or_default();
        self.device.transport_mut().set_local(&gids);
    }

    fn query_device(&self) -> abi::DeviceAttrResp {
        let a = self.device.engine().query_device();
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

    fn query_port(&self, port: u8) -> Result<Vec<u8>, Refused> {
        let p = self.device.engine().query_port(port).or_refuse("port")?;
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

    fn owned(
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

    fn cq_of(&self, ctx: u32, cq: u32) -> Result<(), Refused> {
        match self.cqs.get(&cq) {
            Some(c) if c.context == ctx => Ok(()),
            _ => Err(noent("CQ")),
        }
    }

    fn srq_of(&self, ctx: u32, srq: u32) -> Result<(), Refused> {
        match self.srqs.get(&srq) {
            Some(s) if s.context == ctx => Ok(()),
            _ => Err(noent("SRQ")),
        }
    }

    fn qp_of(&self, ctx: u32, qpn: u32) -> Result<(), Refused> {
        match self.qps.get(&qpn) {
            Some(q) if q.context == ctx => Ok(()),
            _ => Err(noent("QP")),
        }
    }

    /// Whether `len` bytes at `addr` are guest memory.
    fn in_memory(&self, addr: u64, len: usize) -> bool {
        // One region holds it (regions are page-aligned: a page or a
        // ring header is in one or in none).
        self.device
            .mem()
            .map()
            .get_slice(GuestAddress(addr), len)
            .is_ok()
    }

    /// A work queue's ring (its header's producer and consumer words).
    fn guest_ring(&self, r: &RingSpec) -> Result<GuestRing<FreeRunning>, Refused> {
        self.ring_at(r, wq_header::PRODUCER, wq_header::CONSUMER)
    }

    /// A ring whose header and pages are guest memory, for the face core,
    /// its index words at `prod` and `cons` in its header.
    fn ring_at(
        &self,
        r: &RingSpec,
        prod: u64,
        cons: u64,
    ) -> Result<GuestRing<FreeRunning>, Refused> {
        if !self.in_memory(r.header, abi::RING_HEADER_SIZE as usize) {
            return Err(fault("ring header outside guest memory"));
        }
        if r.pages
            .iter()
            .any(|&p| !self.in_memory(p, abi::PAGE_SIZE as usize))
        {
            return Err(fault("ring page outside guest memory"));
        }
        let indices = FreeRunning::new(r.entries).ok_or(Refused::invalid("ring entries"))?;
        let pages = PageList::new(r.pages.clone()).or_refuse("ring pages")?;
        GuestRing::new(
            indices,
            u64::from(r.stride),
            r.header + prod,
            r.header + cons,
            pages,
        )
        .ok_or(Refused::invalid("ring shape"))
    }

    fn create_context(&mut self, bits: u32, pages: Vec<u64>) -> Result<Vec<u8>, Refused> {
        if bits > self.opts.max_doorbell_bits {
            return Err(Refused::invalid("doorbell bits past the device's"));
        }
        if self.contexts.len() as u32 >= self.opts.max_contexts {
            return Err(Refused::new(decode::errno::ENOMEM, "contexts"));
        }
        if pages
            .iter()
            .any(|&p| !self.in_memory(p, abi::PAGE_SIZE as usize))
        {
            return Err(fault("doorbell page outside guest memory"));
        }
        self.claims.check(&pages, &[], None)?;
        let claimed = pages.clone();
        let area = doorbell::Area::new(bits, pages);
        area.set_poll(self.device.mem(), self.polling)
            .map_err(|_| fault("doorbell area"))?;
        // Handles are not reused until the counter wraps (a stale handle
        // of a destroyed context names nothing for 2^32 contexts).
        let mut h = self.next_context;
        while h == 0 || self.contexts.contains_key(&h) {
            h = h.wrapping_add(1);
        }
        self.next_context = h.wrapping_add(1);
        self.claims.claim(Owner::Context(h), &claimed, &[]);
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
    fn destroy_context(&mut self, ctx: u32) {
        let of = |m: &BTreeMap<u32, u32>| -> Vec<u32> {
            m.iter()
                .filter(|(_, c)| **c == ctx)
                .map(|(h, _)| *h)
                .collect()
        };
        let qps: Vec<u32> = self
            .qps
            .iter()
            .filter(|(_, q)| q.context == ctx)
            .map(|(h, _)| *h)
            .collect();
        for qpn in qps {
            let _ = self.destroy_qp(qpn);
        }
        let srqs: Vec<u32> = self
            .srqs
            .iter()
            .filter(|(_, s)| s.context == ctx)
            .map(|(h, _)| *h)
            .collect();
        let engine = self.device.engine_mut();
        for srq in srqs {
            let _ = engine.destroy_srq(SrqHandle(srq));
            self.srqs.remove(&srq);
            self.claims.release(Owner::Srq(srq));
            self.busy_srqs.remove(&srq);
        }
        let cqs: Vec<u32> = self
            .cqs
            .iter()
            .filter(|(_, c)| c.context == ctx)
            .map(|(h, _)| *h)
            .collect();
        for cq in cqs {
            let _ = engine.destroy_cq(CqHandle(cq));
            self.cqs.remove(&cq);
            self.claims.release(Owner::Cq(cq));
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
        self.claims.release(Owner::Context(ctx));
        self.contexts.remove(&ctx);
    }

    fn take_doorbell(&mut self, ctx: u32, obj: Obj) -> Result<u32, Refused> {
        let c = self.contexts.get_mut(&ctx).ok_or(noent("context"))?;
        let i = c.indices.take().ok_or(Refused::new(
            decode::errno::ENOMEM,
            "doorbells of the context",
        ))?;
        c.doorbells.insert(i, obj);
        Ok(i)
    }

    fn free_doorbell(&mut self, ctx: u32, i: u32) {
        if let Some(c) = self.contexts.get_mut(&ctx) {
            c.indices.give(i);
            c.doorbells.remove(&i);
        }
    }

    fn sink(&self, ring: GuestRing<FreeRunning>, tail: u32) -> Result<(Sink, Arc<Track>), Refused> {
        let track = Arc::new(Track {
            tail: AtomicU32::new(tail),
            due: AtomicU32::new(tail),
        });
        let inner = GuestCq::new(self.shared.clone(), ring, decode::cqe).or_refuse("CQ ring")?;
        Ok((
            Sink {
                inner,
                track: track.clone(),
            },
            track,
        ))
    }

    /// A CQ's ring (the device produces, the driver consumes).
    fn cq_ring(&self, r: &RingSpec) -> Result<GuestRing<FreeRunning>, Refused> {
        self.ring_at(r, cq_header::PRODUCER, cq_header::CONSUMER)
    }

    fn create_cq(&mut self, ctx: u32, r: RingSpec) -> Result<Vec<u8>, Refused> {
        let ring = self.cq_ring(&r)?;
        self.claims.check(&r.pages, &[r.header], None)?;
        let tail = ring.prod(self.device.mem().map()).or_refuse("CQ header")?;
        let (sink, track) = self.sink(ring.clone(), tail)?;
        let doorbell = self.take_doorbell(ctx, Obj::Cq(0))?;
        let made = self
            .device
            .engine_mut()
            .create_cq_with_sink(r.entries, 0, Box::new(sink));
        let (cq, entries) = match made {
            Ok(v) => v,
            Err(e) => {
                self.free_doorbell(ctx, doorbell);
                return Err(Refused::verbs(&e, "CQ"));
            }
        };
        if let Some(c) = self.contexts.get_mut(&ctx) {
            c.doorbells.insert(doorbell, Obj::Cq(cq.0));
        }
        let arm = self
            .device
            .mem()
            .load_u64(r.header + cq_header::ARM)
            .unwrap_or(0);
        self.claims.claim(Owner::Cq(cq.0), &r.pages, &[r.header]);
        self.cqs.insert(
            cq.0,
            CqFace {
                context: ctx,
                doorbell,
                ring,
                header: r.header,
                arm_seq: arm >> 34,
                track,
                in_error: false,
            },
        );
        Ok(abi::CreateCqResp {
            cq: cq.0.into(),
            entries: entries.into(),
            doorbell: doorbell.into(),
            reserved: 0.into(),
        }
        .as_bytes()
        .to_vec())
    }

    /// A CQ's completions move to a new ring: those the driver has not
    /// consumed are copied to its first slots.
    fn resize_cq(&mut self, ctx: u32, cq: u32, r: RingSpec) -> Result<Vec<u8>, Refused> {
        self.cq_of(ctx, cq)?;
        let new = self.cq_ring(&r)?;
        self.claims
            .check(&r.pages, &[r.header], Some(Owner::Cq(cq)))?;
        let mem = self.device.mem().map().clone();
        let old = &self.cqs[&cq];
        if old.in_error {
            return Err(Refused::invalid("CQ in error"));
        }
        let tail = old.track.tail.load(Ordering::Relaxed);
        let cons = old.ring.cons(&mem).or_refuse("CQ header")?;
        let waiting = tail.wrapping_sub(cons);
        if waiting > old.ring.indices().capacity() {
            return Err(Refused::invalid("CQ consumer index"));
        }
        if waiting > r.entries {
            return Err(Refused::invalid("CQ too small for its completions"));
        }
        let mut entry = abi::Cqe::new_zeroed();
        for i in 0..waiting {
            old.ring
                .read_entry(&mem, cons.wrapping_add(i), entry.as_mut_bytes())
                .or_refuse("CQ ring")?;
            new.write_entry(&mem, i, &entry).or_refuse("new CQ ring")?;
        }
        new.set_prod(&mem, waiting).or_refuse("new CQ header")?;
        new.set_cons(&mem, 0).or_refuse("new CQ header")?;
        let (sink, track) = self.sink(new.clone(), waiting)?;
        // A solicited completion that waits stays due for an arm.
        let due_old = old.track.due.load(Ordering::Relaxed);
        if due_old.wrapping_sub(cons) <= waiting && due_old != cons {
            track
                .due
                .store(due_old.wrapping_sub(cons), Ordering::Relaxed);
        }
        let entries = self
            .device
            .engine_mut()
            .resize_cq_sink(CqHandle(cq), r.entries, Box::new(sink))
            .or_refuse("CQ size")?;
        self.claims.release(Owner::Cq(cq));
        self.claims.claim(Owner::Cq(cq), &r.pages, &[r.header]);
        if let Some(c) = self.cqs.get_mut(&cq) {
            c.ring = new;
            c.header = r.header;
            c.track = track;
        }
        Ok(abi::HandleResp {
            handle: entries.into(),
            reserved: 0.into(),
        }
        .as_bytes()
        .to_vec())
    }

    fn create_srq(
        &mut self,
        ctx: u32,
        pd: u32,
        max_sge: u32,
        srq_limit: u32,
        r: RingSpec,
    ) -> Result<Vec<u8>, Refused> {
        self.owned(&self.pds, pd, ctx, "PD")?;
        let ring = self.guest_ring(&r)?;
        self.claims.check(&r.pages, &[r.header], None)?;
        let doorbell = self.take_doorbell(ctx, Obj::Srq(0))?;
        let made = self.device.engine_mut().create_srq(
            PdHandle(pd),
            SrqAttr {
                max_wr: r.entries,
                max_sge,
                srq_limit,
            },
        );
        let (srq, attr) = match made {
            Ok(v) => v,
            Err(e) => {
                self.free_doorbell(ctx, doorbell);
                return Err(Refused::verbs(&e, "SRQ"));
            }
        };
        if let Some(c) = self.contexts.get_mut(&ctx) {
            c.doorbells.insert(doorbell, Obj::Srq(srq.0));
        }
        self.claims.claim(Owner::Srq(srq.0), &r.pages, &[r.header]);
        self.srqs.insert(
            srq.0,
            SrqFace {
                context: ctx,
                doorbell,
                queue: SrqQueue::new(srq, ring, attr.max_wr).breaking_on_malformed(),
                max_sge: attr.max_sge,
            },
        );
        Ok(abi::CreateSrqResp {
            srq: srq.0.into(),
            max_wr: attr.max_wr.into(),
            max_sge: attr.max_sge.into(),
            doorbell: doorbell.into(),
        }
        .as_bytes()
        .to_vec())
    }

    fn create_qp(&mut self, ctx: u32, c: CreateQp) -> Result<Vec<u8>, Refused> {
        self.owned(&self.pds, c.pd, ctx, "PD")?;
        self.cq_of(ctx, c.send_cq)?;
        self.cq_of(ctx, c.recv_cq)?;
        if let Some(s) = c.srq {
            self.srq_of(ctx, s)?;
        }
        let sq = self.guest_ring(&c.sq)?;
        let rq = c.rq.as_ref().map(|r| self.guest_ring(r)).transpose()?;
        let mut pages = c.sq.pages.clone();
        let mut headers = vec![c.sq.header];
        if let Some(r) = &c.rq {
            pages.extend_from_slice(&r.pages);
            headers.push(r.header);
        }
        self.claims.check(&pages, &headers, None)?;
        let doorbell = self.take_doorbell(ctx, Obj::Qp(0))?;
        let made = self.device.engine_mut().create_qp(QpInitAttr {
            pd: PdHandle(c.pd),
            send_cq: CqHandle(c.send_cq),
            recv_cq: CqHandle(c.recv_cq),
            srq: c.srq.map(SrqHandle),
            cap: QpCap {
                max_send_wr: c.sq.entries,
                max_recv_wr: c.rq.as_ref().map_or(0, |r| r.entries),
                max_send_sge: c.max_send_sge,
                max_recv_sge: c.max_recv_sge,
                max_inline_data: c.max_inline_data,
            },
            qp_type: c.qp_type,
            sq_sig_all: c.sq_sig_all,
        });
        let (qpn, cap) = match made {
            Ok(v) => v,
            Err(e) => {
                self.free_doorbell(ctx, doorbell);
                return Err(Refused::verbs(&e, "QP"));
            }
        };
        let h = qpn.value();
        self.claims.claim(Owner::Qp(h), &pages, &headers);
        if let Some(cx) = self.contexts.get_mut(&ctx) {
            cx.doorbells.insert(doorbell, Obj::Qp(h));
        }
        self.qps.insert(
            h,
            QpFace {
                context: ctx,
                doorbell,
                queues: QpQueues::new(qpn, sq, rq),
                shape: SendShape {
                    qp_type: c.qp_type,
                    max_sge: cap.max_send_sge,
                    max_inline: cap.max_inline_data,
                },
                max_recv_sge: cap.max_recv_sge,
            },
        );
        Ok(abi::CreateQpResp {
            qpn: h.into(),
            max_send_wr: cap.max_send_wr.into(),
            max_recv_wr: cap.max_recv_wr.into(),
            max_send_sge: cap.max_send_sge.into(),
            max_recv_sge: cap.max_recv_sge.into(),
            max_inline_data: cap.max_inline_data.into(),
            doorbell: doorbell.into(),
            reserved: 0.into(),
        }
        .as_bytes()
        .to_vec())
    }

    /// A QP goes; its pending WRs are discarded without completions, and
    /// the device's answers still due go out first.
    fn destroy_qp(&mut self, qpn: u32) -> Result<(), Refused> {
        let _ = self.device.send_pending();
        self.device
            .engine_mut()
            .destroy_qp(Qpn::from_masked(qpn))
            .or_refuse("QP")?;
        if let Some(q) = self.qps.remove(&qpn) {
            self.free_doorbell(q.context, q.doorbell);
        }
        self.claims.release(Owner::Qp(qpn));
        self.busy_qps.remove(&qpn);
        // Its pending events go with it: a reused QPN must not hear them.
        self.drop_events(|e| {
            matches!(
                e.event_type.get(),
                ev::QP_FATAL
                    | ev::QP_REQ_ERR
                    | ev::QP_ACCESS_ERR
                    | ev::QP_LAST_WQE_REACHED
                    | ev::SQ_DRAINED
            ) && e.object.get() == qpn
        });
        Ok(())
    }

    // --- doorbells and rings ----------------------------------------------

    /// Whether the device polls the doorbell areas now; says so in each.
    pub fn set_polling(&mut self, on: bool) {
        self.polling = on;
        let mem = self.device.mem().clone();
        for c in self.contexts.values() {
            if c.area.set_poll(&mem, on).is_err() {
                self.stats.area_faults += 1;
            }
        }
    }

    pub fn polling(&self) -> bool {
        self.polling
    }

    /// Takes every doorbell rung in every context: the rings that moved
    /// are taken, the CQs armed. Returns how many doorbells.
    pub fn doorbells(&mut self) -> usize {
        let mem = self.device.mem().clone();
        let mut rung = 0;
        let ctxs: Vec<u32> = self.contexts.keys().copied().collect();
        for ctx in ctxs {
            let mut bits = std::mem::take(&mut self.scratch);
            bits.clear();
            let Some(c) = self.contexts.get(&ctx) else {
                continue;
            };
            if c.area.take(&mem, &mut bits).is_err() {
                self.stats.area_faults += 1;
            }
            for &i in &bits {
                rung += 1;
                match self.contexts.get(&ctx).and_then(|c| c.doorbells.get(&i)) {
                    Some(Obj::Qp(q)) => self.take_qp(*q),
                    Some(Obj::Srq(s)) => self.take_srq(*s),
                    Some(Obj::Cq(cq)) => self.arm(*cq),
                    None => self.stats.stale_doorbells += 1,
                }
            }
            self.scratch = bits;
        }
        self.stats.doorbells += rung as u64;
        rung
    }

    fn take_qp(&mut self, qpn: u32) {
        let mem = self.device.mem().map().clone();
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let now = self.device.now();
        let engine = self.device.engine_mut();
        let t = take_wqes(q, &mem, engine, &mut self.refusals, now, qpn);
        self.stats.wqes += u64::from(t.entries);
        self.stats.malformed_wqes += u64::from(t.malformed);
        if t.broken {
            self.stats.broken_rings += 1;
            let _ = engine.qp_fatal(q.queues.qpn());
        }
        self.busy_qps.insert(qpn);
    }

    fn take_srq(&mut self, srq: u32) {
        let mem = self.device.mem().map().clone();
        let Some(s) = self.srqs.get_mut(&srq) else {
            return;
        };
        let (max, ctx) = (s.max_sge, s.context);
        let now = self.device.now();
        let refusals = &mut self.refusals;
        let t = s.queue.take(&mem, self.device.engine_mut(), |e| {
            recv_wqe(e, max).map_err(|m| {
                refusals
                    .note_wqe(now, FACE, refusals::Kind::RecvWqe, srq, &m)
                    .0
            })
        });
        self.srq_taken(srq, ctx, t);
        self.busy_srqs.insert(srq);
    }

    fn srq_taken(&mut self, srq: u32, ctx: u32, t: vrdma_face::Taken) {
        self.stats.wqes += u64::from(t.entries);
        self.stats.malformed_wqes += u64::from(t.malformed);
        if t.broken {
            self.stats.broken_rings += 1;
            self.event(ev::SRQ_ERR, srq, ctx);
        }
    }

    /// A CQ's arm word, read after its doorbell: a new arm (its sequence
    /// changed) notifies at once if a completion it wants is already
    /// there past the consumer index the driver armed at, and arms the
    /// engine's CQ otherwise.
    fn arm(&mut self, cq: u32) {
        let Some(c) = self.cqs.get_mut(&cq) else {
            return;
        };
        let Ok(word) = self.device.mem().load_u64(c.header + cq_header::ARM) else {
            self.stats.area_faults += 1;
            return;
        };
        let seq = word >> 34;
        let mode = (word >> 32) & 3;
        if seq == c.arm_seq || mode == 0 || mode == 3 {
            return;
        }
        c.arm_seq = seq;
        self.stats.arms += 1;
        let at = word as u32;
        let tail = c.track.tail.load(Ordering::Relaxed);
        let ahead = tail.wrapping_sub(at);
        let cap = c.ring.indices().capacity();
        let ready = if mode == cq_header::ARM_NEXT {
            ahead != 0 && ahead <= cap
        } else {
            let due = c.track.due.load(Ordering::Relaxed);
            let d = due.wrapping_sub(at);
            d != 0 && d <= ahead && ahead <= cap
        };
        let ctx = c.context;
        if ready {
            // This arm is satisfied now; an earlier one the engine still
            // holds (solicited-only, passed by unsolicited completions)
            // merged into it and goes too: one arm, one notification.
            let _ = self.device.engine_mut().disarm_cq(CqHandle(cq));
            self.notify(cq, ctx);
        } else {
            let _ = self
                .device
                .engine_mut()
                .req_notify_cq(CqHandle(cq), mode == cq_header::ARM_SOLICITED);
        }
    }

    fn notify(&mut self, cq: u32, ctx: u32) {
        if self.notified.insert(cq) {
            self.notifications.push_back(abi::Notification {
                cq: cq.into(),
                context: ctx.into(),
            });
        }
    }

    fn event(&mut self, kind: u32, object: u32, context: u32) {
        if self.events.len() >= self.opts.max_pending_events {
            if self.lost_events == 0 {
                self.lost_behind = self.events.len();
            }
            self.lost_events = self.lost_events.saturating_add(1);
            self.stats.events_lost += 1;
            return;
        }
        self.events.push_back(abi::Event {
            event_type: kind.into(),
            object: object.into(),
            context: context.into(),
            reserved: 0.into(),
        });
    }

    /// Room freed in the engine: takes what waited in the busy QPs' and
    /// SRQs' rings, and forgets those with nothing left. Returns whether a
    /// ring still holds WQEs the engine had no room for.
    fn progress_rings(&mut self) -> bool {
        let mut waiting = false;
        let mem = self.device.mem().map().clone();
        let busy: Vec<u32> = self.busy_qps.iter().copied().collect();
        for qpn in busy {
            let Some(q) = self.qps.get_mut(&qpn) else {
                self.busy_qps.remove(&qpn);
                continue;
            };
            let now = self.device.now();
            let engine = self.device.engine_mut();
            if q.queues.pending(&mem) {
                let t = take_wqes(q, &mem, engine, &mut self.refusals, now, qpn);
                self.stats.wqes += u64::from(t.entries);
                self.stats.malformed_wqes += u64::from(t.malformed);
                if t.broken {
                    self.stats.broken_rings += 1;
                    let _ = engine.qp_fatal(q.queues.qpn());
                }
            }
            if q.queues.settle(&mem, engine) {
                self.busy_qps.remove(&qpn);
            } else {
                waiting |= q.queues.pending(&mem);
            }
        }
        let busy: Vec<u32> = self.busy_srqs.iter().copied().collect();
        for srq in busy {
            let Some(s) = self.srqs.get_mut(&srq) else {
                self.busy_srqs.remove(&srq);
                continue;
            };
            let now = self.device.now();
            let engine = self.device.engine_mut();
            let max = s.max_sge;
            let refusals = &mut self.refusals;
            let t = if s.queue.pending(&mem) {
                s.queue.take(&mem, engine, |e| {
                    recv_wqe(e, max).map_err(|m| {
                        refusals
                            .note_wqe(now, FACE, refusals::Kind::RecvWqe, srq, &m)
                            .0
                    })
                })
            } else {
                vrdma_face::Taken::default()
            };
            let idle = s.queue.settle(&mem, engine);
            waiting |= !idle && s.queue.pending(&mem);
            let ctx = s.context;
            self.srq_taken(srq, ctx, t);
            if idle {
                self.busy_srqs.remove(&srq);
            }
        }
        waiting
    }

    /// One turn of the device: doorbells (when `scan`), the engine's
    /// progress, the rings that waited for room, and the events and
    /// notifications it raised. Returns whether anything happened and the
    /// next deadline.
    pub fn turn(&mut self, scan: bool) -> std::io::Result<Turn> {
        let rung = if scan { self.doorbells() } else { 0 };
        let progress = self.device.progress()?;
        let waiting = self.progress_rings();
        // What this turn made the engine owe — the answers to the packets
        // it took (ACKs, READ responses), the WQEs taken after the
        // progress's send — goes now: a device that sleeps after the turn
        // (event mode, or idle past its spin) would otherwise hold them
        // until a timer, tens of milliseconds.
        let _ = self.device.send_pending();
        let mut raised = 0;
        while let Some(cq) = self.device.engine_mut().poll_notification() {
            let ctx = self.cqs.get(&cq.0).map_or(0, |c| c.context);
            self.notify(cq.0, ctx);
            raised += 1;
        }
        while let Some(e) = self.device.engine_mut().poll_event() {
            let (kind, object) = event_code(e);
            let ctx = self.owner_of_event(e);
            self.event(kind, object, ctx);
            raised += 1;
            if let AsyncEvent::CqErr { cq } = e {
                if let Some(c) = self.cqs.get_mut(&cq.0) {
                    c.in_error = true;
                }
                raised += self.cq_error_takes_down(cq);
            }
        }
        Ok(Turn {
            // A QP whose WQEs all sit in the engine (receives waiting for
            // messages, sends for ACKs) needs no turn until the network,
            // a timer or a doorbell brings one: only WQEs still in a ring,
            // waiting for room in the engine, keep the device turning.
            // (Counting every busy QP kept a device with receives posted
            // — any QP that waits for a message — turning at full speed,
            // a core gone in event mode and polling that never stopped.)
            busy: rung > 0 || !progress.is_idle() || raised > 0 || waiting,
            deadline: progress.deadline,
        })
    }

    /// A CQ in error took the QPs that use it to ERR (the engine did):
    /// one QP_FATAL each, after the CQ_ERR (§10.2, DEV-48). Returns how
    /// many.
    fn cq_error_takes_down(&mut self, cq: CqHandle) -> usize {
        let engine = self.device.engine();
        let down: Vec<(u32, u32)> = self
            .qps
            .iter()
            .filter(|(qpn, _)| {
                engine
                    .query_qp(Qpn::from_masked(**qpn))
                    .is_ok_and(|(_, init)| init.send_cq == cq || init.recv_cq == cq)
            })
            .map(|(qpn, q)| (*qpn, q.context))
            .collect();
        for &(qpn, ctx) in &down {
            self.event(ev::QP_FATAL, qpn, ctx);
        }
        down.len()
    }

    fn owner_of_event(&self, e: AsyncEvent) -> u32 {
        match e {
            AsyncEvent::CqErr { cq } => self.cqs.get(&cq.0).map_or(0, |c| c.context),
            AsyncEvent::QpFatal { qp }
            | AsyncEvent::QpReqErr { qp }
            | AsyncEvent::QpAccessErr { qp }
            | AsyncEvent::QpLastWqeReached { qp }
            | AsyncEvent::SqDrained { qp } => self.qps.get(&qp.value()).map_or(0, |q| q.context),
            AsyncEvent::SrqLimitReached { srq } => self.srqs.get(&srq.0).map_or(0, |s| s.context),
            AsyncEvent::PortActive { .. } => 0,
        }
    }

    /// Pending events `gone` names are dropped (their context or object
    /// is).
    fn drop_events(&mut self, gone: impl Fn(&abi::Event) -> bool) {
        let behind = self.lost_behind;
        let (mut i, mut ahead) = (0, 0);
        self.events.retain(|e| {
            let before_lost = i < behind;
            i += 1;
            let drop = gone(e);
            ahead += usize::from(drop && before_lost);
            !drop
        });
        self.lost_behind -= ahead;
    }

    /// The next event for the driver, if one waits (an EVENTS_LOST once
    /// the events queued before the first drop are delivered).
    pub fn next_event(&mut self) -> Option<abi::Event> {
        if self.lost_events > 0 && self.lost_behind == 0 {
            let n = std::mem::take(&mut self.lost_events);
            self.events.push_front(abi::Event {
                event_type: ev::EVENTS_LOST.into(),
                object: n.into(),
                context: 0.into(),
                reserved: 0.into(),
            });
        }
        let e = self.events.pop_front()?;
        if self.lost_events > 0 {
            self.lost_behind -= 1;
        }
        self.stats.events += 1;
        Some(e)
    }

    /// An event taken by [`VirtioRdma::next_event`] that found no buffer
    /// goes back first in line.
    pub fn unget_event(&mut self, e: abi::Event) {
        self.stats.events -= 1;
        if self.lost_events > 0 {
            self.lost_behind += 1;
        }
        self.events.push_front(e);
    }

    /// The next CQ notification, if one waits.
    pub fn next_notification(&mut self) -> Option<abi::Notification> {
        let n = self.notifications.pop_front()?;
        self.notified.remove(&n.cq.get());
        self.stats.notifications += 1;
        Some(n)
    }

    pub fn unget_notification(&mut self, n: abi::Notification) {
        self.stats.notifications -= 1;
        self.notified.insert(n.cq.get());
        self.notifications.push_front(n);
    }

    /// The device failed inside: DEVICE_FATAL for the driver, then
    /// everything goes as in a reset.
    pub fn fail(&mut self) {
        self.reset();
        self.fatal = true;
        self.event(ev::DEVICE_FATAL, 0, 0);
    }

    /// The feature bits the driver accepted (FEATURES_OK, or vhost-user's
    /// SET_FEATURES); 0 after a reset.
    pub fn set_features(&mut self, acked: u64) {
        self.features = acked;
    }

    /// QUERY_STATS: the data path's counters, then the refusals (the
    /// order of [`abi::STATS_NAMES`]).
    fn query_stats(&self) -> abi::StatsResp {
        let mut r = abi::StatsResp::default();
        let engine = self.device.engine().stats().fields();
        let kind = refusals::Kind::Command;
        let own = [
            self.refusals.total(kind),
            self.refusals.total(refusals::Kind::SendWqe),
            self.refusals.total(refusals::Kind::RecvWqe),
            self.stats.broken_rings,
        ];
        let values = engine.iter().map(|&(_, v)| v).chain(own);
        for (slot, v) in r.value.iter_mut().zip(values) {
            *slot = v.into();
        }
        r
    }

    /// Counters for `vrdma stat`: the device's and the face's.
    pub fn counters(&self) -> Vec<(String, u64)> {
        let mut c = self.device.counters();
        let s = &self.stats;
        for (k, v) in [
            ("commands", s.commands),
            ("refused", s.refused),
            ("doorbells", s.doorbells),
            ("stale_doorbells", s.stale_doorbells),
            ("wqes", s.wqes),
            ("malformed_wqes", s.malformed_wqes),
            ("broken_rings", s.broken_rings),
            ("arms", s.arms),
            ("notifications", s.notifications),
            ("events", s.events),
            ("events_lost", s.events_lost),
            ("area_faults", s.area_faults),
            ("resets", s.resets),
            ("contexts", self.contexts.len() as u64),
        ] {
            c.push((format!("virtio.{k}"), v));
        }
        c.extend(
            self.refusals
                .fields()
                .into_iter()
                .map(|(k, v)| (format!("virtio.{k}"), v)),
        );
        c
    }
}

/// Entries of the port's GID table (QUERY_PORT's `gid_tbl_len`), as
/// PVRDMA's default.
pub const GID_TABLE_LEN: usize = 128;

/// The largest request the control queue takes: a header, the largest
/// body and a 4 MiB trailing array.
pub const MAX_REQUEST: u32 = (4 << 20) + 4096;

/// What a turn did.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Turn {
    /// Something happened: the device should look again soon.
    pub busy: bool,
    /// The engine's next deadline (device clock, ns).
    pub deadline: Option<u64>,
}

fn handle_resp(h: u32) -> Vec<u8> {
    abi::HandleResp {
        handle: h.into(),
        reserved: 0.into(),
    }
    .as_bytes()
    .to_vec()
}

fn mr_resp(lkey: Lkey, rkey: Rkey) -> Vec<u8> {
    abi::MrResp {
        lkey: lkey.0.into(),
        rkey: rkey.0.into(),
    }
    .as_bytes()
    .to_vec()
}

fn qp_type_code(t: vrdma_engine::qp::QpType) -> u8 {
    use vrdma_engine::qp::QpType;
    match t {
        QpType::Gsi => abi::qp_type::GSI,
        QpType::Rc => abi::qp_type::RC,
        QpType::Uc => abi::qp_type::UC,
        QpType::Ud => abi::qp_type::UD,
    }
}

/// The event entry's type and object for an engine event.
fn event_code(e: AsyncEvent) -> (u32, u32) {
    match e {
        AsyncEvent::CqErr { cq } => (ev::CQ_ERR, cq.0),
        AsyncEvent::QpFatal { qp } => (ev::QP_FATAL, qp.value()),
        AsyncEvent::QpReqErr { qp } => (ev::QP_REQ_ERR, qp.value()),
        AsyncEvent::QpAccessErr { qp } => (ev::QP_ACCESS_ERR, qp.value()),
        AsyncEvent::QpLastWqeReached { qp } => (ev::QP_LAST_WQE_REACHED, qp.value()),
        AsyncEvent::SqDrained { qp } => (ev::SQ_DRAINED, qp.value()),
        AsyncEvent::SrqLimitReached { srq } => (ev::SRQ_LIMIT_REACHED, srq.0),
        AsyncEvent::PortActive { port } => (ev::PORT_ACTIVE, u32::from(port)),
    }
}

/// What QP `qpn`'s rings hold, taken into the engine as far as it has
/// room; each malformed send WQE noted (counted by reason, logged).
fn take_wqes(
    q: &mut QpFace,
    mem: &GuestMemoryMmap<()>,
    engine: &mut Engine,
    refusals: &mut Refusals,
    now: u64,
    qpn: u32,
) -> vrdma_face::Taken {
    let (shape, max_recv) = (q.shape, q.max_recv_sge);
    let sends = q.queues.take_sends(mem, engine, |e, engine| {
        send_wqe(mem, e, &shape, engine)
            .map_err(|m| refusals.note_wqe(now, FACE, refusals::Kind::SendWqe, qpn, &m))
    });
    sends.and(q.queues.take_recvs(mem, engine, |e| {
        recv_wqe(e, max_recv).map_err(|m| {
            refusals
                .note_wqe(now, FACE, refusals::Kind::RecvWqe, qpn, &m)
                .0
        })
    }))
}

/// A send WQE from its copy, for the engine: decoded, a fast
/// registration's page list read (a copy), keys resolved to the objects'
/// current ones.
fn send_wqe(
    mem: &GuestMemoryMmap<()>,
    entry: &[u8],
    shape: &SendShape,
    engine: &Engine,
) -> Result<wq::SendWqe, decode::Malformed> {
    let w = decode::decode_send_why(entry, shape)?;
    // (the header's opcode byte, after the wr_id)
    let opcode = entry.get(8).copied().map_or(0, u32::from);
    let bad = |status, rule, field, value| {
        Err(decode::Malformed {
            wr_id: w.wr_id,
            status,
            opcode,
            rule,
            field,
            value,
        })
    };
    let (sges, inline) = match w.payload {
        Payload::Sges(s) => (s, None),
        Payload::Inline(d) => (Vec::new(), Some(d)),
    };
    let mut op = w.op;
    let mut fast_reg = None;
    match &mut op {
        vrdma_engine::wr::SendOp::RegMr { mr, .. } => {
            let Some(f) = w.fast_reg else {
                return bad(WcStatus::LocQpOpErr, "a REG_MR segment", "opcode", 0);
            };
            // The MR by its index (the WQE names the key it takes).
            let Some(cur) = engine.current_lkey(f.mr.0 >> 8) else {
                return bad(
                    WcStatus::LocQpOpErr,
                    "a key naming a fast-registration MR",
                    "key",
                    f.mr.0.into(),
                );
            };
            let max = engine.query_device().max_fast_reg_page_list_len;
            if f.npages > max {
                return bad(
                    WcStatus::LocQpOpErr,
                    "npages within max_fast_reg_page_list_len",
                    "npages",
                    f.npages.into(),
                );
            }
            // A page list or page outside guest memory is a protection
            // error (§7.9), a misaligned page a malformed WQE.
            let Ok(pages) = PageList::read(mem, f.page_list, f.npages as usize) else {
                return bad(
                    WcStatus::LocProtErr,
                    "a page list in guest memory",
                    "page_list",
                    f.page_list,
                );
            };
            if let Some(p) = pages
                .pages()
                .iter()
                .find(|p| !p.is_multiple_of(1u64 << f.page_shift))
            {
                return bad(
                    WcStatus::LocQpOpErr,
                    "pages aligned to the page size",
                    "page",
                    *p,
                );
            }
            let page = 1usize << f.page_shift;
            if let Some(p) = pages
                .pages()
                .iter()
                .find(|&&p| mem.get_slice(GuestAddress(p), page).is_err())
            {
                return bad(WcStatus::LocProtErr, "pages in guest memory", "page", *p);
            }
            *mr = cur;
            fast_reg = Some((
                cur,
                Translation::Pages {
                    page_shift: f.page_shift,
                    offset: f.offset,
                    pages: pages.into_pages(),
                },
            ));
        }
        vrdma_engine::wr::SendOp::BindMw { mw, .. } => {
            let Some(cur) = engine.current_rkey(mw.0 >> 8) else {
                return bad(
                    WcStatus::MwBindErr,
                    "a key naming a memory window",
                    "mw",
                    mw.0.into(),
                );
            };
            *mw = cur;
        }
        _ => {}
    }
    Ok(wq::SendWqe {
        wr_id: w.wr_id,
        op,
        flags: w.flags,
        sges,
        inline,
        ud: w.ud,
        fast_reg,
    })
}

fn recv_wqe(entry: &[u8], max_sge: u32) -> Result<wq::RecvWqe, decode::Malformed> {
    decode::decode_recv(entry, max_sge).map(|(wr_id, sges)| wq::RecvWqe { wr_id, sges })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rings_and_areas_keep_to_pages_of_their_own() {
        let mut c = Claims::default();
        let ok = |r: Result<(), Refused>| r.is_ok();
        // A page twice in one command; a header inside the command's pages;
        // two equal headers.
        assert!(!ok(c.check(&[0x1000, 0x1000], &[], None)));
        assert!(!ok(c.check(&[0x1000], &[0x1040], None)));
        assert!(!ok(c.check(&[0x1000], &[0x9000, 0x9000], None)));
        assert!(ok(c.check(&[0x1000, 0x2000], &[0x9000, 0x9040], None)));
        c.claim(Owner::Qp(17), &[0x1000, 0x2000], &[0x9000, 0x9040]);
        // Another's page, a header on another's page, another's header, a
        // page holding another's header.
        assert!(!ok(c.check(&[0x2000], &[0xa000], None)));
        assert!(!ok(c.check(&[0x3000], &[0x1080], None)));
        assert!(!ok(c.check(&[0x3000], &[0x9040], None)));
        assert!(!ok(c.check(&[0x9000], &[0xa000], None)));
        // Headers share a page with each other.
        assert!(ok(c.check(&[0x3000], &[0x9080], None)));
        c.claim(Owner::Cq(1), &[0x3000], &[0x9080]);
        // A CQ resized keeps its header; its pages are new ones.
        assert!(ok(c.check(&[0x4000], &[0x9080], Some(Owner::Cq(1)))));
        assert!(!ok(c.check(&[0x4000], &[0x9080], Some(Owner::Cq(2)))));
        // Given back, taken again.
        c.release(Owner::Qp(17));
        assert!(ok(c.check(&[0x2000], &[0x9000], None)));
        assert!(!ok(c.check(&[0x3000], &[], None)));
        c.release(Owner::Cq(1));
        assert!(c.pages.is_empty() && c.headers.is_empty() && c.by_owner.is_empty());
    }
}
