//! The stages of one RL step, shared by both ways of running it. `train.pipeline: sequential`
//! (`Trainer::sequential_step`) runs each over the whole step in turn; `train.pipeline: dock`
//! (`pipeline.rs`) runs each over a few prompt groups at a time as TransferDock stages, so
//! rewards and log-probs start while the engines still generate. Either way a step is:
//!
//! 1. **generate**: [`generation_requests`] (one request of `n` samples per prompt, seeded by
//!    the prompt's index in the step) on the engines, answers checked by [`check_outputs`];
//! 2. **reward**: [`rewards`] (rule or custom functions as tasks, a remote server, Python
//!    workers or the reward-model group);
//! 3. **log-probs and values**: [`start_log_probs`] for the reference and the old policy, the
//!    critic's values (sequential only: the dock mode runs group-local estimators);
//! 4. **advantages**: [`assemble`] (KL to the reference, shaping, advantages, returns, the
//!    step's aggregates);
//! 5. **train**: [`train`], the policy and the critic over mini-batches and epochs;
//!
//! then the trainer sends the new weights to the engines. [`make_experience`] is stages 2-4 for
//! a whole batch with every role call in flight together.

use rtrun_rlhf_engine::{GenerationOutput, GenerationRequest, SamplingParams};
use tch::{Device, Kind, Tensor};

use crate::algo::{self, AdvantageInputs, RunningMoments};
use crate::config::RewardKind;
use crate::error::{Result, TrainError};
use crate::experience::{ExperienceRow, Sequence, pad_rows, unpad_rows};
use crate::prompts::PromptRecord;
use crate::reward::{
    RemoteRewardClient, RewardAnswer, RewardQuery, score_remote, score_with_function,
};
use crate::rng::{SplitMix64, mix_seed};
use crate::roles::critic::CriticTrainStats;
use crate::roles::lm::{GlobalBatch, PolicyTrainStats};
use crate::trainer::Trainer;
use crate::trainer::calls::{self, CallWatch, RankCall, RankName};

/// Stage 1's requests: for each `(index, prompt)`, `params` with the seed of the prompt's
/// index in the step, so a prompt samples the same whichever engine and batch it lands in.
pub fn generation_requests<'a>(
    prompts: impl IntoIterator<Item = (usize, &'a [u32])>,
    params: &SamplingParams,
    seed_base: u64,
) -> Vec<GenerationRequest> {
    prompts
        .into_iter()
        .map(|(index, ids)| GenerationRequest {
            prompt_token_ids: ids.to_vec(),
            params: SamplingParams {
                seed: Some(mix_seed(seed_base, index as u64)),
                ..params.clone()
            },
        })
        .collect()
}

/// Stage 1's answers: one output per request, each with `samples` samples.
pub fn check_outputs(
    outputs: Vec<GenerationOutput>,
    requests: usize,
    samples: usize,
) -> Result<Vec<GenerationOutput>> {
    if outputs.len() != requests {
        return Err(TrainError::role(
            "vllm_engine",
            format!("expected {requests} outputs, found {}", outputs.len()),
        ));
    }
    if let Some(short) = outputs.iter().find(|o| o.samples.len() != samples) {
        return Err(TrainError::role(
            "vllm_engine",
            format!("expected {samples} samples per prompt, found {}", short.samples.len()),
        ));
    }
    Ok(outputs)
}

/// Whose per-token log-probs stage 3 asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogProbs {
    /// The reference policy's: its own group, or with LoRA the policy ranks with their
    /// adapters off.
    Reference,
    /// The policy's as it generated the batch (the PPO ratio's denominator).
    Old,
}

