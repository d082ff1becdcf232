//! One whole run as the `train` driver performs it: check what can be checked before any work
//! ([`preflight`]: the placement spec and the resources it needs, the run directory), prepare
//! the run directory (datasets, the warmed-up initial policy), start the embedded runtime,
//! create the roles from the placement, then `fit()` with metrics in the run directory. Tests
//! call [`run`] in-process too.

use std::collections::BTreeMap;

use rtrun_rlhf_telemetry::{MetricsWriter, StartMode};

use crate::config::TrainConfig;
use crate::data::load_prompts;
use crate::data::{read_jsonl, write_jsonl};
use crate::demo::warmup::{WarmupReport, make_initial_policy, policy_config};
use crate::error::{Result, TrainError};
use crate::placement_map::RolePlacements;
use crate::prompts::PromptRecord;
use crate::tokenizer::HfTokenizer;
use crate::trainer::{FitReport, ProgressObserver, RunPaths, Trainer, checkpoint, telemetry_error};

/// Where the initial policy came from.
#[derive(Debug, Clone, PartialEq)]
pub enum InitialPolicy {
    /// Made now, with this warm-up.
    Made(WarmupReport),
    /// Reused from the run directory (a resumed run).
    Reused,
    /// A Hugging Face checkpoint (`policy.pretrain`).
    Pretrained(std::path::PathBuf),
}

/// What [`prepare`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    /// Where the initial policy came from.
    pub initial: InitialPolicy,
    /// Training prompts.
    pub train: Vec<PromptRecord>,
    /// Held-out prompts.
    pub eval: Vec<PromptRecord>,
    /// Prompts dropped for `data.max_prompt_len` (train, held-out).
    pub dropped_too_long: (usize, usize),
}

impl Prepared {
    /// Number of training prompts.
    pub fn train_prompts(&self) -> usize {
        self.train.len()
    }

    /// Number of held-out prompts.
    pub fn eval_prompts(&self) -> usize {
        self.eval.len()
    }
}

/// Name of the file recording what a run directory's data and initial policy were made from.
pub const PREPARED_FILE: &str = "prepared.json";

/// Files a run writes as it goes (besides checkpoints and TensorBoard event files): an earlier
/// run's results, which a new run in the same directory would replace.
pub const RUN_OUTPUTS: [&str; 6] =
    ["metrics.jsonl", "samples.jsonl", "summary.md", "reward.png", "loss.png", "final_policy"];

/// Everything that can be checked before any work starts (the warm-up, the runtime): the
/// placement spec (it exists, parses, names every role) and the GPUs it reserves against
/// `cluster.num_gpus`, the prompt files, and the run directory (`check_run_dir`, which with
/// `overwrite` removes the earlier run). Returns the placements for [`run_prepared`].
pub fn preflight(config: &TrainConfig, paths: &RunPaths) -> Result<RolePlacements> {
    let placements = RolePlacements::from_config(config)?;
    // A cluster's resources are its nodes'; they are checked once connected.
    if cluster_address(config).is_none() {
        check_resources(config, &placements)?;
    }
    crate::data::check_files("data.prompt_data", &config.data.prompt_data)?;
    crate::data::check_files("data.eval_data", &config.data.eval_data)?;
    if config.reward.kind == crate::config::RewardKind::Remote {
        let timeout = std::time::Duration::from_secs_f64(config.reward.timeout_s.min(10.0));
        crate::reward::check_reachable(&config.reward.url.0, timeout)
            .map_err(|e| TrainError::config("reward.url", e))?;
    }
    check_run_dir(config, paths)?;
    // A cluster is joined now, so that an unreachable or too small one is an error before any
    // work rather than after the warm-up.
    if let Some(address) = cluster_address(config) {
        join_cluster(&address, &placements)?;
    }
    Ok(placements)
}

/// The cluster the run uses: `cluster.address`, else `RTRUN_ADDRESS`; `None` for the
/// embedded single-node runtime.
pub fn cluster_address(config: &TrainConfig) -> Option<String> {
    address_or_env(config.cluster.address.as_deref())
}

