# SPDX-License-Identifier: GPL-2.0 OR Linux-OpenIB
"""
virtio-rdma: address vectors as middleware builds them.

A GRH's flow label is 20 bits in a 32-bit field. UCX 1.13 fills it with
0xffffffff and with the complement of a path index and relies on the
driver to keep the low 20 bits, as rxe and hardware do; the driver masks
what it is given and the device ignores bits 20-31 (docs/virtio-rdma.md
§6.27). Before that, ibv_create_ah took such a vector and every UD send
through it then failed, and an RC QP's move to RTR with one was refused.

Written in rdma-core's test style (its tests package) and run beside its
suite by scripts/virtio-guest/rdma-core-tests.sh, on the device the suite
is given; both sides of each exchange on that device.
"""
import pyverbs.enums as e
from pyverbs.addr import AH, AHAttr, GlobalRoute

import tests.base as b
from tests.base import RCResources, RDMATestCase, UDResources
import tests.utils as u

# UCX's values: the all-ones label and ~path_index for paths 1 and 2.
LABELS = (0xffffffff, ~1 & 0xffffffff, ~2 & 0xffffffff)


def route(res, label):
    gid = res.ctx.query_gid(res.ib_port, res.gid_index)
    return GlobalRoute(dgid=gid, sgid_index=res.gid_index, flow_label=label)


class WideLabelRC(RCResources):
    """RC resources whose path to RTR carries a flow label wider than 20 bits."""

    label = LABELS[0]

    def to_rts(self):
        # The suite's own move to RTS (its attributes differ between
        # rdma-core releases), its path's GlobalRoute given the label.
        plain = b.GlobalRoute
        label = self.label

        def wide(*args, **kwargs):
            kwargs['flow_label'] = label
            return plain(*args, **kwargs)

        b.GlobalRoute = wide
        try:
            super().to_rts()
        finally:
            b.GlobalRoute = plain


class WideFlowLabelTest(RDMATestCase):
    def setUp(self):
        super().setUp()
        self.iters = 10

    def test_ud_through_wide_flow_labels(self):
        """
        An AH made with each of UCX's labels is taken, and datagrams sent
        through it arrive, their data checked.
        """
        self.create_players(UDResources)
        c, s = self.client, self.server
        for label in LABELS:
            # The sender's AH, to the device's own GID (both sides on it).
            ah = AH(c.pd, attr=AHAttr(port_num=self.ib_port, is_global=1,
                                      gr=route(c, label),
                                      dlid=c.port_attr.lid))
            s_recv = u.get_recv_wr(s)
            u.post_recv(s, s_recv)
            for _ in range(self.iters):
                send_wr, _ = u.get_send_elements(c, False)
                u.post_send(c, send_wr, ah=ah)
                u.poll_cq(c.cq)
                u.poll_cq(s.cq)
                u.post_recv(s, s_recv)
                for msg in u.get_msg_received(s, s.GRH_SIZE):
                    u.validate(msg, True, s.msg_size)

    def test_rc_path_with_a_wide_flow_label(self):
        """
        RC QPs moved to RTR with each of UCX's labels: the move is taken,
        QUERY_QP reports the low 20 bits, and traffic flows.
        """
        for label in LABELS:
            WideLabelRC.label = label
            self.create_players(WideLabelRC)
            for side in (self.client, self.server):
                attr, _ = side.qp.query(e.IBV_QP_AV)
                self.assertEqual(attr.ah_attr.flow_label, label & 0xfffff)
            u.traffic(**self.traffic_args)
