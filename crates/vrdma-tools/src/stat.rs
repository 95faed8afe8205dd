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
    /// Its network on the same-host fabric, if it has a switch.
    net: Option<String>,
    state: String,
    updated_ms: u128,
    counters: Vec<(String, u64)>,
}

fn parse(text: &str) -> Result<Snapshot> {
    let mut s = Snapshot {
        pid: 0,
        addr: String::new(),
        net: None,
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
            "net" => s.net = Some(v.to_string()),
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
                "addr": s.addr, "net": s.net, "pid": s.pid, "open": alive,
                "updated_ms": s.updated_ms as u64, "counters": counters,
            });
            println!("{doc}");
            continue;
        }
        let age = now.saturating_sub(s.updated_ms) as f64 / 1000.0;
        let net = s
            .net
            .as_deref()
            .map_or(String::new(), |n| format!(" net {n}"));
        println!(
            "link {}/1{net} pid {} {} (counters from {age:.1} s ago)",
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
    if !a.json {
        for line in networks(snaps.iter().filter(|s| {
            (a.addr.is_empty() || a.addr.contains(&s.addr))
                && (a.all || (s.state == "open" && Path::new(&format!("/proc/{}", s.pid)).exists()))
        })) {
            println!("{line}");
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

/// What the same-host counters of a network's devices add up to.
const NETWORK_SUMS: [(&str, &[&str]); 4] = [
    ("through memory", &["shm.tx_packets"]),
    ("to the uplink", &["shm.tx_uplink"]),
    (
        "of those, held by another network",
        &["shm.tx_other_network"],
    ),
    (
        "refused",
        &[
            "shm.tx_spoofed",
            "shm.gid_conflicts",
            "shm.gid_refused",
            "shm.rx_refused",
        ],
    ),
];

/// One line per named network of the devices shown: its members, and the
/// sums of their same-host counters (a private network is its one
/// device's, shown with it).
fn networks<'a>(snaps: impl Iterator<Item = &'a Snapshot>) -> Vec<String> {
    let mut nets: Vec<(&str, Vec<&Snapshot>)> = Vec::new();
    for s in snaps {
        let Some(n) = s.net.as_deref().filter(|n| *n != "private") else {
            continue;
        };
        match nets.iter_mut().find(|(m, _)| *m == n) {
            Some((_, v)) => v.push(s),
            None => nets.push((n, vec![s])),
        }
    }
    nets.sort_by(|x, y| x.0.cmp(y.0));
    nets.iter()
        .map(|(n, members)| {
            let names: Vec<&str> = members.iter().map(|s| s.addr.as_str()).collect();
            let sums: Vec<String> = NETWORK_SUMS
                .iter()
                .map(|(what, keys)| {
                    let sum: u64 = members
                        .iter()
                        .flat_map(|s| s.counters.iter())
                        .filter(|(k, _)| keys.contains(&k.as_str()))
                        .map(|(_, v)| v)
                        .sum();
                    format!("{what} {sum}")
                })
                .collect();
            format!(
                "network {n}: {} ({}); packets {}",
                names.join(" "),
                names.len(),
                sums.join(", ")
            )
        })
        .collect()
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
        let n =
            parse("pid 7\naddr a\nnet tenant-a\nshm.tx_packets 4\nshm.gid_refused 1\n").unwrap();
        let m = parse("pid 8\naddr b\nnet tenant-a\nshm.tx_packets 5\nshm.tx_uplink 2\n").unwrap();
        let p = parse("pid 9\naddr c\nnet private\nshm.tx_packets 6\n").unwrap();
        assert_eq!(n.net.as_deref(), Some("tenant-a"));
        assert_eq!(
            networks([&n, &m, &p].into_iter()),
            [
                "network tenant-a: a b (2); packets through memory 9, to the uplink 2, of those, \
              held by another network 0, refused 1"
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
