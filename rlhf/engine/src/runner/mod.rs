//! The model runner: executes one scheduler step on a [`CausalLm`] with a paged KV cache.
//!
//! It reuses the model's public layers (norms, projections, RoPE, MLP) and replaces only the
//! attention read: new keys and values are written into their KV slots, then every query reads
//! its sequence's context through the block table ([`batch::StepBatch`] turns tables into gather
//! indices). Logits are computed only for the rows that are sampled.
//!
//! Tensor parallelism: a runner executes one [`ShardSpec`] of the model. A shard's model (built by
//! [`crate::tp::shard_model`]) has the rank's query and key/value heads and its slice of the
//! MLP, the KV cache holds that many key/value heads, and the partial outputs of `o_proj` and
//! `down_proj` are all-reduced over the group ([`crate::tp::TensorParallel`]) at the two points
//! marked in `execute_inner`. Only rank 0 computes logits.

pub mod batch;
pub(crate) mod cpu_kernels;
pub mod decode_lanes;
#[cfg(feature = "cuda")]
mod graph;
pub mod kv_cache;
pub mod static_decode;

use std::cell::RefCell;
use std::collections::HashMap;

use rtrun_rlhf_model::CausalLm;
use rtrun_rlhf_model::layers::{Attention, DecoderLayer, Linear, RmsNorm};
use rtrun_rlhf_model::rope::apply_rotary;
use tch::{Device, Kind, Tensor};

use crate::error::EngineError;
use crate::tp::TensorParallel;
use batch::{AttentionGroup, StepBatch};
use decode_lanes::{DecodeLanes, LaneStep};
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
    /// The tensor-parallel group, when the runner is one rank of several.
    tp: Option<TensorParallel>,
    cache_shape: KvCacheShape,
    cache: Option<KvCache>,
    /// Projections computed with the weight as the left operand (on the CPU, see
    /// [`ModelRunner::linear`]).
    weight_left: bool,
    /// RMSNorm, RoPE and SiLU-and-multiply run as the fused kernels of [`cpu_kernels`] (a
    /// float32 model on the CPU) where their input's rows are contiguous.
    fused_ops: bool,
    /// Large float32 projections go through oneDNN (on a CPU without AVX-512, where libtorch
    /// has oneDNN; see [`ModelRunner::linear`]).
    onednn: bool,
    /// Large float32 projections run [`cpu_kernels::gemm`] on weights packed into its panels
    /// (on a CPU with AVX-512; decision 060).
    gemm: bool,
    /// Per decoder layer, the projections that read the same input as one (on the CPU, see
    /// [`ModelRunner::fuse`]); empty when unfused.
    fused: Vec<FusedLayer>,
    /// The intra-op threads of a large step (libtorch's count when the runner was made).
    threads: i32,
    /// Multiply-adds per token (the parameter count).
    macs_per_token: i64,
    /// RoPE's `cos` and `sin` of every position below the model's maximum (capped at
    /// [`ROPE_TABLE_MAX`]), `[positions, head_dim]` each in the model's kind: a step looks its
    /// rows up instead of computing them (on the CPU).
    rope_table: Option<(Tensor, Tensor)>,
    /// The keys and values of the last decode step's sequences, contiguous (on the CPU, see
    /// [`decode_lanes`]); `None` after any other step.
    lanes: RefCell<Option<DecodeLanes>>,
    /// Whether decode steps use [`ModelRunner::lanes`] (off only to compare with the paged
    /// read in tests).
    use_lanes: bool,
    /// Whether decode steps on the lanes run [`cpu_kernels::decode_attention`] (a float32 model
    /// on a CPU with AVX2 and FMA) rather than libtorch's batched products.
    attention_kernel: bool,
    /// The weights [`ModelRunner::linear`] has packed for oneDNN, by [`WeightKey`], each with
    /// the in-place version of the weight it was packed from (a copy into the weight bumps
    /// the version, and the next product packs it again). Cleared whenever the weights'
    /// storage changes hands ([`ModelRunner::fuse`], [`ModelRunner::unfuse`]) or the engine
    /// updates them ([`ModelRunner::weights_changed`]).
    packed: RefCell<HashMap<WeightKey, PackedWeight>>,
    /// Whether steps of decodes only run the static-shape step ([`static_decode`]): the
    /// default on a GPU; on the CPU the decode lanes are faster (see `docs/engine.md`).
    static_decode: bool,
    /// Whether static decode steps run eagerly rather than as CUDA graphs
    /// (`EngineConfig::enforce_eager`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    enforce_eager: bool,
    /// What the static decode steps did.
    static_stats: RefCell<static_decode::StaticDecodeStats>,
    /// The static decode step's CUDA graphs.
    #[cfg(feature = "cuda")]
    graphs: RefCell<graph::Graphs>,
}

/// A weight matrix by its address, shape (`[out, in]`) and strides.
type WeightKey = (usize, i64, i64, i64, i64);

/// A weight packed for oneDNN.
#[derive(Debug)]
struct PackedWeight {
    /// The weight itself, held so that its memory cannot be freed and reused by another
    /// weight (which would then find this packing under its address).
    _weight: Tensor,
    /// The weight's in-place version when it was packed.
    version: i64,
    /// The packing.
    packed: Tensor,
}

/// One decoder layer's query/key/value projections, and its gate/up projections, each
/// concatenated along the output dimension. The model's own parameters are views into them.
#[derive(Debug)]
struct FusedLayer {
    qkv: Linear,
    gate_up: Linear,
}

/// The index tensors of one attention group, on the model's device.
struct GroupTensors {
    batch: i64,
    q_len: i64,
    kv_len: i64,
    q_index: Tensor,
    /// The [`KvCache::head_major`] rows of the group's key slots (`None` when the step reads
    /// its keys from the decode lanes).
    kv_rows: Option<Tensor>,
    mask: Tensor,
    valid_slots: Tensor,
    valid_rows: Tensor,
    /// The group's query slots are the step's packed rows in order ([`covers_packed_rows`]):
    /// its output rows are the attention output as they are.
    identity: bool,
    /// For a decode group on the CPU: the additive mask (0 or -inf) of
    /// [`decode_attention`], `[kv_heads * batch, 1, kv_len]`.
    additive: Option<Tensor>,
}

impl ModelRunner {
    /// A runner of `model` with `block_size`-slot KV blocks (no cache allocated yet): the whole
    /// model without `tp`, else the rank's shard of it ([`crate::tp::shard_model`]) whose
    /// partial outputs are all-reduced over `tp`.
    pub fn new(
        model: CausalLm,
        tp: Option<TensorParallel>,
        block_size: usize,
    ) -> Result<Self, EngineError> {
        let shard = match &tp {
            Some(tp) => ShardSpec { rank: tp.rank(), world_size: tp.world_size() },
            None => ShardSpec::WHOLE,
        };
        if block_size == 0 {
            return Err(EngineError::InvalidConfig(
                "block_size must be at least 1, found 0".into(),
            ));
        }
        let config = model.config();
        let cache_shape = KvCacheShape {
            num_layers: model.backbone.layers.len(),
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            block_size,
            kind: model.params.kind(),
        };
        let weight_left = model.backbone.device() == Device::Cpu;
        let gemm = weight_left && cpu_kernels::gemm_supported();
        let onednn = weight_left && !gemm && onednn_works();
        let fused_ops = weight_left && model.params.kind() == Kind::Float;
        let macs_per_token = model.params.numel();
        let mut runner = Self {
            model,
            shard,
            tp,
            cache_shape,
            cache: None,
            weight_left,
            fused_ops,
            onednn,
            gemm,
            fused: Vec::new(),
            threads: tch::get_num_threads(),
            macs_per_token,
            rope_table: None,
            lanes: RefCell::new(None),
            use_lanes: true,
            attention_kernel: fused_ops && cpu_kernels::decode_attention_supported(),
            packed: RefCell::new(HashMap::new()),
            static_decode: !weight_left,
            enforce_eager: false,
            static_stats: RefCell::default(),
            #[cfg(feature = "cuda")]
            graphs: RefCell::default(),
        };
        if runner.weight_left {
            runner.rope_table = Some(rope_table(&runner.model)?);
        }
        runner.fuse()?;
        Ok(runner)
    }

    /// Concatenates each layer's q/k/v projections and its gate/up projections into one weight
    /// each and points the model's parameters at views of them: a step then runs two products
    /// where it ran five (on a GPU, two kernel launches where it ran five), and a weight update
    /// that copies into the parameters (every transport does) lands in the fused weights. Call again after the parameters' storage was replaced (a
    /// wake-up); [`ModelRunner::unfuse`] before releasing it (a sleep). Layers whose q/k/v
    /// mix biased and unbiased projections stay unfused.
    pub fn fuse(&mut self) -> Result<(), EngineError> {
        self.fused.clear();
        self.packed.get_mut().clear();
        self.forget_graphs();
        let mut fused = Vec::new();
        for layer in &self.model.backbone.layers {
            let attn = &layer.self_attn;
            let (Some(qkv), Some(gate_up)) = (
                fuse_linears(&[&attn.q_proj, &attn.k_proj, &attn.v_proj])?,
                fuse_linears(&[&layer.mlp.gate_proj, &layer.mlp.up_proj])?,
            ) else {
                return Ok(());
            };
            fused.push(FusedLayer { qkv, gate_up });
        }
        self.fused = fused;
        Ok(())
    }

    /// Drops the fused weights (the parameters keep their views until their storage is
    /// replaced).
    pub fn unfuse(&mut self) {
        self.fused.clear();
        self.packed.get_mut().clear();
        self.forget_graphs();
    }

