//! The transformer trunk shared by every head (`model.*` in Hugging Face names): token
//! embedding, decoder layers and the final norm, plus the input checks and the attention mask.
//!
//! Inputs are a batch of token ids `[batch, seq]`, an attention mask of the same shape (1 for a
//! real token, 0 for padding; left, right or both sides) and optional explicit positions. Without
//! positions, each real token gets its index among the real tokens of its row (what OpenRLHF and
//! verl compute), so a left-padded prompt starts at position 0.

use tch::{Device, Kind, Tensor};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::layers::{DecoderLayer, RmsNorm};
use crate::layerwise::Layerwise;
use crate::params::{Init, Parameters};
use crate::rope::RotaryEmbedding;

/// Embedding, decoder layers and final norm.
#[derive(Debug)]
pub struct Backbone {
    /// The validated config the trunk was built from.
    pub config: ModelConfig,
    /// `[vocab_size, hidden_size]` token embedding (`model.embed_tokens.weight`).
    pub embed_tokens: Tensor,
    /// The decoder layers in order.
    pub layers: Vec<DecoderLayer>,
    /// Final norm (`model.norm.weight`).
    pub norm: RmsNorm,
    /// Rotary embedding frequencies.
    pub rotary: RotaryEmbedding,
    /// Layer-by-layer execution (activation checkpointing, sharded training's hooks); `None`
    /// runs the trunk as one graph.
    layerwise: std::cell::RefCell<Option<Layerwise>>,
}

/// The attention masks of one forward: the full-attention layers' (`None`: plain causal) and,
/// when some layers slide and a sequence outgrows the window, the sliding layers'.
#[derive(Debug)]
pub(crate) struct LayerMasks {
    full: Option<Tensor>,
    sliding: Option<Tensor>,
    /// Per layer: whether it reads `sliding`.
    slides: Vec<bool>,
}

impl LayerMasks {
    /// `full` for every layer, and for the sliding layers `full` (or causality) limited to keys
    /// less than the window behind each query, by position: the same keys as transformers'
    /// `kv_idx > q_idx - sliding_window` wherever a sample's tokens are contiguous, and the
    /// right ones in packed and branched rows, whose positions restart or continue a prefix.
    pub(crate) fn new(
        config: &ModelConfig,
        full: Option<Tensor>,
        positions: &Tensor,
    ) -> Result<LayerMasks> {
        let slides: Vec<bool> =
            (0..config.num_hidden_layers as usize).map(|i| config.window_of(i).is_some()).collect();
        let seq = positions.size().last().copied().unwrap_or(0);
        let sliding = match &config.sliding_window {
            Some(window) if seq > window.size => {
                // `[batch, 1, seq, seq]`: position of the query minus that of the key.
                let distance = positions.f_unsqueeze(2)?.f_sub(&positions.f_unsqueeze(1)?)?;
                let near = distance.f_lt(window.size)?.f_unsqueeze(1)?;
                let base = match &full {
                    Some(full) => full.shallow_clone(),
                    None => {
                        Tensor::f_ones([seq, seq], (Kind::Bool, positions.device()))?.f_tril(0)?
                    }
                };
                Some(base.f_logical_and(&near)?)
            }
            _ => None,
        };
        Ok(LayerMasks { full, sliding, slides })
    }

    /// The mask of decoder layer `layer`.
    pub(crate) fn of(&self, layer: usize) -> Option<&Tensor> {
        match (self.slides.get(layer).copied().unwrap_or(false), &self.sliding) {
            (true, Some(sliding)) => Some(sliding),
            _ => self.full.as_ref(),
        }
    }

    /// The same masks (shared storage).
    pub(crate) fn shallow_clone(&self) -> LayerMasks {
        LayerMasks {
            full: self.full.as_ref().map(Tensor::shallow_clone),
            sliding: self.sliding.as_ref().map(Tensor::shallow_clone),
            slides: self.slides.clone(),
        }
    }
}

