//! The one place where a YAML placement spec (placement/SPEC.md) becomes actor options for the
//! role groups, and where the colocation mode is decided.
//!
//! With a spec, [`RolePlacements::deploy`] creates the spec's placement groups on the runtime
//! (`rtrun::colocation::deploy_spec`, all-or-nothing, waiting until reserved) and each rank of a
//! role gets its bundle and its share of it (fractional GPUs on the node's declared — possibly
//! fake — GPUs). Without a spec, roles get `cluster.*_replicas` ranks placed anywhere.

use std::path::Path;

use rtrun::ActorOptions;
use rtrun::colocation::{DeployOptions, SpecDeployment};
use rtrun_placement::spec::{PlacementSpec, parse_spec};

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};

/// How long (in spins) an idle libgomp thread of a role's worker busy-waits for more work
/// before it sleeps; libgomp's default is 300000, several milliseconds. The roles of a step take
/// turns (generate, then reference and reward, then train), and on shared cores a role that
/// just finished kept its intra-op threads spinning into the next role's phase. With 10000 a
/// team stays awake between the operators of one phase (microseconds apart) and goes to sleep
/// within a fraction of a millisecond after it: the walkthrough GRPO step on two cores went
/// from 0.144 s to 0.131-0.133 s (300000, 100000, 10000 and 1000 measured back to back, twice;
/// see decision 055).
pub const ROLE_GOMP_SPINCOUNT: &str = "10000";

/// Whether this process's environment sets libgomp's waiting (then role workers inherit it
/// instead of getting [`ROLE_GOMP_SPINCOUNT`]).
fn driver_sets_gomp_waiting() -> bool {
    ["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"].iter().any(|k| std::env::var_os(k).is_some())
}

/// Spec role names, as OpenRLHF names them.
pub const ROLE_NAMES: [&str; 5] = ["actor", "ref", "critic", "reward", "vllm_engine"];

/// How the roles share devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ColocationMode {
    /// Every role on its own devices.
    Separate,
    /// Policy and reference share devices.
    ActorRef,
    /// Critic and reward model share devices.
    CriticReward,
    /// Policy and reference, and critic and reward model, share devices pairwise.
    ActorRefAndCriticReward,
    /// Everything, engines included, shares one set of devices (hybrid engine): engines sleep
    /// while training and training state is offloaded while generating.
    All,
}

/// One role's ranks and what each needs.
#[derive(Debug, Clone, PartialEq)]
pub struct RolePlacement {
    /// Ranks.
    pub replicas: usize,
    /// GPUs per rank (fractional).
    pub num_gpus: f64,
    /// CPUs per rank.
    pub num_cpus: f64,
}

/// Placements of every role and the colocation mode.
#[derive(Debug, Clone)]
pub struct RolePlacements {
    /// Policy ranks.
    pub actor: RolePlacement,
    /// Reference ranks.
    pub reference: RolePlacement,
    /// Critic ranks.
    pub critic: RolePlacement,
    /// Reward-model ranks.
    pub reward: RolePlacement,
    /// Engine actors.
    pub engine: RolePlacement,
    /// The colocation mode.
    pub mode: ColocationMode,
    /// The spec, when there is one.
    pub spec: Option<PlacementSpec>,
    /// The spec's placement groups once deployed.
    pub deployment: Option<SpecDeployment>,
}

impl RolePlacements {
    /// From the config: the spec when one is named, else `cluster.*_replicas` with no GPUs.
    pub fn from_config(config: &TrainConfig) -> Result<Self> {
        match &config.cluster.placement_spec {
            Some(path) => Self::from_spec(&read_spec(path)?, path, &needed_roles(config)),
            None => {
                let c = &config.cluster;
                let plain = |replicas| RolePlacement { replicas, num_gpus: 0.0, num_cpus: 0.0 };
                Ok(Self {
                    actor: plain(c.actor_replicas),
                    reference: plain(c.ref_replicas),
                    critic: plain(c.critic_replicas),
                    reward: plain(c.reward_replicas),
                    engine: plain(c.engine_replicas),
                    mode: if c.colocate_all {
                        ColocationMode::All
                    } else {
                        ColocationMode::Separate
                    },
                    spec: None,
                    deployment: None,
                })
            }
        }
    }

