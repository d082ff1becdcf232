//! The rollout of a sequential step: the engines generate `n` samples per prompt; with
//! `algo.dynamic_sampling` (DAPO's dynamic sampling, verl's `filter_groups`) the samples are
//! scored at once, prompt groups whose rewards are all equal (no signal for a group baseline)
//! are dropped, and fresh prompts from the loader are generated for until the step has its
//! `rollout.prompts_per_step` groups or `max_gen_batches` rounds have run.

use rtrun_rlhf_engine::SamplingParams;

use crate::config::{PipelineMode, RolloutMode};
use crate::error::Result;
use crate::experience::Sequence;
use crate::prompts::PromptRecord;
use crate::rng::mix_seed;
use crate::trainer::agent::ToolStats;
use crate::trainer::stream::{
    self, AsyncBatch, AsyncRollout, AsyncSetup, DockSink, Finished, RolloutStream, STEPS_PER_POLL,
};
use crate::trainer::{ENGINE, ProgressObserver, Trainer, calls, stages};

/// Rewards of a group at most this far apart count as equal.
pub const EQUAL_REWARDS: f32 = 1e-6;

/// One prompt's samples.
#[derive(Debug, Clone)]
pub(super) struct Group {
    pub(super) record: PromptRecord,
    pub(super) prompt_ids: Vec<u32>,
    pub(super) responses: Vec<Vec<u32>>,
    pub(super) engine_log_probs: Vec<Vec<f32>>,
    /// Per response, which tokens are the model's (multi-turn rollouts; empty: all).
    pub(super) loss_masks: Vec<Vec<bool>>,
    rewards: Vec<f32>,
    /// What the filter reads: the reward source's `scores` when it gave them, else the rewards.
    scores: Vec<f32>,
}

impl Group {
    /// No samples yet.
    pub(super) fn new(record: PromptRecord, prompt_ids: Vec<u32>) -> Self {
        Self {
            record,
            prompt_ids,
            responses: Vec::new(),
            engine_log_probs: Vec::new(),
            loss_masks: Vec::new(),
            rewards: Vec::new(),
            scores: Vec::new(),
        }
    }

    /// Sample `i` as a sequence (with its loss mask).
    pub(super) fn sequence(&self, i: usize) -> Sequence {
        let mut sequence = Sequence::new(self.prompt_ids.clone(), self.responses[i].clone());
        sequence.loss_mask = self.loss_masks.get(i).cloned().unwrap_or_default();
        sequence
    }

    fn informative(&self) -> bool {
        let (lo, hi) = self
            .scores
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        hi - lo > EQUAL_REWARDS
    }
}

/// A step's samples, prompt-major, and their rewards when the rollout already scored them.
pub struct Rollout {
    /// The prompt of each sample.
    pub records: Vec<PromptRecord>,
    /// Prompt and response ids of each sample.
    pub sequences: Vec<Sequence>,
    /// The engine's per-token log-probs of each response.
    pub engine_log_probs: Vec<Vec<f32>>,
    /// Each sample's reward (dynamic sampling scores while it samples).
    pub rewards: Option<Vec<f32>>,
}

