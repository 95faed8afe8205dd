#!/usr/bin/env python3
"""QEMU 11 attaches `vrdma serve`'s virtio-rdma device: the QEMU route of
docs/virtio-rdma.md §13.1, checked without a guest kernel.

QEMU runs with `-accel qtest`: this script is the guest. It finds the
vhost-user-test-device-pci function on the PCI bus, reads its virtio
capabilities, negotiates features with the daemon through QEMU, reads the
device configuration (the sibling NIC's MAC), sets up the four virtqueues
and sends commands on the control queue — QUERY_DEVICE, CREATE_CONTEXT,
ALLOC_PD — whose responses come back through QEMU from the daemon. Beside
it, a virtio-net whose `-netdev stream` backend is the daemon's port.

    attach.py VRDMA_BINARY [VIRTIO_ID | pci]

VIRTIO_ID defaults to 30: QEMU 11.1 aborts for 42 (its virtio name table
has no entry for it: `virtio_id_to_name: Assertion 'name != NULL'`), so the
check uses an ID QEMU names and no Linux driver binds. With VIRTIO_ID 42 the
script reports that abort.

With `pci` the daemon serves the device as a whole virtio-pci function over
vfio-user (`kind=virtio-pci`, §13.3) and QEMU attaches it with
`vfio-user-pci`, which knows nothing of virtio: the real device ID, 42, and
the same checks. Exit status 0: every check passed.
"""
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

QEMU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../shared/interop/qemu11/qemu")
MAC = "52:54:00:12:34:56"
SLOT = 4


CHILDREN = []


def fail(msg):
    print(f"attach: FAIL: {msg}", file=sys.stderr)
    for c in CHILDREN:
        c.kill()
    sys.exit(1)


