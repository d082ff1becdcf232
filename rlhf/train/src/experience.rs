//! Experience as it travels between the trainer and the role actors, and its tensor layout.
//!
//! Rows are plain vectors (serde) on the wire and become OpenRLHF's layout only inside a role:
//! prompts left-padded to the longest prompt, responses right-padded to the longest response, so
//! the last `R` columns of every row are response positions ([`ResponseBatch`]). Or, with
//! `train.share_prompt`, each prompt laid out once for all the responses to it that a
//! micro-batch holds ([`SharedPromptBatch`]): GRPO samples several responses per prompt, and
//! the prompt's forward and backward are then paid once instead of once per response.

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use rtrun_rlhf_model::ResponseBatch;

use crate::error::{Result, TrainError};

/// The id at padded positions. They are masked out of every loss, so any id of the
/// vocabulary serves; 0 is in every vocabulary.
const PAD: i64 = 0;

/// A prompt and one generated response, as token ids (the response keeps its `<eos>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sequence {
    /// Prompt ids, `<bos>` first.
    pub prompt_ids: Vec<u32>,
    /// Response ids.
    pub response_ids: Vec<u32>,
    /// Which response tokens the model wrote (`true`) and which entered its context from
    /// elsewhere (`false`: a tool's answer in a multi-turn rollout), one per response token;
    /// only the model's count in the losses, the KL and the advantages. Empty: every token is
    /// the model's.
    #[serde(default)]
    pub loss_mask: Vec<bool>,
}

impl Sequence {
    /// A prompt and a response the model wrote whole.
    pub fn new(prompt_ids: Vec<u32>, response_ids: Vec<u32>) -> Self {
        Self { prompt_ids, response_ids, loss_mask: Vec::new() }
    }

    /// Whether response token `i` is the model's (counts in the losses).
    pub fn counts(&self, i: usize) -> bool {
        self.loss_mask.get(i).copied().unwrap_or(true)
    }
}

/// One sequence with everything training needs; vectors are per response token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExperienceRow {
    /// The sequence.
    pub sequence: Sequence,
    /// Log-probs of the response under the policy that generated it.
    pub old_log_probs: Vec<f32>,
    /// Log-probs under the reference model (empty when KL is off).
    pub ref_log_probs: Vec<f32>,
    /// Critic values before training (empty without a critic).
    pub values: Vec<f32>,
    /// Advantages.
    pub advantages: Vec<f32>,
    /// Returns (critic targets; empty without a critic).
    pub returns: Vec<f32>,
    /// Per-token truncated importance weights `min(π_old / π_engine, algo.tis_cap)` that scale
    /// the policy loss (empty: none).
    #[serde(default)]
    pub is_weights: Vec<f32>,
}

/// Builds the padded batch of `sequences` on `device`.
pub fn response_batch(sequences: &[&Sequence], device: Device) -> Result<ResponseBatch> {
    if sequences.is_empty() {
        return Err(TrainError::Data("a batch needs at least one sequence, found 0".into()));
    }
    let prompt_len = sequences.iter().map(|s| s.prompt_ids.len()).max().unwrap_or(0);
    // At least one response column, so an empty response still gives a well-formed batch
    // (its action mask is all zero).
    let response_len = sequences.iter().map(|s| s.response_ids.len()).max().unwrap_or(0).max(1);
    if prompt_len == 0 {
        return Err(TrainError::Data("every prompt needs at least one token, found none".into()));
    }
    let width = prompt_len + response_len;
    let rows = sequences.len();
    let mut ids = vec![PAD; rows * width];
    let mut attention = vec![0i64; rows * width];
    let mut actions = vec![0i64; rows * response_len];
    for (row, s) in sequences.iter().enumerate() {
        let base = row * width;
        let offset = prompt_len - s.prompt_ids.len();
        for (i, &t) in s.prompt_ids.iter().enumerate() {
            ids[base + offset + i] = i64::from(t);
            attention[base + offset + i] = 1;
        }
        for (i, &t) in s.response_ids.iter().enumerate() {
            ids[base + prompt_len + i] = i64::from(t);
            attention[base + prompt_len + i] = 1;
            actions[row * response_len + i] = i64::from(s.counts(i));
        }
    }
    let shape = |w: usize| [rows as i64, w as i64];
    Ok(ResponseBatch {
        input_ids: Tensor::from_slice(&ids).view(shape(width)).to_device(device),
        attention_mask: Tensor::from_slice(&attention).view(shape(width)).to_device(device),
        action_mask: Tensor::from_slice(&actions).view(shape(response_len)).to_device(device),
    })
}

