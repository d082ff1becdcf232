//! Worker processes: the driver's executable re-run in worker mode. A worker registers with the
//! control plane and then either hosts one actor or runs tasks, one at a time.
//!
//! Calls arrive on connection reader threads and are handed to an executor thread, so a call
//! that waits (for an `ObjectRef` argument, a nested call) never blocks a reader.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use dashmap::{DashMap, DashSet};
use futures::FutureExt;
use tokio::sync::{RwLock, Semaphore};
use tracing::Instrument;

use crate::actor::{Actor, Invocation, unshare};
use crate::error::{Error, Result};
pub(crate) use rtrun_proto::env::{WORKER_ENV, WorkerSpec};

use crate::ids::WorkerId;
use crate::object::{ObjectBytes, ObjectRef, Value};
use crate::protocol::{Arg, Assignment, CallFrame, CallTarget, Frame, Outcome, ask};
use crate::runtime::{Ending, Runtime, To};
use crate::transport::Connection;

/// This process's worker spec, from its environment; `None` in a driver.
pub(crate) fn worker_spec_from_env() -> Option<WorkerSpec> {
    WorkerSpec::parse(&std::env::var(WORKER_ENV).ok()?)
}

/// Runs this process as a worker: the main of a worker process, which never returns. It
/// serves its assignment until its part in the session ends, then exits with that ending's
/// code.
pub(crate) fn run(spec: WorkerSpec) -> ! {
    let ending = match Runtime::start_worker(&spec) {
        // A registration that failed because the head went away ends as that did.
        Ok(runtime) => match serve(&runtime, &spec) {
            Ok(()) => runtime.wait_for_end(),
            Err(e) => runtime.ended().unwrap_or_else(|| {
                Ending::StartFailed(format!("rtrun worker {} failed to start: {e}", spec.worker))
            }),
        },
        Err(e) => Ending::StartFailed(format!("rtrun worker {} failed to start: {e}", spec.worker)),
    };
    ending.exit()
}

fn serve(runtime: &Arc<Runtime>, spec: &WorkerSpec) -> Result<()> {
    let assignment = runtime.ask(
        To::Head,
        ask::RegisterWorker {
            worker: spec.worker,
            address: runtime.address().clone(),
            pid: std::process::id(),
        },
    )?;
    match assignment {
        Assignment::Tasks => task_executor(runtime).map(|_| ()),
        Assignment::Actor(start) => {
            let actor = start.actor;
            let incarnation = start.incarnation;
            *runtime.actor_context.lock() = Some((*start).clone());
            let result = host_actor(runtime, &start).map_err(|e| e.to_string());
            // When the constructor failed, the head kills this process: it waits for that.
            runtime.ask(To::Head, ask::ActorStarted { actor, incarnation, result })
        }
    }
}

fn host_actor(runtime: &Arc<Runtime>, start: &crate::protocol::ActorStart) -> Result<()> {
    let entry = crate::registry::actor_type(&start.type_name).ok_or_else(|| {
        Error::Invalid(format!("actor type {} is not compiled into this binary", start.type_name))
    })?;
    let args = resolve_args(&start.ctor_args)?;
    let hosted = (entry.host)(args, start.max_concurrency)?;
    let worker = runtime.worker().ok_or(Error::NotInitialised)?;
    let _ = worker.hosted.set(hosted);
    Ok(())
}

/// Fetches `ObjectRef` arguments from their owners; inline ones pass through.
fn resolve_args(args: &[Arg]) -> Result<Vec<ObjectBytes>> {
    let runtime = crate::runtime::current()?;
    let refs: Vec<Option<ObjectRef<()>>> = args
        .iter()
        .map(|arg| match arg {
            Arg::Inline(_) | Arg::Nested { .. } | Arg::Stored(_) => None,
            Arg::Ref(locator) => {
                let r: ObjectRef<()> =
                    ObjectRef::from_local(runtime.objects.handle_for(runtime, locator.clone()));
                r.ensure_fetch();
                Some(r)
            }
        })
        .collect();
    args.iter()
        .zip(refs)
        .map(|(arg, r)| match (arg, r) {
            (Arg::Inline(bytes), _) => Ok(ObjectBytes::inline(bytes.clone())),
            (Arg::Nested { bytes, refs }, _) => {
                Ok(ObjectBytes::nested(bytes.clone(), refs.clone()))
            }
            (Arg::Stored(stored), _) => Value::Stored(stored.clone()).resolve(),
            (_, Some(r)) => r.get_bytes(None),
            (Arg::Ref(_), None) => Err(Error::Invalid("unresolved argument".into())),
        })
        .collect()
}

