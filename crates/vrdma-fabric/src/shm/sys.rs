//! The one thing the rendezvous needs that no safe wrapper gives: taking
//! ownership of a descriptor the kernel installed for this process
//! (`accept4`, `SCM_RIGHTS`). This module is the medium's only unsafe
//! code.
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Owns `fd`, a descriptor the kernel just installed for this process
/// (returned by `accept4` or received by `SCM_RIGHTS`).
pub(super) fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: the caller passes a descriptor the kernel created for this
    // process in the call just made (a new connection, or one received
    // with a message); nothing else holds or closes it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// Whether `fd` is an eventfd (a peer's wake-up descriptor must be one:
/// anything else could block the writer, or be a file it should not
/// write).
pub(super) fn is_eventfd(fd: &OwnedFd) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|p| p.as_os_str() == "anon_inode:[eventfd]")
}
