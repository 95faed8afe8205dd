//! `vrdma`: the command-line face of the vrdma software RDMA device.
//!
//! | module | what |
//! |---|---|
//! | `args` | the command line (clap derive) |
//! | `bench` | `vrdma bench`: vrdma beside raw UDP and memcpy, as ratios |
//! | `capture` | reading pcap and pcapng files into link-layer frames |
//! | `decode` | `vrdma decode`: one line (or JSON object) per RoCEv2 packet |
//! | `demo` | `vrdma demo`: two devices on loopback, a ping-pong and a bandwidth/latency table |
//! | `perf` | `vrdma perf`: perftest 4.5's ib_*_bw / ib_*_lat, interoperable |
//! | `rawudp` | the raw UDP baseline the benchmark compares against |
//! | `pingpong` | `vrdma pingpong rc\|uc\|ud`: rdma-core's ibv_*_pingpong, interoperable |
//! | `stat` | `vrdma stat`: the counters every device publishes in the run directory |
//! | `verbs` | a device with a PD, CQ and MR, and the completion loop the tools share |

mod args;
mod bench;
mod capture;
mod decode;
mod demo;
mod perf;
mod pingpong;
mod rawudp;
mod stat;
mod verbs;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = args::Cli::parse();
    // decode exits 2 when the capture cannot be read; the rdma-core tools
    // exit 1 on any failure.
    let failure = match cli.command {
        args::Command::Decode(_) => 2,
        _ => 1,
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("VRDMA_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        args::Command::Decode(a) => decode::run(&a),
        args::Command::Pingpong(a) => pingpong::run(&a).map(|()| ExitCode::SUCCESS),
        args::Command::Perf(a) => perf::run(&a).map(|()| ExitCode::SUCCESS),
        args::Command::Stat(a) => stat::run(&a).map(|()| ExitCode::SUCCESS),
        args::Command::Bench(a) => bench::run(&a).map(|()| ExitCode::SUCCESS),
        args::Command::Demo(a) => demo::run(&a).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vrdma: {e:#}");
            ExitCode::from(failure)
        }
    }
}
