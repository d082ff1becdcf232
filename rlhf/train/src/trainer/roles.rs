//! Creating the role groups and engines of a run (the calls to their ranks are in
//! [`crate::trainer::calls`]).

use std::path::Path;

use rtrun::ActorGroup;
use rtrun_rlhf_engine::{EngineActor, EngineActorConfig, EngineActorRef, EngineConfig};
use rtrun_rlhf_model::train::{OptimizerConfig, ScheduleConfig};

use rtrun_rlhf_dock::RemoteDock;

use crate::config::{
    LrScheduler, PipelineMode, RewardKind, RolloutMode, TrainConfig, WorkerThreads,
};
use crate::error::{Result, TrainError};
use crate::placement_map::RolePlacements;
use crate::python_reward::{PythonRewardConfig, PythonRewardWorker};
use crate::roles::critic::{
    CriticWorker, CriticWorkerConfig, RewardModelConfig, RewardModelWorker,
};
use crate::roles::lm::{LmWorker, LmWorkerConfig, PolicyLossConfig};
use crate::roles::{ThreadPlan, WorkerSetup};

/// Every role of a run.
pub struct Roles {
    /// Policy ranks.
    pub actor: ActorGroup<LmWorker>,
    /// Reference ranks (absent when no KL is used, and with LoRA, where the policy ranks
    /// compute the reference log-probs with their adapters off: see
    /// [`Roles::reference_from_policy`]).
    pub reference: Option<ActorGroup<LmWorker>>,
    /// Whether the reference is the policy's base model (LoRA without `reference.pretrain`):
    /// the policy ranks' `reference_log_probs`.
    pub reference_from_policy: bool,
    /// Critic ranks (GAE only).
    pub critic: Option<ActorGroup<CriticWorker>>,
    /// Reward-model ranks (`reward.kind: model`).
    pub reward_model: Option<ActorGroup<RewardModelWorker>>,
    /// Python reward workers (`reward.kind: python`, `reward.parallel_tasks` of them).
    pub python_reward: Option<ActorGroup<PythonRewardWorker>>,
    /// Generation engines: each engine's rank 0, the handle callers generate through.
    pub engines: Vec<EngineActorRef>,
    /// Every rank of each engine (`engine_ranks[e][r]`; one per engine without tensor
    /// parallelism): weight syncs give each rank its own shard.
    pub engine_ranks: Vec<Vec<EngineActorRef>>,
    /// The node of each rank of each engine (`engine_rank_nodes[e][r]`, as the rank reports
    /// it; empty without tensor parallelism), for errors that name a rank other than 0.
    pub engine_rank_nodes: Vec<Vec<String>>,
    /// Where everything was placed.
    pub placements: RolePlacements,
    /// The TransferDock actor of `train.pipeline: dock`.
    pub dock: Option<RemoteDock>,
}

/// The thread plan of every role worker: a fixed count, or with `auto` the workers that compute
/// at once in each phase (all of them counted, wherever they are placed, so co-located ranks
/// never oversubscribe a machine; on a cluster that errs towards too few threads, never too many).
/// Experience: policy (old log-probs, unless the engine's serve), reference, critic and
/// reward-model ranks in parallel; training: policy and critic ranks. With `rollout.mode:
/// async` the engines generate through every phase, so they count in both.
fn thread_plan(config: &TrainConfig, p: &RolePlacements, reward_model: bool) -> ThreadPlan {
    match config.cluster.threads_per_worker {
        WorkerThreads::Fixed(n) => ThreadPlan::Fixed(n),
        WorkerThreads::Auto => {
            let count = |yes: bool, replicas: usize| if yes { replicas as u32 } else { 0 };
            let engines = count(config.rollout.mode == RolloutMode::Async, p.engine.replicas);
            // Workers that compute in both phases: the critic, and async engines.
            let critic = count(config.algo.needs_critic(), p.critic.replicas) + engines;
            let experience = count(!config.old_logprobs_from_engine(), p.actor.replicas)
                + count(
                    config.algo.needs_reference() && !config.reference_from_policy(),
                    p.reference.replicas,
                )
                + critic
                + count(reward_model && config.reward.kind == RewardKind::Model, p.reward.replicas);
            ThreadPlan::Shared { experience, train: p.actor.replicas as u32 + critic }
        }
    }
}

