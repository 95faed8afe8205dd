//! The system calls the UDP fabric needs that `std` does not offer:
//! batched receive and send (`recvmmsg` / `sendmmsg`) with ancillary data,
//! integer socket options and `poll`. Written against `libc` by hand
//! because the crates that wrap them (nix, socket2) either allocate per
//! batch or do not offer the batched calls; this is the fabric's only
//! unsafe code.
#![allow(unsafe_code)]

use vm_memory::volatile_memory::PtrGuard;

use crate::{Lender, Piece as Lent};

use std::{
    io,
    mem::{self, MaybeUninit},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::RawFd,
    ptr,
};

/// Datagrams per system call, at most.
pub(crate) const MAX_BATCH: usize = 64;

/// Room for the ancillary data we ask for or give (TOS/traffic class,
/// TTL/hop limit, flow label, GRO or GSO segment size): four
/// `CMSG_SPACE(4)` of 24 bytes each, and slack.
const CONTROL_LEN: usize = 128;

/// Segments in one GSO datagram, at most (the kernel's `UDP_MAX_SEGMENTS`
/// is 64 before Linux 6.8, 128 after).
pub(crate) const MAX_SEGMENTS: usize = 64;

/// UDP payload bytes in one GSO datagram, at most (an IPv4 datagram's
/// 65535 bytes less the IPv4 and UDP headers, rounded down).
pub(crate) const MAX_GSO_BYTES: usize = 65_000;

/// An ancillary-data buffer aligned as `struct cmsghdr` must be.
#[derive(Clone, Copy)]
#[repr(C, align(8))]
struct Control([u8; CONTROL_LEN]);

/// `setsockopt(fd, level, name, &value, sizeof(int))`.
pub(crate) fn set_int_option(fd: RawFd, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: the option value points at a live c_int and its size is
    // passed; setsockopt reads at most that many bytes.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&raw const value).cast(),
            mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Waits until `fd` is readable, at most `timeout_ms` (negative: no
/// limit). False when the time ran out or a signal interrupted the wait.
pub(crate) fn wait_readable(fd: RawFd, timeout_ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid, writable pollfd and a count of one.
    let r = unsafe { libc::poll(&raw mut p, 1, timeout_ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        };
    }
    Ok(r > 0)
}

/// The name of the interface that holds `addr`, from `getifaddrs(3)`.
pub(crate) fn interface_of(addr: IpAddr) -> Option<String> {
    let mut list: *mut libc::ifaddrs = ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with
    // freeifaddrs; nothing else aliases it.
    if unsafe { libc::getifaddrs(&raw mut list) } != 0 {
        return None;
    }
    let mut found = None;
    let mut at = list;
    while !at.is_null() {
        // SAFETY: `at` is a node of the list getifaddrs returned, alive
        // until freeifaddrs.
        let ifa = unsafe { &*at };
        at = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a non-null ifa_addr points at a sockaddr of the family it
        // names, which from_sockaddr checks; sockaddr_storage is only read
        // up to the length of that family's struct.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let len = match family {
            libc::AF_INET => mem::size_of::<libc::sockaddr_in>(),
            libc::AF_INET6 => mem::size_of::<libc::sockaddr_in6>(),
            _ => continue,
        };
        let mut storage = zeroed_storage();
        // SAFETY: the kernel's sockaddr for this family is `len` bytes and
        // storage is larger.
        unsafe {
            ptr::copy_nonoverlapping(
                ifa.ifa_addr.cast::<u8>(),
                (&raw mut storage).cast::<u8>(),
                len,
            );
        }
        if from_sockaddr(&storage, len as libc::socklen_t).map(|a| a.ip()) == Some(addr) {
            // SAFETY: ifa_name is a NUL-terminated string alive until
            // freeifaddrs; it is copied out before that.
            let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
            found = Some(name.to_string_lossy().into_owned());
            break;
        }
    }
    // SAFETY: the list from getifaddrs, freed once.
    unsafe { libc::freeifaddrs(list) };
    found
}

/// An all-zero `msghdr`: every field is an integer or a nullable pointer.
fn zeroed_msghdr() -> libc::msghdr {
    // SAFETY: msghdr is plain old data; all-zero is a valid value (null
    // pointers, zero lengths), and private padding fields on some targets
    // make a struct literal impossible.
    unsafe { mem::zeroed() }
}

fn zeroed_storage() -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain old data; all-zero is AF_UNSPEC.
    unsafe { mem::zeroed() }
}

