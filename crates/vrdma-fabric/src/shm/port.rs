//! A device's port on the switch: the addresses it holds, its sends
//! queued by mailbox and delivered under one lock each, its receives from
//! its mailbox and from other daemons' rings, and the wake-ups it spares
//! its senders while it polls.

use std::{
    io,
    os::fd::{AsFd, BorrowedFd},
    sync::{Arc, atomic::Ordering},
};

use nix::sys::epoll::{EpollEvent, EpollFlags};
use vrdma_wire::{Gid, frame::Route};

use super::{
    BATCH, Dest, Dropped, NetId, Network, Owned, PortShared, RendezvousStats, SPARES, Stats,
    Switch, lock,
    mailbox::{Loan, Mailbox, Parcel},
    peer, read, write,
};
use crate::{Lender, Piece};

/// A device's port on a [`Switch`].
#[derive(Debug)]
pub struct Port {
    switch: Switch,
    /// Its network.
    net: NetId,
    /// What it may hold.
    owned: Owned,
    mailbox: Arc<Mailbox>,
    /// Its identity, addresses and descriptor as the rendezvous sees them
    /// (the epoll instance: the mailbox's eventfd, the rings', and
    /// whatever else the device waits on, [`Port::watch`]).
    shared: Arc<PortShared>,
    /// The addresses this port holds on the switch.
    gids: Vec<Gid>,
    /// Addresses it claimed that another port holds (each counted once).
    refused: Vec<Gid>,
    /// Addresses it claimed that it does not own (each counted once).
    unowned: Vec<Gid>,
    /// The last destination looked up, the switch generation it is good
    /// for, and whether another network holds it.
    cache: Option<(u64, Gid, Option<Dest>, bool)>,
    /// Packets queued by [`Port::send`] for [`Port::flush`], by mailbox.
    outbox: Vec<(Arc<Mailbox>, Vec<Parcel>)>,
    /// Rings into other daemons' devices written since the last flush.
    touched: Vec<Arc<peer::Outbound>>,
    /// Packet buffers for the next sends (from the receivers' spares).
    pool: Vec<Vec<u8>>,
    /// Packets taken from the mailbox, being delivered.
    inbox: Vec<Parcel>,
    /// Buffers of the packets delivered, given back at the next receive.
    delivered: Vec<Vec<u8>>,
    /// Rings other daemons write for this device, and the generation of
    /// the shared list last taken.
    rings: Vec<peer::InRing>,
    rings_gen: u64,
    /// The ring the next receive starts at.
    ring_next: usize,
    /// A packet copied out of a ring.
    ring_buf: Vec<u8>,
    /// The switch generation [`Port::local_peers`] last answered for.
    peers_gen: Option<u64>,
    /// Whether senders were asked to wake the device ([`Port::arm`]).
    armed: bool,
    stats: Stats,
}

impl Port {
    /// The port [`Switch::attach_to`] made on network `net` of `switch`,
    /// which may hold what `owned` allows and holds nothing yet: its
    /// mailbox, and what it shares with the rendezvous thread.
    pub(super) fn attached(
        switch: Switch,
        net: NetId,
        owned: Owned,
        mailbox: Arc<Mailbox>,
        shared: Arc<PortShared>,
    ) -> Self {
        Port {
            switch,
            net,
            owned,
            mailbox,
            shared,
            gids: Vec::new(),
            refused: Vec::new(),
            unowned: Vec::new(),
            cache: None,
            outbox: Vec::new(),
            touched: Vec::new(),
            pool: Vec::new(),
            inbox: Vec::with_capacity(BATCH),
            delivered: Vec::with_capacity(BATCH),
            rings: Vec::new(),
            rings_gen: 0,
            ring_next: 0,
            ring_buf: vec![0; vrdma_wire::packet::MAX_LEN],
            peers_gen: None,
            armed: true,
            stats: Stats::default(),
        }
    }

