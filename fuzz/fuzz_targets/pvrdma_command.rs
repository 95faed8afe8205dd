//! A hostile PVRDMA driver and a hostile network: a whole function
//! (`Pvrdma`) on its Ethernet port — the guest NIC's side and the uplink
//! are socket pairs this target holds, so nothing reaches a real network
//! and what the device sends to its own addresses loops back into it —
//! behind its registers, over 32 pages of guest memory, activated with a
//! good shared region, then driven by the input: commands through the
//! command slot, pokes into the free pages (page directories, rings,
//! WQEs), doorbells, register writes (a new shared region, CTL, IMR),
//! frames from the uplink and from the guest's NIC, and rounds of the
//! device at a simulated clock. The device must never panic nor hang (it
//! reaches memory only through vm-memory, which bounds every access to the
//! 32 pages).
//!
//! Input: records, each a tag byte then its fields (little-endian):
//! - 0 command: a length byte, then that many bytes (at most 184) of the
//!   request, zero-padded; REQUEST is written.
//! - 1 poke: a u16 offset into the free pages, a length byte, the bytes.
//! - 2 doorbell: a u16 doorbell page, a byte choosing the offset (QP, CQ,
//!   SRQ, other), a u32 value.
//! - 3 round: a byte of milliseconds the clock moves on, then a round.
//! - 4 register: a byte choosing the register, a u32 value.
//! - 5 frame from the uplink: a u16 length, then that many bytes (at most
//!   9018), sent as one stream frame; the device takes it in its next
//!   round (RoCEv2 for an address the guest bound goes to the engine).
//! - 6 frame from the guest's NIC: the same, checked against the guest's
//!   MAC and addresses before it may leave on the uplink.
#![no_main]

mod common;

use std::io::Write;

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vrdma_pvrdma::{
    Pvrdma,
    abi::{self, PAGE_SIZE, reg},
};
use vrdma_vfio_user::{Bus, Function, irq::Irqs};
use zerocopy::IntoBytes;

/// Guest memory: 32 pages.
const BASE: u64 = 0x10_0000;
const PAGES: u64 = 32;
/// Fixed layout: the shared region, the slots, the two device rings
/// (directory, table, state page, one data page each).
const DSR: u64 = BASE;
const CMD: u64 = BASE + PAGE_SIZE;
const RESP: u64 = BASE + 2 * PAGE_SIZE;
const ASYNC_DIR: u64 = BASE + 3 * PAGE_SIZE;
const CQN_DIR: u64 = BASE + 7 * PAGE_SIZE;
/// Pages 11 to 31 are the input's.
const FREE: u64 = BASE + 11 * PAGE_SIZE;
const FREE_LEN: u64 = (PAGES - 11) * PAGE_SIZE;

