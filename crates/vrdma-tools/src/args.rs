//! Command-line arguments, kept apart from the logic so that man pages can
//! be generated from them.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
};

use anyhow::{Context, Result, anyhow};

use clap::{Args, Parser, Subcommand, ValueEnum};

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

    /// rdma-core's ibv_rc_pingpong / ibv_uc_pingpong / ibv_ud_pingpong on a
    /// vrdma device: the same options, exchange (TCP port 18515) and
    /// output, so that either side can be the real tool (with `-g` on the
    /// rdma-core side, e.g. `ibv_rc_pingpong -g 1` against rxe's IPv4 GID).
    ///
    /// Without SERVER it waits for a client; with it, it connects. The
    /// device binds the address the TCP connection uses, or `-d ADDR`.
    Pingpong(PingpongArgs),

    /// perftest 4.5's ib_{write,read,send,atomic}_{bw,lat} on a vrdma
    /// device: the same options, out-of-band exchange (TCP port 18515) and
    /// output, so that either side can be the real perftest tool.
    ///
    /// Without SERVER it waits for a client; with it, it connects. The
    /// device binds the address the TCP connection uses, or `-d ADDR`.
    Perf(PerfArgs),

    /// Counters of the vrdma devices on this machine (those the vrdma
    /// tools opened): datagrams and bytes each way, drops by reason (bad
    /// ICRC, malformed, no such QP, wrong peer, bad key, out of sequence,
    /// …), retransmissions and objects, as `rdma statistic` shows rxe's.
    /// Counters that are 0 are left out unless --zeros.
    Stat(StatArgs),

    /// vrdma beside the best this machine does without it, in one run:
    /// 1 MiB RDMA WRITE bandwidth against a raw UDP GSO/GRO stream (and
    /// one datagram per syscall, and memcpy), 64 B RDMA WRITE latency
    /// against a raw UDP ping-pong, and a 64 B SEND message rate with
    /// 16 384 QPs per device against one; as ratios. Both sides
    /// busy-poll: run nothing else beside it.
    Bench(BenchArgs),

    /// Two vrdma devices in this process on loopback, connected by an RC
    /// QP over real UDP sockets: a ping-pong, then a short latency and
    /// bandwidth table. Nothing to set up.
    Demo(DemoArgs),

    /// Serve RDMA devices to QEMU guests: each a VMware PVRDMA PCI
    /// function (15ad:0820) over vfio-user, which a guest's stock
    /// `vmw_pvrdma` driver and rdma-core's provider use, with vrdma's
    /// RoCEv2 engine behind it.
    ///
    /// Each --device is one guest's: the vfio-user socket QEMU's
    /// `vfio-user-pci` connects to, and the network: the daemon is the
    /// network backend of the guest's vmxnet3 (QEMU's `-netdev stream`
    /// connects to the netdev socket), passing its frames to and from an
    /// uplink and taking the RoCEv2 traffic of the device's addresses. The
    /// vmxnet3 is function 0 and the vfio-user-pci function 1 of one PCI
    /// slot: the driver pairs them. Start the daemon before QEMU.
    ///
    /// Example (README, "A device for a QEMU guest"):
    ///
    ///   vrdma serve --device socket=/run/vrdma/g1.sock,netdev=/run/vrdma/g1.net,uplink=tap:tap1,mac=52:54:00:4c:00:01
    ///
    /// Runs until SIGINT or SIGTERM; a guest that goes away (QEMU killed,
    /// a reboot) leaves its device reset and waiting for the next one.
    /// Counters: `vrdma stat` (each device under its name).
    Serve(ServeArgs),
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A device: comma-separated KEY=VALUE —
    /// kind=pvrdma|virtio|virtio-pci (pvrdma, the default: VMware's PVRDMA over vfio-user, for
    /// QEMU's vfio-user-pci and the stock vmw_pvrdma driver; virtio: virtio-rdma, device ID 42,
    /// over vhost-user, for QEMU's vhost-user-test-device-pci, docs/virtio-rdma.md; virtio-pci:
    /// the same device as a whole virtio-pci function, 1af4:106a, over vfio-user, for QEMU's
    /// vfio-user-pci and the guest's stock virtio_pci, §13.3),
    /// socket=PATH (the vfio-user or vhost-user socket to listen on),
    /// netdev=PATH (the socket QEMU's `-netdev stream,server=off` connects to),
    /// uplink=tap:NAME (a TAP device: an existing one, e.g. a port of a bridge, or
    /// else one made for the daemon's lifetime) or uplink=stream:PATH (a
    /// socket of length-prefixed frames to connect to, as `-netdev stream`'s),
    /// mac=MAC (the vmxnet3's, as given to QEMU: the source of the device's frames),
    /// and optionally mtu=BYTES (the link's Ethernet MTU, default 1500: the port's
    /// active MTU is the largest IB MTU that fits), name=NAME (for `vrdma stat`;
    /// default pvrdmaN or vrdmaN), doorbells=trap|shared for pvrdma (trap, the default: each doorbell is
    /// a write QEMU forwards; shared: the doorbell pages are memory the guest writes
    /// without an exit and the device's thread polls them and every ring while work flows
    /// and for up to spin=MICROSECONDS after, then looks at intervals of 50 µs doubling
    /// to 5 ms; an arm can then not be told from a poll, so a CQ may get a
    /// notification nobody asked for) or doorbells=poll|event for virtio and virtio-pci (poll, the default: the
    /// device polls the doorbell areas while work flows and for up to spin=MICROSECONDS after,
    /// default 200, then sleeps until a kick; a polling thread that is preempted stops polling
    /// for a hold-off, so it never takes a core a busy host needs; event: every doorbell is kicked), spoof=on|off (the guest may send only from its
    /// MAC, and from the addresses ip= gives; on by default with a TAP uplink),
    /// ip=ADDR[+ADDR…] (the guest's IPv4/IPv6 addresses, and its MAC's IPv6 link-local
    /// one: the only ones it may bind as GIDs and hold on the same-host switch;
    /// required on a network shared with another device or with other daemons),
    /// net=NAME (the virtual network the device is on: devices of one network reach
    /// each other through same-host shared memory, a device of another network never —
    /// addresses may repeat across networks; default: a network of its own),
    /// mem=SIZE (the guest's memory, e.g. 2G: the most its VMM may map for the device,
    /// and what the object budget is derived from) and
    /// objects=SIZE|derived|unlimited (the memory the guest's QPs, CQs, SRQs and MR
    /// page lists may make the daemon hold, e.g. 256M; derived, the default: 64 MiB
    /// plus 1/256 of the guest's memory — mem=, or what it shares, at most 64 GiB;
    /// past it, creates fail with ENOMEM). Repeat for more guests.
    #[arg(
        long = "device",
        required_unless_present = "print_capabilities",
        value_name = "socket=PATH,netdev=PATH,uplink=…,mac=MAC"
    )]
    pub devices: Vec<String>,

    /// The socket of the one --device given, instead of its socket= (the
    /// option of rust-vmm's vhost-device daemons: `vrdma serve --socket-path
    /// /run/g1-rdma.sock --device kind=virtio,netdev=…,uplink=…,mac=…`).
    #[arg(long, value_name = "PATH")]
    pub socket_path: Option<PathBuf>,

    /// No same-host shared memory at all: without it, the devices this
    /// process serves on one network (net=) reach each other through
    /// shared memory (a packet for another of its devices' addresses goes
    /// straight into that device's mailbox, never onto the uplink; `vrdma
    /// stat` counts it as `shm.*`).
    #[arg(long, conflicts_with = "shm_dir")]
    pub no_shm: bool,

    /// Reach the devices of other `vrdma serve` daemons on this host
    /// through shared memory too: join the rendezvous directory DIR (it
    /// must exist, be root's or the daemon's user's, writable by the
    /// daemon's user, and sticky if anyone may write it). Devices of one
    /// network (net=) in different daemons then exchange packets in rings
    /// — packets only: no daemon maps another's guest memory
    /// (docs/same-host.md). Who may join: whoever can make a socket in DIR
    /// and passes the check of its peer's credentials (the daemon's own
    /// user, root, --shm-group); what a daemon of another user may
    /// announce (networks, addresses) is what root granted that user in
    /// DIR/grants — `vrdma serve` started as root with --user writes its
    /// user's grant from its devices' net= and ip=.
    #[arg(long, value_name = "DIR")]
    pub shm_dir: Option<PathBuf>,

    /// A group (name or gid) whose daemons may join this one's
    /// rendezvous (its socket is then mode 0660 of that group). Repeatable.
    #[arg(long = "shm-group", value_name = "GROUP", requires = "shm_dir")]
    pub shm_groups: Vec<String>,

    /// Print the vhost-user backend's capabilities as JSON (QEMU's
    /// "Backend program conventions": `{"type": …, "features": […]}`) and
    /// exit. vhost-user.json names no RDMA type; the type printed is
    /// "rdma", vrdma's own.
    #[arg(long)]
    pub print_capabilities: bool,

    /// The device's limits, as its capabilities announce them (QEMU's
    /// PVRDMA had these as dev-caps-*).
    #[command(flatten)]
    pub caps: CapsArgs,

    /// Once the devices are open, confine the process to the system calls
    /// serving needs: kill (a call outside the list kills the process),
    /// log (the kernel logs it and lets it through), or off.
    #[arg(long, value_enum, default_value_t = crate::sandbox::Seccomp::Off)]
    pub seccomp: crate::sandbox::Seccomp,

    /// Once the devices are open, become this user (name or uid; root
    /// only): its uid and primary group, no other group, no capability.
    /// Counters are then published in a subdirectory of the run directory
    /// named after the user. A root daemon without --user that confines
    /// itself (--seccomp) drops its capabilities instead.
    #[arg(long, value_name = "USER")]
    pub user: Option<String>,

    /// A user (name or uid) whose processes may connect to the devices'
    /// sockets (QEMU's), beside the daemon's own user and root; the socket
    /// files then belong to the first such user (mode 0600). Repeatable.
    #[arg(long = "allow-user", value_name = "USER")]
    pub allow_users: Vec<String>,

    /// A group (name or gid) whose processes may connect to the devices'
    /// sockets (by the peer's effective group); the socket files then
    /// belong to the first such group, mode 0660. Repeatable.
    #[arg(long = "allow-group", value_name = "GROUP")]
    pub allow_groups: Vec<String>,

    /// Take guest memory whose file is not sealed against shrinking (e.g.
    /// memory-backend-file on hugetlbfs or /dev/shm), guarded so that a
    /// truncated file cannot SIGBUS the daemon. By default such memory is
    /// refused: QEMU's memory-backend-memfd seals its memory.
    #[arg(long)]
    pub allow_unsealed: bool,

    /// DMA maps a guest's VMM may hold at once (each holds a descriptor
    /// and a mapping, which the process shares among its guests).
    #[arg(long, default_value_t = vrdma_vfio_user::dma::DEFAULT_MAX_MAPS)]
    pub max_dma_maps: usize,

    /// Bytes of guest memory a guest's VMM may map into the daemon (K, M,
    /// G, T suffixes).
    #[arg(long, default_value = "1T", value_parser = parse_size_arg)]
    pub max_dma_bytes: u64,
}

