//! The device's state: what it is made with, its contexts and the
//! objects each owns, the pages their rings and areas hold, the counters,
//! and the device's life (made, reset, failed).

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    sync::Arc,
};

use vm_memory::GuestMemoryMmap;
use vrdma_device::{Device, GuestMem, ObjectBudget, Transport};
use vrdma_engine::attr::{DeviceAttr, PortAttr};
use vrdma_face::{
    FaceDevice, GuestRing, Malformed, RingQp, RingSrq, TakeStats,
    ring::FreeRunning,
    wq::{QpQueues, RecvWqe, SendWqe, SrqQueue},
};
use zerocopy::FromZeros;

use super::sink::Track;
use crate::{
    abi::{self, event as ev},
    decode::{self, SendShape},
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
    /// What was taken from the driver's rings (the face core's count).
    pub rings: TakeStats,
    pub arms: u64,
    pub notifications: u64,
    pub events: u64,
    pub events_lost: u64,
    /// Doorbell areas the device could not read or write (outside memory).
    pub area_faults: u64,
    pub resets: u64,
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
pub(crate) struct QpFace {
    pub(super) context: u32,
    pub(super) doorbell: u32,
    pub(super) queues: QpQueues<FreeRunning>,
    pub(super) shape: SendShape,
    pub(super) max_recv_sge: u32,
}

#[derive(Debug)]
pub(crate) struct SrqFace {
    pub(super) context: u32,
    pub(super) doorbell: u32,
    pub(super) queue: SrqQueue<FreeRunning>,
    pub(super) max_sge: u32,
}

impl RingQp for QpFace {
    type Indices = FreeRunning;
    /// The send queue's shape, and the receive queue's SGE limit.
    type Shape = (SendShape, u32);

    fn queues(&mut self) -> &mut QpQueues<FreeRunning> {
        &mut self.queues
    }

    fn shape(&self) -> Self::Shape {
        (self.shape, self.max_recv_sge)
    }

    fn decode_send(shape: &Self::Shape, entry: &[u8]) -> Result<SendWqe, Malformed> {
        decode::decode_send_why(entry, &shape.0)
    }

    fn decode_recv(shape: &Self::Shape, entry: &[u8]) -> Result<RecvWqe, Malformed> {
        recv_wqe(entry, shape.1)
    }
}

/// A malformed WQE breaks the SRQ (SRQ_ERR, §10.2: its queue is made
/// `breaking_on_malformed`).
impl RingSrq for SrqFace {
    type Indices = FreeRunning;
    /// The SRQ's SGE limit.
    type Shape = u32;

    fn queue(&mut self) -> &mut SrqQueue<FreeRunning> {
        &mut self.queue
    }

    fn shape(&self) -> u32 {
        self.max_sge
    }

    fn decode_recv(max_sge: &u32, entry: &[u8]) -> Result<RecvWqe, Malformed> {
        recv_wqe(entry, *max_sge)
    }
}

fn recv_wqe(entry: &[u8], max_sge: u32) -> Result<RecvWqe, Malformed> {
    decode::decode_recv(entry, max_sge).map(|(wr_id, sges)| RecvWqe { wr_id, sges })
}

/// The face's state.
#[derive(Debug)]
pub struct VirtioRdma<T: Transport> {
    pub(super) opts: Options,
    /// The device, its QPs and SRQs with their rings, claimed pages,
    /// refusals: the face core's, as every face's.
    pub(crate) dev: FaceDevice<T, QpFace, SrqFace>,
    pub(super) contexts: BTreeMap<u32, Context>,
    pub(super) next_context: u32,
    /// Owners (context) of PDs by handle, MRs and MWs by key index.
    pub(super) pds: BTreeMap<u32, u32>,
    pub(super) mrs: BTreeMap<u32, u32>,
    pub(super) mws: BTreeMap<u32, u32>,
    pub(super) cqs: BTreeMap<u32, CqFace>,
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
    /// The objects a round's doorbells named (kept for its allocation).
    pub(super) rung: Vec<Obj>,
    pub(crate) stats: FaceStats,
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
        VirtioRdma {
            opts,
            dev: FaceDevice::new(attr, port, transport, FACE),
            contexts: BTreeMap::new(),
            next_context: 1,
            pds: BTreeMap::new(),
            mrs: BTreeMap::new(),
            mws: BTreeMap::new(),
            cqs: BTreeMap::new(),
            events: VecDeque::new(),
            lost_events: 0,
            lost_behind: 0,
            notifications: VecDeque::new(),
            notified: BTreeSet::new(),
            polling: false,
            fatal: false,
            features: 0,
            scratch: Vec::new(),
            rung: Vec::new(),
            stats: FaceStats::default(),
        }
    }

    /// The vrdma device behind the face.
    pub fn device(&self) -> &Device<GuestMem, T> {
        &self.dev.device
    }

    pub fn device_mut(&mut self) -> &mut Device<GuestMem, T> {
        &mut self.dev.device
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
            max_qp: self.dev.attr().max_qp.into(),
            max_cq: self.dev.attr().max_cq.into(),
            max_request: MAX_REQUEST.into(),
            ..abi::Config::new_zeroed()
        }
    }

    /// What the guest's objects may make the engine hold.
    pub fn set_budget(&mut self, budget: ObjectBudget) {
        self.dev.set_budget(budget);
    }

    /// The guest has `guest` bytes of RAM (with memory hot-plug, the most
    /// it may have), or a size not configured: a derived object budget
    /// comes from it, never from more than the device maps
    /// ([`ObjectBudget::Derived`]).
    pub fn set_guest_size(&mut self, guest: Option<u64>) {
        self.dev.set_guest_size(guest);
    }

    /// The guest's configured size ([`VirtioRdma::set_guest_size`]).
    pub fn guest_size(&self) -> Option<u64> {
        self.dev.guest_size()
    }

    /// The guest's memory maps changed: the engine, the sinks and the
    /// doorbell scans see the new ones at once.
    pub fn set_memory(&mut self, mem: &GuestMemoryMmap<()>) {
        self.dev.remap(mem);
    }

    /// Everything the driver made goes (a device reset): a new engine,
    /// whose objects reach no guest memory, empty tables.
    pub fn reset(&mut self) {
        self.dev.reset();
        self.contexts.clear();
        self.next_context = 1;
        self.pds.clear();
        self.mrs.clear();
        self.mws.clear();
        self.cqs.clear();
        self.events.clear();
        self.lost_events = 0;
        self.lost_behind = 0;
        self.notifications.clear();
        self.notified.clear();
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

    /// The face's counters, with what the face core counted of the rings.
    pub fn stats(&self) -> FaceStats {
        FaceStats {
            rings: self.dev.taken,
            ..self.stats
        }
    }

    /// Counters for `vrdma stat`: the device's and the face's.
    pub fn counters(&self) -> Vec<(String, u64)> {
        let mut c = self.dev.device.counters();
        let s = &self.stats();
        for (k, v) in [
            ("commands", s.commands),
            ("refused", s.refused),
            ("doorbells", s.doorbells),
            ("stale_doorbells", s.stale_doorbells),
            ("arms", s.arms),
            ("notifications", s.notifications),
            ("events", s.events),
            ("events_lost", s.events_lost),
            ("area_faults", s.area_faults),
            ("resets", s.resets),
            ("contexts", self.contexts.len() as u64),
            ("gids_refused", self.dev.gids_refused),
        ]
        .into_iter()
        .chain(s.rings.fields())
        {
            c.push((format!("virtio.{k}"), v));
        }
        c.extend(
            self.dev
                .refusals
                .fields()
                .into_iter()
                .map(|(k, v)| (format!("virtio.{k}"), v)),
        );
        c
    }
}
