//! The model runner: executes one scheduler step on a [`CausalLm`] with a paged KV cache.
//!
//! It reuses the model's public layers (norms, projections, RoPE, MLP) and replaces only the
//! attention read: new keys and values are written into their KV slots, then every query reads
//! its sequence's context through the block table ([`batch::StepBatch`] turns tables into gather
//! indices). Logits are computed only for the rows that are sampled.
//!
//! Model-sharding seam: a runner executes one [`ShardSpec`] of the model. Tensor parallelism
//! (a later issue) gives each shard `num_heads / world_size` attention heads and a slice of the
//! MLP, sizes the KV cache with the shard's key/value heads (already done through
//! [`KvCacheShape`]), and all-reduces the outputs of `o_proj` and `down_proj` at the two marked
//! points in [`ModelRunner::execute`]. Today only `world_size == 1` is accepted.

pub mod batch;
pub mod kv_cache;

use rtrun_rlhf_model::CausalLm;
use rtrun_rlhf_model::layers::Attention;
use tch::{Device, Kind, Tensor};

use crate::error::EngineError;
use batch::{AttentionGroup, StepBatch};
use kv_cache::{KvCache, KvCacheShape};

/// Which tensor-parallel shard of the model a runner executes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    /// This shard's rank in the tensor-parallel group.
    pub rank: usize,
    /// Shards in the group.
    pub world_size: usize,
}

impl ShardSpec {
    /// The whole model on one device.
    pub const WHOLE: ShardSpec = ShardSpec { rank: 0, world_size: 1 };
}

/// A model plus its paged KV cache.
#[derive(Debug)]
pub struct ModelRunner {
    model: CausalLm,
    shard: ShardSpec,
    cache_shape: KvCacheShape,
    cache: Option<KvCache>,
}

/// The index tensors of one attention group, on the model's device.
struct GroupTensors {
    batch: i64,
    q_len: i64,
    kv_len: i64,
    q_index: Tensor,
    kv_slots: Tensor,
    mask: Tensor,
    valid_slots: Tensor,
    valid_rows: Tensor,
    /// The group covers every packed row, one query each, in packed order: its output rows
    /// are the attention output as they are.
    identity: bool,
}

impl ModelRunner {
    /// A runner for `shard` of `model` with `block_size`-slot KV blocks (no cache allocated yet).
    pub fn new(model: CausalLm, shard: ShardSpec, block_size: usize) -> Result<Self, EngineError> {
        if shard.world_size != 1 || shard.rank != 0 {
            return Err(EngineError::InvalidConfig(format!(
                "tensor parallelism is not implemented yet: expected shard 0 of 1, found shard {} of {}",
                shard.rank, shard.world_size
            )));
        }
        if block_size == 0 {
            return Err(EngineError::InvalidConfig(
                "block_size must be at least 1, found 0".into(),
            ));
        }
        let config = model.config();
        let cache_shape = KvCacheShape {
            num_layers: model.backbone.layers.len(),
            num_kv_heads: config.num_key_value_heads / shard.world_size as i64,
            head_dim: config.head_dim,
            block_size,
            kind: model.params.kind(),
        };
        Ok(Self { model, shard, cache_shape, cache: None })
    }

    /// The model.
    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    /// The shard this runner executes.
    pub fn shard(&self) -> ShardSpec {
        self.shard
    }

    /// The device of the model and the cache.
    pub fn device(&self) -> Device {
        self.model.backbone.device()
    }

    /// Bytes one KV block takes.
    pub fn kv_bytes_per_block(&self) -> u64 {
        self.cache_shape.bytes_per_block()
    }

    /// Allocates (zeroed) a cache of `num_blocks` blocks, replacing any previous one.
    pub fn allocate_kv_cache(&mut self, num_blocks: usize) -> Result<(), EngineError> {
        self.cache = None;
        self.cache = Some(KvCache::allocate(&self.cache_shape, num_blocks, self.device())?);
        Ok(())
    }

    /// Frees the cache (its K/V content is lost).
    pub fn free_kv_cache(&mut self) {
        self.cache = None;
    }

    /// Whether a cache is allocated.
    pub fn has_kv_cache(&self) -> bool {
        self.cache.is_some()
    }

    /// Runs one step and returns the logits of the sampled rows as `[rows, vocab]` float32,
    /// row-major, in `batch.sample_rows` order.
    pub fn execute(&self, batch: &StepBatch) -> Result<Vec<f32>, EngineError> {
        let Some(cache) = self.cache_for(batch)? else {
            return Ok(Vec::new());
        };
        let logits = tch::no_grad(|| self.execute_inner(batch, cache))?;
        let logits = logits.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?.f_contiguous()?;
        Ok(Vec::<f32>::try_from(logits.f_view(-1)?)?)
    }

    /// Runs one step and picks every sampled row's most likely token on the device, with its
    /// log-prob (of the unscaled distribution): greedy decoding without copying `[rows,
    /// vocab]` logits to the host, which on a GPU costs more than the step itself at large
    /// vocabularies. Ties go to the lowest token id, as the host sampler's.
    pub fn execute_greedy(&self, batch: &StepBatch) -> Result<Vec<(u32, f32)>, EngineError> {
        let Some(cache) = self.cache_for(batch)? else {
            return Ok(Vec::new());
        };
        let (tokens, logprobs) = tch::no_grad(|| -> Result<(Tensor, Tensor), EngineError> {
            let logits = self.execute_inner(batch, cache)?.f_to_kind(Kind::Float)?;
            let tokens = logits.f_argmax(-1, true)?;
            let logprobs = logits.f_log_softmax(-1, Kind::Float)?.f_gather(-1, &tokens, false)?;
            Ok((tokens.f_to_device(Device::Cpu)?, logprobs.f_to_device(Device::Cpu)?))
        })?;
        let tokens = Vec::<i64>::try_from(tokens.f_view(-1)?)?;
        let logprobs = Vec::<f32>::try_from(logprobs.f_view(-1)?)?;
        Ok(tokens.into_iter().map(|t| t as u32).zip(logprobs).collect())
    }

