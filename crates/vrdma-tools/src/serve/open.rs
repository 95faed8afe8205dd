//! A device opened from its spec: its Ethernet port and uplink, its place
//! on the same-host switch, the face it presents (PVRDMA, virtio-rdma
//! over vhost-user or as a virtio-pci function), its sockets bound.

use anyhow::{Context, Result};
use vrdma_device::active_mtu;
use vrdma_device::transport::SameHost;
use vrdma_engine::attr::PortAttr;
use vrdma_fabric::{
    eth::{EthPort, Link, SourceFilter},
    shm::Switch,
};
use vrdma_pvrdma::{Pvrdma, Server, caps::Limits};

use super::spec::{DeviceSpec, Kind, Uplink};
use crate::{
    args::{CapsArgs, ServeArgs},
    sandbox::{self},
};

/// Who may connect and what a client may map, from the command line.
pub(super) fn vfio_config(a: &ServeArgs) -> Result<vrdma_vfio_user::Config> {
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
pub(super) enum Opened {
    Pvrdma(Box<Server<Port>>),
    VirtioPci(Box<vrdma_face::vfio::Server<vrdma_virtio::pci::VirtioPci<Port>>>),
    Virtio(vrdma_virtio::server::Server<Port>),
}

/// A served device's transport: its Ethernet port, behind the process's
/// same-host switch unless `--no-shm`.
pub(super) type Port = SameHost<EthPort>;

/// The Ethernet port of the device `spec` describes: its netdev socket
/// (private to the peers `config` allows), its uplink, its filter.
pub(super) fn port(spec: &DeviceSpec, config: &vrdma_vfio_user::Config) -> Result<EthPort> {
    let link = match &spec.uplink {
        Uplink::Tap(t) => {
            let link = Link::tap(t).with_context(|| format!("opening TAP {t}"))?;
            if let Link::Tap(tap) = &link {
                tracing::info!(
                    tap = %t,
                    offloads = tap.offloads(),
                    "TAP uplink (offloads: UDP segmentation both ways, checksums)"
                );
            }
            link
        }
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
pub(super) fn open(
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
        function.set_spin(spec.spin);
    }
    let mut server = Server::bind_with(&spec.socket, function, &spec.name, &device_config)
        .with_context(|| format!("listening at {}", spec.socket.display()))?;
    if let Some(l) = &label {
        server.set_network(l);
    }
    Ok(Opened::Pvrdma(Box::new(server)))
}
