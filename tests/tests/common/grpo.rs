//! GRPO pipeline stages on the TransferDock doing real work with the tiny model of
//! `rtrun-rlhf-model`, shared by the pipeline test and the overlap benchmark.
//!
//! Every stage is a [`GrpoStage`] actor in its own worker process running
//! [`rtrun_rlhf_dock::run_stage`] against the dock actor; stages talk only through the dock:
//! - `rollout`: prompts → responses, sampled token by token from the policy (no KV cache; the
//!   tiny model is small enough to re-run the whole sequence per token);
//! - `rule_reward`: responses → rm_scores, the share of response tokens in the lower half of
//!   the vocabulary (a rule the policy can learn);
//! - `ref_log_prob` / `old_log_prob`: prompts + responses → per-token log-probs under the
//!   reference model and the rollout policy (`CausalLm::response_log_probs`);
//! - `compute_advantage`: rm_scores → advantages, GRPO's group-normalised score on every token;
//! - `actor_train`: everything → one clipped policy-gradient step with a k3 KL penalty per batch.

// Shared by a test and an example through `#[path]`; each uses only part of it.
#![allow(dead_code)]

use std::sync::Mutex;

use anyhow::Context;
use rtrun_rlhf_dock::{
    ColumnKind, ColumnValues, DockConfig, PackedBatch, PackedNamedColumn, PollConfig, RemoteDock,
    SampleOrder, SamplingConfig, StageSpec, StageTimeline, StageWorkError,
};
use rtrun_rlhf_model::tch::{self, Kind, Tensor};
use rtrun_rlhf_model::train::{AdamW, OptimizerConfig, ScheduleConfig, masked_mean};
use rtrun_rlhf_model::{CausalLm, ModelFamily, ResponseBatch};
use serde::{Deserialize, Serialize};

/// Token ids below this earn reward.
pub const REWARDED_BELOW: i64 = 192;
/// The tiny models' end-of-sequence id.
pub const EOS: i64 = 2;
/// The tiny models' padding id.
pub const PAD: i64 = 0;
/// The seed of the initial policy and of the reference model (the same weights).
pub const MODEL_SEED: u64 = 7;
/// GRPO's advantage denominator epsilon.
pub const ADVANTAGE_EPS: f32 = 1e-6;
/// PPO clip range.
pub const CLIP: f64 = 0.2;
/// KL penalty coefficient.
pub const KL_COEF: f64 = 0.01;
/// How long a stage waits without rows before it fails: long enough for a loaded machine,
/// short enough that a run whose upstream stage died fails within the test's hard timeout
/// (120 s, `.config/nextest.toml`) instead of being killed by it.
pub const STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The stages, in pipeline order: (consumer, inputs, outputs).
pub const STAGES: [(&str, &[&str], &[&str]); 6] = [
    ("rollout", &["prompts"], &["responses"]),
    ("rule_reward", &["responses"], &["rm_scores"]),
    ("ref_log_prob", &["prompts", "responses"], &["ref_log_prob"]),
    ("old_log_prob", &["prompts", "responses"], &["old_log_prob"]),
    ("compute_advantage", &["responses", "rm_scores"], &["advantages"]),
    ("actor_train", &["prompts", "responses", "old_log_prob", "ref_log_prob", "advantages"], &[]),
];

/// A consumer that reads everything after the run, for checks.
pub const AUDIT: &str = "audit";

/// The dock of one GRPO step: prompts × samples rows, the stages' columns and consumers plus
/// [`AUDIT`]; groups handed out in ascending order so a run is reproducible.
pub fn dock_config(prompts: usize, samples: usize) -> DockConfig {
    let mut config = DockConfig::new(prompts, samples)
        .with_column("prompts", ColumnKind::TokenIds)
        .with_column("responses", ColumnKind::TokenIds)
        .with_column("rm_scores", ColumnKind::Scalars)
        .with_column("ref_log_prob", ColumnKind::Floats)
        .with_column("old_log_prob", ColumnKind::Floats)
        .with_column("advantages", ColumnKind::Floats)
        .with_sampling(SamplingConfig {
            order: SampleOrder::Ascending,
            seed: 0,
            allow_short_final_batch: false,
        });
    for (consumer, _, _) in STAGES {
        config = config.with_consumer(consumer);
    }
    config.with_consumer(AUDIT)
}

