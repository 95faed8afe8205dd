//! Completions into guest memory in PVRDMA's formats: a CQ's ring of
//! `pvrdma_cqe`s, written by the engine as each completion happens
//! ([`GuestCq`], the face core's CQ sink with [`cqe`] as its encoding),
//! and the device's own rings (async events, CQ notifications) that the
//! device produces into and the driver consumes ([`DeviceRing`]).
//!
//! The device keeps its own producer index; the guest's consumer index is
//! read, checked, and only then trusted to say how much room is left. A
//! ring the guest broke (a bad index, unmapped pages) or let fill up takes
//! no more: the CQ overflows (the engine raises CQ_ERR and takes its QPs
//! to ERR), a device ring drops the entry and counts it.

use vm_memory::GuestMemory;
use vrdma_engine::wc::{NetworkHdr, Wc, WcFlags, WcOpcode, WcStatus};
pub use vrdma_face::cq::SharedMem;
use vrdma_face::{Producer, ring::WrapBit};
use zerocopy::{FromZeros, Immutable, IntoBytes, little_endian::U32, little_endian::U64};

use crate::{
    abi::{self, Cqe, network_hdr, wc_flags, wc_opcode},
    ring::Ring,
};

/// A CQ whose ring is in guest memory: made with [`cqe`] as its encoding.
pub type GuestCq = vrdma_face::cq::GuestCq<WrapBit, Cqe>;

/// The CQE the driver expects for `wc`.
pub fn cqe(wc: &Wc) -> Cqe {
    let opcode = match wc.opcode {
        WcOpcode::Send => wc_opcode::SEND,
        WcOpcode::RdmaWrite => wc_opcode::RDMA_WRITE,
        WcOpcode::RdmaRead => wc_opcode::RDMA_READ,
        WcOpcode::CompSwap => wc_opcode::COMP_SWAP,
        WcOpcode::FetchAdd => wc_opcode::FETCH_ADD,
        WcOpcode::BindMw => wc_opcode::BIND_MW,
        WcOpcode::LocalInv => wc_opcode::LOCAL_INV,
        WcOpcode::RegMr => wc_opcode::FAST_REG_MR,
        WcOpcode::Recv => wc_opcode::RECV,
        WcOpcode::RecvRdmaWithImm => wc_opcode::RECV_RDMA_WITH_IMM,
    };
    let mut flags = 0;
    if wc.wc_flags.contains(WcFlags::GRH) {
        flags |= wc_flags::GRH;
    }
    // The immediate goes into the CQE as the bytes on the wire; an
    // invalidated key as a number (the kernel copies the word into its
    // union either way).
    let imm = if wc.wc_flags.contains(WcFlags::WITH_IMM) {
        flags |= wc_flags::WITH_IMM;
        U32::from_bytes(wc.imm_data.to_be_bytes())
    } else if wc.wc_flags.contains(WcFlags::WITH_INV) {
        flags |= wc_flags::WITH_INVALIDATE;
        U32::new(wc.imm_data)
    } else {
        U32::new(0)
    };
    let network = match wc.network_hdr {
        Some(NetworkHdr::Ipv4) => network_hdr::IPV4,
        Some(NetworkHdr::Ipv6) => network_hdr::IPV6,
        None => 0,
    };
    if network != 0 {
        flags |= wc_flags::WITH_NETWORK_HDR_TYPE;
    }
    Cqe {
        wr_id: U64::new(wc.wr_id),
        // QP handles are QP numbers.
        qp: U64::new(u64::from(wc.qp_num)),
        opcode: U32::new(opcode),
        status: U32::new(status_code(wc.status)),
        byte_len: U32::new(wc.byte_len),
        imm_data: imm,
        src_qp: U32::new(wc.src_qp),
        wc_flags: U32::new(flags),
        vendor_err: U32::new(wc.vendor_err),
        pkey_index: wc.pkey_index.into(),
        port_num: 1,
        network_hdr_type: network,
        ..Cqe::new_zeroed()
    }
}

/// `pvrdma_wc_status`, which is the verbs numbering.
pub fn status_code(s: WcStatus) -> u32 {
    s as u32
}

/// A ring the device produces into (async events, CQ notifications).
#[derive(Debug)]
pub struct DeviceRing {
    producer: Producer<WrapBit>,
    /// Entries dropped: the ring was full or broken.
    pub dropped: u64,
}

impl DeviceRing {
    /// A ring the device writes from index 0 on.
    pub fn new(ring: Ring) -> Self {
        DeviceRing {
            producer: Producer::new(ring, 0),
            dropped: 0,
        }
    }

    /// Appends `entry`; false (counted) if the ring had no room.
    pub fn push<M, T>(&mut self, mem: &M, entry: &T) -> bool
    where
        M: GuestMemory + ?Sized,
        T: IntoBytes + Immutable,
    {
        let ok = self.producer.push(mem, entry);
        if !ok {
            self.dropped += 1;
        }
        ok
    }
}