/// Starts stage 3 for `sequences` on the ranks that answer `which` (split across their DP
/// ranks); `None` when the run has no reference.
pub fn start_log_probs(
    trainer: &Trainer,
    which: LogProbs,
    sequences: Vec<Sequence>,
) -> Option<Vec<RankCall<Vec<Vec<f32>>>>> {
    let roles = &trainer.roles;
    let policy = roles.actor.members();
    match which {
        LogProbs::Old => Some(calls::dispatch("actor", policy, sequences, |w, c| w.log_probs(c))),
        LogProbs::Reference => match &roles.reference {
            Some(g) => Some(calls::dispatch("ref", g.members(), sequences, |w, c| w.log_probs(c))),
            None if roles.reference_from_policy => {
                Some(calls::dispatch("actor", policy, sequences, |w, c| w.reference_log_probs(c)))
            }
            None => None,
        },
    }
}

/// Rewards being computed (by tasks, the reward-model group or Python workers), or already
/// known.
pub struct PendingRewards {
    /// Sources answering plain rewards (rules, custom functions, the reward model).
    plain: Vec<RankCall<Vec<f32>>>,
    /// Sources answering rewards with scores and logs (remote servers, Python functions).
    rich: Vec<RankCall<RewardAnswer>>,
    known: Option<RewardAnswer>,
}

impl PendingRewards {
    /// Rewards computed already.
    pub fn done(answer: RewardAnswer) -> Self {
        Self { plain: Vec::new(), rich: Vec::new(), known: Some(answer) }
    }

    fn plain(calls: Vec<RankCall<Vec<f32>>>) -> Self {
        Self { plain: calls, rich: Vec::new(), known: None }
    }

    fn rich(calls: Vec<RankCall<RewardAnswer>>) -> Self {
        Self { plain: Vec::new(), rich: calls, known: None }
    }

    /// Waits for every reward, in sequence order.
    pub fn get(self, watch: &CallWatch) -> Result<RewardAnswer> {
        if let Some(answer) = self.known {
            return Ok(answer);
        }
        if !self.rich.is_empty() {
            let answers = watch.wait("rewards", self.rich)?;
            return Ok(RewardAnswer::concat(answers));
        }
        Ok(RewardAnswer::rewards(watch.gather("rewards", self.plain)?))
    }
}

/// Starts computing the rewards of `sequences` (one per record) and returns at once.
pub fn rewards(
    trainer: &Trainer,
    records: &[&PromptRecord],
    sequences: &[Sequence],
) -> Result<PendingRewards> {
    let config = &trainer.config.reward;
    if config.kind == RewardKind::Model {
        let group = trainer.roles.reward_model.as_ref().ok_or_else(|| {
            TrainError::role(
                "reward",
                "reward.kind is `model` but no reward-model group was created",
            )
        })?;
        let sequences = match &trainer.reward_tokenizer {
            None => sequences.to_vec(),
            Some(rm) => retokenize(trainer, rm.as_ref(), records, sequences)?,
        };
        let calls = calls::dispatch("reward", group.members(), sequences, |w, c| w.rewards(c));
        return Ok(PendingRewards::plain(calls));
    }
    let queries: Vec<RewardQuery> = records
        .iter()
        .zip(sequences)
        .map(|(record, s)| RewardQuery {
            prompt: record.prompt.clone(),
            response: crate::tokenizer::response_text(trainer.tokenizer.as_ref(), s),
            label: record.label.clone(),
            data_source: record.data_source.clone(),
        })
        .collect();
    if let Some(group) = &trainer.roles.python_reward {
        let chunks = rtrun::split_batch(queries, group.members().len());
        let calls = calls::each_with("reward", group.members(), chunks, |w, c| w.score(c));
        return Ok(PendingRewards::rich(calls));
    }
    let chunks: Vec<(usize, Vec<RewardQuery>)> = rtrun::split_batch(queries, config.parallel_tasks)
        .into_iter()
        .filter(|c| !c.is_empty())
        .enumerate()
        .collect();
    let rank = |i| RankName { role: "reward", rank: i, actor: None, shard: None };
    if config.kind == RewardKind::Remote {
        let calls = chunks
            .into_iter()
            .map(|(i, chunk)| RankCall {
                rank: rank(i),
                answer: score_remote::remote(
                    RemoteRewardClient {
                        urls: config.url.0.clone(),
                        first: i,
                        timeout: std::time::Duration::from_secs_f64(config.timeout_s),
                        retries: config.max_retries,
                    },
                    chunk,
                ),
            })
            .collect();
        return Ok(PendingRewards::rich(calls));
    }
    let calls = chunks
        .into_iter()
        .map(|(i, chunk)| RankCall {
            rank: rank(i),
            answer: score_with_function::remote(
                config.name.clone(),
                config.by_source.clone(),
                chunk,
            ),
        })
        .collect();
    Ok(PendingRewards::plain(calls))
}

