//! `vrdma serve`'s confinement, once its devices are open: no privileges
//! beyond what serving needs, and a system-call allow-list.
//!
//! A device that is serving needs no privilege: its sockets are bound,
//! its TAP open, its doorbell memory made. What it still does is wait
//! (`poll`, `epoll_wait`), move bytes on descriptors it holds (`read`,
//! `write`, `recvmsg`, `sendmsg` with descriptors, `sendmmsg`), accept
//! clients on its sockets and check them (`accept4`, `getsockopt`
//! `SO_PEERCRED`), map and unmap the memory a client shares (`mmap`,
//! `munmap`, `fstat`, `fcntl` for seals and flags), inspect a descriptor
//! it was given (`readlinkat` on `/proc/self/fd`), publish its counters
//! (`openat`, `renameat`, `unlinkat` in its run directory), allocate, use
//! futexes and clocks, and exit. So:
//!
//! - [`refuse_staying_root`]: `--seccomp kill` — the confinement a
//!   multi-tenant host relies on — is refused to a root daemon that would
//!   stay root (no `--user`, or a `--user` whose uid is 0). Without
//!   capabilities it would still be uid 0, the owner of root's files
//!   (`/etc`, `/root`, the units and binaries root installed), which file
//!   permissions let their owner write; seccomp cannot check paths. It
//!   must become a user of its own.
//! - [`drop_privileges`]: with `--user`, the process takes that user's
//!   uid and gid (and no supplementary groups), which clears every
//!   capability; a root daemon without `--user` (only under `--seccomp
//!   log` now) drops each thread's capabilities
//!   ([`drop_thread_capabilities`]: capabilities are per thread, so every
//!   device thread calls it after opening its device).
//! - [`apply`]: a seccomp filter (rust-vmm's `seccompiler`) on every
//!   thread at once (TSYNC), with `no_new_privs`: a system call outside
//!   [`allowed`] kills the process (`kill`) or is logged by the kernel
//!   and allowed (`log`, to find what a new code path needs). `ioctl` is
//!   allowed only as `FIONBIO` (what setting a socket non-blocking uses),
//!   `clone` only for a thread (`CLONE_THREAD`: a virtio-rdma device's
//!   vhost-user daemon starts threads for each connection; `clone3`, whose
//!   flags a filter cannot read, fails with ENOSYS and the C library falls
//!   back to `clone`), `prctl` only as `PR_SET_NAME` and `PR_SET_TIMERSLACK`; `mmap` and
//!   `mprotect` never with `PROT_EXEC` (no code is loaded once the daemon
//!   serves: a compromised thread cannot make memory executable), and
//!   `kill` and `tgkill` only to the daemon itself (the filter compares
//!   their pid argument with the daemon's pid, known when the filter is
//!   made: a device thread wakes the main thread with SIGUSR1, the C
//!   library's `abort` signals its own thread; `tkill`, which names a
//!   thread of any process, is not allowed at all).
//!
//! Seccomp cannot look at paths: a confined daemon may still open files
//! its user may open, which is why a multi-tenant host runs it as a user
//! of its own (README).

#![allow(unsafe_code)]

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use nix::unistd::{Gid, Uid, User};
use seccompiler::{
    SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};

/// What a system call outside the allow-list does.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq, clap::ValueEnum)]
pub enum Seccomp {
    /// No filter.
    #[default]
    Off,
    /// The process is killed (SIGSYS).
    Kill,
    /// The kernel logs the call (audit) and lets it through.
    Log,
}

/// The user a daemon becomes.
#[derive(Clone, Debug)]
pub struct Identity {
    pub name: String,
    pub uid: Uid,
    pub gid: Gid,
}

/// Looks up `name` (a user name or a numeric uid) in the user database:
/// before anything is opened, so that a bad name fails at once.
pub fn identity(name: &str) -> Result<Identity> {
    let user = match name.parse::<u32>() {
        Ok(n) => User::from_uid(Uid::from_raw(n)),
        Err(_) => User::from_name(name),
    }
    .with_context(|| format!("looking up user {name}"))?;
    let Some(u) = user else {
        bail!("no user {name}");
    };
    Ok(Identity {
        name: u.name,
        uid: u.uid,
        gid: u.gid,
    })
}

