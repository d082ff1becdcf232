//! Layer-by-layer execution of the decoder trunk: activation checkpointing and the hooks that
//! sharded (ZeRO-3 / FSDP-style) training runs around each segment of the model.
//!
//! Plain execution leaves the autograd graph whole and `loss.backward()` walks it at once.
//! With a [`Layerwise`] installed on a [`crate::Backbone`] the graph is cut between segments
//! (the embedding, each decoder layer, the head after the last layer): each layer's input is
//! a fresh leaf, and [`crate::Backbone::backward`] walks the layers itself, last to first,
//! propagating each layer's output gradient as the vector-Jacobian product
//! `sum(output * grad).backward()` (its gradient with respect to `output` is `grad` exactly).
//! That gives two things tch has no other way to express:
//!
//! - **activation checkpointing** (`torch.utils.checkpoint`, OpenRLHF's
//!   `--gradient_checkpointing`): a layer's forward runs without a graph, keeping only its
//!   input; its backward recomputes the layer with a graph first;
//! - **a moment between segments**: [`SegmentHooks`] gathers a segment's parameters before
//!   they are read (forward, recompute or backward), releases them after, and reduces its
//!   gradients as soon as its backward is done — what ZeRO-3 needs to hold one layer's full
//!   parameters and gradients at a time.
//!
//! Gradients equal plain execution's up to the order in which autograd sums the two
//! contributions (residual and layer) to a layer's output gradient.

use tch::{Kind, Tensor};

use crate::backbone::{Backbone, LayerMasks};
use crate::error::{ModelError, Result};

/// A part of a decoder whose parameters are used together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Segment {
    /// The token embedding (`model.embed_tokens`).
    Embedding,
    /// Decoder layer `i` (`model.layers.i`).
    Layer(usize),
    /// Everything after the last layer: the final norm, the LM head or a scalar head (and,
    /// with tied embeddings, the embedding matrix the LM head reads).
    Head,
}

/// What a sharded trainer does around each segment. Every rank of a group runs the same
/// segments in the same order, so hooks may run collectives.
pub trait SegmentHooks: Send {
    /// Before the segment's parameters are read: a forward, a recompute, or a backward that
    /// reads saved views of them. Called again while they are present must do nothing.
    fn gather(&mut self, segment: Segment) -> Result<()>;
    /// After the segment's forward or backward, when its parameters are not read again until
    /// the next [`SegmentHooks::gather`]. The head is released after the backward (or by
    /// [`crate::Backbone::release_parameters`] after a forward without one).
    fn release(&mut self, segment: Segment) -> Result<()>;
    /// After the segment's backward for one forward pass: the `.grad` of its parameters holds
    /// that pass's (accumulated) gradients.
    fn reduce(&mut self, segment: Segment) -> Result<()>;
}

/// Layer-by-layer execution settings and the record of forward passes awaiting backward.
pub struct Layerwise {
    checkpoint: bool,
    hooks: Option<Box<dyn SegmentHooks>>,
    tape: Vec<Pass>,
}

impl std::fmt::Debug for Layerwise {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Layerwise")
            .field("checkpoint", &self.checkpoint)
            .field("hooks", &self.hooks.is_some())
            .field("passes", &self.tape.len())
            .finish()
    }
}

/// One forward pass with gradients, kept until the backward.
struct Pass {
    /// The embedding's output (its graph reaches the embedding matrix).
    embedded: Tensor,
    /// Layers in order.
    layers: Vec<LayerRecord>,
    cos: Tensor,
    sin: Tensor,
    masks: LayerMasks,
    /// The leaf the head computed from.
    head_input: Tensor,
}

/// A layer's input leaf and, without checkpointing, its output with the graph.
struct LayerRecord {
    input: Tensor,
    output: Option<Tensor>,
}

impl Layerwise {
    /// Layer-by-layer execution with activation checkpointing on or off and optional hooks.
    pub fn new(checkpoint: bool, hooks: Option<Box<dyn SegmentHooks>>) -> Self {
        Self { checkpoint, hooks, tape: Vec::new() }
    }

