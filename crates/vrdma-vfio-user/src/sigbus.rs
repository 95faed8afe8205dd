//! A guard against SIGBUS from memory another process can shrink.
//!
//! A shared mapping of a file faults with SIGBUS when it touches a page
//! past the file's end: a client that truncates the file behind guest
//! memory it shared would kill the whole daemon, every tenant with it,
//! at the device's next access. Files sealed against shrinking
//! (`F_SEAL_SHRINK`) cannot do that; for the others a process registers
//! each such mapping here, by address range.
//!
//! A fault in a registered range (`BUS_ADRERR`) is repaired in the handler:
//! the faulting page is replaced by a private anonymous zero page (`mmap`
//! with `MAP_FIXED`), the range's fault count goes up, and the access is
//! retried — it reads zeros, and what it writes goes nowhere. A fault
//! anywhere else, or a SIGBUS another process sent, gets the action that
//! was there before this handler (the default kills the process, as if the
//! guard were not there): the handler puts it back and returns, so the
//! access faults again, or raises the signal again.
//!
//! The registry has a fixed capacity ([`CAPACITY`] ranges) and is
//! lock-free: the handler only loads atomics, and a registration is
//! published and withdrawn with atomic stores, read as a sequence lock
//! (a slot that changed while the handler read it is skipped). Nothing here
//! knows vfio-user: a vhost-user face or a shared-memory fabric that maps
//! foreign memory registers its ranges the same way.

#![allow(unsafe_code)]

use std::{
    ops::Range,
    sync::{
        OnceLock,
        atomic::{AtomicU64, AtomicUsize, Ordering, fence},
    },
};

use nix::errno::Errno;

/// Ranges registered at most at once.
pub const CAPACITY: usize = 4096;

/// Why a range could not be registered.
#[derive(Debug, thiserror::Error, Eq, PartialEq)]
pub enum Error {
    #[error("the SIGBUS registry is full ({CAPACITY} ranges)")]
    Full,
    #[error("an empty, unaligned or wrapping range: {start:#x}+{len:#x} (page {page:#x})")]
    BadRange {
        start: usize,
        len: usize,
        page: usize,
    },
    #[error("installing the SIGBUS handler: {0}")]
    Install(#[source] Errno),
}

/// A registered range: faults in it are repaired while this lives; it is
/// withdrawn when dropped.
#[derive(Debug)]
pub struct Guard {
    slot: usize,
    range: Range<usize>,
}

impl Guard {
    /// Faults repaired in the range (each one a page the file lost).
    pub fn faults(&self) -> u64 {
        SLOTS[self.slot].faults.load(Ordering::Relaxed)
    }

    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let s = &SLOTS[self.slot];
        let state = s.state.load(Ordering::Relaxed);
        // A new generation, free: the handler skips the slot from now on
        // (and a reader that saw it active sees the change).
        s.state.store(next(state, FREE), Ordering::Release);
    }
}

/// Registers `len` bytes at `start`, made of pages of `page` bytes (a
/// power of two; `start` and `len` multiples of it): a SIGBUS in them is
/// repaired with zero pages from now until the [`Guard`] is dropped. The
/// handler is installed on the first registration.
///
/// # Safety
///
/// The range must be a mapping the caller owns and keeps mapped for as long
/// as the guard lives (drop the guard before unmapping: an address range
/// registered after its mapping went could be reused by another mapping,
/// whose faults would then be hidden), and its pages of `page` bytes may be
/// replaced at any time by private zero pages (only pages whose access
/// faulted, which had no contents left to lose).
pub unsafe fn register(start: usize, len: usize, page: usize) -> Result<Guard, Error> {
    let bad = Error::BadRange { start, len, page };
    if !page.is_power_of_two()
        || len == 0
        || !start.is_multiple_of(page)
        || !len.is_multiple_of(page)
    {
        return Err(bad);
    }
    let end = start.checked_add(len).ok_or(bad)?;
    install()?;
    for (i, s) in SLOTS.iter().enumerate() {
        let state = s.state.load(Ordering::Relaxed);
        if tag(state) != FREE {
            continue;
        }
        let busy = next(state, BUSY);
        if s.state
            .compare_exchange(state, busy, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            continue;
        }
        // The sequence lock's writer: the busy state is visible before
        // any of the fields change.
        fence(Ordering::Release);
        s.start.store(start, Ordering::Relaxed);
        s.end.store(end, Ordering::Relaxed);
        s.page.store(page, Ordering::Relaxed);
        s.faults.store(0, Ordering::Relaxed);
        s.state.store(next(busy, ACTIVE), Ordering::Release);
        return Ok(Guard {
            slot: i,
            range: start..end,
        });
    }
    Err(Error::Full)
}

/// The system's page size (the smallest `page` to register with).
pub fn page_size() -> usize {
    // SAFETY: sysconf(3) reads a system constant; it touches no memory
    // of ours.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).unwrap_or(4096)
}

/// Ranges registered now.
pub fn registered() -> usize {
    SLOTS
        .iter()
        .filter(|s| tag(s.state.load(Ordering::Relaxed)) == ACTIVE)
        .count()
}

