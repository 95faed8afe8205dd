//! A hostile virtio-rdma driver and a hostile network: the device's state
//! (`VirtioRdma`, everything but the virtqueues' transport) on its
//! Ethernet port — the guest NIC's side and the uplink are socket pairs
//! this target holds, so nothing reaches a real network — over 64 pages of
//! guest memory, driven by the input: control requests, pokes into guest
//! memory (doorbell areas, ring headers, WQEs, page lists), device turns,
//! frames from the uplink and the guest's NIC, polling switched on and
//! off, events and notifications taken, the memory map shrunk under the
//! device, resets. The device must never panic nor hang (vm-memory bounds
//! every access to the pages mapped), and every response is a whole
//! response header with a status the spec names.
//!
//! Input: records, each a tag byte then its fields (little-endian):
//! - 0 request: a u16 length (at most 4096), then that many bytes;
//! - 1 poke: a u16 offset into the pages, a length byte, the bytes;
//! - 2 turn (doorbells scanned, the engine's progress);
//! - 3 frame from the uplink, 4 from the guest's NIC: a u16 length, then
//!   that many bytes (at most 9018);
//! - 5 polling: a byte, on when odd;
//! - 6 take every event and notification;
//! - 7 memory: a byte, even: all 64 pages, odd: the first 8 only;
//! - 8 reset.
#![no_main]

mod common;

use std::io::Write;

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vrdma_virtio::abi;

const BASE: u64 = 0x10_0000;
const PAGES: u64 = 64;
const LEN: u64 = PAGES * abi::PAGE_SIZE;

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
}

fuzz_target!(|data: &[u8]| {
    thread_local! {
        static MEM: (GuestMemoryMmap<()>, GuestMemoryMmap<()>) = {
            let full = GuestMemoryMmap::from_ranges(&[(GuestAddress(BASE), LEN as usize)]).unwrap();
            let small = GuestMemoryMmap::from_ranges(&[(GuestAddress(BASE), 8 * 4096)]).unwrap();
            (full, small)
        };
    }
    let (mem, small) = MEM.with(Clone::clone);
    static ZERO: [u8; LEN as usize] = [0; LEN as usize];
    mem.write_slice(&ZERO, GuestAddress(BASE)).unwrap();
    let (mut f, mut guest_nic, mut uplink) = common::eth_virtio();
    f.set_memory(&mem);
    let mut input = Input(data);
    while let Some(tag) = input.u8() {
        match tag % 9 {
            0 => {
                let len = usize::from(input.u16().unwrap_or(0)).min(4096);
                let req = input.bytes(len).to_vec();
                let resp = f.command(&req, 4096);
                let hdr = &resp[..8];
                let status = u16::from_le_bytes([hdr[0], hdr[1]]);
                assert!(status <= abi::status::DEVICE, "status {status}");
                assert!(status == abi::status::OK || resp.len() == 8);
                if common::trace() {
                    eprintln!("request {:02x?}: {:02x?}", &req[..req.len().min(8)], resp);
                }
            }
            1 => {
                let off = u64::from(input.u16().unwrap_or(0)) * 4 % LEN;
                let len = usize::from(input.u8().unwrap_or(0));
                let bytes = input.bytes(len);
                let n = bytes.len().min((LEN - off) as usize);
                mem.write_slice(&bytes[..n], GuestAddress(BASE + off))
                    .unwrap();
            }
            2 => {
                let _ = f.turn(true);
            }
            3 | 4 => {
                let len = usize::from(input.u16().unwrap_or(0)).min(9018);
                let frame = input.bytes(len);
                let to = if tag % 9 == 3 {
                    &mut uplink
                } else {
                    &mut guest_nic
                };
                let _ = to.write_all(&[&(frame.len() as u32).to_be_bytes()[..], frame].concat());
            }
            5 => f.set_polling(input.u8().unwrap_or(0) % 2 == 1),
            6 => {
                while f.next_event().is_some() {}
                while f.next_notification().is_some() {}
            }
            7 => {
                if input.u8().unwrap_or(0) % 2 == 1 {
                    f.set_memory(&small);
                } else {
                    f.set_memory(&mem);
                }
            }
            _ => f.reset(),
        }
    }
    let _ = f.turn(true);
    if common::trace() {
        eprintln!("{:?}", f.stats());
    }
});
