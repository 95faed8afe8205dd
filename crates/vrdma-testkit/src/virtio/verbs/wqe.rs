//! Work requests as the ABI lays them out: SGEs, receive WQEs, send WQEs
//! of every opcode built field by field ([`Wqe`]), address vectors.

use vrdma_virtio::abi::{self, wr};
use vrdma_wire::Gid;
use zerocopy::IntoBytes;

/// An SGE.
pub fn sge(addr: u64, length: u32, lkey: u32) -> abi::Sge {
    abi::Sge {
        addr: addr.into(),
        length: length.into(),
        lkey: lkey.into(),
    }
}

/// A receive WQE's bytes.
pub fn recv_wqe(wr_id: u64, sges: &[abi::Sge]) -> Vec<u8> {
    let h = abi::RecvWqeHdr {
        wr_id: wr_id.into(),
        count: u16::try_from(sges.len()).expect("SGEs").into(),
        reserved: [0; 6],
    };
    let mut b = h.as_bytes().to_vec();
    for s in sges {
        b.extend_from_slice(s.as_bytes());
    }
    b
}

/// A send WQE, built field by field from the ABI's layouts.
#[derive(Clone, Debug)]
pub struct Wqe {
    pub wr_id: u64,
    pub opcode: u8,
    pub flags: u8,
    pub ex: u32,
    pub op: [u8; 48],
    pub sges: Vec<abi::Sge>,
    pub inline: Option<Vec<u8>>,
    /// A `count` other than the SGEs' or inline bytes' (hostile WQEs).
    pub count: Option<u16>,
}

impl Wqe {
    /// A signaled WQE of `opcode` with nothing else.
    pub fn new(opcode: u8, wr_id: u64) -> Self {
        Wqe {
            wr_id,
            opcode,
            flags: wr::SIGNALED,
            ex: 0,
            op: [0; 48],
            sges: Vec::new(),
            inline: None,
            count: None,
        }
    }

    pub fn send(wr_id: u64, sges: &[abi::Sge]) -> Self {
        Wqe {
            sges: sges.to_vec(),
            ..Self::new(wr::SEND, wr_id)
        }
    }

    fn rdma(mut self, remote: u64, rkey: u32) -> Self {
        let r = abi::WqeRdma {
            remote_addr: remote.into(),
            rkey: rkey.into(),
            reserved: [0; 36],
        };
        self.op.copy_from_slice(r.as_bytes());
        self
    }

    pub fn write(wr_id: u64, sges: &[abi::Sge], remote: u64, rkey: u32) -> Self {
        Wqe {
            sges: sges.to_vec(),
            ..Self::new(wr::RDMA_WRITE, wr_id)
        }
        .rdma(remote, rkey)
    }

    pub fn write_imm(wr_id: u64, sges: &[abi::Sge], remote: u64, rkey: u32, imm: u32) -> Self {
        Wqe {
            sges: sges.to_vec(),
            ex: imm,
            ..Self::new(wr::RDMA_WRITE_WITH_IMM, wr_id)
        }
        .rdma(remote, rkey)
    }

    pub fn read(wr_id: u64, sges: &[abi::Sge], remote: u64, rkey: u32) -> Self {
        Wqe {
            sges: sges.to_vec(),
            ..Self::new(wr::RDMA_READ, wr_id)
        }
        .rdma(remote, rkey)
    }

    fn atomic(
        opcode: u8,
        wr_id: u64,
        s: abi::Sge,
        remote: u64,
        rkey: u32,
        ca: u64,
        swap: u64,
    ) -> Self {
        let mut w = Wqe {
            sges: vec![s],
            ..Self::new(opcode, wr_id)
        };
        let a = abi::WqeAtomic {
            remote_addr: remote.into(),
            compare_add: ca.into(),
            swap: swap.into(),
            rkey: rkey.into(),
            reserved: [0; 20],
        };
        w.op.copy_from_slice(a.as_bytes());
        w
    }

    pub fn cmp_swap(
        wr_id: u64,
        s: abi::Sge,
        remote: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    ) -> Self {
        Self::atomic(
            wr::ATOMIC_CMP_AND_SWP,
            wr_id,
            s,
            remote,
            rkey,
            compare,
            swap,
        )
    }

