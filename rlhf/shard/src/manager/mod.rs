//! The sharding manager (MindSpeed-RL's name): moves a colocated rank's training state between
//! the device and host memory as the rank switches between training, the inference engine's
//! generation and forward-only passes.
//!
//! - [`buffers`]: per-dtype contiguous buffers whose views the tensors are, moved as a few
//!   large copies and sliced into weight-sync buckets.
//! - [`plan`]: the pure state machine — where each tensor class lives in each [`Mode`] and
//!   the ordered [`Action`]s of every transition (the table is in its doc).
//! - [`ShardingManager`]: the executor that owns the flat buffers of the parameters, their
//!   gradients and AdamW's moments and runs the plans.
//!
//! Offloading is a real copy into a separate host buffer (pinned on a GPU) after which the
//! device buffer is dropped and the tensors point at the host copy; on a CPU device it is
//! still a separate allocation, so the whole path runs in CPU tests. A class whose tensors
//! were replaced (not written into) is noticed at its next offload or onload, which lays it
//! out again from the tensors as they are; [`ShardingManager::relayout`] does it at once.
//!
//! A stage-0 [`crate::ShardedModel`] owns one, built with the model: its buffers are the
//! parameters' only storage.

pub mod buffers;
pub mod plan;

use tch::{Device, Tensor};

use rtrun_rlhf_model::storage::clear_grad;
use rtrun_rlhf_model::train::AdamW;

pub use buffers::{Bucket, FlatBuffers, TensorMeta};
pub use plan::{Action, IdleGrads, ManagerState, Mode, Plan, Residency, TensorClass};

use crate::error::{Result, ShardError};

/// How a [`ShardingManager`] treats what it moves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ManagerConfig {
    /// What happens to the gradients outside `Train` (default: offloaded, values kept).
    pub idle_grads: IdleGrads,
}

/// Bytes of each tensor class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassBytes {
    /// The parameters.
    pub params: u64,
    /// Their gradients.
    pub grads: u64,
    /// AdamW's moments.
    pub optimizer: u64,
}

impl ClassBytes {
    /// The sum of the three.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }

    fn add(&mut self, class: TensorClass, bytes: u64) {
        match class {
            TensorClass::Params => self.params += bytes,
            TensorClass::Grads => self.grads += bytes,
            TensorClass::Optimizer => self.optimizer += bytes,
        }
    }
}

/// Bytes a manager holds, by residency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldByResidency {
    /// In device buffers.
    pub device: ClassBytes,
    /// In host buffers.
    pub host: ClassBytes,
}

/// What one transition did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransitionReport {
    /// The plan it ran.
    pub plan: Plan,
    /// Bytes copied from the device to host buffers.
    pub to_host: ClassBytes,
    /// Bytes copied from host buffers to the device.
    pub to_device: ClassBytes,
    /// Bytes dropped without a copy (freed gradients).
    pub freed: ClassBytes,
}

/// Owns the flat buffers of a rank's parameters, gradients and AdamW moments and moves them
/// as [`plan::plan`] says (module doc).
#[derive(Debug)]
pub struct ShardingManager {
    state: ManagerState,
    /// Shallow clones of the model's parameters, by name (whose `.grad` are the gradients).
    params: Vec<(String, Tensor)>,
    param_buffers: FlatBuffers,
    /// Laid out from the defined gradients; `None` until a backward made some, or once freed.
    grad_buffers: Option<FlatBuffers>,
    /// AdamW's moments; `None` on a rank without an optimizer.
    moment_buffers: Option<FlatBuffers>,
}

