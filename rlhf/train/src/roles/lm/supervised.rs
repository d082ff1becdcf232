//! Supervised steps of a policy rank (`train --mode sft`): token-level negative log-likelihood of
//! the response tokens of packed rows, summed per rank and divided by the global batch's response
//! tokens, so the all-reduced gradient is that of the mean over the whole batch whatever the
//! ranks' shares; then one AdamW step.

use serde::{Deserialize, Serialize};

use rtrun_rlhf_model::CausalLm;

use super::LmWorkerState;
use crate::roles::Phase;
use crate::stage::pack::{PackedRow, nll_sum, row_tensors};

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

/// The summed NLL of the response tokens of `rows` (a float32 scalar with the graph when
/// gradients are on) and how many there are. Only positions that predict a response token are
/// projected to the vocabulary.
fn rows_nll(model: &CausalLm, rows: &[PackedRow]) -> crate::Result<(tch::Tensor, usize)> {
    let t = row_tensors(rows, model.params.device())?;
    let hidden = model.backbone.forward_packed(&t.input_ids, &t.segment_ids)?;
    let width = hidden.size()[2];
    let index = t.loss_mask.f_flatten(0, -1)?.f_nonzero()?.f_squeeze_dim(1)?;
    let picked = hidden.f_reshape([-1, width])?.f_index_select(0, &index)?;
    let targets = t.targets.f_flatten(0, -1)?.f_index_select(0, &index)?;
    Ok((nll_sum(&model.lm_logits(&picked)?, &targets)?, t.loss_tokens))
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
        let optimizer = self
            .optimizer
            .as_mut()
            .ok_or_else(|| crate::TrainError::role(&role, "this rank is frozen (no optimizer)"))?;
        optimizer.zero_grad();
        // The gradients are averaged over ranks, so each rank's sum is scaled by dp_size.
        let scale = dp_size as f64 / global_tokens.max(1) as f64;
        let mut stats = SupervisedStats::default();
        for rows in batches {
            let (nll, tokens) = rows_nll(&self.model, rows)?;
            stats.nll_sum += nll.f_double_value(&[])?;
            stats.tokens += tokens;
            nll.f_mul_scalar(scale)?.f_backward()?;
        }
        self.comm.all_reduce_gradients(&self.model, &role)?;
        let step = optimizer.step()?;
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
        tch::no_grad(|| {
            let mut out = (0.0, 0);
            for rows in batches {
                let (nll, tokens) = rows_nll(&self.model, rows)?;
                out.0 += nll.f_double_value(&[])?;
                out.1 += tokens;
            }
            Ok(out)
        })
    }
}
