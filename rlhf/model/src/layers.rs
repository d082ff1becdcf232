//! The building blocks of a Llama / Qwen2 / Qwen3 decoder layer: linear projections, RMSNorm,
//! grouped-query attention (with Qwen3's per-head query/key norms) and the SwiGLU MLP.
//!
//! Their pieces are public on purpose: the generation engine runs the same projections and RoPE
//! but replaces [`Attention::attend`] with paged attention over its KV cache, so it needs
//! [`Attention::project_qkv`], [`Attention::rotate`] and [`Attention::project_output`] apart.
//!
//! Shapes inside a layer follow from the config validated at construction and from the input
//! checks in [`crate::backbone`]; the arithmetic operators of `tch` used here therefore cannot
//! meet mismatched shapes.

use tch::{Kind, Tensor};

use crate::config::ModelConfig;
use crate::error::Result;
use crate::params::{Init, Parameters};
use crate::rope::apply_rotary;

/// `y = x W^T + b` with `W: [out, in]`, as `torch.nn.Linear`.
#[derive(Debug)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Tensor,
    /// `[out_features]` when the layer has a bias.
    pub bias: Option<Tensor>,
    /// A LoRA adapter beside the weight ([`crate::lora`]).
    pub lora: Option<crate::lora::LoraAdapter>,
}

impl Linear {
    /// Registers `<prefix>.weight` (and `<prefix>.bias`) in `params`.
    pub fn new(
        params: &mut Parameters,
        prefix: &str,
        in_features: i64,
        out_features: i64,
        bias: bool,
        std: f64,
    ) -> Result<Self> {
        let weight = params.create(
            &format!("{prefix}.weight"),
            &[out_features, in_features],
            Init::Normal(std),
        )?;
        let bias = if bias {
            Some(params.create(&format!("{prefix}.bias"), &[out_features], Init::Constant(0.0))?)
        } else {
            None
        };
        Ok(Self { weight, bias, lora: None })
    }

    /// Applies the projection (and its adapter) to the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.f_linear(&self.weight, self.bias.as_ref())?;
        match &self.lora {
            Some(adapter) => match adapter.delta(x)? {
                Some(delta) => Ok(y.f_add(&delta)?),
                None => Ok(y),
            },
            None => Ok(y),
        }
    }
}

/// Root-mean-square layer norm with a learned scale, computed in float32 like transformers.
#[derive(Debug)]
pub struct RmsNorm {
    /// `[hidden_size]` scale.
    pub weight: Tensor,
    /// Added to the mean square before the square root.
    pub eps: f64,
}

impl RmsNorm {
    /// Registers `<prefix>.weight` (initialised to ones).
    pub fn new(params: &mut Parameters, prefix: &str, size: i64, eps: f64) -> Result<Self> {
        let weight = params.create(&format!("{prefix}.weight"), &[size], Init::Constant(1.0))?;
        Ok(Self { weight, eps })
    }

    /// Normalises the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let kind = x.f_kind()?;
        let x32 = x.f_to_kind(Kind::Float)?;
        let variance = x32.f_pow_tensor_scalar(2)?.f_mean_dim(-1, true, Kind::Float)?;
        let normed = x32.f_mul(&variance.f_add_scalar(self.eps)?.f_rsqrt()?)?;
        Ok(self.weight.f_mul(&normed.f_to_kind(kind)?)?)
    }
}

/// Grouped-query self-attention with rotary embeddings.
#[derive(Debug)]
pub struct Attention {
    /// Query projection, `hidden -> num_heads * head_dim`.
    pub q_proj: Linear,
    /// Key projection, `hidden -> num_kv_heads * head_dim`.
    pub k_proj: Linear,
    /// Value projection, `hidden -> num_kv_heads * head_dim`.
    pub v_proj: Linear,
    /// Output projection, `num_heads * head_dim -> hidden`.
    pub o_proj: Linear,
    /// Qwen3's RMSNorm over each query head (`[head_dim]` scale), before RoPE.
    pub q_norm: Option<RmsNorm>,
    /// Qwen3's RMSNorm over each key head, before RoPE.
    pub k_norm: Option<RmsNorm>,
    /// Query heads.
    pub num_heads: i64,
    /// Key/value heads; each serves `num_heads / num_kv_heads` query heads.
    pub num_kv_heads: i64,
    /// Width of one head.
    pub head_dim: i64,
}

