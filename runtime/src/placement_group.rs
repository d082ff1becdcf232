//! Placement groups in the public API (Ray's `ray.util.placement_group`): reserve bundles of
//! resources across the cluster all at once, wait until they are reserved, place actors and tasks
//! into a bundle, read the bundle table (bundle → node, GPU indices, GPU UUIDs), and remove the
//! group, which stops everything running in it.
//!
//! The decisions themselves (which node, which GPUs, pending or infeasible) are made by the pure
//! `rtrun-placement` state machine inside the control plane; this module only carries requests
//! to it and answers back.
//!
//! ```ignore
//! let pg = rtrun::placement_group(
//!     PlacementGroupOptions::uniform(8, &[("GPU", 1.0), ("CPU", 1.0)])?.name("train"),
//! )?;
//! let table = pg.ready().wait(Some(Duration::from_secs(60)))?;
//! let actor = Policy::remote_with(ActorOptions::default().num_gpus(0.2).bundle(&pg, 3), ())?;
//! pg.remove()?;
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

pub use rtrun_proto::placement_group::{
    BundlePlacement, BundleRef, BundleSchedule, BundleTable, Bundles, GpuInstance, GpuShare,
    PlacementGroupId, PlacementGroupOptions, PlacementGroupState, PlacementGroupStatus, Quantity,
    ResourceSet, Strategy,
};

use crate::error::{Error, Result};
use crate::protocol::ask;
use crate::runtime::{self, To};

/// A handle to a placement group. Serializable: pass it to actors, which may place their own
/// children into it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PlacementGroup {
    id: PlacementGroupId,
    name: String,
    bundle_count: usize,
}

