//! The UNIX socket a vfio-user client connects to, and both ends of a
//! connection on it: whole messages in with the descriptors that came with
//! them, replies out with at most one.
//!
//! The server's end, [`Connection`], never blocks: it takes what the
//! socket holds whenever its event loop says so, keeping at most one
//! message (at most [`proto::MAX_MESSAGE`] bytes and [`proto::MAX_FDS`]
//! descriptors) between turns, and a reply the client does not take at
//! once waits in it — while it waits, nothing more is read from the
//! client, so a client that sends without reading is held back rather
//! than buffered for. A message must arrive whole, and a reply be taken,
//! within [`SocketConfig::deadline`] of its first byte; a client that is
//! slower is dropped (QEMU sends each message in one call and waits for
//! its reply). So a client can hold neither the device's thread nor its
//! memory. [`Client`] is the client's end, blocking, for tests and tools.
//!
//! The socket is private: its file is 0600 (0660 when a group is allowed),
//! and a peer whose credentials (`SO_PEERCRED`) are not allowed is closed
//! at once, counted. Descriptors are received and connections accepted
//! the way every socket of the daemon does (`vrdma_sys::sock`): room for
//! the kernel's maximum of descriptors, every one owned; a shortage of
//! descriptors or memory waited out, never the listener's end.

use std::{
    io::{self, IoSlice},
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd},
        unix::net::{UnixListener, UnixStream},
    },
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use nix::{
    fcntl::{AT_FDCWD, AtFlags},
    sys::socket::{
        self, AddressFamily, Backlog, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr,
        sockopt,
    },
    unistd::{Gid, Uid, fchownat, geteuid},
};
use vrdma_sys::sock::{Accepted, Acceptor};
use zerocopy::FromBytes;

use crate::proto::{self, Header};

/// How a listening socket treats its clients.
#[derive(Clone, Debug)]
pub struct SocketConfig {
    /// How long a message may take to arrive, from its first byte, and a
    /// reply to be taken by the client, from when it was ready; a client
    /// that is slower is dropped. QEMU sends a message in one call and
    /// reads its reply at once; [`DEADLINE`] by default.
    pub deadline: Duration,
    /// Users whose processes may connect (the peer's effective uid when it
    /// connected): by default this process's effective user, and root.
    pub allowed_uids: Vec<u32>,
    /// Groups whose processes may connect (the peer's effective gid when
    /// it connected; not its supplementary groups): none by default. With
    /// any, the socket file is 0660 and belongs to the first (which this
    /// process must be allowed to give it); without, 0600.
    pub allowed_gids: Vec<u32>,
}

impl Default for SocketConfig {
    fn default() -> Self {
        let mut allowed_uids = vec![geteuid().as_raw(), 0];
        allowed_uids.dedup();
        SocketConfig {
            deadline: DEADLINE,
            allowed_uids,
            allowed_gids: Vec::new(),
        }
    }
}

/// The default [`SocketConfig::deadline`].
pub const DEADLINE: Duration = Duration::from_secs(1);

/// How long a [`Client`] waits for a reply, or for room to send, before it
/// gives up (a test fails rather than hangs).
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections looked at in one [`Listener::accept`] (peers turned away
/// do not count against the next turn).
const ACCEPTS_PER_CALL: usize = 16;

/// A listening UNIX socket at `path` whose file only the peers `config`
/// allows can connect to: mode 0600, owned by the first allowed user that
/// is neither this process's nor root (QEMU's, when the daemon runs as
/// another user), or 0660 with the first allowed group. A socket file left
/// there by an earlier run is replaced only if nothing accepts connections
/// on it. Non-blocking, close-on-exec.
///
/// The file gets its owner and mode after `bind` and before `listen`:
/// until then nothing can connect to it (ECONNREFUSED), so it is never
/// connectable with a wider mode; the process's umask, which other threads
/// share, is left alone. Someone who can write to the directory could swap
/// the file in that moment, as they could at any time after.
pub fn bind_private(path: &Path, config: &SocketConfig) -> io::Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} is served by another process", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    socket::bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    let private = || -> io::Result<()> {
        let me = geteuid().as_raw();
        let owner = config
            .allowed_uids
            .iter()
            .copied()
            .find(|&u| u != me && u != 0)
            .map(Uid::from_raw);
        let group = config.allowed_gids.first().copied().map(Gid::from_raw);
        if owner.is_some() || group.is_some() {
            fchownat(AT_FDCWD, path, owner, group, AtFlags::AT_SYMLINK_NOFOLLOW)?;
        }
        let mode = if group.is_some() { 0o660 } else { 0o600 };
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))?;
        socket::listen(&fd, Backlog::MAXCONN)?;
        Ok(())
    };
    if let Err(e) = private() {
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(UnixListener::from(fd))
}

