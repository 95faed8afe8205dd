//! Devices on Ethernet ports, as `vrdma serve` makes them: each port
//! between its guest's NIC (a socket the port listens on, where the test
//! connects as QEMU's `-netdev stream` would: [`Nic`]) and an uplink
//! attached to an in-test [`Switch`] that forwards frames between uplinks
//! by destination MAC. Frames on every stream are QEMU's: a 4-byte
//! big-endian length, then the frame. [`frame`] builds what a guest's NIC
//! sends.

use std::{
    collections::VecDeque,
    io::{self, Read, Write},
    os::{
        fd::AsFd,
        unix::net::{UnixListener, UnixStream},
    },
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use vrdma_device::Transport;
use vrdma_engine::attr::Mtu;
use vrdma_fabric::eth::{EthPort, Link, MAX_FRAME, SourceFilter, Stream};
use vrdma_pvrdma::Pvrdma;

use super::{Device, Endpoint, Net, Served, connect, function, mac_of};

/// Bytes of frames the switch holds for one port that does not read (then
/// it drops, as a switch's port buffer does).
const PORT_BACKLOG: usize = 4 << 20;

/// Bytes the switch reads from one port per turn.
const READ_PER_TURN: usize = 256 << 10;

impl Net {
    /// A device on an Ethernet port at an address of its own: its uplink
    /// attached to `switch`, its guest socket at [`Device::netdev`], its
    /// source filter on (its MAC and its one address).
    pub fn eth_device(&self, name: &str, switch: &Switch) -> Device {
        self.eth_device_with(
            name,
            switch,
            vrdma_vfio_user::Config::default(),
            eth_function,
        )
    }

    /// A device on an Ethernet port (as [`Net::eth_device`]) whose
    /// function `make` builds from the port and the MAC, served with
    /// `config`.
    pub fn eth_device_with<T: Transport + 'static>(
        &self,
        name: &str,
        switch: &Switch,
        config: vrdma_vfio_user::Config,
        make: impl FnOnce(EthPort, [u8; 6]) -> Pvrdma<T> + Send + 'static,
    ) -> Device {
        let addr = self.addr();
        let mac = mac_of(addr);
        let uplink = switch.attach(mac);
        let mut d = eth_device_at(name, addr, uplink, config, make);
        d._switch = Some(switch.clone());
        d
    }

    /// A device on an Ethernet port (as [`Net::eth_device`]) whose uplink
    /// is `uplink` (the far end is the test's: another daemon's uplink, a
    /// peer it plays).
    pub fn eth_device_on(&self, name: &str, uplink: UnixStream) -> Device {
        let addr = self.addr();
        eth_device_at(
            name,
            addr,
            uplink,
            vrdma_vfio_user::Config::default(),
            eth_function,
        )
    }

    /// Two devices on Ethernet ports of `switch` (`NAME-a`, `NAME-b`), a
    /// guest on each with its objects, their QPs connected.
    pub fn eth_pair(&self, name: &str, switch: &Switch) -> (Device, Device, Endpoint, Endpoint) {
        let da = self.eth_device(&format!("{name}-a"), switch);
        let db = self.eth_device(&format!("{name}-b"), switch);
        let mut a = Endpoint::new(&da);
        let mut b = Endpoint::new(&db);
        connect(&mut a, &mut b);
        (da, db, a, b)
    }
}

/// A device at `addr` on an Ethernet port whose uplink is `uplink`.
fn eth_device_at<T: Transport + 'static>(
    name: &str,
    addr: std::net::IpAddr,
    uplink: UnixStream,
    config: vrdma_vfio_user::Config,
    make: impl FnOnce(EthPort, [u8; 6]) -> Pvrdma<T> + Send + 'static,
) -> Device {
    let mac = mac_of(addr);
    let netdev = std::env::temp_dir().join(format!("vrdma-test-{}-{name}.net", std::process::id()));
    // A socket file left by an earlier run of this process id.
    let _ = std::fs::remove_file(&netdev);
    let listener = UnixListener::bind(&netdev).expect("binding the guest socket");
    let uplink = Stream::new(uplink).expect("the uplink stream");
    let mut port =
        EthPort::with_listener(listener, Link::Stream(uplink), mac).expect("the Ethernet port");
    port.set_filter(SourceFilter {
        mac: true,
        addrs: vec![addr],
    });
    Device {
        served: Served::start_with(name, config, move || make(port, mac)),
        addr,
        mac,
        netdev: Some(netdev),
        _switch: None,
    }
}

