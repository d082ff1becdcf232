//! LoRA (Hu et al. 2021, as `peft` implements it): a trainable low-rank update `B A` beside a
//! frozen projection `W`, so that `y = x W^T + b + (alpha / r) * dropout(x) A^T B^T`.
//!
//! [`CausalLm::add_lora`] puts adapters on the projections `target_modules` names (`q_proj`,
//! `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`; `all-linear` for all seven,
//! peft's spelling) of every decoder layer, freezes every base weight (no gradient, so no
//! optimizer state either) and keeps the adapters in a registry of their own
//! ([`CausalLm::lora_parameters`]), named as the projection plus `.lora_A.weight` /
//! `.lora_B.weight`. `A` starts as `peft` starts it (Kaiming-uniform with `a = sqrt(5)`, i.e.
//! uniform in `±1/sqrt(in)`), `B` at zero, so a fresh adapter changes nothing.
//!
//! The adapters can be switched off ([`CausalLm::set_adapters_enabled`]): the model is then the
//! base model, which is how an RL run gets its reference policy without a second copy of the
//! base. [`CausalLm::merged_parameters`] folds the update into `W` (what a Hugging Face export
//! and an engine get); [`CausalLm::save_adapter`] / [`CausalLm::load_adapter`] write and read a
//! `peft` adapter directory (`adapter_config.json`, `adapter_model.safetensors` with peft's
//! `base_model.model.` names) that `PeftModel.from_pretrained` loads onto the base model.
//!
//! Dropout applies only while autograd records (training passes); log-prob and generation
//! passes run without it, as `peft` in eval mode.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::causal_lm::CausalLm;
use crate::config::{ModelConfig, write_json};
use crate::error::{ModelError, Result};
use crate::params::{Init, Parameters};
use crate::safetensors_io::{read_file, write_file};
use crate::scalar_head::{SCORE_WEIGHT, ScalarHeadModel};

/// The projections of a decoder layer an adapter may sit on, in layer order.
pub const LORA_TARGETS: [&str; 7] =
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// peft's name of an adapter tensor: `base_model.model.` + ours.
const PEFT_PREFIX: &str = "base_model.model.";

/// LoRA settings (OpenRLHF `--lora_rank/--lora_alpha/--lora_dropout/--target_modules`, peft's
/// `r/lora_alpha/lora_dropout/target_modules`).
///
/// Unset keys take OpenRLHF's defaults: `alpha` 16, `dropout` 0, `target_modules` all-linear.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// The rank `r` of every adapter.
    pub rank: i64,
    /// The update is scaled by `alpha / rank`.
    #[serde(default = "default_alpha")]
    pub alpha: f64,
    /// Dropout on the adapter's input while training, in `[0, 1)`.
    #[serde(default)]
    pub dropout: f64,
    /// Projections to adapt: names from [`LORA_TARGETS`], or `all-linear`.
    #[serde(default = "default_targets")]
    pub target_modules: Vec<String>,
}

fn default_alpha() -> f64 {
    16.0
}

fn default_targets() -> Vec<String> {
    vec!["all-linear".to_owned()]
}

