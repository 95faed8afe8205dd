#!/usr/bin/env python3
"""Writes the seeds of the PVRDMA and vfio-user fuzz targets
(seeds/vfio_user_message, seeds/vfio_user_fds, seeds/pvrdma_command, seeds/tap_frame,
seeds/pvrdma_wqe): a few
valid inputs each, in the formats the targets' doc comments describe.
VRDMA_FUZZ_TRACE=1 makes the PVRDMA targets say what each seed did:

    cd fuzz && python3 seeds/make_seeds.py && RUSTC_BOOTSTRAP=1 cargo fuzz build
    VRDMA_FUZZ_TRACE=1 target/x86_64-unknown-linux-gnu/release/pvrdma_command seeds/pvrdma_command/*
"""
import os
import struct

PAGE = 4096
HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    os.makedirs(os.path.join(HERE, target), exist_ok=True)
    with open(os.path.join(HERE, target, name), "wb") as f:
        f.write(data)


# ---- vfio_user_message: messages back to back ---------------------------
def msg(cmd, payload, id=1, flags=0):
    return struct.pack("<HHIII", id, cmd, 16 + len(payload), flags, 0) + payload


def access(region, off, count):
    return struct.pack("<QII", off, region, count)


def reg_write(region, off, v):
    return access(region, off, 4) + struct.pack("<I", v)


VERSION = struct.pack("<HH", 0, 0) + b'{"capabilities":{"max_msg_fds":16}}\0'
write("vfio_user_message", "version", msg(1, VERSION))
write(
    "vfio_user_message",
    "version-info-regions",
    msg(1, VERSION, 1)
    + msg(4, struct.pack("<IIII", 16, 0, 0, 0), 2)
    + b"".join(msg(5, struct.pack("<IIIIQQ", 32, 0, i, 0, 0, 0), 3 + i) for i in range(9))
    + msg(7, struct.pack("<IIII", 16, 0, 2, 0), 20),
)
write(
    "vfio_user_message",
    "version-config-bars",
    msg(1, VERSION)
    + msg(9, access(7, 0, 64), 2)
    + msg(10, access(7, 4, 2) + struct.pack("<H", 6), 3)
    + msg(9, access(1, 0, 4), 4)
    + msg(10, reg_write(1, 0x1C, 0), 5)
    + msg(10, reg_write(1, 0x0C, 0), 6)
    + msg(9, access(1, 0x14, 4), 7),
)
write(
    "vfio_user_message",
    "version-dma-irqs-reset",
    msg(1, VERSION)
    + msg(2, struct.pack("<IIQQQ", 32, 3, 0, 0x100000, 0x10000), 2)
    + msg(8, struct.pack("<IIIII", 20, 1 | 32, 2, 0, 0), 3)
    + msg(3, struct.pack("<IIQQ", 24, 0, 0x100000, 0x10000), 4)
    + msg(13, b"", 5)
    + msg(10, reg_write(2, 0, 0x40000011), 6, 0x10),
)

# ---- vfio_user_fds: a policy byte, then messages with descriptors --------
SEALED, UNSEALED, EVENTFD, PIPE_R, PIPE_W, DEV_NULL, SOCKET, SHRINK = range(8)


def fd(kind, pages=0):
    return kind | pages << 3


def with_fds(fds, message):
    return bytes([len(fds)]) + bytes(fds) + message


def policy(unsealed, max_maps, bytes_shift):
    return bytes([int(unsealed) | (max_maps - 1) << 1 | bytes_shift << 4])


RAM = 0x100000
BUS_MASTER = msg(10, access(7, 4, 2) + struct.pack("<H", 6), 4)
# The device reads the shared region from the first page of RAM.
ACTIVATE = (
    with_fds([], msg(10, reg_write(1, 0x04, RAM), 5))
    + with_fds([], msg(10, reg_write(1, 0x08, 0), 6))
    + with_fds([], msg(10, reg_write(1, 0x0C, 0), 7))
)


def dma_map(addr, size, id):
    return msg(2, struct.pack("<IIQQQ", 32, 3, 0, addr, size), id)


