//! `vrdma`: the command line of the vrdma software RDMA device — its
//! arguments, parsed, and the exit status; the tools themselves are in
//! `vrdma-tools`.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use vrdma_tools::{args, bench, decode, demo, perf, pingpong, serve, stat};

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
        args::Command::Serve(a) => serve::run(&a).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vrdma: {e:#}");
            ExitCode::from(failure)
        }
    }
}