/// The optimizer of a trained role at peak rate `lr` over `total_steps` optimizer steps, with
/// the run's schedule (`train.lr_scheduler`, `lr_warmup_steps` or `lr_warmup_ratio`,
/// `min_lr_ratio`).
pub fn optimizer(config: &TrainConfig, lr: f64, total_steps: u64) -> OptimizerConfig {
    let t = &config.train;
    let total_steps = total_steps.max(1);
    let warmup_steps = match t.lr_warmup_ratio {
        Some(ratio) => (ratio * total_steps as f64).ceil() as u64,
        None => t.lr_warmup_steps,
    };
    OptimizerConfig {
        schedule: ScheduleConfig {
            peak_lr: lr,
            warmup_steps,
            total_steps,
            min_lr_ratio: match t.lr_scheduler {
                LrScheduler::ConstantWithWarmup => 1.0,
                LrScheduler::CosineWithMinLr => t.min_lr_ratio,
            },
        },
        weight_decay: config.train.weight_decay,
        max_grad_norm: config.train.max_grad_norm,
        ..OptimizerConfig::default()
    }
}

impl Roles {
    /// Creates every group from `policy_dir` (the initial policy; also the reference and the
    /// critic's trunk) and `reward_dir` (a reward model, when the reward is model-based). On an
    /// error the spec's placement groups are removed again (with the actors already in them),
    /// so a refused run leaves the cluster's resources free.
    pub fn create(
        config: &TrainConfig,
        placements: RolePlacements,
        policy_dir: &Path,
        reward_dir: Option<&Path>,
        total_optimizer_steps: u64,
    ) -> Result<Roles> {
        let deployed = placements.clone();
        Self::create_in(config, placements, policy_dir, reward_dir, total_optimizer_steps)
            .inspect_err(|_| {
                let _ = deployed.remove();
            })
    }

    fn create_in(
        config: &TrainConfig,
        placements: RolePlacements,
        policy_dir: &Path,
        reward_dir: Option<&Path>,
        total_optimizer_steps: u64,
    ) -> Result<Roles> {
        let threads = thread_plan(config, &placements, reward_dir.is_some());
        let p = &placements;
        // Engine shapes first, before any actor starts.
        engine_count(config, p)?;
        check_tensor_parallel(policy_dir, config.engine.tensor_parallel_size)?;
        let actor_config = policy_config(config, threads, policy_dir, total_optimizer_steps);
        let actor =
            ActorGroup::create("actor", p.actor.replicas, Default::default(), |rank, options| {
                LmWorker::remote_with(placed(p, "actor", rank, options)?, actor_config.clone())
            })?;
        let reference_from_policy = config.reference_from_policy();
        let reference = match config.algo.needs_reference() && !reference_from_policy {
            true => Some(create_reference(config, p, threads, policy_dir, &actor_config)?),
            false => None,
        };
        let critic = match config.algo.needs_critic() {
            true => Some(create_critic(config, p, threads, policy_dir, total_optimizer_steps)?),
            false => None,
        };
        let reward_model = create_reward_model(config, p, threads, reward_dir)?;
        let python_reward = create_python_reward(config)?;
        let engine_ranks = create_engines(config, p, policy_dir)?;
        let engines = engine_ranks.iter().filter_map(|ranks| ranks.first().cloned()).collect();
        let engine_rank_nodes = engine_nodes(&engine_ranks);
        let dock = match config.train.pipeline {
            PipelineMode::Dock => Some(
                RemoteDock::create(
                    crate::trainer::dock_layout::dock_config(config),
                    rtrun::ActorOptions::default(),
                )
                .map_err(|e| TrainError::role("dock", e))?,
            ),
            PipelineMode::Sequential => None,
        };
        Ok(Roles {
            actor,
            reference,
            reference_from_policy,
            critic,
            reward_model,
            python_reward,
            engines,
            engine_ranks,
            engine_rank_nodes,
            placements,
            dock,
        })
    }