IRQS = msg(8, struct.pack("<IIIII", 20, 4 | 32, 2, 0, 3), 3)
write(
    "vfio_user_fds",
    "sealed-ram-irqs-activate",
    policy(False, 4, 15)
    + with_fds([], msg(1, VERSION, 1))
    + with_fds([fd(SEALED, 16)], dma_map(RAM, 16 * PAGE, 2))
    + with_fds([fd(EVENTFD)] * 3, IRQS)
    + with_fds([], BUS_MASTER)
    + ACTIVATE,
)
write(
    "vfio_user_fds",
    "unsealed-ram-shrunk",
    policy(True, 4, 15)
    + with_fds([], msg(1, VERSION, 1))
    + with_fds([fd(UNSEALED, 16)], dma_map(RAM, 16 * PAGE, 2))
    + with_fds([fd(EVENTFD)] * 3, IRQS)
    + with_fds([], BUS_MASTER)
    + with_fds([fd(SHRINK, 0)], msg(10, reg_write(1, 0x04, RAM), 5))
    + with_fds([], msg(10, reg_write(1, 0x08, 0), 6))
    + with_fds([], msg(10, reg_write(1, 0x0C, 0), 7)),
)
write(
    "vfio_user_fds",
    "wrong-kinds",
    policy(False, 8, 15)
    + with_fds([], msg(1, VERSION, 1))
    + with_fds([fd(PIPE_W), fd(SOCKET), fd(EVENTFD)], IRQS)
    + with_fds([fd(PIPE_R)], dma_map(RAM, PAGE, 2))
    + with_fds([fd(DEV_NULL)], dma_map(RAM, PAGE, 3))
    + with_fds([fd(SOCKET)], dma_map(RAM, PAGE, 4))
    + with_fds([fd(UNSEALED, 1)], dma_map(RAM, PAGE, 5))
    + with_fds([fd(EVENTFD)] * 17, IRQS),
)
write(
    "vfio_user_fds",
    "over-budget",
    policy(False, 1, 0)
    + with_fds([], msg(1, VERSION, 1))
    + with_fds([fd(SEALED, 2)], dma_map(RAM, 2 * PAGE, 2))
    + with_fds([fd(SEALED, 1)], dma_map(RAM, PAGE, 3))
    + with_fds([], dma_map(RAM + PAGE, PAGE, 4))
    + with_fds([fd(SEALED, 1)], dma_map(RAM + 2 * PAGE, PAGE, 5)),
)

# ---- pvrdma_command: records on a probed device --------------------------
BASE = 0x100000
FREE = BASE + 11 * PAGE


def fp(i):
    """Free page i (0 to 20)."""
    return FREE + i * PAGE


def cmdhdr(code):
    return struct.pack("<QII", 0x1234, code, 0)


def command(req):
    assert len(req) <= 184
    return bytes([0, len(req)]) + req


def poke(addr, data):
    off, out = addr - FREE, b""
    while data:
        chunk, data = data[:255], data[255:]
        out += bytes([1]) + struct.pack("<HB", off, len(chunk)) + chunk
        off += len(chunk)
    return out


def doorbell(page, which, v):
    return bytes([2]) + struct.pack("<HBI", page, which, v)


def rnd(ms):
    return bytes([3, ms])


def regw(which, v):
    return bytes([4, which]) + struct.pack("<I", v)


def pdir(dir_page, table_page, pages):
    return poke(dir_page, struct.pack("<Q", table_page)) + poke(
        table_page, b"".join(struct.pack("<Q", p) for p in pages)
    )


GID = bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1])
PEER = bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 2])
pd = command(cmdhdr(2) + struct.pack("<II", 0, 0))
bind = command(cmdhdr(15) + struct.pack("<III", 1024, 0, 0) + GID + bytes([2, 0, 0, 0]))
unbind = command(cmdhdr(16) + struct.pack("<I", 0) + GID + bytes(4))
dma_mr = command(cmdhdr(4) + struct.pack("<QQQIIII", 0, 0, 0, 1, 1, 1, 0))
# A CQ of 64 entries: state fp(2), entries fp(3); directory fp(0), table fp(1).
cq = pdir(fp(0), fp(1), [fp(2), fp(3)]) + command(
    cmdhdr(6) + struct.pack("<QIIII", fp(0), 0, 64, 2, 0)
)
# An RC QP, 16 deep with 2 SGEs each way: state fp(6), send fp(7), receive
# fp(8); directory fp(4), table fp(5). It is QP 17 and uses CQ 1.
qp = pdir(fp(4), fp(5), [fp(6), fp(7), fp(8)]) + command(
    cmdhdr(9)
    + struct.pack("<QIIIIIIIIIII", fp(4), 1, 1, 1, 0, 16, 16, 2, 2, 0, 0, 1)
    + struct.pack("<HHHBBB", 3, 1, 0, 0, 2, 0)
    + bytes(3)
)