/// `configured` (a config's `cluster.address`), else `RTRUN_ADDRESS`; `None` for the embedded
/// single-node runtime.
pub fn address_or_env(configured: Option<&str>) -> Option<String> {
    configured.map(str::to_owned).or_else(|| {
        std::env::var(rtrun::cluster::ADDRESS_ENV).ok().filter(|a| !a.trim().is_empty())
    })
}

/// The GPUs the embedded node declares: `cluster.num_gpus`, the host's when absent. More than
/// the host has (after an inherited `CUDA_VISIBLE_DEVICES`) is an error unless `fake` names
/// them (`cluster.fake_gpus`).
pub fn embedded_gpus(num_gpus: Option<f64>, fake: bool) -> Result<f64> {
    let (detected, source) = rtrun::gpus::detect_gpus();
    let host = match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(visible) => rtrun::gpus::restrict_to_visible(detected, &visible).len(),
        Err(_) => detected.len(),
    } as f64;
    let requested = num_gpus.unwrap_or(host);
    if requested > host && !fake {
        let found = match source {
            rtrun::gpus::GpuSource::NvidiaSmi => "found by nvidia-smi",
            rtrun::gpus::GpuSource::ProcDriver => "found in /proc/driver/nvidia/gpus",
            rtrun::gpus::GpuSource::None => "no NVIDIA GPU found",
        };
        return Err(TrainError::config(
            "cluster.num_gpus",
            format!(
                "expected at most the {host} GPUs this host has ({found}), found {requested}; \
                 set cluster.fake_gpus: true to declare the missing ones as fake GPUs (no \
                 device behind them: placement tests on a CPU machine)"
            ),
        ));
    }
    Ok(requested)
}

/// The GPUs the placement spec reserves fit in the ones the embedded node declares.
fn check_resources(config: &TrainConfig, placements: &RolePlacements) -> Result<()> {
    let (_, bundle_gpus) = placements.reserved();
    let gpus = embedded_gpus(config.cluster.num_gpus, config.cluster.fake_gpus)?;
    if bundle_gpus > gpus {
        let spec = config.cluster.placement_spec.as_deref();
        return Err(TrainError::config(
            "cluster.num_gpus",
            format!(
                "expected at least the {bundle_gpus} GPUs the placement spec {} reserves, found \
                 {gpus}{}",
                spec.map_or_else(String::new, |p| p.display().to_string()),
                if config.cluster.fake_gpus {
                    ""
                } else {
                    " (with cluster.fake_gpus: true and cluster.num_gpus, a CPU machine declares \
                     fake ones)"
                }
            ),
        ));
    }
    Ok(())
}

/// What an earlier run left in the run directory: results a new run would replace, and
/// checkpoints, each described for a message (`metrics.jsonl (5 steps)`).
fn earlier_run(paths: &RunPaths) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for name in RUN_OUTPUTS {
        let path = paths.root.join(name);
        if name == "metrics.jsonl" && path.is_file() {
            let text = std::fs::read_to_string(&path).map_err(|e| TrainError::io(&path, e))?;
            found.push(format!("{name} ({} records)", text.lines().count()));
        } else if path.is_dir() {
            found.push(format!("{name}/"));
        } else if path.exists() {
            found.push(name.to_owned());
        }
    }
    let events = event_files(paths)?;
    if !events.is_empty() {
        found.push(format!("{} TensorBoard event file(s)", events.len()));
    }
    if paths.checkpoints.exists() {
        found.push("checkpoints/".to_owned());
    }
    Ok(found)
}

/// TensorBoard event files in the run directory.
fn event_files(paths: &RunPaths) -> Result<Vec<std::path::PathBuf>> {
    let entries = match std::fs::read_dir(&paths.root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(TrainError::io(&paths.root, e)),
    };
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| TrainError::io(&paths.root, e))?;
        if entry.file_name().to_string_lossy().starts_with("events.out.tfevents.") {
            files.push(entry.path());
        }
    }
    Ok(files)
}

/// A run directory holding an earlier run is refused unless the run resumes from one of its
/// checkpoints or `overwrite` is set; with `overwrite` the earlier run's results and
/// checkpoints are removed now (the prepared data and initial policy stay: [`prepare`] reuses
/// them when the settings match).
fn check_run_dir(config: &TrainConfig, paths: &RunPaths) -> Result<()> {
    check_run_dir_with(config.overwrite, config.checkpoint.resume, paths)
}

