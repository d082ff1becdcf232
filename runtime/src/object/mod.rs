//! Object references and the process-local object table.
//!
//! Every process keeps the objects it owns (the values it `put` and the results of the calls it
//! made) in its table; other processes fetch them from the owner on demand. An [`ObjectRef`] is
//! a handle on a table entry: cloning it is an `Arc` clone, and when the last handle in the
//! owner drops, the value is freed.
//!
//! A value is either inline (small: its bytes sit in the slot and travel in frames) or stored
//! (over the inline limit: it lives in the node's shared-memory store, the slot holds a
//! [`StoredValue`] that carries this process's reference count, and readers map it in place).
//! References to stored values travel with their own counts (see `crate::store`), so such an
//! object is freed when the last reference in any process drops — also when the reference
//! travels inside another value: encoding collects the stored values of the references it
//! serializes, they travel beside the bytes (`Arg::Nested`, `Outcome::Nested`) and keep their
//! objects alive as long as the containing value lives, and decoding hands each deserialized
//! reference its share (Ray's nested references). A reference to an inline or still-pending
//! value that escapes keeps the owner's entry until [`free`] or the owner's exit.

use std::cell::RefCell;
use std::future::{Future, IntoFuture};
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::codec;
use crate::error::{Error, Result};
use crate::ids::ObjectId;
use crate::protocol::{Address, ObjectLocator, Outcome};
use crate::runtime::{self, Runtime};
use crate::store::Hold;

pub use rtrun_proto::object::StoredValue;

pub(crate) mod table;

pub(crate) use table::LocalObject;
pub use table::{ObjectTable, Slot, Value};

pub use rtrun_object_store::{DType, ObjectView, TensorHeader, TensorView};

/// The bytes of a resolved object: owned inline bytes, or a read-only mapping of a stored
/// object that keeps it pinned while any clone lives. Derefs to `[u8]`; a 1 GiB stored object
/// is a mapping, not a copy.
#[derive(Clone)]
pub struct ObjectBytes(BytesRepr);

#[derive(Clone)]
enum BytesRepr {
    Inline(Arc<Vec<u8>>),
    /// Inline bytes with the stored values of the references serialized in them.
    Nested(Arc<Vec<u8>>, Arc<Vec<StoredValue>>),
    Mapped(Arc<Mapping>),
}

/// A pinned view of a stored object, and for a copy pulled from another node the count that
/// keeps the copy. The count drops after the view unpins (field order), so the copy is never
/// left freed but pinned, which another reader's pull could neither share nor replace.
struct Mapping {
    view: ObjectView,
    _count: Option<Arc<Hold>>,
}

impl ObjectBytes {
    /// Bytes owned by this process.
    pub fn inline(bytes: Vec<u8>) -> ObjectBytes {
        ObjectBytes(BytesRepr::Inline(Arc::new(bytes)))
    }

    /// A pinned mapping of an object in this node's store.
    pub(crate) fn mapped(view: ObjectView) -> ObjectBytes {
        ObjectBytes(BytesRepr::Mapped(Arc::new(Mapping { view, _count: None })))
    }

    /// A pinned mapping of a copy this process pulled from another node, with its count on
    /// the copy (released after the unpin).
    pub(crate) fn mapped_copy(view: ObjectView, count: Arc<Hold>) -> ObjectBytes {
        ObjectBytes(BytesRepr::Mapped(Arc::new(Mapping { view, _count: Some(count) })))
    }