    /// Kills every role actor.
    pub fn kill(&self) {
        let _ = self.actor.kill();
        if let Some(g) = &self.reference {
            let _ = g.kill();
        }
        if let Some(g) = &self.critic {
            let _ = g.kill();
        }
        if let Some(g) = &self.reward_model {
            let _ = g.kill();
        }
        if let Some(g) = &self.python_reward {
            let _ = g.kill();
        }
        for e in self.engine_ranks.iter().flatten() {
            let _ = e.kill();
        }
        if let Some(dock) = &self.dock {
            let _ = dock.actor().kill();
        }
        let _ = self.placements.remove();
    }
}

/// The policy ranks' settings: model, optimizer, loss, sharding, LoRA.
fn policy_config(
    config: &TrainConfig,
    threads: ThreadPlan,
    policy_dir: &Path,
    total_optimizer_steps: u64,
) -> LmWorkerConfig {
    let loss = PolicyLossConfig {
        clip: config.algo.clip_config(),
        entropy_coef: config.algo.entropy_coef,
        use_kl_loss: config.algo.use_kl_loss,
        kl_estimator: config.algo.kl_estimator,
        micro_batch_size: config.train.micro_batch_size,
        micro_batch_tokens: config.train.micro_batch_tokens,
        share_prompt: config.train.share_prompt,
        loss_agg_mode: config.algo.loss_agg_mode,
        max_new_tokens: config.max_new_tokens(),
    };
    LmWorkerConfig {
        setup: WorkerSetup::on("actor", threads, &config.policy.device, config.policy.dtype),
        model_dir: policy_dir.to_path_buf(),
        optimizer: Some(optimizer(config, config.train.actor_lr, total_optimizer_steps)),
        loss,
        with_reference: false,
        shard: config.train.shard(),
        lora: config.policy.lora_setup(config.seed),
    }
}

/// The reference group: the policy's settings without an optimizer or adapters.
fn create_reference(
    config: &TrainConfig,
    p: &RolePlacements,
    threads: ThreadPlan,
    policy_dir: &Path,
    actor_config: &LmWorkerConfig,
) -> Result<ActorGroup<LmWorker>> {
    let ref_config = LmWorkerConfig {
        setup: WorkerSetup::on("ref", threads, &config.reference.device, config.reference.dtype),
        model_dir: config.reference.pretrain.clone().unwrap_or(policy_dir.to_path_buf()),
        optimizer: None,
        lora: None,
        ..actor_config.clone()
    };
    Ok(ActorGroup::create("ref", p.reference.replicas, Default::default(), |rank, options| {
        LmWorker::remote_with(placed(p, "ref", rank, options)?, ref_config.clone())
    })?)
}

/// The critic group (PPO with GAE).
fn create_critic(
    config: &TrainConfig,
    p: &RolePlacements,
    threads: ThreadPlan,
    policy_dir: &Path,
    total_optimizer_steps: u64,
) -> Result<ActorGroup<CriticWorker>> {
    let critic_config = CriticWorkerConfig {
        setup: WorkerSetup::on("critic", threads, &config.critic.device, config.critic.dtype),
        model_dir: config.critic.pretrain.clone().unwrap_or(policy_dir.to_path_buf()),
        optimizer: optimizer(config, config.train.critic_lr, total_optimizer_steps),
        value_clip: config.algo.value_clip,
        micro_batch_size: config.train.micro_batch_size,
        share_prompt: config.train.share_prompt,
        seed: config.seed,
        shard: config.train.shard(),
        lora: None,
    };
    Ok(ActorGroup::create("critic", p.critic.replicas, Default::default(), |rank, options| {
        CriticWorker::remote_with(placed(p, "critic", rank, options)?, critic_config.clone())
    })?)
}

