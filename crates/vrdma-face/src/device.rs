//! The face device: what every face holds around its ABI — the vrdma
//! device, guest memory as the CQ sinks see it, the object budget, the
//! QPs and SRQs whose rings the device takes from, which of them have
//! work waiting, the pages their rings hold, the refusals and the
//! counters of what was taken — and what it does the same for every face:
//! a reset, a new memory map, the port's addresses bound again, the rings
//! taken and accounted, the busy rings visited as the engine makes room.
//!
//! A face keeps beside it what its ABI adds (contexts, doorbell pages or
//! areas, events, its CQs) and says, per QP and SRQ, how its WQEs decode
//! ([`RingQp`], [`RingSrq`]): pure functions of an entry's copy, the
//! decode shape the object was made with, and nothing else.

use std::collections::{BTreeMap, BTreeSet};

use vm_memory::GuestMemoryMmap;
use vrdma_device::{Device, GuestMem, ObjectBudget, Transport};
use vrdma_engine::{
    Engine,
    attr::{DeviceAttr, GidEntry, GidType, PortAttr},
};
use vrdma_wire::Gid;

use crate::{
    Budget, Claims, Malformed, OrRefuse, Refusals, Refused, Taken,
    cq::SharedMem,
    ring::Indices,
    wq::{Noting, QpQueues, RecvWqe, SendWqe, SrqQueue},
};

/// A QP as a face holds it: its rings, and how its WQEs decode.
pub trait RingQp {
    type Indices: Indices;
    /// What the QP's WQEs are decoded against (its type, its limits).
    type Shape: Copy;

    fn queues(&mut self) -> &mut QpQueues<Self::Indices>;
    fn shape(&self) -> Self::Shape;
    /// A send WQE from its copy (the ring's stride).
    fn decode_send(shape: &Self::Shape, entry: &[u8]) -> Result<SendWqe, Malformed>;
    /// A receive WQE from its copy.
    fn decode_recv(shape: &Self::Shape, entry: &[u8]) -> Result<RecvWqe, Malformed>;
}

/// An SRQ as a face holds it: its ring, and how its WQEs decode.
pub trait RingSrq {
    type Indices: Indices;
    type Shape: Copy;

    fn queue(&mut self) -> &mut SrqQueue<Self::Indices>;
    fn shape(&self) -> Self::Shape;
    fn decode_recv(shape: &Self::Shape, entry: &[u8]) -> Result<RecvWqe, Malformed>;
}

/// Which of a QP's rings a doorbell names.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Rings {
    pub sends: bool,
    pub recvs: bool,
}

impl Rings {
    pub const BOTH: Rings = Rings {
        sends: true,
        recvs: true,
    };
    pub const SENDS: Rings = Rings {
        sends: true,
        recvs: false,
    };
    pub const RECVS: Rings = Rings {
        sends: false,
        recvs: true,
    };
}

/// Counters of what the device took from the guest's rings.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct TakeStats {
    pub wqes: u64,
    pub malformed_wqes: u64,
    /// QPs and SRQs whose rings the guest broke (a QP taken to ERR, an
    /// SRQ reported by its face).
    pub broken_rings: u64,
}