    /// Whether these bytes are mapped from the node's object store (rather than copied here).
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, BytesRepr::Mapped(_))
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            BytesRepr::Inline(bytes) | BytesRepr::Nested(bytes, _) => bytes,
            BytesRepr::Mapped(mapping) => &mapping.view,
        }
    }

    /// Inline bytes and the references that travelled with them.
    pub(crate) fn nested(bytes: Vec<u8>, refs: Vec<StoredValue>) -> ObjectBytes {
        ObjectBytes(BytesRepr::Nested(Arc::new(bytes), Arc::new(refs)))
    }

    fn refs(&self) -> Option<Arc<Vec<StoredValue>>> {
        match &self.0 {
            BytesRepr::Nested(_, refs) => Some(refs.clone()),
            BytesRepr::Inline(_) | BytesRepr::Mapped(_) => None,
        }
    }

    /// The typed tensor in these bytes (an object made by [`put_tensor`]).
    pub fn tensor(&self) -> Result<TensorView<'_>> {
        TensorView::parse(self.as_bytes())
            .map_err(|e| Error::Codec(format!("not a tensor object: {e}")))
    }
}

impl std::ops::Deref for ObjectBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl AsRef<[u8]> for ObjectBytes {
    fn as_ref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl std::fmt::Debug for ObjectBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.is_mapped() { "mapped" } else { "inline" };
        write!(f, "ObjectBytes({} bytes, {kind})", self.len())
    }
}

impl Value {
    /// The bytes: the inline ones, or a pinned mapping of the stored object.
    pub fn resolve(&self) -> Result<ObjectBytes> {
        match self {
            Value::Inline(bytes) => Ok(ObjectBytes(BytesRepr::Inline(bytes.clone()))),
            Value::Nested { bytes, refs } => {
                Ok(ObjectBytes(BytesRepr::Nested(bytes.clone(), refs.clone())))
            }
            Value::Stored(stored) => {
                let runtime = runtime::current()?;
                if runtime.is_foreign(stored) {
                    return runtime.fetch_foreign(stored);
                }
                let client = runtime.store_client()?;
                Ok(ObjectBytes::mapped(client.view(stored.id)?))
            }
        }
    }
}

thread_local! {
    /// Stored values of the references serialized by the innermost `encode_collecting` on this
    /// thread (`None` outside one).
    static ENCODING_REFS: RefCell<Option<Vec<StoredValue>>> = const { RefCell::new(None) };
    /// Stored values that came with the bytes the innermost `decode_object` decodes.
    static DECODING_REFS: RefCell<Option<Arc<Vec<StoredValue>>>> = const { RefCell::new(None) };
    /// References in the return value last encoded on this thread, for the reply that follows.
    static RETURN_REFS: RefCell<Vec<StoredValue>> = const { RefCell::new(Vec::new()) };
}

/// Encodes a value and collects the stored values of the references serialized in it.
pub(crate) fn encode_collecting<T: Serialize + ?Sized>(
    value: &T,
) -> Result<(Vec<u8>, Vec<StoredValue>)> {
    let outer = ENCODING_REFS.with(|refs| refs.replace(Some(Vec::new())));
    let result = codec::encode(value);
    let refs = ENCODING_REFS.with(|refs| refs.replace(outer)).unwrap_or_default();
    result.map(|bytes| (bytes, refs))
}

/// Decodes an object's bytes; references in them take their share of the stored values that
/// travelled with the bytes.
pub fn decode_object<T: DeserializeOwned>(bytes: &ObjectBytes) -> Result<T> {
    let Some(refs) = bytes.refs() else { return codec::decode(bytes) };
    let outer = DECODING_REFS.with(|current| current.replace(Some(refs)));
    let result = codec::decode(bytes);
    DECODING_REFS.with(|current| current.replace(outer));
    result
}

/// Encodes a method's or task's return value (generated code calls this); the references in it
/// go with the reply that this thread sends next.
pub fn encode_return<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>> {
    let (bytes, refs) = encode_collecting(value)?;
    RETURN_REFS.with(|current| *current.borrow_mut() = refs);
    Ok(bytes)
}

/// Takes the references of the return value last encoded on this thread.
pub(crate) fn take_return_refs() -> Vec<StoredValue> {
    RETURN_REFS.with(|current| std::mem::take(&mut *current.borrow_mut()))
}