/// Sequences laid out with each prompt once: row `g` holds the `g`-th distinct prompt (branch
/// 0) followed by every response to it (branches 1, 2, ...), each response's positions
/// continuing the prompt's. A response attends the prompt and its own earlier tokens only (see
/// [`rtrun_rlhf_model::Backbone::forward_rows`]), so it gets exactly the hidden states it gets
/// in the padded layout of [`response_batch`], while the prompt is computed once per row.
/// Predictions come back in the sequences' order as `[batch, R]`, like [`ResponseBatch`]'s.
#[derive(Debug)]
pub struct SharedPromptBatch {
    /// `[rows, width]` token ids (pad at padding).
    pub input_ids: Tensor,
    /// `[rows, width]`: 1 at real tokens, 0 at padding.
    pub segment_ids: Tensor,
    /// `[rows, width]`: 0 for prompt tokens, `k` for the `k`-th response of the row.
    pub branch_ids: Tensor,
    /// `[rows, width]`: each token's position in its own sequence.
    pub position_ids: Tensor,
    /// `[batch * R]`: the flat index (`row * width + column`) of the position that predicts
    /// each response token (0 where the response is shorter than `R`; masked).
    pub predict_positions: Tensor,
    /// `[batch, R]` response token ids (pad past each response's end).
    pub response_ids: Tensor,
    /// `[batch, R]`: 1 for response tokens, 0 for padding.
    pub action_mask: Tensor,
}

impl SharedPromptBatch {
    /// The response columns `R`.
    pub fn num_actions(&self) -> i64 {
        self.action_mask.size()[1]
    }

    /// The final hidden states of `backbone` at the positions that predict each response
    /// token (the states before it), `[batch, R, hidden]`.
    pub fn response_hidden(&self, backbone: &rtrun_rlhf_model::Backbone) -> Result<Tensor> {
        let hidden = backbone.forward_rows(
            &self.input_ids,
            &self.segment_ids,
            Some(&self.branch_ids),
            Some(&self.position_ids),
            None,
        )?;
        let width = hidden.size()[2];
        let [batch, responses] = [self.action_mask.size()[0], self.num_actions()];
        Ok(hidden
            .f_reshape([-1, width])?
            .f_index_select(0, &self.predict_positions)?
            .f_view([batch, responses, width])?)
    }

    /// Logits predicting every response token, `[batch, R, vocab]`, from `model`.
    pub fn response_logits(&self, model: &rtrun_rlhf_model::CausalLm) -> Result<Tensor> {
        Ok(model.lm_logits(&self.response_hidden(&model.backbone)?)?)
    }

    /// A critic's values of the states before each response token, `[batch, R]` float32, zero
    /// at padding (what `ScalarHeadModel::action_values` gives for the padded layout).
    pub fn action_values(&self, model: &rtrun_rlhf_model::ScalarHeadModel) -> Result<Tensor> {
        let hidden = self.response_hidden(&model.backbone)?;
        let values = model.score.forward(&hidden)?.f_squeeze_dim(-1)?.f_to_kind(Kind::Float)?;
        Ok(values.f_mul(&self.action_mask.f_to_kind(Kind::Float)?)?)
    }