/// The device's capabilities (every device served gets the same).
#[derive(Args, Debug)]
pub struct CapsArgs {
    /// QPs (the GSI QP counts).
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_qp)]
    pub max_qp: u32,
    /// Work requests per QP queue.
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_qp_wr)]
    pub max_qp_wr: u32,
    /// Scatter/gather entries per work request.
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_sge)]
    pub max_sge: u32,
    /// CQs.
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_cq)]
    pub max_cq: u32,
    /// Entries per CQ.
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_cqe)]
    pub max_cqe: u32,
    /// Memory regions.
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_mr)]
    pub max_mr: u32,
    /// Protection domains.
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_pd)]
    pub max_pd: u32,
    /// Address handles.
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_ah)]
    pub max_ah: u32,
    /// Shared receive queues (0: none).
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_srq)]
    pub max_srq: u32,
    /// Work requests per SRQ.
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_srq_wr)]
    pub max_srq_wr: u32,
    /// Scatter/gather entries per SRQ work request.
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_srq_sge)]
    pub max_srq_sge: u32,
    /// Outstanding RDMA READs and atomics per QP, each way.
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_qp_rd_atom)]
    pub max_qp_rd_atom: u32,
    /// The largest memory region, in bytes.
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_mr_size)]
    pub max_mr_size: u64,
    /// User contexts at once (each has a doorbell page); a power of two.
    #[arg(long, default_value_t = DEFAULT_LIMITS.max_uar)]
    pub max_uar: u32,
    /// Entries of the GID table.
    #[arg(long, default_value_t = DEFAULT_LIMITS.gid_tbl_len)]
    pub gid_tbl_len: u32,
}