impl SocketConfig {
    /// Whether the peer of `stream` may use the socket (its credentials
    /// when it connected); `Err` when they cannot be read.
    pub fn allows_peer(&self, stream: &UnixStream) -> io::Result<bool> {
        let c = socket::getsockopt(stream, sockopt::PeerCredentials)?;
        Ok(self.allows(c.uid(), c.gid()))
    }

    fn allows(&self, uid: u32, gid: u32) -> bool {
        self.allowed_uids.contains(&uid) || self.allowed_gids.contains(&gid)
    }
}

/// A listening socket at a path.
#[derive(Debug)]
pub struct Listener {
    listener: UnixListener,
    path: PathBuf,
    config: SocketConfig,
    /// Its accepts, shortages waited out.
    acceptor: Acceptor,
    /// Peers turned away (credentials not allowed).
    refused: u64,
}

impl Listener {
    /// Listens at `path`, a socket file only the peers `config` allows can
    /// connect to ([`bind_private`]).
    pub fn bind(path: &Path, config: &SocketConfig) -> io::Result<Self> {
        Ok(Listener {
            listener: bind_private(path, config)?,
            path: path.to_owned(),
            config: config.clone(),
            acceptor: Acceptor::new(),
            refused: 0,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A client that is waiting and allowed, if any; peers not allowed are
    /// closed at once (no reply), counted and logged. A shortage of
    /// descriptors or memory is waited out ([`vrdma_sys::sock::Acceptor`]):
    /// `None` meanwhile, and the listener is not to be watched until
    /// [`Listener::retry_at`] — its connection stays queued, and readable.
    pub fn accept(&mut self) -> io::Result<Option<Connection>> {
        for _ in 0..ACCEPTS_PER_CALL {
            let accepted = self
                .acceptor
                .accept(Instant::now(), || self.listener.accept())?;
            let stream = match accepted {
                Accepted::Conn((stream, _)) => stream,
                Accepted::Nothing | Accepted::Later(_) => return Ok(None),
            };
            match socket::getsockopt(&stream, sockopt::PeerCredentials) {
                Ok(c) if self.config.allows(c.uid(), c.gid()) => {
                    return Connection::new(stream, self.config.deadline).map(Some);
                }
                Ok(c) => {
                    self.refused += 1;
                    tracing::warn!(
                        socket = %self.path.display(),
                        uid = c.uid(),
                        gid = c.gid(),
                        pid = c.pid(),
                        "a peer not allowed was turned away"
                    );
                }
                Err(e) => {
                    self.refused += 1;
                    tracing::warn!(socket = %self.path.display(), error = %e, "a peer without credentials was turned away");
                }
            }
        }
        Ok(None)
    }

    /// Whether the event loop is to watch the listener at `now` (not while
    /// a shortage is waited out: it would be readable all along).
    pub fn watching(&self, now: Instant) -> bool {
        self.acceptor.watching(now)
    }

    /// While a shortage is waited out, when [`Listener::accept`] is to be
    /// called again (whether or not the listener is readable).
    pub fn retry_at(&self) -> Option<Instant> {
        self.acceptor.retry_at()
    }

    /// Shortages of descriptors or memory met accepting.
    pub fn shortages(&self) -> u64 {
        self.acceptor.shortages()
    }

    /// Peers turned away since the start.
    pub fn refused(&self) -> u64 {
        self.refused
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.listener.as_fd()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A message as it arrived.
#[derive(Debug)]
pub struct Message {
    pub header: Header,
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// What [`Connection::receive`] found.
#[derive(Debug)]
pub enum Received {
    /// A whole message.
    Message(Message),
    /// Nothing whole yet (or a reply is waiting to be taken): what came is
    /// kept for the next call.
    Pending,
    /// The client closed the connection between messages.
    Closed,
}

/// The server's end of a connected client: non-blocking.
#[derive(Debug)]
pub struct Connection {
    stream: UnixStream,
    inbox: Inbox,
    outbox: Option<Outbox>,
    deadline: Duration,
}

/// A reply the socket has not taken whole yet.
#[derive(Debug)]
struct Outbox {
    bytes: Vec<u8>,
    sent: usize,
    /// Goes with the first byte.
    fd: Option<Arc<OwnedFd>>,
    since: Instant,
}

impl Connection {
    /// Over a connected stream (a test may pass one end of a pair); a
    /// message or a reply may take `deadline`.
    pub fn new(stream: UnixStream, deadline: Duration) -> io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(Connection {
            stream,
            inbox: Inbox::default(),
            outbox: None,
            deadline,
        })
    }

    /// Takes what the client sent, up to the end of one message (never a
    /// byte of the next), without blocking. Nothing is read while a reply
    /// waits. An error ends the connection: a malformed header, a message
    /// over [`proto::MAX_MESSAGE`], more than [`proto::MAX_FDS`]
    /// descriptors (all of them closed), a message cut off.
    pub fn receive(&mut self, now: Instant) -> io::Result<Received> {
        if self.outbox.is_some() {
            return Ok(Received::Pending);
        }
        match self.inbox.fill(self.stream.as_fd(), now) {
            Ok(Fill::Message(m)) => Ok(Received::Message(m)),
            Ok(Fill::Closed) => Ok(Received::Closed),
            Ok(Fill::WouldBlock) => Ok(Received::Pending),
            Err(e) => {
                self.inbox = Inbox::default();
                Err(e)
            }
        }
    }

    /// Queues a reply (with at most one descriptor) and sends what the
    /// socket takes now; [`Connection::flush`] sends the rest. One reply
    /// at a time: the next message is read only once it is gone.
    pub fn send(
        &mut self,
        bytes: Vec<u8>,
        fd: Option<Arc<OwnedFd>>,
        now: Instant,
    ) -> io::Result<()> {
        if self.outbox.is_some() {
            return Err(io::Error::other("vfio-user: a reply is already waiting"));
        }
        self.outbox = Some(Outbox {
            bytes,
            sent: 0,
            fd,
            since: now,
        });
        self.flush()
    }

    /// Sends what the socket takes of the waiting reply, without blocking.
    pub fn flush(&mut self) -> io::Result<()> {
        let Some(o) = &mut self.outbox else {
            return Ok(());
        };
        while o.sent < o.bytes.len() {
            let fd = o.fd.as_deref().filter(|_| o.sent == 0).map(AsFd::as_fd);
            match send_some(self.stream.as_fd(), &o.bytes[o.sent..], fd.as_slice()) {
                Ok(n) => o.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.outbox = None;
        Ok(())
    }

    /// Whether a reply waits for the client to take it (the event loop
    /// then waits for room to send, not for input).
    pub fn is_sending(&self) -> bool {
        self.outbox.is_some()
    }

    /// When the client must have finished the message it started sending,
    /// or taken the waiting reply; `None` between messages.
    pub fn deadline(&self) -> Option<Instant> {
        let start = match (&self.outbox, self.inbox.since) {
            (Some(o), Some(i)) => o.since.min(i),
            (Some(o), None) => o.since,
            (None, i) => i?,
        };
        Some(start + self.deadline)
    }

    /// An error (which ends the connection) once `now` is past
    /// [`Connection::deadline`].
    pub fn check_deadline(&self, now: Instant) -> io::Result<()> {
        match self.deadline() {
            Some(d) if now >= d => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "vfio-user: the client took more than {:?} to send a message or take a reply",
                    self.deadline
                ),
            )),
            _ => Ok(()),
        }
    }
}

impl AsFd for Connection {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

/// The client's end of a connection, blocking (at most
/// [`CLIENT_TIMEOUT`] per call): what QEMU is to the server.
#[derive(Debug)]
pub struct Client {
    stream: UnixStream,
    inbox: Inbox,
}

impl Client {
    pub fn new(stream: UnixStream) -> io::Result<Self> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
        Ok(Client {
            stream,
            inbox: Inbox::default(),
        })
    }

    /// Sends `bytes` as one message, with `fds` (SET_IRQS carries several).
    pub fn send(&mut self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        let mut sent = 0;
        while sent < bytes.len() {
            // Descriptors go with the first byte only.
            let with = if sent == 0 { fds } else { &[] };
            match send_some(self.stream.as_fd(), &bytes[sent..], with) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(timed_out()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Receives one message; `None` when the server closed the connection
    /// between messages.
    pub fn receive(&mut self) -> io::Result<Option<Message>> {
        match self.inbox.fill(self.stream.as_fd(), Instant::now()) {
            Ok(Fill::Message(m)) => Ok(Some(m)),
            Ok(Fill::Closed) => Ok(None),
            Ok(Fill::WouldBlock) => {
                self.inbox = Inbox::default();
                Err(timed_out())
            }
            Err(e) => {
                self.inbox = Inbox::default();
                Err(e)
            }
        }
    }
}

impl AsFd for Client {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

/// A message being received: its header, then its payload, and the
/// descriptors that came with any of its bytes.
#[derive(Debug, Default)]
struct Inbox {
    head: [u8; proto::HEADER_LEN],
    /// Bytes of the message received (header included).
    got: usize,
    /// Once the header is whole and checked.
    header: Option<Header>,
    payload: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// When its first byte came.
    since: Option<Instant>,
}

/// What [`Inbox::fill`] found.
enum Fill {
    Message(Message),
    WouldBlock,
    Closed,
}

impl Inbox {
    /// Receives what `sock` holds of the message, never past its end (the
    /// next message's descriptors stay with it); the message once whole.
    fn fill(&mut self, sock: BorrowedFd<'_>, now: Instant) -> io::Result<Fill> {
        loop {
            let room = match self.header {
                None => &mut self.head[self.got..],
                Some(_) => &mut self.payload[self.got - proto::HEADER_LEN..],
            };
            if room.is_empty() {
                break;
            }
            let n = match recv_with_fds(sock, room, &mut self.fds) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Fill::WouldBlock),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                if self.got == 0 && self.fds.is_empty() {
                    return Ok(Fill::Closed);
                }
                return Err(cut_off());
            }
            self.since.get_or_insert(now);
            self.got += n;
            if self.header.is_none() && self.got == proto::HEADER_LEN {
                let header = Header::read_from_bytes(&self.head).map_err(|_| invalid("header"))?;
                let len = header
                    .payload_len()
                    .ok_or_else(|| invalid("message size"))?;
                if header.size as usize > proto::MAX_MESSAGE {
                    return Err(invalid("message larger than max_data_xfer_size"));
                }
                self.payload = vec![0; len];
                self.header = Some(header);
            }
        }
        let done = std::mem::take(self);
        match done.header {
            Some(header) => Ok(Fill::Message(Message {
                header,
                payload: done.payload,
                fds: done.fds,
            })),
            // The loop ends only once the header is whole.
            None => Err(invalid("header")),
        }
    }
}

/// One `sendmsg` of `bytes` with `fds`; how many bytes went.
fn send_some(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let rights = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &rights };
    let n = socket::sendmsg::<()>(
        sock.as_raw_fd(),
        &[IoSlice::new(bytes)],
        cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(io::Error::from)?;
    if n == 0 && !bytes.is_empty() {
        return Err(io::ErrorKind::WriteZero.into());
    }
    Ok(n)
}

fn timed_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("vfio-user: nothing from the server for {CLIENT_TIMEOUT:?}"),
    )
}

/// One `recvmsg` into `buf` ([`vrdma_sys::sock::recv_with_fds`]: room
/// for the kernel's maximum of descriptors, every one it installed owned,
/// also when it cut the control data short); the descriptors that came
/// with it are added to `fds`. More than [`proto::MAX_FDS`] in `fds` is an
/// error, and so is control data cut short (descriptors lost): every
/// descriptor received is closed when the caller drops `fds`. Nothing but
/// `SCM_RIGHTS` arrives: the socket asks for no credentials or security
/// labels (`SO_PASSCRED`, `SO_PASSSEC`, `SO_PASSPIDFD` are off).
fn recv_with_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    // A stream's bytes are never cut (MSG_TRUNC): EMSGSIZE is control
    // data cut short.
    let n = match vrdma_sys::sock::recv_with_fds(sock, buf, fds) {
        Ok(n) => n,
        Err(nix::errno::Errno::EMSGSIZE) => {
            return Err(invalid("control data cut short (descriptors lost)"));
        }
        Err(e) => return Err(e.into()),
    };
    if fds.len() > proto::MAX_FDS {
        return Err(invalid("more descriptors than max_msg_fds"));
    }
    Ok(n)
}

fn cut_off() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the client closed the connection inside a message",
    )
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("vfio-user: bad {what}"))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use zerocopy::IntoBytes;

