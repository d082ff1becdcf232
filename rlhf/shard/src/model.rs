//! [`ShardedModel`]: one rank's sharded view of one model.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use rtrun::collective::ReduceOp;
use rtrun_rlhf_model::Backbone;
use rtrun_rlhf_model::layerwise::{Layerwise, Segment, SegmentHooks};
use rtrun_rlhf_model::storage::clear_grad;
use rtrun_rlhf_model::train::{AdamW, OptimizerConfig, StepStats};

use crate::ZeroStage;
use crate::comm::GroupComm;
use crate::error::{Result, ShardError};
use crate::manager::{
    Bucket, FlatBuffers, HeldByResidency, ManagerConfig, Mode, ShardingManager, TransitionReport,
};
use crate::optim::ShardOptimizer;
use crate::state::{HeldBytes, SharedState, ZeroState};

/// How a role's ranks share their model (`train.zero_stage`, `train.gradient_checkpointing`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShardConfig {
    /// What each rank shards.
    pub stage: ZeroStage,
    /// Recompute each decoder layer in the backward pass instead of keeping its activations.
    pub gradient_checkpointing: bool,
}

/// The optimizer of a trained model.
enum Optimizer {
    /// Stage 0: AdamW over the whole model after the gradient all-reduce.
    Whole(AdamW),
    /// Stages 1-3: AdamW over the rank's shards.
    Sharded(ShardOptimizer),
}

/// One rank's part of a model trained (or evaluated) data-parallel at a [`ZeroStage`].
///
/// Built over a model's parameters, it lays them out in flat units (each parameter becomes a
/// view into its unit's buffer) and, where the stage or activation checkpointing needs it,
/// installs layer-by-layer execution on the model's [`Backbone`] with hooks that gather,
/// release and reduce each unit. The model is then used as before, except that the loss is
/// backpropagated with the model's `backward` (not `loss.backward()`) and the step is
/// [`ShardedModel::step`].
///
/// At stage 0 a [`ShardingManager`] built with the model lays the parameters out instead (one
/// buffer per dtype; AdamW's moments too, the gradients at the first offload), so that a
/// colocated rank moves its training state to host memory and back with
/// [`ShardedModel::transition`] and the weight sync reads whole slices of the buffers
/// ([`ShardedModel::param_buckets`]).
pub struct ShardedModel {
    shared: SharedState,
    optimizer: Option<Optimizer>,
    /// Stage 0: owns the buffers the parameters, their gradients and AdamW's moments are
    /// views of. Built with the model rather than at the first offload, so the parameters are
    /// laid out once, never in two places, and every weight sync reads the same buffers.
    manager: Option<ShardingManager>,
    config: ShardConfig,
}

impl std::fmt::Debug for ShardedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedModel").field("config", &self.config).finish()
    }
}

impl ShardedModel {
    /// Shards the model whose trunk is `backbone` and whose parameters are `named` (in
    /// registration order; `tied`: its head reads the embedding matrix) over `comm`'s group.
    /// With `optimizer` the model trains; without, it is frozen (reference, reward model).
    ///
    /// Every rank must hold the same weights when this is called (they all loaded the same
    /// checkpoint): each keeps its own shard without talking to the others.
    pub fn new(
        backbone: &Backbone,
        named: &[(String, Tensor)],
        tied: bool,
        config: ShardConfig,
        comm: GroupComm,
        optimizer: Option<OptimizerConfig>,
    ) -> Result<Self> {
        let trains = optimizer.is_some();
        let mut state = ZeroState::new(named, tied, config.stage, trains, comm)?;
        state.start_prefetch()?;
        let optimizer = match optimizer {
            None => None,
            Some(o) if config.stage == ZeroStage::Zero => {
                // Frozen parameters (LoRA's base) have no gradient and no moments.
                let trained = || named.iter().filter(|(_, t)| t.requires_grad());
                let adamw = AdamW::new(trained().map(|(n, t)| (n.as_str(), t)), o)?;
                let numel: u64 = trained().map(|(_, t)| t.numel() as u64).sum();
                state.optimizer_bytes = 2 * 4 * numel;
                Some(Optimizer::Whole(adamw))
            }
            Some(o) => Some(Optimizer::Sharded(ShardOptimizer::new(&mut state, o)?)),
        };
        let manager = match config.stage {
            ZeroStage::Zero => {
                let adamw = match &optimizer {
                    Some(Optimizer::Whole(adamw)) => Some(adamw),
                    _ => None,
                };
                let params = named.iter().map(|(n, t)| (n.as_str(), t));
                Some(ShardingManager::new(params, adamw, ManagerConfig::default())?)
            }
            _ => None,
        };
        let shared = SharedState(Arc::new(Mutex::new(state)));
        let checkpoint = config.gradient_checkpointing && trains;
        let layerwise = checkpoint
            || config.stage == ZeroStage::Three
            || (trains && config.stage == ZeroStage::Two);
        if layerwise {
            backbone
                .set_layerwise(Some(Layerwise::new(checkpoint, Some(Box::new(shared.clone())))));
        }
        Ok(Self { shared, optimizer, manager, config })
    }