/// The defaults of [`CapsArgs`].
const DEFAULT_LIMITS: vrdma_pvrdma::caps::Limits = vrdma_pvrdma::caps::Limits::DEFAULT;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// The first device's address.
    #[arg(long, default_value_t = DEFAULT_A)]
    pub addr_a: std::net::Ipv4Addr,

    /// The second device's address.
    #[arg(long, default_value_t = DEFAULT_B)]
    pub addr_b: std::net::Ipv4Addr,

    /// Ping-pong iterations.
    #[arg(short = 'n', long, default_value_t = 10000)]
    pub iters: u32,

    /// MiB moved per bandwidth test.
    #[arg(long, default_value_t = 256)]
    pub megabytes: u64,
}

/// Which pingpong.
#[derive(Clone, Copy, Debug, Eq, PartialEq, ValueEnum)]
pub enum Transport {
    /// ibv_rc_pingpong: reliable connection.
    Rc,
    /// ibv_uc_pingpong: unreliable connection.
    Uc,
    /// ibv_ud_pingpong: unreliable datagram (Q_Key 0x11111111).
    Ud,
}

#[derive(Args, Debug)]
pub struct PingpongArgs {
    /// rc, uc or ud.
    #[arg(value_enum)]
    pub transport: Transport,

    /// The server to connect to (without it: be the server).
    pub server: Option<String>,

