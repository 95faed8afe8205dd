//! The daemon's privileges: the user it becomes and its run directory,
//! what that user may announce on a rendezvous (written as root, before
//! the drop), and the confinement once every device is open.

use anyhow::{Context, Result};
use vrdma_fabric::shm::{JoinConfig, Owned, Rendezvous, Switch};
use vrdma_wire::Gid;

use super::spec::DeviceSpec;
use crate::{
    args::ServeArgs,
    sandbox::{self, Seccomp},
};

/// The user the daemon becomes (`--user`), and whether a root daemon that
/// stays root gives up its capabilities instead.
pub(super) struct Who {
    pub(super) user: Option<sandbox::Identity>,
    /// A root daemon that confines itself without becoming another user
    /// gives up its capabilities: each device thread its own, once its
    /// device is open (capabilities are per thread), the main thread last.
    pub(super) drop_caps: bool,
}

impl Who {
    /// `--user` looked up; `--seccomp kill` refused to a daemon that would
    /// stay root.
    pub(super) fn of(a: &ServeArgs) -> Result<Self> {
        let user = a.user.as_deref().map(sandbox::identity).transpose()?;
        let euid = nix::unistd::Uid::effective();
        sandbox::refuse_staying_root(a.seccomp, user.as_ref(), euid)?;
        let drop_caps = user.is_none() && a.seccomp != Seccomp::Off && euid.is_root();
        Ok(Who { user, drop_caps })
    }

    /// The user's run directory, where its counters go and `vrdma stat`
    /// reads them. Before any thread exists.
    pub(super) fn prepare(&self) -> Result<()> {
        let Some(u) = &self.user else {
            return Ok(());
        };
        let dir = vrdma_device::publish::run_dir().join(&u.name);
        prepare_run_dir(&dir, u)?;
        // SAFETY: no other thread exists yet (the device threads start
        // after this), so nothing reads the environment concurrently.
        #[allow(unsafe_code)]
        unsafe {
            std::env::set_var("VRDMA_RUN_DIR", &dir)
        };
        Ok(())
    }
}

/// Confines the whole process once every device is open: another user
/// or no capabilities, then the seccomp filter on every thread.
/// `unconfined` runs between the two (as the daemon's user, before the
/// filter: what it opens, the filter need not allow).
pub(super) fn confine(
    user: Option<&sandbox::Identity>,
    drop_caps: bool,
    seccomp: Seccomp,
    unconfined: impl FnOnce() -> Result<()>,
) -> Result<()> {
    if let Some(u) = user {
        sandbox::drop_privileges(u)?;
    }
    if drop_caps {
        sandbox::drop_thread_capabilities()?;
    }
    unconfined()?;
    sandbox::apply(seccomp)
}

/// Joins the rendezvous directory `--shm-dir` names (as the daemon's
/// user: the socket it makes is the user's).
pub(super) fn join(switch: Option<&Switch>, a: &ServeArgs) -> Result<Option<Rendezvous>> {
    let (Some(switch), Some(dir)) = (switch, &a.shm_dir) else {
        return Ok(None);
    };
    let mut config = JoinConfig::new(dir);
    for g in &a.shm_groups {
        config.admit.gids.push(sandbox::group(g)?.as_raw());
    }
    let r = switch
        .join(config)
        .with_context(|| format!("joining the rendezvous directory {}", dir.display()))?;
    eprintln!(
        "vrdma serve: same-host shared memory with the daemons of {}",
        dir.display()
    );
    Ok(Some(r))
}

/// What the devices' owner may announce on a rendezvous: for each named
/// network, the addresses of its devices there.
pub(super) fn grant_entries(specs: &[DeviceSpec]) -> Vec<(String, Vec<Gid>)> {
    let mut v: Vec<(String, Vec<Gid>)> = Vec::new();
    for s in specs {
        let (Some(net), Owned::Only(addrs)) = (&s.net, s.owned()) else {
            continue;
        };
        match v.iter_mut().find(|(n, _)| n == net) {
            Some((_, a)) => a.extend(addrs),
            None => v.push((net.clone(), addrs)),
        }
    }
    v
}

/// Writes, as root and before the daemon becomes `user`, what `user`'s
/// daemons may announce on the rendezvous directory (`--shm-dir`): its
/// devices' networks and addresses, in a file the user cannot write
/// (`vrdma_fabric::shm::write_grant`). Other daemons take this daemon's
/// addresses only as far as that file says. A root daemon that stays root
/// needs none (other daemons trust root); one that is not root cannot
/// write it, and says so.
pub(super) fn grant(
    a: &ServeArgs,
    entries: &[(String, Vec<Gid>)],
    user: Option<&sandbox::Identity>,
) -> Result<()> {
    let Some(dir) = &a.shm_dir else {
        return Ok(());
    };
    let root = nix::unistd::Uid::effective().is_root();
    match user {
        Some(u) if root => {
            vrdma_fabric::shm::write_grant(dir, u.uid.as_raw(), entries)
                .with_context(|| format!("writing {}'s grant in {}", u.name, dir.display()))?;
        }
        None if root => {}
        _ => eprintln!(
            "vrdma serve: not root: no grant written in {}/grants; daemons of other users take \
             this daemon's addresses only if root granted them",
            dir.display()
        ),
    }
    Ok(())
}

/// Makes `dir` a directory of `user`'s, closed to others, for its
/// counters.
pub(super) fn prepare_run_dir(dir: &std::path::Path, user: &sandbox::Identity) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("making {}", dir.display()))?;
    nix::unistd::chown(dir, Some(user.uid), Some(user.gid))
        .with_context(|| format!("giving {} to {}", dir.display(), user.name))?;
    // The user must pass through the run directory to reach its own (and
    // may not list or write it).
    if let Some(parent) = dir.parent() {
        use std::os::unix::fs::PermissionsExt;
        let m =
            std::fs::metadata(parent).with_context(|| format!("reading {}", parent.display()))?;
        let mode = m.permissions().mode() & 0o7777;
        if mode & 0o001 == 0 {
            std::fs::set_permissions(parent, std::fs::Permissions::from_mode(mode | 0o011))
                .with_context(|| format!("opening {} to traversal", parent.display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The grant: each named network's owned addresses, nothing for a
    /// device of a network of its own.
    #[test]
    fn the_grant_holds_each_networks_addresses() {
        let dev = |i: usize, extra: &str| {
            DeviceSpec::parse(
                &format!(
                    "netdev=/n,uplink=stream:/u,socket=/s{i},mac=52:54:00:00:00:0{i},name=d{i}{extra}"
                ),
                i,
            )
            .unwrap()
        };
        let g = grant_entries(&[
            dev(1, ",net=a,ip=10.0.0.5"),
            dev(3, ",net=b,ip=10.0.0.5"),
            dev(4, ""),
        ]);
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].0, "a");
        let a5 = Gid::from("10.0.0.5".parse::<std::net::IpAddr>().unwrap());
        assert!(g[0].1.contains(&a5) && g[1].1.contains(&a5));
    }
}