/// The sequences as the reward model's own tokenizer reads them: prompt text and decoded
/// response re-encoded, and the reward model's EOS appended where the response ended with one.
fn retokenize(
    trainer: &Trainer,
    rm: &dyn crate::tokenizer::PromptTokenizer,
    records: &[&PromptRecord],
    sequences: &[Sequence],
) -> Result<Vec<Sequence>> {
    let eos = trainer.tokenizer.eos_token_ids();
    let rm_eos = rm.eos_token_ids();
    records
        .iter()
        .zip(sequences)
        .map(|(record, s)| {
            let mut response_ids = rm
                .encode_response(&crate::tokenizer::response_text(trainer.tokenizer.as_ref(), s))?;
            if s.response_ids.last().is_some_and(|id| eos.contains(id))
                && let Some(&end) = rm_eos.first()
            {
                response_ids.push(end);
            }
            if response_ids.is_empty() {
                // The score is read at the last real token; an empty response reads it at the
                // prompt's end, which the reward model must still see as a response position.
                response_ids.extend(rm_eos.first());
            }
            Ok(Sequence::new(rm.encode_prompt(&record.prompt)?, response_ids))
        })
        .collect()
}

/// Samples whose reward is full (≥ 1 − 1e-6: exactly right for the built-in rules).
pub fn full_reward_count(rewards: &[f32]) -> usize {
    rewards.iter().filter(|&&r| r >= 1.0 - 1e-6).count()
}

/// Aggregates of one step's experience.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExperienceStats {
    /// Mean scalar reward.
    pub reward: f64,
    /// Fraction of samples with full reward.
    pub accuracy: f64,
    /// Mean per-token KL to the reference (0 without one).
    pub kl: f64,
    /// Mean response length.
    pub response_length: f64,
    /// Mean prompt + response length (OpenRLHF's `total_length`).
    pub total_length: f64,
    /// Mean sum of per-token rewards (OpenRLHF's `return`).
    pub token_return: f64,
    /// Mean absolute advantage.
    pub advantage_abs: f64,
    /// Mean |engine log-prob − policy log-prob| over response tokens: the rollout/trainer
    /// mismatch (near 0 when the engines hold the policy's weights).
    pub engine_logprob_gap: f64,
    /// Mean overlong penalty added to the rewards (`algo.overlong_penalty`; 0 when off).
    pub overlong_penalty: f64,
}

/// A step's training rows and their aggregates.
#[derive(Debug, Clone)]
pub struct ExperienceBatch {
    /// One row per sample, prompt-major.
    pub rows: Vec<ExperienceRow>,
    /// Aggregates for the metrics.
    pub stats: ExperienceStats,
    /// Each row's reward from the reward function or model, before any shaping.
    pub rewards: Vec<f32>,
    /// The running reward moments with this batch's rewards merged in
    /// (`algo.normalize_reward`), for the trainer's state.
    pub reward_moments: Option<RunningMoments>,
}

/// What a step's samples already have when make-experience starts (the dock's stages, or
/// dynamic sampling, computed it).
#[derive(Debug, Clone, Default)]
pub struct Known {
    /// Each sample's reward.
    pub rewards: Option<Vec<f32>>,
    /// Each sample's per-token reference log-probs.
    pub ref_log_probs: Option<Vec<Vec<f32>>>,
}