impl LoraConfig {
    /// The projections named, in layer order; an error names an entry that is no projection.
    pub fn targets(&self) -> Result<Vec<&'static str>> {
        if self.target_modules.is_empty() {
            return Err(ModelError::Config(format!(
                "lora target_modules should name at least one of {}, or all-linear",
                LORA_TARGETS.join(", ")
            )));
        }
        for name in &self.target_modules {
            if name != "all-linear" && !LORA_TARGETS.contains(&name.as_str()) {
                return Err(ModelError::Config(format!(
                    "lora target_modules entry `{name}` names no module of the model: expected \
                     {} or all-linear",
                    LORA_TARGETS.join(", ")
                )));
            }
        }
        let all = self.target_modules.iter().any(|n| n == "all-linear");
        Ok(LORA_TARGETS
            .into_iter()
            .filter(|t| all || self.target_modules.iter().any(|n| n == t))
            .collect())
    }

    /// `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// `(out_features, in_features)` of each projection of `model`'s layers, by target name.
    fn projection_shapes(model: &ModelConfig) -> [(&'static str, (i64, i64)); 7] {
        let (hidden, inter) = (model.hidden_size, model.intermediate_size);
        let (q, kv) = (
            model.num_attention_heads * model.head_dim,
            model.num_key_value_heads * model.head_dim,
        );
        [
            ("q_proj", (q, hidden)),
            ("k_proj", (kv, hidden)),
            ("v_proj", (kv, hidden)),
            ("o_proj", (hidden, q)),
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ]
    }

    /// [`LoraConfig::validate`], and that the rank fits every targeted projection of
    /// `model` (a rank above a projection's smaller side adds nothing a full update lacks).
    pub fn check_against(&self, model: &ModelConfig) -> Result<()> {
        self.validate()?;
        let targets = self.targets()?;
        for (name, (out, input)) in Self::projection_shapes(model) {
            if targets.contains(&name) && self.rank > out.min(input) {
                return Err(ModelError::Config(format!(
                    "lora rank {} is larger than {name} ({out} x {input}) allows: at most {}",
                    self.rank,
                    out.min(input)
                )));
            }
        }
        Ok(())
    }

    /// Checks rank, alpha, dropout and target names.
    pub fn validate(&self) -> Result<()> {
        if self.rank <= 0 {
            return Err(ModelError::Config(format!(
                "lora rank should be positive, found {}",
                self.rank
            )));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(ModelError::Config(format!(
                "lora alpha should be positive, found {}",
                self.alpha
            )));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ModelError::Config(format!(
                "lora dropout should be in [0, 1), found {}",
                self.dropout
            )));
        }
        self.targets().map(drop)
    }
}

/// One projection's adapter.
#[derive(Debug)]
pub struct LoraAdapter {
    /// `A: [rank, in_features]`.
    pub a: Tensor,
    /// `B: [out_features, rank]`.
    pub b: Tensor,
    /// `alpha / rank`.
    pub scale: f64,
    /// Dropout on the input while training.
    pub dropout: f64,
    /// Shared by every adapter of the model ([`CausalLm::set_adapters_enabled`]).
    enabled: Arc<AtomicBool>,
}

impl LoraAdapter {
    /// The adapter's share of the projection of `x`, or `None` while adapters are off.
    pub(crate) fn delta(&self, x: &Tensor) -> Result<Option<Tensor>> {
        if !self.enabled.load(Ordering::Relaxed) {
            return Ok(None);
        }
        // Autograd records (a training pass) exactly when an op on the trainable `A` yields a
        // tensor that requires grad; a view costs nothing.
        let training = || -> Result<bool> { Ok(self.a.f_view([-1])?.requires_grad()) };
        let x = match self.dropout > 0.0 && training()? {
            true => x.f_dropout(self.dropout, true)?,
            false => x.shallow_clone(),
        };
        let low = x.f_linear::<Tensor>(&self.a, None)?;
        Ok(Some(low.f_linear::<Tensor>(&self.b, None)?.f_mul_scalar(self.scale)?))
    }

    /// `scale * B A`, the update folded into the weight.
    fn update(&self) -> Result<Tensor> {
        Ok(self.b.f_matmul(&self.a)?.f_mul_scalar(self.scale)?)
    }
}

/// The adapters of a model.
#[derive(Debug)]
pub struct Lora {
    /// Their settings.
    pub config: LoraConfig,
    /// `A` and `B` of every adapted projection, in layer order.
    pub params: Parameters,
    enabled: Arc<AtomicBool>,
}

/// The `adapter_config.json` fields rtrun writes and reads (peft writes more; the rest is
/// ignored on reading).
#[derive(Debug, Serialize, Deserialize)]
struct AdapterConfig {
    peft_type: String,
    r: i64,
    lora_alpha: f64,
    #[serde(default)]
    lora_dropout: f64,
    target_modules: TargetModules,
    #[serde(default)]
    base_model_name_or_path: Option<String>,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
}

/// peft writes `target_modules` as a list (or a set, also a list in JSON) or one string.
#[derive(Debug, Serialize, Deserialize)]
#[serde(untagged)]
enum TargetModules {
    One(String),
    Many(Vec<String>),
}

