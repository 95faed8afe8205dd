//! `vrdma`: the command-line face of the vrdma software RDMA device.
//!
//! | module | what |
//! |---|---|
//! | `args` | the command line (clap derive) |
//! | `capture` | reading pcap and pcapng files into link-layer frames |
//! | `decode` | `vrdma decode`: one line (or JSON object) per RoCEv2 packet |

mod args;
mod capture;
mod decode;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = args::Cli::parse();
    let result = match cli.command {
        args::Command::Decode(a) => decode::run(&a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vrdma: {e:#}");
            ExitCode::from(2)
        }
    }
}