impl Trainer {
    /// Generates the step's samples for `records` (see the module doc).
    pub(super) fn rollout(
        &mut self,
        records: &[PromptRecord],
        prompt_ids: &[Vec<u32>],
        params: &SamplingParams,
        seed_base: u64,
        progress: &mut dyn ProgressObserver,
    ) -> Result<Rollout> {
        progress.phase("generate");
        let Some(dynamic) = self.config.algo.dynamic_sampling.clone() else {
            let groups = self.timed("generate", |t| -> Result<_> {
                t.wake_engines()?;
                let groups = t.generate_groups(records, prompt_ids, params, seed_base)?;
                t.record_gpu_memory("generate")?;
                t.sleep_engines_if_hybrid()?;
                Ok(groups)
            })?;
            return Ok(flatten(groups, false));
        };
        let wanted = records.len();
        let (mut kept, mut dropped) = (Vec::new(), Vec::new());
        let (mut records, mut prompt_ids) = (records.to_vec(), prompt_ids.to_vec());
        let mut rounds = 0;
        self.timed("generate", |t| t.wake_engines())?;
        loop {
            // Round 0 samples as a step without dynamic sampling does; later rounds reseed.
            let seed = if rounds == 0 { seed_base } else { mix_seed(seed_base, 1 << 32 | rounds) };
            let mut groups =
                self.timed("generate", |t| t.generate_groups(&records, &prompt_ids, params, seed))?;
            self.timed("reward", |t| t.score(&mut groups))?;
            rounds += 1;
            for group in groups {
                if group.informative() { kept.push(group) } else { dropped.push(group) }
            }
            if kept.len() >= wanted || rounds >= dynamic.max_gen_batches as u64 {
                break;
            }
            let more = self.state.loader.next_batch(wanted - kept.len());
            records = more.iter().map(|&i| self.train_data[i].clone()).collect();
            prompt_ids = records
                .iter()
                .map(|r| self.tokenizer.encode_prompt(&r.prompt))
                .collect::<Result<Vec<_>>>()?;
        }
        self.timed("generate", |t| -> Result<_> {
            t.record_gpu_memory("generate")?;
            t.sleep_engines_if_hybrid()
        })?;
        // Every round generated for the groups still missing, so kept + dropped cover the
        // step; when the rounds ran out, all-equal groups fill it (they add no policy gradient
        // under a group baseline).
        let dropped_count = dropped.len();
        let filled = wanted.saturating_sub(kept.len());
        if filled > 0 {
            tracing::warn!(
                rounds,
                filled,
                "algo.dynamic_sampling: {rounds} generation rounds left {filled} of {wanted} \
                 prompt groups without differing rewards; they fill the step"
            );
        }
        kept.truncate(wanted);
        kept.extend(dropped.into_iter().take(filled));
        if let Ok(mut metrics) = self.phase_metrics.lock() {
            metrics.push(("dynamic_sampling/gen_batches".into(), rounds as f64));
            metrics.push(("dynamic_sampling/dropped_groups".into(), dropped_count as f64));
            metrics.push(("dynamic_sampling/filled_groups".into(), filled as f64));
        }
        Ok(flatten(kept, true))
    }

