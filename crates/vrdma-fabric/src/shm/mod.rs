//! Same-host shared memory: devices served by one process reach each other
//! without a network. A [`Switch`] is the medium — a directory of the
//! devices' addresses (GIDs) and a mailbox per device; a device's [`Port`]
//! on it puts a packet straight into the mailbox of the device that holds
//! its destination GID, and takes what its own mailbox holds. No IP or UDP
//! header, no ICRC (the packet never leaves the process, so nothing can
//! corrupt it), no system call per packet: an eventfd wakes a receiver
//! whose mailbox went from empty to not empty, and a busy-polling receiver
//! reads an atomic count before it takes a lock.
//!
//! A packet's payload lent by the engine (a gather send) is copied once,
//! from the sender's memory (through its volatile view, [`Lender`]) into
//! the mailbox; the receiving engine then moves it into the MR its checks
//! allow. A mailbox is bounded in bytes: a packet for a full one is dropped
//! and counted, as a network drops it, and RC's recovery resends it.
//!
//! A switch carries any number of virtual networks ([`Network`]), as a
//! cloud's virtual switch carries its tenants' segments: every port is on
//! one, addresses are unique within a network and may repeat across
//! networks (tenants' address spaces overlap), and a packet reaches
//! through memory only a device of its sender's own network — for any
//! other destination the sender's uplink takes it, as if the medium were
//! not there.
//!
//! What the medium checks, so that a device on it is no more trusted than
//! one on a wire: a packet's source GID must be one its port holds (a
//! device cannot speak as another); a port holds only addresses its owner
//! was given ([`Owned`]: the operator's `ip=`), and an address belongs to
//! the first device of its network that claims it (a second claim is
//! refused, logged and counted, its traffic to that address stays on the
//! uplink). Everything else — QPN, PSN, keys, rights, bounds — is the
//! receiving engine's job, exactly as for a packet from the wire.
//!
//! Devices of other daemons on the host join through a rendezvous
//! directory ([`Switch::join`], [`peer`]): an address one of them holds
//! leads to a ring ([`ring`]) into that device, and a device reads the
//! rings the other daemons write for it beside its mailbox.

use std::{
    collections::{HashMap, VecDeque},
    io,
    os::fd::{AsFd, BorrowedFd},
    sync::{
        Arc, Mutex, MutexGuard, OnceLock, PoisonError, RwLock, Weak,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
};

use nix::sys::{
    epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags},
    eventfd::{EfdFlags, EventFd},
};
use vrdma_wire::{Gid, frame::Route};

pub mod peer;
pub mod ring;
mod sys;

pub use peer::{Admit, Grant, JoinConfig, Rendezvous, RendezvousStats, Trust, write_grant};

use crate::{Lender, Piece};

/// The medium's limits.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Config {
    /// Bytes of packets a device's mailbox holds at most: 16 MiB, room for
    /// 32 RC QPs' whole windows (128 packets of 4 KiB) — a receiver that
    /// falls further behind loses packets, as a switch's buffer would.
    pub mailbox_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mailbox_bytes: 16 << 20,
        }
    }
}

/// Packets one [`Port::receive`] takes at most.
pub const BATCH: usize = 64;

/// Spare packet buffers a mailbox keeps for its senders, and a port for
/// its next sends (the rest are freed).
const SPARES: usize = 256;

/// The same-host medium: the devices on it, by network and address.
/// Cloning gives another handle on the same switch.
#[derive(Clone, Debug, Default)]
pub struct Switch {
    inner: Arc<Directory>,
}

/// A network's number on one switch (names are what other daemons share).
#[derive(Clone, Copy, Debug, Default, Eq, Hash, Ord, PartialEq, PartialOrd)]
pub(crate) struct NetId(u32);

/// A virtual network on a [`Switch`]: its devices reach each other through
/// memory, and no device of another network. A named one
/// ([`Switch::network`]) is the same network for every device of the
/// switch that names it, and for devices of other daemons on a rendezvous
/// that name it ([`Switch::join`]); a private one
/// ([`Switch::private_network`]) is a network of its one device.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct Network {
    id: NetId,
    /// `None`: private, never announced to other daemons.
    name: Option<Arc<str>>,
}

impl Network {
    /// The name, for a named network.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// What `vrdma stat` shows: the name, or `private`.
    pub fn label(&self) -> &str {
        self.name().unwrap_or("private")
    }
}

/// The name of the network [`Switch::attach`] puts a port on: the one a
/// process's own devices share (the tools', the tests').
pub const DEFAULT_NETWORK: &str = "default";

/// Bytes a network's name has at most.
pub const MAX_NETWORK_NAME: usize = 32;

/// Why a network name is refused.
#[derive(Clone, Debug, Eq, PartialEq, thiserror::Error)]
#[error("network name {0:?}: 1 to 32 of A-Z a-z 0-9 . _ -")]
pub struct BadNetworkName(pub String);

/// Checks a network's name: 1 to [`MAX_NETWORK_NAME`] bytes of letters,
/// digits, `.`, `_` and `-` (it goes into logs, counters and the
/// rendezvous protocol).
pub fn check_network_name(name: &str) -> Result<(), BadNetworkName> {
    let ok = (1..=MAX_NETWORK_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(BadNetworkName(name.to_owned()))
    }
}

/// The addresses a port may hold on its network: what its owner (the
/// operator, for a served guest) gave it. A claim of anything else is
/// refused and counted (`shm.gid_refused`): a guest kernel that binds a
/// foreign GID keeps it off the switch.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub enum Owned {
    /// Any address (a device of the process's own: the tools', the tests').
    #[default]
    Any,
    /// These only.
    Only(Vec<Gid>),
}

impl Owned {
    pub fn allows(&self, gid: &Gid) -> bool {
        match self {
            Owned::Any => true,
            Owned::Only(set) => set.contains(gid),
        }
    }
}

#[derive(Debug, Default)]
struct Networks {
    /// Named networks' numbers; the default network is 0.
    named: HashMap<Arc<str>, NetId>,
    next: u32,
}

#[derive(Debug, Default)]
struct Directory {
    config: Config,
    /// Who holds each address of each network.
    owners: RwLock<Owners>,
    /// Bumped whenever `owners` changes: a port's cached lookups are good
    /// while it stands.
    generation: AtomicU64,
    /// Port (and remote ring) identities handed out.
    next_id: AtomicU64,
    /// The ports, for the rendezvous (which gives each a ring from every
    /// other daemon and tells them its addresses).
    ports: Mutex<Vec<Weak<PortShared>>>,
    /// The rendezvous thread's wake-up, once the switch joined one: a
    /// port came, went or changed its addresses.
    notify: OnceLock<Arc<EventFd>>,
    networks: Mutex<Networks>,
    /// The rendezvous' counters, once the switch joined one.
    rendezvous: OnceLock<Arc<RendezvousStats>>,
}

