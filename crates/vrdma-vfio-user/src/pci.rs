//! A PCI function's configuration space (conventional, 256 bytes): the
//! type 0 header and a capability list, with the bits a guest may write
//! and those it clears by writing 1. QEMU's client emulates the BARs, the
//! ROM BAR, the capability pointers and MSI-X on its side, and sends every
//! config write here first "to filter": what reaches the guest of this
//! space is its identity, the BARs' type bits, the Command register (the
//! function sees Memory Space and Bus Master through it) and the
//! capabilities' layout.

/// Config space bytes.
pub const SIZE: usize = 256;

/// Header offsets.
pub mod off {
    pub const VENDOR: usize = 0x00;
    pub const DEVICE: usize = 0x02;
    pub const COMMAND: usize = 0x04;
    pub const STATUS: usize = 0x06;
    pub const REVISION: usize = 0x08;
    pub const CLASS: usize = 0x09;
    pub const CACHE_LINE: usize = 0x0c;
    pub const LATENCY: usize = 0x0d;
    pub const HEADER_TYPE: usize = 0x0e;
    pub const BAR0: usize = 0x10;
    pub const SUBSYSTEM_VENDOR: usize = 0x2c;
    pub const SUBSYSTEM: usize = 0x2e;
    pub const ROM: usize = 0x30;
    pub const CAP_PTR: usize = 0x34;
    pub const INTERRUPT_LINE: usize = 0x3c;
    pub const INTERRUPT_PIN: usize = 0x3d;
}

/// Command register bits.
pub mod command {
    pub const IO: u16 = 1 << 0;
    pub const MEMORY: u16 = 1 << 1;
    pub const BUS_MASTER: u16 = 1 << 2;
    pub const PARITY: u16 = 1 << 6;
    pub const SERR: u16 = 1 << 8;
    pub const INTX_DISABLE: u16 = 1 << 10;
}

/// Status register: the capability list bit, and the error bits a write
/// of 1 clears.
const STATUS_CAP_LIST: u16 = 1 << 4;
const STATUS_W1C: u16 = 0xf900;

/// Capability ids.
pub const CAP_VENDOR: u8 = 0x09;
pub const CAP_MSIX: u8 = 0x11;

/// What a BAR is.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Bar {
    /// Not implemented.
    None,
    /// 32-bit memory, not prefetchable.
    Mem32,
    /// 64-bit memory (takes this BAR and the next).
    Mem64 { prefetchable: bool },
}

/// A configuration space with its write masks.
#[derive(Clone, Debug)]
pub struct ConfigSpace {
    bytes: [u8; SIZE],
    /// Bits the guest may change.
    writable: [u8; SIZE],
    /// Bits a write of 1 clears.
    w1c: [u8; SIZE],
    /// Where the next capability goes, and the previous one's next
    /// pointer.
    next_cap: usize,
    last_link: usize,
    /// Capability fields the guest writes, zeroed by a reset.
    cleared_on_reset: Vec<(usize, usize)>,
}

impl ConfigSpace {
    /// A type 0 header: identity, no interrupt pin (MSI-X only), no ROM.
    pub fn new(vendor: u16, device: u16, class: u32, revision: u8) -> Self {
        let mut c = ConfigSpace {
            bytes: [0; SIZE],
            writable: [0; SIZE],
            w1c: [0; SIZE],
            next_cap: 0x40,
            last_link: off::CAP_PTR,
            cleared_on_reset: Vec::new(),
        };
        c.put16(off::VENDOR, vendor);
        c.put16(off::DEVICE, device);
        c.bytes[off::REVISION] = revision;
        c.bytes[off::CLASS..off::CLASS + 3].copy_from_slice(&class.to_le_bytes()[..3]);
        c.put16(off::SUBSYSTEM_VENDOR, vendor);
        c.put16(off::SUBSYSTEM, device);
        c.mask16(
            off::COMMAND,
            command::IO
                | command::MEMORY
                | command::BUS_MASTER
                | command::PARITY
                | command::SERR
                | command::INTX_DISABLE,
        );
        c.w1c[off::STATUS..off::STATUS + 2].copy_from_slice(&STATUS_W1C.to_le_bytes());
        c.writable[off::CACHE_LINE] = 0xff;
        c.writable[off::LATENCY] = 0xff;
        c.writable[off::INTERRUPT_LINE] = 0xff;
        c
    }