    /// TCP port of the exchange.
    #[arg(short, long, default_value_t = 18515)]
    pub port: u16,

    /// The device's IP address (rdma-core: the device name). Default: the
    /// address of the TCP connection.
    #[arg(short = 'd', long = "ib-dev")]
    pub ib_dev: Option<IpAddr>,

    /// Port number (a vrdma device has one: 1).
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    pub ib_port: u32,

    /// Message size (default 4096; ud: 1024, at most the MTU).
    #[arg(short, long)]
    pub size: Option<u32>,

    /// Path MTU: 256, 512, 1024, 2048 or 4096 (default 1024; not for ud).
    #[arg(short, long)]
    pub mtu: Option<u32>,

    /// Receives kept posted.
    #[arg(short, long = "rx-depth", default_value_t = 500)]
    pub rx_depth: u32,

    /// Messages each side sends.
    #[arg(short = 'n', long, default_value_t = 1000)]
    pub iters: u32,

    /// Service level.
    #[arg(short = 'l', long, default_value_t = 0)]
    pub sl: u8,

    /// Sleep until completions arrive instead of busy-polling.
    #[arg(short, long)]
    pub events: bool,

    /// Local GID index (a vrdma device has one GID: 0, its address).
    #[arg(short, long = "gid-idx")]
    pub gid_idx: Option<u8>,

    /// Validate the received buffer as the C tools do (the client zeroes
    /// the first byte of each page; the server checks them at the end).
    #[arg(short, long)]
    pub chk: bool,