/// The reward-model group, with `reward.kind: model`.
fn create_reward_model(
    config: &TrainConfig,
    p: &RolePlacements,
    threads: ThreadPlan,
    reward_dir: Option<&Path>,
) -> Result<Option<ActorGroup<RewardModelWorker>>> {
    let dir = match (config.reward.kind, reward_dir) {
        (RewardKind::Model, Some(dir)) => dir,
        (RewardKind::Model, None) => {
            return Err(TrainError::config(
                "reward.model_dir",
                "expected a reward model directory, found none",
            ));
        }
        _ => return Ok(None),
    };
    let rm_config = RewardModelConfig {
        setup: WorkerSetup::on("reward", threads, &config.reward.device, config.reward.dtype),
        model_dir: dir.to_path_buf(),
        micro_batch_size: config.train.micro_batch_size,
        shard: config.train.shard(),
    };
    Ok(Some(ActorGroup::create(
        "reward",
        p.reward.replicas,
        Default::default(),
        |rank, options| {
            RewardModelWorker::remote_with(placed(p, "reward", rank, options)?, rm_config.clone())
        },
    )?))
}

/// The Python reward workers, with `reward.kind: python`.
fn create_python_reward(config: &TrainConfig) -> Result<Option<ActorGroup<PythonRewardWorker>>> {
    let (RewardKind::Python, Some(path)) = (config.reward.kind, &config.reward.path) else {
        return Ok(None);
    };
    let python = PythonRewardConfig {
        python: config.reward.python.clone(),
        path: path.clone(),
        function: config.reward.function.clone(),
        timeout_s: config.reward.timeout_s,
    };
    Ok(Some(ActorGroup::create(
        "reward",
        config.reward.parallel_tasks,
        Default::default(),
        |_, options| PythonRewardWorker::remote_with(options, python.clone()),
    )?))
}

/// Every engine's tensor-parallel ranks (rank 0 first).
fn create_engines(
    config: &TrainConfig,
    p: &RolePlacements,
    policy_dir: &Path,
) -> Result<Vec<Vec<EngineActorRef>>> {
    let e = &config.engine;
    let engine_config = EngineActorConfig {
        model_dir: policy_dir.to_path_buf(),
        engine: EngineConfig {
            seed: config.seed,
            device: e.device.0.clone(),
            dtype: e.dtype.engine_name().to_owned(),
            kv_cache_bytes: e.kv_cache_bytes,
            max_num_seqs: e.max_num_seqs,
            tensor_parallel_size: e.tensor_parallel_size,
            weight_updates_in_flight: config.rollout.streams(),
            enforce_eager: e.enforce_eager,
            ..EngineConfig::default()
        },
    };
    // libtorch reads its intra-op thread count from OMP_NUM_THREADS when the engine's
    // process starts; without `engine.threads` it uses every core.
    let tp = engine_config.engine.tensor_parallel_size;
    (0..engine_count(config, p)?)
        .map(|engine| {
            let name = format!("vllm_engine-{engine}");
            let group = EngineActor::create_group(&name, &engine_config, |rank, base| {
                let base = match e.threads.or_else(|| async_engine_threads(config, p)) {
                    Some(n) => base.env("OMP_NUM_THREADS", &n.to_string()),
                    None => base,
                };
                p.options("vllm_engine", engine * tp + rank, base)
                    .map_err(|e| rtrun::Error::Invalid(e.to_string()))
            })
            .map_err(|e| TrainError::role("vllm_engine", e))?;
            Ok(group.members().to_vec())
        })
        .collect()
}

/// Where each rank of each tensor-parallel engine runs (nothing for one-rank engines): the
/// weight sync calls every rank, and a rank that died is named with its node.
fn engine_nodes(engine_ranks: &[Vec<EngineActorRef>]) -> Vec<Vec<String>> {
    engine_ranks
        .iter()
        .map(|ranks| match ranks.len() {
            1 => Vec::new(),
            _ => ranks
                .iter()
                .map(|rank| match rank.whereabouts().get() {
                    Ok(Ok(node)) => node,
                    Ok(Err(e)) => format!("unknown ({e})"),
                    Err(e) => format!("unknown ({e})"),
                })
                .collect(),
        })
        .collect()
}

