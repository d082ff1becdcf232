//! Turning one scheduler step into the index tensors the model runner needs: the packed token
//! ids and positions of every scheduled chunk, the KV slot each new token writes, and the
//! padded gather indices and masks with which attention reads K/V through block tables.
//!
//! This is plain data built on the host (no tensors), so its layout is unit-testable.
//!
//! Layout: all chunks of a step are packed into one row of `T` tokens (the projections and the
//! MLP run on it once). Attention runs in *groups*: decodes (one query each) form one group and
//! prefill chunks the following ones (bounded in padded area), so a step that mixes a long
//! prefill with many decodes does not pad every decode to the prefill's length. Within a group, sequence `b` has `Q` query slots and
//! `L` key slots (the group's longest chunk and longest context); missing ones are padding.

use serde::{Deserialize, Serialize};

use crate::SequenceId;
use crate::block::BlockId;
use crate::error::EngineError;

/// One scheduled chunk together with what the runner needs to know about its sequence.
#[derive(Debug, Clone, Copy)]
pub struct ChunkView<'a> {
    /// The sequence.
    pub sequence: SequenceId,
    /// All tokens of the sequence (prompt then outputs so far).
    pub tokens: &'a [u32],
    /// First position computed in this step.
    pub start: usize,
    /// Positions computed in this step.
    pub num_tokens: usize,
    /// The sequence's block table.
    pub block_table: &'a [BlockId],
    /// Whether the chunk's last position is sampled.
    pub sample: bool,
}

/// The padded attention problem of one group of chunks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionGroup {
    /// Sequences in the group.
    pub batch: usize,
    /// Query slots per sequence (longest chunk).
    pub q_len: usize,
    /// Key slots per sequence (longest context).
    pub kv_len: usize,
    /// `[batch * q_len]` packed row of each query slot (0 for padding).
    pub q_index: Vec<i64>,
    /// `[batch * kv_len]` cache slot of each key position (0 for padding).
    pub kv_slots: Vec<i64>,
    /// `[batch * q_len * kv_len]`: query slot may attend key slot. A padding query may attend
    /// key 0 only, so no softmax row is empty (that would be NaN); its output is dropped.
    pub mask: Vec<bool>,
    /// Indices into `batch * q_len` of the real query slots, in packed order.
    pub valid_slots: Vec<i64>,
    /// The packed row of each real query slot (same order as `valid_slots`).
    pub valid_rows: Vec<i64>,
}

/// Everything the runner needs for one step (what a tensor-parallel engine's rank 0 sends its
/// other ranks once per step).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepBatch {
    /// `[T]` token id of each packed row.
    pub input_ids: Vec<i64>,
    /// `[T]` position of each packed row within its sequence.
    pub positions: Vec<i64>,
    /// `[T]` KV cache slot each packed row writes.
    pub slots: Vec<i64>,
    /// The attention groups (decodes, then prefills), covering every row exactly once.
    pub groups: Vec<AttentionGroup>,
    /// Packed rows whose logits are sampled.
    pub sample_rows: Vec<i64>,
    /// The sequence of each sampled row.
    pub sampled: Vec<SequenceId>,
}

impl StepBatch {
    /// Lays out the chunks of one step for a cache of `block_size`-slot blocks. Prefill chunks
    /// are grouped in order while a group's padded area `batch * q_len * kv_len` stays within
    /// `max_group_area` (a single larger chunk gets a group of its own): attention materialises
    /// scores of that area per head, and padding many short prompts to one long one wastes it.
    pub fn build(
        block_size: usize,
        max_group_area: usize,
        chunks: &[ChunkView<'_>],
    ) -> Result<Self, EngineError> {
        let mut batch = StepBatch::default();
        let mut offsets = Vec::with_capacity(chunks.len());
        for chunk in chunks {
            let end = chunk.start + chunk.num_tokens;
            let covered = chunk.block_table.len() * block_size;
            if end > covered || end > chunk.tokens.len() || chunk.num_tokens == 0 {
                return Err(EngineError::BlockTableTooShort {
                    sequence: chunk.sequence,
                    needed: end,
                    covered: covered.min(chunk.tokens.len()),
                });
            }
            offsets.push(batch.input_ids.len());
            for position in chunk.start..end {
                batch.input_ids.push(i64::from(chunk.tokens[position]));
                batch.positions.push(position as i64);
                batch.slots.push(slot(chunk.block_table, block_size, position));
            }
            if chunk.sample {
                batch.sample_rows.push((batch.input_ids.len() - 1) as i64);
                batch.sampled.push(chunk.sequence);
            }
        }
        let (decodes, prefills): (Vec<usize>, Vec<usize>) =
            (0..chunks.len()).partition(|&i| chunks[i].num_tokens == 1);
        if !decodes.is_empty() {
            batch.groups.push(group(block_size, chunks, &offsets, &decodes));
        }
        let mut members: Vec<usize> = Vec::new();
        let (mut q_len, mut kv_len) = (0, 0);
        for i in prefills {
            let (q, kv) = (chunks[i].num_tokens, chunks[i].start + chunks[i].num_tokens);
            let area = (members.len() + 1) * q_len.max(q) * kv_len.max(kv);
            if !members.is_empty() && area > max_group_area {
                batch.groups.push(group(block_size, chunks, &offsets, &members));
                members.clear();
                (q_len, kv_len) = (0, 0);
            }
            members.push(i);
            (q_len, kv_len) = (q_len.max(q), kv_len.max(kv));
        }
        if !members.is_empty() {
            batch.groups.push(group(block_size, chunks, &offsets, &members));
        }
        Ok(batch)
    }

    /// Packed rows in the step.
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }
}

