//! Identifiers of the runtime's entities (the wire's, from `rtrun-proto`), and the per-process
//! counter that makes call ids and object sequence numbers without coordination.

use std::sync::atomic::{AtomicU64, Ordering};

pub use rtrun_proto::ids::*;

/// A per-process counter for call ids and object sequence numbers.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// A counter whose first value is `start`.
    pub const fn starting_at(start: u64) -> Counter {
        Counter(AtomicU64::new(start))
    }

    /// The next value.
    pub fn next(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed)
    }
}