impl ShardingManager {
    /// Takes over `params` (a model's `named_parameters()`, all on one device): lays them out
    /// in one buffer per dtype on that device, their defined gradients too, and `optimizer`'s
    /// moments when the rank trains. The rank starts in [`Mode::Train`].
    pub fn new<'a>(
        params: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
        optimizer: Option<&AdamW>,
        config: ManagerConfig,
    ) -> Result<Self> {
        let params: Vec<(String, Tensor)> =
            params.into_iter().map(|(n, t)| (n.to_string(), t.shallow_clone())).collect();
        let (first_name, first) = params
            .first()
            .ok_or_else(|| ShardError::Config("the sharding manager got no parameters".into()))?;
        let device = first.device();
        if let Some((name, t)) = params.iter().find(|(_, t)| t.device() != device) {
            return Err(ShardError::Config(format!(
                "the sharding manager needs every parameter on one device: `{first_name}` is \
                 on {device:?}, `{name}` on {:?}",
                t.device()
            )));
        }
        let has_grads = params.iter().any(|(_, t)| t.requires_grad());
        let param_buffers = FlatBuffers::build(params.iter().map(clone_named), device)?;
        let grads = defined_grads(&params)?;
        let grad_buffers = match grads.is_empty() {
            true => None,
            false => Some(FlatBuffers::build(grads, device)?),
        };
        let moment_buffers = match optimizer {
            Some(optimizer) => Some(FlatBuffers::build(moments(optimizer), device)?),
            None => None,
        };
        let state = ManagerState::training(has_grads, optimizer.is_some(), config.idle_grads);
        Ok(Self { state, params, param_buffers, grad_buffers, moment_buffers })
    }

    /// Where everything is.
    pub fn state(&self) -> &ManagerState {
        &self.state
    }

    /// The mode the rank is in.
    pub fn mode(&self) -> Mode {
        self.state.mode
    }

    /// The device the buffers live on when resident.
    pub fn device(&self) -> Device {
        self.param_buffers.device()
    }

    /// The parameters' buffers (their [`FlatBuffers::bucket_slices`] are the weight sync's).
    pub fn params(&self) -> &FlatBuffers {
        &self.param_buffers
    }

    /// The gradients' buffers, once laid out.
    pub fn grads(&self) -> Option<&FlatBuffers> {
        self.grad_buffers.as_ref()
    }

    /// AdamW's moments' buffers, on a rank with an optimizer.
    pub fn moments(&self) -> Option<&FlatBuffers> {
        self.moment_buffers.as_ref()
    }

    /// Whether the parameters are still the views of [`ShardingManager::params`] it made
    /// (none replaced or repointed since), so its [`FlatBuffers::bucket_slices`] read them.
    pub fn params_laid_out(&self) -> bool {
        self.param_buffers.is_laid_out(&self.params)
    }

    /// Lays out again, where they are now, the classes whose tensors are no longer views of
    /// their buffers ([`AdamW::load`] replaces the moments), dropping the stale buffers so
    /// that they hold no memory beside the new tensors. Gradients not laid out yet are left
    /// to the next offload. Returns the bytes laid out again.
    pub fn relayout(&mut self, optimizer: Option<&AdamW>) -> Result<u64> {
        let mut bytes = 0;
        for class in TensorClass::ALL {
            let Some(buffers) = self.buffers(class) else { continue };
            let residency = buffers.residency();
            let current = self.current(class, optimizer)?;
            if buffers.is_laid_out(&current) {
                continue;
            }
            let rebuilt = match (class, current.is_empty(), residency) {
                (TensorClass::Grads, true, _) => None,
                (_, _, Residency::Host) => {
                    Some(FlatBuffers::build_offloaded(current, self.device())?)
                }
                _ => Some(FlatBuffers::build(current, self.device())?),
            };
            bytes += rebuilt.as_ref().map_or(0, FlatBuffers::bytes);
            self.replace(class, rebuilt);
        }
        Ok(bytes)
    }

    /// Bytes held now in device and in host buffers, by class.
    pub fn held(&self) -> HeldByResidency {
        let mut held = HeldByResidency::default();
        for class in TensorClass::ALL {
            if let Some(buffers) = self.buffers(class) {
                held.device.add(class, buffers.device_bytes());
                held.host.add(class, buffers.host_bytes());
            }
        }
        held
    }

    /// Moves to `target` (no weight sync: for a rank whose engine needs none, or tests).
    /// `optimizer` is the AdamW whose moments were given to [`ShardingManager::new`].
    pub fn transition(
        &mut self,
        target: Mode,
        optimizer: Option<&AdamW>,
    ) -> Result<TransitionReport> {
        self.transition_with_sync(target, optimizer, |_| Ok(()))
    }

    /// Moves to `target`, calling `sync` with the parameters' buffers (still resident) where
    /// the plan syncs the engine's weights. Every completed action is recorded, so after an
    /// error the next transition does only what is left.
    pub fn transition_with_sync(
        &mut self,
        target: Mode,
        optimizer: Option<&AdamW>,
        sync: impl FnOnce(&FlatBuffers) -> Result<()>,
    ) -> Result<TransitionReport> {
        let plan = plan::plan(&self.state, target)?;
        let mut report = TransitionReport {
            plan: plan.clone(),
            to_host: ClassBytes::default(),
            to_device: ClassBytes::default(),
            freed: ClassBytes::default(),
        };
        let mut sync = Some(sync);
        for &action in &plan.actions {
            match action {
                Action::Offload(class) => {
                    let bytes = self.offload(class, optimizer)?;
                    report.to_host.add(class, bytes);
                }
                Action::Onload(class) => {
                    let bytes = self.onload(class, optimizer)?;
                    report.to_device.add(class, bytes);
                }
                Action::Free(class) => report.freed.add(class, self.free(class)?),
                // Gradients come back at the next backward (tch cannot set `.grad`); they are
                // laid out again at the next offload.
                Action::Allocate(_) => {}
                Action::SyncWeights => {
                    if let Some(sync) = sync.take() {
                        sync(&self.param_buffers)?;
                    }
                }
            }
            action.apply_to(&mut self.state);
        }
        Plan::enter(&mut self.state, target);
        if self.device().is_cuda() && (report.to_host.total() + report.freed.total()) > 0 {
            // The dropped device buffers are in libtorch's cache until given back.
            rtrun_rlhf_model::cuda::empty_cache()?;
        }
        tracing::debug!(
            from = %plan.from,
            to = %plan.to,
            to_host = report.to_host.total(),
            to_device = report.to_device.total(),
            freed = report.freed.total(),
            "sharding manager transition"
        );
        Ok(report)
    }

    fn buffers(&self, class: TensorClass) -> Option<&FlatBuffers> {
        match class {
            TensorClass::Params => Some(&self.param_buffers),
            TensorClass::Grads => self.grad_buffers.as_ref(),
            TensorClass::Optimizer => self.moment_buffers.as_ref(),
        }
    }

    fn buffers_mut(&mut self, class: TensorClass) -> Option<&mut FlatBuffers> {
        match class {
            TensorClass::Params => Some(&mut self.param_buffers),
            TensorClass::Grads => self.grad_buffers.as_mut(),
            TensorClass::Optimizer => self.moment_buffers.as_mut(),
        }
    }

    /// The class's tensors as they are now (gradients: the defined ones).
    fn current(
        &self,
        class: TensorClass,
        optimizer: Option<&AdamW>,
    ) -> Result<Vec<(String, Tensor)>> {
        match class {
            TensorClass::Params => Ok(self.params.iter().map(clone_named).collect()),
            TensorClass::Grads => defined_grads(&self.params),
            TensorClass::Optimizer => match optimizer {
                Some(optimizer) => Ok(moments(optimizer).collect()),
                None => Err(ShardError::Config(
                    "the sharding manager moves this rank's optimizer state: pass its AdamW to \
                     the transition"
                        .into(),
                )),
            },
        }
    }

    /// Offloads `class`: its buffers as they are, or, when its tensors are no longer views
    /// of them (replaced, or gradients made by a backward since), laid out again straight
    /// into host buffers.
    fn offload(&mut self, class: TensorClass, optimizer: Option<&AdamW>) -> Result<u64> {
        let current = self.current(class, optimizer)?;
        let device = self.device();
        let laid_out = self.buffers(class).is_some_and(|b| b.is_laid_out(&current));
        if laid_out {
            return match self.buffers_mut(class) {
                Some(buffers) => buffers.offload(),
                None => Ok(0),
            };
        }
        let rebuilt = match (class, current.is_empty()) {
            (TensorClass::Grads, true) => None,
            _ => Some(FlatBuffers::build_offloaded(current, device)?),
        };
        let bytes = rebuilt.as_ref().map_or(0, FlatBuffers::bytes);
        self.replace(class, rebuilt);
        Ok(bytes)
    }

    /// Onloads `class`: its buffers as they are, or, when its tensors are no longer views of
    /// them (replaced while offloaded, as [`AdamW::load`] replaces the moments), laid out
    /// again from the tensors straight into device buffers (the stale host buffers dropped).
    fn onload(&mut self, class: TensorClass, optimizer: Option<&AdamW>) -> Result<u64> {
        if self.buffers(class).is_none() {
            return Ok(0);
        }
        let current = self.current(class, optimizer)?;
        let laid_out = self.buffers(class).is_some_and(|b| b.is_laid_out(&current));
        if laid_out {
            return match self.buffers_mut(class) {
                Some(buffers) => buffers.onload(),
                None => Ok(0),
            };
        }
        let rebuilt = match (class, current.is_empty()) {
            (TensorClass::Grads, true) => None,
            _ => Some(FlatBuffers::build(current, self.device())?),
        };
        let bytes = rebuilt.as_ref().map_or(0, FlatBuffers::bytes);
        self.replace(class, rebuilt);
        Ok(bytes)
    }

    fn replace(&mut self, class: TensorClass, rebuilt: Option<FlatBuffers>) {
        match class {
            TensorClass::Params => {
                if let Some(rebuilt) = rebuilt {
                    self.param_buffers = rebuilt;
                }
            }
            TensorClass::Grads => self.grad_buffers = rebuilt,
            TensorClass::Optimizer => self.moment_buffers = rebuilt,
        }
    }

    /// Drops `class`'s tensors without a copy (gradients only: `.grad` is cleared).
    fn free(&mut self, class: TensorClass) -> Result<u64> {
        if class != TensorClass::Grads {
            return Err(ShardError::Config(format!("the {class} cannot be freed, only offloaded")));
        }
        let bytes = defined_grads(&self.params)?
            .iter()
            .map(|(_, g)| g.numel() as u64 * g.kind().elt_size_in_bytes() as u64)
            .sum();
        for (_, param) in &self.params {
            clear_grad(param)?;
        }
        self.grad_buffers = None;
        Ok(bytes)
    }
}

fn clone_named((name, tensor): &(String, Tensor)) -> (String, Tensor) {
    (name.clone(), tensor.shallow_clone())
}

/// `(name, .grad)` of every parameter whose gradient is defined.
fn defined_grads(params: &[(String, Tensor)]) -> Result<Vec<(String, Tensor)>> {
    let mut grads = Vec::new();
    for (name, param) in params {
        let grad = param.f_grad()?;
        if grad.defined() {
            grads.push((name.clone(), grad));
        }
    }
    Ok(grads)
}

/// AdamW's moments as `exp_avg.<name>` and `exp_avg_sq.<name>` (shallow clones).
fn moments(optimizer: &AdamW) -> impl Iterator<Item = (String, Tensor)> + '_ {
    optimizer.moments().flat_map(|(name, avg, avg_sq)| {
        [
            (format!("exp_avg.{name}"), avg.shallow_clone()),
            (format!("exp_avg_sq.{name}"), avg_sq.shallow_clone()),
        ]
    })
}