/// A checked batch of inputs: ids and positions as int64, mask as bool, all `[batch, seq]`.
#[derive(Debug)]
pub struct CheckedInputs {
    /// Token ids.
    pub input_ids: Tensor,
    /// True where the token is real.
    pub attention_mask: Tensor,
    /// Position of each token.
    pub position_ids: Tensor,
}

impl Backbone {
    /// Registers the trunk's parameters (in Hugging Face order) and builds it.
    pub fn new(params: &mut Parameters, config: &ModelConfig) -> Result<Self> {
        config.validate()?;
        let embed_tokens = params.create(
            "model.embed_tokens.weight",
            &[config.vocab_size, config.hidden_size],
            Init::Normal(config.initializer_range),
        )?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| DecoderLayer::new(params, i, config))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(params, "model.norm", config.hidden_size, config.rms_norm_eps)?;
        let rotary = RotaryEmbedding::new(config, params.device())?;
        Ok(Self {
            config: config.clone(),
            embed_tokens,
            layers,
            norm,
            rotary,
            layerwise: std::cell::RefCell::new(None),
        })
    }

    /// Installs (or with `None` removes) layer-by-layer execution; passes recorded by the one
    /// it replaces are dropped.
    pub fn set_layerwise(&self, layerwise: Option<Layerwise>) {
        *self.layerwise.borrow_mut() = layerwise;
    }

    /// Whether layers run one by one (see [`crate::layerwise`]).
    pub fn is_layerwise(&self) -> bool {
        self.layerwise.borrow().is_some()
    }

    /// Backpropagates `loss`: `loss.backward()`, or with layer-by-layer execution the head and
    /// then each recorded forward pass layer by layer (recomputing checkpointed layers).
    /// Either way every trained parameter's `.grad` ends up holding its gradient (or, with
    /// sharding hooks, the rank's shard of it).
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        match self.layerwise.borrow_mut().as_mut() {
            Some(layerwise) => layerwise.backward(self, loss),
            None => Ok(loss.f_backward()?),
        }
    }

    /// Releases parameters a forward left gathered for the head (sharded training, after a
    /// forward without a backward) and drops its recorded passes. Nothing to do otherwise.
    pub fn release_parameters(&self) -> Result<()> {
        match self.layerwise.borrow_mut().as_mut() {
            Some(layerwise) => layerwise.discard(),
            None => Ok(()),
        }
    }

    /// Embedding, decoder layers and final norm over checked ids and positions.
    fn trunk(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        mask: impl FnOnce() -> Result<Option<Tensor>>,
    ) -> Result<Tensor> {
        let masks = LayerMasks::new(&self.config, mask()?, position_ids)?;
        if let Some(layerwise) = self.layerwise.borrow_mut().as_mut() {
            return layerwise.forward(self, input_ids, position_ids, &masks);
        }
        let mut hidden = Tensor::f_embedding(&self.embed_tokens, input_ids, -1, false, false)?;
        let (cos, sin) = self.rotary.cos_sin(position_ids, hidden.f_kind()?)?;
        for (index, layer) in self.layers.iter().enumerate() {
            hidden = layer.forward(&hidden, &cos, &sin, masks.of(index))?;
        }
        self.norm.forward(&hidden)
    }

    /// The device of the parameters.
    pub fn device(&self) -> Device {
        self.embed_tokens.device()
    }

    /// Checks shapes, dtypes and value ranges of a batch and fills in default positions.
    pub fn check_inputs(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: Option<&Tensor>,
    ) -> Result<CheckedInputs> {
        let shape = input_ids.size();
        if shape.len() != 2 || shape[0] == 0 || shape[1] == 0 {
            return Err(ModelError::Input(format!(
                "input_ids should be a non-empty [batch, seq] tensor, found shape {shape:?}"
            )));
        }
        check_integer("input_ids", input_ids)?;
        let device = self.device();
        let ids = input_ids.f_to_kind(Kind::Int64)?.f_to_device(device)?;
        let (min, max) = (ids.f_min()?.f_int64_value(&[])?, ids.f_max()?.f_int64_value(&[])?);
        if min < 0 || max >= self.config.vocab_size {
            return Err(ModelError::Input(format!(
                "token ids should lie in [0, {}), found values in [{min}, {max}]",
                self.config.vocab_size
            )));
        }
        if attention_mask.size() != shape {
            return Err(ModelError::Shape {
                name: "attention_mask".into(),
                expected: shape,
                found: attention_mask.size(),
            });
        }
        let mask = attention_mask.f_to_device(device)?.f_ne(0)?;
        let positions = match position_ids {
            Some(p) => {
                if p.size() != shape {
                    return Err(ModelError::Shape {
                        name: "position_ids".into(),
                        expected: shape,
                        found: p.size(),
                    });
                }
                check_integer("position_ids", p)?;
                let p = p.f_to_kind(Kind::Int64)?.f_to_device(device)?;
                if p.f_min()?.f_int64_value(&[])? < 0 {
                    return Err(ModelError::Input("position_ids should be non-negative".into()));
                }
                p
            }
            None => position_ids_from_mask(&mask)?,
        };
        Ok(CheckedInputs { input_ids: ids, attention_mask: mask, position_ids: positions })
    }

    /// Runs the trunk and returns the final hidden states `[batch, seq, hidden]`.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: Option<&Tensor>,
    ) -> Result<Tensor> {
        let inputs = self.check_inputs(input_ids, attention_mask, position_ids)?;
        self.forward_checked(&inputs)
    }

    /// [`Backbone::forward`] on inputs that already passed [`Backbone::check_inputs`].
    pub fn forward_checked(&self, inputs: &CheckedInputs) -> Result<Tensor> {
        self.trunk(&inputs.input_ids, &inputs.position_ids, || {
            // Without padding the mask is plain causal, and leaving it implicit lets libtorch
            // use its fused attention kernel.
            let all_real = inputs.attention_mask.f_all()?.f_int64_value(&[])? != 0;
            Ok(if all_real { None } else { Some(causal_padding_mask(&inputs.attention_mask)?) })
        })
    }
}

