//! Interrupts: the eventfds the client hands over with `DEVICE_SET_IRQS`
//! (for MSI-X, one per vector, typically KVM irqfds), and raising one.
//! QEMU masks and unmasks MSI-X vectors itself by swapping the eventfd
//! behind a vector, so a device only ever writes to the one it holds; the
//! mask actions are still honoured for a client that uses them (a masked
//! vector's interrupt is held and raised on unmask).
//!
//! Only eventfds are taken, made non-blocking: a write to one never waits
//! (it fails, and the interrupt is lost, only if the client saturated the
//! counter), where a pipe or a socket nobody reads would hold the device's
//! thread once full.

use std::{
    fs::File,
    io::Write,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
};

use nix::{
    errno::Errno,
    fcntl::{FcntlArg, OFlag, fcntl},
};

use crate::proto::{IrqSet, irq};

#[derive(Debug, Default)]
struct Vector {
    fd: Option<File>,
    masked: bool,
    pending: bool,
}

/// The interrupt indexes of a function and their vectors.
#[derive(Debug)]
pub struct Irqs {
    /// Per index, its vectors (the count the function reports).
    indexes: Vec<Vec<Vector>>,
    /// Interrupts raised and delivered.
    raised: u64,
    /// Interrupts raised with no eventfd behind the vector (lost, as a
    /// device whose MSI-X vector is not enabled loses them).
    dropped: u64,
}

impl Irqs {
    /// Indexes with `counts[i]` vectors each.
    pub fn new(counts: &[u32]) -> Self {
        Irqs {
            indexes: counts
                .iter()
                .map(|&n| (0..n).map(|_| Vector::default()).collect())
                .collect(),
            raised: 0,
            dropped: 0,
        }
    }

    /// `DEVICE_SET_IRQS` (flags already checked by the decoder: one data
    /// kind, at most one action). A descriptor that is not an eventfd is
    /// EINVAL, and nothing changes.
    pub fn set(&mut self, s: &IrqSet, fds: Vec<OwnedFd>) -> Result<(), Errno> {
        let vectors = self
            .indexes
            .get_mut(s.index as usize)
            .ok_or(Errno::EINVAL)?;
        let data = s.flags & irq::DATA_MASK;
        let action = s.flags & irq::ACTION_MASK_ALL;
        if data != irq::DATA_EVENTFD && !fds.is_empty() {
            return Err(Errno::EINVAL);
        }
        // DATA_NONE with TRIGGER and count 0: disable the whole index.
        if data == irq::DATA_NONE && action == irq::ACTION_TRIGGER && s.count == 0 {
            if s.start != 0 {
                return Err(Errno::EINVAL);
            }
            for v in vectors.iter_mut() {
                *v = Vector::default();
            }
            return Ok(());
        }
        let end = s.start.checked_add(s.count).ok_or(Errno::EINVAL)? as usize;
        if s.count == 0 || end > vectors.len() {
            return Err(Errno::EINVAL);
        }
        let range = s.start as usize..end;
        match (data, action) {
            (irq::DATA_EVENTFD, irq::ACTION_TRIGGER) => {
                if fds.is_empty() {
                    // No descriptors: the vectors lose theirs.
                    for v in &mut vectors[range] {
                        v.fd = None;
                    }
                } else if fds.len() == s.count as usize {
                    for fd in &fds {
                        take_eventfd(fd.as_fd())?;
                    }
                    for (v, fd) in vectors[range].iter_mut().zip(fds) {
                        v.fd = Some(File::from(fd));
                    }
                } else {
                    return Err(Errno::EINVAL);
                }
            }
            (irq::DATA_NONE, irq::ACTION_TRIGGER) => {
                // Loopback: raise them now.
                for n in range {
                    self.raise(s.index, n as u32);
                }
            }
            (irq::DATA_NONE, irq::ACTION_MASK) => {
                for v in &mut vectors[range] {
                    v.masked = true;
                }
            }
            (irq::DATA_NONE, irq::ACTION_UNMASK) => {
                let mut deliver = Vec::new();
                for (n, v) in vectors[range.clone()].iter_mut().enumerate() {
                    v.masked = false;
                    if std::mem::take(&mut v.pending) {
                        deliver.push(range.start + n);
                    }
                }
                for n in deliver {
                    self.raise(s.index, n as u32);
                }
            }
            // Eventfds for mask/unmask (INTx resampling) are not taken: no
            // index of this server is level-triggered.
            _ => return Err(Errno::EINVAL),
        }
        Ok(())
    }