/// How a step makes its experience.
#[derive(Debug, Clone, Copy)]
pub struct ExperienceSettings {
    /// The KL coefficient of the step.
    pub kl_coef: f64,
    /// Whether the policy recomputes the old log-probs; without, the engine's sampling
    /// log-probs are the old log-probs (no policy forward pass; the gap in the stats is then 0
    /// and means nothing).
    pub recompute_old: bool,
}

/// Rewards and reference log-probs (unless `known` holds them already), old log-probs and
/// values in parallel, then advantages.
pub fn make_experience(
    trainer: &Trainer,
    records: &[&PromptRecord],
    sequences: Vec<Sequence>,
    engine_log_probs: &[Vec<f32>],
    settings: ExperienceSettings,
    known: Known,
) -> Result<ExperienceBatch> {
    let ExperienceSettings { kl_coef, recompute_old } = settings;
    let roles = &trainer.roles;
    // Everything in flight at once: the roles run in their own processes.
    let pending_rewards = match known.rewards {
        Some(rewards) => PendingRewards::done(RewardAnswer::rewards(rewards)),
        None => rewards(trainer, records, &sequences)?,
    };
    let ref_calls = match known.ref_log_probs {
        Some(_) => None,
        None => start_log_probs(trainer, LogProbs::Reference, sequences.clone()),
    };
    let old_calls = match recompute_old {
        true => start_log_probs(trainer, LogProbs::Old, sequences.clone()),
        false => None,
    };
    let value_calls = roles
        .critic
        .as_ref()
        .map(|g| calls::dispatch("critic", g.members(), sequences.clone(), |w, c| w.values(c)));
    let watch = &trainer.watch;
    let answer = pending_rewards.get(watch)?;
    trainer.log_reward_extras(&answer);
    let scalar_rewards = answer.rewards;
    let old_log_probs = match old_calls {
        Some(calls) => watch.gather("log_probs", calls)?,
        None => engine_log_probs.to_vec(),
    };
    let ref_log_probs = match ref_calls {
        Some(calls) => Some(watch.gather("log_probs", calls)?),
        None => known.ref_log_probs,
    };
    let values = match value_calls {
        Some(calls) => Some(watch.gather("values", calls)?),
        None => None,
    };
    assemble(
        trainer,
        sequences,
        engine_log_probs,
        RoleResults { scalar_rewards, old_log_probs, ref_log_probs, values },
        kl_coef,
    )
}

/// The task's rewards shaped for the advantages: the overlong penalty, then the running
/// normalisation (the metrics keep the task's own); with the penalties' sum and the merged
/// moments.
fn shape_rewards(
    trainer: &Trainer,
    rewards: &[f32],
    lengths: &[usize],
) -> (Vec<f32>, f64, Option<RunningMoments>) {
    let algo_config = &trainer.config.algo;
    let mut shaped = rewards.to_vec();
    let mut penalty_sum = 0.0;
    if let Some(p) = &algo_config.overlong_penalty {
        let budget = trainer.config.max_new_tokens();
        for (reward, &length) in shaped.iter_mut().zip(lengths) {
            let penalty = algo::overlong_penalty(length, budget, p.buffer_len, p.factor);
            penalty_sum += penalty;
            *reward += penalty as f32;
        }
    }
    let moments = algo_config.normalize_reward.then(|| {
        let moments = trainer.state.reward_moments.merge(&RunningMoments::of(&shaped));
        shaped.iter_mut().for_each(|r| *r = moments.normalize(*r));
        moments
    });
    (shaped, penalty_sum, moments)
}

/// The summed |engine − policy| log-prob over every response token.
fn absolute_gap(engine: &[Vec<f32>], policy: &[Vec<f32>]) -> f64 {
    engine
        .iter()
        .zip(policy)
        .flat_map(|(e, p)| e.iter().zip(p))
        .map(|(a, b)| f64::from((a - b).abs()))
        .sum()
}

