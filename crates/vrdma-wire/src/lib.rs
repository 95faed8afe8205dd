//! RoCEv2 wire formats, bit-exact with Linux rxe and RoCE NICs.
//!
//! The crate follows smoltcp's split between *views* and *representations*:
//!
//! * a `Packet<T: AsRef<[u8]>>` is a checked view over bytes. `check_len`
//!   (called by `new_checked`) guarantees that no accessor can panic
//!   afterwards; setters exist where `T: AsMut<[u8]>`;
//! * a `Repr` is the validated meaning of a header: `parse` from a view,
//!   `emit` into a view, `buffer_len` to size the buffer.
//!
//! Parsing never allocates. Every malformed input yields a typed [`Error`].
//!
//! # Module map
//!
//! | module | what |
//! |---|---|
//! | [`types`] | newtypes: [`Psn`], [`Qpn`], [`Lkey`], [`Rkey`], [`PKey`], [`QKey`], [`Msn`], [`Gid`] |
//! | [`opcode`] | the IBTA opcode table for RC, UC, UD and CNP, as data |
//! | [`bth`] | Base Transport Header |
//! | [`reth`], [`aeth`], [`deth`], [`immdt`], [`ieth`], [`atomic`] | extended transport headers |
//! | [`grh`] | the 40-byte GRH at the front of a UD receive buffer |
//! | [`packet`] | a whole RoCE packet: BTH, extension headers, payload, pad, ICRC |
//! | [`icrc`] | the invariant CRC of IBTA Annex A17 (RoCEv2) |
//! | [`ethernet`], [`ipv4`], [`ipv6`], [`udp`] | the framing under RoCEv2 |
//! | [`frame`] | Ethernet frame (or bare IP packet) ⇄ RoCE packet |
//! | [`vlan`], [`vxlan`], [`encap`] | for tools reading captures: up to two VLAN tags (802.1Q, 802.1ad QinQ) and a VXLAN tunnel around a RoCEv2 packet |
//!
//! Section references such as "IBTA Vol1 §9.2" point at the InfiniBand
//! Architecture Specification, Volume 1, release 1.4, and its Annex A17
//! (RoCEv2).
#![forbid(unsafe_code)]

pub mod aeth;
pub mod atomic;
pub mod bth;
pub mod deth;
pub mod encap;
mod error;
pub mod ethernet;
pub mod frame;
pub mod grh;
pub mod icrc;
pub mod ieth;
pub mod immdt;
pub mod ipv4;
pub mod ipv6;
pub mod opcode;
pub mod packet;
pub mod reth;
pub mod types;
pub mod udp;
pub mod vlan;
pub mod vxlan;

pub use error::{Error, Header, Result};
pub use opcode::{Opcode, OpcodeInfo, Operation, Position, ServiceType};
pub use types::{Gid, Lkey, Msn, PKey, Psn, QKey, Qpn, Rkey, Vni};

/// UDP destination port assigned to RoCEv2 by IANA.
pub const ROCEV2_UDP_PORT: u16 = 4791;

/// The largest path MTU InfiniBand defines: no packet carries more payload.
// IBTA Vol1 §7.7.8 (MTU): 256, 512, 1024, 2048 or 4096 bytes.
pub const MAX_PAYLOAD: usize = 4096;

/// Big-endian field access on slices whose length the caller has checked.
///
/// Written by hand (rather than pulling in `byteorder`) because the standard
/// library's `from_be_bytes` already does the work; only the 24-bit fields
/// need help. Every function indexes a fixed range, so a slice that passed
/// the view's `check_len` can never make them panic.
pub(crate) mod be {
    pub fn u16(d: &[u8], at: usize) -> u16 {
        u16::from_be_bytes([d[at], d[at + 1]])
    }
    pub fn u24(d: &[u8], at: usize) -> u32 {
        u32::from_be_bytes([0, d[at], d[at + 1], d[at + 2]])
    }
    pub fn u32(d: &[u8], at: usize) -> u32 {
        u32::from_be_bytes([d[at], d[at + 1], d[at + 2], d[at + 3]])
    }
    pub fn u64(d: &[u8], at: usize) -> u64 {
        let mut b = [0; 8];
        b.copy_from_slice(&d[at..at + 8]);
        u64::from_be_bytes(b)
    }
    pub fn set_u16(d: &mut [u8], at: usize, v: u16) {
        d[at..at + 2].copy_from_slice(&v.to_be_bytes());
    }
    pub fn set_u24(d: &mut [u8], at: usize, v: u32) {
        d[at..at + 3].copy_from_slice(&v.to_be_bytes()[1..]);
    }
    pub fn set_u32(d: &mut [u8], at: usize, v: u32) {
        d[at..at + 4].copy_from_slice(&v.to_be_bytes());
    }
    pub fn set_u64(d: &mut [u8], at: usize, v: u64) {
        d[at..at + 8].copy_from_slice(&v.to_be_bytes());
    }
}

/// Checks that `needed` bytes are available for `header`.
pub(crate) fn need(header: Header, needed: usize, available: usize) -> Result<()> {
    if available < needed {
        Err(Error::Truncated {
            header,
            needed,
            available,
        })
    } else {
        Ok(())
    }
}

/// Declares a fixed-length header view `Packet<T>` with the smoltcp
/// constructors: `new_unchecked`, `new_checked`, `check_len`, `into_inner`.
macro_rules! fixed_view {
    ($doc:literal, $header:expr, $len:expr) => {
        #[doc = $doc]
        #[derive(Clone, Copy, Debug, Eq, PartialEq)]
        pub struct Packet<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> Packet<T> {
            /// Wraps `buffer` without checking its length; accessors may
            /// panic until [`Self::check_len`] succeeds.
            pub const fn new_unchecked(buffer: T) -> Self {
                Self { buffer }
            }

            /// Wraps `buffer` after checking it holds the whole header.
            pub fn new_checked(buffer: T) -> $crate::Result<Self> {
                let p = Self::new_unchecked(buffer);
                p.check_len()?;
                Ok(p)
            }

            /// Checks the buffer holds the whole header; after this no
            /// accessor panics.
            pub fn check_len(&self) -> $crate::Result<()> {
                $crate::need($header, $len, self.buffer.as_ref().len())
            }

            /// The wrapped buffer.
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}
pub(crate) use fixed_view;
