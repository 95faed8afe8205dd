//! A peer daemon that sends more descriptors than a rendezvous message
//! takes leaks none into the switch's process: every descriptor the
//! kernel installs with the message is closed with the connection, however
//! many came (8, or the kernel's maximum per message, 253).
//!
//! This binary holds one test on purpose: it counts the process's open
//! descriptors (`/proc/self/fd`), which a test running beside it in another
//! thread would change.

use std::{
    io::{IoSlice, IoSliceMut},
    os::fd::{AsRawFd, OwnedFd},
    path::PathBuf,
};

use nix::sys::{
    socket::{
        AddressFamily, MsgFlags, SockFlag, SockType, UnixAddr, connect, recvmsg, sendmsg,
        setsockopt, socket, sockopt,
    },
    time::TimeVal,
};
use vrdma_fabric::shm::{JoinConfig, Switch};

const RING: u32 = 2;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vrdma-rdv-fds-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A hand-made peer connected to the rendezvous socket at `path`. It says
/// no HELLO: what it sends first is refused whatever the protocol's
/// version, after the switch received it — and with it its descriptors.
fn peer(path: &std::path::Path) -> OwnedFd {
    let sock = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    setsockopt(&sock, sockopt::ReceiveTimeout, &TimeVal::new(10, 0)).unwrap();
    connect(sock.as_raw_fd(), &UnixAddr::new(path).unwrap()).unwrap();
    sock
}

fn send(sock: &OwnedFd, m: &[u8], fds: &[i32]) {
    let iov = [IoSlice::new(m)];
    let c = [nix::sys::socket::ControlMessage::ScmRights(fds)];
    let cm: &[nix::sys::socket::ControlMessage<'_>] = if fds.is_empty() { &[] } else { &c };
    sendmsg::<()>(sock.as_raw_fd(), &iov, cm, MsgFlags::empty(), None).unwrap();
}

/// Reads what the switch sends (its HELLO; no descriptors: it has no
/// device) until it closes the connection; false if it did not within the
/// timeout.
fn closed_by_switch(sock: &OwnedFd) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        match recvmsg::<()>(sock.as_raw_fd(), &mut iov, None, MsgFlags::empty()) {
            Ok(m) if m.bytes == 0 => return true,
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => {}
            Err(nix::errno::Errno::ECONNRESET) => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn descriptors_past_what_a_message_takes_are_all_closed() {
    let d = dir("many");
    let sw = Switch::new();
    let r = sw.join(JoinConfig::new(&d)).unwrap();
    let memfd =
        nix::sys::memfd::memfd_create("vrdma-fd-test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .unwrap();
    let baseline = open_fds();
    // A RING takes two descriptors (the ring's memfd, the eventfd), and
    // none comes before a HELLO.
    let mut ring = RING.to_le_bytes().to_vec();
    ring.extend_from_slice(&7u32.to_le_bytes());
    ring.extend_from_slice(&8u32.to_le_bytes());
    for n in [8, 253] {
        let sock = peer(r.path());
        send(&sock, &ring, &vec![memfd.as_raw_fd(); n]);
        assert!(closed_by_switch(&sock), "{n}: the connection stays open");
        drop(sock);
        assert_eq!(open_fds(), baseline, "{n} descriptors with a RING");
    }
    drop(r);
    let _ = std::fs::remove_dir_all(&d);
}
