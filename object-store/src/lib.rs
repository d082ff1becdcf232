//! The per-node object store: immutable objects in shared memory that every process on the node
//! maps read-only, owned by the process that created them.
//!
//! The node process runs the store; worker processes attach to its shared-memory arena and read
//! objects in place. The allocator and eviction policy are pure cores; only `shm` touches memory.

pub mod id;

pub use id::ObjectId;
