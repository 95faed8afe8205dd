//! A hostile guest and VMM against the virtio-pci transport of the
//! virtio-rdma device (`vrdma_virtio::pci::VirtioPci`, docs/virtio-rdma.md
//! §13.3): config-space reads and writes (the PCI configuration access
//! window among them), BAR reads and writes of any width at any offset
//! inside the regions (common configuration, ISR, device configuration,
//! notify addresses), pokes into 16 pages of guest memory (virtqueues,
//! requests, doorbell areas), device turns, the memory map replaced or
//! gone (bus mastering off), function resets, a client gone, a failure.
//! The device runs on a transport that sends nothing. Nothing may panic
//! or hang, and the features the device accepted are always ones it
//! offered, VERSION_1 among them.
//!
//! Input: records, each a tag byte then its fields (little-endian):
//! - 0 config read, 1 config write: an offset byte, a width byte (1, 2 or
//!   4), and for a write that many bytes;
//! - 2 BAR read, 3 BAR write: a region byte (0 or 2), a u16 offset, a
//!   width byte (1, 2, 4 or 8), and for a write that many bytes;
//! - 4 poke: a u16 offset into the pages, a length byte, the bytes;
//! - 5 turn;
//! - 6 memory: a byte, 0: all 16 pages, 1: the first 2, 2: none;
//! - 7 function reset, 8 client gone, 9 failure.
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vrdma_engine::attr::PortAttr;
use vrdma_face::vfio::Served;
use vrdma_vfio_user::{Bus, Function, irq::Irqs};
use vrdma_virtio::{
    abi::feature,
    face::{Options, VirtioRdma},
    pci::{BAR0_SIZE, BAR2_SIZE, VECTORS, VirtioPci},
};

const LEN: u64 = 16 * 4096;

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn bytes(&mut self, n: usize) -> &[u8] {
        let (a, b) = self.0.split_at(n.min(self.0.len()));
        self.0 = b;
        a
    }

    fn u8(&mut self) -> u8 {
        self.bytes(1).first().copied().unwrap_or(0)
    }

    fn u16(&mut self) -> u16 {
        let b = self.bytes(2);
        if b.len() == 2 {
            u16::from_le_bytes([b[0], b[1]])
        } else {
            0
        }
    }
}

fuzz_target!(|data: &[u8]| {
    thread_local! {
        static MEM: [GuestMemoryMmap<()>; 3] = [
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), LEN as usize)]).unwrap(),
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 * 4096)]).unwrap(),
            GuestMemoryMmap::default(),
        ];
    }
    let mems = MEM.with(Clone::clone);
    static ZERO: [u8; LEN as usize] = [0; LEN as usize];
    mems[0].write_slice(&ZERO, GuestAddress(0)).unwrap();
    let face = VirtioRdma::new(
        Options::default(),
        PortAttr::with_gids(&[]),
        common::Null::new(),
    );
    let mut f = VirtioPci::new(face, std::time::Duration::ZERO);
    let mut irqs = Irqs::new(&[0, 0, VECTORS]);
    let mut mem = 0usize;
    f.memory_changed(&mut Bus {
        mem: &mems[mem],
        irqs: &mut irqs,
    });
    let mut input = Input(data);
    while !input.0.is_empty() {
        let tag = input.u8();
        let mut bus = Bus {
            mem: &mems[mem],
            irqs: &mut irqs,
        };
        match tag % 10 {
            t @ (0 | 1) => {
                let off = u64::from(input.u8());
                let w = [1, 2, 4][usize::from(input.u8() % 3)];
                if off + w as u64 > 256 {
                    continue;
                }
                if t == 0 {
                    let mut b = [0u8; 4];
                    f.config_read(&mut bus, off, &mut b[..w]);
                } else {
                    let b = input.bytes(w).to_vec();
                    f.config_write(&mut bus, off, &b);
                    f.config_written(&mut bus);
                }
            }
            t @ (2 | 3) => {
                let region = if input.u8() % 2 == 0 { 0 } else { 2 };
                let size = if region == 0 { BAR0_SIZE } else { BAR2_SIZE };
                let off = u64::from(input.u16());
                let w = [1, 2, 4, 8][usize::from(input.u8() % 4)];
                if off + w as u64 > size {
                    continue;
                }
                if t == 2 {
                    let mut b = [0u8; 8];
                    let _ = f.region_read(&mut bus, region, off, &mut b[..w]);
                } else {
                    let b = input.bytes(w).to_vec();
                    let _ = f.region_write(&mut bus, region, off, &b);
                }
            }
            4 => {
                let off = u64::from(input.u16()) % LEN;
                let len = usize::from(input.u8());
                let b = input.bytes(len);
                let n = b.len().min((LEN - off) as usize);
                mems[0].write_slice(&b[..n], GuestAddress(off)).unwrap();
            }
            5 => {
                let _ = f.progress(&mut bus);
            }
            6 => {
                mem = usize::from(input.u8() % 3);
                f.memory_changed(&mut Bus {
                    mem: &mems[mem],
                    irqs: &mut irqs,
                });
            }
            7 => f.reset(&mut bus),
            8 => f.client_gone(),
            _ => f.fail(&mut bus),
        }
        let acked = f.acked();
        assert!(acked == 0 || acked & feature::VERSION_1 != 0);
        let offered = feature::VERSION_1
            | feature::RING_INDIRECT_DESC
            | feature::RING_EVENT_IDX
            | feature::STATS
            | feature::DOORBELL_POLL;
        assert_eq!(
            acked & !offered,
            0,
            "features accepted that were not offered"
        );
    }
    let mut bus = Bus {
        mem: &mems[mem],
        irqs: &mut irqs,
    };
    let _ = f.progress(&mut bus);
});
