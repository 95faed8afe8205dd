//! What every socket of the daemon does the same way.
//!
//! - **Descriptors received** ([`recv_with_fds`], [`try_recv_with_fds`]):
//!   the control buffer has room for the kernel's maximum per message
//!   ([`SCM_MAX_FD`]), so a peer that sends more than a message takes
//!   cannot make the kernel cut the control data short; and whatever the
//!   kernel installed in this process is owned at once — also when it did
//!   cut it short (`MSG_CTRUNC`: the socket asked for more control data
//!   than descriptors, credentials say), when nix would hand none of them
//!   over and they would stay open for ever. A caller that wants fewer
//!   closes the rest by dropping them.
//! - **Connections accepted** ([`Acceptor`]): a shortage (`EMFILE`,
//!   `ENFILE`, `ENOBUFS`, `ENOMEM`: the descriptor table or the kernel's
//!   memory full for now) is waited out, never the listener's end. The
//!   connection stays queued (the kernel takes a descriptor before it
//!   takes the connection), and the next try comes later — 10 ms, doubled
//!   up to a second while the shortage lasts — at a time the acceptor
//!   says, because a listener with a connection waiting stays readable:
//!   an event loop that kept watching it would spin. [`Backoff`] is that
//!   schedule alone, for a loop whose accept happens inside a library.

use std::{
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd},
    time::{Duration, Instant},
};

use nix::{
    errno::Errno,
    sys::socket::{SockFlag, accept4},
};

use crate::sys;

/// The most descriptors the kernel passes with one message (`SCM_MAX_FD`,
/// include/net/scm.h).
pub const SCM_MAX_FD: usize = 253;

