//! Hostile vfio-user messages: a stream of them, as the socket would
//! frame it (a 16-byte header, then the payload its size names; a size the
//! socket would refuse ends the stream), each decoded by `proto::parse`
//! and then handled by a session with a PVRDMA function behind it (on a
//! transport that sends nothing; no descriptors come with the messages, so
//! no guest memory is ever mapped). Nothing may panic; what the decoder
//! accepts must be what the message carried, and every reply must be a
//! well-formed answer to its request.
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use vrdma_vfio_user::{
    Session,
    proto::{self, Header, Request},
};
use zerocopy::FromBytes;

fuzz_target!(|data: &[u8]| {
    let mut f = common::function();
    let mut session = Session::new(&f);
    let mut rest = data;
    while let Ok((h, tail)) = Header::read_from_prefix(rest) {
        let Some(len) = h.payload_len() else {
            break;
        };
        if h.size as usize > proto::MAX_MESSAGE || tail.len() < len {
            break;
        }
        let (payload, next) = tail.split_at(len);
        rest = next;
        match proto::parse(&h, payload) {
            Ok(Request::RegionWrite { data, .. }) => {
                assert_eq!(data.len() + size_of::<proto::RegionAccess>(), payload.len());
            }
            Ok(Request::RegionRead { count, .. }) => {
                assert!(count as usize <= proto::MAX_DATA_XFER);
            }
            Ok(Request::Version { caps, .. }) => {
                assert!(caps.len() + size_of::<proto::VersionHead>() <= payload.len());
            }
            Ok(_) | Err(_) => {}
        }
        let Some(reply) = session.handle(&mut f, &h, payload, Vec::new()) else {
            assert!(h.no_reply());
            continue;
        };
        let (r, body) = Header::read_from_prefix(&reply.bytes).expect("a reply header");
        assert_eq!((r.id, r.command), (h.id, h.command));
        assert_eq!(r.size as usize, reply.bytes.len());
        assert_ne!(r.flags & proto::flags::TYPE_REPLY, 0);
        if r.flags & proto::flags::ERROR != 0 {
            assert_ne!(r.error, 0, "an error reply with errno 0");
            assert!(body.is_empty());
        }
        assert!(reply.bytes.len() <= proto::MAX_MESSAGE);
    }
});
