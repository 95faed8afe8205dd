//! `vrdma stat`: the counters every device publishes to the run directory
//! (`vrdma_device::publish`), read back and shown.

use std::{
    fs,
    path::Path,
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};
use vrdma_device::publish::{SUFFIX, run_dir};

use crate::args::StatArgs;

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
    // Snapshots in the run directory, and in its subdirectories: a daemon
    // that serves as a user of its own (`vrdma serve --user`) publishes
    // into one named after that user.
    let mut paths = Vec::new();
    for e in entries {
        let path = e?.path();
        if fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
            if let Ok(sub) = fs::read_dir(&path) {
                paths.extend(sub.filter_map(|e| e.ok().map(|e| e.path())));
            }
        } else {
            paths.push(path);
        }
    }
    let mut snaps = Vec::new();
    for path in paths {
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
        if !a.addr.is_empty() && !a.addr.contains(&s.addr) {
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
