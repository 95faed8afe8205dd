# SPDX-License-Identifier: GPL-2.0 OR Linux-OpenIB
"""
virtio-rdma: verbs' limits on outstanding work requests, end to end.

The device gives a ring slot back when it copies a WQE, before the work
request completes (docs/virtio-rdma.md §7.2), so the limits are the
driver's to keep: a receive is outstanding until its completion is polled;
a send, until a completion of it or of a later send on the queue is polled
— the device says in each send completion how many send WQEs retired
(§7.8, `src_qp`). A post past max_send_wr or max_recv_wr
outstanding fails with ENOMEM, as on hardware.

Written in rdma-core's test style (its tests package: RDMATestCase,
RCResources) and run beside its suite by
scripts/virtio-guest/rdma-core-tests.sh, on the device the suite is given.
"""
import errno

import pyverbs.enums as e
from pyverbs.cq import CQ, CompChannel
from pyverbs.mr import MR
from pyverbs.pyverbs_error import PyverbsRDMAError
from pyverbs.qp import QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

from tests.base import RCResources, RDMATestCase


class LimitedRC(RCResources):
    """An RC QP of a few work requests a queue, its CQ on a channel."""

    DEPTH = 8

    def create_cq(self):
        self.channel = CompChannel(self.ctx)
        self.cq = CQ(self.ctx, self.num_msgs, None, self.channel, 0)

    def create_mr(self):
        self.mr = MR(self.pd, self.msg_size,
                     e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)

    def create_qp_attr(self):
        attr = QPAttr(port_num=self.ib_port)
        attr.qp_access_flags = (e.IBV_ACCESS_LOCAL_WRITE |
                                e.IBV_ACCESS_REMOTE_WRITE)
        return attr

    def create_qp_cap(self):
        return QPCap(max_send_wr=self.DEPTH, max_recv_wr=self.DEPTH)

    def create_qp_init_attr(self):
        # Only the WRs posted signaled complete (pyverbs signals all by
        # default).
        return QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                          cap=self.create_qp_cap(), sq_sig_all=0)


class OutstandingLimitsTest(RDMATestCase):
    def setUp(self):
        super().setUp()
        self.iters = 1
        self.create_players(LimitedRC)

    def caps(self, side):
        attr, _ = side.qp.query(e.IBV_QP_CAP)
        return attr.cap.max_send_wr, attr.cap.max_recv_wr

    def write(self, wr_id, signaled):
        c = self.client
        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                    sg=[SGE(c.mr.buf, 8, c.mr.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED if signaled else 0)
        wr.set_wr_rdma(c.rkey, c.raddr)
        return wr

    def refused(self, post):
        with self.assertRaises(PyverbsRDMAError) as ex:
            post()
        self.assertEqual(ex.exception.error_code, errno.ENOMEM)

    def wait_completion(self):
        """
        Blocks until the client's CQ, armed before the posts, holds a
        completion; polls none.
        """
        c = self.client
        c.channel.get_cq_event(c.cq)
        c.cq.ack_events(1)

    def test_sends_outstanding_until_a_later_completion_is_polled(self):
        """
        max_send_wr WRITEs, the last signaled: once its completion is in
        the CQ the device has taken and done them all and every ring slot
        is free, but until it is polled each is outstanding and one more
        is refused; once polled, as many again are taken.
        """
        c = self.client
        depth, _ = self.caps(c)
        for rnd in range(3):
            c.cq.req_notify()
            for i in range(depth):
                c.qp.post_send(self.write(rnd * depth + i, i == depth - 1))
            self.wait_completion()
            self.refused(lambda: c.qp.post_send(self.write(999, True)))
            n, wcs = c.cq.poll()
            self.assertEqual(n, 1)
            self.assertEqual(wcs[0].status, e.IBV_WC_SUCCESS)
            self.assertEqual(wcs[0].wr_id, rnd * depth + depth - 1)

    def test_receives_outstanding_until_polled(self):
        """max_recv_wr receives posted; one more is refused."""
        s = self.server
        _, depth = self.caps(s)
        sge = SGE(s.mr.buf, s.msg_size, s.mr.lkey)
        for i in range(depth):
            s.qp.post_recv(RecvWR(wr_id=i, num_sge=1, sg=[sge]))
        self.refused(lambda: s.qp.post_recv(RecvWR(wr_id=depth, num_sge=1,
                                                   sg=[sge])))