/// Prompt `p`: a BOS then 3–8 ids from a fixed stream (the same prompt for its `n` rows).
pub fn prompt(p: usize) -> Vec<i64> {
    let mut state = (p as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut next = move || {
        state ^= state >> 29;
        state = state.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        state ^= state >> 32;
        state
    };
    let len = 3 + (next() % 6) as usize;
    std::iter::once(1).chain((0..len).map(|_| 3 + (next() % 381) as i64)).collect()
}

/// The rule reward of a response: the share of its tokens below [`REWARDED_BELOW`].
pub fn rule_reward(response: &[i64]) -> f32 {
    if response.is_empty() {
        return 0.0;
    }
    response.iter().filter(|t| **t < REWARDED_BELOW).count() as f32 / response.len() as f32
}

/// GRPO advantages of one group's scores: `(r - mean) / (std + eps)` with the unbiased std
/// (torch's default, as OpenRLHF uses).
pub fn group_advantages(scores: &[f32]) -> Vec<f32> {
    let n = scores.len() as f32;
    let mean = scores.iter().sum::<f32>() / n;
    let var = if scores.len() > 1 {
        scores.iter().map(|s| (s - mean).powi(2)).sum::<f32>() / (n - 1.0)
    } else {
        0.0
    };
    scores.iter().map(|s| (s - mean) / (var.sqrt() + ADVANTAGE_EPS)).collect()
}

/// What a stage actor does.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Role {
    /// Samples responses from the policy.
    Rollout {
        /// Most new tokens per response.
        max_new_tokens: usize,
    },
    /// Scores responses with [`rule_reward`].
    RuleReward,
    /// Log-probs under the reference model.
    RefLogProb,
    /// Log-probs under the rollout policy.
    OldLogProb,
    /// GRPO advantages.
    Advantage {
        /// Rows per prompt group.
        samples_per_prompt: usize,
    },
    /// Policy-gradient training.
    Train {
        /// Peak learning rate.
        lr: f64,
    },
}

/// Statistics of the training stage.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainStats {
    /// Loss of every step.
    pub losses: Vec<f64>,
    /// Mean ratio `exp(logp - old)` over action tokens of every step, before the step.
    pub ratios: Vec<f64>,
}

struct Model {
    lm: Option<CausalLm>,
    optimizer: Option<AdamW>,
    stats: TrainStats,
}

/// One stage process. The model lives behind a mutex because tch tensors are `Send` but not
/// `Sync`; only one call runs at a time anyway.
pub struct GrpoStage {
    role: Role,
    seed: u64,
    model: Mutex<Model>,
}

#[rtrun::actor(pub)]
impl GrpoStage {
    pub fn new(role: Role, seed: u64) -> Result<GrpoStage, String> {
        let needs_model = !matches!(role, Role::RuleReward | Role::Advantage { .. });
        let lm = if needs_model {
            let config = rtrun_rlhf_model::tiny::tiny_config(ModelFamily::Qwen2);
            Some(
                rtrun_rlhf_model::tiny::tiny_model(&config, MODEL_SEED)
                    .map_err(|e| e.to_string())?,
            )
        } else {
            None
        };
        let optimizer = match (role, &lm) {
            (Role::Train { lr }, Some(lm)) => {
                let config = OptimizerConfig {
                    schedule: ScheduleConfig { peak_lr: lr, ..ScheduleConfig::default() },
                    ..OptimizerConfig::default()
                };
                Some(AdamW::new(lm.named_parameters(), config).map_err(|e| e.to_string())?)
            }
            _ => None,
        };
        tch::set_num_threads(1);
        Ok(GrpoStage {
            role,
            seed,
            model: Mutex::new(Model { lm, optimizer, stats: TrainStats::default() }),
        })
    }

    /// Runs this stage against the dock until its consumer has received every row.
    pub fn run(&self, dock: RemoteDock, spec: StageSpec) -> Result<StageTimeline, String> {
        let mut model = self.model.lock().map_err(|_| "a previous run panicked".to_owned())?;
        rtrun_rlhf_dock::run_stage(&dock, &spec, |batch| self.work(&mut model, batch))
            .map_err(|e| e.to_string())
    }