    /// The descriptor that becomes readable when a packet arrives (or when
    /// a descriptor added with [`Port::watch`] does).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.shared.epoll.0.as_fd()
    }

    /// Adds `fd` to what [`Port::fd`] stands for (a device's other
    /// transport): `fd` must outlive the port.
    pub fn watch(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.shared
            .epoll
            .add(fd, EpollEvent::new(EpollFlags::EPOLLIN, 1))
            .map_err(io::Error::from)
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The addresses the port holds on the switch.
    pub fn gids(&self) -> &[Gid] {
        &self.gids
    }

    /// Its network.
    pub fn network(&self) -> &Network {
        &self.shared.net
    }

    /// The counters of the rendezvous the switch joined, if it did (the
    /// daemon's, not the port's).
    pub fn rendezvous(&self) -> Option<&RendezvousStats> {
        self.switch.inner.rendezvous.get().map(|a| &**a)
    }

    /// Whether the port may hold `gid` ([`Owned`]).
    pub fn owns(&self, gid: &Gid) -> bool {
        self.owned.allows(gid)
    }

    /// Makes `gids` the port's addresses on its network: the ones it held
    /// and no longer names are released; a new one it does not own is not
    /// taken (refused, counted, logged once), nor one another port of the
    /// network holds (a conflict, counted and logged once: packets to it
    /// go to that port).
    pub fn set_local(&mut self, gids: &[Gid]) {
        let dir = &self.switch.inner;
        let net = self.net;
        let mut owners = write(&dir.owners);
        for g in &self.gids {
            if !gids.contains(g)
                && owners
                    .get(net, g)
                    .is_some_and(|d| d.id() == self.mailbox.id)
            {
                owners.remove(net, g);
            }
        }
        let mut held = Vec::with_capacity(gids.len());
        for g in gids {
            if held.contains(g) {
                continue;
            }
            if !self.owned.allows(g) {
                if !self.unowned.contains(g) {
                    self.unowned.push(*g);
                    self.stats.gid_refused += 1;
                    tracing::warn!(
                        network = self.shared.net.label(),
                        gid = %g.ip(),
                        "same-host switch: an address the device was not given is not taken"
                    );
                }
                continue;
            }
            match owners.get(net, g) {
                Some(d) if d.id() != self.mailbox.id => {
                    if !self.refused.contains(g) {
                        self.refused.push(*g);
                        self.stats.gid_conflicts += 1;
                        tracing::warn!(
                            network = self.shared.net.label(),
                            gid = %g.ip(),
                            "same-host switch: an address another device of the network holds is not taken"
                        );
                    }
                }
                Some(_) => held.push(*g),
                None => {
                    owners.insert(net, *g, Dest::Local(Arc::clone(&self.mailbox)));
                    held.push(*g);
                }
            }
        }
        self.refused
            .retain(|g| gids.contains(g) && !held.contains(g));
        self.unowned.retain(|g| gids.contains(g));
        self.gids = held;
        dir.generation.fetch_add(1, Ordering::AcqRel);
        drop(owners);
        self.cache = None;
        let mut shared = lock(&self.shared.gids);
        if *shared != self.gids {
            shared.clone_from(&self.gids);
            drop(shared);
            dir.changed();
        }
    }

    /// Where `dgid` leads, if another port on the switch (or another
    /// daemon's device) holds it — cached while the switch's directory
    /// does not change, and no reference count touched on the way (an
    /// atomic per packet that the profile showed). The port's own
    /// addresses lead nowhere here: a device's packets to itself take its
    /// uplink's loopback, which paces them (the Ethernet port's bounded
    /// queue) rather than dropping what a full mailbox cannot hold.
    fn dest_of(&mut self, dgid: &Gid) -> Option<&Dest> {
        let generation = self.switch.generation();
        let fresh = matches!(&self.cache, Some((g, gid, _, _)) if *g == generation && gid == dgid);
        if !fresh {
            let (d, elsewhere) = self.switch.lookup(self.net, dgid);
            self.cache = Some((generation, *dgid, d, elsewhere));
        }
        let own = self.mailbox.id;
        self.cache
            .as_ref()
            .and_then(|(_, _, d, _)| d.as_ref())
            .filter(|d| d.id() != own)
    }

    /// Whether another port of the port's network holds `dgid` (the packet
    /// then goes through [`Port::send`]); when none does, the packet is
    /// the uplink's (counted: `tx_uplink`, and `tx_other_network` when a
    /// device of another network holds the address).
    pub fn reaches(&mut self, dgid: &Gid) -> bool {
        if self.dest_of(dgid).is_some() {
            return true;
        }
        self.stats.tx_uplink += 1;
        if matches!(&self.cache, Some((_, _, _, true))) {
            self.stats.tx_other_network += 1;
        }
        false
    }

    /// Queues a packet for the mailbox of the port holding `route.dst`;
    /// [`Port::flush`] delivers what is queued, a mailbox's share under one
    /// lock. `head` holds the packet's bytes (BTH through the ICRC field);
    /// when `lent` is not empty, `head` holds the bytes before the payload
    /// up to `payload_at` and those after it from there, and the payload is
    /// read from `mem` at the pieces' addresses — the one copy of its bytes
    /// on the way, from the sender's memory through its volatile view into
    /// a buffer of the daemon's own.
    pub fn send(
        &mut self,
        route: &Route,
        head: &[u8],
        payload_at: usize,
        lent: &[Piece],
        mem: &impl Lender,
    ) -> Result<(), Dropped> {
        if self.dest_of(&route.dst).is_none() {
            return Err(Dropped::NotHere);
        }
        if !self.gids.contains(&route.src) {
            self.stats.tx_spoofed += 1;
            return Err(Dropped::Spoofed);
        }
        let dest = match &self.cache {
            Some((_, _, Some(d), _)) if d.id() != self.mailbox.id => d,
            _ => return Err(Dropped::NotHere),
        };
        let mailbox = match dest {
            Dest::Local(m) => m,
            Dest::Remote(o) => {
                // Straight into the other daemon's ring.
                return match o.push(route, head, payload_at, lent, mem) {
                    Ok(len) => {
                        self.stats.tx_packets += 1;
                        self.stats.tx_bytes += len as u64;
                        if !self.touched.iter().any(|t| t.id == o.id) {
                            self.touched.push(Arc::clone(o));
                        }
                        Ok(())
                    }
                    Err(e) => {
                        match e {
                            Dropped::Full => self.stats.tx_dropped_full += 1,
                            Dropped::Unlent => self.stats.tx_dropped_unlent += 1,
                            _ => self.stats.tx_dropped_gone += 1,
                        }
                        Err(e)
                    }
                };
            }
        };
        let mut bytes = self.pool.pop().unwrap_or_default();
        let len = head.len() + lent.iter().map(|p| p.len).sum::<usize>();
        if bytes.len() < len {
            bytes.resize(len, 0);
        }
        if !gather(&mut bytes[..len], head, payload_at, lent, mem) {
            self.pool.push(bytes);
            self.stats.tx_dropped_unlent += 1;
            return Err(Dropped::Unlent);
        }
        let parcel = Parcel {
            route: *route,
            bytes,
            len,
            loan: None,
        };
        match self.outbox.iter_mut().find(|(m, _)| m.id == mailbox.id) {
            Some((_, q)) => q.push(parcel),
            None => self.outbox.push((Arc::clone(mailbox), vec![parcel])),
        }
        Ok(())
    }

    /// Whether `dgid` is held by a device of this process (not another
    /// daemon's): one a payload can be lent on to ([`Port::send_loan`]).
    pub fn lends_to(&mut self, dgid: &Gid) -> bool {
        matches!(self.dest_of(dgid), Some(Dest::Local(_)))
    }

    /// Queues a packet whose payload is lent on, not copied: `head` holds
    /// its bytes around the payload (up to `loan.payload_at`, then those
    /// after it) and the receiver copies the payload from the sender's
    /// memory through the loan — one copy, by the receiver, into the MR
    /// its checks allow. Only to a device of this process
    /// ([`Port::lends_to`]); else `Err` with the loan back (the caller then
    /// copies, [`Port::send`]).
    pub fn send_loan(&mut self, route: &Route, head: &[u8], loan: Loan) -> Result<(), Loan> {
        let Some(Dest::Local(mailbox)) = self.dest_of(&route.dst) else {
            return Err(loan);
        };
        let mailbox = Arc::clone(mailbox);
        if !self.gids.contains(&route.src) {
            self.stats.tx_spoofed += 1;
            // Refused, and counted: the caller must not send it otherwise.
            drop(loan);
            return Ok(());
        }
        let mut bytes = self.pool.pop().unwrap_or_default();
        if bytes.len() < head.len() {
            bytes.resize(head.len(), 0);
        }
        bytes[..head.len()].copy_from_slice(head);
        let parcel = Parcel {
            route: *route,
            bytes,
            len: head.len(),
            loan: Some(Box::new(loan)),
        };
        match self.outbox.iter_mut().find(|(m, _)| m.id == mailbox.id) {
            Some((_, q)) => q.push(parcel),
            None => self.outbox.push((mailbox, vec![parcel])),
        }
        Ok(())
    }

    /// The addresses held by the other devices of this process on the
    /// port's network, when they changed since the last call (`None` if
    /// not): the peers a device's engine may send a run of segments to in
    /// one packet (a lent-on payload is not cut into MTUs).
    #[inline]
    pub fn local_peers(&mut self) -> Option<Vec<Gid>> {
        let generation = self.switch.generation();
        if self.peers_gen == Some(generation) {
            return None;
        }
        self.local_peers_at(generation)
    }

    #[cold]
    fn local_peers_at(&mut self, generation: u64) -> Option<Vec<Gid>> {
        self.peers_gen = Some(generation);
        let (own, net) = (self.mailbox.id, self.net);
        let owners = read(&self.switch.inner.owners);
        Some(
            owners
                .by_net
                .iter()
                .filter(|((n, _), d)| *n == net && matches!(d, Dest::Local(m) if m.id != own))
                .map(|((_, g), _)| *g)
                .collect(),
        )
    }

    /// Delivers what [`Port::send`] queued: each mailbox's packets under
    /// one lock, one wake-up if its receiver was not already woken.
    /// Packets a full mailbox has no room for, or a closed one, are dropped
    /// and counted. Returns the packets delivered.
    pub fn flush(&mut self) -> usize {
        let mut delivered = 0;
        let (stats, pool) = (&mut self.stats, &mut self.pool);
        // A destination unused since the last flush is let go (a gone
        // port's mailbox is freed with it); one in use keeps its entry.
        self.outbox.retain_mut(|(mailbox, parcels)| {
            if parcels.is_empty() {
                return false;
            }
            let mut q = lock(&mailbox.queue);
            if q.closed {
                stats.tx_dropped_gone += parcels.len() as u64;
                pool.extend(parcels.drain(..).map(|p| p.bytes));
                return false;
            }
            let before = q.packets.len();
            for p in parcels.drain(..) {
                let weight = p.weight();
                if q.bytes + weight > mailbox.limit {
                    stats.tx_dropped_full += 1;
                    pool.push(p.bytes);
                    continue;
                }
                q.bytes += weight;
                stats.tx_packets += 1;
                stats.tx_bytes += (p.len + p.loan.as_ref().map_or(0, |l| l.len)) as u64;
                q.packets.push_back(p);
            }
            let added = q.packets.len() - before;
            delivered += added;
            // Buffers the receiver gave back, for the next packets.
            let take = q.spare.len().min(added.max(1));
            let at = q.spare.len() - take;
            pool.extend(q.spare.drain(at..));
            mailbox.pending.0.store(q.packets.len(), Ordering::SeqCst);
            if added > 0 && !q.signaled && mailbox.armed.load(Ordering::SeqCst) {
                q.signaled = true;
                // One write per wake-up cannot overflow the counter; a
                // failed write leaves a polling receiver to find them.
                let _ = mailbox.event.write(1);
            }
            true
        });
        self.pool.truncate(SPARES);
        for o in self.touched.drain(..) {
            o.publish();
        }
        delivered
    }

    /// Takes up to [`BATCH`] packets from the mailbox and hands each, with
    /// its route, to `deliver` — with its loan, if its sender lent its
    /// payload on ([`Port::send_loan`]; the bytes are then those around the
    /// payload). Returns the packets taken.
    pub fn receive(&mut self, mut deliver: impl FnMut(&Route, &[u8], Option<&Loan>)) -> usize {
        if self.armed {
            // Awake: the senders may spare the wake-ups until it arms
            // again.
            self.armed = false;
            self.mailbox.armed.store(false, Ordering::Relaxed);
            for r in &self.rings {
                r.disarm();
            }
        }
        let mut n = self.receive_rings(&mut deliver);
        if self.mailbox.pending.0.load(Ordering::Acquire) == 0 {
            return n;
        }
        {
            let mut q = lock(&self.mailbox.queue);
            let room = SPARES.saturating_sub(q.spare.len());
            let keep = self.delivered.len().min(room);
            q.spare.extend(self.delivered.drain(..keep));
            self.delivered.clear();
            while self.inbox.len() < BATCH {
                let Some(p) = q.packets.pop_front() else {
                    break;
                };
                q.bytes -= p.weight();
                self.inbox.push(p);
            }
            self.mailbox
                .pending
                .0
                .store(q.packets.len(), Ordering::Release);
            if q.packets.is_empty() && q.signaled {
                q.signaled = false;
                // Drains the counter: the descriptor is readable again
                // only when the next packet arrives.
                let _ = self.mailbox.event.read();
            }
        }
        n += self.inbox.len();
        for p in self.inbox.drain(..) {
            self.stats.rx_packets += 1;
            self.stats.rx_bytes += (p.len + p.loan.as_ref().map_or(0, |l| l.len)) as u64;
            self.stats.rx_lent += u64::from(p.loan.is_some());
            deliver(&p.route, p.packet(), p.loan.as_deref());
            self.delivered.push(p.bytes);
        }
        n
    }

    /// Takes what other daemons' rings hold for this device ([`BATCH`]
    /// packets at most), and lets go of the rings that are done with.
    fn receive_rings(&mut self, deliver: &mut impl FnMut(&Route, &[u8], Option<&Loan>)) -> usize {
        let g = self.shared.incoming_gen.load(Ordering::Acquire);
        let mut done = false;
        if g != self.rings_gen {
            self.rings_gen = g;
            self.rings.append(&mut lock(&self.shared.incoming));
            done = true;
        }
        let mut n = 0;
        // Round-robin: each call starts one ring further on, so that a ring
        // that fills the batch every time does not keep the later ones
        // unread.
        let count = self.rings.len();
        let first = if count == 0 {
            0
        } else {
            self.ring_next % count
        };
        self.ring_next = first.wrapping_add(1);
        for k in 0..count {
            let r = &mut self.rings[(first + k) % count];
            n += r.receive(
                &mut self.ring_buf,
                &self.gids,
                &mut self.stats,
                BATCH - n,
                &mut |route: &Route, p: &[u8]| deliver(route, p, None),
            );
            // A ring that broke, or whose daemon left and which is read
            // to its end, goes now (its eventfd out of the device's epoll,
            // its mapping unmapped), not when the next ring comes.
            done |= r.finished();
            if n >= BATCH {
                break;
            }
        }
        if done {
            let epoll = &self.shared.epoll;
            self.rings.retain(|r| {
                if r.finished() {
                    let _ = epoll.delete(r.event());
                    return false;
                }
                true
            });
        }
        n
    }

    /// Bytes received since the port was made.
    pub fn rx_bytes(&self) -> u64 {
        self.stats.rx_bytes
    }

    /// Says the port's user is about to sleep on [`Port::fd`]: senders
    /// must wake it again, and a packet that came while they need not is
    /// announced now (the descriptor is then readable at once). A
    /// [`Port::receive`] spares senders the wake-ups until the next arm, so
    /// a user must arm before every sleep — a busy-polling user never
    /// does, and costs its senders no system call.
    pub fn arm(&mut self) {
        self.armed = true;
        for r in &self.rings {
            r.arm();
        }
        self.mailbox.armed.store(true, Ordering::SeqCst);
        if self.mailbox.pending.0.load(Ordering::SeqCst) > 0 {
            let mut q = lock(&self.mailbox.queue);
            if !q.signaled && !q.packets.is_empty() {
                q.signaled = true;
                let _ = self.mailbox.event.write(1);
            }
        }
    }
}

