//! Device counters outside the process: every device the tools open
//! publishes a snapshot of its counters (the fabric's, the engine's and
//! its object counts) to a small text file in the run directory, at most
//! once a second and when it closes — the way rxe's counters sit in sysfs
//! for `rdma statistic` to read. `vrdma stat` reads them.
//!
//! The run directory is `$VRDMA_RUN_DIR`, else `/run/vrdma` for root, else
//! `$XDG_RUNTIME_DIR/vrdma`, else `/tmp/vrdma-UID`. A snapshot is written
//! to a temporary file and renamed, so a reader never sees half of one.

use std::{
    fs,
    io::Write,
    os::unix::fs::{MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};
use vrdma_engine::VecMemory;
use vrdma_fabric::udp::UdpDevice;

use crate::args::StatArgs;

/// How often a running device rewrites its snapshot.
const PERIOD: Duration = Duration::from_secs(1);
const SUFFIX: &str = ".stat";

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
    path: PathBuf,
    /// The device clock ([`UdpDevice::clock`]) at which the next snapshot
    /// is due.
    next: u64,
}

impl Publisher {
    /// For the device bound to `addr`; `None` (logged) when the run
    /// directory cannot be made: counters are a convenience, never a
    /// reason to fail.
    pub fn new(addr: std::net::IpAddr) -> Option<Self> {
        let dir = run_dir();
        if let Err(e) = own_dir(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "no run directory: counters not published");
            return None;
        }
        Some(Publisher {
            path: dir.join(format!("{addr}{SUFFIX}")),
            next: 0,
        })
    }

    /// Writes a snapshot if a period has passed by the device's clock as
    /// its last round read it (a busy loop calls this every round: it
    /// reads no clock), or if `last` (the device closes).
    pub fn publish(&mut self, dev: &UdpDevice<VecMemory>, last: bool) {
        let now = dev.clock();
        if !last && now < self.next {
            return;
        }
        self.next = now.saturating_add(PERIOD.as_nanos() as u64);
        if let Err(e) = self.write(dev, last) {
            tracing::warn!(path = %self.path.display(), error = %e, "counters not published");
        }
    }

    fn write(&self, dev: &UdpDevice<VecMemory>, last: bool) -> std::io::Result<()> {
        let mut text = String::new();
        let addr = dev.local_addr()?.ip();
        let updated = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        text.push_str(&format!("pid {}\n", std::process::id()));
        text.push_str(&format!("addr {addr}\n"));
        text.push_str(&format!("state {}\n", if last { "closed" } else { "open" }));
        text.push_str(&format!("updated_ms {updated}\n"));
        for (k, v) in dev.stats().fields() {
            text.push_str(&format!("udp.{k} {v}\n"));
        }
        for (k, v) in dev.engine().stats().fields() {
            text.push_str(&format!("engine.{k} {v}\n"));
        }
        let c = dev.engine().counts();
        for (k, v) in [
            ("pds", c.pds),
            ("mrs", c.mrs),
            ("cqs", c.cqs),
            ("qps", c.qps),
            ("srqs", c.srqs),
            ("ahs", c.ahs),
        ] {
            text.push_str(&format!("objects.{k} {v}\n"));
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

/// Makes `dir` (mode 0700) or accepts it if it is a real directory of
/// this user that nobody else may write to: in a shared place like /tmp
/// another user could have made it first, to plant links.
fn own_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    match fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
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

/// One snapshot as read back.
#[derive(Debug, PartialEq)]
struct Snapshot {
    pid: u32,
    addr: String,
    state: String,
    updated_ms: u128,
    counters: Vec<(String, u64)>,
}

fn parse(text: &str) -> Result<Snapshot> {
    let mut s = Snapshot {
        pid: 0,
        addr: String::new(),
        state: String::new(),
        updated_ms: 0,
        counters: Vec::new(),
    };
    for line in text.lines() {
        let Some((k, v)) = line.split_once(' ') else {
            bail!("bad line {line:?}");
        };
        match k {
            "pid" => s.pid = v.parse()?,
            "addr" => s.addr = v.to_string(),
            "state" => s.state = v.to_string(),
            "updated_ms" => s.updated_ms = v.parse()?,
            _ => s.counters.push((k.to_string(), v.parse()?)),
        }
    }
    if s.addr.is_empty() || s.pid == 0 {
        bail!("no address or pid");
    }
    Ok(s)
}

/// `vrdma stat`.
pub fn run(a: &StatArgs) -> Result<()> {
    let dir = run_dir();
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!("no vrdma devices (nothing in {})", dir.display());
            return Ok(());
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    let mut snaps = Vec::new();
    for e in entries {
        let path = e?.path();
        if !path.to_string_lossy().ends_with(SUFFIX) {
            continue;
        }
        // Only regular files: a FIFO named *.stat would block the read.
        let regular = fs::symlink_metadata(&path).is_ok_and(|m| m.is_file());
        let text = if regular {
            fs::read_to_string(&path).map_err(anyhow::Error::from)
        } else {
            Err(anyhow::anyhow!("not a regular file"))
        };
        match text.and_then(|t| parse(&t)) {
            Ok(s) => snaps.push(s),
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "not a snapshot"),
        }
    }
    snaps.sort_by(|x, y| x.addr.cmp(&y.addr));
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let mut shown = 0;
    for s in &snaps {
        if !a.addr.is_empty() && !a.addr.iter().any(|x| x.to_string() == s.addr) {
            continue;
        }
        // A device whose process died without closing it is gone too.
        let alive = s.state == "open" && Path::new(&format!("/proc/{}", s.pid)).exists();
        if !alive && !a.all {
            continue;
        }
        shown += 1;
        if a.json {
            let counters: serde_json::Map<String, serde_json::Value> = s
                .counters
                .iter()
                .map(|(k, v)| (k.clone(), (*v).into()))
                .collect();
            let doc = serde_json::json!({
                "addr": s.addr, "pid": s.pid, "open": alive,
                "updated_ms": s.updated_ms as u64, "counters": counters,
            });
            println!("{doc}");
            continue;
        }
        let age = now.saturating_sub(s.updated_ms) as f64 / 1000.0;
        println!(
            "link {}/1 pid {} {} (counters from {age:.1} s ago)",
            s.addr,
            s.pid,
            if alive { "open" } else { "closed" }
        );
        let width = s.counters.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (k, v) in &s.counters {
            if *v != 0 || a.zeros {
                println!("    {k:<width$}  {v}");
            }
        }
    }
    if shown == 0 && !a.json {
        println!(
            "no {}vrdma devices{} in {}",
            if a.all { "" } else { "open " },
            if a.all {
                ""
            } else {
                " (--all shows closed ones)"
            },
            dir.display()
        );
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

    #[test]
    fn snapshots_read_back() {
        let text = "pid 7\naddr 127.0.0.41\nstate open\nupdated_ms 5\nudp.rx_datagrams 3\nengine.rx_bad_addr 0\n";
        let s = parse(text).unwrap();
        assert_eq!(s.pid, 7);
        assert_eq!(s.addr, "127.0.0.41");
        assert_eq!(
            s.counters,
            [
                ("udp.rx_datagrams".to_string(), 3),
                ("engine.rx_bad_addr".to_string(), 0)
            ]
        );
        for bad in [
            "",
            "pid x\naddr a\n",
            "pid 1\naddr a\nudp.x -1\n",
            "pid 1\nnoline",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