/// Records a serialized reference's stored value when an `encode_collecting` is running.
fn collect_encoded_ref(stored: &StoredValue) -> bool {
    ENCODING_REFS.with(|refs| match &mut *refs.borrow_mut() {
        Some(list) => {
            list.push(stored.clone());
            true
        }
        None => false,
    })
}

/// The stored value with this id among those travelling with the bytes being decoded.
fn decoding_ref(id: ObjectId) -> Option<StoredValue> {
    DECODING_REFS.with(|refs| {
        refs.borrow().as_ref().and_then(|refs| refs.iter().find(|r| r.id == id).cloned())
    })
}

impl ObjectTable {
    /// The handle for a reference to a stored value that arrived inside another value: it
    /// takes its share of the count that travelled with the bytes (or, when none did, asks the
    /// store for a count of its own) and needs nothing from the owner.
    pub(crate) fn handle_for_stored(
        &self,
        runtime: &Arc<Runtime>,
        locator: ObjectLocator,
        stored_id: ObjectId,
        size: u64,
    ) -> Arc<LocalObject> {
        if let Some(existing) = self.handles.get(&locator.id).and_then(|w| w.upgrade()) {
            return existing;
        }
        let stored = decoding_ref(stored_id).or_else(|| {
            let hold = runtime.store_client().ok()?.borrow(stored_id).ok()?;
            Some(StoredValue { id: stored_id, size, home: None, hold: Some(hold) })
        });
        let Some(stored) = stored else { return self.handle_for(runtime, locator) };
        let object = Arc::new(LocalObject {
            id: locator.id,
            owner: locator.owner,
            slot: Arc::new(Slot::done(Ok(Value::Stored(stored)))),
            fetch_started: Mutex::new(true),
            runtime: Arc::downgrade(runtime),
        });
        self.handles.insert(locator.id, Arc::downgrade(&object));
        object
    }
}

/// A reference to a value that is (or will be) held by its owner process.
///
/// `get` blocks; `.await` waits asynchronously. References can be cloned, sent to other actors
/// as arguments (they are resolved before the call runs) or inside values.
pub struct ObjectRef<T> {
    pub(crate) object: Arc<LocalObject>,
    _type: PhantomData<fn() -> T>,
}

impl<T> Clone for ObjectRef<T> {
    fn clone(&self) -> Self {
        ObjectRef { object: self.object.clone(), _type: PhantomData }
    }
}

impl<T> std::fmt::Debug for ObjectRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ObjectRef({}@{})", self.object.id, self.object.owner)
    }
}

impl<T> ObjectRef<T> {
    pub(crate) fn from_local(object: Arc<LocalObject>) -> Self {
        ObjectRef { object, _type: PhantomData }
    }

    /// The object's id.
    pub fn id(&self) -> ObjectId {
        self.object.id
    }

    /// Where the object can be fetched from.
    pub fn locator(&self) -> ObjectLocator {
        ObjectLocator { id: self.object.id, owner: self.object.owner.clone() }
    }

    /// Whether the value (or its error) is already known locally, without blocking.
    pub fn is_ready(&self) -> bool {
        self.object.slot.is_done()
    }

    /// Starts fetching a borrowed object's value from its owner (once).
    pub(crate) fn ensure_fetch(&self) {
        ensure_fetch(&self.object);
    }

    /// Waits for the value and returns its bytes without decoding them: inline bytes, or a
    /// read-only mapping of the stored object that keeps it pinned while it lives.
    pub fn get_bytes(&self, timeout: Option<Duration>) -> Result<ObjectBytes> {
        self.wait_value(timeout)?.resolve()
    }

    /// Waits for the value and returns a zero-copy view of its bytes (see
    /// [`ObjectRef::get_bytes`]); for objects made by [`put_bytes`] and [`put_tensor`].
    pub fn get_view(&self) -> Result<ObjectBytes> {
        self.get_bytes(None)
    }

