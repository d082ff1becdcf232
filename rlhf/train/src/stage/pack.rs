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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackedRow {
    /// The samples.
    pub samples: Vec<Sample>,
}

impl PackedRow {
    /// Tokens of the row.
    pub fn len(&self) -> usize {
        self.samples.iter().map(|s| s.ids.len()).sum()
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
/// consecutive.
pub fn pack(units: Vec<Unit>, max_len: usize, packing: bool) -> Vec<PackedRow> {
    let mut rows: Vec<PackedRow> = Vec::new();
    for unit in units {
        if !packing {
            rows.extend(unit.into_iter().map(|s| PackedRow { samples: vec![s] }));
            continue;
        }
        let len = unit_len(&unit);
        match rows.iter_mut().find(|r| r.len() + len <= max_len) {
            Some(row) => row.samples.extend(unit),
            None => rows.push(PackedRow { samples: unit }),
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
    micro: usize,
) -> Vec<Vec<Vec<PackedRow>>> {
    split_over_ranks(units, ranks)
        .into_iter()
        .map(|share| {
            let per_unit = share.first().map_or(1, Vec::len).max(1);
            let rows = if packing { micro } else { micro * per_unit };
            micro_batches(pack(share, max_len, packing), rows)
        })
        .collect()
}

/// The tensors of a micro-batch, all `[rows, width]` (right-padded to the longest row).
#[derive(Debug)]
pub struct RowTensors {
    /// Token ids (0 at padding).
    pub input_ids: Tensor,
    /// The sample each token belongs to, numbered from 1 in each row; 0 at padding.
    pub segment_ids: Tensor,
    /// The token each position predicts: the next one of the same sample (0 elsewhere).
    pub targets: Tensor,
    /// Where the loss applies: positions predicting a response token.
    pub loss_mask: Tensor,
    /// Response tokens of the micro-batch (true entries of `loss_mask`).
    pub loss_tokens: usize,
    /// The sample each position belongs to, numbered over the micro-batch in row-major order
    /// (`num_samples` at padding), int64.
    pub sample_index: Tensor,
    /// The flat index (`row * width + column`) of each sample's last token, int64 `[samples]`.
    pub last_positions: Tensor,
    /// Samples in the micro-batch.
    pub num_samples: usize,
}

/// Builds the tensors of `rows` on `device`.
pub fn row_tensors(rows: &[PackedRow], device: Device) -> Result<RowTensors> {
    let width = rows.iter().map(PackedRow::len).max().unwrap_or(0);
    if rows.is_empty() || width == 0 {
        return Err(TrainError::Data("a micro-batch needs at least one token".into()));
    }
    let n = rows.len() * width;
    let (mut ids, mut segments, mut targets) = (vec![0i64; n], vec![0i64; n], vec![0i64; n]);
    let mut mask = vec![false; n];
    let mut loss_tokens = 0;
    let num_samples: usize = rows.iter().map(|r| r.samples.len()).sum();
    let mut sample_index = vec![num_samples as i64; n];
    let mut last_positions = Vec::with_capacity(num_samples);
    for (r, row) in rows.iter().enumerate() {
        let mut at = r * width;
        for (s, sample) in row.samples.iter().enumerate() {
            let len = sample.ids.len();
            let index = last_positions.len() as i64;
            last_positions.push((at + len.max(1) - 1) as i64);
            for (i, &id) in sample.ids.iter().enumerate() {
                ids[at + i] = i64::from(id);
                sample_index[at + i] = index;
                segments[at + i] = s as i64 + 1;
                if i + 1 < len {
                    targets[at + i] = i64::from(sample.ids[i + 1]);
                    // Position i predicts token i + 1: a loss where that token is a response's.
                    if i + 1 >= sample.prompt_len {
                        mask[at + i] = true;
                        loss_tokens += 1;
                    }
                }
            }
            at += len;
        }
    }
    let shape = [rows.len() as i64, width as i64];
    let tensor = |v: &[i64]| -> Result<Tensor> {
        Ok(Tensor::from_slice(v).f_view(shape)?.f_to_device(device)?)
    };
    Ok(RowTensors {
        input_ids: tensor(&ids)?,
        segment_ids: tensor(&segments)?,
        targets: tensor(&targets)?,
        loss_mask: Tensor::from_slice(&mask).f_view(shape)?.f_to_device(device)?,
        loss_tokens,
        sample_index: tensor(&sample_index)?,
        last_positions: Tensor::from_slice(&last_positions).f_to_device(device)?,
        num_samples,
    })
}

impl RowTensors {
    /// The flat indices (`row * width + column`) of the positions the loss covers, in order.
    pub fn response_positions(&self) -> Result<Tensor> {
        Ok(self.loss_mask.f_flatten(0, -1)?.f_nonzero()?.f_squeeze_dim(1)?)
    }

    /// Sums `values: [N]`, one per position of [`RowTensors::response_positions`], per sample:
    /// `[num_samples]` float32 (with token log-probs: each response's log-likelihood).
    pub fn sum_per_sample(&self, positions: &Tensor, values: &Tensor) -> Result<Tensor> {
        let owners = self.sample_index.f_flatten(0, -1)?.f_index_select(0, positions)?;
        let device = values.device();
        let sums = Tensor::f_zeros([self.num_samples as i64], (Kind::Float, device))?;
        Ok(sums.f_scatter_add(0, &owners, &values.f_to_kind(Kind::Float)?)?)
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
        let rows = pack(units.clone(), 8, true);
        let lens: Vec<Vec<usize>> =
            rows.iter().map(|r| r.samples.iter().map(|s| s.ids.len()).collect()).collect();
        assert_eq!(lens, vec![vec![5, 3], vec![4, 2]]);
        assert_eq!(pack(units, 8, false).len(), 4);
    }

    #[test]
    fn pairs_stay_whole_and_consecutive() {
        let pairs: Vec<Unit> = (0..3u32)
            .map(|i| vec![sample(3 + i as usize, 1, 10 * i), sample(2, 1, 100 + 10 * i)])
            .collect();
        // Unpacked: micro 2 counts pairs, so a micro-batch holds 4 rows, chosen then rejected.
        let batches = rank_batches(pairs.clone(), 1, 64, false, 2);
        let firsts: Vec<Vec<u32>> =
            batches[0].iter().map(|m| m.iter().map(|r| r.samples[0].ids[0]).collect()).collect();
        assert_eq!(firsts, vec![vec![0, 100, 10, 110], vec![20, 120]]);
        // Packed in rows of 9: a pair goes whole into a row (3 + 2, then 4 + 2 in a new row,
        // then 5 + 2 in another).
        let rows = pack(pairs, 9, true);
        let lens: Vec<Vec<usize>> =
            rows.iter().map(|r| r.samples.iter().map(|s| s.ids.len()).collect()).collect();
        assert_eq!(lens, vec![vec![3, 2], vec![4, 2], vec![5, 2]]);
    }

    #[test]
    fn tensors_mask_only_response_predictions_within_each_sample() {
        // Row: [10 11 | 12 13] (prompt 2 of 4) then [20 | 21] (prompt 1 of 2), width 6.
        let row = PackedRow {
            samples: vec![
                Sample { ids: vec![10, 11, 12, 13], prompt_len: 2 },
                Sample { ids: vec![20, 21], prompt_len: 1 },
            ],
        };
        let short = PackedRow { samples: vec![Sample { ids: vec![5, 6, 7], prompt_len: 1 }] };
        let t = row_tensors(&[row, short], Device::Cpu).unwrap();
        let v = |x: &Tensor| Vec::<i64>::try_from(x.to_kind(Kind::Int64).flatten(0, -1)).unwrap();
        assert_eq!(v(&t.segment_ids), vec![1, 1, 1, 1, 2, 2, 1, 1, 1, 0, 0, 0]);
        assert_eq!(v(&t.targets), vec![11, 12, 13, 0, 21, 0, 6, 7, 0, 0, 0, 0]);
        // Predicting 12 and 13 (positions 1, 2), 21 (position 4); 6 and 7 (positions 0, 1).
        assert_eq!(v(&t.loss_mask), vec![0, 1, 1, 0, 1, 0, 1, 1, 0, 0, 0, 0]);
        assert_eq!(t.loss_tokens, 5);
        assert_eq!(v(&t.sample_index), vec![0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3]);
        assert_eq!(Vec::<i64>::try_from(&t.last_positions).unwrap(), vec![3, 5, 8]);
        let positions = t.response_positions().unwrap();
        assert_eq!(Vec::<i64>::try_from(&positions).unwrap(), vec![1, 2, 4, 6, 7]);
        let ones = Tensor::ones([5], (Kind::Float, Device::Cpu));
        let sums = t.sum_per_sample(&positions, &ones).unwrap();
        assert_eq!(Vec::<f32>::try_from(&sums).unwrap(), vec![2.0, 1.0, 2.0]);
        let positions = Tensor::arange(12, (Kind::Float, Device::Cpu)).view([2, 6]);
        let last = t.at_last_tokens(&positions).unwrap();
        assert_eq!(Vec::<f32>::try_from(&last).unwrap(), vec![3.0, 5.0, 8.0]);
        assert_eq!(
            loss_tokens(&[vec![PackedRow {
                samples: vec![Sample { ids: vec![1, 2, 3, 4], prompt_len: 2 }]
            }]]),
            2
        );
    }
}
