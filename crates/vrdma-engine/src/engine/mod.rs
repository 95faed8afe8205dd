//! The engine: one per device, driven by one thread, no locks inside.
//! This module holds the control path (the verbs that create, modify,
//! query and destroy objects); every call validates its input and fails
//! with the error rdma-core would return. The data path's entry points
//! are in [`crate::datapath`].
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | [`Engine`]: its construction, the device and port queries, the event queues, the GID table, and the lookups the verbs share |
//! | `protection` | protection domains, memory regions and windows, and the key lookups of the protection checks |
//! | `cqs` | completion queues |
//! | `srqs` | shared receive queues |
//! | `ahs` | address handles and the check of an address vector |
//! | `qps` | queue pairs: create, modify, query and destroy |
//! | `post` | posting send and receive work requests |

use vrdma_wire::Qpn;

use crate::{
    attr::{DeviceAttr, GidEntry, PortAttr},
    budget::Budget,
    context::Ctx,
    cq::Cq,
    error::{Kind, Result, VerbsError},
    event::AsyncEvent,
    handle::{CqHandle, PdHandle},
    mr::Keys,
    objects::{Ah, Pd},
    qpc::Qp,
    table::Table,
};

mod ahs;
mod cqs;
mod post;
mod protection;
mod qps;
mod srqs;

/// The first QPN handed out: 0 and 1 are the special QPs, and rxe starts
/// its numbers at 17 too.
const FIRST_QPN: u32 = 17;
/// The only port.
const PORT: u8 = 1;

/// The RDMA device model.
#[derive(Debug)]
pub struct Engine {
    pub(crate) attr: DeviceAttr,
    pub(crate) pds: Table<Pd>,
    pub(crate) ahs: Table<Ah>,
    /// Boxed: the table cycles ([`Table::cycling`]), so its slots grow to
    /// `max_qp` over a device's life.
    pub(crate) qps: Table<Box<Qp>>,
    /// Everything else, which the data path's roles share
    /// ([`crate::context`]).
    pub(crate) cx: Ctx,
    /// The memory the consumer's objects hold ([`crate::budget`]).
    pub(crate) budget: Budget,
}

/// The memory a consumer's objects hold in the engine, against its limit
/// ([`Engine::set_memory_limit`]).
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct MemoryUse {
    /// Bytes held for work queues, page lists, engine-kept CQs, AHs.
    pub held: u64,
    /// `None`: no limit.
    pub limit: Option<u64>,
    /// Creates refused with ENOMEM for passing the limit.
    pub refused: u64,
}

impl Engine {
    /// A device with these limits and this port. Raises the port-active
    /// event when the port starts active.
    pub fn new(attr: DeviceAttr, port: PortAttr) -> Self {
        let active = port.state == crate::attr::PortState::Active;
        let mut cx = Ctx::new(
            port,
            Keys::new(attr.max_mr, attr.max_mw),
            Table::new(1, attr.max_cq),
            Table::new(1, attr.max_srq),
        );
        if active {
            cx.events.push_back(AsyncEvent::PortActive { port: PORT });
        }
        Engine {
            pds: Table::new(1, attr.max_pd),
            // QPNs 1 to 16 are kept for the special QPs (1: GSI).
            // QPNs are handed out in turn (Table::cycling says why).
            qps: Table::with_reserved(1, FIRST_QPN - 1, attr.max_qp).cycling(),
            ahs: Table::new(1, attr.max_ah),
            cx,
            attr,
            budget: Budget::default(),
        }
    }

    /// Limits the memory the consumer's objects may make the engine hold
    /// (`None`: no limit). A create that would pass it fails with ENOMEM;
    /// objects already made stay, even above a lowered limit.
    pub fn set_memory_limit(&mut self, limit: Option<u64>) {
        self.budget.limit = limit;
    }

    /// What the consumer's objects hold, the limit, the refusals.
    pub fn memory_use(&self) -> MemoryUse {
        MemoryUse {
            held: self.budget.held,
            limit: self.budget.limit,
            refused: self.budget.refused,
        }
    }