fn device_ring(mem: &GuestMemoryMmap<()>, dir: u64) {
    let table = dir + PAGE_SIZE;
    mem.write_obj(table.to_le(), GuestAddress(dir)).unwrap();
    for i in 0..2u64 {
        let page = table + (1 + i) * PAGE_SIZE;
        mem.write_obj(page.to_le(), GuestAddress(table + 8 * i))
            .unwrap();
    }
}

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn bytes(&mut self, n: usize) -> &[u8] {
        let (a, b) = self.0.split_at(n.min(self.0.len()));
        self.0 = b;
        a
    }

    fn u8(&mut self) -> Option<u8> {
        self.bytes(1).first().copied()
    }

    fn u16(&mut self) -> Option<u16> {
        let b = self.bytes(2);
        (b.len() == 2).then(|| u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Option<u32> {
        let b = self.bytes(4);
        b.try_into().ok().map(u32::from_le_bytes)
    }
}

fuzz_target!(|data: &[u8]| {
    // The same pages each run (faulting fresh ones in costs more than
    // zeroing them).
    thread_local! {
        static MEM: GuestMemoryMmap<()> =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(BASE), (PAGES * PAGE_SIZE) as usize)])
                .unwrap();
    }
    let mem = MEM.with(Clone::clone);
    static ZERO: [u8; (PAGES * PAGE_SIZE) as usize] = [0; (PAGES * PAGE_SIZE) as usize];
    mem.write_slice(&ZERO, GuestAddress(BASE)).unwrap();
    let mut irqs = Irqs::new(&[0, 0, abi::intr::VECTORS]);
    let (mut f, mut guest_nic, mut uplink) = common::eth_function();
    let mut bus = Bus {
        mem: &mem,
        irqs: &mut irqs,
    };
    f.memory_changed(&mut bus);

    // The probe.
    device_ring(&mem, ASYNC_DIR);
    device_ring(&mem, CQN_DIR);
    let ring = |dir: u64| abi::RingPages {
        num_pages: 2.into(),
        reserved: 0.into(),
        pdir_dma: dir.into(),
    };
    let dsr = abi::Dsr {
        driver_version: abi::VERSION.into(),
        cmd_slot_dma: CMD.into(),
        resp_slot_dma: RESP.into(),
        async_ring_pages: ring(ASYNC_DIR),
        cq_ring_pages: ring(CQN_DIR),
        uar_pfn64: 0xfe000.into(),
        ..abi::Dsr::default()
    };
    mem.write_slice(dsr.as_bytes(), GuestAddress(DSR)).unwrap();
    let write =
        |f: &mut Pvrdma<vrdma_fabric::eth::EthPort>, bus: &mut Bus<'_>, region, off, v: u32| {
            let _ = f.region_write(bus, region, off, &v.to_le_bytes());
        };
    write(&mut f, &mut bus, 1, reg::DSRLOW, DSR as u32);
    write(&mut f, &mut bus, 1, reg::DSRHIGH, 0);
    write(&mut f, &mut bus, 1, reg::IMR, 0);
    write(&mut f, &mut bus, 1, reg::CTL, reg::CTL_ACTIVATE);
    assert!(f.is_active());

    let mut now = 0u64;
    let mut input = Input(data);
    while let Some(tag) = input.u8() {
        match tag % 7 {
            0 => {
                let len = usize::from(input.u8().unwrap_or(0)).min(abi::MAX_REQUEST);
                let mut slot = [0u8; abi::MAX_REQUEST];
                let req = input.bytes(len);
                slot[..req.len()].copy_from_slice(req);
                mem.write_slice(&slot, GuestAddress(CMD)).unwrap();
                write(&mut f, &mut bus, 1, reg::REQUEST, 0);
                if common::trace() {
                    let mut r = [0u8; 4];
                    let _ = f.region_read(&mut bus, 1, reg::ERR, &mut r);
                    let mut resp = [0u8; 24];
                    let _ = mem.read_slice(&mut resp, GuestAddress(RESP));
                    eprintln!(
                        "command {}: ERR {} response {:02x?}",
                        u32::from_le_bytes(slot[8..12].try_into().unwrap()),
                        u32::from_le_bytes(r),
                        &resp[8..24]
                    );
                }
            }
            1 => {
                let off = u64::from(input.u16().unwrap_or(0)) % FREE_LEN;
                let len = usize::from(input.u8().unwrap_or(0));
                let bytes = input.bytes(len);
                let n = bytes.len().min((FREE_LEN - off) as usize);
                mem.write_slice(&bytes[..n], GuestAddress(FREE + off))
                    .unwrap();
            }
            2 => {
                let page = u64::from(input.u16().unwrap_or(0)) % u64::from(f.uar_pages());
                let off = match input.u8().unwrap_or(0) % 4 {
                    0 => abi::uar::QP_OFFSET,
                    1 => abi::uar::CQ_OFFSET,
                    2 => abi::uar::SRQ_OFFSET,
                    _ => 12,
                };
                let v = input.u32().unwrap_or(0);
                write(&mut f, &mut bus, 2, page * PAGE_SIZE + off, v);
            }
            3 => {
                now += u64::from(input.u8().unwrap_or(0)) * 1_000_000;
                let _ = f.device_mut().progress_at(now);
                f.deliver(&mut bus);
            }
            4 => {
                let off = match input.u8().unwrap_or(0) % 8 {
                    0 => reg::DSRLOW,
                    1 => reg::DSRHIGH,
                    2 => reg::CTL,
                    3 => reg::IMR,
                    4 => reg::REQUEST,
                    5 => reg::ICR,
                    6 => reg::ERR,
                    _ => reg::VERSION,
                };
                let v = input.u32().unwrap_or(0);
                write(&mut f, &mut bus, 1, off, v);
                let mut r = [0u8; 4];
                let _ = f.region_read(&mut bus, 1, reg::ERR, &mut r);
            }
            _ => {
                let len = usize::from(input.u16().unwrap_or(0)).min(9018);
                let frame = input.bytes(len);
                let to = if tag % 7 == 5 {
                    &mut uplink
                } else {
                    &mut guest_nic
                };
                // A full socket loses the frame, as a wire would.
                let _ = to.write_all(&[&(frame.len() as u32).to_be_bytes()[..], frame].concat());
            }
        }
    }
    // A last round with every timer due.
    let _ = f.device_mut().progress_at(now + 60_000_000_000);
    f.deliver(&mut bus);
    if common::trace() {
        eprintln!("{:?}", f.stats());
    }
});