impl Backbone {
    /// Runs the trunk over *packed* rows: `segment_ids: [batch, seq]` numbers the samples
    /// packed into each row (1, 2, ...; 0 is padding). A token attends only earlier tokens of
    /// its own sample and its position counts from that sample's first token, so every sample
    /// gets exactly the hidden states it would get alone (what flash-attention's varlen
    /// packing gives OpenRLHF and TRL), while the row pays for one forward.
    pub fn forward_packed(&self, input_ids: &Tensor, segment_ids: &Tensor) -> Result<Tensor> {
        self.forward_rows(input_ids, segment_ids, None, None, None)
    }

    /// [`Backbone::forward_packed`] with, optionally, branches and explicit positions: within a
    /// segment a token attends earlier tokens of branch 0 (a shared prefix) and of its own
    /// branch, so two continuations of one prompt (`prompt, a, b` with `b`'s positions
    /// continuing the prompt's) each get the states they would get after the prompt alone.
    /// `one_per_row` says whether every row holds one right-padded sample (a caller that built
    /// the rows knows); `None` reads it from the segment ids, at the cost of a few device reads.
    pub fn forward_rows(
        &self,
        input_ids: &Tensor,
        segment_ids: &Tensor,
        branch_ids: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        one_per_row: Option<bool>,
    ) -> Result<Tensor> {
        check_integer("segment_ids", segment_ids)?;
        for (name, t) in [("segment_ids", Some(segment_ids)), ("branch_ids", branch_ids)] {
            if let Some(t) = t
                && t.size() != input_ids.size()
            {
                return Err(ModelError::Shape {
                    name: name.into(),
                    expected: input_ids.size(),
                    found: t.size(),
                });
            }
        }
        let device = self.device();
        let segments = segment_ids.f_to_device(device)?.f_to_kind(Kind::Int64)?;
        let positions = match position_ids {
            Some(p) => p.f_to_device(device)?.f_to_kind(Kind::Int64)?,
            None => packed_position_ids(&segments)?,
        };
        let inputs = self.check_inputs(input_ids, &segments.f_ne(0)?, Some(&positions))?;
        self.trunk(&inputs.input_ids, &inputs.position_ids, || {
            // Rows of one right-padded sample each need no mask beyond causality: a real token
            // only sees earlier, real tokens, and padding outputs are never read. Leaving the
            // mask implicit lets libtorch use its fused attention kernel.
            Ok(match branch_ids {
                Some(branches) => {
                    let branches = branches.f_to_device(device)?.f_to_kind(Kind::Int64)?;
                    Some(branched_attention_mask(&segments, &branches)?)
                }
                None if one_per_row.map_or_else(|| one_sample_per_row(&segments), Ok)? => None,
                None => Some(packed_attention_mask(&segments)?),
            })
        })
    }
}

