//! `vrdma decode`: RoCEv2 packets of a capture, one line (or one JSON
//! object) each, then a summary.

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
use vrdma_wire::{
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
        if write_err.is_none()
            && let Err(e) = report.add(&f, &mut out)
        {
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
    body: Body,
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
        if frame::peek_udp_dst_port(data, ethernet) != Some(vrdma_wire::ROCEV2_UDP_PORT) {
            *self
                .other
                .entry("not UDP to port 4791".to_owned())
                .or_default() += 1;
            return Ok(());
        }
        let decoded = if ethernet {
            frame::decode_ethernet(data)
        } else {
            frame::decode_ip(data)
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
            writeln!(out, "{:>6} {:>12.6}  {body}", p.index, p.rel_time)?;
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
        for ((code, op), n) in &self.by_opcode {
            writeln!(out, "  {code:#04x} {op:<40} {n:>6}")?;
        }
        for (why, n) in &self.other {
            writeln!(out, "  not RoCEv2: {why}: {n}")?;
        }
        Ok(())
    }
}

/// The IP packet inside a Linux cooked frame (a `hdr`-byte header with the
/// EtherType at `proto_at`), or nothing if it does not carry IP.
fn cooked(data: &[u8], hdr: usize, proto_at: usize) -> &[u8] {
    match (data.get(proto_at..proto_at + 2), data.get(hdr..)) {
        (Some([0x08, 0x00] | [0x86, 0xdd]), Some(ip)) => ip,
        _ => &[],
    }
}