    /// Log-probs of the response tokens under `model`, `[batch, R]`, zero at padding.
    pub fn response_log_probs(&self, model: &rtrun_rlhf_model::CausalLm) -> Result<Tensor> {
        let logits = self.response_logits(model)?;
        let log_probs = rtrun_rlhf_model::logprobs::token_log_probs(&logits, &self.response_ids)?;
        Ok(log_probs.f_mul(&self.action_mask.f_to_kind(Kind::Float)?)?)
    }
}

/// Lays `sequences` out with each distinct prompt once (see [`SharedPromptBatch`]); rows in the
/// order prompts first appear, responses in the sequences' order.
pub fn shared_prompt_batch(sequences: &[&Sequence], device: Device) -> Result<SharedPromptBatch> {
    if sequences.is_empty() {
        return Err(TrainError::Data("a batch needs at least one sequence, found 0".into()));
    }
    if let Some(i) = sequences.iter().position(|s| s.prompt_ids.is_empty()) {
        return Err(TrainError::Data(format!(
            "every prompt needs at least one token, found none in sequence {i}"
        )));
    }
    let rows = prompt_groups(sequences);
    let row_len = |(prompt, members): &(&[u32], Vec<usize>)| {
        prompt.len() + members.iter().map(|&i| sequences[i].response_ids.len()).sum::<usize>()
    };
    let width = rows.iter().map(row_len).max().unwrap_or(0);
    let responses = sequences.iter().map(|s| s.response_ids.len()).max().unwrap_or(0).max(1);
    let cells = rows.len() * width;
    let mut ids = vec![PAD; cells];
    let mut segments = vec![0i64; cells];
    let mut branches = vec![0i64; cells];
    let mut positions = vec![0i64; cells];
    let mut predict = vec![0i64; sequences.len() * responses];
    let mut response_ids = vec![PAD; sequences.len() * responses];
    let mut actions = vec![0i64; sequences.len() * responses];
    for (r, (prompt, members)) in rows.iter().enumerate() {
        let base = r * width;
        let mut put = |at: usize, tokens: &[u32], branch: i64, first_position: usize| {
            for (k, &t) in tokens.iter().enumerate() {
                ids[base + at + k] = i64::from(t);
                segments[base + at + k] = 1;
                branches[base + at + k] = branch;
                positions[base + at + k] = (first_position + k) as i64;
            }
        };
        put(0, prompt, 0, 0);
        let mut at = prompt.len();
        for (k, &i) in members.iter().enumerate() {
            let response = &sequences[i].response_ids;
            put(at, response, k as i64 + 1, prompt.len());
            for (j, &t) in response.iter().enumerate() {
                // The first token is predicted by the prompt's last, the others by their own
                // response's previous token.
                let from = if j == 0 { prompt.len() - 1 } else { at + j - 1 };
                predict[i * responses + j] = (base + from) as i64;
                response_ids[i * responses + j] = i64::from(t);
                actions[i * responses + j] = i64::from(sequences[i].counts(j));
            }
            at += response.len();
        }
    }
    let grid = |v: &[i64]| -> Result<Tensor> {
        Ok(Tensor::from_slice(v).f_view([rows.len() as i64, width as i64])?.f_to_device(device)?)
    };
    let per_action = |v: &[i64]| -> Result<Tensor> {
        Ok(Tensor::from_slice(v)
            .f_view([sequences.len() as i64, responses as i64])?
            .f_to_device(device)?)
    };
    Ok(SharedPromptBatch {
        input_ids: grid(&ids)?,
        segment_ids: grid(&segments)?,
        branch_ids: grid(&branches)?,
        position_ids: grid(&positions)?,
        predict_positions: Tensor::from_slice(&predict).f_to_device(device)?,
        response_ids: per_action(&response_ids)?,
        action_mask: per_action(&actions)?,
    })
}

/// Indices of `sequences` reordered so that sequences answering the same prompt are adjacent
/// (groups in order of first appearance, each in its original order): cut into micro-batches,
/// this order lets [`shared_prompt_batch`] lay each prompt out once for as many responses as
/// possible. A policy loss summed over micro-batches does not depend on which rows share one.
pub fn grouped_by_prompt(sequences: &[&Sequence]) -> Vec<usize> {
    prompt_groups(sequences).into_iter().flat_map(|(_, members)| members).collect()
}

