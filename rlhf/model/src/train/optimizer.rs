//! AdamW with global-norm gradient clipping, the warm-up + cosine schedule and gradient
//! accumulation over micro-batches, with its state saved to and loaded from a safetensors file
//! for resume.
//!
//! It is written over plain tensors rather than libtorch's C++ optimizer because the state must
//! be saved, loaded and (later) offloaded tensor by tensor, which the C++ optimizer does not
//! expose through `tch`. Moments are kept in float32 whatever the parameter dtype.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::schedule::ScheduleConfig;
use crate::error::{ModelError, Result};
use crate::safetensors_io::{read_file, write_file};

/// Added to the gradient norm when clipping, as `torch.nn.utils.clip_grad_norm_` does, so the
/// scale stays finite and the clipped norm lands just under the limit.
const CLIP_EPSILON: f64 = 1e-6;

/// AdamW and clipping settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerConfig {
    /// Learning-rate schedule.
    pub schedule: ScheduleConfig,
    /// First-moment decay. Default 0.9.
    pub beta1: f64,
    /// Second-moment decay. Default 0.95 (OpenRLHF's `adam_betas`).
    pub beta2: f64,
    /// Added to the denominator. Default 1e-8.
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices only (not to norms and biases). Default 0.
    pub weight_decay: f64,
    /// Gradients are scaled so their global L2 norm is at most this; 0 disables. Default 1.0.
    pub max_grad_norm: f64,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            schedule: ScheduleConfig::default(),
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
        }
    }
}

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// The 1-based number of the step just taken.
    pub step: u64,
    /// The learning rate it used.
    pub lr: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
}

/// The factor gradients are scaled by so their global norm is at most `max_grad_norm`
/// (`torch.nn.utils.clip_grad_norm_`); 1 when clipping is off or not needed.
pub fn clip_coefficient(max_grad_norm: f64, grad_norm: f64) -> f64 {
    if max_grad_norm > 0.0 && grad_norm > max_grad_norm {
        max_grad_norm / (grad_norm + CLIP_EPSILON)
    } else {
        1.0
    }
}

/// One AdamW update's constants: the same element-wise arithmetic for a whole tensor
/// ([`AdamW::step`]) or a rank's flat shard of many (ZeRO), so both give equal values.
#[derive(Debug, Clone, Copy)]
pub struct AdamWUpdate {
    lr: f64,
    clip: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    bias1: f64,
    bias2_sqrt: f64,
}

impl AdamWUpdate {
    /// The constants of update number `step` (1-based) at rate `lr` with gradients scaled by
    /// `clip`.
    pub fn new(config: &OptimizerConfig, step: u64, lr: f64, clip: f64) -> Self {
        let t = i32::try_from(step).unwrap_or(i32::MAX);
        Self {
            lr,
            clip,
            beta1: config.beta1,
            beta2: config.beta2,
            eps: config.eps,
            weight_decay: config.weight_decay,
            bias1: 1.0 - config.beta1.powi(t),
            bias2_sqrt: (1.0 - config.beta2.powi(t)).sqrt(),
        }
    }

    /// `value` after decoupled weight decay (applied to matrices only, by the caller's choice).
    pub fn decayed(&self, value: &Tensor) -> Result<Tensor> {
        Ok(value.f_mul_scalar(1.0 - self.lr * self.weight_decay)?)
    }

    /// Updates the float32 moments with gradient `grad` and returns `value` (float32) minus the
    /// Adam step.
    pub fn apply(
        &self,
        value: Tensor,
        grad: &Tensor,
        exp_avg: &mut Tensor,
        exp_avg_sq: &mut Tensor,
    ) -> Result<Tensor> {
        let (b1, b2) = (self.beta1, self.beta2);
        let g = grad.f_to_kind(Kind::Float)?.f_mul_scalar(self.clip)?;
        let _ = exp_avg.f_mul_scalar_(b1)?.f_add_(&g.f_mul_scalar(1.0 - b1)?)?;
        let _ = exp_avg_sq.f_mul_scalar_(b2)?.f_add_(&g.f_mul(&g)?.f_mul_scalar(1.0 - b2)?)?;
        let denom = exp_avg_sq.f_sqrt()?.f_div_scalar(self.bias2_sqrt)?.f_add_scalar(self.eps)?;
        Ok(value.f_sub(&exp_avg.f_div(&denom)?.f_mul_scalar(self.lr / self.bias1)?)?)
    }
}