def qpattr(state, mtu=0, rq_psn=0, sq_psn=0, dest=0, access=0, max_rd=0,
           max_dest_rd=0, rnr=0, timeout=0, retry=0, rnr_retry=0, dgid=PEER):
    a = bytearray(160)
    struct.pack_into("<IIIIIIIII", a, 0, state, 0, mtu, 0, 0, rq_psn, sq_psn, dest, access)
    a[42:49] = bytes([max_rd, max_dest_rd, rnr, 1, timeout, retry, rnr_retry])
    a[80:96] = dgid  # ah_attr.dgid
    a[101] = 64  # hop_limit
    a[111] = 1  # ah_flags: GRH
    a[112] = 1  # port_num
    return bytes(a)


def modify(handle, mask, attr):
    return command(cmdhdr(10) + struct.pack("<II", handle, mask) + attr)


INIT = 1 | 1 << 3 | 1 << 4 | 1 << 5
RTR = 1 | 1 << 7 | 1 << 8 | 1 << 12 | 1 << 15 | 1 << 17 | 1 << 20
RTS = 1 | 1 << 9 | 1 << 10 | 1 << 11 | 1 << 13 | 1 << 16
up = (
    modify(17, INIT, qpattr(1, access=7))
    + modify(17, RTR, qpattr(2, mtu=3, dest=17, rq_psn=0x100, max_dest_rd=4, rnr=12))
    + modify(17, RTS, qpattr(3, sq_psn=0x100, timeout=14, retry=7, rnr_retry=7, max_rd=4))
)
# The DMA MR's lkey is 0x100 (index 1, key 0).
send_wqe = (
    struct.pack("<QIIIIII", 1, 1, 0, 2, 2, 0, 0)
    + bytes(48)
    + struct.pack("<QII", fp(10), 64, 0x100)
)
send = poke(fp(7), send_wqe) + poke(fp(6), struct.pack("<I", 1)) + doorbell(0, 0, 17 | 1 << 30)
recv_wqe = struct.pack("<QII", 2, 1, 0) + struct.pack("<QII", fp(10), 64, 0x100)
recv = poke(fp(8), recv_wqe) + poke(fp(6) + 8, struct.pack("<I", 1)) + doorbell(0, 0, 17 | 1 << 31)
arm = doorbell(0, 1, 1 | 1 << 30)
write("pvrdma_command", "pd-mr-cq", pd + dma_mr + cq + rnd(0))
write(
    "pvrdma_command",
    "query-bind",
    command(cmdhdr(0) + bytes([1]) + bytes(7))
    + command(cmdhdr(1) + bytes([1, 0]) + bytes(6))
    + bind
    + unbind,
)
write(
    "pvrdma_command",
    "qp-up-send-recv",
    bind + pd + dma_mr + cq + arm + qp + up + recv + rnd(1) + send + rnd(5) + rnd(200),
)
write(
    "pvrdma_command",
    "qp-destroy-all",
    pd + cq + qp
    + command(cmdhdr(12) + struct.pack("<II", 17, 0))
    + command(cmdhdr(8) + struct.pack("<II", 1, 0))
    + command(cmdhdr(3) + struct.pack("<II", 1, 0)),
)
# A user context (doorbell page 1), its PD and an SRQ (state fp(13),
# entries fp(14)) with one receive posted, then its limit set.
srq = pdir(fp(11), fp(12), [fp(13), fp(14)]) + command(
    cmdhdr(17) + struct.pack("<QII", fp(11), 1, 2) + struct.pack("<IIII", 16, 2, 0, 0) + bytes(8)
)
srq_recv = poke(fp(14), recv_wqe) + poke(fp(13) + 8, struct.pack("<I", 1)) + doorbell(1, 2, 1 | 1 << 30)
write(
    "pvrdma_command",
    "uc-srq",
    command(cmdhdr(13) + struct.pack("<Q", 0xFE001))
    + command(cmdhdr(2) + struct.pack("<II", 1, 0))
    + srq
    + srq_recv
    + command(cmdhdr(19) + struct.pack("<II", 1, 0))
    + command(cmdhdr(18) + struct.pack("<II", 1, 2) + struct.pack("<IIII", 16, 2, 1, 0)),
)
# CTL RESET, then the shared region again (DSRLOW 0x100000, DSRHIGH 0),
# IMR 0, ACTIVATE.
write(
    "pvrdma_command",
    "reset-reprobe",
    pd + regw(2, 2) + pd + regw(0, BASE) + regw(1, 0) + regw(3, 0) + regw(2, 0) + pd,
)