    fn put16(&mut self, at: usize, v: u16) {
        self.bytes[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }

    fn put32(&mut self, at: usize, v: u32) {
        self.bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    fn mask16(&mut self, at: usize, v: u16) {
        self.writable[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }

    fn get16(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.bytes[at], self.bytes[at + 1]])
    }

    /// Sets BAR `i`'s type bits (its address bits are QEMU's to emulate).
    pub fn set_bar(&mut self, i: usize, bar: Bar) {
        assert!(i < 6, "BAR index");
        let at = off::BAR0 + 4 * i;
        let bits = match bar {
            Bar::None => 0,
            Bar::Mem32 => 0,
            Bar::Mem64 { prefetchable } => 0b100 | if prefetchable { 0b1000 } else { 0 },
        };
        self.put32(at, bits);
    }

    /// Appends an MSI-X capability: `vectors` entries, the table at
    /// `table_offset` of BAR `table_bar`, the pending bits at `pba_offset`
    /// of BAR `pba_bar`. Returns its offset.
    pub fn add_msix(
        &mut self,
        vectors: u16,
        table_bar: u8,
        table_offset: u32,
        pba_bar: u8,
        pba_offset: u32,
    ) -> usize {
        assert!((1..=2048).contains(&vectors), "MSI-X vectors");
        assert!(table_bar < 6 && pba_bar < 6, "MSI-X BARs");
        assert!(
            table_offset.is_multiple_of(8) && pba_offset.is_multiple_of(8),
            "MSI-X alignment"
        );
        let at = self.add_cap(CAP_MSIX, 12);
        self.put16(at + 2, vectors - 1);
        // Enable and Function Mask.
        self.mask16(at + 2, 0xc000);
        self.put32(at + 4, table_offset | u32::from(table_bar));
        self.put32(at + 8, pba_offset | u32::from(pba_bar));
        at
    }

    /// Appends a vendor-specific capability whose bytes after its id and
    /// next pointer are `body` (by convention its first byte is the
    /// capability's length, id and pointer included). Returns its offset.
    pub fn add_vendor(&mut self, body: &[u8]) -> usize {
        let at = self.add_cap(CAP_VENDOR, 2 + body.len());
        self.bytes[at + 2..at + 2 + body.len()].copy_from_slice(body);
        at
    }

    /// Lets the guest write `len` bytes at `at` (a capability's fields
    /// that are the driver's to set); a reset zeroes them.
    pub fn make_writable(&mut self, at: usize, len: usize) {
        assert!(at + len <= SIZE, "writable bytes past config space");
        self.writable[at..at + len].fill(0xff);
        self.cleared_on_reset.push((at, len));
    }

    fn add_cap(&mut self, id: u8, len: usize) -> usize {
        let at = self.next_cap;
        assert!(at + len <= SIZE, "capabilities overflow config space");
        self.bytes[at] = id;
        self.bytes[at + 1] = 0;
        self.bytes[self.last_link] = at as u8;
        self.last_link = at + 1;
        self.next_cap = (at + len + 3) & !3;
        let status = self.get16(off::STATUS) | STATUS_CAP_LIST;
        self.put16(off::STATUS, status);
        at
    }

    /// Reads `data.len()` bytes at `offset`; false (nothing read) past the
    /// end.
    pub fn read(&self, offset: u64, data: &mut [u8]) -> bool {
        let Some(range) = range(offset, data.len()) else {
            return false;
        };
        data.copy_from_slice(&self.bytes[range]);
        true
    }

    /// Writes `data` at `offset` through the masks; false (nothing
    /// written) past the end.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> bool {
        let Some(range) = range(offset, data.len()) else {
            return false;
        };
        for (i, &v) in range.zip(data) {
            let keep = self.bytes[i] & !self.writable[i];
            let set = v & self.writable[i];
            let cleared = v & self.w1c[i];
            self.bytes[i] = (keep | set) & !cleared;
        }
        true
    }

    /// The Command register.
    pub fn command(&self) -> u16 {
        self.get16(off::COMMAND)
    }

