//! Hostile messages on a same-host rendezvous socket: whatever bytes a
//! peer daemon sends (and however many descriptors it attaches), the
//! decoder never panics, and what it accepts re-encodes to the very bytes
//! that came.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vrdma_fabric::shm::peer::Message;

fuzz_target!(|data: &[u8]| {
    let Some((&fds, m)) = data.split_first() else {
        return;
    };
    if let Ok(msg) = Message::parse(m, usize::from(fds % 4)) {
        assert_eq!(msg.emit(), m, "{msg:?}");
    }
});