/// A trained role's rows in the order its micro-batches take them: grouped by prompt with
/// `share_prompt` (see [`grouped_by_prompt`]), else as they came.
pub fn training_order(rows: &[ExperienceRow], share_prompt: bool) -> Vec<&ExperienceRow> {
    if !share_prompt {
        return rows.iter().collect();
    }
    let sequences: Vec<&Sequence> = rows.iter().map(|r| &r.sequence).collect();
    grouped_by_prompt(&sequences).into_iter().map(|i| &rows[i]).collect()
}

/// Micro-batches of `sequences` (indices) under a token budget, verl's dynamic batch size
/// (`use_dynamic_bsz` with `ppo_max_token_len_per_gpu`; `train.micro_batch_tokens`): the
/// layout's rows (a prompt with all its responses with `share_prompt`, else one prompt and
/// response) are sorted longest first and packed while `rows x the longest row's positions`,
/// the cells a micro-batch pads to, stays within `budget`; a row longer than the budget is a
/// micro-batch alone. A long response then costs its own positions instead of padding every
/// row of a fixed-size micro-batch to its length. Sequences of one prompt stay together, and
/// the order within a row is kept.
pub fn token_budget_batches(
    sequences: &[&Sequence],
    share_prompt: bool,
    budget: usize,
) -> Vec<Vec<usize>> {
    let mut rows: Vec<(usize, Vec<usize>)> = match share_prompt {
        true => prompt_groups(sequences)
            .into_iter()
            .map(|(prompt, members)| {
                let responses: usize =
                    members.iter().map(|&i| sequences[i].response_ids.len()).sum();
                (prompt.len() + responses, members)
            })
            .collect(),
        false => sequences
            .iter()
            .enumerate()
            .map(|(i, s)| (s.prompt_ids.len() + s.response_ids.len(), vec![i]))
            .collect(),
    };
    // Longest first; a stable sort keeps equal rows in their order.
    rows.sort_by_key(|row| std::cmp::Reverse(row.0));
    let mut batches: Vec<Vec<usize>> = Vec::new();
    let (mut count, mut widest) = (0usize, 0usize);
    for (length, members) in rows {
        let fits = count > 0 && (count + 1).saturating_mul(widest.max(length)) <= budget;
        if !fits {
            batches.push(Vec::new());
            (count, widest) = (0, length);
        }
        count += 1;
        widest = widest.max(length);
        if let Some(batch) = batches.last_mut() {
            batch.extend(members);
        }
    }
    batches
}

/// The distinct prompts of `sequences` in order of first appearance, each with the indices of
/// the sequences that answer it, in order.
fn prompt_groups<'a>(sequences: &[&'a Sequence]) -> Vec<(&'a [u32], Vec<usize>)> {
    let mut groups: Vec<(&[u32], Vec<usize>)> = Vec::new();
    let mut group_of: std::collections::HashMap<&[u32], usize> = std::collections::HashMap::new();
    for (i, s) in sequences.iter().enumerate() {
        let g = *group_of.entry(&s.prompt_ids).or_insert_with(|| {
            groups.push((&s.prompt_ids, Vec::new()));
            groups.len() - 1
        });
        groups[g].1.push(i);
    }
    groups
}

/// A `[rows, R]` tensor of per-response-token values from per-row vectors (right-padded with 0).
pub fn pad_rows(rows: &[&[f32]], width: i64, device: Device) -> Result<Tensor> {
    let width_usize = usize::try_from(width)
        .map_err(|_| TrainError::Data(format!("width should be >= 0, found {width}")))?;
    let mut flat = vec![0f32; rows.len() * width_usize];
    for (r, values) in rows.iter().enumerate() {
        if values.len() > width_usize {
            return Err(TrainError::Data(format!(
                "row {r} should have at most {width} values, found {}",
                values.len()
            )));
        }
        flat[r * width_usize..r * width_usize + values.len()].copy_from_slice(values);
    }
    Ok(Tensor::from_slice(&flat).view([rows.len() as i64, width]).to_device(device))
}

