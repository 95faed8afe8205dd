//! The vfio-user wire format (QEMU's `docs/interop/vfio-user.rst`): a
//! 16-byte header, then one command's payload, in the host's byte order.
//! [`parse`] turns a received message into a typed [`Request`] after
//! checking every size and count against the message it came in; the
//! reply builders produce what QEMU's client accepts (a reply never longer
//! than what it is prepared to receive, errors header-only with a real
//! errno). Nothing here does I/O, so the whole decoder is fuzzed
//! (`fuzz/fuzz_targets/vfio_user_message.rs`).

use nix::errno::Errno;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Header bytes.
pub const HEADER_LEN: usize = 16;

/// The largest payload this server takes or sends in one message (what it
/// announces as `max_data_xfer_size`, and the most a region access moves).
pub const MAX_DATA_XFER: usize = 1 << 20;

/// The largest message accepted: a region write of [`MAX_DATA_XFER`]
/// bytes and its headers.
pub const MAX_MESSAGE: usize = MAX_DATA_XFER + 64;

/// File descriptors one message may carry (announced as `max_msg_fds`).
pub const MAX_FDS: usize = 16;

/// Command codes.
pub mod cmd {
    pub const VERSION: u16 = 1;
    pub const DMA_MAP: u16 = 2;
    pub const DMA_UNMAP: u16 = 3;
    pub const DEVICE_GET_INFO: u16 = 4;
    pub const DEVICE_GET_REGION_INFO: u16 = 5;
    pub const DEVICE_GET_REGION_IO_FDS: u16 = 6;
    pub const DEVICE_GET_IRQ_INFO: u16 = 7;
    pub const DEVICE_SET_IRQS: u16 = 8;
    pub const REGION_READ: u16 = 9;
    pub const REGION_WRITE: u16 = 10;
    pub const DMA_READ: u16 = 11;
    pub const DMA_WRITE: u16 = 12;
    pub const DEVICE_RESET: u16 = 13;
    pub const DIRTY_PAGES: u16 = 14;
    pub const REGION_WRITE_MULTI: u16 = 15;
}

/// Header flags.
pub mod flags {
    pub const TYPE_MASK: u32 = 0xf;
    pub const TYPE_COMMAND: u32 = 0;
    pub const TYPE_REPLY: u32 = 1;
    /// The sender wants no reply (QEMU's posted writes).
    pub const NO_REPLY: u32 = 0x10;
    pub const ERROR: u32 = 0x20;
}

/// `DMA_MAP` flags.
pub mod dma {
    pub const READ: u32 = 1;
    pub const WRITE: u32 = 2;
    /// `DMA_UNMAP`: every mapping (the kernel's `VFIO_DMA_UNMAP_FLAG_ALL`,
    /// the value QEMU sends).
    pub const UNMAP_ALL: u32 = 2;
    /// `DMA_UNMAP`: return a dirty-page bitmap (never offered).
    pub const UNMAP_GET_DIRTY_BITMAP: u32 = 1;
}

/// Device, region and interrupt flags (the kernel's VFIO values).
pub mod info {
    pub const DEVICE_RESET: u32 = 1;
    pub const DEVICE_PCI: u32 = 2;
    pub const REGION_READ: u32 = 1;
    pub const REGION_WRITE: u32 = 2;
    pub const REGION_MMAP: u32 = 4;
    pub const REGION_CAPS: u32 = 8;
    /// Capability id of a sparse-mmap list.
    pub const CAP_SPARSE_MMAP: u16 = 1;
    pub const IRQ_EVENTFD: u32 = 1;
    pub const IRQ_MASKABLE: u32 = 2;
    pub const IRQ_AUTOMASKED: u32 = 4;
    pub const IRQ_NORESIZE: u32 = 8;
}