/// A slot's state: a tag in the low two bits, a generation above them
/// that every change moves on (so that a reader sees any change).
const FREE: u64 = 0;
const BUSY: u64 = 1;
const ACTIVE: u64 = 2;

fn tag(state: u64) -> u64 {
    state & 3
}

fn next(state: u64, tag: u64) -> u64 {
    ((state >> 2).wrapping_add(1) << 2) | tag
}

struct Slot {
    state: AtomicU64,
    start: AtomicUsize,
    end: AtomicUsize,
    page: AtomicUsize,
    faults: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)] // Only the array's initializer.
const EMPTY: Slot = Slot {
    state: AtomicU64::new(FREE),
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    page: AtomicUsize::new(0),
    faults: AtomicU64::new(0),
};

static SLOTS: [Slot; CAPACITY] = [EMPTY; CAPACITY];

/// The SIGBUS action before ours (what a fault that is not ours gets).
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// Installs the handler once; the first result stays.
fn install() -> Result<(), Error> {
    static INSTALLED: OnceLock<Result<(), Errno>> = OnceLock::new();
    let r = INSTALLED.get_or_init(|| {
        // SAFETY: an all-zero `sigaction` is a valid value (no handler,
        // no flags, an empty mask), filled in below.
        let mut new: libc::sigaction = unsafe { std::mem::zeroed() };
        new.sa_sigaction = on_sigbus as *const () as usize;
        // The thread's alternate stack if it has one (Rust gives its
        // threads one): a fault may come with little stack left.
        new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: an all-zero `sigaction` is valid; the kernel fills it.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: both pointers are to live `sigaction` values; the
        // handler is an `extern "C"` function of the SA_SIGINFO shape that
        // does only async-signal-safe things.
        let rc = unsafe { libc::sigaction(libc::SIGBUS, &new, &mut old) };
        if rc != 0 {
            return Err(Errno::last());
        }
        // The handler reads it only once set; a fault before that finds
        // none and restores the default action.
        let _ = PREVIOUS.set(old);
        Ok(())
    });
    r.map_err(Error::Install)
}

/// The slot whose range holds `addr`, and its page size.
fn find(addr: usize) -> Option<(&'static Slot, usize)> {
    for s in &SLOTS {
        let before = s.state.load(Ordering::Acquire);
        if tag(before) != ACTIVE {
            continue;
        }
        let (start, end, page) = (
            s.start.load(Ordering::Relaxed),
            s.end.load(Ordering::Relaxed),
            s.page.load(Ordering::Relaxed),
        );
        // The sequence lock's reader: the fields were those of the state
        // read first only if the state has not changed since.
        fence(Ordering::Acquire);
        if s.state.load(Ordering::Relaxed) != before {
            continue;
        }
        if (start..end).contains(&addr) {
            return Some((s, page));
        }
    }
    None
}

/// The SIGBUS handler: async-signal-safe (atomics, `mmap`, `sigaction`,
/// `raise`; no allocation, no lock).
extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: `__errno_location` gives this thread's errno, which the
    // handler saves and restores around its system calls so that the
    // interrupted code never sees them.
    let errno = unsafe { libc::__errno_location() };
    // SAFETY: as above; the pointer is valid for the thread's life.
    let saved = unsafe { *errno };
    // SAFETY: the kernel passes a valid `siginfo_t` to an SA_SIGINFO
    // handler; `si_addr` is the faulting address for a fault.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    if code == libc::BUS_ADRERR
        && let Some((slot, page)) = find(addr)
    {
        let at = addr & !(page - 1);
        // SAFETY: `at..at + page` lies in a registered range (pages of
        // `page` bytes, aligned), which its registrant keeps mapped and
        // allows to be replaced by zero pages (`register`'s contract);
        // MAP_FIXED replaces exactly that page of it.
        let p = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            slot.faults.fetch_add(1, Ordering::Relaxed);
            // SAFETY: see above.
            unsafe { *errno = saved };
            return;
        }
    }
    // Not ours: the action there was before, for this fault (it faults
    // again on return) and every later one.
    let dfl = {
        // SAFETY: an all-zero `sigaction` is SIG_DFL with no flags.
        unsafe { std::mem::zeroed::<libc::sigaction>() }
    };
    let previous = PREVIOUS.get().unwrap_or(&dfl);
    // SAFETY: a valid `sigaction` value; sigaction(2) is
    // async-signal-safe.
    unsafe { libc::sigaction(libc::SIGBUS, previous, std::ptr::null_mut()) };
    if code <= 0 {
        // Sent by a process, not a fault: nothing faults again, so the
        // signal is raised again (delivered on return, SIGBUS being
        // blocked while its handler runs).
        // SAFETY: raise(3) is async-signal-safe.
        unsafe { libc::raise(libc::SIGBUS) };
    }
    // SAFETY: see above.
    unsafe { *errno = saved };
}

#[cfg(test)]
mod tests {
    use std::{
        fs::File,
        os::unix::{fs::FileExt, process::ExitStatusExt},
    };

    use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

    use super::*;
    use crate::child;

