//! What the rendezvous asks of a descriptor a peer sent: whether it is an
//! eventfd. (Descriptors are received and owned by `vrdma_sys::sock`.)

use std::os::fd::{AsRawFd, OwnedFd};

/// Whether `fd` is an eventfd (a peer's wake-up descriptor must be one:
/// anything else could block the writer, or be a file it should not
/// write).
pub(super) fn is_eventfd(fd: &OwnedFd) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|p| p.as_os_str() == "anon_inode:[eventfd]")
}