/// Looks up a group by name or number.
pub fn group(name: &str) -> Result<Gid> {
    let g = match name.parse::<u32>() {
        Ok(n) => nix::unistd::Group::from_gid(Gid::from_raw(n)),
        Err(_) => nix::unistd::Group::from_name(name),
    }
    .with_context(|| format!("looking up group {name}"))?;
    match g {
        Some(g) => Ok(g.gid),
        None => bail!("no group {name}"),
    }
}

/// Refuses `--seccomp kill` for a daemon that would stay root: one whose
/// effective uid `euid` is 0 and that becomes no other user (`user` is
/// `None`, or names uid 0). Called before anything is opened; the error
/// says what to pass.
pub fn refuse_staying_root(seccomp: Seccomp, user: Option<&Identity>, euid: Uid) -> Result<()> {
    if seccomp != Seccomp::Kill || !euid.is_root() {
        return Ok(());
    }
    match user {
        Some(u) if !u.uid.is_root() => Ok(()),
        Some(u) => bail!(
            "--seccomp kill --user {}: that is root (uid 0), and a confined daemon must not stay \
             root (it would keep write access to root's files); pass --user with a user of its \
             own (e.g. --user vrdma-g1, or --user nobody)",
            u.name
        ),
        None => bail!(
            "--seccomp kill as root needs --user: without it the daemon would stay root (uid 0, \
             no capabilities, but the owner of root's files, which it could still write); pass \
             --user with a user of its own (e.g. --user vrdma-g1, or --user nobody), which it \
             becomes once its devices are open"
        ),
    }
}

/// Becomes `who` (uid, gid, no supplementary groups): every thread of the
/// process at once (the C library's set*id calls reach all threads), and
/// every capability goes with root.
pub fn drop_privileges(who: &Identity) -> Result<()> {
    if Uid::effective() == who.uid {
        return Ok(());
    }
    if !Uid::effective().is_root() {
        bail!("--user {}: only root can change user", who.name);
    }
    nix::unistd::setgroups(&[who.gid]).context("setgroups")?;
    nix::unistd::setgid(who.gid).context("setgid")?;
    nix::unistd::setuid(who.uid).context("setuid")?;
    if nix::unistd::setuid(Uid::from_raw(0)).is_ok() {
        bail!("--user {}: root could be regained", who.name);
    }
    Ok(())
}

/// Drops every capability of the calling thread (effective, permitted,
/// inheritable): a root daemon that keeps its uid keeps no power beyond a
/// user's file permissions.
pub fn drop_thread_capabilities() -> Result<()> {
    // linux/capability.h: _LINUX_CAPABILITY_VERSION_3, two 32-bit words.
    const VERSION_3: u32 = 0x2008_0522;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let data = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capset(2) reads one header and, for version 3, two data
    // structs, both laid out as the kernel defines them (repr(C)) and
    // alive for the call; pid 0 is the calling thread.
    let r = unsafe { libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr()) };
    if r != 0 {
        return Err(std::io::Error::last_os_error()).context("capset");
    }
    Ok(())
}

