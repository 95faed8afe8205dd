//! `ibv_rc_pingpong`, `ibv_uc_pingpong` and `ibv_ud_pingpong` from a guest
//! on a **virtio-rdma** device: the interop harness's way to hold the
//! virtio face against the kernel's rxe (issue 20) before a Linux guest
//! driver exists. This process is the whole stack a guest would be: a
//! virtio-rdma device (`vrdma_virtio` over vhost-user, on a UDP port at
//! the address of the TCP exchange, in a thread of its own) and, through
//! its socket, the virtio test kit's front-end playing QEMU and the
//! driver — commands on the controlq, WQEs in rings in guest memory,
//! doorbells in the context's area, completions polled from the CQ ring.
//!
//! ```sh
//! cargo build --release -p vrdma-tools --example virtio_pingpong
//! ip netns exec rxens target/release/examples/virtio_pingpong pingpong rc -m 1024 -s 4096 -n 100 [SERVER]
//! ```
//!
//! The arguments are `vrdma pingpong`'s (so that `scripts/interop.sh` runs
//! it in `vrdma pingpong`'s place: `scripts/virtio-guest/rxe.sh`), the
//! out-of-band exchange is rdma-core's (`vrdma_tools::pingpong::Dest`), and
//! the loop is `vrdma pingpong`'s: each side sends `iters` messages, the
//! client first, sending again once its last send completed and a message
//! arrived. `-e` (events) and `-c` (the C tools' page check) are `vrdma
//! pingpong`'s only.

use std::{
    net::Ipv6Addr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use clap::{Parser, Subcommand};
use vrdma_engine::attr::Mtu;
use vrdma_testkit::virtio::{Endpoint, Path, QKEY, Qp, QpSpec, Wqe, av, serve, wc};
use vrdma_tools::{
    args::{PingpongArgs, Transport},
    common::random_psn,
    pingpong::{Dest, exchange, exchange_stream},
};
use vrdma_virtio::abi::{self, qp_type};
use vrdma_wire::{Gid, Qpn};

const RECV_WRID: u64 = 1;
const SEND_WRID: u64 = 2;
/// ibv_ud_pingpong's Q_Key (the kit's UD QPs are made with it).
const UD_QKEY: u32 = 0x1111_1111;
const _: () = assert!(UD_QKEY == QKEY);
/// Room for the GRH in front of a UD receive.
const GRH_LEN: u32 = 40;
/// Receives kept posted (the C tools' -r, 500 by default; one message is
/// in flight each way, so 64 is room to spare).
const RX_DEPTH: u32 = 64;

#[derive(Debug, Parser)]
#[command(about = "rdma-core's pingpong tools on a virtio-rdma device (vhost-user, in-process)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// As `vrdma pingpong`.
    Pingpong(PingpongArgs),
}

fn main() {
    let Cmd::Pingpong(a) = Cli::parse().cmd;
    if let Err(e) = run(&a) {
        eprintln!("virtio_pingpong: {e:#}");
        std::process::exit(1);
    }
}

fn mtu_code(bytes: u32) -> Result<(u32, Mtu)> {
    Ok(match bytes {
        256 => (1, Mtu::Mtu256),
        512 => (2, Mtu::Mtu512),
        1024 => (3, Mtu::Mtu1024),
        2048 => (4, Mtu::Mtu2048),
        4096 => (5, Mtu::Mtu4096),
        _ => bail!("MTU {bytes}: one of 256, 512, 1024, 2048, 4096"),
    })
}