/// Per-row vectors of the first `lengths[r]` entries of a `[rows, R]` tensor.
pub fn unpad_rows(tensor: &Tensor, lengths: &[usize]) -> Result<Vec<Vec<f32>>> {
    let tensor = tensor.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?.f_contiguous()?;
    let size = tensor.size();
    let width = match size.as_slice() {
        [rows, width] if *rows as usize == lengths.len() => *width as usize,
        _ => {
            return Err(TrainError::Data(format!(
                "expected a [{}, R] tensor, found {size:?}",
                lengths.len()
            )));
        }
    };
    let flat = Vec::<f32>::try_from(tensor.f_view([-1])?)?;
    lengths
        .iter()
        .enumerate()
        .map(|(r, &len)| {
            if len > width {
                return Err(TrainError::Data(format!(
                    "row {r} has {len} tokens, wider than {width}"
                )));
            }
            Ok(flat[r * width..r * width + len].to_vec())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_left_pads_prompts_and_right_pads_responses() {
        let a = Sequence::new(vec![1, 5, 6], vec![7, 2]);
        let b = Sequence::new(vec![1, 5], vec![8, 9, 2]);
        let batch = response_batch(&[&a, &b], Device::Cpu).unwrap();
        let ids = Vec::<i64>::try_from(batch.input_ids.view([-1])).unwrap();
        assert_eq!(ids, vec![1, 5, 6, 7, 2, 0, 0, 1, 5, 8, 9, 2]);
        let mask = Vec::<i64>::try_from(batch.attention_mask.view([-1])).unwrap();
        assert_eq!(mask, vec![1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1]);
        let actions = Vec::<i64>::try_from(batch.action_mask.view([-1])).unwrap();
        assert_eq!(actions, vec![1, 1, 0, 1, 1, 1]);
        assert_eq!(batch.num_actions().unwrap(), 3);
        let response = Vec::<i64>::try_from(batch.response_ids().unwrap().reshape([-1])).unwrap();
        assert_eq!(response, vec![7, 2, 0, 8, 9, 2]);
    }

    fn sequence(prompt: &[u32], response: &[u32]) -> Sequence {
        Sequence::new(prompt.to_vec(), response.to_vec())
    }

    /// A multi-turn response whose middle tokens are a tool's answer: both layouts mask them
    /// out of the actions, so no loss reads them.
    #[test]
    fn tool_tokens_are_out_of_both_layouts_action_masks_and_take_no_gradient() {
        use rtrun_rlhf_model::{ModelFamily, tiny};
        let model = tiny::tiny_model(&tiny::tiny_config(ModelFamily::Qwen2), 5).unwrap();
        let turn = |tool: [u32; 3]| {
            let mut s = sequence(&[1, 5, 6], &[10, 11, tool[0], tool[1], tool[2], 12, 2]);
            s.loss_mask = vec![true, true, false, false, false, true, true];
            s
        };
        let (a, b) = (turn([30, 31, 32]), turn([40, 41, 42]));
        let plain = sequence(&[1, 5, 6], &[13, 2]);
        assert!(a.counts(1) && !a.counts(2) && a.counts(6) && plain.counts(0) && plain.counts(9));
        let expected = vec![1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0];
        for seqs in [[&a, &plain], [&b, &plain]] {
            let padded = response_batch(&seqs, Device::Cpu).unwrap();
            let shared = shared_prompt_batch(&seqs, Device::Cpu).unwrap();
            for mask in [&padded.action_mask, &shared.action_mask] {
                assert_eq!(Vec::<i64>::try_from(mask.reshape([-1])).unwrap(), expected);
            }
        }
        // The log-probs every loss reads are zero at the tool's positions (so no loss or
        // gradient comes from them) and not at the model's.
        for s in [&a, &b] {
            let batch = response_batch(&[s], Device::Cpu).unwrap();
            let log_probs = model.response_log_probs(&batch).unwrap();
            assert_eq!(log_probs.narrow(1, 2, 3).abs().sum(Kind::Float).double_value(&[]), 0.0);
            let own = log_probs.narrow(1, 0, 2).abs().sum(Kind::Float).double_value(&[]);
            assert!(own > 0.0 && own.is_finite());
        }
        // A sequence written before masks existed reads back as the model's whole.
        let back: Sequence =
            serde_json::from_str(r#"{"prompt_ids": [1, 5, 6], "response_ids": [13, 2]}"#).unwrap();
        assert_eq!(back, plain);
        let masked: Sequence = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        assert_eq!(masked.loss_mask, a.loss_mask);
    }

    #[test]
    fn shared_prompts_give_the_padded_layouts_log_probs_and_gradients() {
        use rtrun_rlhf_model::{ModelFamily, tiny};
        let config = tiny::tiny_config(ModelFamily::Qwen2);
        let model = tiny::tiny_model(&config, 7).unwrap();
        // Three prompts of different lengths, interleaved, with 3, 1 and 2 responses of
        // different lengths (one of a single token).
        let (p1, p2, p3) = (vec![1, 5, 6, 9], vec![1, 7], vec![1, 4, 4, 8, 3, 2]);
        let sequences = [
            sequence(&p1, &[10, 11, 2]),
            sequence(&p2, &[12, 13, 14, 15, 2]),
            sequence(&p1, &[16]),
            sequence(&p3, &[17, 18]),
            sequence(&p1, &[19, 20, 21, 22]),
            sequence(&p3, &[23, 24, 25]),
        ];
        let refs: Vec<&Sequence> = sequences.iter().collect();
        let shared = shared_prompt_batch(&refs, Device::Cpu).unwrap();
        assert_eq!(shared.input_ids.size(), [3, 4 + 3 + 1 + 4]);
        let padded = response_batch(&refs, Device::Cpu).unwrap();
        assert_eq!(
            Vec::<i64>::try_from(shared.action_mask.reshape([-1])).unwrap(),
            Vec::<i64>::try_from(padded.action_mask.reshape([-1])).unwrap()
        );
        // Weights per token, so the gradients of both layouts can be compared.
        let weights = Tensor::arange(6 * 5, (Kind::Float, Device::Cpu)).view([6, 5]).sin();
        let run = |log_probs: Tensor| -> (Tensor, Vec<Tensor>) {
            for (_, p) in model.named_parameters() {
                p.shallow_clone().zero_grad();
            }
            log_probs.multiply(&weights).sum(Kind::Float).backward();
            let grads = model.named_parameters().map(|(_, p)| p.grad().copy()).collect();
            (log_probs.detach(), grads)
        };
        let (expected, expected_grads) = run(model.response_log_probs(&padded).unwrap());
        let (found, found_grads) = run(shared.response_log_probs(&model).unwrap());
        let gap = (&expected - &found).abs().max().double_value(&[]);
        assert!(gap < 1e-5, "log-probs differ by {gap}");
        assert!(expected.abs().sum(Kind::Float).double_value(&[]) > 1.0, "a vacuous comparison");
        for ((name, _), (e, f)) in
            model.named_parameters().zip(expected_grads.iter().zip(&found_grads))
        {
            let gap = (e - f).abs().max().double_value(&[]);
            let scale = e.abs().max().double_value(&[]).max(1e-3);
            assert!(gap <= 1e-4 * scale, "{name}: gradients differ by {gap} (scale {scale})");
        }
    }

    #[test]
    fn shared_prompts_give_the_padded_layouts_critic_values() {
        use rtrun_rlhf_model::{ModelFamily, ScalarHeadModel, tiny};
        let config = tiny::tiny_config(ModelFamily::Qwen2);
        let critic = ScalarHeadModel::new_random(&config, Device::Cpu, Kind::Float, 5).unwrap();
        let (p1, p2) = (vec![1, 5, 6], vec![1, 7, 8, 9, 3]);
        let sequences = [
            sequence(&p1, &[10, 2]),
            sequence(&p2, &[12, 13, 14]),
            sequence(&p1, &[16, 17, 18, 19]),
            sequence(&p2, &[20]),
        ];
        let refs: Vec<&Sequence> = sequences.iter().collect();
        let expected = critic.action_values(&response_batch(&refs, Device::Cpu).unwrap()).unwrap();
        let found =
            shared_prompt_batch(&refs, Device::Cpu).unwrap().action_values(&critic).unwrap();
        assert_eq!(found.size(), expected.size());
        let gap = (&expected - &found).abs().max().double_value(&[]);
        assert!(gap < 1e-5, "values differ by {gap}");
        assert!(expected.abs().sum(Kind::Float).double_value(&[]) > 1e-3, "a vacuous comparison");
    }

    #[test]
    fn grouping_puts_the_responses_to_one_prompt_together_in_first_seen_order() {
        let sequences = [
            sequence(&[1, 2], &[3]),
            sequence(&[1, 4], &[5]),
            sequence(&[1, 2], &[6]),
            sequence(&[1, 7], &[8]),
            sequence(&[1, 4], &[9]),
        ];
        let refs: Vec<&Sequence> = sequences.iter().collect();
        assert_eq!(grouped_by_prompt(&refs), vec![0, 2, 1, 4, 3]);
        assert!(shared_prompt_batch(&[], Device::Cpu).is_err());
        let empty = sequence(&[], &[3]);
        let err = shared_prompt_batch(&[&empty], Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("sequence 0"), "{err}");
    }

    /// Token-budgeted micro-batches: every sequence once, a prompt's responses together (with
    /// shared prompts), longest rows first, and no micro-batch of several rows padded past the
    /// budget; a row over the budget alone.
    #[test]
    fn token_budget_batches_pack_rows_longest_first_under_the_budget() {
        let long: Vec<u32> = (0..40).collect();
        let sequences = [
            sequence(&[1, 2], &[3]),
            sequence(&[1, 4], &long),
            sequence(&[1, 2], &[6, 7]),
            sequence(&[1, 7], &[8]),
            sequence(&[1, 4], &[9]),
            sequence(&[5, 5, 5], &[1, 2, 3, 4]),
        ];
        let refs: Vec<&Sequence> = sequences.iter().collect();
        // Shared prompts: rows are [1,4] (2 + 41 = 43), [5,5,5] (7), [1,2] (5), [1,7] (3).
        assert_eq!(token_budget_batches(&refs, true, 16), vec![vec![1, 4], vec![5, 0, 2], vec![3]]);
        // One row per sequence: 42, 11, 7, 4, 3, 3 positions.
        assert_eq!(
            token_budget_batches(&refs, false, 24),
            vec![vec![1], vec![5, 2, 0], vec![3, 4]]
        );
        for budget in [1, 8, 30, 1000] {
            for share in [true, false] {
                let batches = token_budget_batches(&refs, share, budget);
                let mut all: Vec<usize> = batches.iter().flatten().copied().collect();
                all.sort_unstable();
                assert_eq!(all, (0..sequences.len()).collect::<Vec<_>>(), "{budget} {share}");
                if budget == 1000 {
                    assert_eq!(batches.len(), 1);
                }
            }
        }
    }

    #[test]
    fn pad_and_unpad_round_trip_and_check_shapes() {
        let rows: Vec<Vec<f32>> = vec![vec![1.0, 2.0], vec![3.0]];
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let t = pad_rows(&refs, 3, Device::Cpu).unwrap();
        assert_eq!(unpad_rows(&t, &[2, 1]).unwrap(), rows);
        assert!(pad_rows(&refs, 1, Device::Cpu).is_err());
        assert!(unpad_rows(&t, &[4, 1]).is_err());
        assert!(unpad_rows(&t, &[1]).is_err());
        assert!(response_batch(&[], Device::Cpu).is_err());
    }
}
