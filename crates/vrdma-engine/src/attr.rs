//! Device and port attributes: what `ibv_query_device` and
//! `ibv_query_port` report, and the limits every create call is checked
//! against. Configurable, like PVRDMA's `dev-caps-*` properties.

use vrdma_wire::{Gid, PKey};

/// Path MTU (`enum ibv_mtu`).
#[derive(Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd)]
pub enum Mtu {
    Mtu256 = 1,
    Mtu512 = 2,
    Mtu1024 = 3,
    Mtu2048 = 4,
    Mtu4096 = 5,
}

impl Mtu {
    /// Payload bytes per packet.
    pub const fn bytes(self) -> u32 {
        128 << (self as u32)
    }

    /// From rdma-core's enum value.
    pub const fn from_code(code: u32) -> Option<Self> {
        match code {
            1 => Some(Mtu::Mtu256),
            2 => Some(Mtu::Mtu512),
            3 => Some(Mtu::Mtu1024),
            4 => Some(Mtu::Mtu2048),
            5 => Some(Mtu::Mtu4096),
            _ => None,
        }
    }
}

/// Atomic operation support (`enum ibv_atomic_cap`).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum AtomicCap {
    None,
    /// Atomic with respect to this device's operations only.
    Hca,
    /// Atomic with respect to everything touching the memory.
    Global,
}

/// Device limits and identity (`struct ibv_device_attr`).
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct DeviceAttr {
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_sge_rd: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_pd: u32,
    /// Outstanding RDMA READ / atomic requests a QP may receive.
    pub max_qp_rd_atom: u32,
    /// Outstanding RDMA READ / atomic requests a QP may initiate.
    pub max_qp_init_rd_atom: u32,
    pub max_res_rd_atom: u32,
    pub atomic_cap: AtomicCap,
    pub max_mw: u32,
    pub max_ah: u32,
    pub max_srq: u32,
    pub max_srq_wr: u32,
    pub max_srq_sge: u32,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
    pub max_inline_data: u32,
    pub max_fast_reg_page_list_len: u32,
}

impl Default for DeviceAttr {
    /// Limits in the range Linux rxe advertises (rxe_param.h), scaled to a
    /// device that keeps its state in host memory.
    fn default() -> Self {
        DeviceAttr {
            node_guid: 0x0250_56ff_fe00_0001,
            sys_image_guid: 0x0250_56ff_fe00_0001,
            // No IEEE OUI is claimed; 0 is "unassigned" to rdma-core.
            vendor_id: 0,
            vendor_part_id: 0,
            hw_ver: 0,
            max_mr_size: u64::MAX,
            page_size_cap: 0xffff_f000,
            max_qp: 0x1_0000,
            max_qp_wr: 0x4000,
            max_sge: 32,
            max_sge_rd: 32,
            max_cq: 0x4000,
            max_cqe: (1 << 15) - 1,
            max_mr: 0x4000,
            max_pd: 0x7ffc,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            max_res_rd_atom: 0x3f000,
            atomic_cap: AtomicCap::Hca,
            max_mw: 0x1000,
            max_ah: 0x3fff,
            max_srq: 0x4000,
            max_srq_wr: 0x4000,
            max_srq_sge: 27,
            max_pkeys: 1,
            local_ca_ack_delay: 15,
            phys_port_cnt: 1,
            max_inline_data: 256,
            max_fast_reg_page_list_len: 512,
        }
    }
}

/// Port state (`enum ibv_port_state`).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum PortState {
    Down = 1,
    Init = 2,
    Armed = 3,
    Active = 4,
}

/// What a GID table entry is (`enum ibv_gid_type`); vrdma speaks RoCEv2
/// only.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum GidType {
    RoceV2,
}

/// One GID table entry.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct GidEntry {
    pub gid: Gid,
    pub ty: GidType,
}

/// Port attributes and tables (`struct ibv_port_attr`, the GID and P_Key
/// tables).
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct PortAttr {
    pub state: PortState,
    pub max_mtu: Mtu,
    pub active_mtu: Mtu,
    /// GID table: RoCEv2 GIDs (IPv6, and IPv4-mapped for IPv4 addresses).
    /// Empty slots are `None`; the table's length is `gid_tbl_len`.
    pub gids: Vec<Option<GidEntry>>,
    pub pkeys: Vec<PKey>,
}

impl PortAttr {
    /// A port with the given GIDs (RoCEv2), the default P_Key and an active
    /// MTU of 1024 (what rxe reports on a 1500-byte Ethernet MTU).
    pub fn with_gids(gids: &[Gid]) -> Self {
        PortAttr {
            state: PortState::Active,
            max_mtu: Mtu::Mtu4096,
            active_mtu: Mtu::Mtu1024,
            gids: gids
                .iter()
                .map(|&gid| {
                    Some(GidEntry {
                        gid,
                        ty: GidType::RoceV2,
                    })
                })
                .collect(),
            pkeys: vec![PKey::DEFAULT],
        }
    }

    /// The GID at `index`, if that slot is filled.
    pub fn gid(&self, index: u8) -> Option<GidEntry> {
        self.gids.get(usize::from(index)).copied().flatten()
    }

    /// The P_Key at `index`.
    pub fn pkey(&self, index: u16) -> Option<PKey> {
        self.pkeys.get(usize::from(index)).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_codes_and_sizes() {
        assert_eq!(Mtu::Mtu256.bytes(), 256);
        assert_eq!(Mtu::Mtu1024.bytes(), 1024);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        for code in 1..=5 {
            assert_eq!(Mtu::from_code(code).map(|m| m as u32), Some(code));
        }
        assert_eq!(Mtu::from_code(0), None);
        assert_eq!(Mtu::from_code(6), None);
    }

    #[test]
    fn gid_and_pkey_lookup() {
        let g = Gid::from(core::net::Ipv4Addr::new(127, 0, 0, 2));
        let p = PortAttr::with_gids(&[g]);
        assert_eq!(p.gid(0).map(|e| e.gid), Some(g));
        assert_eq!(p.gid(1), None);
        assert_eq!(p.pkey(0), Some(PKey::DEFAULT));
        assert_eq!(p.pkey(1), None);
    }
}