/// `addr` as a C socket address.
fn to_sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    let mut storage = zeroed_storage();
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for
            // every sockaddr type.
            unsafe { ptr::write((&raw mut storage).cast::<libc::sockaddr_in>(), sin) };
            mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo().to_be(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above.
            unsafe { ptr::write((&raw mut storage).cast::<libc::sockaddr_in6>(), sin6) };
            mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// The address the kernel wrote into `storage`, if it is IPv4 or IPv6.
fn from_sockaddr(storage: &libc::sockaddr_storage, len: libc::socklen_t) -> Option<SocketAddr> {
    let len = len as usize;
    match i32::from(storage.ss_family) {
        libc::AF_INET if len >= mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: the family says the storage holds a sockaddr_in, the
            // kernel wrote at least its size, and storage is aligned for it.
            let sin = unsafe { &*(&raw const *storage).cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 if len >= mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe { &*(&raw const *storage).cast::<libc::sockaddr_in6>() };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::new(
                IpAddr::V6(ip),
                u16::from_be(sin6.sin6_port),
            ))
        }
        _ => None,
    }
}

/// What the kernel said about one received datagram.
#[derive(Clone, Copy, Debug, Default)]
struct RecvMeta {
    len: usize,
    name_len: libc::socklen_t,
    control_len: usize,
    flags: i32,
}

/// One datagram of a [`RecvBatch`].
#[derive(Debug)]
pub(crate) struct Datagram<'a> {
    pub src: Option<SocketAddr>,
    pub traffic_class: u8,
    pub hop_limit: u8,
    pub flow_label: u32,
    pub data: &'a [u8],
    /// Longer than the slot (the rest was discarded).
    pub truncated: bool,
    /// With `UDP_GRO`: the kernel coalesced datagrams of this size (the
    /// last may be shorter) into `data`.
    pub segment: Option<usize>,
}

/// Buffers for up to [`MAX_BATCH`] datagrams received by one `recvmmsg`.
/// The C headers pointing into them are built on the stack for each call,
/// so the batch holds no raw pointers (and the device stays `Send`).
pub(crate) struct RecvBatch {
    slot: usize,
    bufs: Vec<u8>,
    names: Vec<libc::sockaddr_storage>,
    controls: Vec<Control>,
    meta: Vec<RecvMeta>,
    /// Datagrams the last call returned.
    last: usize,
}

impl std::fmt::Debug for RecvBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvBatch")
            .field("slot", &self.slot)
            .field("slots", &self.meta.len())
            .finish()
    }
}

impl RecvBatch {
    /// `count` (at most [`MAX_BATCH`]) slots of `slot` bytes.
    pub fn new(count: usize, slot: usize) -> Self {
        let count = count.clamp(1, MAX_BATCH);
        RecvBatch {
            slot,
            bufs: vec![0; count * slot],
            names: vec![zeroed_storage(); count],
            controls: vec![Control([0; CONTROL_LEN]); count],
            meta: Vec::with_capacity(count),
            last: 0,
        }
    }

    /// Receives what is queued on `fd` without waiting; the number of
    /// datagrams (0 when none). After a call that found nothing, the next
    /// asks for one datagram: a busy-polling device calls this in a loop,
    /// building 64 headers for each empty poll cost more than the call,
    /// and a call for several that finds one tries the socket again in
    /// vain — on the path of a ping-pong's every message. After a call
    /// that found some, more may be queued: the next asks for a batch.
    pub fn recv(&mut self, fd: RawFd) -> io::Result<usize> {
        let count = self.controls.len();
        let n = if self.last == 0 {
            self.recv_n::<1>(fd, 1)?
        } else {
            self.recv_n::<MAX_BATCH>(fd, count)?
        };
        self.last = n;
        Ok(n)
    }