    /// [`ShardedModel::new`] for a causal LM (its parameters and its LoRA adapters', if any,
    /// and tied when it has no separate LM head). With adapters the base weights are frozen:
    /// they are sharded and gathered as usual but have no gradients, optimizer state or
    /// reductions.
    pub fn for_causal_lm(
        model: &rtrun_rlhf_model::CausalLm,
        config: ShardConfig,
        comm: GroupComm,
        optimizer: Option<OptimizerConfig>,
    ) -> Result<Self> {
        let adapters = model.lora_parameters().map(|p| p.named()).into_iter().flatten();
        let named: Vec<(String, Tensor)> = model
            .named_parameters()
            .chain(adapters)
            .map(|(n, t)| (n.to_string(), t.shallow_clone()))
            .collect();
        Self::new(&model.backbone, &named, model.lm_head.is_none(), config, comm, optimizer)
    }

    /// The settings.
    pub fn config(&self) -> ShardConfig {
        self.config
    }

    /// This rank and the group's size.
    pub fn rank_and_world(&self) -> (usize, usize) {
        let state = self.shared.lock();
        (state.comm.rank(), state.comm.world_size())
    }

    /// Whether ranks must run the same number of passes because each issues collectives:
    /// every pass at stage 3, training passes (forward and backward) of a trained model at
    /// stage 2.
    pub fn needs_balanced_passes(&self, training: bool) -> bool {
        let state = self.shared.lock();
        state.comm.world_size() > 1
            && (state.stage == ZeroStage::Three || (training && state.reduces_per_segment()))
    }

    /// The most passes any rank runs, given this rank's `mine` (every rank calls it with its
    /// own count, for `training` passes — forward and backward — or forward-only ones).
    /// Without per-pass collectives it is `mine` and nothing is exchanged.
    pub fn balance(&self, mine: usize, training: bool) -> Result<usize> {
        if !self.needs_balanced_passes(training) {
            return Ok(mine);
        }
        let state = self.shared.lock();
        let mut most = [mine as f64];
        state.comm.run(
            || "agreeing on the number of passes".into(),
            |c| c.all_reduce_f64(&mut most, ReduceOp::Max),
        )?;
        Ok(most[0] as usize)
    }

    /// The model's decoder layers (what an idle pass walks through).
    fn layers(&self) -> usize {
        self.shared.lock().plan.layers()
    }

    /// Takes part in the collectives of a forward pass without gradients that this rank has
    /// no data for (after [`ShardedModel::balance`]).
    pub fn idle_forward(&self) -> Result<()> {
        let mut hooks = self.shared.clone();
        forward_sequence(&mut hooks, self.layers())?;
        hooks.release(Segment::Head)?;
        Ok(())
    }

    /// Takes part in the collectives of a forward pass with gradients that this rank has no
    /// data for; [`ShardedModel::idle_backward`] follows it where the real pass's backward
    /// would.
    pub fn idle_training_forward(&self) -> Result<()> {
        Ok(forward_sequence(&mut self.shared.clone(), self.layers())?)
    }

    /// Takes part in the collectives of the backward pass of an idle training forward: this
    /// rank's gradient contribution is zero.
    pub fn idle_backward(&self) -> Result<()> {
        let mut hooks = self.shared.clone();
        hooks.reduce(Segment::Head)?;
        for index in (0..self.layers()).rev() {
            hooks.gather(Segment::Layer(index))?;
            hooks.release(Segment::Layer(index))?;
            hooks.reduce(Segment::Layer(index))?;
        }
        hooks.reduce(Segment::Embedding)?;
        hooks.release(Segment::Head)?;
        Ok(())
    }

    /// [`ShardedModel::idle_training_forward`] and then [`ShardedModel::idle_backward`].
    pub fn idle_training_pass(&self) -> Result<()> {
        self.idle_training_forward()?;
        self.idle_backward()
    }

    /// Makes every unit whole on this rank (stage 3: gathers them all; every rank must call
    /// it), for an export or a weight sync that reads the whole model.
    pub fn gather_all(&self) -> Result<()> {
        let mut state = self.shared.lock();
        for index in 0..state.units.len() {
            state.gather_unit(index)?;
        }
        Ok(())
    }

    /// Frees what [`ShardedModel::gather_all`] gathered (stage 3).
    pub fn release_all(&self) -> Result<()> {
        let mut state = self.shared.lock();
        state.release_all_units()?;
        Ok(())
    }

