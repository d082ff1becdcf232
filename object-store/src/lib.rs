//! The per-node object store: immutable objects in shared memory that every process on the node
//! maps read-only, owned by the process that created them.
//!
//! The node process runs the store ([`ObjectStore`]); worker processes attach to its
//! shared-memory arena ([`Arena::attach`]) and read objects in place. The allocator
//! ([`alloc`]), the object table with its eviction and spill policy ([`core`]) and the
//! cross-node pull bookkeeping ([`pull`]) are pure cores; only the private `shm` module touches memory and holds
//! the crate's `unsafe`.
//!
//! How the runtime uses it: the node opens the store, makes the arena fd inheritable while it
//! spawns workers and passes [`Arena::env_value`] in [`ARENA_ENV`]; a worker attaches with
//! [`Arena::attach_from_env`]. A put from a worker asks the node (by message) to
//! [`ObjectStore::create`], writes through [`Arena::writer`] at the returned [`Allocation`],
//! then asks the node to [`ObjectStore::seal`]. A get asks the node to [`ObjectStore::pin`]
//! (which restores a spilled object), reads through an [`ObjectView`] whose release hook sends
//! the unpin. References travel as [`ObjectStore::add_holder`] / [`ObjectStore::remove_holder`];
//! when a worker dies the node calls [`ObjectStore::release_process`].

// `unsafe` is denied everywhere but `shm`, which opts back in.
#![deny(unsafe_code)]

pub mod alloc;
pub mod arena;
pub mod config;
pub mod core;
pub mod error;
pub mod id;
pub mod pull;
mod shm;
pub mod store;
pub mod tensor;
pub mod view;

pub use alloc::{ALIGNMENT, Allocation, Allocator};
pub use arena::{ARENA_ENV, Arena, ArenaBacking, ArenaOptions, ObjectWriter};
pub use config::{SPILL_DIR_ENV, StoreConfig};
pub use core::{
    CopyKind, Freed, HolderId, ObjectState, ObjectStats, OwnerStats, PinOutcome, Placement,
    SpillCounters, StoreCore, StoreStats, Victim, VictimAction,
};
pub use error::{Result, StoreError};
pub use id::ObjectId;
pub use pull::{ChunkOutcome, ChunkRequest, PullConfig, PullError, PullState};
pub use shm::RangeError;
pub use store::ObjectStore;
pub use tensor::{DType, TensorError, TensorHeader, TensorView};
pub use view::{ObjectView, ReleaseHook};