/// What the roles computed for a batch of sequences, one entry per sequence.
#[derive(Debug, Clone, Default)]
pub struct RoleResults {
    /// Scalar rewards.
    pub scalar_rewards: Vec<f32>,
    /// Per-token log-probs under the policy that generated the batch.
    pub old_log_probs: Vec<Vec<f32>>,
    /// Per-token reference log-probs (when the run has a reference).
    pub ref_log_probs: Option<Vec<Vec<f32>>>,
    /// Per-token critic values (when the run has a critic).
    pub values: Option<Vec<Vec<f32>>>,
}

/// The maths of `make_experience` once the roles have answered: the KL to the reference,
/// advantages and returns, the step's aggregates and the training rows. Group-local
/// estimators give every prompt group the same result whether it is assembled alone or in a
/// larger batch, which the dock pipeline relies on.
pub fn assemble(
    trainer: &Trainer,
    sequences: Vec<Sequence>,
    engine_log_probs: &[Vec<f32>],
    results: RoleResults,
    kl_coef: f64,
) -> Result<ExperienceBatch> {
    let algo_config = &trainer.config.algo;
    let RoleResults { scalar_rewards, old_log_probs, ref_log_probs, values } = results;
    let count = sequences.len();
    for (name, len) in [
        ("reward", scalar_rewards.len()),
        ("vllm_engine", engine_log_probs.len()),
        ("actor", old_log_probs.len()),
        ("ref", ref_log_probs.as_ref().map_or(count, Vec::len)),
        ("critic", values.as_ref().map_or(count, Vec::len)),
    ] {
        if len != count {
            return Err(TrainError::role(name, format!("expected {count} results, found {len}")));
        }
    }

    let lengths: Vec<usize> = sequences.iter().map(|s| s.response_ids.len()).collect();
    let prompt_tokens: usize = sequences.iter().map(|s| s.prompt_ids.len()).sum();
    let width = lengths.iter().copied().max().unwrap_or(0).max(1) as i64;
    let device = Device::Cpu;
    let as_rows = |v: &[Vec<f32>]| -> Vec<Vec<f32>> { v.to_vec() };
    let tensor_of = |v: &[Vec<f32>]| -> Result<Tensor> {
        let refs: Vec<&[f32]> = v.iter().map(Vec::as_slice).collect();
        pad_rows(&refs, width, device)
    };
    // The model's tokens (a tool's answer in a multi-turn response takes no loss, KL or
    // advantage).
    let ones: Vec<Vec<f32>> = sequences
        .iter()
        .map(|s| (0..s.response_ids.len()).map(|i| f32::from(u8::from(s.counts(i)))).collect())
        .collect();
    let mask = tensor_of(&ones)?;
    let old = tensor_of(&old_log_probs)?;
    let kl = match &ref_log_probs {
        Some(r) => {
            Some(algo::approx_kl(&old, &tensor_of(r)?, algo_config.kl_estimator)?.f_mul(&mask)?)
        }
        None => None,
    };
    let values_tensor = match &values {
        Some(v) => Some(tensor_of(v)?),
        None => None,
    };
    let (shaped, penalty_sum, reward_moments) = shape_rewards(trainer, &scalar_rewards, &lengths);
    let scalar = Tensor::from_slice(&shaped);
    let reward_kl = if algo_config.use_kl_loss { None } else { kl.as_ref() };
    let advantages = algo::compute_advantages(
        &algo_config.advantage_config(),
        trainer.config.rollout.n_samples_per_prompt,
        if algo_config.use_kl_loss { 0.0 } else { kl_coef },
        AdvantageInputs {
            scalar_rewards: &scalar,
            action_mask: &mask,
            kl: reward_kl,
            values: values_tensor.as_ref(),
        },
    )?;
    let adv_rows = unpad_rows(&advantages.advantages, &lengths)?;
    let ret_rows = unpad_rows(&advantages.returns, &lengths)?;

    let tokens = mask.f_sum(Kind::Float)?.f_double_value(&[])?.max(1.0);
    let correct = full_reward_count(&scalar_rewards);
    let stats = ExperienceStats {
        engine_logprob_gap: absolute_gap(engine_log_probs, &old_log_probs) / tokens,
        reward: scalar_rewards.iter().map(|&r| f64::from(r)).sum::<f64>() / count.max(1) as f64,
        accuracy: correct as f64 / count.max(1) as f64,
        kl: match &kl {
            Some(kl) => kl.f_sum(Kind::Float)?.f_double_value(&[])? / tokens,
            None => 0.0,
        },
        response_length: lengths.iter().sum::<usize>() as f64 / count.max(1) as f64,
        total_length: (prompt_tokens + lengths.iter().sum::<usize>()) as f64 / count.max(1) as f64,
        token_return: advantages.token_rewards.f_sum(Kind::Float)?.f_double_value(&[])?
            / count.max(1) as f64,
        advantage_abs: advantages
            .advantages
            .f_abs()?
            .f_mul(&mask)?
            .f_sum(Kind::Float)?
            .f_double_value(&[])?
            / tokens,
        overlong_penalty: penalty_sum / count.max(1) as f64,
    };

    let is_weights = match trainer.config.rollout.tis_cap(algo_config) {
        Some(cap) => Some(truncated_is_weights(trainer, &old_log_probs, engine_log_probs, cap)?),
        None => None,
    };
    let empty = Vec::new();
    let ref_rows = ref_log_probs.as_deref().map(as_rows);
    let value_rows = values.as_deref().map(as_rows);
    let rows = sequences
        .into_iter()
        .enumerate()
        .map(|(i, sequence)| ExperienceRow {
            sequence,
            old_log_probs: old_log_probs[i].clone(),
            ref_log_probs: ref_rows.as_ref().map_or_else(|| empty.clone(), |r| r[i].clone()),
            values: value_rows.as_ref().map_or_else(|| empty.clone(), |v| v[i].clone()),
            advantages: adv_rows[i].clone(),
            returns: ret_rows[i].clone(),
            is_weights: is_weights.as_ref().map_or_else(|| empty.clone(), |w| w[i].clone()),
        })
        .collect();
    Ok(ExperienceBatch { rows, stats, rewards: scalar_rewards, reward_moments })
}

