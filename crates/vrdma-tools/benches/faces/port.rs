//! What the measurements need of one side, whatever face drives it: RC RDMA
//! WRITEs posted into the face's send queue, its doorbell, its completions,
//! and the side's buffer — one layout on every face.

/// The side's registered buffer: where each measurement's bytes go.
pub mod layout {
    /// The bandwidth test's 1 MiB source, and the peer's destination.
    pub const SRC_BW: u64 = 0;
    pub const DST_BW: u64 = 1 << 20;
    /// The message-rate test's slots: [`SLOTS`] of 64 bytes each way,
    /// and one more for the message that is checked.
    pub const SRC_MSG: u64 = 2 << 20;
    pub const DST_MSG: u64 = SRC_MSG + 32 * 1024;
    pub const SLOTS: u64 = 256;
    /// The latency test's 64-byte messages.
    pub const SRC_LAT: u64 = DST_MSG + 32 * 1024;
    pub const DST_LAT: u64 = SRC_LAT + 4096;
    /// The buffer's size (whole pages).
    pub const LEN: u64 = DST_LAT + 4096;
}

/// One side's driver: a QP connected to the peer's, its CQ, its buffer.
pub trait Port: Send {
    /// Posts an RC RDMA WRITE of `len` bytes from `src` (an offset in this
    /// side's buffer) to `dst` (an offset in the peer's).
    fn post_write(&mut self, wr_id: u64, src: u64, len: u32, dst: u64, signaled: bool);

    /// Tells the device about the WQEs posted since the last call (a
    /// virtio-rdma doorbell; nothing where the device needs none).
    fn ring(&mut self);

    /// The completions there now, as (wr_id, `ibv_wc_status`: 0 is
    /// success), appended to `out`.
    /// Engine-direct: one round of the device first (its driver is its
    /// device's only thread).
    fn poll(&mut self, out: &mut Vec<(u64, u32)>);

    /// One round of the device with nothing to post or poll: only a side
    /// whose device has no thread of its own needs it.
    fn idle(&mut self) {}

    /// One round of a device that has no thread of its own (engine-direct),
    /// nothing otherwise.
    fn idle_once(&mut self) {}

    /// Whether the side needs a thread even when its driver has nothing to
    /// do (engine-direct: the device runs in its driver's thread).
    fn needs_thread(&self) -> bool {
        false
    }

    /// The stepped mode's device round where the driver's side holds the
    /// device (engine-direct); nothing where the device is a face's (the
    /// stepped mode steps it).
    fn round(&mut self) {}

    /// The completions there now, without a round of a device the side
    /// holds (the stepped mode; [`Port::poll`] where the side holds none).
    fn poll_ready(&mut self, out: &mut Vec<(u64, u32)>) {
        self.poll(out);
    }

    fn put(&mut self, off: u64, data: &[u8]);

    fn get(&self, off: u64, len: usize) -> Vec<u8>;

    fn byte(&self, off: u64) -> u8;

    /// Kicks the device's doorbell queue (virtio-rdma only): what a driver
    /// does when the device does not poll.
    fn kick(&mut self) {}

    /// The requester's retransmit timeouts so far (`engine.retry_timeout`),
    /// where the side can read its device's counters.
    fn retry_timeouts(&self) -> Option<u64> {
        None
    }

    /// Doorbellq kicks so far (virtio-rdma only).
    fn kicks(&self) -> Option<u64> {
        None
    }
}

/// A deterministic pattern of `len` bytes from `seed`.
pub fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            ((i as u32)
                .wrapping_mul(31)
                .wrapping_add(seed.wrapping_mul(101))
                ^ (i >> 8) as u32) as u8
        })
        .collect()
}