impl Attention {
    /// Registers the four projections under `<prefix>.{q,k,v,o}_proj` (and Qwen3's
    /// `<prefix>.{q,k}_norm`).
    pub fn new(params: &mut Parameters, prefix: &str, config: &ModelConfig) -> Result<Self> {
        let h = config.hidden_size;
        let q = config.num_attention_heads * config.head_dim;
        let kv = config.num_key_value_heads * config.head_dim;
        let std = config.initializer_range;
        let head_norm = |params: &mut Parameters, name: &str| -> Result<Option<RmsNorm>> {
            match config.qk_norm() {
                true => Ok(Some(RmsNorm::new(
                    params,
                    &format!("{prefix}.{name}"),
                    config.head_dim,
                    config.rms_norm_eps,
                )?)),
                false => Ok(None),
            }
        };
        Ok(Self {
            q_proj: Linear::new(params, &format!("{prefix}.q_proj"), h, q, config.qkv_bias, std)?,
            k_proj: Linear::new(params, &format!("{prefix}.k_proj"), h, kv, config.qkv_bias, std)?,
            v_proj: Linear::new(params, &format!("{prefix}.v_proj"), h, kv, config.qkv_bias, std)?,
            o_proj: Linear::new(params, &format!("{prefix}.o_proj"), q, h, config.o_bias, std)?,
            q_norm: head_norm(params, "q_norm")?,
            k_norm: head_norm(params, "k_norm")?,
            num_heads: config.num_attention_heads,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        })
    }

    /// Projects `x: [batch, seq, hidden]` to `q: [batch, heads, seq, head_dim]` and
    /// `k, v: [batch, kv_heads, seq, head_dim]` (before RoPE; after Qwen3's head norms).
    pub fn project_qkv(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (batch, seq) = (x.size()[0], x.size()[1]);
        let split = |t: Tensor, heads: i64, norm: Option<&RmsNorm>| -> Result<Tensor> {
            let t = t.f_view([batch, seq, heads, self.head_dim])?;
            let t = match norm {
                Some(norm) => norm.forward(&t)?,
                None => t,
            };
            Ok(t.f_transpose(1, 2)?)
        };
        let q = split(self.q_proj.forward(x)?, self.num_heads, self.q_norm.as_ref())?;
        let k = split(self.k_proj.forward(x)?, self.num_kv_heads, self.k_norm.as_ref())?;
        let v = split(self.v_proj.forward(x)?, self.num_kv_heads, None)?;
        Ok((q, k, v))
    }

    /// Applies RoPE to queries and keys with `cos`/`sin` from
    /// [`crate::rope::RotaryEmbedding::cos_sin`].
    pub fn rotate(
        &self,
        q: &Tensor,
        k: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        Ok((apply_rotary(q, cos, sin)?, apply_rotary(k, cos, sin)?))
    }

    /// Scaled dot-product attention of `q: [batch, heads, q_len, head_dim]` over
    /// `k, v: [batch, kv_heads, k_len, head_dim]`. `mask` is a boolean tensor broadcastable to
    /// `[batch, heads, q_len, k_len]` (true = may attend); `None` means plain causal attention
    /// with `q_len == k_len`, which lets libtorch use its fused kernel. Returns
    /// `[batch, q_len, heads * head_dim]`.
    pub fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        // `enable_gqa` lets each query head read its key/value head in place: the same
        // arithmetic as `repeat_kv` (bit-identical outputs, checked in the tests) without
        // copying every key and value `num_heads / num_kv_heads` times, which was most of the
        // engine's decode step at batch 64.
        let out = Tensor::f_scaled_dot_product_attention(
            q,
            k,
            v,
            mask,
            0.0,
            mask.is_none(),
            1.0 / (self.head_dim as f64).sqrt(),
            self.num_heads != self.num_kv_heads,
        )?;
        let (batch, q_len) = (q.size()[0], q.size()[2]);
        Ok(out.f_transpose(1, 2)?.f_reshape([batch, q_len, self.num_heads * self.head_dim])?)
    }

    /// Projects the attended values back to the residual width.
    pub fn project_output(&self, attended: &Tensor) -> Result<Tensor> {
        self.o_proj.forward(attended)
    }

    /// Full self-attention over `x` with the given rotary tables and mask.
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (q, k, v) = self.project_qkv(x)?;
        let (q, k) = self.rotate(&q, &k, cos, sin)?;
        let attended = self.attend(&q, &k, &v, mask)?;
        self.project_output(&attended)
    }
}

