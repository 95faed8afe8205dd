//! Devices of different daemons on one host: a rendezvous directory of
//! UNIX sockets where each daemon's switch listens, and rings
//! ([`super::ring`]) between them.
//!
//! A daemon that joins ([`Switch::join`]) binds `DIR/<pid>-<n>.sock`, connects
//! to every socket already there, and accepts whoever connects later; a
//! peer must pass the admission check (its `SO_PEERCRED`: the daemon's own
//! user, root, or a user or group the daemon names) on both sides. Over
//! each connection (`SOCK_SEQPACKET`, a message a datagram) each daemon
//! tells the other, for each of its devices, a ring to write that
//! device's packets into (`RING`, with the ring's sealed memfd and an
//! eventfd to wake the device by `SCM_RIGHTS`) and the addresses the device
//! holds (`GIDS`, again whenever they change; `GONE` when the device goes).
//! The receiving daemon's switch then reaches those addresses through the
//! ring; the device that reads a ring takes from it only packets whose
//! source is an address the ring's daemon holds and whose destination is
//! its own.
//!
//! What crosses is packets, never guest memory: a peer daemon learns
//! nothing but what a device sends it, as a peer on the network would —
//! the reason the design does not map each other's guest memory (see
//! docs/same-host.md). A peer that lies (a message out of shape, a ring
//! unsealed or of the wrong size, an eventfd that is not one, indices from
//! nowhere) loses its connection or the ring; nothing it sends reaches a
//! device unchecked.

use std::{
    collections::HashMap,
    fs,
    io::{self, IoSlice, IoSliceMut},
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
        unix::fs::PermissionsExt,
    },
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
};

use nix::{
    fcntl::{FcntlArg, OFlag, fcntl},
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::{
        epoll::{EpollEvent, EpollFlags},
        eventfd::{EfdFlags, EventFd},
        socket::{
            AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
            UnixAddr, accept4, bind, connect, getsockopt, listen, recvmsg, sendmsg, socket,
            sockopt::PeerCredentials,
        },
    },
};
use vrdma_wire::{Gid, frame::Route};

use super::{Dest, Directory, PortShared, Stats, Switch, lock, ring, sys, write};
use crate::{Lender, Piece};

/// The protocol's first message: magic, version, the daemon's identity.
const MAGIC: u64 = u64::from_le_bytes(*b"VRDMASHM");
const VERSION: u32 = 1;
const HELLO: u32 = 1;
const RING: u32 = 2;
const GIDS: u32 = 3;
const GONE: u32 = 4;
/// A message's bytes at most (a GIDS of [`MAX_GIDS`] addresses).
const MAX_MESSAGE: usize = 12 + 16 * MAX_GIDS;
/// Addresses one device announces at most (a GID table's worth).
const MAX_GIDS: usize = 128;
/// Peers a daemon keeps at most, and devices of one peer.
const MAX_PEERS: usize = 64;
const MAX_PEER_PORTS: usize = 64;
/// How long a connection may go without its HELLO (a peer slot held by
/// one that never speaks is given back).
const HELLO_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);
/// Slots a ring may have at most when a peer offers one (about 4 MiB at
/// 1024).
const MAX_PEER_SLOTS: u32 = 1024;

/// A message of the rendezvous protocol, decoded from a copy of its
/// bytes (and the number of descriptors that came with it).
#[derive(Clone, Debug, Eq, PartialEq)]
pub enum Message {
    /// The daemon's identity (magic and version checked).
    Hello { id: u64 },
    /// A ring into the sender's device `port`, of `slots` slots (its memfd
    /// and its eventfd came with it).
    Ring { port: u32, slots: u32 },
    /// The addresses of the sender's device `port` now.
    Gids { port: u32, gids: Vec<Gid> },
    /// The sender's device `port` is gone.
    Gone { port: u32 },
}

