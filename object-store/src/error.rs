//! The store's error type, shared by the pure core and the node-side store.

use std::io;
use std::path::PathBuf;

use crate::alloc::AllocError;
use crate::core::HolderId;
use crate::id::ObjectId;
use crate::shm::RangeError;
use crate::tensor::TensorError;

/// Everything that can go wrong with an object-store operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No object with this id is in the store (never created, already freed, or evicted).
    #[error("object {0} not found in the store")]
    ObjectNotFound(ObjectId),
    /// An object with this id already exists.
    #[error("object {0} already exists in the store, expected a new id")]
    ObjectExists(ObjectId),
    /// The object's last reference is gone; it lives on only until its readers unpin it.
    #[error("object {0} was freed, expected a live object")]
    ObjectFreed(ObjectId),
    /// The operation needs a sealed object.
    #[error("object {id} is {found}, expected a sealed object")]
    NotSealed {
        /// The object.
        id: ObjectId,
        /// Its current state.
        found: &'static str,
    },
    /// The operation needs an object that is still being written.
    #[error("object {id} is {found}, expected an object being created")]
    NotCreating {
        /// The object.
        id: ObjectId,
        /// Its current state.
        found: &'static str,
    },
    /// The object can never fit, whatever is spilled.
    #[error("object of {size} bytes needs more than the store capacity of {capacity} bytes")]
    TooLarge {
        /// Bytes requested.
        size: u64,
        /// Store capacity.
        capacity: u64,
    },
    /// Even spilling every spillable object cannot make room.
    #[error(
        "store full: needed {needed} contiguous bytes of {capacity}, but {pinned} bytes are pinned \
         or still being written and cannot be spilled"
    )]
    StoreFull {
        /// Bytes requested (reserved length).
        needed: u64,
        /// Store capacity.
        capacity: u64,
        /// Bytes held by pinned or unsealed objects.
        pinned: u64,
    },
    /// An unpin without a matching pin.
    #[error("holder {holder} does not pin object {id}, expected a pin to release")]
    NotPinned {
        /// The object.
        id: ObjectId,
        /// The reader that tried to unpin.
        holder: HolderId,
    },
    /// The allocator's bookkeeping refused a range (a broken invariant, never hostile input).
    #[error("arena bookkeeping: {0}")]
    Alloc(#[from] AllocError),
    /// A range of the shared-memory arena could not be accessed.
    #[error("arena access: {0}")]
    Range(#[from] RangeError),
    /// Creating, attaching or mapping the arena failed.
    #[error("shared-memory arena: {context}: {source}")]
    Arena {
        /// What was being done.
        context: String,
        /// The OS error.
        source: io::Error,
    },
    /// Spilling to or restoring from disk failed; the object stays where it was.
    #[error("spill file {path}: {source}")]
    Spill {
        /// The spill file or directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// A spill file's bytes do not match the checksum taken when the object was spilled (the
    /// file was changed on disk, or the disk returned wrong bytes). The corrupt bytes are never
    /// handed out: the object stays spilled, and every later read fails the same way.
    #[error(
        "object {id} is corrupted on disk: spill file {path} has xxh3 checksum {found:#018x}, \
         expected {expected:#018x}"
    )]
    ObjectCorrupted {
        /// The object.
        id: ObjectId,
        /// Its spill file.
        path: PathBuf,
        /// The XXH3-64 checksum of the bytes when they were spilled.
        expected: u64,
        /// The XXH3-64 checksum of the bytes read back.
        found: u64,
    },
    /// A tensor object's header or data is invalid.
    #[error("tensor object: {0}")]
    Tensor(#[from] TensorError),
    /// The store configuration is unusable.
    #[error("invalid store configuration: {0}")]
    Config(String),
}

/// Shorthand for results of store operations.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;