/// A call that arrived for the hosted actor or task executor.
pub struct IncomingCall {
    call_id: u64,
    target: CallTarget,
    args: Vec<Arg>,
    reply_to: Arc<Connection>,
}

/// This worker's task executor, started on first use.
fn task_executor(runtime: &Arc<Runtime>) -> Result<&Arc<TaskExecutor>> {
    static START: std::sync::Mutex<()> = std::sync::Mutex::new(());
    if let Some(tasks) = runtime.tasks() {
        return Ok(tasks);
    }
    let _guard = START.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let worker = runtime.worker().ok_or(Error::NotInitialised)?;
    if worker.tasks.get().is_none() {
        let _ = worker.tasks.set(TaskExecutor::start(runtime.clone())?);
    }
    runtime.tasks().ok_or(Error::NotInitialised)
}

/// The job this process belongs to (`-` outside a submitted job), as its spans name it.
fn process_job() -> &'static str {
    static JOB: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    JOB.get_or_init(|| std::env::var(crate::cluster::JOB_ENV).unwrap_or_else(|_| "-".into()))
}

/// The span of one call as this worker runs it: the job, node and worker, the actor and method
/// (or the task's function), and who called with the caller's id of the call, which the
/// caller's `actor_call` span (or the head's `task dispatched` line) names too. Every line the
/// method logs carries them.
/// The fields are computed only when the span is enabled (the macros evaluate them lazily):
/// calls are the hot path.
fn call_span(runtime: &Runtime, call: &IncomingCall, target: &str) -> tracing::Span {
    let caller = || {
        let holder =
            call.reply_to.peer().and_then(|peer| rtrun_proto::address::holder_of_address(&peer));
        holder.map_or_else(|| "-".to_owned(), |h| WorkerId(h.0).to_string())
    };
    let (node, worker, call_id) = (runtime.node(), runtime.worker_id, call.call_id);
    match &call.target {
        CallTarget::Actor { actor, .. } => tracing::info_span!(
            "call",
            job = process_job(),
            %node,
            %worker,
            %actor,
            method = target,
            caller = caller(),
            call = call_id
        ),
        CallTarget::Task { .. } => tracing::info_span!(
            "task",
            job = process_job(),
            %node,
            %worker,
            function = target,
            caller = caller(),
            call = call_id
        ),
    }
}

/// Routes an incoming call to the hosted actor or the task executor.
pub(crate) fn on_call(runtime: &Arc<Runtime>, conn: &Arc<Connection>, call: CallFrame) {
    let incoming = IncomingCall {
        call_id: call.call_id,
        target: call.target,
        args: call.args,
        reply_to: conn.clone(),
    };
    match (&incoming.target, runtime.hosted()) {
        (CallTarget::Actor { .. }, Some(hosted)) => hosted.submit(incoming),
        // The head may dispatch a task before our registration call has returned, so the task
        // executor starts with the first task rather than with the assignment.
        (CallTarget::Task { .. }, None) => match task_executor(runtime) {
            Ok(tasks) => tasks.submit(incoming),
            Err(e) => answer(&incoming, Err(e)),
        },
        _ => answer(
            &incoming,
            Err(Error::Invalid(format!(
                "worker {} cannot run {:?}",
                runtime.worker_id, incoming.target
            ))),
        ),
    }
}

