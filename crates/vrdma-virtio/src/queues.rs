//! The virtqueues' work, whichever transport carries them — vhost-user's
//! vrings ([`crate::vhost`]) or the virtio-pci function's queues
//! ([`crate::pci`]): the controlq's requests carried out on the face, the
//! eventq's and notifyq's buffers filled from what waits, and whether the
//! driver wants a used-buffer notification. Chains are read through
//! `virtio-queue` from the guest memory the transport gives; every length
//! and direction is checked before a byte moves.

use std::ops::Deref;

use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory};
use vrdma_device::Transport;
use zerocopy::IntoBytes;

use crate::{
    abi,
    face::{MAX_REQUEST, VirtioRdma},
};

/// The available ring's flag by which a driver without EVENT_IDX asks for
/// no notifications.
const VIRTQ_AVAIL_F_NO_INTERRUPT: u16 = 1;

/// Whether the driver wants a used-buffer notification now: with
/// VIRTIO_F_EVENT_IDX, by its used_event (virtio-queue decides); without,
/// by VIRTQ_AVAIL_F_NO_INTERRUPT in the available ring's flags (virtio 1.2
/// §2.7.10: the device SHOULD NOT notify then — virtio-queue reads no
/// flags, so the word is read here, from guest memory; unreadable, it
/// notifies).
pub(crate) fn wants_notification<M: GuestMemory>(
    q: &mut Queue,
    mem: &M,
    event_idx: bool,
) -> Result<bool, virtio_queue::Error> {
    if event_idx {
        return q.needs_notification(mem);
    }
    let avail = GuestAddress(q.avail_ring());
    Ok(mem
        .load::<u16>(avail, std::sync::atomic::Ordering::Acquire)
        .map_or(true, |flags| {
            u16::from_le(flags) & VIRTQ_AVAIL_F_NO_INTERRUPT == 0
        }))
}

/// Carries out every request available on the controlq, in order, each
/// used with its response. Returns whether the driver is to be notified.
/// `bad` counts the chains that could carry no status.
pub(crate) fn control<T: Transport, M: GuestMemory>(
    face: &mut VirtioRdma<T>,
    q: &mut Queue,
    mem: &M,
    event_idx: bool,
    bad: &mut u64,
) -> Result<bool, virtio_queue::Error> {
    let mut notify = false;
    loop {
        if event_idx {
            q.disable_notification(mem)?;
        }
        let mut used_any = false;
        while let Some(chain) = q.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let len = command(face, chain, bad);
            q.add_used(mem, head, len)?;
            used_any = true;
        }
        if used_any && wants_notification(q, mem, event_idx)? {
            notify = true;
        }
        if !event_idx {
            break;
        }
        let more = q.enable_notification(mem)?;
        if more && !used_any {
            // The available index names chains that cannot be taken (it
            // is more than the queue's size ahead): a broken ring, left
            // until the driver mends it — never looked at again and
            // again here, which would hold the device's thread for good.
            *bad += 1;
            break;
        }
        if !more {
            break;
        }
    }
    Ok(notify)
}

/// One request: read whole from its chain's driver-readable part, its
/// response written into the device-writable part. Returns the bytes
/// written (`used.len`).
pub(crate) fn command<T: Transport, M>(
    face: &mut VirtioRdma<T>,
    chain: DescriptorChain<M>,
    bad: &mut u64,
) -> u32
where
    M: Deref + Clone,
    M::Target: GuestMemory,
{
    let mem = chain.memory();
    let mut req = Vec::new();
    let mut writable = Vec::new();
    let mut room = 0usize;
    let mut over = false;
    for d in chain.clone() {
        if d.is_write_only() {
            room = room.saturating_add(d.len() as usize);
            writable.push((d.addr(), d.len() as usize));
            continue;
        }
        if !writable.is_empty() {
            // A readable buffer after a writable one: no status can be
            // trusted to its place.
            *bad += 1;
            return 0;
        }
        if req.len() + d.len() as usize > MAX_REQUEST as usize {
            over = true;
            continue;
        }
        let at = req.len();
        req.resize(at + d.len() as usize, 0);
        if mem.read_slice(&mut req[at..], d.addr()).is_err() {
            *bad += 1;
            return 0;
        }
    }
    if room < size_of::<abi::RespHdr>() {
        *bad += 1;
        return 0;
    }
    let resp = if over {
        let hdr = abi::RespHdr {
            status: abi::status::LENGTH.into(),
            reserved: 0.into(),
            detail: vrdma_engine::errno::EMSGSIZE.unsigned_abs().into(),
        };
        face.stats.commands += 1;
        face.stats.refused += 1;
        hdr.as_bytes().to_vec()
    } else {
        face.command(&req, room)
    };
    let mut done = 0;
    for (addr, len) in writable {
        if done == resp.len() {
            break;
        }
        let n = len.min(resp.len() - done);
        if mem.write_slice(&resp[done..done + n], addr).is_err() {
            *bad += 1;
            break;
        }
        done += n;
    }
    done as u32
}

/// Hands what waits to the driver's eventq or notifyq buffers: one item
/// into each buffer's first descriptor. A buffer too small, or one the
/// device must not write, is returned empty and the item waits (DEV-8).
/// Returns whether the driver is to be notified.
pub(crate) fn deliver<E, M>(
    q: &mut Queue,
    mem: &M,
    event_idx: bool,
    mut next: impl FnMut() -> Option<E>,
    mut unget: impl FnMut(E),
    bad: &mut u64,
) -> Result<bool, virtio_queue::Error>
where
    E: IntoBytes + zerocopy::Immutable + Copy,
    M: GuestMemory,
{
    let mut used_any = false;
    while let Some(item) = next() {
        let Some(chain) = q.pop_descriptor_chain(mem) else {
            unget(item);
            break;
        };
        let head = chain.head_index();
        let bytes = item.as_bytes();
        let mut first = None;
        let mut readable = false;
        for d in chain {
            if !d.is_write_only() {
                readable = true;
            } else if first.is_none() {
                first = Some(d);
            }
        }
        let written = match first {
            Some(d)
                if !readable
                    && d.len() as usize >= bytes.len()
                    && mem.write_slice(bytes, d.addr()).is_ok() =>
            {
                bytes.len() as u32
            }
            _ => {
                *bad += 1;
                unget(item);
                0
            }
        };
        q.add_used(mem, head, written)?;
        used_any = true;
        if written == 0 {
            break;
        }
    }
    Ok(used_any && wants_notification(q, mem, event_idx)?)
}