    /// One `recvmmsg` of up to `count` (at most `N`) datagrams, with
    /// headers for `N` on the stack.
    fn recv_n<const N: usize>(&mut self, fd: RawFd, count: usize) -> io::Result<usize> {
        let count = count.min(N).min(self.controls.len());
        // Only the `count` headers the call uses are written (clearing all
        // N for every poll showed in profiles).
        let mut iovs = [const { MaybeUninit::<libc::iovec>::uninit() }; N];
        let mut hdrs = [const { MaybeUninit::<libc::mmsghdr>::uninit() }; N];
        for (i, chunk) in self
            .bufs
            .chunks_exact_mut(self.slot)
            .take(count)
            .enumerate()
        {
            let iov = iovs[i].write(libc::iovec {
                iov_base: chunk.as_mut_ptr().cast(),
                iov_len: chunk.len(),
            });
            let mut h = zeroed_msghdr();
            h.msg_name = (&raw mut self.names[i]).cast();
            h.msg_namelen = mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            h.msg_iov = iov;
            h.msg_iovlen = 1;
            h.msg_control = (&raw mut self.controls[i]).cast();
            h.msg_controllen = CONTROL_LEN as _;
            hdrs[i].write(libc::mmsghdr {
                msg_hdr: h,
                msg_len: 0,
            });
        }
        // SAFETY: the first `count` headers are initialized (the loop ran
        // over `count` slots: count <= the batch's slots), each pointing at
        // a live buffer, name and control area of the stated sizes, all
        // owned by `self` or this frame and not otherwise borrowed during
        // the call; the kernel reads and writes only those `count`.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                hdrs.as_mut_ptr().cast::<libc::mmsghdr>(),
                count as libc::c_uint,
                libc::MSG_DONTWAIT,
                ptr::null_mut(),
            )
        };
        self.meta.clear();
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
                _ => Err(e),
            };
        }
        let n = (n as usize).min(count);
        for h in &hdrs[..n] {
            // SAFETY: written by the loop above (n <= count).
            let h = unsafe { h.assume_init_ref() };
            // msg_controllen is size_t in glibc, socklen_t in musl.
            #[allow(clippy::unnecessary_cast)]
            self.meta.push(RecvMeta {
                len: h.msg_len as usize,
                name_len: h.msg_hdr.msg_namelen,
                control_len: h.msg_hdr.msg_controllen as usize,
                flags: h.msg_hdr.msg_flags,
            });
        }
        Ok(n)
    }

    /// Datagram `i` of the last [`RecvBatch::recv`].
    pub fn get(&self, i: usize) -> Datagram<'_> {
        let m = self.meta[i];
        let start = i * self.slot;
        let mut d = Datagram {
            src: from_sockaddr(&self.names[i], m.name_len),
            traffic_class: 0,
            hop_limit: 0,
            flow_label: 0,
            data: &self.bufs[start..start + m.len.min(self.slot)],
            truncated: m.flags & libc::MSG_TRUNC != 0,
            segment: None,
        };
        let control = &self.controls[i].0[..m.control_len.min(CONTROL_LEN)];
        for (level, ty, data) in cmsgs(control) {
            let int =
                || -> Option<i32> { Some(i32::from_ne_bytes(data.get(..4)?.try_into().ok()?)) };
            match (level, ty) {
                (libc::IPPROTO_IP, libc::IP_TOS) => {
                    d.traffic_class = data.first().copied().unwrap_or(0);
                }
                (libc::IPPROTO_IP, libc::IP_TTL) => {
                    d.hop_limit = int().unwrap_or(0) as u8;
                }
                (libc::IPPROTO_IPV6, libc::IPV6_TCLASS) => {
                    d.traffic_class = int().unwrap_or(0) as u8;
                }
                (libc::IPPROTO_IPV6, libc::IPV6_HOPLIMIT) => {
                    d.hop_limit = int().unwrap_or(0) as u8;
                }
                (libc::IPPROTO_IPV6, libc::IPV6_FLOWINFO) => {
                    let be = data.get(..4).and_then(|b| b.try_into().ok());
                    d.flow_label = be.map_or(0, u32::from_be_bytes) & 0x000f_ffff;
                }
                (libc::SOL_UDP, libc::UDP_GRO) => {
                    // A zero would make no progress: treat as unsegmented.
                    d.segment = int()
                        .and_then(|g| usize::try_from(g).ok())
                        .filter(|&g| g > 0);
                }
                _ => {}
            }
        }
        d
    }
}

/// The (level, type, data) of each control message in `control`, parsed
/// by hand in the kernel's layout (`struct cmsghdr`, data aligned to the
/// word size).
fn cmsgs(control: &[u8]) -> impl Iterator<Item = (i32, i32, &[u8])> {
    const WORD: usize = mem::size_of::<usize>();
    let header = mem::size_of::<libc::cmsghdr>();
    let mut at = 0;
    std::iter::from_fn(move || {
        let h = control.get(at..at + header)?;
        let len = usize::from_ne_bytes(h[..WORD].try_into().ok()?);
        let level = i32::from_ne_bytes(h[WORD..WORD + 4].try_into().ok()?);
        let ty = i32::from_ne_bytes(h[WORD + 4..WORD + 8].try_into().ok()?);
        let data = control.get(at + header..at.checked_add(len)?)?;
        at += len.checked_next_multiple_of(WORD)?.max(header);
        Some((level, ty, data))
    })
}

/// Where a datagram goes and the IP header fields it leaves with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dest {
    pub addr: SocketAddr,
    pub traffic_class: u8,
    pub hop_limit: u8,
    /// The socket has this traffic class and hop limit as its options
    /// ([`preset`]): the datagram needs no ancillary data for them, which
    /// spares the kernel parsing it on every send. (The socket is not
    /// connected: a connected IPv4 socket numbers its datagrams' IPv4
    /// Identification from a random start, which the ICRC covers and a
    /// sender cannot learn; an unconnected one with DF writes 0.)
    pub preset: bool,
}

/// A piece of a queued datagram: bytes of the batch's buffer, or payload
/// bytes lent from the device's memory (a gather send), which the kernel
/// reads in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Piece {
    Batch { start: usize, len: usize },
    Lent { addr: u64, len: usize },
}