    /// The training statistics so far.
    pub fn train_stats(&self) -> TrainStats {
        self.model.lock().map(|m| m.stats.clone()).unwrap_or_default()
    }

    /// The sum of every weight's absolute value, to see whether training changed the model.
    pub fn weight_checksum(&self) -> f64 {
        let Ok(model) = self.model.lock() else { return f64::NAN };
        let Some(lm) = &model.lm else { return 0.0 };
        tch::no_grad(|| {
            lm.named_parameters().map(|(_, t)| t.abs().sum(Kind::Double).double_value(&[])).sum()
        })
    }
}

impl GrpoStage {
    fn work(
        &self,
        model: &mut Model,
        batch: &PackedBatch,
    ) -> Result<Vec<PackedNamedColumn>, StageWorkError> {
        let out = match self.role {
            Role::Rollout { max_new_tokens } => {
                let prompts = token_rows(batch, "prompts")?;
                let lm = model.lm.as_ref().context("rollout without a model")?;
                let seed = self.seed ^ batch.rows.first().copied().unwrap_or(0) as u64;
                let responses = sample(lm, &prompts, max_new_tokens, seed)?;
                vec![PackedNamedColumn::new("responses", &ColumnValues::TokenIds(responses))]
            }
            Role::RuleReward => {
                let responses = token_rows(batch, "responses")?;
                let scores = responses.iter().map(|r| rule_reward(r)).collect();
                vec![PackedNamedColumn::new("rm_scores", &ColumnValues::Scalars(scores))]
            }
            Role::RefLogProb | Role::OldLogProb => {
                let name =
                    if self.role == Role::RefLogProb { "ref_log_prob" } else { "old_log_prob" };
                let lm = model.lm.as_ref().context("log-probs without a model")?;
                let layout =
                    Layout::new(&token_rows(batch, "prompts")?, &token_rows(batch, "responses")?)?;
                let log_probs = tch::no_grad(|| lm.response_log_probs(&layout.batch))?;
                vec![PackedNamedColumn::new(name, &ColumnValues::Floats(layout.unpad(&log_probs)?))]
            }
            Role::Advantage { samples_per_prompt: n } => {
                check_groups(batch, n)?;
                let responses = token_rows(batch, "responses")?;
                let scores = scalars(batch, "rm_scores")?;
                let advantages: Vec<Vec<f32>> = scores
                    .chunks(n)
                    .flat_map(group_advantages)
                    .zip(&responses)
                    .map(|(a, r)| vec![a; r.len()])
                    .collect();
                vec![PackedNamedColumn::new("advantages", &ColumnValues::Floats(advantages))]
            }
            Role::Train { .. } => {
                train_step(model, batch)?;
                Vec::new()
            }
        };
        Ok(out)
    }
}

fn check_groups(batch: &PackedBatch, n: usize) -> anyhow::Result<()> {
    let whole = n > 0
        && batch.rows.len().is_multiple_of(n)
        && batch.rows.chunks(n).all(|g| g[0] % n == 0 && g.windows(2).all(|w| w[1] == w[0] + 1));
    anyhow::ensure!(whole, "rows {:?} are not whole groups of {n}", batch.rows);
    Ok(())
}

fn token_rows(batch: &PackedBatch, name: &str) -> anyhow::Result<Vec<Vec<i64>>> {
    match batch.column(name) {
        Some(rtrun_rlhf_dock::PackedColumn::TokenIds(packed)) => Ok(packed.unpack()?),
        other => anyhow::bail!("expected token ids in `{name}`, found {other:?}"),
    }
}

fn float_rows(batch: &PackedBatch, name: &str) -> anyhow::Result<Vec<Vec<f32>>> {
    match batch.column(name) {
        Some(rtrun_rlhf_dock::PackedColumn::Floats(packed)) => Ok(packed.unpack()?),
        other => anyhow::bail!("expected float rows in `{name}`, found {other:?}"),
    }
}

fn scalars(batch: &PackedBatch, name: &str) -> anyhow::Result<Vec<f32>> {
    match batch.column(name) {
        Some(rtrun_rlhf_dock::PackedColumn::Scalars(values)) => Ok(values.clone()),
        other => anyhow::bail!("expected scalars in `{name}`, found {other:?}"),
    }
}