/// Repeats each key/value head `groups` times along the head dimension (transformers'
/// `repeat_kv`), so query head `i` reads key/value head `i / groups`.
pub fn repeat_kv(x: &Tensor, groups: i64) -> Result<Tensor> {
    if groups == 1 {
        return Ok(x.shallow_clone());
    }
    let size = x.size();
    let (batch, heads, seq, dim) = (size[0], size[1], size[2], size[3]);
    Ok(x.f_unsqueeze(2)?.f_expand([batch, heads, groups, seq, dim], false)?.f_reshape([
        batch,
        heads * groups,
        seq,
        dim,
    ])?)
}

/// The SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`.
#[derive(Debug)]
pub struct Mlp {
    /// Gate projection, `hidden -> intermediate`.
    pub gate_proj: Linear,
    /// Up projection, `hidden -> intermediate`.
    pub up_proj: Linear,
    /// Down projection, `intermediate -> hidden`.
    pub down_proj: Linear,
}

impl Mlp {
    /// Registers the three projections under `<prefix>.{gate,up,down}_proj`.
    pub fn new(params: &mut Parameters, prefix: &str, config: &ModelConfig) -> Result<Self> {
        let (h, i, b, std) = (
            config.hidden_size,
            config.intermediate_size,
            config.mlp_bias,
            config.initializer_range,
        );
        Ok(Self {
            gate_proj: Linear::new(params, &format!("{prefix}.gate_proj"), h, i, b, std)?,
            up_proj: Linear::new(params, &format!("{prefix}.up_proj"), h, i, b, std)?,
            down_proj: Linear::new(params, &format!("{prefix}.down_proj"), i, h, b, std)?,
        })
    }

    /// Applies the block to the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = self.gate_proj.forward(x)?.f_silu()?;
        self.down_proj.forward(&gate.f_mul(&self.up_proj.forward(x)?)?)
    }
}

/// One pre-norm decoder layer: `x + attn(norm(x))`, then `x + mlp(norm(x))`.
#[derive(Debug)]
pub struct DecoderLayer {
    /// Norm before attention.
    pub input_layernorm: RmsNorm,
    /// Self-attention.
    pub self_attn: Attention,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// Feed-forward block.
    pub mlp: Mlp,
}

impl DecoderLayer {
    /// Whether a parameter of the layer trains (its projections' weights, or their LoRA
    /// adapters when the base is frozen).
    pub fn trains(&self) -> bool {
        self.projections().iter().any(|(_, linear)| {
            linear.weight.requires_grad()
                || linear.lora.as_ref().is_some_and(|a| a.a.requires_grad())
        })
    }

