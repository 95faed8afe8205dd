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
    crate::need(Header::Bth, bth::HEADER_LEN + ICRC_LEN, roce.len())?;
    let (head, tail) = roce.split_at(roce.len() - ICRC_LEN);
    compute_parts(ip_header, udp_header, head, &[], tail)
}

/// [`compute`] for a packet in pieces, as a gather send leaves it: `head`
/// (the BTH and what follows it, at least the BTH), the `middle` pieces (a
/// payload read in place), and `tail` (what remains, ending with the ICRC
/// field).
pub fn compute_parts(
    ip_header: &[u8],
    udp_header: &[u8],
    head: &[u8],
    middle: &[&[u8]],
    tail: &[u8],
) -> Result<u32> {
    let mut h = Icrc::new(ip_header, udp_header, head)?;
    for piece in middle {
        h.update(piece);
    }
    h.finish(tail)
}

/// An ICRC computed piece by piece, for a packet whose bytes are not in one
/// place (a payload a fabric reads from memory in chunks): [`Icrc::new`]
/// with the headers and the packet's first bytes, [`Icrc::update`] with
/// each piece in order, [`Icrc::finish`] with the last bytes, which end
/// with the ICRC field.
#[derive(Clone, Debug)]
pub struct Icrc {
    hasher: crc32fast::Hasher,
}

impl Icrc {
    /// Starts the ICRC of a packet sent with `ip_header` (IPv4 or IPv6,
    /// told apart by the version nibble) and `udp_header`, whose first
    /// bytes are `head` (at least the BTH).
    pub fn new(ip_header: &[u8], udp_header: &[u8], head: &[u8]) -> Result<Self> {
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
        crate::need(Header::Bth, bth::HEADER_LEN, head.len())?;

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
        b.copy_from_slice(&head[..bth::HEADER_LEN]);
        b[bth::ICRC_MASKED_BYTE] = 0xff;
        at += bth::HEADER_LEN;

        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&buf[..at]);
        hasher.update(&head[bth::HEADER_LEN..]);
        Ok(Icrc { hasher })
    }

    /// The next bytes of the packet.
    pub fn update(&mut self, bytes: &[u8]) {
        self.hasher.update(bytes);
    }

    /// The packet's last bytes, `tail`, ending with the ICRC field (not
    /// covered): the ICRC.
    pub fn finish(mut self, tail: &[u8]) -> Result<u32> {
        crate::need(Header::Bth, ICRC_LEN, tail.len())?;
        self.hasher.update(&tail[..tail.len() - ICRC_LEN]);
        Ok(self.hasher.finalize())
    }
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

/// Verifies the ICRC of an IPv4 packet whose Identification field the
/// receiver cannot see, and recovers it.
///
/// A fabric that receives through a UDP socket learns the addresses, the
/// TOS and the TTL of a datagram, but not its IPv4 Identification, which
/// the ICRC covers (IBTA Annex A17 masks only TOS, TTL and the checksum).
/// Linux rxe varies it from packet to packet. The CRC is affine, so a
/// received ICRC that differs from the one computed with Identification 0
/// differs by exactly the CRC of the Identification bits, shifted by the
/// bytes that follow them: `D = ID(x) · x^(32 + 8k) mod P`. Multiplying `D`
/// by `x^-(32 + 8k)` gives back `ID(x)`; when the result is not a 16-bit
/// polynomial no Identification explains the ICRC and the packet is
/// corrupt.
///
/// `ip_header` is the 20-byte header the socket's metadata describes, its
/// Identification ignored; on success it holds the recovered value. This
/// check is weaker than a full ICRC: of the ICRC's 32 bits, 16 are spent
/// on the unknown field, so a random corruption of the rest of the packet
/// passes with probability 2^-16 rather than 2^-32 (a receiver that reads
/// whole IP packets verifies with [`verify`] instead).
pub fn verify_ipv4_recover_ident(
    ip_header: &mut [u8],
    udp_header: &[u8],
    roce: &[u8],
) -> Result<u16> {
    if ip_header.len() != crate::ipv4::HEADER_LEN || ip_header[0] != 0x45 {
        return Err(Error::BadIpv4HeaderLen(
            ip_header.first().map_or(0, |b| b & 0x0f),
        ));
    }
    ip_header[4..6].fill(0);
    let computed = compute(ip_header, udp_header, roce)?;
    let found = stored(roce);
    if found == computed || cfg!(fuzzing) {
        return Ok(0);
    }
    // The bytes hashed after the Identification: the rest of the IP
    // header (14), the UDP header and the RoCE packet without its ICRC.
    let after = (crate::ipv4::HEADER_LEN - 6) + udp::HEADER_LEN + roce.len() - ICRC_LEN;
    let id = gf2::mul(found ^ computed, gf2::unshift(after));
    if id & 0xffff != 0 {
        return Err(Error::BadIcrc { found, computed });
    }
    // The register holds the field's two bytes least significant first
    // (bit 16 is the first byte's first bit, as the CRC reads it).
    let [b0, b1] = ((id >> 16) as u16).to_le_bytes();
    ip_header[4] = b0;
    ip_header[5] = b1;
    Ok(u16::from_be_bytes([b0, b1]))
}

