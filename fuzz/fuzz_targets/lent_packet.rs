//! Hostile packets whose payload comes lent on (same-host shared memory:
//! `Engine::handle_lent_packet`): the head (the bytes around the payload),
//! where the payload goes and how long it is all come from the input, to
//! an engine with an RC QP in RTS and receives posted, whose peer may send
//! runs of segments or not. Nothing may panic, and no copy may reach past
//! the payload that was lent.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_engine::{
    memory::{Memory, MemoryError, WithLent},
    wr::{RecvWr, Sge},
};
use vrdma_testkit::{
    direct::End,
    setup::{BASE, Connection, EngineSpec, gid},
};
use vrdma_wire::Qpn;

const MEM: usize = 256 * 1024;

fuzz_target!(|data: &[u8]| {
    // flags (1: the peer may send runs of segments, 2: aim at the QP, 4:
    // aim a RETH at the MR), payload_at, the payload's length (3 bytes),
    // then the head.
    let [flags, at, l0, l1, l2, head @ ..] = data else {
        return;
    };
    let mut e = End::new(&EngineSpec::new(2).mem(MEM), 2);
    let (qpn, lkey, rkey) = (e.ids.qpn, e.ids.lkey, e.ids.rkey);
    Connection::default().join(&mut e.engine, qpn, gid(1), Qpn::from_masked(1));
    for i in 0..4 {
        let r = [Sge {
            addr: BASE + i * 0x8000,
            length: 0x8000,
            lkey,
        }];
        let wr = RecvWr {
            wr_id: i,
            sg_list: &r,
        };
        e.engine.post_recv(qpn, &wr).unwrap();
    }
    if flags & 1 != 0 {
        e.engine.set_jumbo(&[gid(1)]);
    }
    // Aim the packet at the QP (and a RETH at the MR) when the input asks,
    // so that the fuzzer spends its time past the lookups.
    let mut head = head.to_vec();
    if flags & 2 != 0 && head.len() >= 12 {
        head[5..8].copy_from_slice(&qpn.value().to_be_bytes()[1..]);
    }
    if flags & 4 != 0 && head.len() >= 28 {
        head[20..24].copy_from_slice(&rkey.0.to_be_bytes());
    }
    let lent = (usize::from(*l0) | usize::from(*l1) << 8 | usize::from(*l2) << 16) % (512 << 10);
    let mut mem = WithLent {
        mem: &mut e.mem,
        copy: |mem: &mut vrdma_engine::memory::VecMemory, addr: u64, from: usize, len: usize| {
            assert!(
                from.checked_add(len).is_some_and(|end| end <= lent),
                "a copy past the payload lent: {from}+{len} of {lent}"
            );
            let bytes: Vec<u8> = (from..from + len).map(|i| i as u8).collect();
            mem.write(addr, &bytes).map_err(|_| MemoryError {
                addr,
                len: len as u64,
            })
        },
    };
    e.engine
        .handle_lent_packet(1, &e.ip, &head, usize::from(*at), lent, &mut mem);
    e.engine.finish_revocations();
    // Whatever it made of it, the engine still answers and times out.
    let mut buf = vec![0u8; vrdma_engine::transmit::MAX_PACKET];
    while e.engine.poll_transmit(2, &e.mem, &mut buf).is_some() {}
    let _ = e.engine.poll_timeout();
});