/// Puts adapters on the `config.target_modules` projections of every layer of `backbone`
/// (nothing is frozen here); `seed` draws `A`.
fn attach(
    backbone: &mut crate::Backbone,
    base: &Parameters,
    config: &LoraConfig,
    seed: u64,
) -> Result<Lora> {
    config.validate()?;
    let targets = config.targets()?;
    let mut params = Parameters::new(base.device(), base.kind(), seed);
    let enabled = Arc::new(AtomicBool::new(true));
    for (index, layer) in backbone.layers.iter_mut().enumerate() {
        for (path, linear) in layer.projections_mut() {
            let name = path.rsplit('.').next().unwrap_or(path);
            if !targets.contains(&name) {
                continue;
            }
            let stem = format!("model.layers.{index}.{path}");
            let size = linear.weight.size();
            let (out_features, in_features) = (size[0], size[1]);
            if config.rank > in_features.min(out_features) {
                return Err(ModelError::Config(format!(
                    "lora rank {} is larger than {stem} ({out_features} x {in_features}) \
                     allows: at most {}",
                    config.rank,
                    in_features.min(out_features)
                )));
            }
            let bound = 1.0 / (in_features as f64).sqrt();
            let a = params.create(
                &format!("{stem}.lora_A.weight"),
                &[config.rank, in_features],
                Init::Uniform(bound),
            )?;
            let b = params.create(
                &format!("{stem}.lora_B.weight"),
                &[out_features, config.rank],
                Init::Constant(0.0),
            )?;
            linear.lora = Some(LoraAdapter {
                a,
                b,
                scale: config.scale(),
                dropout: config.dropout,
                enabled: enabled.clone(),
            });
        }
    }
    Ok(Lora { config: config.clone(), params, enabled })
}

/// Adapters on `backbone` into `slot` (which must be empty), every weight of `params` frozen.
fn add_frozen(
    slot: &mut Option<Lora>,
    backbone: &mut crate::Backbone,
    params: &Parameters,
    config: &LoraConfig,
    seed: u64,
) -> Result<()> {
    if slot.is_some() {
        return Err(ModelError::Config("the model already has LoRA adapters".into()));
    }
    let lora = attach(backbone, params, config, seed)?;
    params.set_requires_grad(false)?;
    *slot = Some(lora);
    Ok(())
}

/// Every adapted projection of `backbone` with its update folded in, `(name, W + scale B A)`.
fn merged_projections_of(backbone: &crate::Backbone) -> Result<Vec<(String, Tensor)>> {
    let mut merged = Vec::new();
    tch::no_grad(|| -> Result<()> {
        for (index, layer) in backbone.layers.iter().enumerate() {
            for (name, linear) in layer.projections() {
                if let Some(adapter) = &linear.lora {
                    let update = adapter.update()?.f_to_kind(linear.weight.kind())?;
                    merged.push((
                        format!("model.layers.{index}.{name}.weight"),
                        linear.weight.f_add(&update)?,
                    ));
                }
            }
        }
        Ok(())
    })?;
    Ok(merged)
}

/// `params` with the merged projections in place of the base ones.
fn merged_with(params: &Parameters, merged: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    let mut merged: HashMap<String, Tensor> = merged.into_iter().collect();
    params
        .named()
        .map(|(name, tensor)| {
            let value = merged.remove(name).unwrap_or_else(|| tensor.shallow_clone());
            (name.to_owned(), value)
        })
        .collect()
}

/// Sets the dropout of every adapter of `backbone`.
fn set_dropout(backbone: &mut crate::Backbone, lora: Option<&mut Lora>, dropout: f64) {
    for layer in &mut backbone.layers {
        for (_, linear) in layer.projections_mut() {
            if let Some(adapter) = &mut linear.lora {
                adapter.dropout = dropout;
            }
        }
    }
    if let Some(lora) = lora {
        lora.config.dropout = dropout;
    }
}