# The device on its Ethernet port: QP 17 connected to itself (its packets
# loop back through the port), a SEND and a receive for it.
loop_up = (
    modify(17, INIT, qpattr(1, access=7))
    + modify(17, RTR, qpattr(2, mtu=3, dest=17, rq_psn=0x100, max_dest_rd=4, rnr=12, dgid=GID))
    + modify(17, RTS, qpattr(3, sq_psn=0x100, timeout=14, retry=7, rnr_retry=7, max_rd=4, dgid=GID))
)
write(
    "pvrdma_command",
    "eth-loopback-send",
    bind + pd + dma_mr + cq + arm + qp + loop_up + recv + rnd(1) + send + rnd(1) + rnd(1) + rnd(5),
)


def frame(tag, data):
    return bytes([tag]) + struct.pack("<H", len(data)) + data


GUEST_MAC = bytes([2, 0, 0, 0, 0, 1])
PEER_MAC = bytes([2, 0, 0, 0, 0, 2])


def ipv4_udp(src, dst, sport, dport, payload):
    udp = struct.pack(">HHHH", sport, dport, 8 + len(payload), 0) + payload
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, 17, 0, src, dst)
    return ip + udp


# An RC SEND_ONLY (opcode 4) to QP 17 at PSN 0x100 with AckReq, 64 bytes,
# ICRC left zero (checksums and the ICRC pass under cfg(fuzzing)).
bth = struct.pack(">BBHII", 4, 0x40, 0xFFFF, 17, 1 << 31 | 0x100)
roce = ipv4_udp(bytes([127, 0, 0, 2]), bytes([127, 0, 0, 1]), 0xC011, 4791, bth + bytes(64) + bytes(4))
from_uplink = frame(5, GUEST_MAC + PEER_MAC + b"\x08\x00" + roce)
write(
    "pvrdma_command",
    "eth-uplink-send",
    bind + pd + dma_mr + cq + arm + qp + up + recv + from_uplink + rnd(1) + rnd(1) + rnd(5),
)
# Frames from the guest's NIC: its own (127.0.0.1), a forged source MAC,
# a forged address, an ARP for itself.
plain = ipv4_udp(bytes([127, 0, 0, 1]), bytes([127, 0, 0, 2]), 1000, 2000, bytes(32))
forged = ipv4_udp(bytes([127, 0, 0, 9]), bytes([127, 0, 0, 2]), 1000, 2000, bytes(32))
arp = struct.pack(">HHBBH", 1, 0x0800, 6, 4, 1) + GUEST_MAC + bytes([127, 0, 0, 1]) + bytes(6) + bytes([127, 0, 0, 2])
write(
    "pvrdma_command",
    "eth-guest-frames",
    frame(6, PEER_MAC + GUEST_MAC + b"\x08\x00" + plain)
    + frame(6, PEER_MAC + PEER_MAC + b"\x08\x00" + plain)
    + frame(6, PEER_MAC + GUEST_MAC + b"\x08\x00" + forged)
    + frame(6, b"\xff" * 6 + GUEST_MAC + b"\x08\x06" + arp)
    + rnd(1)
    + rnd(1),
)

# ---- pvrdma_wqe: QP type, SGEs, offset, one page (in all four) ------------
def wqe_seed(ty, sges, at, page):
    return bytes([ty, sges]) + struct.pack("<H", at) + page