/// One datagram queued in a [`SendBatch`]: with GSO, a run of segments
/// the kernel splits (all `segment` bytes long but the last, which may be
/// shorter and then ends the run).
#[derive(Clone, Copy, Debug)]
struct Pending {
    dest: Dest,
    /// Its pieces: `pieces` of the batch's list from `first`.
    first: usize,
    pieces: usize,
    len: usize,
    segment: usize,
    segments: usize,
    /// A shorter segment ended the run.
    closed: bool,
}

impl Pending {
    /// Whether a packet of `len` bytes for `dest`, in at most `pieces`
    /// pieces, can join this run.
    fn takes(&self, dest: &Dest, len: usize, pieces: usize) -> bool {
        !self.closed
            && self.dest == *dest
            && len <= self.segment
            && self.segments < MAX_SEGMENTS
            && self.len + len <= MAX_GSO_BYTES
            && self.pieces + pieces <= MAX_PIECES
    }
}

/// Pieces (iovecs) of one datagram, at most: the kernel's `UIO_MAXIOV`.
const MAX_PIECES: usize = 1024;

/// Datagrams gathered for one `sendmmsg`, all from one socket. Packets
/// are written straight into its buffer ([`SendBatch::slot`]), then
/// committed ([`SendBatch::commit`]): no copy between the engine and the
/// kernel. A packet whose payload the engine lent is committed as its
/// headers and trailer in the buffer around the lent pieces
/// ([`SendBatch::commit_parts`]), which the kernel reads from memory.
pub(crate) struct SendBatch {
    /// Allocated (and zeroed) once; `used` bytes of it are committed.
    data: Vec<u8>,
    used: usize,
    pending: Vec<Pending>,
    pieces: Vec<Piece>,
    /// Addresses and ancillary data of one call, kept between calls so
    /// that a flush does not clear 16 KiB of stack for a datagram or two.
    names: Vec<libc::sockaddr_storage>,
    controls: Vec<Control>,
}

impl std::fmt::Debug for SendBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendBatch")
            .field("used", &self.used)
            .field("pending", &self.pending)
            .field("pieces", &self.pieces.len())
            .finish()
    }
}

/// Bytes a batch holds before it must be flushed.
const BATCH_BYTES: usize = 1 << 20;

/// What a [`SendBatch::flush`] did.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Flushed {
    pub sent: usize,
    pub bytes: usize,
    /// Refused by the kernel (no route, message too long…): dropped, as a
    /// network would drop them; RC recovers, UC and UD lose them.
    pub failed: usize,
    pub calls: usize,
    /// A GSO datagram was refused as such (`EINVAL`/`EIO`: a route or
    /// device that cannot segment): the caller should stop using GSO.
    pub gso_refused: bool,
}

impl SendBatch {
    pub fn new() -> Self {
        SendBatch {
            data: vec![0; BATCH_BYTES],
            used: 0,
            pending: Vec::with_capacity(MAX_BATCH),
            pieces: Vec::with_capacity(4 * MAX_BATCH),
            names: vec![zeroed_storage(); MAX_BATCH],
            controls: vec![Control([0; CONTROL_LEN]); MAX_BATCH],
        }
    }

    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// No room for another datagram, or for a packet of `max` bytes.
    pub fn is_full(&self, max: usize) -> bool {
        self.pending.len() >= MAX_BATCH || self.used + max > self.data.len()
    }

    /// Where the next packet is written: `max` bytes after the committed
    /// ones (the caller made room with [`SendBatch::is_full`] and a flush).
    pub fn slot(&mut self, max: usize) -> &mut [u8] {
        &mut self.data[self.used..self.used + max]
    }

    /// The segment index a packet of `len` bytes for `dest`, in `pieces`
    /// pieces (1 when whole in the buffer; 2 and its lent pieces when
    /// lent), would get from a commit with `gso`: 0 when it starts a
    /// datagram of its own. (The kernel gives the segments of a GSO
    /// datagram consecutive IPv4 Identifications from 0, which their ICRCs
    /// must cover.)
    pub fn next_index(&self, dest: &Dest, len: usize, pieces: usize, gso: bool) -> usize {
        match self.pending.last() {
            Some(p) if gso && p.takes(dest, len, pieces) => p.segments,
            _ => 0,
        }
    }

    /// Commits the `len` bytes written at [`SendBatch::slot`] as a
    /// datagram for `dest`: with `gso`, as one more segment of the last
    /// datagram when it can be.
    pub fn commit(&mut self, dest: &Dest, len: usize, gso: bool) {
        self.commit_parts(dest, len, &[], 0, gso);
    }

