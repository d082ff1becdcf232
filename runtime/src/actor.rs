//! Actors: the [`Actor`] trait that `#[rtrun::actor]` implements, typed references
//! ([`ActorRef`]), creation options, and how a method call is turned into work on the worker.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard};

pub use rtrun_proto::actor::{ActorInfo, ActorOptions, ActorSpec};

use crate::error::{Error, Result};
use crate::ids::ActorId;
use crate::object::{ObjectBytes, ObjectRef, Value};
use crate::protocol::Arg;
use crate::runtime;

/// A boxed future returned by an async actor method.
pub type MethodFuture = Pin<Box<dyn Future<Output = Result<Vec<u8>>> + Send>>;

/// The body of a sync `&mut self` method call.
pub type ExclusiveCall<A> = Box<dyn FnOnce(&mut A) -> Result<Vec<u8>> + Send>;
/// The body of a sync `&self` method call.
pub type SharedCall<A> = Box<dyn FnOnce(&A) -> Result<Vec<u8>> + Send>;

/// One decoded method call, ready to run against the actor's state. The variant says how the
/// method borrows the actor, which decides what may run concurrently with it.
pub enum Invocation<A> {
    /// `fn m(&mut self, ..)`: runs alone, in call order.
    Exclusive(ExclusiveCall<A>),
    /// `fn m(&self, ..)`: may run concurrently with other shared calls up to `max_concurrency`.
    Shared(SharedCall<A>),
    /// `async fn m(&mut self, ..)`: runs alone.
    ExclusiveAsync(Box<dyn FnOnce(OwnedRwLockWriteGuard<A>) -> MethodFuture + Send>),
    /// `async fn m(&self, ..)`: runs concurrently up to `max_concurrency` (default 1000).
    SharedAsync(Box<dyn FnOnce(OwnedRwLockReadGuard<A>) -> MethodFuture + Send>),
}

/// Implemented by `#[rtrun::actor]` for the actor's type.
pub trait Actor: Sized + Send + Sync + 'static {
    /// The generated typed reference (`<Type>Ref`).
    type Ref: From<ActorRef<Self>> + std::ops::Deref<Target = ActorRef<Self>> + Clone;
    /// The registered name: module path and type name.
    const TYPE_NAME: &'static str;
    /// Runs the constructor with the encoded arguments.
    fn construct(args: Vec<ObjectBytes>) -> Result<Self>;
    /// Decodes a call of method `method`.
    fn invoke(method: u16, args: Vec<ObjectBytes>) -> Result<Invocation<Self>>;
    /// The method's name, for errors and logs.
    fn method_name(method: u16) -> &'static str;
}

/// A serializable reference to an actor of type `A`. Generated `<Type>Ref`s dereference to it.
pub struct ActorRef<A> {
    info: ActorInfo,
    _type: PhantomData<fn() -> A>,
}

impl<A> Clone for ActorRef<A> {
    fn clone(&self) -> Self {
        ActorRef { info: self.info.clone(), _type: PhantomData }
    }
}

impl<A> std::fmt::Debug for ActorRef<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ActorRef({} {})", self.info.type_name, self.info.id)
    }
}

impl<A> Serialize for ActorRef<A> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.info.serialize(s)
    }
}

impl<'de, A> Deserialize<'de> for ActorRef<A> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(ActorRef { info: ActorInfo::deserialize(d)?, _type: PhantomData })
    }
}

impl<A> ActorRef<A> {
    pub(crate) fn from_info(info: ActorInfo) -> Self {
        ActorRef { info, _type: PhantomData }
    }

    /// The actor's id.
    pub fn id(&self) -> ActorId {
        self.info.id
    }

    /// The actor's description.
    pub fn info(&self) -> &ActorInfo {
        &self.info
    }

    /// Calls method number `method` (used by generated code).
    #[doc(hidden)]
    pub fn call<R>(&self, method: u16, args: Vec<Result<Arg>>) -> ObjectRef<R> {
        match runtime::current() {
            Ok(runtime) => runtime.submit_actor_call(&self.info, method, args),
            Err(e) => crate::object::failed_ref(e),
        }
    }

    /// Kills the actor's worker process; it is not restarted, and every pending and later call
    /// fails with [`Error::ActorDied`].
    pub fn kill(&self) -> Result<()> {
        runtime::current()?.kill_actor(self.info.id, true)
    }

    /// Kills the worker process as a crash would: the actor restarts if `max_restarts` allows.
    pub fn kill_and_restart(&self) -> Result<()> {
        runtime::current()?.kill_actor(self.info.id, false)
    }
}