    /// Give up after this many seconds without a completion (0: never, as
    /// the C tools).
    #[arg(long, default_value_t = 0)]
    pub timeout: u64,
}

/// Which perftest tool.
#[derive(Clone, Copy, Debug, Eq, PartialEq, ValueEnum)]
pub enum PerfTest {
    /// ib_write_bw
    #[value(name = "write_bw", alias = "ib_write_bw")]
    WriteBw,
    /// ib_write_lat
    #[value(name = "write_lat", alias = "ib_write_lat")]
    WriteLat,
    /// ib_read_bw
    #[value(name = "read_bw", alias = "ib_read_bw")]
    ReadBw,
    /// ib_read_lat
    #[value(name = "read_lat", alias = "ib_read_lat")]
    ReadLat,
    /// ib_send_bw
    #[value(name = "send_bw", alias = "ib_send_bw")]
    SendBw,
    /// ib_send_lat
    #[value(name = "send_lat", alias = "ib_send_lat")]
    SendLat,
    /// ib_atomic_bw
    #[value(name = "atomic_bw", alias = "ib_atomic_bw")]
    AtomicBw,
    /// ib_atomic_lat
    #[value(name = "atomic_lat", alias = "ib_atomic_lat")]
    AtomicLat,
}

/// perftest's connection types (those a vrdma device runs these tests on).
#[derive(Clone, Copy, Debug, Eq, PartialEq, ValueEnum)]
pub enum Connection {
    #[value(name = "RC")]
    Rc,
    /// WRITE and SEND tests only.
    #[value(name = "UC")]
    Uc,
}

/// perftest's `-A`.
#[derive(Clone, Copy, Debug, Eq, PartialEq, ValueEnum)]
pub enum AtomicType {
    #[value(name = "FETCH_AND_ADD")]
    FetchAndAdd,
    #[value(name = "CMP_AND_SWAP")]
    CmpAndSwap,
}

#[derive(Args, Debug)]
pub struct PerfArgs {
    /// The test: write_bw, write_lat, read_bw, read_lat, send_bw,
    /// send_lat, atomic_bw or atomic_lat.
    #[arg(value_enum)]
    pub test: PerfTest,

    /// The server to connect to (without it: be the server).
    pub server: Option<String>,

    /// TCP port of the exchange.
    #[arg(short, long, default_value_t = 18515)]
    pub port: u16,

    /// The device's IP address (perftest: the device name). Default: the
    /// address of the TCP connection.
    #[arg(short = 'd', long = "ib-dev")]
    pub ib_dev: Option<IpAddr>,

    /// Port number (a vrdma device has one: 1).
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    pub ib_port: u32,

    /// GID index (a vrdma device has one GID: 0, its address).
    #[arg(short = 'x', long = "gid-index")]
    pub gid_index: Option<u8>,

    /// Message size (default: bw 65536, lat 2, atomic 8).
    #[arg(short, long)]
    pub size: Option<u64>,

    /// Iterations (default: write_bw 5000, others 1000).
    #[arg(short = 'n', long)]
    pub iters: Option<u64>,

    /// Run sizes 2 B .. 8 MiB (both sides need it).
    #[arg(short = 'a', long)]
    pub all: bool,

    /// Number of QPs (bw tests).
    #[arg(short = 'q', long = "qp", default_value_t = 1)]
    pub qps: u32,

    /// Path MTU: 256, 512, 1024, 2048 or 4096 (default: the port's active
    /// MTU; the lower of both sides' is used).
    #[arg(short, long)]
    pub mtu: Option<u32>,

    /// Run for this many seconds instead of a number of iterations.
    #[arg(short = 'D', long)]
    pub duration: Option<u64>,

    /// Accepted for perftest's command lines: vrdma measures with the
    /// monotonic clock, never the CPU frequency.
    #[arg(short = 'F', long = "CPU-freq")]
    pub cpu_freq: bool,