    /// The cache a step runs with (an error while it is asleep), or `None` for an empty step.
    fn cache_for(&self, batch: &StepBatch) -> Result<Option<&KvCache>, EngineError> {
        let cache = self
            .cache
            .as_ref()
            .ok_or(EngineError::Asleep { operation: "a forward step", part: "kv cache" })?;
        Ok((batch.num_tokens() > 0).then_some(cache))
    }

    /// The forward step; logits of the sampled rows on the device, `[rows, vocab]`.
    fn execute_inner(&self, batch: &StepBatch, cache: &KvCache) -> Result<Tensor, EngineError> {
        let device = self.device();
        let index = |values: &[i64]| -> Result<Tensor, EngineError> {
            Ok(Tensor::f_from_slice(values)?.f_to_device(device)?)
        };
        let total = batch.num_tokens() as i64;
        let input_ids = index(&batch.input_ids)?.f_view([1, total])?;
        let positions = index(&batch.positions)?.f_view([1, total])?;
        let slots = index(&batch.slots)?;
        let groups = batch
            .groups
            .iter()
            .map(|g| group_tensors(g, total, device))
            .collect::<Result<Vec<_>, _>>()?;

        let backbone = &self.model.backbone;
        let mut hidden = Tensor::f_embedding(&backbone.embed_tokens, &input_ids, -1, false, false)?;
        let (cos, sin) = backbone.rotary.cos_sin(&positions, hidden.f_kind()?)?;
        for (layer, layer_cache) in backbone.layers.iter().zip(&cache.layers) {
            let attn = &layer.self_attn;
            let normed = layer.input_layernorm.forward(&hidden)?;
            let (q, k, v) = attn.project_qkv(&normed)?;
            let (q, k) = attn.rotate(&q, &k, &cos, &sin)?;
            // Every new K/V of this layer lands in the cache before any query reads it, which
            // lets a chunk read prefix blocks another chunk of the same step computes.
            layer_cache.write(&slots, &k, &v)?;
            let attended = paged_attention(attn, &q, layer_cache, &groups, total)?;
            let out = attn.project_output(&attended)?;
            // Tensor-parallel seam: all-reduce `out` across shards here.
            hidden = hidden.f_add(&out)?;
            let mlp = layer.mlp.forward(&layer.post_attention_layernorm.forward(&hidden)?)?;
            // Tensor-parallel seam: all-reduce `mlp` across shards here.
            hidden = hidden.f_add(&mlp)?;
        }
        let rows = hidden.f_squeeze_dim(0)?.f_index_select(0, &index(&batch.sample_rows)?)?;
        Ok(self.model.lm_logits(&backbone.norm.forward(&rows)?)?)
    }
}

fn group_tensors(
    g: &AttentionGroup,
    total: i64,
    device: Device,
) -> Result<GroupTensors, EngineError> {
    let index = |values: &[i64]| -> Result<Tensor, EngineError> {
        Ok(Tensor::f_from_slice(values)?.f_to_device(device)?)
    };
    let (batch, q_len, kv_len) = (g.batch as i64, g.q_len as i64, g.kv_len as i64);
    let identity = q_len == 1
        && batch == total
        && g.valid_rows.iter().enumerate().all(|(i, &row)| row == i as i64);
    Ok(GroupTensors {
        batch,
        q_len,
        kv_len,
        q_index: index(&g.q_index)?,
        kv_slots: index(&g.kv_slots)?,
        mask: Tensor::f_from_slice(&g.mask)?
            .f_view([batch, 1, q_len, kv_len])?
            .f_to_device(device)?,
        valid_slots: index(&g.valid_slots)?,
        valid_rows: index(&g.valid_rows)?,
        identity,
    })
}

/// Attention of the packed queries `q: [1, heads, T, head_dim]` over the cache, group by group;
/// returns `[1, T, heads * head_dim]`.
fn paged_attention(
    attn: &Attention,
    q: &Tensor,
    cache: &kv_cache::LayerCache,
    groups: &[GroupTensors],
    total: i64,
) -> Result<Tensor, EngineError> {
    let width = attn.num_heads * attn.head_dim;
    // [T, heads, head_dim]
    let q_rows = q.f_squeeze_dim(0)?.f_transpose(0, 1)?;
    let attend_group = |g: &GroupTensors| -> Result<Tensor, EngineError> {
        let qg = q_rows
            .f_index_select(0, &g.q_index)?
            .f_view([g.batch, g.q_len, attn.num_heads, attn.head_dim])?
            .f_permute([0, 2, 1, 3])?;
        let (k, v) = cache.gather(&g.kv_slots, g.batch, g.kv_len)?;
        Ok(attn.attend(&qg, &k, &v, Some(&g.mask))?.f_reshape([g.batch * g.q_len, width])?)
    };
    if let [only] = groups
        && only.identity
    {
        // A pure decode step: the group's rows already are the packed rows, in order.
        return Ok(attend_group(only)?.f_unsqueeze(0)?);
    }
    let mut attended = Tensor::f_zeros([total, width], (q.f_kind()?, q.device()))?;
    for g in groups {
        let out = attend_group(g)?;
        let _ =
            attended.f_index_copy_(0, &g.valid_rows, &out.f_index_select(0, &g.valid_slots)?)?;
    }
    Ok(attended.f_unsqueeze(0)?)
}
