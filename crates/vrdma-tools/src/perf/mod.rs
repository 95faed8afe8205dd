//! `vrdma perf`: perftest 4.5's `ib_{write,read,send,atomic}_{bw,lat}` on
//! a vrdma device, compatible with them on the wire and in the out-of-band
//! exchange, so that either side can be the real perftest tool.
//!
//! The exchange (perftest 4.5, `src/perftest_communication.c`; the facts
//! are written up in `docs/perftest.md`): the client connects to TCP port
//! 18515; every message is one `write(2)` that the peer reads with one
//! `read(2)` of exactly its size, the client writing first. First the
//! versions (16 bytes, `"6.06"`), the page size and cache-line size (4-byte
//! big-endian each, both sides use the larger), the MTU (`"%d"` of the
//! `ibv_mtu` code and a NUL, both use the smaller); then 108-byte key
//! messages (`lid:out_reads:qpn:psn:rkey:vaddr:gid…:srqn:`), in the order
//! and number each test uses, some of them only to keep the two sides in
//! step; at the end the bandwidth report (five 8-byte big-endian numbers)
//! and `"done"`.
//!
//! Measurements use the monotonic clock (perftest counts CPU cycles; `-F`
//! is accepted and does nothing). The statistics are perftest's: bandwidth
//! from the first post to the last completion, peak over the completion
//! windows, latency from the gaps between posts, the two slowest samples
//! dropped, percentiles as `sorted[ceil(n × q)]`. The standard deviation
//! is the exact one (perftest truncates each squared difference to an
//! integer).
//!
//! | module | what |
//! |---|---|
//! | `params` | the verb, the test's kind, the negotiated parameters |
//! | `oob` | the TCP side channel: versions, sizes, MTU, key messages, reports |
//! | `report` | the statistics and the output |
//! | `tester` | the tests: posting, polling, timing |
//!
//! [`run`] goes through its phases in order: the arguments checked
//! (`params`), the side channel opened, the sizes and the MTU agreed, the
//! device opened and its QPs brought up with the peer's keys, then the
//! test.

mod oob;
mod params;
mod report;
mod tester;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener, TcpStream},
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow, ensure};
use vrdma_engine::{attr::Mtu, qp::QpType};
use vrdma_wire::{Gid, QKey};

use vrdma_device::verbs::{Connect, Context, Remote};

use oob::{BwReport, Key, Oob};
use params::{Params, Settings, Verb, mtu_from_bytes};
use report::{RESULT_LINE, bw_header, lat_header, print_bw_row, print_info, print_key, print_lat};
use tester::Tester;

use crate::{
    args::{Connection, PerfArgs},
    common::random_psn,
};

pub fn run(a: &PerfArgs) -> Result<()> {
    let s = Settings::check(a)?;
    let (stream, local_ip) = side_channel(a)?;
    let timeout = (a.timeout > 0).then(|| Duration::from_secs(a.timeout));
    let mut oob = Oob::new(stream, s.client, timeout)?;
    let (cycle, cache_line) = oob.agree_sizes()?;
    let ip = a.ib_dev.unwrap_or(local_ip);
    let region = s.buf_size.max(cycle).next_multiple_of(cache_line);
    let mut dev = open_device(&s, ip, region, a.events, a.qps as usize)?;
    let mtu = agree_mtu(a.mtu, &dev, &mut oob)?;
    let out_reads: u16 = match s.verb {
        Verb::Read | Verb::Atomic => {
            let max = dev.dev.engine().query_device().max_qp_rd_atom;
            a.outs.unwrap_or(max).clamp(1, max) as u16
        }
        _ => 1,
    };
    let p = Params {
        test: s,
        qps: a.qps as usize,
        out_reads,
        atomic: a.atomic_type,
        cycle,
        cache_line,
        region,
        gbits: a.report_gbits,
        timeout,
    };
    let (my, rem) = bring_up(a, &p, &mut dev, &mut oob, mtu)?;
    let mut t = Tester {
        dev,
        qps: my.iter().map(|k| k.qpn).collect(),
        rem,
        p,
    };
    test(&mut t, oob, &my[0])?;
    let s = t.dev.dev.transport().stats();
    tracing::debug!(?s, engine = ?t.dev.dev.engine().stats(), "device counters");
    Ok(())
}

