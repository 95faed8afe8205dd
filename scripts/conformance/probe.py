#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0 OR Linux-OpenIB
"""
A conformance probe (issue 38): drives verbs' attributes through edge values
on one RDMA device and prints, as JSON, what the device did with each —
"ok", "errno N" (refused at the call), or "ok, then STATUS" (taken at the call
and failing later, which a device must never do where it could refuse at
once). Run on rxe and on each face of vrdma (scripts/conformance/run.sh), the
outcomes are compared: every difference is fixed or written down with its
reason (known.txt beside this script; README, "Conformance against rxe").

Values that depend on a device's limits are taken relative to what it
reports (its maximum, one past it), so two devices with different limits
compare equal when each keeps its own.

    probe.py --dev NAME --gid INDEX [--out FILE]

pyverbs as Debian 12 (rdma-core 44) and the project's Debian 13 image
(rdma-core 56) ship it.
"""
import argparse
import errno
import json
import sys

import pyverbs.enums as e
from pyverbs.addr import AH, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

OUT = {}


def outcome(name, fn):
    """Runs fn(); records ok, errno N, or what it returned (a string)."""
    try:
        r = fn()
        OUT[name] = r if isinstance(r, str) else "ok"
    except PyverbsRDMAError as ex:
        OUT[name] = "errno %s" % errno.errorcode.get(ex.error_code, ex.error_code)
    except PyverbsError as ex:
        OUT[name] = "error %s" % str(ex).split("\n")[0][:60]
    except (OverflowError, ValueError) as ex:
        # pyverbs cannot even pass the value (a GID index past 255)
        OUT[name] = "not passable: %s" % type(ex).__name__


class Dev:
    def __init__(self, name, gid):
        self.ctx = Context(name=name)
        self.attr = self.ctx.query_device()
        self.port = self.ctx.query_port(1)
        self.gid_index = gid
        self.gid = self.ctx.query_gid(1, gid)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 256, None, None, 0)

    def gr(self, **kw):
        args = dict(dgid=self.gid, sgid_index=self.gid_index)
        args.update(kw)
        return GlobalRoute(**args)

    def ah_attr(self, **kw):
        return AHAttr(port_num=1, is_global=1, gr=self.gr(**kw))


def probe_ah(d):
    for label in (0, 0xFFFFF, 0x100000, 0xFFFFFFFF, 0xFFFFFFFE):
        outcome("ah.flow_label=%#x" % label,
                lambda: AH(d.pd, attr=d.ah_attr(flow_label=label)))
    for hop in (0, 1, 255):
        outcome("ah.hop_limit=%d" % hop, lambda: AH(d.pd, attr=d.ah_attr(hop_limit=hop)))
    for tc in (0, 0xFF):
        outcome("ah.traffic_class=%#x" % tc,
                lambda: AH(d.pd, attr=d.ah_attr(traffic_class=tc)))
    # An empty slot of the GID table, and the first index past it (an AH's
    # index is 8 bits: a table of more than 255 entries has none).
    n = d.port.gid_tbl_len
    empty = next((i for i in range(d.gid_index + 1, min(n, 256))
                  if str(d.ctx.query_gid(1, i)) in ("::", "0000:0000:0000:0000:0000:0000:0000:0000")),
                 None)
    if empty is None:
        OUT["ah.sgid_index=an empty slot"] = "no empty slot"
    else:
        outcome("ah.sgid_index=an empty slot",
                lambda: AH(d.pd, attr=d.ah_attr(sgid_index=empty)))
    if n <= 255:
        outcome("ah.sgid_index=gid_tbl_len", lambda: AH(d.pd, attr=d.ah_attr(sgid_index=n)))
    else:
        OUT["ah.sgid_index=gid_tbl_len"] = "not passable: a table of more than 255"

    outcome("ah.no_grh", lambda: AH(d.pd, attr=AHAttr(port_num=1, is_global=0)))
    outcome("ah.port=2", lambda: AH(d.pd, attr=AHAttr(port_num=2, is_global=1, gr=d.gr())))


