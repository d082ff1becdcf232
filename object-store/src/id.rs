//! Object identifiers.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A cluster-unique object id. The high 64 bits name the process that created the object, the
/// low 64 bits count objects within that process, so ids are made without coordination.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ObjectId(pub u128);

impl ObjectId {
    /// An id from the creating process's unique prefix and its local counter.
    pub const fn new(process_prefix: u64, sequence: u64) -> ObjectId {
        ObjectId(((process_prefix as u128) << 64) | sequence as u128)
    }

    /// The creating process's prefix.
    pub const fn process_prefix(self) -> u64 {
        (self.0 >> 64) as u64
    }
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ObjectId({self})")
    }
}