/// Writes a `peft` adapter directory for `lora`: `adapter_config.json` (`base` as
/// `base_model_name_or_path`, `task_type`, `modules_to_save` named by `saved`) and
/// `adapter_model.safetensors` with the adapters and the `saved` whole modules.
fn write_adapter(
    dir: &Path,
    lora: &Lora,
    base: &str,
    task_type: &str,
    saved: &[(&str, &Tensor)],
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let targets = lora.config.targets()?.into_iter().map(String::from).collect();
    let config = AdapterConfig {
        peft_type: "LORA".into(),
        r: lora.config.rank,
        lora_alpha: lora.config.alpha,
        lora_dropout: lora.config.dropout,
        target_modules: TargetModules::Many(targets),
        base_model_name_or_path: Some(base.to_owned()),
        bias: Some("none".into()),
        use_rslora: false,
        use_dora: false,
    };
    let mut json = serde_json::to_value(&config).map_err(|e| ModelError::json(dir, e))?;
    if let Some(map) = json.as_object_mut() {
        map.insert("task_type".into(), task_type.into());
        map.insert("inference_mode".into(), true.into());
        map.insert("fan_in_fan_out".into(), false.into());
        if !saved.is_empty() {
            let modules: Vec<&str> =
                saved.iter().map(|(n, _)| n.split('.').next().unwrap_or(n)).collect();
            map.insert("modules_to_save".into(), modules.into());
        }
    }
    write_json(&dir.join("adapter_config.json"), &json)?;
    let mut named: Vec<(String, Tensor)> = lora
        .params
        .named()
        .map(|(name, t)| (format!("{PEFT_PREFIX}{name}"), t.shallow_clone()))
        .collect();
    named.extend(saved.iter().map(|(n, t)| (format!("{PEFT_PREFIX}{n}"), t.shallow_clone())));
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    write_file(
        &dir.join("adapter_model.safetensors"),
        named.iter().map(|(n, t)| (n.as_str(), t)),
        metadata,
    )
}

/// Copies the tensors of `dir`'s `adapter_model.safetensors` into `lora`'s adapters and into
/// `saved` (whole modules peft keeps, e.g. a score head: copied when present), each checked
/// against its target's shape.
fn read_adapter_weights(dir: &Path, lora: &Lora, saved: &[(&str, &Parameters)]) -> Result<()> {
    let weights = dir.join("adapter_model.safetensors");
    let tensors: HashMap<String, Tensor> = read_file(&weights)?.0.into_iter().collect();
    let check = |key: &str, found: &Tensor, target: &Tensor| -> Result<()> {
        if found.size() != target.size() {
            return Err(ModelError::Config(format!(
                "{}: `{key}` has shape {:?}, the model's projection needs {:?} (an adapter for \
                 another base model?)",
                weights.display(),
                found.size(),
                target.size()
            )));
        }
        Ok(())
    };
    for (name, tensor) in lora.params.named() {
        let key = format!("{PEFT_PREFIX}{name}");
        let found = tensors.get(&key).ok_or_else(|| {
            ModelError::Config(format!("{}: missing tensor `{key}`", weights.display()))
        })?;
        check(&key, found, tensor)?;
        lora.params.copy_into(name, found)?;
    }
    for (name, params) in saved {
        let key = format!("{PEFT_PREFIX}{name}");
        if let (Some(found), Some(target)) = (tensors.get(&key), params.get(name)) {
            check(&key, found, target)?;
            params.copy_into(name, found)?;
        }
    }
    Ok(())
}

impl CausalLm {
    /// Puts adapters on the `config.target_modules` projections of every layer and freezes
    /// every base weight; `seed` draws `A`.
    pub fn add_lora(&mut self, config: &LoraConfig, seed: u64) -> Result<()> {
        add_frozen(&mut self.lora, &mut self.backbone, &self.params, config, seed)
    }

    /// The adapters' parameters (the trainable ones of a LoRA model), if it has adapters.
    pub fn lora_parameters(&self) -> Option<&Parameters> {
        self.lora.as_ref().map(|lora| &lora.params)
    }

    /// Switches every adapter on or off (off: the model computes as its base model does).
    pub fn set_adapters_enabled(&self, enabled: bool) {
        if let Some(lora) = &self.lora {
            lora.enabled.store(enabled, Ordering::Relaxed);
        }
    }

    /// Sets the dropout of every adapter (training passes only; a loaded adapter keeps the
    /// dropout its directory names until this).
    pub fn set_lora_dropout(&mut self, dropout: f64) {
        set_dropout(&mut self.backbone, self.lora.as_mut(), dropout);
    }

    /// Every adapted projection's weight with its update folded in, `(name, W + scale B A)`
    /// (only the adapted ones: what changes when the adapters train).
    pub fn merged_projections(&self) -> Result<Vec<(String, Tensor)>> {
        merged_projections_of(&self.backbone)
    }