/// Why a message is refused (the connection is dropped).
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
pub enum ProtocolError {
    #[error("a message of {0} bytes")]
    Length(usize),
    #[error("an unknown message type {0}")]
    Kind(u32),
    #[error("not vrdma's rendezvous protocol, or another version")]
    Magic,
    #[error("{got} descriptors with a message that takes {want}")]
    Descriptors { got: usize, want: usize },
    #[error("{0} addresses for one device")]
    TooManyGids(usize),
}

impl Message {
    /// Decodes `m`, which came with `fds` descriptors.
    pub fn parse(m: &[u8], fds: usize) -> Result<Message, ProtocolError> {
        if m.len() < 4 || m.len() > MAX_MESSAGE {
            return Err(ProtocolError::Length(m.len()));
        }
        let u32_at = |o: usize| u32::from_le_bytes([m[o], m[o + 1], m[o + 2], m[o + 3]]);
        let u64_at = |o: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&m[o..o + 8]);
            u64::from_le_bytes(b)
        };
        let kind = u32_at(0);
        let (len_ok, want_fds) = match kind {
            HELLO => (m.len() == 24, 0),
            RING => (m.len() == 12, 2),
            GIDS => (m.len() >= 12, 0),
            GONE => (m.len() == 8, 0),
            k => return Err(ProtocolError::Kind(k)),
        };
        if !len_ok {
            return Err(ProtocolError::Length(m.len()));
        }
        if fds != want_fds {
            return Err(ProtocolError::Descriptors {
                got: fds,
                want: want_fds,
            });
        }
        Ok(match kind {
            HELLO => {
                if u64_at(4) != MAGIC || u32_at(12) != VERSION {
                    return Err(ProtocolError::Magic);
                }
                Message::Hello { id: u64_at(16) }
            }
            RING => Message::Ring {
                port: u32_at(4),
                slots: u32_at(8),
            },
            GIDS => {
                let n = u32_at(8) as usize;
                if n > MAX_GIDS {
                    return Err(ProtocolError::TooManyGids(n));
                }
                if m.len() != 12 + 16 * n {
                    return Err(ProtocolError::Length(m.len()));
                }
                let gids = (0..n)
                    .map(|k| {
                        let mut g = [0u8; 16];
                        g.copy_from_slice(&m[12 + 16 * k..28 + 16 * k]);
                        Gid(g)
                    })
                    .collect();
                Message::Gids {
                    port: u32_at(4),
                    gids,
                }
            }
            _ => Message::Gone { port: u32_at(4) },
        })
    }

    /// The message's bytes (its descriptors go beside them).
    pub fn emit(&self) -> Vec<u8> {
        let mut m = Vec::with_capacity(24);
        match self {
            Message::Hello { id } => {
                m.extend_from_slice(&HELLO.to_le_bytes());
                m.extend_from_slice(&MAGIC.to_le_bytes());
                m.extend_from_slice(&VERSION.to_le_bytes());
                m.extend_from_slice(&id.to_le_bytes());
            }
            Message::Ring { port, slots } => {
                m.extend_from_slice(&RING.to_le_bytes());
                m.extend_from_slice(&port.to_le_bytes());
                m.extend_from_slice(&slots.to_le_bytes());
            }
            Message::Gids { port, gids } => {
                m.extend_from_slice(&GIDS.to_le_bytes());
                m.extend_from_slice(&port.to_le_bytes());
                m.extend_from_slice(&(gids.len() as u32).to_le_bytes());
                for g in gids {
                    m.extend_from_slice(&g.0);
                }
            }
            Message::Gone { port } => {
                m.extend_from_slice(&GONE.to_le_bytes());
                m.extend_from_slice(&port.to_le_bytes());
            }
        }
        m
    }
}

/// Who may join the rendezvous: the daemon's own user and root always,
/// and these users and groups.
#[derive(Clone, Debug, Default)]
pub struct Admit {
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
}

impl Admit {
    fn allows(&self, uid: u32, gid: u32) -> bool {
        uid == 0
            || uid == nix::unistd::geteuid().as_raw()
            || self.uids.contains(&uid)
            || self.gids.contains(&gid)
    }
}

