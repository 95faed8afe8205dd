//! What root grants a user's daemons: a grant file per user in the
//! rendezvous directory's `grants/`, its parser, and its safe writing and
//! reading (never through a link, never a file others may write).

use std::{
    collections::HashMap,
    fs,
    io::{self, Read},
    net::IpAddr,
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    path::{Path, PathBuf},
};

use nix::{
    fcntl::{OFlag, openat, renameat},
    sys::stat::{Mode, fstat, mkdirat},
    unistd::{UnlinkatFlags, unlinkat},
};
use vrdma_wire::Gid;

use super::{message::MAX_GIDS, open_rendezvous};
use crate::shm::check_network_name;

/// A grant file's bytes at most.
const MAX_GRANT: u64 = 64 << 10;
/// The subdirectory of the rendezvous directory that holds the grants.
pub const GRANTS: &str = "grants";

/// What a user's daemons may announce: for each network, its addresses.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct Grant(pub HashMap<String, Vec<Gid>>);

/// Why a grant file is not taken.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    #[error("line {line}: {what}")]
    Syntax { line: usize, what: &'static str },
    #[error("grant {path}: {what}")]
    Unsafe { path: PathBuf, what: &'static str },
    #[error("grant {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl Grant {
    /// Parses a grant file: a line per network, `NETWORK ADDRESS…`
    /// (IPv4 or IPv6), `#` comments and blank lines ignored.
    pub fn parse(text: &str) -> Result<Grant, GrantError> {
        let mut g = Grant::default();
        for (i, line) in text.lines().enumerate() {
            let err = |what| GrantError::Syntax { line: i + 1, what };
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_ascii_whitespace();
            let net = words.next().ok_or(err("no network"))?;
            check_network_name(net).map_err(|_| err("not a network name"))?;
            let addrs = g.0.entry(net.to_owned()).or_default();
            for w in words {
                let a: IpAddr = w.parse().map_err(|_| err("not an address"))?;
                if addrs.len() >= MAX_GIDS {
                    return Err(err("too many addresses"));
                }
                addrs.push(Gid::from(a));
            }
        }
        Ok(g)
    }

    fn emit(entries: &[(String, Vec<Gid>)]) -> String {
        let mut t = String::from("# vrdma rendezvous grant: NETWORK ADDRESS...\n");
        for (net, addrs) in entries {
            t.push_str(net);
            for a in addrs {
                t.push(' ');
                t.push_str(&a.ip().to_string());
            }
            t.push('\n');
        }
        t
    }

    pub(super) fn allows(&self, net: &str, gid: &Gid) -> bool {
        self.0.get(net).is_some_and(|a| a.contains(gid))
    }
}

/// A directory opened without following a link, that must be `owner`'s
/// and written by nobody else.
fn open_private_dir(at: BorrowedFd<'_>, name: &Path, owner: u32) -> Result<OwnedFd, GrantError> {
    let path = name.to_path_buf();
    let fd = openat(
        at,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| GrantError::Io {
        path: path.clone(),
        source: e.into(),
    })?;
    let st = fstat(&fd).map_err(|e| GrantError::Io {
        path: path.clone(),
        source: e.into(),
    })?;
    if st.st_uid != owner || st.st_mode & 0o022 != 0 {
        return Err(GrantError::Unsafe {
            path,
            what: "not its owner's, or written by others",
        });
    }
    Ok(fd)
}

/// Writes what user `uid`'s daemons may announce on the rendezvous
/// directory `dir`: for each network, its addresses. Root does this (the
/// grants directory and files must be root's, written by nobody else:
/// [`Trust::grant_owner`](super::Trust::grant_owner)) — `vrdma serve` for
/// the user it becomes, before it drops its privileges. The file is
/// replaced whole (written aside, then renamed), never through a link.
pub fn write_grant(dir: &Path, uid: u32, entries: &[(String, Vec<Gid>)]) -> io::Result<()> {
    for (net, _) in entries {
        check_network_name(net).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    }
    let rdv = open_rendezvous(dir)?;
    match mkdirat(&rdv, GRANTS, Mode::from_bits_truncate(0o755)) {
        Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
        Err(e) => return Err(e.into()),
    }
    let me = nix::unistd::geteuid().as_raw();
    let grants = open_private_dir(rdv.as_fd(), Path::new(GRANTS), me).map_err(io::Error::other)?;
    let name = uid.to_string();
    let tmp = format!(".{name}.{}", std::process::id());
    let _ = unlinkat(&grants, tmp.as_str(), UnlinkatFlags::NoRemoveDir);
    let fd = openat(
        &grants,
        tmp.as_str(),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o644),
    )?;
    let mut f = fs::File::from(fd);
    io::Write::write_all(&mut f, Grant::emit(entries).as_bytes())?;
    drop(f);
    renameat(&grants, tmp.as_str(), &grants, name.as_str())?;
    Ok(())
}

/// What user `uid` was granted on the rendezvous directory `dir` (opened as
/// `rdv`): `None` when there is no grant, or none that is safe to read (a
/// file that is not the grant owner's, or that others may write).
pub(super) fn read_grant(rdv: BorrowedFd<'_>, uid: u32, owner: u32) -> Option<Grant> {
    let grants = match open_private_dir(rdv, Path::new(GRANTS), owner) {
        Ok(g) => g,
        Err(GrantError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return None;
        }
        Err(e) => {
            tracing::warn!(error = %e, "shm rendezvous: grants not read");
            return None;
        }
    };
    let name = uid.to_string();
    let fd = openat(
        &grants,
        name.as_str(),
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let st = fstat(&fd).ok()?;
    let regular = st.st_mode & nix::libc::S_IFMT == nix::libc::S_IFREG;
    if !regular || st.st_uid != owner || st.st_mode & 0o022 != 0 || st.st_size as u64 > MAX_GRANT {
        tracing::warn!(uid, "shm rendezvous: a grant file that is not safe to read");
        return None;
    }
    let mut text = String::new();
    fs::File::from(fd)
        .take(MAX_GRANT)
        .read_to_string(&mut text)
        .ok()?;
    match Grant::parse(&text) {
        Ok(g) => Some(g),
        Err(e) => {
            tracing::warn!(uid, error = %e, "shm rendezvous: a grant file refused");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_parse_strictly() {
        let g = Grant::parse("# a comment\n\ntenant-a 10.0.0.5 fd00::5 # trailing\ntenant-b\n")
            .unwrap();
        assert_eq!(
            g.0.get("tenant-a"),
            Some(&vec![
                Gid::from("10.0.0.5".parse::<IpAddr>().unwrap()),
                Gid::from("fd00::5".parse::<IpAddr>().unwrap()),
            ])
        );
        assert_eq!(g.0.get("tenant-b"), Some(&vec![]));
        assert!(g.allows(
            "tenant-a",
            &Gid::from("10.0.0.5".parse::<IpAddr>().unwrap())
        ));
        assert!(!g.allows(
            "tenant-b",
            &Gid::from("10.0.0.5".parse::<IpAddr>().unwrap())
        ));
        for bad in ["bad/name 10.0.0.1", "n 10.0.0.256", "n not-an-address"] {
            assert!(Grant::parse(bad).is_err(), "{bad:?}");
        }
        let emitted = Grant::emit(&[(
            "n".into(),
            vec![Gid::from("10.1.2.3".parse::<IpAddr>().unwrap())],
        )]);
        assert_eq!(
            Grant::parse(&emitted).unwrap().0.get("n").map(Vec::len),
            Some(1)
        );
    }
}