    /// From a checked spec, which must declare the roles in `needed` (the others, when absent,
    /// get no ranks).
    pub fn from_spec(spec: &PlacementSpec, path: &Path, needed: &[&str]) -> Result<Self> {
        let role = |name: &str| -> Result<(RolePlacement, Option<String>)> {
            let Some(r) = spec.roles.iter().find(|r| r.name == name) else {
                if !needed.contains(&name) {
                    let none = RolePlacement { replicas: 0, num_gpus: 0.0, num_cpus: 0.0 };
                    return Ok((none, None));
                }
                return Err(TrainError::Placement(format!(
                    "{}: expected a role `{name}` (this run needs {needed:?}), found {:?}",
                    path.display(),
                    spec.roles.iter().map(|r| r.name.as_str()).collect::<Vec<_>>()
                )));
            };
            let placement = RolePlacement {
                replicas: r.replicas,
                num_gpus: r.resources.get("GPU").as_f64(),
                num_cpus: r.resources.get("CPU").as_f64(),
            };
            Ok((placement, r.placement.as_ref().map(|p| p.group.clone())))
        };
        let (actor, actor_group) = role("actor")?;
        let (reference, ref_group) = role("ref")?;
        let (critic, critic_group) = role("critic")?;
        let (reward, reward_group) = role("reward")?;
        let (engine, engine_group) = role("vllm_engine")?;
        let shared = |a: &Option<String>, b: &Option<String>| a.is_some() && a == b;
        let mode = if shared(&actor_group, &engine_group) {
            ColocationMode::All
        } else {
            match (shared(&actor_group, &ref_group), shared(&critic_group, &reward_group)) {
                (true, true) => ColocationMode::ActorRefAndCriticReward,
                (true, false) => ColocationMode::ActorRef,
                (false, true) => ColocationMode::CriticReward,
                (false, false) => ColocationMode::Separate,
            }
        };
        Ok(Self {
            actor,
            reference,
            critic,
            reward,
            engine,
            mode,
            spec: Some(spec.clone()),
            deployment: None,
        })
    }

    /// Creates the spec's placement groups and waits until they are reserved (nothing to do
    /// without a spec). Needs the runtime.
    pub fn deploy(&mut self) -> Result<()> {
        if let (Some(spec), None) = (&self.spec, &self.deployment) {
            self.deployment = Some(deploy(spec)?);
        }
        Ok(())
    }

    /// `options` (which carry the group membership) with rank `rank`'s bundle and share of role
    /// `role` (a spec role name), or unchanged placement without a deployed spec.
    ///
    /// Every rank also gets [`ROLE_GOMP_SPINCOUNT`] unless the driver's environment sets
    /// libgomp's waiting itself.
    pub fn options(&self, role: &str, rank: usize, options: ActorOptions) -> Result<ActorOptions> {
        let mut options = options.env("RTRUN_RLHF_ROLE", &format!("{role}:{rank}"));
        if !driver_sets_gomp_waiting() {
            options = options.env("GOMP_SPINCOUNT", ROLE_GOMP_SPINCOUNT);
        }
        match &self.deployment {
            Some(deployment) => deployment
                .role(role)
                .and_then(|r| r.options_for(rank, options))
                .map_err(|e| TrainError::Placement(e.to_string())),
            None => Ok(options),
        }
    }

    /// Where the deployed spec put each role, one line per role: every rank's node (named by
    /// `node_name`, from the placement tables' node ids) and GPU indices, e.g.
    /// `vllm_engine: 0 → n2 GPU [0], 1 → n2 GPU [1]`. Empty without a deployed spec.
    pub fn describe(&self, node_name: impl Fn(&str) -> String) -> Vec<String> {
        match &self.deployment {
            Some(deployment) => describe(deployment, node_name),
            None => Vec::new(),
        }
    }