    /// Commits a packet of `head` bytes written at [`SendBatch::slot`],
    /// then the `lent` pieces of memory, then `tail` bytes written right
    /// after the head, as [`SendBatch::commit`] does.
    pub fn commit_parts(
        &mut self,
        dest: &Dest,
        head: usize,
        lent: &[Lent],
        tail: usize,
        gso: bool,
    ) {
        let len = head + lent.iter().map(|r| r.len).sum::<usize>() + tail;
        let pieces = if lent.is_empty() { 1 } else { 2 + lent.len() };
        let join = gso
            && self
                .pending
                .last()
                .is_some_and(|p| p.takes(dest, len, pieces));
        if !join {
            self.pending.push(Pending {
                dest: *dest,
                first: self.pieces.len(),
                pieces: 0,
                len: 0,
                segment: len,
                segments: 0,
                closed: false,
            });
        }
        let start = self.used;
        self.used += head + tail;
        let before = self.pieces.len();
        self.put(Piece::Batch { start, len: head });
        for r in lent {
            self.put(Piece::Lent {
                addr: r.addr,
                len: r.len,
            });
        }
        self.put(Piece::Batch {
            start: start + head,
            len: tail,
        });
        let added = self.pieces.len() - before;
        if let Some(p) = self.pending.last_mut() {
            p.pieces += added;
            p.len += len;
            p.segments += 1;
            p.closed = len < p.segment;
        }
    }

    /// Appends `piece` to the last datagram's, merging buffer bytes that
    /// follow the last piece's (a run of whole packets is one piece).
    fn put(&mut self, piece: Piece) {
        let first = self.pending.last().map_or(0, |p| p.first);
        let ours = self.pieces.len() > first;
        match (piece, self.pieces.last_mut()) {
            (Piece::Batch { len: 0, .. } | Piece::Lent { len: 0, .. }, _) => {}
            (Piece::Batch { start, len }, Some(Piece::Batch { start: s, len: l }))
                if ours && *s + *l == start =>
            {
                *l += len;
            }
            _ => self.pieces.push(piece),
        }
    }

    /// Copies `payload` into the batch and commits it (tests).
    #[cfg(test)]
    pub fn push(&mut self, dest: &Dest, payload: &[u8], gso: bool) {
        self.slot(payload.len()).copy_from_slice(payload);
        self.commit(dest, payload.len(), gso);
    }

    /// Sends everything committed through `fd` (a blocking socket: a full
    /// send buffer waits, which paces the sender), keeping the `tail`
    /// bytes written at the slot but not committed: they move to the
    /// front, where the next slot begins. Lent pieces are read from
    /// `mem`; a datagram one of whose pieces it no longer has is dropped
    /// (counted as failed).
    pub fn flush(&mut self, fd: RawFd, tail: usize, mem: &impl Lender) -> Flushed {
        let mut out = Flushed::default();
        let mut next = 0;
        while next < self.pending.len() {
            let left = self.pending.len() - next;
            let r = if left <= 4 {
                self.send_n::<4>(fd, next, mem)
            } else {
                self.send_n::<MAX_BATCH>(fd, next, mem)
            };
            out.calls += 1;
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    if e.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    // The first datagram was refused: drop it and go on.
                    let p = &self.pending[next];
                    tracing::debug!(dst = %p.dest.addr, segments = p.segments, error = %e, "send refused");
                    out.failed += p.segments;
                    out.gso_refused |= p.segments > 1
                        && matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EIO));
                    next += 1;
                    continue;
                }
            };
            for p in &self.pending[next..next + r] {
                out.bytes += p.len;
                out.sent += p.segments;
            }
            next += r;
        }
        self.pending.clear();
        self.pieces.clear();
        self.data.copy_within(self.used..self.used + tail, 0);
        self.used = 0;
        out
    }

    /// One `sendmmsg` of the datagrams from `first` on, at most `N` (with
    /// headers for `N` on the stack); the number the kernel took.
    fn send_n<const N: usize>(
        &mut self,
        fd: RawFd,
        first: usize,
        mem: &impl Lender,
    ) -> io::Result<usize> {
        let batch = &self.pending[first..];
        let mut count = batch.len().min(N).min(self.names.len());
        // The iovecs of all `count` datagrams, built before any header
        // points into them (the vector does not move after).
        let mut iovs: Vec<libc::iovec> =
            Vec::with_capacity(batch[..count].iter().map(|p| p.pieces).sum());
        // Lent pieces are handed to the kernel by pointer, from volatile
        // slices of the memory (never a reference to bytes another party
        // may be writing); their guards live until the call returns. (Not
        // kept between calls: a guard holds a raw pointer, and a port that
        // held them would not be Send.)
        let mut guards: Vec<PtrGuard> = Vec::new();
        'datagrams: for (i, p) in batch[..count].iter().enumerate() {
            let mark = iovs.len();
            for piece in &self.pieces[p.first..p.first + p.pieces] {
                let (base, len) = match *piece {
                    Piece::Batch { start, len } => {
                        let bytes = &self.data[start..start + len];
                        (bytes.as_ptr(), bytes.len())
                    }
                    Piece::Lent { addr, len } => match mem.lend(addr, len) {
                        Some(slice) if slice.len() == len => {
                            let guard = slice.ptr_guard();
                            let ptr = guard.as_ptr();
                            guards.push(guard);
                            (ptr, len)
                        }
                        _ => {
                            // The engine checked it; memory that is gone
                            // since loses the datagram, as a network
                            // would: the ones before it leave first.
                            iovs.truncate(mark);
                            if i == 0 {
                                return Err(io::Error::new(
                                    io::ErrorKind::InvalidData,
                                    "lent memory is gone",
                                ));
                            }
                            count = i;
                            break 'datagrams;
                        }
                    },
                };
                iovs.push(libc::iovec {
                    // sendmmsg only reads through this pointer.
                    iov_base: base.cast_mut().cast(),
                    iov_len: len,
                });
            }
        }
        // Only the `count` headers the call uses are written.
        let mut hdrs = [const { MaybeUninit::<libc::mmsghdr>::uninit() }; N];
        let mut at = 0;
        for (i, p) in batch[..count].iter().enumerate() {
            let mut h = zeroed_msghdr();
            let (name, name_len) = to_sockaddr(p.dest.addr);
            self.names[i] = name;
            h.msg_name = (&raw mut self.names[i]).cast();
            h.msg_namelen = name_len;
            let control_len = write_send_control(&mut self.controls[i].0, p);
            if control_len > 0 {
                h.msg_control = (&raw mut self.controls[i]).cast();
                h.msg_controllen = control_len as _;
            }
            h.msg_iov = iovs[at..].as_mut_ptr();
            h.msg_iovlen = p.pieces as _;
            at += p.pieces;
            hdrs[i].write(libc::mmsghdr {
                msg_hdr: h,
                msg_len: 0,
            });
        }
        // SAFETY: the first `count` headers are initialized by the loop,
        // pointing at live names and control areas (owned by `self`) and at
        // their datagrams' iovecs in `iovs`, which point at bytes of the
        // batch, or of `mem` through volatile slices whose guards are held
        // in `guards`, of the stated lengths, borrowed for this call;
        // the kernel only reads them, and touches no header past `count`.
        let r = unsafe {
            libc::sendmmsg(
                fd,
                hdrs.as_mut_ptr().cast::<libc::mmsghdr>(),
                count as libc::c_uint,
                0,
            )
        };
        drop(guards);
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as usize)
        }
    }
}