/// A function on `port` (a 9000-byte Ethernet: an active MTU of 4096).
pub fn eth_function(port: EthPort, mac: [u8; 6]) -> Pvrdma<EthPort> {
    function(port, mac, Mtu::Mtu4096)
}

/// Counters of a [`Switch`].
#[derive(Debug, Default)]
pub struct SwitchStats {
    /// Frames forwarded (a broadcast counts once per port it went to).
    pub forwarded: AtomicU64,
    /// Frames for a MAC no port has: dropped.
    pub unknown: AtomicU64,
    /// Frames dropped for a port whose backlog was full.
    pub full: AtomicU64,
    /// Ports attached whose device has not closed its end.
    pub ports: AtomicUsize,
}

/// An Ethernet switch in a thread: uplinks attach with their MAC; a frame
/// goes to the port of its destination MAC (a broadcast or multicast to
/// every other port; one for a MAC nobody has is dropped). A port that
/// does not read has its frames held up to a bound, then dropped. Clones
/// share the switch; it stops when the last goes.
#[derive(Clone, Debug)]
pub struct Switch(Arc<SwitchInner>);

#[derive(Debug)]
struct SwitchInner {
    add: Mutex<mpsc::Sender<Port>>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
    stats: Arc<SwitchStats>,
}

/// One port of the switch: the far end of a device's uplink.
#[derive(Debug)]
struct Port {
    sock: UnixStream,
    mac: [u8; 6],
    rx: Vec<u8>,
    tx: VecDeque<u8>,
    open: bool,
}

impl Default for Switch {
    fn default() -> Self {
        Self::new()
    }
}

impl Switch {
    pub fn new() -> Self {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(SwitchStats::default());
        let (halt, counts) = (stop.clone(), stats.clone());
        let thread = std::thread::spawn(move || run_switch(&rx, &halt, &counts));
        Switch(Arc::new(SwitchInner {
            add: Mutex::new(tx),
            stop,
            thread: Mutex::new(Some(thread)),
            stats,
        }))
    }

    /// A new port for the device whose MAC is `mac`: the device's end of
    /// its uplink.
    pub fn attach(&self, mac: [u8; 6]) -> UnixStream {
        let (device_end, switch_end) = UnixStream::pair().expect("socketpair");
        switch_end.set_nonblocking(true).expect("non-blocking");
        let port = Port {
            sock: switch_end,
            mac,
            rx: Vec::new(),
            tx: VecDeque::new(),
            open: true,
        };
        self.0
            .add
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(port)
            .expect("the switch's thread runs");
        device_end
    }

    pub fn stats(&self) -> &SwitchStats {
        &self.0.stats
    }

    /// Ports attached whose device has not closed its end of the uplink
    /// (as of the switch's last turn).
    pub fn ports(&self) -> usize {
        self.0.stats.ports.load(Ordering::Relaxed)
    }
}

impl Drop for SwitchInner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let t = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = t
            && t.join().is_err()
            && !std::thread::panicking()
        {
            panic!("the switch's thread panicked");
        }
    }
}

fn run_switch(add: &mpsc::Receiver<Port>, stop: &AtomicBool, stats: &SwitchStats) {
    let mut ports: Vec<Port> = Vec::new();
    let mut frames: Vec<(usize, Vec<u8>)> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        ports.extend(add.try_iter());
        ports.retain(|p| p.open);
        stats.ports.store(ports.len(), Ordering::Relaxed);
        let ready: Vec<(bool, bool)> = {
            let mut fds: Vec<PollFd<'_>> = ports
                .iter()
                .map(|p| {
                    let mut want = PollFlags::POLLIN;
                    if !p.tx.is_empty() {
                        want |= PollFlags::POLLOUT;
                    }
                    PollFd::new(p.sock.as_fd(), want)
                })
                .collect();
            match poll(&mut fds, PollTimeout::from(10u8)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => panic!("the switch's poll: {e}"),
            }
            fds.iter()
                .map(|f| {
                    let r = f.revents().unwrap_or(PollFlags::empty());
                    (
                        r.intersects(PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR),
                        r.contains(PollFlags::POLLOUT),
                    )
                })
                .collect()
        };
        for (i, &(readable, _)) in ready.iter().enumerate() {
            if readable {
                read_port(&mut ports[i], i, &mut frames);
            }
        }
        for (from, f) in frames.drain(..) {
            forward(&mut ports, from, &f, stats);
        }
        for p in &mut ports {
            flush_port(p);
        }
    }
}

