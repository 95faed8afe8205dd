//! Completions: the engine's work completions as the CQ ring's entries.

use vrdma_engine::wc::{NetworkHdr, Wc, WcFlags};

use crate::abi::{self};

/// The CQE a work completion becomes.
pub fn cqe(wc: &Wc) -> abi::Cqe {
    let mut flags = 0u16;
    if wc.wc_flags.contains(WcFlags::GRH) {
        flags |= abi::wc_flags::GRH;
    }
    if wc.wc_flags.contains(WcFlags::WITH_IMM) {
        flags |= abi::wc_flags::WITH_IMM;
    }
    if wc.wc_flags.contains(WcFlags::WITH_INV) {
        flags |= abi::wc_flags::WITH_INV;
    }
    // The immediate travels as its wire bytes; an invalidated rkey as a
    // number.
    let ex = if wc.wc_flags.contains(WcFlags::WITH_IMM) {
        u32::from_le_bytes(wc.imm_data.to_be_bytes())
    } else {
        wc.imm_data
    };
    abi::Cqe {
        wr_id: wc.wr_id.into(),
        status: wc.status as u8,
        opcode: wc.opcode as u8,
        wc_flags: flags.into(),
        qpn: wc.qp_num.into(),
        byte_len: wc.byte_len.into(),
        ex: ex.into(),
        // A send queue's completion carries the QP's count of send WQEs
        // retired through it (§7.8): with it a driver counts outstanding
        // WQEs as verbs do, unsignaled ones included.
        src_qp: if (wc.opcode as u8) & abi::OPCODE_RECV_BIT == 0 {
            wc.sq_retired
        } else {
            wc.src_qp
        }
        .into(),
        pkey_index: wc.pkey_index.into(),
        sl: wc.sl,
        network_hdr_type: match wc.network_hdr {
            None => 0,
            Some(NetworkHdr::Ipv4) => 2,
            Some(NetworkHdr::Ipv6) => 3,
        },
    }
}