    /// Lets `write` overwrite the whole model in place (every rank loading the same
    /// checkpoint from disk), then keeps this rank's shards of what it wrote. At stage 3 the
    /// units are given memory for it without a gather and freed after; nothing is exchanged.
    pub fn overwrite_whole(
        &self,
        write: impl FnOnce() -> rtrun_rlhf_model::Result<()>,
    ) -> Result<()> {
        let mut state = self.shared.lock();
        let three = state.stage == ZeroStage::Three;
        let element = state.kind.elt_size_in_bytes();
        if three {
            for unit in &mut state.units {
                if !unit.gathered {
                    rtrun_rlhf_model::storage::allocate_storage(
                        &unit.full,
                        unit.plan.padded * element,
                    )?;
                    let _ = tch::no_grad(|| unit.full.shallow_clone().f_zero_())?;
                    unit.gathered = true;
                }
            }
        }
        write()?;
        if three {
            let (rank, world) = (state.comm.rank(), state.comm.world_size());
            for unit in &state.units {
                let own = unit.plan.shard_range(world, rank);
                let slice = unit.full.f_narrow(0, own.start as i64, own.len() as i64)?;
                tch::no_grad(|| unit.shard.shallow_clone().f_copy_(&slice))?;
            }
            state.release_all_units()?;
        }
        Ok(())
    }

    /// Clears the gradients (whole ones and shards).
    pub fn zero_grad(&mut self) -> Result<()> {
        match &mut self.optimizer {
            Some(Optimizer::Whole(adamw)) => adamw.zero_grad(),
            Some(Optimizer::Sharded(_)) => {
                let state = self.shared.lock();
                for unit in &state.units {
                    for param in &unit.params {
                        clear_grad(param)?;
                    }
                    if let Some(g) = &unit.grad_shard {
                        let _ = tch::no_grad(|| g.shallow_clone().f_zero_())?;
                    }
                }
            }
            None => {}
        }
        Ok(())
    }

    /// Finishes the gradients of the passes since the last step (stage 0: all-reduce; stage 1:
    /// reduce-scatter into the shards; 2-3: already done) and takes one AdamW step.
    pub fn step(&mut self) -> Result<StepStats> {
        let mut state = self.shared.lock();
        match &mut self.optimizer {
            None => Err(ShardError::Config("this model is frozen (no optimizer)".into())),
            Some(Optimizer::Whole(adamw)) => {
                state.measure();
                if state.comm.world_size() > 1 {
                    let params: Vec<Tensor> = state
                        .units
                        .iter()
                        .flat_map(|u| u.params.iter().map(Tensor::shallow_clone))
                        .filter(Tensor::requires_grad)
                        .collect();
                    let started = std::time::Instant::now();
                    state.comm.with(|c| {
                        rtrun_rlhf_algo::all_reduce_gradients(c, &params, &Default::default())
                            .map_err(ShardError::from)
                    })?;
                    state.comm_seconds += started.elapsed().as_secs_f64();
                }
                Ok(adamw.step()?)
            }
            Some(Optimizer::Sharded(optimizer)) => {
                if state.stage == ZeroStage::One {
                    for index in 0..state.units.len() {
                        state.reduce_unit(index)?;
                    }
                }
                optimizer.step(&mut state)
            }
        }
    }

    /// Optimizer steps taken.
    pub fn steps_taken(&self) -> u64 {
        match &self.optimizer {
            Some(Optimizer::Whole(adamw)) => adamw.steps_taken(),
            Some(Optimizer::Sharded(o)) => o.step,
            None => 0,
        }
    }

    /// The stage-0 optimizer (its checkpoints keep today's format), if that is what trains.
    pub fn whole_optimizer(&mut self) -> Option<&mut AdamW> {
        match &mut self.optimizer {
            Some(Optimizer::Whole(adamw)) => Some(adamw),
            _ => None,
        }
    }

    /// The stage-0 sharding manager (`None` at stages 1-3).
    pub fn manager(&self) -> Option<&ShardingManager> {
        self.manager.as_ref()
    }

    /// The mode the stage-0 training state is in (`None` at stages 1-3).
    pub fn mode(&self) -> Option<Mode> {
        self.manager.as_ref().map(ShardingManager::mode)
    }

    /// Moves the training state for `target` (stage 0 only): [`Mode::Infer`] offloads the
    /// parameters, gradients and AdamW's moments into separate host buffers and drops the
    /// device ones, [`Mode::Train`] brings them back (see [`crate::manager`]).
    pub fn transition(&mut self, target: Mode) -> Result<TransitionReport> {
        self.transition_with_sync(target, |_| Ok(()))
    }

