//! Devices of different daemons on one host: a rendezvous directory of
//! UNIX sockets where each daemon's switch listens, and rings
//! ([`super::ring`]) between them.
//!
//! A daemon that joins ([`Switch::join`]) binds `DIR/<pid>-<n>.sock`, connects
//! to every socket already there, and accepts whoever connects later; a
//! peer must pass the admission check (its `SO_PEERCRED`: the daemon's own
//! user, root, or a user or group the daemon names) on both sides. Over
//! each connection (`SOCK_SEQPACKET`, a message a datagram) each daemon
//! says which named networks its devices are on (`NETS`) and tells the
//! other, for each of its devices on a network both have, a ring to write
//! that device's packets into (`RING`, naming the network, with the ring's
//! sealed memfd and an eventfd to wake the device by `SCM_RIGHTS`) and the
//! addresses the device holds (`GIDS`, again whenever they change; `GONE`
//! when the device goes). The receiving daemon's switch then reaches those
//! addresses, on that network, through the ring; the device that reads a
//! ring takes from it only packets whose source is an address the ring's
//! daemon holds on the device's network and whose destination is its own.
//!
//! **Who a peer is, and what it may claim**, come from the kernel and from
//! root, never from the peer: its identity is its process (`SO_PEERCRED`'s
//! pid) with the instance number its HELLO gives (several switches of one
//! process), so that no process can pass for another and a second
//! connection for a live identity is refused; and a peer that is neither
//! root nor this daemon's own user may announce a device only on a network
//! and at addresses its user was granted ([`write_grant`]: a file per user
//! in `DIR/grants/`, which root writes — `vrdma serve` does, for the user
//! it becomes, before it drops its privileges — and which the peer cannot
//! write). Anything else is refused and counted; the rest of the peer's
//! devices go on.
//!
//! What crosses is packets, never guest memory: a peer daemon learns
//! nothing but what a device sends it, as a peer on the network would —
//! the reason the design does not map each other's guest memory (see
//! docs/same-host.md). A peer that lies (a message out of shape, a ring
//! unsealed or of the wrong size, an eventfd that is not one, indices from
//! nowhere) loses its connection or the ring; nothing it sends reaches a
//! device unchecked.