/// How a switch joins a rendezvous directory.
#[derive(Clone, Debug)]
pub struct JoinConfig {
    pub dir: PathBuf,
    /// Slots of each ring this daemon's devices offer (a power of two, at
    /// most 1024).
    pub slots: u32,
    pub admit: Admit,
}

impl JoinConfig {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        JoinConfig {
            dir: dir.into(),
            slots: 512,
            admit: Admit::default(),
        }
    }
}

/// What the rendezvous did, for logs and tests.
#[derive(Debug, Default)]
pub struct RendezvousStats {
    /// Peers connected now.
    pub peers: AtomicU64,
    /// Connections refused (admission) or dropped for a protocol error.
    pub refused: AtomicU64,
    /// Rings a peer offered that were refused (unsealed, wrong size, not
    /// an eventfd, too many).
    pub bad_rings: AtomicU64,
    /// Addresses a peer announced that another device already held.
    pub gid_conflicts: AtomicU64,
}

/// A daemon on the other side of a connection, as the devices that read
/// its rings and write into them see it.
#[derive(Debug)]
pub(super) struct Link {
    /// Its connection is gone: its rings are read to their end, then
    /// dropped.
    pub(super) gone: AtomicBool,
    /// The addresses it holds (its devices' accepted announcements).
    allowed: Mutex<Arc<Vec<Gid>>>,
    /// Bumped with `allowed`.
    generation: AtomicU64,
}

impl Link {
    fn new() -> Arc<Self> {
        Arc::new(Link {
            gone: AtomicBool::new(false),
            allowed: Mutex::new(Arc::new(Vec::new())),
            generation: AtomicU64::new(0),
        })
    }
}

/// The writing end of a ring of a peer's device.
#[derive(Debug)]
pub(super) struct Outbound {
    pub(super) id: u64,
    producer: Mutex<ring::Producer>,
    /// The peer device's eventfd (checked to be one).
    wake: OwnedFd,
    link: Arc<Link>,
}

impl Outbound {
    /// Writes a packet (as [`super::Port::send`] describes it) into the
    /// ring; visible at [`Outbound::publish`].
    pub(super) fn push(
        &self,
        route: &Route,
        head: &[u8],
        payload_at: usize,
        lent: &[Piece],
        mem: &impl Lender,
    ) -> Result<usize, super::Dropped> {
        if self.link.gone.load(Ordering::Relaxed) {
            return Err(super::Dropped::Gone);
        }
        let mut p = lock(&self.producer);
        p.push_gather(route, head, payload_at, lent, mem)
            .map_err(|e| match e {
                ring::PushError::Full => super::Dropped::Full,
                ring::PushError::Broken => super::Dropped::Gone,
                ring::PushError::Unlent => super::Dropped::Unlent,
            })
    }

    /// Makes what was pushed visible, and wakes the peer's device if it
    /// asked to be.
    pub(super) fn publish(&self) {
        if lock(&self.producer).publish() {
            // An eventfd (checked when the ring came): 8 bytes, never
            // blocking (non-blocking, and a full counter only refuses).
            let _ = nix::unistd::write(&self.wake, &1u64.to_ne_bytes());
        }
    }
}

/// The reading end of a ring this daemon gave a peer for one device.
#[derive(Debug)]
pub(super) struct InRing {
    consumer: ring::Consumer,
    /// Written by the peer (or by the device itself when it arms with
    /// packets waiting); in the device's epoll.
    event: EventFd,
    link: Arc<Link>,
    /// The peer's addresses as last read, and the generation read.
    allowed: (u64, Arc<Vec<Gid>>),
}

impl InRing {
    /// Whether the ring is done with: broken, or its peer gone and every
    /// packet read.
    pub(super) fn finished(&self) -> bool {
        self.consumer.is_broken()
            || (self.link.gone.load(Ordering::Acquire) && self.consumer.pending() == 0)
    }