def probe_cq(d):
    m = d.attr.max_cqe
    for name, n in (("1", 1), ("max_cqe", m), ("max_cqe+1", m + 1), ("0", 0)):
        outcome("cq.cqe=%s" % name, lambda: CQ(d.ctx, n, None, None, 0))
    outcome("cq.comp_vector=num_comp_vectors",
            lambda: CQ(d.ctx, 16, None, None, d.ctx.num_comp_vectors))


ACCESS = (
    ("LW", e.IBV_ACCESS_LOCAL_WRITE),
    ("RW", e.IBV_ACCESS_REMOTE_WRITE),
    ("RR", e.IBV_ACCESS_REMOTE_READ),
    ("RA", e.IBV_ACCESS_REMOTE_ATOMIC),
    ("MW", e.IBV_ACCESS_MW_BIND),
)


def probe_mr(d):
    for bits in range(1 << len(ACCESS)):
        flags, names = 0, []
        for i, (n, f) in enumerate(ACCESS):
            if bits & (1 << i):
                flags |= f
                names.append(n)
        outcome("mr.access=%s" % ("+".join(names) or "none"),
                lambda: MR(d.pd, 4096, flags))
    outcome("mr.length=1", lambda: MR(d.pd, 1, e.IBV_ACCESS_LOCAL_WRITE))


def qp_init(d, qp_type=e.IBV_QPT_RC, **cap):
    c = dict(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
    c.update(cap)
    return QPInitAttr(qp_type=qp_type, scq=d.cq, rcq=d.cq, cap=QPCap(**c))


def probe_qp_create(d):
    a = d.attr
    for field, mx in (("max_send_wr", a.max_qp_wr), ("max_recv_wr", a.max_qp_wr),
                      ("max_send_sge", a.max_sge), ("max_recv_sge", a.max_sge)):
        for name, v in (("0", 0), ("max", mx), ("max+1", mx + 1)):
            outcome("qp.%s=%s" % (field, name), lambda: QP(d.pd, qp_init(d, **{field: v})))
    for v in (0, 64, 1 << 20):
        outcome("qp.max_inline_data=%d" % v,
                lambda: QP(d.pd, qp_init(d, max_inline_data=v)))
    for t, n in ((e.IBV_QPT_RC, "rc"), (e.IBV_QPT_UC, "uc"), (e.IBV_QPT_UD, "ud")):
        outcome("qp.type=%s" % n, lambda: QP(d.pd, qp_init(d, t)))


def to_init(qp, access=e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE):
    a = QPAttr(qp_state=e.IBV_QPS_INIT)
    a.pkey_index = 0
    a.port_num = 1
    a.qp_access_flags = access
    qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)


RTR = (e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN
       | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)
RTS = (e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY
       | e.IBV_QP_SQ_PSN | e.IBV_QP_MAX_QP_RD_ATOMIC)


def rtr_attr(d, dest, **kw):
    a = QPAttr(qp_state=e.IBV_QPS_RTR)
    a.path_mtu = e.IBV_MTU_1024
    a.dest_qp_num = dest
    a.rq_psn = 0
    a.max_dest_rd_atomic = 1
    a.min_rnr_timer = 12
    a.ah_attr = d.ah_attr(flow_label=kw.pop("flow_label", 0))
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def rts_attr(**kw):
    a = QPAttr(qp_state=e.IBV_QPS_RTS)
    a.timeout = 14
    a.retry_cnt = 7
    a.rnr_retry = 7
    a.sq_psn = 0
    a.max_rd_atomic = 1
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def fresh_rc(d, **cap):
    qp = QP(d.pd, qp_init(d, **cap))
    to_init(qp)
    return qp


