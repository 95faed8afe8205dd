//! The rendezvous protocol's messages (HELLO, NETS, RING, GIDS, GONE):
//! decoded from a copy of a datagram's bytes, every length, count and
//! name checked, and emitted from their types.

use vrdma_wire::Gid;

use crate::shm::{MAX_NETWORK_NAME, check_network_name};

/// The protocol's first message: magic, version, the switch's instance.
const MAGIC: u64 = u64::from_le_bytes(*b"VRDMASHM");
/// 2: networks (NETS, and the network of each RING); identities from the
/// kernel.
const VERSION: u32 = 2;
const HELLO: u32 = 1;
const RING: u32 = 2;
const GIDS: u32 = 3;
const GONE: u32 = 4;
const NETS: u32 = 5;
/// Addresses one device announces at most (a GID table's worth).
pub(super) const MAX_GIDS: usize = 128;
/// Networks one daemon announces at most.
pub(super) const MAX_NETS: usize = 64;
/// A message's bytes at most: a GIDS of [`MAX_GIDS`] addresses, or a NETS
/// of [`MAX_NETS`] names.
pub(super) const MAX_MESSAGE: usize = {
    let gids = 12 + 16 * MAX_GIDS;
    let nets = 8 + MAX_NETS * (1 + MAX_NETWORK_NAME);
    if gids > nets { gids } else { nets }
};

/// A message of the rendezvous protocol, decoded from a copy of its
/// bytes (and the number of descriptors that came with it).
#[derive(Clone, Debug, Eq, PartialEq)]
pub enum Message {
    /// The switch's instance within its process (magic and version
    /// checked): with the process's id from the kernel, the peer's
    /// identity.
    Hello { id: u64 },
    /// The named networks the sender's devices are on.
    Nets { names: Vec<String> },
    /// A ring into the sender's device `port`, on network `net`, of
    /// `slots` slots (its memfd and its eventfd came with it).
    Ring { port: u32, slots: u32, net: String },
    /// The addresses of the sender's device `port` now.
    Gids { port: u32, gids: Vec<Gid> },
    /// The sender's device `port` is gone.
    Gone { port: u32 },
}

/// Why a message is refused (the connection is dropped).
#[derive(Clone, Copy, Debug, Eq, PartialEq, thiserror::Error)]
pub enum ProtocolError {
    #[error("a message of {0} bytes")]
    Length(usize),
    #[error("an unknown message type {0}")]
    Kind(u32),
    #[error("not vrdma's rendezvous protocol, or another version")]
    Magic,
    #[error("{got} descriptors with a message that takes {want}")]
    Descriptors { got: usize, want: usize },
    #[error("{0} addresses for one device")]
    TooManyGids(usize),
    #[error("{0} networks")]
    TooManyNets(usize),
    #[error("a network name that is not one")]
    NetworkName,
}

/// Reads a length-prefixed network name at `m[at..]`: the name and the
/// offset after it.
fn name_at(m: &[u8], at: usize) -> Result<(String, usize), ProtocolError> {
    let len = usize::from(*m.get(at).ok_or(ProtocolError::Length(m.len()))?);
    let bytes = m
        .get(at + 1..at + 1 + len)
        .ok_or(ProtocolError::Length(m.len()))?;
    let name = std::str::from_utf8(bytes).map_err(|_| ProtocolError::NetworkName)?;
    check_network_name(name).map_err(|_| ProtocolError::NetworkName)?;
    Ok((name.to_owned(), at + 1 + len))
}

fn push_name(m: &mut Vec<u8>, name: &str) {
    // Names are checked (at most 32 bytes) before they are sent.
    m.push(name.len().min(usize::from(u8::MAX)) as u8);
    m.extend_from_slice(name.as_bytes());
}

