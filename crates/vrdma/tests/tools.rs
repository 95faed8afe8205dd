//! The tools end to end, vrdma against vrdma over loopback: every
//! `vrdma perf` test and every `vrdma pingpong` transport, server and
//! client as separate processes talking over the TCP side channel and
//! RoCEv2 on real UDP sockets; then `vrdma stat` reads the counters the
//! devices published. (Against the real perftest and rdma-core tools and
//! the kernel's rxe: `scripts/interop.sh`.)
//!
//! One pair at a time (one test function): both sides of a pair may
//! busy-poll, and a 2-core machine has room for one pair.

use std::{
    net::Ipv4Addr,
    path::Path,
    process::{Child, Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

fn vrdma(run_dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vrdma"));
    c.env("VRDMA_RUN_DIR", run_dir);
    c
}

/// Whether something listens on TCP `port` (Linux: /proc/net/tcp, state
/// 0A), without connecting (the tools accept one connection only).
fn listening(port: u16) -> bool {
    let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    tcp.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 3
            && f[3] == "0A"
            && f[1]
                .rsplit(':')
                .next()
                .is_some_and(|p| u16::from_str_radix(p, 16) == Ok(port))
    })
}

fn wait_output(child: Child, what: &str) -> Output {
    let out = child.wait_with_output().expect("wait");
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `tool` as a server on `a` and a client on `b`; both outputs.
fn pair(run_dir: &Path, tool: &[&str], port: u16, a: Ipv4Addr, b: Ipv4Addr) -> (String, String) {
    let port_s = port.to_string();
    let (a_s, b_s) = (a.to_string(), b.to_string());
    let common = ["-p", &port_s, "--timeout", "20"];
    let server = vrdma(run_dir)
        .args(tool)
        .args(common)
        .args(["-d", &a_s])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the server");
    let start = Instant::now();
    while !listening(port) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{tool:?}: the server never listened on {port}"
        );
        thread::sleep(Duration::from_millis(20));
    }
    let client = vrdma(run_dir)
        .args(tool)
        .args(common)
        .args(["-d", &b_s, &a_s])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the client");
    let c = wait_output(client, &format!("{tool:?} client"));
    let s = wait_output(server, &format!("{tool:?} server"));
    (
        String::from_utf8_lossy(&s.stdout).into_owned(),
        String::from_utf8_lossy(&c.stdout).into_owned(),
    )
}

/// The result row under perftest's header: its numbers.
fn row(out: &str) -> Vec<f64> {
    let mut lines = out.lines().skip_while(|l| !l.starts_with(" #bytes"));
    lines.next().expect("no result header");
    let row = lines.next().expect("no result row");
    row.split_whitespace()
        .map(|f| {
            f.parse()
                .unwrap_or_else(|_| panic!("not a number {f:?} in {row:?}"))
        })
        .collect()
}

#[test]
fn every_tool_between_two_vrdma_devices() {
    let run_dir = std::env::temp_dir().join(format!("vrdma-tools-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run_dir);
    let mut k = 0u8;
    let mut next = || {
        k += 1;
        (
            19_000 + u16::from(k),
            Ipv4Addr::new(127, 0, 9, 2 * k),
            Ipv4Addr::new(127, 0, 9, 2 * k + 1),
        )
    };

    // Bandwidth: the server of write/read/atomic prints the client's row
    // (from the report exchange); send_bw's server measures its own.
    for (test, size, reported) in [
        ("write_bw", "65536", true),
        ("read_bw", "65536", true),
        ("atomic_bw", "8", true),
        ("send_bw", "4096", false),
    ] {
        let (port, a, b) = next();
        let mut args = vec!["perf", test, "-n", "200"];
        if test != "atomic_bw" {
            args.extend(["-s", size]);
        }
        if test != "write_bw" {
            args.push("-e");
        }
        let (s, c) = pair(&run_dir, &args, port, a, b);
        let client = row(&c);
        assert_eq!(client[..2], [size.parse().unwrap(), 200.0], "{test}: {c}");
        assert!(client[3] > 0.0, "{test}: no bandwidth: {c}");
        let server = row(&s);
        if reported {
            assert_eq!(server, client, "{test}: the report exchange");
        } else {
            assert_eq!(server[..2], client[..2], "{test}: {s}");
        }
    }

    // Latency: both sides of write_lat and send_lat report; read and
    // atomic only the client.
    for test in ["write_lat", "send_lat", "read_lat", "atomic_lat"] {
        let (port, a, b) = next();
        let mut args = vec!["perf", test, "-n", "300"];
        if test != "write_lat" {
            args.push("-e");
        }
        let (s, c) = pair(&run_dir, &args, port, a, b);
        let client = row(&c);
        let size = if test == "atomic_lat" { 8.0 } else { 2.0 };
        assert_eq!(client[..2], [size, 300.0], "{test}: {c}");
        // t_min <= t_typical <= t_max, all positive.
        assert!(
            client[2] > 0.0 && client[2] <= client[4] && client[4] <= client[3],
            "{test}: {c}"
        );
        if matches!(test, "write_lat" | "send_lat") {
            assert_eq!(row(&s)[..2], [size, 300.0], "{test}: {s}");
        } else {
            assert!(!s.contains(" #bytes"), "{test}: the server reported: {s}");
        }
    }

    // pingpong, every transport: each side ends with the C tools' lines.
    for (transport, size) in [("rc", "4096"), ("uc", "4096"), ("ud", "1024")] {
        let (port, a, b) = next();
        let args = ["pingpong", transport, "-n", "100", "-s", size, "-c"];
        let (s, c) = pair(&run_dir, &args, port, a, b);
        for out in [&s, &c] {
            assert!(
                out.contains("100 iters in"),
                "{transport}: no summary: {out}"
            );
            assert!(!out.contains("invalid data"), "{transport}: {out}");
        }
    }

    // Every device published its counters where VRDMA_RUN_DIR says.
    let out = vrdma(&run_dir)
        .args(["stat", "--all", "--json"])
        .output()
        .expect("run vrdma stat");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let docs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(docs.len(), 2 * usize::from(k), "{text}");
    for d in &docs {
        assert_eq!(d["open"], false, "{d}");
        assert!(d["counters"]["udp.rx_datagrams"].as_u64() > Some(0), "{d}");
        assert_eq!(d["counters"]["udp.rx_bad_icrc"].as_u64(), Some(0), "{d}");
    }
    std::fs::remove_dir_all(&run_dir).unwrap();
}