    /// Whether layers are recomputed in the backward pass.
    pub fn checkpointing(&self) -> bool {
        self.checkpoint
    }

    fn hook(&mut self, f: impl FnOnce(&mut dyn SegmentHooks) -> Result<()>) -> Result<()> {
        match &mut self.hooks {
            Some(hooks) => f(hooks.as_mut()),
            None => Ok(()),
        }
    }

    /// Embedding, layers and final norm of `backbone` on checked ids and positions.
    pub(crate) fn forward(
        &mut self,
        backbone: &Backbone,
        input_ids: &Tensor,
        position_ids: &Tensor,
        masks: &LayerMasks,
    ) -> Result<Tensor> {
        self.hook(|h| h.gather(Segment::Embedding))?;
        let embedded = Tensor::f_embedding(&backbone.embed_tokens, input_ids, -1, false, false)?;
        self.hook(|h| h.release(Segment::Embedding))?;
        // A graph is recorded exactly when autograd is on and parameters train: the
        // embedding's, or only the layers' (LoRA adapters over a frozen base).
        let record = embedded.requires_grad()
            || (grad_mode_on()? && backbone.layers.iter().any(|l| l.trains()));
        let (cos, sin) = backbone.rotary.cos_sin(position_ids, embedded.f_kind()?)?;
        let mut hidden = embedded.shallow_clone();
        let mut layers = Vec::with_capacity(if record { backbone.layers.len() } else { 0 });
        for (index, layer) in backbone.layers.iter().enumerate() {
            self.hook(|h| h.gather(Segment::Layer(index)))?;
            let mask = masks.of(index);
            hidden = if record {
                let input = hidden.f_detach()?.f_set_requires_grad(true)?;
                if self.checkpoint {
                    let output = tch::no_grad(|| layer.forward(&input, &cos, &sin, mask))?;
                    layers.push(LayerRecord { input, output: None });
                    output
                } else {
                    let output = layer.forward(&input, &cos, &sin, mask)?;
                    layers.push(LayerRecord { input, output: Some(output.shallow_clone()) });
                    output
                }
            } else {
                layer.forward(&hidden, &cos, &sin, mask)?
            };
            self.hook(|h| h.release(Segment::Layer(index)))?;
        }
        self.hook(|h| h.gather(Segment::Head))?;
        if record {
            let head_input = hidden.f_detach()?.f_set_requires_grad(true)?;
            self.tape.push(Pass {
                embedded,
                layers,
                cos,
                sin,
                masks: masks.shallow_clone(),
                head_input: head_input.shallow_clone(),
            });
            hidden = head_input;
        }
        backbone.norm.forward(&hidden)
    }

    /// Backpropagates `loss` through the head, then every recorded pass layer by layer (last
    /// pass first), reducing each segment's gradients as soon as they are complete.
    pub(crate) fn backward(&mut self, backbone: &Backbone, loss: &Tensor) -> Result<()> {
        let passes = std::mem::take(&mut self.tape);
        let result = self.backward_passes(backbone, loss, passes);
        // The head stayed gathered since the forward; its parameters are not read again.
        let released = self.hook(|h| h.release(Segment::Head));
        result.and(released)
    }

    fn backward_passes(
        &mut self,
        backbone: &Backbone,
        loss: &Tensor,
        passes: Vec<Pass>,
    ) -> Result<()> {
        loss.f_backward()?;
        self.hook(|h| h.reduce(Segment::Head))?;
        for mut pass in passes.into_iter().rev() {
            // Every layer's hooks run whether or not the loss reaches it, so all ranks of a
            // sharded group issue the same collectives.
            let mut grad = pass.head_input.grad();
            let mut index = pass.layers.len();
            while let Some(record) = pass.layers.pop() {
                index -= 1;
                let segment = Segment::Layer(index);
                self.hook(|h| h.gather(segment))?;
                if grad.defined() {
                    let output = match record.output {
                        Some(output) => output,
                        None => backbone.layers[index].forward(
                            &record.input,
                            &pass.cos,
                            &pass.sin,
                            pass.masks.of(index),
                        )?,
                    };
                    vector_jacobian(&output, &grad)?;
                }
                self.hook(|h| h.release(segment))?;
                self.hook(|h| h.reduce(segment))?;
                grad = record.input.grad();
            }
            if grad.defined() && pass.embedded.requires_grad() {
                vector_jacobian(&pass.embedded, &grad)?;
            }
            self.hook(|h| h.reduce(Segment::Embedding))?;
        }
        Ok(())
    }

