//! Supervised and preference steps of a policy rank on packed rows (`train --mode sft|dpo`).
//!
//! SFT: the token-level negative log-likelihood of the response tokens, summed per rank and
//! divided by the global batch's response tokens. DPO: the per-pair loss of the summed response
//! log-probs against a frozen reference held by the same rank (as OpenRLHF keeps it), summed
//! per rank and divided by the global batch's pairs. Either way the all-reduced (mean) gradient
//! is that of the mean over the whole batch whatever the ranks' shares; then one AdamW step.

use serde::{Deserialize, Serialize};
use tch::Tensor;

use rtrun_rlhf_model::CausalLm;
use rtrun_rlhf_model::logprobs::token_log_probs;

use super::{BaseOnly, LmWorkerState};
use crate::roles::Phase;
use crate::stage::losses::{PairStats, PreferenceLoss, pair_sums, preference_losses};
use crate::stage::pack::{PackedRow, RowTensors, row_tensors};

/// What one supervised step did on this rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SupervisedStats {
    /// Summed negative log-likelihood of this rank's response tokens.
    pub nll_sum: f64,
    /// This rank's response tokens.
    pub tokens: usize,
    /// Gradient norm before clipping (after the all-reduce).
    pub grad_norm: f64,
    /// Learning rate of the step.
    pub lr: f64,
}

/// Log-probs `[N]` of every response token of `t` under `model`, in prediction order; only the
/// predicting positions are projected to the vocabulary.
fn response_log_probs(model: &CausalLm, t: &RowTensors) -> crate::Result<Tensor> {
    let picked = t.at_predictions(&t.hidden(&model.backbone)?)?;
    Ok(token_log_probs(&model.lm_logits(&picked)?, &t.predict_targets)?)
}

/// The summed NLL of the response tokens of `rows` (a scalar with the graph when gradients are
/// on) and how many there are.
fn rows_nll(model: &CausalLm, rows: &[PackedRow]) -> crate::Result<(Tensor, usize)> {
    let t = row_tensors(rows, model.params.device())?;
    let log_probs = response_log_probs(model, &t)?;
    Ok((log_probs.f_sum(tch::Kind::Float)?.f_neg()?, t.loss_tokens))
}

/// DPO on the pairs of `rows` (chosen, rejected consecutive): per-pair losses (with the graph)
/// and the micro-batch's sums.
fn dpo_pairs(
    model: &CausalLm,
    reference: Option<&CausalLm>,
    rows: &[PackedRow],
    loss: PreferenceLoss,
) -> crate::Result<(Tensor, PairStats)> {
    let t = row_tensors(rows, model.params.device())?;
    // The reference first: with LoRA (`reference` None) it is this model with its adapters
    // off, whose head must be released before the policy's forward, which the backward reads.
    let frozen = {
        let (reference, _base) = match reference {
            Some(reference) => (reference, None),
            None => (model, Some(BaseOnly::new(model))),
        };
        let frozen = tch::no_grad(|| t.sum_per_sample(&response_log_probs(reference, &t)?))?;
        // A sharded reference gathered its head for that forward; nothing reads it after.
        reference.backbone.release_parameters()?;
        frozen
    };
    let policy = t.sum_per_sample(&response_log_probs(model, &t)?)?;
    let mut ratio = policy.f_sub(&frozen)?;
    if let PreferenceLoss::Dpo { ipo: true, .. } = loss {
        // IPO compares mean log-probs per response token (OpenRLHF's `average_log_prob`).
        let ones = Tensor::f_ones([t.loss_tokens as i64], (tch::Kind::Float, ratio.device()))?;
        ratio = ratio.f_div(&t.sum_per_sample(&ones)?.f_clamp_min(1.0)?)?;
    }
    let pairs = ratio.f_view([-1, 2])?;
    let (chosen, rejected) = (pairs.f_select(1, 0)?, pairs.f_select(1, 1)?);
    let (losses, chosen_rewards, rejected_rewards) = preference_losses(&chosen, &rejected, loss)?;
    let mut sums = pair_sums(&losses.f_detach()?, &chosen_rewards, &rejected_rewards)?;
    sums.tokens = rows.iter().map(PackedRow::len).sum();
    Ok((losses, sums))
}