def probe_qp_modify(d):
    # RESET -> INIT without the port: a required attribute missing.
    def missing():
        qp = QP(d.pd, qp_init(d))
        a = QPAttr(qp_state=e.IBV_QPS_INIT)
        qp.modify(a, e.IBV_QP_STATE)
    outcome("modify.reset-init.without_required", missing)
    outcome("modify.reset-rtr", lambda: QP(d.pd, qp_init(d)).modify(
        rtr_attr(d, 1), RTR))
    a = d.attr
    cases = [
        ("rtr.flow_label=0xffffffff", dict(flow_label=0xFFFFFFFF), None),
        ("rtr.path_mtu=4096", dict(path_mtu=e.IBV_MTU_4096), None),
        ("rtr.dest_qp_num=2^24-1", dict(dest_qp_num=(1 << 24) - 1), None),
        ("rtr.min_rnr_timer=31", dict(min_rnr_timer=31), None),
        ("rtr.max_dest_rd_atomic=max", dict(max_dest_rd_atomic=a.max_qp_rd_atom), None),
        ("rtr.max_dest_rd_atomic=max+1", dict(max_dest_rd_atomic=a.max_qp_rd_atom + 1), None),
        ("rtr.max_dest_rd_atomic=0", dict(max_dest_rd_atomic=0), None),
    ]
    for name, kw, _ in cases:
        def go(kw=kw):
            qp = fresh_rc(d)
            qp.modify(rtr_attr(d, qp.qp_num, **kw), RTR)
        outcome("modify." + name, go)
    rts_cases = [
        ("rts.timeout=0", dict(timeout=0)),
        ("rts.timeout=31", dict(timeout=31)),
        ("rts.retry_cnt=7", dict(retry_cnt=7)),
        ("rts.rnr_retry=7", dict(rnr_retry=7)),
        ("rts.max_rd_atomic=max", dict(max_rd_atomic=a.max_qp_init_rd_atom)),
        ("rts.max_rd_atomic=max+1", dict(max_rd_atomic=a.max_qp_init_rd_atom + 1)),
        ("rts.max_rd_atomic=0", dict(max_rd_atomic=0)),
    ]
    for name, kw in rts_cases:
        def go(kw=kw):
            qp = fresh_rc(d)
            qp.modify(rtr_attr(d, qp.qp_num), RTR)
            qp.modify(rts_attr(**kw), RTS)
        outcome("modify." + name, go)
    # The access flags a QP takes.
    for bits in range(1 << 4):
        flags, names = 0, []
        for i, (n, f) in enumerate(ACCESS[:4]):
            if bits & (1 << i):
                flags |= f
                names.append(n)
        outcome("modify.init.access=%s" % ("+".join(names) or "none"),
                lambda: to_init(QP(d.pd, qp_init(d)), flags))


def loopback_rc(d, **cap):
    """An RC QP connected to itself, in RTS, and a 4 KiB MR."""
    qp = fresh_rc(d, **cap)
    qp.modify(rtr_attr(d, qp.qp_num), RTR)
    qp.modify(rts_attr(), RTS)
    mr = MR(d.pd, 4096, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
            | e.IBV_ACCESS_REMOTE_READ)
    return qp, mr


def poll_one(cq, tries=200000):
    for _ in range(tries):
        n, wcs = cq.poll(1)
        if n:
            return wcs[0]
    return None


def send_then(d, qp, wr, cq):
    """Posts wr: "ok" if its completion succeeds, "ok, then STATUS" if it
    fails later, errno at the post."""
    qp.post_send(wr)
    wc = poll_one(cq)
    if wc is None:
        return "ok, then no completion"
    if wc.status != e.IBV_WC_SUCCESS:
        return "ok, then status %d" % wc.status
    return "ok"


