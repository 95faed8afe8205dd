//! Hostile vfio-user messages with descriptors: each message comes with
//! the descriptors the input chooses — memfds sealed or not and of any
//! size, eventfds, pipes, /dev/null, a socket — and goes to a session with
//! a PVRDMA function behind it (on a transport that sends nothing), as the
//! socket would hand it over; the client may shrink the unsealed memfds it
//! sent while they are mapped, and the device then touches them. Nothing may
//! panic or die of SIGBUS; every reply must be a well-formed answer; what
//! the session holds stays within its budgets; once the client is gone it
//! holds nothing (no descriptor, no mapping, no SIGBUS registration).
//!
//! Input: a byte choosing the session's policy (bit 0: unsealed memory
//! allowed; bits 1-3: at most 1 to 8 maps; bits 4-7: at most 4 KiB << n
//! bytes), then records, each:
//! - a byte: how many descriptor bytes follow (its value mod 18: up to one
//!   more than a message may carry);
//! - that many descriptor bytes: the low 3 bits the kind (0 a memfd sealed
//!   against shrinking and growing, 1 an unsealed memfd the client keeps,
//!   2 an eventfd, 3 and 4 a pipe's ends, 5 /dev/null, 6 a socket, 7 no
//!   descriptor: the client shrinks every unsealed memfd it kept), the
//!   high 5 bits a size in pages (of the memfd, or what 7 shrinks to);
//! - a message: a 16-byte header and the payload its size names (a size
//!   the socket would refuse ends the input).
#![no_main]

mod common;

use std::{
    fs::File,
    os::{fd::OwnedFd, unix::net::UnixStream},
};

use libfuzzer_sys::fuzz_target;
use nix::{
    fcntl::{FcntlArg, SealFlag, fcntl},
    sys::{
        eventfd::EventFd,
        memfd::{MFdFlags, memfd_create},
    },
};
use vrdma_pvrdma::abi::PAGE_SIZE;
use vrdma_vfio_user::{
    Session,
    dma::DmaConfig,
    proto::{self, Header},
    sigbus,
};
use zerocopy::FromBytes;

fn memfd(pages: u64) -> OwnedFd {
    let fd = memfd_create(c"fuzz-ram", MFdFlags::MFD_ALLOW_SEALING).expect("memfd");
    let len = i64::try_from(pages * PAGE_SIZE).expect("at most 31 pages");
    nix::unistd::ftruncate(&fd, len).expect("ftruncate");
    fd
}

/// The descriptor `b` names, and the client's copy of an unsealed memfd.
fn descriptor(b: u8) -> (Option<OwnedFd>, Option<OwnedFd>) {
    let pages = u64::from(b >> 3);
    match b & 7 {
        0 => {
            let fd = memfd(pages);
            let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW;
            fcntl(&fd, FcntlArg::F_ADD_SEALS(seals)).expect("seals");
            (Some(fd), None)
        }
        1 => {
            let fd = memfd(pages);
            let kept = fd.try_clone().expect("dup");
            (Some(fd), Some(kept))
        }
        2 => (Some(EventFd::new().expect("eventfd").into()), None),
        3 => (Some(nix::unistd::pipe().expect("pipe").0), None),
        4 => (Some(nix::unistd::pipe().expect("pipe").1), None),
        5 => (
            Some(File::open("/dev/null").expect("/dev/null").into()),
            None,
        ),
        6 => (Some(UnixStream::pair().expect("socketpair").0.into()), None),
        _ => (None, None),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&policy, mut rest)) = data.split_first() else {
        return;
    };
    let config = DmaConfig {
        allow_unsealed: policy & 1 != 0,
        max_maps: 1 + usize::from((policy >> 1) & 7),
        max_bytes: 4096 << (policy >> 4),
    };
    let mut f = common::function();
    let mut session = Session::with_config(&f, config.clone());
    let vectors: usize = {
        use vrdma_vfio_user::Function;
        f.irq_counts().iter().map(|&n| n as usize).sum()
    };
    // The client's copies of the unsealed memfds it sent.
    let mut kept: Vec<OwnedFd> = Vec::new();
    let mut now = 0u64;
    while let Some((&count, tail)) = rest.split_first() {
        let n = usize::from(count % 18).min(tail.len());
        let (kinds, tail) = tail.split_at(n);
        let mut fds = Vec::new();
        for &k in kinds {
            let (fd, keep) = descriptor(k);
            fds.extend(fd);
            kept.extend(keep);
            if k & 7 == 7 {
                let len = i64::try_from(u64::from(k >> 3) * PAGE_SIZE).expect("31 pages");
                for fd in &kept {
                    let _ = nix::unistd::ftruncate(fd, len);
                }
            }
        }
        let Ok((h, tail)) = Header::read_from_prefix(tail) else {
            break;
        };
        let Some(len) = h.payload_len() else {
            break;
        };
        if h.size as usize > proto::MAX_MESSAGE || tail.len() < len {
            break;
        }
        let (payload, next) = tail.split_at(len);
        rest = next;
        if let Some(reply) = session.handle(&mut f, &h, payload, fds) {
            let (r, body) = Header::read_from_prefix(&reply.bytes).expect("a reply header");
            assert_eq!((r.id, r.command), (h.id, h.command));
            assert_eq!(r.size as usize, reply.bytes.len());
            assert_ne!(r.flags & proto::flags::TYPE_REPLY, 0);
            if r.flags & proto::flags::ERROR != 0 {
                assert_ne!(r.error, 0, "an error reply with errno 0");
                assert!(body.is_empty());
            }
        } else {
            assert!(h.no_reply());
        }
        // The device's round: it reads and writes the memory it was given.
        now += 1_000_000;
        let _ = f.device_mut().progress_at(now);
        f.deliver(&mut session.bus());
        let held = session.holdings();
        assert!(held.dma_maps <= config.max_maps, "{held:?}");
        assert!(held.dma_bytes <= config.max_bytes, "{held:?}");
        assert!(held.fds <= config.max_maps + vectors, "{held:?}");
    }
    session.disconnect(&mut f);
    let held = session.holdings();
    assert_eq!((held.dma_maps, held.dma_bytes, held.fds), (0, 0, 0));
    assert_eq!(sigbus::registered(), 0, "a guard outlived its mapping");
    if common::trace() {
        eprintln!("{:?} {held:?}", session.stats());
    }
});