    pub(crate) fn wait_value(&self, timeout: Option<Duration>) -> Result<Value> {
        self.ensure_fetch();
        let deadline = timeout.map(|t| Instant::now() + t);
        match self.object.slot.wait(deadline) {
            Some(result) => result,
            None => Err(Error::Timeout(timeout.unwrap_or_default())),
        }
    }

    /// The stored value behind this reference, when it is complete and in the store.
    pub(crate) fn stored_value(&self) -> Option<StoredValue> {
        match self.object.slot.peek() {
            Some(Ok(Value::Stored(stored))) => Some(stored),
            _ => None,
        }
    }
}

pub(crate) fn ensure_fetch(object: &Arc<LocalObject>) {
    let mut started = object.fetch_started.lock();
    if !*started {
        *started = true;
        drop(started);
        match runtime::current() {
            Ok(runtime) => runtime.fetch_object(object.id, &object.owner, object.slot.clone()),
            Err(e) => object.slot.complete(Err(e)),
        }
    }
}

impl<T: DeserializeOwned> ObjectRef<T> {
    /// Blocks until the value is available and decodes it.
    pub fn get(&self) -> Result<T> {
        decode_object(&self.get_bytes(None)?)
    }

    /// Like [`ObjectRef::get`], failing with [`Error::Timeout`] after `timeout`.
    pub fn get_timeout(&self, timeout: Duration) -> Result<T> {
        decode_object(&self.get_bytes(Some(timeout))?)
    }
}

/// A reference on the wire: where to fetch the value, and for a stored value its place in the
/// store (the count travels beside the bytes).
type WireRef = (ObjectLocator, Option<(ObjectId, u64)>);

impl<T> Serialize for ObjectRef<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let stored = self.stored_value().filter(collect_encoded_ref);
        if stored.is_none()
            && let Ok(runtime) = runtime::current()
        {
            runtime.objects.mark_escaped(&self.object, runtime);
        }
        let wire: WireRef = (self.locator(), stored.map(|stored| (stored.id, stored.size)));
        wire.serialize(serializer)
    }
}

impl<'de, T> Deserialize<'de> for ObjectRef<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let (locator, stored) = WireRef::deserialize(deserializer)?;
        let runtime = runtime::current().map_err(serde::de::Error::custom)?;
        let object = match stored {
            Some((id, size)) => runtime.objects.handle_for_stored(runtime, locator, id, size),
            None => runtime.objects.handle_for(runtime, locator),
        };
        Ok(ObjectRef::from_local(object))
    }
}

/// The future of an awaited [`ObjectRef`].
pub struct ObjectFuture<T> {
    object: Arc<LocalObject>,
    waker: Arc<Mutex<Option<Waker>>>,
    registered: bool,
    _type: PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned> Future for ObjectFuture<T> {
    type Output = Result<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Some(result) = self.object.slot.peek() {
            return Poll::Ready(result.and_then(|value| decode_object(&value.resolve()?)));
        }
        *self.waker.lock() = Some(cx.waker().clone());
        if !self.registered {
            self.registered = true;
            ensure_fetch(&self.object);
            let waker = self.waker.clone();
            self.object.slot.on_done(move |_| {
                if let Some(waker) = waker.lock().take() {
                    waker.wake();
                }
            });
        }
        // The slot may have completed between the peek and the registration.
        match self.object.slot.peek() {
            Some(result) => Poll::Ready(result.and_then(|value| decode_object(&value.resolve()?))),
            None => Poll::Pending,
        }
    }
}

impl<T: DeserializeOwned> IntoFuture for ObjectRef<T> {
    type Output = Result<T>;
    type IntoFuture = ObjectFuture<T>;

    fn into_future(self) -> ObjectFuture<T> {
        ObjectFuture {
            object: self.object,
            waker: Arc::new(Mutex::new(None)),
            registered: false,
            _type: PhantomData,
        }
    }
}