    /// Every parameter of the model with the adapters folded in (the base's own tensors where
    /// nothing is adapted): what a Hugging Face export holds.
    pub fn merged_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(merged_with(&self.params, self.merged_projections()?))
    }

    /// Writes a `peft` adapter directory: `adapter_config.json` (`base` as
    /// `base_model_name_or_path`) and `adapter_model.safetensors`.
    pub fn save_adapter(&self, dir: &Path, base: &str) -> Result<()> {
        let lora = self
            .lora
            .as_ref()
            .ok_or_else(|| ModelError::Config("the model has no LoRA adapters to save".into()))?;
        write_adapter(dir, lora, base, "CAUSAL_LM", &[])
    }

    /// Adds the adapters of the `peft` directory `dir` to a model without adapters: its
    /// settings from `adapter_config.json`, its tensors from `adapter_model.safetensors`, each
    /// checked against the model's projections (an adapter for another base model is an error
    /// naming the tensor and both shapes).
    pub fn load_adapter(&mut self, dir: &Path) -> Result<()> {
        add_from_dir(dir, |settings| self.add_lora(settings, 0))?;
        self.load_adapter_weights(dir)
    }

    /// Copies the tensors of the `peft` directory `dir`'s `adapter_model.safetensors` into the
    /// model's adapters (which must exist, with the same targets and rank), each checked
    /// against its adapter's shape.
    pub fn load_adapter_weights(&self, dir: &Path) -> Result<()> {
        read_adapter_weights(dir, no_adapters(self.lora.as_ref(), dir)?, &[])
    }
}

/// A model LoRA adapters go on: a causal LM, or a scalar-head model (reward model).
pub trait LoraModel {
    /// Fresh adapters (see [`CausalLm::add_lora`]).
    fn add_lora(&mut self, config: &LoraConfig, seed: u64) -> Result<()>;
    /// The adapters of a `peft` directory (see [`CausalLm::load_adapter`]).
    fn load_adapter(&mut self, dir: &Path) -> Result<()>;
    /// Every adapter's dropout.
    fn set_lora_dropout(&mut self, dropout: f64);
}

impl LoraModel for CausalLm {
    fn add_lora(&mut self, config: &LoraConfig, seed: u64) -> Result<()> {
        CausalLm::add_lora(self, config, seed)
    }
    fn load_adapter(&mut self, dir: &Path) -> Result<()> {
        CausalLm::load_adapter(self, dir)
    }
    fn set_lora_dropout(&mut self, dropout: f64) {
        CausalLm::set_lora_dropout(self, dropout)
    }
}

impl LoraModel for ScalarHeadModel {
    fn add_lora(&mut self, config: &LoraConfig, seed: u64) -> Result<()> {
        ScalarHeadModel::add_lora(self, config, seed)
    }
    fn load_adapter(&mut self, dir: &Path) -> Result<()> {
        ScalarHeadModel::load_adapter(self, dir)
    }
    fn set_lora_dropout(&mut self, dropout: f64) {
        ScalarHeadModel::set_lora_dropout(self, dropout)
    }
}

/// Adds the adapters `dir`'s `adapter_config.json` describes with `add`; an error names the
/// file.
fn add_from_dir(dir: &Path, add: impl FnOnce(&LoraConfig) -> Result<()>) -> Result<()> {
    let settings = read_adapter_config(dir)?;
    let path = dir.join("adapter_config.json");
    add(&settings).map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))
}

/// The adapters to load into, or an error naming the directory.
fn no_adapters<'a>(lora: Option<&'a Lora>, dir: &Path) -> Result<&'a Lora> {
    lora.ok_or_else(|| {
        ModelError::Config(format!(
            "loading {}: the model has no LoRA adapters to load into",
            dir.display()
        ))
    })
}

impl ScalarHeadModel {
    /// Puts adapters on the trunk's `config.target_modules` projections and freezes every
    /// trunk weight; the score head stays trained whole (peft's `modules_to_save` of a
    /// sequence-classification model). `seed` draws `A`.
    pub fn add_lora(&mut self, config: &LoraConfig, seed: u64) -> Result<()> {
        add_frozen(&mut self.lora, &mut self.backbone, &self.params, config, seed)?;
        let _ = self.score.weight.f_set_requires_grad(true)?;
        Ok(())
    }

    /// The adapters' parameters, if the model has adapters.
    pub fn lora_parameters(&self) -> Option<&Parameters> {
        self.lora.as_ref().map(|lora| &lora.params)
    }