/// Writes the control messages `p` needs into `buf` — its TOS / traffic
/// class and TTL / hop limit unless its socket has them as options, and
/// its GSO segment size if it has several segments — and returns their
/// total length.
fn write_send_control(buf: &mut [u8; CONTROL_LEN], p: &Pending) -> usize {
    const WORD: usize = mem::size_of::<usize>();
    let header = mem::size_of::<libc::cmsghdr>();
    let (level, tos_type, ttl_type) = match p.dest.addr {
        SocketAddr::V4(_) => (libc::IPPROTO_IP, libc::IP_TOS, libc::IP_TTL),
        SocketAddr::V6(_) => (libc::IPPROTO_IPV6, libc::IPV6_TCLASS, libc::IPV6_HOPLIMIT),
    };
    let mut at = 0;
    if !p.dest.preset {
        for (ty, value) in [
            (tos_type, i32::from(p.dest.traffic_class)),
            (ttl_type, i32::from(p.dest.hop_limit.max(1))),
        ] {
            let len = header + 4;
            buf[at..at + WORD].copy_from_slice(&len.to_ne_bytes());
            buf[at + WORD..at + WORD + 4].copy_from_slice(&level.to_ne_bytes());
            buf[at + WORD + 4..at + WORD + 8].copy_from_slice(&ty.to_ne_bytes());
            buf[at + header..at + header + 4].copy_from_slice(&value.to_ne_bytes());
            at += len.next_multiple_of(WORD);
        }
    }
    if p.segments > 1 {
        // UDP_SEGMENT takes a u16; `segment` is at most MAX_GSO_BYTES.
        let len = header + 2;
        buf[at..at + WORD].copy_from_slice(&len.to_ne_bytes());
        buf[at + WORD..at + WORD + 4].copy_from_slice(&libc::SOL_UDP.to_ne_bytes());
        buf[at + WORD + 4..at + WORD + 8].copy_from_slice(&libc::UDP_SEGMENT.to_ne_bytes());
        buf[at + header..at + header + 2].copy_from_slice(&(p.segment as u16).to_ne_bytes());
        at += len.next_multiple_of(WORD);
    }
    at
}