/// Arithmetic on polynomials over GF(2) modulo the CRC-32 polynomial, in
/// the reflected representation the CRC register uses (bit 31 is x^0, bit
/// 0 is x^31). Written by hand: crc32fast offers combining of CRCs but not
/// the inverse powers of x needed to undo a shift.
mod gf2 {
    /// The CRC-32 polynomial without its x^32 term, reflected.
    const POLY: u32 = 0xedb8_8320;
    /// x^0.
    const ONE: u32 = 1 << 31;
    /// x^-1 = (P(x) + 1) / x: P's terms each one degree down (x^32
    /// becomes x^31, bit 0) and its x^0 term gone.
    const X_INV: u32 = (POLY << 1) | 1;

    /// a · b mod P.
    pub(super) const fn mul(a: u32, mut b: u32) -> u32 {
        let mut p = 0;
        let mut m = ONE;
        while m != 0 {
            if a & m != 0 {
                p ^= b;
            }
            m >>= 1;
            // b · x: one degree up, reducing x^32.
            b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        }
        p
    }

    /// Packets up to this many bytes after the Identification (a 4096-byte
    /// MTU's packets with every header) find their factor in [`UNSHIFT`].
    const TABLE_LEN: usize = 4400;

    /// `UNSHIFT[a]` = x^-(32 + 8a): what undoes the shift of a field
    /// followed by `a` bytes and the 32-bit register. Built at compile
    /// time, one multiplication per entry.
    static UNSHIFT: [u32; TABLE_LEN] = {
        let mut t = [0u32; TABLE_LEN];
        t[0] = x_pow_neg(32);
        let step = x_pow_neg(8);
        let mut a = 1;
        while a < TABLE_LEN {
            t[a] = mul(t[a - 1], step);
            a += 1;
        }
        t
    };

    /// x^-(32 + 8·after): one table lookup for packets the device can
    /// receive, by squaring beyond.
    pub(super) fn unshift(after: usize) -> u32 {
        match UNSHIFT.get(after) {
            Some(&f) => f,
            None => x_pow_neg(32 + 8 * after as u64),
        }
    }