/// `DEVICE_SET_IRQS` flags.
pub mod irq {
    pub const DATA_NONE: u32 = 1;
    pub const DATA_BOOL: u32 = 2;
    pub const DATA_EVENTFD: u32 = 4;
    pub const DATA_MASK: u32 = DATA_NONE | DATA_BOOL | DATA_EVENTFD;
    pub const ACTION_MASK: u32 = 8;
    pub const ACTION_UNMASK: u32 = 16;
    pub const ACTION_TRIGGER: u32 = 32;
    pub const ACTION_MASK_ALL: u32 = ACTION_MASK | ACTION_UNMASK | ACTION_TRIGGER;
}

/// PCI region indexes (the kernel's `VFIO_PCI_*_REGION_INDEX`).
pub mod region {
    pub const BAR0: u32 = 0;
    pub const BAR5: u32 = 5;
    pub const ROM: u32 = 6;
    pub const CONFIG: u32 = 7;
    pub const VGA: u32 = 8;
    /// Regions a PCI function reports.
    pub const COUNT: u32 = 9;
}

/// PCI interrupt indexes.
pub mod irq_index {
    pub const INTX: u32 = 0;
    pub const MSI: u32 = 1;
    pub const MSIX: u32 = 2;
    pub const ERR: u32 = 3;
    pub const REQ: u32 = 4;
}

/// The message header.
#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct Header {
    pub id: u16,
    pub command: u16,
    /// The whole message, header included.
    pub size: u32,
    pub flags: u32,
    pub error: u32,
}

impl Header {
    pub fn is_command(&self) -> bool {
        self.flags & flags::TYPE_MASK == flags::TYPE_COMMAND
    }

    pub fn no_reply(&self) -> bool {
        self.flags & flags::NO_REPLY != 0
    }

    /// The payload's length, if the size is at least a header's.
    pub fn payload_len(&self) -> Option<usize> {
        (self.size as usize).checked_sub(HEADER_LEN)
    }
}

#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct VersionHead {
    pub major: u16,
    pub minor: u16,
}

#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct DmaMap {
    pub argsz: u32,
    pub flags: u32,
    /// Offset of the mapping in the file descriptor that came with it.
    pub offset: u64,
    /// The device (guest-physical) address.
    pub addr: u64,
    pub size: u64,
}

#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct DmaUnmap {
    pub argsz: u32,
    pub flags: u32,
    pub addr: u64,
    pub size: u64,
}

#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct DeviceInfo {
    pub argsz: u32,
    pub flags: u32,
    pub num_regions: u32,
    pub num_irqs: u32,
}

#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct RegionInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub cap_offset: u32,
    pub size: u64,
    /// Offset of the region in the file descriptor sent with the reply.
    pub offset: u64,
}

/// A capability header in a region-info chain.
#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct CapHeader {
    pub id: u16,
    pub version: u16,
    pub next: u32,
}

#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct SparseMmapHead {
    pub nr_areas: u32,
    pub reserved: u32,
}

#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct SparseArea {
    pub offset: u64,
    pub size: u64,
}

#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct IrqInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub count: u32,
}

#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct IrqSet {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub start: u32,
    pub count: u32,
}

#[derive(
    Clone, Copy, Debug, Default, Eq, PartialEq, FromBytes, Immutable, IntoBytes, KnownLayout,
)]
#[repr(C)]
pub struct RegionAccess {
    pub offset: u64,
    pub region: u32,
    pub count: u32,
}

const _: () = {
    assert!(size_of::<Header>() == HEADER_LEN);
    assert!(size_of::<DmaMap>() == 32);
    assert!(size_of::<DmaUnmap>() == 24);
    assert!(size_of::<DeviceInfo>() == 16);
    assert!(size_of::<RegionInfo>() == 32);
    assert!(size_of::<IrqInfo>() == 16);
    assert!(size_of::<IrqSet>() == 20);
    assert!(size_of::<RegionAccess>() == 16);
};