impl LmWorkerState {
    /// One optimizer step over this rank's micro-batches of a global batch holding
    /// `global_tokens` response tokens.
    pub(super) fn supervised_step(
        &mut self,
        batches: &[Vec<PackedRow>],
        global_tokens: usize,
    ) -> crate::Result<SupervisedStats> {
        self.setup.enter(Phase::Train);
        let role = self.setup.role.clone();
        let dp_size = rtrun::context()?.group.map(|g| g.world_size).unwrap_or(1);
        self.require_optimizer()?;
        self.sharded.zero_grad()?;
        let passes = self.sharded.balance(batches.len(), true)?;
        // The gradients are averaged over ranks, so each rank's sum is scaled by dp_size.
        let scale = dp_size as f64 / global_tokens.max(1) as f64;
        let mut stats = SupervisedStats::default();
        for rows in batches {
            let (nll, tokens) = rows_nll(&self.model, rows)?;
            stats.nll_sum += nll.f_double_value(&[])?;
            stats.tokens += tokens;
            self.model.backward(&nll.f_mul_scalar(scale)?)?;
        }
        for _ in batches.len()..passes {
            self.sharded.idle_training_pass()?;
        }
        let step =
            self.sharded.step().map_err(|e| crate::TrainError::role(&role, e.to_string()))?;
        stats.grad_norm = step.grad_norm;
        stats.lr = step.lr;
        Ok(stats)
    }

    /// The summed NLL and the count of the response tokens of `batches` (no gradients).
    pub(super) fn supervised_eval(
        &self,
        batches: &[Vec<PackedRow>],
    ) -> crate::Result<(f64, usize)> {
        self.setup.enter(Phase::Experience);
        let passes = self.sharded.balance(batches.len(), false)?;
        let out = tch::no_grad(|| -> crate::Result<(f64, usize)> {
            let mut out = (0.0, 0);
            for rows in batches {
                let (nll, tokens) = rows_nll(&self.model, rows)?;
                self.model.backbone.release_parameters()?;
                out.0 += nll.f_double_value(&[])?;
                out.1 += tokens;
            }
            Ok(out)
        })?;
        for _ in batches.len()..passes {
            self.sharded.idle_forward()?;
        }
        Ok(out)
    }

    /// The reference: a frozen copy (`Some`), or with LoRA the model with its adapters off
    /// (`None`).
    fn reference(&self) -> crate::Result<Option<&CausalLm>> {
        match (&self.reference, self.lora) {
            (Some((model, _)), _) => Ok(Some(model)),
            (None, true) => Ok(None),
            (None, false) => {
                Err(crate::TrainError::role(&self.setup.role, "this rank holds no reference model"))
            }
        }
    }

    /// The collectives of one reference forward this rank has no data for.
    fn idle_reference_forward(&self) -> crate::Result<()> {
        match &self.reference {
            Some((_, frozen)) => frozen.idle_forward()?,
            None => self.sharded.idle_forward()?,
        }
        Ok(())
    }

    fn require_optimizer(&self) -> crate::Result<()> {
        if self.trains {
            Ok(())
        } else {
            Err(crate::TrainError::role(&self.setup.role, "this rank is frozen (no optimizer)"))
        }
    }

    /// One DPO optimizer step over this rank's micro-batches of a global batch of
    /// `global_pairs` pairs.
    pub(super) fn preference_step(
        &mut self,
        batches: &[Vec<PackedRow>],
        global_pairs: usize,
        loss: PreferenceLoss,
    ) -> crate::Result<PairStats> {
        self.setup.enter(Phase::Train);
        let role = self.setup.role.clone();
        let dp_size = rtrun::context()?.group.map(|g| g.world_size).unwrap_or(1);
        self.require_optimizer()?;
        self.reference()?;
        self.sharded.zero_grad()?;
        let passes = self.sharded.balance(batches.len(), true)?;
        let scale = dp_size as f64 / global_pairs.max(1) as f64;
        let mut stats = PairStats::default();
        for rows in batches {
            let (losses, sums) = dpo_pairs(&self.model, self.reference()?, rows, loss)?;
            stats = stats.plus(&sums);
            self.model.backward(&losses.f_sum(tch::Kind::Float)?.f_mul_scalar(scale)?)?;
        }
        for _ in batches.len()..passes {
            // The collectives of `dpo_pairs` and the backward, in their order.
            self.idle_reference_forward()?;
            self.sharded.idle_training_forward()?;
            self.sharded.idle_backward()?;
        }
        let step =
            self.sharded.step().map_err(|e| crate::TrainError::role(&role, e.to_string()))?;
        stats.grad_norm = step.grad_norm;
        stats.lr = step.lr;
        Ok(stats)
    }

