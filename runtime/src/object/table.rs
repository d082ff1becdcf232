//! The process's object table: each object's [`Slot`] (its [`Value`] once known, waited on by
//! threads, futures and callbacks) and the handles that keep it, by id. What the API does with
//! them (`ObjectRef`, `put`, `get`, resolving a stored value) is in the parent module.

use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::ids::ObjectId;
use crate::protocol::{Address, ObjectLocator};
use crate::runtime::Runtime;
use rtrun_proto::object::StoredValue;

/// The value of an object as a slot holds it.
#[derive(Clone, Debug)]
pub enum Value {
    /// The encoded value itself.
    Inline(Arc<Vec<u8>>),
    /// The encoded value and the stored values of the references serialized in it, which it
    /// keeps alive. Such a value stays inline whatever its size.
    Nested {
        /// The encoded value.
        bytes: Arc<Vec<u8>>,
        /// Its references' stored values.
        refs: Arc<Vec<StoredValue>>,
    },
    /// Where the value is in the node's store.
    Stored(StoredValue),
}

impl Value {
    /// Inline bytes.
    pub fn inline(bytes: Vec<u8>) -> Value {
        Value::Inline(Arc::new(bytes))
    }
}

type Callback = Box<dyn FnOnce(&Result<Value>) + Send>;

enum SlotState {
    Pending(Vec<Callback>),
    Done(Result<Value>),
}

/// A value that will be known later: completed once, waited on by threads, futures and
/// callbacks.
pub struct Slot {
    state: Mutex<SlotState>,
    ready: Condvar,
}

impl Default for Slot {
    fn default() -> Self {
        Slot { state: Mutex::new(SlotState::Pending(Vec::new())), ready: Condvar::new() }
    }
}

impl Slot {
    /// A slot that is already complete.
    pub fn done(result: Result<Value>) -> Slot {
        Slot { state: Mutex::new(SlotState::Done(result)), ready: Condvar::new() }
    }

    /// Completes the slot; later completions are ignored (the first outcome wins).
    pub fn complete(&self, result: Result<Value>) {
        let callbacks = {
            let mut state = self.state.lock();
            match &mut *state {
                SlotState::Done(_) => return,
                SlotState::Pending(callbacks) => {
                    let callbacks = std::mem::take(callbacks);
                    *state = SlotState::Done(result);
                    callbacks
                }
            }
        };
        self.ready.notify_all();
        if !callbacks.is_empty() {
            let state = self.state.lock();
            if let SlotState::Done(result) = &*state {
                let result = result.clone();
                drop(state);
                for callback in callbacks {
                    callback(&result);
                }
            }
        }
    }

    /// Replaces a completed value (used by `free`, which turns a value into an error).
    pub fn overwrite(&self, result: Result<Value>) {
        *self.state.lock() = SlotState::Done(result);
        self.ready.notify_all();
    }

    /// The outcome, if known.
    pub fn peek(&self) -> Option<Result<Value>> {
        match &*self.state.lock() {
            SlotState::Done(result) => Some(result.clone()),
            SlotState::Pending(_) => None,
        }
    }

    /// Whether the outcome is known.
    pub fn is_done(&self) -> bool {
        matches!(&*self.state.lock(), SlotState::Done(_))
    }

    /// Runs `callback` with the outcome: now if known, else when it completes.
    pub fn on_done(&self, callback: impl FnOnce(&Result<Value>) + Send + 'static) {
        let mut state = self.state.lock();
        match &mut *state {
            SlotState::Pending(callbacks) => callbacks.push(Box::new(callback)),
            SlotState::Done(result) => {
                let result = result.clone();
                drop(state);
                callback(&result);
            }
        }
    }

    /// Blocks until the outcome is known or `deadline` passes.
    pub fn wait(&self, deadline: Option<Instant>) -> Option<Result<Value>> {
        let mut state = self.state.lock();
        loop {
            if let SlotState::Done(result) = &*state {
                return Some(result.clone());
            }
            match deadline {
                None => self.ready.wait(&mut state),
                Some(deadline) => {
                    if self.ready.wait_until(&mut state, deadline).timed_out() {
                        if let SlotState::Done(result) = &*state {
                            return Some(result.clone());
                        }
                        return None;
                    }
                }
            }
        }
    }
}