    /// x^-n mod P, by squaring.
    pub(super) const fn x_pow_neg(mut n: u64) -> u32 {
        let mut result = ONE;
        let mut base = X_INV;
        while n != 0 {
            if n & 1 != 0 {
                result = mul(result, base);
            }
            base = mul(base, base);
            n >>= 1;
        }
        result
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_table_is_the_powers() {
            for a in [0, 1, 2, 100, TABLE_LEN - 1, TABLE_LEN, TABLE_LEN + 77] {
                assert_eq!(unshift(a), x_pow_neg(32 + 8 * a as u64), "{a}");
            }
        }

        #[test]
        fn x_inverse_times_x_is_one() {
            let x = ONE >> 1;
            assert_eq!(mul(X_INV, x), ONE);
            assert_eq!(mul(x_pow_neg(40), mul(x_pow_neg(0), ONE)), x_pow_neg(40));
            // x^-3 · x · x · x = 1
            assert_eq!(mul(mul(mul(x_pow_neg(3), x), x), x), ONE);
        }
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
    fn a_packet_in_pieces_has_the_icrc_of_the_whole() {
        // A WRITE-sized packet: the captured BTH, then payload and ICRC.
        let mut roce = ROCE[..12].to_vec();
        roce.extend((0..1000u32).map(|i| (i * 7 + 3) as u8));
        roce.extend([0; 4]);
        let whole = compute(&IP, &UDP, &roce).unwrap();
        let n = roce.len();
        for head in [12, 13, 40, 512, n - 4] {
            for cut in [head, head + 1, (head + n - 4) / 2, n - 4] {
                let cut = cut.min(n - 4);
                let (a, rest) = roce.split_at(head);
                let (b, c) = rest.split_at(cut - head);
                // The middle as one piece, as two, or none.
                let (b1, b2) = b.split_at(b.len() / 2);
                assert_eq!(compute_parts(&IP, &UDP, a, &[b], c), Ok(whole));
                assert_eq!(compute_parts(&IP, &UDP, a, &[b1, b2], c), Ok(whole));
                if b.is_empty() {
                    assert_eq!(compute_parts(&IP, &UDP, a, &[], c), Ok(whole));
                }
            }
        }
        // The pieces must hold a BTH in front and an ICRC behind.
        assert!(
            compute_parts(&IP, &UDP, &roce[..11], &[&roce[11..n - 4]], &roce[n - 4..]).is_err()
        );
        assert!(
            compute_parts(&IP, &UDP, &roce[..12], &[&roce[12..n - 3]], &roce[n - 3..]).is_err()
        );
    }

    #[test]
    fn ident_is_recovered_from_the_icrc() {
        // The captured rxe ACK had Identification 0xf90e.
        let mut ip = IP;
        ip[4] = 0;
        ip[5] = 0;
        assert_eq!(verify_ipv4_recover_ident(&mut ip, &UDP, &ROCE), Ok(0xf90e));
        assert_eq!(ip, IP);
        // Every Identification, over a longer packet.
        let mut roce = vec![0u8; 1040];
        roce[..16].copy_from_slice(&ROCE[..16]);
        for (i, b) in roce[16..1036].iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        let mut udp = UDP;
        udp[4..6].copy_from_slice(&(8 + roce.len() as u16).to_be_bytes());
        for id in (0..=u16::MAX).step_by(97).chain([u16::MAX, 1, 0x8000]) {
            let mut sent = IP;
            sent[4..6].copy_from_slice(&id.to_be_bytes());
            let crc = compute(&sent, &udp, &roce).unwrap();
            let n = roce.len();
            roce[n - 4..].copy_from_slice(&crc.to_le_bytes());
            let mut seen = IP;
            seen[4..6].copy_from_slice(&[0x55, 0xaa]); // whatever was there
            assert_eq!(verify_ipv4_recover_ident(&mut seen, &udp, &roce), Ok(id));
            assert_eq!(seen, sent);
        }
    }

    #[test]
    fn corruption_is_not_explained_by_an_ident() {
        let mut rejected = 0;
        let mut tried = 0;
        for at in 0..ROCE.len() - 4 {
            if at == 4 {
                continue; // the masked BTH byte
            }
            for bit in 0..8 {
                let mut bad = ROCE;
                bad[at] ^= 1 << bit;
                let mut ip = IP;
                tried += 1;
                if matches!(
                    verify_ipv4_recover_ident(&mut ip, &UDP, &bad),
                    Err(Error::BadIcrc { .. })
                ) {
                    rejected += 1;
                }
            }
        }
        // In this packet no single flipped bit is explained by some
        // Identification (in general one in 2^16 random corruptions is).
        assert_eq!(rejected, tried);
        let mut not_v4 = [0u8; 40];
        not_v4[0] = 0x60;
        assert_eq!(
            verify_ipv4_recover_ident(&mut not_v4, &UDP, &ROCE),
            Err(Error::BadIpv4HeaderLen(0))
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