fn run(a: &PingpongArgs) -> Result<()> {
    ensure!(!a.events && !a.chk, "-e and -c are vrdma pingpong's only");
    ensure!(
        a.ib_port == 1 && a.gid_idx.unwrap_or(0) == 0,
        "port 1, GID 0"
    );
    ensure!(a.iters > 0, "iterations must be positive");
    let ud = a.transport == Transport::Ud;
    ensure!(
        !(ud && a.mtu.is_some()),
        "-m is not an ibv_ud_pingpong option"
    );
    let size = a.size.unwrap_or(if ud { 1024 } else { 4096 });
    // The port's active MTU: 4096 (what a RoCE port on a jumbo-frame
    // netdev shows); the QP's path MTU is -m's.
    let (mtu, _) = mtu_code(a.mtu.unwrap_or(1024))?;
    if ud {
        ensure!(size <= 4096, "Requested size larger than port MTU (4096)");
    }

    // The TCP exchange decides the device's address.
    let (stream, ip) = exchange_stream(a)?;

    // The device, and the guest on it.
    let opts = vrdma_virtio::face::Options {
        mac: vrdma_testkit::virtio::mac_of(ip),
        ..Default::default()
    };
    let port = vrdma_fabric::udp::UdpPort::bind(vrdma_fabric::udp::Config::new(ip))
        .with_context(|| format!("binding UDP 4791 on {ip}"))?;
    let dev = serve(
        "pingpong",
        ip,
        Mtu::Mtu4096,
        opts,
        vrdma_virtio::vhost::DEFAULT_SPIN,
        port,
    );
    let buf_len = size + if ud { GRH_LEN } else { 0 };
    let mem = (u64::from(buf_len).next_multiple_of(4096) + (32 << 20)).max(64 << 20);
    let mut s = Endpoint::with_memory(&dev, mem);
    let ty = match a.transport {
        Transport::Rc => qp_type::RC,
        Transport::Uc => qp_type::UC,
        Transport::Ud => qp_type::UD,
    };
    let mut spec = QpSpec::new(ty, s.cq.handle);
    spec.rq_entries = RX_DEPTH;
    spec.max_inline = 64;
    let mut qp = s.fe.qp(&s.ctx, s.pd, &spec);
    let buf = s.fe.reg_mr(
        &s.ctx,
        s.pd,
        u64::from(buf_len).next_multiple_of(4096),
        abi::access::LOCAL_WRITE,
    );
    // The C tools fill the buffer with 0x7b.
    s.fe.ram.fill(buf.gpa, buf_len as usize, 0x7b);

    // RESET → INIT (UD: ibv_ud_pingpong's Q_Key, the kit's).
    s.fe.qp_init(&s.ctx, &qp, 0);
    for _ in 0..RX_DEPTH {
        qp.post_recv(RECV_WRID, &[buf.sge(0, buf_len)]);
    }
    let mut routs = RX_DEPTH;

    let me = Dest {
        lid: 0,
        qpn: Qpn::from_masked(qp.qpn),
        psn: random_psn(),
        gid: dev.gid(),
    };
    println!(
        "  local address:  LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        me.lid,
        me.qpn.value(),
        me.psn.value(),
        Ipv6Addr::from(me.gid.0)
    );
    let connect = |s: &mut Endpoint, rem: &Dest| -> Result<()> {
        ensure!(
            rem.gid != Gid::default(),
            "the peer sent no GID: RoCE needs one (give the rdma-core tool -g)"
        );
        let path = Path {
            psn: rem.psn.value(),
            mtu,
            ..Path::new(rem.qpn.value(), rem.gid)
        };
        s.fe.try_qp_rtr_to(&s.ctx, &qp, &path)
            .map_err(|e| anyhow!("QP to RTR: {e:?}"))?;
        s.fe.try_qp_rts_at(&s.ctx, &qp, me.psn.value())
            .map_err(|e| anyhow!("QP to RTS: {e:?}"))?;
        Ok(())
    };
    let (rem, ()) = exchange(stream, a.server.is_some(), me, |rem| connect(&mut s, rem))?;
    println!(
        "  remote address: LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        rem.lid,
        rem.qpn.value(),
        rem.psn.value(),
        Ipv6Addr::from(rem.gid.0)
    );

    let send_at = u64::from(if ud { GRH_LEN } else { 0 });
    let ram = s.fe.ram.clone();
    let inline = size <= spec.max_inline;
    let post_send = |qp: &mut Qp| {
        let mut w = Wqe::send(SEND_WRID, &[buf.sge(send_at, size)]);
        if inline {
            w = w.inline(&ram.read_bytes(buf.gpa + send_at, size as usize));
        }
        if ud {
            w = w.ud(av(rem.gid), rem.qpn.value(), UD_QKEY);
        }
        qp.post_send(&w);
    };
    let mut pending = RECV_WRID;
    if a.server.is_some() {
        post_send(&mut qp);
        pending |= SEND_WRID;
    }
    let start = Instant::now();
    // No limit (0) waits as the C tools do: forever.
    let limit = Duration::from_secs(if a.timeout > 0 {
        a.timeout
    } else {
        u64::MAX / 4
    });
    let (mut rcnt, mut scnt) = (0u32, 0u32);
    let mut last = Instant::now();
    while rcnt < a.iters || scnt < a.iters {
        let Some(c) = s.cq.poll() else {
            ensure!(
                last.elapsed() < limit,
                "no completion in {} s (sent {scnt}, received {rcnt})",
                a.timeout
            );
            // Polls as the C tools do, giving the core away between looks
            // (the device's thread and, here, an emulated peer share it).
            std::thread::yield_now();
            continue;
        };
        last = Instant::now();
        let id = c.wr_id.get();
        if c.status != wc::SUCCESS {
            bail!(
                "Failed status {} for wr_id {id} (sent {scnt} of {}, received {rcnt})",
                c.status,
                a.iters
            );
        }
        match (id, c.opcode) {
            (SEND_WRID, wc::SEND) => scnt += 1,
            (RECV_WRID, wc::RECV) => {
                // A message is the size sent (UD: behind the GRH).
                let want = size + if ud { GRH_LEN } else { 0 };
                ensure!(
                    c.byte_len.get() == want,
                    "a receive of {} bytes, not {want}",
                    c.byte_len.get()
                );
                routs -= 1;
                if routs <= 1 {
                    for _ in routs..RX_DEPTH {
                        qp.post_recv(RECV_WRID, &[buf.sge(0, buf_len)]);
                    }
                    routs = RX_DEPTH;
                }
                rcnt += 1;
            }
            (id, op) => bail!("Completion for unknown wr_id {id} (opcode {op})"),
        }
        pending &= !id;
        if scnt < a.iters && pending == 0 {
            post_send(&mut qp);
            pending = RECV_WRID | SEND_WRID;
        }
    }
    let usec = start.elapsed().as_secs_f64() * 1e6;
    if ty == qp_type::RC {
        // The peer's last message may wait for an ACK that was lost: the
        // device (its own thread) answers a resend while the process
        // stays (four of the peer's 67 ms ACK timeouts), as vrdma pingpong.
        std::thread::sleep(Duration::from_millis(270));
    }
    let bytes = u64::from(size) * u64::from(a.iters) * 2;
    println!(
        "{bytes} bytes in {:.2} seconds = {:.2} Mbit/sec",
        usec / 1e6,
        bytes as f64 * 8.0 / usec
    );
    println!(
        "{} iters in {:.2} seconds = {:.2} usec/iter",
        a.iters,
        usec / 1e6,
        usec / f64::from(a.iters)
    );
    let st = dev.stats();
    println!(
        "virtio-rdma device: {} commands, {} WQEs taken, {} malformed",
        st.commands, st.rings.wqes, st.rings.malformed_wqes
    );
    Ok(())
}