/// The system calls a serving daemon makes (see the module's doc).
pub fn allowed() -> Vec<i64> {
    let mut v = vec![
        // Waiting.
        libc::SYS_ppoll,
        libc::SYS_epoll_pwait,
        libc::SYS_epoll_ctl,
        libc::SYS_clock_nanosleep,
        libc::SYS_nanosleep,
        libc::SYS_clock_gettime,
        libc::SYS_gettimeofday,
        libc::SYS_rt_sigtimedwait,
        libc::SYS_rt_sigprocmask,
        libc::SYS_rt_sigreturn,
        libc::SYS_sigaltstack,
        libc::SYS_futex,
        libc::SYS_sched_yield,
        // A polling device's thread reads its own involuntary context
        // switches (RUSAGE_THREAD: vrdma_face::spin's preemption guard).
        libc::SYS_getrusage,
        // Bytes on descriptors it holds.
        libc::SYS_read,
        libc::SYS_write,
        libc::SYS_readv,
        libc::SYS_writev,
        libc::SYS_recvfrom,
        libc::SYS_sendto,
        libc::SYS_recvmsg,
        libc::SYS_sendmsg,
        libc::SYS_recvmmsg,
        libc::SYS_sendmmsg,
        libc::SYS_close,
        libc::SYS_fcntl,
        libc::SYS_fstat,
        libc::SYS_newfstatat,
        libc::SYS_statx,
        libc::SYS_fstatfs,
        libc::SYS_lseek,
        libc::SYS_pread64,
        libc::SYS_pwrite64,
        // Clients on its sockets.
        libc::SYS_accept4,
        libc::SYS_getsockopt,
        libc::SYS_setsockopt,
        libc::SYS_getsockname,
        libc::SYS_shutdown,
        // Memory: its own and what clients share (`mmap` and `mprotect`
        // never executable: `apply`).
        libc::SYS_munmap,
        libc::SYS_mremap,
        libc::SYS_madvise,
        libc::SYS_brk,
        // Descriptors it was given, and its counters' files.
        libc::SYS_readlinkat,
        libc::SYS_openat,
        libc::SYS_renameat2,
        libc::SYS_unlinkat,
        libc::SYS_mkdirat,
        libc::SYS_getdents64,
        // Who it is, threads, signals (to itself only: `kill` and `tgkill`
        // in `apply`), the end.
        libc::SYS_getpid,
        libc::SYS_gettid,
        libc::SYS_getuid,
        libc::SYS_geteuid,
        libc::SYS_getgid,
        libc::SYS_getegid,
        libc::SYS_getrandom,
        libc::SYS_rt_sigaction,
        libc::SYS_exit,
        libc::SYS_exit_group,
        libc::SYS_restart_syscall,
        libc::SYS_rseq,
        libc::SYS_set_robust_list,
        // A virtio-rdma device serves each vhost-user connection with a
        // new rust-vmm daemon: its epoll, eventfds and timer deadlines
        // (threads are allowed apart, see `apply`).
        libc::SYS_epoll_create1,
        libc::SYS_eventfd2,
        libc::SYS_timerfd_settime,
        libc::SYS_timerfd_gettime,
        // A new thread's C library asks how many CPUs it may run on (its
        // malloc arenas).
        libc::SYS_sched_getaffinity,
        // Same-host shared memory between daemons (`--shm-dir`): a ring for
        // each peer daemon that joins later is a sealed memfd given its
        // size (memfd_create itself only with the rings' flags: `apply`).
        libc::SYS_ftruncate,
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([
        libc::SYS_poll,
        libc::SYS_epoll_wait,
        libc::SYS_readlink,
        libc::SYS_open,
        libc::SYS_rename,
        libc::SYS_renameat,
        libc::SYS_unlink,
        libc::SYS_mkdir,
        libc::SYS_stat,
        libc::SYS_lstat,
        libc::SYS_arch_prctl,
    ]);
    v
}

/// Confines every thread of the process to [`allowed`] (and the calls
/// allowed with some arguments only: see the module's doc), with
/// `no_new_privs`.
pub fn apply(mode: Seccomp) -> Result<()> {
    let action = match mode {
        Seccomp::Off => return Ok(()),
        Seccomp::Kill => SeccompAction::KillProcess,
        Seccomp::Log => SeccompAction::Log,
    };
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|_| anyhow::anyhow!("--seccomp: not supported on {}", std::env::consts::ARCH))?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        allowed().into_iter().map(|n| (n, Vec::new())).collect();
    let fionbio =
        SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, libc::FIONBIO)?;
    rules.insert(libc::SYS_ioctl, vec![SeccompRule::new(vec![fionbio])?]);
    // A same-host ring's memfd (`vrdma_fabric::shm::ring::create`): close
    // on exec and sealable, nothing else (no hugetlb, no executable).
    let ring_memfd = SeccompCondition::new(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        u64::from(libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING),
    )?;
    rules.insert(
        libc::SYS_memfd_create,
        vec![SeccompRule::new(vec![ring_memfd])?],
    );
    // Threads, never processes: clone only with CLONE_THREAD (a
    // virtio-rdma device's vhost-user daemon starts its threads per
    // connection), and a thread may name itself.
    let thread = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
        libc::CLONE_THREAD as u64,
    )?;
    rules.insert(libc::SYS_clone, vec![SeccompRule::new(vec![thread])?]);
    let set_name = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        libc::PR_SET_NAME as u64,
    )?;
    // And a device thread's timer slack (vrdma_face::spin::precise_timers).
    let set_slack = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        libc::PR_SET_TIMERSLACK as u64,
    )?;
    rules.insert(
        libc::SYS_prctl,
        vec![
            SeccompRule::new(vec![set_name])?,
            SeccompRule::new(vec![set_slack])?,
        ],
    );
    // No executable memory: mmap's and mprotect's protection (their third
    // argument) without PROT_EXEC.
    let not_exec = || {
        SeccompCondition::new(
            2,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::MaskedEq(libc::PROT_EXEC as u64),
            0,
        )
    };
    rules.insert(libc::SYS_mmap, vec![SeccompRule::new(vec![not_exec()?])?]);
    rules.insert(
        libc::SYS_mprotect,
        vec![SeccompRule::new(vec![not_exec()?])?],
    );
    // Signals to this process only: kill(pid, …) and tgkill(tgid, …) with
    // its own pid (never 0, -1 or another's: a group, everyone, someone
    // else). The pid does not change (the daemon never forks: clone only
    // makes threads).
    let own_pid = u64::from(std::process::id());
    let to_self = || SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, own_pid);
    rules.insert(libc::SYS_kill, vec![SeccompRule::new(vec![to_self()?])?]);
    rules.insert(libc::SYS_tgkill, vec![SeccompRule::new(vec![to_self()?])?]);
    // clone3 passes its flags in memory a filter cannot read: allowed by
    // this filter, answered ENOSYS by the next, so the C library falls
    // back to clone, whose flags are checked.
    rules.insert(libc::SYS_clone3, Vec::new());
    let filter = SeccompFilter::new(rules, action, SeccompAction::Allow, arch)?;
    let program: seccompiler::BpfProgram = filter.try_into()?;
    let no_clone3 = SeccompFilter::new(
        [(libc::SYS_clone3, Vec::new())].into_iter().collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )?;
    let no_clone3: seccompiler::BpfProgram = no_clone3.try_into()?;
    // The clone3 filter first: once the allow-list is in, installing
    // another (prctl NO_NEW_PRIVS, seccomp) is outside it.
    seccompiler::apply_filter_all_threads(&no_clone3)
        .context("installing the seccomp filter (clone3)")?;
    seccompiler::apply_filter_all_threads(&program).context("installing the seccomp filter")?;
    Ok(())
}

