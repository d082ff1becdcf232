//! Store configuration and the default capacity rule.
//!
//! The arena is a memfd, so its size is bounded by the machine's memory (and the cgroup's
//! memory limit), not by the mount size of /dev/shm: a small /dev/shm (Docker's 64 MiB default)
//! does not matter. The default capacity is [`DEFAULT_MEMORY_FRACTION`] of the smaller of total
//! RAM and the cgroup limit, capped at [`DEFAULT_CAPACITY_CAP`] and never below
//! [`MIN_CAPACITY`]. When the reservation of that much memory fails, the store halves the
//! capacity (down to [`MIN_CAPACITY`]) with a warning, and when memfd itself is unavailable it
//! falls back to an unlinked file in the directory that holds spill directories, also with a
//! warning.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Share of memory the store takes by default (Ray uses the same 30 %).
pub const DEFAULT_MEMORY_FRACTION: f64 = 0.3;
/// Upper bound of the default capacity: 200 GiB.
pub const DEFAULT_CAPACITY_CAP: u64 = 200 << 30;
/// Smallest capacity the store accepts or falls back to: 64 MiB.
pub const MIN_CAPACITY: u64 = 64 << 20;

/// Environment variable naming where spill directories go when [`StoreConfig::spill_dir`] is
/// `None`; unset or empty means the system temp dir.
pub const SPILL_DIR_ENV: &str = "RTRUN_OBJECT_SPILL_DIR";

/// How the node-side store is set up.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Arena capacity in bytes (`--object-store-memory`); `None` applies the default rule
    /// ([`default_capacity`]).
    pub capacity: Option<u64>,
    /// Where spill files go: the store makes its own directory `rtrun-spill-<pid>-<n>` in this
    /// one. `None` reads [`SPILL_DIR_ENV`] (`RTRUN_OBJECT_SPILL_DIR`), else takes the system temp
    /// dir. The store's directory is created when the first object spills (a store that never
    /// spills leaves nothing on disk) and removed when the store drops; one left behind by a
    /// process that exited without dropping its store is removed by the next store opened in
    /// the same place. The directory given here is created if missing and never removed.
    pub spill_dir: Option<PathBuf>,
    /// Allocate every arena page at creation (fallocate) so that running out of memory is an
    /// error at startup rather than a SIGBUS later. Default: true. Turning it off is only for
    /// tests that want a huge sparse arena.
    pub reserve: bool,
    /// Fault the arena's pages into the node process at creation (MAP_POPULATE) so the first
    /// puts run at full memory bandwidth. Default: false (startup cost of about 0.1 s per GiB).
    pub prefault: bool,
    /// When reserving `capacity` fails, halve it (down to [`MIN_CAPACITY`]) with a warning
    /// instead of failing. Default: true, false from [`StoreConfig::with_capacity`].
    pub shrink_on_reserve_failure: bool,
}

impl Default for StoreConfig {
    fn default() -> StoreConfig {
        StoreConfig {
            capacity: None,
            spill_dir: None,
            reserve: true,
            prefault: false,
            shrink_on_reserve_failure: true,
        }
    }
}

impl StoreConfig {
    /// A configuration with an explicit capacity: reservation failures are errors, because the
    /// user asked for exactly this much.
    pub fn with_capacity(capacity: u64) -> StoreConfig {
        StoreConfig {
            capacity: Some(capacity),
            shrink_on_reserve_failure: false,
            ..StoreConfig::default()
        }
    }
}

/// The directory in which a store makes its spill directory: the configured one, else the one
/// named by [`SPILL_DIR_ENV`], else the system temp dir.
pub fn spill_parent(configured: Option<&Path>) -> PathBuf {
    spill_parent_from(configured, std::env::var_os(SPILL_DIR_ENV))
}