impl TakeStats {
    /// The counters by name, for `vrdma stat` (each face's prefix before).
    pub fn fields(&self) -> [(&'static str, u64); 3] {
        [
            ("wqes", self.wqes),
            ("malformed_wqes", self.malformed_wqes),
            ("broken_rings", self.broken_rings),
        ]
    }
}

/// The device behind a face, and the objects with rings it takes from.
#[derive(Debug)]
pub struct FaceDevice<T: Transport, Q, S> {
    pub device: Device<GuestMem, T>,
    /// Guest memory as the CQ sinks see it (replaced in place when the
    /// maps change).
    pub shared: SharedMem,
    budget: Budget,
    /// What a new engine is made with (after each reset).
    attr: DeviceAttr,
    port: PortAttr,
    /// The face's name in the log when the device's thread has none.
    face: &'static str,
    pub qps: BTreeMap<u32, Q>,
    pub srqs: BTreeMap<u32, S>,
    /// The pages of every ring, area and header, by owner.
    pub claims: Claims,
    /// QPs and SRQs with WQEs the engine holds or the guest posted and the
    /// device did not take yet: visited each round until settled.
    busy_qps: BTreeSet<u32>,
    busy_srqs: BTreeSet<u32>,
    /// SRQs whose ring broke since the face last asked.
    broken_srqs: Vec<u32>,
    pub taken: TakeStats,
    /// GIDs the guest tried to bind that are not its port's addresses.
    pub gids_refused: u64,
    /// Refused commands and WQEs, by reason, and their log.
    pub refusals: Refusals,
}

impl<T: Transport, Q: RingQp, S: RingSrq> FaceDevice<T, Q, S> {
    /// A device whose engine has `attr` and `port`, reaching the network
    /// through `transport`; nothing made, no memory mapped, the object
    /// budget derived from the (no) memory mapped.
    pub fn new(attr: DeviceAttr, port: PortAttr, transport: T, face: &'static str) -> Self {
        let engine = Engine::new(attr.clone(), port.clone());
        let mut device = Device::new(engine, GuestMem::default(), transport);
        let budget = Budget::new(ObjectBudget::Derived);
        budget.apply(&mut device);
        FaceDevice {
            device,
            shared: SharedMem::new(GuestMemoryMmap::default()),
            budget,
            attr,
            port,
            face,
            qps: BTreeMap::new(),
            srqs: BTreeMap::new(),
            claims: Claims::default(),
            busy_qps: BTreeSet::new(),
            busy_srqs: BTreeSet::new(),
            broken_srqs: Vec::new(),
            taken: TakeStats::default(),
            gids_refused: 0,
            refusals: Refusals::default(),
        }
    }

    /// The attributes the engine is made with.
    pub fn attr(&self) -> &DeviceAttr {
        &self.attr
    }

    /// What the guest's objects may make the engine hold, from now on.
    pub fn set_budget(&mut self, budget: ObjectBudget) {
        self.budget.set(budget, &mut self.device);
    }

    /// The guest has `guest` bytes of RAM (with memory hot-plug, the most
    /// it may have), or a size not configured: a derived object budget
    /// comes from it, never from more than the device maps.
    pub fn set_guest_size(&mut self, guest: Option<u64>) {
        self.budget.set_guest_size(guest, &mut self.device);
    }

    /// The guest's configured size ([`FaceDevice::set_guest_size`]).
    pub fn guest_size(&self) -> Option<u64> {
        self.budget.guest_size()
    }

    /// The guest's memory maps changed: the engine, the CQ sinks and the
    /// transport's lent pieces move to the new memory at once.
    pub fn remap(&mut self, mem: &GuestMemoryMmap<()>) {
        self.budget.remap(&mut self.device, &self.shared, mem);
    }

    /// Everything the guest made goes: a new engine (nothing of the old
    /// one reaches guest memory again), no QP, SRQ or claimed page, no GID
    /// steered to the engine. The face clears what it keeps beside.
    pub fn reset(&mut self) {
        let fresh = Engine::new(self.attr.clone(), self.port.clone());
        self.budget.replace_engine(&mut self.device, fresh);
        self.qps.clear();
        self.srqs.clear();
        self.claims.clear();
        self.busy_qps.clear();
        self.busy_srqs.clear();
        self.broken_srqs.clear();
        self.device.transport_mut().set_local(&[]);
    }

    /// Binds GID table entry `index` to `gid` (a RoCEv2 address), or
    /// clears it (`None`), and steers to the engine what is addressed to
    /// the GIDs bound then. A GID the port was not given — another
    /// tenant's address, spoofed through the device — is refused, and
    /// nothing changes.
    pub fn set_gid(&mut self, index: u8, gid: Option<Gid>) -> Result<(), Refused> {
        if let Some(g) = gid
            && !self.device.transport().admits_gid(&g)
        {
            self.gids_refused += 1;
            return Err(Refused::invalid("GID: not one of the port's addresses"));
        }
        let entry = gid.map(|gid| GidEntry {
            gid,
            ty: GidType::RoceV2,
        });
        self.device
            .engine_mut()
            .set_gid(index, entry)
            .or_refuse("GID index")?;
        self.rebind();
        Ok(())
    }

    /// The port steers to the engine what is addressed to the GIDs bound
    /// now.
    pub fn rebind(&mut self) {
        let gids: Vec<Gid> = self
            .device
            .engine()
            .query_port(1)
            .map(|p| p.gids.iter().flatten().map(|e| e.gid).collect())
            .unwrap_or_default();
        self.device.transport_mut().set_local(&gids);
    }

