//! What the operator asked for: each `--device` parsed into a
//! [`DeviceSpec`], and the set of them checked — names, sockets and MACs
//! unique, and no combination of networks that would let one tenant take
//! another's addresses.

use std::{net::IpAddr, path::PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use vrdma_device::ObjectBudget;
use vrdma_fabric::{eth::link_local, shm::Owned};
use vrdma_wire::Gid;

use crate::args::{ServeArgs, parse_size};

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
                "uplink" => uplink.replace(parse_uplink(v)?).is_some(),
                "mac" => mac.replace(parse_mac(v)?).is_some(),
                "mtu" => mtu.replace(parse_mtu(v)?).is_some(),
                "name" => name.replace(v.to_owned()).is_some(),
                "kind" => kind.replace(parse_kind(v)?).is_some(),
                "doorbells" => {
                    if !matches!(v, "trap" | "shared" | "poll" | "event") {
                        bail!(
                            "--device: doorbells {v:?}: trap or shared (pvrdma), poll or event (virtio)"
                        );
                    }
                    doorbells.replace(v.to_owned()).is_some()
                }
                "spin" => spin.replace(parse_spin(v)?).is_some(),
                "spoof" => spoof.replace(parse_on_off("spoof", v)?).is_some(),
                "ip" => addrs.replace(parse_addrs(v)?).is_some(),
                "mem" => mem.replace(parse_mem(v)?).is_some(),
                "net" => {
                    vrdma_fabric::shm::check_network_name(v)
                        .map_err(|e| anyhow!("--device: net: {e}"))?;
                    net.replace(v.to_owned()).is_some()
                }
                "objects" => objects.replace(parse_objects(v)?).is_some(),
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
        if kind == Kind::Pvrdma && !shared_doorbells && spin.is_some() {
            bail!(
                "--device: spin= is for polled doorbells (virtio-rdma's, PVRDMA's doorbells=shared)"
            );
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

/// `uplink=`: `tap:NAME` or `stream:PATH`.
fn parse_uplink(v: &str) -> Result<Uplink> {
    if let Some(t) = v.strip_prefix("tap:") {
        // IFNAMSIZ: 15 bytes and a NUL.
        if t.is_empty() || t.len() > 15 || t.contains('/') {
            bail!("--device: uplink {v:?}: a TAP's name is 1 to 15 bytes");
        }
        Ok(Uplink::Tap(t.to_owned()))
    } else if let Some(p) = v.strip_prefix("stream:") {
        Ok(Uplink::Stream(PathBuf::from(p)))
    } else {
        bail!("--device: uplink {v:?}: tap:NAME or stream:PATH");
    }
}

/// `mtu=`: what an Ethernet carries, 68 (IPv4's least) to a 9000-byte
/// jumbo frame.
fn parse_mtu(v: &str) -> Result<u32> {
    let m: u32 = v.parse().with_context(|| format!("--device: mtu {v:?}"))?;
    if !(68..=9000).contains(&m) {
        bail!("--device: mtu {m}: 68 to 9000");
    }
    Ok(m)
}

/// `kind=`.
fn parse_kind(v: &str) -> Result<Kind> {
    Ok(match v {
        "pvrdma" => Kind::Pvrdma,
        "virtio" => Kind::Virtio,
        "virtio-pci" => Kind::VirtioPci,
        _ => bail!("--device: kind {v:?}: pvrdma, virtio or virtio-pci"),
    })
}

/// `spin=`: microseconds, at most a second.
fn parse_spin(v: &str) -> Result<std::time::Duration> {
    let us: u64 = v
        .parse()
        .with_context(|| format!("--device: spin {v:?}: microseconds"))?;
    if us > 1_000_000 {
        bail!("--device: spin {us}: at most 1 000 000 µs");
    }
    Ok(std::time::Duration::from_micros(us))
}

/// `KEY=on` or `KEY=off`.
fn parse_on_off(key: &str, v: &str) -> Result<bool> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => bail!("--device: {key} {v:?}: on or off"),
    }
}

/// `ip=A+B…`.
fn parse_addrs(v: &str) -> Result<Vec<IpAddr>> {
    v.split('+')
        .map(|a| {
            a.parse::<IpAddr>()
                .with_context(|| format!("--device: ip {a:?}: an address"))
        })
        .collect()
}

/// `mem=SIZE`: at least a MiB.
fn parse_mem(v: &str) -> Result<u64> {
    let b = parse_size(v).with_context(|| format!("--device: mem {v:?}"))?;
    if b < 1 << 20 {
        bail!("--device: mem {v:?}: at least 1M");
    }
    Ok(b)
}

/// `objects=`: `derived`, `unlimited` or a size.
fn parse_objects(v: &str) -> Result<ObjectBudget> {
    Ok(match v {
        "derived" => ObjectBudget::Derived,
        "unlimited" => ObjectBudget::Unlimited,
        _ => {
            ObjectBudget::Fixed(parse_size(v).with_context(|| format!("--device: objects {v:?}"))?)
        }
    })
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

/// The `--device` strings, `--socket-path` (rust-vmm's vhost-device
/// daemons' option) given to the one device that names no socket.
pub(super) fn device_strings(a: &ServeArgs) -> Result<Vec<String>> {
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

/// Every `--device`, parsed, and the set checked: names, sockets and MACs
/// unique; the networks as [`check_networks`] requires (with `--no-shm`
/// nothing is joined through memory, which is said of a device that names
/// a network).
pub(super) fn specs(a: &ServeArgs) -> Result<Vec<DeviceSpec>> {
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
    Ok(specs)
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
    }
}