/// Reads what `p` has (a bounded amount), its whole frames into `frames`.
fn read_port(p: &mut Port, i: usize, frames: &mut Vec<(usize, Vec<u8>)>) {
    let mut buf = [0u8; 65536];
    let mut read = 0;
    while read < READ_PER_TURN {
        match p.sock.read(&mut buf) {
            Ok(0) => {
                p.open = false;
                break;
            }
            Ok(n) => {
                p.rx.extend_from_slice(&buf[..n]);
                read += n;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                p.open = false;
                break;
            }
        }
    }
    let mut at = 0;
    while p.rx.len() - at >= 4 {
        let len = u32::from_be_bytes([p.rx[at], p.rx[at + 1], p.rx[at + 2], p.rx[at + 3]]);
        let len = len as usize;
        if len > MAX_FRAME {
            // Not a frame stream any more.
            p.open = false;
            return;
        }
        if p.rx.len() - at - 4 < len {
            break;
        }
        frames.push((i, p.rx[at + 4..at + 4 + len].to_vec()));
        at += 4 + len;
    }
    p.rx.drain(..at);
}

/// Sends `f` from port `from` where its destination MAC says.
fn forward(ports: &mut [Port], from: usize, f: &[u8], stats: &SwitchStats) {
    let Some(dst) = f.get(..6) else {
        return;
    };
    let broadcast = dst[0] & 1 != 0;
    let mut found = false;
    for (j, p) in ports.iter_mut().enumerate() {
        if j == from || !p.open || !(broadcast || p.mac == dst) {
            continue;
        }
        found = true;
        if p.tx.len() + 4 + f.len() > PORT_BACKLOG {
            stats.full.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        p.tx.extend((f.len() as u32).to_be_bytes());
        p.tx.extend(f);
        stats.forwarded.fetch_add(1, Ordering::Relaxed);
    }
    if !found && !broadcast {
        stats.unknown.fetch_add(1, Ordering::Relaxed);
    }
}

/// Writes what `p` holds, as far as its socket takes it.
fn flush_port(p: &mut Port) {
    while !p.tx.is_empty() && p.open {
        let (a, _) = p.tx.as_slices();
        match p.sock.write(a) {
            Ok(0) => p.open = false,
            Ok(n) => {
                p.tx.drain(..n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => p.open = false,
        }
    }
}

/// A guest's NIC, connected to its device's guest socket as QEMU's
/// `-netdev stream` is: frames written and read whole.
#[derive(Debug)]
pub struct Nic {
    pub sock: UnixStream,
    rx: Vec<u8>,
}

impl Nic {
    /// Connects to `device`'s guest socket, and waits until the port took
    /// the connection (`eth.guest_connects` grew).
    pub fn connect(device: &Device) -> Self {
        let before = device.counter_when("eth.guest_connects", |_| true);
        let nic = Self::connect_only(device);
        let now = device.counter_when("eth.guest_connects", |n| n > before);
        assert!(now > before, "the port never took the NIC's connection");
        nic
    }

    /// Connects to `device`'s guest socket without waiting for the port.
    pub fn connect_only(device: &Device) -> Self {
        let path = device
            .netdev
            .as_ref()
            .expect("a device on an Ethernet port");
        let sock = UnixStream::connect(path).expect("connecting to the guest socket");
        sock.set_write_timeout(Some(Duration::from_secs(10)))
            .expect("a write timeout");
        Nic {
            sock,
            rx: Vec::new(),
        }
    }

    /// Sends one frame (blocking while the port has not read enough).
    pub fn send(&mut self, frame: &[u8]) -> io::Result<()> {
        let mut m = (frame.len() as u32).to_be_bytes().to_vec();
        m.extend_from_slice(frame);
        self.sock.write_all(&m)
    }

    /// The next frame the port sent the guest, within `limit`.
    pub fn receive(&mut self, limit: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + limit;
        loop {
            if self.rx.len() >= 4 {
                let len = u32::from_be_bytes([self.rx[0], self.rx[1], self.rx[2], self.rx[3]]);
                let len = len as usize;
                if self.rx.len() >= 4 + len {
                    let f = self.rx[4..4 + len].to_vec();
                    self.rx.drain(..4 + len);
                    return Some(f);
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            self.sock
                .set_read_timeout(Some(left))
                .expect("a read timeout");
            let mut buf = [0u8; 16384];
            match self.sock.read(&mut buf) {
                Ok(0) => return None,
                Ok(n) => self.rx.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => panic!("reading the NIC: {e}"),
            }
        }
    }

    /// The frames that come within `limit`, until one `last` accepts
    /// (which ends the list), or the time runs out.
    pub fn receive_until(&mut self, limit: Duration, last: impl Fn(&[u8]) -> bool) -> Vec<Vec<u8>> {
        let deadline = Instant::now() + limit;
        let mut out = Vec::new();
        while let Some(f) = self.receive(deadline.saturating_duration_since(Instant::now())) {
            let end = last(&f);
            out.push(f);
            if end {
                break;
            }
        }
        out
    }
}

/// Frames as a guest's NIC sends them.
pub mod frame {
    use std::net::Ipv4Addr;

    /// The broadcast MAC.
    pub const BROADCAST: [u8; 6] = [0xff; 6];

    /// An Ethernet header, then `payload`.
    pub fn ethernet(dst: [u8; 6], src: [u8; 6], ethertype: u16, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::with_capacity(14 + payload.len());
        f.extend_from_slice(&dst);
        f.extend_from_slice(&src);
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// A UDP datagram over IPv4 from `src` to `dst` (port `dport`) with
    /// `payload`, in a frame from `src_mac` to `dst_mac` (the IPv4 header
    /// checksum right; no UDP checksum, which IPv4 allows).
    pub fn udp(
        dst_mac: [u8; 6],
        src_mac: [u8; 6],
        src: Ipv4Addr,
        dst: Ipv4Addr,
        dport: u16,
        payload: &[u8],
    ) -> Vec<u8> {
        let total = 20 + 8 + payload.len();
        let mut ip = vec![0u8; 20];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        ip[8] = 64;
        ip[9] = 17;
        ip[12..16].copy_from_slice(&src.octets());
        ip[16..20].copy_from_slice(&dst.octets());
        let sum = checksum(&ip);
        ip[10..12].copy_from_slice(&sum.to_be_bytes());
        ip.extend_from_slice(&9999u16.to_be_bytes());
        ip.extend_from_slice(&dport.to_be_bytes());
        ip.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
        ip.extend_from_slice(&[0, 0]);
        ip.extend_from_slice(payload);
        ethernet(dst_mac, src_mac, 0x0800, &ip)
    }

    /// An ARP request (Ethernet/IPv4), broadcast: who has `target`, tell
    /// `sender` at `sender_mac` (the frame from `src_mac`).
    pub fn arp_request(
        src_mac: [u8; 6],
        sender_mac: [u8; 6],
        sender: Ipv4Addr,
        target: Ipv4Addr,
    ) -> Vec<u8> {
        let mut p = vec![0, 1, 8, 0, 6, 4, 0, 1];
        p.extend_from_slice(&sender_mac);
        p.extend_from_slice(&sender.octets());
        p.extend_from_slice(&[0; 6]);
        p.extend_from_slice(&target.octets());
        ethernet(BROADCAST, src_mac, 0x0806, &p)
    }

    /// The Internet checksum of `b` (RFC 1071).
    fn checksum(b: &[u8]) -> u16 {
        let mut sum: u32 = b
            .chunks(2)
            .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
            .sum();
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    /// The IPv4 address of a test address (IPv4 in these tests).
    pub fn v4(a: std::net::IpAddr) -> Ipv4Addr {
        match a {
            std::net::IpAddr::V4(a) => a,
            std::net::IpAddr::V6(a) => a.to_ipv4_mapped().expect("an IPv4 address"),
        }
    }
}