    /// Raises vector `n` of `index`: writes its eventfd, or holds it while
    /// masked. False if it was lost (no eventfd behind the vector).
    pub fn raise(&mut self, index: u32, n: u32) -> bool {
        let Some(v) = self
            .indexes
            .get_mut(index as usize)
            .and_then(|v| v.get_mut(n as usize))
        else {
            self.dropped += 1;
            return false;
        };
        if v.masked {
            v.pending = true;
            return true;
        }
        // An eventfd adds the 8-byte value written to its counter; the
        // write fails only if the counter would overflow, which nothing
        // short of 2^64 unconsumed interrupts does.
        match &mut v.fd {
            // `&File` writes too: the guard needs no mutable borrow.
            Some(f) if (&*f).write_all(&1u64.to_ne_bytes()).is_ok() => {
                self.raised += 1;
                true
            }
            _ => {
                self.dropped += 1;
                false
            }
        }
    }

    /// Descriptors held (one per vector with an eventfd).
    pub fn fds(&self) -> usize {
        self.indexes
            .iter()
            .flatten()
            .filter(|v| v.fd.is_some())
            .count()
    }

    /// Whether vector `n` of `index` has an eventfd.
    pub fn is_enabled(&self, index: u32, n: u32) -> bool {
        self.indexes
            .get(index as usize)
            .and_then(|v| v.get(n as usize))
            .is_some_and(|v| v.fd.is_some())
    }

    /// Drops every eventfd (the client went away).
    pub fn clear(&mut self) {
        for v in self.indexes.iter_mut().flatten() {
            *v = Vector::default();
        }
    }

    /// (delivered, lost) since the start.
    pub fn counts(&self) -> (u64, u64) {
        (self.raised, self.dropped)
    }
}

