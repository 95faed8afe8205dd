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

use crate::{Error, Header, Result, bth, ipv6, packet::ICRC_LEN, udp};

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
        4 => {
            // The slice must be exactly the header its IHL describes.
            let ihl = ip_header[0] & 0x0f;
            if ihl < 5 || usize::from(ihl) * 4 != ip_len {
                return Err(Error::BadIpv4HeaderLen(ihl));
            }
        }
        6 if ip_len == ipv6::HEADER_LEN => {}
        6 => {
            return Err(Error::BadLength {
                header: Header::Ipv6,
                stated: ipv6::HEADER_LEN,
                available: ip_len,
            });
        }
        v => return Err(Error::BadIpVersion(v, 4)),
    }
    if udp_header.len() != udp::HEADER_LEN {
        return Err(Error::BadLength {
            header: Header::Udp,
            stated: udp::HEADER_LEN,
            available: udp_header.len(),
        });
    }
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
    u.copy_from_slice(udp_header);
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

#[cfg(test)]
mod tests {
    use super::*;

    // rc_pingpong_64.pcap frame 2 (rxe ACK): IPv4 header, UDP header, RoCE.
    const IP: [u8; 20] = [
        0x45, 0x00, 0x00, 0x30, 0xf9, 0x0e, 0x40, 0x00, 0x40, 0x11, 0x77, 0x39, 0x0a, 0x2f, 0x5b,
        0x0b, 0x0a, 0x2f, 0x5b, 0x0c,
    ];
    const UDP: [u8; 8] = [0xc1, 0x43, 0x12, 0xb7, 0x00, 0x1c, 0x00, 0x00];
    const ROCE: [u8; 20] = [
        0x11, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x00, 0x2b, 0xfb, 0x3c, 0x1f, 0x00, 0x00,
        0x01, 0x01, 0x67, 0xae, 0xcb,
    ];

    #[test]
    fn known_answer_and_verify() {
        assert_eq!(compute(&IP, &UDP, &ROCE), Ok(0xcbae_6701));
        assert_eq!(stored(&ROCE), 0xcbae_6701);
        assert_eq!(verify(&IP, &UDP, &ROCE), Ok(()));
        let mut bad = ROCE;
        bad[15] ^= 1;
        assert_eq!(
            verify(&IP, &UDP, &bad),
            Err(Error::BadIcrc {
                found: 0xcbae_6701,
                computed: compute(&IP, &UDP, &bad).unwrap()
            })
        );
    }

    #[test]
    fn inconsistent_headers_are_rejected() {
        let mut ihl6 = IP;
        ihl6[0] = 0x46;
        assert_eq!(compute(&ihl6, &UDP, &ROCE), Err(Error::BadIpv4HeaderLen(6)));
        assert_eq!(
            compute(&IP[..19], &UDP, &ROCE),
            Err(Error::BadIpv4HeaderLen(5))
        );
        assert_eq!(
            compute(&[0x60; 39], &UDP, &ROCE),
            Err(Error::BadLength {
                header: Header::Ipv6,
                stated: 40,
                available: 39
            })
        );
        assert_eq!(compute(&[], &UDP, &ROCE), Err(Error::BadIpVersion(0, 4)));
        assert_eq!(
            compute(&IP, &[0; 9], &ROCE),
            Err(Error::BadLength {
                header: Header::Udp,
                stated: 8,
                available: 9
            })
        );
        assert_eq!(
            compute(&IP, &UDP, &ROCE[..15]),
            Err(Error::Truncated {
                header: Header::Bth,
                needed: 16,
                available: 15
            })
        );
    }
}