impl Message {
    /// Decodes `m`, which came with `fds` descriptors.
    pub fn parse(m: &[u8], fds: usize) -> Result<Message, ProtocolError> {
        if m.len() < 4 || m.len() > MAX_MESSAGE {
            return Err(ProtocolError::Length(m.len()));
        }
        let u32_at = |o: usize| u32::from_le_bytes([m[o], m[o + 1], m[o + 2], m[o + 3]]);
        let u64_at = |o: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&m[o..o + 8]);
            u64::from_le_bytes(b)
        };
        let kind = u32_at(0);
        let (len_ok, want_fds) = match kind {
            HELLO => (m.len() == 24, 0),
            RING => (m.len() >= 14, 2),
            GIDS => (m.len() >= 12, 0),
            GONE => (m.len() == 8, 0),
            NETS => (m.len() >= 8, 0),
            k => return Err(ProtocolError::Kind(k)),
        };
        if !len_ok {
            return Err(ProtocolError::Length(m.len()));
        }
        if fds != want_fds {
            return Err(ProtocolError::Descriptors {
                got: fds,
                want: want_fds,
            });
        }
        Ok(match kind {
            HELLO => {
                if u64_at(4) != MAGIC || u32_at(12) != VERSION {
                    return Err(ProtocolError::Magic);
                }
                Message::Hello { id: u64_at(16) }
            }
            RING => {
                let (net, end) = name_at(m, 12)?;
                if end != m.len() {
                    return Err(ProtocolError::Length(m.len()));
                }
                Message::Ring {
                    port: u32_at(4),
                    slots: u32_at(8),
                    net,
                }
            }
            GIDS => {
                let n = u32_at(8) as usize;
                if n > MAX_GIDS {
                    return Err(ProtocolError::TooManyGids(n));
                }
                if m.len() != 12 + 16 * n {
                    return Err(ProtocolError::Length(m.len()));
                }
                let gids = (0..n)
                    .map(|k| {
                        let mut g = [0u8; 16];
                        g.copy_from_slice(&m[12 + 16 * k..28 + 16 * k]);
                        Gid(g)
                    })
                    .collect();
                Message::Gids {
                    port: u32_at(4),
                    gids,
                }
            }
            NETS => {
                let n = u32_at(4) as usize;
                if n > MAX_NETS {
                    return Err(ProtocolError::TooManyNets(n));
                }
                let mut names = Vec::with_capacity(n);
                let mut at = 8;
                for _ in 0..n {
                    let (name, next) = name_at(m, at)?;
                    names.push(name);
                    at = next;
                }
                if at != m.len() {
                    return Err(ProtocolError::Length(m.len()));
                }
                Message::Nets { names }
            }
            _ => Message::Gone { port: u32_at(4) },
        })
    }

    /// The message's bytes (its descriptors go beside them).
    pub fn emit(&self) -> Vec<u8> {
        let mut m = Vec::with_capacity(24);
        match self {
            Message::Hello { id } => {
                m.extend_from_slice(&HELLO.to_le_bytes());
                m.extend_from_slice(&MAGIC.to_le_bytes());
                m.extend_from_slice(&VERSION.to_le_bytes());
                m.extend_from_slice(&id.to_le_bytes());
            }
            Message::Nets { names } => {
                m.extend_from_slice(&NETS.to_le_bytes());
                m.extend_from_slice(&(names.len() as u32).to_le_bytes());
                for n in names {
                    push_name(&mut m, n);
                }
            }
            Message::Ring { port, slots, net } => {
                m.extend_from_slice(&RING.to_le_bytes());
                m.extend_from_slice(&port.to_le_bytes());
                m.extend_from_slice(&slots.to_le_bytes());
                push_name(&mut m, net);
            }
            Message::Gids { port, gids } => {
                m.extend_from_slice(&GIDS.to_le_bytes());
                m.extend_from_slice(&port.to_le_bytes());
                m.extend_from_slice(&(gids.len() as u32).to_le_bytes());
                for g in gids {
                    m.extend_from_slice(&g.0);
                }
            }
            Message::Gone { port } => {
                m.extend_from_slice(&GONE.to_le_bytes());
                m.extend_from_slice(&port.to_le_bytes());
            }
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_anything_else_is_refused() {
        let all = [
            (Message::Hello { id: 7 }, 0),
            (
                Message::Ring {
                    port: 3,
                    slots: 512,
                    net: "tenant-a".into(),
                },
                2,
            ),
            (
                Message::Gids {
                    port: 3,
                    gids: vec![Gid([1; 16]), Gid([2; 16])],
                },
                0,
            ),
            (
                Message::Gids {
                    port: 3,
                    gids: vec![],
                },
                0,
            ),
            (Message::Gone { port: 3 }, 0),
            (
                Message::Nets {
                    names: vec!["a".into(), "tenant-b.2".into()],
                },
                0,
            ),
            (Message::Nets { names: vec![] }, 0),
        ];
        for (m, fds) in &all {
            assert_eq!(Message::parse(&m.emit(), *fds).as_ref(), Ok(m));
            let bytes = m.emit();
            // Cut short, or one byte more: refused.
            assert!(Message::parse(&bytes[..bytes.len() - 1], *fds).is_err());
            let mut long = bytes.clone();
            long.push(0);
            assert!(Message::parse(&long, *fds).is_err());
            // The wrong number of descriptors: refused.
            assert!(Message::parse(&bytes, fds + 1).is_err());
        }
        let mut hello = Message::Hello { id: 1 }.emit();
        hello[4] ^= 1;
        assert_eq!(Message::parse(&hello, 0), Err(ProtocolError::Magic));
        assert_eq!(
            Message::parse(&[9, 0, 0, 0], 0),
            Err(ProtocolError::Kind(9))
        );
        let mut many = Message::Gids {
            port: 0,
            gids: vec![],
        }
        .emit();
        many[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Message::parse(&many, 0).is_err());
        assert!(Message::parse(&[], 0).is_err());
        assert!(Message::parse(&vec![0; MAX_MESSAGE + 1], 0).is_err());
        // Network names: only the checked ones, whole.
        for bad in ["", "a b", "x/y", &"n".repeat(33)] {
            let mut m = Message::Nets { names: vec![] }.emit();
            m[4..8].copy_from_slice(&1u32.to_le_bytes());
            m.push(bad.len() as u8);
            m.extend_from_slice(bad.as_bytes());
            assert!(Message::parse(&m, 0).is_err(), "{bad:?}");
        }
        let mut ring = Message::Ring {
            port: 1,
            slots: 8,
            net: "n".into(),
        }
        .emit();
        ring[12] = 5;
        assert!(
            Message::parse(&ring, 2).is_err(),
            "a name longer than the message"
        );
    }
}