/// The side channel: the client connects, the server waits for one
/// client. Its local address decides which address the device binds.
fn side_channel(a: &PerfArgs) -> Result<(TcpStream, IpAddr)> {
    match &a.server {
        Some(host) => {
            let stream = crate::common::tcp_connect(host, a.port)?;
            let ip = stream.local_addr()?.ip();
            Ok((stream, ip))
        }
        None => {
            println!();
            println!("************************************");
            println!("* Waiting for client to connect... *");
            println!("************************************");
            let any: IpAddr = match a.ib_dev {
                Some(IpAddr::V6(_)) => Ipv6Addr::UNSPECIFIED.into(),
                _ => Ipv4Addr::UNSPECIFIED.into(),
            };
            let listener = TcpListener::bind((any, a.port))
                .with_context(|| format!("listening on TCP port {}", a.port))?;
            let (stream, _) = listener.accept()?;
            let ip = stream.local_addr()?.ip();
            Ok((stream, ip))
        }
    }
}

/// The device at `ip`, with memory for every QP's local and remote
/// region and a CQ for every QP's send and receive depth.
fn open_device(s: &Settings, ip: IpAddr, region: u64, events: bool, qps: usize) -> Result<Context> {
    let mem = region
        .checked_mul(2 * qps as u64)
        .filter(|m| *m <= 16 << 30)
        .ok_or_else(|| anyhow!("buffers of {qps} QPs × 2 × {region} B are too large"))?;
    let (tx_depth, rx_depth) = (s.tx_depth, s.rx_depth);
    let cqe = (u64::from(tx_depth) + u64::from(rx_depth)) * qps as u64;
    ensure!(
        cqe <= 32767,
        "{qps} QPs × (tx depth {tx_depth} + rx depth {rx_depth}) exceed the CQ's 32767 entries"
    );
    Ok(Context::open_with_cq(
        ip,
        mem as usize,
        events,
        cqe.max(64) as u32,
    )?)
}

/// The MTU: the one asked for (`-m`), as perftest corrects it against the
/// port's active MTU, then the smaller of the two sides'.
fn agree_mtu(asked: Option<u32>, dev: &Context, oob: &mut Oob) -> Result<Mtu> {
    let active = dev.active_mtu();
    let mut mtu = match asked {
        None => active,
        Some(m) => match mtu_from_bytes(m) {
            None => {
                println!(" Invalid MTU - {m} ");
                println!(" Please choose mtu from {{256,512,1024,2048,4096}}");
                println!(" Will run with the port active mtu - {}", active.bytes());
                active
            }
            Some(m) if m > active => {
                println!(" Requested mtu is higher than active mtu ");
                println!(" Changing to active mtu - {}", active.bytes());
                active
            }
            Some(m) => m,
        },
    };
    let mut two = [0u8; 2];
    oob.xchg(&[b'0' + mtu as u8, 0], &mut two, None)?;
    if two[1] == 0
        && let Some(theirs) = (two[0] as char).to_digit(10).and_then(Mtu::from_code)
    {
        mtu = mtu.min(theirs);
    }
    Ok(mtu)
}

/// The QPs made and brought up with the peer's keys, in perftest's
/// order of key messages ("K" in docs/perftest.md): this side's keys and
/// the peer's.
fn bring_up(
    a: &PerfArgs,
    p: &Params,
    dev: &mut Context,
    oob: &mut Oob,
    mtu: Mtu,
) -> Result<(Vec<Key>, Vec<Key>)> {
    let (verb, bw, out_reads) = (p.test.verb, p.test.bw, p.out_reads);
    let ty = match a.connection {
        Connection::Rc => QpType::Rc,
        Connection::Uc => QpType::Uc,
    };
    let mut c = Connect {
        mtu,
        sl: 0,
        hop_limit: 0xff,
        traffic_class: a.tclass,
        min_rnr_timer: 12,
        timeout: a.qp_timeout,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
        max_dest_rd_atomic: out_reads.min(255) as u8,
        qkey: QKey(0),
        access: verb.access(),
    };
    let mut my = Vec::with_capacity(p.qps);
    for q in 0..p.qps {
        let qpn = dev.create_qp(ty, p.test.tx_depth, p.test.rx_depth, p.test.inline)?;
        dev.init_qp(qpn, &c)?;
        my.push(Key {
            lid: 0,
            out_reads,
            qpn,
            psn: random_psn(),
            rkey: dev.rkey,
            vaddr: p.remote(q),
            gid: dev.gid(),
            srqn: 0,
        });
    }
    print_info(a, p, dev, mtu);

    let first_single = !bw && verb != Verb::Send;
    if first_single {
        oob.key(&my[0], dev)?;
    }
    let mut rem = Vec::with_capacity(p.qps);
    for k in &my {
        let r = oob.key(k, dev)?;
        ensure!(
            is_v4_mapped(r.gid) == is_v4_mapped(k.gid),
            "Found Incompatibility issue with GID types."
        );
        print_key("local", verb, k);
        print_key("remote", verb, &r);
        rem.push(r);
    }
    // Both sides of a latency test and a bandwidth client request; a
    // bandwidth server only answers (perftest leaves it in RTR).
    let rts = !bw || p.test.client;
    for (k, r) in my.iter().zip(&rem) {
        c.max_rd_atomic = r.out_reads.clamp(1, out_reads.max(1)).min(255) as u8;
        let remote = Remote {
            qpn: r.qpn,
            psn: r.psn,
            gid: r.gid,
        };
        if rts {
            dev.connect(k.qpn, k.psn, remote, &c)?;
        } else {
            dev.connect_rtr(k.qpn, k.psn, remote, &c)?;
        }
    }
    if verb == Verb::Send {
        oob.key(&my[0], dev)?;
        for k in &my {
            oob.key(k, dev)?;
        }
    } else {
        for k in &my {
            oob.key(k, dev)?;
        }
        oob.key(&my[0], dev)?;
    }
    Ok((my, rem))
}