    /// Removes the spec's placement groups (stopping the actors in them).
    pub fn remove(&self) -> Result<()> {
        match &self.deployment {
            Some(d) => d.remove().map_err(|e| TrainError::Placement(e.to_string())),
            None => Ok(()),
        }
    }

    /// CPUs and GPUs the spec's bundles reserve together (the embedded node must offer at least
    /// this, plus a CPU per reward task).
    pub fn reserved(&self) -> (f64, f64) {
        let Some(spec) = &self.spec else { return (0.0, 0.0) };
        let bundles = spec.groups.iter().flat_map(|g| g.bundles.iter());
        bundles.fold((0.0, 0.0), |(cpu, gpu), b| {
            (cpu + b.get("CPU").as_f64(), gpu + b.get("GPU").as_f64())
        })
    }

    /// Whether engines and training share devices (the hybrid engine).
    pub fn hybrid(&self) -> bool {
        self.mode == ColocationMode::All
    }
}

/// The roles a run's spec must declare: the policy and the engines always; the reference when
/// the run needs one that is not the policy itself (LoRA); the critic for GAE; the reward model
/// for `reward.kind: model`.
pub fn needed_roles(config: &TrainConfig) -> Vec<&'static str> {
    let mut roles = vec!["actor"];
    if config.algo.needs_reference() && !config.reference_from_policy() {
        roles.push("ref");
    }
    if config.algo.needs_critic() {
        roles.push("critic");
    }
    if config.reward.kind == crate::config::RewardKind::Model {
        roles.push("reward");
    }
    roles.push("vllm_engine");
    roles
}

/// Reads and checks the placement spec at `path` (the config key `cluster.placement_spec`).
pub fn read_spec(path: &Path) -> Result<PlacementSpec> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        TrainError::config(
            "cluster.placement_spec",
            format!("expected a readable placement spec file, found {} ({e})", path.display()),
        )
    })?;
    parse_spec(&text, &path.display().to_string()).map_err(|e| TrainError::Placement(e.to_string()))
}

/// Creates `spec`'s placement groups (under a prefix unique to this deployment, so several runs
/// can share a cluster or a test process) and waits until they are reserved.
pub fn deploy(spec: &PlacementSpec) -> Result<SpecDeployment> {
    static DEPLOYMENTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = DEPLOYMENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let options = DeployOptions {
        name_prefix: format!("rlhf{}-{n}-", std::process::id()),
        ..DeployOptions::default()
    };
    rtrun::colocation::deploy_spec(spec, &options)
        .map_err(|e| TrainError::Placement(format!("deploying the spec: {e}")))
}

/// The runtime's node names by node id (for [`describe`]; empty before the runtime starts).
pub fn node_names() -> std::collections::BTreeMap<String, String> {
    rtrun::current()
        .and_then(|runtime| runtime.cluster_info())
        .map(|info| info.nodes.iter().map(|n| (n.node.to_string(), n.name.clone())).collect())
        .unwrap_or_default()
}

