//! Two engines joined with no network between them, for benchmarks of the
//! engine alone: a packet one engine transmits goes straight into the
//! other's `handle_packet` (no framing, no ICRC), with the IP header a
//! fabric would have reported.

use std::net::Ipv4Addr;

use vrdma_engine::{Engine, VecMemory};
use vrdma_wire::{frame::IpRepr, ipv4};

use crate::setup::{EngineSpec, Ids};

/// One engine of a direct link.
#[derive(Debug)]
pub struct End {
    pub engine: Engine,
    pub mem: VecMemory,
    pub ids: Ids,
    /// The IP header its packets arrive with (from host `3 - n` to host
    /// `n`: the two ends are hosts 1 and 2).
    pub ip: IpRepr,
}

impl End {
    /// `side` built as host `n` (1 or 2).
    pub fn new(side: &EngineSpec, n: u8) -> Self {
        let (engine, mem, ids) = side.clone().gid(crate::setup::gid(n)).build();
        let ip = IpRepr::V4(ipv4::Repr {
            src: Ipv4Addr::new(127, 0, 0, 3 - n),
            dst: Ipv4Addr::new(127, 0, 0, n),
            tos: 0,
            ident: 0,
            dont_frag: true,
            ttl: 64,
            payload_len: 0,
        });
        End {
            engine,
            mem,
            ids,
            ip,
        }
    }
}

/// Moves packets between `a` and `b` (one each way in turn) until both
/// are quiet; how many moved. `buf` holds one packet.
pub fn exchange(a: &mut End, b: &mut End, buf: &mut [u8]) -> u64 {
    let mut n = 0;
    loop {
        let mut moved = false;
        if let Some(t) = a.engine.poll_transmit(0, &a.mem, buf) {
            b.engine.handle_packet(0, &b.ip, &buf[..t.len], &mut b.mem);
            n += 1;
            moved = true;
        }
        if let Some(t) = b.engine.poll_transmit(0, &b.mem, buf) {
            a.engine.handle_packet(0, &a.ip, &buf[..t.len], &mut a.mem);
            n += 1;
            moved = true;
        }
        if !moved {
            return n;
        }
    }
}