/// AdamW over a set of named parameters.
#[derive(Debug)]
pub struct AdamW {
    /// The settings.
    pub config: OptimizerConfig,
    params: Vec<(String, Tensor)>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    step: u64,
}

impl AdamW {
    /// An optimizer over `params` (shallow clones of the model's tensors).
    pub fn new<'a>(
        params: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
        config: OptimizerConfig,
    ) -> Result<Self> {
        let params: Vec<(String, Tensor)> =
            params.into_iter().map(|(n, t)| (n.to_string(), t.shallow_clone())).collect();
        let zeros = |t: &Tensor| Tensor::f_zeros(t.size(), (Kind::Float, t.device()));
        let exp_avg = params.iter().map(|(_, t)| zeros(t)).collect::<Result<Vec<_>, _>>()?;
        let exp_avg_sq = params.iter().map(|(_, t)| zeros(t)).collect::<Result<Vec<_>, _>>()?;
        Ok(Self { config, params, exp_avg, exp_avg_sq, step: 0 })
    }

    /// Optimizer steps taken so far.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// The learning rate the next step will use.
    pub fn current_lr(&self) -> f64 {
        self.config.schedule.lr_at(self.step)
    }

    /// Moves the whole training state (every parameter's storage, its gradient and both AdamW
    /// moments) to `device`, e.g. to host memory while the engines generate and back before
    /// training. Parameters move in place (`set_data`), so the model's layers, which hold
    /// shallow clones of the same tensors, follow without being rebuilt.
    pub fn move_to(&mut self, device: Device) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for (_, param) in &self.params {
                let grad = param.grad();
                if grad.defined() {
                    grad.shallow_clone().f_set_data(&grad.f_to_device(device)?)?;
                }
                param.shallow_clone().f_set_data(&param.f_to_device(device)?)?;
            }
            for moment in self.exp_avg.iter_mut().chain(self.exp_avg_sq.iter_mut()) {
                *moment = moment.f_to_device(device)?;
            }
            Ok(())
        })
    }

    /// `(parameter name, exp_avg, exp_avg_sq)` for every parameter, in order: for a sharding
    /// manager that lays the moments out in flat buffers and moves them between the device
    /// and host memory. It repoints them with `set_data` on shallow clones, which keeps these
    /// tensors (the step updates them in place); [`AdamW::load`] and [`AdamW::move_to`]
    /// replace them with new tensors instead.
    pub fn moments(&self) -> impl Iterator<Item = (&str, &Tensor, &Tensor)> {
        self.params
            .iter()
            .zip(self.exp_avg.iter().zip(&self.exp_avg_sq))
            .map(|((name, _), (avg, avg_sq))| (name.as_str(), avg, avg_sq))
    }

    /// Clears every gradient.
    pub fn zero_grad(&mut self) {
        for (_, p) in &mut self.params {
            p.zero_grad();
        }
    }

    /// Global L2 norm of all gradients (parameters without a gradient count as zero).
    pub fn grad_norm(&self) -> Result<f64> {
        let mut sum_sq = 0.0;
        for (_, p) in &self.params {
            let g = p.grad();
            if g.defined() {
                let n = g.f_to_kind(Kind::Float)?.f_norm()?.f_double_value(&[])?;
                sum_sq += n * n;
            }
        }
        Ok(sum_sq.sqrt())
    }

    /// Names of parameters whose gradient is missing or all zero (a test of wiring).
    pub fn params_without_grad(&self) -> Result<Vec<String>> {
        let mut names = Vec::new();
        for (name, p) in &self.params {
            let g = p.grad();
            if !g.defined() || g.f_abs()?.f_max()?.f_double_value(&[])? == 0.0 {
                names.push(name.clone());
            }
        }
        Ok(names)
    }

    /// Clips, applies one AdamW update with the scheduled rate, clears gradients.
    pub fn step(&mut self) -> Result<StepStats> {
        let grad_norm = self.grad_norm()?;
        if !grad_norm.is_finite() {
            return Err(ModelError::Input(format!(
                "gradient norm should be finite, found {grad_norm}"
            )));
        }
        let clip = clip_coefficient(self.config.max_grad_norm, grad_norm);
        let lr = self.current_lr();
        let update = AdamWUpdate::new(&self.config, self.step + 1, lr, clip);
        tch::no_grad(|| -> Result<()> {
            for (i, (_, p)) in self.params.iter().enumerate() {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let mut value = p.f_to_kind(Kind::Float)?;
                if self.config.weight_decay > 0.0 && p.dim() > 1 {
                    value = update.decayed(&value)?;
                }
                let value =
                    update.apply(value, &g, &mut self.exp_avg[i], &mut self.exp_avg_sq[i])?;
                let mut target = p.shallow_clone();
                target.f_copy_(&value)?;
            }
            Ok(())
        })?;
        self.step += 1;
        self.zero_grad();
        Ok(StepStats { step: self.step, lr, grad_norm })
    }

    /// One optimizer step over several micro-batches: `loss_fn` returns each micro-batch's mean
    /// loss, which is scaled by `1 / micro_batches.len()` before `backward`, so the step sees
    /// the gradient of the mean over the whole batch. Returns the stats and the mean loss.
    pub fn step_accumulated<B>(
        &mut self,
        micro_batches: &[B],
        mut loss_fn: impl FnMut(&B) -> Result<Tensor>,
    ) -> Result<(StepStats, f64)> {
        if micro_batches.is_empty() {
            return Err(ModelError::Input(
                "step_accumulated needs at least one micro-batch, found 0".into(),
            ));
        }
        self.zero_grad();
        let scale = 1.0 / micro_batches.len() as f64;
        let mut total = 0.0;
        for batch in micro_batches {
            let loss = loss_fn(batch)?;
            total += loss.f_double_value(&[])?;
            loss.f_mul_scalar(scale)?.f_backward()?;
        }
        Ok((self.step()?, total * scale))
    }

    /// Writes the moments and the step count to a safetensors file.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut named: Vec<(String, &Tensor)> = Vec::new();
        for (i, (name, _)) in self.params.iter().enumerate() {
            named.push((format!("exp_avg.{name}"), &self.exp_avg[i]));
            named.push((format!("exp_avg_sq.{name}"), &self.exp_avg_sq[i]));
        }
        let mut metadata = HashMap::new();
        metadata.insert("step".to_string(), self.step.to_string());
        let config = serde_json::to_string(&self.config).map_err(|e| ModelError::json(path, e))?;
        metadata.insert("config".to_string(), config);
        write_file(path, named.iter().map(|(n, t)| (n.as_str(), *t)), metadata)
    }

    /// Loads moments and step count saved by [`AdamW::save`] for the same parameters. The
    /// config stays the one this optimizer was built with (a resumed run may change it).
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let (tensors, metadata) = read_file(path)?;
        let step = metadata.get("step").and_then(|s| s.parse::<u64>().ok()).ok_or_else(|| {
            ModelError::OptimizerState("file should record `step`, found none".into())
        })?;
        let by_name: HashMap<&str, &Tensor> =
            tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        if by_name.len() != 2 * self.params.len() {
            return Err(ModelError::OptimizerState(format!(
                "file should hold {} moment tensors, found {}",
                2 * self.params.len(),
                by_name.len()
            )));
        }
        for (i, (name, p)) in self.params.iter().enumerate() {
            for (prefix, target) in
                [("exp_avg", &mut self.exp_avg[i]), ("exp_avg_sq", &mut self.exp_avg_sq[i])]
            {
                let key = format!("{prefix}.{name}");
                let source = by_name.get(key.as_str()).ok_or_else(|| {
                    ModelError::OptimizerState(format!("file has no tensor `{key}`"))
                })?;
                if source.size() != p.size() {
                    return Err(ModelError::Shape {
                        name: key,
                        expected: p.size(),
                        found: source.size(),
                    });
                }
                *target = source.f_to_kind(Kind::Float)?.f_to_device(p.device())?;
            }
        }
        self.step = step;
        Ok(())
    }
}