/// `algo.tis_cap`: each token's truncated importance weight of the policy before the update
/// (`old`) against the engine that sampled it; the step's metrics get their mean
/// (`tis/weight_mean`) and the share of tokens at the cap (`tis/capped_fraction`).
fn truncated_is_weights(
    trainer: &Trainer,
    old: &[Vec<f32>],
    engine: &[Vec<f32>],
    cap: f32,
) -> Result<Vec<Vec<f32>>> {
    let (mut sum, mut capped, mut tokens) = (0.0f64, 0usize, 0usize);
    let weights = old
        .iter()
        .zip(engine)
        .enumerate()
        .map(|(row, (old, engine))| {
            if old.len() != engine.len() {
                return Err(TrainError::role(
                    "vllm_engine",
                    format!(
                        "expected one log-prob per response token ({}) for algo.tis_cap, found \
                         {} in sample {row}",
                        old.len(),
                        engine.len()
                    ),
                ));
            }
            let row: Vec<f32> = old
                .iter()
                .zip(engine)
                .map(|(&o, &e)| algo::truncated_is_weight(o, e, cap))
                .collect();
            sum += row.iter().map(|&w| f64::from(w)).sum::<f64>();
            capped += row.iter().filter(|&&w| w >= cap).count();
            tokens += row.len();
            Ok(row)
        })
        .collect::<Result<Vec<_>>>()?;
    if let Ok(mut metrics) = trainer.phase_metrics.lock() {
        metrics.push(("tis/weight_mean".to_owned(), sum / tokens.max(1) as f64));
        metrics.push(("tis/capped_fraction".to_owned(), capped as f64 / tokens.max(1) as f64));
    }
    Ok(weights)
}