/// [`packed_attention_mask`] further limited by branches `[batch, seq]`: query `i` attends key
/// `j` only when `j`'s branch is 0 (the shared prefix) or `i`'s own.
pub fn branched_attention_mask(segments: &Tensor, branches: &Tensor) -> Result<Tensor> {
    let seq = segments.size()[1];
    let keys = branches.f_unsqueeze(1)?;
    let visible = keys.f_eq(0)?.f_logical_or(&keys.f_eq_tensor(&branches.f_unsqueeze(2)?)?)?;
    let diagonal = Tensor::f_eye(seq, (Kind::Bool, segments.device()))?;
    Ok(packed_attention_mask(segments)?
        .f_logical_and(&visible.f_unsqueeze(1)?)?
        .f_logical_or(&diagonal)?)
}

/// Whether every row holds one sample starting at column 0 and padding only after it.
fn one_sample_per_row(segments: &Tensor) -> Result<bool> {
    let seq = segments.size()[1];
    if segments.f_max()?.f_int64_value(&[])? > 1 || segments.f_min()?.f_int64_value(&[])? < 0 {
        return Ok(false);
    }
    let first_real = segments.f_narrow(1, 0, 1)?.f_eq(1)?.f_all()?.f_int64_value(&[])? != 0;
    if !first_real || seq < 2 {
        return Ok(first_real);
    }
    // No real token after a padding one: the ids never rise along a row.
    let rises =
        segments.f_narrow(1, 1, seq - 1)?.f_gt_tensor(&segments.f_narrow(1, 0, seq - 1)?)?;
    Ok(rises.f_any()?.f_int64_value(&[])? == 0)
}

/// Positions of packed rows: each token's index within its own segment (padding: 0).
pub fn packed_position_ids(segments: &Tensor) -> Result<Tensor> {
    let seq = segments.size()[1];
    let index = Tensor::f_arange(seq, (Kind::Int64, segments.device()))?
        .f_unsqueeze(0)?
        .f_expand_as(segments)?;
    // A segment starts where the id differs from the previous column's (column 0 always).
    let before = Tensor::f_full([segments.size()[0], 1], -1, (Kind::Int64, segments.device()))?;
    let previous = Tensor::f_cat(&[before, segments.f_narrow(1, 0, (seq - 1).max(0))?], 1)?;
    let starts = segments.f_ne_tensor(&previous)?;
    // The start column of each token's segment: a running maximum of the start indices.
    let start_index = index.f_mul(&starts.f_to_kind(Kind::Int64)?)?.f_cummax(1)?.0;
    let positions = index.f_sub(&start_index)?;
    Ok(positions.f_mul(&segments.f_ne(0)?.f_to_kind(Kind::Int64)?)?)
}

/// The boolean attention mask `[batch, 1, seq, seq]` of packed rows: query `i` attends key
/// `j` when `j <= i` and both belong to the same (non-padding) segment; every query attends
/// itself (so padding rows are never empty).
pub fn packed_attention_mask(segments: &Tensor) -> Result<Tensor> {
    let seq = segments.size()[1];
    let device = segments.device();
    let causal = Tensor::f_ones([seq, seq], (Kind::Bool, device))?.f_tril(0)?;
    let same = segments.f_unsqueeze(2)?.f_eq_tensor(&segments.f_unsqueeze(1)?)?;
    let real = segments.f_ne(0)?.f_unsqueeze(1)?;
    let diagonal = Tensor::f_eye(seq, (Kind::Bool, device))?;
    Ok(same
        .f_logical_and(&real)?
        .f_logical_and(&causal)?
        .f_logical_or(&diagonal)?
        .f_unsqueeze(1)?)
}