/// [`spill_parent`] as a pure function of the configured directory and the environment value.
pub fn spill_parent_from(configured: Option<&Path>, env_value: Option<OsString>) -> PathBuf {
    match (configured, env_value) {
        (Some(dir), _) => dir.to_path_buf(),
        (None, Some(value)) if !value.is_empty() => PathBuf::from(value),
        (None, _) => std::env::temp_dir(),
    }
}

/// The default arena capacity for this machine, read from /proc/meminfo and the cgroup v2 memory
/// limit; [`MIN_CAPACITY`] when neither can be read.
pub fn default_capacity() -> u64 {
    let mem_total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| meminfo_field(&text, "MemTotal:"));
    let cgroup_limit = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|text| text.trim().parse::<u64>().ok());
    default_capacity_from(mem_total, cgroup_limit)
}

/// Memory that can still be reserved without pushing the machine (or this cgroup) into the OOM
/// killer: MemAvailable, further limited by the cgroup v2 headroom (`memory.max` minus
/// `memory.current`). `None` when it cannot be read.
pub fn available_memory() -> Option<u64> {
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| meminfo_field(&text, "MemAvailable:"));
    let read = |name: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{name}"))
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
    };
    let cgroup_headroom = match (read("memory.max"), read("memory.current")) {
        (Some(max), Some(current)) => Some(max.saturating_sub(current)),
        _ => None,
    };
    match (available, cgroup_headroom) {
        (Some(a), Some(h)) => Some(a.min(h)),
        (a, h) => a.or(h),
    }
}

/// The default capacity rule as a pure function of total memory and the cgroup limit (bytes).
pub fn default_capacity_from(mem_total: Option<u64>, cgroup_limit: Option<u64>) -> u64 {
    let memory = match (mem_total, cgroup_limit) {
        (Some(total), Some(limit)) => total.min(limit),
        (Some(total), None) => total,
        (None, Some(limit)) => limit,
        (None, None) => return MIN_CAPACITY,
    };
    // Precision loss above 2^53 bytes is irrelevant for a capacity.
    let share = (memory as f64 * DEFAULT_MEMORY_FRACTION) as u64;
    share.clamp(MIN_CAPACITY, DEFAULT_CAPACITY_CAP)
}

/// A `Name:   123 kB` field of /proc/meminfo, in bytes.
fn meminfo_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|line| line.starts_with(name))?;
    let kib: u64 = line[name.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_thirty_percent_of_the_smaller_limit_within_bounds() {
        let gib = 1u64 << 30;
        assert_eq!(default_capacity_from(Some(10 * gib), None), 3 * gib);
        assert_eq!(default_capacity_from(Some(100 * gib), Some(10 * gib)), 3 * gib);
        assert_eq!(default_capacity_from(Some(10_000 * gib), None), DEFAULT_CAPACITY_CAP);
        assert_eq!(default_capacity_from(Some(gib / 16), None), MIN_CAPACITY);
        assert_eq!(default_capacity_from(None, None), MIN_CAPACITY);
    }

    #[test]
    fn the_spill_parent_is_the_configured_dir_then_the_environment_then_temp() {
        let configured = Path::new("/data/configured");
        let env = || Some(OsString::from("/data/from-env"));
        assert_eq!(spill_parent_from(Some(configured), env()), configured);
        assert_eq!(spill_parent_from(None, env()), Path::new("/data/from-env"));
        assert_eq!(spill_parent_from(None, Some(OsString::new())), std::env::temp_dir());
        assert_eq!(spill_parent_from(None, None), std::env::temp_dir());
    }

    #[test]
    fn meminfo_is_parsed_and_garbage_is_not() {
        let text = "MemTotal:       24576000 kB\nMemFree: 1 kB\n";
        assert_eq!(meminfo_field(text, "MemTotal:"), Some(24_576_000 * 1024));
        assert_eq!(meminfo_field("MemTotal: lots", "MemTotal:"), None);
        assert!(default_capacity() >= MIN_CAPACITY);
    }
}
