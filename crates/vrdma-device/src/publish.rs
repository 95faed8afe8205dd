//! Device counters outside the process: a device publishes a snapshot of
//! its counters (the transport's, the engine's and its object counts) to a
//! small text file in the run directory, at most once a second and when
//! it closes — the way rxe's counters sit in sysfs for `rdma statistic` to
//! read. `vrdma stat` reads them.
//!
//! The run directory is `$VRDMA_RUN_DIR`, else `/run/vrdma` for root, else
//! `$XDG_RUNTIME_DIR/vrdma`, else `/tmp/vrdma-UID`. A snapshot is written
//! to a temporary file and renamed, so a reader never sees half of one.
//! Its lines are `key value`: `pid`, `addr` (the device's name), `net`
//! (its virtual network on the same-host fabric, when it has a switch:
//! the network's name or `private`), `state` (`open` or `closed`),
//! `updated_ms`, then one line per counter.

use std::{
    fs,
    io::Write,
    os::unix::fs::{MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// How often a running device rewrites its snapshot.
const PERIOD: Duration = Duration::from_secs(1);

/// The file name suffix of a snapshot.
pub const SUFFIX: &str = ".stat";

/// Where snapshots live.
pub fn run_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("VRDMA_RUN_DIR") {
        return d.into();
    }
    let uid = fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid());
    if uid == 0 {
        return "/run/vrdma".into();
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        return Path::new(&d).join("vrdma");
    }
    format!("/tmp/vrdma-{uid}").into()
}

/// A device's snapshot writer.
#[derive(Debug)]
pub struct Publisher {
    name: String,
    /// The run directory, and the snapshot's file in it.
    dir: PathBuf,
    path: PathBuf,
    /// The device clock at which the next snapshot is due.
    next: u64,
    /// A failure to publish was logged (once, not every period).
    warned: bool,
    /// The device's network, when it has one.
    net: Option<String>,
}

impl Publisher {
    /// For the device called `name` (its address, for a device on a UDP
    /// port); `None` (logged) when the run directory cannot be made:
    /// counters are a convenience, never a reason to fail. The directory
    /// must be this user's, closed to others, when a snapshot is written
    /// (checked each time): a daemon that becomes another user (`vrdma
    /// serve --user`) makes its publishers before it is that user, in a
    /// directory that is the user's.
    pub fn new(name: &str) -> Option<Self> {
        Self::at(run_dir(), name)
    }

    /// [`Publisher::new`] in `dir`.
    fn at(dir: PathBuf, name: &str) -> Option<Self> {
        if let Err(e) = make_dir(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "no run directory: counters not published");
            return None;
        }
        // The name becomes a file name: nothing that could leave the
        // directory.
        let file: String = name
            .chars()
            .map(|c| if c == '/' || c == '\0' { '_' } else { c })
            .collect();
        Some(Publisher {
            name: name.to_owned(),
            path: dir.join(format!("{file}{SUFFIX}")),
            dir,
            next: 0,
            warned: false,
            net: None,
        })
    }

    /// Names the device's network in its snapshots (`net`).
    pub fn set_network(&mut self, net: &str) {
        // One word on one line: a name is checked, `private` is one.
        self.net = Some(net.split_whitespace().collect::<Vec<_>>().join("_"));
    }

    /// Writes the counters `counters` gives if a period has passed by the
    /// device clock `now`, or if `last` (the device closes). A busy loop
    /// calls this every round: it reads no clock of its own, and asks for
    /// the counters only when it writes them.
    pub fn publish(&mut self, now: u64, counters: impl FnOnce() -> Vec<(String, u64)>, last: bool) {
        if !last && now < self.next {
            return;
        }
        self.next = now.saturating_add(PERIOD.as_nanos() as u64);
        match self.write(&counters(), last) {
            Ok(()) => self.warned = false,
            Err(e) if !self.warned => {
                self.warned = true;
                tracing::warn!(path = %self.path.display(), error = %e, "counters not published");
            }
            Err(_) => {}
        }
    }

    fn write(&self, counters: &[(String, u64)], last: bool) -> std::io::Result<()> {
        check_dir(&self.dir)?;
        let mut text = String::new();
        let updated = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        text.push_str(&format!("pid {}\n", std::process::id()));
        text.push_str(&format!("addr {}\n", self.name));
        if let Some(n) = &self.net {
            text.push_str(&format!("net {n}\n"));
        }
        text.push_str(&format!("state {}\n", if last { "closed" } else { "open" }));
        text.push_str(&format!("updated_ms {updated}\n"));
        for (k, v) in counters {
            text.push_str(&format!("{k} {v}\n"));
        }
        let tmp = self
            .path
            .with_extension(format!("tmp{}", std::process::id()));
        // A fresh file, never through a link someone planted: a leftover
        // of a crashed run is removed (the link itself, not its target).
        let _ = fs::remove_file(&tmp);
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&tmp)?
            .write_all(text.as_bytes())?;
        fs::rename(&tmp, &self.path)
    }
}

/// Makes `dir` (mode 0700) unless it exists.
fn make_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// Whether `dir` is a real directory of this user that nobody else may
/// write to: in a shared place like /tmp another user could have made it
/// first, to plant links.
fn check_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let m = fs::symlink_metadata(dir)?;
    let me = fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid());
    if !m.is_dir() || m.uid() != me || m.permissions().mode() & 0o022 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "not a directory of this user closed to others",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_directory_must_be_ours_and_closed() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("vrdma-stat-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let dir = base.join("run");
        let own_dir = |d: &Path| make_dir(d).and_then(|()| check_dir(d));
        own_dir(&dir).unwrap();
        assert_eq!(
            fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        // Writable by others: refused (someone could plant links there).
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        assert!(own_dir(&dir).is_err());
        // A link to a directory is not the directory.
        let link = base.join("link");
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(own_dir(&link).is_err());
        fs::remove_dir_all(&base).unwrap();
    }

    /// `vrdma serve --user` makes its publishers as root, in a directory
    /// that is the user's: they write once the process is that user.
    /// Here, a directory open to others (not fit) that is closed later.
    #[test]
    fn a_publisher_made_before_its_directory_is_fit_writes_once_it_is() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("vrdma-stat-late-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let dir = base.join("run");
        fs::create_dir_all(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        let mut p = Publisher::at(dir.clone(), "late").expect("a publisher");
        let counters = || vec![("x.y".to_owned(), 7)];
        p.publish(0, counters, false);
        let file = dir.join(format!("late{SUFFIX}"));
        assert!(!file.exists(), "written in a directory open to others");
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        p.publish(0, counters, true);
        let text = fs::read_to_string(&file).unwrap();
        assert!(
            text.contains("state closed\n") && text.contains("x.y 7\n"),
            "{text}"
        );
        fs::remove_dir_all(&base).unwrap();
    }
}