/// The test, every size of it, its table printed; then the side channel
/// closed as perftest closes it. `my` is this side's first key (the one
/// every step message carries).
fn test(t: &mut Tester, mut oob: Oob, my: &Key) -> Result<()> {
    let client = t.p.test.client;
    match (t.p.test.verb, t.p.test.bw) {
        (Verb::Send, true) => {
            println!("{RESULT_LINE}{}", bw_header(t.p.gbits));
            let all = t.p.test.sizes.len() > 1;
            for size in t.p.test.sizes.clone() {
                if !client {
                    t.post_recvs_bw(size)?;
                }
                oob.key(my, &mut t.dev)?;
                let r = if client {
                    t.bw_client(size)?
                } else {
                    t.bw_server(size)?
                };
                print_bw_row(&t.p, &r);
                if all {
                    oob.key(my, &mut t.dev)?;
                }
            }
            println!("{RESULT_LINE}");
            oob.close(my, &mut t.dev)?;
        }
        (_, true) => {
            println!("{RESULT_LINE}{}", bw_header(t.p.gbits));
            if client {
                let mut last = BwReport::default();
                for size in t.p.test.sizes.clone() {
                    last = t.bw_client(size)?;
                    print_bw_row(&t.p, &last);
                }
                oob.key(my, &mut t.dev)?;
                oob.reports(last, &mut t.dev)?;
            } else {
                // Serve until the client says it is done; its report is
                // the row to print.
                oob.key(my, &mut t.dev)?;
                let theirs = oob.reports(BwReport::default(), &mut t.dev)?;
                print_bw_row(&t.p, &theirs);
            }
            println!("{RESULT_LINE}");
            oob.close(my, &mut t.dev)?;
        }
        (Verb::Write, false) => {
            println!("{RESULT_LINE}{}", lat_header(t.p.test.duration.is_some()));
            for size in t.p.test.sizes.clone() {
                let samples = t.write_lat(size)?;
                print_lat(&t.p, size, &samples);
            }
            println!("{RESULT_LINE}");
        }
        (Verb::Send, false) => {
            println!("{RESULT_LINE}{}", lat_header(t.p.test.duration.is_some()));
            for size in t.p.test.sizes.clone() {
                let n = if t.p.test.duration.is_some() {
                    t.p.test.rx_depth
                } else {
                    t.p.test.rx_depth.min(t.p.test.iters as u32)
                };
                t.dev
                    .post_recvs(t.qps[0], 0, t.p.remote(0), size as u32, n)?;
                oob.key(my, &mut t.dev)?;
                let samples = t.send_lat(size)?;
                print_lat(&t.p, size, &samples);
            }
            println!("{RESULT_LINE}");
            oob.close(my, &mut t.dev)?;
        }
        (_, false) => {
            if client {
                println!("{RESULT_LINE}{}", lat_header(t.p.test.duration.is_some()));
                for size in t.p.test.sizes.clone() {
                    let samples = t.op_lat(size)?;
                    print_lat(&t.p, size, &samples);
                }
            }
            println!("{RESULT_LINE}");
            oob.close(my, &mut t.dev)?;
        }
    }
    Ok(())
}

fn is_v4_mapped(g: Gid) -> bool {
    Ipv6Addr::from(g.0).to_ipv4_mapped().is_some()
}
