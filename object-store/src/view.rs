//! Read-only, zero-copy views of sealed objects.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use crate::alloc::Allocation;
use crate::arena::Arena;
use crate::error::Result;
use crate::id::ObjectId;

/// Called once when a view drops, typically to unpin the object (directly in the node process,
/// through a message in a worker).
pub type ReleaseHook = Box<dyn FnOnce(ObjectId) + Send + Sync>;

/// The bytes of one sealed object, read in place in the shared arena. The view keeps this
/// process's mapping alive; while it lives no writer in this process can touch the range, and
/// the store's pin (released by the hook) keeps other processes from reusing it.
pub struct ObjectView {
    arena: Arc<Arena>,
    id: ObjectId,
    allocation: Allocation,
    on_release: Option<ReleaseHook>,
}

impl ObjectView {
    /// A view of `allocation`, which the caller has pinned for this process. `on_release` runs
    /// when the view drops.
    pub fn new(
        arena: Arc<Arena>,
        id: ObjectId,
        allocation: Allocation,
        on_release: Option<ReleaseHook>,
    ) -> Result<ObjectView> {
        arena.mapping().lease(allocation.offset, allocation.size)?;
        Ok(ObjectView { arena, id, allocation, on_release })
    }

    /// The object.
    pub fn id(&self) -> ObjectId {
        self.id
    }

    /// Where the object lives in the arena.
    pub fn allocation(&self) -> Allocation {
        self.allocation
    }

    /// The object's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.arena.mapping().leased(self.allocation.offset, self.allocation.size)
    }
}

impl Deref for ObjectView {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl fmt::Debug for ObjectView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectView")
            .field("id", &self.id)
            .field("allocation", &self.allocation)
            .finish()
    }
}

impl Drop for ObjectView {
    fn drop(&mut self) {
        self.arena.mapping().end_lease(self.allocation.offset, self.allocation.size);
        if let Some(hook) = self.on_release.take() {
            hook(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    #[test]
    fn a_view_blocks_writers_and_runs_its_hook_once_on_drop() {
        let arena = Arc::new(Arena::create(1 << 20).unwrap());
        let allocation = Allocation { offset: 0, size: 10 };
        arena.writer(allocation).unwrap().copy_from_slice(b"0123456789");
        let released = Arc::new(AtomicBool::new(false));
        let flag = released.clone();
        let hook: ReleaseHook = Box::new(move |_| flag.store(true, Ordering::SeqCst));
        let view = ObjectView::new(arena.clone(), ObjectId(1), allocation, Some(hook)).unwrap();
        assert_eq!(&*view, b"0123456789");
        assert!(arena.writer(allocation).is_err());
        drop(view);
        assert!(released.load(Ordering::SeqCst));
        assert!(arena.writer(allocation).is_ok());
    }
}
