//! Hostile messages on a same-host rendezvous socket: whatever bytes a
//! peer daemon sends (and however many descriptors it attaches), the
//! decoder never panics, and what it accepts re-encodes to the very bytes
//! that came. The same bytes as a grant file (what a user's daemons may
//! announce): the parser never panics, and a grant it takes keeps only
//! valid network names.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_fabric::shm::{Grant, check_network_name, peer::Message};

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(g) = Grant::parse(text)
    {
        for net in g.0.keys() {
            assert!(check_network_name(net).is_ok(), "{net:?}");
        }
    }
    let Some((&fds, m)) = data.split_first() else {
        return;
    };
    if let Ok(msg) = Message::parse(m, usize::from(fds % 4)) {
        assert_eq!(msg.emit(), m, "{msg:?}");
    }
});
