//! AdamW on a rank's shards (stages 1-3): the global gradient norm from every rank's shard,
//! then the same element-wise update as [`rtrun_rlhf_model::train::AdamW`] on each unit's
//! shard (weight decay on the slices of matrices), then, below stage 3, the updated shards
//! gathered back into every rank's whole parameters.

use tch::{Kind, Tensor};

use rtrun::collective::ReduceOp;
use rtrun_rlhf_model::train::{AdamWUpdate, OptimizerConfig, StepStats, clip_coefficient};

use crate::ZeroStage;
use crate::error::{Result, ShardError};
use crate::state::ZeroState;

/// AdamW over one model's shards.
pub(crate) struct ShardOptimizer {
    pub(crate) config: OptimizerConfig,
    /// Per unit: the two float32 moments of this rank's shard.
    pub(crate) moments: Vec<(Tensor, Tensor)>,
    pub(crate) step: u64,
}

impl ShardOptimizer {
    /// Zero moments for every trained unit's shard (a frozen unit's are empty).
    pub(crate) fn new(state: &mut ZeroState, config: OptimizerConfig) -> Result<Self> {
        let world = state.comm.world_size();
        let mut moments = Vec::with_capacity(state.units.len());
        let mut bytes = 0u64;
        for unit in &state.units {
            let len = if unit.plan.trains { unit.plan.shard_len(world) as i64 } else { 0 };
            let zeros = || Tensor::f_zeros([len], (Kind::Float, state.device));
            moments.push((zeros()?, zeros()?));
            bytes += 2 * 4 * len as u64;
        }
        state.optimizer_bytes = bytes;
        Ok(Self { config, moments, step: 0 })
    }

    /// The learning rate the next step uses.
    pub(crate) fn current_lr(&self) -> f64 {
        self.config.schedule.lr_at(self.step)
    }

    /// Clips by the global norm and updates every shard; gradients shards are zeroed after.
    pub(crate) fn step(&mut self, state: &mut ZeroState) -> Result<StepStats> {
        state.measure();
        let mut sum_sq = [0f64];
        for unit in &state.units {
            if let Some(g) = &unit.grad_shard {
                let norm = g.f_norm()?.f_double_value(&[])?;
                sum_sq[0] += norm * norm;
            }
        }
        if state.comm.world_size() > 1 {
            state.comm.run(
                || "the global gradient norm".into(),
                |c| c.all_reduce_f64(&mut sum_sq, ReduceOp::Sum),
            )?;
        }
        let grad_norm = sum_sq[0].sqrt();
        if !grad_norm.is_finite() {
            return Err(ShardError::Config(format!(
                "gradient norm should be finite, found {grad_norm}"
            )));
        }
        let clip = clip_coefficient(self.config.max_grad_norm, grad_norm);
        let lr = self.current_lr();
        let update = AdamWUpdate::new(&self.config, self.step + 1, lr, clip);
        let (rank, world) = (state.comm.rank(), state.comm.world_size());
        let decay = self.config.weight_decay > 0.0;
        tch::no_grad(|| -> Result<()> {
            for (unit, (exp_avg, exp_avg_sq)) in state.units.iter().zip(self.moments.iter_mut()) {
                let Some(grad) = &unit.grad_shard else { continue };
                let own = unit.plan.shard_range(world, rank);
                let value = unit.shard.f_to_kind(Kind::Float)?;
                if decay {
                    for member in unit.plan.members.iter().filter(|m| m.decays()) {
                        let (lo, hi) = (
                            member.offset.max(own.start),
                            (member.offset + member.numel).min(own.end),
                        );
                        if lo < hi {
                            let slice =
                                value.f_narrow(0, (lo - own.start) as i64, (hi - lo) as i64)?;
                            let decayed = update.decayed(&slice)?;
                            slice.shallow_clone().f_copy_(&decayed)?;
                        }
                    }
                }
                let value = update.apply(value, grad, exp_avg, exp_avg_sq)?;
                unit.shard.shallow_clone().f_copy_(&value)?;
                let _ = grad.shallow_clone().f_zero_()?;
            }
            Ok(())
        })?;
        if state.stage == ZeroStage::One {
            // Rebuilt from the whole gradients at the next step.
            for unit in &mut state.units {
                unit.grad_shard = None;
            }
        }
        if state.stage == ZeroStage::Three {
            // Whatever is still gathered holds the old values.
            state.release_all_units()?;
        } else {
            for index in 0..state.units.len() {
                state.refresh_full(index)?;
            }
        }
        self.step += 1;
        Ok(StepStats { step: self.step, lr, grad_norm })
    }
}