/// Receives one message into `buf` (blocking if `sock` blocks) and owns
/// the descriptors that came with it, adding them to `fds`; the bytes
/// received. Room is left for [`SCM_MAX_FD`] descriptors, and every
/// descriptor the kernel installed is in `fds` whatever the result, to be
/// closed when the caller drops it.
///
/// `Err(EMSGSIZE)` when the message was longer than `buf` (`MSG_TRUNC`, a
/// datagram's or a seqpacket's rest lost) or its control data was cut
/// short (`MSG_CTRUNC`: descriptors lost). Descriptors received are close
/// on exec (`MSG_CMSG_CLOEXEC`). Only `SCM_RIGHTS` carries descriptors: a
/// socket that also asks for credentials (`SO_PASSCRED`) gets them, but
/// they take room the descriptors would have had.
pub fn recv_with_fds(
    sock: impl AsFd,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> nix::Result<usize> {
    recv_into(sock.as_fd(), buf, fds, SCM_MAX_FD, 0)
}

/// [`recv_with_fds`] that never blocks (`MSG_DONTWAIT`): `Err(EAGAIN)`
/// when nothing waits.
pub fn try_recv_with_fds(
    sock: impl AsFd,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> nix::Result<usize> {
    recv_into(sock.as_fd(), buf, fds, SCM_MAX_FD, libc::MSG_DONTWAIT)
}

/// The kernel's `struct cmsghdr`: `cmsg_len` (a `size_t`), `cmsg_level`
/// and `cmsg_type` (`int`s), its data after the header aligned to a
/// `size_t`.
const WORD: usize = size_of::<usize>();
const CMSG_HEADER: usize = cmsg_align(WORD + 2 * size_of::<libc::c_int>());

const fn cmsg_align(n: usize) -> usize {
    (n + WORD - 1) & !(WORD - 1)
}

/// `CMSG_SPACE(n)`.
const fn cmsg_space(n: usize) -> usize {
    CMSG_HEADER + cmsg_align(n)
}

/// Room for one `SCM_RIGHTS` message of [`SCM_MAX_FD`] descriptors.
const CONTROL_LEN: usize = cmsg_space(SCM_MAX_FD * size_of::<RawFd>());

/// A control buffer, aligned for `struct cmsghdr` (a `size_t`: 8 bytes at
/// most on Linux).
#[repr(C, align(8))]
struct Control([u8; CONTROL_LEN]);

/// [`recv_with_fds`] with room for `room` descriptors (at most
/// [`SCM_MAX_FD`]; fewer only to test what a cut-short control buffer
/// does) and extra `flags`.
fn recv_into(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    room: usize,
    flags: libc::c_int,
) -> nix::Result<usize> {
    let mut control = Control([0; CONTROL_LEN]);
    let len = cmsg_space(room.min(SCM_MAX_FD) * size_of::<RawFd>());
    let r = sys::recvmsg(
        sock,
        buf,
        &mut control.0[..len],
        libc::MSG_CMSG_CLOEXEC | flags,
    )?;
    own_rights(&control.0[..r.control_len], fds);
    if r.flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(Errno::EMSGSIZE);
    }
    Ok(r.bytes)
}

/// Owns every descriptor of the `SCM_RIGHTS` messages in `control`, the
/// control data the kernel wrote (all of it, or as much as fitted: the
/// kernel then writes a header for what it installed). Only the kernel
/// writes there: what it says is trusted to be whole headers and
/// descriptors it installed; anything shorter ends the walk.
fn own_rights(control: &[u8], fds: &mut Vec<OwnedFd>) {
    let int_at = |at: usize| -> Option<libc::c_int> {
        let b = control.get(at..at + size_of::<libc::c_int>())?;
        Some(libc::c_int::from_ne_bytes(b.try_into().ok()?))
    };
    let mut at = 0;
    while at + CMSG_HEADER <= control.len() {
        let Some(Ok(len)) = control
            .get(at..at + WORD)
            .map(|b| b.try_into().map(usize::from_ne_bytes))
        else {
            return;
        };
        if len < CMSG_HEADER {
            return;
        }
        let end = at.saturating_add(len).min(control.len());
        let (level, kind) = (int_at(at + WORD), int_at(at + WORD + 4));
        if level == Some(libc::SOL_SOCKET) && kind == Some(libc::SCM_RIGHTS) {
            let data = &control[at + CMSG_HEADER..end];
            for fd in data.chunks_exact(size_of::<RawFd>()) {
                // `chunks_exact` gives whole descriptors only.
                if let Ok(b) = fd.try_into() {
                    fds.push(sys::owned(RawFd::from_ne_bytes(b)));
                }
            }
        }
        at = at.saturating_add(cmsg_align(len));
    }
}

/// Accepts a connection on `listener`, owned, non-blocking and close on
/// exec (`accept4`), for a listener whose connections are raw sockets;
/// use it through [`Acceptor::accept`].
pub fn accept(listener: impl AsFd) -> io::Result<OwnedFd> {
    accept4(
        listener.as_fd().as_raw_fd(),
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
    )
    .map(sys::owned)
    .map_err(io::Error::from)
}

/// Whether `e`, from `accept`, is a shortage that passes: the process's
/// descriptor table full (`EMFILE`), the system's (`ENFILE`), or no memory
/// for the socket (`ENOBUFS`, `ENOMEM`).
pub fn is_shortage(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error().map(Errno::from_raw),
        Some(Errno::EMFILE | Errno::ENFILE | Errno::ENOBUFS | Errno::ENOMEM)
    )
}

/// The first wait after a shortage.
pub const FIRST_WAIT: Duration = Duration::from_millis(10);

/// The longest wait between tries while a shortage lasts.
pub const LONGEST_WAIT: Duration = Duration::from_secs(1);

/// Waits that grow while something keeps failing: [`FIRST_WAIT`], doubled
/// each time up to [`LONGEST_WAIT`], back to the first once it worked.
#[derive(Clone, Debug)]
pub struct Backoff {
    next: Duration,
}

impl Backoff {
    pub const fn new() -> Self {
        Backoff { next: FIRST_WAIT }
    }

    /// How long to wait after one more failure.
    pub fn fail(&mut self) -> Duration {
        let wait = self.next;
        self.next = (wait * 2).min(LONGEST_WAIT);
        wait
    }

