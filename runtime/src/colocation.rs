//! Deploying a YAML colocation spec (`placement/SPEC.md`): create the spec's placement groups,
//! wait until they are reserved, and hand back, per role, where each replica goes — group,
//! bundle index and resource share — so the application creates its role actors from it.
//!
//! ```ignore
//! let spec = rtrun::colocation::load_spec("deploy/examples/placement/hybrid-1x8.yaml")?;
//! let deployment = rtrun::colocation::deploy_spec(&spec, &DeployOptions::default())?;
//! for replica in &deployment.role("actor")?.replicas {
//!     let options = replica.apply_to(ActorOptions::default());
//!     // create rank `replica.rank` of the policy group with `options` ...
//! }
//! deployment.remove()?; // stops the role actors and frees every bundle
//! ```

use std::path::Path;
use std::time::{Duration, Instant};

pub use rtrun_placement::spec::{PlacementSpec, RoleSpec, SpecError, parse_spec};

use crate::actor::ActorOptions;
use crate::error::{Error, Result};
use crate::placement_group::{
    BundlePlacement, BundleTable, PlacementGroup, PlacementGroupOptions, ResourceSet,
    placement_group,
};

/// How to deploy a spec.
#[derive(Debug, Clone)]
pub struct DeployOptions {
    /// How long to wait for every group to be reserved before giving up (and removing what was
    /// created). Default 60 s.
    pub ready_timeout: Duration,
    /// Prepended to every group name (`<prefix><name>`), so two deployments of one spec can live
    /// side by side. Default none.
    pub name_prefix: String,
}

impl Default for DeployOptions {
    fn default() -> Self {
        DeployOptions { ready_timeout: Duration::from_secs(60), name_prefix: String::new() }
    }
}

/// Where one replica (rank) of a role goes.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaPlacement {
    /// The role's name.
    pub role: String,
    /// The replica's rank in its role.
    pub rank: usize,
    /// The role's number of replicas.
    pub world_size: usize,
    /// What the replica's actor holds (its share of the bundle).
    pub resources: ResourceSet,
    /// The placement group it lives in (`None`: anywhere in the cluster).
    pub group: Option<PlacementGroup>,
    /// Its bundle's index in `group`.
    pub bundle_index: Option<usize>,
    /// Where that bundle is: node, GPU indices and UUIDs.
    pub bundle: Option<BundlePlacement>,
}

impl ReplicaPlacement {
    /// Options that give an actor this replica's resources and bundle.
    pub fn actor_options(&self) -> ActorOptions {
        self.apply_to(ActorOptions::default())
    }

    /// `options` with this replica's resources and bundle set (other settings kept).
    pub fn apply_to(&self, options: ActorOptions) -> ActorOptions {
        let mut options = options.resource_set(&self.resources);
        options.placement = match (&self.group, self.bundle_index) {
            (Some(group), Some(index)) => Some(group.bundle(index)),
            _ => None,
        };
        options
    }
}

/// One role group of a deployed spec.
#[derive(Debug, Clone, PartialEq)]
pub struct RoleDeployment {
    /// The role's name.
    pub name: String,
    /// Its replicas by rank.
    pub replicas: Vec<ReplicaPlacement>,
}

impl RoleDeployment {
    /// `options` with the resources and bundle of rank `rank` (for an actor group's spawn
    /// closure: `|rank, options| Policy::remote_with(role.options_for(rank, options)?, ..)`).
    pub fn options_for(&self, rank: usize, options: ActorOptions) -> Result<ActorOptions> {
        let replica = self.replicas.get(rank).ok_or_else(|| {
            Error::Invalid(format!(
                "role `{}` has {} replicas, found rank {rank}",
                self.name,
                self.replicas.len()
            ))
        })?;
        Ok(replica.apply_to(options))
    }
}

/// A deployed spec: its groups (created and reserved) and where every replica goes.
#[derive(Debug, Clone)]
pub struct SpecDeployment {
    groups: Vec<(String, PlacementGroup, BundleTable)>,
    roles: Vec<RoleDeployment>,
}

impl SpecDeployment {
    /// The role groups, in file order.
    pub fn roles(&self) -> &[RoleDeployment] {
        &self.roles
    }