/// Writes a packet into `out` (exactly its length): the head's bytes
/// before `payload_at`, the lent pieces read from `mem`, the head's rest.
/// False when `mem` no longer holds a piece (or the head is shorter than
/// `payload_at`).
fn gather(
    out: &mut [u8],
    head: &[u8],
    payload_at: usize,
    lent: &[Piece],
    mem: &impl Lender,
) -> bool {
    if lent.is_empty() {
        out.copy_from_slice(head);
        return true;
    }
    let (Some(before), Some(after)) = (head.get(..payload_at), head.get(payload_at..)) else {
        return false;
    };
    let (first, mut rest) = out.split_at_mut(payload_at);
    first.copy_from_slice(before);
    for p in lent {
        let (piece, tail) = rest.split_at_mut(p.len);
        if mem.lend(p.addr, p.len).map(|s| s.copy_to(piece)) != Some(p.len) {
            return false;
        }
        rest = tail;
    }
    rest.copy_from_slice(after);
    true
}

impl Drop for Port {
    /// Releases the port's addresses and closes its mailbox: packets sent
    /// to it from now on are dropped as gone.
    fn drop(&mut self) {
        self.flush();
        self.set_local(&[]);
        // The rendezvous tells the other daemons it is gone.
        self.shared.alive.store(false, Ordering::Release);
        self.switch.inner.changed();
        let mut q = lock(&self.mailbox.queue);
        q.closed = true;
        q.packets.clear();
        q.spare.clear();
        q.bytes = 0;
        self.mailbox.pending.0.store(0, Ordering::Release);
    }
}
