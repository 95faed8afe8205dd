//! A whole RoCE packet as it travels in a UDP datagram: BTH, the extension
//! headers its opcode requires (IBTA Vol1 §9.2, in that order), the
//! payload, 0–3 pad bytes (BTH PadCnt) and the 4-byte ICRC.
//!
//! The ICRC covers the IP and UDP headers too, so it is computed and
//! verified one level up, in [`crate::frame`] (or with [`crate::icrc`]
//! directly when the IP/UDP headers come from a socket).

use crate::{
    Error, Header, MAX_PAYLOAD, Opcode, Result, aeth, atomic, bth, deth, ieth, immdt,
    opcode::HeaderSet, reth,
};

/// Length of the ICRC trailer.
pub const ICRC_LEN: usize = 4;
/// The shortest possible RoCE packet: BTH and ICRC.
pub const MIN_LEN: usize = bth::HEADER_LEN + ICRC_LEN;
/// The longest RoCE packet of the RC, UC and UD opcodes: BTH, the longest
/// set of extension headers (AtomicETH, 28 bytes; RETH with ImmDt is 20),
/// a 4096-byte payload (padding is part of it), ICRC.
pub const MAX_LEN: usize = bth::HEADER_LEN + 28 + MAX_PAYLOAD + ICRC_LEN;

/// A checked view over a RoCE packet (the UDP payload).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

/// Where the parts of a checked packet lie.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
struct Layout {
    opcode: Opcode,
    /// Offset of the payload (end of the extension headers).
    payload: usize,
    /// Payload length without pad.
    payload_len: usize,
    /// Offset of the ICRC.
    icrc: usize,
}