/// A process-local handle on an object; shared by every `ObjectRef` to it in this process.
pub(crate) struct LocalObject {
    pub(crate) id: ObjectId,
    pub(crate) owner: Address,
    pub(crate) slot: Arc<Slot>,
    /// For borrowed objects: whether a fetch from the owner has been started.
    pub(crate) fetch_started: Mutex<bool>,
    pub(crate) runtime: Weak<Runtime>,
}

impl Drop for LocalObject {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.upgrade() {
            runtime.objects.release(self.id);
        }
    }
}

/// The process's object table.
#[derive(Default)]
pub struct ObjectTable {
    /// Live handles by id, so that a reference arriving from elsewhere joins the existing entry.
    pub(super) handles: dashmap::DashMap<ObjectId, Weak<LocalObject>>,
    /// Owned objects whose references escaped to other processes: kept until freed.
    pub(super) escaped: dashmap::DashMap<ObjectId, Arc<Slot>>,
}

impl ObjectTable {
    /// Registers a new object owned by this process.
    pub(crate) fn create_owned(
        &self,
        runtime: &Arc<Runtime>,
        id: ObjectId,
        slot: Arc<Slot>,
    ) -> Arc<LocalObject> {
        let object = Arc::new(LocalObject {
            id,
            owner: runtime.address().clone(),
            slot,
            fetch_started: Mutex::new(true),
            runtime: Arc::downgrade(runtime),
        });
        self.handles.insert(id, Arc::downgrade(&object));
        object
    }

    /// The handle for a reference that arrived from another process (or our own, returning).
    pub(crate) fn handle_for(
        &self,
        runtime: &Arc<Runtime>,
        locator: ObjectLocator,
    ) -> Arc<LocalObject> {
        if let Some(existing) = self.handles.get(&locator.id).and_then(|w| w.upgrade()) {
            return existing;
        }
        let owned_here = &locator.owner == runtime.address();
        let slot = match self.escaped.get(&locator.id) {
            Some(slot) => slot.clone(),
            None if owned_here => Arc::new(Slot::done(Err(Error::ObjectFreed(locator.id)))),
            None => Arc::new(Slot::default()),
        };
        let object = Arc::new(LocalObject {
            id: locator.id,
            owner: locator.owner,
            slot,
            fetch_started: Mutex::new(owned_here),
            runtime: Arc::downgrade(runtime),
        });
        self.handles.insert(locator.id, Arc::downgrade(&object));
        object
    }

    /// Marks an owned object as referenced from elsewhere, so it outlives local handles.
    pub(crate) fn mark_escaped(&self, object: &LocalObject, runtime: &Runtime) {
        if &object.owner == runtime.address() && !self.escaped.contains_key(&object.id) {
            self.escaped.insert(object.id, object.slot.clone());
        }
    }

    /// The slot of an object this process owns or holds, for answering fetches.
    pub(crate) fn find_slot(&self, id: ObjectId) -> Option<Arc<Slot>> {
        if let Some(slot) = self.escaped.get(&id) {
            return Some(slot.clone());
        }
        self.handles.get(&id).and_then(|w| w.upgrade()).map(|o| o.slot.clone())
    }

    /// Frees an owned object: later gets anywhere fail with `ObjectFreed`.
    pub(crate) fn free_owned(&self, id: ObjectId) {
        let slot =
            self.escaped.remove(&id).map(|(_, slot)| slot).or_else(|| {
                self.handles.get(&id).and_then(|w| w.upgrade()).map(|o| o.slot.clone())
            });
        if let Some(slot) = slot {
            slot.overwrite(Err(Error::ObjectFreed(id)));
        }
    }

    fn release(&self, id: ObjectId) {
        self.handles.remove_if(&id, |_, weak| weak.strong_count() == 0);
    }

    /// How many objects this process currently tracks (live handles plus escaped objects).
    pub fn len(&self) -> usize {
        self.handles.len() + self.escaped.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
