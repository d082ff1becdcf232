//! The control plane's placement: placement groups (create, wait, remove, list) and placing
//! actor and task demands on the node or inside a bundle. Decisions come from the pure
//! [`ClusterState`](rtrun_placement::ClusterState); this module keeps the runtime's side of it —
//! who waits for which group, and which actors and tasks to stop when a group goes.

use std::collections::BTreeSet;

use rtrun_placement::{
    Allocation, BundleRef, GpuPool, GroupId, GroupStatus, PlacementError, PlacementGroupRequest,
    PlacementTarget, ResourceSet,
};

use super::{ActorState, Effect, GroupOwner, HeadCore, ReplyToken};
use rtrun_proto::error::{Error, Missing, Result};
use rtrun_proto::ids::{ActorId, WorkerId};
use rtrun_proto::placement_group::{
    BundleSchedule, PlacementGroupOptions, PlacementGroupState, PlacementGroupStatus,
};
use rtrun_proto::protocol::{Outcome, Response};

/// Whether a placement failure means "wait for resources" rather than "never".
pub(super) fn is_waiting(error: &PlacementError) -> bool {
    matches!(error, PlacementError::Unavailable { .. } | PlacementError::GroupPending(_))
}

impl HeadCore {
    pub(super) fn create_group(
        &mut self,
        options: PlacementGroupOptions,
    ) -> Result<PlacementGroupState> {
        let name = match options.name {
            Some(name) if name.is_empty() => {
                return Err(Error::Invalid(
                    "placement group name: expected a non-empty name, found an empty one".into(),
                ));
            }
            Some(name) => name,
            None => {
                self.unnamed_groups += 1;
                format!("unnamed-{}", self.unnamed_groups)
            }
        };
        let request =
            PlacementGroupRequest { name, strategy: options.strategy, bundles: options.bundles };
        let (id, status) = self.cluster.create_group(request).map_err(|e| match e {
            PlacementError::Infeasible { .. } => Error::Infeasible(e.to_string()),
            e => Error::Invalid(e.to_string()),
        })?;
        if status == GroupStatus::Pending {
            self.pending_groups.insert(id);
        }
        self.group_state(id).ok_or_else(|| Error::Invalid(format!("{id} vanished on creation")))
    }

    /// Answers `reply` once the group is created (now, if it is).
    pub(super) fn wait_group(
        &mut self,
        group: GroupId,
        reply: ReplyToken,
        effects: &mut Vec<Effect>,
    ) {
        match self.group_state(group) {
            None => effects.push(Effect::Respond(
                reply,
                Response::Error(Error::NotFound(Missing::Group(group))),
            )),
            Some(state) if state.status == PlacementGroupStatus::Created => {
                effects.push(Effect::Respond(reply, Response::PlacementGroup(Box::new(state))))
            }
            Some(_) => self.group_waiters.entry(group).or_default().push(reply),
        }
    }

    /// Ends what the actors in `ended_owners` owned (Ray's fate-sharing): the actors they
    /// created, except those created detached, are killed for good (their own children follow
    /// when their workers exit), and the groups they created are removed.
    fn end_owned(&mut self, effects: &mut Vec<Effect>) {
        for owner in std::mem::take(&mut self.ended_owners) {
            let children: Vec<ActorId> = self
                .children
                .get(&owner)
                .into_iter()
                .flatten()
                .copied()
                .filter(|id| {
                    self.actors.get(id).is_some_and(|a| {
                        !a.spec.options.detached && !matches!(a.state, ActorState::Dead { .. })
                    })
                })
                .collect();
            for child in children {
                let _ = self.kill_actor(child, true, effects);
                self.journal.actor(child);
                if let Some(entry) = self.actors.get_mut(&child) {
                    entry.death_reason = Some(format!("its owner, actor {owner}, ended"));
                }
            }
            self.remove_groups_of(GroupOwner::Actor(owner), effects);
            // Idle task workers started for the owner's tasks (a detached trainer's reward
            // tasks) end with it, as a driver's do; a busy one finishes its task first.
            let idle: Vec<WorkerId> = self
                .idle_task_workers
                .iter()
                .map(|(w, _)| *w)
                .filter(|w| self.workers.get(w).is_some_and(|e| e.lineage.owner == Some(owner)))
                .collect();
            for worker in idle {
                self.unpark_task_worker(worker);
                self.kill_worker(worker, effects);
            }
        }
    }