    /// A streamed step's samples: in async mode, `prompts_per_step` finished groups from the
    /// rollout thread at most `max_staleness` versions old; with `partial_threshold`, the
    /// groups carried from the last step plus fresh ones, once that share has finished.
    pub(super) fn streamed_rollout(
        &mut self,
        step: u64,
        params: SamplingParams,
        progress: &mut dyn ProgressObserver,
    ) -> Result<Rollout> {
        progress.phase("generate");
        let wanted = self.config.rollout.prompts_per_step;
        // Step `step` trains the policy of version `step - 1` (the weights the engines hold).
        let policy_version = step - 1;
        let groups = if self.config.rollout.mode == RolloutMode::Async {
            let taken = self.take_async(step, params)?;
            self.stop_async_if_last(step)?;
            taken
                .groups
                .into_iter()
                .map(|finished| match finished {
                    Finished::Group(group) => Ok(group),
                    Finished::Docked { slot, .. } => Err(crate::TrainError::role(
                        "pipeline",
                        format!("group in dock slot {slot} in a step without the dock"),
                    )),
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            let mut stream = match self.stream.take() {
                Some(stream) => stream,
                None => {
                    self.set_engine_version(policy_version)?;
                    RolloutStream::new(self.roles.engines.clone(), self.watch, params)
                }
            };
            let fresh = wanted.saturating_sub(stream.in_flight());
            let threshold = self.config.rollout.partial_threshold.unwrap_or(1.0);
            let enough = ((threshold * wanted as f64).ceil() as usize).clamp(1, wanted);
            let seed = self.config.seed;
            let groups = stream::draw_groups(
                &mut self.state.loader,
                fresh,
                &self.train_data,
                self.tokenizer.as_ref(),
                seed,
            )?;
            let carried = stream.in_flight();
            // A group queued `partial_max_carry` steps ago finishes in this one.
            let max_carry = self.config.rollout.partial_max_carry as u64;
            let overdue = |stream: &RolloutStream| {
                stream.oldest_step().is_some_and(|queued| step - queued >= max_carry)
            };
            let finished = self.timed("generate", |_| -> Result<_> {
                stream.submit(groups, step)?;
                let mut finished = Vec::new();
                while (finished.len() < enough || overdue(&stream)) && stream.in_flight() > 0 {
                    finished.extend(stream.poll(STEPS_PER_POLL)?);
                }
                Ok(finished)
            });
            let left = stream.in_flight();
            self.stream = Some(stream);
            let finished = finished?;
            self.push_metrics([
                ("partial/carried_in_groups".to_owned(), carried as f64),
                ("partial/carried_out_groups".to_owned(), left as f64),
            ]);
            finished
        };
        let (rollout, versions) = stream::into_rollout(groups, policy_version);
        self.push_metrics(versions.metrics());
        Ok(rollout)
    }

    /// `rollout.mode: async`: starts the rollout thread on the first step (writing finished
    /// groups into the dock with `train.pipeline: dock`), then takes the step's
    /// `prompts_per_step` groups at most `max_staleness` versions old.
    pub(super) fn take_async(&mut self, step: u64, params: SamplingParams) -> Result<AsyncBatch> {
        let wanted = self.config.rollout.prompts_per_step;
        // Step `step` trains the policy of version `step - 1` (the weights the engines hold).
        let policy_version = step - 1;
        if self.rollouter.is_none() {
            self.set_engine_version(policy_version)?;
            let dock = match self.config.train.pipeline {
                PipelineMode::Dock => {
                    let dock = self.roles.dock.clone().ok_or_else(|| {
                        crate::TrainError::role(
                            "dock",
                            "train.pipeline is `dock` but no dock actor was created",
                        )
                    })?;
                    let config = dock.config().map_err(|e| crate::TrainError::role("dock", e))?;
                    let (samples, slots) = (config.samples_per_prompt, config.prompts);
                    Some(DockSink { dock, samples, slots })
                }
                PipelineMode::Sequential => None,
            };
            self.rollouter = Some(AsyncRollout::start(AsyncSetup {
                stream: RolloutStream::new(self.roles.engines.clone(), self.watch, params),
                loader: self.state.loader.clone(),
                data: self.train_data.clone(),
                tokenizer: self.tokenizer.clone(),
                seed: self.config.seed,
                version: policy_version,
                per_step: wanted,
                staleness: self.config.rollout.staleness(),
                dock,
            })?);
        }
        let oldest_allowed = policy_version.saturating_sub(self.config.rollout.staleness());
        let taken = self.timed("generate", |t| match &t.rollouter {
            Some(rollouter) => rollouter.take(wanted, oldest_allowed),
            None => Err(crate::TrainError::Data("the rollout thread is gone".into())),
        })?;
        if let Some(rollouter) = &self.rollouter {
            // The checkpoint's position: prompts queued so far (what is in flight is not
            // trained on after a resume, never twice).
            self.state.loader = rollouter.loader();
        }
        self.push_metrics([
            ("async/stale_dropped_groups".to_owned(), taken.stale_dropped as f64),
            ("async/generate_s".to_owned(), taken.generate_s),
            ("async/wait_s".to_owned(), taken.wait_s),
        ]);
        Ok(taken)
    }

    /// Stops the rollout thread after the run's last step.
    pub(super) fn stop_async_if_last(&mut self, step: u64) -> Result<()> {
        if step >= self.total_steps()
            && let Some(rollouter) = self.rollouter.take()
        {
            self.state.loader = rollouter.stop()?;
        }
        Ok(())
    }

    /// Tags the engines' next tokens with policy version `version`.
    pub(super) fn set_engine_version(&self, version: u64) -> Result<()> {
        let engines = &self.roles.engines;
        self.watch
            .wait(
                "set_weight_version",
                calls::each(ENGINE, engines, |e| e.set_weight_version(version)),
            )
            .map(drop)
    }

    /// Adds figures to this step's metrics.
    pub(super) fn push_metrics(&self, figures: impl IntoIterator<Item = (String, f64)>) {
        if let Ok(mut metrics) = self.phase_metrics.lock() {
            metrics.extend(figures);
        }
    }

    /// `n` samples per prompt from the engines, one group per prompt.
    fn generate_groups(
        &self,
        records: &[PromptRecord],
        prompt_ids: &[Vec<u32>],
        params: &SamplingParams,
        seed_base: u64,
    ) -> Result<Vec<Group>> {
        let (groups, tools) = self.sample_groups(records, prompt_ids, params, seed_base)?;
        if let Some(stats) = tools {
            self.push_metrics(stats.metrics());
        }
        Ok(groups)
    }

    /// [`Trainer::generate_groups`] without recording metrics: the groups, and with tools what
    /// the tools did (multi-turn conversations, [`Trainer::agent_groups`]).
    pub(super) fn sample_groups(
        &self,
        records: &[PromptRecord],
        prompt_ids: &[Vec<u32>],
        params: &SamplingParams,
        seed_base: u64,
    ) -> Result<(Vec<Group>, Option<ToolStats>)> {
        if self.tools.is_some() {
            let (groups, stats) = self.agent_groups(records, prompt_ids, params, seed_base)?;
            return Ok((groups, Some(stats)));
        }
        let outputs = self.generate(prompt_ids, params, seed_base)?;
        let groups = outputs
            .into_iter()
            .zip(prompt_ids)
            .zip(records)
            .map(|((output, ids), record)| {
                let (responses, engine_log_probs) =
                    output.samples.into_iter().map(|s| (s.token_ids, s.log_probs)).unzip();
                let mut group = Group::new(record.clone(), ids.clone());
                (group.responses, group.engine_log_probs) = (responses, engine_log_probs);
                group
            })
            .collect();
        Ok((groups, None))
    }

    /// Every sample's reward, into its group.
    fn score(&self, groups: &mut [Group]) -> Result<()> {
        let mut records = Vec::new();
        let mut sequences = Vec::new();
        for group in groups.iter() {
            for i in 0..group.responses.len() {
                records.push(&group.record);
                sequences.push(group.sequence(i));
            }
        }
        let answer = stages::rewards(self, &records, &sequences)?.get(&self.watch)?;
        self.log_reward_extras(&answer);
        let scores = answer.scores.unwrap_or_else(|| answer.rewards.clone());
        let (mut rewards, mut scores) = (answer.rewards.into_iter(), scores.into_iter());
        for group in groups {
            let n = group.responses.len();
            group.rewards = rewards.by_ref().take(n).collect();
            group.scores = scores.by_ref().take(n).collect();
        }
        Ok(())
    }
}

/// The groups' samples, prompt-major; `scored`: with their rewards.
fn flatten(groups: Vec<Group>, scored: bool) -> Rollout {
    let mut rollout = Rollout {
        records: Vec::new(),
        sequences: Vec::new(),
        engine_log_probs: Vec::new(),
        rewards: scored.then(Vec::new),
    };
    for group in groups {
        let mut masks = group.loss_masks.into_iter();
        for (response, log_probs) in group.responses.into_iter().zip(group.engine_log_probs) {
            rollout.records.push(group.record.clone());
            let mut sequence = Sequence::new(group.prompt_ids.clone(), response);
            sequence.loss_mask = masks.next().unwrap_or_default();
            rollout.sequences.push(sequence);
            rollout.engine_log_probs.push(log_probs);
        }
        if let Some(rewards) = &mut rollout.rewards {
            rewards.extend(group.rewards);
        }
    }
    rollout
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(rewards: &[f32]) -> Group {
        Group {
            record: PromptRecord { prompt: "1>".into(), label: "1".into(), ..Default::default() },
            prompt_ids: vec![1, 2],
            responses: rewards.iter().map(|_| vec![3]).collect(),
            engine_log_probs: rewards.iter().map(|_| vec![-0.5]).collect(),
            loss_masks: Vec::new(),
            rewards: rewards.to_vec(),
            scores: rewards.to_vec(),
        }
    }

    #[test]
    fn a_group_informs_only_when_its_rewards_differ() {
        assert!(!group(&[1.0, 1.0, 1.0]).informative());
        assert!(!group(&[0.0, 0.0]).informative());
        assert!(!group(&[0.5, 0.5 + 1e-7]).informative());
        assert!(group(&[0.0, 1.0]).informative());
        assert!(group(&[0.25, 0.75, 0.75]).informative());
    }

    #[test]
    fn flattening_keeps_prompt_major_order_and_rewards() {
        let rollout = flatten(vec![group(&[0.0, 1.0]), group(&[0.5, 0.5])], true);
        assert_eq!(rollout.sequences.len(), 4);
        assert_eq!(rollout.rewards, Some(vec![0.0, 1.0, 0.5, 0.5]));
        assert!(flatten(vec![group(&[1.0])], false).rewards.is_none());
        // A multi-turn group's masks reach its sequences.
        let mut masked = group(&[1.0, 0.0]);
        masked.loss_masks = vec![vec![false], vec![true]];
        let rollout = flatten(vec![masked], false);
        assert_eq!(rollout.sequences[0].loss_mask, vec![false]);
        assert_eq!(rollout.sequences[1].loss_mask, vec![true]);
    }
}