    /// `ibv_query_device`.
    pub fn query_device(&self) -> &DeviceAttr {
        &self.attr
    }

    /// `ibv_query_port`, with the GID and P_Key tables.
    pub fn query_port(&self, port: u8) -> Result<&PortAttr> {
        check_port(port)?;
        Ok(&self.cx.port)
    }

    /// The next asynchronous event, if any.
    #[must_use = "an event taken and dropped is lost"]
    pub fn poll_event(&mut self) -> Option<AsyncEvent> {
        self.cx.events.pop_front()
    }

    /// The next CQ whose armed notification fired (one per arming).
    #[must_use = "a notification taken and dropped is lost"]
    pub fn poll_notification(&mut self) -> Option<CqHandle> {
        self.cx.notifications.pop_front()
    }

    /// Sets GID table entry `index` (a face binds its guest's addresses as
    /// they come and go). Connected QPs' paths follow; a QP whose source
    /// GID went away sends nothing until it is set again.
    pub fn set_gid(&mut self, index: u8, entry: Option<GidEntry>) -> Result<()> {
        let slot = self
            .cx
            .port
            .gids
            .get_mut(usize::from(index))
            .ok_or(VerbsError::Invalid { what: "GID index" })?;
        *slot = entry;
        let port = &self.cx.port;
        for (_, q) in self.qps.iter_mut() {
            q.path = q.route(port, q.attr.ah_attr);
        }
        Ok(())
    }

    /// Live objects per kind, for `vrdma stat` and tests.
    pub fn counts(&self) -> Counts {
        Counts {
            pds: self.pds.len(),
            mrs: self.cx.keys.len(),
            cqs: self.cx.cqs.len(),
            qps: self.qps.len(),
            srqs: self.cx.srqs.len(),
            ahs: self.ahs.len(),
        }
    }

    // ---- lookups the verbs share ---------------------------------------

    /// The PD `pd` names.
    fn pd(&self, pd: PdHandle) -> Result<&Pd> {
        self.pds.get(pd.0).ok_or(VerbsError::NotFound {
            kind: Kind::Pd,
            handle: pd.0,
        })
    }

    /// The QP `qpn` names.
    fn qp(&self, qpn: Qpn) -> Result<&Qp> {
        self.qps
            .get(qpn.value())
            .map(|q| &**q)
            .ok_or(VerbsError::NotFound {
                kind: Kind::Qp,
                handle: qpn.value(),
            })
    }

    /// The CQ `cq` names.
    fn cq(&self, cq: CqHandle) -> Result<&Cq> {
        self.cx.cqs.get(cq.0).ok_or(VerbsError::NotFound {
            kind: Kind::Cq,
            handle: cq.0,
        })
    }

    /// The CQ `cq` names, to change.
    fn cq_mut(&mut self, cq: CqHandle) -> Result<&mut Cq> {
        self.cx.cqs.get_mut(cq.0).ok_or(VerbsError::NotFound {
            kind: Kind::Cq,
            handle: cq.0,
        })
    }
}

/// Live objects per kind.
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct Counts {
    pub pds: u32,
    pub mrs: u32,
    pub cqs: u32,
    pub qps: u32,
    pub srqs: u32,
    pub ahs: u32,
}

/// Checks that `port` is the only port (EINVAL otherwise).
fn check_port(port: u8) -> Result<()> {
    if port == PORT {
        Ok(())
    } else {
        Err(VerbsError::Invalid {
            what: "port number",
        })
    }
}

/// The QP `qpn` names, from the table alone (so that the context stays
/// free to borrow beside it).
fn qp_mut(qps: &mut Table<Box<Qp>>, qpn: Qpn) -> Result<&mut Qp> {
    qps.get_mut(qpn.value())
        .map(|q| &mut **q)
        .ok_or(VerbsError::NotFound {
            kind: Kind::Qp,
            handle: qpn.value(),
        })
}

/// How many of a table's objects `f` holds true for.
fn count<T>(t: &Table<T>, f: impl Fn(&T) -> bool) -> u32 {
    t.iter().filter(|(_, v)| f(v)).count() as u32
}