/// Creates an actor of type `A` (used by generated code).
#[doc(hidden)]
pub fn create_actor<A: Actor>(options: ActorOptions, args: Vec<Result<Arg>>) -> Result<A::Ref> {
    let runtime = runtime::current()?;
    let ctor_args = args.into_iter().collect::<Result<Vec<_>>>()?;
    let mut options = options;
    if options.placement.is_none() {
        options.placement = runtime.captured_placement();
    }
    let spec = ActorSpec { type_name: A::TYPE_NAME.to_owned(), ctor_args, options };
    let info = runtime.create_actor(spec)?;
    Ok(ActorRef::from_info(info).into())
}

/// Looks a named actor up; fails when there is none or it has another type.
pub fn get_actor<A: Actor>(name: &str, namespace: Option<&str>) -> Result<A::Ref> {
    let runtime = runtime::current()?;
    let info = runtime.get_actor_by_name(name, namespace)?;
    if info.type_name != A::TYPE_NAME {
        return Err(Error::Invalid(format!(
            "actor `{name}` has type {}, expected {}",
            info.type_name,
            A::TYPE_NAME
        )));
    }
    Ok(ActorRef::from_info(info).into())
}

/// A live named actor, as [`list_named_actors`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct NamedActor {
    /// Its name.
    pub name: String,
    /// The namespace of the name.
    pub namespace: String,
    /// Its type.
    pub type_name: String,
    /// It outlives its driver.
    pub detached: bool,
}

/// The live named actors of this runtime's namespace (`all_namespaces`: of every namespace),
/// sorted by namespace then name (Ray's `ray.util.list_named_actors`).
pub fn list_named_actors(all_namespaces: bool) -> Result<Vec<NamedActor>> {
    let runtime = runtime::current()?;
    let mut named: Vec<NamedActor> = runtime
        .list_actors()?
        .into_iter()
        .filter(|a| !a.state.starts_with("DEAD"))
        .filter_map(|a| {
            let (name, namespace) = (a.name?, a.namespace?);
            let wanted = all_namespaces || namespace == runtime.namespace();
            wanted.then_some(NamedActor {
                name,
                namespace,
                type_name: a.type_name,
                detached: a.detached,
            })
        })
        .collect();
    named.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    Ok(named)
}

/// Converts a call argument: a value is encoded; an [`ObjectRef`] is passed by reference and
/// resolved by the callee before the call runs.
pub trait IntoArg<T> {
    /// The wire form of the argument.
    fn into_arg(self) -> Result<Arg>;
}

impl<T: Serialize> IntoArg<T> for T {
    fn into_arg(self) -> Result<Arg> {
        let (bytes, refs) = crate::object::encode_collecting(&self)?;
        match runtime::current() {
            Ok(runtime) => Ok(match runtime.value_of(bytes, refs)? {
                Value::Inline(bytes) => Arg::Inline(unshare(bytes)),
                Value::Nested { bytes, refs } => {
                    Arg::Nested { bytes: unshare(bytes), refs: unshare(refs) }
                }
                Value::Stored(stored) => Arg::Stored(stored),
            }),
            Err(_) => Ok(Arg::Inline(bytes)),
        }
    }
}

impl<T> IntoArg<T> for ObjectRef<T> {
    fn into_arg(self) -> Result<Arg> {
        IntoArg::<T>::into_arg(&self)
    }
}

impl<T> IntoArg<T> for &ObjectRef<T> {
    fn into_arg(self) -> Result<Arg> {
        // A completed stored value travels by location with its own reference count; anything
        // else is fetched from the owner, which keeps it for the borrower.
        if let Some(stored) = self.stored_value() {
            return Ok(Arg::Stored(stored));
        }
        let runtime = runtime::current()?;
        runtime.objects.mark_escaped(&self.object, runtime);
        Ok(Arg::Ref(self.locator()))
    }
}

/// The contents of an `Arc` that is usually not shared, copied only when it is.
pub(crate) fn unshare<T: Clone>(shared: Arc<T>) -> T {
    Arc::try_unwrap(shared).unwrap_or_else(|shared| (*shared).clone())
}

/// Turns a constructor's return value (`Self` or `Result<Self, E>`) into a result.
pub trait IntoConstructed<A> {
    /// The actor or the constructor's error.
    fn into_constructed(self) -> Result<A>;
}

impl<A: Actor> IntoConstructed<A> for A {
    fn into_constructed(self) -> Result<A> {
        Ok(self)
    }
}

impl<A: Actor, E: std::fmt::Display> IntoConstructed<A> for std::result::Result<A, E> {
    fn into_constructed(self) -> Result<A> {
        self.map_err(|e| Error::TaskFailed {
            target: format!("{}::new", A::TYPE_NAME),
            message: e.to_string(),
        })
    }
}

/// Checks the argument count of a call (used by generated code).
#[doc(hidden)]
pub fn expect_args(target: &str, args: &[ObjectBytes], expected: usize) -> Result<()> {
    if args.len() == expected {
        Ok(())
    } else {
        Err(Error::Invalid(format!("{target} takes {expected} arguments, found {}", args.len())))
    }
}
