//! What the process holds, from `/proc/self`: its open descriptors and its
//! resident memory, now and at its peak since the peak was last reset.
//! A test binary that measures with these runs one test (the numbers are
//! the whole process's).

/// The process's open descriptors (`/proc/self/fd`, less the one the
/// listing itself holds).
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
        .saturating_sub(1)
}

/// A field of `/proc/self/status` counted in kB (`VmRSS`, `VmHWM`,
/// `RssAnon`…), in bytes.
pub fn status(field: &str) -> u64 {
    status_of("/proc/self/status", field)
}

/// A field counted in kB of the status file at `path`, in bytes.
pub fn status_of(path: &str, field: &str) -> u64 {
    let s = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in {path}"));
    kb << 10
}

/// Resets the process's peak resident size (`VmHWM`) to its current one
/// (`/proc/self/clear_refs`, 5).
pub fn reset_peak() {
    std::fs::write("/proc/self/clear_refs", "5").expect("/proc/self/clear_refs");
}

/// How far the process's resident memory rose above `before` (a `VmRSS`
/// read after [`reset_peak`]) at its peak since then.
pub fn peak_growth(before: u64) -> u64 {
    status("VmHWM").saturating_sub(before)
}
