//! The device's state: what it is made with, its contexts and the
//! objects each owns, the pages their rings and areas hold, the counters,
//! and the device's life (made, reset, failed).

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
};

use vm_memory::GuestMemoryMmap;
use vrdma_device::{Device, GuestMem, ObjectBudget, Transport};
use vrdma_engine::{
    Engine,
    attr::{DeviceAttr, PortAttr},
    cq::CqSink,
    wc::{Wc, WcStatus},
};
use vrdma_face::{
    Budget, Claims, GuestRing, Refusals,
    cq::{GuestCq, SharedMem},
    ring::FreeRunning,
    wq::{QpQueues, SrqQueue},
};
use zerocopy::FromZeros;

use crate::{
    abi::{self, event as ev},
    decode::SendShape,
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
pub(super) struct Track {
    pub(super) tail: AtomicU32,
    pub(super) due: AtomicU32,
}

/// The engine's sink for a CQ ring: the face core's, counting as it goes.
#[derive(Debug)]
pub(super) struct Sink {
    pub(super) inner: GuestCq<FreeRunning, abi::Cqe>,
    pub(super) track: Arc<Track>,
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
pub(super) enum Obj {
    Qp(u32),
    Srq(u32),
    Cq(u32),
}

#[derive(Debug)]
pub(super) struct Context {
    pub(super) area: doorbell::Area,
    pub(super) indices: doorbell::Indices,
    pub(super) doorbells: BTreeMap<u32, Obj>,
}

#[derive(Debug)]
pub(super) struct CqFace {
    pub(super) context: u32,
    pub(super) doorbell: u32,
    pub(super) ring: GuestRing<FreeRunning>,
    pub(super) header: u64,
    /// The last arm's sequence number taken.
    pub(super) arm_seq: u64,
    pub(super) track: Arc<Track>,
    /// CQ_ERR was raised: the CQ is in error until destroyed (§10.2).
    pub(super) in_error: bool,
}

#[derive(Debug)]
pub(super) struct QpFace {
    pub(super) context: u32,
    pub(super) doorbell: u32,
    pub(super) queues: QpQueues<FreeRunning>,
    pub(super) shape: SendShape,
    pub(super) max_recv_sge: u32,
}

#[derive(Debug)]
pub(super) struct SrqFace {
    pub(super) context: u32,
    pub(super) doorbell: u32,
    pub(super) queue: SrqQueue<FreeRunning>,
    pub(super) max_sge: u32,
}

/// The face's state.
#[derive(Debug)]
pub struct VirtioRdma<T: Transport> {
    pub(super) opts: Options,
    pub(super) attr: DeviceAttr,
    pub(super) port: PortAttr,
    pub device: Device<GuestMem, T>,
    /// Guest memory as the CQ sinks see it (replaced in place when the
    /// maps change).
    pub(super) shared: SharedMem,
    pub(super) budget: Budget,
    pub(super) contexts: BTreeMap<u32, Context>,
    pub(super) next_context: u32,
    /// Owners (context) of PDs by handle, MRs and MWs by key index.
    pub(super) pds: BTreeMap<u32, u32>,
    pub(super) mrs: BTreeMap<u32, u32>,
    pub(super) mws: BTreeMap<u32, u32>,
    pub(super) cqs: BTreeMap<u32, CqFace>,
    pub(super) qps: BTreeMap<u32, QpFace>,
    pub(super) srqs: BTreeMap<u32, SrqFace>,
    pub(super) claims: Claims,
    /// QPs and SRQs whose WQEs wait (in the engine or in their ring).
    pub(super) busy_qps: BTreeSet<u32>,
    pub(super) busy_srqs: BTreeSet<u32>,
    pub(super) events: VecDeque<abi::Event>,
    pub(super) lost_events: u32,
    /// Events queued ahead of the EVENTS_LOST that reports the drops
    /// (those queued when the first of them was dropped, §10.3).
    pub(super) lost_behind: usize,
    pub(super) notifications: VecDeque<abi::Notification>,
    pub(super) notified: BTreeSet<u32>,
    pub(super) polling: bool,
    /// DEVICE_FATAL was raised: every command but the queries is
    /// ERR_DEVICE until a reset.
    pub(super) fatal: bool,
    /// The feature bits the driver accepted.
    pub(super) features: u64,
    pub(super) scratch: Vec<u32>,
    pub stats: FaceStats,
    /// Refused commands and WQEs, by reason, and their log.
    pub(super) refusals: Refusals,
}

/// The device's name in the log when its thread has none.
pub(super) const FACE: &str = "virtio-rdma";

/// The name the device's thread carries (its `--device` name), for logs.
pub(super) fn device_name() -> String {
    std::thread::current().name().unwrap_or(FACE).to_owned()
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
    /// The network moved packets this turn (sent or received): the next
    /// round may have more to move at once — a round sends a budget of
    /// packets, and the rest of a long message waits for it (no ACK comes
    /// back for a UC SEND to wake the device). A turn that only found its
    /// rings waiting for room in the engine need not be followed at once:
    /// the ACKs that make room wake the device.
    pub moved: bool,
    /// The engine's next deadline (device clock, ns).
    pub deadline: Option<u64>,
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
