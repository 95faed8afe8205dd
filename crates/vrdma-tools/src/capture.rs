//! Reading capture files: classic pcap (either byte order, micro- or
//! nanosecond timestamps) and pcapng (any number of interfaces, each with
//! its link type and timestamp resolution).
//!
//! The file is read into memory and parsed with `pcap-file`'s slice parsers,
//! so a hostile length field can only point past the end of the buffer (an
//! error), never make us allocate what it claims.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use pcap_file::{
    DataLink, TsResolution,
    pcap::PcapParser,
    pcapng::{
        Block, PcapNgParser,
        blocks::interface_description::{InterfaceDescriptionBlock, InterfaceDescriptionOption},
    },
};

/// How the bytes of a frame begin.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Link {
    Ethernet,
    /// A bare IPv4 or IPv6 packet.
    Ip,
    /// Linux cooked capture v1 (16-byte header) or v2 (20-byte header).
    LinuxSll,
    LinuxSll2,
    /// A link type this tool does not decode.
    Other(u32),
}

impl From<DataLink> for Link {
    fn from(d: DataLink) -> Self {
        match d {
            DataLink::ETHERNET => Link::Ethernet,
            DataLink::RAW | DataLink::IPV4 | DataLink::IPV6 => Link::Ip,
            DataLink::LINUX_SLL => Link::LinuxSll,
            DataLink::LINUX_SLL2 => Link::LinuxSll2,
            other => Link::Other(u32::from(other)),
        }
    }
}

/// One captured frame.
#[derive(Debug)]
pub struct Frame<'a> {
    /// Time since the Unix epoch.
    pub time: Duration,
    pub link: Link,
    /// The bytes captured: fewer than `orig_len` when the capture's
    /// snapshot length cut the frame.
    pub data: &'a [u8],
    /// The frame's length on the wire.
    pub orig_len: u32,
}

impl Frame<'_> {
    /// True when the capture kept only part of the frame.
    pub fn cut_by_snaplen(&self) -> bool {
        (self.data.len() as u64) < u64::from(self.orig_len)
    }
}

const PCAPNG_MAGIC: [u8; 4] = [0x0a, 0x0d, 0x0d, 0x0a];

