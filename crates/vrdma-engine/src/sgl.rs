//! Scatter/gather lists: a message's bytes walked across a WR's SGEs,
//! each piece checked against its lkey, PD, bounds and rights before the
//! memory is touched.

use vrdma_wire::Lkey;

use crate::{
    handle::PdHandle,
    memory::{Memory, Payload},
    mr::{Access, AccessError, Keys, Mr},
    transmit::PayloadRef,
    wr::Sge,
};

/// Lends `len` bytes starting `offset` bytes into the SGE list: checks
/// each piece as [`gather`] does and appends its device address to `out`.
/// False (and `out` as it was) when the memory does not lend a piece.
#[allow(clippy::too_many_arguments)]
pub(crate) fn lend(
    keys: &Keys,
    mem: &impl Memory,
    pd: PdHandle,
    sges: &[Sge],
    offset: u64,
    len: usize,
    out: &mut Vec<PayloadRef>,
    mrs: &mut Vec<Lkey>,
) -> Result<bool, AccessError> {
    let start = out.len();
    let mut lendable = true;
    walk(sges, offset, len, |sge, at, _, n| {
        let mr = keys.check_local(sge.lkey, pd, sge.addr + at, n as u64, Access::NONE)?;
        if lendable {
            lendable = lend_range(mr, mem, sge.addr + at, n as u64, out, mrs)?;
        }
        Ok(())
    })?;
    if !lendable {
        out.truncate(start);
    }
    Ok(lendable)
}

/// Appends the device addresses of `va..va + len` of the (checked) `mr`
/// to `out` if `mem` lends every piece, and the MR's lkey to `mrs`
/// unless it is there already (its fence guards the pieces:
/// [`crate::Engine::gathered_fences`]); else leaves `out` as it was. Whether it
/// did.
pub(crate) fn lend_range(
    mr: &Mr,
    mem: &impl Memory,
    va: u64,
    len: u64,
    out: &mut Vec<PayloadRef>,
    mrs: &mut Vec<Lkey>,
) -> Result<bool, AccessError> {
    let start = out.len();
    let mut lendable = true;
    mr.for_each_chunk(va, len, |addr, n| {
        // n <= len, which is at most a packet's payload.
        let n = n as usize;
        if lendable && mem.lends(addr, n) {
            out.push(PayloadRef { addr, len: n });
        } else {
            lendable = false;
        }
        Ok(())
    })?;
    if !lendable {
        out.truncate(start);
    } else if !mrs.contains(&mr.lkey) {
        mrs.push(mr.lkey);
    }
    Ok(lendable)
}

/// Reads `out.len()` bytes starting `offset` bytes into the SGE list, each
/// SGE checked against its lkey and `pd`.
pub(crate) fn gather(
    keys: &Keys,
    mem: &impl Memory,
    pd: PdHandle,
    sges: &[Sge],
    offset: u64,
    out: &mut [u8],
) -> Result<(), AccessError> {
    walk(sges, offset, out.len(), |sge, at, done, n| {
        let mr = keys.check_local(sge.lkey, pd, sge.addr + at, n as u64, Access::NONE)?;
        mr.read(mem, sge.addr + at, &mut out[done..done + n])
    })
}

/// Writes `data` starting `offset` bytes into the SGE list (LOCAL_WRITE
/// needed on every MR).
pub(crate) fn scatter(
    keys: &Keys,
    mem: &mut impl Memory,
    pd: PdHandle,
    sges: &[Sge],
    offset: u64,
    data: Payload<'_>,
) -> Result<(), AccessError> {
    // One match, then the walk of each kind (the bytes' is every packet's).
    match data {
        Payload::Bytes(b) => walk(sges, offset, b.len(), |sge, at, done, n| {
            let mr =
                keys.check_local(sge.lkey, pd, sge.addr + at, n as u64, Access::LOCAL_WRITE)?;
            mr.write(mem, sge.addr + at, &b[done..done + n])
        }),
        Payload::Lent { .. } => walk(sges, offset, data.len(), |sge, at, done, n| {
            let mr =
                keys.check_local(sge.lkey, pd, sge.addr + at, n as u64, Access::LOCAL_WRITE)?;
            mr.write_payload(mem, sge.addr + at, data.part(done, n))
        }),
    }
}

/// Calls `f(sge, offset_in_sge, bytes_done, n)` for each piece of
/// `len` bytes starting `offset` bytes into the SGE list.
fn walk(
    sges: &[Sge],
    offset: u64,
    len: usize,
    mut f: impl FnMut(&Sge, u64, usize, usize) -> Result<(), AccessError>,
) -> Result<(), AccessError> {
    let mut skip = offset;
    let mut done = 0usize;
    for sge in sges {
        if done == len {
            break;
        }
        let sl = u64::from(sge.length);
        if skip >= sl {
            skip -= sl;
            continue;
        }
        let n = ((sl - skip) as usize).min(len - done);
        f(sge, skip, done, n)?;
        done += n;
        skip = 0;
    }
    if done < len {
        return Err(AccessError::OutOfBounds {
            va: offset,
            len: len as u64,
            start: 0,
            length: sges.iter().map(|s| u64::from(s.length)).sum(),
        });
    }
    Ok(())
}