def main():
    vrdma = sys.argv[1]
    pci = len(sys.argv) > 2 and sys.argv[2] == "pci"
    vid = 42 if pci else int(sys.argv[2]) if len(sys.argv) > 2 else 30
    run = tempfile.mkdtemp(prefix="vrdma-attach-")
    sock, netdev, uplink = (os.path.join(run, n) for n in ("rdma.sock", "net.sock", "uplink.sock"))
    # The uplink: a stream socket the daemon connects to; frames are read
    # and dropped.
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    up.bind(uplink)
    up.listen(1)

    def drain():
        c, _ = up.accept()
        while c.recv(65536):
            pass

    threading.Thread(target=drain, daemon=True).start()
    env = dict(os.environ, VRDMA_RUN_DIR=run)
    daemon = subprocess.Popen(
        [vrdma, "serve", *os.environ.get("VRDMA_SERVE_ARGS", "--seccomp kill --user nobody").split(), "--device",
         f"kind={'virtio-pci' if pci else 'virtio'},name=vrdma-attach,socket={sock},netdev={netdev},"
         f"uplink=stream:{uplink},mac={MAC}"],
        stderr=open(os.path.join(run, "daemon.err"), "w"), env=env)
    CHILDREN.append(daemon)
    # Ready once it says so (its sockets listen, the process is confined).
    deadline = time.monotonic() + 10
    while "ready" not in open(os.path.join(run, "daemon.err")).read():
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            fail("vrdma serve did not start: " + open(os.path.join(run, "daemon.err")).read())
        time.sleep(0.05)
    qemu_err = os.path.join(run, "qemu.err")
    if pci:
        rdma = ["-device", '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"%s"},'
                '"addr":"%#x.0","x-no-posted-writes":true}' % (sock, SLOT)]
    else:
        rdma = ["-chardev", f"socket,id=rdma0,path={sock}",
                "-device", f"vhost-user-test-device-pci,chardev=rdma0,addr={SLOT}.0,virtio-id={vid},"
                           "num_vqs=4,config_size=64,vq_size=256,page-per-vq=on"]
    qemu = subprocess.Popen(
        [QEMU, "-nodefaults", "-display", "none", "-accel", "qtest", "-qtest", "stdio",
         "-machine", "q35,memory-backend=mem", "-m", "256",
         "-object", "memory-backend-memfd,id=mem,size=256M,share=on",
         *rdma,
         "-netdev", f"stream,id=net0,server=off,addr.type=unix,addr.path={netdev}",
         "-device", f"virtio-net-pci,netdev=net0,mac={MAC},addr=5.0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(qemu_err, "w"), text=True)
    CHILDREN.append(qemu)

    def q(line):
        qemu.stdin.write(line + "\n")
        qemu.stdin.flush()
        while True:
            r = qemu.stdout.readline()
            if not r:
                err = open(qemu_err).read()
                if vid == 42 and "name != NULL" in err:
                    print("attach: QEMU aborts for virtio-id 42 (no name in its virtio table):")
                    print("  " + err.strip().splitlines()[-1])
                    daemon.terminate()
                    sys.exit(2)
                fail("QEMU exited: " + err[-800:])
            if r.startswith("IRQ"):
                continue
            return r.strip()

    val = lambda r: int(r.split()[1], 16)

    def cfg_r(off, size=4):
        q(f"outl 0xcf8 {0x80000000 | (SLOT << 11) | (off & ~3):#x}")
        v = val(q("inl 0xcfc")) >> (8 * (off & 3))
        return v & ((1 << (8 * size)) - 1)

    def cfg_w32(off, v):
        q(f"outl 0xcf8 {0x80000000 | (SLOT << 11) | off:#x}")
        q(f"outl 0xcfc {v:#x}")

    r8 = lambda a: val(q(f"readb {a:#x}"))
    r16 = lambda a: val(q(f"readw {a:#x}"))
    r32 = lambda a: val(q(f"readl {a:#x}"))
    w8 = lambda a, v: q(f"writeb {a:#x} {v:#x}")
    w16 = lambda a, v: q(f"writew {a:#x} {v:#x}")
    w32 = lambda a, v: q(f"writel {a:#x} {v:#x}")
    w64 = lambda a, v: q(f"writeq {a:#x} {v:#x}")

    def wbytes(a, b):
        for i in range(0, len(b), 4):
            chunk = b[i:i + 4].ljust(4, b"\0")
            w32(a + i, struct.unpack("<I", chunk)[0])

    def rbytes(a, n):
        return b"".join(struct.pack("<I", r32(a + i)) for i in range(0, n, 4))[:n]

    # The function: 1af4:(1040 + ID).
    vendor, device = cfg_r(0, 2), cfg_r(2, 2)
    print(f"attach: PCI function {vendor:04x}:{device:04x} at 00:{SLOT:02x}.0")
    if (vendor, device) != (0x1AF4, 0x1040 + vid):
        fail("not the virtio device asked for")
    # BAR2 (the modern BAR: 64-bit for QEMU's virtio-pci, 32-bit for the
    # daemon's function) at a fixed address; memory decoding and bus
    # mastering on.
    BAR = 0xE0000000
    cfg_w32(0x18, BAR)
    if not pci:
        cfg_w32(0x1C, 0)
    cfg_w32(0x04, cfg_r(0x04) | 6)
    caps = {}
    at = cfg_r(0x34, 1)
    while at:
        if cfg_r(at, 1) == 0x09:
            kind, bar, off = cfg_r(at + 3, 1), cfg_r(at + 4, 1), cfg_r(at + 8)
            mult = cfg_r(at + 16) if kind == 2 else None
            caps.setdefault(kind, (bar, off, mult))
        at = cfg_r(at + 1, 1)
    common, notify, devcfg = BAR + caps[1][1], BAR + caps[2][1], BAR + caps[4][1]
    mult = caps[2][2]
    print(f"attach: notify_off_multiplier {mult} (page-per-vq: {mult == 4096})")
    # Initialization (virtio 1.x §3.1).
    w8(common + 0x14, 0)
    w8(common + 0x14, 1)
    w8(common + 0x14, 3)
    feats = 0
    for sel in (0, 1):
        w32(common + 0x00, sel)
        feats |= r32(common + 0x04) << (32 * sel)
    print(f"attach: device features {feats:#x}")
    if not feats & (1 << 32):
        fail("no VIRTIO_F_VERSION_1")
    want = (1 << 32) | (feats & 1)  # VERSION_1, DOORBELL_POLL if offered
    for sel in (0, 1):
        w32(common + 0x08, sel)
        w32(common + 0x0C, (want >> (32 * sel)) & 0xFFFFFFFF)
    w8(common + 0x14, 0x0B)
    if not r8(common + 0x14) & 8:
        fail("FEATURES_OK refused")
    mac = bytes(r8(devcfg + i) for i in range(6))
    macs = ":".join(f"{b:02x}" for b in mac)
    print(f"attach: config mac {macs}, max_contexts {r32(devcfg + 8)}, max_request {r32(devcfg + 24)}")
    if macs != MAC:
        fail("the config does not name the sibling NIC's MAC")
    nq = r16(common + 0x12)
    if nq != 4:
        fail(f"{nq} queues, not 4")
    RING = 0x100000
    qsize = 16
    notify_off = {}
    for i in range(4):
        w16(common + 0x16, i)
        w16(common + 0x18, qsize)
        base = RING + i * 0x4000
        w64(common + 0x20, base)
        w64(common + 0x28, base + 0x1000)
        w64(common + 0x30, base + 0x2000)
        notify_off[i] = r16(common + 0x1E)
        w16(common + 0x1C, 1)
    w8(common + 0x14, 0x0F)
    if r8(common + 0x14) != 0x0F:
        fail("DRIVER_OK not taken")
    ctrl = RING
    state = {"n": 0}

    def command(req, resp_len):
        n = state["n"]
        out, inn = 0x200000 + n * 0x2000, 0x201000 + n * 0x2000
        wbytes(out, req)
        d = ctrl + (2 * n % qsize) * 16
        w64(d, out)
        w32(d + 8, len(req))
        w16(d + 12, 1)
        w16(d + 14, (2 * n + 1) % qsize)
        w64(d + 16, inn)
        w32(d + 24, resp_len)
        w16(d + 28, 2)
        w16(d + 30, 0)
        w16(ctrl + 0x1000 + 4 + 2 * (n % qsize), (2 * n) % qsize)
        w16(ctrl + 0x1000 + 2, n + 1)
        w16(notify + notify_off[0] * mult, 0)
        deadline = time.monotonic() + 10
        while r16(ctrl + 0x2000 + 2) != n + 1:
            if time.monotonic() > deadline:
                fail(f"command {n}: no used entry in 10 s")
        length = r32(ctrl + 0x2000 + 4 + 8 * (n % qsize) + 4)
        state["n"] = n + 1
        return rbytes(inn, length)

    r = command(struct.pack("<HHI", 1, 0, 0), 8 + 128)
    status = struct.unpack_from("<H", r)[0]
    if status != 0 or len(r) != 136:
        fail(f"QUERY_DEVICE: status {status}, {len(r)} bytes")
    vendor_id, part, _, max_qp = struct.unpack_from("<IIII", r, 8 + 40)
    print(f"attach: QUERY_DEVICE ok: vendor {vendor_id:#x} part {part:#x} max_qp {max_qp}")
    area = 0x300000
    wbytes(area, b"\0" * 4096)
    r = command(struct.pack("<HHIIIQ", 3, 0, 0, 64, 1, area), 16)
    status, _, _, ctx = struct.unpack_from("<HHII", r)
    if status != 0:
        fail(f"CREATE_CONTEXT: status {status}")
    r = command(struct.pack("<HHI", 5, 0, ctx), 16)
    status, _, _, pd = struct.unpack_from("<HHII", r)
    if status != 0:
        fail(f"ALLOC_PD: status {status}")
    print(f"attach: CREATE_CONTEXT {ctx}, ALLOC_PD {pd} in it; poll word {r32(area)}")
    r = command(struct.pack("<HHIII", 6, 0, ctx + 1000, pd, 0), 16)
    if struct.unpack_from("<H", r)[0] != 2:
        fail("a command in a context that does not exist was not ERR_NOENT")
    print("attach: a foreign context's command: ERR_NOENT")
    qemu.stdin.close()
    qemu.terminate()
    qemu.wait(timeout=10)
    daemon.terminate()
    if daemon.wait(timeout=10) != 0:
        fail("vrdma serve did not stop cleanly: " + open(os.path.join(run, "daemon.err")).read())
    how = "as a virtio-pci function over vfio-user-pci" if pci else "over vhost-user"
    print(f"attach: ok (QEMU attached the daemon's virtio-rdma device {how}, device ID {vid}, "
          "negotiated, 4 queues, 4 commands; the daemon ran confined and stopped with status 0)")


if __name__ == "__main__":
    main()
