//! `vrdma decode`: RoCEv2 packets of a capture, one line (or one JSON
//! object) each, then a summary. Packets behind VLAN tags (802.1Q, QinQ)
//! or inside a VXLAN tunnel are decoded too, their line prefixed with the
//! VLAN IDs and VNI (`vlan 10 vni 5001 vlan 100`, outermost first).

use std::{
    borrow::Cow,
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    io::{self, Write},
    process::ExitCode,
    time::Duration,
};

use anyhow::{Context, Result};
use serde::Serialize;
use vrdma_fabric::eth::cut_captured;
use vrdma_wire::{
    aeth::Syndrome,
    encap::{self, Encapsulation, Peek},
    frame::Decoded,
};

use crate::{
    args::DecodeArgs,
    capture::{self, Frame, Link},
};

/// The capture decoded when no file is given: Linux rxe ↔ rxe traffic from
/// the interop harness (see testdata/rxe/README.md).
const DEFAULT_CAPTURE: &[u8] = include_bytes!("../../../testdata/rxe/rc_imm_and_rnr_nak.pcap");
const DEFAULT_NAME: &str = "built-in capture rc_imm_and_rnr_nak.pcap (Linux rxe)";

pub fn run(a: &DecodeArgs) -> Result<ExitCode> {
    let (name, bytes): (String, Cow<'static, [u8]>) = match &a.file {
        Some(p) => (
            p.display().to_string(),
            Cow::Owned(fs::read(p).with_context(|| format!("reading {}", p.display()))?),
        ),
        None => (DEFAULT_NAME.to_owned(), Cow::Borrowed(DEFAULT_CAPTURE)),
    };
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let mut report = Report::new(a.json);
    // Packets are printed as they are decoded; a write error (say, a closed
    // pipe) stops the run.
    let mut write_err = None;
    let read = capture::for_each_frame(&bytes, |f| {
        if write_err.is_some() {
            return;
        }
        // A frame a TAP with offloads took whole (the device's packets as
        // one UDP GSO frame, before the kernel cut it) is decoded as the
        // packets the kernel made of it.
        if f.link == Link::Ethernet && !f.cut_by_snaplen() {
            let mut segs = Vec::new();
            if cut_captured(f.data, |s| segs.push(s.to_vec())).is_some() {
                report.gso_frames += 1;
                for s in &segs {
                    let seg = Frame {
                        data: s,
                        orig_len: u32::try_from(s.len()).unwrap_or(u32::MAX),
                        ..f
                    };
                    if let Err(e) = report.add(&seg, &mut out) {
                        write_err = Some(e);
                        return;
                    }
                }
                // One frame of the file, not one per packet.
                report.frames -= segs.len() as u64 - 1;
                return;
            }
        }
        if let Err(e) = report.add(&f, &mut out) {
            write_err = Some(e);
        }
    });
    if let Some(e) = write_err {
        return Err(e).context("writing the decode");
    }
    report.finish(&name, &mut out)?;
    out.flush()?;
    read.with_context(|| format!("{name}: capture ends badly after {} frames", report.frames))?;
    Ok(if report.bad() == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// What one RoCEv2 packet said.
#[derive(Debug, Serialize)]
struct Packet {
    index: u64,
    /// Seconds since the Unix epoch.
    time: f64,
    /// Seconds since the first frame of the capture.
    rel_time: f64,
    #[serde(flatten)]
    encap: Encap,
    #[serde(flatten)]
    body: Body,
}

/// The VLAN tags and VXLAN tunnel around a packet. Each key appears only
/// when there is something to say, so an untagged frame's object is as it
/// always was.
#[derive(Debug, Default, Serialize)]
struct Encap {
    /// VLAN IDs of the Ethernet header carrying the RoCEv2 packet (the
    /// tenant's, inside a tunnel), outermost first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    vlans: Vec<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    vni: Option<u32>,
    /// The VXLAN tunnel's outer headers.
    #[serde(skip_serializing_if = "Option::is_none")]
    underlay: Option<Underlay>,
}

#[derive(Debug, Serialize)]
struct Underlay {
    src: String,
    dst: String,
    src_port: u16,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    vlans: Vec<u16>,
}

impl Encap {
    fn new(e: &Encapsulation) -> Self {
        let vlans = e
            .ethernet()
            .map(|h| h.tags.vids().collect())
            .unwrap_or_default();
        let t = e.vxlan();
        Encap {
            vlans,
            vni: t.map(|t| t.vni.value()),
            underlay: t.map(|t| Underlay {
                src: t.ip.src().to_string(),
                dst: t.ip.dst().to_string(),
                src_port: t.src_port,
                vlans: t.outer.map(|h| h.tags.vids().collect()).unwrap_or_default(),
            }),
        }
    }

    /// The text form's prefix, outermost first: `vlan 10 vni 5001 vlan
    /// 100.200  ` (QinQ's IDs joined by dots), or nothing.
    fn prefix(&self) -> String {
        let vlan = |ids: &[u16]| {
            let ids: Vec<String> = ids.iter().map(u16::to_string).collect();
            format!("vlan {}", ids.join("."))
        };
        let mut parts = Vec::new();
        if let Some(u) = &self.underlay
            && !u.vlans.is_empty()
        {
            parts.push(vlan(&u.vlans));
        }
        if let Some(v) = self.vni {
            parts.push(format!("vni {v}"));
        }
        if !self.vlans.is_empty() {
            parts.push(vlan(&self.vlans));
        }
        if parts.is_empty() {
            String::new()
        } else {
            parts.join(" ") + "  "
        }
    }
}

#[derive(Debug, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
enum Body {
    Ok(Box<Roce>),
    Malformed {
        error: String,
    },
    /// The capture's snapshot length cut the frame before its end.
    Cut {
        captured: usize,
        length: u32,
    },
}

#[derive(Debug, Serialize)]
struct Roce {
    src: String,
    dst: String,
    src_port: u16,
    /// The innermost VLAN ID (the customer VLAN of QinQ).
    vlan: Option<u16>,
    opcode: String,
    opcode_code: u8,
    qpn: u32,
    psn: u32,
    ack_req: bool,
    solicited: bool,
    mig_req: bool,
    fecn: bool,
    becn: bool,
    pkey: u16,
    pad_cnt: u8,
    reth: Option<Reth>,
    aeth: Option<Aeth>,
    deth: Option<Deth>,
    immdt: Option<u32>,
    ieth: Option<u32>,
    atomic_eth: Option<AtomicEth>,
    atomic_ack_eth: Option<u64>,
    payload_len: usize,
    icrc: Icrc,
}

#[derive(Debug, Serialize)]
struct Reth {
    va: u64,
    rkey: u32,
    dma_len: u32,
}

#[derive(Debug, Serialize)]
struct Aeth {
    /// "ack", "rnr_nak" or "nak".
    kind: &'static str,
    syndrome: u8,
    /// ACK: credits advertised (`None` for the invalid code 31).
    credits: Option<u32>,
    /// RNR NAK: the timer code and the delay it stands for.
    rnr_timer: Option<u8>,
    rnr_delay_us: Option<u32>,
    /// NAK: what went wrong.
    nak: Option<&'static str>,
    msn: u32,
    /// The syndrome in words, for the text form.
    #[serde(skip)]
    text: String,
}

#[derive(Debug, Serialize)]
struct Deth {
    qkey: u32,
    src_qp: u32,
}

#[derive(Debug, Serialize)]
struct AtomicEth {
    va: u64,
    rkey: u32,
    swap_add: u64,
    compare: u64,
}

#[derive(Debug, Serialize)]
struct Icrc {
    found: u32,
    computed: u32,
    good: bool,
}

impl Roce {
    fn new(d: &Decoded<'_>, vlan: Option<u16>) -> Self {
        let r = &d.repr;
        let b = &r.roce.bth;
        let e = &r.roce.ext;
        Roce {
            src: r.ip.src().to_string(),
            dst: r.ip.dst().to_string(),
            src_port: r.udp.src_port,
            vlan,
            opcode: b.opcode.to_string(),
            opcode_code: b.opcode.code(),
            qpn: b.dest_qp.value(),
            psn: b.psn.value(),
            ack_req: b.ack_req,
            solicited: b.solicited,
            mig_req: b.mig_req,
            fecn: b.fecn,
            becn: b.becn,
            pkey: b.pkey.0,
            pad_cnt: b.pad_cnt,
            reth: e.reth.map(|h| Reth {
                va: h.va,
                rkey: h.rkey.0,
                dma_len: h.dma_len,
            }),
            aeth: e.aeth.map(|h| {
                let (kind, credits, rnr_timer, rnr_delay_us, nak) = match h.syndrome {
                    Syndrome::Ack(c) => ("ack", c.credits(), None, None, None),
                    Syndrome::RnrNak(t) => {
                        ("rnr_nak", None, Some(t.code()), Some(t.micros()), None)
                    }
                    Syndrome::Nak(n) => ("nak", None, None, None, Some(n.name())),
                };
                Aeth {
                    kind,
                    syndrome: h.syndrome.to_byte(),
                    credits,
                    rnr_timer,
                    rnr_delay_us,
                    nak,
                    msn: h.msn.value(),
                    text: h.syndrome.to_string(),
                }
            }),
            deth: e.deth.map(|h| Deth {
                qkey: h.qkey.0,
                src_qp: h.src_qp.value(),
            }),
            immdt: e.immdt.map(|h| h.imm),
            ieth: e.ieth.map(|h| h.rkey.0),
            atomic_eth: e.atomic_eth.map(|h| AtomicEth {
                va: h.va,
                rkey: h.rkey.0,
                swap_add: h.swap_add,
                compare: h.compare,
            }),
            atomic_ack_eth: e.atomic_ack_eth.map(|h| h.orig),
            payload_len: r.roce.payload.len(),
            icrc: Icrc {
                found: d.icrc.found,
                computed: d.icrc.computed,
                good: d.icrc.is_good(),
            },
        }
    }

    /// The text form: `src → dst  OPCODE  qp psn flags  headers  len icrc`.
    fn line(&self) -> String {
        let mut s = format!(
            "{} → {}  {:<36} qp={:#08x} psn={}",
            self.src, self.dst, self.opcode, self.qpn, self.psn
        );
        let flags: Vec<&str> = [
            (self.ack_req, "A"),
            (self.solicited, "SE"),
            (self.mig_req, "M"),
            (self.fecn, "FECN"),
            (self.becn, "BECN"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, n)| *n)
        .collect();
        if !flags.is_empty() {
            let _ = write!(s, " [{}]", flags.join(","));
        }
        if self.pkey != 0xffff {
            let _ = write!(s, " pkey={:#06x}", self.pkey);
        }
        if let Some(h) = &self.deth {
            let _ = write!(s, "  DETH qkey={:#010x} src_qp={:#08x}", h.qkey, h.src_qp);
        }
        if let Some(h) = &self.reth {
            let _ = write!(
                s,
                "  RETH va={:#018x} rkey={:#010x} len={}",
                h.va, h.rkey, h.dma_len
            );
        }
        if let Some(h) = &self.atomic_eth {
            let _ = write!(
                s,
                "  AtomicETH va={:#018x} rkey={:#010x} swap_add={:#x} compare={:#x}",
                h.va, h.rkey, h.swap_add, h.compare
            );
        }
        if let Some(h) = &self.aeth {
            let _ = write!(s, "  AETH {} msn={}", h.text, h.msn);
        }
        if let Some(o) = self.atomic_ack_eth {
            let _ = write!(s, "  AtomicAckETH orig={o:#x}");
        }
        if let Some(i) = self.immdt {
            let _ = write!(s, "  ImmDt {i:#010x}");
        }
        if let Some(k) = self.ieth {
            let _ = write!(s, "  IETH rkey={k:#010x}");
        }
        let _ = write!(s, "  payload={}", self.payload_len);
        if self.icrc.good {
            s.push_str("  icrc=good");
        } else {
            let _ = write!(
                s,
                "  icrc=BAD (carried {:#010x}, computed {:#010x})",
                self.icrc.found, self.icrc.computed
            );
        }
        s
    }
}

/// Counts over a capture, and the output format.
#[derive(Debug)]
struct Report {
    json: bool,
    frames: u64,
    first: Option<Duration>,
    /// RoCEv2 packets printed so far (ok, malformed or cut).
    printed: u64,
    /// Frames that are not RoCEv2 at all, by reason.
    other: BTreeMap<String, u64>,
    by_opcode: BTreeMap<(u8, String), u64>,
    icrc_good: u64,
    icrc_bad: u64,
    malformed: u64,
    cut: u64,
    /// Frames a TAP with offloads took whole, decoded as their packets.
    gso_frames: u64,
}

#[derive(Serialize)]
struct Summary<'a> {
    capture: &'a str,
    frames: u64,
    roce_packets: u64,
    icrc_good: u64,
    icrc_bad: u64,
    malformed: u64,
    /// RoCEv2 frames the capture's snapshot length cut short (not decoded,
    /// not counted as bad).
    cut_by_capture: u64,
    /// Frames a TAP with UDP segmentation offload took whole (several
    /// RoCEv2 packets, before the kernel cut them), decoded packet by
    /// packet.
    #[serde(skip_serializing_if = "is_zero")]
    gso_frames: u64,
    not_roce: u64,
    not_roce_reasons: &'a BTreeMap<String, u64>,
    opcodes: BTreeMap<String, u64>,
}

impl Report {
    fn new(json: bool) -> Self {
        Report {
            json,
            frames: 0,
            first: None,
            printed: 0,
            other: BTreeMap::new(),
            by_opcode: BTreeMap::new(),
            icrc_good: 0,
            icrc_bad: 0,
            malformed: 0,
            cut: 0,
            gso_frames: 0,
        }
    }

    fn add(&mut self, f: &Frame<'_>, out: &mut impl Write) -> Result<()> {
        self.frames += 1;
        let first = *self.first.get_or_insert(f.time);
        let (data, ethernet) = match f.link {
            Link::Ethernet => (f.data, true),
            Link::Ip => (f.data, false),
            Link::LinuxSll => (cooked(f.data, 16, 14), false),
            Link::LinuxSll2 => (cooked(f.data, 20, 0), false),
            Link::Other(t) => {
                *self.other.entry(format!("link type {t}")).or_default() += 1;
                return Ok(());
            }
        };
        let why = match encap::peek(data, ethernet) {
            Peek::Roce => None,
            Peek::VxlanOther => Some("VXLAN not carrying UDP to port 4791"),
            Peek::Other => Some("not UDP to port 4791"),
        };
        if let Some(why) = why {
            *self.other.entry(why.to_owned()).or_default() += 1;
            return Ok(());
        }
        // The tags and tunnel first, so that they are shown even when the
        // packet inside is malformed.
        let peeled = if ethernet {
            encap::peel_ethernet(data)
        } else {
            encap::peel_ip(data)
        };
        let (encap, decoded) = match &peeled {
            Ok(p) => (Encap::new(&p.encap), p.decode()),
            Err(e) => (Encap::default(), Err(*e)),
        };
        let body = match decoded {
            Ok(d) => {
                if d.icrc.is_good() {
                    self.icrc_good += 1;
                } else {
                    self.icrc_bad += 1;
                }
                let op = d.repr.roce.bth.opcode;
                *self
                    .by_opcode
                    .entry((op.code(), op.to_string()))
                    .or_default() += 1;
                Body::Ok(Box::new(Roce::new(&d, encap.vlans.last().copied())))
            }
            Err(_) if f.cut_by_snaplen() => {
                self.cut += 1;
                Body::Cut {
                    captured: f.data.len(),
                    length: f.orig_len,
                }
            }
            Err(e) => {
                self.malformed += 1;
                Body::Malformed {
                    error: e.to_string(),
                }
            }
        };
        let p = Packet {
            index: self.frames,
            time: f.time.as_secs_f64(),
            rel_time: f.time.saturating_sub(first).as_secs_f64(),
            encap,
            body,
        };
        if self.json {
            let sep = if self.printed == 0 {
                "{\"packets\":[\n"
            } else {
                ",\n"
            };
            write!(out, "{sep}{}", serde_json::to_string(&p)?)?;
        } else {
            let body = match &p.body {
                Body::Ok(r) => r.line(),
                Body::Malformed { error } => format!("malformed RoCEv2 packet: {error}"),
                Body::Cut { captured, length } => {
                    format!("cut by the capture ({captured} of {length} bytes)")
                }
            };
            let prefix = p.encap.prefix();
            writeln!(out, "{:>6} {:>12.6}  {prefix}{body}", p.index, p.rel_time)?;
        }
        self.printed += 1;
        Ok(())
    }

    fn bad(&self) -> u64 {
        self.icrc_bad + self.malformed
    }

    fn finish(&self, name: &str, out: &mut impl Write) -> Result<()> {
        let sm = Summary {
            capture: name,
            frames: self.frames,
            roce_packets: self.printed,
            icrc_good: self.icrc_good,
            icrc_bad: self.icrc_bad,
            malformed: self.malformed,
            cut_by_capture: self.cut,
            gso_frames: self.gso_frames,
            not_roce: self.other.values().sum(),
            not_roce_reasons: &self.other,
            opcodes: self
                .by_opcode
                .iter()
                .map(|((_, n), c)| (n.clone(), *c))
                .collect(),
        };
        if self.json {
            let open = if self.printed == 0 {
                "{\"packets\":["
            } else {
                ""
            };
            writeln!(
                out,
                "{open}\n],\"summary\":{}}}",
                serde_json::to_string(&sm)?
            )?;
            return Ok(());
        }
        writeln!(out, "\n{name}")?;
        writeln!(
            out,
            "  {} frames: {} RoCEv2 packets, {} not RoCEv2",
            sm.frames, sm.roce_packets, sm.not_roce
        )?;
        writeln!(
            out,
            "  ICRC: {} good, {} bad; malformed: {}; cut by the capture: {}",
            sm.icrc_good, sm.icrc_bad, sm.malformed, sm.cut_by_capture
        )?;
        if sm.gso_frames > 0 {
            writeln!(
                out,
                "  offloaded (UDP GSO) frames decoded as their packets: {}",
                sm.gso_frames
            )?;
        }
        for ((code, op), n) in &self.by_opcode {
            writeln!(out, "  {code:#04x} {op:<40} {n:>6}")?;
        }
        for (why, n) in &self.other {
            writeln!(out, "  not RoCEv2: {why}: {n}")?;
        }
        Ok(())
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The IP packet inside a Linux cooked frame (a `hdr`-byte header with the
/// EtherType at `proto_at`), or nothing if it does not carry IP.
fn cooked(data: &[u8], hdr: usize, proto_at: usize) -> &[u8] {
    match (data.get(proto_at..proto_at + 2), data.get(hdr..)) {
        (Some([0x08, 0x00] | [0x86, 0xdd]), Some(ip)) => ip,
        _ => &[],
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use vrdma_wire::{
        Vni,
        encap::{Encapsulated, VxlanTunnel},
        ethernet::{EtherType, MacAddr},
        frame::{self, IpRepr},
        ipv4,
        vlan::{Tag, TaggedRepr, Tags},
    };

    use super::*;

    /// The capture built into the binary: Linux rxe frames, untagged.
    fn rxe_frames() -> Vec<Vec<u8>> {
        let mut frames = Vec::new();
        capture::for_each_frame(DEFAULT_CAPTURE, |f| frames.push(f.data.to_vec())).unwrap();
        frames
    }

    fn header(tags: &[Tag]) -> TaggedRepr {
        TaggedRepr {
            dst: MacAddr([2, 0, 0, 0, 0, 2]),
            src: MacAddr([2, 0, 0, 0, 0, 1]),
            tags: Tags::from_slice(tags).unwrap(),
            ethertype: EtherType::Ipv4,
        }
    }

    /// The untagged rxe frame `plain` behind `tags`, inside VXLAN `vni`
    /// when given.
    fn wrap(plain: &[u8], tags: &[Tag], vni: Option<u32>) -> Vec<u8> {
        let d = frame::decode_ethernet(plain).unwrap();
        let eth = d.repr.ethernet.unwrap();
        let inner = TaggedRepr {
            tags: Tags::from_slice(tags).unwrap(),
            ..TaggedRepr::from(eth)
        };
        let encap = match vni {
            None => Encapsulation::Ethernet(inner),
            Some(v) => Encapsulation::Vxlan(VxlanTunnel {
                outer: Some(header(&[])),
                ip: IpRepr::V4(ipv4::Repr {
                    src: Ipv4Addr::new(192, 0, 2, 1),
                    dst: Ipv4Addr::new(192, 0, 2, 2),
                    tos: 0,
                    ident: 7,
                    dont_frag: true,
                    ttl: 64,
                    payload_len: 0,
                }),
                src_port: 54177,
                udp_checksum: false,
                vni: Vni::try_from(v).unwrap(),
                inner,
            }),
        };
        let e = Encapsulated {
            encap,
            inner: Decoded {
                repr: frame::Repr {
                    ethernet: None,
                    ..d.repr
                },
                icrc: d.icrc,
            },
        };
        let mut out = vec![0; e.buffer_len()];
        e.emit(&mut out).unwrap();
        out
    }

    /// The text lines (and summary) `vrdma decode` prints for `frames`.
    fn text(frames: &[Vec<u8>]) -> String {
        let mut report = Report::new(false);
        let mut out = Vec::new();
        for (i, data) in frames.iter().enumerate() {
            let f = Frame {
                time: Duration::from_millis(u64::try_from(i).unwrap()),
                link: Link::Ethernet,
                data,
                orig_len: u32::try_from(data.len()).unwrap(),
            };
            report.add(&f, &mut out).unwrap();
        }
        report.finish("test", &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    /// A text line after its index (6 columns), time (12) and separators.
    fn body(line: &str) -> &str {
        line.get(21..).unwrap_or_default()
    }

    #[test]
    fn vlan_and_vxlan_frames_are_prefixed_with_their_ids() {
        let rxe = rxe_frames();
        let p = &rxe[0];
        let frames = [
            p.clone(),
            wrap(p, &[Tag::ctag(100)], None),
            wrap(p, &[Tag::stag(10), Tag::ctag(100)], None),
            wrap(p, &[], Some(5001)),
            wrap(p, &[Tag::ctag(100)], Some(5001)),
        ];
        let out = text(&frames);
        let lines: Vec<&str> = out.lines().collect();
        let plain = body(lines[0]);
        assert!(plain.starts_with("10.47.91.12 → 10.47.91.11  RC SEND_ONLY_WITH_IMMEDIATE"));
        for (line, prefix) in lines[1..5].iter().zip([
            "vlan 100  ",
            "vlan 10.100  ",
            "vni 5001  ",
            "vni 5001 vlan 100  ",
        ]) {
            assert_eq!(body(line), format!("{prefix}{plain}"), "{line}");
        }
        assert!(out.contains("5 frames: 5 RoCEv2 packets, 0 not RoCEv2"));
        assert!(out.contains("ICRC: 5 good, 0 bad; malformed: 0"));
    }

    #[test]
    fn an_untagged_line_has_no_prefix_and_no_vlan_field() {
        let rxe = rxe_frames();
        let out = text(&rxe[..1]);
        assert_eq!(
            out.lines().next().unwrap(),
            "     1     0.000000  10.47.91.12 → 10.47.91.11  RC SEND_ONLY_WITH_IMMEDIATE          \
             qp=0x000021 psn=11041294 [A]  ImmDt 0x44332211  payload=64  icrc=good"
        );
    }

    #[test]
    fn json_carries_vlans_vni_and_the_underlay_only_when_present() {
        let rxe = rxe_frames();
        let p = &rxe[0];
        let mut report = Report::new(true);
        let mut out = Vec::new();
        for (i, data) in [
            p.clone(),
            wrap(p, &[Tag::stag(10), Tag::ctag(100)], Some(0xab_cdef)),
        ]
        .iter()
        .enumerate()
        {
            let f = Frame {
                time: Duration::from_secs(u64::try_from(i).unwrap()),
                link: Link::Ethernet,
                data,
                orig_len: u32::try_from(data.len()).unwrap(),
            };
            report.add(&f, &mut out).unwrap();
        }
        report.finish("test", &mut out).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let plain = &v["packets"][0];
        for key in ["vlans", "vni", "underlay"] {
            assert!(plain.get(key).is_none(), "{key} in {plain}");
        }
        assert_eq!(plain["vlan"], serde_json::Value::Null);
        let t = &v["packets"][1];
        assert_eq!(t["vlans"], serde_json::json!([10, 100]));
        assert_eq!(t["vlan"], 100);
        assert_eq!(t["vni"], 0xab_cdef);
        assert_eq!(
            t["underlay"],
            serde_json::json!({"src": "192.0.2.1", "dst": "192.0.2.2", "src_port": 54177})
        );
        assert_eq!(t["icrc"]["good"], true);
    }

    #[test]
    fn a_malformed_packet_in_a_tunnel_shows_the_tunnel_and_the_error() {
        let rxe = rxe_frames();
        let mut bad = wrap(&rxe[0], &[Tag::ctag(100)], Some(5001));
        // BTH byte 1 of the inner packet: 50 bytes of tunnel, 18 of tagged
        // Ethernet, 20 of IPv4 and 8 of UDP in front of the BTH.
        bad[50 + 18 + 20 + 8 + 1] |= 0x01;
        let mut arp = wrap(&rxe[0], &[], Some(5001));
        arp[50 + 12..50 + 14].copy_from_slice(&[0x08, 0x06]);
        let mut flags = wrap(&rxe[0], &[], Some(5001));
        flags[42] = 0;
        let three = wrap(&rxe[0], &[Tag::ctag(1); 2], None);
        let three = [&three[..12], &[0x81, 0x00, 0x00, 0x03], &three[12..]].concat();
        let out = text(&[bad, arp, flags, three]);
        let lines: Vec<&str> = out.lines().collect();
        assert!(
            lines[0].ends_with(
                "vni 5001 vlan 100  malformed RoCEv2 packet: unsupported BTH transport \
                 version 1 (only 0 is defined)"
            ),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].ends_with(
                "malformed RoCEv2 packet: VXLAN flags 0x00 lack the I flag (0x08): no valid VNI"
            ),
            "{}",
            lines[1]
        );
        assert!(
            lines[2].ends_with(
                "malformed RoCEv2 packet: more than 2 VLAN tags: another TPID 0x8100 at byte 20"
            ),
            "{}",
            lines[2]
        );
        assert!(
            out.contains("4 frames: 3 RoCEv2 packets, 1 not RoCEv2"),
            "{out}"
        );
        assert!(out.contains("not RoCEv2: VXLAN not carrying UDP to port 4791: 1"));
    }

    #[test]
    fn prefixes_read_outermost_first() {
        let e = Encap {
            vlans: vec![100, 200],
            vni: Some(7),
            underlay: Some(Underlay {
                src: String::new(),
                dst: String::new(),
                src_port: 0,
                vlans: vec![10],
            }),
        };
        assert_eq!(e.prefix(), "vlan 10 vni 7 vlan 100.200  ");
        assert_eq!(Encap::default().prefix(), "");
    }
}