/// Calls `f` for each frame of the capture in `bytes`, in file order.
pub fn for_each_frame(bytes: &[u8], mut f: impl FnMut(Frame<'_>)) -> Result<()> {
    if bytes.starts_with(&PCAPNG_MAGIC) {
        read_pcapng(bytes, &mut f)
    } else {
        read_pcap(bytes, &mut f)
    }
}

fn read_pcap(bytes: &[u8], f: &mut impl FnMut(Frame<'_>)) -> Result<()> {
    let (mut rest, parser) = PcapParser::new(bytes).context("not a pcap or pcapng file")?;
    let header = parser.header();
    let link = Link::from(header.datalink);
    let mut n = 0u64;
    while !rest.is_empty() {
        n += 1;
        // Raw records: pcap-file's checked records refuse any frame longer
        // than the snapshot length, which is every cut frame of a
        // `tcpdump -s N` capture; the cut is reported per frame instead.
        let (r, pkt) = parser
            .next_raw_packet(rest)
            .with_context(|| format!("pcap record {n}"))?;
        let frac = match header.ts_resolution {
            TsResolution::MicroSecond => u64::from(pkt.ts_frac).saturating_mul(1000),
            TsResolution::NanoSecond => u64::from(pkt.ts_frac),
        };
        f(Frame {
            time: Duration::from_secs(u64::from(pkt.ts_sec)) + Duration::from_nanos(frac),
            link,
            data: &pkt.data,
            orig_len: pkt.orig_len,
        });
        rest = r;
    }
    Ok(())
}

fn read_pcapng(bytes: &[u8], f: &mut impl FnMut(Frame<'_>)) -> Result<()> {
    let (mut rest, mut parser) = PcapNgParser::new(bytes).context("bad pcapng section header")?;
    let mut n = 0u64;
    while !rest.is_empty() {
        n += 1;
        let (r, block) = parser
            .next_block(rest)
            .with_context(|| format!("pcapng block {n}"))?;
        match block {
            Block::EnhancedPacket(epb) => {
                let Some(idb) = parser.interfaces().get(epb.interface_id as usize) else {
                    bail!(
                        "pcapng block {n}: packet on undeclared interface {}",
                        epb.interface_id
                    );
                };
                f(Frame {
                    time: scale_timestamp(epb.timestamp, idb),
                    link: Link::from(idb.linktype),
                    data: &epb.data,
                    orig_len: epb.original_len,
                });
            }
            Block::SimplePacket(spb) => {
                let Some(idb) = parser.interfaces().first() else {
                    bail!("pcapng block {n}: simple packet before any interface");
                };
                f(Frame {
                    time: Duration::ZERO,
                    link: Link::from(idb.linktype),
                    data: &spb.data,
                    orig_len: spb.original_len,
                });
            }
            _ => {}
        }
        rest = r;
    }
    Ok(())
}

/// pcap-file 2.0 hands back an enhanced packet's 64-bit timestamp as if it
/// counted nanoseconds; its unit is really the interface's `if_tsresol`
/// (default microseconds). Recover the raw count and scale it.
fn scale_timestamp(raw: Duration, idb: &InterfaceDescriptionBlock<'_>) -> Duration {
    let units = raw.as_nanos();
    let resol = idb
        .options
        .iter()
        .find_map(|o| match o {
            InterfaceDescriptionOption::IfTsResol(r) => Some(*r),
            _ => None,
        })
        .unwrap_or(6);
    let nanos = if resol & 0x80 == 0 {
        // Units of 10^-resol seconds.
        let exp = u32::from(resol);
        if exp <= 9 {
            units.saturating_mul(10u128.pow(9 - exp))
        } else {
            units / 10u128.saturating_pow(exp - 9)
        }
    } else {
        // Units of 2^-(resol & 0x7f) seconds.
        let shift = u32::from(resol & 0x7f).min(127);
        units.saturating_mul(1_000_000_000) >> shift
    };
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use pcap_file::pcapng::{
        PcapNgWriter,
        blocks::{enhanced_packet::EnhancedPacketBlock, interface_description},
    };

    use super::*;

    fn idb(resol: Option<u8>) -> InterfaceDescriptionBlock<'static> {
        InterfaceDescriptionBlock {
            linktype: DataLink::ETHERNET,
            snaplen: 0,
            options: resol
                .map(interface_description::InterfaceDescriptionOption::IfTsResol)
                .into_iter()
                .collect(),
        }
    }

    #[test]
    fn pcapng_timestamps_follow_if_tsresol() {
        // 1.5 s in each unit.
        let us = Duration::from_nanos(1_500_000);
        assert_eq!(scale_timestamp(us, &idb(None)), Duration::from_millis(1500));
        let ns = Duration::from_nanos(1_500_000_000);
        assert_eq!(
            scale_timestamp(ns, &idb(Some(9))),
            Duration::from_millis(1500)
        );
        let pow2 = Duration::from_nanos(3 << 9);
        assert_eq!(
            scale_timestamp(pow2, &idb(Some(0x80 | 10))),
            Duration::from_millis(1500)
        );
    }

    #[test]
    fn pcapng_file_is_read() {
        let mut w = PcapNgWriter::new(Vec::new()).unwrap();
        w.write_pcapng_block(idb(Some(9))).unwrap();
        w.write_pcapng_block(EnhancedPacketBlock {
            interface_id: 0,
            timestamp: Duration::from_nanos(2_000_000_123),
            original_len: 3,
            data: Cow::Borrowed(&[1, 2, 3]),
            options: vec![],
        })
        .unwrap();
        let bytes = w.into_inner();
        let mut got = Vec::new();
        for_each_frame(&bytes, |f| got.push((f.time, f.link, f.data.to_vec()))).unwrap();
        assert_eq!(
            got,
            [(
                Duration::from_nanos(2_000_000_123),
                Link::Ethernet,
                vec![1, 2, 3]
            )]
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(for_each_frame(b"not a capture at all", |_| {}).is_err());
        assert!(for_each_frame(&PCAPNG_MAGIC, |_| {}).is_err());
        let mut truncated = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/rxe/rc_pingpong_64.pcap"
        ))
        .unwrap();
        truncated.truncate(truncated.len() - 5);
        let mut n = 0;
        assert!(for_each_frame(&truncated, |_| n += 1).is_err());
        assert_eq!(n, 11, "the frames before the cut are still delivered");
    }
}