/// Where `deployment` put each role, one line per role: every rank's node (named by
/// `node_name`) and GPU indices, e.g. `vllm_engine: 0 → n2 GPU [0], 1 → n2 GPU [1]`.
pub fn describe(deployment: &SpecDeployment, node_name: impl Fn(&str) -> String) -> Vec<String> {
    deployment
        .roles()
        .iter()
        .map(|role| {
            let ranks: Vec<String> = role
                .replicas
                .iter()
                .map(|replica| match &replica.bundle {
                    Some(bundle) => format!(
                        "{} → {} GPU {:?}",
                        replica.rank,
                        node_name(&bundle.node.to_string()),
                        bundle.gpu_indices()
                    ),
                    None => format!("{} → anywhere", replica.rank),
                })
                .collect();
            format!("{}: {}", role.name, ranks.join(", "))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/placement")
    }

    fn mode_of(file: &str) -> ColocationMode {
        let path = spec_dir().join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let spec = parse_spec(&text, file).unwrap();
        RolePlacements::from_spec(&spec, &path, &ROLE_NAMES).unwrap().mode
    }

    #[test]
    fn shipped_specs_give_their_modes() {
        assert_eq!(mode_of("separate-1x8.yaml"), ColocationMode::Separate);
        assert_eq!(mode_of("actor-ref-colocated-1x8.yaml"), ColocationMode::ActorRef);
        assert_eq!(mode_of("critic-reward-colocated-1x8.yaml"), ColocationMode::CriticReward);
        assert_eq!(mode_of("hybrid-1x8.yaml"), ColocationMode::All);
        assert_eq!(mode_of("hybrid-2x8.yaml"), ColocationMode::All);
    }

    #[test]
    fn hybrid_ranks_take_a_fifth_of_a_gpu() {
        let path = spec_dir().join("hybrid-1x8.yaml");
        let spec = parse_spec(&std::fs::read_to_string(&path).unwrap(), "h").unwrap();
        let p = RolePlacements::from_spec(&spec, &path, &ROLE_NAMES).unwrap();
        assert_eq!(p.actor.replicas, 8);
        assert!((p.actor.num_gpus - 0.2).abs() < 1e-9);
        // Not deployed yet: the options only gain the role tag (and libgomp's spin count).
        let options = p.options("actor", 3, ActorOptions::default()).unwrap();
        assert_eq!(options.env.get("RTRUN_RLHF_ROLE").map(String::as_str), Some("actor:3"));
        if !driver_sets_gomp_waiting() {
            let spins = options.env.get("GOMP_SPINCOUNT").map(String::as_str);
            assert_eq!(spins, Some(ROLE_GOMP_SPINCOUNT));
        }
        assert_eq!(p.reserved(), (40.0, 8.0));
    }

    #[test]
    fn a_spec_without_a_role_is_an_error_naming_it() {
        let text = "roles:\n  actor:\n    replicas: 1\n";
        let spec = parse_spec(text, "x.yaml").unwrap();
        let err = RolePlacements::from_spec(&spec, Path::new("x.yaml"), &ROLE_NAMES)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`ref`"), "{err}");
    }

    /// A spec declares the roles its run uses: GRPO with the KL in the loss needs no critic or
    /// reward model; with LoRA the policy is its own reference; GAE needs the critic.
    #[test]
    fn a_spec_needs_only_the_roles_its_run_uses() {
        let roles = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            needed_roles(&TrainConfig::from_yaml("", "r.yaml", &sets).unwrap())
        };
        let grpo = ["algo.advantage_estimator=group_norm", "algo.use_kl_loss=true"];
        assert_eq!(roles(&grpo), ["actor", "ref", "vllm_engine"]);
        let lora: Vec<&str> = grpo.iter().copied().chain(["policy.lora.rank=4"]).collect();
        assert_eq!(roles(&lora), ["actor", "vllm_engine"]);
        assert_eq!(roles(&["algo.init_kl_coef=0"]), ["actor", "critic", "vllm_engine"]);
        let text = "roles:\n  actor:\n    replicas: 2\n  vllm_engine:\n    replicas: 1\n";
        let spec = parse_spec(text, "grpo.yaml").unwrap();
        let p = RolePlacements::from_spec(&spec, Path::new("grpo.yaml"), &roles(&lora)).unwrap();
        assert_eq!((p.actor.replicas, p.reference.replicas, p.critic.replicas), (2, 0, 0));
        let err = RolePlacements::from_spec(&spec, Path::new("grpo.yaml"), &roles(&grpo))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`ref`") && err.contains("grpo.yaml"), "{err}");
    }
}