    pub(super) fn event(&self) -> BorrowedFd<'_> {
        self.event.as_fd()
    }

    pub(super) fn disarm(&self) {
        self.consumer.disarm();
    }

    /// Before the device sleeps: the peer must wake it; if packets wait
    /// already, the device's descriptor is made readable now. The
    /// eventfd's count is drained first, so that a peer that writes it
    /// without sending wakes the device once per write, not for ever.
    pub(super) fn arm(&self) {
        let _ = self.event.read();
        if self.consumer.arm() {
            let _ = self.event.write(1);
        }
    }

    /// Takes up to `budget` packets, each copied into `buf` and handed to
    /// `deliver` if its source is an address of the peer's and its
    /// destination one of `local`; the others are counted. Returns the
    /// packets taken.
    pub(super) fn receive(
        &mut self,
        buf: &mut [u8],
        local: &[Gid],
        stats: &mut Stats,
        budget: usize,
        deliver: &mut impl FnMut(&Route, &[u8]),
    ) -> usize {
        let generation = self.link.generation.load(Ordering::Acquire);
        if generation != self.allowed.0 {
            self.allowed = (generation, Arc::clone(&lock(&self.link.allowed)));
        }
        let mut n = 0;
        while n < budget {
            match self.consumer.pop(buf) {
                Ok(r) => {
                    n += 1;
                    if !self.allowed.1.contains(&r.route.src) || !local.contains(&r.route.dst) {
                        stats.rx_refused += 1;
                        continue;
                    }
                    stats.rx_packets += 1;
                    stats.rx_bytes += r.len as u64;
                    deliver(&r.route, &buf[..r.len]);
                }
                Err(ring::PopError::Empty) => break,
                Err(ring::PopError::Broken) => {
                    stats.rx_broken += 1;
                    break;
                }
            }
        }
        if n > 0 {
            self.consumer.release();
        }
        n
    }
}

/// A switch's membership of a rendezvous directory: its socket there and
/// the thread that speaks with the other daemons. Dropping it leaves: the
/// socket is removed, the connections closed (the peers drop this
/// daemon's addresses), and its rings are read to their end.
#[derive(Debug)]
pub struct Rendezvous {
    path: PathBuf,
    stop: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<RendezvousStats>,
}

impl Rendezvous {
    /// The daemon's socket in the directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn stats(&self) -> &RendezvousStats {
        &self.stats
    }
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = fs::remove_file(&self.path);
    }
}

impl Switch {
    /// Joins the rendezvous directory `config.dir`: this switch's devices
    /// and those of every daemon there (and of those that come later)
    /// reach each other through rings. The directory must exist; who may
    /// create sockets in it, and connect to them, decides who may join
    /// (see [`Admit`] for what each side checks on top).
    pub fn join(&self, config: JoinConfig) -> io::Result<Rendezvous> {
        if config.slots == 0 || config.slots > MAX_PEER_SLOTS || !config.slots.is_power_of_two() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "ring slots: a power of two, 1 to 1024",
            ));
        }
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "{}-{}.sock",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let path = config.dir.join(name);
        let _ = fs::remove_file(&path);
        let listener = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )?;
        bind(listener.as_raw_fd(), &UnixAddr::new(&path)?)?;
        let mode = if config.admit.gids.is_empty() {
            0o600
        } else {
            0o660
        };
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))?;
        if let Some(g) = config.admit.gids.first() {
            nix::unistd::chown(&path, None, Some(nix::unistd::Gid::from_raw(*g)))?;
        }
        listen(
            &listener,
            nix::sys::socket::Backlog::new(16).map_err(io::Error::from)?,
        )?;
        let stop = Arc::new(EventFd::from_flags(
            EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK,
        )?);
        let notify = Arc::new(EventFd::from_flags(
            EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK,
        )?);
        if self.inner.notify.set(Arc::clone(&notify)).is_err() {
            let _ = fs::remove_file(&path);
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "the switch has joined a rendezvous already",
            ));
        }
        let stats = Arc::new(RendezvousStats::default());
        let me = rand_u64();
        let mut r = Runner {
            dir: Arc::clone(&self.inner),
            config,
            me,
            listener,
            notify,
            stop: Arc::clone(&stop),
            peers: Vec::new(),
            stats: Arc::clone(&stats),
        };
        r.connect_existing(&path);
        let thread = std::thread::Builder::new()
            .name("vrdma-shm".into())
            .spawn(move || r.run())?;
        Ok(Rendezvous {
            path,
            stop,
            thread: Some(thread),
            stats,
        })
    }
}