fn layout(d: &[u8]) -> Result<Layout> {
    crate::need(Header::Bth, bth::HEADER_LEN, d.len())?;
    let b = bth::Packet::new_unchecked(d);
    let opcode = Opcode::try_from(b.opcode_raw())?;
    let at = bth::HEADER_LEN + opcode.info().header_len;
    if d.len() < at + ICRC_LEN {
        // Name the first part that is cut off.
        let headers = opcode.headers();
        let mut at = bth::HEADER_LEN;
        for (bit, header, len) in HeaderSet::ORDER {
            if headers.contains(bit) {
                crate::need(header, at + len, d.len())?;
                at += len;
            }
        }
        crate::need(Header::Icrc, at + ICRC_LEN, d.len())?;
    }
    let icrc = d.len() - ICRC_LEN;
    let area = icrc - at;
    let pad = usize::from(b.pad_cnt());
    let bad_pad = Error::BadPadCnt {
        opcode,
        pad_cnt: b.pad_cnt(),
        area,
    };
    if !opcode.has_payload() {
        if area != 0 {
            return Err(Error::UnexpectedPayload { opcode, len: area });
        }
        if pad != 0 {
            return Err(bad_pad);
        }
    } else {
        if pad > area {
            return Err(bad_pad);
        }
        if !area.is_multiple_of(4) {
            return Err(Error::UnalignedPayload { len: area });
        }
        if area - pad > MAX_PAYLOAD {
            return Err(Error::PayloadTooLong {
                len: area - pad,
                max: MAX_PAYLOAD,
            });
        }
    }
    Ok(Layout {
        opcode,
        payload: at,
        payload_len: area - pad,
        icrc,
    })
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps `buffer` without checks. Until [`Self::check_len`] succeeds the
    /// BTH view's accessors may panic on a short buffer (as every view's
    /// do); the extension-header, payload and ICRC accessors never panic and
    /// return `None` or empty for parts they cannot find.
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wraps `buffer` after [`Self::check_len`].
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// Checks that the opcode is known, that every header it requires and
    /// the ICRC are present, and that PadCnt and the payload length are
    /// consistent with the opcode.
    pub fn check_len(&self) -> Result<()> {
        layout(self.buffer.as_ref()).map(|_| ())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The BTH (a view of the first 12 bytes).
    pub fn bth(&self) -> bth::Packet<&[u8]> {
        bth::Packet::new_unchecked(self.buffer.as_ref())
    }

    /// Bytes of the extension header `which`, if the opcode carries it.
    fn ext(&self, which: HeaderSet) -> Option<&[u8]> {
        let d = self.buffer.as_ref();
        let headers = Opcode::try_from(*d.first()?).ok()?.headers();
        if !headers.contains(which) {
            return None;
        }
        let mut at = bth::HEADER_LEN;
        for (bit, _, len) in HeaderSet::ORDER {
            if bit == which {
                return d.get(at..at + len);
            }
            if headers.contains(bit) {
                at += len;
            }
        }
        None
    }

    pub fn deth(&self) -> Option<deth::Packet<&[u8]>> {
        self.ext(HeaderSet::DETH).map(deth::Packet::new_unchecked)
    }
    pub fn reth(&self) -> Option<reth::Packet<&[u8]>> {
        self.ext(HeaderSet::RETH).map(reth::Packet::new_unchecked)
    }
    pub fn atomic_eth(&self) -> Option<atomic::eth::Packet<&[u8]>> {
        self.ext(HeaderSet::ATOMIC_ETH)
            .map(atomic::eth::Packet::new_unchecked)
    }
    pub fn aeth(&self) -> Option<aeth::Packet<&[u8]>> {
        self.ext(HeaderSet::AETH).map(aeth::Packet::new_unchecked)
    }
    pub fn atomic_ack_eth(&self) -> Option<atomic::ack::Packet<&[u8]>> {
        self.ext(HeaderSet::ATOMIC_ACK_ETH)
            .map(atomic::ack::Packet::new_unchecked)
    }
    pub fn immdt(&self) -> Option<immdt::Packet<&[u8]>> {
        self.ext(HeaderSet::IMMDT).map(immdt::Packet::new_unchecked)
    }
    pub fn ieth(&self) -> Option<ieth::Packet<&[u8]>> {
        self.ext(HeaderSet::IETH).map(ieth::Packet::new_unchecked)
    }

    /// The payload without pad (empty if the packet does not check).
    pub fn payload(&self) -> &[u8] {
        let d = self.buffer.as_ref();
        match layout(d) {
            Ok(l) => &d[l.payload..l.payload + l.payload_len],
            Err(_) => &[],
        }
    }

    /// The ICRC as stored (the last four bytes, least significant first), or
    /// `None` for a buffer too short to hold one.
    pub fn icrc(&self) -> Option<u32> {
        let d = self.buffer.as_ref();
        let at = d.len().checked_sub(ICRC_LEN)?;
        let mut b = [0; ICRC_LEN];
        b.copy_from_slice(&d[at..]);
        Some(u32::from_le_bytes(b))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Stores the ICRC in the last four bytes (least significant first).
    /// Does nothing to a buffer too short to hold one.
    pub fn set_icrc(&mut self, icrc: u32) {
        let d = self.buffer.as_mut();
        if let Some(at) = d.len().checked_sub(ICRC_LEN) {
            d[at..].copy_from_slice(&icrc.to_le_bytes());
        }
    }
}

/// The extension headers of a packet; which are present is fixed by the
/// opcode.
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct ExtHeaders {
    pub deth: Option<deth::Repr>,
    pub reth: Option<reth::Repr>,
    pub atomic_eth: Option<atomic::eth::Repr>,
    pub aeth: Option<aeth::Repr>,
    pub atomic_ack_eth: Option<atomic::ack::Repr>,
    pub immdt: Option<immdt::Repr>,
    pub ieth: Option<ieth::Repr>,
}

impl ExtHeaders {
    /// Which headers are present.
    pub fn set(&self) -> HeaderSet {
        let mut s = HeaderSet::NONE;
        let flags = [
            (self.deth.is_some(), HeaderSet::DETH),
            (self.reth.is_some(), HeaderSet::RETH),
            (self.atomic_eth.is_some(), HeaderSet::ATOMIC_ETH),
            (self.aeth.is_some(), HeaderSet::AETH),
            (self.atomic_ack_eth.is_some(), HeaderSet::ATOMIC_ACK_ETH),
            (self.immdt.is_some(), HeaderSet::IMMDT),
            (self.ieth.is_some(), HeaderSet::IETH),
        ];
        for (present, bit) in flags {
            if present {
                s = s.with(bit);
            }
        }
        s
    }
}

/// The meaning of a RoCE packet.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct Repr<'a> {
    /// The BTH. On emit, `pad_cnt` is recomputed from the payload length.
    pub bth: bth::Repr,
    pub ext: ExtHeaders,
    /// The payload, without pad.
    pub payload: &'a [u8],
}

impl<'a> Repr<'a> {
    /// A packet with `bth.pad_cnt` set to what `payload` needs (so that it
    /// compares equal to the packet parsed back).
    pub fn new(bth: bth::Repr, ext: ExtHeaders, payload: &'a [u8]) -> Self {
        let mut r = Self { bth, ext, payload };
        // pad_len() < 4.
        r.bth.pad_cnt = r.pad_len() as u8;
        r
    }

    /// Parses a packet: layout checks, then every header. The ICRC is not
    /// verified here (it needs the IP and UDP headers).
    // Always inlined: the engine's receive path calls it from two places,
    // and an outlined parse returns its large result through memory (a
    // fifth of a 64-byte SEND's engine time, measured).
    #[inline(always)]
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&'a T>) -> Result<Self> {
        let d: &'a [u8] = p.buffer.as_ref();
        let l = layout(d)?;
        let b = bth::Packet::new_unchecked(d);
        if b.tver() != bth::TVER {
            return Err(Error::BadTver(b.tver()));
        }
        let bth = bth::Repr {
            opcode: l.opcode,
            solicited: b.solicited(),
            mig_req: b.mig_req(),
            pad_cnt: b.pad_cnt(),
            pkey: b.pkey(),
            fecn: b.fecn(),
            becn: b.becn(),
            dest_qp: b.dest_qp(),
            ack_req: b.ack_req(),
            psn: b.psn(),
        };
        let mut ext = ExtHeaders::default();
        let headers = l.opcode.headers();
        let mut at = bth::HEADER_LEN;
        // Straight through the headers in wire order; `layout` checked they
        // are all there.
        macro_rules! take {
            ($bit:expr, $field:ident, $module:path, $len:expr) => {
                if headers.contains($bit) {
                    use $module as m;
                    let h = &d[at..at + $len];
                    ext.$field = Some(m::Repr::parse(&m::Packet::new_unchecked(h))?);
                    at += $len;
                }
            };
        }
        take!(HeaderSet::DETH, deth, deth, deth::HEADER_LEN);
        take!(HeaderSet::RETH, reth, reth, reth::HEADER_LEN);
        take!(
            HeaderSet::ATOMIC_ETH,
            atomic_eth,
            atomic::eth,
            atomic::ATOMIC_ETH_LEN
        );
        take!(HeaderSet::AETH, aeth, aeth, aeth::HEADER_LEN);
        take!(
            HeaderSet::ATOMIC_ACK_ETH,
            atomic_ack_eth,
            atomic::ack,
            atomic::ATOMIC_ACK_ETH_LEN
        );
        take!(HeaderSet::IMMDT, immdt, immdt, immdt::HEADER_LEN);
        take!(HeaderSet::IETH, ieth, ieth, ieth::HEADER_LEN);
        // The CNP's reserved bytes carry nothing; `at` is not needed after.
        let _ = at;
        Ok(Self {
            bth,
            ext,
            payload: &d[l.payload..l.payload + l.payload_len],
        })
    }

    /// Pad bytes needed after the payload.
    pub const fn pad_len(&self) -> usize {
        (4 - self.payload.len() % 4) % 4
    }

    /// Length of the packet from BTH through ICRC.
    pub const fn buffer_len(&self) -> usize {
        bth::HEADER_LEN
            + self.bth.opcode.headers().len()
            + self.payload.len()
            + self.pad_len()
            + ICRC_LEN
    }

    /// Checks that the headers match the opcode and the payload is allowed.
    pub fn validate(&self) -> Result<()> {
        check(&self.bth, &self.ext, self.payload.len())
    }

    /// Writes the packet into a buffer of exactly [`Self::buffer_len`]
    /// bytes. Pad bytes are zero; the ICRC field is zeroed for the caller to
    /// fill in ([`crate::frame`] does).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        let len = self.buffer_len();
        let d = p.buffer.as_mut();
        if d.len() != len {
            return Err(Error::BufferSize {
                needed: len,
                available: d.len(),
            });
        }
        let at = emit_headers(d, &self.bth, &self.ext, self.payload.len())?;
        d[at..at + self.payload.len()].copy_from_slice(self.payload);
        Ok(())
    }
}

