//! The two things no safe wrapper gives [`super::sock`]: a `recvmsg` that
//! reports the length of the control data the kernel wrote (nix hides the
//! control messages of a message whose control data was cut short, and so
//! the descriptors the kernel installed with it), and owning a descriptor
//! the kernel installed for this process. This crate's only unsafe code.
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

/// What one `recvmsg` received.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Received {
    /// Bytes of the message.
    pub bytes: usize,
    /// The message's flags (`MSG_TRUNC`, `MSG_CTRUNC`, ...).
    pub flags: libc::c_int,
    /// Bytes of `control` the kernel wrote.
    pub control_len: usize,
}

/// One `recvmsg(2)` on `sock` into `buf`, its control messages into
/// `control` (which the caller aligns for `struct cmsghdr`), with `flags`.
pub(crate) fn recvmsg(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    control: &mut [u8],
    flags: libc::c_int,
) -> nix::Result<Received> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: `msghdr` is plain data (pointers, lengths, padding); all
    // zeros is a valid value — no name, no iovec, no control buffer —
    // which the fields set below complete.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    // SAFETY: `msg` names one iovec over `buf` and the control buffer
    // `control`, both valid for writes of their lengths and exclusively
    // borrowed for the call; the kernel writes at most those lengths into
    // them and updates `msg`'s lengths and flags. `sock` is open for the
    // call (borrowed).
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &raw mut msg, flags) };
    if n < 0 {
        return Err(Errno::last());
    }
    Ok(Received {
        // `n` is not negative (checked above).
        bytes: n.unsigned_abs(),
        flags: msg.msg_flags,
        // A `size_t` with glibc, a `socklen_t` with musl.
        #[allow(clippy::unnecessary_cast)]
        control_len: (msg.msg_controllen as usize).min(control.len()),
    })
}

/// Owns `fd`, a descriptor the kernel just installed for this process:
/// returned by `accept4`, or received with a message (`SCM_RIGHTS`).
pub(crate) fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: the caller passes a descriptor the kernel created for this
    // process in the call just made (a new connection, or one received
    // with a message); nothing else holds or closes it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}