    /// The seven projections by name within the layer (`self_attn.q_proj`, ..., `mlp.down_proj`),
    /// in [`crate::lora::LORA_TARGETS`] order.
    pub fn projections(&self) -> [(&'static str, &Linear); 7] {
        let (attn, mlp) = (&self.self_attn, &self.mlp);
        [
            ("self_attn.q_proj", &attn.q_proj),
            ("self_attn.k_proj", &attn.k_proj),
            ("self_attn.v_proj", &attn.v_proj),
            ("self_attn.o_proj", &attn.o_proj),
            ("mlp.gate_proj", &mlp.gate_proj),
            ("mlp.up_proj", &mlp.up_proj),
            ("mlp.down_proj", &mlp.down_proj),
        ]
    }

    /// [`DecoderLayer::projections`], mutably.
    pub fn projections_mut(&mut self) -> [(&'static str, &mut Linear); 7] {
        let (attn, mlp) = (&mut self.self_attn, &mut self.mlp);
        [
            ("self_attn.q_proj", &mut attn.q_proj),
            ("self_attn.k_proj", &mut attn.k_proj),
            ("self_attn.v_proj", &mut attn.v_proj),
            ("self_attn.o_proj", &mut attn.o_proj),
            ("mlp.gate_proj", &mut mlp.gate_proj),
            ("mlp.up_proj", &mut mlp.up_proj),
            ("mlp.down_proj", &mut mlp.down_proj),
        ]
    }

    /// Registers layer `index` under `model.layers.<index>`.
    pub fn new(params: &mut Parameters, index: i64, config: &ModelConfig) -> Result<Self> {
        let prefix = format!("model.layers.{index}");
        let (h, eps) = (config.hidden_size, config.rms_norm_eps);
        Ok(Self {
            input_layernorm: RmsNorm::new(params, &format!("{prefix}.input_layernorm"), h, eps)?,
            self_attn: Attention::new(params, &format!("{prefix}.self_attn"), config)?,
            post_attention_layernorm: RmsNorm::new(
                params,
                &format!("{prefix}.post_attention_layernorm"),
                h,
                eps,
            )?,
            mlp: Mlp::new(params, &format!("{prefix}.mlp"), config)?,
        })
    }

    /// Runs the layer on `x: [batch, seq, hidden]`.
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let attn = self.self_attn.forward(&self.input_layernorm.forward(x)?, cos, sin, mask)?;
        let x = x.f_add(&attn)?;
        let mlp = self.mlp.forward(&self.post_attention_layernorm.forward(&x)?)?;
        Ok(x.f_add(&mlp)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention that reads shared key/value heads in place (`enable_gqa`) must give exactly
    /// what the explicit `repeat_kv` copy gives, with the causal fast path and with a mask.
    #[test]
    fn grouped_query_attention_matches_repeated_key_values() {
        let config = crate::tiny::tiny_config(crate::ModelFamily::Qwen2);
        let model = crate::tiny::tiny_model(&config, 3).unwrap();
        let attn = &model.backbone.layers[0].self_attn;
        assert!(attn.num_kv_heads < attn.num_heads, "the tiny Qwen2 config shares kv heads");
        tch::manual_seed(11);
        let (batch, len) = (3, 7);
        let q = Tensor::randn([batch, attn.num_heads, len, attn.head_dim], tch::kind::FLOAT_CPU);
        let k = Tensor::randn([batch, attn.num_kv_heads, len, attn.head_dim], tch::kind::FLOAT_CPU);
        let v = Tensor::randn([batch, attn.num_kv_heads, len, attn.head_dim], tch::kind::FLOAT_CPU);
        let groups = attn.num_heads / attn.num_kv_heads;
        let (rk, rv) = (repeat_kv(&k, groups).unwrap(), repeat_kv(&v, groups).unwrap());
        let scale = 1.0 / (attn.head_dim as f64).sqrt();
        let reference = |mask: Option<&Tensor>| {
            Tensor::scaled_dot_product_attention(
                &q,
                &rk,
                &rv,
                mask,
                0.0,
                mask.is_none(),
                scale,
                false,
            )
            .transpose(1, 2)
            .reshape([batch, len, attn.num_heads * attn.head_dim])
        };
        let causal = attn.attend(&q, &k, &v, None).unwrap();
        assert!(causal.equal(&reference(None)));
        let mask = Tensor::ones([len, len], (Kind::Bool, tch::Device::Cpu))
            .tril(0)
            .logical_and(&Tensor::rand([batch, 1, len, len], tch::kind::FLOAT_CPU).gt(0.3))
            .logical_or(&Tensor::eye(len, (Kind::Bool, tch::Device::Cpu)));
        let masked = attn.attend(&q, &k, &v, Some(&mask)).unwrap();
        assert!(masked.allclose(&reference(Some(&mask)), 1e-6, 1e-6, false));
    }
}