/// The directory proper: each network's addresses, and how many networks
/// hold each address (a destination held only by another network is
/// counted on its way to the uplink, `shm.tx_other_network`).
#[derive(Debug, Default)]
struct Owners {
    by_net: HashMap<(NetId, Gid), Dest>,
    holders: HashMap<Gid, u32>,
}

impl Owners {
    fn get(&self, net: NetId, g: &Gid) -> Option<&Dest> {
        self.by_net.get(&(net, *g))
    }

    fn insert(&mut self, net: NetId, g: Gid, d: Dest) {
        if self.by_net.insert((net, g), d).is_none() {
            *self.holders.entry(g).or_insert(0) += 1;
        }
    }

    fn remove(&mut self, net: NetId, g: &Gid) {
        if self.by_net.remove(&(net, *g)).is_some()
            && let Some(n) = self.holders.get_mut(g)
        {
            *n -= 1;
            if *n == 0 {
                self.holders.remove(g);
            }
        }
    }

    /// Whether a network other than `net` holds `g`.
    fn elsewhere(&self, net: NetId, g: &Gid) -> bool {
        let here = u32::from(self.by_net.contains_key(&(net, *g)));
        self.holders.get(g).is_some_and(|n| *n > here)
    }
}

impl Directory {
    fn changed(&self) {
        if let Some(e) = self.notify.get() {
            let _ = e.write(1);
        }
    }
}

/// Where an address leads: a device of this process, or a ring into a
/// device of another daemon.
#[derive(Clone, Debug)]
enum Dest {
    Local(Arc<Mailbox>),
    Remote(Arc<peer::Outbound>),
}

impl Dest {
    fn id(&self) -> u64 {
        match self {
            Dest::Local(m) => m.id,
            Dest::Remote(o) => o.id,
        }
    }
}

/// What a port shares with the rendezvous thread.
#[derive(Debug)]
struct PortShared {
    id: u64,
    /// Its network (a private one is never announced to other daemons).
    net: Network,
    /// False once the port is dropped (the rendezvous then says GONE).
    alive: AtomicBool,
    /// The device's descriptor: its mailbox's eventfd, its uplink's, and
    /// the rings' from other daemons.
    epoll: Epoll,
    /// Its addresses, as the rendezvous tells other daemons.
    gids: Mutex<Vec<Gid>>,
    /// Rings other daemons were given for it, not yet taken by the port.
    incoming: Mutex<Vec<peer::InRing>>,
    /// Bumped when `incoming` grows or a ring's daemon leaves.
    incoming_gen: AtomicU64,
}

impl Switch {
    /// A switch with the default limits.
    pub fn new() -> Self {
        Switch::with_config(Config::default())
    }

    pub fn with_config(config: Config) -> Self {
        Switch {
            inner: Arc::new(Directory {
                config,
                ..Directory::default()
            }),
        }
    }

    /// The network called `name` on this switch (the same one for every
    /// caller that names it).
    pub fn network(&self, name: &str) -> Result<Network, BadNetworkName> {
        check_network_name(name)?;
        let mut n = lock(&self.inner.networks);
        if let Some((k, id)) = n.named.get_key_value(name) {
            return Ok(Network {
                id: *id,
                name: Some(Arc::clone(k)),
            });
        }
        let id = if name == DEFAULT_NETWORK {
            NetId(0)
        } else {
            n.next += 1;
            NetId(n.next)
        };
        let name: Arc<str> = name.into();
        n.named.insert(Arc::clone(&name), id);
        Ok(Network {
            id,
            name: Some(name),
        })
    }

    /// The network called `name`, if this switch has one (nothing is
    /// made: a peer's names are looked up, never kept).
    pub(crate) fn find_network(&self, name: &str) -> Option<Network> {
        let n = lock(&self.inner.networks);
        n.named.get_key_value(name).map(|(k, id)| Network {
            id: *id,
            name: Some(Arc::clone(k)),
        })
    }

    /// A network no other port is on, nor any other daemon's device: a
    /// device alone on it reaches nothing through memory.
    pub fn private_network(&self) -> Network {
        let mut n = lock(&self.inner.networks);
        n.next += 1;
        Network {
            id: NetId(n.next),
            name: None,
        }
    }

    /// The [`DEFAULT_NETWORK`].
    pub fn default_network(&self) -> Network {
        let mut n = lock(&self.inner.networks);
        let name = n
            .named
            .get_key_value(DEFAULT_NETWORK)
            .map(|(k, _)| Arc::clone(k))
            .unwrap_or_else(|| DEFAULT_NETWORK.into());
        n.named.insert(Arc::clone(&name), NetId(0));
        Network {
            id: NetId(0),
            name: Some(name),
        }
    }

    /// A new port on the [`DEFAULT_NETWORK`], which may hold any address:
    /// a device of the process's own ([`Switch::attach_to`] for a guest's).
    pub fn attach(&self) -> io::Result<Port> {
        self.attach_to(&self.default_network(), Owned::Any)
    }

    /// A new port on `net`, which may hold the addresses `owned` allows,
    /// holding none yet ([`Port::set_local`]).
    pub fn attach_to(&self, net: &Network, owned: Owned) -> io::Result<Port> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let event = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        epoll.add(&event, EpollEvent::new(EpollFlags::EPOLLIN, 0))?;
        let shared = Arc::new(PortShared {
            id,
            net: net.clone(),
            alive: AtomicBool::new(true),
            epoll,
            gids: Mutex::new(Vec::new()),
            incoming: Mutex::new(Vec::new()),
            incoming_gen: AtomicU64::new(0),
        });
        lock(&self.inner.ports).push(Arc::downgrade(&shared));
        self.inner.changed();
        let mailbox = Arc::new(Mailbox {
            id,
            limit: self.inner.config.mailbox_bytes,
            pending: Pending(AtomicUsize::new(0)),
            armed: AtomicBool::new(true),
            queue: Mutex::new(Queue::default()),
            event,
        });
        Ok(Port {
            switch: self.clone(),
            net: net.id,
            owned,
            mailbox,
            shared,
            gids: Vec::new(),
            refused: Vec::new(),
            unowned: Vec::new(),
            cache: None,
            outbox: Vec::new(),
            touched: Vec::new(),
            pool: Vec::new(),
            inbox: Vec::with_capacity(BATCH),
            delivered: Vec::with_capacity(BATCH),
            rings: Vec::new(),
            rings_gen: 0,
            ring_next: 0,
            ring_buf: vec![0; vrdma_wire::packet::MAX_LEN],
            peers_gen: None,
            armed: true,
            stats: Stats::default(),
        })
    }

    /// Whether some port on `net` holds `gid`.
    pub fn holds(&self, net: &Network, gid: &Gid) -> bool {
        read(&self.inner.owners).get(net.id, gid).is_some()
    }

    /// Who holds `gid` on `net`, and whether another network holds it.
    fn lookup(&self, net: NetId, gid: &Gid) -> (Option<Dest>, bool) {
        let o = read(&self.inner.owners);
        (o.get(net, gid).cloned(), o.elsewhere(net, gid))
    }

    #[inline]
    fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::Acquire)
    }
}