    /// Sets the dropout of every adapter.
    pub fn set_lora_dropout(&mut self, dropout: f64) {
        set_dropout(&mut self.backbone, self.lora.as_mut(), dropout);
    }

    /// Every parameter with the adapters folded in: what a Hugging Face export holds.
    pub fn merged_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(merged_with(&self.params, merged_projections_of(&self.backbone)?))
    }

    /// Writes a `peft` adapter directory of a sequence-classification model: the adapters and
    /// the score head (`modules_to_save`), which `PeftModel.from_pretrained` loads onto
    /// `AutoModelForSequenceClassification`.
    pub fn save_adapter(&self, dir: &Path, base: &str) -> Result<()> {
        let lora = self
            .lora
            .as_ref()
            .ok_or_else(|| ModelError::Config("the model has no LoRA adapters to save".into()))?;
        write_adapter(dir, lora, base, "SEQ_CLS", &[(SCORE_WEIGHT, &self.score.weight)])
    }

    /// Adds the adapters (and the score head, when saved) of the `peft` directory `dir`.
    pub fn load_adapter(&mut self, dir: &Path) -> Result<()> {
        add_from_dir(dir, |settings| self.add_lora(settings, 0))?;
        self.load_adapter_weights(dir)
    }

    /// Copies `dir`'s adapter tensors (and its score head, when saved) into the model.
    pub fn load_adapter_weights(&self, dir: &Path) -> Result<()> {
        let lora = no_adapters(self.lora.as_ref(), dir)?;
        read_adapter_weights(dir, lora, &[(SCORE_WEIGHT, &self.params)])
    }
}

