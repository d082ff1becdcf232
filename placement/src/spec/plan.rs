//! Turning a checked spec into what the runtime executes: placement-group requests and one
//! placement per actor (role, rank, group, bundle, resources), and optionally scheduling all of
//! it on a [`ClusterState`] at once.

use serde::{Deserialize, Serialize};

use crate::cluster::{
    Allocation, BundleRef, ClusterState, GroupId, GroupStatus, PlacementGroupRequest,
    PlacementTarget,
};
use crate::error::PlacementError;
use crate::resources::ResourceSet;
use crate::spec::PlacementSpec;

/// A bundle named by group name (ids exist only once the group is created).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecBundle {
    /// The placement group's name in the spec.
    pub group: String,
    /// The bundle index.
    pub index: usize,
}

/// Where one actor of a role group goes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorPlacement {
    /// The role group's name.
    pub role: String,
    /// The actor's rank in its role group.
    pub rank: usize,
    /// The role group's size.
    pub world_size: usize,
    /// What the actor needs.
    pub resources: ResourceSet,
    /// Its bundle, or `None` to place it anywhere.
    pub bundle: Option<SpecBundle>,
}

/// Everything a spec asks the runtime to do, in order: create `groups`, then place `actors`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementPlan {
    /// Groups in file order.
    pub groups: Vec<PlacementGroupRequest>,
    /// Actors by role (file order) then rank.
    pub actors: Vec<ActorPlacement>,
}

/// One actor of a scheduled plan with what it was given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledActor {
    /// What the plan asked for.
    pub placement: ActorPlacement,
    /// What the cluster gave it (node, GPUs, bundle).
    pub allocation: Allocation,
}

/// A plan scheduled on a cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledPlan {
    /// Each spec group's name and id, in file order.
    pub groups: Vec<(String, GroupId)>,
    /// Every actor, in plan order.
    pub actors: Vec<ScheduledActor>,
}

impl PlacementSpec {
    /// The groups to create and the actors to place.
    pub fn plan(&self) -> PlacementPlan {
        let groups = self
            .groups
            .iter()
            .map(|group| PlacementGroupRequest {
                name: group.name.clone(),
                strategy: group.strategy,
                bundles: group.bundles.clone(),
            })
            .collect();
        let mut actors = Vec::new();
        for role in &self.roles {
            for rank in 0..role.replicas {
                let bundle = role.placement.as_ref().and_then(|placement| {
                    placement
                        .bundle_of_rank(rank, role.replicas)
                        .map(|index| SpecBundle { group: placement.group.clone(), index })
                });
                actors.push(ActorPlacement {
                    role: role.name.clone(),
                    rank,
                    world_size: role.replicas,
                    resources: role.resources.clone(),
                    bundle,
                });
            }
        }
        PlacementPlan { groups, actors }
    }
}

impl PlacementPlan {
    /// Creates every group and places every actor now, or changes nothing: a group that would
    /// be pending fails with [`PlacementError::GroupPending`], and anything created before a
    /// failure is removed again.
    pub fn schedule(&self, cluster: &mut ClusterState) -> Result<ScheduledPlan, PlacementError> {
        let mut created: Vec<(String, GroupId)> = Vec::new();
        let mut actors: Vec<ScheduledActor> = Vec::new();
        let result = self.schedule_into(cluster, &mut created, &mut actors);
        if let Err(err) = result {
            for actor in actors.iter().rev() {
                // Best effort: the allocation was just made, so it is there to release; a
                // failure here would only mean it is already gone.
                let _ = cluster.release(actor.allocation.id);
            }
            for (_, id) in created.iter().rev() {
                let _ = cluster.remove_group(*id);
            }
            return Err(err);
        }
        Ok(ScheduledPlan { groups: created, actors })
    }

    fn schedule_into(
        &self,
        cluster: &mut ClusterState,
        created: &mut Vec<(String, GroupId)>,
        actors: &mut Vec<ScheduledActor>,
    ) -> Result<(), PlacementError> {
        for request in &self.groups {
            let (id, status) = cluster.create_group(request.clone())?;
            created.push((request.name.clone(), id));
            if status == GroupStatus::Pending {
                return Err(PlacementError::GroupPending(request.name.clone()));
            }
        }
        for placement in &self.actors {
            let target = match &placement.bundle {
                None => PlacementTarget::Anywhere,
                Some(bundle) => {
                    let group = created
                        .iter()
                        .find(|(name, _)| *name == bundle.group)
                        .map(|(_, id)| *id)
                        .ok_or_else(|| {
                            PlacementError::Accounting(format!(
                                "plan names group `{}` that it does not create",
                                bundle.group
                            ))
                        })?;
                    PlacementTarget::Bundle(BundleRef { group, index: bundle.index })
                }
            };
            let allocation = cluster.place(&placement.resources, &target)?;
            actors.push(ScheduledActor { placement: placement.clone(), allocation });
        }
        Ok(())
    }
}