    /// It worked: the next failure waits [`FIRST_WAIT`] again.
    pub fn reset(&mut self) {
        self.next = FIRST_WAIT;
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

/// What [`Acceptor::accept`] found.
#[derive(Debug)]
pub enum Accepted<T> {
    /// A connection.
    Conn(T),
    /// None waiting (or one that went before it was taken): watch the
    /// listener again.
    Nothing,
    /// A shortage, waited out until the instant given: until then the
    /// listener is not to be watched (it stays readable), and the next
    /// try comes then.
    Later(Instant),
}

/// A listener's accepts, shortages waited out (see the module's doc).
///
/// An event loop watches the listener only while [`Acceptor::watching`],
/// wakes by [`Acceptor::retry_at`] otherwise, and calls
/// [`Acceptor::accept`] when the listener is readable or that time came.
#[derive(Debug, Default)]
pub struct Acceptor {
    /// While a shortage is waited out: when the next try comes.
    retry_at: Option<Instant>,
    backoff: Backoff,
    shortages: u64,
}

impl Acceptor {
    pub const fn new() -> Self {
        Acceptor {
            retry_at: None,
            backoff: Backoff::new(),
            shortages: 0,
        }
    }

    /// Tries `accept` (one `accept` call on the listener) unless a
    /// shortage is waited out until after `now`. A connection, none
    /// waiting (`EAGAIN`, `EINTR`, or a connection that went before it
    /// was taken: `ECONNABORTED`, `EPROTO`), or a shortage ([`is_shortage`])
    /// to wait out; any other error is the listener's own, returned.
    pub fn accept<T>(
        &mut self,
        now: Instant,
        accept: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<Accepted<T>> {
        if let Some(t) = self.retry_at
            && now < t
        {
            return Ok(Accepted::Later(t));
        }
        let e = match accept() {
            Ok(c) => {
                self.recovered();
                return Ok(Accepted::Conn(c));
            }
            Err(e) => e,
        };
        if e.kind() == io::ErrorKind::WouldBlock
            || matches!(
                e.raw_os_error().map(Errno::from_raw),
                Some(Errno::EINTR | Errno::ECONNABORTED | Errno::EPROTO)
            )
        {
            // A descriptor could be had: whatever was short is not now.
            self.recovered();
            return Ok(Accepted::Nothing);
        }
        if !is_shortage(&e) {
            return Err(e);
        }
        let wait = self.backoff.fail();
        self.shortages += 1;
        if self.retry_at.is_none() {
            tracing::warn!(error = %e, retry_in = ?wait, "accept: no resources for a new connection now");
        } else {
            tracing::debug!(error = %e, retry_in = ?wait, "accept: still no resources");
        }
        let t = now + wait;
        self.retry_at = Some(t);
        Ok(Accepted::Later(t))
    }

    fn recovered(&mut self) {
        self.retry_at = None;
        self.backoff.reset();
    }

    /// Whether the listener is to be watched at `now`: not while a
    /// shortage is waited out.
    pub fn watching(&self, now: Instant) -> bool {
        self.retry_at.is_none_or(|t| now >= t)
    }

    /// When the next try comes, while a shortage is waited out (until
    /// [`Acceptor::accept`] tried again).
    pub fn retry_at(&self) -> Option<Instant> {
        self.retry_at
    }

    /// Whether a shortage was waited out and its time has come at `now`
    /// (the loop tries again without the listener being readable).
    pub fn retry_due(&self, now: Instant) -> bool {
        self.retry_at.is_some_and(|t| now >= t)
    }

    /// Shortages met since the start.
    pub fn shortages(&self) -> u64 {
        self.shortages
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io::IoSlice,
        os::{fd::AsRawFd, unix::net::UnixStream},
        sync::Mutex,
    };

    use nix::sys::socket::{
        AddressFamily, ControlMessage, MsgFlags, SockType, sendmsg, setsockopt, socketpair, sockopt,
    };

    use super::*;

    /// The tests that count this process's descriptors run one at a time
    /// (every test here takes it: each makes sockets).
    static FDS: Mutex<()> = Mutex::new(());

    fn open_fds() -> usize {
        std::fs::read_dir("/proc/self/fd").unwrap().count()
    }

    fn memfd() -> OwnedFd {
        nix::sys::memfd::memfd_create(c"vrdma-sys-test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .unwrap()
    }

    fn send_with(sock: &impl AsFd, bytes: &[u8], fd: &OwnedFd, n: usize) {
        let raw = vec![fd.as_raw_fd(); n];
        let rights = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage<'_>] = if n == 0 { &[] } else { &rights };
        let sent = sendmsg::<()>(
            sock.as_fd().as_raw_fd(),
            &[IoSlice::new(bytes)],
            cmsgs,
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        assert_eq!(sent, bytes.len());
    }

    fn seqpacket() -> (OwnedFd, OwnedFd) {
        socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap()
    }

    #[test]
    fn every_descriptor_of_a_message_is_owned_up_to_the_kernels_maximum() {
        let _l = FDS.lock().unwrap_or_else(|p| p.into_inner());
        let fd = memfd();
        let baseline = open_fds();
        // A seqpacket message (the rendezvous's) and a stream's bytes (the
        // vfio-user socket's), with more descriptors than either protocol
        // takes: all of them owned, and closed with `fds`.
        for n in [0, 1, 2, 4, 8, 100, SCM_MAX_FD] {
            let (a, b) = seqpacket();
            send_with(&b, b"ring", &fd, n);
            let mut fds = Vec::new();
            let mut buf = [0u8; 16];
            assert_eq!(try_recv_with_fds(&a, &mut buf, &mut fds), Ok(4), "{n}");
            assert_eq!(&buf[..4], b"ring");
            assert_eq!(fds.len(), n);
            drop((a, b, fds));
            assert_eq!(open_fds(), baseline, "{n} descriptors on a seqpacket");

            let (a, b) = UnixStream::pair().unwrap();
            send_with(&b, b"header", &fd, n);
            let mut fds = Vec::new();
            let mut buf = [0u8; 16];
            assert_eq!(recv_with_fds(&a, &mut buf, &mut fds), Ok(6), "{n}");
            assert_eq!(fds.len(), n);
            drop((a, b, fds));
            assert_eq!(open_fds(), baseline, "{n} descriptors on a stream");
        }
    }

    #[test]
    fn descriptors_are_owned_when_the_control_data_is_cut_short() {
        let _l = FDS.lock().unwrap_or_else(|p| p.into_inner());
        let fd = memfd();
        let baseline = open_fds();
        // A buffer with room for 4 (what the rendezvous once left) and 8
        // or 253 sent: the kernel installs 4 and closes the rest; the 4
        // are owned, and the message is refused.
        for n in [8, SCM_MAX_FD] {
            let (a, b) = seqpacket();
            send_with(&b, b"ring", &fd, n);
            let mut fds = Vec::new();
            let r = recv_into(a.as_fd(), &mut [0u8; 16], &mut fds, 4, libc::MSG_DONTWAIT);
            assert_eq!(r, Err(Errno::EMSGSIZE), "{n}");
            assert_eq!(fds.len(), 4, "{n}");
            drop((a, b, fds));
            assert_eq!(open_fds(), baseline, "{n} into room for 4");
        }
        // Full room, but credentials ahead of the descriptors (a socket
        // with SO_PASSCRED): those that fitted are owned.
        for n in [8, SCM_MAX_FD] {
            let (a, b) = UnixStream::pair().unwrap();
            setsockopt(&a, sockopt::PassCred, &true).unwrap();
            send_with(&b, b"header", &fd, n);
            let mut fds = Vec::new();
            let r = recv_with_fds(&a, &mut [0u8; 16], &mut fds);
            if n == SCM_MAX_FD {
                assert_eq!(r, Err(Errno::EMSGSIZE));
                assert!(fds.len() < n && fds.len() > 200, "{}", fds.len());
            } else {
                assert_eq!((r, fds.len()), (Ok(6), n));
            }
            drop((a, b, fds));
            assert_eq!(open_fds(), baseline, "{n} after credentials");
        }
    }

    #[test]
    fn a_message_longer_than_the_buffer_is_refused_with_its_descriptors_owned() {
        let _l = FDS.lock().unwrap_or_else(|p| p.into_inner());
        let fd = memfd();
        let baseline = open_fds();
        let (a, b) = seqpacket();
        send_with(&b, &[7; 64], &fd, 3);
        let mut fds = Vec::new();
        let r = try_recv_with_fds(&a, &mut [0u8; 16], &mut fds);
        assert_eq!((r, fds.len()), (Err(Errno::EMSGSIZE), 3));
        // Nothing waits now.
        assert_eq!(
            try_recv_with_fds(&a, &mut [0u8; 16], &mut fds),
            Err(Errno::EAGAIN)
        );
        drop((a, b, fds));
        assert_eq!(open_fds(), baseline);
    }

    fn os(e: Errno) -> io::Error {
        io::Error::from_raw_os_error(e as i32)
    }

    #[test]
    fn a_shortage_is_waited_out_with_growing_waits_and_forgotten_once_it_passed() {
        let mut a = Acceptor::new();
        let t0 = Instant::now();
        assert!(a.watching(t0));
        for e in [Errno::EMFILE, Errno::ENFILE, Errno::ENOBUFS, Errno::ENOMEM] {
            let mut a = Acceptor::new();
            match a.accept(t0, || Err::<(), _>(os(e))) {
                Ok(Accepted::Later(t)) => assert_eq!(t, t0 + FIRST_WAIT, "{e}"),
                other => panic!("{e}: {other:?}"),
            }
        }
        // EMFILE: not watched, not tried, until its time; then tried, and
        // the next wait is longer.
        let Ok(Accepted::Later(t1)) = a.accept(t0, || Err::<(), _>(os(Errno::EMFILE))) else {
            panic!("a shortage");
        };
        assert!(!a.watching(t0) && !a.retry_due(t0));
        let early = a.accept(t0 + FIRST_WAIT / 2, || -> io::Result<()> {
            panic!("tried before its time")
        });
        assert!(matches!(early, Ok(Accepted::Later(t)) if t == t1));
        assert!(a.watching(t1) && a.retry_due(t1));
        let mut waits = Vec::new();
        let mut now = t1;
        for _ in 0..10 {
            let Ok(Accepted::Later(t)) = a.accept(now, || Err::<(), _>(os(Errno::EMFILE))) else {
                panic!("a shortage");
            };
            waits.push(t - now);
            now = t;
        }
        assert_eq!(waits[0], FIRST_WAIT * 2);
        assert_eq!(waits[1], FIRST_WAIT * 4);
        assert_eq!(*waits.last().unwrap(), LONGEST_WAIT);
        assert_eq!(a.shortages(), 11);
        // Descriptors back: the connection, and the next shortage waits
        // the first wait again.
        assert!(matches!(a.accept(now, || Ok(5)), Ok(Accepted::Conn(5))));
        assert!(a.watching(now) && a.retry_at().is_none());
        let Ok(Accepted::Later(t)) = a.accept(now, || Err::<(), _>(os(Errno::EMFILE))) else {
            panic!("a shortage");
        };
        assert_eq!(t - now, FIRST_WAIT);
    }

    #[test]
    fn nothing_waiting_is_not_an_error_and_other_errors_are() {
        let mut a = Acceptor::new();
        let now = Instant::now();
        for e in [
            Errno::EAGAIN,
            Errno::EINTR,
            Errno::ECONNABORTED,
            Errno::EPROTO,
        ] {
            assert!(
                matches!(a.accept(now, || Err::<(), _>(os(e))), Ok(Accepted::Nothing)),
                "{e}"
            );
        }
        for e in [Errno::EBADF, Errno::EINVAL, Errno::ENOTSOCK] {
            let r = a.accept(now, || Err::<(), _>(os(e)));
            assert_eq!(r.unwrap_err().raw_os_error(), Some(e as i32));
        }
        assert_eq!(a.shortages(), 0);
    }

    #[test]
    fn accept_owns_a_nonblocking_connection() {
        let _l = FDS.lock().unwrap_or_else(|p| p.into_inner());
        let dir = std::env::temp_dir().join(format!("vrdma-sys-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("l.sock");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        l.set_nonblocking(true).unwrap();
        let mut a = Acceptor::new();
        let now = Instant::now();
        assert!(matches!(
            a.accept(now, || accept(&l)),
            Ok(Accepted::Nothing)
        ));
        let _c = UnixStream::connect(&path).unwrap();
        let Ok(Accepted::Conn(s)) = a.accept(now, || accept(&l)) else {
            panic!("the connection");
        };
        let flags = nix::fcntl::fcntl(&s, nix::fcntl::FcntlArg::F_GETFL).unwrap();
        assert_ne!(flags & libc::O_NONBLOCK, 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