def probe_post(d):
    a = d.attr
    for name, flags in (("SIGNALED", e.IBV_SEND_SIGNALED),
                        ("SIGNALED+SOLICITED", e.IBV_SEND_SIGNALED | e.IBV_SEND_SOLICITED),
                        ("SIGNALED+FENCE", e.IBV_SEND_SIGNALED | e.IBV_SEND_FENCE)):
        def go(flags=flags):
            cq = CQ(d.ctx, 64, None, None, 0)
            qp = QP(d.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq,
                                     cap=QPCap(max_send_wr=4, max_recv_wr=4)))
            to_init(qp)
            qp.modify(rtr_attr(d, qp.qp_num), RTR)
            qp.modify(rts_attr(), RTS)
            mr = MR(d.pd, 4096, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
            wr = SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                        sg=[SGE(mr.buf, 64, mr.lkey)], send_flags=flags)
            wr.set_wr_rdma(mr.rkey, mr.buf + 1024)
            return send_then(d, qp, wr, cq)
        outcome("post.write.flags=%s" % name, go)
    for name, n in (("0", 0), ("max_send_sge", None), ("max_send_sge+1", None)):
        def go(name=name):
            cq = CQ(d.ctx, 64, None, None, 0)
            sge = min(a.max_sge, 4)
            qp = QP(d.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq,
                                     cap=QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=sge)))
            to_init(qp)
            qp.modify(rtr_attr(d, qp.qp_num), RTR)
            qp.modify(rts_attr(), RTS)
            mr = MR(d.pd, 4096, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
            k = {"0": 0, "max_send_sge": sge, "max_send_sge+1": sge + 1}[name]
            sg = [SGE(mr.buf + 16 * i, 16, mr.lkey) for i in range(k)]
            wr = SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=k, sg=sg or None,
                        send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(mr.rkey, mr.buf + 2048)
            return send_then(d, qp, wr, cq)
        outcome("post.write.sges=%s" % name, go)
    # A UD QP asked for an RDMA WRITE.
    def ud_write():
        cq = CQ(d.ctx, 64, None, None, 0)
        qp = QP(d.pd, QPInitAttr(qp_type=e.IBV_QPT_UD, scq=cq, rcq=cq,
                                 cap=QPCap(max_send_wr=4, max_recv_wr=4)))
        at = QPAttr(qp_state=e.IBV_QPS_INIT)
        at.pkey_index, at.port_num, at.qkey = 0, 1, 0x11111111
        qp.modify(at, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_QKEY)
        qp.modify(QPAttr(qp_state=e.IBV_QPS_RTR), e.IBV_QP_STATE)
        at = QPAttr(qp_state=e.IBV_QPS_RTS)
        at.sq_psn = 0
        qp.modify(at, e.IBV_QP_STATE | e.IBV_QP_SQ_PSN)
        mr = MR(d.pd, 4096, e.IBV_ACCESS_LOCAL_WRITE)
        ah = AH(d.pd, attr=d.ah_attr())
        wr = SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(mr.buf, 8, mr.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_ud(ah, qp.qp_num, 0x11111111)
        return send_then(d, qp, wr, cq)
    outcome("post.ud.rdma_write", ud_write)
    # A receive with more SGEs than max_recv_sge.
    def recv_sges():
        qp, mr = loopback_rc(d, max_recv_sge=1)
        sg = [SGE(mr.buf, 8, mr.lkey), SGE(mr.buf + 8, 8, mr.lkey)]
        qp.post_recv(RecvWR(num_sge=2, sg=sg))
    outcome("post.recv.sges=max_recv_sge+1", recv_sges)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dev", required=True)
    ap.add_argument("--gid", type=int, required=True)
    ap.add_argument("--out")
    a = ap.parse_args()
    d = Dev(a.dev, a.gid)
    for p in (probe_ah, probe_cq, probe_mr, probe_qp_create, probe_qp_modify, probe_post):
        try:
            p(d)
        except Exception as ex:  # a probe that cannot run says so, the rest go on
            OUT[p.__name__] = "probe failed: %s" % ex
    text = json.dumps(OUT, indent=1, sort_keys=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