    /// Removes every group `owner` created (its driver went, or its incarnation ended).
    pub(super) fn remove_groups_of(&mut self, owner: GroupOwner, effects: &mut Vec<Effect>) {
        let groups: Vec<GroupId> =
            self.owned_groups.get(&owner).into_iter().flatten().copied().collect();
        for group in groups {
            if let Err(e) = self.remove_group(group, effects) {
                tracing::debug!(%group, ?owner, "removing a group whose owner ended: {e}");
            }
        }
    }

    /// Removes a group: kills the actors and tasks placed in it, fails waiters, frees its
    /// bundles, and lets pending work use what was freed.
    pub(super) fn remove_group(&mut self, group: GroupId, effects: &mut Vec<Effect>) -> Result<()> {
        let removed = self.cluster.remove_group(group).map_err(|e| match e {
            PlacementError::UnknownGroup(_) => Error::NotFound(Missing::Group(group)),
            e => Error::Invalid(e.to_string()),
        })?;
        self.pending_groups.remove(&group);
        self.journal.group(group);
        if let Some(owner) = self.group_owners.remove(&group) {
            super::remove_member(&mut self.owned_groups, &owner, &group);
        }
        let reason = format!("its placement group `{}` was removed", removed.name);
        for reply in self.group_waiters.remove(&group).unwrap_or_default() {
            effects.push(Effect::Respond(
                reply,
                Response::Error(Error::GroupRemoved {
                    name: removed.name.clone(),
                    when: " before it was created".into(),
                }),
            ));
        }
        let released: BTreeSet<_> = removed.released.iter().map(|a| a.id).collect();
        let in_group = |placement: Option<BundleSchedule>| {
            placement.is_some_and(|schedule| schedule.group == group)
        };
        // Actors: those holding a bundle's resources are killed; those still waiting die now.
        // (Found through the allocations' holders and the pending queue, not by a scan of
        // every actor.)
        let mut to_kill = Vec::new();
        for allocation in &released {
            let Some(id) = self.holders.remove(allocation) else { continue };
            let Some(entry) = self.actors.get_mut(&id) else { continue };
            self.journal.actor(id);
            entry.allocation = None;
            entry.killed = true;
            entry.death_reason = Some(reason.clone());
            if let ActorState::Starting { worker } | ActorState::Alive { worker, .. } = entry.state
            {
                to_kill.push(worker);
            }
        }
        let waiting_actors: Vec<ActorId> = self
            .pending_actors
            .iter()
            .copied()
            .filter(|id| {
                self.actors.get(id).is_some_and(|entry| {
                    matches!(entry.state, ActorState::Pending)
                        && in_group(entry.spec.options.placement)
                })
            })
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        for worker in to_kill {
            self.kill_worker(worker, effects);
        }
        for actor in waiting_actors {
            self.finish_actor(actor, reason.clone(), effects);
        }
        // Tasks: running ones lose their worker, queued ones fail.
        self.fail_running_tasks(|allocation| released.contains(&allocation), &reason, effects);
        let mut index = 0;
        while index < self.task_queue.len() {
            if in_group(self.task_queue[index].spec.options.placement)
                && let Some(task) = self.task_queue.remove(index)
            {
                let error = Error::Invalid(format!(
                    "task {} cannot run: {reason}",
                    task.spec.function.clone()
                ));
                self.answer_task(task, Outcome::Error(error), effects);
                continue;
            }
            index += 1;
        }
        self.reschedule(effects);
        Ok(())
    }

    /// After anything was released: creates pending groups that now fit (answering their
    /// waiters), then starts pending actors and queued tasks.
    pub(super) fn reschedule(&mut self, effects: &mut Vec<Effect>) {
        self.end_owned(effects);
        if !self.pending_groups.is_empty() {
            for id in self.cluster.schedule_pending() {
                self.pending_groups.remove(&id);
                self.journal.group(id);
                let waiters = self.group_waiters.remove(&id).unwrap_or_default();
                if waiters.is_empty() {
                    continue;
                }
                if let Some(state) = self.group_state(id) {
                    for reply in waiters {
                        effects.push(Effect::Respond(
                            reply,
                            Response::PlacementGroup(Box::new(state.clone())),
                        ));
                    }
                }
            }
        }
        self.schedule_pending_actors(effects);
        self.dispatch_tasks(effects);
    }

    pub(super) fn group_state(&self, id: GroupId) -> Option<PlacementGroupState> {
        let (request, status) = self.cluster.group(id)?;
        Some(state_of(id, request, status, self.cluster.bundle_table(id).cloned()))
    }

