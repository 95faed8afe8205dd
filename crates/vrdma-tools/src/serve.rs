//! `vrdma serve`: RDMA devices for QEMU guests — PVRDMA over vfio-user
//! (`kind=pvrdma`, the stock `vmw_pvrdma` driver's), virtio-rdma over
//! vhost-user (`kind=virtio`, docs/virtio-rdma.md) — each on its own
//! socket, each with its Ethernet port between the guest's NIC (vmxnet3,
//! or the virtio-net sibling) and an uplink.
//!
//! One thread per device (a PVRDMA device and its engine never move
//! between threads: `vrdma_pvrdma::Server` is its whole event loop; a
//! virtio-rdma device's turns run in its vhost-user worker). The main
//! thread only waits for signals: SIGINT and SIGTERM stop every device;
//! a device whose port fails (its uplink gone) stops alone, said on
//! stderr, while the others go on serving.

use std::{
    net::IpAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
};

use anyhow::{Context, Result, anyhow, bail};
use nix::{
    sys::signal::{SigSet, Signal, kill},
    unistd::getpid,
};
use vrdma_device::transport::SameHost;
use vrdma_device::{ObjectBudget, active_mtu};
use vrdma_engine::attr::PortAttr;
use vrdma_fabric::{
    eth::{EthPort, Link, SourceFilter, link_local},
    shm::{JoinConfig, Owned, Rendezvous, Switch},
};
use vrdma_pvrdma::{Pvrdma, Server, caps::Limits};
use vrdma_wire::Gid;

use crate::{
    args::{CapsArgs, ServeArgs, parse_size},
    sandbox::{self, Seccomp},
};

/// Where a device's uplink goes.
#[derive(Clone, Debug, Eq, PartialEq)]
pub enum Uplink {
    /// A TAP device: an existing one (`ip tuntap add NAME mode tap`, a
    /// bridge's port), or else one the daemon makes for its lifetime.
    Tap(String),
    /// A socket of length-prefixed frames to connect to.
    Stream(PathBuf),
}

/// Which device ABI a device presents.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Kind {
    /// VMware's PVRDMA over vfio-user.
    Pvrdma,
    /// virtio-rdma (device ID 42) over vhost-user.
    Virtio,
    /// virtio-rdma as a whole virtio-pci function (1af4:106a) over
    /// vfio-user (docs/virtio-rdma.md §13.3).
    VirtioPci,
}

/// One `--device`, parsed.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct DeviceSpec {
    pub kind: Kind,
    pub socket: PathBuf,
    pub netdev: PathBuf,
    pub uplink: Uplink,
    pub mac: [u8; 6],
    /// The link's Ethernet MTU.
    pub mtu: u32,
    pub name: String,
    /// Doorbell pages shared with the guest, read by a busy-polling device
    /// thread (no exit per post), instead of trapped.
    pub shared_doorbells: bool,
    /// The guest may send only from its MAC (and from `addrs`, when
    /// given), and bind only `addrs` as GIDs: on by default with a TAP
    /// uplink (a bridge shared with other tenants).
    pub spoof_check: bool,
    /// The addresses the guest was given (`ip=A+B…`): the only ones it
    /// may bind as GIDs and hold on the same-host switch (with its MAC's
    /// link-local one), and, with `spoof=on`, send from.
    pub addrs: Vec<IpAddr>,
    /// The virtual network the device is on (`net=NAME`): devices of one
    /// network reach each other through same-host shared memory, and no
    /// device of another. None: a network of its own.
    pub net: Option<String>,
    /// What the guest's objects may make the daemon hold.
    pub objects: ObjectBudget,
    /// The guest's memory (`mem=SIZE`: its RAM, or `maxmem` with
    /// hot-plug): the most a VMM may map for the device, and what its
    /// object budget is derived from, whatever the VMM maps.
    pub mem: Option<u64>,
    /// virtio-rdma: the device polls doorbell areas while work flows
    /// (`doorbells=poll`, the default) or takes a kick for each
    /// (`doorbells=event`).
    pub poll: bool,
    /// virtio-rdma: how long the device keeps polling after its last work.
    pub spin: std::time::Duration,
}

/// Parses a MAC address, `aa:bb:cc:dd:ee:ff`: a unicast one (a device
/// sends from it).
pub fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        let p = parts
            .next()
            .ok_or_else(|| anyhow!("MAC {s:?}: six bytes, aa:bb:cc:dd:ee:ff"))?;
        if p.len() != 2 {
            bail!("MAC {s:?}: six bytes, aa:bb:cc:dd:ee:ff");
        }
        *b = u8::from_str_radix(p, 16).with_context(|| format!("MAC {s:?}"))?;
    }
    if parts.next().is_some() {
        bail!("MAC {s:?}: six bytes, aa:bb:cc:dd:ee:ff");
    }
    if mac[0] & 1 != 0 || mac == [0; 6] {
        bail!("MAC {s:?}: not a unicast address");
    }
    Ok(mac)
}