    /// DPO sums over `batches` (no gradients).
    pub(super) fn preference_eval(
        &self,
        batches: &[Vec<PackedRow>],
        loss: PreferenceLoss,
    ) -> crate::Result<PairStats> {
        self.setup.enter(Phase::Experience);
        let reference = self.reference()?;
        let passes = self.sharded.balance(batches.len(), false)?;
        let stats = tch::no_grad(|| -> crate::Result<PairStats> {
            let mut stats = PairStats::default();
            for rows in batches {
                stats = stats.plus(&dpo_pairs(&self.model, reference, rows, loss)?.1);
                self.model.backbone.release_parameters()?;
            }
            Ok(stats)
        })?;
        for _ in batches.len()..passes {
            self.idle_reference_forward()?;
            self.sharded.idle_forward()?;
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::pack::{Sample, rank_batches};

    /// A plain gradient step on the DPO loss of a fixed batch lowers that batch's loss and
    /// widens its margin, and the per-pair log-ratios match a direct per-sequence computation.
    #[test]
    fn a_dpo_step_lowers_the_loss_of_its_batch() {
        let config = rtrun_rlhf_model::tiny::tiny_config(rtrun_rlhf_model::ModelFamily::Qwen2);
        let policy = rtrun_rlhf_model::tiny::tiny_model(&config, 7).unwrap();
        let reference = rtrun_rlhf_model::tiny::tiny_model(&config, 7).unwrap();
        let sample = |ids: &[u32], prompt_len| Sample { ids: ids.to_vec(), prompt_len };
        let units = vec![
            vec![sample(&[5, 6, 7, 8, 9], 3), sample(&[5, 6, 7, 10, 11, 12], 3)],
            vec![sample(&[20, 21, 22, 23], 2), sample(&[20, 21, 30], 2)],
        ];
        let loss = PreferenceLoss::Dpo { beta: 0.5, label_smoothing: 0.0, ipo: false };
        let rows = rank_batches(units.clone(), 1, 64, false, false, 8).remove(0).remove(0);
        let (losses, before) = dpo_pairs(&policy, Some(&reference), &rows, loss).unwrap();
        assert_eq!((before.pairs, before.chosen_sum, before.rejected_sum), (2, 0.0, 0.0));
        losses.sum(tch::Kind::Float).backward();
        tch::no_grad(|| {
            for (_, p) in policy.named_parameters() {
                let g = p.grad();
                if g.defined() {
                    let _ = p.shallow_clone().f_sub_(&(g * 0.05)).unwrap();
                }
            }
        });
        let (_, after) = dpo_pairs(&policy, Some(&reference), &rows, loss).unwrap();
        assert!(after.loss_sum < before.loss_sum, "{before:?} -> {after:?}");
        assert!(after.chosen_sum - after.rejected_sum > 0.0, "{after:?}");
        // The implicit rewards are β (log π - log ref) summed over each response.
        let direct = |model: &CausalLm, s: &Sample| -> f64 {
            let ids: Vec<i64> = s.ids.iter().map(|&i| i64::from(i)).collect();
            let t = Tensor::from_slice(&ids).view([1, ids.len() as i64]);
            let logits = model.forward(&t, &t.ones_like(), None).unwrap();
            let lp = token_log_probs(
                &logits.narrow(1, 0, ids.len() as i64 - 1),
                &t.narrow(1, 1, ids.len() as i64 - 1),
            )
            .unwrap();
            lp.narrow(1, s.prompt_len as i64 - 1, (s.ids.len() - s.prompt_len) as i64)
                .sum(tch::Kind::Double)
                .double_value(&[])
        };
        let chosen: f64 =
            units.iter().map(|u| 0.5 * (direct(&policy, &u[0]) - direct(&reference, &u[0]))).sum();
        assert!((chosen - after.chosen_sum).abs() < 1e-4, "{chosen} vs {}", after.chosen_sum);
    }
}