use std::{
    collections::{HashMap, HashSet},
    ffi::OsStr,
    fs,
    io::{self, IoSlice, Read},
    net::IpAddr,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use nix::{
    fcntl::{AtFlags, FcntlArg, OFlag, fcntl, openat, renameat},
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::{
        epoll::{EpollEvent, EpollFlags},
        eventfd::{EfdFlags, EventFd},
        socket::{
            AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, bind, connect,
            getsockopt, listen, sendmsg, socket, sockopt::PeerCredentials,
        },
        stat::{FchmodatFlags, Mode, fchmodat, fstat, mkdirat},
    },
    unistd::{UnlinkatFlags, fchownat, unlinkat},
};
use vrdma_sys::sock::{Accepted, Acceptor};
use vrdma_wire::{Gid, frame::Route};

use super::{
    Dest, Directory, NetId, PortShared, Stats, Switch, check_network_name, lock, ring, sys, write,
};
use crate::{Lender, Piece};

/// The protocol's first message: magic, version, the switch's instance.
const MAGIC: u64 = u64::from_le_bytes(*b"VRDMASHM");
/// 2: networks (NETS, and the network of each RING); identities from the
/// kernel.
const VERSION: u32 = 2;
const HELLO: u32 = 1;
const RING: u32 = 2;
const GIDS: u32 = 3;
const GONE: u32 = 4;
const NETS: u32 = 5;
/// Addresses one device announces at most (a GID table's worth).
const MAX_GIDS: usize = 128;
/// Networks one daemon announces at most.
const MAX_NETS: usize = 64;
/// A message's bytes at most: a GIDS of [`MAX_GIDS`] addresses, or a NETS
/// of [`MAX_NETS`] names.
const MAX_MESSAGE: usize = {
    let gids = 12 + 16 * MAX_GIDS;
    let nets = 8 + MAX_NETS * (1 + super::MAX_NETWORK_NAME);
    if gids > nets { gids } else { nets }
};
/// Peers a daemon keeps at most, of them from one user (root too), and
/// devices of one peer.
const MAX_PEERS: usize = 64;
const MAX_PEERS_PER_USER: usize = 16;
const MAX_PEER_PORTS: usize = 64;
/// How long a connection may go without its HELLO (a peer slot held by
/// one that never speaks is given back).
const HELLO_WITHIN: Duration = Duration::from_secs(5);
/// Slots a ring may have at most when a peer offers one (about 4 MiB at
/// 1024).
const MAX_PEER_SLOTS: u32 = 1024;
/// GIDS a peer may send in a burst, and then per second: each one changes
/// the switch's directory, which every device's cached routes follow. One
/// beyond them waits (the latest for each device) until the peer's
/// allowance comes back; none is lost.
const GIDS_BURST: f64 = 64.0;
const GIDS_PER_SECOND: f64 = 16.0;
/// A grant file's bytes at most.
const MAX_GRANT: u64 = 64 << 10;
/// The subdirectory of the rendezvous directory that holds the grants.
pub const GRANTS: &str = "grants";

/// A message of the rendezvous protocol, decoded from a copy of its
/// bytes (and the number of descriptors that came with it).
#[derive(Clone, Debug, Eq, PartialEq)]
pub enum Message {
    /// The switch's instance within its process (magic and version
    /// checked): with the process's id from the kernel, the peer's
    /// identity.
    Hello { id: u64 },
    /// The named networks the sender's devices are on.
    Nets { names: Vec<String> },
    /// A ring into the sender's device `port`, on network `net`, of
    /// `slots` slots (its memfd and its eventfd came with it).
    Ring { port: u32, slots: u32, net: String },
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
    #[error("{0} networks")]
    TooManyNets(usize),
    #[error("a network name that is not one")]
    NetworkName,
}

/// Reads a length-prefixed network name at `m[at..]`: the name and the
/// offset after it.
fn name_at(m: &[u8], at: usize) -> Result<(String, usize), ProtocolError> {
    let len = usize::from(*m.get(at).ok_or(ProtocolError::Length(m.len()))?);
    let bytes = m
        .get(at + 1..at + 1 + len)
        .ok_or(ProtocolError::Length(m.len()))?;
    let name = std::str::from_utf8(bytes).map_err(|_| ProtocolError::NetworkName)?;
    check_network_name(name).map_err(|_| ProtocolError::NetworkName)?;
    Ok((name.to_owned(), at + 1 + len))
}

fn push_name(m: &mut Vec<u8>, name: &str) {
    // Names are checked (at most 32 bytes) before they are sent.
    m.push(name.len().min(usize::from(u8::MAX)) as u8);
    m.extend_from_slice(name.as_bytes());
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
            RING => (m.len() >= 14, 2),
            GIDS => (m.len() >= 12, 0),
            GONE => (m.len() == 8, 0),
            NETS => (m.len() >= 8, 0),
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
            RING => {
                let (net, end) = name_at(m, 12)?;
                if end != m.len() {
                    return Err(ProtocolError::Length(m.len()));
                }
                Message::Ring {
                    port: u32_at(4),
                    slots: u32_at(8),
                    net,
                }
            }
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
            NETS => {
                let n = u32_at(4) as usize;
                if n > MAX_NETS {
                    return Err(ProtocolError::TooManyNets(n));
                }
                let mut names = Vec::with_capacity(n);
                let mut at = 8;
                for _ in 0..n {
                    let (name, next) = name_at(m, at)?;
                    names.push(name);
                    at = next;
                }
                if at != m.len() {
                    return Err(ProtocolError::Length(m.len()));
                }
                Message::Nets { names }
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
            Message::Nets { names } => {
                m.extend_from_slice(&NETS.to_le_bytes());
                m.extend_from_slice(&(names.len() as u32).to_le_bytes());
                for n in names {
                    push_name(&mut m, n);
                }
            }
            Message::Ring { port, slots, net } => {
                m.extend_from_slice(&RING.to_le_bytes());
                m.extend_from_slice(&port.to_le_bytes());
                m.extend_from_slice(&slots.to_le_bytes());
                push_name(&mut m, net);
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

/// Which peers may announce any address on a network both have, and who
/// writes the grants of the others.
#[derive(Clone, Debug)]
pub struct Trust {
    /// Users whose daemons are trusted with any address (root and the
    /// daemon's own user: either could do anything to this daemon
    /// already).
    pub uids: Vec<u32>,
    /// The owner a grant file and its directory must have: root.
    pub grant_owner: u32,
}

impl Default for Trust {
    fn default() -> Self {
        Trust {
            uids: vec![0, nix::unistd::geteuid().as_raw()],
            grant_owner: 0,
        }
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
    pub trust: Trust,
}

impl JoinConfig {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        JoinConfig {
            dir: dir.into(),
            slots: 512,
            admit: Admit::default(),
            trust: Trust::default(),
        }
    }
}

/// What the rendezvous did, for logs, `vrdma stat` and tests.
#[derive(Debug, Default)]
pub struct RendezvousStats {
    /// Peers connected now.
    pub peers: AtomicU64,
    /// Connections refused (admission, too many, a second connection for
    /// a live identity) or dropped for a protocol error.
    pub refused: AtomicU64,
    /// Of those, connections for an identity already connected.
    pub duplicates: AtomicU64,
    /// Rings a peer offered that were refused (unsealed, wrong size, not
    /// an eventfd, too many).
    pub bad_rings: AtomicU64,
    /// Rings a peer offered for a device on a network it was not granted,
    /// or one this daemon does not have.
    pub networks_refused: AtomicU64,
    /// Addresses a peer announced that another device of the network
    /// already held.
    pub gid_conflicts: AtomicU64,
    /// Addresses a peer announced that its user was not granted.
    pub claims_refused: AtomicU64,
    /// GIDS held back by the rate limit (applied later, the latest of each
    /// device).
    pub gids_deferred: AtomicU64,
}

impl RendezvousStats {
    /// The counters by name (`rendezvous.*` in `vrdma stat`).
    pub fn fields(&self) -> [(&'static str, u64); 8] {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("peers", l(&self.peers)),
            ("refused", l(&self.refused)),
            ("duplicates", l(&self.duplicates)),
            ("bad_rings", l(&self.bad_rings)),
            ("networks_refused", l(&self.networks_refused)),
            ("gid_conflicts", l(&self.gid_conflicts)),
            ("claims_refused", l(&self.claims_refused)),
            ("gids_deferred", l(&self.gids_deferred)),
        ]
    }
}

/// What a user's daemons may announce: for each network, its addresses.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct Grant(pub HashMap<String, Vec<Gid>>);

/// Why a grant file is not taken.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    #[error("line {line}: {what}")]
    Syntax { line: usize, what: &'static str },
    #[error("grant {path}: {what}")]
    Unsafe { path: PathBuf, what: &'static str },
    #[error("grant {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl Grant {
    /// Parses a grant file: a line per network, `NETWORK ADDRESS…`
    /// (IPv4 or IPv6), `#` comments and blank lines ignored.
    pub fn parse(text: &str) -> Result<Grant, GrantError> {
        let mut g = Grant::default();
        for (i, line) in text.lines().enumerate() {
            let err = |what| GrantError::Syntax { line: i + 1, what };
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_ascii_whitespace();
            let net = words.next().ok_or(err("no network"))?;
            check_network_name(net).map_err(|_| err("not a network name"))?;
            let addrs = g.0.entry(net.to_owned()).or_default();
            for w in words {
                let a: IpAddr = w.parse().map_err(|_| err("not an address"))?;
                if addrs.len() >= MAX_GIDS {
                    return Err(err("too many addresses"));
                }
                addrs.push(Gid::from(a));
            }
        }
        Ok(g)
    }

    fn emit(entries: &[(String, Vec<Gid>)]) -> String {
        let mut t = String::from("# vrdma rendezvous grant: NETWORK ADDRESS...\n");
        for (net, addrs) in entries {
            t.push_str(net);
            for a in addrs {
                t.push(' ');
                t.push_str(&a.ip().to_string());
            }
            t.push('\n');
        }
        t
    }

    fn allows(&self, net: &str, gid: &Gid) -> bool {
        self.0.get(net).is_some_and(|a| a.contains(gid))
    }
}

/// A directory opened without following a link, that must be `owner`'s
/// and written by nobody else.
fn open_private_dir(at: BorrowedFd<'_>, name: &Path, owner: u32) -> Result<OwnedFd, GrantError> {
    let path = name.to_path_buf();
    let fd = openat(
        at,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| GrantError::Io {
        path: path.clone(),
        source: e.into(),
    })?;
    let st = fstat(&fd).map_err(|e| GrantError::Io {
        path: path.clone(),
        source: e.into(),
    })?;
    if st.st_uid != owner || st.st_mode & 0o022 != 0 {
        return Err(GrantError::Unsafe {
            path,
            what: "not its owner's, or written by others",
        });
    }
    Ok(fd)
}

/// The rendezvous directory `dir`, opened: a directory (not a link) of
/// root's or this user's, and if anyone may write it, sticky (so that no
/// member can remove or rename what another put there).
fn open_rendezvous(dir: &Path) -> io::Result<OwnedFd> {
    let fd = nix::fcntl::open(
        dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| {
        let e = io::Error::from(e);
        io::Error::new(e.kind(), format!("opening {}: {e}", dir.display()))
    })?;
    let st = fstat(&fd)?;
    let me = nix::unistd::geteuid().as_raw();
    if st.st_uid != 0 && st.st_uid != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{}: neither root's nor this user's", dir.display()),
        ));
    }
    if st.st_mode & 0o002 != 0 && st.st_mode & 0o1000 == 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{}: anyone may write it and it is not sticky (chmod +t)",
                dir.display()
            ),
        ));
    }
    Ok(fd)
}