def sq_hdr(wr_id, num_sge, opcode, wr=bytes(48)):
    return struct.pack("<QIIIIII", wr_id, num_sge, 0, opcode, 2, 0, 0) + wr


def sge(addr, length, lkey=0x100):
    return struct.pack("<QII", addr, length, lkey)


write("pvrdma_wqe", "rc-send", wqe_seed(2, 2, 0, sq_hdr(7, 2, 2) + sge(BASE + 0x1000, 64) + sge(BASE + 0x2000, 32)))
write(
    "pvrdma_wqe",
    "rc-write",
    wqe_seed(2, 1, 0, sq_hdr(8, 1, 0, struct.pack("<QQQQQQ", 0x7F0000000000, 0x1234, 0, 0, 0, 0)) + sge(BASE + 0x1000, 64)),
)
write(
    "pvrdma_wqe",
    "rc-fetch-add",
    wqe_seed(2, 1, 0, sq_hdr(9, 1, 6, struct.pack("<QQQQQQ", 0x7F0000000000, 1, 0, 0x1234, 0, 0)) + sge(BASE + 0x1000, 8)),
)
AV = struct.pack("<II", 1 << 24 | 1, 0) + PEER + bytes([0, 0, 0, 64]) + bytes(12)
write(
    "pvrdma_wqe",
    "ud-send",
    wqe_seed(4, 1, 0, sq_hdr(10, 1, 2, struct.pack("<II", 17, 0x11111111) + AV) + sge(BASE + 0x1000, 64)),
)
# FAST_REG_MR: its wr_id is also the directory's table and the table's one
# page (every page holds these bytes): iova, the directory, page shift 12,
# 1 page, 4096 bytes, access 7, the rkey of MR 1 with key 5.
fr = struct.pack("<QQIIIII", 0x7F0000000000, BASE + 0x1000, 12, 1, 4096, 7, 1 << 8 | 5) + bytes(12)
write("pvrdma_wqe", "rc-fast-reg", wqe_seed(2, 2, 0, struct.pack("<QIIIIII", BASE + 0x2000, 0, 0, 11, 2, 0, 0) + fr))
write("pvrdma_wqe", "recv", wqe_seed(2, 2, 0, struct.pack("<QII", 5, 2, 0) + sge(BASE + 0x1000, 64) + sge(BASE + 0x2000, 64)))


# ---- virtio-rdma ------------------------------------------------------------------------------
# virtio_command: a context, a PD, a CQ, an RC QP and an MR, then a send WQE posted and its
# doorbell rung, turns of the device (see fuzz_targets/virtio_command.rs for the records).
VBASE = 0x10_0000


def vreq(opcode, ctx, body=b"", pages=()):
    req = struct.pack("<HHI", opcode, 0, ctx) + body + b"".join(struct.pack("<Q", p) for p in pages)
    return b"\0" + struct.pack("<H", len(req)) + req