    /// One role group.
    pub fn role(&self, name: &str) -> Result<&RoleDeployment> {
        self.roles.iter().find(|role| role.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.roles.iter().map(|role| role.name.as_str()).collect();
            Error::Invalid(format!("expected one of the spec's roles {known:?}, found `{name}`"))
        })
    }

    /// The placement group the spec calls `name`.
    pub fn group(&self, name: &str) -> Option<&PlacementGroup> {
        self.groups.iter().find(|(spec_name, _, _)| spec_name == name).map(|(_, group, _)| group)
    }

    /// The bundle table of the group the spec calls `name`.
    pub fn bundle_table(&self, name: &str) -> Option<&BundleTable> {
        self.groups.iter().find(|(spec_name, _, _)| spec_name == name).map(|(_, _, table)| table)
    }

    /// Every group with the spec's name for it, in file order.
    pub fn groups(&self) -> impl Iterator<Item = (&str, &PlacementGroup, &BundleTable)> {
        self.groups.iter().map(|(name, group, table)| (name.as_str(), group, table))
    }

    /// Removes every group: the actors placed in them are stopped and the bundles freed.
    /// Groups already removed are skipped; the first other failure is returned after trying all.
    pub fn remove(&self) -> Result<()> {
        let mut first_error = None;
        for (_, group, _) in &self.groups {
            if let Err(e) = group.remove()
                && !is_gone(&e)
            {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

fn is_gone(error: &Error) -> bool {
    matches!(error, Error::NotFound(crate::error::Missing::Group(_)))
}

/// Reads and checks a spec file; errors read `file:line:column: expected X, found Y`.
pub fn load_spec(path: impl AsRef<Path>) -> Result<PlacementSpec> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::Invalid(format!("cannot read placement spec {}: {e}", path.display()))
    })?;
    parse_spec(&text, &path.display().to_string()).map_err(|e| Error::Invalid(e.to_string()))
}

/// Creates the spec's placement groups, waits until all are reserved, and returns where every
/// replica of every role goes. All or nothing: on any failure (a group the cluster can never
/// hold, a name in use, groups still pending at the timeout) the groups already created are
/// removed and the error returned — ``infeasible: placement group `hybrid` needs GPU: 16,
/// cluster has 8``.
pub fn deploy_spec(spec: &PlacementSpec, options: &DeployOptions) -> Result<SpecDeployment> {
    let plan = spec.plan();
    let mut created: Vec<(String, PlacementGroup)> = Vec::new();
    let result = create_and_wait(&plan, options, &mut created);
    let tables = match result {
        Ok(tables) => tables,
        Err(e) => {
            for (_, group) in created.iter().rev() {
                if let Err(cleanup) = group.remove() {
                    tracing::warn!(
                        group = group.name(),
                        "could not remove after a failed deploy: {cleanup}"
                    );
                }
            }
            return Err(e);
        }
    };
    let groups: Vec<(String, PlacementGroup, BundleTable)> = created
        .into_iter()
        .zip(tables)
        .map(|((name, group), table)| (name, group, table))
        .collect();
    let mut roles: Vec<RoleDeployment> = Vec::new();
    for actor in plan.actors {
        let (group, bundle_index, bundle) = match &actor.bundle {
            None => (None, None, None),
            Some(spec_bundle) => {
                let (_, group, table) = groups
                    .iter()
                    .find(|(name, _, _)| *name == spec_bundle.group)
                    .ok_or_else(|| {
                        Error::Invalid(format!(
                            "role `{}` uses group `{}`, which the spec does not declare",
                            actor.role, spec_bundle.group
                        ))
                    })?;
                let bundle = table.bundles.get(spec_bundle.index).cloned();
                (Some(group.clone()), Some(spec_bundle.index), bundle)
            }
        };
        let replica = ReplicaPlacement {
            role: actor.role.clone(),
            rank: actor.rank,
            world_size: actor.world_size,
            resources: actor.resources,
            group,
            bundle_index,
            bundle,
        };
        match roles.iter_mut().find(|role| role.name == actor.role) {
            Some(role) => role.replicas.push(replica),
            None => roles.push(RoleDeployment { name: actor.role, replicas: vec![replica] }),
        }
    }
    Ok(SpecDeployment { groups, roles })
}

fn create_and_wait(
    plan: &rtrun_placement::spec::PlacementPlan,
    options: &DeployOptions,
    created: &mut Vec<(String, PlacementGroup)>,
) -> Result<Vec<BundleTable>> {
    for request in &plan.groups {
        let group_options = PlacementGroupOptions {
            bundles: request.bundles.clone(),
            strategy: request.strategy,
            name: Some(format!("{}{}", options.name_prefix, request.name)),
        };
        created.push((request.name.clone(), placement_group(group_options)?));
    }
    let deadline = Instant::now() + options.ready_timeout;
    let waits: Vec<_> = created.iter().map(|(_, group)| group.ready()).collect();
    let mut tables = Vec::with_capacity(waits.len());
    for ((name, _), wait) in created.iter().zip(waits) {
        let left = deadline.saturating_duration_since(Instant::now());
        match wait.wait(Some(left)) {
            Ok(table) => tables.push(table),
            Err(Error::Timeout(_)) => {
                tracing::warn!(
                    group = name.as_str(),
                    "placement group not reserved within {:?}: the cluster has room for it, but \
                     not now",
                    options.ready_timeout
                );
                return Err(Error::Timeout(options.ready_timeout));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(tables)
}
