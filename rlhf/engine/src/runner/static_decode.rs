//! The static-shape decode step (issue 42): a step of decodes only runs at one of a few batch
//! sizes ([`DECODE_BUCKETS`]), padded up to the next, over inputs of fixed shapes that live in
//! preallocated device tensors ([`DecodeInputs`]): token ids, positions, the slot each row
//! writes, a block table of a fixed width and the context lengths. Everything else (the slots
//! a row reads, the attention mask, the RoPE rows) is computed from those on the device, inside
//! the step, so the step reads nothing from the host and allocates at fixed sizes: what a CUDA
//! graph captures once per bucket and replays (`runner/graph.rs`, with the `cuda` feature).
//!
//! Padding rows decode token 0 at position 0 of the KV cache's scratch block
//! ([`KvCache::scratch_block`]), which no sequence owns, with a context of one key; their
//! logits are dropped. The block table's width is the batch's longest context in blocks
//! rounded up to a power of two, so a bucket has a handful of widths rather than one per
//! context length; a row reads `width * block_size` keys and masks those past its context.
//!
//! Attention multiplies each key/value head's queries at once (the runner's `decode_attention`):
//! no `repeat_kv` copy of the keys for grouped-query attention.
//!
//! The same code runs eagerly on the CPU, where it is tested for token identity with the
//! paged step; there the decode lanes ([`super::decode_lanes`]) stay the default, as they read
//! only each sequence's own keys (see `docs/engine.md`).

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::kv_cache::KvCache;
use super::{ModelRunner, decode_attention, is_packed_decode, last_contiguous};
use crate::error::EngineError;
use crate::runner::batch::StepBatch;

/// The batch sizes a static decode step runs at (vLLM's capture sizes up to 256); a step of
/// more rows runs the paged step.
pub const DECODE_BUCKETS: [i64; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// The bucket of a step of `rows` decodes: the smallest of [`DECODE_BUCKETS`] that holds them.
pub fn bucket_for(rows: usize) -> Option<i64> {
    DECODE_BUCKETS.iter().copied().find(|&bucket| bucket >= rows as i64)
}

/// The block-table width (in blocks) of a step whose longest context takes `blocks` blocks:
/// the next power of two.
pub fn width_for(blocks: i64) -> i64 {
    (blocks.max(1) as u64).next_power_of_two() as i64
}

/// What the static decode steps did (in `EngineStats::static_decode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StaticDecodeStats {
    /// Steps run as static decode steps (eagerly or by a graph).
    pub steps: u64,
    /// Of those, steps run by replaying a captured CUDA graph.
    pub graph_replays: u64,
    /// CUDA graphs captured (one per bucket and block-table width used).
    pub graphs_captured: u64,
    /// Captures that failed (those shapes then run eagerly; the reason is logged).
    pub capture_failures: u64,
    /// Device memory the captures reserved (the caching allocator's growth across them).
    pub graph_memory_bytes: u64,
}

/// A static step's shape: its bucket of rows and its block-table width in blocks.
pub type DecodeShape = (i64, i64);

/// The fixed-shape inputs of one [`DecodeShape`], on the model's device. A step copies its
/// values in ([`DecodeInputs::load`]) and the step body reads only these tensors.
#[derive(Debug)]
pub struct DecodeInputs {
    /// Rows (the bucket).
    pub rows: i64,
    /// Block-table width in blocks.
    pub width: i64,
    /// `[rows]` token ids.
    pub input_ids: Tensor,
    /// `[rows]` positions.
    pub positions: Tensor,
    /// `[rows]` the cache slot each row writes.
    pub write_slots: Tensor,
    /// `[rows, width]` block ids.
    pub block_tables: Tensor,
    /// `[rows]` keys each row reads (its position plus one).
    pub context_lens: Tensor,
}

/// One step's values for a [`DecodeInputs`], on the host.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct HostInputs {
    /// `[rows]` token ids.
    pub input_ids: Vec<i64>,
    /// `[rows]` positions.
    pub positions: Vec<i64>,
    /// `[rows]` slots written.
    pub write_slots: Vec<i64>,
    /// `[rows * width]` block ids.
    pub block_tables: Vec<i64>,
    /// `[rows]` context lengths.
    pub context_lens: Vec<i64>,
}