/// A number no other daemon is likely to have (the identity that breaks
/// the tie when two daemons connect to each other at once).
fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is keyed from the system's randomness for each process.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}

/// One connected daemon.
struct Peer {
    sock: OwnedFd,
    /// Whether this daemon connected (else it accepted).
    initiated: bool,
    /// Its identity, once its HELLO came.
    id: Option<u64>,
    /// When it connected (its HELLO is due within [`HELLO_WITHIN`]).
    since: std::time::Instant,
    /// A second connection to the same daemon replaced this one: dropped
    /// at the end of the round.
    doomed: bool,
    link: Arc<Link>,
    /// This daemon's devices it was given a ring for: port id → the
    /// addresses last announced for it.
    given: HashMap<u64, Vec<Gid>>,
    /// Its devices: their port numbers → the ring into each, and the
    /// addresses of each that this switch took.
    remote: HashMap<u32, (Arc<Outbound>, Vec<Gid>)>,
}

struct Runner {
    dir: Arc<Directory>,
    config: JoinConfig,
    me: u64,
    listener: OwnedFd,
    notify: Arc<EventFd>,
    stop: Arc<EventFd>,
    peers: Vec<Peer>,
    stats: Arc<RendezvousStats>,
}

impl Runner {
    /// Connects to every socket of the directory but `own`.
    fn connect_existing(&mut self, own: &Path) {
        let Ok(entries) = fs::read_dir(&self.config.dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p == own || p.extension().is_none_or(|x| x != "sock") {
                continue;
            }
            if self.peers.len() >= MAX_PEERS {
                break;
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

    /// Takes a connection that passed admission: says HELLO.
    fn add(&mut self, sock: OwnedFd, initiated: bool) {
        let admitted = getsockopt(&sock, PeerCredentials)
            .is_ok_and(|c| self.config.admit.allows(c.uid(), c.gid()));
        if !admitted || self.peers.len() >= MAX_PEERS {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if fcntl(&sock, FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).is_err() {
            return;
        }
        let hello = Message::Hello { id: self.me }.emit();
        if send(&sock, &hello, &[]).is_err() {
            return;
        }
        self.peers.push(Peer {
            sock,
            initiated,
            id: None,
            since: std::time::Instant::now(),
            doomed: false,
            link: Link::new(),
            given: HashMap::new(),
            remote: HashMap::new(),
        });
        self.stats
            .peers
            .store(self.peers.len() as u64, Ordering::Relaxed);
    }

    fn run(mut self) {
        let mut buf = vec![0u8; MAX_MESSAGE + 1];
        loop {
            let (stop, notify, listener, ready) = {
                let mut fds = vec![
                    PollFd::new(self.stop.as_fd(), PollFlags::POLLIN),
                    PollFd::new(self.notify.as_fd(), PollFlags::POLLIN),
                    PollFd::new(self.listener.as_fd(), PollFlags::POLLIN),
                ];
                fds.extend(
                    self.peers
                        .iter()
                        .map(|p| PollFd::new(p.sock.as_fd(), PollFlags::POLLIN)),
                );
                match poll(&mut fds, PollTimeout::from(1000u16)) {
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
            self.drop_doomed();
            if listener {
                while let Ok(s) = accept4(
                    self.listener.as_raw_fd(),
                    SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
                ) {
                    self.add(sys::owned(s), false);
                }
            }
            if notify {
                let _ = self.notify.read();
            }
            // The devices' rings and addresses, to every peer that said
            // HELLO (cheap when nothing changed).
            for i in 0..self.peers.len() {
                let p = &self.peers[i];
                if p.id.is_none() && p.since.elapsed() > HELLO_WITHIN {
                    self.stats.refused.fetch_add(1, Ordering::Relaxed);
                    self.peers[i].doomed = true;
                } else if p.id.is_some() && self.sync(i).is_err() {
                    self.peers[i].doomed = true;
                }
            }
            self.drop_doomed();
        }
        while !self.peers.is_empty() {
            self.drop_peer(self.peers.len() - 1);
        }
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

    /// Handles one message of peer `i`; false on a protocol error.
    fn message(&mut self, i: usize, m: &[u8], mut fds: Vec<OwnedFd>) -> bool {
        let msg = match Message::parse(m, fds.len()) {
            Ok(msg) => msg,
            Err(e) => {
                tracing::warn!(error = %e, "shm rendezvous: a peer's message refused");
                return false;
            }
        };
        match (msg, self.peers[i].id) {
            (Message::Hello { id }, None) => {
                if id == self.me {
                    return false;
                }
                // Two connections to one daemon (both connected at once):
                // the one the smaller identity made stays.
                if let Some(j) = self
                    .peers
                    .iter()
                    .position(|q| q.id == Some(id) && !q.doomed)
                {
                    let keep_new = self.peers[i].initiated == (self.me < id);
                    if !keep_new {
                        return false;
                    }
                    self.peers[j].doomed = true;
                }
                self.peers[i].id = Some(id);
                true
            }
            (Message::Ring { port, slots }, Some(_)) => {
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
                if let Some((old, held)) = self.peers[i].remote.insert(port, (out, Vec::new())) {
                    self.release(old.id, &held);
                }
                true
            }
            (Message::Gids { port, gids }, Some(_)) => {
                let Some((out, held)) = self.peers[i].remote.get(&port).cloned() else {
                    // Addresses of a device with no ring: nothing to do.
                    return true;
                };
                let taken = self.claim(&out, &held, &gids);
                if let Some(e) = self.peers[i].remote.get_mut(&port) {
                    e.1 = taken;
                }
                self.publish_allowed(i);
                true
            }
            (Message::Gone { port }, Some(_)) => {
                if let Some((out, held)) = self.peers[i].remote.remove(&port) {
                    self.release(out.id, &held);
                    self.publish_allowed(i);
                }
                true
            }
            // A second HELLO, or anything before the first.
            _ => false,
        }
    }

    /// Points the directory's entries for `gids` at `out` where no one
    /// else holds them, releasing those of `held` no longer named; the
    /// addresses taken.
    fn claim(&self, out: &Arc<Outbound>, held: &[Gid], gids: &[Gid]) -> Vec<Gid> {
        let mut owners = write(&self.dir.owners);
        for g in held {
            if !gids.contains(g) && owners.get(g).is_some_and(|d| d.id() == out.id) {
                owners.remove(g);
            }
        }
        let mut taken = Vec::new();
        for g in gids {
            if taken.contains(g) {
                continue;
            }
            match owners.get(g) {
                Some(d) if d.id() != out.id => {
                    if !held.contains(g) {
                        self.stats.gid_conflicts.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Some(_) => taken.push(*g),
                None => {
                    owners.insert(*g, Dest::Remote(Arc::clone(out)));
                    taken.push(*g);
                }
            }
        }
        self.dir.generation.fetch_add(1, Ordering::AcqRel);
        taken
    }

    /// Removes the directory's entries for `gids` that lead to `id`.
    fn release(&self, id: u64, gids: &[Gid]) {
        let mut owners = write(&self.dir.owners);
        for g in gids {
            if owners.get(g).is_some_and(|d| d.id() == id) {
                owners.remove(g);
            }
        }
        self.dir.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Tells the rings peer `i` writes which sources are its own.
    fn publish_allowed(&self, i: usize) {
        let p = &self.peers[i];
        let all: Vec<Gid> = p
            .remote
            .values()
            .flat_map(|(_, g)| g.iter().copied())
            .collect();
        *lock(&p.link.allowed) = Arc::new(all);
        p.link.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Gives peer `i` a ring for each device that has none from it yet,
    /// each device's addresses when they changed, GONE for devices that
    /// left.
    fn sync(&mut self, i: usize) -> io::Result<()> {
        let ports: Vec<Arc<PortShared>> = {
            let mut all = lock(&self.dir.ports);
            all.retain(|w| w.strong_count() > 0);
            all.iter()
                .filter_map(Weak::upgrade)
                .filter(|p| p.alive.load(Ordering::Acquire))
                .collect()
        };
        let slots = self.config.slots;
        let p = &mut self.peers[i];
        for port in &ports {
            let gids = lock(&port.gids).clone();
            if !p.given.contains_key(&port.id) {
                let (consumer, memfd) = ring::create(slots, "vrdma-shm-ring")
                    .map_err(|e| io::Error::other(e.to_string()))?;
                let event = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
                let m = Message::Ring {
                    port: port.id as u32,
                    slots,
                }
                .emit();
                // (SCM_RIGHTS gives the peer descriptors of its own.)
                send(&p.sock, &m, &[memfd.as_raw_fd(), event.as_fd().as_raw_fd()])?;
                port.epoll
                    .add(&event, EpollEvent::new(EpollFlags::EPOLLIN, 2))?;
                let ring = InRing {
                    consumer,
                    event,
                    link: Arc::clone(&p.link),
                    allowed: (u64::MAX, Arc::new(Vec::new())),
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
        let live: Vec<u64> = ports.iter().map(|p| p.id).collect();
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
        for (out, held) in p.remote.values() {
            self.release(out.id, held);
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
/// (owned: closed if the message is refused). A message longer than
/// `buf` is an error (`MSG_TRUNC`).
fn recv(sock: &OwnedFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> nix::Result<usize> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([i32; 4]);
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
    )?;
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            fds.extend(raw.into_iter().map(sys::owned));
        }
    }
    if msg
        .flags
        .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC)
    {
        return Err(nix::errno::Errno::EMSGSIZE);
    }
    Ok(msg.bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_anything_else_is_refused() {
        let all = [
            (Message::Hello { id: 7 }, 0),
            (
                Message::Ring {
                    port: 3,
                    slots: 512,
                },
                2,
            ),
            (
                Message::Gids {
                    port: 3,
                    gids: vec![Gid([1; 16]), Gid([2; 16])],
                },
                0,
            ),
            (
                Message::Gids {
                    port: 3,
                    gids: vec![],
                },
                0,
            ),
            (Message::Gone { port: 3 }, 0),
        ];
        for (m, fds) in &all {
            assert_eq!(Message::parse(&m.emit(), *fds).as_ref(), Ok(m));
            let bytes = m.emit();
            // Cut short, or one byte more: refused.
            assert!(Message::parse(&bytes[..bytes.len() - 1], *fds).is_err());
            let mut long = bytes.clone();
            long.push(0);
            assert!(Message::parse(&long, *fds).is_err());
            // The wrong number of descriptors: refused.
            assert!(Message::parse(&bytes, fds + 1).is_err());
        }
        let mut hello = Message::Hello { id: 1 }.emit();
        hello[4] ^= 1;
        assert_eq!(Message::parse(&hello, 0), Err(ProtocolError::Magic));
        assert_eq!(
            Message::parse(&[9, 0, 0, 0], 0),
            Err(ProtocolError::Kind(9))
        );
        let mut many = Message::Gids {
            port: 0,
            gids: vec![],
        }
        .emit();
        many[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Message::parse(&many, 0).is_err());
        assert!(Message::parse(&[], 0).is_err());
        assert!(Message::parse(&vec![0; MAX_MESSAGE + 1], 0).is_err());
    }
}