/// Checks that `ext` holds exactly the headers `bth.opcode` requires and
/// that a payload of `payload_len` bytes is allowed.
fn check(bth: &bth::Repr, ext: &ExtHeaders, payload_len: usize) -> Result<()> {
    let opcode = bth.opcode;
    let want = opcode.headers();
    let have = ext.set();
    // The CNP's reserved bytes are not a header a `Repr` carries.
    if want.without(HeaderSet::CNP_RESERVED) != have {
        for (bit, header, _) in HeaderSet::ORDER {
            if bit != HeaderSet::CNP_RESERVED && want.contains(bit) != have.contains(bit) {
                return Err(Error::HeaderMismatch {
                    opcode,
                    header,
                    present: have.contains(bit),
                });
            }
        }
    }
    if !opcode.has_payload() && payload_len != 0 {
        return Err(Error::UnexpectedPayload {
            opcode,
            len: payload_len,
        });
    }
    if payload_len > MAX_PAYLOAD {
        return Err(Error::PayloadTooLong {
            len: payload_len,
            max: MAX_PAYLOAD,
        });
    }
    Ok(())
}

/// The length of a packet from BTH through ICRC with `opcode`'s headers and
/// `payload_len` bytes of payload (plus pad).
pub const fn packet_len(opcode: Opcode, payload_len: usize) -> usize {
    bth::HEADER_LEN + opcode.headers().len() + payload_len.next_multiple_of(4) + ICRC_LEN
}