/// What the step's training did (means over mini-batches and ranks).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TrainStats {
    /// Policy statistics.
    pub policy: PolicyTrainStats,
    /// Critic statistics.
    pub critic: CriticTrainStats,
    /// Whether the policy was trained (it is frozen for `freezing_actor_steps`).
    pub actor_trained: bool,
}

/// `max_epochs` passes over the rows in seeded random order, in global mini-batches of
/// `train_batch_size`; each mini-batch is split across the DP ranks of the policy and of the
/// critic, which train concurrently.
pub fn train(
    trainer: &Trainer,
    rows: &[ExperienceRow],
    step: u64,
    kl_coef: f64,
) -> Result<TrainStats> {
    let config = &trainer.config;
    let roles = &trainer.roles;
    let train_actor = step > config.train.freezing_actor_steps;
    let mut stats = TrainStats { actor_trained: train_actor, ..TrainStats::default() };
    let mut policy_calls = 0usize;
    let mut critic_calls = 0usize;
    for epoch in 0..config.train.max_epochs {
        let mut order: Vec<usize> = (0..rows.len()).collect();
        let mut rng = SplitMix64::new(mix_seed(mix_seed(config.seed, step), epoch as u64));
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        for mini_batch in order.chunks(config.train.train_batch_size) {
            let batch: Vec<ExperienceRow> = mini_batch.iter().map(|&i| rows[i].clone()).collect();
            let global_tokens: usize = batch.iter().map(|r| r.sequence.response_ids.len()).sum();
            let policy_calls_now = if train_actor {
                let shares = rtrun::split_batch(batch.clone(), roles.actor.world_size());
                let members = roles.actor.members();
                Some(calls::each_with("actor", members, shares, |w, rows| {
                    let global = GlobalBatch { tokens: global_tokens, sequences: mini_batch.len() };
                    w.train(rows, kl_coef, global)
                }))
            } else {
                None
            };
            let critic_calls_now = roles.critic.as_ref().map(|critic| {
                let shares = rtrun::split_batch(batch, critic.world_size());
                calls::each_with("critic", critic.members(), shares, |w, rows| {
                    w.train(rows, global_tokens)
                })
            });
            if let Some(calls) = policy_calls_now {
                for s in trainer.watch.wait("train", calls)? {
                    add_policy(&mut stats.policy, &s);
                    policy_calls += 1;
                }
            }
            if let Some(calls) = critic_calls_now {
                for s in trainer.watch.wait("train", calls)? {
                    stats.critic.value_loss += s.value_loss;
                    stats.critic.grad_norm += s.grad_norm;
                    stats.critic.lr += s.lr;
                    critic_calls += 1;
                }
            }
        }
    }
    scale_policy(&mut stats.policy, policy_calls);
    if critic_calls > 0 {
        let k = critic_calls as f64;
        stats.critic.value_loss /= k;
        stats.critic.grad_norm /= k;
        stats.critic.lr /= k;
    }
    Ok(stats)
}

fn add_policy(total: &mut PolicyTrainStats, s: &PolicyTrainStats) {
    total.policy_loss += s.policy_loss;
    total.clip_fraction += s.clip_fraction;
    total.approx_kl += s.approx_kl;
    total.ref_kl += s.ref_kl;
    total.entropy += s.entropy;
    total.grad_norm += s.grad_norm;
    total.lr += s.lr;
    total.micro_batches += s.micro_batches;
}

fn scale_policy(total: &mut PolicyTrainStats, calls: usize) {
    if calls == 0 {
        return;
    }
    let k = calls as f64;
    total.policy_loss /= k;
    total.clip_fraction /= k;
    total.approx_kl /= k;
    total.ref_kl /= k;
    total.entropy /= k;
    total.grad_norm /= k;
    total.lr /= k;
    total.micro_batches /= k;
}