/// Samples up to `max_new` tokens per prompt (stopping at EOS, which is kept), batched with
/// left padding so every row's next token is read from the last column.
fn sample(
    lm: &CausalLm,
    prompts: &[Vec<i64>],
    max_new: usize,
    seed: u64,
) -> anyhow::Result<Vec<Vec<i64>>> {
    tch::manual_seed(seed as i64);
    let mut responses: Vec<Vec<i64>> = vec![Vec::new(); prompts.len()];
    let mut done = vec![false; prompts.len()];
    for _ in 0..max_new {
        let rows: Vec<Vec<i64>> =
            prompts.iter().zip(&responses).map(|(p, r)| [p.as_slice(), r].concat()).collect();
        let width = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(rows.len() * width);
        let mut mask = Vec::with_capacity(rows.len() * width);
        for row in &rows {
            ids.extend(std::iter::repeat_n(PAD, width - row.len()).chain(row.iter().copied()));
            mask.extend(std::iter::repeat_n(0i64, width - row.len()));
            mask.extend(std::iter::repeat_n(1i64, row.len()));
        }
        let shape = [rows.len() as i64, width as i64];
        let ids = Tensor::from_slice(&ids).view(shape);
        let mask = Tensor::from_slice(&mask).view(shape);
        let next: Vec<i64> = tch::no_grad(|| -> anyhow::Result<Vec<i64>> {
            let logits = lm.forward(&ids, &mask, None)?;
            let last = logits.select(1, width as i64 - 1);
            let probs = last.softmax(-1, Kind::Float);
            Ok(Vec::<i64>::try_from(probs.multinomial(1, true).view([-1]))?)
        })?;
        for ((response, token), finished) in responses.iter_mut().zip(next).zip(&mut done) {
            if !*finished {
                response.push(token);
                *finished = token == EOS;
            }
        }
        if done.iter().all(|d| *d) {
            break;
        }
    }
    Ok(responses)
}

/// OpenRLHF's experience layout: prompts left-padded to the longest prompt, responses
/// right-padded to the longest response, the action mask over the response columns.
struct Layout {
    batch: ResponseBatch,
    lengths: Vec<usize>,
}

impl Layout {
    fn new(prompts: &[Vec<i64>], responses: &[Vec<i64>]) -> anyhow::Result<Layout> {
        anyhow::ensure!(prompts.len() == responses.len(), "prompts and responses differ in count");
        let p = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let r = responses.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let (mut ids, mut mask, mut action) = (Vec::new(), Vec::new(), Vec::new());
        for (prompt, response) in prompts.iter().zip(responses) {
            ids.extend(std::iter::repeat_n(PAD, p - prompt.len()));
            ids.extend(prompt.iter().chain(response).copied());
            ids.extend(std::iter::repeat_n(PAD, r - response.len()));
            mask.extend(std::iter::repeat_n(0i64, p - prompt.len()));
            mask.extend(std::iter::repeat_n(1i64, prompt.len() + response.len()));
            mask.extend(std::iter::repeat_n(0i64, r - response.len()));
            action.extend(std::iter::repeat_n(1i64, response.len()));
            action.extend(std::iter::repeat_n(0i64, r - response.len()));
        }
        let b = prompts.len() as i64;
        let batch = ResponseBatch {
            input_ids: Tensor::from_slice(&ids).view([b, (p + r) as i64]),
            attention_mask: Tensor::from_slice(&mask).view([b, (p + r) as i64]),
            action_mask: Tensor::from_slice(&action).view([b, r as i64]),
        };
        Ok(Layout { batch, lengths: responses.iter().map(Vec::len).collect() })
    }

    /// `[batch, R]` per-token values back to one row per response, without the padding.
    fn unpad(&self, values: &Tensor) -> anyhow::Result<Vec<Vec<f32>>> {
        let r = values.size().get(1).copied().unwrap_or(0) as usize;
        let flat = Vec::<f32>::try_from(values.to_kind(Kind::Float).contiguous().view([-1]))?;
        Ok(self
            .lengths
            .iter()
            .enumerate()
            .map(|(i, len)| flat[i * r..i * r + len].to_vec())
            .collect())
    }

