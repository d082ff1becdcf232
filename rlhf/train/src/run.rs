//! One whole run as the `train` driver performs it: prepare the run directory (datasets, the
//! warmed-up initial policy), start the embedded runtime, create the roles from the placement,
//! then `fit()` with metrics in the run directory. Tests call [`run`] in-process too.

use std::collections::BTreeMap;

use rtrun_rlhf_telemetry::{MetricsWriter, StartMode};

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::placement_map::RolePlacements;
use crate::task::{read_jsonl, write_jsonl};
use crate::trainer::{FitReport, ProgressObserver, RunPaths, Trainer, checkpoint, telemetry_error};
use crate::warmup::{WarmupReport, make_initial_policy, policy_config};

/// Where the initial policy came from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum InitialPolicy {
    /// Made now, with this warm-up.
    Made(WarmupReport),
    /// Reused from the run directory (a resumed run).
    Reused,
}

/// Writes the datasets and the initial policy into the run directory, unless a previous run
/// already did (then they are reused, so a resumed run sees the same data and model).
pub fn prepare(config: &TrainConfig, paths: &RunPaths) -> Result<InitialPolicy> {
    let data_dir = paths.train_data.parent().unwrap_or(&paths.root);
    std::fs::create_dir_all(data_dir).map_err(|e| TrainError::io(data_dir, e))?;
    if !(paths.train_data.is_file() && paths.eval_data.is_file()) {
        let (train, eval) = config.task.generate(config.seed)?;
        write_jsonl(&paths.train_data, &train)?;
        write_jsonl(&paths.eval_data, &eval)?;
    }
    if paths.initial_policy.join("config.json").is_file() {
        return Ok(InitialPolicy::Reused);
    }
    let train = read_jsonl(&paths.train_data)?;
    let max_positions = (config.task.max_prompt_tokens() + config.max_new_tokens() + 8) as i64;
    let model_config = policy_config(&config.model, max_positions);
    // Written under a temporary name and renamed, so a killed warm-up is redone, not reused.
    let tmp = paths.initial_policy.with_extension("tmp");
    let report = make_initial_policy(&tmp, &model_config, &config.warmup, &train, config.seed)?;
    if paths.initial_policy.exists() {
        std::fs::remove_dir_all(&paths.initial_policy)
            .map_err(|e| TrainError::io(&paths.initial_policy, e))?;
    }
    std::fs::rename(&tmp, &paths.initial_policy).map_err(|e| TrainError::io(&tmp, e))?;
    Ok(InitialPolicy::Made(report))
}

/// Starts the embedded runtime sized for the placement (declared GPUs, enough CPUs for the
/// role actors plus the reward tasks).
pub fn start_runtime(config: &TrainConfig, placements: &RolePlacements) -> Result<()> {
    let machine = std::thread::available_parallelism().map(|n| n.get() as f64).unwrap_or(2.0);
    let (bundle_cpus, bundle_gpus) = placements.reserved();
    // CPUs are accounting here (actors hold none by default); tasks need one each besides what
    // the bundles reserve.
    let needed = bundle_cpus + config.reward.parallel_tasks as f64;
    let num_cpus = config.cluster.num_cpus.unwrap_or(machine).max(needed);
    if bundle_gpus > config.cluster.num_gpus {
        return Err(TrainError::config(
            "cluster.num_gpus",
            format!(
                "expected at least the {bundle_gpus} GPUs the placement spec reserves, found {}",
                config.cluster.num_gpus
            ),
        ));
    }
    rtrun::init_with(rtrun::Config {
        num_cpus: Some(num_cpus),
        num_gpus: Some(config.cluster.num_gpus),
        resources: BTreeMap::new(),
        ..Default::default()
    })?;
    Ok(())
}

/// Everything after `rtrun::init`: roles, trainer (resumed when possible), fit.
pub fn run(
    config: &TrainConfig,
    progress: &mut dyn ProgressObserver,
) -> Result<(Trainer, FitReport)> {
    let paths = RunPaths::new(&config.run_dir);
    prepare(config, &paths)?;
    let mut placements = RolePlacements::from_config(config)?;
    start_runtime(config, &placements)?;
    placements.deploy()?;
    let train = read_jsonl(&paths.train_data)?;
    let eval = read_jsonl(&paths.eval_data)?;
    let steps_hint = {
        let per_episode = (train.len() / config.rollout.prompts_per_step).max(1) as u64;
        let total = per_episode * config.train.num_episodes as u64;
        let total = config.train.max_steps.map_or(total, |m| m.min(total));
        let samples = config.rollout.prompts_per_step * config.rollout.n_samples_per_prompt;
        total * (samples / config.train.train_batch_size) as u64 * config.train.max_epochs as u64
    };
    let reward_dir = config.reward.model_dir.clone();
    let roles = crate::trainer::Roles::create(
        config,
        placements,
        &paths.initial_policy,
        reward_dir.as_deref(),
        steps_hint,
    )?;
    let resuming = config.checkpoint.resume && checkpoint::newest(&paths.checkpoints)?.is_some();
    let mut trainer = Trainer::new(config.clone(), paths.clone(), train, eval, roles)?;
    let mode = if resuming {
        StartMode::Resume { next_step: trainer.state.step + 1 }
    } else {
        StartMode::Overwrite
    };
    let mut writer = MetricsWriter::create(&paths.root, mode).map_err(telemetry_error)?;
    let report = trainer.fit(&mut writer, progress);
    if report.is_err() {
        trainer.roles.kill();
    }
    Ok((trainer, report?))
}