    /// Takes from QP `qpn`'s `rings` what its guest posted (as far as the
    /// engine has room), counts it, fails the QP whose ring broke, and
    /// keeps it among the busy until it settles.
    pub fn take_qp(&mut self, qpn: u32, rings: Rings) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        // The round's clock (a refusal's time in the log): no clock read per take.
        let now = self.device.clock();
        let (engine, mem) = self.device.parts();
        let mut noting = Noting {
            refusals: &mut self.refusals,
            face: self.face,
            now,
        };
        let t = take_qp(q, mem.map(), engine, &mut noting, rings);
        account_qp(&mut self.taken, engine, q, t);
        self.busy_qps.insert(qpn);
    }

    /// Whether QP `qpn`'s rings hold WQEs the device has not taken (a
    /// look that costs two index reads, where a take costs its
    /// bookkeeping too).
    pub fn qp_pending(&mut self, qpn: u32) -> bool {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return false;
        };
        let (_, mem) = self.device.parts();
        q.queues().pending(mem.map())
    }

    /// Takes what SRQ `srq`'s guest posted, counts it, and keeps it among
    /// the busy until it settles; a ring that broke is reported
    /// ([`FaceDevice::take_broken_srqs`]).
    pub fn take_srq(&mut self, srq: u32) {
        let Some(s) = self.srqs.get_mut(&srq) else {
            return;
        };
        let now = self.device.clock();
        let (engine, mem) = self.device.parts();
        let mut noting = Noting {
            refusals: &mut self.refusals,
            face: self.face,
            now,
        };
        let shape = s.shape();
        let t = s.queue().take(mem.map(), engine, &mut noting, |e| {
            S::decode_recv(&shape, e)
        });
        self.account_srq(srq, t);
        self.busy_srqs.insert(srq);
    }

    /// QP `qpn` destroyed: forgotten, busy or not.
    pub fn remove_qp(&mut self, qpn: u32) -> Option<Q> {
        self.busy_qps.remove(&qpn);
        self.qps.remove(&qpn)
    }

    /// SRQ `srq` destroyed: forgotten, busy or not.
    pub fn remove_srq(&mut self, srq: u32) -> Option<S> {
        self.busy_srqs.remove(&srq);
        self.srqs.remove(&srq)
    }

    /// Takes from every ring (for a face that cannot tell which rings were
    /// posted to).
    pub fn take_all(&mut self) {
        let qps: Vec<u32> = self.qps.keys().copied().collect();
        for qpn in qps {
            self.take_qp(qpn, Rings::BOTH);
        }
        self.take_all_srqs();
    }

    /// Takes from every SRQ's ring.
    pub fn take_all_srqs(&mut self) {
        let srqs: Vec<u32> = self.srqs.keys().copied().collect();
        for s in srqs {
            self.take_srq(s);
        }
    }

    /// Room freed in the engine: takes what waited in the busy QPs' and
    /// SRQs' rings, gives their slots back, and forgets those with nothing
    /// left in the engine or the ring. Returns whether a ring still holds
    /// WQEs the engine had no room for.
    #[must_use = "a ring still waiting for room wants another turn"]
    pub fn progress_rings(&mut self) -> bool {
        let mut waiting = false;
        let busy: Vec<u32> = self.busy_qps.iter().copied().collect();
        for qpn in busy {
            let Some(q) = self.qps.get_mut(&qpn) else {
                self.busy_qps.remove(&qpn);
                continue;
            };
            let now = self.device.clock();
            let (engine, mem) = self.device.parts();
            let mem = mem.map();
            if q.queues().pending(mem) {
                let mut noting = Noting {
                    refusals: &mut self.refusals,
                    face: self.face,
                    now,
                };
                let t = take_qp(q, mem, engine, &mut noting, Rings::BOTH);
                account_qp(&mut self.taken, engine, q, t);
            }
            if q.queues().settle(mem, engine) {
                self.busy_qps.remove(&qpn);
            } else {
                waiting |= q.queues().pending(mem);
            }
        }
        let busy: Vec<u32> = self.busy_srqs.iter().copied().collect();
        for srq in busy {
            let Some(s) = self.srqs.get_mut(&srq) else {
                self.busy_srqs.remove(&srq);
                continue;
            };
            let now = self.device.clock();
            let (engine, mem) = self.device.parts();
            let mem = mem.map();
            let shape = s.shape();
            let t = if s.queue().pending(mem) {
                let mut noting = Noting {
                    refusals: &mut self.refusals,
                    face: self.face,
                    now,
                };
                s.queue()
                    .take(mem, engine, &mut noting, |e| S::decode_recv(&shape, e))
            } else {
                Taken::default()
            };
            let idle = s.queue().settle(mem, engine);
            waiting |= !idle && s.queue().pending(mem);
            self.account_srq(srq, t);
            if idle {
                self.busy_srqs.remove(&srq);
            }
        }
        waiting
    }

    /// The SRQs whose ring broke since the last call, for the face to
    /// report (each once: nothing more is taken from a broken ring).
    #[must_use = "a broken SRQ must be reported"]
    pub fn take_broken_srqs(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.broken_srqs)
    }

    /// Counts what an SRQ's ring gave, and a ring that broke.
    fn account_srq(&mut self, srq: u32, t: Taken) {
        self.taken.wqes += u64::from(t.entries);
        self.taken.malformed_wqes += u64::from(t.malformed);
        if t.broken {
            self.taken.broken_rings += 1;
            self.broken_srqs.push(srq);
        }
    }
}

