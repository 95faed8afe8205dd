//! A hostile VMM on a virtio-rdma device's vhost-user socket: any sequence
//! of vhost-user messages (any request codes, flags, sizes and payloads),
//! with a sealed memfd attached where a message takes guest memory and an
//! eventfd where it takes a kick, call or error descriptor, sent to a
//! device served by `vrdma_virtio::server::Server` — rust-vmm's daemon
//! decoding, the backend answering. Each input is one connection; the
//! device must never panic, must close the connection or answer, and must
//! serve the next connection (its configuration read back whole).
//!
//! Input: messages, each a u32 request, a u32 flags word, a length byte,
//! then that many payload bytes; the header sent says the payload's true
//! length unless the flags' top bit asks for a lie (the length byte then).
#![no_main]

mod common;

use std::{
    io::{IoSlice, Read},
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::net::{UnixListener, UnixStream},
    },
    sync::{Arc, OnceLock},
    time::Duration,
};

use libfuzzer_sys::fuzz_target;
use nix::sys::{
    eventfd::{EfdFlags, EventFd},
    memfd::{MFdFlags, memfd_create},
    socket::{ControlMessage, MsgFlags, sendmsg},
};
use vrdma_fabric::eth::EthPort;
use vrdma_virtio::{server::Server, vhost::Backend};

/// One device, served for the whole run in a thread of its own.
fn socket() -> &'static std::path::Path {
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("vrdma-fuzz-vhost-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("dev.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).expect("bind");
        let (face, nic, uplink) = common::eth_virtio();
        // The port's far ends live as long as the device.
        std::mem::forget((nic, uplink));
        let backend: Arc<Backend<EthPort>> =
            Backend::new(face, Duration::from_micros(50)).expect("backend");
        let server = Server::new("fuzz", listener, backend).expect("server");
        std::thread::spawn(move || {
            let _ = server.run();
        });
        path
    })
}

/// A sealed memfd of 64 KiB: what a VMM's guest memory would be.
fn memfd() -> OwnedFd {
    let fd = memfd_create(c"vrdma-fuzz-mem", MFdFlags::MFD_ALLOW_SEALING).expect("memfd");
    let file = std::fs::File::from(fd);
    file.set_len(64 * 1024).expect("size");
    let _ = nix::fcntl::fcntl(
        &file,
        nix::fcntl::FcntlArg::F_ADD_SEALS(
            nix::fcntl::SealFlag::F_SEAL_SHRINK | nix::fcntl::SealFlag::F_SEAL_GROW,
        ),
    );
    OwnedFd::from(file)
}

/// Descriptors open now.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

fuzz_target!(|data: &[u8]| {
    let path = socket();
    // Nothing a connection brings stays once it is gone (a descriptor a
    // connection leaked would exhaust the table after some thousands).
    assert!(open_fds() < 256, "{} descriptors open", open_fds());
    let Ok(mut s) = UnixStream::connect(path) else {
        return;
    };
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut input = data;
    while input.len() >= 9 {
        let request = u32::from_le_bytes(input[..4].try_into().unwrap());
        let flags = u32::from_le_bytes(input[4..8].try_into().unwrap());
        let len = usize::from(input[8]).min(input.len() - 9);
        let payload = &input[9..9 + len];
        input = &input[9 + len..];
        let size = if flags & 0x8000_0000 != 0 {
            u32::from(data[8 % data.len()])
        } else {
            len as u32
        };
        // Version 1 (0x1) in the flags' low bits, as every VMM sends.
        let hdr = [
            request.to_le_bytes(),
            (flags & 0xfc | 1).to_le_bytes(),
            size.to_le_bytes(),
        ]
        .concat();
        let fds: Vec<OwnedFd> = match request {
            5 | 37 => vec![memfd()],
            12..=14 | 21 => EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK)
                .map(|e| vec![OwnedFd::from(e)])
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let cmsg = [ControlMessage::ScmRights(&raw)];
        let iov = [IoSlice::new(&hdr), IoSlice::new(payload)];
        let sent = if raw.is_empty() {
            sendmsg::<()>(s.as_raw_fd(), &iov, &[], MsgFlags::MSG_NOSIGNAL, None)
        } else {
            sendmsg::<()>(s.as_raw_fd(), &iov, &cmsg, MsgFlags::MSG_NOSIGNAL, None)
        };
        if sent.is_err() {
            break;
        }
    }
    // The device ends the connection once ours is shut: read to the end.
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut sink = [0u8; 4096];
    loop {
        match s.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            // Closed with our bytes unread: a reset is a close too.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the device neither answered nor closed: {e}"),
        }
    }
});