/// [`check_run_dir`] for any trainer: `overwrite` and `checkpoint.resume` as given.
pub(crate) fn check_run_dir_with(overwrite: bool, resume: bool, paths: &RunPaths) -> Result<()> {
    let found = earlier_run(paths)?;
    if found.is_empty() {
        return Ok(());
    }
    if overwrite {
        let mut doomed: Vec<std::path::PathBuf> =
            RUN_OUTPUTS.iter().map(|name| paths.root.join(name)).collect();
        doomed.push(paths.final_policy.with_extension("tmp"));
        doomed.push(paths.checkpoints.clone());
        doomed.extend(event_files(paths)?);
        for path in doomed {
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else if path.exists() {
                std::fs::remove_file(&path)
            } else {
                Ok(())
            };
            removed.map_err(|e| TrainError::io(&path, e))?;
        }
        tracing::info!(run_dir = %paths.root.display(), "overwrite: removed {}", found.join(", "));
        return Ok(());
    }
    let checkpoint = checkpoint::newest(&paths.checkpoints)?;
    if resume && checkpoint.is_some() {
        return Ok(());
    }
    let why = match checkpoint {
        Some(_) => "checkpoint.resume is false",
        None => "no checkpoint to resume from",
    };
    Err(TrainError::config(
        "run_dir",
        format!(
            "expected a new run directory or one with a checkpoint to resume from, found {} \
             holding an earlier run ({}) and {why}; pass --overwrite (or --set overwrite=true) \
             to replace it, or choose another run_dir",
            paths.root.display(),
            found.join(", ")
        ),
    ))
}

/// Writes the datasets (generated, or read from the prompt files, rendered and filtered) and,
/// for a synthetic task, the warmed-up initial policy into the run directory; or reuses those a
/// previous run made from the same settings (so a resumed run sees the same data and model).
/// A directory prepared from other settings is prepared again, unless it holds checkpoints,
/// which would then not match: that is an error.
pub fn prepare(config: &TrainConfig, paths: &RunPaths) -> Result<Prepared> {
    let data_dir = paths.train_data.parent().unwrap_or(&paths.root);
    std::fs::create_dir_all(data_dir).map_err(|e| TrainError::io(data_dir, e))?;
    let synthetic = config.data.synthetic_task();
    // Prompts are rendered with the tools' schemas (the chat template lists them).
    let tool_schemas = match config.tools.any() {
        true => crate::tools::from_config(&config.tools)?.schemas(),
        false => Vec::new(),
    };
    let key = match &synthetic {
        Some(task) => serde_json::json!({
            "seed": config.seed,
            "synthetic": task,
            "model": config.model,
            "warmup": config.warmup,
            "max_new_tokens": config.max_new_tokens(),
        }),
        None => serde_json::json!({
            "seed": config.seed,
            "data": config.data,
            "policy": config.policy.pretrain,
        }),
    };
    let mut key = key;
    if !tool_schemas.is_empty() {
        key["tools"] = serde_json::Value::from(tool_schemas.clone());
    }
    let key_path = paths.root.join(PREPARED_FILE);
    let previous: Option<serde_json::Value> =
        std::fs::read(&key_path).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok());
    let same = previous.as_ref().and_then(|p| p.get("key")) == Some(&key)
        && paths.train_data.is_file()
        && paths.eval_data.is_file();
    let (train, eval, dropped) = if same {
        let dropped = previous
            .as_ref()
            .and_then(|p| p.get("dropped_too_long"))
            .and_then(|d| serde_json::from_value::<(usize, usize)>(d.clone()).ok())
            .unwrap_or((0, 0));
        (read_jsonl(&paths.train_data)?, read_jsonl(&paths.eval_data)?, dropped)
    } else {
        if checkpoint::newest(&paths.checkpoints)?.is_some() {
            return Err(TrainError::config(
                "run_dir",
                format!(
                    "{} holds checkpoints of a run with other seed/data/model settings \
                     (see {PREPARED_FILE}); use another run_dir or remove it",
                    paths.root.display()
                ),
            ));
        }
        let (train, eval, dropped) = match (&synthetic, &config.policy.pretrain) {
            (Some(task), _) => {
                let (train, eval) = task.generate(config.seed)?;
                (train, eval, (0, 0))
            }
            (None, Some(dir)) => {
                let tokenizer = HfTokenizer::from_dir(dir, config.data.apply_chat_template)
                    .map_err(|e| TrainError::config("policy.pretrain", e.to_string()))?;
                let loaded = load_prompts(&config.data, &tokenizer, config.seed, &tool_schemas)?;
                (loaded.train, loaded.eval, loaded.dropped_too_long)
            }
            (None, None) => {
                return Err(TrainError::config(
                    "policy.pretrain",
                    "expected a checkpoint directory for data.prompt_data, found none",
                ));
            }
        };
        write_jsonl(&paths.train_data, &train)?;
        write_jsonl(&paths.eval_data, &eval)?;
        if paths.initial_policy.exists() {
            std::fs::remove_dir_all(&paths.initial_policy)
                .map_err(|e| TrainError::io(&paths.initial_policy, e))?;
        }
        let record = serde_json::json!({"key": key, "dropped_too_long": dropped});
        std::fs::write(&key_path, record.to_string()).map_err(|e| TrainError::io(&key_path, e))?;
        (train, eval, dropped)
    };
    let mut prepared =
        Prepared { initial: InitialPolicy::Reused, train, eval, dropped_too_long: dropped };
    let Some(task) = synthetic else {
        prepared.initial = InitialPolicy::Pretrained(config.policy_dir());
        return Ok(prepared);
    };
    if paths.initial_policy.join("config.json").is_file() {
        return Ok(prepared);
    }
    let max_positions = (task.max_prompt_tokens() + config.max_new_tokens() + 8) as i64;
    let model_config = policy_config(&config.model, max_positions);
    // Written under a temporary name and renamed, so a killed warm-up is redone, not reused.
    let tmp = paths.initial_policy.with_extension("tmp");
    let report =
        make_initial_policy(&tmp, &model_config, &config.warmup, &prepared.train, config.seed)?;
    std::fs::rename(&tmp, &paths.initial_policy).map_err(|e| TrainError::io(&tmp, e))?;
    prepared.initial = InitialPolicy::Made(report);
    Ok(prepared)
}