    /// Report bandwidth in Gb/s instead of MiB/s.
    #[arg(long = "report_gbits")]
    pub report_gbits: bool,

    /// Send queue depth (default: bw 128, lat 1).
    #[arg(short = 't', long = "tx-depth")]
    pub tx_depth: Option<u32>,

    /// Receive queue depth of send tests (default 512).
    #[arg(short = 'r', long = "rx-depth")]
    pub rx_depth: Option<u32>,

    /// Signal one send in this many (bw tests; default 100).
    #[arg(short = 'Q', long = "cq-mod")]
    pub cq_mod: Option<u32>,

    /// Connection type.
    #[arg(short = 'c', long = "connection", value_enum, default_value = "RC")]
    pub connection: Connection,

    /// The atomic operation of atomic tests.
    #[arg(
        short = 'A',
        long = "atomic_type",
        value_enum,
        default_value = "FETCH_AND_ADD"
    )]
    pub atomic_type: AtomicType,

    /// Outstanding READs / atomics (default: the device's maximum, 128).
    #[arg(short = 'o', long = "outs")]
    pub outs: Option<u32>,

    /// QP local ACK timeout exponent (4.096 µs × 2^N).
    #[arg(short = 'u', long = "qp-timeout", default_value_t = 14)]
    pub qp_timeout: u8,

    /// Sleep until completions arrive instead of busy-polling.
    #[arg(short, long)]
    pub events: bool,

    /// Traffic class of the QPs' GRH (the IP header's DS field).
    #[arg(long = "tclass", default_value_t = 0)]
    pub tclass: u8,

    /// Largest message sent inline (default 0, as perftest on rxe).
    #[arg(short = 'I', long = "inline_size")]
    pub inline_size: Option<u32>,

    /// Give up after this many seconds without progress (0: never, as
    /// perftest).
    #[arg(long, default_value_t = 0)]
    pub timeout: u64,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// MiB moved per bandwidth test.
    #[arg(long, default_value_t = 4096)]
    pub megabytes: u64,

    /// Round trips per latency test.
    #[arg(short = 'n', long, default_value_t = 100_000)]
    pub iters: u32,

    /// Only the bandwidth, the latency, the scale, the same-host (shm) or
    /// the Ethernet port (port: needs root) tests.
    #[arg(long, value_parser = ["bw", "lat", "scale", "shm", "port"])]
    pub only: Option<String>,

    /// QPs per device in the scale test (all brought up to RTS, one
    /// active), against one.
    #[arg(long, default_value_t = 16_384)]
    pub qps: u32,
}

#[derive(Args, Debug)]
pub struct StatArgs {
    /// Only these devices: their addresses (a device on a UDP port) or
    /// names (a device `vrdma serve` serves).
    pub addr: Vec<String>,

    /// Include closed devices (their last counters).
    #[arg(short, long)]
    pub all: bool,

    /// Show counters that are 0 too.
    #[arg(short, long)]
    pub zeros: bool,

    /// One JSON object per device.
    #[arg(long)]
    pub json: bool,
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

/// Default addresses: loopback, away from 127.0.0.1 where a real service
/// may listen.
pub const DEFAULT_A: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 41);
pub const DEFAULT_B: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 42);

/// A size in bytes: a number with an optional K, M, G or T suffix (powers
/// of 1024).
pub fn parse_size(s: &str) -> Result<u64> {
    let (digits, shift) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 10),
        Some((i, 'M' | 'm')) => (&s[..i], 20),
        Some((i, 'G' | 'g')) => (&s[..i], 30),
        Some((i, 'T' | 't')) => (&s[..i], 40),
        _ => (s, 0),
    };
    let n: u64 = digits
        .parse()
        .context("a size: a number, then K, M, G or T")?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| anyhow!("{s}: too large"))
}

/// [`parse_size`] for clap.
pub fn parse_size_arg(s: &str) -> std::result::Result<u64, String> {
    parse_size(s).map_err(|e| format!("{e:#}"))
}