    /// Drops the static decode step's CUDA graphs: the weights or the cache they read moved.
    fn forget_graphs(&mut self) {
        #[cfg(feature = "cuda")]
        self.graphs.get_mut().clear();
    }

    /// Forgets the weights packed for oneDNN: the engine calls it after every weight update,
    /// whatever wrote the new values (a transport that writes the storage directly does not
    /// bump the weights' in-place versions).
    pub fn weights_changed(&mut self) {
        self.packed.get_mut().clear();
    }

    /// Turns the static-shape decode step ([`static_decode`]) on or off (on by default on a
    /// GPU, off on the CPU).
    pub fn set_static_decode(&mut self, on: bool) {
        self.static_decode = on;
    }

    /// Runs static decode steps eagerly (no CUDA graphs) when `on`.
    pub fn set_enforce_eager(&mut self, on: bool) {
        self.enforce_eager = on;
    }

    /// The model.
    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    /// The shard this runner executes.
    pub fn shard(&self) -> ShardSpec {
        self.shard
    }

    /// All-reduces issued by this rank and the bytes it contributed (zeros without tensor
    /// parallelism).
    pub fn tp_totals(&self) -> (u64, u64) {
        self.tp.as_ref().map_or((0, 0), TensorParallel::totals)
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
        self.forget_graphs();
        self.cache = None;
        *self.lanes.get_mut() = None;
        self.cache = Some(KvCache::allocate(&self.cache_shape, num_blocks, self.device())?);
        Ok(())
    }

    /// Frees the cache (its K/V content is lost).
    pub fn free_kv_cache(&mut self) {
        self.forget_graphs();
        self.cache = None;
        *self.lanes.get_mut() = None;
    }

    /// Whether a cache is allocated.
    pub fn has_kv_cache(&self) -> bool {
        self.cache.is_some()
    }

    /// Runs one step and returns the logits of the sampled rows as `[rows, vocab]` float32,
    /// row-major, in `batch.sample_rows` order.
    pub fn execute(&self, batch: &StepBatch) -> Result<Vec<f32>, EngineError> {
        let logits = self.execute_logits(batch)?;
        Ok(Vec::<f32>::try_from(logits.f_view(-1)?)?)
    }

    /// [`ModelRunner::execute`]'s logits as a contiguous float32 CPU tensor `[rows, vocab]`,
    /// which the engine's host sampler reads in place (`cpu_kernels::with_floats`) rather
    /// than copying them out.
    pub fn execute_logits(&self, batch: &StepBatch) -> Result<Tensor, EngineError> {
        let Some(cache) = self.cache_for(batch)? else {
            return Ok(Tensor::f_zeros([0], (Kind::Float, Device::Cpu))?);
        };
        self.choose_threads(batch);
        let logits = tch::no_grad(|| self.step_logits(batch, cache))?;
        Ok(logits.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?.f_contiguous()?)
    }