/// Takes from `q`'s `rings`, decoded as its face says.
fn take_qp<Q: RingQp>(
    q: &mut Q,
    mem: &GuestMemoryMmap<()>,
    engine: &mut Engine,
    noting: &mut Noting<'_>,
    rings: Rings,
) -> Taken {
    let shape = q.shape();
    let queues = q.queues();
    let mut t = Taken::default();
    if rings.sends {
        t = t.and(queues.take_sends(mem, engine, noting, |e| Q::decode_send(&shape, e)));
    }
    if rings.recvs {
        t = t.and(queues.take_recvs(mem, engine, noting, |e| Q::decode_recv(&shape, e)));
    }
    t
}

/// Counts what a QP's rings gave; a ring that broke (it happens once:
/// nothing more is taken from the QP until it is reset) fails the QP.
fn account_qp<Q: RingQp>(stats: &mut TakeStats, engine: &mut Engine, q: &mut Q, t: Taken) {
    stats.wqes += u64::from(t.entries);
    stats.malformed_wqes += u64::from(t.malformed);
    if t.broken {
        stats.broken_rings += 1;
        let _ = engine.qp_fatal(q.queues().qpn());
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io,
        os::fd::{AsFd, BorrowedFd, OwnedFd},
    };

    use vrdma_engine::{
        PdHandle,
        attr::PortAttr,
        qp::{QpCap, QpInitAttr, QpType},
        transmit::Transmit,
    };
    use vrdma_fabric::Lender;
    use vrdma_wire::{Gid, Qpn, frame::IpRepr};

    use super::*;
    use crate::{
        PageList,
        pages::Owner,
        ring::{GuestRing, WrapBit},
    };

    /// A port that carries nothing, owns the addresses it was given and
    /// records what the device steers to it.
    #[derive(Debug)]
    struct Owned {
        given: Vec<Gid>,
        local: Vec<Gid>,
        slot: Vec<u8>,
        fd: OwnedFd,
    }

    impl Owned {
        fn new(given: &[Gid]) -> Self {
            let (fd, _) = nix::unistd::pipe().unwrap();
            Owned {
                given: given.to_vec(),
                local: Vec::new(),
                slot: vec![0; 9000],
                fd,
            }
        }
    }

    impl Transport for Owned {
        fn receive(
            &mut self,
            _: impl FnMut(&IpRepr, &[u8], Option<&vrdma_fabric::shm::Loan>),
        ) -> io::Result<usize> {
            Ok(0)
        }
        fn batch(&self) -> usize {
            1
        }
        fn rx_bytes(&self) -> u64 {
            0
        }
        fn slot(&mut self, _: &impl Lender) -> (&mut [u8], usize) {
            (&mut self.slot, 0)
        }
        fn queue(
            &mut self,
            _: &Transmit,
            _: &vrdma_device::transport::Lent<'_>,
            _: &impl Lender,
        ) -> usize {
            0
        }
        fn flush(&mut self, _: &impl Lender) -> usize {
            0
        }
        fn fd(&self) -> BorrowedFd<'_> {
            self.fd.as_fd()
        }
        fn counters(&self, _: &mut Vec<(String, u64)>) {}
        fn set_local(&mut self, gids: &[Gid]) {
            self.local = gids.to_vec();
        }
        fn admits_gid(&self, gid: &Gid) -> bool {
            self.given.contains(gid)
        }
    }

    /// A QP whose WQEs never decode (none is posted in these tests).
    #[derive(Debug)]
    struct Qp(QpQueues<WrapBit>);

    impl RingQp for Qp {
        type Indices = WrapBit;
        type Shape = ();
        fn queues(&mut self) -> &mut QpQueues<WrapBit> {
            &mut self.0
        }
        fn shape(&self) {}
        fn decode_send(_: &(), _: &[u8]) -> Result<SendWqe, Malformed> {
            unreachable!("nothing is posted")
        }
        fn decode_recv(_: &(), _: &[u8]) -> Result<RecvWqe, Malformed> {
            unreachable!("nothing is posted")
        }
    }

    #[derive(Debug)]
    struct Srq(SrqQueue<WrapBit>);

    impl RingSrq for Srq {
        type Indices = WrapBit;
        type Shape = ();
        fn queue(&mut self) -> &mut SrqQueue<WrapBit> {
            &mut self.0
        }
        fn shape(&self) {}
        fn decode_recv(_: &(), _: &[u8]) -> Result<RecvWqe, Malformed> {
            unreachable!("nothing is posted")
        }
    }

    fn gid(n: u8) -> Gid {
        Gid::from(std::net::Ipv4Addr::new(127, 0, 0, n))
    }

    fn device() -> FaceDevice<Owned, Qp, Srq> {
        // A GID table of 16 entries, none bound.
        let mut port = PortAttr::with_gids(&[]);
        port.gids.resize(16, None);
        FaceDevice::new(DeviceAttr::default(), port, Owned::new(&[gid(1)]), "test")
    }

    /// A ring of 4 entries of 64 bytes on page `page`.
    fn ring(page: u64) -> GuestRing<WrapBit> {
        GuestRing::new(
            WrapBit::new(4).unwrap(),
            64,
            page,
            page + 4,
            PageList::new(vec![page]).unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn a_gid_is_bound_only_if_it_is_the_ports_and_the_port_steers_what_is_bound() {
        let mut d = device();
        let refused = d.set_gid(0, Some(gid(2))).unwrap_err();
        assert_eq!(refused.errno, crate::Refused::invalid("").errno);
        assert_eq!(d.gids_refused, 1, "a spoofed address is counted");
        assert!(d.device.transport().local.is_empty(), "nothing steered");
        d.set_gid(0, Some(gid(1))).unwrap();
        assert_eq!(d.device.transport().local, [gid(1)]);
        assert!(
            d.set_gid(200, Some(gid(1))).is_err(),
            "an index past the table"
        );
        d.set_gid(0, None).unwrap();
        assert!(d.device.transport().local.is_empty(), "cleared, unsteered");
        assert_eq!(d.gids_refused, 1);
    }

    #[test]
    fn a_reset_forgets_every_object_claim_and_address_and_makes_a_new_engine() {
        let mut d = device();
        d.set_gid(0, Some(gid(1))).unwrap();
        let e = d.device.engine_mut();
        let pd: PdHandle = e.alloc_pd().unwrap();
        let (cq, _) = e.create_cq(16, 0).unwrap();
        let init = QpInitAttr {
            qp_type: QpType::Rc,
            pd,
            send_cq: cq,
            recv_cq: cq,
            srq: None,
            cap: QpCap {
                max_send_wr: 4,
                max_recv_wr: 4,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: false,
        };
        let (qpn, _): (Qpn, _) = e.create_qp(init).unwrap();
        let q = Qp(QpQueues::new(qpn, ring(0x1000), Some(ring(0x2000))));
        d.qps.insert(qpn.value(), q);
        d.claims
            .claim(Owner::Qp(qpn.value()), &[0x1000, 0x2000], &[]);
        d.take_qp(qpn.value(), Rings::BOTH);
        assert_eq!(d.taken, TakeStats::default(), "no memory: nothing taken");
        d.reset();
        assert!(d.qps.is_empty() && d.srqs.is_empty());
        assert!(d.device.transport().local.is_empty(), "no GID steered");
        assert!(
            d.device.engine().query_qp(qpn).is_err(),
            "the old engine's QP is gone with it"
        );
        assert!(d.claims.is_empty(), "the pages are free again");
        assert!(!d.progress_rings(), "nothing busy after a reset");
        assert!(d.remove_qp(qpn.value()).is_none());
    }
}