/// A command, checked against the message it came in.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Request<'a> {
    /// The client's version and its capabilities (JSON, NUL removed).
    Version {
        major: u16,
        minor: u16,
        caps: &'a [u8],
    },
    DmaMap(DmaMap),
    DmaUnmap(DmaUnmap),
    DeviceGetInfo {
        argsz: u32,
    },
    RegionInfo {
        argsz: u32,
        index: u32,
    },
    IrqInfo {
        argsz: u32,
        index: u32,
    },
    /// `DEVICE_SET_IRQS` with no data or with eventfds (those come with
    /// the message, not in it).
    SetIrqs(IrqSet),
    RegionRead {
        region: u32,
        offset: u64,
        count: u32,
    },
    RegionWrite {
        region: u32,
        offset: u64,
        data: &'a [u8],
    },
    Reset,
    /// A command this server does not implement (answered `ENOTSUP`).
    Unsupported(u16),
}

/// Reads a `T` from the start of `payload`, which must hold at least
/// that many bytes.
fn take<T: FromBytes>(payload: &[u8]) -> Result<T, Errno> {
    T::read_from_prefix(payload)
        .map(|(v, _)| v)
        .map_err(|_| Errno::EINVAL)
}

/// A query's `argsz`: the room the client has for the reply (its request
/// carries only the fixed part), at least the fixed part.
fn room(argsz: u32, min: usize) -> Result<(), Errno> {
    if (argsz as usize) < min {
        return Err(Errno::EINVAL);
    }
    Ok(())
}

/// Checks a command's `argsz` against the bytes it came with: at least
/// the fixed part, and no more than the payload.
fn argsz(argsz: u32, min: usize, payload: &[u8]) -> Result<(), Errno> {
    let a = argsz as usize;
    if a < min || a > payload.len() {
        return Err(Errno::EINVAL);
    }
    Ok(())
}

/// Decodes a command's payload (the header already read, its size
/// checked against what arrived). An error is the errno to reply with.
pub fn parse<'a>(h: &Header, payload: &'a [u8]) -> Result<Request<'a>, Errno> {
    if !h.is_command() {
        return Err(Errno::EINVAL);
    }
    match h.command {
        cmd::VERSION => {
            let v: VersionHead = take(payload)?;
            let json = &payload[size_of::<VersionHead>()..];
            // NUL-terminated JSON; the terminator is not part of it.
            let caps = match json.split_last() {
                Some((0, rest)) => rest,
                None => json,
                Some(_) => return Err(Errno::EINVAL),
            };
            Ok(Request::Version {
                major: v.major,
                minor: v.minor,
                caps,
            })
        }
        cmd::DMA_MAP => {
            let m: DmaMap = take(payload)?;
            argsz(m.argsz, size_of::<DmaMap>(), payload)?;
            Ok(Request::DmaMap(m))
        }
        cmd::DMA_UNMAP => {
            let m: DmaUnmap = take(payload)?;
            argsz(m.argsz, size_of::<DmaUnmap>(), payload)?;
            Ok(Request::DmaUnmap(m))
        }
        cmd::DEVICE_GET_INFO => {
            let i: DeviceInfo = take(payload)?;
            room(i.argsz, size_of::<DeviceInfo>())?;
            Ok(Request::DeviceGetInfo { argsz: i.argsz })
        }
        cmd::DEVICE_GET_REGION_INFO => {
            let i: RegionInfo = take(payload)?;
            room(i.argsz, size_of::<RegionInfo>())?;
            Ok(Request::RegionInfo {
                argsz: i.argsz,
                index: i.index,
            })
        }
        cmd::DEVICE_GET_IRQ_INFO => {
            let i: IrqInfo = take(payload)?;
            room(i.argsz, size_of::<IrqInfo>())?;
            Ok(Request::IrqInfo {
                argsz: i.argsz,
                index: i.index,
            })
        }
        cmd::DEVICE_SET_IRQS => {
            let s: IrqSet = take(payload)?;
            argsz(s.argsz, size_of::<IrqSet>(), payload)?;
            // Exactly one data kind and at most one action.
            let data = s.flags & irq::DATA_MASK;
            let action = s.flags & irq::ACTION_MASK_ALL;
            if data.count_ones() != 1
                || action.count_ones() > 1
                || s.flags & !(irq::DATA_MASK | irq::ACTION_MASK_ALL) != 0
            {
                return Err(Errno::EINVAL);
            }
            if data == irq::DATA_BOOL {
                // An array of booleans after the header: QEMU never sends
                // it, and this server does not take it.
                return Err(Errno::ENOTSUP);
            }
            Ok(Request::SetIrqs(s))
        }
        cmd::REGION_READ => {
            let a: RegionAccess = take(payload)?;
            if payload.len() != size_of::<RegionAccess>() {
                return Err(Errno::EINVAL);
            }
            if a.count as usize > MAX_DATA_XFER {
                return Err(Errno::E2BIG);
            }
            Ok(Request::RegionRead {
                region: a.region,
                offset: a.offset,
                count: a.count,
            })
        }
        cmd::REGION_WRITE => {
            let a: RegionAccess = take(payload)?;
            let data = &payload[size_of::<RegionAccess>()..];
            if data.len() != a.count as usize {
                return Err(Errno::EINVAL);
            }
            Ok(Request::RegionWrite {
                region: a.region,
                offset: a.offset,
                data,
            })
        }
        cmd::DEVICE_RESET => Ok(Request::Reset),
        other => Ok(Request::Unsupported(other)),
    }
}