/// The cache slot of `position` through a block table the caller checked covers it.
fn slot(block_table: &[BlockId], block_size: usize, position: usize) -> i64 {
    let block = block_table[position / block_size].0 as usize;
    (block * block_size + position % block_size) as i64
}

fn group(
    block_size: usize,
    chunks: &[ChunkView<'_>],
    offsets: &[usize],
    members: &[usize],
) -> AttentionGroup {
    let q_len = members.iter().map(|&i| chunks[i].num_tokens).max().unwrap_or(1);
    let kv_len = members.iter().map(|&i| chunks[i].start + chunks[i].num_tokens).max().unwrap_or(1);
    let batch = members.len();
    let mut g = AttentionGroup {
        batch,
        q_len,
        kv_len,
        q_index: Vec::with_capacity(batch * q_len),
        kv_slots: Vec::with_capacity(batch * kv_len),
        mask: Vec::with_capacity(batch * q_len * kv_len),
        valid_slots: Vec::new(),
        valid_rows: Vec::new(),
    };
    for (b, &i) in members.iter().enumerate() {
        let chunk = &chunks[i];
        let context = chunk.start + chunk.num_tokens;
        for q in 0..q_len {
            if q < chunk.num_tokens {
                let row = (offsets[i] + q) as i64;
                g.q_index.push(row);
                g.valid_slots.push((b * q_len + q) as i64);
                g.valid_rows.push(row);
                let query_position = chunk.start + q;
                g.mask.extend((0..kv_len).map(|k| k <= query_position));
            } else {
                g.q_index.push(0);
                g.mask.extend((0..kv_len).map(|k| k == 0));
            }
        }
        g.kv_slots.extend(
            (0..kv_len)
                .map(|k| if k < context { slot(chunk.block_table, block_size, k) } else { 0 }),
        );
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RequestId;
    use proptest::prelude::*;

    fn seq(i: u64) -> SequenceId {
        SequenceId { request: RequestId(i), sample_index: 0 }
    }

    #[test]
    fn decodes_and_prefills_form_separate_padded_groups() {
        let tokens_a = [10, 11, 12, 13, 14];
        let tokens_b = [20, 21, 22];
        let table_a = [BlockId(3), BlockId(1)];
        let table_b = [BlockId(0)];
        let chunks = [
            // A decodes position 4 (its fifth token), block 1 slot 0.
            ChunkView {
                sequence: seq(0),
                tokens: &tokens_a,
                start: 4,
                num_tokens: 1,
                block_table: &table_a,
                sample: true,
            },
            // B prefills positions 1..3.
            ChunkView {
                sequence: seq(1),
                tokens: &tokens_b,
                start: 1,
                num_tokens: 2,
                block_table: &table_b,
                sample: true,
            },
        ];
        let batch = StepBatch::build(4, usize::MAX, &chunks).unwrap();
        assert_eq!(batch.input_ids, vec![14, 21, 22]);
        assert_eq!(batch.positions, vec![4, 1, 2]);
        assert_eq!(batch.slots, vec![4, 1, 2]);
        assert_eq!(batch.sample_rows, vec![0, 2]);
        assert_eq!(batch.groups.len(), 2);
        let decode = &batch.groups[0];
        assert_eq!((decode.batch, decode.q_len, decode.kv_len), (1, 1, 5));
        assert_eq!(decode.kv_slots, vec![12, 13, 14, 15, 4]);
        assert_eq!(decode.mask, vec![true; 5]);
        let prefill = &batch.groups[1];
        assert_eq!((prefill.batch, prefill.q_len, prefill.kv_len), (1, 2, 3));
        assert_eq!(prefill.q_index, vec![1, 2]);
        assert_eq!(prefill.mask, vec![true, true, false, true, true, true]);
        assert_eq!(prefill.valid_rows, vec![1, 2]);
    }

    /// A random step: per chunk (start, num_tokens, extra context beyond the chunk, sample).
    fn arbitrary_chunks() -> impl Strategy<Value = Vec<(usize, usize, usize, bool)>> {
        prop::collection::vec((0usize..20, 1usize..6, 0usize..4, any::<bool>()), 1..8)
    }

    proptest! {
        /// Every packed row is a query of exactly one group; each real query sees exactly the
        /// positions up to its own, through the right slots; sampled rows are chunk ends.
        #[test]
        fn groups_cover_every_row_once_with_causal_masks(
            spec in arbitrary_chunks(),
            max_group_area in prop_oneof![Just(usize::MAX), 1usize..200],
        ) {
            let block_size = 4;
            let tokens: Vec<Vec<u32>> = spec
                .iter()
                .map(|&(start, n, extra, _)| (0..(start + n + extra) as u32).collect())
                .collect();
            // Block tables: block b of chunk i is `7 * i + b`, distinct everywhere.
            let tables: Vec<Vec<BlockId>> = tokens
                .iter()
                .enumerate()
                .map(|(i, t)| (0..t.len().div_ceil(block_size)).map(|b| BlockId((7 * i + b) as u32 * 3)).collect())
                .collect();
            let chunks: Vec<ChunkView<'_>> = spec
                .iter()
                .enumerate()
                .map(|(i, &(start, num_tokens, _, sample))| ChunkView {
                    sequence: seq(i as u64),
                    tokens: &tokens[i],
                    start,
                    num_tokens,
                    block_table: &tables[i],
                    sample,
                })
                .collect();
            let batch = StepBatch::build(block_size, max_group_area, &chunks).unwrap();
            let total = batch.num_tokens();
            prop_assert_eq!(total, spec.iter().map(|s| s.1).sum::<usize>());
            let mut seen = vec![0; total];
            // Packed row where each chunk starts.
            let starts: Vec<usize> = spec
                .iter()
                .scan(0usize, |next, &(_, n, _, _)| { let s = *next; *next += n; Some(s) })
                .collect();
            for g in &batch.groups {
                prop_assert_eq!(g.q_index.len(), g.batch * g.q_len);
                prop_assert_eq!(g.kv_slots.len(), g.batch * g.kv_len);
                prop_assert_eq!(g.mask.len(), g.batch * g.q_len * g.kv_len);
                for (&slot, &row) in g.valid_slots.iter().zip(&g.valid_rows) {
                    let row = row as usize;
                    seen[row] += 1;
                    prop_assert_eq!(g.q_index[slot as usize], row as i64);
                    let b = slot as usize / g.q_len;
                    let mask = &g.mask[slot as usize * g.kv_len..(slot as usize + 1) * g.kv_len];
                    let position = batch.positions[row] as usize;
                    for (k, &allowed) in mask.iter().enumerate() {
                        prop_assert_eq!(allowed, k <= position);
                        if allowed {
                            // The key slot holds position k of the query's own sequence.
                            let owner = starts.iter().rposition(|&s| s <= row).unwrap();
                            let block = tables[owner][k / block_size].0 as usize;
                            let expected = (block * block_size + k % block_size) as i64;
                            prop_assert_eq!(g.kv_slots[b * g.kv_len + k], expected);
                        }
                    }
                }
                for q in 0..g.batch * g.q_len {
                    let row = &g.mask[q * g.kv_len..(q + 1) * g.kv_len];
                    prop_assert!(row.iter().any(|&m| m), "no softmax row may be empty");
                }
            }
            prop_assert!(seen.iter().all(|&c| c == 1), "{:?}", seen);
            for g in batch.groups.iter().filter(|g| g.batch > 1 && g.q_len > 1) {
                prop_assert!(g.batch * g.q_len * g.kv_len <= max_group_area);
            }
            let expected_samples: Vec<i64> = spec
                .iter()
                .scan(0usize, |end, &(_, n, _, _)| { *end += n; Some(*end) })
                .zip(&spec)
                .filter(|(_, s)| s.3)
                .map(|(end, _)| end as i64 - 1)
                .collect();
            prop_assert_eq!(&batch.sample_rows, &expected_samples);
        }
    }

    #[test]
    fn padding_queries_attend_only_key_zero_and_a_short_table_is_an_error() {
        let tokens = [1, 2, 3, 4];
        let table = [BlockId(0)];
        let chunks = [
            ChunkView {
                sequence: seq(0),
                tokens: &tokens,
                start: 0,
                num_tokens: 3,
                block_table: &table,
                sample: false,
            },
            ChunkView {
                sequence: seq(1),
                tokens: &tokens,
                start: 0,
                num_tokens: 2,
                block_table: &table,
                sample: true,
            },
        ];
        let batch = StepBatch::build(4, usize::MAX, &chunks).unwrap();
        let g = &batch.groups[0];
        assert_eq!(g.q_index, vec![0, 1, 2, 3, 4, 0]);
        assert_eq!(&g.mask[15..18], &[true, false, false]);
        assert_eq!(g.valid_slots, vec![0, 1, 2, 3, 4]);
        let too_long = [ChunkView { num_tokens: 4, start: 1, ..chunks[0] }];
        assert!(matches!(
            StepBatch::build(4, usize::MAX, &too_long),
            Err(EngineError::BlockTableTooShort { needed: 5, .. })
        ));
    }
}