/// Writes what user `uid`'s daemons may announce on the rendezvous
/// directory `dir`: for each network, its addresses. Root does this (the
/// grants directory and files must be root's, written by nobody else:
/// [`Trust::grant_owner`]) — `vrdma serve` for the user it becomes, before
/// it drops its privileges. The file is replaced whole (written aside,
/// then renamed), never through a link.
pub fn write_grant(dir: &Path, uid: u32, entries: &[(String, Vec<Gid>)]) -> io::Result<()> {
    for (net, _) in entries {
        check_network_name(net).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    }
    let rdv = open_rendezvous(dir)?;
    match mkdirat(&rdv, GRANTS, Mode::from_bits_truncate(0o755)) {
        Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
        Err(e) => return Err(e.into()),
    }
    let me = nix::unistd::geteuid().as_raw();
    let grants = open_private_dir(rdv.as_fd(), Path::new(GRANTS), me).map_err(io::Error::other)?;
    let name = uid.to_string();
    let tmp = format!(".{name}.{}", std::process::id());
    let _ = unlinkat(&grants, tmp.as_str(), UnlinkatFlags::NoRemoveDir);
    let fd = openat(
        &grants,
        tmp.as_str(),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o644),
    )?;
    let mut f = fs::File::from(fd);
    io::Write::write_all(&mut f, Grant::emit(entries).as_bytes())?;
    drop(f);
    renameat(&grants, tmp.as_str(), &grants, name.as_str())?;
    Ok(())
}