    /// Per-row values as a `[batch, R]` tensor, zero on padding.
    fn pad(&self, rows: &[Vec<f32>]) -> anyhow::Result<Tensor> {
        let r = self.batch.action_mask.size()[1] as usize;
        let mut flat = vec![0f32; rows.len() * r];
        for (i, (row, len)) in rows.iter().zip(&self.lengths).enumerate() {
            anyhow::ensure!(row.len() == *len, "row {i} has {} values for {len} tokens", row.len());
            flat[i * r..i * r + len].copy_from_slice(row);
        }
        Ok(Tensor::from_slice(&flat).view([rows.len() as i64, r as i64]))
    }
}

/// One clipped policy-gradient step with a k3 KL penalty to the reference (GRPO's loss, token
/// mean over the batch).
fn train_step(model: &mut Model, batch: &PackedBatch) -> anyhow::Result<()> {
    let layout = Layout::new(&token_rows(batch, "prompts")?, &token_rows(batch, "responses")?)?;
    let old = layout.pad(&float_rows(batch, "old_log_prob")?)?;
    let reference = layout.pad(&float_rows(batch, "ref_log_prob")?)?;
    let advantages = layout.pad(&float_rows(batch, "advantages")?)?;
    let mask = layout.batch.action_mask.to_kind(Kind::Float);
    let Model { lm, optimizer, stats } = model;
    let lm = lm.as_ref().context("training without a model")?;
    let optimizer = optimizer.as_mut().context("training without an optimizer")?;
    let log_probs = lm.response_log_probs(&layout.batch)?;
    let ratio = (&log_probs - &old).exp();
    let surrogate =
        (&ratio * &advantages).minimum(&(ratio.clamp(1.0 - CLIP, 1.0 + CLIP) * &advantages));
    let log_ratio = &reference - &log_probs;
    let kl = log_ratio.exp() - &log_ratio - 1.0;
    let loss = masked_mean(&(kl * KL_COEF - surrogate), &mask)?;
    let mean_ratio = tch::no_grad(|| masked_mean(&ratio, &mask))?.double_value(&[]);
    loss.backward();
    optimizer.step()?;
    stats.losses.push(loss.double_value(&[]));
    stats.ratios.push(mean_ratio);
    Ok(())
}

/// Stage specs in pipeline order for batches of `groups_per_batch` prompt groups, with
/// `ranks` DP ranks for every stage (the train stage always has one).
pub fn stage_specs(samples: usize, groups_per_batch: usize, ranks: usize) -> Vec<StageSpec> {
    let mut specs = Vec::new();
    for (consumer, inputs, outputs) in STAGES {
        let ranks = if consumer == "actor_train" { 1 } else { ranks };
        for rank in 0..ranks {
            specs.push(
                StageSpec::new(consumer, inputs, outputs, samples * groups_per_batch)
                    .with_rank(rank)
                    .with_poll(PollConfig {
                        stall_timeout: STALL_TIMEOUT,
                        ..PollConfig::default()
                    }),
            );
        }
    }
    specs
}

/// The role of a stage by consumer name.
pub fn role_of(
    consumer: &str,
    samples_per_prompt: usize,
    max_new_tokens: usize,
    lr: f64,
) -> anyhow::Result<Role> {
    Ok(match consumer {
        "rollout" => Role::Rollout { max_new_tokens },
        "rule_reward" => Role::RuleReward,
        "ref_log_prob" => Role::RefLogProb,
        "old_log_prob" => Role::OldLogProb,
        "compute_advantage" => Role::Advantage { samples_per_prompt },
        "actor_train" => Role::Train { lr },
        other => anyhow::bail!("no stage is called `{other}`"),
    })
}

/// Puts the prompts of every row (each prompt repeated for its `samples` rows).
pub fn put_prompts(dock: &RemoteDock, prompts: usize, samples: usize) -> anyhow::Result<()> {
    let rows: Vec<usize> = (0..prompts * samples).collect();
    let values: Vec<Vec<i64>> = rows.iter().map(|row| prompt(row / samples)).collect();
    dock.put_experience(PackedBatch {
        rows,
        columns: vec![PackedNamedColumn::new("prompts", &ColumnValues::TokenIds(values))],
    })?;
    Ok(())
}
