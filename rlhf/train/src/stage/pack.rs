//! Supervised batches: tokenized samples (ids + where the loss starts), split over the DP ranks
//! by token count, packed several to a row (each sample attends only itself: see
//! [`rtrun_rlhf_model::Backbone::forward_packed`]) and cut into micro-batches; and the tensors
//! a rank builds from its rows.

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::error::{Result, TrainError};

/// One tokenized sample: the loss covers `ids[prompt_len..]` (the response; the prompt is
/// context only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sample {
    /// Prompt then response token ids.
    pub ids: Vec<u32>,
    /// Tokens of the prompt (no loss on them).
    pub prompt_len: usize,
}

impl Sample {
    /// Tokens the loss covers.
    pub fn loss_tokens(&self) -> usize {
        self.ids.len().saturating_sub(self.prompt_len)
    }
}

/// Samples packed into one row of a micro-batch, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackedRow {
    /// The samples.
    pub samples: Vec<Sample>,
    /// The samples come in (chosen, rejected) pairs answering the same prompt, and each pair is
    /// laid out once as prompt, chosen response, rejected response: the rejected response
    /// attends the prompt and itself, not the chosen one, and its positions continue the
    /// prompt's, so both responses see what they would see alone while the prompt is computed
    /// once (`train.share_prompt`).
    pub shared_prompts: bool,
}

impl PackedRow {
    /// A row of `samples` laid out one after another.
    pub fn of(samples: Vec<Sample>) -> Self {
        PackedRow { samples, shared_prompts: false }
    }

    /// Tokens of the row.
    pub fn len(&self) -> usize {
        let all: usize = self.samples.iter().map(|s| s.ids.len()).sum();
        if self.shared_prompts {
            // Every rejected sample's prompt is laid out once, with its chosen one.
            all - self.samples.iter().skip(1).step_by(2).map(|s| s.prompt_len).sum::<usize>()
        } else {
            all
        }
    }

    /// Whether the row holds no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Samples that stay together: one for SFT, a (chosen, rejected) pair for the preference
/// trainers. A unit goes to one rank, and its samples stay consecutive in the row-major order
/// of the micro-batch they land in.
pub type Unit = Vec<Sample>;

fn unit_len(unit: &[Sample]) -> usize {
    unit.iter().map(|s| s.ids.len()).sum()
}

/// Whether `unit` is a pair whose two samples start with the same prompt.
fn shares_prompt(unit: &[Sample]) -> bool {
    matches!(unit, [c, r] if c.prompt_len == r.prompt_len
        && c.prompt_len > 0
        && c.ids.get(..c.prompt_len) == r.ids.get(..r.prompt_len))
}

/// Splits units over `ranks`, balancing tokens: longest first, each to the rank with the fewest
/// tokens so far (lowest rank on ties); each rank keeps its units in their original order.
pub fn split_over_ranks(units: Vec<Unit>, ranks: usize) -> Vec<Vec<Unit>> {
    let ranks = ranks.max(1);
    let mut order: Vec<usize> = (0..units.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(unit_len(&units[i])), i));
    let mut load = vec![0usize; ranks];
    let mut owner = vec![0usize; units.len()];
    for i in order {
        let rank = (0..ranks).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[rank] += unit_len(&units[i]);
        owner[i] = rank;
    }
    let mut out: Vec<Vec<Unit>> = vec![Vec::new(); ranks];
    for (unit, rank) in units.into_iter().zip(owner) {
        out[rank].push(unit);
    }
    out
}

/// Rows of at most `max_len` tokens: with `packing`, first fit in order (a unit goes whole into
/// the first row it fits in, or a row of its own); without, one sample per row, a unit's rows
/// consecutive. With `share_prompt`, pairs answering the same prompt are laid out with the
/// prompt once ([`PackedRow::shared_prompts`]), one pair per row without packing.
pub fn pack(units: Vec<Unit>, max_len: usize, packing: bool, share_prompt: bool) -> Vec<PackedRow> {
    let share = share_prompt && !units.is_empty() && units.iter().all(|u| shares_prompt(u));
    let mut rows: Vec<PackedRow> = Vec::new();
    for unit in units {
        if !packing {
            if share {
                rows.push(PackedRow { samples: unit, shared_prompts: true });
            } else {
                rows.extend(unit.into_iter().map(|s| PackedRow::of(vec![s])));
            }
            continue;
        }
        let unit = PackedRow { samples: unit, shared_prompts: share };
        let len = unit.len();
        match rows.iter_mut().find(|r| r.len() + len <= max_len) {
            Some(row) => row.samples.extend(unit.samples),
            None => rows.push(unit),
        }
    }
    rows
}