/// Positions counting real tokens only: `cumsum(mask) - 1`, with padding clamped to 0.
pub fn position_ids_from_mask(mask: &Tensor) -> Result<Tensor> {
    let counts = mask.f_to_kind(Kind::Int64)?.f_cumsum(-1, Kind::Int64)?;
    Ok(counts.f_sub_scalar(1)?.f_clamp_min(0)?)
}

/// The boolean self-attention mask `[batch, 1, seq, seq]`: query `i` may attend key `j` when
/// `j <= i` and `j` is a real token. Every query may also attend itself, so rows of padding
/// queries are never empty (an all-false row would turn softmax into NaN); outputs at padding
/// positions are meaningless and every head ignores them.
pub fn causal_padding_mask(mask: &Tensor) -> Result<Tensor> {
    let seq = mask.size()[1];
    let device = mask.device();
    let causal = Tensor::f_ones([seq, seq], (Kind::Bool, device))?.f_tril(0)?;
    let keys = mask.f_to_kind(Kind::Bool)?.f_unsqueeze(1)?.f_unsqueeze(1)?;
    let diagonal = Tensor::f_eye(seq, (Kind::Bool, device))?;
    Ok(keys.f_logical_and(&causal)?.f_logical_or(&diagonal)?)
}

fn check_integer(name: &str, t: &Tensor) -> Result<()> {
    match t.f_kind()? {
        Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8 | Kind::Uint8 => Ok(()),
        other => {
            Err(ModelError::Input(format!("{name} should be an integer tensor, found {other:?}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_causal_path_matches_the_explicit_mask() {
        let config = crate::tiny::tiny_config(crate::ModelFamily::Qwen2);
        let model = crate::tiny::tiny_model(&config, 4).unwrap();
        let ids = Tensor::from_slice(&[1i64, 5, 9, 13, 200, 7]).view([1, 6]);
        let mask = ids.ones_like();
        let backbone = &model.backbone;
        let fused = backbone.forward(&ids, &mask, None).unwrap();
        let inputs = backbone.check_inputs(&ids, &mask, None).unwrap();
        let mut hidden =
            Tensor::embedding(&backbone.embed_tokens, &inputs.input_ids, -1, false, false);
        let (cos, sin) = backbone.rotary.cos_sin(&inputs.position_ids, Kind::Float).unwrap();
        let explicit = causal_padding_mask(&inputs.attention_mask).unwrap();
        for layer in &backbone.layers {
            hidden = layer.forward(&hidden, &cos, &sin, Some(&explicit)).unwrap();
        }
        let masked = backbone.norm.forward(&hidden).unwrap();
        assert!(fused.allclose(&masked, 1e-5, 1e-5, false));
    }

    /// Two samples packed into one row (plus padding) get exactly the hidden states each gets
    /// alone: no attention crosses a sample boundary and positions restart per sample.
    #[test]
    fn packed_rows_isolate_their_samples() {
        let config = crate::tiny::tiny_config(crate::ModelFamily::Qwen2);
        let model = crate::tiny::tiny_model(&config, 4).unwrap();
        let backbone = &model.backbone;
        let a = [3i64, 17, 9, 40, 2];
        let b = [8i64, 8, 21];
        let alone = |ids: &[i64]| {
            let t = Tensor::from_slice(ids).view([1, ids.len() as i64]);
            backbone.forward(&t, &t.ones_like(), None).unwrap()
        };
        let row: Vec<i64> = a.iter().chain(&b).copied().chain([0, 0]).collect();
        let segments: Vec<i64> = [1; 5].iter().chain(&[2; 3]).copied().chain([0, 0]).collect();
        let packed = backbone
            .forward_packed(
                &Tensor::from_slice(&row).view([1, 10]),
                &Tensor::from_slice(&segments).view([1, 10]),
            )
            .unwrap();
        assert!(packed.narrow(1, 0, 5).allclose(&alone(&a), 1e-5, 1e-5, false));
        assert!(packed.narrow(1, 5, 3).allclose(&alone(&b), 1e-5, 1e-5, false));
        let positions = packed_position_ids(&Tensor::from_slice(&segments).view([1, 10])).unwrap();
        let expected = Tensor::from_slice(&[0i64, 1, 2, 3, 4, 0, 1, 2, 0, 0]).view([1, 10]);
        assert!(positions.equal(&expected), "{positions}");
        // One right-padded sample per row takes the implicit causal path: the same states.
        let row: Vec<i64> = a.iter().copied().chain([0, 0]).collect();
        let one = backbone
            .forward_packed(
                &Tensor::from_slice(&row).view([1, 7]),
                &Tensor::from_slice(&[1i64, 1, 1, 1, 1, 0, 0]).view([1, 7]),
            )
            .unwrap();
        assert!(one.narrow(1, 0, 5).allclose(&alone(&a), 1e-5, 1e-5, false));
        let segs = |v: &[i64]| Tensor::from_slice(v).view([1, v.len() as i64]);
        assert!(one_sample_per_row(&segs(&[1, 1, 0])).unwrap());
        assert!(!one_sample_per_row(&segs(&[0, 1, 1])).unwrap());
        assert!(!one_sample_per_row(&segs(&[1, 0, 1])).unwrap());
        assert!(!one_sample_per_row(&segs(&[1, 2, 0])).unwrap());
    }

    /// A prompt laid out once with two continuations after it (the second's positions continue
    /// the prompt's, and it does not see the first) gives each continuation the states it gets
    /// after the prompt alone.
    #[test]
    fn branches_share_a_prefix_without_seeing_each_other() {
        let config = crate::tiny::tiny_config(crate::ModelFamily::Qwen2);
        let model = crate::tiny::tiny_model(&config, 5).unwrap();
        let backbone = &model.backbone;
        let alone = |ids: &[i64]| {
            let t = Tensor::from_slice(ids).view([1, ids.len() as i64]);
            backbone.forward(&t, &t.ones_like(), None).unwrap()
        };
        let row = |v: &[i64]| Tensor::from_slice(v).view([1, v.len() as i64]);
        let shared = backbone
            .forward_rows(
                &row(&[3, 17, 9, 40, 2, 8, 8, 21, 0]),
                &row(&[1, 1, 1, 1, 1, 1, 1, 1, 0]),
                Some(&row(&[0, 0, 0, 1, 1, 2, 2, 2, 0])),
                Some(&row(&[0, 1, 2, 3, 4, 3, 4, 5, 0])),
                None,
            )
            .unwrap();
        let a = alone(&[3, 17, 9, 40, 2]);
        let b = alone(&[3, 17, 9, 8, 8, 21]);
        assert!(shared.narrow(1, 0, 5).allclose(&a, 1e-5, 1e-5, false));
        assert!(shared.narrow(1, 5, 3).allclose(&b.narrow(1, 3, 3), 1e-5, 1e-5, false));
    }

    #[test]
    fn positions_skip_left_padding() {
        let mask = Tensor::from_slice(&[0i64, 0, 1, 1, 1, 1, 1, 1, 1, 0]).view([2, 5]);
        let pos = position_ids_from_mask(&mask).unwrap();
        let expected = Tensor::from_slice(&[0i64, 0, 0, 1, 2, 0, 1, 2, 3, 3]).view([2, 5]);
        assert!(pos.equal(&expected));
    }

    #[test]
    fn mask_is_causal_ignores_padding_and_keeps_the_diagonal() {
        let mask = Tensor::from_slice(&[0i64, 1, 1]).view([1, 3]);
        let m = causal_padding_mask(&mask).unwrap().view([3, 3]);
        let expected =
            Tensor::from_slice(&[true, false, false, false, true, false, false, true, true])
                .view([3, 3]);
        assert!(m.equal(&expected));
    }
}