/// What [`wait`] returns: the ready references, then the others.
pub type WaitResult<T> = (Vec<ObjectRef<T>>, Vec<ObjectRef<T>>);

/// Waits until `num_returns` of `refs` are ready or `timeout` passes; returns the ready ones and
/// the rest, each in their original order (Ray's `ray.wait`).
pub fn wait<T>(
    refs: &[ObjectRef<T>],
    num_returns: usize,
    timeout: Option<Duration>,
) -> Result<WaitResult<T>> {
    if num_returns > refs.len() {
        return Err(Error::Invalid(format!(
            "num_returns is {num_returns} but only {} references were given",
            refs.len()
        )));
    }
    let counter = Arc::new((Mutex::new(0usize), Condvar::new()));
    for r in refs {
        r.ensure_fetch();
        let counter = counter.clone();
        r.object.slot.on_done(move |_| {
            *counter.0.lock() += 1;
            counter.1.notify_all();
        });
    }
    let deadline = timeout.map(|t| Instant::now() + t);
    {
        let mut done = counter.0.lock();
        while *done < num_returns {
            match deadline {
                None => counter.1.wait(&mut done),
                Some(deadline) => {
                    if counter.1.wait_until(&mut done, deadline).timed_out() {
                        break;
                    }
                }
            }
        }
    }
    let mut ready = Vec::new();
    let mut rest = Vec::new();
    for r in refs {
        if ready.len() < num_returns && r.is_ready() {
            ready.push(r.clone());
        } else {
            rest.push(r.clone());
        }
    }
    Ok((ready, rest))
}

/// Gets every value in order.
pub fn get_all<T: DeserializeOwned>(refs: &[ObjectRef<T>]) -> Result<Vec<T>> {
    refs.iter().for_each(ObjectRef::ensure_fetch);
    refs.iter().map(ObjectRef::get).collect()
}

/// Stores a value and returns a reference to it: in this process's object table when its
/// encoding is small, in the node's shared-memory store when it is over the inline limit.
pub fn put<T: Serialize>(value: &T) -> Result<ObjectRef<T>> {
    let runtime = runtime::current()?;
    let (bytes, refs) = encode_collecting(value)?;
    runtime.put_encoded(bytes, refs)
}

/// Marks references made by [`put_bytes`]: read them with [`ObjectRef::get_view`].
#[derive(Debug, Clone, Copy)]
pub enum RawBytes {}

/// Marks references made by [`put_tensor`]: read them with [`ObjectRef::get_view`] and
/// [`ObjectBytes::tensor`].
#[derive(Debug, Clone, Copy)]
pub enum Tensor {}

/// Stores raw bytes without the codec: one copy into the node's store (or inline when small).
pub fn put_bytes(bytes: &[u8]) -> Result<ObjectRef<RawBytes>> {
    let runtime = runtime::current()?;
    runtime.put_raw(bytes.len() as u64, |target| {
        crate::store::copy_parallel(target, bytes);
        Ok(())
    })
}

/// Stores a contiguous tensor (row-major `shape` of `dtype`, `data` its bytes) without the
/// codec, laid out so that a tensor library can view the data in place (64-byte aligned).
pub fn put_tensor(dtype: DType, shape: &[u64], data: &[u8]) -> Result<ObjectRef<Tensor>> {
    let header = TensorHeader::new(dtype, shape.to_vec())
        .map_err(|e| Error::Invalid(format!("tensor shape: {e}")))?;
    if data.len() as u64 != header.byte_len() {
        return Err(Error::Invalid(format!(
            "tensor of {dtype:?} {shape:?} needs {} bytes, found {}",
            header.byte_len(),
            data.len()
        )));
    }
    let runtime = runtime::current()?;
    runtime.put_raw(header.object_size(), |target| {
        let offset = header.data_offset() as usize;
        header
            .write_header(&mut target[..offset])
            .map_err(|e| Error::Invalid(format!("tensor header: {e}")))?;
        crate::store::copy_parallel(&mut target[offset..], data);
        Ok(())
    })
}