/// `rows` cut into micro-batches of at most `micro` rows.
pub fn micro_batches(rows: Vec<PackedRow>, micro: usize) -> Vec<Vec<PackedRow>> {
    let micro = micro.max(1);
    let mut out = Vec::new();
    let mut rows = rows.into_iter().peekable();
    while rows.peek().is_some() {
        out.push(rows.by_ref().take(micro).collect());
    }
    out
}

/// Each rank's share of a global batch of units: its micro-batches of packed rows. `micro`
/// counts rows when packing and units otherwise (a micro-batch of 4 pairs is 8 rows), so a unit
/// never spans two micro-batches.
pub fn rank_batches(
    units: Vec<Unit>,
    ranks: usize,
    max_len: usize,
    packing: bool,
    share_prompt: bool,
    micro: usize,
) -> Vec<Vec<Vec<PackedRow>>> {
    split_over_ranks(units, ranks)
        .into_iter()
        .map(|share| {
            let per_unit = share.first().map_or(1, Vec::len).max(1);
            let rows = pack(share, max_len, packing, share_prompt);
            // Unpacked and not sharing prompts, each sample of a unit has a row of its own.
            let separate = !packing && !rows.first().is_some_and(|r| r.shared_prompts);
            micro_batches(rows, if separate { micro * per_unit } else { micro })
        })
        .collect()
}

/// The tensors of a micro-batch: `[rows, width]` (right-padded to the longest row) for the
/// model's input, and one entry per *prediction* (a position and the response token it predicts,
/// in sample order) for the losses.
#[derive(Debug)]
pub struct RowTensors {
    /// Token ids (0 at padding).
    pub input_ids: Tensor,
    /// The sample (or pair, with shared prompts) each token belongs to, numbered from 1 in each
    /// row; 0 at padding.
    pub segment_ids: Tensor,
    /// With shared prompts: 0 for a prompt token, 1 for a chosen-response token, 2 for a
    /// rejected-response one (a token attends its segment's prompt and its own branch).
    pub branch_ids: Option<Tensor>,
    /// With shared prompts: each token's position (a rejected response continues its prompt).
    pub position_ids: Option<Tensor>,
    /// The flat index (`row * width + column`) of each prediction's position, int64 `[N]`.
    pub predict_positions: Tensor,
    /// The response token each prediction is scored on, int64 `[N]`.
    pub predict_targets: Tensor,
    /// The sample (numbered over the micro-batch, in row-major order) of each prediction.
    pub predict_samples: Tensor,
    /// Predictions, which is to say response tokens (`N`).
    pub loss_tokens: usize,
    /// The flat index of each sample's last token, int64 `[samples]`.
    pub last_positions: Tensor,
    /// Every row holds one sample (no mask beyond causality is needed).
    pub one_per_row: bool,
    /// Samples in the micro-batch.
    pub num_samples: usize,
}

/// What [`row_tensors`] fills in, on the host.
#[derive(Default)]
struct Layout {
    ids: Vec<i64>,
    segments: Vec<i64>,
    branches: Vec<i64>,
    positions: Vec<i64>,
    predict: (Vec<i64>, Vec<i64>, Vec<i64>),
    last: Vec<i64>,
}

impl Layout {
    /// Lays `tokens` out from flat index `at` in segment `segment`, branch `branch`, positions
    /// from `first_position`.
    fn put(&mut self, at: usize, tokens: &[u32], segment: i64, branch: i64, first_position: usize) {
        for (k, &id) in tokens.iter().enumerate() {
            self.ids[at + k] = i64::from(id);
            self.segments[at + k] = segment;
            self.branches[at + k] = branch;
            self.positions[at + k] = (first_position + k) as i64;
        }
    }

    /// Sample `index` predicts `targets` from the flat positions `from` (one each).
    fn predict(&mut self, index: usize, from: impl Iterator<Item = usize>, targets: &[u32]) {
        for (position, &target) in from.zip(targets) {
            self.predict.0.push(position as i64);
            self.predict.1.push(i64::from(target));
            self.predict.2.push(index as i64);
        }
    }
}