/// Writes a packet around a payload the caller fills in place: the BTH
/// (PadCnt computed from `payload_len`), the extension headers, zeroed pad
/// and a zeroed ICRC. `buf` must be exactly [`packet_len`] bytes; returns
/// the offset of the payload, whose `payload_len` bytes are left as they
/// were. This lets a sender gather a payload straight into its packet
/// instead of copying it twice.
pub fn emit_headers(
    buf: &mut [u8],
    bth: &bth::Repr,
    ext: &ExtHeaders,
    payload_len: usize,
) -> Result<usize> {
    check(bth, ext, payload_len)?;
    let len = packet_len(bth.opcode, payload_len);
    if buf.len() != len {
        return Err(Error::BufferSize {
            needed: len,
            available: buf.len(),
        });
    }
    let pad = payload_len.next_multiple_of(4) - payload_len;
    let bth = bth::Repr {
        // pad < 4.
        pad_cnt: pad as u8,
        ..*bth
    };
    bth.emit(&mut bth::Packet::new_unchecked(&mut buf[..bth::HEADER_LEN]))?;
    let mut at = bth::HEADER_LEN;
    // Straight through the headers in wire order; `check` found exactly
    // the ones the opcode needs.
    macro_rules! put {
        ($field:ident, $module:path, $len:expr) => {
            if let Some(r) = ext.$field {
                use $module as m;
                r.emit(&mut m::Packet::new_unchecked(&mut buf[at..at + $len]))?;
                at += $len;
            }
        };
    }
    put!(deth, deth, deth::HEADER_LEN);
    put!(reth, reth, reth::HEADER_LEN);
    put!(atomic_eth, atomic::eth, atomic::ATOMIC_ETH_LEN);
    put!(aeth, aeth, aeth::HEADER_LEN);
    put!(atomic_ack_eth, atomic::ack, atomic::ATOMIC_ACK_ETH_LEN);
    put!(immdt, immdt, immdt::HEADER_LEN);
    put!(ieth, ieth, ieth::HEADER_LEN);
    if bth.opcode.headers().contains(HeaderSet::CNP_RESERVED) {
        let end = at + crate::opcode::CNP_RESERVED_LEN;
        buf[at..end].fill(0);
        at = end;
    }
    buf[at + payload_len..].fill(0);
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PKey, Psn, Qpn, Rkey, aeth::Syndrome};

    fn bth(opcode: Opcode) -> bth::Repr {
        bth::Repr {
            opcode,
            solicited: false,
            mig_req: false,
            pad_cnt: 0,
            pkey: PKey::DEFAULT,
            fecn: false,
            becn: false,
            dest_qp: Qpn::from_masked(0x11),
            ack_req: true,
            psn: Psn::from_masked(100),
        }
    }

    fn emit(r: &Repr<'_>) -> Vec<u8> {
        let mut v = vec![0xee; r.buffer_len()];
        r.emit(&mut Packet::new_unchecked(&mut v[..])).unwrap();
        v
    }

    fn send_only(payload: &[u8]) -> Vec<u8> {
        emit(&Repr {
            bth: bth(Opcode::RcSendOnly),
            ext: ExtHeaders::default(),
            payload,
        })
    }

    fn ack() -> Vec<u8> {
        emit(&Repr {
            bth: bth(Opcode::RcAcknowledge),
            ext: ExtHeaders {
                aeth: Some(aeth::Repr {
                    syndrome: Syndrome::Ack(aeth::CreditCode::INVALID),
                    msn: crate::Msn::from_masked(1),
                }),
                ..ExtHeaders::default()
            },
            payload: &[],
        })
    }

    #[test]
    fn pad_is_computed_and_zero() {
        let v = send_only(b"hello");
        assert_eq!(v.len(), 12 + 5 + 3 + 4);
        assert_eq!(v[1] >> 4 & 3, 3, "PadCnt");
        assert_eq!(&v[17..20], &[0, 0, 0]);
        let p = Packet::new_checked(&v[..]).unwrap();
        assert_eq!(p.payload(), b"hello");
        let r = Repr::parse(&p).unwrap();
        assert_eq!((r.payload, r.bth.pad_cnt), (&b"hello"[..], 3));
    }

    #[test]
    fn emit_headers_leaves_the_payload_to_the_caller() {
        // A WRITE_ONLY_WITH_IMMEDIATE: RETH then ImmDt, 5 payload bytes.
        let payload = b"vrdma";
        let ext = ExtHeaders {
            reth: Some(reth::Repr {
                va: 0x1000,
                rkey: crate::Rkey(0x1234_5601),
                dma_len: 5,
            }),
            immdt: Some(immdt::Repr { imm: 0xdead_beef }),
            ..ExtHeaders::default()
        };
        let b = bth(Opcode::RcWriteOnlyImm);
        let want = emit(&Repr::new(b, ext, payload));
        let mut v = vec![0xee; packet_len(b.opcode, payload.len())];
        assert_eq!(v.len(), want.len());
        let at = emit_headers(&mut v, &b, &ext, payload.len()).unwrap();
        assert_eq!(at, 12 + 16 + 4);
        assert_eq!(&v[at..at + 5], &[0xee; 5], "payload bytes untouched");
        v[at..at + 5].copy_from_slice(payload);
        assert_eq!(v, want);
        // The buffer must be exactly the packet, and the headers must be
        // the opcode's.
        let mut long = vec![0; v.len() + 1];
        assert_eq!(
            emit_headers(&mut long, &b, &ext, payload.len()),
            Err(Error::BufferSize {
                needed: v.len(),
                available: v.len() + 1
            })
        );
        let no_imm = ExtHeaders { immdt: None, ..ext };
        assert_eq!(
            emit_headers(&mut v, &b, &no_imm, payload.len()),
            Err(Error::HeaderMismatch {
                opcode: Opcode::RcWriteOnlyImm,
                header: Header::ImmDt,
                present: false
            })
        );
    }

    #[test]
    fn zero_length_send() {
        let v = send_only(&[]);
        assert_eq!(v.len(), MIN_LEN);
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&v[..])).unwrap().payload,
            b""
        );
    }

    #[test]
    fn truncated_bth() {
        let v = send_only(b"abcd");
        assert_eq!(
            Packet::new_checked(&v[..11]),
            Err(Error::Truncated {
                header: Header::Bth,
                needed: 12,
                available: 11
            })
        );
    }

    #[test]
    fn truncated_extension_header() {
        let v = ack();
        assert_eq!(
            Packet::new_checked(&v[..14]),
            Err(Error::Truncated {
                header: Header::Aeth,
                needed: 16,
                available: 14
            })
        );
    }

    #[test]
    fn truncated_icrc() {
        let v = ack();
        assert_eq!(
            Packet::new_checked(&v[..18]),
            Err(Error::Truncated {
                header: Header::Icrc,
                needed: 20,
                available: 18
            })
        );
    }

    #[test]
    fn over_long_ack_carries_unexpected_payload() {
        let mut v = ack();
        v.extend_from_slice(&[0; 4]);
        assert_eq!(
            Packet::new_checked(&v[..]),
            Err(Error::UnexpectedPayload {
                opcode: Opcode::RcAcknowledge,
                len: 4
            })
        );
    }

    #[test]
    fn over_long_payload_beyond_the_largest_mtu() {
        let big = vec![7; MAX_PAYLOAD + 4];
        let mut v = send_only(&big[..MAX_PAYLOAD]);
        assert!(Packet::new_checked(&v[..]).is_ok());
        v.splice(12..12, [0; 4]);
        assert_eq!(
            Packet::new_checked(&v[..]),
            Err(Error::PayloadTooLong {
                len: MAX_PAYLOAD + 4,
                max: MAX_PAYLOAD
            })
        );
        let r = Repr {
            bth: bth(Opcode::RcSendOnly),
            ext: ExtHeaders::default(),
            payload: &big,
        };
        assert_eq!(
            r.validate(),
            Err(Error::PayloadTooLong {
                len: MAX_PAYLOAD + 4,
                max: MAX_PAYLOAD
            })
        );
    }

    #[test]
    fn wrong_tver() {
        let mut v = send_only(b"abcd");
        v[1] |= 0x02;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&v[..])),
            Err(Error::BadTver(2))
        );
    }

    #[test]
    fn pad_count_larger_than_the_payload() {
        let mut v = send_only(&[]);
        v[1] |= 0x30;
        assert_eq!(
            Packet::new_checked(&v[..]),
            Err(Error::BadPadCnt {
                opcode: Opcode::RcSendOnly,
                pad_cnt: 3,
                area: 0
            })
        );
    }

    #[test]
    fn pad_count_on_an_opcode_without_payload() {
        let mut v = ack();
        v[1] |= 0x10;
        assert_eq!(
            Packet::new_checked(&v[..]),
            Err(Error::BadPadCnt {
                opcode: Opcode::RcAcknowledge,
                pad_cnt: 1,
                area: 0
            })
        );
    }

    #[test]
    fn payload_not_padded_to_four_bytes() {
        let mut v = send_only(b"abcd");
        v.insert(12, 0);
        assert_eq!(
            Packet::new_checked(&v[..]),
            Err(Error::UnalignedPayload { len: 5 })
        );
    }

    #[test]
    fn unknown_opcode() {
        let mut v = send_only(b"abcd");
        v[0] = 0x40; // RD SEND_FIRST
        assert_eq!(Packet::new_checked(&v[..]), Err(Error::UnknownOpcode(0x40)));
        assert_eq!(Packet::new_unchecked(&v[..]).payload(), b"");
    }

    #[test]
    fn emit_rejects_headers_that_do_not_match_the_opcode() {
        let missing = Repr {
            bth: bth(Opcode::RcWriteOnly),
            ext: ExtHeaders::default(),
            payload: b"x",
        };
        assert_eq!(
            missing.validate(),
            Err(Error::HeaderMismatch {
                opcode: Opcode::RcWriteOnly,
                header: Header::Reth,
                present: false
            })
        );
        let extra = Repr {
            bth: bth(Opcode::RcSendOnly),
            ext: ExtHeaders {
                ieth: Some(ieth::Repr { rkey: Rkey(1) }),
                ..ExtHeaders::default()
            },
            payload: b"x",
        };
        assert_eq!(
            extra.validate(),
            Err(Error::HeaderMismatch {
                opcode: Opcode::RcSendOnly,
                header: Header::Ieth,
                present: true
            })
        );
        let mut buf = vec![0; extra.buffer_len()];
        assert_eq!(
            extra.emit(&mut Packet::new_unchecked(&mut buf[..])),
            Err(Error::HeaderMismatch {
                opcode: Opcode::RcSendOnly,
                header: Header::Ieth,
                present: true
            })
        );
    }

    #[test]
    fn emit_rejects_a_wrongly_sized_buffer() {
        let r = Repr {
            bth: bth(Opcode::RcSendOnly),
            ext: ExtHeaders::default(),
            payload: b"abcd",
        };
        let mut buf = vec![0; r.buffer_len() - 1];
        assert_eq!(
            r.emit(&mut Packet::new_unchecked(&mut buf[..])),
            Err(Error::BufferSize {
                needed: 20,
                available: 19
            })
        );
    }

    #[test]
    fn cnp_has_sixteen_reserved_bytes_and_no_payload() {
        let r = Repr {
            bth: bth::Repr {
                becn: true,
                ack_req: false,
                ..bth(Opcode::Cnp)
            },
            ext: ExtHeaders::default(),
            payload: &[],
        };
        let v = emit(&r);
        assert_eq!(v.len(), 12 + 16 + 4);
        assert!(v[12..32].iter().all(|&b| b == 0));
        assert_eq!(Repr::parse(&Packet::new_unchecked(&v[..])), Ok(r));
    }

    #[test]
    fn a_reserved_aeth_syndrome_in_a_packet() {
        let mut v = ack();
        v[12] = 0x40; // kind 10: reserved
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&v[..])),
            Err(Error::BadAethSyndrome(0x40))
        );
    }

    #[test]
    fn non_zero_pad_bytes_are_accepted() {
        let mut v = send_only(b"hello");
        v[17..20].copy_from_slice(&[1, 2, 3]);
        let r = Repr::parse(&Packet::new_unchecked(&v[..])).unwrap();
        assert_eq!(r.payload, b"hello");
    }

    #[test]
    fn new_sets_the_pad_count() {
        let r = Repr::new(bth(Opcode::RcSendOnly), ExtHeaders::default(), b"abcde");
        assert_eq!(r.bth.pad_cnt, 3);
        let v = emit(&r);
        assert_eq!(Repr::parse(&Packet::new_unchecked(&v[..])), Ok(r));
    }
}
