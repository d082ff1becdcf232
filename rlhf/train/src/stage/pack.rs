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

/// Splits samples over `ranks`, balancing tokens: longest first, each to the rank with the fewest
/// tokens so far (lowest rank on ties); each rank keeps its samples in their original order.
pub fn split_over_ranks(samples: Vec<Sample>, ranks: usize) -> Vec<Vec<Sample>> {
    let ranks = ranks.max(1);
    let mut order: Vec<usize> = (0..samples.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(samples[i].ids.len()), i));
    let mut load = vec![0usize; ranks];
    let mut owner = vec![0usize; samples.len()];
    for i in order {
        let rank = (0..ranks).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[rank] += samples[i].ids.len();
        owner[i] = rank;
    }
    let mut out: Vec<Vec<Sample>> = vec![Vec::new(); ranks];
    for (sample, rank) in samples.into_iter().zip(owner) {
        out[rank].push(sample);
    }
    out
}

/// Rows of at most `max_len` tokens: with `packing`, first fit in order (a sample goes into the
/// first row it fits in); without, one sample per row.
pub fn pack(samples: Vec<Sample>, max_len: usize, packing: bool) -> Vec<PackedRow> {
    let mut rows: Vec<PackedRow> = Vec::new();
    for sample in samples {
        let fits = if packing {
            rows.iter_mut().find(|r| r.len() + sample.ids.len() <= max_len)
        } else {
            None
        };
        match fits {
            Some(row) => row.samples.push(sample),
            None => rows.push(PackedRow { samples: vec![sample] }),
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

/// A rank's share of a global batch: its micro-batches of packed rows.
pub fn rank_batches(
    samples: Vec<Sample>,
    ranks: usize,
    max_len: usize,
    packing: bool,
    micro: usize,
) -> Vec<Vec<Vec<PackedRow>>> {
    split_over_ranks(samples, ranks)
        .into_iter()
        .map(|share| micro_batches(pack(share, max_len, packing), micro))
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
    for (r, row) in rows.iter().enumerate() {
        let mut at = r * width;
        for (s, sample) in row.samples.iter().enumerate() {
            let len = sample.ids.len();
            for (i, &id) in sample.ids.iter().enumerate() {
                ids[at + i] = i64::from(id);
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
    })
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
        let shares = split_over_ranks(samples, 2);
        let lens: Vec<Vec<usize>> =
            shares.iter().map(|s| s.iter().map(|x| x.ids.len()).collect()).collect();
        // 9 -> rank 0; 5 -> rank 1; 4 -> rank 1 (5 < 9); 3 -> rank 0 (9 = 9: the lower rank).
        assert_eq!(lens, vec![vec![9, 3], vec![5, 4]]);
    }

    #[test]
    fn packing_fits_first_and_never_exceeds_the_row() {
        let samples = vec![sample(5, 1, 0), sample(4, 1, 10), sample(3, 1, 20), sample(2, 1, 30)];
        let rows = pack(samples.clone(), 8, true);
        let lens: Vec<Vec<usize>> =
            rows.iter().map(|r| r.samples.iter().map(|s| s.ids.len()).collect()).collect();
        assert_eq!(lens, vec![vec![5, 3], vec![4, 2]]);
        assert_eq!(pack(samples, 8, false).len(), 4);
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
        assert_eq!(
            loss_tokens(&[vec![PackedRow {
                samples: vec![Sample { ids: vec![1, 2, 3, 4], prompt_len: 2 }]
            }]]),
            2
        );
    }
}