/// Builds the tensors of `rows` on `device`.
pub fn row_tensors(rows: &[PackedRow], device: Device) -> Result<RowTensors> {
    let width = rows.iter().map(PackedRow::len).max().unwrap_or(0);
    if rows.is_empty() || width == 0 {
        return Err(TrainError::Data("a micro-batch needs at least one token".into()));
    }
    let n = rows.len() * width;
    let mut l = Layout {
        ids: vec![0; n],
        segments: vec![0; n],
        branches: vec![0; n],
        positions: vec![0; n],
        ..Layout::default()
    };
    let shared = rows.iter().any(|r| r.shared_prompts);
    for (r, row) in rows.iter().enumerate() {
        let mut at = r * width;
        if row.shared_prompts {
            for (p, pair) in row.samples.chunks(2).enumerate() {
                let [chosen, rejected] = pair else {
                    return Err(TrainError::Data("a shared-prompt row holds an odd sample".into()));
                };
                let prompt = chosen.prompt_len;
                let (c, rj) = (&chosen.ids[prompt..], &rejected.ids[prompt..]);
                let segment = p as i64 + 1;
                l.put(at, &chosen.ids[..prompt], segment, 0, 0);
                l.put(at + prompt, c, segment, 1, prompt);
                l.put(at + prompt + c.len(), rj, segment, 2, prompt);
                // Each response's first token is predicted from the prompt's last one.
                let index = l.last.len();
                let before_c = at + prompt - 1;
                l.predict(
                    index,
                    (0..c.len()).map(|k| if k == 0 { before_c } else { before_c + 1 + k - 1 }),
                    c,
                );
                let rejected_start = at + prompt + c.len();
                l.predict(
                    index + 1,
                    (0..rj.len()).map(|k| if k == 0 { before_c } else { rejected_start + k - 1 }),
                    rj,
                );
                l.last.push((at + prompt + c.len()).max(1) as i64 - 1);
                l.last.push((rejected_start + rj.len()).max(1) as i64 - 1);
                at += prompt + c.len() + rj.len();
            }
            continue;
        }
        for (s, sample) in row.samples.iter().enumerate() {
            let len = sample.ids.len();
            l.put(at, &sample.ids, s as i64 + 1, 0, 0);
            // Position i predicts token i + 1: a loss where that token is a response's.
            let first = sample.prompt_len.max(1);
            let index = l.last.len();
            l.predict(
                index,
                (first - 1..len.saturating_sub(1)).map(|i| at + i),
                &sample.ids[first.min(len)..],
            );
            l.last.push((at + len.max(1) - 1) as i64);
            at += len;
        }
    }
    let shape = [rows.len() as i64, width as i64];
    let grid = |v: &[i64]| -> Result<Tensor> {
        Ok(Tensor::from_slice(v).f_view(shape)?.f_to_device(device)?)
    };
    let flat = |v: &[i64]| -> Result<Tensor> { Ok(Tensor::from_slice(v).f_to_device(device)?) };
    Ok(RowTensors {
        input_ids: grid(&l.ids)?,
        segment_ids: grid(&l.segments)?,
        branch_ids: if shared { Some(grid(&l.branches)?) } else { None },
        position_ids: if shared { Some(grid(&l.positions)?) } else { None },
        predict_positions: flat(&l.predict.0)?,
        predict_targets: flat(&l.predict.1)?,
        predict_samples: flat(&l.predict.2)?,
        loss_tokens: l.predict.0.len(),
        last_positions: flat(&l.last)?,
        one_per_row: !shared && rows.iter().all(|r| r.samples.len() == 1),
        num_samples: l.last.len(),
    })
}

impl RowTensors {
    /// The final hidden states `[rows, width, hidden]` of `backbone` over these rows.
    pub fn hidden(&self, backbone: &rtrun_rlhf_model::Backbone) -> Result<Tensor> {
        Ok(backbone.forward_rows(
            &self.input_ids,
            &self.segment_ids,
            self.branch_ids.as_ref(),
            self.position_ids.as_ref(),
            Some(self.one_per_row),
        )?)
    }

