//! The Linux `vmw_pvrdma` driver's control path, modelled: the probe
//! handshake, the shared region (DSR) and its capabilities, commands run
//! and refusals checked, the async-event and CQ-notification rings read,
//! and the objects most tests need (GIDs, PDs, MRs).

use vrdma_pvrdma::abi::{self, PAGE_SIZE, cmd, reg};
use vrdma_wire::Gid;
use zerocopy::{FromBytes, IntoBytes};

use super::vmm::{Guest, UAR_PFN, le32};

impl Guest {
    /// The driver's probe: the shared region, its rings and slots,
    /// DSRLOW/DSRHIGH, then IMR and ACTIVATE. Returns ERR after ACTIVATE.
    pub fn probe(&mut self) -> u32 {
        assert_eq!(self.read32(1, reg::VERSION), abi::VERSION);
        let dsr = self.dsr_template();
        self.load_dsr(&dsr);
        self.write32(1, reg::IMR, 0);
        self.write32(1, reg::CTL, reg::CTL_ACTIVATE);
        self.read32(1, reg::ERR)
    }

    /// Writes `dsr` at `self.dsr` and hands it over (DSRLOW, DSRHIGH);
    /// reads back the capabilities. Returns ERR.
    pub fn load_dsr(&mut self, dsr: &abi::Dsr) -> u32 {
        self.put(self.dsr, dsr.as_bytes());
        self.write32(1, reg::DSRLOW, self.dsr as u32);
        self.write32(1, reg::DSRHIGH, (self.dsr >> 32) as u32);
        let d = abi::Dsr::read_from_bytes(&self.get(self.dsr, 280)).expect("280 bytes");
        self.caps = d.caps;
        self.read32(1, reg::ERR)
    }

    /// A shared region as the driver makes it (in fresh pages, not yet
    /// handed over).
    pub fn dsr_template(&mut self) -> abi::Dsr {
        self.async_head = 0;
        self.cqn_head = 0;
        self.dsr = self.alloc(1);
        self.cmd_slot = self.alloc(1);
        self.resp_slot = self.alloc(1);
        let (apages, apdir) = self.pages(4);
        let (cpages, cpdir) = self.pages(4);
        self.async_ring = apages[0];
        self.cq_ring = cpages[0];
        abi::Dsr {
            driver_version: 20.into(),
            gos_info: 0x46.into(),
            cmd_slot_dma: self.cmd_slot.into(),
            resp_slot_dma: self.resp_slot.into(),
            async_ring_pages: abi::RingPages {
                num_pages: 4.into(),
                reserved: 0.into(),
                pdir_dma: apdir.into(),
            },
            cq_ring_pages: abi::RingPages {
                num_pages: 4.into(),
                reserved: 0.into(),
                pdir_dma: cpdir.into(),
            },
            // BAR2 at an address of the firmware's choosing.
            uar_pfn64: UAR_PFN.into(),
            ..abi::Dsr::default()
        }
    }

    /// Runs a command (`req` is its request structure, the command code in
    /// its header): Ok(response bytes) or Err(ERR). Waits for the response
    /// interrupt when the driver would.
    pub fn command<T: IntoBytes + zerocopy::Immutable>(&mut self, req: &T) -> Result<Vec<u8>, u32> {
        let bytes = req.as_bytes();
        let code = le32(&bytes[8..12]);
        let mut slot = vec![0u8; abi::MAX_REQUEST];
        slot[..bytes.len()].copy_from_slice(bytes);
        self.put(self.cmd_slot, &slot);
        self.write32(1, reg::REQUEST, 0);
        let err = self.read32(1, reg::ERR);
        if err != 0 {
            return Err(err);
        }
        let waits = !matches!(
            code,
            cmd::DESTROY_PD
                | cmd::DESTROY_MR
                | cmd::DESTROY_CQ
                | cmd::DESTROY_QP
                | cmd::DESTROY_UC
                | cmd::CREATE_BIND
                | cmd::DESTROY_BIND
                | cmd::MODIFY_SRQ
                | cmd::DESTROY_SRQ
        );
        if waits {
            assert!(self.wait_irq(0), "no response interrupt for command {code}");
            let resp = self.get(self.resp_slot, abi::MAX_RESPONSE);
            let ack = le32(&resp[8..12]);
            assert_eq!(ack, cmd::ACK | code, "ack");
            Ok(resp)
        } else {
            Ok(Vec::new())
        }
    }

