#!/usr/bin/env python3
# Holds a verbs context on DEVICE with a PD, an MR, a CQ and an RC QP through the stock
# libibverbs (pyverbs) and the provider, says "ready", then waits for the device's async
# events and prints each; exits 0 after IBV_EVENT_DEVICE_FATAL once its objects are closed
# (what a process must see when the driver is unloaded under it); SIGALRM ends it (rc 142)
# when none came within TIMEOUT seconds.
#   hold-context.py DEVICE [TIMEOUT]
import signal
import sys

import pyverbs.enums as e
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPCap, QPInitAttr

dev = sys.argv[1]
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 120
ctx = Context(name=dev)
pd = PD(ctx)
mr = MR(pd, 65536, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
cq = CQ(ctx, 64)
qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq,
                       cap=QPCap(max_send_wr=16, max_recv_wr=16)))
print(f"ready qpn {qp.qp_num} lkey {mr.lkey:#x}", flush=True)
signal.alarm(int(timeout))
fatal = False
while not fatal:
    ev = ctx.get_async_event()
    kind = ev.event_type
    ev.ack()
    print(f"event {kind}", flush=True)
    fatal = kind == e.IBV_EVENT_DEVICE_FATAL
# The objects are gone from the device: closing them must not fail the process.
for o in (qp, cq, mr, pd):
    try:
        o.close()
    except Exception as x:  # the kernel answers EIO for a disassociated device
        print(f"close {type(o).__name__}: {x}", flush=True)
ctx.close()
print("device fatal seen, objects closed", flush=True)