/// Sets `fd`'s TOS / traffic class and TTL / hop limit options to
/// `dest`'s (see [`Dest::preset`]).
pub(crate) fn preset(fd: RawFd, dest: &Dest) -> io::Result<()> {
    match dest.addr {
        SocketAddr::V4(_) => {
            set_int_option(
                fd,
                libc::IPPROTO_IP,
                libc::IP_TOS,
                i32::from(dest.traffic_class),
            )?;
            set_int_option(
                fd,
                libc::IPPROTO_IP,
                libc::IP_TTL,
                i32::from(dest.hop_limit.max(1)),
            )?;
        }
        SocketAddr::V6(_) => {
            let tclass = i32::from(dest.traffic_class);
            set_int_option(fd, libc::IPPROTO_IPV6, libc::IPV6_TCLASS, tclass)?;
            let hops = i32::from(dest.hop_limit.max(1));
            set_int_option(fd, libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS, hops)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dest(addr: &str, traffic_class: u8, preset: bool) -> Dest {
        Dest {
            addr: addr.parse().unwrap(),
            traffic_class,
            hop_limit: 64,
            preset,
        }
    }

    #[test]
    fn control_messages_round_trip_through_the_parser() {
        let mut buf = [0u8; CONTROL_LEN];
        let p = Pending {
            dest: Dest {
                hop_limit: 7,
                ..dest("127.0.0.1:4791", 0x2e << 2 | 1, false)
            },
            first: 0,
            pieces: 1,
            len: 0,
            segment: 4112,
            segments: 1,
            closed: false,
        };
        let n = write_send_control(&mut buf, &p);
        assert_eq!(n, 48); // two CMSG_SPACE(4)
        let got: Vec<_> = cmsgs(&buf[..n]).collect();
        assert_eq!(
            got,
            vec![
                (libc::IPPROTO_IP, libc::IP_TOS, &(0xb9i32).to_ne_bytes()[..]),
                (libc::IPPROTO_IP, libc::IP_TTL, &7i32.to_ne_bytes()[..]),
            ]
        );
        // A GSO run adds its segment size.
        let gso = Pending { segments: 3, ..p };
        let n = write_send_control(&mut buf, &gso);
        assert_eq!(n, 72);
        assert_eq!(
            cmsgs(&buf[..n]).nth(2),
            Some((libc::SOL_UDP, libc::UDP_SEGMENT, &4112u16.to_ne_bytes()[..]))
        );
        // A socket with TOS and TTL as options: only the segment size is
        // left, and a single datagram needs nothing.
        let preset = Dest {
            preset: true,
            ..gso.dest
        };
        let n = write_send_control(
            &mut buf,
            &Pending {
                dest: preset,
                ..gso
            },
        );
        assert_eq!(
            cmsgs(&buf[..n]).collect::<Vec<_>>(),
            vec![(libc::SOL_UDP, libc::UDP_SEGMENT, &4112u16.to_ne_bytes()[..])]
        );
        let single = Pending { dest: preset, ..p };
        assert_eq!(write_send_control(&mut buf, &single), 0);
        // Hostile lengths end the walk instead of reading out of bounds.
        let n = write_send_control(&mut buf, &gso);
        let mut bad = buf;
        bad[..8].copy_from_slice(&usize::MAX.to_ne_bytes());
        assert_eq!(cmsgs(&bad[..n]).count(), 0);
        bad[..8].copy_from_slice(&0usize.to_ne_bytes());
        assert!(cmsgs(&bad[..n]).count() <= 2);
    }

    #[test]
    fn gso_runs_take_equal_segments_and_one_shorter_last() {
        let a = dest("127.0.0.1:4791", 0, false);
        let b = dest("127.0.0.2:4791", 0, false);
        let mut s = SendBatch::new();
        let push = |s: &mut SendBatch, d: &Dest, len: usize| {
            let k = s.next_index(d, len, 1, true);
            s.push(d, &vec![0u8; len], true);
            k
        };
        // A first packet longer than the rest starts a run the others
        // cannot join (they would be shorter than its segment, and a
        // shorter segment ends a run).
        assert_eq!(push(&mut s, &a, 4128), 0);
        assert_eq!(push(&mut s, &a, 4112), 1);
        assert_eq!(push(&mut s, &a, 4112), 0);
        assert_eq!(push(&mut s, &a, 4112), 1);
        assert_eq!(push(&mut s, &a, 100), 2);
        // Closed by the shorter one; another address, TOS or way of
        // sending starts anew.
        assert_eq!(push(&mut s, &a, 100), 0);
        assert_eq!(push(&mut s, &b, 100), 0);
        let b4 = Dest {
            traffic_class: 4,
            ..b
        };
        assert_eq!(push(&mut s, &b4, 100), 0);
        let b4c = Dest { preset: true, ..b4 };
        assert_eq!(push(&mut s, &b4c, 100), 0);
        assert_eq!(push(&mut s, &b4c, 100), 1);
        assert_eq!(s.len(), 6);
        // Without GSO every packet is a datagram.
        let mut plain = SendBatch::new();
        for _ in 0..3 {
            assert_eq!(plain.next_index(&a, 64, 1, false), 0);
            plain.push(&a, &[0; 64], false);
        }
        assert_eq!(plain.len(), 3);
        // Runs stop at the segment and byte limits.
        let mut big = SendBatch::new();
        for i in 0..20 {
            let k = big.next_index(&a, 4112, 1, true);
            assert_eq!(k, i % 15, "{i}");
            big.push(&a, &[0; 4112], true);
        }
        let mut many = SendBatch::new();
        for i in 0..(MAX_SEGMENTS + 1) {
            let k = many.next_index(&a, 64, 1, true);
            assert_eq!(k, i % MAX_SEGMENTS);
            many.push(&a, &[0; 64], true);
        }
    }

    /// Packets whose payload stays in memory leave as the bytes around it
    /// and the memory's bytes in between, whole packets beside them; in a
    /// GSO run each segment is one packet.
    #[test]
    fn lent_payloads_leave_from_memory() {
        use std::{net::UdpSocket, os::fd::AsRawFd};

        use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
        let rx = UdpSocket::bind("127.0.0.71:0").unwrap();
        rx.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let tx = UdpSocket::bind("127.0.0.72:0").unwrap();
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0x1000), 0x4000)]).unwrap();
        let pattern: Vec<u8> = (0..0x4000).map(|i| (i * 13 + 5) as u8).collect();
        mem.write_slice(&pattern, GuestAddress(0x1000)).unwrap();
        let at = |addr: u64, len: usize| {
            let mut v = vec![0; len];
            mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
            v
        };
        let mut buf = [0u8; 2048];
        for gso in [false, true] {
            let d = Dest {
                addr: rx.local_addr().unwrap(),
                traffic_class: 0,
                hop_limit: 64,
                preset: false,
            };
            let mut s = SendBatch::new();
            let mut want = Vec::new();
            // Three packets of 100 bytes: 20 + 76 lent (in two pieces, as
            // across a page) + 4; 20 + 76 lent + 4; 100 whole.
            for (k, lent) in [
                vec![
                    Lent {
                        addr: 0x1ff0,
                        len: 16,
                    },
                    Lent {
                        addr: 0x2000,
                        len: 60,
                    },
                ],
                vec![Lent {
                    addr: 0x3003,
                    len: 76,
                }],
                vec![],
            ]
            .into_iter()
            .enumerate()
            {
                let head: Vec<u8> = (0..20).map(|i| (k * 50 + i) as u8).collect();
                let tail: Vec<u8> = (0..4).map(|i| (k * 50 + 40 + i) as u8).collect();
                let mut packet = head.clone();
                for r in &lent {
                    packet.extend(at(r.addr, r.len));
                }
                packet.extend(&tail);
                if lent.is_empty() {
                    packet.resize(100, 0xee);
                    s.push(&d, &packet, gso);
                } else {
                    let slot = s.slot(128);
                    slot[..20].copy_from_slice(&head);
                    slot[20..24].copy_from_slice(&tail);
                    let pieces = 2 + lent.len();
                    assert_eq!(s.next_index(&d, 100, pieces, gso), if gso { k } else { 0 });
                    s.commit_parts(&d, 20, &lent, 4, gso);
                }
                want.push(packet);
            }
            assert_eq!(s.len(), if gso { 1 } else { 3 });
            let f = s.flush(tx.as_raw_fd(), 0, &mem);
            assert_eq!((f.sent, f.failed), (3, 0));
            for (k, w) in want.iter().enumerate() {
                let n = rx.recv(&mut buf).unwrap();
                assert_eq!(&buf[..n], &w[..], "packet {k}, gso {gso}");
            }
        }
        // Memory that no longer holds a lent piece drops that datagram.
        let d = Dest {
            addr: rx.local_addr().unwrap(),
            traffic_class: 0,
            hop_limit: 64,
            preset: false,
        };
        let mut s = SendBatch::new();
        s.slot(8).fill(1);
        s.commit_parts(
            &d,
            4,
            &[Lent {
                addr: 0x9000,
                len: 8,
            }],
            4,
            false,
        );
        s.push(&d, &[2; 12], false);
        let f = s.flush(tx.as_raw_fd(), 0, &mem);
        assert_eq!((f.sent, f.failed), (1, 1));
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], &[2; 12]);
    }

    #[test]
    fn the_loopback_address_is_on_lo() {
        assert_eq!(
            interface_of("127.0.0.1".parse().unwrap()).as_deref(),
            Some("lo")
        );
        assert_eq!(interface_of("::1".parse().unwrap()).as_deref(), Some("lo"));
        assert_eq!(interface_of("192.0.2.77".parse().unwrap()), None);
    }

    #[test]
    fn socket_addresses_convert_both_ways() {
        for a in ["127.0.0.9:4791", "[::1]:49152", "[fe80::1]:1"] {
            let a: SocketAddr = a.parse().unwrap();
            let (s, len) = to_sockaddr(a);
            assert_eq!(from_sockaddr(&s, len), Some(a));
        }
        assert_eq!(from_sockaddr(&zeroed_storage(), 128), None);
    }
}