/// A count a receiver polls, on a cache line of its own: a sender that
/// takes the queue's lock does not take the line the receiver spins on.
#[derive(Debug)]
#[repr(align(64))]
struct Pending(AtomicUsize);

/// A device's mailbox: the packets sent to it, in order.
#[derive(Debug)]
struct Mailbox {
    /// The port it belongs to.
    id: u64,
    /// Bytes it holds at most.
    limit: usize,
    /// Packets queued (read without the lock by a polling receiver).
    pending: Pending,
    /// Whether the receiver may be asleep on its descriptor, so that a
    /// sender must wake it (true until its first [`Port::receive`]).
    ///
    /// A receiver that polls spares its senders the wake-up (an eventfd
    /// write and read, two system calls per packet of a ping-pong): a
    /// receive clears the flag; before it sleeps the receiver sets it
    /// ([`Port::arm`]) and looks at the count once more, while a sender
    /// stores the count, then reads the flag. Both sequentially
    /// consistent, so at least one of them sees the other: no packet is
    /// left unannounced to a sleeper.
    armed: AtomicBool,
    queue: Mutex<Queue>,
    /// Readable while packets wait (once written per empty-to-not-empty
    /// change, read when the receiver finds the queue empty).
    event: EventFd,
}

#[derive(Debug, Default)]
struct Queue {
    packets: VecDeque<Parcel>,
    /// Bytes of the packets queued.
    bytes: usize,
    /// Whether the eventfd was written since the receiver last emptied
    /// the queue.
    signaled: bool,
    /// Buffers the receiver gave back, for the next packets.
    spare: Vec<Vec<u8>>,
    /// The port is gone: nothing more is queued.
    closed: bool,
}

/// A packet in a mailbox: its route (from which the receiver rebuilds the
/// IP header the engine checks) and its bytes, BTH through ICRC — or, for
/// a payload lent on ([`Port::send_loan`]), the bytes around the payload
/// and the loan.
#[derive(Debug)]
struct Parcel {
    route: Route,
    /// A buffer whose first `len` bytes are the packet (its length never
    /// shrinks, so that a reused buffer is not cleared again).
    bytes: Vec<u8>,
    len: usize,
    /// Boxed: a loan is rare (long payloads only), and the short packets'
    /// parcels stay small as they move through the queues.
    loan: Option<Box<Loan>>,
}

/// A payload a device lent on to its receiver instead of copying it: the
/// receiver copies it, once, from the sender's memory into its own MR
/// ([`Port::send_loan`]). What `token` holds — the sender's memory and the
/// fences its MRs and maps are revoked through — is the devices' business,
/// not the medium's: the medium carries it, the receiving device reads
/// it.
#[derive(Debug)]
pub struct Loan {
    /// Where the payload goes in the packet: the packet's bytes before it
    /// are those up to here, those after it follow.
    pub payload_at: usize,
    /// Its length.
    pub len: usize,
    pub token: Box<dyn std::any::Any + Send>,
}

/// Bytes a lent-on packet counts in its receiver's mailbox beside its
/// headers: what a copy of its payload would hold, up to a 4 KiB page (a
/// mailbox bounds a slow receiver's backlog, and a loan holds its
/// sender's MR against deregistration until it is read).
const LOAN_WEIGHT: usize = 4096;