    /// `hidden: [rows, width, H]` at every prediction's position, `[N, H]`.
    pub fn at_predictions(&self, hidden: &Tensor) -> Result<Tensor> {
        let width = hidden.size()[2];
        Ok(hidden.f_reshape([-1, width])?.f_index_select(0, &self.predict_positions)?)
    }

    /// Sums `values: [N]` (one per prediction) per sample: `[num_samples]` float32 (with token
    /// log-probs: each response's log-likelihood).
    pub fn sum_per_sample(&self, values: &Tensor) -> Result<Tensor> {
        let device = values.device();
        let sums = Tensor::f_zeros([self.num_samples as i64], (Kind::Float, device))?;
        Ok(sums.f_scatter_add(0, &self.predict_samples, &values.f_to_kind(Kind::Float)?)?)
    }

    /// `per_position: [rows, width, ..]` at each sample's last token, `[num_samples, ..]`.
    pub fn at_last_tokens(&self, per_position: &Tensor) -> Result<Tensor> {
        let size = per_position.size();
        let mut flat: Vec<i64> = vec![size[0] * size[1]];
        flat.extend_from_slice(&size[2..]);
        Ok(per_position.f_reshape(flat.as_slice())?.f_index_select(0, &self.last_positions)?)
    }
}

/// Response tokens of every sample of `batches`.
pub fn loss_tokens(batches: &[Vec<PackedRow>]) -> usize {
    batches.iter().flatten().flat_map(|r| &r.samples).map(Sample::loss_tokens).sum()
}