/// The element sizes of the device's rings.
pub const EQE_SIZE: u64 = size_of::<abi::Eqe>() as u64;
pub const CQNE_SIZE: u64 = size_of::<abi::Cqne>() as u64;

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryMmap};
    use vrdma_engine::cq::CqSink;
    use vrdma_face::{PageList, guest};
    use zerocopy::FromBytes;

    use super::*;
    use crate::ring;

    fn shared() -> SharedMem {
        SharedMem::new(
            GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x10_0000), 0x4000)]).unwrap(),
        )
    }

    fn sink(mem: &SharedMem, count: u32) -> GuestCq {
        let ring = ring::ring(
            count,
            64,
            0x10_0000 + abi::ring_state::RX,
            PageList::new(vec![0x10_1000]).unwrap(),
        )
        .unwrap();
        GuestCq::new(mem.clone(), ring, cqe).unwrap()
    }

    #[test]
    fn completions_land_in_order_and_a_full_ring_overflows() {
        let mem = shared();
        let mut cq = sink(&mem, 4);
        for i in 0..4 {
            assert!(cq.push(&Wc::new(i, WcStatus::Success, WcOpcode::Send, 17)));
        }
        assert!(
            !cq.push(&Wc::new(4, WcStatus::Success, WcOpcode::Send, 17)),
            "full"
        );
        let m = mem.memory();
        assert_eq!(m.read_obj::<u32>(GuestAddress(0x10_0008)).unwrap(), 4);
        let e: Cqe = guest::read(&*m, 0x10_1000 + 3 * 64).unwrap();
        assert_eq!((e.wr_id.get(), e.qp.get(), e.port_num), (3, 17, 1));
        // The guest consumes two: room for two more, wrapping.
        m.write_obj(2u32, GuestAddress(0x10_000c)).unwrap();
        assert!(cq.push(&Wc::new(5, WcStatus::Success, WcOpcode::Send, 17)));
        let e = Cqe::read_from_bytes(&{
            let mut b = [0u8; 64];
            m.read_slice(&mut b, GuestAddress(0x10_1000)).unwrap();
            b
        })
        .unwrap();
        assert_eq!(e.wr_id.get(), 5);
        // A consumer index the driver could never have written.
        m.write_obj(9u32, GuestAddress(0x10_000c)).unwrap();
        assert!(!cq.push(&Wc::new(6, WcStatus::Success, WcOpcode::Send, 17)));
    }

    #[test]
    fn a_cqe_carries_the_immediate_as_wire_bytes_and_an_invalidated_key_as_a_number() {
        let mut wc = Wc::new(1, WcStatus::Success, WcOpcode::Recv, 20);
        wc.wc_flags = WcFlags::WITH_IMM;
        wc.imm_data = 0x1122_3344;
        let e = cqe(&wc);
        assert_eq!(e.imm_data.to_bytes(), [0x11, 0x22, 0x33, 0x44]);
        assert_eq!(e.wc_flags.get(), wc_flags::WITH_IMM);
        wc.wc_flags = WcFlags::WITH_INV;
        wc.imm_data = 0xabcd;
        let e = cqe(&wc);
        assert_eq!(e.imm_data.get(), 0xabcd);
        assert_eq!(e.wc_flags.get(), wc_flags::WITH_INVALIDATE);
        wc.wc_flags = WcFlags::GRH;
        wc.network_hdr = Some(NetworkHdr::Ipv4);
        let e = cqe(&wc);
        assert_eq!(
            e.wc_flags.get(),
            wc_flags::GRH | wc_flags::WITH_NETWORK_HDR_TYPE
        );
        assert_eq!(e.network_hdr_type, network_hdr::IPV4);
        assert_eq!(e.opcode.get(), wc_opcode::RECV);
    }

    #[test]
    fn a_device_ring_keeps_to_its_capacity() {
        let m = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x10_0000), 0x4000)]).unwrap();
        // 3 data pages of 4-byte entries: 3072, of which 1024 usable.
        let ring = ring::ring(
            3072,
            4,
            0x10_0000 + abi::ring_state::RX,
            PageList::new(vec![0x10_1000, 0x10_2000, 0x10_3000]).unwrap(),
        )
        .unwrap();
        let mut r = DeviceRing::new(ring);
        for i in 0..1024u32 {
            assert!(r.push(&m, &abi::Cqne { info: i.into() }));
        }
        assert!(!r.push(&m, &abi::Cqne { info: 0.into() }));
        assert_eq!(r.dropped, 1);
        assert_eq!(
            m.read_obj::<u32>(GuestAddress(0x10_1000 + 1023 * 4))
                .unwrap(),
            1023
        );
    }
}