/// Starts the embedded runtime sized for the placement (declared GPUs, enough CPUs for the
/// role actors plus the reward tasks), or joins the cluster at `cluster.address` and checks
/// that its nodes hold what the placement reserves.
pub fn start_runtime(config: &TrainConfig, placements: &RolePlacements) -> Result<()> {
    if let Some(address) = cluster_address(config) {
        return join_cluster(&address, placements);
    }
    let machine = std::thread::available_parallelism().map(|n| n.get() as f64).unwrap_or(2.0);
    let (bundle_cpus, _) = placements.reserved();
    // CPUs are accounting here (actors hold none by default); tasks need one each besides what
    // the bundles reserve.
    let needed = bundle_cpus + config.reward.parallel_tasks as f64;
    let num_cpus = config.cluster.num_cpus.unwrap_or(machine).max(needed);
    rtrun::init_with(rtrun::Config {
        num_cpus: Some(num_cpus),
        num_gpus: Some(embedded_gpus(config.cluster.num_gpus, config.cluster.fake_gpus)?),
        resources: BTreeMap::new(),
        ..Default::default()
    })?;
    Ok(())
}

/// Connects to the cluster at `address` as a driver (once per process: later calls only
/// check again); the CPUs and GPUs the placement
/// reserves must fit in its live nodes' totals (whether they fit node by node is the placement
/// groups' answer, which names the group that cannot be placed).
fn join_cluster(address: &str, placements: &RolePlacements) -> Result<()> {
    let key = "cluster.address";
    rtrun::init_with(rtrun::Config { address: Some(address.to_owned()), ..Default::default() })
        .map_err(|e| {
            TrainError::config(key, format!("cannot join the cluster at {address}: {e}"))
        })?;
    let info = rtrun::current()
        .and_then(|runtime| runtime.cluster_info())
        .map_err(|e| TrainError::config(key, format!("cluster at {address}: {e}")))?;
    let (cpus, gpus) = placements.reserved();
    let nodes: Vec<String> = info
        .nodes
        .iter()
        .filter(|node| node.alive)
        .map(|node| {
            let of = |name: &str| node.total.get(name).copied().unwrap_or(0.0);
            format!("{} ({} CPU, {} GPU)", node.name, of("CPU"), of("GPU"))
        })
        .collect();
    for (name, needed) in [("GPU", gpus), ("CPU", cpus)] {
        let total = info.total.get(name).copied().unwrap_or(0.0);
        if needed > total {
            return Err(TrainError::config(
                "cluster.placement_spec",
                format!(
                    "expected the cluster at {address} to hold the {needed} {name}s the \
                     placement spec reserves, found {total} on its live nodes: {}",
                    nodes.join(", ")
                ),
            ));
        }
    }
    tracing::info!(%address, nodes = %nodes.join(", "), "joined the cluster");
    Ok(())
}