/// The summed negative log-likelihood of the masked targets of `logits: [N, vocab]` (one row
/// per masked position, in order) as a float32 scalar.
pub fn nll_sum(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let log_probs = rtrun_rlhf_model::logprobs::token_log_probs(logits, targets)?;
    Ok(log_probs.f_sum(Kind::Float)?.f_neg()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize, prompt_len: usize, first: u32) -> Sample {
        Sample { ids: (first..first + len as u32).collect(), prompt_len }
    }

    #[test]
    fn ranks_get_balanced_tokens_and_keep_order() {
        let samples =
            vec![sample(9, 2, 0), sample(3, 1, 100), sample(5, 1, 200), sample(4, 1, 300)];
        let shares = split_over_ranks(samples.into_iter().map(|s| vec![s]).collect(), 2);
        let lens: Vec<Vec<usize>> =
            shares.iter().map(|s| s.iter().map(|x| x[0].ids.len()).collect()).collect();
        // 9 -> rank 0; 5 -> rank 1; 4 -> rank 1 (5 < 9); 3 -> rank 0 (9 = 9: the lower rank).
        assert_eq!(lens, vec![vec![9, 3], vec![5, 4]]);
    }

    #[test]
    fn packing_fits_first_and_never_exceeds_the_row() {
        let samples = vec![sample(5, 1, 0), sample(4, 1, 10), sample(3, 1, 20), sample(2, 1, 30)];
        let units: Vec<Unit> = samples.into_iter().map(|s| vec![s]).collect();
        let rows = pack(units.clone(), 8, true, false);
        let lens: Vec<Vec<usize>> =
            rows.iter().map(|r| r.samples.iter().map(|s| s.ids.len()).collect()).collect();
        assert_eq!(lens, vec![vec![5, 3], vec![4, 2]]);
        assert_eq!(pack(units, 8, false, false).len(), 4);
    }

    #[test]
    fn pairs_stay_whole_and_consecutive() {
        let pairs: Vec<Unit> = (0..3u32)
            .map(|i| vec![sample(3 + i as usize, 1, 10 * i), sample(2, 1, 100 + 10 * i)])
            .collect();
        // Unpacked: micro 2 counts pairs, so a micro-batch holds 4 rows, chosen then rejected.
        let batches = rank_batches(pairs.clone(), 1, 64, false, false, 2);
        let firsts: Vec<Vec<u32>> =
            batches[0].iter().map(|m| m.iter().map(|r| r.samples[0].ids[0]).collect()).collect();
        assert_eq!(firsts, vec![vec![0, 100, 10, 110], vec![20, 120]]);
        // Packed in rows of 9: a pair goes whole into a row (3 + 2, then 4 + 2 in a new row,
        // then 5 + 2 in another).
        let rows = pack(pairs, 9, true, false);
        let lens: Vec<Vec<usize>> =
            rows.iter().map(|r| r.samples.iter().map(|s| s.ids.len()).collect()).collect();
        assert_eq!(lens, vec![vec![3, 2], vec![4, 2], vec![5, 2]]);
    }

    #[test]
    fn tensors_predict_only_response_tokens_within_each_sample() {
        // Row: [10 11 | 12 13] (prompt 2 of 4) then [20 | 21] (prompt 1 of 2), width 6.
        let row = PackedRow::of(vec![
            Sample { ids: vec![10, 11, 12, 13], prompt_len: 2 },
            Sample { ids: vec![20, 21], prompt_len: 1 },
        ]);
        let short = PackedRow::of(vec![Sample { ids: vec![5, 6, 7], prompt_len: 1 }]);
        let t = row_tensors(&[row, short], Device::Cpu).unwrap();
        let v = |x: &Tensor| Vec::<i64>::try_from(x.to_kind(Kind::Int64).flatten(0, -1)).unwrap();
        assert_eq!(v(&t.segment_ids), vec![1, 1, 1, 1, 2, 2, 1, 1, 1, 0, 0, 0]);
        assert!(t.branch_ids.is_none() && t.position_ids.is_none());
        // 12 and 13 predicted at 1 and 2, 21 at 4; 6 and 7 at 6 and 7 (row 2 starts at 6).
        assert_eq!(v(&t.predict_positions), vec![1, 2, 4, 6, 7]);
        assert_eq!(v(&t.predict_targets), vec![12, 13, 21, 6, 7]);
        assert_eq!(v(&t.predict_samples), vec![0, 0, 1, 2, 2]);
        assert_eq!(t.loss_tokens, 5);
        assert_eq!(v(&t.last_positions), vec![3, 5, 8]);
        let ones = Tensor::ones([5], (Kind::Float, Device::Cpu));
        let sums = t.sum_per_sample(&ones).unwrap();
        assert_eq!(Vec::<f32>::try_from(&sums).unwrap(), vec![2.0, 1.0, 2.0]);
        let positions = Tensor::arange(12, (Kind::Float, Device::Cpu)).view([2, 6]);
        let last = t.at_last_tokens(&positions).unwrap();
        assert_eq!(Vec::<f32>::try_from(&last).unwrap(), vec![3.0, 5.0, 8.0]);
        assert_eq!(
            loss_tokens(&[vec![PackedRow::of(vec![Sample {
                ids: vec![1, 2, 3, 4],
                prompt_len: 2
            }])]]),
            2
        );
    }

    #[test]
    fn a_shared_prompt_pair_is_laid_out_once_with_both_responses_after_it() {
        // Prompt [1 2 3]; chosen response [4 5], rejected [6 7 8].
        let pair = vec![
            Sample { ids: vec![1, 2, 3, 4, 5], prompt_len: 3 },
            Sample { ids: vec![1, 2, 3, 6, 7, 8], prompt_len: 3 },
        ];
        let rows = pack(vec![pair.clone(), pair], 64, false, true);
        assert_eq!(rows.len(), 2);
        assert!(rows[0].shared_prompts && rows[0].len() == 8);
        let t = row_tensors(&rows[..1], Device::Cpu).unwrap();
        let v = |x: &Tensor| Vec::<i64>::try_from(x.to_kind(Kind::Int64).flatten(0, -1)).unwrap();
        assert_eq!(v(&t.input_ids), vec![1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(v(t.branch_ids.as_ref().unwrap()), vec![0, 0, 0, 1, 1, 2, 2, 2]);
        assert_eq!(v(t.position_ids.as_ref().unwrap()), vec![0, 1, 2, 3, 4, 3, 4, 5]);
        // Both responses' first tokens are predicted from the prompt's last (position 2).
        assert_eq!(v(&t.predict_positions), vec![2, 3, 2, 5, 6]);
        assert_eq!(v(&t.predict_targets), vec![4, 5, 6, 7, 8]);
        assert_eq!(v(&t.predict_samples), vec![0, 0, 1, 1, 1]);
        assert_eq!(v(&t.last_positions), vec![4, 7]);
        // Pairs whose prompts differ are laid out whole.
        let other = vec![
            Sample { ids: vec![1, 2, 4], prompt_len: 2 },
            Sample { ids: vec![1, 3, 4], prompt_len: 2 },
        ];
        assert!(!pack(vec![other], 64, false, true)[0].shared_prompts);
    }
}
