//! The PVRDMA face's test kit (feature `pvrdma`): what the face's suites
//! (`vrdma-pvrdma/tests`: the driver model, the hostile guest on UDP and on
//! the Ethernet port, the bounds) and the daemon's end-to-end test
//! (`vrdma/tests/serve.rs`) share.
//!
//! | module | what |
//! |---|---|
//! | [`guest`] | a guest as a device sees it: a vfio-user client with RAM in a sealed memfd, and a model of the Linux driver (probe, commands, page directories, rings, doorbells) |
//! | `guest::vmm` | the guest's VMM part: the vfio-user client and the RAM, its guard and canary pages, page directories |
//! | `guest::driver` | the driver's control path: probe, shared region, commands and refusals, event rings, GIDs, PDs, MRs |
//! | `guest::queues` | CQs and QPs as the driver holds them: rings, polling and arming, posting, MODIFY_QP, RC bring-up |
//! | [`served`] | a device served in a thread of its own, its counters copied out each turn, a gate between turns |
//! | [`side`] | a well-behaved guest's objects ([`Endpoint`]), two of them connected, an exchange checked byte for byte (SEND and WRITE; READ and atomics), one running throughout a test ([`side::Steady`]) |
//! | [`eth`] | devices on Ethernet ports whose uplinks meet in an in-test [`eth::Switch`], the guest's NIC ([`eth::Nic`]) and the frames it sends |
//! | [`measure`] | the process's open descriptors and peak memory, from `/proc/self` |
//!
//! Devices are made through a test binary's [`Net`], which hands out
//! their addresses: a binary names its own block of loopback addresses
//! (`static NET: Net = Net::new(N)`, 127.N.0.0/16), so that no two of its
//! tests, and no two binaries, bind the same UDP address (a device on a
//! UDP port binds its address; the tests of a binary run in parallel,
//! and binaries may too). The blocks taken (the older suites use 127.0.x.y:
//! the engine's 127.0.0, the device's 127.0.7 and 127.0.8, the tools'
//! 127.0.9):
//!
//! | block | binary |
//! |---|---|
//! | 127.20 | `vrdma-pvrdma/tests/driver.rs` |
//! | 127.21 | `vrdma-pvrdma/tests/hostile.rs` |
//! | 127.22 | `vrdma-pvrdma/tests/ethernet.rs` |
//! | 127.23 | `vrdma-pvrdma/tests/bounds.rs` |
//! | 127.24 | `vrdma/tests/serve.rs` |
//! | 127.25–27 | `vrdma-virtio/tests/{operations,lifecycle,hostile}.rs` (the `virtio` kit's `Net`) |
//! | 127.28 | `vrdma-tools/tests/faces_interop.rs` (both faces' devices, addresses from the `virtio` kit's `Net`) |
//! | 127.29–30 | `vrdma-virtio/tests/{operations_pci,pci}.rs` |
//! | 127.31–33 | `vrdma-virtio/tests/memory.rs` |
//!
//! This is test code: a failure is the test's, so it panics, saying what
//! failed (`expect`), as the tests' own code does.

pub mod eth;
pub mod guest;
pub mod measure;
pub mod served;
pub mod side;

use std::{net::IpAddr, ops::Deref, path::PathBuf};

pub use crate::addrs::mac_of;
pub use guest::{
    Guest, GuestCq, GuestQp, RAM_BASE, UAR_PFN, hdr, le32, one_page, rc_up, rc_up_mtu,
    sealed_memfd, sge, unsealed_page, wqe,
};
pub use served::Served;
pub use side::{
    Endpoint, Steady, completion, connect, eventually, exchange, one_way,
    page_lists_past_the_budget, read_and_atomics, wait_event,
};
use vrdma_device::Transport;
use vrdma_engine::attr::PortAttr;
use vrdma_fabric::udp::UdpPort;
use vrdma_pvrdma::{Pvrdma, caps::Limits};
use vrdma_wire::Gid;

/// A test binary's block of loopback addresses, 127.N.0.0/16, handed out
/// one by one (from 127.N.0.1; no address ends in 0 or 255).
#[derive(Debug)]
pub struct Net {
    block: crate::addrs::Block,
}

impl Net {
    /// Block `block` (see the table in the module's doc for those taken).
    pub const fn new(block: u8) -> Self {
        Net {
            block: crate::addrs::Block::new(block),
        }
    }

    /// An address no other device of this binary has.
    pub fn addr(&self) -> IpAddr {
        self.block.addr()
    }

    /// A device on a UDP port at an address of its own.
    pub fn device(&self, name: &str) -> Device {
        self.device_with(name, vrdma_vfio_user::Config::default(), udp_function)
    }

    /// A device at an address of its own whose function `make` builds (in
    /// the device's thread) from its address and MAC, served with
    /// `config`.
    pub fn device_with<T: Transport + 'static>(
        &self,
        name: &str,
        config: vrdma_vfio_user::Config,
        make: impl FnOnce(IpAddr, [u8; 6]) -> Pvrdma<T> + Send + 'static,
    ) -> Device {
        let addr = self.addr();
        let mac = mac_of(addr);
        Device {
            served: Served::start_with(name, config, move || make(addr, mac)),
            addr,
            mac,
            netdev: None,
            _switch: None,
        }
    }

    /// The set-up most tests open with: two devices on UDP ports
    /// (`NAME-a`, `NAME-b`), a guest on each with its objects
    /// ([`Endpoint::new`]), their QPs connected to each other.
    pub fn pair(&self, name: &str) -> (Device, Device, Endpoint, Endpoint) {
        let da = self.device(&format!("{name}-a"));
        let db = self.device(&format!("{name}-b"));
        let mut a = Endpoint::new(&da);
        let mut b = Endpoint::new(&db);
        connect(&mut a, &mut b);
        (da, db, a, b)
    }
}

/// A device a test serves: its address (the GID its guest binds), its
/// MAC and, on an Ethernet port, where its guest's NIC connects. It
/// dereferences to the [`Served`] device.
#[derive(Debug)]
pub struct Device {
    pub served: Served,
    pub addr: IpAddr,
    pub mac: [u8; 6],
    /// The guest socket of the device's Ethernet port.
    pub netdev: Option<PathBuf>,
    /// The switch its uplink is attached to, kept running while the
    /// device is (after `served`: dropped once the device thread ended).
    _switch: Option<eth::Switch>,
}

impl Device {
    /// The device's address as a GID.
    pub fn gid(&self) -> Gid {
        Gid::from(self.addr)
    }
}

impl Deref for Device {
    type Target = Served;

    fn deref(&self) -> &Served {
        &self.served
    }
}

/// A function with the default limits over `transport`, its port's MAC
/// `mac` and active MTU `mtu`.
pub fn function<T: Transport>(
    transport: T,
    mac: [u8; 6],
    mtu: vrdma_engine::attr::Mtu,
) -> Pvrdma<T> {
    let mut attr = PortAttr::with_gids(&[]);
    attr.active_mtu = mtu;
    Pvrdma::new(Limits::default(), mac, attr, transport).expect("the default limits")
}

/// A function on a UDP port bound to `addr` (port 4791; the guest binds
/// the address as its GID).
pub fn udp_function(addr: IpAddr, mac: [u8; 6]) -> Pvrdma<UdpPort> {
    let port = UdpPort::bind(vrdma_fabric::udp::Config::new(addr)).expect("binding the UDP port");
    function(port, mac, vrdma_engine::attr::Mtu::Mtu1024)
}
