//! `vrdma decode`: RoCEv2 packets of a capture, one line (or one JSON
//! object) each, then a summary.

use std::{collections::BTreeMap, fmt::Write as _, fs, process::ExitCode, time::Duration};

use anyhow::{Context, Result};
use serde::Serialize;
use vrdma_wire::{
    Error as WireError,
    aeth::Syndrome,
    frame::{self, Decoded},
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
    let (name, bytes) = match &a.file {
        Some(p) => (
            p.display().to_string(),
            fs::read(p).with_context(|| format!("reading {}", p.display()))?,
        ),
        None => (DEFAULT_NAME.to_owned(), DEFAULT_CAPTURE.to_vec()),
    };
    let mut report = Report::default();
    let read = capture::for_each_frame(&bytes, |f| report.add(&f));
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report.json(&name))?);
    } else {
        print!("{}", report.text(&name));
    }
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
    body: Body,
}

#[derive(Debug, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
enum Body {
    Ok(Box<Roce>),
    Malformed { error: String },
}

#[derive(Debug, Serialize)]
struct Roce {
    src: String,
    dst: String,
    src_port: u16,
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
    fn new(d: &Decoded<'_>) -> Self {
        let r = &d.repr;
        let b = &r.roce.bth;
        let e = &r.roce.ext;
        Roce {
            src: r.ip.src().to_string(),
            dst: r.ip.dst().to_string(),
            src_port: r.udp.src_port,
            vlan: r.ethernet.and_then(|e| e.vlan).map(|v| v.vid),
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
        if let Some(v) = self.vlan {
            let _ = write!(s, " vlan={v}");
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
            let what = match (h.kind, h.credits, h.rnr_timer, h.nak) {
                ("ack", Some(c), _, _) => format!("ACK credits={c}"),
                ("ack", None, _, _) => "ACK credits=invalid".to_owned(),
                ("rnr_nak", _, Some(t), _) => format!(
                    "RNR-NAK timer={t} ({} us)",
                    h.rnr_delay_us.unwrap_or_default()
                ),
                (_, _, _, Some(n)) => format!("NAK {n}"),
                _ => format!("syndrome={:#04x}", h.syndrome),
            };
            let _ = write!(s, "  AETH {what} msn={}", h.msn);
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

/// Everything seen in a capture.
#[derive(Debug, Default)]
struct Report {
    frames: u64,
    first: Option<Duration>,
    packets: Vec<Packet>,
    /// Frames that are not RoCEv2 at all, by reason.
    other: BTreeMap<String, u64>,
    by_opcode: BTreeMap<(u8, String), u64>,
    icrc_good: u64,
    icrc_bad: u64,
    malformed: u64,
}

#[derive(Serialize)]
struct Summary<'a> {
    capture: &'a str,
    frames: u64,
    roce_packets: usize,
    icrc_good: u64,
    icrc_bad: u64,
    malformed: u64,
    not_roce: u64,
    not_roce_reasons: &'a BTreeMap<String, u64>,
    opcodes: BTreeMap<String, u64>,
}

#[derive(Serialize)]
struct Json<'a> {
    packets: &'a [Packet],
    summary: Summary<'a>,
}

impl Report {
    fn add(&mut self, f: &Frame<'_>) {
        self.frames += 1;
        let first = *self.first.get_or_insert(f.time);
        let decoded = match f.link {
            Link::Ethernet => frame::decode_ethernet(f.data),
            Link::Ip => frame::decode_ip(f.data),
            Link::LinuxSll => cooked(f.data, 16, 14),
            Link::LinuxSll2 => cooked(f.data, 20, 0),
            Link::Other(t) => {
                *self.other.entry(format!("link type {t}")).or_default() += 1;
                return;
            }
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
                Body::Ok(Box::new(Roce::new(&d)))
            }
            Err(e) if !is_roce(&e) => {
                *self.other.entry(e.to_string()).or_default() += 1;
                return;
            }
            Err(e) => {
                self.malformed += 1;
                Body::Malformed {
                    error: e.to_string(),
                }
            }
        };
        self.packets.push(Packet {
            index: self.frames,
            time: f.time.as_secs_f64(),
            rel_time: f.time.saturating_sub(first).as_secs_f64(),
            body,
        });
    }

    fn bad(&self) -> u64 {
        self.icrc_bad + self.malformed
    }

    fn summary<'a>(&'a self, name: &'a str) -> Summary<'a> {
        Summary {
            capture: name,
            frames: self.frames,
            roce_packets: self.packets.len(),
            icrc_good: self.icrc_good,
            icrc_bad: self.icrc_bad,
            malformed: self.malformed,
            not_roce: self.other.values().sum(),
            not_roce_reasons: &self.other,
            opcodes: self
                .by_opcode
                .iter()
                .map(|((_, n), c)| (n.clone(), *c))
                .collect(),
        }
    }

    fn json<'a>(&'a self, name: &'a str) -> Json<'a> {
        Json {
            packets: &self.packets,
            summary: self.summary(name),
        }
    }

    fn text(&self, name: &str) -> String {
        let mut s = String::new();
        for p in &self.packets {
            let body = match &p.body {
                Body::Ok(r) => r.line(),
                Body::Malformed { error } => format!("malformed RoCEv2 packet: {error}"),
            };
            let _ = writeln!(s, "{:>6} {:>12.6}  {body}", p.index, p.rel_time);
        }
        let sm = self.summary(name);
        let _ = writeln!(s, "\n{name}");
        let _ = writeln!(
            s,
            "  {} frames: {} RoCEv2 packets, {} not RoCEv2",
            sm.frames, sm.roce_packets, sm.not_roce
        );
        let _ = writeln!(
            s,
            "  ICRC: {} good, {} bad; malformed: {}",
            sm.icrc_good, sm.icrc_bad, sm.malformed
        );
        for ((code, op), n) in &self.by_opcode {
            let _ = writeln!(s, "  {code:#04x} {op:<40} {n:>6}");
        }
        for (why, n) in &self.other {
            let _ = writeln!(s, "  not RoCEv2: {why}: {n}");
        }
        s
    }
}

/// Decodes a Linux cooked capture: a `hdr`-byte header with the EtherType
/// at `proto_at`.
fn cooked(data: &[u8], hdr: usize, proto_at: usize) -> Result<Decoded<'_>, WireError> {
    let (Some(p), Some(rest)) = (data.get(proto_at..proto_at + 2), data.get(hdr..)) else {
        return Err(WireError::Truncated {
            header: vrdma_wire::Header::Ethernet,
            needed: hdr,
            available: data.len(),
        });
    };
    match u16::from_be_bytes([p[0], p[1]]) {
        0x0800 | 0x86dd => frame::decode_ip(rest),
        other => Err(WireError::UnsupportedEtherType(other)),
    }
}

/// True for errors of packets that were addressed to RoCEv2 (UDP port
/// 4791) and so count as malformed; false for traffic that is simply
/// something else.
fn is_roce(e: &WireError) -> bool {
    !matches!(
        e,
        WireError::UnsupportedEtherType(_)
            | WireError::NotUdp(_)
            | WireError::NotRoce(_)
            | WireError::Fragmented { .. }
    )
}