/// Sends a call's outcome to its caller: an actor call's as a [`Frame::Reply`], a task's as a
/// [`Frame::TaskReply`] to the head; a value over the inline limit goes through the node's
/// object store (the reply carries its location, and the caller gets its own reference count).
/// The references in the value come from the return value this thread encoded last.
fn answer(call: &IncomingCall, result: Result<Vec<u8>>) {
    let task = matches!(call.target, CallTarget::Task { .. });
    reply_with(&call.reply_to, call.call_id, task, result, crate::object::take_return_refs());
}

/// Like [`answer`], with the references the value carries given explicitly.
fn reply_with(
    conn: &Arc<Connection>,
    call_id: u64,
    task: bool,
    result: Result<Vec<u8>>,
    refs: Vec<crate::object::StoredValue>,
) {
    let value = result.and_then(|bytes| match crate::runtime::current() {
        Ok(runtime) => runtime.value_of(bytes, refs),
        Err(_) => Ok(Value::inline(bytes)),
    });
    let outcome = match value {
        Ok(Value::Inline(bytes)) => Outcome::Value(unshare(bytes)),
        Ok(Value::Nested { bytes, refs }) => {
            Outcome::Nested { bytes: unshare(bytes), refs: unshare(refs) }
        }
        Ok(Value::Stored(stored)) => Outcome::Stored(stored),
        Err(e) => Outcome::Error(e),
    };
    match &outcome {
        Outcome::Error(e) => tracing::debug!("call failed: {e}"),
        _ => tracing::debug!("call replied"),
    }
    let frame = match task {
        true => Frame::TaskReply { call_id, outcome },
        false => Frame::Reply { call_id, outcome },
    };
    if let Err(e) = conn.send(&frame) {
        tracing::debug!("could not deliver a reply: {e}");
    }
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "panicked".to_owned()
    }
}

/// A hosted actor, type-erased for the worker.
pub trait HostedActor: Send + Sync {
    /// Queues a call.
    fn submit(&self, call: IncomingCall);
    /// Cancels a call that has not started, or aborts a running async one.
    fn cancel(&self, call_id: u64);
}

/// Runs one actor's calls: an executor thread takes them in arrival order.
struct ActorCell<A: Actor> {
    queue: crossbeam_channel::Sender<IncomingCall>,
    cancelled: Arc<DashSet<u64>>,
    running_async: Arc<DashMap<u64, tokio::task::AbortHandle>>,
    _type: std::marker::PhantomData<fn() -> A>,
}

impl<A: Actor> HostedActor for ActorCell<A> {
    fn submit(&self, call: IncomingCall) {
        if let Err(e) = self.queue.send(call) {
            let call = e.into_inner();
            answer(&call, Err(Error::Invalid("the actor's executor stopped".into())));
        }
    }

    fn cancel(&self, call_id: u64) {
        if let Some((_, handle)) = self.running_async.remove(&call_id) {
            handle.abort();
        } else {
            self.cancelled.insert(call_id);
        }
    }
}

/// Constructs an actor and starts hosting it (the registry's `host` entry for `A`).
#[doc(hidden)]
pub fn host<A: Actor>(
    args: Vec<ObjectBytes>,
    max_concurrency: Option<usize>,
) -> Result<Arc<dyn HostedActor>> {
    let constructed =
        std::panic::catch_unwind(AssertUnwindSafe(|| A::construct(args))).map_err(|p| {
            Error::TaskFailed {
                target: format!("{}::new", A::TYPE_NAME),
                message: panic_message(p),
            }
        })??;
    let state = Arc::new(RwLock::new(constructed));
    let (tx, rx) = crossbeam_channel::unbounded::<IncomingCall>();
    let cancelled = Arc::new(DashSet::new());
    let running_async = Arc::new(DashMap::new());
    let runtime = crate::runtime::current()?.clone();
    let executor = Executor::<A> {
        state,
        runtime,
        cancelled: cancelled.clone(),
        running_async: running_async.clone(),
        async_permits: Arc::new(Semaphore::new(max_concurrency.unwrap_or(1000).max(1))),
        sync_pool: match max_concurrency {
            Some(n) if n > 1 => Some(SyncPool::start(n)?),
            _ => None,
        },
    };
    std::thread::Builder::new()
        .name(format!("rtrun-actor-{}", A::TYPE_NAME))
        .spawn(move || executor.run(rx))
        .map_err(|e| Error::System(format!("cannot start the actor thread: {e}")))?;
    Ok(Arc::new(ActorCell::<A> {
        queue: tx,
        cancelled,
        running_async,
        _type: std::marker::PhantomData,
    }))
}

