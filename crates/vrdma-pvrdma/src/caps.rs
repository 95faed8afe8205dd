//! What the device offers: its limits (options, as QEMU's PVRDMA had its
//! `dev-caps-*` properties), turned into the capabilities the driver reads
//! from the shared region and into the engine's limits.
//!
//! Handles the driver indexes tables with must stay below the counts it
//! sizes them by: the engine numbers CQs and SRQs from 1 and QPs from 17
//! (1 is the GSI QP), so the capabilities announce one more CQ and SRQ,
//! and 17 more QPs, than the engine holds. The driver keeps its own counts
//! against those; the engine refuses what goes past its own.

use vrdma_engine::attr::{AtomicCap, DeviceAttr};

use crate::abi::{self, Caps};

/// Handles the engine gives before its first QP (0, 1 = GSI, 2..16).
const QPN_BASE: u32 = 17;

/// The device's limits, as a user sets them.
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct Limits {
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_pd: u32,
    pub max_ah: u32,
    pub max_srq: u32,
    pub max_srq_wr: u32,
    pub max_srq_sge: u32,
    pub max_qp_rd_atom: u32,
    pub max_mr_size: u64,
    /// User contexts at once (each has one doorbell page); a power of two.
    pub max_uar: u32,
    pub gid_tbl_len: u32,
}