/// The whole run: [`preflight`], [`prepare`], then [`run_prepared`].
pub fn run(
    config: &TrainConfig,
    progress: &mut dyn ProgressObserver,
) -> Result<(Trainer, FitReport)> {
    let paths = RunPaths::new(&config.run_dir);
    let placements = preflight(config, &paths)?;
    let prepared = prepare(config, &paths)?;
    let resume = checkpoint::resume_from(config.checkpoint.resume, &paths.checkpoints)?;
    run_prepared(config, prepared, placements, resume.as_ref(), progress)
}

/// Everything after [`prepare`]: the runtime, roles, trainer (resumed from `resume`, the
/// checkpoint [`checkpoint::resume_from`] chose), fit. `placements` are the ones [`preflight`]
/// checked (the spec against the GPUs).
pub fn run_prepared(
    config: &TrainConfig,
    prepared: Prepared,
    mut placements: RolePlacements,
    resume: Option<&checkpoint::ResumePoint>,
    progress: &mut dyn ProgressObserver,
) -> Result<(Trainer, FitReport)> {
    let paths = RunPaths::new(&config.run_dir);
    let Prepared { train, eval, .. } = prepared;
    start_runtime(config, &placements)?;
    placements.deploy()?;
    let names = crate::placement_map::node_names();
    progress
        .placed(&placements.describe(|id| names.get(id).cloned().unwrap_or_else(|| id.to_owned())));
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
        &config.policy_dir(),
        reward_dir.as_deref(),
        steps_hint,
    )?;
    let resume_dir = resume.map(|point| point.dir.as_path());
    let mut trainer = Trainer::new(config.clone(), paths.clone(), train, eval, roles, resume_dir)?;
    let mode = if resume.is_some() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepare_reuses_same_settings_and_refuses_mismatched_checkpoints() {
        let root = std::env::temp_dir().join(format!("rtrun-prepare-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let yaml = format!(
            "run_dir: {}\ndata: {{synthetic: {{train_size: 32, eval_size: 4, max_digits: 4}}}}\n\
             model: {{hidden_size: 16, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 32}}\n\
             warmup: {{steps: 2, batch_size: 4}}\n",
            root.display()
        );
        let config = TrainConfig::from_yaml(&yaml, "t.yaml", &[]).unwrap();
        let paths = RunPaths::new(&root);
        assert!(matches!(prepare(&config, &paths).unwrap().initial, InitialPolicy::Made(_)));
        assert_eq!(prepare(&config, &paths).unwrap().initial, InitialPolicy::Reused);
        // Other settings without checkpoints: prepared again.
        let other = TrainConfig::from_yaml(&yaml, "t.yaml", &["seed=5".into()]).unwrap();
        assert!(matches!(prepare(&other, &paths).unwrap().initial, InitialPolicy::Made(_)));
        // With a checkpoint, switching settings again is refused.
        let ckpt = paths.checkpoints.join("step_000001");
        std::fs::create_dir_all(&ckpt).unwrap();
        std::fs::write(ckpt.join(checkpoint::STATE_FILE), "{}").unwrap();
        let err = prepare(&config, &paths).unwrap_err().to_string();
        assert!(err.contains("run_dir"), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