impl DecodeInputs {
    /// Zeroed inputs of `shape` on `device`.
    pub fn new((rows, width): DecodeShape, device: Device) -> Result<Self, EngineError> {
        let zeros = |size: &[i64]| Tensor::f_zeros(size, (Kind::Int64, device));
        Ok(Self {
            rows,
            width,
            input_ids: zeros(&[rows])?,
            positions: zeros(&[rows])?,
            write_slots: zeros(&[rows])?,
            block_tables: zeros(&[rows, width])?,
            context_lens: Tensor::f_ones([rows], (Kind::Int64, device))?,
        })
    }

    /// Copies `host` into the tensors in place (their addresses stay what a captured graph
    /// reads).
    pub fn load(&mut self, host: &HostInputs) -> Result<(), EngineError> {
        let copy = |target: &Tensor, values: &[i64]| -> Result<(), EngineError> {
            let source = Tensor::f_from_slice(values)?.f_view(target.size().as_slice())?;
            target.shallow_clone().f_copy_(&source)?;
            Ok(())
        };
        copy(&self.input_ids, &host.input_ids)?;
        copy(&self.positions, &host.positions)?;
        copy(&self.write_slots, &host.write_slots)?;
        copy(&self.block_tables, &host.block_tables)?;
        copy(&self.context_lens, &host.context_lens)?;
        Ok(())
    }
}

/// The static step's shape and host inputs for `batch`, or `None` when `batch` is not a step
/// of decodes only that a bucket holds, or its longest context is past `max_blocks` blocks.
pub fn host_inputs(
    batch: &StepBatch,
    block_size: i64,
    scratch_block: i64,
    max_blocks: i64,
) -> Option<(DecodeShape, HostInputs)> {
    let total = batch.num_tokens();
    let [group] = batch.groups.as_slice() else { return None };
    let in_order = batch.sample_rows.iter().enumerate().all(|(i, &row)| row == i as i64);
    if !is_packed_decode(group, total as i64) || batch.sample_rows.len() != total || !in_order {
        return None;
    }
    let rows = bucket_for(total)?;
    let blocks_of = |context: i64| (context + block_size - 1) / block_size;
    let longest = batch.positions.iter().map(|&p| blocks_of(p + 1)).max().unwrap_or(1);
    let width = width_for(longest);
    if width > max_blocks.max(1) {
        return None;
    }
    let mut host = HostInputs {
        input_ids: batch.input_ids.clone(),
        positions: batch.positions.clone(),
        write_slots: batch.slots.clone(),
        block_tables: Vec::with_capacity((rows * width) as usize),
        context_lens: batch.positions.iter().map(|&p| p + 1).collect(),
    };
    let kv_len = group.kv_len as i64;
    for (row, &position) in batch.positions.iter().enumerate() {
        let first_slot = row as i64 * kv_len;
        for block in 0..width {
            let key = block * block_size;
            host.block_tables.push(match key <= position {
                true => group.kv_slots[(first_slot + key) as usize] / block_size,
                false => scratch_block,
            });
        }
    }
    let padding = (rows - total as i64) as usize;
    let scratch_slot = scratch_block * block_size;
    host.input_ids.extend(std::iter::repeat_n(0, padding));
    host.positions.extend(std::iter::repeat_n(0, padding));
    host.write_slots.extend(std::iter::repeat_n(scratch_slot, padding));
    host.context_lens.extend(std::iter::repeat_n(1, padding));
    host.block_tables.extend(std::iter::repeat_n(scratch_block, padding * width as usize));
    Some(((rows, width), host))
}

impl ModelRunner {
    /// What the static decode steps did so far.
    pub fn static_decode_stats(&self) -> StaticDecodeStats {
        *self.static_stats.borrow()
    }

    /// The static step's shape and inputs for `batch`, when the runner runs static decode
    /// steps and `batch` is one.
    pub(super) fn static_step(
        &self,
        batch: &StepBatch,
        cache: &KvCache,
    ) -> Option<(DecodeShape, HostInputs)> {
        if !self.static_decode || self.tp.is_some() || self.model.config().sliding_window.is_some()
        {
            return None;
        }
        let block_size = self.cache_shape.block_size as i64;
        host_inputs(batch, block_size, cache.scratch_block(), cache.num_blocks as i64)
    }