    use super::*;
    use crate::proto::cmd;

    const D: Duration = Duration::from_secs(1);

    fn pair() -> (Connection, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        (Connection::new(a, D).unwrap(), b)
    }

    fn header(size: u32) -> Header {
        Header {
            id: 9,
            command: cmd::DEVICE_RESET,
            size,
            flags: 0,
            error: 0,
        }
    }

    fn message(r: io::Result<Received>) -> Message {
        match r.unwrap() {
            Received::Message(m) => m,
            other => panic!("no message: {other:?}"),
        }
    }

    fn error(r: io::Result<Received>) -> io::ErrorKind {
        r.unwrap_err().kind()
    }

    fn temp_socket(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("vrdma-sock-{}-{name}.sock", std::process::id()))
    }

    #[test]
    fn the_socket_file_is_private_to_its_user_or_its_group() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};

        let path = temp_socket("private");
        let l = Listener::bind(&path, &SocketConfig::default()).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
        drop(l);
        assert!(!path.exists());
        let egid = nix::unistd::getegid().as_raw();
        let config = SocketConfig {
            allowed_gids: vec![egid],
            ..SocketConfig::default()
        };
        let l = Listener::bind(&path, &config).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o7777, 0o660);
        assert_eq!(meta.gid(), egid);
        drop(l);
    }

    #[test]
    fn peers_not_allowed_are_turned_away_and_counted() {
        let path = temp_socket("peers");
        let me = nix::unistd::geteuid().as_raw();
        let config = SocketConfig {
            allowed_uids: vec![4242],
            allowed_gids: vec![],
            ..SocketConfig::default()
        };
        let mut l = Listener::bind(&path, &config).unwrap();
        assert_ne!(me, 4242);
        let mut peer = UnixStream::connect(&path).unwrap();
        assert!(l.accept().unwrap().is_none());
        assert_eq!(l.refused(), 1);
        // Closed without a word.
        let mut b = [0u8; 16];
        match std::io::Read::read(&mut peer, &mut b) {
            Ok(0) => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
            other => panic!("{other:?}"),
        }
        drop(l);
        // Allowed by user (the default: this process's), or by group.
        for config in [
            SocketConfig::default(),
            SocketConfig {
                allowed_uids: vec![4242],
                allowed_gids: vec![nix::unistd::getegid().as_raw()],
                ..SocketConfig::default()
            },
        ] {
            let mut l = Listener::bind(&path, &config).unwrap();
            let _peer = UnixStream::connect(&path).unwrap();
            assert!(l.accept().unwrap().is_some(), "{config:?}");
            assert_eq!(l.refused(), 0);
        }
    }

    #[test]
    fn a_message_and_its_descriptors_arrive_together() {
        let (mut c, peer) = pair();
        let memfd =
            nix::sys::memfd::memfd_create(c"x", nix::sys::memfd::MFdFlags::empty()).unwrap();
        let mut bytes = header(20).as_bytes().to_vec();
        bytes.extend_from_slice(&[1, 2, 3, 4]);
        let mut client = Client::new(peer).unwrap();
        client.send(&bytes, &[memfd.as_fd()]).unwrap();
        let m = message(c.receive(Instant::now()));
        assert_eq!(m.header, header(20));
        assert_eq!(m.payload, [1, 2, 3, 4]);
        assert_eq!(m.fds.len(), 1);
        drop(client);
        // EOF once every copy of the peer's end is closed: a test of this
        // binary that spawns a child process meanwhile holds one until the
        // child's exec closes it.
        let limit = Instant::now() + Duration::from_secs(10);
        let r = loop {
            match c.receive(Instant::now()) {
                Ok(Received::Pending) if Instant::now() < limit => {
                    let mut p = [nix::poll::PollFd::new(
                        c.as_fd(),
                        nix::poll::PollFlags::POLLIN,
                    )];
                    let _ = nix::poll::poll(&mut p, nix::poll::PollTimeout::from(100u16));
                }
                r => break r,
            }
        };
        assert!(matches!(r, Ok(Received::Closed)), "{r:?}");
    }

    #[test]
    fn a_message_in_pieces_is_kept_until_whole_and_must_be_whole_by_its_deadline() {
        let (mut c, mut peer) = pair();
        let t0 = Instant::now();
        assert!(matches!(c.receive(t0), Ok(Received::Pending)));
        assert_eq!(c.deadline(), None, "nothing started");
        let mut bytes = header(20).as_bytes().to_vec();
        bytes.extend_from_slice(&[1, 2, 3, 4]);
        // Two messages back to back: the first is taken alone.
        bytes.extend_from_slice(header(16).as_bytes());
        peer.write_all(&bytes[..10]).unwrap();
        assert!(matches!(c.receive(t0), Ok(Received::Pending)));
        assert_eq!(c.deadline(), Some(t0 + D));
        let later = t0 + D / 2;
        peer.write_all(&bytes[10..18]).unwrap();
        assert!(matches!(c.receive(later), Ok(Received::Pending)));
        assert_eq!(c.deadline(), Some(t0 + D), "from the first byte");
        c.check_deadline(t0 + D - Duration::from_millis(1)).unwrap();
        assert_eq!(
            c.check_deadline(t0 + D).unwrap_err().kind(),
            io::ErrorKind::TimedOut
        );
        peer.write_all(&bytes[18..]).unwrap();
        let m = message(c.receive(later));
        assert_eq!(m.payload, [1, 2, 3, 4]);
        assert_eq!(c.deadline(), None, "between messages");
        let m = message(c.receive(later));
        assert_eq!(m.header, header(16));
        assert!(m.payload.is_empty());
    }

    #[test]
    fn a_reply_the_client_does_not_take_waits_and_holds_back_its_next_message() {
        let (mut c, peer) = pair();
        let mut client = Client::new(peer).unwrap();
        client.send(header(16).as_bytes(), &[]).unwrap();
        let t0 = Instant::now();
        message(c.receive(t0));
        // More than a socket holds.
        let len = proto::MAX_MESSAGE;
        let mut reply = header(len as u32).as_bytes().to_vec();
        reply.resize(len, 7);
        c.send(reply, None, t0).unwrap();
        assert!(c.is_sending());
        assert_eq!(c.deadline(), Some(t0 + D));
        // The client's next message is not read meanwhile.
        client.send(header(16).as_bytes(), &[]).unwrap();
        assert!(matches!(c.receive(t0), Ok(Received::Pending)));
        assert!(c.send(vec![0; 16], None, t0).is_err(), "one at a time");
        assert_eq!(
            c.check_deadline(t0 + D).unwrap_err().kind(),
            io::ErrorKind::TimedOut
        );
        // The client reads: the reply goes, and the next message comes.
        let reader = std::thread::spawn(move || {
            let m = client.receive().unwrap().unwrap();
            (m.payload.len(), client)
        });
        while c.is_sending() {
            let mut p = [nix::poll::PollFd::new(
                c.as_fd(),
                nix::poll::PollFlags::POLLOUT,
            )];
            nix::poll::poll(&mut p, nix::poll::PollTimeout::NONE).unwrap();
            c.flush().unwrap();
        }
        let (len, _client) = reader.join().unwrap();
        assert_eq!(len + proto::HEADER_LEN, proto::MAX_MESSAGE);
        assert_eq!(c.deadline(), None);
        message(c.receive(t0));
    }

    #[test]
    fn oversized_and_undersized_messages_end_the_connection() {
        let (mut c, mut peer) = pair();
        peer.write_all(header(8).as_bytes()).unwrap();
        assert_eq!(error(c.receive(Instant::now())), io::ErrorKind::InvalidData);
        let (mut c, mut peer) = pair();
        peer.write_all(header(u32::MAX).as_bytes()).unwrap();
        assert_eq!(error(c.receive(Instant::now())), io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_message_cut_off_by_the_client_is_an_error_not_a_hang() {
        let (mut c, mut peer) = pair();
        peer.write_all(&header(100).as_bytes()[..10]).unwrap();
        drop(peer);
        assert_eq!(
            error(c.receive(Instant::now())),
            io::ErrorKind::UnexpectedEof
        );
        let (mut c, mut peer) = pair();
        peer.write_all(header(100).as_bytes()).unwrap();
        drop(peer);
        assert_eq!(
            error(c.receive(Instant::now())),
            io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn replies_carry_a_descriptor_when_given_one() {
        let (mut c, peer) = pair();
        let memfd =
            nix::sys::memfd::memfd_create(c"y", nix::sys::memfd::MFdFlags::empty()).unwrap();
        c.send(
            header(16).as_bytes().to_vec(),
            Some(Arc::new(memfd)),
            Instant::now(),
        )
        .unwrap();
        assert!(!c.is_sending());
        let mut peer = Client::new(peer).unwrap();
        let m = peer.receive().unwrap().unwrap();
        assert_eq!(m.fds.len(), 1);
    }
}
