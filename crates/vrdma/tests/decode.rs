//! `vrdma decode` end to end: the binary on real captures, on a corrupted
//! one, on files that are not captures, and on real packets behind VLAN
//! tags and inside VXLAN tunnels.

use std::{
    fs,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use serde_json::Value;
use vrdma_wire::{
    Vni,
    encap::{Encapsulated, Encapsulation, VxlanTunnel},
    frame, ipv4, vlan,
};

fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/rxe")
}

fn all_captures() -> Vec<PathBuf> {
    let mut files: Vec<_> = ["rxe", "rxe-ipv6"]
        .iter()
        .flat_map(|d| {
            fs::read_dir(testdata().join("..").join(d))
                .unwrap()
                .map(|e| e.unwrap().path())
        })
        .filter(|p| p.extension().is_some_and(|x| x == "pcap"))
        .collect();
    files.sort();
    files
}

fn vrdma(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vrdma"))
        .args(args)
        .output()
        .expect("run vrdma")
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn every_rxe_capture_decodes_with_good_icrcs_and_named_opcodes() {
    let files = all_captures();
    assert!(files.len() >= 20);
    for f in files {
        let out = vrdma(&["decode", "--json", f.to_str().unwrap()]);
        assert!(out.status.success(), "{}: {:?}", f.display(), out.status);
        let v = json(&out);
        let s = &v["summary"];
        assert_eq!(s["icrc_bad"], 0, "{}", f.display());
        assert_eq!(s["malformed"], 0, "{}", f.display());
        assert_eq!(s["not_roce"], 0, "{}", f.display());
        let packets = v["packets"].as_array().unwrap();
        assert_eq!(Some(packets.len() as u64), s["frames"].as_u64());
        for p in packets {
            assert_eq!(p["status"], "ok");
            let op = p["opcode"].as_str().unwrap();
            assert!(
                op.starts_with("RC ") || op.starts_with("UC ") || op.starts_with("UD "),
                "{op}"
            );
            assert_eq!(p["icrc"]["good"], true);
        }
        // The text form says the same in its summary.
        let text = String::from_utf8(vrdma(&["decode", f.to_str().unwrap()]).stdout).unwrap();
        assert!(
            text.contains(&format!(
                "ICRC: {} good, 0 bad; malformed: 0",
                packets.len()
            )),
            "{text}"
        );
    }
}

#[test]
fn without_a_file_the_built_in_capture_is_decoded() {
    let out = vrdma(&["decode"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("RC SEND_ONLY_WITH_IMMEDIATE"));
    assert!(text.contains("AETH RNR-NAK timer=25 (61440 us)"));
    assert!(text.contains("ImmDt 0x44332211"));
    assert!(text.contains("28 frames: 28 RoCEv2 packets"));
}

#[test]
fn a_corrupted_packet_is_reported_and_fails_the_run() {
    let mut bytes = fs::read(testdata().join("write_bw_64.pcap")).unwrap();
    // The last byte of the file is the last byte of the last packet's ICRC.
    *bytes.last_mut().unwrap() ^= 0x01;
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("corrupt-icrc.pcap");
    fs::write(&path, &bytes).unwrap();
    let out = vrdma(&["decode", "--json", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let v = json(&out);
    assert_eq!(v["summary"]["icrc_bad"], 1);
    let last = v["packets"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["icrc"]["good"], false);
    assert_ne!(last["icrc"]["found"], last["icrc"]["computed"]);
    let text = String::from_utf8(vrdma(&["decode", path.to_str().unwrap()]).stdout).unwrap();
    assert!(text.contains("icrc=BAD"), "{text}");
}

#[test]
fn a_malformed_packet_is_shown_with_its_error() {
    let mut bytes = fs::read(testdata().join("write_bw_64.pcap")).unwrap();
    // First record: 24-byte file header, 16-byte record header, then the
    // frame; the BTH starts after 14 + 20 + 8 bytes. Set TVer to 1.
    let bth = 24 + 16 + 14 + 20 + 8;
    bytes[bth + 1] |= 0x01;
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bad-tver.pcap");
    fs::write(&path, &bytes).unwrap();
    let out = vrdma(&["decode", "--json", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let v = json(&out);
    assert_eq!(v["summary"]["malformed"], 1);
    assert_eq!(v["packets"][0]["status"], "malformed");
    assert!(
        v["packets"][0]["error"]
            .as_str()
            .unwrap()
            .contains("transport version 1")
    );
}

#[test]
fn files_that_are_not_captures_fail_with_status_2() {
    let out = vrdma(&["decode", "/nonexistent/capture.pcap"]);
    assert_eq!(out.status.code(), Some(2));
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("not-a-capture.pcap");
    fs::write(&path, b"hello, this is not a pcap").unwrap();
    let out = vrdma(&["decode", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a pcap or pcapng file"));
}

/// Rewrites a classic little-endian pcap with snapshot length `snap`,
/// cutting each frame to at most `snap` bytes (as `tcpdump -s` does), and
/// applies `edit` to each frame's bytes.
fn rewrite_pcap(src: &[u8], snap: u32, mut edit: impl FnMut(usize, &mut Vec<u8>)) -> Vec<u8> {
    let mut out = src[..24].to_vec();
    out[16..20].copy_from_slice(&snap.to_le_bytes());
    let mut at = 24;
    let mut i = 0;
    while at < src.len() {
        let word = |o: usize| u32::from_le_bytes(src[at + o..at + o + 4].try_into().unwrap());
        let incl = word(8) as usize;
        let mut data = src[at + 16..at + 16 + incl].to_vec();
        edit(i, &mut data);
        let orig = data.len() as u32;
        data.truncate(snap as usize);
        out.extend_from_slice(&src[at..at + 8]);
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&orig.to_le_bytes());
        out.extend_from_slice(&data);
        at += 16 + incl;
        i += 1;
    }
    out
}

#[test]
fn frames_cut_by_a_small_snaplen_are_reported_not_failed() {
    let src = fs::read(testdata().join("write_bw_4096.pcap")).unwrap();
    let cut = rewrite_pcap(&src, 96, |_, _| {});
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("snaplen-96.pcap");
    fs::write(&path, &cut).unwrap();
    let out = vrdma(&["decode", "--json", path.to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out);
    let s = &v["summary"];
    // 20 data packets longer than 96 bytes are cut; the 5 ACKs (62 bytes)
    // fit and decode.
    assert_eq!(s["cut_by_capture"], 20);
    assert_eq!(s["icrc_good"], 5);
    assert_eq!(s["malformed"], 0);
    let first = &v["packets"][0];
    assert_eq!(first["status"], "cut");
    assert_eq!(first["captured"], 96);
}

#[test]
fn traffic_that_is_not_roce_is_counted_not_failed() {
    let src = fs::read(testdata().join("rc_pingpong_64.pcap")).unwrap();
    // Make the even frames TCP (IP protocol 6); the checksum no longer
    // matters, nothing looks further than the protocol.
    let mixed = rewrite_pcap(&src, 65535, |i, d| {
        if i % 2 == 0 {
            d[23] = 6;
        }
    });
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("mixed.pcap");
    fs::write(&path, &mixed).unwrap();
    let out = vrdma(&["decode", "--json", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0));
    let v = json(&out);
    assert_eq!(v["summary"]["not_roce"], 6);
    assert_eq!(v["summary"]["not_roce_reasons"]["not UDP to port 4791"], 6);
    assert_eq!(v["summary"]["icrc_good"], 6);
    assert_eq!(v["packets"][0]["index"], 2);
}

/// `plain` (an untagged rxe frame) behind `tags`, inside a VXLAN tunnel
/// over IPv4 with segment `vni` when given.
fn encapsulate(plain: &[u8], tags: &[vlan::Tag], vni: Option<u32>) -> Vec<u8> {
    let d = frame::decode_ethernet(plain).unwrap();
    let tenant = vlan::TaggedRepr {
        tags: vlan::Tags::from_slice(tags).unwrap(),
        ..vlan::TaggedRepr::from(d.repr.ethernet.unwrap())
    };
    let encap = match vni {
        None => Encapsulation::Ethernet(tenant),
        Some(v) => Encapsulation::Vxlan(VxlanTunnel {
            outer: Some(vlan::TaggedRepr {
                tags: vlan::Tags::NONE,
                ..tenant
            }),
            ip: frame::IpRepr::V4(ipv4::Repr {
                src: Ipv4Addr::new(192, 0, 2, 1),
                dst: Ipv4Addr::new(192, 0, 2, 2),
                tos: 0,
                ident: 1,
                dont_frag: true,
                ttl: 64,
                payload_len: 0,
            }),
            src_port: 49152,
            udp_checksum: true,
            vni: Vni::try_from(v).unwrap(),
            inner: tenant,
        }),
    };
    let e = Encapsulated {
        encap,
        inner: frame::Decoded {
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

#[test]
fn vlan_and_vxlan_frames_are_decoded_with_their_ids_as_prefix() {
    let src = fs::read(testdata().join("rc_pingpong_64.pcap")).unwrap();
    // Frames 1-2 as captured, then tagged, QinQ, in VXLAN, in VXLAN with
    // the tenant's frame tagged; frame 7 is ARP in VXLAN.
    let wrapped = rewrite_pcap(&src, 65535, |i, d| {
        *d = match i {
            2 => encapsulate(d, &[vlan::Tag::ctag(100)], None),
            3 => encapsulate(d, &[vlan::Tag::stag(10), vlan::Tag::ctag(200)], None),
            4 => encapsulate(d, &[], Some(5001)),
            5 => encapsulate(d, &[vlan::Tag::ctag(100)], Some(5001)),
            6 => {
                let mut f = encapsulate(d, &[], Some(5001));
                f[50 + 12..50 + 14].copy_from_slice(&[0x08, 0x06]);
                f
            }
            _ => return,
        };
    });
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vlan-vxlan.pcap");
    fs::write(&path, &wrapped).unwrap();

    let out = vrdma(&["decode", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    // Index, time, then the body.
    let body = |n: usize| lines[n].get(21..).unwrap();
    assert!(
        body(0).starts_with("10.47.91.12 → 10.47.91.11  RC SEND_ONLY"),
        "{text}"
    );
    assert!(
        body(1).starts_with("10.47.91.11 → 10.47.91.12  RC ACKNOWLEDGE"),
        "{text}"
    );
    assert!(
        body(2).starts_with("vlan 100  10.47.91.11 → 10.47.91.12  RC SEND_ONLY"),
        "{text}"
    );
    assert!(
        body(3).starts_with("vlan 10.200  10.47.91.12 → 10.47.91.11  RC ACK"),
        "{text}"
    );
    assert!(
        body(4).starts_with("vni 5001  10.47.91.12 → 10.47.91.11  RC SEND_ONLY"),
        "{text}"
    );
    assert!(
        body(5).starts_with("vni 5001 vlan 100  10.47.91.11 → "),
        "{text}"
    );
    assert!(
        lines[..6].iter().all(|l| l.ends_with("icrc=good")),
        "{text}"
    );
    assert!(
        text.contains("12 frames: 11 RoCEv2 packets, 1 not RoCEv2"),
        "{text}"
    );
    assert!(text.contains("not RoCEv2: VXLAN not carrying UDP to port 4791: 1"));

    let v = json(&vrdma(&["decode", "--json", path.to_str().unwrap()]));
    assert_eq!(v["summary"]["icrc_good"], 11);
    let p = &v["packets"];
    assert!(p[0].get("vlans").is_none() && p[0].get("vni").is_none());
    assert_eq!(p[2]["vlans"], serde_json::json!([100]));
    assert_eq!(p[3]["vlans"], serde_json::json!([10, 200]));
    assert_eq!(p[3]["vlan"], 200);
    assert_eq!(p[4]["vni"], 5001);
    assert_eq!(p[4]["underlay"]["dst"], "192.0.2.2");
    assert_eq!(p[5]["vlans"], serde_json::json!([100]));
    assert_eq!(p[5]["icrc"]["good"], true);
}
