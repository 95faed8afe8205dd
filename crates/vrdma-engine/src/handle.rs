//! The numbers a consumer (a guest driver, a tool) names objects by: PD,
//! CQ, SRQ and AH handles. Each kind is its own type, so that a CQ handle
//! cannot be passed where a PD is meant (QPNs and memory keys have their
//! newtypes in `vrdma-wire`). A handle says nothing about whether its
//! object exists: the engine checks that on every call.

use core::fmt;

macro_rules! handle {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Default, Eq, Hash, Ord, PartialEq, PartialOrd)]
        pub struct $name(pub u32);

        impl $name {
            /// The number as the consumer sees it.
            pub const fn value(self) -> u32 {
                self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($kind, "({})"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($kind, " {}"), self.0)
            }
        }

        impl From<$name> for u32 {
            fn from(h: $name) -> u32 {
                h.0
            }
        }
    };
}

handle!(
    /// A protection domain.
    PdHandle,
    "PD"
);
handle!(
    /// A completion queue.
    CqHandle,
    "CQ"
);
handle!(
    /// A shared receive queue.
    SrqHandle,
    "SRQ"
);
handle!(
    /// An address handle.
    AhHandle,
    "AH"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_print_their_kind() {
        assert_eq!(format!("{:?}", CqHandle(3)), "CQ(3)");
        assert_eq!(PdHandle(7).to_string(), "PD 7");
        assert_eq!(u32::from(SrqHandle(9)), 9);
        assert_eq!(AhHandle(2).value(), 2);
    }
}
