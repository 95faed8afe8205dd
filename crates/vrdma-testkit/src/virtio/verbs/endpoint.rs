//! A side of a test ([`Endpoint`]: a guest with the objects most tests
//! need), two sides' QPs connected, and a SEND between them checked byte
//! for byte.

use vrdma_virtio::abi::access;
use vrdma_wire::Gid;

use super::{
    codes::{ALL_ACCESS, wc},
    objects::{Cq, Ctx, Mr, Qp, QpSpec},
    wqe::Wqe,
};
use crate::virtio::{GuestDevice, frontend::Frontend};

/// A guest on a device with what most tests need: a context (4096
/// doorbells) with the device's address as GID 0, a PD, a CQ of 256
/// entries and a 1 MiB MR with every access.
#[derive(Debug)]
pub struct Endpoint {
    pub fe: Frontend,
    pub ctx: Ctx,
    pub pd: u32,
    pub cq: Cq,
    pub mr: Mr,
    pub gid: Gid,
}

impl Endpoint {
    /// On `dev` with 64 MiB of guest memory.
    pub fn new(dev: &impl GuestDevice) -> Self {
        Self::with_memory(dev, 64 << 20)
    }

    pub fn with_memory(dev: &impl GuestDevice, size: u64) -> Self {
        Self::on(dev.connect(size), dev.gid())
    }

    /// On a connected front-end, binding `gid`.
    pub fn on(mut fe: Frontend, gid: Gid) -> Self {
        let ctx = fe.context(4096);
        fe.set_gid(&ctx, 0, gid)
            .unwrap_or_else(|s| panic!("SET_GID refused: {s:?}"));
        let pd = fe.pd(&ctx);
        let cq = fe.cq(&ctx, 256);
        let mr = fe.reg_mr(&ctx, pd, 1 << 20, ALL_ACCESS | access::MW_BIND);
        Endpoint {
            fe,
            ctx,
            pd,
            cq,
            mr,
            gid,
        }
    }

    /// A QP of `qp_type` on the side's CQ.
    pub fn qp(&mut self, qp_type: u8) -> Qp {
        let spec = QpSpec::new(qp_type, self.cq.handle);
        self.fe.qp(&self.ctx, self.pd, &spec)
    }

    /// Guest memory of the MR: writes `data` at `off`.
    pub fn put(&self, off: u64, data: &[u8]) {
        self.fe.ram.write(self.mr.gpa + off, data);
    }

    /// Reads `len` bytes of the MR at `off`.
    pub fn get(&self, off: u64, len: usize) -> Vec<u8> {
        self.fe.ram.read_bytes(self.mr.gpa + off, len)
    }
}

/// Brings `qa` (of side `a`) and `qb` (of `b`) to RTS, connected to each
/// other (UD QPs: each to RTS).
pub fn connect(a: &mut Endpoint, qa: &Qp, b: &mut Endpoint, qb: &Qp) {
    let (ga, gb) = (a.gid, b.gid);
    for (s, q, peer, pgid) in [(&mut *a, qa, qb.qpn, gb), (&mut *b, qb, qa.qpn, ga)] {
        s.fe.qp_init(&s.ctx, q, ALL_ACCESS);
        s.fe.qp_rtr(&s.ctx, q, peer, pgid);
        s.fe.qp_rts(&s.ctx, q);
    }
}

/// A deterministic pattern of `len` bytes from `seed`.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// A SEND of `len` bytes from `a` to `b` on connected RC QPs, checked
/// byte for byte: the receive posted, the send posted, both completions,
/// the bytes in `b`'s MR. `tag` makes the data and wr_ids differ.
pub fn send_checked(
    a: &mut Endpoint,
    qa: &mut Qp,
    b: &mut Endpoint,
    qb: &mut Qp,
    tag: u8,
    len: u32,
) {
    let data = pattern(tag, len as usize);
    a.put(0, &data);
    b.fe.ram.fill(b.mr.gpa + 4096, len as usize, 0);
    qb.post_recv(u64::from(tag) << 8 | 1, &[b.mr.sge(4096, len)]);
    qa.post_send(&Wqe::send(u64::from(tag) << 8 | 2, &[a.mr.sge(0, len)]));
    a.cq.expect_ok(wc::SEND, u64::from(tag) << 8 | 2);
    let c = b.cq.expect_ok(wc::RECV, u64::from(tag) << 8 | 1);
    assert_eq!(c.byte_len.get(), len);
    assert_eq!(c.qpn.get(), qb.qpn);
    assert_eq!(b.get(4096, len as usize), data, "the SEND's bytes");
}