    /// Runs one step and samples every sampled row on the device
    /// ([`crate::sampling::device`]) under `rows` (in `batch.sample_rows` order): only the
    /// chosen tokens and their log-probs cross to the host. What the engine runs on a GPU.
    pub fn execute_sampled(
        &self,
        batch: &StepBatch,
        rows: &[crate::sampling::device::RowSampling<'_>],
    ) -> Result<Vec<crate::sampling::SampledToken>, EngineError> {
        let Some(cache) = self.cache_for(batch)? else {
            return Ok(Vec::new());
        };
        self.choose_threads(batch);
        tch::no_grad(|| crate::sampling::device::sample(&self.step_logits(batch, cache)?, rows))
    }

    /// On the CPU, runs a step of fewer than [`SMALL_STEP_MACS`] multiply-adds on one intra-op
    /// thread and a larger one on the runner's full count. A small step's operators take
    /// microseconds, and handing each to a second thread (waking it when it went to sleep
    /// between operators) costs more than it saves: the GRPO rollout of the walkthrough model
    /// (a ~100k-parameter policy, 128 sequences) generated a third faster on one thread.
    fn choose_threads(&self, batch: &StepBatch) {
        if !self.weight_left {
            return;
        }
        let macs = (batch.num_tokens() as i64).saturating_mul(self.macs_per_token);
        let wanted = if macs < SMALL_STEP_MACS { 1 } else { self.threads };
        if tch::get_num_threads() != wanted {
            tch::set_num_threads(wanted);
        }
    }

    /// The cache a step runs with (an error while it is asleep), or `None` for an empty step.
    fn cache_for(&self, batch: &StepBatch) -> Result<Option<&KvCache>, EngineError> {
        let cache = self
            .cache
            .as_ref()
            .ok_or(EngineError::Asleep { operation: "a forward step", part: "kv cache" })?;
        Ok((batch.num_tokens() > 0).then_some(cache))
    }

    /// The step's logits of its sampled rows on the device, `[rows, vocab]`: by the static
    /// decode step where it applies, else by the paged step.
    fn step_logits(&self, batch: &StepBatch, cache: &KvCache) -> Result<Tensor, EngineError> {
        match self.execute_static(batch, cache)? {
            Some(logits) => Ok(logits),
            None => self.execute_inner(batch, cache),
        }
    }

    /// The forward step; logits of the sampled rows on the device, `[rows, vocab]`.
    fn execute_inner(&self, batch: &StepBatch, cache: &KvCache) -> Result<Tensor, EngineError> {
        self.head(batch, &self.forward(batch, cache)?)
    }

    /// Runs one step on a tensor-parallel rank other than 0: its share of every layer (K/V
    /// written into its cache, partial outputs all-reduced with the other ranks), no logits.
    pub fn execute_shard(&self, batch: &StepBatch) -> Result<(), EngineError> {
        let Some(cache) = self.cache_for(batch)? else {
            return Ok(());
        };
        self.choose_threads(batch);
        tch::no_grad(|| self.forward(batch, cache).map(drop))
    }

    /// The all-reduce of a row-parallel projection's partial output over the tensor-parallel
    /// group (the output as it is without one).
    fn reduce(&self, partial: Tensor) -> Result<Tensor, EngineError> {
        match &self.tp {
            Some(tp) => tp.all_reduce(partial),
            None => Ok(partial),
        }
    }

    /// The decoder layers of one step: the last hidden states `[T, hidden]` (before the final
    /// norm), with every scheduled token's K/V written into the cache.
    fn forward(&self, batch: &StepBatch, cache: &KvCache) -> Result<Tensor, EngineError> {
        let device = self.device();
        let index = |values: &[i64]| -> Result<Tensor, EngineError> {
            Ok(Tensor::f_from_slice(values)?.f_to_device(device)?)
        };
        let total = batch.num_tokens() as i64;
        let input_ids = index(&batch.input_ids)?.f_view([1, total])?;
        let positions = index(&batch.positions)?.f_view([1, total])?;
        let slots = index(&cache.head_major(&batch.slots))?;
        let backbone = &self.model.backbone;
        let (heads, kv_heads, head_dim) = {
            let attn = &backbone.layers[0].self_attn;
            (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        };
        let decode_masks = self.weight_left.then_some((kv_heads, self.model.params.kind()));
        // A step of decodes only, on the CPU, reads keys and values from the lanes; any other
        // step drops them (it may write slots they hold).
        let mut lanes = match batch.groups.as_slice() {
            [g] if self.use_lanes && self.weight_left && is_packed_decode(g, total) => {
                Some(DecodeLanes::step(self.lanes.take(), &batch.positions, &g.kv_slots, g.kv_len)?)
            }
            _ => {
                self.lanes.replace(None);
                None
            }
        };
        let appending = lanes.as_ref().is_some_and(|step| step.append_at.is_some());
        let groups = batch
            .groups
            .iter()
            .map(|g| group_tensors(g, total, cache, device, decode_masks, !appending))
            .collect::<Result<Vec<_>, _>>()?;
        // Sliding-window layers read the same groups under masks limited to the window.
        let config = self.model.config();
        let sliding_groups = match &config.sliding_window {
            Some(window) => Some(
                batch
                    .groups
                    .iter()
                    .zip(&groups)
                    .map(|(g, tensors)| {
                        let mask = windowed_mask(g, window.size);
                        tensors.with_mask(&mask, device, decode_masks)
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            None => None,
        };

        // `[T, hidden]`: the step's tokens are one packed row, so the runner works on 2-D rows.
        let mut hidden = Tensor::f_embedding(&backbone.embed_tokens, &input_ids, -1, false, false)?
            .f_squeeze_dim(0)?;
        // The table's length once, not once per token (`size()` is a call and an allocation).
        let in_table = |table: &Tensor| {
            let rows = table.size()[0];
            batch.positions.iter().all(|&p| p < rows)
        };
        let (cos, sin) = match &self.rope_table {
            Some((cos, sin)) if in_table(cos) => {
                let flat = positions.f_view([total])?;
                (cos.f_index_select(0, &flat)?, sin.f_index_select(0, &flat)?)
            }
            _ => backbone.rotary.cos_sin(&positions, hidden.f_kind()?)?,
        };
        let (cos_rows, sin_rows) = (cos.f_view([total, head_dim])?, sin.f_view([total, head_dim])?);
        // `[T, 1, head_dim]`, broadcast over the heads of `[T, heads, head_dim]` rows.
        let (cos, sin) = (cos.f_view([total, 1, head_dim])?, sin.f_view([total, 1, head_dim])?);
        // The last layer's MLP output, added to `hidden` by the next layer's first norm.
        let mut pending: Option<Tensor> = None;
        for (index, (layer, layer_cache)) in backbone.layers.iter().zip(&cache.layers).enumerate() {
            let attn = &layer.self_attn;
            let groups = match (&sliding_groups, config.window_of(index)) {
                (Some(sliding), Some(_)) => sliding,
                _ => &groups,
            };
            let normed = self.add_norm(&layer.input_layernorm, &mut hidden, pending.take())?;
            let rows = |t: Tensor, n: i64| t.f_view([total, n, head_dim]);
            let (q, k, v) = match self.fused.get(index) {
                Some(fused) => {
                    // Queries and keys are adjacent: one rotation turns both.
                    let qkv = self.linear(&fused.qkv, &normed)?;
                    let qk =
                        rows(qkv.f_narrow(1, 0, (heads + kv_heads) * head_dim)?, heads + kv_heads)?;
                    let qk = match (&attn.q_norm, &attn.k_norm) {
                        (Some(q_norm), Some(k_norm)) => Tensor::f_cat(
                            &[
                                self.head_norm(q_norm, &qk.f_narrow(1, 0, heads)?)?,
                                self.head_norm(k_norm, &qk.f_narrow(1, heads, kv_heads)?)?,
                            ],
                            1,
                        )?,
                        _ => qk,
                    };
                    let qk = match self.fused_ops && last_contiguous(&qk) {
                        true => cpu_kernels::rotary(&qk, &cos_rows, &sin_rows)?,
                        false => apply_rotary(&qk, &cos, &sin)?,
                    };
                    let v = qkv.f_narrow(1, (heads + kv_heads) * head_dim, kv_heads * head_dim)?;
                    (
                        qk.f_narrow(1, 0, heads)?,
                        qk.f_narrow(1, heads, kv_heads)?,
                        rows(v, kv_heads)?,
                    )
                }
                None => {
                    let mut q = rows(self.linear(&attn.q_proj, &normed)?, heads)?;
                    let mut k = rows(self.linear(&attn.k_proj, &normed)?, kv_heads)?;
                    let v = rows(self.linear(&attn.v_proj, &normed)?, kv_heads)?;
                    if let (Some(q_norm), Some(k_norm)) = (&attn.q_norm, &attn.k_norm) {
                        q = self.head_norm(q_norm, &q)?;
                        k = self.head_norm(k_norm, &k)?;
                    }
                    (apply_rotary(&q, &cos, &sin)?, apply_rotary(&k, &cos, &sin)?, v)
                }
            };
            // Every new K/V of this layer lands in the cache before any query reads it, which
            // lets a chunk read prefix blocks another chunk of the same step computes.
            let (k, v) = match self.fused_ops {
                true => {
                    // One pass from the projections' rows into the cache (and the lanes, which
                    // the attention below then only reads).
                    let lane_target = match lanes.as_ref() {
                        Some(LaneStep { lanes, append_at: Some([_, positions]) }) => {
                            let (keys, values) = lanes.layer(index)?;
                            Some(cpu_kernels::LaneTarget { keys, values, positions })
                        }
                        _ => None,
                    };
                    let (cache_k, cache_v) = (&layer_cache.keys, &layer_cache.values);
                    cpu_kernels::write_kv(&k, &v, &slots, cache_k, cache_v, lane_target)?;
                    (k, v)
                }
                false => {
                    let (k, v) = (kv_cache::head_major_rows(&k)?, kv_cache::head_major_rows(&v)?);
                    layer_cache.write(&slots, &k, &v)?;
                    (k, v)
                }
            };
            let attended = match (lanes.as_mut(), groups.as_slice()) {
                (Some(step), [g @ GroupTensors { additive: Some(additive), .. }]) => {
                    let (keys, values) = match &step.append_at {
                        Some(_) if self.fused_ops => step.lanes.views(index, g.kv_len)?,
                        Some(at) => step.lanes.append_layer(index, at, &k, &v, g.kv_len)?,
                        None => step.lanes.rebuild_layer(layer_cache, g.kv_rows()?, g.kv_len)?,
                    };
                    match self.attention_kernel {
                        true => {
                            let keep = g.mask.f_view([g.batch, g.kv_len])?;
                            let scale = 1.0 / (head_dim as f64).sqrt();
                            // Small products' outputs are transposed views (`linear`).
                            let q = match last_contiguous(&q) {
                                true => q,
                                false => q.f_contiguous()?,
                            };
                            // Past its context a lane holds zeros or keys: finite.
                            let readable = step.lanes.capacity();
                            cpu_kernels::decode_attention(
                                &q, &keys, &values, &keep, readable, scale,
                            )?
                        }
                        false => {
                            // Contiguous, as a gather leaves them: the same products, bit for
                            // bit, as the paged read.
                            let keys = keys.f_transpose(2, 3)?.f_contiguous()?;
                            decode_attention(attn, &q, &keys, &values, additive, g.batch)?
                        }
                    }
                }
                _ => {
                    let kernel = self.attention_kernel;
                    paged_attention(attn, &q, layer_cache, groups, total, kernel)?
                }
            };
            let out = self.reduce(self.linear(&attn.o_proj, &attended)?)?;
            let normed = self.add_norm(&layer.post_attention_layernorm, &mut hidden, Some(out))?;
            let activated = self.mlp_activation(index, layer, &normed)?;
            let mlp = self.reduce(self.linear(&layer.mlp.down_proj, &activated)?)?;
            pending = Some(mlp);
        }
        if let Some(mlp) = pending {
            hidden = hidden.f_add(&mlp)?;
        }
        if let (Some(mut step), [g]) = (lanes, batch.groups.as_slice()) {
            if step.append_at.is_some() {
                step.lanes.record_append(&batch.positions, &g.kv_slots, g.kv_len);
            }
            self.lanes.replace(Some(step.lanes));
        }
        Ok(hidden)
    }

    /// Layer `index`'s `silu(gate) * up` of its normed rows: one fused gate/up product where
    /// the layer is fused (then the CPU's fused kernel where it applies), else two.
    fn mlp_activation(
        &self,
        index: usize,
        layer: &DecoderLayer,
        normed: &Tensor,
    ) -> Result<Tensor, EngineError> {
        let Some(fused) = self.fused.get(index) else {
            let gate = self.linear(&layer.mlp.gate_proj, normed)?.f_silu()?;
            return Ok(gate.f_mul(&self.linear(&layer.mlp.up_proj, normed)?)?);
        };
        let gate_up = self.linear(&fused.gate_up, normed)?;
        if self.fused_ops && last_contiguous(&gate_up) {
            return cpu_kernels::silu_mul(&gate_up);
        }
        let width = gate_up.size()[1] / 2;
        let gate = gate_up.f_narrow(1, 0, width)?.f_silu()?;
        Ok(gate.f_mul(&gate_up.f_narrow(1, width, width)?)?)
    }

    /// The logits of the sampled rows of the last hidden states `hidden: [T, hidden]`.
    fn head(&self, batch: &StepBatch, hidden: &Tensor) -> Result<Tensor, EngineError> {
        let backbone = &self.model.backbone;
        let sample_rows = Tensor::f_from_slice(&batch.sample_rows)?.f_to_device(self.device())?;
        let rows = self.norm(&backbone.norm, &hidden.f_index_select(0, &sample_rows)?)?;
        match &self.model.lm_head {
            Some(head) => self.linear(head, &rows),
            None => self.linear_weight(&backbone.embed_tokens, None, &rows),
        }
    }

    /// The model's RMSNorm of `hidden: [T, hidden]` after `hidden += delta` (a residual
    /// branch's output), the sum and the norm in one pass on the CPU.
    fn add_norm(
        &self,
        norm: &RmsNorm,
        hidden: &mut Tensor,
        delta: Option<Tensor>,
    ) -> Result<Tensor, EngineError> {
        let Some(delta) = delta else {
            return self.norm(norm, hidden);
        };
        match self.fused_ops && last_contiguous(hidden) && last_contiguous(&delta) {
            true => cpu_kernels::add_rms_norm(hidden, &delta, &norm.weight, norm.eps),
            false => {
                *hidden = hidden.f_add(&delta)?;
                self.norm(norm, hidden)
            }
        }
    }

    /// Qwen3's RMSNorm of every head of `x: [T, heads, head_dim]` (the same as
    /// [`RmsNorm::forward`] over the last dimension), as `[T * heads, head_dim]` rows.
    fn head_norm(&self, norm: &RmsNorm, x: &Tensor) -> Result<Tensor, EngineError> {
        let size = x.size();
        let rows = x.f_reshape([size[0] * size[1], size[2]])?;
        Ok(self.norm(norm, &rows)?.f_view([size[0], size[1], size[2]])?)
    }

    /// The model's RMSNorm of rows `x: [T, hidden]`, in one fused pass on the CPU.
    fn norm(&self, norm: &RmsNorm, x: &Tensor) -> Result<Tensor, EngineError> {
        match self.fused_ops && last_contiguous(x) {
            true => cpu_kernels::rms_norm(x, &norm.weight, norm.eps),
            false => Ok(norm.forward(x)?),
        }
    }

    /// `x W^T + b` for rows `x: [T, in]`, the same projection as [`Linear::forward`]. On the
    /// CPU:
    /// - on a CPU with AVX-512, every float32 product runs the runner's own kernel on a weight
    ///   packed once ([`cpu_kernels::gemm`], decision 060): ~420-470 GFLOP/s on two Zen 5
    ///   cores at the decode step's shapes with the weights coming from memory, where oneDNN's
    ///   inner product reaches ~350-400; its fixed cost is a parallel loop's, so small products
    ///   and single rows gain too (the 27M model's batch-1 decode ran 2.7x faster than on MKL).
    /// - elsewhere a float32 product of at least [`ONEDNN_MIN_MACS`] multiply-adds and
    ///   [`ONEDNN_MIN_ROWS`] rows runs on oneDNN's inner product with the weight packed once
    ///   into its layout. libtorch sends float32 matmuls to MKL, whose kernels on this
    ///   project's AMD machines are its AVX2 ones (~190 GFLOP/s on two Zen cores).
    /// - otherwise it is computed as `(W x^T)^T`: MKL packs the right-hand operand of every
    ///   product into its own layout first, and with the weight on the left that operand is
    ///   the small activation instead of the whole weight matrix (the decode step at batch 64
    ///   spent a fifth of its time copying weights). The result is a transposed view of a
    ///   contiguous `[out, T]` tensor, so the next projection's `x^T` is contiguous again.
    fn linear(&self, layer: &Linear, x: &Tensor) -> Result<Tensor, EngineError> {
        self.linear_weight(&layer.weight, layer.bias.as_ref(), x)
    }

    fn linear_weight(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        x: &Tensor,
    ) -> Result<Tensor, EngineError> {
        if !self.weight_left {
            return Ok(x.f_linear(weight, bias)?);
        }
        let (rows, inputs) = x.size2()?;
        let outputs = weight.size()[0];
        let float = x.f_kind()? == Kind::Float;
        if self.gemm && float {
            return cpu_kernels::gemm(x, &self.packed_weight(weight)?, bias, outputs);
        }
        if self.onednn
            && float
            && rows >= ONEDNN_MIN_ROWS
            && rows * inputs * outputs >= ONEDNN_MIN_MACS
        {
            return cpu_kernels::linear(x, &self.packed_weight(weight)?, bias);
        }
        let x_t = x.f_transpose(0, 1)?;
        let out = match bias {
            Some(bias) => bias.f_unsqueeze(1)?.f_addmm(weight, &x_t)?,
            None => weight.f_matmul(&x_t)?,
        };
        Ok(out.f_transpose(0, 1)?)
    }

    /// `weight` packed for oneDNN: the packing made for it before, unless the weight changed
    /// in place since.
    fn packed_weight(&self, weight: &Tensor) -> Result<Tensor, EngineError> {
        let (outputs, inputs) = weight.size2()?;
        let strides = weight.stride();
        let key = (weight.data_ptr() as usize, outputs, inputs, strides[0], strides[1]);
        let version = weight.f_internal_version()?;
        let mut packed = self.packed.borrow_mut();
        if let Some(entry) = packed.get(&key)
            && entry.version == version
        {
            return Ok(entry.packed.shallow_clone());
        }
        // A weight whose storage was replaced outside the engine's update paths leaves its old
        // packing behind: never hold more than twice the projections.
        let projections = 7 * self.model.backbone.layers.len() + 1;
        if packed.len() >= 2 * projections {
            packed.clear();
        }
        let tensor = match self.gemm {
            true => cpu_kernels::gemm_pack(weight)?,
            false => cpu_kernels::pack(weight)?,
        };
        let entry = PackedWeight {
            _weight: weight.shallow_clone(),
            version,
            packed: tensor.shallow_clone(),
        };
        packed.insert(key, entry);
        Ok(tensor)
    }
}

/// `layers` (same input width) as one projection whose output is theirs side by side, with
/// each layer's weight and bias pointed at its slice; `None` when some have a bias and some
/// not.
fn fuse_linears(layers: &[&Linear]) -> Result<Option<Linear>, EngineError> {
    let biases: Vec<&Tensor> = layers.iter().filter_map(|l| l.bias.as_ref()).collect();
    if !biases.is_empty() && biases.len() != layers.len() {
        return Ok(None);
    }
    tch::no_grad(|| {
        let weights: Vec<&Tensor> = layers.iter().map(|l| &l.weight).collect();
        let weight = Tensor::f_cat(&weights, 0)?;
        let bias = match biases.is_empty() {
            true => None,
            false => Some(Tensor::f_cat(&biases, 0)?),
        };
        let mut start = 0;
        for layer in layers {
            let n = layer.weight.size()[0];
            layer.weight.shallow_clone().f_set_data(&weight.f_narrow(0, start, n)?)?;
            if let (Some(own), Some(bias)) = (&layer.bias, &bias) {
                own.shallow_clone().f_set_data(&bias.f_narrow(0, start, n)?)?;
            }
            start += n;
        }
        Ok(Some(Linear { weight, bias, lora: None }))
    })
}

/// The most positions [`ModelRunner`]'s RoPE table holds (a step with a later position
/// computes its rows instead).
const ROPE_TABLE_MAX: i64 = 1 << 16;

/// RoPE's `cos` and `sin` of positions `0..min(max_position_embeddings, ROPE_TABLE_MAX)`,
/// `[positions, head_dim]` each, computed by the model's own rotary embedding (so a looked-up
/// row is the value a step would compute).
fn rope_table(model: &CausalLm) -> Result<(Tensor, Tensor), EngineError> {
    let config = model.config();
    let positions = config.max_position_embeddings.clamp(1, ROPE_TABLE_MAX);
    let backbone = &model.backbone;
    let ids =
        Tensor::f_arange(positions, (Kind::Int64, backbone.device()))?.f_view([1, positions])?;
    let (cos, sin) = backbone.rotary.cos_sin(&ids, model.params.kind())?;
    let flat = |t: Tensor| t.f_view([positions, config.head_dim]);
    Ok((flat(cos)?, flat(sin)?))
}

/// Steps below this many multiply-adds run on one thread (see [`ModelRunner::choose_threads`]):
/// on two Zen cores the 0.5M-parameter benchmark model decodes as fast on one thread as on two
/// at batch 16 (8M), and faster on two at batch 64 (32M).
const SMALL_STEP_MACS: i64 = 16 << 20;

/// The smallest product (rows x inputs x outputs) [`ModelRunner::linear`] sends to oneDNN with
/// a packed weight: its fixed cost per call (~10 µs) is about that of 1M multiply-adds on MKL,
/// on one thread or two (two Zen cores). The 0.5M-parameter benchmark model decodes at batch
/// 64 at 73-76k tokens/s with a threshold of 256K-1M, and at 65-66k with every product on MKL.
const ONEDNN_MIN_MACS: i64 = 1 << 20;
/// Fewer rows than this stay on MKL whatever the product (MKL's narrow kernels are the faster).
const ONEDNN_MIN_ROWS: i64 = 8;

/// Whether `t`'s last dimension is contiguous (what the fused kernels read; a small projection's
/// output on MKL is a transposed view).
fn last_contiguous(t: &Tensor) -> bool {
    t.stride().last() == Some(&1)
}

/// Whether this libtorch runs oneDNN's inner product and agrees with `linear` on a small
/// product (a build without oneDNN, or a CPU it rejects, keeps every projection on MKL).
fn onednn_works() -> bool {
    let probe = || -> Result<bool, EngineError> {
        let x = Tensor::f_arange(6 * 5, (Kind::Float, Device::Cpu))?.f_view([6, 5])?;
        let w = Tensor::f_arange(4 * 5, (Kind::Float, Device::Cpu))?.f_view([4, 5])?;
        let b = Tensor::f_arange(4, (Kind::Float, Device::Cpu))?;
        let expected = x.f_linear(&w, Some(&b))?;
        let found = cpu_kernels::linear(&x, &cpu_kernels::pack(&w)?, Some(&b))?;
        Ok(found.f_allclose(&expected, 1e-5, 1e-5, false)?)
    };
    tch::no_grad(|| probe().unwrap_or(false))
}

fn group_tensors(
    g: &AttentionGroup,
    total: i64,
    cache: &KvCache,
    device: Device,
    decode_masks: Option<(i64, Kind)>,
    with_kv_rows: bool,
) -> Result<GroupTensors, EngineError> {
    let index = |values: &[i64]| -> Result<Tensor, EngineError> {
        Ok(Tensor::f_from_slice(values)?.f_to_device(device)?)
    };
    let (batch, q_len, kv_len) = (g.batch as i64, g.q_len as i64, g.kv_len as i64);
    let identity = covers_packed_rows(g, total);
    let (mask, additive) = mask_tensors(&g.mask, (batch, q_len, kv_len), device, decode_masks)?;
    Ok(GroupTensors {
        batch,
        q_len,
        kv_len,
        q_index: index(&g.q_index)?,
        kv_rows: match with_kv_rows {
            true => Some(index(&cache.head_major(&g.kv_slots))?),
            false => None,
        },
        mask,
        valid_slots: index(&g.valid_slots)?,
        valid_rows: index(&g.valid_rows)?,
        identity,
        additive,
    })
}

/// A group's boolean mask as `[batch, 1, q_len, kv_len]` and, for a decode group on the CPU,
/// its additive form (0 or -inf) `[kv_heads * batch, 1, kv_len]` for [`decode_attention`].
fn mask_tensors(
    mask: &[bool],
    (batch, q_len, kv_len): (i64, i64, i64),
    device: Device,
    decode_masks: Option<(i64, Kind)>,
) -> Result<(Tensor, Option<Tensor>), EngineError> {
    let additive = match decode_masks {
        Some((kv_heads, kind)) if q_len == 1 => {
            let row: Vec<f32> =
                mask.iter().map(|&keep| if keep { 0.0 } else { f32::NEG_INFINITY }).collect();
            let mask = Tensor::f_from_slice(&row)?.f_view([1, batch, kv_len])?;
            Some(
                mask.f_expand([kv_heads, batch, kv_len], false)?
                    .f_reshape([kv_heads * batch, 1, kv_len])?
                    .f_to_kind(kind)?,
            )
        }
        _ => None,
    };
    let mask =
        Tensor::f_from_slice(mask)?.f_view([batch, 1, q_len, kv_len])?.f_to_device(device)?;
    Ok((mask, additive))
}

/// `g.mask` limited to a sliding window of `window` keys: a query at position `p` (its row's
/// last allowed key) keeps the keys after `p - window` (transformers' `kv_idx > q_idx -
/// sliding_window`); a padding query keeps its one key.
fn windowed_mask(g: &AttentionGroup, window: i64) -> Vec<bool> {
    let mut mask = g.mask.clone();
    for row in mask.chunks_mut(g.kv_len.max(1)) {
        let Some(position) = row.iter().rposition(|&keep| keep) else { continue };
        let first = (position as i64 - window + 1).max(0) as usize;
        row[..first].fill(false);
    }
    mask
}

/// Whether `g`'s query slots are the `total` packed rows in packed order, with no padding (a
/// step of decodes only, or a prefill of prompts of one length): its output rows then are the
/// step's attention output as they are.
fn covers_packed_rows(g: &AttentionGroup, total: i64) -> bool {
    let in_order = |rows: &[i64]| rows.iter().enumerate().all(|(i, &row)| row == i as i64);
    (g.batch * g.q_len) as i64 == total
        && g.q_index.len() as i64 == total
        && g.valid_rows.len() as i64 == total
        && in_order(&g.q_index)
        && in_order(&g.valid_rows)
        && in_order(&g.valid_slots)
}

/// Whether `g` is every packed row of a `total`-row step, one query each, in packed order (a
/// step of decodes only).
fn is_packed_decode(g: &AttentionGroup, total: i64) -> bool {
    g.q_len == 1 && covers_packed_rows(g, total)
}

impl GroupTensors {
    /// The same group under another boolean mask (a sliding window's).
    fn with_mask(
        &self,
        mask: &[bool],
        device: Device,
        decode_masks: Option<(i64, Kind)>,
    ) -> Result<GroupTensors, EngineError> {
        let (mask, additive) =
            mask_tensors(mask, (self.batch, self.q_len, self.kv_len), device, decode_masks)?;
        Ok(GroupTensors {
            batch: self.batch,
            q_len: self.q_len,
            kv_len: self.kv_len,
            q_index: self.q_index.shallow_clone(),
            kv_rows: self.kv_rows.as_ref().map(Tensor::shallow_clone),
            mask,
            valid_slots: self.valid_slots.shallow_clone(),
            valid_rows: self.valid_rows.shallow_clone(),
            identity: self.identity,
            additive,
        })
    }

    /// The gather rows; only a step that appends to the decode lanes is built without them,
    /// and it gathers nothing.
    fn kv_rows(&self) -> Result<&Tensor, EngineError> {
        self.kv_rows.as_ref().ok_or_else(|| {
            EngineError::InvalidArgument(
                "a decode step that appends to the decode lanes has no gather rows".into(),
            )
        })
    }
}

/// Attention of the packed queries `q_rows: [T, heads, head_dim]` over the cache, group by
/// group; returns `[T, heads * head_dim]`. With `kernel` (float32 on a CPU with AVX2, see
/// [`cpu_kernels::decode_attention`]) a prefill chunk's rows run the C++ attention kernel
/// instead of libtorch's masked attention: at 64 prompts of 32 tokens that took a tenth of the
/// 27M-parameter model's prefill on two cores.
fn paged_attention(
    attn: &Attention,
    q_rows: &Tensor,
    cache: &kv_cache::LayerCache,
    groups: &[GroupTensors],
    total: i64,
    kernel: bool,
) -> Result<Tensor, EngineError> {
    let width = attn.num_heads * attn.head_dim;
    let attend_group = |g: &GroupTensors| -> Result<Tensor, EngineError> {
        let qg = match g.identity {
            true => q_rows.shallow_clone(),
            false => q_rows.f_index_select(0, &g.q_index)?,
        };
        // `[kv_heads, batch, kv_len, head_dim]`.
        let (k, v) = cache.gather(g.kv_rows()?, g.batch, g.kv_len)?;
        if let Some(additive) = &g.additive {
            return decode_attention(attn, &qg, &k, &v, additive, g.batch);
        }
        if kernel {
            // The chunk's query rows, each over its own sequence's keys (transposed, as the
            // kernel reads them) under its row of the mask (a padding row attends key 0; the
            // caller drops its output).
            let keys = k.f_transpose(2, 3)?.f_contiguous()?;
            let keep = g.mask.f_view([g.batch * g.q_len, g.kv_len])?;
            let scale = 1.0 / (attn.head_dim as f64).sqrt();
            let qg = match last_contiguous(&qg) {
                true => qg,
                false => qg.f_contiguous()?,
            };
            return cpu_kernels::decode_attention(&qg, &keys, &v, &keep, g.kv_len, scale);
        }
        let qg = qg
            .f_view([g.batch, g.q_len, attn.num_heads, attn.head_dim])?
            .f_permute([0, 2, 1, 3])?;
        let (k, v) = (k.f_permute([1, 0, 2, 3])?, v.f_permute([1, 0, 2, 3])?);
        Ok(attn.attend(&qg, &k, &v, Some(&g.mask))?.f_reshape([g.batch * g.q_len, width])?)
    };
    if let [only] = groups
        && only.identity
    {
        // The group's rows already are the packed rows, in order.
        return attend_group(only);
    }
    let mut attended = Tensor::f_zeros([total, width], (q_rows.f_kind()?, q_rows.device()))?;
    for g in groups {
        let out = attend_group(g)?;
        let _ =
            attended.f_index_copy_(0, &g.valid_rows, &out.f_index_select(0, &g.valid_slots)?)?;
    }
    Ok(attended)
}

/// One query per sequence (`q: [batch, heads, head_dim]`) over its gathered context (`k, v:
/// [kv_heads, batch, len, head_dim]`, contiguous): two batched products over the `kv_heads *
/// batch` pairs, each multiplying the `heads / kv_heads` query heads that share a key/value
/// head at once, with the padding masked by `additive`. On the CPU this is twice as fast as
/// `scaled_dot_product_attention`, whose flash kernel runs one tiny product per query row and
/// head; the arithmetic is the same softmax of the same scaled scores.
fn decode_attention(
    attn: &Attention,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    additive: &Tensor,
    batch: i64,
) -> Result<Tensor, EngineError> {
    let (heads, kv_heads, head_dim) = (attn.num_heads, attn.num_kv_heads, attn.head_dim);
    let (group, len) = (heads / kv_heads, k.size()[2]);
    let pairs = kv_heads * batch;
    let q = q
        .f_view([batch, kv_heads, group, head_dim])?
        .f_permute([1, 0, 2, 3])?
        .f_reshape([pairs, group, head_dim])?;
    let k = k.f_view([pairs, len, head_dim])?;
    let v = v.f_view([pairs, len, head_dim])?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let scores = additive.f_baddbmm(&q, &k.f_transpose(1, 2)?, 1.0, scale)?;
    let probs = scores.f_softmax(-1, q.f_kind()?)?;
    Ok(probs
        .f_bmm(&v)?
        .f_view([kv_heads, batch, group, head_dim])?
        .f_permute([1, 0, 2, 3])?
        .f_reshape([batch, heads * head_dim])?)
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn onednn_projections_equal_mkls_up_to_rounding() {
        // libtorch's x86-64 builds all carry oneDNN; elsewhere the engine keeps MKL.
        assert_eq!(onednn_works(), cfg!(target_arch = "x86_64"));
        if !onednn_works() {
            return;
        }
        tch::manual_seed(3);
        let x = Tensor::randn([64, 512], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([1536, 512], (Kind::Float, Device::Cpu));
        let b = Tensor::randn([1536], (Kind::Float, Device::Cpu));
        // A transposed view, as the weight-left projections leave their outputs.
        let x_view = x.transpose(0, 1).contiguous().transpose(0, 1);
        let found =
            cpu_kernels::linear(&x_view, &cpu_kernels::pack(&w).unwrap(), Some(&b)).unwrap();
        let expected = x.linear(&w, Some(&b));
        assert_eq!(found.size(), [64, 1536]);
        let worst = (found - &expected).abs().max().double_value(&[]);
        assert!(worst < 1e-3, "{worst}");
    }

    /// The packed AVX-512 projection gives `linear`'s result within float rounding: rows
    /// below, at and past its tiles (14, 8, 4, 2, 1) and its row chunk (256), inputs past its
    /// slice of 512 and none at all, outputs that fill panels of 32 partly, with and without
    /// bias, and row-strided inputs; a packing that does not fit is an error.
    #[test]
    fn packed_projections_equal_linear_up_to_rounding() {
        if !cpu_kernels::gemm_supported() {
            return;
        }
        let o = (Kind::Float, Device::Cpu);
        tch::manual_seed(7);
        for (rows, inputs, outputs) in [
            (64, 512, 768),
            (1, 7, 1),
            (15, 33, 17),
            (300, 64, 100),
            (27, 600, 64),
            (8, 16, 33),
            (3, 0, 5),
        ] {
            let wide = Tensor::randn([rows, inputs + 5], o);
            let x = wide.narrow(1, 2, inputs);
            let w = Tensor::randn([outputs, inputs], o);
            let b = Tensor::randn([outputs], o);
            let packed = cpu_kernels::gemm_pack(&w).unwrap();
            assert_eq!(packed.size(), [(outputs + 31) / 32, inputs, 32]);
            for bias in [None, Some(&b)] {
                let found = cpu_kernels::gemm(&x, &packed, bias, outputs).unwrap();
                let expected = x.linear(&w, bias);
                assert_eq!(found.size(), [rows, outputs]);
                let scale = expected.abs().max().double_value(&[]) + 1.0;
                let worst = (found - &expected).abs().max().double_value(&[]) / scale;
                assert!(worst < 1e-5, "{rows}x{inputs}x{outputs}: {worst}");
            }
        }
        let x = Tensor::randn([4, 16], o);
        let packed = cpu_kernels::gemm_pack(&Tensor::randn([40, 16], o)).unwrap();
        let error = cpu_kernels::gemm(&x, &packed, None, 80).unwrap_err();
        assert!(error.to_string().contains("does not fit"), "{error}");
        assert!(cpu_kernels::gemm(&x.narrow(1, 0, 8), &packed, None, 40).is_err());
        assert!(cpu_kernels::gemm(&x, &packed, Some(&Tensor::ones([3], o)), 40).is_err());
        assert!(cpu_kernels::gemm(&x.to_kind(Kind::Double), &packed, None, 40).is_err());
        assert!(cpu_kernels::gemm_pack(&Tensor::ones([3], o)).is_err());
    }

    /// `parallel_for` runs every index once (on this thread below its grain, never for an
    /// empty range), and a panicking body comes back as an error instead of unwinding into
    /// C++; `with_floats` lends a tensor's values in order, in place only where nothing else
    /// holds them, and refuses other kinds.
    #[test]
    fn parallel_loops_and_borrowed_floats() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        for (n, grain) in [(1000, 7), (1000, 5000), (3, 1)] {
            let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            cpu_kernels::parallel_for(n, grain, |begin, end| {
                for count in &seen[begin..end] {
                    count.fetch_add(1, Ordering::Relaxed);
                }
            })
            .unwrap();
            assert!(seen.iter().all(|count| count.load(Ordering::Relaxed) == 1), "{n}, {grain}");
        }
        cpu_kernels::parallel_for(0, 1, |_, _| panic!("an empty range runs nothing")).unwrap();
        let error = cpu_kernels::parallel_for(10, 1, |begin, _| assert!(begin > 0)).unwrap_err();
        assert!(error.to_string().contains("panicked"), "{error}");

        // A transposed view (copied first), a tensor with a second handle (copied: the other
        // handle could write it), and a sole fresh one (lent in place).
        let t = Tensor::arange(12, (Kind::Float, Device::Cpu)).view([3, 4]).transpose(0, 1);
        let expected = Vec::<f32>::try_from(t.contiguous().view(-1)).unwrap();
        let values = cpu_kernels::with_floats(t.shallow_clone(), |v| v.to_vec()).unwrap();
        assert_eq!(values, expected);
        let shared = t.contiguous();
        let at = |v: &[f32]| v.as_ptr() as usize;
        let lent = cpu_kernels::with_floats(shared.shallow_clone(), at).unwrap();
        assert_ne!(lent, shared.data_ptr() as usize);
        let fresh = t.contiguous();
        let address = fresh.data_ptr() as usize;
        assert_eq!(cpu_kernels::with_floats(fresh, at).unwrap(), address);
        assert!(cpu_kernels::with_floats(t.to_kind(Kind::Double), |v| v.len()).is_err());
        assert_eq!(
            cpu_kernels::with_floats(Tensor::zeros([0], (Kind::Float, Device::Cpu)), |v| v.len())
                .unwrap(),
            0
        );
    }

    /// The fused kernels give the results of the operators they replace: RoPE bit for bit,
    /// RMSNorm and SiLU-and-multiply within float rounding, on row-strided inputs too, and the
    /// same bits however the rows are split over threads; the residual sum before a norm bit
    /// for bit; a wrong input is an error.
    #[test]
    fn fused_kernels_equal_the_operators_they_replace() {
        let o = (Kind::Float, Device::Cpu);
        let worst = |found: &Tensor, expected: &Tensor| {
            let scale = expected.abs().f_add_scalar(1.0).unwrap();
            ((found - expected).abs() / scale).max().double_value(&[])
        };
        tch::manual_seed(11);
        // Rows narrowed out of wider ones, as the fused projections leave them.
        let wide = Tensor::randn([37, 100], o);
        let x = wide.narrow(1, 3, 90);
        let norm = RmsNorm { weight: Tensor::randn([90], o), eps: 1e-6 };
        let found = cpu_kernels::rms_norm(&x, &norm.weight, norm.eps).unwrap();
        assert!(worst(&found, &norm.forward(&x).unwrap()) < 1e-6);
        // The residual sum in place (libtorch's add, bit for bit), then the same norm.
        let delta = Tensor::randn([37, 95], o).narrow(1, 5, 90);
        let sum = &x + &delta;
        let mut hidden = x.copy();
        let found = cpu_kernels::add_rms_norm(&mut hidden, &delta, &norm.weight, norm.eps).unwrap();
        assert!(hidden.equal(&sum));
        assert!(found.equal(&cpu_kernels::rms_norm(&sum, &norm.weight, norm.eps).unwrap()));
        let mut shared = Tensor::randn([1, 90], o).expand([37, 90], false);
        let error = cpu_kernels::add_rms_norm(&mut shared, &delta, &norm.weight, 1e-6).unwrap_err();
        assert!(error.to_string().contains("do not own their memory"), "{error}");
        assert!(
            cpu_kernels::add_rms_norm(&mut hidden, &delta.narrow(0, 0, 5), &norm.weight, 1e-6)
                .is_err()
        );

        let qkv = Tensor::randn([37, 7 * 16], o);
        let qk = qkv.narrow(1, 0, 5 * 16).view([37, 5, 16]);
        let (cos, sin) = (Tensor::randn([37, 16], o), Tensor::randn([37, 16], o));
        let found = cpu_kernels::rotary(&qk, &cos, &sin).unwrap();
        let expected = apply_rotary(&qk, &cos.view([37, 1, 16]), &sin.view([37, 1, 16])).unwrap();
        assert!(found.equal(&expected));

        // Gates far out on both sides reach the exponential's clamp.
        let gate_up = Tensor::randn([37, 2 * 50], o) * 30.0;
        let found = cpu_kernels::silu_mul(&gate_up).unwrap();
        let expected = gate_up.narrow(1, 0, 50).silu() * gate_up.narrow(1, 50, 50);
        assert!(worst(&found, &expected) < 1e-6);
        // Large enough to be split over the intra-op threads: each row's bits are those the
        // row gets alone, and within rounding of libtorch's operators.
        let gate_up = Tensor::randn([64, 2 * 600], o);
        let found = cpu_kernels::silu_mul(&gate_up).unwrap();
        let expected = gate_up.narrow(1, 0, 600).silu() * gate_up.narrow(1, 600, 600);
        assert!(worst(&found, &expected) < 1e-6);
        for row in [0, 31, 32, 63] {
            let alone = cpu_kernels::silu_mul(&gate_up.narrow(0, row, 1)).unwrap();
            assert!(found.narrow(0, row, 1).equal(&alone), "row {row}");
        }

        assert!(cpu_kernels::rms_norm(&x, &Tensor::ones([3], o), 1e-6).is_err());
        assert!(cpu_kernels::silu_mul(&Tensor::ones([2, 3], o)).is_err());
        assert!(cpu_kernels::rotary(&qk.to_kind(Kind::Double), &cos, &sin).is_err());
        assert!(cpu_kernels::rms_norm(&x.transpose(0, 1), &Tensor::ones([37], o), 1e-6).is_err());
    }

    /// The decode attention kernel gives libtorch's softmax attention within float rounding:
    /// query groups of 1 to 8 heads (run four, two or one at a time), contexts shorter than,
    /// equal to and longer than its blocks of keys, widths that are not a multiple of its
    /// vectors, masks with holes, strided inputs as the lanes and projections leave them, and
    /// several query rows per sequence (a prefill chunk's, with causal masks).
    #[test]
    fn decode_attention_kernel_equals_softmax_attention() {
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            cpu_kernels::decode_attention_supported(),
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
        );
        if !cpu_kernels::decode_attention_supported() {
            return;
        }
        let o = (Kind::Float, Device::Cpu);
        tch::manual_seed(5);
        // (heads, kv_heads, head_dim, len, batch, query rows per sequence)
        for (heads, kv_heads, d, len, batch, queries) in [
            (8, 2, 64, 96, 5, 1),
            (4, 2, 32, 37, 3, 1),
            (3, 1, 48, 17, 2, 1),
            (8, 1, 16, 1, 1, 1),
            (2, 2, 64, 33, 4, 1),
            (7, 7, 8, 70, 2, 1),
            (8, 2, 64, 32, 3, 4),
            (4, 1, 16, 9, 2, 9),
        ] {
            let group = heads / kv_heads;
            let rows = batch * queries;
            // Queries narrowed out of wider rows; keys and values narrowed out of lanes.
            let q = Tensor::randn([rows, heads + 3, d], o).narrow(1, 1, heads);
            let keys = Tensor::randn([kv_heads, batch, d, len + 40], o).narrow(3, 0, len);
            let values = Tensor::randn([kv_heads, batch, len + 40, d], o).narrow(2, 0, len);
            // Ragged contexts, one with a hole; a sequence's query rows keep growing prefixes
            // of it (a prefill chunk's causal rows); every row keeps its first position.
            let mut keep = vec![false; (rows * len) as usize];
            for r in 0..rows {
                let b = r / queries;
                let kept = (1 + (b * 7) % len) * (1 + r % queries) / queries;
                for t in 0..kept.max(1) {
                    keep[(r * len + t) as usize] = !(b == 1 && t == kept / 2 && t > 0);
                }
            }
            let keep = Tensor::from_slice(&keep).view([rows, len]);
            let scale = 1.0 / (d as f64).sqrt();
            let found =
                cpu_kernels::decode_attention(&q, &keys, &values, &keep, len + 40, scale).unwrap();
            // Reading the last block in place (the rows hold 40 finite keys more) or through
            // a padded copy gives the same bits; a claim past the keys' storage is bounded.
            let attend = |keys: &Tensor, readable: i64| {
                cpu_kernels::decode_attention(&q, keys, &values, &keep, readable, scale).unwrap()
            };
            assert!(attend(&keys, len).equal(&found));
            assert!(attend(&keys.contiguous(), i64::MAX).equal(&found));

            // Each query row against its own sequence's keys and values.
            let sequence = Tensor::arange(rows, (Kind::Int64, Device::Cpu))
                .divide_scalar_mode(queries, "floor");
            let (keys, values) =
                (keys.index_select(1, &sequence), values.index_select(1, &sequence));
            let qg = q.reshape([rows, kv_heads, group, d]);
            let k = keys.permute([1, 0, 3, 2]); // [rows, kv_heads, len, d]
            let scores = qg.matmul(&k.transpose(2, 3)) * scale;
            let masked =
                scores.masked_fill(&keep.logical_not().view([rows, 1, 1, len]), f64::NEG_INFINITY);
            let expected = masked
                .softmax(-1, Kind::Float)
                .matmul(&values.permute([1, 0, 2, 3]))
                .reshape([rows, heads * d]);
            let error = (&found - &expected).abs().max().double_value(&[]);
            assert!(error < 1e-5, "{heads}/{kv_heads} heads, d {d}, len {len}, {queries}: {error}");
        }
        // A row that attends nothing comes out zero, not NaN.
        let q = Tensor::randn([4, 2, 16], o);
        let keys = Tensor::randn([1, 2, 16, 5], o);
        let values = Tensor::randn([1, 2, 5, 16], o);
        let keep =
            Tensor::from_slice(&[true, false, false, false, false]).view([1, 5]).repeat([4, 1]);
        let _ = keep.get(2).fill_(0);
        let found = cpu_kernels::decode_attention(&q, &keys, &values, &keep, 5, 0.25).unwrap();
        assert_eq!(found.get(2).abs().sum(Kind::Float).double_value(&[]), 0.0);
        assert_eq!(found.isfinite().all().int64_value(&[]), 1);
        let first = values.select(2, 0).repeat([1, 1, 2]).view([2, 32]);
        assert!(found.get(3).allclose(&first.get(1), 1e-6, 1e-6, false));
        // Shapes that do not fit are errors, not reads out of bounds.
        let q = Tensor::randn([2, 4, 8], o);
        let keys = Tensor::randn([2, 2, 8, 5], o);
        let values = Tensor::randn([2, 2, 5, 8], o);
        let keep = Tensor::ones([2, 5], (Kind::Bool, Device::Cpu));
        let attend = |q: &Tensor, k: &Tensor, v: &Tensor, keep: &Tensor| {
            cpu_kernels::decode_attention(q, k, v, keep, 5, 0.5).map_err(|e| e.to_string())
        };
        assert!(attend(&q, &keys, &values, &keep).is_ok());
        let error = attend(&q, &keys, &values, &keep.narrow(1, 0, 4)).unwrap_err();
        assert!(error.contains("attention wants q [batch * queries"), "{error}");
        assert!(attend(&q.narrow(1, 0, 3), &keys, &values, &keep).is_err());
        assert!(attend(&q, &keys.transpose(2, 3), &values, &keep).is_err());
        assert!(attend(&q.to_kind(Kind::Double), &keys, &values, &keep).is_err());
        assert!(attend(&q, &keys, &values, &keep.to_kind(Kind::Float)).is_err());
    }

    /// `write_kv` puts a step's keys and values where the copy, `index_copy_` and `index_put_`
    /// it replaces put them, for strided inputs and two-byte kinds, and refuses rows and
    /// positions outside the cache and the lanes before writing anything.
    #[test]
    fn write_kv_writes_what_the_index_operators_write() {
        let (tokens, kv_heads, d, slots, capacity) = (5i64, 2i64, 6i64, 40i64, 9i64);
        for kind in [Kind::Float, Kind::BFloat16] {
            let o = (kind, Device::Cpu);
            // As the projections leave them: [T, kv_heads, d] views, one transposed.
            let k = Tensor::randn([tokens, kv_heads + 1, d], (Kind::Float, Device::Cpu))
                .to_kind(kind)
                .narrow(1, 1, kv_heads);
            let v = Tensor::randn([kv_heads, d, tokens], (Kind::Float, Device::Cpu))
                .to_kind(kind)
                .permute([2, 0, 1]);
            let rows: Vec<i64> = (0..kv_heads * tokens).map(|i| (i * 7 + 3) % slots).collect();
            let rows = Tensor::from_slice(&rows);
            let positions = Tensor::from_slice(&[0i64, 8, 3, 4, 1]);
            let cache = || (Tensor::zeros([slots, d], o), Tensor::zeros([slots, d], o));
            let lanes = || {
                (
                    Tensor::zeros([kv_heads, tokens, d, capacity], o),
                    Tensor::zeros([kv_heads, tokens, capacity, d], o),
                )
            };
            let (cache_k, cache_v) = cache();
            let (lane_k, lane_v) = lanes();
            let target =
                cpu_kernels::LaneTarget { keys: &lane_k, values: &lane_v, positions: &positions };
            cpu_kernels::write_kv(&k, &v, &rows, &cache_k, &cache_v, Some(target)).unwrap();

            let (expected_k, expected_v) = cache();
            let layer = kv_cache::LayerCache { keys: expected_k, values: expected_v };
            let (hk, hv) =
                (kv_cache::head_major_rows(&k).unwrap(), kv_cache::head_major_rows(&v).unwrap());
            layer.write(&rows, &hk, &hv).unwrap();
            assert!(cache_k.equal(&layer.keys) && cache_v.equal(&layer.values), "{kind:?}");
            let (want_k, want_v) = lanes();
            let lane = Tensor::arange(tokens, (Kind::Int64, Device::Cpu));
            let at = [Some(lane), Some(positions.shallow_clone())];
            let _ = want_k.permute([1, 3, 0, 2]).index_put_(&at, &hk.permute([1, 0, 2]), false);
            let _ = want_v.permute([1, 2, 0, 3]).index_put_(&at, &hv.permute([1, 0, 2]), false);
            assert!(lane_k.equal(&want_k) && lane_v.equal(&want_v), "{kind:?}");

            // Out of range: nothing is written, and the error names the value.
            let (fresh_k, fresh_v) = cache();
            let bad_rows = rows.copy();
            let _ = bad_rows.get(3).fill_(slots);
            let err =
                cpu_kernels::write_kv(&k, &v, &bad_rows, &fresh_k, &fresh_v, None).unwrap_err();
            assert!(err.to_string().contains(&format!("cache row {slots}")), "{err}");
            assert_eq!(fresh_k.abs().sum(Kind::Float).double_value(&[]), 0.0);
            let (lane_k, lane_v) = lanes();
            let far = Tensor::from_slice(&[0i64, 1, capacity, 2, 3]);
            let target =
                cpu_kernels::LaneTarget { keys: &lane_k, values: &lane_v, positions: &far };
            let err =
                cpu_kernels::write_kv(&k, &v, &rows, &fresh_k, &fresh_v, Some(target)).unwrap_err();
            assert!(err.to_string().contains(&format!("lane position {capacity}")), "{err}");
            assert_eq!(lane_k.abs().sum(Kind::Float).double_value(&[]), 0.0);
            assert_eq!(fresh_k.abs().sum(Kind::Float).double_value(&[]), 0.0);
            let err =
                cpu_kernels::write_kv(&k, &v, &rows.narrow(0, 0, 4), &fresh_k, &fresh_v, None);
            assert!(err.is_err());
        }
    }

    /// A weight packed for oneDNN is packed again after it changed in place, and after the
    /// engine says the weights changed.
    #[test]
    fn packed_weights_follow_weight_updates() {
        use rtrun_rlhf_model::{ModelFamily, tiny};

        let config = tiny::tiny_config(ModelFamily::Qwen2);
        let mut runner = ModelRunner::new(tiny::tiny_model(&config, 4).unwrap(), None, 4).unwrap();
        if !(runner.onednn || runner.gemm) {
            return;
        }
        tch::manual_seed(5);
        let x = Tensor::randn([64, 512], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([1024, 512], (Kind::Float, Device::Cpu));
        let close = |found: Tensor, w: &Tensor| {
            let worst = (found - x.linear(w, None::<&Tensor>)).abs().max().double_value(&[]);
            assert!(worst < 1e-3, "{worst}");
        };
        close(runner.linear_weight(&w, None, &x).unwrap(), &w);
        assert_eq!(runner.packed.borrow().len(), 1);
        let updated = Tensor::randn([1024, 512], (Kind::Float, Device::Cpu));
        tch::no_grad(|| w.shallow_clone().copy_(&updated));
        close(runner.linear_weight(&w, None, &x).unwrap(), &updated);
        assert_eq!(runner.packed.borrow().len(), 1);
        runner.weights_changed();
        assert!(runner.packed.borrow().is_empty());
        close(runner.linear_weight(&w, None, &x).unwrap(), &updated);
        // Weights replaced again and again (new storage each time) do not pile up.
        let cap = 2 * (7 * runner.model.backbone.layers.len() + 1);
        for _ in 0..cap + 3 {
            let fresh = Tensor::randn([1024, 512], (Kind::Float, Device::Cpu));
            close(runner.linear_weight(&fresh, None, &x).unwrap(), &fresh);
            assert!(runner.packed.borrow().len() <= cap);
        }
    }

    /// The greedy path picks the host sampler's tokens (log-probs within 1e-5) and refuses the
    /// logits it refuses.
    #[test]
    fn device_sampled_steps_pick_the_host_samplers_tokens_and_refuse_what_it_refuses() {
        use crate::block::BlockId;
        use crate::sampling::SamplingError;
        use crate::sampling::device::RowSampling;
        use crate::{RequestId, SequenceId};
        use rtrun_rlhf_model::{ModelFamily, tiny};

        let config = tiny::tiny_config(ModelFamily::Qwen2);
        let mut runner = ModelRunner::new(tiny::tiny_model(&config, 4).unwrap(), None, 4).unwrap();
        runner.allocate_kv_cache(16).unwrap();
        let tokens: Vec<Vec<u32>> = vec![vec![5, 9, 13, 2, 7], vec![3, 8, 1]];
        let tables = [vec![BlockId(0), BlockId(1)], vec![BlockId(2)]];
        let chunks: Vec<batch::ChunkView<'_>> = (0..2)
            .map(|i| batch::ChunkView {
                sequence: SequenceId { request: RequestId(i as u64), sample_index: 0 },
                tokens: &tokens[i],
                start: 0,
                num_tokens: tokens[i].len(),
                block_table: &tables[i],
                sample: true,
            })
            .collect();
        let batch = StepBatch::build(4, usize::MAX, &chunks).unwrap();
        let logits = runner.execute(&batch).unwrap();
        let width = logits.len() / 2;
        let mut sampler = crate::sampling::Sampler::default();
        let warm = crate::SamplingParams { temperature: 0.9, top_p: 0.8, ..Default::default() };
        for params in [crate::SamplingParams::greedy(1), warm] {
            let rows: Vec<RowSampling<'_>> = [0.31, 0.77]
                .into_iter()
                .map(|uniform| RowSampling { params: &params, uniform })
                .collect();
            // The K/V the step writes are the same each time: the step can run again.
            let picked = runner.execute_sampled(&batch, &rows).unwrap();
            for (row, found) in picked.iter().enumerate() {
                let host = sampler
                    .sample(&logits[row * width..][..width], &params, rows[row].uniform)
                    .unwrap();
                assert_eq!(found.token, host.token, "row {row}");
                let gap = (found.logprob - host.logprob).abs();
                assert!(gap < 1e-5, "row {row}: {} vs {}", found.logprob, host.logprob);
            }
        }
        // NaN weights make every logit NaN: the step is the host sampler's error, not token 0.
        let norm = runner.model().params.get("model.norm.weight").unwrap().shallow_clone();
        let _nan = tch::no_grad(|| norm.shallow_clone().f_fill_(f64::NAN)).unwrap();
        let greedy = crate::SamplingParams::greedy(1);
        let rows = [RowSampling { params: &greedy, uniform: 0.5 }; 2];
        let err = runner.execute_sampled(&batch, &rows).unwrap_err();
        assert!(
            matches!(err, EngineError::Sampling(SamplingError::NonFiniteLogit { .. })),
            "{err}"
        );
    }

    /// Decode steps that read the lanes give bit-for-bit the logits of the paged read, through
    /// every way the lanes are kept or rebuilt: appends, a lane that fills up, a finished
    /// sequence, a prefill in between (which may reuse freed blocks), and a reordered batch.
    /// With the decode attention kernel on the lanes, they agree within float rounding.
    #[test]
    fn decode_lanes_give_the_logits_of_the_paged_read() {
        use crate::block::BlockId;
        use crate::{RequestId, SequenceId};
        use rtrun_rlhf_model::{ModelFamily, tiny};

        let config = tiny::tiny_config(ModelFamily::Qwen2);
        let runner = |use_lanes: bool, attention_kernel: bool| {
            let model = tiny::tiny_model(&config, 9).unwrap();
            let mut runner = ModelRunner::new(model, None, 4).unwrap();
            runner.use_lanes = use_lanes;
            runner.attention_kernel &= attention_kernel;
            runner.allocate_kv_cache(96).unwrap();
            runner
        };
        let (lanes, paged) = (runner(true, false), runner(false, false));
        let kernel = runner(true, true);
        let block_size = 4;
        // Sequences 0..3; their tokens grow as they decode. Blocks are handed out in turn from
        // a list, and a finished sequence's blocks go back to its front (as the block
        // manager's free list would reuse them).
        let vocab = config.vocab_size as u32;
        let mut tokens: Vec<Vec<u32>> =
            vec![vec![5, 9, 13, 2, 7], vec![3, 8, 1], vec![11, 4, 6, 10, 12, 14, 15]];
        let mut free: Vec<BlockId> = (0..96).map(BlockId).collect();
        let mut tables: Vec<Vec<BlockId>> = vec![Vec::new(); tokens.len()];
        let step = |members: &[(usize, usize)],
                    tokens: &mut Vec<Vec<u32>>,
                    tables: &mut Vec<Vec<BlockId>>,
                    free: &mut Vec<BlockId>| {
            // `(sequence, start)`: the chunk runs from `start` to the sequence's end.
            for &(i, _) in members {
                while tables[i].len() * block_size < tokens[i].len() {
                    tables[i].push(free.remove(0));
                }
            }
            let chunks: Vec<batch::ChunkView<'_>> = members
                .iter()
                .map(|&(i, start)| batch::ChunkView {
                    sequence: SequenceId { request: RequestId(i as u64), sample_index: 0 },
                    tokens: &tokens[i],
                    start,
                    num_tokens: tokens[i].len() - start,
                    block_table: &tables[i],
                    sample: true,
                })
                .collect();
            let batch = StepBatch::build(block_size, usize::MAX, &chunks).unwrap();
            let found = lanes.execute(&batch).unwrap();
            let expected = paged.execute(&batch).unwrap();
            assert_eq!(found, expected, "step of {members:?}");
            let close = kernel.execute(&batch).unwrap();
            let error = close.iter().zip(&found).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(error < 1e-4, "step of {members:?}: the kernel is {error} off");
            // Greedy next tokens, so the sequences run on as a generation would.
            let width = found.len() / members.len();
            for (row, &(i, _)) in members.iter().enumerate() {
                let logits = &found[row * width..(row + 1) * width];
                let next = (0..width).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap();
                tokens[i].push(next as u32 % vocab);
            }
            lanes.lanes.borrow().is_some()
        };
        let decode = |members: &[usize], tokens: &Vec<Vec<u32>>| -> Vec<(usize, usize)> {
            members.iter().map(|&i| (i, tokens[i].len() - 1)).collect()
        };
        // Prefill 0 and 1: no lanes.
        assert!(!step(&[(0, 0), (1, 0)], &mut tokens, &mut tables, &mut free));
        // 70 decodes: built, appended to, rebuilt when a lane fills (at 64 positions).
        for _ in 0..70 {
            let members = decode(&[0, 1], &tokens);
            assert!(step(&members, &mut tokens, &mut tables, &mut free));
        }
        assert!(tokens[1].len() > 64);
        // 0 finishes: its blocks are freed; 1 decodes alone (rebuilt), then 2 prefills into
        // 0's blocks, which drops the lanes.
        free.splice(0..0, std::mem::take(&mut tables[0]));
        let members = decode(&[1], &tokens);
        assert!(step(&members, &mut tokens, &mut tables, &mut free));
        assert!(!step(&[(2, 0)], &mut tokens, &mut tables, &mut free));
        // Decode 1 and 2, then 2 and 1 (reordered: rebuilt), then appended again.
        for order in [[1, 2], [1, 2], [2, 1], [2, 1], [2, 1]] {
            let members = decode(&order, &tokens);
            assert!(step(&members, &mut tokens, &mut tables, &mut free));
        }
    }

    #[test]
    fn fused_projections_are_the_parameters_storage() {
        use rtrun_rlhf_model::{ModelFamily, tiny};
        for family in [ModelFamily::Llama, ModelFamily::Qwen2, ModelFamily::Qwen3] {
            let model = tiny::tiny_model(&tiny::tiny_config(family), 5).unwrap();
            let runner = ModelRunner::new(model, None, 4).unwrap();
            let layers = &runner.model().backbone.layers;
            assert_eq!(runner.fused.len(), layers.len(), "{family:?}");
            // A weight update copies into the parameters; the fused weight sees it.
            let k = &layers[1].self_attn.k_proj;
            let name = "model.layers.1.self_attn.k_proj.weight";
            let ones = Tensor::ones(k.weight.size(), (Kind::Float, Device::Cpu));
            runner.model().params.copy_into(name, &ones).unwrap();
            let q_rows = layers[1].self_attn.q_proj.weight.size()[0];
            let fused_k = runner.fused[1].qkv.weight.narrow(0, q_rows, k.weight.size()[0]);
            assert!(fused_k.equal(&ones), "{family:?}");
            let bias = runner.fused[1].qkv.bias.is_some();
            assert_eq!(bias, family == ModelFamily::Qwen2);
        }
    }
}