impl Limits {
    /// The defaults: what `vrdma serve` announces unless told otherwise.
    pub const DEFAULT: Limits = Limits {
        max_qp: 1024,
        // What middleware asks for with its defaults fits: UCX wants
        // 4 096-entry UD receive queues and 4 095-entry SRQs (rxe offers
        // 2^20, hardware tens of thousands). A QP's slots in the daemon
        // are charged to the device's object budget, which is what bounds
        // them, not this.
        max_qp_wr: 16384,
        max_sge: 8,
        max_cq: 2048,
        // The driver rounds a CQ up to a power of two: libfabric's rxm
        // asks for 135 168 CQEs (a 2^18 ring, 16 MiB of guest memory).
        max_cqe: 1 << 18,
        max_mr: 4096,
        max_pd: 1024,
        // The kernel's MAD layer makes an AH per reply.
        max_ah: 65536,
        max_srq: 256,
        max_srq_wr: 16384,
        max_srq_sge: 8,
        // As rxe (and vrdma's own UDP device): perftest asks its requester
        // for as many outstanding READs as the peer's responder takes,
        // 128 against rxe, and a modify beyond this limit fails.
        max_qp_rd_atom: 128,
        // One page directory of pages: 262 144 × 4 KiB.
        max_mr_size: 1 << 30,
        max_uar: 256,
        gid_tbl_len: 128,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// A limit the driver cannot work with.
#[derive(Clone, Debug, Eq, PartialEq, thiserror::Error)]
#[error("{what}: {value} (must be {bound})")]
pub struct LimitError {
    pub what: &'static str,
    pub value: u64,
    pub bound: &'static str,
}

impl Limits {
    /// Checks the limits against what the driver needs and what its
    /// tables can index.
    pub fn validate(&self) -> Result<(), LimitError> {
        let check = |ok: bool, what, value: u64, bound| {
            if ok {
                Ok(())
            } else {
                Err(LimitError { what, value, bound })
            }
        };
        check(
            (1..=65535 - QPN_BASE).contains(&self.max_qp),
            "max_qp",
            self.max_qp.into(),
            "1 to 65518 (QP handles are 16-bit to the driver)",
        )?;
        check(
            self.max_qp_wr >= 512,
            "max_qp_wr",
            self.max_qp_wr.into(),
            "at least 512 (the kernel's MAD QP)",
        )?;
        check(
            (2..=250).contains(&self.max_sge),
            "max_sge",
            self.max_sge.into(),
            "2 to 250 (a WQE is at most a page)",
        )?;
        check(
            (1..=0xff_fffe).contains(&self.max_cq),
            "max_cq",
            self.max_cq.into(),
            "1 to 2^24 - 2",
        )?;
        check(
            self.max_cqe >= 1024 && self.max_cqe <= 1 << 20,
            "max_cqe",
            self.max_cqe.into(),
            "1024 to 2^20",
        )?;
        check(self.max_mr >= 1, "max_mr", self.max_mr.into(), "at least 1")?;
        check(self.max_pd >= 1, "max_pd", self.max_pd.into(), "at least 1")?;
        check(self.max_ah >= 1, "max_ah", self.max_ah.into(), "at least 1")?;
        check(
            self.max_srq <= 0xff_fffe,
            "max_srq",
            self.max_srq.into(),
            "at most 2^24 - 2",
        )?;
        check(
            (1..=250).contains(&self.max_srq_sge),
            "max_srq_sge",
            self.max_srq_sge.into(),
            "1 to 250",
        )?;
        check(
            (1..=255).contains(&self.max_qp_rd_atom),
            "max_qp_rd_atom",
            self.max_qp_rd_atom.into(),
            "1 to 255",
        )?;
        check(
            (abi::PAGE_SIZE..=abi::MAX_PDIR_PAGES * abi::PAGE_SIZE).contains(&self.max_mr_size),
            "max_mr_size",
            self.max_mr_size,
            "4 KiB to 1 GiB (one page directory)",
        )?;
        check(
            self.max_uar.is_power_of_two() && (2..=1 << 16).contains(&self.max_uar),
            "max_uar",
            self.max_uar.into(),
            "a power of two, 2 to 65536",
        )?;
        check(
            (1..=256).contains(&self.gid_tbl_len),
            "gid_tbl_len",
            self.gid_tbl_len.into(),
            "1 to 256",
        )?;
        Ok(())
    }

    /// The engine's limits.
    pub fn device_attr(&self, node_guid: u64) -> DeviceAttr {
        DeviceAttr {
            node_guid,
            sys_image_guid: node_guid,
            vendor_id: 0,
            vendor_part_id: u32::from(abi::DEVICE_ID),
            hw_ver: 1,
            max_mr_size: self.max_mr_size,
            page_size_cap: abi::PAGE_SIZE,
            max_qp: self.max_qp,
            max_qp_wr: self.max_qp_wr,
            max_sge: self.max_sge,
            max_sge_rd: self.max_sge,
            max_cq: self.max_cq,
            max_cqe: self.max_cqe,
            // Every kernel PD takes a DMA MR too.
            max_mr: self.max_mr.saturating_add(self.max_pd),
            max_pd: self.max_pd,
            max_qp_rd_atom: self.max_qp_rd_atom,
            max_qp_init_rd_atom: self.max_qp_rd_atom,
            max_res_rd_atom: self.max_qp_rd_atom.saturating_mul(self.max_qp),
            atomic_cap: AtomicCap::Hca,
            // The driver has no memory-window verbs.
            max_mw: 0,
            max_ah: self.max_ah,
            max_srq: self.max_srq,
            max_srq_wr: self.max_srq_wr,
            max_srq_sge: self.max_srq_sge,
            max_pkeys: 1,
            local_ca_ack_delay: 15,
            phys_port_cnt: 1,
            // The driver posts no inline data.
            max_inline_data: 0,
            max_fast_reg_page_list_len: abi::MAX_FAST_REG_PAGES,
        }
    }

    /// The capabilities written into the shared region.
    pub fn caps(&self, node_guid: u64) -> Caps {
        let a = self.device_attr(node_guid);
        let version = env!("CARGO_PKG_VERSION");
        let mut parts = version.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
        let (maj, min, patch) = (
            parts.next().unwrap_or(0),
            parts.next().unwrap_or(0),
            parts.next().unwrap_or(0),
        );
        Caps {
            fw_ver: (maj << 32 | min << 16 | patch).into(),
            node_guid: node_guid.to_be_bytes(),
            sys_image_guid: node_guid.to_be_bytes(),
            max_mr_size: a.max_mr_size.into(),
            page_size_cap: a.page_size_cap.into(),
            vendor_id: a.vendor_id.into(),
            vendor_part_id: a.vendor_part_id.into(),
            hw_ver: a.hw_ver.into(),
            max_qp: (self.max_qp + QPN_BASE).into(),
            max_qp_wr: a.max_qp_wr.into(),
            max_sge: a.max_sge.into(),
            max_sge_rd: a.max_sge_rd.into(),
            max_cq: (self.max_cq + 1).into(),
            max_cqe: a.max_cqe.into(),
            max_mr: self.max_mr.into(),
            max_pd: a.max_pd.into(),
            max_qp_rd_atom: a.max_qp_rd_atom.into(),
            max_res_rd_atom: a.max_res_rd_atom.into(),
            max_qp_init_rd_atom: a.max_qp_init_rd_atom.into(),
            max_ah: a.max_ah.into(),
            max_srq: if self.max_srq == 0 {
                0.into()
            } else {
                (self.max_srq + 1).into()
            },
            max_srq_wr: a.max_srq_wr.into(),
            max_srq_sge: a.max_srq_sge.into(),
            max_uar: self.max_uar.into(),
            gid_tbl_len: self.gid_tbl_len.into(),
            max_pkeys: 1.into(),
            local_ca_ack_delay: a.local_ca_ack_delay,
            phys_port_cnt: 1,
            mode: 0,
            atomic_ops: abi::ATOMIC_OP_COMP_SWAP | abi::ATOMIC_OP_FETCH_ADD,
            bmme_flags: abi::BMME_LOCAL_INV | abi::BMME_REMOTE_INV | abi::BMME_FAST_REG_WR,
            gid_types: abi::GID_TYPE_ROCE_V2,
            max_fast_reg_page_list_len: abi::MAX_FAST_REG_PAGES.into(),
            ..Caps::default()
        }
    }
}

/// The node GUID of a port with this MAC (EUI-64: the universal/local bit
/// flipped, ff:fe in the middle), as the IB core derives a RoCE device's.
pub fn node_guid(mac: [u8; 6]) -> u64 {
    u64::from_be_bytes([
        mac[0] ^ 2,
        mac[1],
        mac[2],
        0xff,
        0xfe,
        mac[3],
        mac[4],
        mac[5],
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_what_the_driver_needs() {
        let l = Limits::default();
        l.validate().unwrap();
        let c = l.caps(1);
        assert_eq!(c.mode, 0);
        assert_eq!(c.gid_types, abi::GID_TYPE_ROCE_V2);
        assert_eq!(c.phys_port_cnt, 1);
        assert!(c.max_uar.get().is_power_of_two());
        assert!(c.max_qp.get() <= 65535);
        assert!(c.max_qp_wr.get() >= 512 && c.max_cqe.get() >= 1024 && c.max_sge.get() >= 2);
        assert_eq!(c.bmme_flags, 7, "fast registration needs all three");
        assert!(c.max_fast_reg_page_list_len.get() <= 128);
    }

    #[test]
    fn the_defaults_fit_what_middleware_asks_for() {
        let c = Limits::default().caps(1);
        // UCX: 4 096-entry UD receive queues and 4 095-entry SRQs.
        assert!(c.max_qp_wr.get() >= 4096 && c.max_srq_wr.get() >= 4096);
        // libfabric's rxm: 135 168 CQEs, which the driver rounds up.
        assert!(c.max_cqe.get() >= 135_168u32.next_power_of_two());
    }

    #[test]
    fn limits_the_driver_cannot_index_are_refused() {
        for bad in [
            Limits {
                max_qp: 65519,
                ..Limits::default()
            },
            Limits {
                max_uar: 3,
                ..Limits::default()
            },
            Limits {
                max_qp_wr: 511,
                ..Limits::default()
            },
            Limits {
                max_cqe: 512,
                ..Limits::default()
            },
            Limits {
                max_sge: 251,
                ..Limits::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn eui64_from_a_mac() {
        assert_eq!(
            node_guid([0x52, 0x54, 0x00, 0x47, 0x91, 0x21]),
            0x5054_00ff_fe47_9121
        );
    }
}