/// The settings of the `peft` adapter directory `dir` (its `adapter_config.json`): a LoRA
/// adapter without bias, rsLoRA or DoRA, or an error naming the file and the field.
pub fn read_adapter_config(dir: &Path) -> Result<LoraConfig> {
    let path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let config: AdapterConfig =
        serde_json::from_str(&text).map_err(|e| ModelError::json(&path, e))?;
    let bad = |what: String| ModelError::Config(format!("{}: {what}", path.display()));
    if config.peft_type != "LORA" {
        return Err(bad(format!("expected peft_type LORA, found {}", config.peft_type)));
    }
    if config.use_rslora || config.use_dora {
        return Err(bad("rsLoRA and DoRA adapters are not supported".into()));
    }
    if config.bias.as_deref().is_some_and(|b| b != "none") {
        return Err(bad(format!("expected bias none, found {:?}", config.bias)));
    }
    let target_modules = match config.target_modules {
        TargetModules::One(one) => vec![one],
        TargetModules::Many(many) => many,
    };
    // peft expands `all-linear` into full module paths (`model.layers.0.self_attn.q_proj`):
    // the projection names they end in, once each.
    let mut short: Vec<String> = Vec::new();
    for name in &target_modules {
        let last = name.rsplit('.').next().unwrap_or(name).to_owned();
        if !short.contains(&last) {
            short.push(last);
        }
    }
    let known = |n: &String| n == "all-linear" || LORA_TARGETS.contains(&n.as_str());
    let target_modules = if short.iter().all(known) { short } else { target_modules };
    Ok(LoraConfig {
        rank: config.r,
        alpha: config.lora_alpha,
        dropout: config.lora_dropout,
        target_modules,
    })
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind};

    use super::*;
    use crate::config::ModelFamily;
    use crate::tiny::{tiny_config, tiny_model};

    fn lora(rank: i64, targets: &[&str]) -> LoraConfig {
        LoraConfig {
            rank,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: targets.iter().map(|t| t.to_string()).collect(),
        }
    }

    fn inputs() -> (Tensor, Tensor) {
        let ids = Tensor::from_slice(&[0i64, 5, 9, 13, 200, 7, 3, 4, 5, 6, 7, 8]).view([2, 6]);
        let mask = ids.ne(0).to_kind(Kind::Int64);
        (ids, mask)
    }

    fn logits(model: &CausalLm) -> Tensor {
        let (ids, mask) = inputs();
        tch::no_grad(|| model.forward(&ids, &mask, None).unwrap())
    }

    /// Gives every `B` random values (a fresh adapter is zero).
    fn perturb(model: &CausalLm) {
        tch::no_grad(|| {
            for (name, t) in model.lora_parameters().unwrap().named() {
                if name.ends_with("lora_B.weight") {
                    t.shallow_clone().copy_(&(Tensor::randn_like(t) * 0.1));
                }
            }
        });
    }

    fn gap(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    #[test]
    fn adapters_train_alone_switch_off_to_the_base_and_merge_into_it() {
        tch::manual_seed(1);
        let config = tiny_config(ModelFamily::Qwen3);
        let base = tiny_model(&config, 3).unwrap();
        let mut model = tiny_model(&config, 3).unwrap();
        model.add_lora(&lora(4, &["q_proj", "v_proj", "down_proj"]), 7).unwrap();
        let names: Vec<&str> = model.lora_parameters().unwrap().named().map(|(n, _)| n).collect();
        assert_eq!(names.len(), 2 * 3 * config.num_hidden_layers as usize);
        assert_eq!(names[0], "model.layers.0.self_attn.q_proj.lora_A.weight");
        // A fresh adapter changes nothing.
        assert_eq!(gap(&logits(&model), &logits(&base)), 0.0);
        perturb(&model);
        let adapted = logits(&model);
        assert!(gap(&adapted, &logits(&base)) > 1e-3, "the adapters do nothing");
        // Off, the model is its base, exactly: the reference needs no second copy.
        model.set_adapters_enabled(false);
        assert_eq!(gap(&logits(&model), &logits(&base)), 0.0);
        model.set_adapters_enabled(true);

        // Gradients reach the adapters only.
        let (ids, mask) = inputs();
        let loss = model.forward(&ids, &mask, None).unwrap().mean(Kind::Float);
        model.backward(&loss).unwrap();
        assert!(model.named_parameters().all(|(_, t)| !t.grad().defined()));
        assert!(model.lora_parameters().unwrap().named().all(|(_, t)| t.grad().defined()));

        // The merged export is a plain checkpoint with the adapted model's outputs, and only
        // the adapted projections change.
        let dir = std::env::temp_dir().join(format!("rtrun-lora-merged-{}", std::process::id()));
        model.save_pretrained(&dir, &Default::default()).unwrap();
        let merged = CausalLm::from_pretrained(&dir, Device::Cpu, Kind::Float).unwrap();
        assert!(gap(&logits(&merged), &adapted) < 1e-5);
        let changed: Vec<String> =
            model.merged_projections().unwrap().into_iter().map(|(n, _)| n).collect();
        assert_eq!(changed.len(), 3 * config.num_hidden_layers as usize);
        assert!(changed.iter().all(|n| n.ends_with("q_proj.weight")
            || n.ends_with("v_proj.weight")
            || n.ends_with("down_proj.weight")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_peft_adapter_directory_round_trips_and_a_foreign_one_is_refused() {
        tch::manual_seed(2);
        let config = tiny_config(ModelFamily::Llama);
        let mut model = tiny_model(&config, 5).unwrap();
        model.add_lora(&lora(8, &["all-linear"]), 1).unwrap();
        perturb(&model);
        let dir = std::env::temp_dir().join(format!("rtrun-lora-adapter-{}", std::process::id()));
        model.save_adapter(&dir, "tiny-llama").unwrap();
        let written: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(written["peft_type"], "LORA");
        assert_eq!(written["r"], 8);
        assert_eq!(written["target_modules"].as_array().unwrap().len(), 7);
        let (tensors, _) = read_file(&dir.join("adapter_model.safetensors")).unwrap();
        assert!(tensors.iter().all(|(n, _)| n.starts_with("base_model.model.model.layers.")));

        let mut again = tiny_model(&config, 5).unwrap();
        again.load_adapter(&dir).unwrap();
        assert!(gap(&logits(&again), &logits(&model)) < 1e-6);

        // An adapter for another base (wider layers): the tensor and both shapes are named.
        let wider = crate::ModelConfig { hidden_size: 96, ..config.clone() };
        let mut other = tiny_model(&wider, 5).unwrap();
        let err = other.load_adapter(&dir).unwrap_err().to_string();
        assert!(err.contains("adapter_model.safetensors") && err.contains("lora_A"), "{err}");
        assert!(err.contains("another base model"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A reward model's trunk takes adapters, its score head stays trained: only they get
    /// gradients; the adapter directory (peft's sequence-classification layout, the head in
    /// `modules_to_save`) and the merged checkpoint both score as the adapted model does.
    #[test]
    fn a_scalar_head_model_adapts_its_trunk_and_trains_its_head() {
        tch::manual_seed(5);
        let config = tiny_config(ModelFamily::Qwen2);
        let mut model = ScalarHeadModel::new_random(&config, Device::Cpu, Kind::Float, 4).unwrap();
        model.add_lora(&lora(4, &["q_proj", "v_proj", "down_proj"]), 2).unwrap();
        let (ids, mask) = inputs();
        let scores = |m: &ScalarHeadModel| m.rewards(&ids, &mask).unwrap();
        scores(&model).sum(Kind::Float).backward();
        for (name, t) in model.named_parameters() {
            assert_eq!(t.grad().defined(), name == SCORE_WEIGHT, "`{name}`");
        }
        for (name, t) in model.lora_parameters().unwrap().named() {
            // A's gradient is zero while B is, but defined.
            assert!(t.grad().defined(), "`{name}`");
        }
        tch::no_grad(|| {
            for (name, t) in model.lora_parameters().unwrap().named() {
                if name.ends_with("lora_B.weight") {
                    t.shallow_clone().copy_(&(Tensor::randn_like(t) * 0.1));
                }
            }
            model.score.weight.shallow_clone().copy_(&(Tensor::randn_like(&model.score.weight)));
        });
        let expected = tch::no_grad(|| scores(&model));
        let dir = std::env::temp_dir().join(format!("rtrun-lora-rm-{}", std::process::id()));
        model.save_adapter(&dir.join("adapter"), "tiny-rm").unwrap();
        let written: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter/adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(
            (written["task_type"].as_str(), written["modules_to_save"][0].as_str()),
            (Some("SEQ_CLS"), Some("score"))
        );
        let mut again = ScalarHeadModel::new_random(&config, Device::Cpu, Kind::Float, 4).unwrap();
        again.load_adapter(&dir.join("adapter")).unwrap();
        assert!(gap(&tch::no_grad(|| scores(&again)), &expected) < 1e-6);
        model.save_pretrained(&dir.join("merged"), &Default::default()).unwrap();
        let merged =
            ScalarHeadModel::from_pretrained(&dir.join("merged"), Device::Cpu, Kind::Float, 0)
                .unwrap();
        // Scores reach ~20 with a random head: f32 rounds merged and unmerged sums apart by
        // a few 1e-7 of their size.
        let scale = expected.abs().max().double_value(&[]).max(1.0);
        assert!(gap(&tch::no_grad(|| scores(&merged)), &expected) < 1e-5 * scale);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// peft expands `all-linear` into module paths in the `adapter_config.json` it writes:
    /// they read as the projections they end in.
    #[test]
    fn peft_module_paths_read_as_projection_names() {
        let dir = std::env::temp_dir().join(format!("rtrun-lora-paths-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = serde_json::json!({
            "peft_type": "LORA", "r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "bias": "none",
            "target_modules": ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj",
                               "model.layers.0.mlp.up_proj"],
        });
        std::fs::write(dir.join("adapter_config.json"), json.to_string()).unwrap();
        let read = read_adapter_config(&dir).unwrap();
        assert_eq!(read.target_modules, ["o_proj", "up_proj"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_settings_name_what_is_wrong() {
        let config = tiny_config(ModelFamily::Qwen2);
        let err = |settings: LoraConfig| {
            let mut model = tiny_model(&config, 1).unwrap();
            model.add_lora(&settings, 0).unwrap_err().to_string()
        };
        let e = err(lora(4, &["q_proj", "qkv"]));
        assert!(e.contains("`qkv`") && e.contains("names no module"), "{e}");
        assert!(err(lora(0, &["q_proj"])).contains("rank should be positive"));
        // k_proj of the tiny Qwen2 is 64 -> 16: rank 17 is too large for it.
        let e = err(lora(17, &["k_proj"]));
        assert!(e.contains("k_proj") && e.contains("at most 16"), "{e}");
        assert!(err(lora(4, &[])).contains("target_modules"));
        let e = err(LoraConfig { dropout: 1.0, ..lora(4, &["q_proj"]) });
        assert!(e.contains("dropout"), "{e}");
    }
}