/// What user `uid` was granted on the rendezvous directory `dir` (opened as
/// `rdv`): `None` when there is no grant, or none that is safe to read (a
/// file that is not the grant owner's, or that others may write).
fn read_grant(rdv: BorrowedFd<'_>, uid: u32, owner: u32) -> Option<Grant> {
    let grants = match open_private_dir(rdv, Path::new(GRANTS), owner) {
        Ok(g) => g,
        Err(GrantError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return None;
        }
        Err(e) => {
            tracing::warn!(error = %e, "shm rendezvous: grants not read");
            return None;
        }
    };
    let name = uid.to_string();
    let fd = openat(
        &grants,
        name.as_str(),
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let st = fstat(&fd).ok()?;
    let regular = st.st_mode & nix::libc::S_IFMT == nix::libc::S_IFREG;
    if !regular || st.st_uid != owner || st.st_mode & 0o022 != 0 || st.st_size as u64 > MAX_GRANT {
        tracing::warn!(uid, "shm rendezvous: a grant file that is not safe to read");
        return None;
    }
    let mut text = String::new();
    fs::File::from(fd)
        .take(MAX_GRANT)
        .read_to_string(&mut text)
        .ok()?;
    match Grant::parse(&text) {
        Ok(g) => Some(g),
        Err(e) => {
            tracing::warn!(uid, error = %e, "shm rendezvous: a grant file refused");
            None
        }
    }
}

/// A daemon on the other side of a connection, as the devices that read
/// its rings and write into them see it.
#[derive(Debug)]
pub(super) struct Link {
    /// Its connection is gone: its rings are read to their end, then
    /// dropped.
    pub(super) gone: AtomicBool,
    /// The addresses it holds, by network (its devices' accepted
    /// announcements).
    allowed: Mutex<Arc<HashSet<(NetId, Gid)>>>,
    /// Bumped with `allowed`.
    generation: AtomicU64,
}

impl Link {
    fn new() -> Arc<Self> {
        Arc::new(Link {
            gone: AtomicBool::new(false),
            allowed: Mutex::new(Arc::new(HashSet::new())),
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
    /// The network of the device it was made for.
    net: NetId,
    /// Written by the peer (or by the device itself when it arms with
    /// packets waiting); in the device's epoll.
    event: EventFd,
    link: Arc<Link>,
    /// The peer's addresses as last read, and the generation read.
    allowed: (u64, Arc<HashSet<(NetId, Gid)>>),
    /// The last source found in `allowed` (a ring's packets mostly come
    /// from one address: no hash per packet), forgotten with it.
    last_src: Option<Gid>,
}

/// Records one [`InRing::receive`] looks at beyond its budget of delivered
/// packets, as multiples of it: refused records (a peer's junk) do not eat
/// the device's batch, but cannot keep it reading one ring for ever.
const REFUSED_PER_BUDGET: usize = 4;

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

    /// Delivers up to `budget` packets, each copied into `buf` and handed
    /// to `deliver` if its source is an address the peer holds on the
    /// ring's network and its destination one of `local`; the others are
    /// counted and do not count against `budget` (at most
    /// [`REFUSED_PER_BUDGET`] × `budget` of them a call). Returns the
    /// packets delivered.
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
            self.last_src = None;
        }
        let (mut n, mut refused, mut taken) = (0, 0, false);
        while n < budget && refused < REFUSED_PER_BUDGET * budget {
            match self.consumer.pop(buf) {
                Ok(r) => {
                    taken = true;
                    let src = r.route.src;
                    let allowed = self.last_src == Some(src)
                        || self.allowed.1.contains(&(self.net, src)) && {
                            self.last_src = Some(src);
                            true
                        };
                    if !allowed || !local.contains(&r.route.dst) {
                        stats.rx_refused += 1;
                        refused += 1;
                        continue;
                    }
                    n += 1;
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
        if taken {
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

/// Binds a listening socket called `name` in the rendezvous directory
/// `rdv` (at `dir`), of `mode` and, when given, group `group`, with no
/// step a member of the directory could turn against this daemon: the
/// socket is made in a fresh directory of this daemon's own (mode 0700,
/// reached through its descriptor, so that renaming it away changes
/// nothing), its mode and group are set there, and it is renamed into the
/// rendezvous directory whole.
fn bind_listener(
    rdv: &OwnedFd,
    dir: &Path,
    name: &str,
    mode: u32,
    group: Option<u32>,
) -> io::Result<(OwnedFd, PathBuf)> {
    let private = format!(".{name}.{:x}", rand_u64());
    mkdirat(rdv, private.as_str(), Mode::from_bits_truncate(0o700))?;
    let done = (|| {
        let pd = openat(
            rdv,
            private.as_str(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        let st = fstat(&pd)?;
        if st.st_uid != nix::unistd::geteuid().as_raw() || st.st_mode & 0o077 != 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the private directory is not this daemon's",
            ));
        }
        let listener = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )?;
        let inside = format!("/proc/self/fd/{}/{name}", pd.as_raw_fd());
        bind(listener.as_raw_fd(), &UnixAddr::new(inside.as_str())?)?;
        fchmodat(
            &pd,
            name,
            Mode::from_bits_truncate(mode),
            FchmodatFlags::FollowSymlink,
        )?;
        if let Some(g) = group {
            fchownat(
                &pd,
                name,
                None,
                Some(nix::unistd::Gid::from_raw(g)),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )?;
        }
        let _ = unlinkat(rdv, name, UnlinkatFlags::NoRemoveDir);
        renameat(&pd, name, rdv, name)?;
        Ok(listener)
    })();
    let _ = unlinkat(rdv, private.as_str(), UnlinkatFlags::RemoveDir);
    Ok((done?, dir.join(name)))
}

impl Switch {
    /// Joins the rendezvous directory `config.dir`: this switch's devices
    /// and those of every daemon there (and of those that come later)
    /// reach each other through rings, network by network. The directory
    /// must exist, be root's or this user's, and be sticky if anyone may
    /// write it; who may create sockets in it, and connect to them, decides
    /// who may join (see [`Admit`] for what each side checks on top, and
    /// [`Trust`] for what a peer may announce).
    pub fn join(&self, config: JoinConfig) -> io::Result<Rendezvous> {
        if config.slots == 0 || config.slots > MAX_PEER_SLOTS || !config.slots.is_power_of_two() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "ring slots: a power of two, 1 to 1024",
            ));
        }
        let rdv = open_rendezvous(&config.dir)?;
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "{}-{}.sock",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let mode = if config.admit.gids.is_empty() {
            0o600
        } else {
            0o660
        };
        let (listener, path) = bind_listener(
            &rdv,
            &config.dir,
            &name,
            mode,
            config.admit.gids.first().copied(),
        )?;
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
        let _ = self.inner.rendezvous.set(Arc::clone(&stats));
        let mut r = Runner {
            switch: self.clone(),
            dir: Arc::clone(&self.inner),
            config,
            rdv,
            me: (std::process::id(), rand_u64()),
            listener,
            acceptor: Acceptor::new(),
            notify,
            stop: Arc::clone(&stop),
            peers: Vec::new(),
            stats: Arc::clone(&stats),
        };
        r.connect_existing(&name);
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

/// A number no other switch of this process is likely to have (its
/// instance, with the pid the kernel gives: the identity that settles two
/// daemons connecting to each other at once).
fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static N: AtomicU64 = AtomicU64::new(0);
    // RandomState is keyed from the system's randomness for each process.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(N.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

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

struct Runner {
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
    /// Connects to every socket of the directory but `own`.
    fn connect_existing(&mut self, own: &str) {
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

    fn run(mut self) {
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
    fn message(&mut self, i: usize, m: &[u8], mut fds: Vec<OwnedFd>) -> bool {
        let msg = match Message::parse(m, fds.len()) {
            Ok(msg) => msg,
            Err(e) => {
                tracing::warn!(error = %e, pid = self.peers[i].pid, "shm rendezvous: a peer's message refused");
                return false;
            }
        };
        match (msg, self.peers[i].id) {
            (Message::Hello { id }, None) => {
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
            (Message::Nets { names }, Some(_)) => {
                self.peers[i].nets = names;
                true
            }
            (Message::Ring { port, slots, net }, Some(_)) => {
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
                    net: "tenant-a".into(),
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
            (
                Message::Nets {
                    names: vec!["a".into(), "tenant-b.2".into()],
                },
                0,
            ),
            (Message::Nets { names: vec![] }, 0),
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
        // Network names: only the checked ones, whole.
        for bad in ["", "a b", "x/y", &"n".repeat(33)] {
            let mut m = Message::Nets { names: vec![] }.emit();
            m[4..8].copy_from_slice(&1u32.to_le_bytes());
            m.push(bad.len() as u8);
            m.extend_from_slice(bad.as_bytes());
            assert!(Message::parse(&m, 0).is_err(), "{bad:?}");
        }
        let mut ring = Message::Ring {
            port: 1,
            slots: 8,
            net: "n".into(),
        }
        .emit();
        ring[12] = 5;
        assert!(
            Message::parse(&ring, 2).is_err(),
            "a name longer than the message"
        );
    }

    #[test]
    fn grants_parse_strictly() {
        let g = Grant::parse("# a comment\n\ntenant-a 10.0.0.5 fd00::5 # trailing\ntenant-b\n")
            .unwrap();
        assert_eq!(
            g.0.get("tenant-a"),
            Some(&vec![
                Gid::from("10.0.0.5".parse::<IpAddr>().unwrap()),
                Gid::from("fd00::5".parse::<IpAddr>().unwrap()),
            ])
        );
        assert_eq!(g.0.get("tenant-b"), Some(&vec![]));
        assert!(g.allows(
            "tenant-a",
            &Gid::from("10.0.0.5".parse::<IpAddr>().unwrap())
        ));
        assert!(!g.allows(
            "tenant-b",
            &Gid::from("10.0.0.5".parse::<IpAddr>().unwrap())
        ));
        for bad in ["bad/name 10.0.0.1", "n 10.0.0.256", "n not-an-address"] {
            assert!(Grant::parse(bad).is_err(), "{bad:?}");
        }
        let emitted = Grant::emit(&[(
            "n".into(),
            vec![Gid::from("10.1.2.3".parse::<IpAddr>().unwrap())],
        )]);
        assert_eq!(
            Grant::parse(&emitted).unwrap().0.get("n").map(Vec::len),
            Some(1)
        );
    }
}