    const PAGE: usize = 4096;

    /// A memfd of `pages` pages mapped shared (as a DMA map is).
    fn mapped(pages: usize) -> (File, MmapRegion<()>) {
        let fd =
            nix::sys::memfd::memfd_create(c"sigbus", nix::sys::memfd::MFdFlags::empty()).unwrap();
        let file = File::from(fd);
        file.set_len((pages * PAGE) as u64).unwrap();
        let clone = file.try_clone().unwrap();
        let m = MmapRegion::from_file(FileOffset::new(clone, 0), pages * PAGE).unwrap();
        (file, m)
    }

    fn guard(m: &MmapRegion<()>) -> Guard {
        // SAFETY: `m` is this test's mapping, alive until after the guard
        // (the guard is dropped first in every test), and nothing reads
        // its pages but the test.
        unsafe { register(m.as_ptr() as usize, m.size(), PAGE) }.unwrap()
    }

    #[test]
    fn a_fault_in_a_registered_range_reads_zeros_and_writes_go_nowhere() {
        const NAME: &str =
            "sigbus::tests::a_fault_in_a_registered_range_reads_zeros_and_writes_go_nowhere";
        if !child::is(NAME) {
            let s = child::run(NAME);
            assert!(s.success(), "the child: {s:?}");
            return;
        }
        let (file, m) = mapped(3);
        let g = guard(&m);
        let v = m.as_volatile_slice();
        v.write_obj(0x1111_u64, 0).unwrap();
        v.write_obj(0x2222_u64, 2 * PAGE).unwrap();
        // The client shrinks the file to one page.
        file.set_len(PAGE as u64).unwrap();
        assert_eq!(v.read_obj::<u64>(0).unwrap(), 0x1111, "still in the file");
        assert_eq!(v.read_obj::<u64>(2 * PAGE).unwrap(), 0, "lost: zeros");
        assert_eq!(g.faults(), 1);
        v.write_obj(0x3333_u64, PAGE + 8).unwrap();
        assert_eq!(g.faults(), 2);
        assert_eq!(v.read_obj::<u64>(PAGE + 8).unwrap(), 0x3333);
        // The write never reached the file: grown again, it reads zeros.
        file.set_len((3 * PAGE) as u64).unwrap();
        let mut b = [0u8; 8];
        file.read_exact_at(&mut b, (PAGE + 8) as u64).unwrap();
        assert_eq!(b, [0; 8]);
        drop(g);
        drop(m);
    }

    #[test]
    fn a_fault_outside_every_registered_range_still_kills() {
        const NAME: &str = "sigbus::tests::a_fault_outside_every_registered_range_still_kills";
        if !child::is(NAME) {
            let s = child::run(NAME);
            assert_eq!(s.signal(), Some(libc::SIGBUS), "the child: {s:?}");
            return;
        }
        let (_f, guarded) = mapped(1);
        let _g = guard(&guarded);
        let (file, m) = mapped(2);
        file.set_len(0).unwrap();
        let _ = m.as_volatile_slice().read_obj::<u64>(PAGE);
        unreachable!("the read faults");
    }

    #[test]
    fn a_withdrawn_range_is_no_longer_repaired() {
        const NAME: &str = "sigbus::tests::a_withdrawn_range_is_no_longer_repaired";
        if !child::is(NAME) {
            let s = child::run(NAME);
            assert_eq!(s.signal(), Some(libc::SIGBUS), "the child: {s:?}");
            return;
        }
        let (file, m) = mapped(2);
        drop(guard(&m));
        file.set_len(0).unwrap();
        let _ = m.as_volatile_slice().read_obj::<u64>(PAGE);
        unreachable!("the read faults");
    }

    #[test]
    fn the_registry_is_bounded_and_slots_come_back() {
        const NAME: &str = "sigbus::tests::the_registry_is_bounded_and_slots_come_back";
        if !child::is(NAME) {
            let s = child::run(NAME);
            assert!(s.success(), "the child: {s:?}");
            return;
        }
        let (_f, m) = mapped(1);
        let mut guards: Vec<Guard> = (0..CAPACITY).map(|_| guard(&m)).collect();
        assert_eq!(registered(), CAPACITY);
        // SAFETY: as in `guard`.
        let full = unsafe { register(m.as_ptr() as usize, PAGE, PAGE) };
        assert_eq!(full.unwrap_err(), Error::Full);
        guards.pop();
        assert_eq!(registered(), CAPACITY - 1);
        guards.push(guard(&m));
        drop(guards);
        assert_eq!(registered(), 0);
    }

    #[test]
    fn ranges_must_be_whole_pages() {
        for (start, len, page) in [
            (0x1000, 0, PAGE),
            (0x1001, PAGE, PAGE),
            (0x1000, 100, PAGE),
            (0x1000, PAGE, 3000),
            (usize::MAX & !(PAGE - 1), 2 * PAGE, PAGE),
        ] {
            // SAFETY: every one is refused before anything is registered.
            let r = unsafe { register(start, len, page) };
            assert!(matches!(r, Err(Error::BadRange { .. })), "{start:#x}");
        }
    }
}