    pub(super) fn group_by_name(&self, name: &str) -> Result<PlacementGroupState> {
        self.cluster
            .group_by_name(name)
            .and_then(|id| self.group_state(id))
            .ok_or_else(|| Error::NotFound(Missing::GroupName(name.to_owned())))
    }

    pub(super) fn list_groups(&self) -> Vec<PlacementGroupState> {
        self.cluster
            .groups()
            .map(|(id, request, status)| {
                state_of(id, request, status, self.cluster.bundle_table(id).cloned())
            })
            .collect()
    }

    /// Checks at submission that `demand` could ever be placed as asked, so an impossible
    /// request fails at once instead of waiting forever.
    pub(super) fn check_placeable(
        &self,
        what: &str,
        demand: &ResourceSet,
        placement: Option<&BundleSchedule>,
    ) -> Result<()> {
        GpuPool::check_demand(demand.get(rtrun_placement::GPU))
            .map_err(|e| Error::Invalid(format!("{what}: {e}")))?;
        let Some(schedule) = placement else {
            let total = self.node_total(demand);
            return match super::shortfall_message(what, demand, &total) {
                Some(message) => Err(Error::Infeasible(message)),
                None => Ok(()),
            };
        };
        let (request, _) = self.cluster.group(schedule.group).ok_or_else(|| {
            Error::Invalid(format!(
                "{what} asks for placement group {}, which was removed or never existed",
                schedule.group
            ))
        })?;
        let name = &request.name;
        let candidates: Vec<(usize, &ResourceSet)> = match schedule.bundle_index {
            Some(index) => match request.bundles.get(index) {
                Some(bundle) => vec![(index, bundle)],
                None => {
                    return Err(Error::Invalid(format!(
                        "{what}: placement group `{name}` has {} bundles, found bundle index \
                         {index}",
                        request.bundles.len()
                    )));
                }
            },
            None => request.bundles.iter().enumerate().collect(),
        };
        let mut shortfall = None;
        for (index, bundle) in candidates {
            match bundle.first_shortfall(demand) {
                None => return Ok(()),
                Some((resource, needed, has)) => {
                    shortfall.get_or_insert(format!(
                        "{what} needs {resource}: {needed}, bundle {index} of `{name}` has {has}"
                    ));
                }
            }
        }
        Err(Error::Infeasible(shortfall.unwrap_or_else(|| format!("{what} fits no bundle"))))
    }

    /// Places `demand` on the node, or inside the bundle(s) `placement` names.
    pub(super) fn place_demand(
        &mut self,
        demand: &ResourceSet,
        placement: Option<&BundleSchedule>,
    ) -> std::result::Result<Allocation, PlacementError> {
        let Some(schedule) = placement else {
            return self.cluster.place(demand, &PlacementTarget::Anywhere);
        };
        let bundle = |index| PlacementTarget::Bundle(BundleRef { group: schedule.group, index });
        if let Some(index) = schedule.bundle_index {
            return self.cluster.place(demand, &bundle(index));
        }
        let count = match self.cluster.bundle_table(schedule.group) {
            Some(table) => table.bundles.len(),
            None => match self.cluster.group_status(schedule.group) {
                Some(_) => return self.cluster.place(demand, &bundle(0)),
                None => return Err(PlacementError::UnknownGroup(schedule.group)),
            },
        };
        let mut last = None;
        for index in 0..count {
            match self.cluster.place(demand, &bundle(index)) {
                Ok(allocation) => return Ok(allocation),
                Err(e) if is_waiting(&e) => last = Some(e),
                Err(e) => {
                    last.get_or_insert(e);
                }
            }
        }
        Err(last.unwrap_or(PlacementError::UnknownGroup(schedule.group)))
    }

    /// The total resources of the node that best fits `demand` (a demand must fit on one node).
    pub(super) fn node_total(&self, demand: &ResourceSet) -> ResourceSet {
        self.cluster
            .live_nodes()
            .find(|node| node.total().first_shortfall(demand).is_none())
            .or_else(|| self.cluster.live_nodes().next())
            .map(|node| node.total().clone())
            .unwrap_or_default()
    }
}

fn state_of(
    id: GroupId,
    request: &PlacementGroupRequest,
    status: GroupStatus,
    table: Option<rtrun_placement::BundleTable>,
) -> PlacementGroupState {
    PlacementGroupState {
        id,
        name: request.name.clone(),
        strategy: request.strategy,
        bundles: request.bundles.clone(),
        status: match status {
            GroupStatus::Pending => PlacementGroupStatus::Pending,
            GroupStatus::Placed => PlacementGroupStatus::Created,
        },
        table,
    }
}