/// The reply header for request `h` carrying `body_len` payload bytes.
pub fn reply_header(h: &Header, body_len: usize) -> Header {
    Header {
        id: h.id,
        command: h.command,
        size: (HEADER_LEN + body_len) as u32,
        flags: flags::TYPE_REPLY,
        error: 0,
    }
}

/// A reply to `h` with `body`.
pub fn reply(h: &Header, body: &[&[u8]]) -> Vec<u8> {
    let len: usize = body.iter().map(|b| b.len()).sum();
    let mut out = Vec::with_capacity(HEADER_LEN + len);
    out.extend_from_slice(reply_header(h, len).as_bytes());
    for b in body {
        out.extend_from_slice(b);
    }
    out
}

/// An error reply to `h`: the header alone, flagged, with the errno (never
/// 0: QEMU reads an error of 0 as success for several commands).
pub fn error_reply(h: &Header, errno: Errno) -> Vec<u8> {
    let mut r = reply_header(h, 0);
    r.flags |= flags::ERROR;
    r.error = match errno as i32 {
        0 => Errno::EIO as u32,
        e => e as u32,
    };
    r.as_bytes().to_vec()
}

/// The capabilities this server announces in its VERSION reply: fds and
/// data per message, page size, DMA maps. No `write_multiple` (QEMU would
/// then batch posted writes into a command this server does not take) and
/// no migration. `max_dma_maps` is the session's budget of maps.
pub fn server_caps(max_dma_maps: usize) -> Vec<u8> {
    let caps = serde_json::json!({
        "capabilities": {
            "max_msg_fds": MAX_FDS,
            "max_data_xfer_size": MAX_DATA_XFER,
            "pgsizes": 4096,
            "max_dma_maps": max_dma_maps,
        }
    });
    let mut v = caps.to_string().into_bytes();
    v.push(0);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(command: u16, payload: usize) -> Header {
        Header {
            id: 7,
            command,
            size: (HEADER_LEN + payload) as u32,
            flags: 0,
            error: 0,
        }
    }

    #[test]
    fn a_region_write_carries_exactly_its_count() {
        let mut p = RegionAccess {
            offset: 0x10,
            region: 1,
            count: 4,
        }
        .as_bytes()
        .to_vec();
        p.extend_from_slice(&[1, 2, 3, 4]);
        let h = header(cmd::REGION_WRITE, p.len());
        assert_eq!(
            parse(&h, &p),
            Ok(Request::RegionWrite {
                region: 1,
                offset: 0x10,
                data: &[1, 2, 3, 4]
            })
        );
        assert_eq!(parse(&h, &p[..p.len() - 1]), Err(Errno::EINVAL));
        p.push(5);
        assert_eq!(parse(&h, &p), Err(Errno::EINVAL));
    }

    #[test]
    fn argsz_must_cover_the_fixed_part_and_stay_in_the_message() {
        let m = DmaMap {
            argsz: 32,
            flags: dma::READ | dma::WRITE,
            offset: 0,
            addr: 0x1000,
            size: 0x1000,
        };
        let h = header(cmd::DMA_MAP, 32);
        assert_eq!(parse(&h, m.as_bytes()), Ok(Request::DmaMap(m)));
        let short = DmaMap { argsz: 31, ..m };
        assert_eq!(parse(&h, short.as_bytes()), Err(Errno::EINVAL));
        let long = DmaMap { argsz: 33, ..m };
        assert_eq!(parse(&h, long.as_bytes()), Err(Errno::EINVAL));
        assert_eq!(parse(&h, &m.as_bytes()[..20]), Err(Errno::EINVAL));
    }

    #[test]
    fn set_irqs_takes_one_data_kind_and_one_action() {
        let s = |flags| IrqSet {
            argsz: 20,
            flags,
            index: irq_index::MSIX,
            start: 0,
            count: 1,
        };
        let h = header(cmd::DEVICE_SET_IRQS, 20);
        let ok = s(irq::DATA_EVENTFD | irq::ACTION_TRIGGER);
        assert_eq!(parse(&h, ok.as_bytes()), Ok(Request::SetIrqs(ok)));
        for bad in [
            irq::DATA_EVENTFD | irq::DATA_NONE | irq::ACTION_TRIGGER,
            irq::DATA_NONE | irq::ACTION_MASK | irq::ACTION_UNMASK,
            0,
            irq::DATA_NONE | 0x1000,
        ] {
            assert_eq!(parse(&h, s(bad).as_bytes()), Err(Errno::EINVAL), "{bad:#x}");
        }
        assert_eq!(
            parse(&h, s(irq::DATA_BOOL | irq::ACTION_TRIGGER).as_bytes()),
            Err(Errno::ENOTSUP)
        );
    }

    #[test]
    fn version_caps_end_with_one_nul() {
        let mut p = VersionHead { major: 0, minor: 0 }.as_bytes().to_vec();
        p.extend_from_slice(b"{}\0");
        let h = header(cmd::VERSION, p.len());
        assert_eq!(
            parse(&h, &p),
            Ok(Request::Version {
                major: 0,
                minor: 0,
                caps: b"{}"
            })
        );
        p.pop();
        assert_eq!(parse(&h, &p), Err(Errno::EINVAL));
        let caps = server_caps(1024);
        assert_eq!(caps.last(), Some(&0));
        let v: serde_json::Value = serde_json::from_slice(&caps[..caps.len() - 1]).unwrap();
        assert_eq!(v["capabilities"]["max_msg_fds"], MAX_FDS);
        assert_eq!(v["capabilities"]["max_dma_maps"], 1024);
    }

    #[test]
    fn errors_are_header_only_with_a_real_errno() {
        let h = header(cmd::DMA_MAP, 32);
        let r = error_reply(&h, Errno::EEXIST);
        let (rh, rest) = Header::read_from_prefix(&r).unwrap();
        assert!(rest.is_empty());
        assert_eq!(rh.flags, flags::TYPE_REPLY | flags::ERROR);
        assert_eq!(rh.error, Errno::EEXIST as u32);
        assert_eq!((rh.id, rh.command, rh.size), (7, cmd::DMA_MAP, 16));
    }
}