type PoolJob = Box<dyn FnOnce() + Send>;

/// Threads that run `&self` sync methods concurrently (`max_concurrency > 1`).
struct SyncPool {
    jobs: crossbeam_channel::Sender<PoolJob>,
}

impl SyncPool {
    fn start(threads: usize) -> Result<SyncPool> {
        let (tx, rx) = crossbeam_channel::unbounded::<PoolJob>();
        for i in 0..threads {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("rtrun-actor-pool-{i}"))
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                })
                .map_err(|e| Error::System(format!("cannot start an actor pool thread: {e}")))?;
        }
        Ok(SyncPool { jobs: tx })
    }
}

struct Executor<A: Actor> {
    state: Arc<RwLock<A>>,
    runtime: Arc<Runtime>,
    cancelled: Arc<DashSet<u64>>,
    running_async: Arc<DashMap<u64, tokio::task::AbortHandle>>,
    async_permits: Arc<Semaphore>,
    sync_pool: Option<SyncPool>,
}

impl<A: Actor> Executor<A> {
    fn run(self, calls: crossbeam_channel::Receiver<IncomingCall>) {
        for call in calls {
            if self.cancelled.remove(&call.call_id).is_some() {
                answer(&call, Err(Error::Cancelled));
                continue;
            }
            let CallTarget::Actor { method, .. } = call.target else { continue };
            let target = format!("{}::{}", A::TYPE_NAME, A::method_name(method));
            let span = call_span(&self.runtime, &call, &target);
            let _entered = span.enter();
            tracing::debug!("call started");
            let invocation = resolve_args(&call.args).and_then(|args| A::invoke(method, args));
            let invocation = match invocation {
                Ok(invocation) => invocation,
                Err(e) => {
                    answer(&call, Err(e));
                    continue;
                }
            };
            self.execute(invocation, call, target, &span);
        }
    }

    fn execute(
        &self,
        invocation: Invocation<A>,
        call: IncomingCall,
        target: String,
        span: &tracing::Span,
    ) {
        let failed = |p| Error::TaskFailed { target: target.clone(), message: panic_message(p) };
        match invocation {
            Invocation::Exclusive(f) => {
                let mut guard = self.state.blocking_write();
                let result = std::panic::catch_unwind(AssertUnwindSafe(|| f(&mut guard)));
                answer(&call, result.unwrap_or_else(|p| Err(failed(p))));
            }
            Invocation::Shared(f) => {
                let guard = self.runtime.tokio().block_on(self.state.clone().read_owned());
                match &self.sync_pool {
                    None => {
                        let result = std::panic::catch_unwind(AssertUnwindSafe(|| f(&guard)));
                        answer(&call, result.unwrap_or_else(|p| Err(failed(p))));
                    }
                    Some(pool) => {
                        let span = span.clone();
                        let job: PoolJob = Box::new(move || {
                            let _entered = span.enter();
                            let result = std::panic::catch_unwind(AssertUnwindSafe(|| f(&guard)));
                            let result = result.unwrap_or_else(|p| {
                                Err(Error::TaskFailed { target, message: panic_message(p) })
                            });
                            answer(&call, result);
                        });
                        if pool.jobs.send(job).is_err() {
                            tracing::error!("actor pool stopped");
                        }
                    }
                }
            }
            Invocation::SharedAsync(f) => {
                let permit =
                    self.runtime.tokio().block_on(self.async_permits.clone().acquire_owned());
                let guard = self.runtime.tokio().block_on(self.state.clone().read_owned());
                self.spawn_async(call, target, permit.ok(), f(guard), span);
            }
            Invocation::ExclusiveAsync(f) => {
                let guard = self.runtime.tokio().block_on(self.state.clone().write_owned());
                self.spawn_async(call, target, None, f(guard), span);
            }
        }
    }