/// `rollout.mode: async` with `cluster.threads_per_worker: auto` and no `engine.threads`: the
/// engines generate while the policy trains, so each gets the training phase's share of the
/// cores (the policy, critic and engine ranks computing at once) rather than every core.
fn async_engine_threads(config: &TrainConfig, p: &RolePlacements) -> Option<i32> {
    if config.rollout.mode != RolloutMode::Async
        || config.cluster.threads_per_worker != WorkerThreads::Auto
    {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let critic = if config.algo.needs_critic() { p.critic.replicas } else { 0 };
    let sharing = p.actor.replicas + critic + p.engine.replicas;
    Some(i32::try_from(cores / sharing.max(1)).unwrap_or(i32::MAX).max(1))
}

/// The number of engines: `cluster.engine_replicas` without a placement spec; with one, the
/// spec's `vllm_engine` bundles divided by `engine.tensor_parallel_size` (each engine takes that
/// many consecutive bundles).
fn engine_count(config: &TrainConfig, p: &RolePlacements) -> Result<usize> {
    let tp = config.engine.tensor_parallel_size;
    if p.spec.is_none() {
        return Ok(p.engine.replicas);
    }
    let bundles = p.engine.replicas;
    if bundles < tp || !bundles.is_multiple_of(tp) {
        return Err(TrainError::config(
            "engine.tensor_parallel_size",
            format!(
                "{tp} ranks per engine need a multiple of {tp} vllm_engine bundles in the placement \
                 spec, found {bundles}"
            ),
        ));
    }
    Ok(bundles / tp)
}

/// Checks that the policy's heads and MLP divide among `tp` engine ranks.
fn check_tensor_parallel(policy_dir: &Path, tp: usize) -> Result<()> {
    if tp <= 1 {
        return Ok(());
    }
    let key = "engine.tensor_parallel_size";
    let model = rtrun_rlhf_model::ModelConfig::from_dir(policy_dir)
        .map_err(|e| TrainError::config(key, format!("reading the policy's config: {e}")))?;
    rtrun_rlhf_engine::tp::TpLayout::new(&model, tp)
        .map(drop)
        .map_err(|e| TrainError::config(key, e.to_string()))
}

/// A rank's options: its group membership plus its bundle and share from the placement.
fn placed(
    p: &RolePlacements,
    role: &str,
    rank: usize,
    options: rtrun::ActorOptions,
) -> rtrun::Result<rtrun::ActorOptions> {
    p.options(role, rank, options).map_err(|e| rtrun::Error::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The schedule each key makes, at hand-computed steps: peak 1e-3 over 20 optimizer steps.
    #[test]
    fn the_learning_rate_schedule_follows_the_keys() {
        let config = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            TrainConfig::from_yaml("", "lr.yaml", &sets).unwrap()
        };
        let lr = |sets: &[&str], step: u64| optimizer(&config(sets), 1e-3, 20).schedule.lr_at(step);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-15;
        // The default: constant after warm-up.
        for step in [0, 7, 19, 25] {
            assert!(close(lr(&[], step), 1e-3));
        }
        assert!(close(lr(&["train.lr_warmup_steps=4"], 0), 0.25e-3));
        // OpenRLHF's: warm-up over ceil(0.1 x 20) = 2 steps, then cosine to 0.1 x the peak.
        let cosine = ["train.lr_scheduler=cosine_with_min_lr", "train.lr_warmup_ratio=0.1"];
        assert!(close(lr(&cosine, 0), 0.5e-3));
        assert!(close(lr(&cosine, 1), 1e-3));
        assert!(close(lr(&cosine, 2), 1e-3));
        // Half way through the 18 decay steps: floor + (peak - floor) / 2 = 1e-4 + 4.5e-4.
        assert!(close(lr(&cosine, 11), 5.5e-4));
        assert!(close(lr(&cosine, 20), 1e-4));
        let floor = ["train.lr_scheduler=cosine_with_min_lr", "train.min_lr_ratio=0"];
        assert!(close(lr(&floor, 10), 0.5e-3) && close(lr(&floor, 20), 0.0));
    }

    #[test]
    fn dual_clip_reaches_the_policy_loss() {
        let sets = vec!["algo.dual_clip=3".to_owned()];
        let config = TrainConfig::from_yaml("", "clip.yaml", &sets).unwrap();
        assert_eq!(config.algo.clip_config().dual_clip, Some(3.0));
        let plain = TrainConfig::from_yaml("", "clip.yaml", &[]).unwrap();
        assert_eq!(plain.algo.clip_config().dual_clip, None);
    }
}