    /// Drops the passes recorded since the last backward (a forward with gradients whose
    /// loss was never backpropagated) and releases the head.
    pub(crate) fn discard(&mut self) -> Result<()> {
        self.tape.clear();
        self.hook(|h| h.release(Segment::Head))
    }
}

/// Whether autograd records now (not inside `tch::no_grad`): a view of a leaf that requires
/// grad requires grad exactly then.
fn grad_mode_on() -> Result<bool> {
    let leaf = Tensor::f_zeros([1], (Kind::Float, tch::Device::Cpu))?.f_set_requires_grad(true)?;
    Ok(leaf.f_view([-1])?.requires_grad())
}

/// Accumulates into the leaves under `output` the gradient that `grad` (the gradient of the
/// loss with respect to `output`) implies.
fn vector_jacobian(output: &Tensor, grad: &Tensor) -> Result<()> {
    if output.size() != grad.size() {
        return Err(ModelError::Shape {
            name: "layer output gradient".into(),
            expected: output.size(),
            found: grad.size(),
        });
    }
    Ok(output.f_mul(grad)?.f_sum(Kind::Float)?.f_backward()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelFamily;
    use crate::tiny::{tiny_config, tiny_model};

    /// The gradient of every parameter, as a flat vector, after backpropagating the summed
    /// log-probs of a fixed batch (padded on the left, so a mask is used).
    fn gradients(family: ModelFamily, checkpoint: Option<bool>) -> Vec<(String, Tensor)> {
        // Mistral with a window of 3 keys, shorter than the rows.
        let window = (family == ModelFamily::Mistral)
            .then(|| crate::SlidingWindow { size: 3, layers: vec![true, true] });
        let config = crate::ModelConfig { sliding_window: window, ..tiny_config(family) };
        let model = tiny_model(&config, 21).unwrap();
        if let Some(checkpoint) = checkpoint {
            model.backbone.set_layerwise(Some(Layerwise::new(checkpoint, None)));
        }
        let ids = Tensor::from_slice(&[0i64, 5, 9, 13, 200, 7, 3, 4, 5, 6, 7, 8]).view([2, 6]);
        let mask = ids.ne(0).to_kind(Kind::Int64);
        for _ in 0..2 {
            let logits = model.forward(&ids, &mask, None).unwrap();
            let loss = logits.log_softmax(-1, Kind::Float).mean(Kind::Float);
            model.backward(&loss).unwrap();
        }
        model
            .named_parameters()
            .map(|(n, t)| (n.to_string(), t.grad().reshape([-1]).copy()))
            .collect()
    }

    /// Layer-by-layer execution, with and without recomputation, gives the gradients of one
    /// whole graph (two passes accumulated) within 1e-6 of the largest entry, for an untied
    /// and a tied model, with per-head norms and with sliding windows.
    #[test]
    fn layerwise_gradients_equal_whole_graph_ones() {
        let families =
            [ModelFamily::Llama, ModelFamily::Qwen2, ModelFamily::Qwen3, ModelFamily::Mistral];
        for family in families {
            let plain = gradients(family, None);
            for checkpoint in [false, true] {
                for ((name, a), (_, b)) in gradients(family, Some(checkpoint)).iter().zip(&plain) {
                    let scale = b.abs().max().double_value(&[]).max(1e-12);
                    let gap = (a - b).abs().max().double_value(&[]) / scale;
                    assert!(gap < 1e-6, "{family:?} checkpoint {checkpoint} {name}: {gap:e}");
                }
            }
        }
    }
}