impl DeviceSpec {
    /// Parses `socket=…,netdev=…,uplink=…,mac=…[,mtu=…][,name=…]`; `index`
    /// names it when no name is given.
    pub fn parse(s: &str, index: usize) -> Result<Self> {
        let (mut socket, mut netdev, mut uplink, mut mac, mut mtu, mut name, mut doorbells) =
            (None, None, None, None, None, None, None);
        let (mut spoof, mut addrs, mut objects) = (None, None, None);
        let (mut kind, mut spin, mut net, mut mem) = (None, None, None, None);
        for kv in s.split(',') {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| anyhow!("--device: {kv:?} is not KEY=VALUE"))?;
            if v.is_empty() {
                bail!("--device: {k} is empty");
            }
            let seen = match k {
                "socket" => socket.replace(PathBuf::from(v)).is_some(),
                "netdev" => netdev.replace(PathBuf::from(v)).is_some(),
                "uplink" => {
                    let u = if let Some(t) = v.strip_prefix("tap:") {
                        // IFNAMSIZ: 15 bytes and a NUL.
                        if t.is_empty() || t.len() > 15 || t.contains('/') {
                            bail!("--device: uplink {v:?}: a TAP's name is 1 to 15 bytes");
                        }
                        Uplink::Tap(t.to_owned())
                    } else if let Some(p) = v.strip_prefix("stream:") {
                        Uplink::Stream(PathBuf::from(p))
                    } else {
                        bail!("--device: uplink {v:?}: tap:NAME or stream:PATH");
                    };
                    uplink.replace(u).is_some()
                }
                "mac" => mac.replace(parse_mac(v)?).is_some(),
                "mtu" => {
                    let m: u32 = v.parse().with_context(|| format!("--device: mtu {v:?}"))?;
                    // What an Ethernet carries: 68 (IPv4's least) to a
                    // 9000-byte jumbo frame.
                    if !(68..=9000).contains(&m) {
                        bail!("--device: mtu {m}: 68 to 9000");
                    }
                    mtu.replace(m).is_some()
                }
                "name" => name.replace(v.to_owned()).is_some(),
                "kind" => {
                    let k = match v {
                        "pvrdma" => Kind::Pvrdma,
                        "virtio" => Kind::Virtio,
                        "virtio-pci" => Kind::VirtioPci,
                        _ => bail!("--device: kind {v:?}: pvrdma, virtio or virtio-pci"),
                    };
                    kind.replace(k).is_some()
                }
                "doorbells" => {
                    if !matches!(v, "trap" | "shared" | "poll" | "event") {
                        bail!(
                            "--device: doorbells {v:?}: trap or shared (pvrdma), poll or event (virtio)"
                        );
                    }
                    doorbells.replace(v.to_owned()).is_some()
                }
                "spin" => {
                    let us: u64 = v
                        .parse()
                        .with_context(|| format!("--device: spin {v:?}: microseconds"))?;
                    if us > 1_000_000 {
                        bail!("--device: spin {us}: at most 1 000 000 µs");
                    }
                    spin.replace(std::time::Duration::from_micros(us)).is_some()
                }
                "spoof" => {
                    let on = match v {
                        "on" => true,
                        "off" => false,
                        _ => bail!("--device: spoof {v:?}: on or off"),
                    };
                    spoof.replace(on).is_some()
                }
                "ip" => {
                    let list = v
                        .split('+')
                        .map(|a| {
                            a.parse::<IpAddr>()
                                .with_context(|| format!("--device: ip {a:?}: an address"))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    addrs.replace(list).is_some()
                }
                "mem" => {
                    let b = parse_size(v).with_context(|| format!("--device: mem {v:?}"))?;
                    if b < 1 << 20 {
                        bail!("--device: mem {v:?}: at least 1M");
                    }
                    mem.replace(b).is_some()
                }
                "net" => {
                    vrdma_fabric::shm::check_network_name(v)
                        .map_err(|e| anyhow!("--device: net: {e}"))?;
                    net.replace(v.to_owned()).is_some()
                }
                "objects" => {
                    let b = match v {
                        "derived" => ObjectBudget::Derived,
                        "unlimited" => ObjectBudget::Unlimited,
                        _ => ObjectBudget::Fixed(
                            parse_size(v).with_context(|| format!("--device: objects {v:?}"))?,
                        ),
                    };
                    objects.replace(b).is_some()
                }
                _ => bail!(
                    "--device: unknown key {k:?} (kind, socket, netdev, uplink, mac, mtu, name, \
                     doorbells, spin, spoof, ip, net, mem, objects)"
                ),
            };
            if seen {
                bail!("--device: {k} given twice");
            }
        }
        let need = |what: &str| anyhow!("--device {s:?}: no {what}=");
        let socket = socket.ok_or_else(|| need("socket"))?;
        let netdev = netdev.ok_or_else(|| need("netdev"))?;
        if socket == netdev {
            bail!("--device: socket and netdev are the same path");
        }
        let uplink = uplink.ok_or_else(|| need("uplink"))?;
        let spoof_check = spoof.unwrap_or(matches!(uplink, Uplink::Tap(_)));
        let addrs = addrs.unwrap_or_default();
        let kind = kind.unwrap_or(Kind::Pvrdma);
        let (shared_doorbells, poll) = match (kind, doorbells.as_deref()) {
            (Kind::Pvrdma, None | Some("trap")) => (false, false),
            (Kind::Pvrdma, Some("shared")) => (true, false),
            (Kind::Virtio | Kind::VirtioPci, None | Some("poll")) => (false, true),
            (Kind::Virtio | Kind::VirtioPci, Some("event")) => (false, false),
            (_, Some(d)) => bail!("--device: doorbells={d} is not one of this kind's"),
        };
        if kind == Kind::Pvrdma && spin.is_some() {
            bail!("--device: spin= is virtio-rdma's");
        }
        Ok(DeviceSpec {
            kind,
            poll,
            spin: spin.unwrap_or(vrdma_virtio::vhost::DEFAULT_SPIN),
            socket,
            netdev,
            uplink,
            mac: mac.ok_or_else(|| need("mac"))?,
            mtu: mtu.unwrap_or(1500),
            name: name.unwrap_or_else(|| match kind {
                Kind::Pvrdma => format!("pvrdma{index}"),
                Kind::Virtio | Kind::VirtioPci => format!("vrdma{index}"),
            }),
            shared_doorbells,
            spoof_check,
            addrs,
            net,
            objects: objects.unwrap_or(ObjectBudget::Derived),
            mem,
        })
    }

    /// What the device may hold as its addresses: the operator's `ip=`
    /// and its MAC's link-local address; anything when none were given
    /// (a device that shares no network: [`check_networks`]).
    pub fn owned(&self) -> Owned {
        if self.addrs.is_empty() {
            return Owned::Any;
        }
        let mut v: Vec<Gid> = self.addrs.iter().map(|a| Gid::from(*a)).collect();
        v.push(Gid::from(link_local(self.mac)));
        Owned::Only(v)
    }
}

/// Refuses, at start-up, a set of devices whose networks would let one
/// tenant take another's addresses on the same-host switch: every device
/// of a network that has several members in this daemon, or that other
/// daemons may join (`--shm-dir`), must be given its addresses (`ip=`),
/// and no address may be given to two devices of one network. Devices of
/// different networks may have the same addresses (tenants' address
/// spaces overlap); a device without `net=` is a network of its own.
pub fn check_networks(specs: &[DeviceSpec], rendezvous: bool) -> Result<()> {
    for (i, x) in specs.iter().enumerate() {
        let Some(net) = &x.net else {
            continue;
        };
        let members: Vec<&DeviceSpec> = specs
            .iter()
            .filter(|y| y.net.as_ref() == Some(net))
            .collect();
        if (members.len() > 1 || rendezvous) && x.addrs.is_empty() {
            let why = if members.len() > 1 {
                let others: Vec<&str> = members
                    .iter()
                    .filter(|y| y.name != x.name)
                    .map(|y| y.name.as_str())
                    .collect();
                format!("shares it with {}", others.join(", "))
            } else {
                "other daemons may join it (--shm-dir)".to_owned()
            };
            bail!(
                "device {} is on network {net}, which {why}: give it its addresses (ip=A+B…), \
                 the only ones it may then hold",
                x.name
            );
        }
        for y in &specs[..i] {
            if y.net.as_ref() != Some(net) {
                continue;
            }
            if let Some(a) = x.addrs.iter().find(|a| y.addrs.contains(a)) {
                bail!(
                    "devices {} and {} are both given {a} on network {net}",
                    y.name,
                    x.name
                );
            }
        }
    }
    Ok(())
}

/// Who may connect and what a client may map, from the command line.
fn vfio_config(a: &ServeArgs) -> Result<vrdma_vfio_user::Config> {
    let mut c = vrdma_vfio_user::Config::default();
    for u in &a.allow_users {
        let uid = sandbox::identity(u)?.uid.as_raw();
        if !c.socket.allowed_uids.contains(&uid) {
            c.socket.allowed_uids.push(uid);
        }
    }
    for g in &a.allow_groups {
        let gid = sandbox::group(g)?.as_raw();
        if !c.socket.allowed_gids.contains(&gid) {
            c.socket.allowed_gids.push(gid);
        }
    }
    c.dma.allow_unsealed = a.allow_unsealed;
    c.dma.max_maps = a.max_dma_maps;
    c.dma.max_bytes = a.max_dma_bytes;
    Ok(c)
}

impl CapsArgs {
    pub fn limits(&self) -> Limits {
        Limits {
            max_qp: self.max_qp,
            max_qp_wr: self.max_qp_wr,
            max_sge: self.max_sge,
            max_cq: self.max_cq,
            max_cqe: self.max_cqe,
            max_mr: self.max_mr,
            max_pd: self.max_pd,
            max_ah: self.max_ah,
            max_srq: self.max_srq,
            max_srq_wr: self.max_srq_wr,
            max_srq_sge: self.max_srq_sge,
            max_qp_rd_atom: self.max_qp_rd_atom,
            max_mr_size: self.max_mr_size,
            max_uar: self.max_uar,
            gid_tbl_len: self.gid_tbl_len,
        }
    }
}

/// A device, opened: its sockets bound, ready to serve.
enum Opened {
    Pvrdma(Box<Server<Port>>),
    VirtioPci(Box<vrdma_face::vfio::Server<vrdma_virtio::pci::VirtioPci<Port>>>),
    Virtio(vrdma_virtio::server::Server<Port>),
}

/// A served device's transport: its Ethernet port, behind the process's
/// same-host switch unless `--no-shm`.
type Port = SameHost<EthPort>;

/// The Ethernet port of the device `spec` describes: its netdev socket
/// (private to the peers `config` allows), its uplink, its filter.
fn port(spec: &DeviceSpec, config: &vrdma_vfio_user::Config) -> Result<EthPort> {
    let link = match &spec.uplink {
        Uplink::Tap(t) => Link::tap(t).with_context(|| format!("opening TAP {t}"))?,
        Uplink::Stream(p) => {
            Link::connect(p).with_context(|| format!("connecting to {}", p.display()))?
        }
    };
    let listener = vrdma_vfio_user::socket::bind_private(&spec.netdev, &config.socket)
        .with_context(|| format!("listening at {}", spec.netdev.display()))?;
    let mut port = EthPort::with_listener(listener, link, spec.mac)?;
    let peers = config.socket.clone();
    port.set_peer_check(Box::new(move |s| peers.allows_peer(s).unwrap_or(false)));
    if spec.spoof_check {
        port.set_filter(SourceFilter {
            mac: true,
            addrs: spec.addrs.clone(),
        });
    }
    Ok(port)
}

/// Builds the device `spec` describes and binds its sockets (private to
/// the peers `config` allows).
fn open(
    spec: &DeviceSpec,
    limits: &Limits,
    config: &vrdma_vfio_user::Config,
    switch: Option<&Switch>,
) -> Result<Opened> {
    let net = match (switch, &spec.net) {
        (Some(sw), Some(n)) => Some(sw.network(n)?),
        (Some(sw), None) => Some(sw.private_network()),
        (None, _) => None,
    };
    let on = switch.zip(net.as_ref());
    // What this device's VMM may map: at most the guest's size.
    let mut device_config = config.clone();
    device_config.dma = device_config.dma.clone().for_guest(spec.mem);
    let label = net.as_ref().map(|n| n.label().to_owned());
    let port = SameHost::on(on, spec.owned(), port(spec, config)?)
        .context("joining the same-host switch")?;
    let mut attr = PortAttr::with_gids(&[]);
    attr.active_mtu = active_mtu(spec.mtu);
    if matches!(spec.kind, Kind::Virtio | Kind::VirtioPci) {
        let opts = vrdma_virtio::face::Options {
            mac: spec.mac,
            poll: spec.poll,
            ..Default::default()
        };
        let mut face = vrdma_virtio::face::VirtioRdma::new(opts, attr, port);
        face.set_budget(spec.objects);
        face.set_guest_size(spec.mem);
        if spec.kind == Kind::VirtioPci {
            let function = vrdma_virtio::pci::VirtioPci::new(face, spec.spin);
            let mut server = vrdma_face::vfio::Server::bind_with(
                &spec.socket,
                function,
                &spec.name,
                &device_config,
            )
            .with_context(|| format!("listening at {}", spec.socket.display()))?;
            if let Some(l) = &label {
                server.set_network(l);
            }
            return Ok(Opened::VirtioPci(Box::new(server)));
        }
        // vfio-user's rules for what a VMM maps, on vhost-user's memory
        // table: sealed (or guarded), at most the guest's size and the
        // process-wide cap, a bounded number of regions.
        let mut limits = vrdma_virtio::vhost::MemoryLimits {
            allow_unsealed: config.dma.allow_unsealed,
            ..vrdma_virtio::vhost::MemoryLimits::for_guest(spec.mem)
        };
        limits.max_bytes = limits.max_bytes.min(config.dma.max_bytes);
        let backend = vrdma_virtio::vhost::Backend::with_limits(face, spec.spin, limits)?;
        backend.publish_as(&spec.name);
        if let Some(l) = &label {
            backend.set_network(l);
        }
        let listener = vrdma_vfio_user::socket::bind_private(&spec.socket, &config.socket)
            .with_context(|| format!("listening at {}", spec.socket.display()))?;
        let server = vrdma_virtio::server::Server::new(&spec.name, listener, backend)?;
        return Ok(Opened::Virtio(server));
    }
    let mut function = Pvrdma::new(limits.clone(), spec.mac, attr, port)?;
    function.set_object_budget(spec.objects);
    function.set_guest_size(spec.mem);
    if spec.shared_doorbells {
        function
            .share_doorbells()
            .context("sharing the doorbell pages")?;
    }
    let mut server = Server::bind_with(&spec.socket, function, &spec.name, &device_config)
        .with_context(|| format!("listening at {}", spec.socket.display()))?;
    if let Some(l) = &label {
        server.set_network(l);
    }
    Ok(Opened::Pvrdma(Box::new(server)))
}

/// Confines the whole process once every device is open: another user
/// or no capabilities, then the seccomp filter on every thread.
/// `unconfined` runs between the two (as the daemon's user, before the
/// filter: what it opens, the filter need not allow).
fn confine(
    user: Option<&sandbox::Identity>,
    drop_caps: bool,
    seccomp: Seccomp,
    unconfined: impl FnOnce() -> Result<()>,
) -> Result<()> {
    if let Some(u) = user {
        sandbox::drop_privileges(u)?;
    }
    if drop_caps {
        sandbox::drop_thread_capabilities()?;
    }
    unconfined()?;
    sandbox::apply(seccomp)
}

/// Joins the rendezvous directory `--shm-dir` names (as the daemon's
/// user: the socket it makes is the user's).
fn join(switch: Option<&Switch>, a: &ServeArgs) -> Result<Option<Rendezvous>> {
    let (Some(switch), Some(dir)) = (switch, &a.shm_dir) else {
        return Ok(None);
    };
    let mut config = JoinConfig::new(dir);
    for g in &a.shm_groups {
        config.admit.gids.push(sandbox::group(g)?.as_raw());
    }
    let r = switch
        .join(config)
        .with_context(|| format!("joining the rendezvous directory {}", dir.display()))?;
    eprintln!(
        "vrdma serve: same-host shared memory with the daemons of {}",
        dir.display()
    );
    Ok(Some(r))
}

/// What the devices' owner may announce on a rendezvous: for each named
/// network, the addresses of its devices there.
fn grant_entries(specs: &[DeviceSpec]) -> Vec<(String, Vec<Gid>)> {
    let mut v: Vec<(String, Vec<Gid>)> = Vec::new();
    for s in specs {
        let (Some(net), Owned::Only(addrs)) = (&s.net, s.owned()) else {
            continue;
        };
        match v.iter_mut().find(|(n, _)| n == net) {
            Some((_, a)) => a.extend(addrs),
            None => v.push((net.clone(), addrs)),
        }
    }
    v
}

/// Writes, as root and before the daemon becomes `user`, what `user`'s
/// daemons may announce on the rendezvous directory (`--shm-dir`): its
/// devices' networks and addresses, in a file the user cannot write
/// (`vrdma_fabric::shm::write_grant`). Other daemons take this daemon's
/// addresses only as far as that file says. A root daemon that stays root
/// needs none (other daemons trust root); one that is not root cannot
/// write it, and says so.
fn grant(
    a: &ServeArgs,
    entries: &[(String, Vec<Gid>)],
    user: Option<&sandbox::Identity>,
) -> Result<()> {
    let Some(dir) = &a.shm_dir else {
        return Ok(());
    };
    let root = nix::unistd::Uid::effective().is_root();
    match user {
        Some(u) if root => {
            vrdma_fabric::shm::write_grant(dir, u.uid.as_raw(), entries)
                .with_context(|| format!("writing {}'s grant in {}", u.name, dir.display()))?;
        }
        None if root => {}
        _ => eprintln!(
            "vrdma serve: not root: no grant written in {}/grants; daemons of other users take \
             this daemon's addresses only if root granted them",
            dir.display()
        ),
    }
    Ok(())
}

/// Makes `dir` a directory of `user`'s, closed to others, for its
/// counters.
fn prepare_run_dir(dir: &std::path::Path, user: &sandbox::Identity) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("making {}", dir.display()))?;
    nix::unistd::chown(dir, Some(user.uid), Some(user.gid))
        .with_context(|| format!("giving {} to {}", dir.display(), user.name))?;
    // The user must pass through the run directory to reach its own (and
    // may not list or write it).
    if let Some(parent) = dir.parent() {
        use std::os::unix::fs::PermissionsExt;
        let m =
            std::fs::metadata(parent).with_context(|| format!("reading {}", parent.display()))?;
        let mode = m.permissions().mode() & 0o7777;
        if mode & 0o001 == 0 {
            std::fs::set_permissions(parent, std::fs::Permissions::from_mode(mode | 0o011))
                .with_context(|| format!("opening {} to traversal", parent.display()))?;
        }
    }
    Ok(())
}

