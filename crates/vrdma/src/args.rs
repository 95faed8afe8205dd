//! Command-line arguments, kept apart from the logic so that man pages can
//! be generated from them.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// vrdma: a software RDMA device speaking RoCEv2.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Decode the RoCEv2 packets of a pcap or pcapng capture.
    ///
    /// Prints one line per packet: time, source → destination, opcode, QPN,
    /// PSN, AckReq, the fields of each extension header, payload length and
    /// whether the ICRC verifies; then a summary. Frames that are not RoCEv2
    /// (not UDP to port 4791) are counted, not shown. Link types: Ethernet,
    /// raw IPv4/IPv6, Linux cooked (SLL, SLL2).
    ///
    /// Exit status: 0 when every RoCEv2 packet decoded with a good ICRC, 1
    /// when some packet was malformed or had a bad ICRC, 2 when the capture
    /// could not be read.
    Decode(DecodeArgs),
}

#[derive(Args, Debug)]
pub struct DecodeArgs {
    /// The capture to decode. Without it, a built-in capture of Linux rxe
    /// traffic (SEND and RDMA WRITE with immediate, multi-packet WRITE, RNR
    /// NAKs and retries) is decoded.
    pub file: Option<PathBuf>,

    /// Print one JSON document (packets and summary) instead of text.
    #[arg(long)]
    pub json: bool,
}
