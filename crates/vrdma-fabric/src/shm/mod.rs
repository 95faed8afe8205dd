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
//! A packet's payload lent by the engine (a gather send) is copied once, from
//! the sender's memory (through its volatile view, [`Lender`](crate::Lender))
//! into the mailbox; the receiving engine then moves it into the MR its checks
//! allow. A mailbox is bounded in bytes: a packet for a full one is dropped and
//! counted, as a network drops it, and RC's recovery resends it.
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
//!
//! | module | what |
//! |---|---|
//! | `mod.rs` | the switch: its networks, the directory of who holds each address, the ports attached, the counters |
//! | `mailbox` | a device's mailbox: the packets sent to it, bounded in bytes, and a payload lent on ([`Loan`]) |
//! | `port` | a device's port ([`Port`]): its addresses, sends, receives and wake-ups |
//! | [`peer`] | devices of other daemons: the rendezvous directory, its protocol and grants |
//! | [`ring`] | a packet ring between two processes |

use std::{
    collections::HashMap,
    io,
    sync::{
        Arc, Mutex, MutexGuard, OnceLock, PoisonError, RwLock, Weak,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use nix::sys::{
    epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags},
    eventfd::{EfdFlags, EventFd},
};
use vrdma_wire::Gid;

mod mailbox;
pub mod peer;
mod port;
pub mod ring;
mod sys;

pub use mailbox::Loan;
use mailbox::Mailbox;
pub use peer::{Admit, Grant, JoinConfig, Rendezvous, RendezvousStats, Trust, write_grant};
pub use port::Port;

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
        let mailbox = Arc::new(Mailbox::new(id, self.inner.config.mailbox_bytes, event));
        Ok(Port::attached(self.clone(), net.id, owned, mailbox, shared))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{NoLender, Piece};
    use std::{net::Ipv4Addr, os::fd::BorrowedFd};
    use vrdma_wire::frame::Route;

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
