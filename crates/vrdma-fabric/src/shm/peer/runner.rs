//! The rendezvous thread ([`Runner`]): the daemons connected (admitted,
//! known by the kernel's pid and their HELLO), the messages each sends
//! (rings and addresses taken as far as its user was granted them), and
//! what this daemon tells each of its own devices' networks, rings and
//! addresses.

use std::{
    collections::{HashMap, HashSet},
    ffi::OsStr,
    fs,
    io::{self, IoSlice},
    os::{
        fd::{AsFd, AsRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    sync::{Arc, Mutex, Weak, atomic::Ordering},
    time::{Duration, Instant},
};

use nix::{
    fcntl::{FcntlArg, OFlag, fcntl},
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::{
        epoll::{EpollEvent, EpollFlags},
        eventfd::{EfdFlags, EventFd},
        socket::{
            AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, connect,
            getsockopt, sendmsg, socket, sockopt::PeerCredentials,
        },
    },
};
use vrdma_sys::sock::{Accepted, Acceptor};
use vrdma_wire::Gid;

use super::{
    JoinConfig, MAX_PEER_SLOTS, RendezvousStats,
    grant::{Grant, read_grant},
    link::{InRing, Link, Outbound},
    message::{MAX_GIDS, MAX_MESSAGE, MAX_NETS, Message},
    rand_u64,
};
use crate::shm::{Dest, Directory, NetId, PortShared, Switch, lock, ring, sys, write};

/// Peers a daemon keeps at most, of them from one user (root too), and
/// devices of one peer.
const MAX_PEERS: usize = 64;
const MAX_PEERS_PER_USER: usize = 16;
const MAX_PEER_PORTS: usize = 64;
/// How long a connection may go without its HELLO (a peer slot held by
/// one that never speaks is given back).
const HELLO_WITHIN: Duration = Duration::from_secs(5);
/// GIDS a peer may send in a burst, and then per second: each one changes
/// the switch's directory, which every device's cached routes follow. One
/// beyond them waits (the latest for each device) until the peer's
/// allowance comes back; none is lost.
const GIDS_BURST: f64 = 64.0;
const GIDS_PER_SECOND: f64 = 16.0;

/// What a peer may announce.
#[derive(Clone, Debug)]
enum Granted {
    /// Any address on a network both have (root, or this daemon's user).
    All,
    /// What its user's grant file says (nothing if there is none).
    Only(Grant),
}

impl Granted {
    fn network(&self, net: &str) -> bool {
        match self {
            Granted::All => true,
            Granted::Only(g) => g.0.contains_key(net),
        }
    }

    fn address(&self, net: &str, gid: &Gid) -> bool {
        match self {
            Granted::All => true,
            Granted::Only(g) => g.allows(net, gid),
        }
    }
}

/// A device of a peer: the ring into it, its network, and the addresses
/// of it this switch took.
#[derive(Clone, Debug)]
struct Remote {
    out: Arc<Outbound>,
    net: NetId,
    net_name: String,
    held: Vec<Gid>,
}

/// One connected daemon.
struct Peer {
    sock: OwnedFd,
    /// Whether this daemon connected (else it accepted).
    initiated: bool,
    /// Its process and user, from the kernel.
    pid: u32,
    uid: u32,
    /// Its switch's instance, once its HELLO came.
    id: Option<u64>,
    /// When it connected (its HELLO is due within [`HELLO_WITHIN`]).
    since: Instant,
    /// To be dropped at the end of the round.
    doomed: bool,
    link: Arc<Link>,
    /// The networks it said its devices are on.
    nets: Vec<String>,
    /// The networks this daemon last told it (NETS).
    told: Option<Vec<String>>,
    /// This daemon's devices it was given a ring for: port id → the
    /// addresses last announced for it.
    given: HashMap<u64, Vec<Gid>>,
    /// Its devices, by their port numbers.
    remote: HashMap<u32, Remote>,
    /// Its GIDS allowance, and when it was last topped up.
    allowance: f64,
    topped: Instant,
    /// GIDS held back by the allowance: the latest of each device.
    deferred: HashMap<u32, Vec<Gid>>,
}

impl Peer {
    fn identity(&self) -> Option<(u32, u64)> {
        self.id.map(|id| (self.pid, id))
    }

    /// Takes one GIDS from the allowance, if there is one left.
    fn spend(&mut self) -> bool {
        let now = Instant::now();
        let secs = now.duration_since(self.topped).as_secs_f64();
        self.topped = now;
        self.allowance = (self.allowance + secs * GIDS_PER_SECOND).min(GIDS_BURST);
        if self.allowance >= 1.0 {
            self.allowance -= 1.0;
            true
        } else {
            false
        }
    }
}

/// The rendezvous thread: the switch it speaks for, its socket in the
/// directory, and the daemons connected to it.
pub(super) struct Runner {
    switch: Switch,
    dir: Arc<Directory>,
    config: JoinConfig,
    /// The rendezvous directory, opened once.
    rdv: OwnedFd,
    /// This switch's identity: its process and instance.
    me: (u32, u64),
    listener: OwnedFd,
    /// The listener's accepts, shortages waited out.
    acceptor: Acceptor,
    notify: Arc<EventFd>,
    stop: Arc<EventFd>,
    peers: Vec<Peer>,
    stats: Arc<RendezvousStats>,
}

impl Runner {
    /// The thread's state for `switch` joining `config.dir` (opened as
    /// `rdv`), accepting on `listener`, woken by `notify` when a port
    /// changes and stopped by `stop`, counting in `stats`: no peer yet.
    pub(super) fn new(
        switch: &Switch,
        config: JoinConfig,
        rdv: OwnedFd,
        listener: OwnedFd,
        notify: Arc<EventFd>,
        stop: Arc<EventFd>,
        stats: Arc<RendezvousStats>,
    ) -> Self {
        Runner {
            switch: switch.clone(),
            dir: Arc::clone(&switch.inner),
            config,
            rdv,
            me: (std::process::id(), rand_u64()),
            listener,
            acceptor: Acceptor::new(),
            notify,
            stop,
            peers: Vec::new(),
            stats,
        }
    }

    /// Connects to every socket of the directory but `own`.
    pub(super) fn connect_existing(&mut self, own: &str) {
        let Ok(entries) = fs::read_dir(&self.config.dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let p = e.path();
            if name == OsStr::new(own) || p.extension().is_none_or(|x| x != "sock") {
                continue;
            }
            if name.as_bytes().starts_with(b".") || self.peers.len() >= MAX_PEERS {
                continue;
            }
            // Non-blocking: a listener whose backlog is full (a daemon
            // that does not accept) is passed over, not waited for.
            let Ok(s) = socket(
                AddressFamily::Unix,
                SockType::SeqPacket,
                SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
                None,
            ) else {
                continue;
            };
            let Ok(addr) = UnixAddr::new(&p) else {
                continue;
            };
            // A socket nobody listens on any more (a daemon that died) is
            // refused; it is not this daemon's to remove.
            if connect(s.as_raw_fd(), &addr).is_err() {
                continue;
            }
            self.add(s, true);
        }
    }

    /// Takes a connection that passes admission (its user, and room for
    /// it: [`MAX_PEERS`], [`MAX_PEERS_PER_USER`]): says HELLO.
    fn add(&mut self, sock: OwnedFd, initiated: bool) {
        let Ok(cred) = getsockopt(&sock, PeerCredentials) else {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let (uid, pid) = (cred.uid(), cred.pid());
        let of_user = self.peers.iter().filter(|p| p.uid == uid).count();
        let room = self.peers.len() < MAX_PEERS && of_user < MAX_PEERS_PER_USER;
        let Ok(pid) = u32::try_from(pid) else {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if !self.config.admit.allows(uid, cred.gid()) || !room {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if fcntl(&sock, FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).is_err() {
            return;
        }
        let hello = Message::Hello { id: self.me.1 }.emit();
        if send(&sock, &hello, &[]).is_err() {
            return;
        }
        let now = Instant::now();
        self.peers.push(Peer {
            sock,
            initiated,
            pid,
            uid,
            id: None,
            since: now,
            doomed: false,
            link: Link::new(),
            nets: Vec::new(),
            told: None,
            given: HashMap::new(),
            remote: HashMap::new(),
            allowance: GIDS_BURST,
            topped: now,
            deferred: HashMap::new(),
        });
        self.stats
            .peers
            .store(self.peers.len() as u64, Ordering::Relaxed);
    }

    pub(super) fn run(mut self) {
        let mut buf = vec![0u8; MAX_MESSAGE + 1];
        loop {
            // GIDS held back are applied as the allowance comes back.
            let deferred = self.peers.iter().any(|p| !p.deferred.is_empty());
            let mut wait = if deferred { 100u16 } else { 1000 };
            // A shortage of descriptors waited out: the listener is not
            // watched (it stays readable), the loop wakes to try again.
            let listen = if self.acceptor.watching(Instant::now()) {
                PollFlags::POLLIN
            } else {
                PollFlags::empty()
            };
            if let Some(t) = self.acceptor.retry_at() {
                let ms = t.saturating_duration_since(Instant::now()).as_millis() + 1;
                wait = wait.min(u16::try_from(ms).unwrap_or(u16::MAX));
            }
            let (stop, notify, listener, ready) = {
                let mut fds = vec![
                    PollFd::new(self.stop.as_fd(), PollFlags::POLLIN),
                    PollFd::new(self.notify.as_fd(), PollFlags::POLLIN),
                    PollFd::new(self.listener.as_fd(), listen),
                ];
                fds.extend(
                    self.peers
                        .iter()
                        .map(|p| PollFd::new(p.sock.as_fd(), PollFlags::POLLIN)),
                );
                match poll(&mut fds, PollTimeout::from(wait)) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "shm rendezvous: poll failed");
                        break;
                    }
                }
                let ready = |f: &PollFd<'_>| f.revents().is_some_and(|r| !r.is_empty());
                (
                    ready(&fds[0]),
                    ready(&fds[1]),
                    ready(&fds[2]),
                    fds[3..].iter().map(ready).collect::<Vec<_>>(),
                )
            };
            if stop {
                break;
            }
            // Messages first: a peer that closed is gone before anything
            // is sent to it.
            for (i, r) in ready.iter().enumerate() {
                if *r && !self.serve_peer(i, &mut buf) {
                    self.peers[i].doomed = true;
                }
            }
            for i in 0..self.peers.len() {
                self.apply_deferred(i);
            }
            self.drop_doomed();
            if listener || self.acceptor.retry_due(Instant::now()) {
                loop {
                    let l = &self.listener;
                    match self
                        .acceptor
                        .accept(Instant::now(), || vrdma_sys::sock::accept(l))
                    {
                        Ok(Accepted::Conn(s)) => self.add(s, false),
                        Ok(Accepted::Nothing | Accepted::Later(_)) => break,
                        Err(e) => {
                            tracing::warn!(error = %e, "shm rendezvous: accept failed");
                            break;
                        }
                    }
                }
            }
            if notify {
                let _ = self.notify.read();
            }
            // The devices' networks, rings and addresses, to every peer
            // that said HELLO (cheap when nothing changed).
            let ports = self.live_ports();
            let nets = named_networks(&ports);
            for i in 0..self.peers.len() {
                let p = &self.peers[i];
                if p.id.is_none() && p.since.elapsed() > HELLO_WITHIN {
                    self.stats.refused.fetch_add(1, Ordering::Relaxed);
                    self.peers[i].doomed = true;
                } else if p.id.is_some() && self.sync(i, &ports, &nets).is_err() {
                    self.peers[i].doomed = true;
                }
            }
            self.drop_doomed();
        }
        while !self.peers.is_empty() {
            self.drop_peer(self.peers.len() - 1);
        }
    }

    /// The switch's ports, alive.
    fn live_ports(&self) -> Vec<Arc<PortShared>> {
        let mut all = lock(&self.dir.ports);
        all.retain(|w| w.strong_count() > 0);
        all.iter()
            .filter_map(Weak::upgrade)
            .filter(|p| p.alive.load(Ordering::Acquire))
            .collect()
    }

    /// Drops the peers marked so.
    fn drop_doomed(&mut self) {
        for i in (0..self.peers.len()).rev() {
            if self.peers[i].doomed {
                self.drop_peer(i);
            }
        }
    }

    /// Reads peer `i`'s messages; false when it is to be dropped.
    fn serve_peer(&mut self, i: usize, buf: &mut [u8]) -> bool {
        loop {
            let mut fds = Vec::new();
            let n = match recv(&self.peers[i].sock, buf, &mut fds) {
                Ok(0) => return false,
                Ok(n) => n,
                Err(nix::errno::Errno::EAGAIN) => return true,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => return false,
            };
            if !self.message(i, &buf[..n], fds) {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                return false;
            }
        }
    }

    /// What peer `i` may announce: everything for a trusted user, else
    /// what root granted its user (read afresh: a grant may change).
    fn granted(&self, i: usize) -> Granted {
        let uid = self.peers[i].uid;
        if self.config.trust.uids.contains(&uid) {
            Granted::All
        } else {
            Granted::Only(
                read_grant(self.rdv.as_fd(), uid, self.config.trust.grant_owner)
                    .unwrap_or_default(),
            )
        }
    }

    /// Handles one message of peer `i`; false on a protocol error.
    fn message(&mut self, i: usize, m: &[u8], fds: Vec<OwnedFd>) -> bool {
        let msg = match Message::parse(m, fds.len()) {
            Ok(msg) => msg,
            Err(e) => {
                tracing::warn!(error = %e, pid = self.peers[i].pid, "shm rendezvous: a peer's message refused");
                return false;
            }
        };
        match (msg, self.peers[i].id) {
            (Message::Hello { id }, None) => self.hello(i, id),
            (Message::Nets { names }, Some(_)) => {
                self.peers[i].nets = names;
                true
            }
            (Message::Ring { port, slots, net }, Some(_)) => {
                self.take_ring(i, port, slots, net, fds)
            }
            (Message::Gids { port, gids }, Some(_)) => {
                if self.peers[i].remote.contains_key(&port) && !self.peers[i].spend() {
                    self.stats.gids_deferred.fetch_add(1, Ordering::Relaxed);
                    self.peers[i].deferred.insert(port, gids);
                    return true;
                }
                self.peers[i].deferred.remove(&port);
                self.apply_gids(i, port, &gids);
                true
            }
            (Message::Gone { port }, Some(_)) => {
                self.peers[i].deferred.remove(&port);
                if let Some(r) = self.peers[i].remote.remove(&port) {
                    self.release(r.out.id, r.net, &r.held);
                    self.publish_allowed(i);
                }
                true
            }
            // A second HELLO, or anything before the first.
            _ => false,
        }
    }

    /// Peer `i`'s HELLO, naming its switch's instance `id`: its identity
    /// from now on. False when the identity is this switch's own, or one
    /// connected already that keeps its connection.
    fn hello(&mut self, i: usize, id: u64) -> bool {
        let them = (self.peers[i].pid, id);
        if them == self.me {
            return false;
        }
        // The identity is the kernel's pid with the instance: no
        // other process can take it. A second connection for it
        // is refused — unless the two daemons connected to each
        // other at once: the one the smaller identity made stays.
        if let Some(j) = self
            .peers
            .iter()
            .position(|q| q.identity() == Some(them) && !q.doomed)
        {
            let keep_new = self.peers[i].initiated != self.peers[j].initiated
                && self.peers[i].initiated == (self.me < them);
            if !keep_new {
                if self.peers[i].initiated == self.peers[j].initiated {
                    self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        pid = them.0,
                        "shm rendezvous: a second connection for a connected daemon refused"
                    );
                }
                return false;
            }
            self.peers[j].doomed = true;
        }
        self.peers[i].id = Some(id);
        true
    }

    /// A RING from peer `i`: a ring into its device `port` on network
    /// `net`, of `slots` slots, its memfd and eventfd in `fds`. A ring out
    /// of bounds, on a network this daemon does not have or the peer's user
    /// was not granted, or that does not map, is refused and counted; one
    /// taken replaces the device's last. False (a protocol error) only when
    /// the descriptors are missing.
    fn take_ring(
        &mut self,
        i: usize,
        port: u32,
        slots: u32,
        net: String,
        mut fds: Vec<OwnedFd>,
    ) -> bool {
        let (Some(wake), Some(memfd)) = (fds.pop(), fds.pop()) else {
            return false;
        };
        if slots > MAX_PEER_SLOTS
            || (self.peers[i].remote.len() >= MAX_PEER_PORTS
                && !self.peers[i].remote.contains_key(&port))
            || !sys::is_eventfd(&wake)
            || fcntl(&wake, FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).is_err()
        {
            self.stats.bad_rings.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        // A network this switch has, and one the peer's user may
        // be on.
        let local = self
            .switch
            .find_network(&net)
            .filter(|n| self.live_ports().iter().any(|p| p.net.id == n.id));
        let (Some(local), true) = (local, self.granted(i).network(&net)) else {
            self.stats.networks_refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                pid = self.peers[i].pid,
                uid = self.peers[i].uid,
                network = net.as_str(),
                "shm rendezvous: a peer's device on a network it was not granted, or that this daemon does not have, refused"
            );
            return true;
        };
        let producer = match ring::open(memfd, slots) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "shm rendezvous: a peer's ring refused");
                self.stats.bad_rings.fetch_add(1, Ordering::Relaxed);
                return true;
            }
        };
        let out = Arc::new(Outbound {
            id: self.dir.next_id.fetch_add(1, Ordering::Relaxed),
            producer: Mutex::new(producer),
            wake,
            link: Arc::clone(&self.peers[i].link),
        });
        let r = Remote {
            out,
            net: local.id,
            net_name: net,
            held: Vec::new(),
        };
        if let Some(old) = self.peers[i].remote.insert(port, r) {
            self.release(old.out.id, old.net, &old.held);
            self.publish_allowed(i);
        }
        true
    }

    /// Applies the GIDS peer `i`'s allowance held back, as far as it goes.
    fn apply_deferred(&mut self, i: usize) {
        while let Some(&port) = self.peers[i].deferred.keys().next() {
            if !self.peers[i].spend() {
                return;
            }
            if let Some(gids) = self.peers[i].deferred.remove(&port) {
                self.apply_gids(i, port, &gids);
            }
        }
    }

    /// Takes the addresses `gids` peer `i` announced for its device
    /// `port`, as far as its grant allows.
    fn apply_gids(&mut self, i: usize, port: u32, gids: &[Gid]) {
        let Some(r) = self.peers[i].remote.get(&port).cloned() else {
            // Addresses of a device with no ring: nothing to do.
            return;
        };
        let granted = self.granted(i);
        let (mine, refused): (Vec<Gid>, Vec<Gid>) =
            gids.iter().partition(|g| granted.address(&r.net_name, g));
        if !refused.is_empty() {
            self.stats
                .claims_refused
                .fetch_add(refused.len() as u64, Ordering::Relaxed);
            tracing::warn!(
                pid = self.peers[i].pid,
                uid = self.peers[i].uid,
                network = r.net_name.as_str(),
                addresses = ?refused.iter().map(|g| g.ip()).collect::<Vec<_>>(),
                "shm rendezvous: addresses a peer's user was not granted refused"
            );
        }
        let taken = self.claim(&r.out, r.net, &r.held, &mine);
        if let Some(e) = self.peers[i].remote.get_mut(&port) {
            e.held = taken;
        }
        self.publish_allowed(i);
    }

    /// Points the directory's entries for `gids` on `net` at `out` where no
    /// one else holds them, releasing those of `held` no longer named; the
    /// addresses taken.
    fn claim(&self, out: &Arc<Outbound>, net: NetId, held: &[Gid], gids: &[Gid]) -> Vec<Gid> {
        let mut owners = write(&self.dir.owners);
        for g in held {
            if !gids.contains(g) && owners.get(net, g).is_some_and(|d| d.id() == out.id) {
                owners.remove(net, g);
            }
        }
        let mut taken = Vec::new();
        for g in gids {
            if taken.contains(g) {
                continue;
            }
            match owners.get(net, g) {
                Some(d) if d.id() != out.id => {
                    if !held.contains(g) {
                        self.stats.gid_conflicts.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            gid = %g.ip(),
                            "shm rendezvous: an address a peer announced that another device of the network holds"
                        );
                    }
                }
                Some(_) => taken.push(*g),
                None => {
                    owners.insert(net, *g, Dest::Remote(Arc::clone(out)));
                    taken.push(*g);
                }
            }
        }
        self.dir.generation.fetch_add(1, Ordering::AcqRel);
        taken
    }

    /// Removes the directory's entries for `gids` on `net` that lead to
    /// `id`.
    fn release(&self, id: u64, net: NetId, gids: &[Gid]) {
        let mut owners = write(&self.dir.owners);
        for g in gids {
            if owners.get(net, g).is_some_and(|d| d.id() == id) {
                owners.remove(net, g);
            }
        }
        self.dir.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Tells the rings peer `i` writes which sources are its own, on which
    /// network.
    fn publish_allowed(&self, i: usize) {
        let p = &self.peers[i];
        let all: HashSet<(NetId, Gid)> = p
            .remote
            .values()
            .flat_map(|r| r.held.iter().map(|g| (r.net, *g)))
            .collect();
        *lock(&p.link.allowed) = Arc::new(all);
        p.link.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Tells peer `i` this daemon's networks (when they changed), gives it a ring
    /// for each device on a network both have and it may be on that has
    /// none from it yet, each such device's addresses when they changed,
    /// GONE for devices that left (or that it may no longer reach).
    fn sync(&mut self, i: usize, ports: &[Arc<PortShared>], nets: &[String]) -> io::Result<()> {
        if self.peers[i].told.as_deref() != Some(nets) {
            send(
                &self.peers[i].sock,
                &Message::Nets {
                    names: nets.to_vec(),
                }
                .emit(),
                &[],
            )?;
            self.peers[i].told = Some(nets.to_vec());
        }
        let granted = self.granted(i);
        let slots = self.config.slots;
        let p = &mut self.peers[i];
        let mut live = Vec::new();
        for port in ports {
            let Some(net) = port.net.name() else {
                continue;
            };
            if !p.nets.iter().any(|n| n == net) || !granted.network(net) {
                continue;
            }
            live.push(port.id);
            let gids = lock(&port.gids).clone();
            if !p.given.contains_key(&port.id) {
                let (consumer, memfd) = ring::create(slots, "vrdma-shm-ring")
                    .map_err(|e| io::Error::other(e.to_string()))?;
                let event = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
                let m = Message::Ring {
                    port: port.id as u32,
                    slots,
                    net: net.to_owned(),
                }
                .emit();
                // (SCM_RIGHTS gives the peer descriptors of its own.)
                send(&p.sock, &m, &[memfd.as_raw_fd(), event.as_fd().as_raw_fd()])?;
                port.epoll
                    .add(&event, EpollEvent::new(EpollFlags::EPOLLIN, 2))?;
                let ring = InRing {
                    consumer,
                    net: port.net.id,
                    event,
                    link: Arc::clone(&p.link),
                    allowed: (u64::MAX, Arc::new(HashSet::new())),
                    last_src: None,
                };
                lock(&port.incoming).push(ring);
                port.incoming_gen.fetch_add(1, Ordering::AcqRel);
                p.given.insert(port.id, Vec::new());
            }
            if p.given.get(&port.id) != Some(&gids) {
                let n = gids.len().min(MAX_GIDS);
                let m = Message::Gids {
                    port: port.id as u32,
                    gids: gids[..n].to_vec(),
                }
                .emit();
                send(&p.sock, &m, &[])?;
                p.given.insert(port.id, gids);
            }
        }
        let gone: Vec<u64> = p
            .given
            .keys()
            .copied()
            .filter(|k| !live.contains(k))
            .collect();
        for id in gone {
            send(&p.sock, &Message::Gone { port: id as u32 }.emit(), &[])?;
            p.given.remove(&id);
        }
        Ok(())
    }

    /// Drops peer `i`: its addresses leave the directory, its rings are
    /// read to their end and dropped by their devices.
    fn drop_peer(&mut self, i: usize) {
        let p = self.peers.remove(i);
        p.link.gone.store(true, Ordering::Release);
        for r in p.remote.values() {
            self.release(r.out.id, r.net, &r.held);
        }
        // Devices asleep on a ring of it look once more.
        for port in lock(&self.dir.ports).iter().filter_map(Weak::upgrade) {
            port.incoming_gen.fetch_add(1, Ordering::AcqRel);
        }
        self.stats
            .peers
            .store(self.peers.len() as u64, Ordering::Relaxed);
    }
}

/// The named networks of `ports`, sorted, each once (at most
/// [`MAX_NETS`]).
fn named_networks(ports: &[Arc<PortShared>]) -> Vec<String> {
    let mut v: Vec<String> = ports
        .iter()
        .filter_map(|p| p.net.name().map(str::to_owned))
        .collect();
    v.sort();
    v.dedup();
    v.truncate(MAX_NETS);
    v
}

/// Sends one message with `fds` attached.
fn send(sock: &OwnedFd, m: &[u8], fds: &[i32]) -> io::Result<()> {
    let iov = [IoSlice::new(m)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsg };
    loop {
        match sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) if n == m.len() => return Ok(()),
            Ok(_) => return Err(io::Error::other("a message cut short")),
            Err(nix::errno::Errno::EINTR) => continue,
            // A peer that does not read its socket is one that is dropped:
            // the rendezvous thread never waits for it.
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receives one message into `buf` and the descriptors that came with it
/// (owned: closed if the message is refused), with room for as many as the
/// kernel sends with one message — the daemon's one receive of descriptors
/// (`vrdma_sys::sock`). A message longer than `buf`, or descriptors cut
/// short, is an error: what came is closed.
fn recv(sock: &OwnedFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> nix::Result<usize> {
    vrdma_sys::sock::try_recv_with_fds(sock, buf, fds)
}