/// Frees objects: later gets (here or in any process) fail with [`Error::ObjectFreed`].
pub fn free<T>(refs: &[ObjectRef<T>]) -> Result<()> {
    let runtime = runtime::current()?;
    for r in refs {
        runtime.free_object(&r.locator());
    }
    Ok(())
}

/// A handle on an already-failed object outside any runtime (used when there is none).
pub(crate) fn detached_object(result: Result<Value>) -> Arc<LocalObject> {
    Arc::new(LocalObject {
        id: ObjectId(0),
        owner: Address::new(),
        slot: Arc::new(Slot::done(result)),
        fetch_started: Mutex::new(true),
        runtime: Weak::new(),
    })
}

/// An `ObjectRef` that already failed with `error` (for calls that could not be submitted).
pub(crate) fn failed_ref<T>(error: Error) -> ObjectRef<T> {
    match runtime::current() {
        Ok(runtime) => {
            let id = runtime.new_object_id();
            ObjectRef::from_local(runtime.objects.create_owned(
                runtime,
                id,
                Arc::new(Slot::done(Err(error))),
            ))
        }
        Err(_) => ObjectRef::from_local(crate::object::detached_object(Err(error))),
    }
}

impl Runtime {
    /// Encoded bytes as a value: inline when small or when they carry references (`refs`),
    /// else written into the node's store.
    pub(crate) fn value_of(
        self: &Arc<Self>,
        bytes: Vec<u8>,
        refs: Vec<crate::object::StoredValue>,
    ) -> Result<Value> {
        if !refs.is_empty() {
            return Ok(Value::Nested { bytes: Arc::new(bytes), refs: Arc::new(refs) });
        }
        match self.store() {
            Some(store) if bytes.len() > store.max_inline() => {
                Ok(Value::Stored(store.put_bytes(self.new_object_id(), &bytes)?))
            }
            _ => Ok(Value::inline(bytes)),
        }
    }

    /// Stores encoded bytes as a new object owned by this process.
    pub(crate) fn put_encoded<T>(
        self: &Arc<Self>,
        bytes: Vec<u8>,
        refs: Vec<crate::object::StoredValue>,
    ) -> Result<ObjectRef<T>> {
        let value = self.value_of(bytes, refs)?;
        let id = self.new_object_id();
        let slot = Arc::new(Slot::done(Ok(value)));
        Ok(ObjectRef::from_local(self.objects.create_owned(self, id, slot)))
    }

    /// Stores `size` raw bytes that `write` produces in place: in the node's store when over
    /// the inline limit, else inline.
    pub(crate) fn put_raw<T>(
        self: &Arc<Self>,
        size: u64,
        write: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<ObjectRef<T>> {
        let id = self.new_object_id();
        let value = match self.store() {
            Some(store) if size > store.max_inline() as u64 => {
                Value::Stored(store.put_with(id, size, write)?)
            }
            _ => {
                let len = usize::try_from(size).map_err(|_| {
                    Error::Invalid(format!("an object of {size} bytes does not fit in memory"))
                })?;
                let mut bytes = vec![0u8; len];
                write(&mut bytes)?;
                Value::inline(bytes)
            }
        };
        let slot = Arc::new(Slot::done(Ok(value)));
        Ok(ObjectRef::from_local(self.objects.create_owned(self, id, slot)))
    }
}

/// Turns a call outcome into the object's result.
pub(crate) fn outcome_to_result(outcome: Outcome) -> Result<Value> {
    match outcome {
        Outcome::Value(bytes) => Ok(Value::inline(bytes)),
        Outcome::Nested { bytes, refs } => {
            Ok(Value::Nested { bytes: Arc::new(bytes), refs: Arc::new(refs) })
        }
        Outcome::Stored(stored) => Ok(Value::Stored(stored)),
        Outcome::Error(e) => Err(e),
    }
}