    /// Bus Master Enable: the function may read and write memory.
    pub fn bus_master(&self) -> bool {
        self.command() & command::BUS_MASTER != 0
    }

    /// Back to the state after power-up (the Command register cleared; the
    /// layout stays).
    pub fn reset(&mut self) {
        self.put16(off::COMMAND, 0);
        let status = self.get16(off::STATUS) & !STATUS_W1C;
        self.put16(off::STATUS, status);
        self.bytes[off::CACHE_LINE] = 0;
        self.bytes[off::LATENCY] = 0;
        self.bytes[off::INTERRUPT_LINE] = 0;
        for &(at, len) in &self.cleared_on_reset {
            self.bytes[at..at + len].fill(0);
        }
        let mut at = self.bytes[off::CAP_PTR] as usize;
        while at != 0 {
            if self.bytes[at] == CAP_MSIX {
                let ctl = self.get16(at + 2) & 0x07ff;
                self.put16(at + 2, ctl);
            }
            at = self.bytes[at + 1] as usize;
        }
    }
}

fn range(offset: u64, len: usize) -> Option<std::ops::Range<usize>> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(len)?;
    (end <= SIZE && len > 0).then_some(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space() -> ConfigSpace {
        let mut c = ConfigSpace::new(0x15ad, 0x0820, 0x020700, 1);
        c.set_bar(0, Bar::Mem32);
        c.set_bar(
            2,
            Bar::Mem64 {
                prefetchable: false,
            },
        );
        c.add_msix(3, 0, 0, 0, 0x2000);
        c
    }

    fn read32(c: &ConfigSpace, at: u64) -> u32 {
        let mut b = [0; 4];
        assert!(c.read(at, &mut b));
        u32::from_le_bytes(b)
    }

    #[test]
    fn identity_and_capabilities_read_back_and_resist_writes() {
        let mut c = space();
        assert_eq!(read32(&c, 0), 0x0820_15ad);
        assert_eq!(read32(&c, 8) >> 8, 0x020700);
        assert_eq!(c.bytes[off::CAP_PTR], 0x40);
        assert_eq!(read32(&c, 0x40) & 0xffff, 0x0011, "MSI-X, last");
        assert_eq!(read32(&c, 0x40) >> 16, 2, "3 vectors");
        assert_eq!(read32(&c, 0x48), 0x2000);
        assert!(c.write(0, &[0xff; 16]));
        assert_eq!(read32(&c, 0), 0x0820_15ad);
        assert_eq!(read32(&c, 0x18), 0b100, "BAR2: 64-bit");
        assert!(c.write(0x18, &[0xff; 4]));
        assert_eq!(read32(&c, 0x18), 0b100, "BAR bits are QEMU's");
        assert_eq!(read32(&c, off::ROM as u64), 0, "no ROM");
        assert!(c.write(off::ROM as u64, &0xffff_f800u32.to_le_bytes()));
        assert_eq!(read32(&c, off::ROM as u64), 0);
    }

    #[test]
    fn command_bits_and_w1c_status() {
        let mut c = space();
        assert!(!c.bus_master());
        assert!(c.write(
            4,
            &(command::MEMORY | command::BUS_MASTER | 0x8000).to_le_bytes()
        ));
        assert!(c.bus_master());
        assert_eq!(c.command(), command::MEMORY | command::BUS_MASTER);
        c.bytes[off::STATUS + 1] |= 0x80;
        assert!(c.write(off::STATUS as u64, &0x8000u16.to_le_bytes()));
        assert_eq!(
            c.get16(off::STATUS),
            STATUS_CAP_LIST,
            "W1C cleared, CAP_LIST kept"
        );
        // MSI-X enable is writable, the table size is not.
        assert!(c.write(0x42, &0xffffu16.to_le_bytes()));
        assert_eq!(c.get16(0x42), 0xc002);
        c.reset();
        assert_eq!(c.command(), 0);
        assert_eq!(c.get16(0x42), 0x0002);
    }

    #[test]
    fn accesses_past_the_end_do_nothing() {
        let mut c = space();
        let mut b = [0u8; 4];
        assert!(!c.read(254, &mut b));
        assert!(!c.read(u64::MAX, &mut b));
        assert!(!c.write(256, &[1]));
        assert!(!c.read(0, &mut []));
    }
}