    /// The static decode step over `inputs`: logits of every row (padding included), `[rows,
    /// vocab]` on the device. It reads only `inputs`, the weights and the cache, and writes
    /// only the rows' keys and values into the cache.
    pub(super) fn static_forward(
        &self,
        inputs: &DecodeInputs,
        cache: &KvCache,
    ) -> Result<Tensor, EngineError> {
        let device = self.device();
        let backbone = &self.model.backbone;
        let (rows, width) = (inputs.rows, inputs.width);
        let block_size = self.cache_shape.block_size as i64;
        let keys = width * block_size;
        let (heads, kv_heads, head_dim) = {
            let attn = &backbone.layers[0].self_attn;
            (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        };
        let kind = self.model.params.kind();
        // `[rows, keys]` the slot of every key a row may read: its blocks' slots in order.
        let offsets = Tensor::f_arange(block_size, (Kind::Int64, device))?;
        let slots = inputs
            .block_tables
            .f_unsqueeze(-1)?
            .f_mul_scalar(block_size)?
            .f_add(&offsets)?
            .f_view([rows, keys])?;
        // Head-major cache rows (`KvCache::head_major`): `[kv_heads, rows, keys]` to read and
        // `[kv_heads, rows]` to write.
        let head_starts = Tensor::f_arange(kv_heads, (Kind::Int64, device))?
            .f_mul_scalar(cache.slots_per_head())?;
        let read_rows =
            head_starts.f_view([kv_heads, 1, 1])?.f_add(&slots.f_unsqueeze(0)?)?.f_view([-1])?;
        let write_rows = head_starts
            .f_view([kv_heads, 1])?
            .f_add(&inputs.write_slots.f_unsqueeze(0)?)?
            .f_view([-1])?;
        // 0 where a row may read a key, -inf past its context: `[kv_heads * rows, 1, keys]`.
        let key_index = Tensor::f_arange(keys, (Kind::Int64, device))?.f_unsqueeze(0)?;
        let past = key_index.f_ge_tensor(&inputs.context_lens.f_unsqueeze(1)?)?;
        let additive = Tensor::f_zeros([rows, keys], (kind, device))?
            .f_masked_fill(&past, f64::NEG_INFINITY)?
            .f_unsqueeze(0)?
            .f_expand([kv_heads, rows, keys], false)?
            .f_reshape([kv_heads * rows, 1, keys])?;
        let (cos, sin) = match &self.rope_table {
            Some((cos, sin)) => (
                cos.f_index_select(0, &inputs.positions)?,
                sin.f_index_select(0, &inputs.positions)?,
            ),
            None => {
                let (cos, sin) =
                    backbone.rotary.cos_sin(&inputs.positions.f_view([1, rows])?, kind)?;
                (cos.f_view([rows, head_dim])?, sin.f_view([rows, head_dim])?)
            }
        };
        let (cos, sin) = (cos.f_view([rows, 1, head_dim])?, sin.f_view([rows, 1, head_dim])?);

        let mut hidden =
            Tensor::f_embedding(&backbone.embed_tokens, &inputs.input_ids, -1, false, false)?;
        let mut pending: Option<Tensor> = None;
        for (index, (layer, layer_cache)) in backbone.layers.iter().zip(&cache.layers).enumerate() {
            let attn = &layer.self_attn;
            let normed = self.add_norm(&layer.input_layernorm, &mut hidden, pending.take())?;
            let as_heads = |t: Tensor, n: i64| t.f_reshape([rows, n, head_dim]);
            let (q, k, v) = match self.fused.get(index) {
                Some(fused) => {
                    let qkv = self.linear(&fused.qkv, &normed)?;
                    (
                        as_heads(qkv.f_narrow(1, 0, heads * head_dim)?, heads)?,
                        as_heads(
                            qkv.f_narrow(1, heads * head_dim, kv_heads * head_dim)?,
                            kv_heads,
                        )?,
                        as_heads(
                            qkv.f_narrow(1, (heads + kv_heads) * head_dim, kv_heads * head_dim)?,
                            kv_heads,
                        )?,
                    )
                }
                None => (
                    as_heads(self.linear(&attn.q_proj, &normed)?, heads)?,
                    as_heads(self.linear(&attn.k_proj, &normed)?, kv_heads)?,
                    as_heads(self.linear(&attn.v_proj, &normed)?, kv_heads)?,
                ),
            };
            let (q, k) = match (&attn.q_norm, &attn.k_norm) {
                (Some(q_norm), Some(k_norm)) => {
                    (self.head_norm(q_norm, &q)?, self.head_norm(k_norm, &k)?)
                }
                _ => (q, k),
            };
            let q = rtrun_rlhf_model::rope::apply_rotary(&q, &cos, &sin)?;
            let k = rtrun_rlhf_model::rope::apply_rotary(&k, &cos, &sin)?;
            let head_major = |t: &Tensor| t.f_permute([1, 0, 2])?.f_contiguous();
            layer_cache.write(&write_rows, &head_major(&k)?, &head_major(&v)?)?;
            let (keys_read, values_read) = layer_cache.gather(&read_rows, rows, keys)?;
            let q = match last_contiguous(&q) {
                true => q,
                false => q.f_contiguous()?,
            };
            let attended = decode_attention(attn, &q, &keys_read, &values_read, &additive, rows)?;
            let out = self.linear(&attn.o_proj, &attended)?;
            let normed = self.add_norm(&layer.post_attention_layernorm, &mut hidden, Some(out))?;
            let activated = self.mlp_activation(index, layer, &normed)?;
            pending = Some(self.linear(&layer.mlp.down_proj, &activated)?);
        }
        if let Some(mlp) = pending {
            hidden = hidden.f_add(&mlp)?;
        }
        let normed = self.norm(&backbone.norm, &hidden)?;
        match &self.model.lm_head {
            Some(head) => self.linear(head, &normed),
            None => self.linear_weight(&backbone.embed_tokens, None, &normed),
        }
    }

    /// Runs `batch` as a static decode step when it is one ([`ModelRunner::static_step`]):
    /// the logits of its rows, `[rows, vocab]` on the device (through a captured graph where
    /// one is, `runner/graph.rs`).
    pub(super) fn execute_static(
        &self,
        batch: &StepBatch,
        cache: &KvCache,
    ) -> Result<Option<Tensor>, EngineError> {
        let Some((shape, host)) = self.static_step(batch, cache) else {
            return Ok(None);
        };
        // The step writes the cache but not the decode lanes: they no longer match it.
        self.lanes.replace(None);
        let logits = self.run_static(shape, &host, cache)?;
        self.static_stats.borrow_mut().steps += 1;
        Ok(Some(logits.f_narrow(0, 0, batch.num_tokens() as i64)?))
    }

    /// The static step of `shape` over `host`, eagerly (on the CPU, or with
    /// `enforce_eager`).
    pub(super) fn run_static_eagerly(
        &self,
        shape: DecodeShape,
        host: &HostInputs,
        cache: &KvCache,
    ) -> Result<Tensor, EngineError> {
        let mut inputs = DecodeInputs::new(shape, self.device())?;
        inputs.load(host)?;
        self.static_forward(&inputs, cache)
    }

    /// Without CUDA graphs every static step runs eagerly.
    #[cfg(not(feature = "cuda"))]
    fn run_static(
        &self,
        shape: DecodeShape,
        host: &HostInputs,
        cache: &KvCache,
    ) -> Result<Tensor, EngineError> {
        self.run_static_eagerly(shape, host, cache)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_hold_every_batch_up_to_256_at_the_next_power_of_two() {
        assert_eq!(bucket_for(1), Some(1));
        assert_eq!(bucket_for(3), Some(4));
        assert_eq!(bucket_for(64), Some(64));
        assert_eq!(bucket_for(65), Some(128));
        assert_eq!(bucket_for(256), Some(256));
        assert_eq!(bucket_for(257), None);
        assert_eq!(width_for(0), 1);
        assert_eq!(width_for(5), 8);
    }
}