impl Parcel {
    fn packet(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// What it counts against its mailbox's bound.
    fn weight(&self) -> usize {
        self.len + self.loan.as_ref().map_or(0, |l| l.len.min(LOAN_WEIGHT))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while a queue is locked leaves it consistent (every change
    // is a push or pop): go on with it.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

/// What a port did, for `vrdma stat` (`shm.*`).
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Stats {
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub rx_bytes: u64,
    /// Packets dropped because the receiver's mailbox was full.
    pub tx_dropped_full: u64,
    /// Packets dropped because their receiver left between the send and
    /// the flush.
    pub tx_dropped_gone: u64,
    /// Packets dropped because their lent payload was no longer in memory.
    pub tx_dropped_unlent: u64,
    /// Packets refused because their source GID is not one the port holds.
    pub tx_spoofed: u64,
    /// Addresses the port claimed that another port of its network
    /// already held.
    pub gid_conflicts: u64,
    /// Addresses the port claimed that its owner was not given
    /// ([`Owned`]): not taken.
    pub gid_refused: u64,
    /// Packets the port left to the uplink (no device of its network on
    /// the switch holds their destination).
    pub tx_uplink: u64,
    /// Of those, packets whose destination a device of another network
    /// holds here: kept apart, as the host's networks keep them.
    pub tx_other_network: u64,
    /// Packets from another daemon's ring refused: a source address that
    /// daemon does not hold, or a destination that is not this device's.
    pub rx_refused: u64,
    /// Rings another daemon broke (indices or records out of range): each
    /// is read no more.
    pub rx_broken: u64,
    /// Packets received whose payload their sender lent on (copied by the
    /// receiving device from the sender's memory: [`Port::send_loan`]).
    pub rx_lent: u64,
}

impl Stats {
    pub fn fields(&self) -> [(&'static str, u64); 15] {
        [
            ("tx_packets", self.tx_packets),
            ("tx_bytes", self.tx_bytes),
            ("rx_packets", self.rx_packets),
            ("rx_bytes", self.rx_bytes),
            ("tx_dropped_full", self.tx_dropped_full),
            ("tx_dropped_gone", self.tx_dropped_gone),
            ("tx_dropped_unlent", self.tx_dropped_unlent),
            ("tx_spoofed", self.tx_spoofed),
            ("gid_conflicts", self.gid_conflicts),
            ("gid_refused", self.gid_refused),
            ("tx_uplink", self.tx_uplink),
            ("tx_other_network", self.tx_other_network),
            ("rx_refused", self.rx_refused),
            ("rx_broken", self.rx_broken),
            ("rx_lent", self.rx_lent),
        ]
    }
}

/// Why a packet was not put in a mailbox (each is counted in [`Stats`]).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Dropped {
    /// No port on the switch holds the destination (send it elsewhere).
    NotHere,
    Full,
    Gone,
    Unlent,
    Spoofed,
}

/// A device's port on a [`Switch`].
#[derive(Debug)]
pub struct Port {
    switch: Switch,
    /// Its network.
    net: NetId,
    /// What it may hold.
    owned: Owned,
    mailbox: Arc<Mailbox>,
    /// Its identity, addresses and descriptor as the rendezvous sees them
    /// (the epoll instance: the mailbox's eventfd, the rings', and
    /// whatever else the device waits on, [`Port::watch`]).
    shared: Arc<PortShared>,
    /// The addresses this port holds on the switch.
    gids: Vec<Gid>,
    /// Addresses it claimed that another port holds (each counted once).
    refused: Vec<Gid>,
    /// Addresses it claimed that it does not own (each counted once).
    unowned: Vec<Gid>,
    /// The last destination looked up, the switch generation it is good
    /// for, and whether another network holds it.
    cache: Option<(u64, Gid, Option<Dest>, bool)>,
    /// Packets queued by [`Port::send`] for [`Port::flush`], by mailbox.
    outbox: Vec<(Arc<Mailbox>, Vec<Parcel>)>,
    /// Rings into other daemons' devices written since the last flush.
    touched: Vec<Arc<peer::Outbound>>,
    /// Packet buffers for the next sends (from the receivers' spares).
    pool: Vec<Vec<u8>>,
    /// Packets taken from the mailbox, being delivered.
    inbox: Vec<Parcel>,
    /// Buffers of the packets delivered, given back at the next receive.
    delivered: Vec<Vec<u8>>,
    /// Rings other daemons write for this device, and the generation of
    /// the shared list last taken.
    rings: Vec<peer::InRing>,
    rings_gen: u64,
    /// The ring the next receive starts at.
    ring_next: usize,
    /// A packet copied out of a ring.
    ring_buf: Vec<u8>,
    /// The switch generation [`Port::local_peers`] last answered for.
    peers_gen: Option<u64>,
    /// Whether senders were asked to wake the device ([`Port::arm`]).
    armed: bool,
    stats: Stats,
}

impl Port {
    /// The descriptor that becomes readable when a packet arrives (or when
    /// a descriptor added with [`Port::watch`] does).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.shared.epoll.0.as_fd()
    }

    /// Adds `fd` to what [`Port::fd`] stands for (a device's other
    /// transport): `fd` must outlive the port.
    pub fn watch(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.shared
            .epoll
            .add(fd, EpollEvent::new(EpollFlags::EPOLLIN, 1))
            .map_err(io::Error::from)
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The addresses the port holds on the switch.
    pub fn gids(&self) -> &[Gid] {
        &self.gids
    }

    /// Its network.
    pub fn network(&self) -> &Network {
        &self.shared.net
    }

    /// The counters of the rendezvous the switch joined, if it did (the
    /// daemon's, not the port's).
    pub fn rendezvous(&self) -> Option<&RendezvousStats> {
        self.switch.inner.rendezvous.get().map(|a| &**a)
    }

    /// Whether the port may hold `gid` ([`Owned`]).
    pub fn owns(&self, gid: &Gid) -> bool {
        self.owned.allows(gid)
    }

    /// Makes `gids` the port's addresses on its network: the ones it held
    /// and no longer names are released; a new one it does not own is not
    /// taken (refused, counted, logged once), nor one another port of the
    /// network holds (a conflict, counted and logged once: packets to it
    /// go to that port).
    pub fn set_local(&mut self, gids: &[Gid]) {
        let dir = &self.switch.inner;
        let net = self.net;
        let mut owners = write(&dir.owners);
        for g in &self.gids {
            if !gids.contains(g)
                && owners
                    .get(net, g)
                    .is_some_and(|d| d.id() == self.mailbox.id)
            {
                owners.remove(net, g);
            }
        }
        let mut held = Vec::with_capacity(gids.len());
        for g in gids {
            if held.contains(g) {
                continue;
            }
            if !self.owned.allows(g) {
                if !self.unowned.contains(g) {
                    self.unowned.push(*g);
                    self.stats.gid_refused += 1;
                    tracing::warn!(
                        network = self.shared.net.label(),
                        gid = %g.ip(),
                        "same-host switch: an address the device was not given is not taken"
                    );
                }
                continue;
            }
            match owners.get(net, g) {
                Some(d) if d.id() != self.mailbox.id => {
                    if !self.refused.contains(g) {
                        self.refused.push(*g);
                        self.stats.gid_conflicts += 1;
                        tracing::warn!(
                            network = self.shared.net.label(),
                            gid = %g.ip(),
                            "same-host switch: an address another device of the network holds is not taken"
                        );
                    }
                }
                Some(_) => held.push(*g),
                None => {
                    owners.insert(net, *g, Dest::Local(Arc::clone(&self.mailbox)));
                    held.push(*g);
                }
            }
        }
        self.refused
            .retain(|g| gids.contains(g) && !held.contains(g));
        self.unowned.retain(|g| gids.contains(g));
        self.gids = held;
        dir.generation.fetch_add(1, Ordering::AcqRel);
        drop(owners);
        self.cache = None;
        let mut shared = lock(&self.shared.gids);
        if *shared != self.gids {
            shared.clone_from(&self.gids);
            drop(shared);
            dir.changed();
        }
    }

    /// Where `dgid` leads, if another port on the switch (or another
    /// daemon's device) holds it — cached while the switch's directory
    /// does not change, and no reference count touched on the way (an
    /// atomic per packet that the profile showed). The port's own
    /// addresses lead nowhere here: a device's packets to itself take its
    /// uplink's loopback, which paces them (the Ethernet port's bounded
    /// queue) rather than dropping what a full mailbox cannot hold.
    fn dest_of(&mut self, dgid: &Gid) -> Option<&Dest> {
        let generation = self.switch.generation();
        let fresh = matches!(&self.cache, Some((g, gid, _, _)) if *g == generation && gid == dgid);
        if !fresh {
            let (d, elsewhere) = self.switch.lookup(self.net, dgid);
            self.cache = Some((generation, *dgid, d, elsewhere));
        }
        let own = self.mailbox.id;
        self.cache
            .as_ref()
            .and_then(|(_, _, d, _)| d.as_ref())
            .filter(|d| d.id() != own)
    }

    /// Whether another port of the port's network holds `dgid` (the packet
    /// then goes through [`Port::send`]); when none does, the packet is
    /// the uplink's (counted: `tx_uplink`, and `tx_other_network` when a
    /// device of another network holds the address).
    pub fn reaches(&mut self, dgid: &Gid) -> bool {
        if self.dest_of(dgid).is_some() {
            return true;
        }
        self.stats.tx_uplink += 1;
        if matches!(&self.cache, Some((_, _, _, true))) {
            self.stats.tx_other_network += 1;
        }
        false
    }

    /// Queues a packet for the mailbox of the port holding `route.dst`;
    /// [`Port::flush`] delivers what is queued, a mailbox's share under one
    /// lock. `head` holds the packet's bytes (BTH through the ICRC field);
    /// when `lent` is not empty, `head` holds the bytes before the payload
    /// up to `payload_at` and those after it from there, and the payload is
    /// read from `mem` at the pieces' addresses — the one copy of its bytes
    /// on the way, from the sender's memory through its volatile view into
    /// a buffer of the daemon's own.
    pub fn send(
        &mut self,
        route: &Route,
        head: &[u8],
        payload_at: usize,
        lent: &[Piece],
        mem: &impl Lender,
    ) -> Result<(), Dropped> {
        if self.dest_of(&route.dst).is_none() {
            return Err(Dropped::NotHere);
        }
        if !self.gids.contains(&route.src) {
            self.stats.tx_spoofed += 1;
            return Err(Dropped::Spoofed);
        }
        let dest = match &self.cache {
            Some((_, _, Some(d), _)) if d.id() != self.mailbox.id => d,
            _ => return Err(Dropped::NotHere),
        };
        let mailbox = match dest {
            Dest::Local(m) => m,
            Dest::Remote(o) => {
                // Straight into the other daemon's ring.
                return match o.push(route, head, payload_at, lent, mem) {
                    Ok(len) => {
                        self.stats.tx_packets += 1;
                        self.stats.tx_bytes += len as u64;
                        if !self.touched.iter().any(|t| t.id == o.id) {
                            self.touched.push(Arc::clone(o));
                        }
                        Ok(())
                    }
                    Err(e) => {
                        match e {
                            Dropped::Full => self.stats.tx_dropped_full += 1,
                            Dropped::Unlent => self.stats.tx_dropped_unlent += 1,
                            _ => self.stats.tx_dropped_gone += 1,
                        }
                        Err(e)
                    }
                };
            }
        };
        let mut bytes = self.pool.pop().unwrap_or_default();
        let len = head.len() + lent.iter().map(|p| p.len).sum::<usize>();
        if bytes.len() < len {
            bytes.resize(len, 0);
        }
        if !gather(&mut bytes[..len], head, payload_at, lent, mem) {
            self.pool.push(bytes);
            self.stats.tx_dropped_unlent += 1;
            return Err(Dropped::Unlent);
        }
        let parcel = Parcel {
            route: *route,
            bytes,
            len,
            loan: None,
        };
        match self.outbox.iter_mut().find(|(m, _)| m.id == mailbox.id) {
            Some((_, q)) => q.push(parcel),
            None => self.outbox.push((Arc::clone(mailbox), vec![parcel])),
        }
        Ok(())
    }

    /// Whether `dgid` is held by a device of this process (not another
    /// daemon's): one a payload can be lent on to ([`Port::send_loan`]).
    pub fn lends_to(&mut self, dgid: &Gid) -> bool {
        matches!(self.dest_of(dgid), Some(Dest::Local(_)))
    }

    /// Queues a packet whose payload is lent on, not copied: `head` holds
    /// its bytes around the payload (up to `loan.payload_at`, then those
    /// after it) and the receiver copies the payload from the sender's
    /// memory through the loan — one copy, by the receiver, into the MR
    /// its checks allow. Only to a device of this process
    /// ([`Port::lends_to`]); else `Err` with the loan back (the caller then
    /// copies, [`Port::send`]).
    pub fn send_loan(&mut self, route: &Route, head: &[u8], loan: Loan) -> Result<(), Loan> {
        let Some(Dest::Local(mailbox)) = self.dest_of(&route.dst) else {
            return Err(loan);
        };
        let mailbox = Arc::clone(mailbox);
        if !self.gids.contains(&route.src) {
            self.stats.tx_spoofed += 1;
            // Refused, and counted: the caller must not send it otherwise.
            drop(loan);
            return Ok(());
        }
        let mut bytes = self.pool.pop().unwrap_or_default();
        if bytes.len() < head.len() {
            bytes.resize(head.len(), 0);
        }
        bytes[..head.len()].copy_from_slice(head);
        let parcel = Parcel {
            route: *route,
            bytes,
            len: head.len(),
            loan: Some(Box::new(loan)),
        };
        match self.outbox.iter_mut().find(|(m, _)| m.id == mailbox.id) {
            Some((_, q)) => q.push(parcel),
            None => self.outbox.push((mailbox, vec![parcel])),
        }
        Ok(())
    }

    /// The addresses held by the other devices of this process on the
    /// port's network, when they changed since the last call (`None` if
    /// not): the peers a device's engine may send a run of segments to in
    /// one packet (a lent-on payload is not cut into MTUs).
    #[inline]
    pub fn local_peers(&mut self) -> Option<Vec<Gid>> {
        let generation = self.switch.generation();
        if self.peers_gen == Some(generation) {
            return None;
        }
        self.local_peers_at(generation)
    }

    #[cold]
    fn local_peers_at(&mut self, generation: u64) -> Option<Vec<Gid>> {
        self.peers_gen = Some(generation);
        let (own, net) = (self.mailbox.id, self.net);
        let owners = read(&self.switch.inner.owners);
        Some(
            owners
                .by_net
                .iter()
                .filter(|((n, _), d)| *n == net && matches!(d, Dest::Local(m) if m.id != own))
                .map(|((_, g), _)| *g)
                .collect(),
        )
    }

    /// Delivers what [`Port::send`] queued: each mailbox's packets under
    /// one lock, one wake-up if its receiver was not already woken.
    /// Packets a full mailbox has no room for, or a closed one, are dropped
    /// and counted. Returns the packets delivered.
    pub fn flush(&mut self) -> usize {
        let mut delivered = 0;
        let (stats, pool) = (&mut self.stats, &mut self.pool);
        // A destination unused since the last flush is let go (a gone
        // port's mailbox is freed with it); one in use keeps its entry.
        self.outbox.retain_mut(|(mailbox, parcels)| {
            if parcels.is_empty() {
                return false;
            }
            let mut q = lock(&mailbox.queue);
            if q.closed {
                stats.tx_dropped_gone += parcels.len() as u64;
                pool.extend(parcels.drain(..).map(|p| p.bytes));
                return false;
            }
            let before = q.packets.len();
            for p in parcels.drain(..) {
                let weight = p.weight();
                if q.bytes + weight > mailbox.limit {
                    stats.tx_dropped_full += 1;
                    pool.push(p.bytes);
                    continue;
                }
                q.bytes += weight;
                stats.tx_packets += 1;
                stats.tx_bytes += (p.len + p.loan.as_ref().map_or(0, |l| l.len)) as u64;
                q.packets.push_back(p);
            }
            let added = q.packets.len() - before;
            delivered += added;
            // Buffers the receiver gave back, for the next packets.
            let take = q.spare.len().min(added.max(1));
            let at = q.spare.len() - take;
            pool.extend(q.spare.drain(at..));
            mailbox.pending.0.store(q.packets.len(), Ordering::SeqCst);
            if added > 0 && !q.signaled && mailbox.armed.load(Ordering::SeqCst) {
                q.signaled = true;
                // One write per wake-up cannot overflow the counter; a
                // failed write leaves a polling receiver to find them.
                let _ = mailbox.event.write(1);
            }
            true
        });
        self.pool.truncate(SPARES);
        for o in self.touched.drain(..) {
            o.publish();
        }
        delivered
    }

    /// Takes up to [`BATCH`] packets from the mailbox and hands each, with
    /// its route, to `deliver` — with its loan, if its sender lent its
    /// payload on ([`Port::send_loan`]; the bytes are then those around the
    /// payload). Returns the packets taken.
    pub fn receive(&mut self, mut deliver: impl FnMut(&Route, &[u8], Option<&Loan>)) -> usize {
        if self.armed {
            // Awake: the senders may spare the wake-ups until it arms
            // again.
            self.armed = false;
            self.mailbox.armed.store(false, Ordering::Relaxed);
            for r in &self.rings {
                r.disarm();
            }
        }
        let mut n = self.receive_rings(&mut deliver);
        if self.mailbox.pending.0.load(Ordering::Acquire) == 0 {
            return n;
        }
        {
            let mut q = lock(&self.mailbox.queue);
            let room = SPARES.saturating_sub(q.spare.len());
            let keep = self.delivered.len().min(room);
            q.spare.extend(self.delivered.drain(..keep));
            self.delivered.clear();
            while self.inbox.len() < BATCH {
                let Some(p) = q.packets.pop_front() else {
                    break;
                };
                q.bytes -= p.weight();
                self.inbox.push(p);
            }
            self.mailbox
                .pending
                .0
                .store(q.packets.len(), Ordering::Release);
            if q.packets.is_empty() && q.signaled {
                q.signaled = false;
                // Drains the counter: the descriptor is readable again
                // only when the next packet arrives.
                let _ = self.mailbox.event.read();
            }
        }
        n += self.inbox.len();
        for p in self.inbox.drain(..) {
            self.stats.rx_packets += 1;
            self.stats.rx_bytes += (p.len + p.loan.as_ref().map_or(0, |l| l.len)) as u64;
            self.stats.rx_lent += u64::from(p.loan.is_some());
            deliver(&p.route, p.packet(), p.loan.as_deref());
            self.delivered.push(p.bytes);
        }
        n
    }

    /// Takes what other daemons' rings hold for this device ([`BATCH`]
    /// packets at most), and lets go of the rings that are done with.
    fn receive_rings(&mut self, deliver: &mut impl FnMut(&Route, &[u8], Option<&Loan>)) -> usize {
        let g = self.shared.incoming_gen.load(Ordering::Acquire);
        let mut done = false;
        if g != self.rings_gen {
            self.rings_gen = g;
            self.rings.append(&mut lock(&self.shared.incoming));
            done = true;
        }
        let mut n = 0;
        // Round-robin: each call starts one ring further on, so that a ring
        // that fills the batch every time does not keep the later ones
        // unread.
        let count = self.rings.len();
        let first = if count == 0 {
            0
        } else {
            self.ring_next % count
        };
        self.ring_next = first.wrapping_add(1);
        for k in 0..count {
            let r = &mut self.rings[(first + k) % count];
            n += r.receive(
                &mut self.ring_buf,
                &self.gids,
                &mut self.stats,
                BATCH - n,
                &mut |route: &Route, p: &[u8]| deliver(route, p, None),
            );
            // A ring that broke, or whose daemon left and which is read
            // to its end, goes now (its eventfd out of the device's epoll,
            // its mapping unmapped), not when the next ring comes.
            done |= r.finished();
            if n >= BATCH {
                break;
            }
        }
        if done {
            let epoll = &self.shared.epoll;
            self.rings.retain(|r| {
                if r.finished() {
                    let _ = epoll.delete(r.event());
                    return false;
                }
                true
            });
        }
        n
    }

    /// Bytes received since the port was made.
    pub fn rx_bytes(&self) -> u64 {
        self.stats.rx_bytes
    }

    /// Says the port's user is about to sleep on [`Port::fd`]: senders
    /// must wake it again, and a packet that came while they need not is
    /// announced now (the descriptor is then readable at once). A
    /// [`Port::receive`] spares senders the wake-ups until the next arm, so
    /// a user must arm before every sleep — a busy-polling user never
    /// does, and costs its senders no system call.
    pub fn arm(&mut self) {
        self.armed = true;
        for r in &self.rings {
            r.arm();
        }
        self.mailbox.armed.store(true, Ordering::SeqCst);
        if self.mailbox.pending.0.load(Ordering::SeqCst) > 0 {
            let mut q = lock(&self.mailbox.queue);
            if !q.signaled && !q.packets.is_empty() {
                q.signaled = true;
                let _ = self.mailbox.event.write(1);
            }
        }
    }
}

/// Writes a packet into `out` (exactly its length): the head's bytes
/// before `payload_at`, the lent pieces read from `mem`, the head's rest.
/// False when `mem` no longer holds a piece (or the head is shorter than
/// `payload_at`).
fn gather(
    out: &mut [u8],
    head: &[u8],
    payload_at: usize,
    lent: &[Piece],
    mem: &impl Lender,
) -> bool {
    if lent.is_empty() {
        out.copy_from_slice(head);
        return true;
    }
    let (Some(before), Some(after)) = (head.get(..payload_at), head.get(payload_at..)) else {
        return false;
    };
    let (first, mut rest) = out.split_at_mut(payload_at);
    first.copy_from_slice(before);
    for p in lent {
        let (piece, tail) = rest.split_at_mut(p.len);
        if mem.lend(p.addr, p.len).map(|s| s.copy_to(piece)) != Some(p.len) {
            return false;
        }
        rest = tail;
    }
    rest.copy_from_slice(after);
    true
}

impl Drop for Port {
    /// Releases the port's addresses and closes its mailbox: packets sent
    /// to it from now on are dropped as gone.
    fn drop(&mut self) {
        self.flush();
        self.set_local(&[]);
        // The rendezvous tells the other daemons it is gone.
        self.shared.alive.store(false, Ordering::Release);
        self.switch.inner.changed();
        let mut q = lock(&self.mailbox.queue);
        q.closed = true;
        q.packets.clear();
        q.spare.clear();
        q.bytes = 0;
        self.mailbox.pending.0.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NoLender;
    use std::net::Ipv4Addr;

    fn gid(last: u8) -> Gid {
        Ipv4Addr::new(127, 0, 0, last).into()
    }

    fn route(src: u8, dst: u8) -> Route {
        Route {
            src: gid(src),
            dst: gid(dst),
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
        }
    }

    fn readable(fd: BorrowedFd<'_>) -> bool {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).unwrap() > 0
    }

    fn pair(sw: &Switch) -> (Port, Port) {
        let mut a = sw.attach().unwrap();
        let mut b = sw.attach().unwrap();
        a.set_local(&[gid(1)]);
        b.set_local(&[gid(2)]);
        (a, b)
    }

    /// Issue 37: one switch, two networks, one address on each: a packet
    /// reaches the holder of its destination on its sender's network only;
    /// one held only on another network goes to the uplink, counted.
    #[test]
    fn networks_keep_their_devices_apart_and_their_addresses_may_repeat() {
        let sw = Switch::new();
        let (ta, tb) = (
            sw.network("tenant-a").unwrap(),
            sw.network("tenant-b").unwrap(),
        );
        assert_eq!(sw.network("tenant-a").unwrap(), ta, "one network per name");
        let on = |net: &Network, g: u8| {
            let mut p = sw.attach_to(net, Owned::Only(vec![gid(g)])).unwrap();
            p.set_local(&[gid(g)]);
            p
        };
        let (mut a1, mut a2) = (on(&ta, 1), on(&ta, 2));
        let (mut b1, mut b2) = (on(&tb, 1), on(&tb, 2));
        let mut c3 = on(&tb, 3);
        assert_eq!(
            (a1.stats().gid_conflicts, b1.stats().gid_conflicts),
            (0, 0),
            "the same address on two networks is no conflict"
        );
        a1.send(&route(1, 2), b"to A's 2", 8, &[], &NoLender)
            .unwrap();
        a1.flush();
        b1.send(&route(1, 2), b"to B's 2", 8, &[], &NoLender)
            .unwrap();
        b1.flush();
        let got = |p: &mut Port| {
            let mut v = Vec::new();
            p.receive(|_, b, _| v.push(b.to_vec()));
            v
        };
        assert_eq!(got(&mut a2), vec![b"to A's 2".to_vec()]);
        assert_eq!(got(&mut b2), vec![b"to B's 2".to_vec()]);
        // tenant-a has no address 3: a1's packet for it is the uplink's,
        // though tenant-b holds one.
        assert!(!a1.reaches(&gid(3)));
        assert_eq!(
            a1.send(&route(1, 3), &[0; 8], 8, &[], &NoLender),
            Err(Dropped::NotHere)
        );
        assert_eq!((a1.stats().tx_uplink, a1.stats().tx_other_network), (1, 1));
        assert!(!a1.reaches(&gid(4)));
        assert_eq!((a1.stats().tx_uplink, a1.stats().tx_other_network), (2, 1));
        assert!(got(&mut c3).is_empty());
        // Runs of segments: only to a network's own devices.
        assert_eq!(a1.local_peers(), Some(vec![gid(2)]));
    }

    /// A device on a private network reaches nothing through memory, and
    /// nothing reaches it.
    #[test]
    fn a_private_network_holds_one_device() {
        let sw = Switch::new();
        let mut a = sw.attach_to(&sw.private_network(), Owned::Any).unwrap();
        a.set_local(&[gid(1)]);
        let mut b = sw.attach_to(&sw.private_network(), Owned::Any).unwrap();
        b.set_local(&[gid(2)]);
        let mut c = sw.attach().unwrap();
        c.set_local(&[gid(3)]);
        assert!(!a.reaches(&gid(2)) && !a.reaches(&gid(3)));
        assert!(!c.reaches(&gid(1)) && !c.reaches(&gid(2)));
        assert_eq!(a.network().name(), None);
        assert_eq!(a.network().label(), "private");
    }

    /// Issue 31: a port holds only what its owner was given; a claim of
    /// anything else (a guest kernel's SET_GID of a foreign address) is
    /// refused, counted once, and the address stays with its owner.
    #[test]
    fn a_port_holds_only_the_addresses_it_owns() {
        let sw = Switch::new();
        let net = sw.network("n").unwrap();
        let mut victim = sw.attach_to(&net, Owned::Only(vec![gid(1)])).unwrap();
        let mut squatter = sw.attach_to(&net, Owned::Only(vec![gid(2)])).unwrap();
        // The squatter claims the victim's address before the victim does.
        squatter.set_local(&[gid(2), gid(1)]);
        squatter.set_local(&[gid(2), gid(1)]);
        assert_eq!(squatter.gids(), &[gid(2)]);
        assert_eq!(squatter.stats().gid_refused, 1, "counted once");
        victim.set_local(&[gid(1)]);
        assert_eq!(victim.gids(), &[gid(1)]);
        assert!(squatter.reaches(&gid(1)));
        squatter
            .send(&route(2, 1), &[1; 8], 8, &[], &NoLender)
            .unwrap();
        squatter.flush();
        let mut n = 0;
        victim.receive(|_, _, _| n += 1);
        assert_eq!(n, 1, "the victim gets its own traffic");
        // Nor may it send as the victim.
        let mut third = sw.attach_to(&net, Owned::Any).unwrap();
        third.set_local(&[gid(3)]);
        assert_eq!(
            squatter.send(&route(1, 3), &[1; 8], 8, &[], &NoLender),
            Err(Dropped::Spoofed)
        );
        assert!(squatter.owns(&gid(2)) && !squatter.owns(&gid(1)));
    }

    #[test]
    fn a_packet_reaches_the_holder_of_its_destination_in_order() {
        let sw = Switch::new();
        let (mut a, mut b) = pair(&sw);
        assert!(a.reaches(&gid(2)));
        assert!(!a.reaches(&gid(3)));
        assert!(!readable(b.fd()));
        for i in 0..3u8 {
            a.send(&route(1, 2), &[i; 40], 40, &[], &NoLender).unwrap();
        }
        assert!(!readable(b.fd()), "nothing delivered before the flush");
        assert_eq!(a.flush(), 3);
        assert!(readable(b.fd()));
        let mut got = Vec::new();
        assert_eq!(
            b.receive(|r, p, _| got.push((r.src, p.to_vec()))),
            3,
            "every packet taken"
        );
        assert_eq!(
            got,
            (0..3u8).map(|i| (gid(1), vec![i; 40])).collect::<Vec<_>>()
        );
        assert!(!readable(b.fd()), "the wake-up is consumed with the queue");
        assert_eq!(
            a.send(&route(1, 3), &[0; 40], 40, &[], &NoLender),
            Err(Dropped::NotHere)
        );
        assert_eq!(b.stats().rx_packets, 3);
        assert_eq!(a.stats().tx_bytes, 120);
    }

    #[test]
    fn a_ports_own_addresses_are_not_reached_through_the_switch() {
        let sw = Switch::new();
        let (mut a, _b) = pair(&sw);
        assert!(sw.holds(&sw.default_network(), &gid(1)));
        assert!(!a.reaches(&gid(1)));
        assert_eq!(
            a.send(&route(1, 1), &[0; 40], 40, &[], &NoLender),
            Err(Dropped::NotHere)
        );
    }

    #[test]
    fn a_port_cannot_speak_as_another() {
        let sw = Switch::new();
        let (mut a, mut b) = pair(&sw);
        assert_eq!(
            a.send(&route(2, 2), &[0; 40], 40, &[], &NoLender),
            Err(Dropped::Spoofed)
        );
        assert_eq!(a.stats().tx_spoofed, 1);
        assert_eq!(b.receive(|_, _, _| panic!("nothing was sent")), 0);
    }

    #[test]
    fn an_address_belongs_to_its_first_claimant() {
        let sw = Switch::new();
        let (mut a, mut b) = pair(&sw);
        let mut c = sw.attach().unwrap();
        c.set_local(&[gid(2), gid(3)]);
        assert_eq!(c.gids(), &[gid(3)]);
        assert_eq!(c.stats().gid_conflicts, 1);
        c.set_local(&[gid(2), gid(3)]);
        assert_eq!(c.stats().gid_conflicts, 1, "counted once");
        a.send(&route(1, 2), &[7; 40], 40, &[], &NoLender).unwrap();
        a.flush();
        assert_eq!(c.receive(|_, _, _| panic!("not c's")), 0);
        assert_eq!(b.receive(|_, _, _| {}), 1);
        // Released when b lets go of it; then c may take it.
        b.set_local(&[]);
        assert!(!a.reaches(&gid(2)));
        c.set_local(&[gid(2), gid(3)]);
        assert!(a.reaches(&gid(2)));
        a.send(&route(1, 2), &[7; 40], 40, &[], &NoLender).unwrap();
        a.flush();
        assert_eq!(c.receive(|_, _, _| {}), 1);
    }

    #[test]
    fn a_full_mailbox_drops_and_counts() {
        let sw = Switch::with_config(Config { mailbox_bytes: 100 });
        let (mut a, mut b) = pair(&sw);
        for _ in 0..2 {
            a.send(&route(1, 2), &[0; 60], 60, &[], &NoLender).unwrap();
        }
        assert_eq!(a.flush(), 1, "room for one");
        assert_eq!(a.stats().tx_dropped_full, 1);
        assert_eq!(a.stats().tx_packets, 1);
        assert_eq!(b.receive(|_, _, _| {}), 1);
        a.send(&route(1, 2), &[0; 60], 60, &[], &NoLender).unwrap();
        assert_eq!(a.flush(), 1);
    }

    #[test]
    fn a_gone_port_takes_nothing_and_releases_its_addresses() {
        let sw = Switch::new();
        let (mut a, b) = pair(&sw);
        assert!(a.reaches(&gid(2)));
        // Queued before the receiver went, flushed after: dropped as gone.
        a.send(&route(1, 2), &[0; 40], 40, &[], &NoLender).unwrap();
        drop(b);
        assert_eq!(a.flush(), 0);
        assert_eq!(a.stats().tx_dropped_gone, 1);
        assert!(!sw.holds(&sw.default_network(), &gid(2)));
        assert_eq!(
            a.send(&route(1, 2), &[0; 40], 40, &[], &NoLender),
            Err(Dropped::NotHere)
        );
    }

    #[test]
    fn a_batch_at_a_time_and_the_descriptor_stays_readable_until_drained() {
        let sw = Switch::new();
        let (mut a, mut b) = pair(&sw);
        for _ in 0..BATCH + 5 {
            a.send(&route(1, 2), &[0; 40], 40, &[], &NoLender).unwrap();
        }
        a.flush();
        assert_eq!(b.receive(|_, _, _| {}), BATCH);
        assert!(readable(b.fd()));
        assert_eq!(b.receive(|_, _, _| {}), 5);
        assert!(!readable(b.fd()));
        assert_eq!(b.receive(|_, _, _| {}), 0);
    }

    #[test]
    fn a_lent_payload_is_copied_from_the_senders_memory() {
        use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x1000), 0x2000)]).unwrap();
        mem.write_slice(&[0xab; 100], GuestAddress(0x1800)).unwrap();
        let sw = Switch::new();
        let (mut a, mut b) = pair(&sw);
        // 12 header bytes, the payload lent, 4 bytes after it.
        let mut head = vec![1u8; 12];
        head.extend_from_slice(&[2; 4]);
        let lent = [
            Piece {
                addr: 0x1800,
                len: 60,
            },
            Piece {
                addr: 0x1800 + 60,
                len: 40,
            },
        ];
        a.send(&route(1, 2), &head, 12, &lent, &mem).unwrap();
        a.flush();
        let mut got = Vec::new();
        b.receive(|_, p, _| got = p.to_vec());
        let mut want = vec![1u8; 12];
        want.extend_from_slice(&[0xab; 100]);
        want.extend_from_slice(&[2; 4]);
        assert_eq!(got, want);
        // A piece the memory does not hold drops the packet.
        let far = [Piece {
            addr: 0x2f80,
            len: 0x100,
        }];
        assert_eq!(
            a.send(&route(1, 2), &head, 12, &far, &mem),
            Err(Dropped::Unlent)
        );
        assert_eq!(a.stats().tx_dropped_unlent, 1);
    }

    #[test]
    fn a_polling_receiver_is_not_woken_and_an_armed_one_is() {
        let sw = Switch::new();
        let (mut a, mut b) = pair(&sw);
        let send = |a: &mut Port| {
            a.send(&route(1, 2), &[0; 40], 40, &[], &NoLender).unwrap();
            a.flush();
        };
        // A new port may sleep before it ever receives: woken.
        send(&mut a);
        assert!(readable(b.fd()));
        assert_eq!(b.receive(|_, _, _| {}), 1);
        // Awake (it received): no wake-up, the packet polled.
        send(&mut a);
        assert!(!readable(b.fd()), "a polling receiver is not woken");
        assert_eq!(b.receive(|_, _, _| {}), 1);
        // Armed before sleeping: woken.
        b.arm();
        send(&mut a);
        assert!(readable(b.fd()));
        assert_eq!(b.receive(|_, _, _| {}), 1);
        assert!(!readable(b.fd()));
        // A packet that came while it polled is announced when it arms.
        send(&mut a);
        assert!(!readable(b.fd()));
        b.arm();
        assert!(readable(b.fd()), "arming announces what waits");
        assert_eq!(b.receive(|_, _, _| {}), 1);
        assert!(!readable(b.fd()));
    }

    #[test]
    fn ports_on_two_threads() {
        let sw = Switch::new();
        let (mut a, mut b) = pair(&sw);
        const N: usize = 10_000;
        let t = std::thread::spawn(move || {
            for i in 0..N {
                let mut head = [0u8; 40];
                head[..4].copy_from_slice(&(i as u32).to_le_bytes());
                a.send(&route(1, 2), &head, 40, &[], &NoLender).unwrap();
                if i % 7 == 0 {
                    a.flush();
                }
            }
            a.flush();
            a
        });
        let mut next = 0u32;
        while (next as usize) < N {
            b.receive(|_, p, _| {
                assert_eq!(u32::from_le_bytes(p[..4].try_into().unwrap()), next);
                next += 1;
            });
        }
        let a = t.join().unwrap();
        assert_eq!(a.stats().tx_packets, N as u64, "16 MiB is room enough");
    }
}