def vpoke(off, data):
    assert off % 4 == 0 and len(data) < 256
    return b"\1" + struct.pack("<HB", off // 4, len(data)) + data


def vring(header, entries, stride, npages):
    return struct.pack("<QIIII", header, entries, stride, npages, 0)


AREA, CQP, SQP, RQP, HDRS, MRP = 1, 2, 3, 5, 6, 8
page = lambda i: VBASE + i * 4096
setup = (
    vreq(3, 0, struct.pack("<II", 64, 1), [page(AREA)])
    + vreq(5, 1)
    + vreq(7, 1, vring(page(HDRS), 128, 32, 1), [page(CQP)])
    + vreq(20, 1, struct.pack("<IBBHIIIIII", 1, 2, 0, 0, 1, 1, 0, 2, 2, 64)
           + vring(page(HDRS) + 64, 64, 64 * 0 + 128, 2) + vring(page(HDRS) + 128, 64, 64, 1),
           [page(SQP), page(SQP + 1), page(RQP)])
    + vreq(10, 1, struct.pack("<IIQQIIII", 1, 7, page(MRP), 8192, 12, 0, 2, 0), [page(MRP), page(MRP + 1)])
)
write("virtio_command", "setup", setup + b"\2")
# A SEND WQE in the send ring's first slot, the producer at 1, doorbell bit 1 (the QP's) and its
# summary bit, a turn; then the QP to INIT (MODIFY_QP: state 1, port 1).
wqe = struct.pack("<QBBHI", 7, 2, 2, 1, 0) + bytes(48) + struct.pack("<QII", page(MRP), 64, 0)
ring = vpoke((SQP) * 4096, wqe) + vpoke(HDRS * 4096 + 64, struct.pack("<I", 1))
bell = vpoke(AREA * 4096 + 1024, struct.pack("<Q", 1 << 1)) + vpoke(AREA * 4096 + 64, struct.pack("<Q", 1))
attrs = struct.pack("<IIIIIIIIHBBBBBBBBBB", 1, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0) + bytes(32)
modify = vreq(21, 1, struct.pack("<II", 17, 1 | 1 << 3 | 1 << 4 | 1 << 5) + attrs)
write("virtio_command", "post", setup + ring + bell + b"\2" + modify + b"\2\6")
write("virtio_command", "shrink", setup + b"\x07\x01\2" + ring + bell + b"\2\x07\x00\2\x08")
# virtio_wqe: RC SEND with two SGEs; UD SEND with its address vector; a REG_MR.
write("virtio_wqe", "rc-send", bytes([0, 4, 16]) + struct.pack("<QBBHI", 1, 2, 2, 2, 0) + bytes(48)
      + struct.pack("<QIIQII", 0x1000, 64, 0x100, 0x2000, 32, 0x100))
write("virtio_wqe", "ud-send", bytes([2, 4, 16]) + struct.pack("<QBBHI", 2, 2, 2, 1, 0)
      + bytes(16) + struct.pack("<IBBBB6sH", 0, 0, 64, 0, 0, bytes([2, 0, 0, 0, 0, 1]), 0)
      + struct.pack("<II", 17, 0x11111111) + bytes(8) + struct.pack("<QII", 0x1000, 64, 0x100))
write("virtio_wqe", "reg-mr", bytes([0, 4, 16]) + struct.pack("<QBBHI", 3, 10, 2, 0, 0)
      + struct.pack("<QQQIIIB", 0x7F0000000000, 8192, 0x9000, 0x105, 7, 2, 12) + bytes(11))

# lent_packet: flags (1: the peer may send runs of segments, 2: aim at the QP, 4: aim a RETH at the
# MR), payload_at, the payload's length (3 bytes, little-endian), then the head: the packet's
# bytes around the payload (BTH, extension headers, then pad and ICRC).


def bth(op, psn, ackreq=1):
    return bytes([op, 0, 0xFF, 0xFF, 0, 0, 0, 0, 0x80 if ackreq else 0]) + psn.to_bytes(3, "big")


def lent(flags, at, length, head):
    return bytes([flags, at]) + length.to_bytes(3, "little") + head + bytes(4)


def reth(va, length):
    return struct.pack(">QII", va, 0, length)


write("lent_packet", "write-only-run", lent(7, 28, 8192, bth(0x0A, 0) + reth(0x10000, 8192)))
write("lent_packet", "write-first-run", lent(7, 28, 4096, bth(0x06, 0) + reth(0x10000, 16384)))
write("lent_packet", "send-only-run", lent(3, 12, 5000, bth(0x04, 0)))
write("lent_packet", "send-only-wire", lent(2, 12, 5000, bth(0x04, 0)))
write("lent_packet", "send-inv", lent(3, 16, 6000, bth(0x17, 0) + bytes(4)))
write("lent_packet", "read-response", lent(3, 16, 4096, bth(0x10, 0) + bytes(4)))


# ---- virtio_pci: the transport's records ---------------------------------
def pci_w(off, data):
    widx = {1: 0, 2: 1, 4: 2, 8: 3}[len(data)]
    return bytes([3, 1]) + struct.pack("<HB", off, widx) + data


def pci_poke(off, data):
    return bytes([4]) + struct.pack("<HB", off, len(data)) + data


def pci_start(features_lo, features_hi, sizes=(16, 16, 16, 2)):
    out = pci_w(0x14, b"\x00") + pci_w(0x14, b"\x01") + pci_w(0x14, b"\x03")
    out += pci_w(0x08, struct.pack("<I", 0)) + pci_w(0x0C, struct.pack("<I", features_lo))
    out += pci_w(0x08, struct.pack("<I", 1)) + pci_w(0x0C, struct.pack("<I", features_hi))
    out += pci_w(0x14, b"\x0b")
    for q in range(4):
        base = (1 + 3 * q) * PAGE
        out += pci_w(0x16, struct.pack("<H", q)) + pci_w(0x18, struct.pack("<H", sizes[q]))
        for field, addr in ((0x20, base), (0x28, base + PAGE), (0x30, base + 2 * PAGE)):
            out += pci_w(field, struct.pack("<I", addr)) + pci_w(field + 4, struct.pack("<I", 0))
        out += pci_w(0x1A, struct.pack("<H", [1, 2, 3, 0xFFFF][q]))
        out += pci_w(0x1C, struct.pack("<H", 1))
    return out + pci_w(0x14, b"\x0f")


def pci_desc(i, addr, length, flags, nxt):
    return pci_poke(1 * PAGE + 16 * i, struct.pack("<QIHH", addr, length, flags, nxt))


def pci_request(opcode, body=b""):
    req = struct.pack("<HHI", opcode, 0, 0) + body
    out = pci_poke(13 * PAGE, req)
    out += pci_desc(0, 13 * PAGE, len(req), 1, 1) + pci_desc(1, 14 * PAGE, 255, 2, 0)
    out += pci_poke(2 * PAGE, struct.pack("<HHH", 0, 1, 0))
    return out + pci_w(0x3000, struct.pack("<H", 0)) + bytes([5])


write("virtio_pci", "start", pci_start((1 << 29) | 1, 1))
write("virtio_pci", "query_device", pci_start((1 << 29) | 1, 1) + pci_request(1))
write("virtio_pci", "no_version_1", pci_start(1, 0) + pci_request(1))
write(
    "virtio_pci",
    "window",
    bytes([1, 0x84 + 4, 0, 2]) + bytes([1, 0x84 + 8, 2]) + struct.pack("<I", 0x12)
    + bytes([0, 0x84 + 16, 2]),
)
write("virtio_pci", "reset_in_use", pci_start(1, 1) + pci_request(2) + bytes([7, 5, 8, 5, 9, 5]))


# ---- tap_frame: one read from a TAP (virtio-net header, then a frame) ---
def csum(b):
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s > 0xFFFF:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def tap_read(v6, segs, size, last, vlan=False):
    """A UDP GSO frame as the kernel gives a TAP that takes USO: `segs`
    segments of `size` payload bytes, the last `last`."""
    payload = b"".join(bytes([k]) * (size if k + 1 < segs else last) for k in range(segs))
    udp_len = 8 + len(payload)
    eth = bytes([2, 0, 0, 0, 0, 0xB]) + bytes([2, 0, 0, 0, 0, 0xA])
    if vlan:
        eth += struct.pack("!HH", 0x8100, 5)
    if v6:
        src, dst = bytes(15) + b"\x0a", bytes(15) + b"\x0b"
        eth += struct.pack("!H", 0x86DD)
        ip = struct.pack("!IHBB", 6 << 28, udp_len, 17, 64) + src + dst
        pseudo = src + dst + struct.pack("!IxxxB", udp_len, 17)
    else:
        src, dst = bytes([10, 9, 0, 1]), bytes([10, 9, 0, 2])
        eth += struct.pack("!H", 0x0800)
        ip = struct.pack("!BBHHHBBH", 0x45, 0, 20 + udp_len, 7, 0x4000, 64, 17, 0) + src + dst
        pseudo = src + dst + struct.pack("!xBH", 17, udp_len)
    udp = struct.pack("!HHHH", 0xC001, 4791, udp_len, csum(pseudo))
    l4 = len(eth) + len(ip)
    hdr = struct.pack("<BBHHHH", 1, 5, l4 + 8, size, l4, 6)
    return hdr + eth + ip + udp + payload


write("tap_frame", "v4-gso", tap_read(False, 5, 1040, 300))
write("tap_frame", "v6-gso", tap_read(True, 3, 4112, 4112))
write("tap_frame", "v4-vlan-gso", tap_read(False, 2, 64, 20, vlan=True))
write("tap_frame", "v4-whole", bytes(10) + tap_read(False, 1, 100, 100)[10:])