/// Raises the soft limit of open descriptors to the hard one: each device
/// holds its guest's memory maps and interrupts (bounded by its budgets),
/// all in one table.
pub fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allow_list_has_no_duplicates_and_nothing_that_grants_power() {
        let v = allowed();
        let set: std::collections::BTreeSet<_> = v.iter().collect();
        assert_eq!(set.len(), v.len());
        for forbidden in [
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_ptrace,
            libc::SYS_setuid,
            libc::SYS_setgid,
            libc::SYS_capset,
            libc::SYS_mount,
            libc::SYS_socket,
            libc::SYS_connect,
            libc::SYS_bind,
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_process_vm_readv,
            libc::SYS_process_vm_writev,
            libc::SYS_memfd_create,
            libc::SYS_ioctl,
            // Allowed with some arguments only (`apply`), or not at all.
            libc::SYS_mmap,
            libc::SYS_mprotect,
            libc::SYS_pkey_mprotect,
            libc::SYS_kill,
            libc::SYS_tgkill,
            libc::SYS_tkill,
            libc::SYS_rt_sigqueueinfo,
            libc::SYS_rt_tgsigqueueinfo,
            libc::SYS_pidfd_send_signal,
            libc::SYS_pidfd_open,
        ] {
            assert!(!set.contains(&forbidden), "{forbidden}");
        }
    }

    fn root(name: &str) -> Identity {
        Identity {
            name: name.into(),
            uid: Uid::from_raw(0),
            gid: Gid::from_raw(0),
        }
    }

    #[test]
    fn a_root_daemon_confined_to_kill_must_become_another_user() {
        let nobody = Identity {
            name: "nobody".into(),
            uid: Uid::from_raw(65534),
            gid: Gid::from_raw(65534),
        };
        let (root_uid, user_uid) = (Uid::from_raw(0), Uid::from_raw(1000));
        // Refused: root staying root, with no --user or a --user of uid 0.
        for user in [None, Some(root("root")), Some(root("toor"))] {
            let e = refuse_staying_root(Seccomp::Kill, user.as_ref(), root_uid).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains("--user"), "{msg}");
            assert!(msg.contains("root"), "{msg}");
        }
        // Allowed: root becoming another user; a daemon that is not root;
        // no filter, or the logging one (to find system calls, not to
        // confine).
        refuse_staying_root(Seccomp::Kill, Some(&nobody), root_uid).unwrap();
        refuse_staying_root(Seccomp::Kill, None, user_uid).unwrap();
        for mode in [Seccomp::Off, Seccomp::Log] {
            refuse_staying_root(mode, None, root_uid).unwrap();
        }
    }

    /// Test `FILTER_TEST`'s child runs one case named by this variable.
    const CASE: &str = "VRDMA_SANDBOX_CASE";
    const FILTER_TEST: &str =
        "sandbox::tests::the_filter_refuses_executable_memory_and_signals_to_others";

    /// In a child process (this binary again): the filter in kill mode,
    /// then what `case` names; a call the filter refuses kills the child
    /// (SIGSYS), one it allows lets it exit 0.
    fn child_case(case: &str) {
        let other = std::os::unix::process::parent_id();
        apply(Seccomp::Kill).unwrap();
        let page = 4096;
        // SAFETY (every block below): raw system calls on memory this
        // child maps itself (an anonymous page, unmapped by nothing else)
        // or with signal 0 (which delivers nothing): no Rust value is
        // touched, whatever the kernel answers.
        match case {
            "allowed" => {
                // SAFETY: see above.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        page,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    )
                };
                assert_ne!(p, libc::MAP_FAILED);
                // SAFETY: see above.
                assert_eq!(unsafe { libc::mprotect(p, page, libc::PROT_READ) }, 0);
                let me = i32::try_from(std::process::id()).unwrap();
                // SAFETY: see above.
                assert_eq!(unsafe { libc::kill(me, 0) }, 0);
                // SAFETY: see above.
                let tid = unsafe { libc::gettid() };
                // SAFETY: see above.
                let r = unsafe { libc::syscall(libc::SYS_tgkill, me, tid, 0) };
                assert_eq!(r, 0);
            }
            "mmap-exec" => {
                // SAFETY: see above.
                unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        page,
                        libc::PROT_READ | libc::PROT_EXEC,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    );
                }
            }
            "mprotect-exec" => {
                // SAFETY: see above.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        page,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    )
                };
                assert_ne!(p, libc::MAP_FAILED);
                // SAFETY: see above.
                unsafe { libc::mprotect(p, page, libc::PROT_READ | libc::PROT_EXEC) };
            }
            "kill-other" => {
                let other = i32::try_from(other).unwrap();
                // SAFETY: see above.
                unsafe { libc::kill(other, 0) };
            }
            "kill-group" => {
                // SAFETY: see above.
                unsafe { libc::kill(0, 0) };
            }
            "kill-everyone" => {
                // SAFETY: see above.
                unsafe { libc::kill(-1, 0) };
            }
            "tgkill-other" => {
                let other = i32::try_from(other).unwrap();
                // SAFETY: see above.
                unsafe { libc::syscall(libc::SYS_tgkill, other, other, 0) };
            }
            "tkill" => {
                // SAFETY: see above.
                let tid = unsafe { libc::gettid() };
                // SAFETY: see above.
                unsafe { libc::syscall(libc::SYS_tkill, tid, 0) };
            }
            other => panic!("no case {other}"),
        }
    }

    #[test]
    fn the_filter_refuses_executable_memory_and_signals_to_others() {
        if let Ok(case) = std::env::var(CASE) {
            child_case(&case);
            return;
        }
        use std::os::unix::process::ExitStatusExt;
        let run = |case: &str| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([FILTER_TEST, "--exact", "--test-threads=1", "--nocapture"])
                .env(CASE, case)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .unwrap()
        };
        let allowed = run("allowed");
        assert!(allowed.success(), "what the daemon does: {allowed:?}");
        for case in [
            "mmap-exec",
            "mprotect-exec",
            "kill-other",
            "kill-group",
            "kill-everyone",
            "tgkill-other",
            "tkill",
        ] {
            let status = run(case);
            assert_eq!(status.signal(), Some(libc::SIGSYS), "{case}: {status:?}");
        }
    }
}
