//! The invariant CRC of a RoCEv2 packet (IBTA Annex A17.8.1).
//!
//! The ICRC is CRC-32 (the Ethernet/zlib polynomial, initial value and final
//! complement) over: eight bytes of ones standing in for the InfiniBand LRH;
//! the IP header with its variant fields set to ones (IPv4: type of
//! service, TTL, header checksum; IPv6: traffic class, flow label, hop
//! limit); the UDP header with its checksum set to ones; the BTH with its
//! byte 4 (FECN, BECN, reserved) set to ones; and everything after the BTH
//! up to the ICRC itself. It is stored least significant byte first.
//!
//! The masked headers are copied to a small stack buffer; the payload is
//! hashed in place. `crc32fast` supplies the CRC (SIMD where available).

use crate::{Error, Header, Result, bth, packet::ICRC_LEN, udp};

/// Longest IP header that can precede a RoCE packet (IPv4 with options).
const MAX_IP_HEADER: usize = 60;
/// Stand-in for the LRH: eight bytes of ones.
const LRH_ONES: usize = 8;

/// Computes the ICRC over `ip_header` (IPv4 or IPv6, told apart by the
/// version nibble), `udp_header` and `roce` (BTH through the ICRC field;
/// the field's own four bytes are not covered).
pub fn compute(ip_header: &[u8], udp_header: &[u8], roce: &[u8]) -> Result<u32> {
    let version = ip_header.first().map_or(0, |b| b >> 4);
    let ip_len = ip_header.len();
    match version {
        4 if (20..=MAX_IP_HEADER).contains(&ip_len) => {}
        6 if ip_len == 40 => {}
        4 => {
            return Err(Error::BadIpv4HeaderLen(
                u8::try_from(ip_len / 4).unwrap_or(u8::MAX),
            ));
        }
        6 => {
            return Err(Error::BadLength {
                header: Header::Ipv6,
                stated: 40,
                available: ip_len,
            });
        }
        v => return Err(Error::BadIpVersion(v, 4)),
    }
    crate::need(Header::Udp, udp::HEADER_LEN, udp_header.len())?;
    crate::need(Header::Bth, bth::HEADER_LEN + ICRC_LEN, roce.len())?;

    let mut buf = [0u8; LRH_ONES + MAX_IP_HEADER + udp::HEADER_LEN + bth::HEADER_LEN];
    buf[..LRH_ONES].fill(0xff);
    let mut at = LRH_ONES;

    let ip = &mut buf[at..at + ip_len];
    ip.copy_from_slice(ip_header);
    if version == 4 {
        ip[1] = 0xff; // type of service (DSCP + ECN)
        ip[8] = 0xff; // TTL
        ip[10] = 0xff; // header checksum
        ip[11] = 0xff;
    } else {
        ip[0] |= 0x0f; // traffic class, high nibble
        ip[1] = 0xff; // traffic class, low nibble; flow label
        ip[2] = 0xff;
        ip[3] = 0xff;
        ip[7] = 0xff; // hop limit
    }
    at += ip_len;

    let u = &mut buf[at..at + udp::HEADER_LEN];
    u.copy_from_slice(&udp_header[..udp::HEADER_LEN]);
    u[6] = 0xff; // checksum
    u[7] = 0xff;
    at += udp::HEADER_LEN;

    let b = &mut buf[at..at + bth::HEADER_LEN];
    b.copy_from_slice(&roce[..bth::HEADER_LEN]);
    b[bth::ICRC_MASKED_BYTE] = 0xff;
    at += bth::HEADER_LEN;

    let mut h = crc32fast::Hasher::new();
    h.update(&buf[..at]);
    h.update(&roce[bth::HEADER_LEN..roce.len() - ICRC_LEN]);
    Ok(h.finalize())
}

/// Verifies the ICRC stored at the end of `roce`.
///
/// Under `cfg(fuzzing)` the comparison always succeeds (the CRC is still
/// computed), so that fuzzers reach the code behind the check.
pub fn verify(ip_header: &[u8], udp_header: &[u8], roce: &[u8]) -> Result<()> {
    let computed = compute(ip_header, udp_header, roce)?;
    let found = stored(roce);
    if found == computed || cfg!(fuzzing) {
        Ok(())
    } else {
        Err(Error::BadIcrc { found, computed })
    }
}

/// The ICRC stored at the end of `roce` (zero if too short to hold one).
pub fn stored(roce: &[u8]) -> u32 {
    crate::packet::Packet::new_unchecked(roce)
        .icrc()
        .unwrap_or(0)
}
