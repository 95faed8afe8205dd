//! The UNIX socket a vfio-user client connects to, and one connection on
//! it: whole messages in with the descriptors that came with them, replies
//! out with at most one. A connection is read only when its event loop
//! says it is readable; the rest of a message that has started must follow
//! within [`IO_TIMEOUT`] (QEMU sends each message in one call), or the
//! connection is dropped — a client cannot stall the device's thread
//! longer than that.

use std::{
    io::{self, IoSlice, IoSliceMut},
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
        unix::net::{UnixListener, UnixStream},
    },
    path::{Path, PathBuf},
    time::Duration,
};

use nix::sys::socket::{self, ControlMessage, ControlMessageOwned, MsgFlags};
use zerocopy::FromBytes;

use crate::proto::{self, Header};

/// How long the rest of a message, or room to send a reply, may take.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// A listening socket at a path.
#[derive(Debug)]
pub struct Listener {
    listener: UnixListener,
    path: PathBuf,
}

impl Listener {
    /// Listens at `path`. A socket file left there by an earlier run is
    /// replaced only if nothing accepts connections on it.
    pub fn bind(path: &Path) -> io::Result<Self> {
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{} is served by another process", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        Ok(Listener {
            listener,
            path: path.to_owned(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A client that is waiting, if any.
    pub fn accept(&self) -> io::Result<Option<Connection>> {
        match self.listener.accept() {
            Ok((stream, _)) => Connection::new(stream).map(Some),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
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

/// A connected client.
#[derive(Debug)]
pub struct Connection {
    stream: UnixStream,
}

impl Connection {
    /// Over a connected stream (a test may pass one end of a pair).
    pub fn new(stream: UnixStream) -> io::Result<Self> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        Ok(Connection { stream })
    }

    /// Receives one message; `None` when the client closed the connection
    /// between messages. Call it only when the socket is readable (it then
    /// waits at most [`IO_TIMEOUT`] for the rest). An error ends the
    /// connection: a malformed header, a message over
    /// [`proto::MAX_MESSAGE`], more than [`proto::MAX_FDS`] descriptors
    /// (all of them closed), a message cut off.
    pub fn receive(&mut self) -> io::Result<Option<Message>> {
        let mut head = [0u8; proto::HEADER_LEN];
        let mut fds = Vec::new();
        if !self.recv_exact(&mut head, &mut fds)? {
            return Ok(None);
        }
        let header = Header::read_from_bytes(&head).map_err(|_| invalid("header"))?;
        let len = header
            .payload_len()
            .ok_or_else(|| invalid("message size"))?;
        if header.size as usize > proto::MAX_MESSAGE {
            return Err(invalid("message larger than max_data_xfer_size"));
        }
        let mut payload = vec![0u8; len];
        if !self.recv_exact(&mut payload, &mut fds)? && len > 0 {
            return Err(cut_off());
        }
        Ok(Some(Message {
            header,
            payload,
            fds,
        }))
    }

    /// Fills `buf`, collecting descriptors into `fds`; false if the client
    /// closed the connection before the first byte (and sent nothing of
    /// this message before).
    fn recv_exact(&mut self, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<bool> {
        let mut got = 0;
        while got < buf.len() {
            let n = recv_with_fds(self.stream.as_fd(), &mut buf[got..], fds)?;
            if n == 0 {
                if got == 0 && fds.is_empty() {
                    return Ok(false);
                }
                return Err(cut_off());
            }
            got += n;
        }
        Ok(true)
    }

    /// Sends `bytes` as one message, with `fds` (a server's reply carries
    /// at most one; a client's SET_IRQS several).
    pub fn send(&mut self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let cmsgs: Vec<ControlMessage<'_>> = if raw.is_empty() {
            Vec::new()
        } else {
            vec![ControlMessage::ScmRights(&raw)]
        };
        let mut sent = 0;
        while sent < bytes.len() {
            let iov = [IoSlice::new(&bytes[sent..])];
            // Descriptors go with the first byte only.
            let c = if sent == 0 { &cmsgs[..] } else { &[] };
            let n = socket::sendmsg::<()>(
                self.stream.as_raw_fd(),
                &iov,
                c,
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(io::Error::from)?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            sent += n;
        }
        Ok(())
    }

    /// Whether another message is already waiting (without blocking).
    pub fn has_more(&self) -> bool {
        let fd = self.stream.as_fd();
        let mut p = [nix::poll::PollFd::new(fd, nix::poll::PollFlags::POLLIN)];
        matches!(nix::poll::poll(&mut p, nix::poll::PollTimeout::ZERO), Ok(n) if n > 0)
    }
}

impl AsFd for Connection {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

/// The most descriptors the kernel passes with one message
/// (`SCM_MAX_FD`, include/net/scm.h).
const SCM_MAX_FD: usize = 253;

/// One `recvmsg` into `buf`; the descriptors that came with it are owned
/// at once and added to `fds`. More than [`proto::MAX_FDS`] in `fds` is an
/// error (and every one of them is closed when the caller drops `fds`).
///
/// The control buffer has room for the kernel's maximum, so the kernel
/// never truncates it: a truncated buffer would still have installed the
/// descriptors that fit, and nix reports a truncated buffer as an error
/// without handing them over — they would stay open in this process for
/// ever. Nothing but `SCM_RIGHTS` can arrive: the socket asks for no
/// credentials or security labels (`SO_PASSCRED`, `SO_PASSSEC`,
/// `SO_PASSPIDFD` are off).
fn recv_with_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    let mut cmsg = nix::cmsg_space!([RawFd; SCM_MAX_FD]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = socket::recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    let n = msg.bytes;
    // An error here (a truncated buffer) cannot happen with this buffer
    // (see above); it ends the connection all the same.
    for c in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: the kernel just installed `fd` in this process
                // for this message (SCM_RIGHTS); nothing else owns it, so
                // it is ours to own and close.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
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

    fn pair() -> (Connection, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        (Connection::new(a).unwrap(), b)
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

    #[test]
    fn a_message_and_its_descriptors_arrive_together() {
        let (mut c, peer) = pair();
        let memfd =
            nix::sys::memfd::memfd_create(c"x", nix::sys::memfd::MFdFlags::empty()).unwrap();
        let mut bytes = header(20).as_bytes().to_vec();
        bytes.extend_from_slice(&[1, 2, 3, 4]);
        let raw = [memfd.as_raw_fd()];
        socket::sendmsg::<()>(
            peer.as_raw_fd(),
            &[IoSlice::new(&bytes)],
            &[ControlMessage::ScmRights(&raw)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        let m = c.receive().unwrap().unwrap();
        assert_eq!(m.header, header(20));
        assert_eq!(m.payload, [1, 2, 3, 4]);
        assert_eq!(m.fds.len(), 1);
        drop(peer);
        assert!(c.receive().unwrap().is_none(), "EOF between messages");
    }

    #[test]
    fn oversized_and_undersized_messages_end_the_connection() {
        let (mut c, mut peer) = pair();
        peer.write_all(header(8).as_bytes()).unwrap();
        assert_eq!(c.receive().unwrap_err().kind(), io::ErrorKind::InvalidData);
        let (mut c, mut peer) = pair();
        peer.write_all(header(u32::MAX).as_bytes()).unwrap();
        assert_eq!(c.receive().unwrap_err().kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_message_cut_off_by_the_client_is_an_error_not_a_hang() {
        let (mut c, mut peer) = pair();
        peer.write_all(&header(100).as_bytes()[..10]).unwrap();
        drop(peer);
        assert_eq!(
            c.receive().unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
        let (mut c, mut peer) = pair();
        peer.write_all(header(100).as_bytes()).unwrap();
        drop(peer);
        assert_eq!(
            c.receive().unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn replies_carry_a_descriptor_when_given_one() {
        let (mut c, peer) = pair();
        let memfd =
            nix::sys::memfd::memfd_create(c"y", nix::sys::memfd::MFdFlags::empty()).unwrap();
        c.send(header(16).as_bytes(), &[memfd.as_fd()]).unwrap();
        let mut peer = Connection::new(peer).unwrap();
        let m = peer.receive().unwrap().unwrap();
        assert_eq!(m.fds.len(), 1);
    }
}