impl PlacementGroup {
    /// The group's id.
    pub fn id(&self) -> PlacementGroupId {
        self.id
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many bundles it has.
    pub fn bundle_count(&self) -> usize {
        self.bundle_count
    }

    /// Resolves once every bundle is reserved, with the bundle table; fails if the group is
    /// removed first. Await it, or block on it with [`PlacementGroupReady::wait`].
    pub fn ready(&self) -> PlacementGroupReady {
        let ready = PlacementGroupReady { inner: Arc::new(ReadyInner::default()) };
        let inner = ready.inner.clone();
        match runtime::current() {
            Ok(runtime) => {
                runtime.send(To::Head, ask::WaitPlacementGroup { group: self.id }, move |state| {
                    inner.complete(state.and_then(|state| table_of(*state)))
                })
            }
            Err(e) => inner.complete(Err(e)),
        }
        ready
    }

    /// Blocks until the group is created (`true`) or `timeout` passes (`false`), like Ray's
    /// `pg.wait(timeout_seconds)`. Fails if the group is removed.
    pub fn wait(&self, timeout: Duration) -> Result<bool> {
        match self.ready().wait(Some(timeout)) {
            Ok(_) => Ok(true),
            Err(Error::Timeout(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The group's current state (status and, once created, its bundle table).
    pub fn state(&self) -> Result<PlacementGroupState> {
        Ok(*runtime::current()?.ask(To::Head, ask::GetPlacementGroup { group: self.id })?)
    }

    /// The bundle table (bundle → node, GPU indices, GPU UUIDs), or `None` while pending.
    pub fn bundle_table(&self) -> Result<Option<BundleTable>> {
        Ok(self.state()?.table)
    }

    /// Removes the group: kills the actors and tasks placed in it (they are not restarted) and
    /// frees its bundles, which may let pending groups be created.
    pub fn remove(&self) -> Result<()> {
        runtime::current()?.ask(To::Head, ask::RemovePlacementGroup { group: self.id })
    }

    /// Placement into bundle `index` of this group, for [`crate::ActorOptions::placement`].
    pub fn bundle(&self, index: usize) -> BundleSchedule {
        BundleSchedule { group: self.id, bundle_index: Some(index), capture_child_tasks: false }
    }

    /// Placement into whichever bundle of this group has room.
    pub fn any_bundle(&self) -> BundleSchedule {
        BundleSchedule { group: self.id, bundle_index: None, capture_child_tasks: false }
    }
}

/// Creates a placement group and returns its handle at once; the group is created now when the
/// cluster has room, or later when resources free up (see [`PlacementGroup::ready`]). Fails at
/// once, reserving nothing, when the cluster could never hold it, naming the missing resource:
/// ``placement group `train` needs GPU: 16, cluster has 8``.
pub fn placement_group(options: PlacementGroupOptions) -> Result<PlacementGroup> {
    let state = runtime::current()?
        .ask(To::Head, ask::CreatePlacementGroup { options: Box::new(options) })?;
    Ok(handle_of(&state))
}

/// Removes a placement group (see [`PlacementGroup::remove`]).
pub fn remove_placement_group(group: &PlacementGroup) -> Result<()> {
    group.remove()
}

/// The live placement group with this name.
pub fn get_placement_group(name: &str) -> Result<PlacementGroup> {
    let request = ask::GetPlacementGroupByName { name: name.to_owned() };
    Ok(handle_of(&*runtime::current()?.ask(To::Head, request)?))
}

/// Every live placement group, oldest first (Ray's `placement_group_table()`).
pub fn list_placement_groups() -> Result<Vec<PlacementGroupState>> {
    runtime::current()?.list_placement_groups()
}

impl From<&PlacementGroupState> for PlacementGroup {
    /// A handle to this group.
    fn from(state: &PlacementGroupState) -> PlacementGroup {
        handle_of(state)
    }
}

impl Bundles for PlacementGroup {
    fn bundle_schedule(&self, index: usize) -> BundleSchedule {
        self.bundle(index)
    }
}

fn handle_of(state: &PlacementGroupState) -> PlacementGroup {
    PlacementGroup { id: state.id, name: state.name.clone(), bundle_count: state.bundles.len() }
}

fn table_of(state: PlacementGroupState) -> Result<BundleTable> {
    state.table.ok_or_else(|| {
        Error::Transport(format!("placement group `{}` reported ready without a table", state.name))
    })
}

/// The pending result of [`PlacementGroup::ready`]: a future, or a blocking
/// [`PlacementGroupReady::wait`].
#[derive(Debug)]
pub struct PlacementGroupReady {
    inner: Arc<ReadyInner>,
}

#[derive(Debug, Default)]
struct ReadyInner {
    result: Mutex<Option<Result<BundleTable>>>,
    done: Condvar,
    waker: Mutex<Option<Waker>>,
}

impl ReadyInner {
    fn complete(&self, result: Result<BundleTable>) {
        *self.result.lock() = Some(result);
        self.done.notify_all();
        if let Some(waker) = self.waker.lock().take() {
            waker.wake();
        }
    }
}

impl PlacementGroupReady {
    /// Blocks until the group is created (its bundle table) or removed (an error), or until
    /// `timeout` passes ([`Error::Timeout`]); `None` waits without limit.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<BundleTable> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut result = self.inner.result.lock();
        loop {
            if let Some(result) = result.as_ref() {
                return result.clone();
            }
            match deadline {
                None => self.inner.done.wait(&mut result),
                Some(deadline) => {
                    if self.inner.done.wait_until(&mut result, deadline).timed_out()
                        && result.is_none()
                    {
                        return Err(Error::Timeout(timeout.unwrap_or_default()));
                    }
                }
            }
        }
    }

    /// Whether the answer is in.
    pub fn is_ready(&self) -> bool {
        self.inner.result.lock().is_some()
    }
}

impl Future for PlacementGroupReady {
    type Output = Result<BundleTable>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // The waker is stored before the result is checked, so a completion racing with this
        // poll either is seen here or wakes the stored waker.
        *self.inner.waker.lock() = Some(cx.waker().clone());
        match self.inner.result.lock().as_ref() {
            Some(result) => Poll::Ready(result.clone()),
            None => Poll::Pending,
        }
    }
}