    /// [`ShardedModel::transition`], calling `sync` with the parameters' buffers (still
    /// resident) where the plan syncs the engines' weights (leaving `Train` for `Infer`).
    pub fn transition_with_sync(
        &mut self,
        target: Mode,
        sync: impl FnOnce(&FlatBuffers) -> Result<()>,
    ) -> Result<TransitionReport> {
        let stage = self.config.stage;
        let adamw = match &self.optimizer {
            Some(Optimizer::Whole(adamw)) => Some(adamw),
            _ => None,
        };
        let manager = self.manager.as_mut().ok_or_else(|| {
            ShardError::Config(format!(
                "moving the training state between the device and host memory needs \
                 zero_stage 0, found {stage}"
            ))
        })?;
        let report = manager.transition_with_sync(target, adamw, sync)?;
        self.shared.lock().measure();
        Ok(report)
    }

    /// Lays the stage-0 training state out again after something replaced tensors instead
    /// of writing into them ([`AdamW::load`] through [`ShardedModel::whole_optimizer`]), so
    /// the stale buffers are dropped; nothing at stages 1-3. Returns the bytes laid out.
    pub fn relayout(&mut self) -> Result<u64> {
        let adamw = match &self.optimizer {
            Some(Optimizer::Whole(adamw)) => Some(adamw),
            _ => None,
        };
        match &mut self.manager {
            Some(manager) => manager.relayout(adamw),
            None => Ok(0),
        }
    }

    /// The parameters as slices of the stage-0 manager's buffers of at most `max_bytes` each
    /// (cut at parameter boundaries, in `named_parameters` order within each dtype): what a
    /// weight sync reads with one copy per bucket. `None` at stages 1-3, or when a parameter
    /// is no longer a view of the buffers.
    pub fn param_buckets(&self, max_bytes: u64) -> Result<Option<Vec<Bucket>>> {
        match &self.manager {
            Some(manager) if manager.params_laid_out() => {
                Ok(Some(manager.params().bucket_slices(max_bytes)?))
            }
            _ => Ok(None),
        }
    }

    /// Bytes of the stage-0 training state in device and in host buffers (`None` at stages
    /// 1-3).
    pub fn held_by_residency(&self) -> Option<HeldByResidency> {
        self.manager.as_ref().map(ShardingManager::held)
    }

    /// Tensor bytes of parameters, gradients and optimizer state held now.
    pub fn held_bytes(&self) -> HeldBytes {
        self.shared.lock().held()
    }

    /// The most bytes held at a measured point (every gather, every reduction, every step)
    /// since construction or [`ShardedModel::reset_peak`].
    pub fn peak_bytes(&self) -> HeldBytes {
        let mut state = self.shared.lock();
        state.measure();
        state.peak
    }

    /// Starts a new peak from now.
    pub fn reset_peak(&self) {
        let mut state = self.shared.lock();
        state.peak = HeldBytes::default();
        state.measure();
    }

    /// Held bytes (now and peak) and collective totals; `reset_peak` starts a new peak after.
    pub fn stats(&self, reset_peak: bool) -> crate::ShardStats {
        let (collective_seconds, collective_bytes) = self.collective_totals();
        let stats = crate::ShardStats {
            now: self.held_bytes(),
            peak: self.peak_bytes(),
            collective_seconds,
            collective_bytes,
            prefetched_gathers: self.shared.lock().prefetched_gathers,
            offloaded: self.held_by_residency().map_or_else(HeldBytes::default, |held| HeldBytes {
                parameters: held.host.params,
                gradients: held.host.grads,
                optimizer: held.host.optimizer,
            }),
        };
        if reset_peak {
            self.reset_peak();
        }
        stats
    }

    /// Seconds spent in this model's collectives and their bytes, since construction.
    pub fn collective_totals(&self) -> (f64, u64) {
        let state = self.shared.lock();
        (state.comm_seconds, state.comm_bytes)
    }

    pub(crate) fn shared(&self) -> &SharedState {
        &self.shared
    }

    pub(crate) fn sharded_optimizer(&mut self) -> Option<&mut ShardOptimizer> {
        match &mut self.optimizer {
            Some(Optimizer::Sharded(o)) => Some(o),
            _ => None,
        }
    }
}

/// The hook calls of a forward pass through `layers` layers, as [`Layerwise`] makes them.
fn forward_sequence(hooks: &mut SharedState, layers: usize) -> rtrun_rlhf_model::Result<()> {
    hooks.gather(Segment::Embedding)?;
    hooks.release(Segment::Embedding)?;
    for index in 0..layers {
        hooks.gather(Segment::Layer(index))?;
        hooks.release(Segment::Layer(index))?;
    }
    hooks.gather(Segment::Head)
}