/// Checks that `fd` is an eventfd and makes it non-blocking (EINVAL if it
/// is not one).
///
/// An eventfd has no file type of its own (it is an anonymous inode, as
/// timerfds, signalfds and epoll instances are); its link in
/// `/proc/self/fd` names it, `anon_inode:[eventfd]` — a name only the
/// kernel's anonymous-inode files have (a file's link is its path, which
/// starts with `/`). Without `/proc` every descriptor is refused.
///
/// `O_NONBLOCK` belongs to the open file, which the client shares: QEMU's
/// eventfds are non-blocking already; a client that clears the flag again
/// and fills the counter itself can stall only its own device's thread.
fn take_eventfd(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|_| Errno::EINVAL)?;
    if link.as_os_str() != "anon_inode:[eventfd]" {
        tracing::debug!(kind = %link.display(), "SET_IRQS: not an eventfd");
        return Err(Errno::EINVAL);
    }
    let flags = OFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use nix::sys::eventfd::{EfdFlags, EventFd};

    use super::*;
    use crate::proto::irq_index;

    fn set(flags: u32, start: u32, count: u32) -> IrqSet {
        IrqSet {
            argsz: 20,
            flags,
            index: irq_index::MSIX,
            start,
            count,
        }
    }

    fn eventfd() -> (OwnedFd, File) {
        let e = EventFd::from_flags(EfdFlags::EFD_NONBLOCK).unwrap();
        let fd: OwnedFd = e.into();
        let reader = File::from(fd.try_clone().unwrap());
        (fd, reader)
    }

    fn count(f: &mut File) -> u64 {
        let mut b = [0u8; 8];
        match f.read(&mut b) {
            Ok(8) => u64::from_ne_bytes(b),
            _ => 0,
        }
    }

    #[test]
    fn a_vector_with_an_eventfd_is_raised_and_one_without_is_lost() {
        let mut irqs = Irqs::new(&[0, 0, 3]);
        let (fd, mut r) = eventfd();
        irqs.set(
            &set(irq::DATA_EVENTFD | irq::ACTION_TRIGGER, 1, 1),
            vec![fd],
        )
        .unwrap();
        assert!(irqs.raise(irq_index::MSIX, 1));
        assert!(irqs.raise(irq_index::MSIX, 1));
        assert_eq!(count(&mut r), 2);
        assert!(!irqs.raise(irq_index::MSIX, 0));
        assert!(!irqs.raise(irq_index::MSIX, 3));
        assert!(!irqs.raise(irq_index::INTX, 0));
        assert_eq!(irqs.counts(), (2, 3));
        // No descriptors for the vector: it loses its eventfd.
        irqs.set(&set(irq::DATA_EVENTFD | irq::ACTION_TRIGGER, 1, 1), vec![])
            .unwrap();
        assert!(!irqs.is_enabled(irq_index::MSIX, 1));
    }

    #[test]
    fn masked_vectors_hold_their_interrupt_until_unmasked() {
        let mut irqs = Irqs::new(&[0, 0, 1]);
        let (fd, mut r) = eventfd();
        irqs.set(
            &set(irq::DATA_EVENTFD | irq::ACTION_TRIGGER, 0, 1),
            vec![fd],
        )
        .unwrap();
        irqs.set(&set(irq::DATA_NONE | irq::ACTION_MASK, 0, 1), vec![])
            .unwrap();
        assert!(irqs.raise(irq_index::MSIX, 0));
        assert_eq!(count(&mut r), 0);
        irqs.set(&set(irq::DATA_NONE | irq::ACTION_UNMASK, 0, 1), vec![])
            .unwrap();
        assert_eq!(count(&mut r), 1);
    }

    #[test]
    fn descriptors_that_are_not_eventfds_are_refused_and_change_nothing() {
        let mut irqs = Irqs::new(&[0, 0, 2]);
        let t = irq::DATA_EVENTFD | irq::ACTION_TRIGGER;
        let (good, mut r) = eventfd();
        irqs.set(&set(t, 0, 1), vec![good]).unwrap();
        let (pipe_r, pipe_w) = nix::unistd::pipe().unwrap();
        let (sock, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let memfd =
            nix::sys::memfd::memfd_create(c"irq", nix::sys::memfd::MFdFlags::empty()).unwrap();
        // Another anonymous inode.
        let epoll =
            nix::sys::epoll::Epoll::new(nix::sys::epoll::EpollCreateFlags::empty()).unwrap();
        for bad in [pipe_w, pipe_r, sock.into(), memfd, epoll.0] {
            let (e, _) = eventfd();
            assert_eq!(irqs.set(&set(t, 0, 2), vec![e, bad]), Err(Errno::EINVAL));
        }
        assert!(!irqs.is_enabled(irq_index::MSIX, 1));
        assert!(irqs.raise(irq_index::MSIX, 0));
        assert_eq!(count(&mut r), 1);
        assert_eq!(irqs.fds(), 1);
    }

    #[test]
    fn an_eventfd_is_made_non_blocking_so_a_full_counter_loses_the_interrupt() {
        let mut irqs = Irqs::new(&[0, 0, 1]);
        let e: OwnedFd = EventFd::from_flags(EfdFlags::empty()).unwrap().into();
        let mut client = File::from(e.try_clone().unwrap());
        irqs.set(&set(irq::DATA_EVENTFD | irq::ACTION_TRIGGER, 0, 1), vec![e])
            .unwrap();
        // The largest count an eventfd holds: one more would wait.
        client.write_all(&(u64::MAX - 1).to_ne_bytes()).unwrap();
        assert!(!irqs.raise(irq_index::MSIX, 0));
        assert_eq!(irqs.counts(), (0, 1));
    }

    #[test]
    fn bad_ranges_and_descriptor_counts_are_refused() {
        let mut irqs = Irqs::new(&[0, 0, 3]);
        let t = irq::DATA_EVENTFD | irq::ACTION_TRIGGER;
        assert_eq!(irqs.set(&set(t, 2, 2), vec![]), Err(Errno::EINVAL));
        assert_eq!(irqs.set(&set(t, u32::MAX, 2), vec![]), Err(Errno::EINVAL));
        let (a, _) = eventfd();
        assert_eq!(irqs.set(&set(t, 0, 2), vec![a]), Err(Errno::EINVAL));
        let (a, _) = eventfd();
        assert_eq!(
            irqs.set(&set(irq::DATA_NONE | irq::ACTION_TRIGGER, 0, 1), vec![a]),
            Err(Errno::EINVAL)
        );
        let bad_index = IrqSet {
            index: 9,
            ..set(t, 0, 1)
        };
        assert_eq!(irqs.set(&bad_index, vec![]), Err(Errno::EINVAL));
        // Disable all: count 0 with no data.
        irqs.set(&set(irq::DATA_NONE | irq::ACTION_TRIGGER, 0, 0), vec![])
            .unwrap();
    }
}