    /// Runs a command the device must refuse: returns ERR, after checking
    /// that the response header answers this command with ERR's low byte
    /// as its `err` (what QEMU's PVRDMA and the driver read) and that no
    /// response interrupt came (the driver does not wait for a refused
    /// command).
    pub fn refused<T: IntoBytes + zerocopy::Immutable>(&mut self, req: &T) -> u32 {
        let code = le32(&req.as_bytes()[8..12]);
        self.put(self.resp_slot, &[0u8; 16]);
        let err = match self.command(req) {
            Ok(_) => panic!("command {code} was accepted"),
            Err(e) => e,
        };
        let h = abi::RespHdr::read_from_bytes(&self.get(self.resp_slot, 16)).expect("16 bytes");
        assert_eq!(h.ack.get(), cmd::ACK | code, "the refusal's ack");
        assert_eq!(h.response.get(), 0x1234, "the refusal's response key");
        assert!(
            !self.irq_fired(0),
            "a response interrupt for a refused command"
        );
        assert_eq!(h.err, err as u8, "the header's err: ERR's low byte");
        err
    }

    /// The async events the device wrote since the last call.
    pub fn events(&mut self) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        loop {
            let tail = self.get32(self.async_ring + 8);
            if tail == self.async_head {
                return out;
            }
            let slot = (self.async_head & 1535) as u64;
            let e = self.get(self.async_ring + PAGE_SIZE + slot * 8, 8);
            out.push((le32(&e[0..4]), le32(&e[4..8])));
            self.async_head = (self.async_head + 1) & (2 * 1536 - 1);
            self.put32(self.async_ring + 12, self.async_head);
        }
    }

    /// The CQ notifications the device wrote since the last call.
    pub fn notifications(&mut self) -> Vec<u32> {
        let mut out = Vec::new();
        loop {
            let tail = self.get32(self.cq_ring + 8);
            if tail == self.cqn_head {
                return out;
            }
            let slot = (self.cqn_head & 3071) as u64;
            out.push(self.get32(self.cq_ring + PAGE_SIZE + slot * 4));
            self.cqn_head = (self.cqn_head + 1) & (2 * 3072 - 1);
            self.put32(self.cq_ring + 12, self.cqn_head);
        }
    }

    /// Binds `gid` at `index` (RoCEv2).
    pub fn bind_gid(&mut self, index: u32, gid: Gid) {
        let req = abi::CreateBind {
            hdr: hdr(cmd::CREATE_BIND),
            mtu: 1024.into(),
            vlan: 0xfff.into(),
            index: index.into(),
            new_gid: gid.0,
            gid_type: abi::GID_TYPE_ROCE_V2,
            reserved: [0; 3],
        };
        self.command(&req).expect("CREATE_BIND");
    }

    pub fn create_pd(&mut self, ctx: u32) -> u32 {
        let r = self
            .command(&abi::Handle {
                hdr: hdr(cmd::CREATE_PD),
                handle: ctx.into(),
                reserved: [0; 4],
            })
            .expect("CREATE_PD");
        le32(&r[16..20])
    }

    /// A DMA MR of `pd` (the kernel's local_dma_lkey): (handle, lkey).
    pub fn dma_mr(&mut self, pd: u32) -> (u32, u32) {
        let r = self
            .command(&abi::CreateMr {
                hdr: hdr(cmd::CREATE_MR),
                pd_handle: pd.into(),
                access_flags: 1.into(),
                flags: abi::MR_FLAG_DMA.into(),
                ..abi::CreateMr::default()
            })
            .expect("CREATE_MR (DMA)");
        let resp = abi::CreateMrResp::read_from_bytes(&r[..32]).expect("32 bytes");
        (resp.mr_handle.get(), resp.lkey.get())
    }

    /// A user MR over `pages` at virtual address `va` (page-aligned here):
    /// (handle, lkey, rkey).
    pub fn user_mr(&mut self, pd: u32, va: u64, pages: &[u64], access: u32) -> (u32, u32, u32) {
        let dir = self.pdir(pages);
        let r = self
            .command(&abi::CreateMr {
                hdr: hdr(cmd::CREATE_MR),
                start: va.into(),
                length: (pages.len() as u64 * PAGE_SIZE).into(),
                pdir_dma: dir.into(),
                pd_handle: pd.into(),
                access_flags: access.into(),
                flags: 0.into(),
                nchunks: (pages.len() as u32).into(),
            })
            .expect("CREATE_MR");
        let resp = abi::CreateMrResp::read_from_bytes(&r[..32]).expect("32 bytes");
        (resp.mr_handle.get(), resp.lkey.get(), resp.rkey.get())
    }
}

/// A request header.
pub fn hdr(code: u32) -> abi::CmdHdr {
    abi::CmdHdr {
        response: 0x1234.into(),
        cmd: code.into(),
        reserved: 0.into(),
    }
}
