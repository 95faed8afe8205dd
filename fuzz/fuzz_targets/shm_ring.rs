//! A hostile daemon on the other end of a same-host ring: it writes any
//! bytes anywhere in the ring's memory (indices, record headers, packets)
//! between the consumer's pops, and sometimes a well-formed packet. The
//! consumer never panics, never hands out more than a packet's bytes, and
//! a ring it found broken stays broken and empty.
//!
//! Input: records, each a tag byte then its fields (little-endian):
//! - 0 scribble: a u16 offset into the ring (modulo its size), a length
//!   byte, the bytes;
//! - 1 pop (up to 4 packets);
//! - 2 release;
//! - 3 a packet through the producer's end: a length byte, then the
//!   packet's first byte (repeated).
#![no_main]

use std::{fs::File, net::Ipv4Addr};

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};
use vrdma_fabric::shm::ring;
use vrdma_wire::{frame::Route, packet};

const SLOTS: u32 = 8;

fuzz_target!(|data: &[u8]| {
    let (mut consumer, fd) = ring::create(SLOTS, "fuzz").expect("a ring");
    let file = File::from(fd.try_clone().expect("dup"));
    let len = ring::ring_len(SLOTS);
    let raw = MmapRegion::<()>::from_file(FileOffset::new(file, 0), len).expect("map");
    let raw = raw.as_volatile_slice();
    let mut producer = ring::open(fd, SLOTS).expect("the producer's end");
    let route = Route {
        src: Ipv4Addr::new(127, 0, 0, 1).into(),
        dst: Ipv4Addr::new(127, 0, 0, 2).into(),
        traffic_class: 0,
        hop_limit: 64,
        flow_label: 0,
    };
    let mut buf = vec![0u8; packet::MAX_LEN];
    let mut rest = data;
    while let Some((&tag, tail)) = rest.split_first() {
        rest = tail;
        match tag % 4 {
            0 => {
                let [a, b, n, tail @ ..] = rest else { break };
                let off = usize::from(u16::from_le_bytes([*a, *b])) % len;
                let n = usize::from(*n).min(tail.len()).min(len - off);
                let _ = raw.write_slice(&tail[..n], off);
                rest = &tail[n..];
            }
            1 => {
                let was_broken = consumer.is_broken();
                for _ in 0..4 {
                    match consumer.pop(&mut buf) {
                        Ok(r) => {
                            assert!(!was_broken, "a broken ring handed out a packet");
                            assert!(r.len <= packet::MAX_LEN);
                        }
                        Err(ring::PopError::Empty) => break,
                        Err(ring::PopError::Broken) => {
                            assert!(consumer.is_broken());
                            assert_eq!(consumer.pending(), 0);
                            break;
                        }
                    }
                }
                assert!(consumer.pending() <= u64::from(SLOTS) + 1);
            }
            2 => consumer.release(),
            _ => {
                let [n, b, tail @ ..] = rest else { break };
                let _ = producer.push(&route, &vec![*b; usize::from(*n)]);
                producer.publish();
                rest = tail;
            }
        }
    }
});
