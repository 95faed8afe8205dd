//! The system calls the Ethernet port needs that `std` does not offer:
//! opening a TAP device (`TUNSETIFF`), an epoll instance that gathers the
//! port's descriptors into one for the device's event loop, and an eventfd
//! that wakes it. Written against `libc` as the UDP port's calls are; this
//! module is the port's only unsafe code.
#![allow(unsafe_code)]

use std::{
    fs::{File, OpenOptions},
    io::{self, Read, Write},
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
};

/// `TUNSETIFF` = `_IOW('T', 202, int)`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;

/// `struct ifreq` as `TUNSETIFF` reads it: the name, then the flags.
#[repr(C)]
struct IfReq {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Opens the TAP device `name` (creating it if it does not exist), frames
/// without packet information, each after a little-endian virtio-net
/// header, non-blocking; with `uso`, asks the kernel for checksum offload
/// and UDP segmentation both ways (Linux 6.2 on), and says whether it
/// agreed (an older kernel refuses: then frames come and go whole, their
/// headers all zero).
pub(super) fn open_tap(name: &str, uso: bool) -> io::Result<(File, bool)> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.bytes().any(|b| b == 0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "TAP name: 1 to 15 bytes, no NUL",
        ));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
        _pad: [0; 22],
    };
    for (d, s) in req.name.iter_mut().zip(name.bytes()) {
        *d = libc::c_char::from_ne_bytes([s]);
    }
    // SAFETY: TUNSETIFF reads (and may write back) one `struct ifreq`;
    // `req` is a live, properly laid out one for the duration of the call.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &raw mut req) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = file.as_raw_fd();
    let hdr_len = libc::c_int::try_from(super::tap::VNET_HDR_LEN).map_err(io::Error::other)?;
    set_int(fd, libc::TUNSETVNETHDRSZ, hdr_len)?;
    set_int(fd, libc::TUNSETVNETLE, 1)?;
    let uso =
        uso && set_offload(fd, libc::TUN_F_CSUM | libc::TUN_F_USO4 | libc::TUN_F_USO6).is_ok();
    if !uso {
        // Frames whole, checksums written: what a peer without offloads
        // gets (a TAP a previous owner set up otherwise is set back).
        set_offload(fd, 0)?;
    }
    set_nonblocking(fd)?;
    Ok((file, uso))
}

/// A TUN ioctl that reads one `int`.
fn set_int(fd: RawFd, request: libc::c_ulong, v: libc::c_int) -> io::Result<()> {
    // SAFETY: the request reads one int through the pointer, which points
    // at a live local for the duration of the call.
    if unsafe { libc::ioctl(fd, request, &raw const v) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `TUNSETOFFLOAD`: the offloads the reader of the TAP takes.
fn set_offload(fd: RawFd, flags: libc::c_uint) -> io::Result<()> {
    // SAFETY: TUNSETOFFLOAD takes its flags by value; no memory is passed.
    if unsafe { libc::ioctl(fd, libc::TUNSETOFFLOAD, libc::c_ulong::from(flags)) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets `O_NONBLOCK` on `fd`.
pub(super) fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor the caller owns; no memory
    // is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An epoll instance (level-triggered, input only) and an eventfd in it
/// that [`Epoll::wake`] makes readable.
#[derive(Debug)]
pub(super) struct Epoll {
    fd: OwnedFd,
    event: File,
}

const TOKEN_WAKE: u64 = 0;

impl Epoll {
    pub(super) fn new() -> io::Result<Self> {
        // SAFETY: creates a new descriptor; no memory is passed.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by epoll_create1 and is owned by
        // nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: creates a new descriptor; no memory is passed.
        let e = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if e < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `e` was just returned by eventfd and is owned by nothing
        // else.
        let event = unsafe { File::from_raw_fd(e) };
        let ep = Epoll { fd, event };
        ep.add(ep.event.as_fd(), TOKEN_WAKE)?;
        Ok(ep)
    }

    /// Watches `fd` for input.
    pub(super) fn add(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, token, libc::EPOLLIN as u32)
    }

    /// Watches `fd` (added with `token`) for room to write as well as for
    /// input (`out`), or for input alone.
    pub(super) fn watch(&self, fd: BorrowedFd<'_>, token: u64, out: bool) -> io::Result<()> {
        let mut events = libc::EPOLLIN as u32;
        if out {
            events |= libc::EPOLLOUT as u32;
        }
        self.ctl(libc::EPOLL_CTL_MOD, fd, token, events)
    }

    /// Watches `fd` (added with `token`) for input (`on`), or for nothing
    /// while it stays in the instance (no memory to allocate when it is
    /// watched again; a listening socket reports no hang-up or error).
    pub(super) fn watch_input(&self, fd: BorrowedFd<'_>, token: u64, on: bool) -> io::Result<()> {
        let events = if on { libc::EPOLLIN as u32 } else { 0 };
        self.ctl(libc::EPOLL_CTL_MOD, fd, token, events)
    }

    fn ctl(&self, op: libc::c_int, fd: BorrowedFd<'_>, token: u64, events: u32) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: both descriptors are open (borrowed for the call) and
        // `ev` is a valid epoll_event the kernel only reads.
        let r = unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd.as_raw_fd(), &raw mut ev) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Stops watching `fd` (before it is closed).
    pub(super) fn remove(&self, fd: BorrowedFd<'_>) {
        // SAFETY: EPOLL_CTL_DEL ignores the event pointer (null is allowed
        // since Linux 2.6.9); both descriptors are open. A failure (not
        // watched) leaves nothing to undo.
        unsafe {
            libc::epoll_ctl(
                self.fd.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                fd.as_raw_fd(),
                std::ptr::null_mut(),
            );
        }
    }

    /// Makes the instance readable until the next [`Epoll::drain`].
    pub(super) fn wake(&self) -> io::Result<()> {
        match (&self.event).write(&1u64.to_ne_bytes()) {
            Ok(_) => Ok(()),
            // The counter is saturated: it is readable anyway.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Clears a wake-up.
    pub(super) fn drain(&self) {
        let mut b = [0u8; 8];
        let _ = (&self.event).read(&mut b);
    }
}

impl AsFd for Epoll {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