    pub fn fetch_add(wr_id: u64, s: abi::Sge, remote: u64, rkey: u32, add: u64) -> Self {
        Self::atomic(wr::ATOMIC_FETCH_AND_ADD, wr_id, s, remote, rkey, add, 0)
    }

    pub fn local_inv(wr_id: u64, key: u32) -> Self {
        Wqe {
            ex: key,
            ..Self::new(wr::LOCAL_INV, wr_id)
        }
    }

    pub fn send_inv(wr_id: u64, sges: &[abi::Sge], rkey: u32) -> Self {
        Wqe {
            sges: sges.to_vec(),
            ex: rkey,
            ..Self::new(wr::SEND_WITH_INV, wr_id)
        }
    }

    /// A fast registration of `key` over the `npages` page addresses at
    /// GPA `page_list`.
    #[allow(clippy::too_many_arguments)]
    pub fn reg_mr(
        wr_id: u64,
        key: u32,
        iova: u64,
        length: u64,
        page_list: u64,
        npages: u32,
        page_shift: u8,
        access: u32,
    ) -> Self {
        let mut w = Self::new(wr::REG_MR, wr_id);
        let r = abi::WqeRegMr {
            iova: iova.into(),
            length: length.into(),
            page_list: page_list.into(),
            key: key.into(),
            access: access.into(),
            npages: npages.into(),
            page_shift,
            reserved: [0; 11],
        };
        w.op.copy_from_slice(r.as_bytes());
        w
    }

    pub fn bind_mw(wr_id: u64, mw: u32, mr: u32, addr: u64, length: u64, access: u32) -> Self {
        let mut w = Self::new(wr::BIND_MW, wr_id);
        let b = abi::WqeBindMw {
            addr: addr.into(),
            length: length.into(),
            mw: mw.into(),
            mr: mr.into(),
            access: access.into(),
            reserved: [0; 20],
        };
        w.op.copy_from_slice(b.as_bytes());
        w
    }

    /// The UD part: where the datagram goes.
    pub fn ud(mut self, av: abi::Av, qpn: u32, qkey: u32) -> Self {
        let u = abi::WqeUd {
            av,
            remote_qpn: qpn.into(),
            remote_qkey: qkey.into(),
            reserved: [0; 8],
        };
        self.op.copy_from_slice(u.as_bytes());
        self
    }

    pub fn imm(mut self, imm: u32) -> Self {
        if self.opcode == wr::SEND {
            self.opcode = wr::SEND_WITH_IMM;
        }
        self.ex = imm;
        self
    }

    /// The data inline instead of SGEs.
    pub fn inline(mut self, data: &[u8]) -> Self {
        self.sges.clear();
        self.inline = Some(data.to_vec());
        self.flags |= wr::INLINE;
        self
    }

    pub fn flags(mut self, f: u8) -> Self {
        self.flags = f;
        self
    }

    pub fn unsignaled(mut self) -> Self {
        self.flags &= !wr::SIGNALED;
        self
    }

    /// The WQE's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let count = match (&self.inline, self.count) {
            (_, Some(c)) => c,
            (Some(d), None) => u16::try_from(d.len()).expect("inline bytes"),
            (None, None) => u16::try_from(self.sges.len()).expect("SGEs"),
        };
        let h = abi::SendWqeHdr {
            wr_id: self.wr_id.into(),
            opcode: self.opcode,
            flags: self.flags,
            count: count.into(),
            ex: self.ex.into(),
            op: self.op,
        };
        let mut b = h.as_bytes().to_vec();
        match &self.inline {
            Some(d) => b.extend_from_slice(d),
            None => {
                for s in &self.sges {
                    b.extend_from_slice(s.as_bytes());
                }
            }
        }
        b
    }
}

/// An address vector to `dgid` from GID index 0.
pub fn av(dgid: Gid) -> abi::Av {
    abi::Av {
        dgid: dgid.0,
        flow_label: 0.into(),
        sgid_index: 0,
        hop_limit: 64,
        traffic_class: 0,
        sl: 0,
        dmac: [2, 0, 0, 0, 0, 1],
        reserved: 0.into(),
    }
}