/// A device's thread, and the word that lets it serve.
struct Running {
    name: String,
    thread: JoinHandle<Result<()>>,
    go: mpsc::Sender<()>,
}

/// What `--print-capabilities` prints.
pub const CAPABILITIES: &str = r#"{"type": "rdma", "features": []}"#;

/// `vrdma serve`.
/// The `--device` strings, `--socket-path` (rust-vmm's vhost-device
/// daemons' option) given to the one device that names no socket.
fn device_strings(a: &ServeArgs) -> Result<Vec<String>> {
    let Some(path) = &a.socket_path else {
        return Ok(a.devices.clone());
    };
    let [d] = a.devices.as_slice() else {
        bail!("--socket-path is one device's socket: give one --device (with socket= for more)");
    };
    if d.split(',').any(|kv| kv.starts_with("socket=")) {
        bail!("--socket-path and the device's socket= both name its socket");
    }
    let p = path
        .to_str()
        .filter(|p| !p.contains(','))
        .ok_or_else(|| anyhow!("--socket-path {path:?}: a UTF-8 path without commas"))?;
    Ok(vec![format!("{d},socket={p}")])
}

pub fn run(a: &ServeArgs) -> Result<()> {
    if a.print_capabilities {
        println!("{CAPABILITIES}");
        return Ok(());
    }
    let limits = a.caps.limits();
    limits.validate()?;
    let specs = device_strings(a)?
        .iter()
        .enumerate()
        .map(|(i, s)| DeviceSpec::parse(s, i))
        .collect::<Result<Vec<_>>>()?;
    for (i, x) in specs.iter().enumerate() {
        for y in &specs[..i] {
            let paths = [&x.socket, &x.netdev];
            if paths.contains(&&y.socket) || paths.contains(&&y.netdev) {
                bail!("devices {} and {} share a socket path", y.name, x.name);
            }
            if x.name == y.name {
                bail!("two devices are called {}", x.name);
            }
            if x.mac == y.mac {
                bail!("devices {} and {} have the same MAC", y.name, x.name);
            }
        }
    }
    if a.no_shm {
        if let Some(x) = specs.iter().find(|x| x.net.is_some()) {
            eprintln!(
                "vrdma serve: --no-shm: device {}'s network reaches nothing through memory",
                x.name
            );
        }
    } else {
        check_networks(&specs, a.shm_dir.is_some())?;
    }

    let user = a.user.as_deref().map(sandbox::identity).transpose()?;
    sandbox::refuse_staying_root(a.seccomp, user.as_ref(), nix::unistd::Uid::effective())?;
    let config = vfio_config(a)?;
    // A root daemon that confines itself without becoming another user
    // gives up its capabilities: each device thread its own, once its
    // device is open (capabilities are per thread), the main thread last.
    let drop_caps =
        user.is_none() && a.seccomp != Seccomp::Off && nix::unistd::Uid::effective().is_root();
    if let Some(u) = &user {
        // The counters go where the user may write them, which `vrdma
        // stat` reads too.
        let dir = vrdma_device::publish::run_dir().join(&u.name);
        prepare_run_dir(&dir, u)?;
        // SAFETY: no other thread exists yet (the device threads start
        // below), so nothing reads the environment concurrently.
        #[allow(unsafe_code)]
        unsafe {
            std::env::set_var("VRDMA_RUN_DIR", &dir)
        };
    }
    sandbox::raise_fd_limit();

    // Signals are taken by the main thread alone, synchronously: blocked
    // here, before any device thread exists (threads inherit the mask).
    let mut signals = SigSet::empty();
    for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGUSR1] {
        signals.add(s);
    }
    signals.thread_block()?;

    let stop = Arc::new(AtomicBool::new(false));
    // The devices' same-host medium.
    let switch = (!a.no_shm).then(Switch::new);
    // The virtio-rdma servers' stops (their threads wait in vhost-user
    // calls, not on the flag).
    let stops: Arc<std::sync::Mutex<Vec<Arc<vrdma_virtio::server::Stop>>>> = Arc::default();
    let mut running = Vec::new();
    let mut failed = None;
    // A device thread that stops says which it was here, then wakes the
    // main thread (SIGUSR1).
    let (done_tx, done_rx) = mpsc::channel::<String>();
    let grants = grant_entries(&specs);
    for spec in specs {
        let (tx, rx) = mpsc::channel();
        let done = done_tx.clone();
        let stop = stop.clone();
        let limits = limits.clone();
        let config = config.clone();
        let stops = stops.clone();
        let switch = switch.clone();
        let name = spec.name.clone();
        let (go, go_rx) = mpsc::channel::<()>();
        let thread =
            std::thread::Builder::new()
                .name(spec.name.clone())
                .spawn(move || -> Result<()> {
                    let opened = open(&spec, &limits, &config, switch.as_ref()).and_then(|s| {
                        if drop_caps {
                            sandbox::drop_thread_capabilities()?;
                        }
                        Ok(s)
                    });
                    let server = match opened {
                        Ok(s) => {
                            if let Opened::Virtio(v) = &s {
                                stops
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .push(v.stopper());
                            }
                            let _ = tx.send(Ok(()));
                            s
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return Ok(());
                        }
                    };
                    // Nothing is served before the whole process is
                    // confined (or if confining it failed: the sender
                    // is dropped).
                    if go_rx.recv().is_err() {
                        return Ok(());
                    }
                    let r = match server {
                        Opened::Pvrdma(mut s) => s.run(&stop).map_err(anyhow::Error::from),
                        Opened::VirtioPci(mut s) => s.run(&stop).map_err(anyhow::Error::from),
                        Opened::Virtio(s) => {
                            // Stopped before it began: its stop came too
                            // early to reach it.
                            if stop.load(Ordering::Relaxed) {
                                s.stopper().stop();
                            }
                            let r = s.run().map_err(anyhow::Error::from);
                            s.backend().publish_last();
                            r
                        }
                    };
                    let _ = done.send(spec.name.clone());
                    let _ = kill(getpid(), Signal::SIGUSR1);
                    r.with_context(|| format!("device {}", spec.name))
                })?;
        match rx.recv() {
            Ok(Ok(())) => running.push(Running { name, thread, go }),
            Ok(Err(e)) => {
                let _ = thread.join();
                failed = Some(e.context(format!("device {name}")));
                break;
            }
            Err(_) => {
                failed = Some(anyhow!("device {name}: its thread died starting"));
                break;
            }
        }
    }
    let mut rendezvous = None;
    if failed.is_none()
        && switch.is_some()
        && let Err(e) = grant(a, &grants, user.as_ref())
    {
        failed = Some(e);
    }
    if failed.is_none()
        && let Err(e) = confine(user.as_ref(), drop_caps, a.seccomp, || {
            rendezvous = join(switch.as_ref(), a)?;
            Ok(())
        })
    {
        failed = Some(e);
    }
    let stop_all = |stop: &AtomicBool| {
        stop.store(true, Ordering::Relaxed);
        for s in stops.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            s.stop();
        }
    };
    if let Some(e) = failed {
        stop_all(&stop);
        for r in running {
            drop(r.go);
            let _ = r.thread.join();
        }
        return Err(e);
    }
    for r in &running {
        let _ = r.go.send(());
        eprintln!("vrdma serve: {} ready", r.name);
    }

    let mut errors = 0;
    while !running.is_empty() {
        let sig = signals.wait()?;
        if sig != Signal::SIGUSR1 {
            eprintln!("vrdma serve: {sig}, stopping");
            stop_all(&stop);
        }
        let stopped: Vec<String> = done_rx.try_iter().collect();
        let (done, live): (Vec<_>, Vec<_>) = running
            .into_iter()
            .partition(|r| stopped.contains(&r.name) || stop.load(Ordering::Relaxed));
        running = live;
        for r in done {
            match r.thread.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    errors += 1;
                    eprintln!("vrdma serve: {e:#}");
                }
                Err(_) => {
                    errors += 1;
                    eprintln!("vrdma serve: device {} failed", r.name);
                }
            }
        }
    }
    if errors > 0 {
        bail!("{errors} device(s) stopped on an error");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_path_names_the_one_devices_socket() {
        use clap::Parser;
        let serve = |args: &[&str]| {
            let mut v = vec!["vrdma", "serve"];
            v.extend_from_slice(args);
            match crate::args::Cli::try_parse_from(v)
                .expect("arguments")
                .command
            {
                crate::args::Command::Serve(a) => device_strings(&a),
                _ => unreachable!("serve"),
            }
        };
        let d = "kind=virtio,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01";
        let s = serve(&["--socket-path", "/run/g1-rdma.sock", "--device", d]).unwrap();
        assert_eq!(s, vec![format!("{d},socket=/run/g1-rdma.sock")]);
        let spec = DeviceSpec::parse(&s[0], 0).unwrap();
        assert_eq!(spec.socket, PathBuf::from("/run/g1-rdma.sock"));
        // Two devices, a device with its own socket=, a path with a comma.
        let two = ["--socket-path", "/s", "--device", d, "--device", d];
        assert!(serve(&two).is_err());
        let own = format!("{d},socket=/t");
        assert!(serve(&["--socket-path", "/s", "--device", &own]).is_err());
        assert!(serve(&["--socket-path", "/s,x", "--device", d]).is_err());
        // Without it, the strings as given.
        assert_eq!(serve(&["--device", d]).unwrap(), vec![d.to_owned()]);
    }

    #[test]
    fn device_specs() {
        let d = DeviceSpec::parse(
            "socket=/run/a.sock,netdev=/run/a.net,uplink=tap:tap1,mac=52:54:00:4c:00:01",
            3,
        )
        .unwrap();
        assert_eq!(d.socket, PathBuf::from("/run/a.sock"));
        assert_eq!(d.netdev, PathBuf::from("/run/a.net"));
        assert_eq!(d.uplink, Uplink::Tap("tap1".into()));
        assert_eq!(d.mac, [0x52, 0x54, 0, 0x4c, 0, 1]);
        assert_eq!(d.mtu, 1500);
        assert_eq!(d.name, "pvrdma3");
        let d = DeviceSpec::parse(
            "name=g2,mtu=9000,uplink=stream:/x,mac=02:00:00:00:00:02,netdev=/n,socket=/s",
            0,
        )
        .unwrap();
        assert_eq!(d.uplink, Uplink::Stream("/x".into()));
        assert_eq!((d.mtu, d.name.as_str()), (9000, "g2"));
        assert!(!d.shared_doorbells);
        let d = DeviceSpec::parse(
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,doorbells=shared",
            0,
        )
        .unwrap();
        assert!(d.shared_doorbells);
        // A TAP uplink checks what the guest sends by default; a stream
        // does not unless told.
        assert!(d.spoof_check && d.addrs.is_empty());
        assert_eq!(d.objects, ObjectBudget::Derived);
        let d = DeviceSpec::parse(
            "socket=/s,netdev=/n,uplink=stream:/u,mac=52:54:00:4c:00:01,spoof=on,\
             ip=10.0.0.5+fd00::5,objects=256M",
            0,
        )
        .unwrap();
        assert!(d.spoof_check);
        assert_eq!(
            d.addrs,
            [
                "10.0.0.5".parse::<IpAddr>().unwrap(),
                "fd00::5".parse().unwrap()
            ]
        );
        assert_eq!(d.objects, ObjectBudget::Fixed(256 << 20));
        let d = DeviceSpec::parse(
            "socket=/s,netdev=/n,uplink=stream:/u,mac=52:54:00:4c:00:01,objects=unlimited",
            0,
        )
        .unwrap();
        assert!(!d.spoof_check);
        assert_eq!(d.objects, ObjectBudget::Unlimited);
        assert_eq!(d.kind, Kind::Pvrdma);
        let d = DeviceSpec::parse(
            "kind=virtio,socket=/s,netdev=/n,uplink=stream:/u,mac=52:54:00:4c:00:01",
            2,
        )
        .unwrap();
        assert_eq!(
            (d.kind, d.poll, d.name.as_str()),
            (Kind::Virtio, true, "vrdma2")
        );
        assert_eq!(d.spin, vrdma_virtio::vhost::DEFAULT_SPIN);
        let d = DeviceSpec::parse(
            "kind=virtio,socket=/s,netdev=/n,uplink=stream:/u,mac=52:54:00:4c:00:01,\
             doorbells=event,spin=50",
            0,
        )
        .unwrap();
        assert!(!d.poll);
        assert_eq!(d.spin, std::time::Duration::from_micros(50));
        let d = DeviceSpec::parse(
            "kind=virtio-pci,socket=/s,netdev=/n,uplink=stream:/u,mac=52:54:00:4c:00:01,spin=7",
            1,
        )
        .unwrap();
        assert_eq!(
            (d.kind, d.poll, d.name.as_str(), d.spin),
            (
                Kind::VirtioPci,
                true,
                "vrdma1",
                std::time::Duration::from_micros(7)
            )
        );
        for bad in [
            "kind=virtio-pci,socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,doorbells=trap",
            "kind=virtio,socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,doorbells=shared",
            "kind=pvrdma,socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,doorbells=poll",
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,spin=10",
            "kind=virtio,socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,spin=2000000",
            "kind=rxe,socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01",
        ] {
            assert!(DeviceSpec::parse(bad, 0).is_err(), "{bad}");
        }
        for bad in [
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00",
            "socket=/s,netdev=/n,uplink=tap:t,mac=01:54:00:4c:00:01",
            "socket=/s,netdev=/n,uplink=tap:t,mac=00:00:00:00:00:00",
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01:02",
            "socket=/s,netdev=/n,uplink=tap:t,mac=5:54:00:4c:00:011",
            "socket=/s,netdev=/n,uplink=eth0,mac=52:54:00:4c:00:01",
            "socket=/s,netdev=/n,uplink=tap:a-name-far-too-long,mac=52:54:00:4c:00:01",
            "socket=/s,netdev=/s,uplink=tap:t,mac=52:54:00:4c:00:01",
            "socket=/s,uplink=tap:t,mac=52:54:00:4c:00:01",
            "socket=/s,socket=/t,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01",
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,mtu=10000",
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,speed=10",
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,name=",
            "socket=/s;netdev=/n",
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,doorbells=polled",
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,spoof=maybe",
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,ip=10.0.0.256",
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,net=a/b",
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,net=a,net=b",
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,objects=12Q",
            "socket=/s,netdev=/n,uplink=tap:t,mac=52:54:00:4c:00:01,objects=99999999999T",
        ] {
            assert!(DeviceSpec::parse(bad, 0).is_err(), "{bad}");
        }
    }

    fn spec(s: &str, i: usize) -> DeviceSpec {
        DeviceSpec::parse(s, i).unwrap()
    }

    /// Issue 31/37: the addresses a device owns, and the sets of devices a
    /// daemon refuses at start-up.
    #[test]
    fn networks_need_owned_addresses_and_may_overlap_across_networks() {
        let base = "netdev=/n,uplink=stream:/u";
        let dev = |i: usize, extra: &str| {
            spec(
                &format!("{base},socket=/s{i},mac=52:54:00:00:00:0{i},name=d{i}{extra}"),
                i,
            )
        };
        // ip= without spoof=on: owned (GIDs, switch claims), frames not
        // filtered.
        let d = dev(1, ",ip=10.0.0.5,net=tenant-a");
        assert!(!d.spoof_check);
        assert_eq!(d.net.as_deref(), Some("tenant-a"));
        let Owned::Only(o) = d.owned() else {
            panic!("ip= owns")
        };
        assert!(o.contains(&Gid::from("10.0.0.5".parse::<IpAddr>().unwrap())));
        assert!(
            o.contains(&Gid::from(link_local(d.mac))),
            "its link-local one"
        );
        assert_eq!(dev(2, "").owned(), Owned::Any);
        // Alone on a network, or without one: no ip= needed.
        check_networks(&[dev(1, ",net=a"), dev(2, ""), dev(3, "")], false).unwrap();
        // Two on one network: each needs ip=.
        let e = check_networks(&[dev(1, ",net=a,ip=10.0.0.1"), dev(2, ",net=a")], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("d2") && e.contains("ip="), "{e}");
        // A rendezvous: every named network's device needs ip=.
        assert!(check_networks(&[dev(1, ",net=a")], true).is_err());
        check_networks(&[dev(1, ""), dev(2, ",net=a,ip=10.0.0.2")], true).unwrap();
        // One address twice on a network: refused; on two networks: fine.
        assert!(
            check_networks(
                &[dev(1, ",net=a,ip=10.0.0.5"), dev(2, ",net=a,ip=10.0.0.5")],
                false
            )
            .is_err()
        );
        check_networks(
            &[
                dev(1, ",net=a,ip=10.0.0.5"),
                dev(2, ",net=a,ip=10.0.0.6"),
                dev(3, ",net=b,ip=10.0.0.5"),
                dev(4, ",net=b,ip=10.0.0.6"),
            ],
            true,
        )
        .unwrap();
        // The grant: each network's addresses.
        let g = grant_entries(&[
            dev(1, ",net=a,ip=10.0.0.5"),
            dev(3, ",net=b,ip=10.0.0.5"),
            dev(4, ""),
        ]);
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].0, "a");
    }
}
