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
//!
//! | module | what |
//! |---|---|
//! | `mod.rs` | joining: the rendezvous directory opened, this daemon's socket bound in it, the thread started ([`Switch::join`]); who is admitted and trusted |
//! | `message` | the protocol's messages, decoded and emitted |
//! | `grant` | what root grants a user's daemons: the grant files |
//! | `link` | a peer daemon as the devices see it, and the two ends of a ring |
//! | `runner` | the rendezvous thread: the peers, their messages, what each is told |

use std::{
    fs, io,
    os::fd::{AsRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    thread::JoinHandle,
};

use nix::{
    fcntl::{AtFlags, OFlag, openat, renameat},
    sys::{
        eventfd::{EfdFlags, EventFd},
        socket::{AddressFamily, SockFlag, SockType, UnixAddr, bind, listen, socket},
        stat::{FchmodatFlags, Mode, fchmodat, fstat, mkdirat},
    },
    unistd::{UnlinkatFlags, fchownat, unlinkat},
};

use super::Switch;

mod grant;
mod link;
mod message;
mod runner;

pub use grant::{GRANTS, Grant, GrantError, write_grant};
pub(super) use link::{InRing, Outbound};
pub use message::{Message, ProtocolError};
use runner::Runner;

/// Slots a ring may have at most when a peer offers one (about 4 MiB at
/// 1024).
const MAX_PEER_SLOTS: u32 = 1024;

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
        let mut r = Runner::new(
            self,
            config,
            rdv,
            listener,
            notify,
            Arc::clone(&stop),
            Arc::clone(&stats),
        );
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
