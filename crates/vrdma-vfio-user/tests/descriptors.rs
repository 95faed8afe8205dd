//! A client that sends more descriptors than a message may carry leaks
//! none into the server: every descriptor the kernel installs in this
//! process is closed again, whether it came in one `recvmsg` or spread
//! over several, and whether the kernel had room for all of them or cut
//! the control data short.
//!
//! This binary holds one test on purpose: it counts the process's open
//! descriptors (`/proc/self/fd`), which a test running beside it in another
//! thread would change.

use std::{
    io::{self, IoSlice},
    os::{
        fd::{AsRawFd, OwnedFd, RawFd},
        unix::net::UnixStream,
    },
    time::Instant,
};

use nix::sys::socket::{self, ControlMessage, MsgFlags, sockopt};
use vrdma_vfio_user::{
    proto::{self, Header, cmd},
    socket::{Connection, DEADLINE, Received},
};
use zerocopy::IntoBytes;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn memfd() -> OwnedFd {
    nix::sys::memfd::memfd_create(c"vrdma-fd-test", nix::sys::memfd::MFdFlags::empty()).unwrap()
}

/// A DEVICE_RESET message with `extra` payload bytes.
fn message(extra: usize) -> Vec<u8> {
    let h = Header {
        id: 1,
        command: cmd::DEVICE_RESET,
        size: (proto::HEADER_LEN + extra) as u32,
        flags: 0,
        error: 0,
    };
    let mut m = h.as_bytes().to_vec();
    m.resize(proto::HEADER_LEN + extra, 0);
    m
}

/// Sends `bytes` in one `sendmsg` with `n` copies of `fd`.
fn send_with(peer: &UnixStream, bytes: &[u8], fd: &OwnedFd, n: usize) {
    let raw: Vec<RawFd> = vec![fd.as_raw_fd(); n];
    let cmsgs = if n == 0 {
        vec![]
    } else {
        vec![ControlMessage::ScmRights(&raw)]
    };
    let sent = socket::sendmsg::<()>(
        peer.as_raw_fd(),
        &[IoSlice::new(bytes)],
        &cmsgs,
        MsgFlags::empty(),
        None,
    )
    .unwrap();
    assert_eq!(sent, bytes.len());
}

/// The server's verdict on what the client sent: a message and how many
/// descriptors came with it, or the error that ended the connection.
fn receive(server: &mut Connection) -> io::Result<usize> {
    match server.receive(Instant::now())? {
        Received::Message(m) => Ok(m.fds.len()),
        other => panic!("the whole message was sent: {other:?}"),
    }
}

#[test]
fn descriptors_over_the_limit_are_all_closed() {
    let fd = memfd();
    let baseline = open_fds();

    // Up to the limit: the message and its descriptors arrive.
    {
        let (a, peer) = UnixStream::pair().unwrap();
        let mut server = Connection::new(a, DEADLINE).unwrap();
        send_with(&peer, &message(8), &fd, proto::MAX_FDS);
        assert_eq!(receive(&mut server).unwrap(), proto::MAX_FDS);
    }
    assert_eq!(open_fds(), baseline, "{} descriptors", proto::MAX_FDS);

    // Over the limit in one sendmsg, up to the kernel's maximum per
    // message (SCM_MAX_FD): refused, and none stays open.
    for n in [proto::MAX_FDS + 1, 20, 100, 253] {
        let e = {
            let (a, peer) = UnixStream::pair().unwrap();
            let mut server = Connection::new(a, DEADLINE).unwrap();
            send_with(&peer, &message(8), &fd, n);
            receive(&mut server).unwrap_err()
        };
        assert_eq!(open_fds(), baseline, "{n} descriptors in one message");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{n}: {e}");
    }

    // The header trickled a byte at a time, each byte with a few
    // descriptors: the total over the message counts.
    let e = {
        let (a, peer) = UnixStream::pair().unwrap();
        let mut server = Connection::new(a, DEADLINE).unwrap();
        let m = message(8);
        for b in m.chunks(1) {
            send_with(&peer, b, &fd, 10);
        }
        receive(&mut server).unwrap_err()
    };
    assert_eq!(open_fds(), baseline, "descriptors spread over a header");
    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");

    // Descriptors with the payload's bytes count too.
    let e = {
        let (a, peer) = UnixStream::pair().unwrap();
        let mut server = Connection::new(a, DEADLINE).unwrap();
        let m = message(64);
        send_with(&peer, &m[..proto::HEADER_LEN], &fd, 8);
        send_with(&peer, &m[proto::HEADER_LEN..], &fd, 253);
        receive(&mut server).unwrap_err()
    };
    assert_eq!(open_fds(), baseline, "descriptors with the payload");
    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");

    // Control data the kernel cuts short (MSG_CTRUNC): here because the
    // server's socket also asks for the sender's credentials
    // (SO_PASSCRED), which take room ahead of the descriptors. Those that
    // fit were installed all the same and must be closed; the kernel closed
    // the rest. The message is refused.
    for n in [8, 253] {
        let e = {
            let (a, peer) = UnixStream::pair().unwrap();
            socket::setsockopt(&a, sockopt::PassCred, &true).unwrap();
            let mut server = Connection::new(a, DEADLINE).unwrap();
            send_with(&peer, &message(8), &fd, n);
            receive(&mut server)
        };
        assert_eq!(
            open_fds(),
            baseline,
            "{n} descriptors, control data cut short"
        );
        if n == 253 {
            assert_eq!(e.unwrap_err().kind(), io::ErrorKind::InvalidData);
        }
    }
}