    fn spawn_async(
        &self,
        call: IncomingCall,
        target: String,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
        future: crate::actor::MethodFuture,
        span: &tracing::Span,
    ) {
        let call_id = call.call_id;
        let running = self.running_async.clone();
        let future = future.instrument(span.clone());
        let inner = self.runtime.tokio().spawn(async move {
            let result = AssertUnwindSafe(future).catch_unwind().await;
            // The return value was encoded in the poll that just finished, on this thread.
            let refs = crate::object::take_return_refs();
            drop(permit);
            let result = result
                .unwrap_or_else(|p| Err(Error::TaskFailed { target, message: panic_message(p) }));
            (result, refs)
        });
        running.insert(call_id, inner.abort_handle());
        let reply_to = call.reply_to;
        self.runtime.tokio().spawn(
            async move {
                let (result, refs) = match inner.await {
                    Ok(done) => done,
                    Err(e) if e.is_cancelled() => (Err(Error::Cancelled), Vec::new()),
                    Err(e) => (
                        Err(Error::TaskFailed {
                            target: "async call".into(),
                            message: e.to_string(),
                        }),
                        Vec::new(),
                    ),
                };
                running.remove(&call_id);
                reply_with(&reply_to, call_id, false, result, refs);
            }
            .instrument(span.clone()),
        );
    }
}

/// Runs tasks one at a time on its own thread.
pub(crate) struct TaskExecutor {
    queue: crossbeam_channel::Sender<IncomingCall>,
    cancelled: Arc<DashSet<u64>>,
}

impl TaskExecutor {
    fn start(runtime: Arc<Runtime>) -> Result<Arc<TaskExecutor>> {
        let (tx, rx) = crossbeam_channel::unbounded::<IncomingCall>();
        let cancelled = Arc::new(DashSet::new());
        let cancelled_in_thread = cancelled.clone();
        std::thread::Builder::new()
            .name("rtrun-tasks".into())
            .spawn(move || {
                for call in rx {
                    if cancelled_in_thread.remove(&call.call_id).is_some() {
                        answer(&call, Err(Error::Cancelled));
                        continue;
                    }
                    let CallTarget::Task { function } = &call.target else { continue };
                    let span = call_span(&runtime, &call, function);
                    let _entered = span.enter();
                    tracing::debug!("task started");
                    let result = run_task(function, &call.args);
                    answer(&call, result);
                }
            })
            .map_err(|e| Error::System(format!("cannot start the task thread: {e}")))?;
        Ok(Arc::new(TaskExecutor { queue: tx, cancelled }))
    }

    pub(crate) fn submit(&self, call: IncomingCall) {
        if let Err(e) = self.queue.send(call) {
            let call = e.into_inner();
            answer(&call, Err(Error::Invalid("the task executor stopped".into())));
        }
    }

    pub(crate) fn cancel(&self, call_id: u64) {
        self.cancelled.insert(call_id);
    }
}

fn run_task(function: &str, args: &[Arg]) -> Result<Vec<u8>> {
    let entry = crate::registry::task(function).ok_or_else(|| {
        Error::Invalid(format!("remote function {function} is not compiled into this binary"))
    })?;
    let args = resolve_args(args)?;
    std::panic::catch_unwind(AssertUnwindSafe(|| (entry.run)(args))).unwrap_or_else(|p| {
        Err(Error::TaskFailed { target: function.to_owned(), message: panic_message(p) })
    })
}

/// Runs an async remote function's future to completion on the worker's async runtime.
#[doc(hidden)]
pub fn block_on<F: std::future::Future>(future: F) -> Result<F::Output> {
    Ok(crate::runtime::current()?.tokio().block_on(future))
}
