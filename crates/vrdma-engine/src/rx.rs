//! A received packet as the roles take it: parsed headers and a payload
//! that is carried or lent. Its own module, below the data path's entry
//! points and the roles (responder, completer) that read it, so that
//! neither imports the other's module for the type.

use crate::memory::Payload;
use vrdma_wire::packet;

/// A received packet, parsed: its headers and its payload (carried, or
/// lent), and whether it may carry a run of segments (it came from a peer
/// [`crate::Engine::set_jumbo`] names).
/// (Its headers are the parsed packet's, reached through `Deref`: built
/// in place, not copied, on the hot path.)
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rx<'r, 'a> {
    repr: &'r packet::Repr<'a>,
    pub payload: Payload<'a>,
    pub jumbo: bool,
}

impl<'a> std::ops::Deref for Rx<'_, 'a> {
    type Target = packet::Repr<'a>;

    fn deref(&self) -> &Self::Target {
        self.repr
    }
}

impl<'r, 'a> Rx<'r, 'a> {
    /// The packet whose headers are `repr`, its payload `payload`.
    pub(crate) fn new(repr: &'r packet::Repr<'a>, payload: Payload<'a>, jumbo: bool) -> Self {
        Rx {
            repr,
            payload,
            jumbo,
        }
    }
}
