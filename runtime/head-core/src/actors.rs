//! Actors: creation with names and `get_if_exists`, placement in creation order, watches on
//! liveness, kills, restarts' bookkeeping and death (which frees resources and the name).

use std::collections::{BTreeMap, VecDeque};

use super::{
    ActorEntry, ActorState, Effect, HeadCore, Lineage, Origin, ReplyToken, WorkerRole, groups,
};
use rtrun_proto::actor::{ActorInfo, ActorSpec};
use rtrun_proto::env::{NOSET_CUDA_VISIBLE_DEVICES_ENV, opt_out};
use rtrun_proto::error::{Error, Missing, Result};
use rtrun_proto::ids::ActorId;
use rtrun_proto::protocol::Response;

pub(super) fn info_of(id: ActorId, spec: &ActorSpec) -> ActorInfo {
    ActorInfo {
        id,
        type_name: spec.type_name.clone(),
        max_task_retries: spec.options.max_task_retries,
    }
}

impl HeadCore {
    pub(super) fn create_actor(
        &mut self,
        spec: ActorSpec,
        lineage: Lineage,
        effects: &mut Vec<Effect>,
    ) -> Result<ActorInfo> {
        let options = &spec.options;
        let demand = super::resources_of(
            options.num_cpus.unwrap_or(0.0),
            options.num_gpus.unwrap_or(0.0),
            &options.resources,
        )?;
        self.check_placeable(
            &format!("actor {}", spec.type_name),
            &demand,
            options.placement.as_ref(),
        )?;
        let name_key = match &options.name {
            Some(name) => {
                let key =
                    (options.namespace.clone().unwrap_or_else(|| "default".into()), name.clone());
                let live = self.names.get(&key).and_then(|&id| Some((id, self.actors.get(&id)?)));
                if let Some((id, existing)) = live {
                    if !options.get_if_exists {
                        return Err(Error::NameTaken { name: key.1, namespace: key.0 });
                    }
                    if existing.spec.type_name != spec.type_name {
                        return Err(Error::Invalid(format!(
                            "get_if_exists: the actor named `{}` in namespace `{}` has type {}, \
                             asked for {}",
                            key.1, key.0, existing.spec.type_name, spec.type_name
                        )));
                    }
                    return Ok(info_of(id, &existing.spec));
                }
                Some(key)
            }
            None if options.get_if_exists => {
                return Err(Error::Invalid(format!(
                    "actor {}: get_if_exists needs a name",
                    spec.type_name
                )));
            }
            None => None,
        };
        let mut lineage = lineage;
        lineage.detached |= options.detached;
        let id = ActorId(self.next_actor);
        self.next_actor += 1;
        if let Some(owner) = lineage.owner {
            self.children.entry(owner).or_default().push(id);
        }
        if let Some(key) = name_key {
            self.names.insert(key, id);
        }
        let info = info_of(id, &spec);
        self.journal.actor(id);
        self.actors.insert(
            id,
            Box::new(ActorEntry {
                lineage,
                restarts_left: spec.options.max_restarts,
                spec,
                demand,
                state: ActorState::Pending,
                incarnation: 0,
                killed: false,
                allocation: None,
                death_reason: None,
                waiters: Vec::new(),
                last_worker: None,
            }),
        );
        self.pending_actors.push_back(id);
        self.schedule_pending_actors(effects);
        Ok(info)
    }

    pub(super) fn actor_by_name(&self, name: String, namespace: String) -> Response {
        let found = self
            .names
            .get(&(namespace.clone(), name.clone()))
            .and_then(|id| self.actors.get(id).map(|entry| (*id, entry)));
        match found {
            Some((id, entry)) if !matches!(entry.state, ActorState::Dead { .. }) => {
                Response::Actor(info_of(id, &entry.spec))
            }
            _ => Response::Error(rtrun_proto::error::Error::ActorNotFound { name, namespace }),
        }
    }

    /// The answer to a watch on `actor` (alive after incarnation `after`), or `None` when the
    /// watch waits and is answered later.
    pub(super) fn wait_actor_alive(
        &mut self,
        actor: ActorId,
        after: Option<u64>,
        reply: ReplyToken,
    ) -> Option<Response> {
        let Some(entry) = self.actors.get_mut(&actor) else {
            return Some(Response::Error(Error::NotFound(Missing::Actor(actor))));
        };
        match &entry.state {
            ActorState::Alive { address, .. } if after.is_none_or(|a| entry.incarnation > a) => {
                Some(Response::ActorAlive {
                    address: address.clone(),
                    incarnation: entry.incarnation,
                })
            }
            ActorState::Dead { reason } => {
                Some(Response::Error(Error::ActorDied { actor, reason: reason.clone() }))
            }
            _ => {
                entry.waiters.push((after, reply));
                None
            }
        }
    }

    /// Starts pending actors whose resources are now available, in creation order.
    pub(super) fn schedule_pending_actors(&mut self, effects: &mut Vec<Effect>) {
        let mut still_pending = VecDeque::new();
        while let Some(id) = self.pending_actors.pop_front() {
            let Some(entry) = self.actors.get(&id) else { continue };
            if !matches!(entry.state, ActorState::Pending) {
                continue;
            }
            let demand = entry.demand.clone();
            let placement = entry.spec.options.placement;
            let allocation = match self.place_demand(&demand, placement.as_ref()) {
                Ok(allocation) => allocation,
                Err(e) if groups::is_waiting(&e) => {
                    still_pending.push_back(id);
                    continue;
                }
                Err(e) => {
                    self.finish_actor(id, format!("it cannot be placed: {e}"), effects);
                    continue;
                }
            };
            let Some(entry) = self.actors.get_mut(&id) else {
                self.release(allocation.id);
                continue;
            };
            let node = self.members.node_of(&allocation.node);
            self.journal.actor(id);
            self.holders.insert(allocation.id, id);
            entry.allocation = Some(allocation);
            let incarnation = entry.incarnation;
            let lineage = entry.lineage.clone();
            let env = self.actor_env(id);
            let role = WorkerRole::Actor { actor: id, incarnation };
            let worker = self.new_worker(role, node, lineage, &env, effects);
            if let Some(entry) = self.actors.get_mut(&id) {
                entry.state = ActorState::Starting { worker };
                entry.last_worker = Some((worker, node));
            }
        }
        self.pending_actors = still_pending;
    }

    pub(super) fn kill_actor(
        &mut self,
        actor: ActorId,
        no_restart: bool,
        effects: &mut Vec<Effect>,
    ) -> Result<()> {
        let entry = self.actors.get_mut(&actor).ok_or(Error::NotFound(Missing::Actor(actor)))?;
        self.journal.actor(actor);
        if no_restart {
            entry.killed = true;
            entry.death_reason = Some("it was killed".into());
        }
        let worker = match entry.state {
            ActorState::Starting { worker } | ActorState::Alive { worker, .. } => worker,
            ActorState::Pending => {
                if no_restart {
                    self.finish_actor(actor, "it was killed before it started".into(), effects);
                }
                return Ok(());
            }
            ActorState::Dead { .. } => return Ok(()),
        };
        self.kill_worker(worker, effects);
        Ok(())
    }

    /// The environment of an actor's worker: its `env` option, plus `CUDA_VISIBLE_DEVICES` and
    /// `CUDA_DEVICE_ORDER` for the GPUs it was given unless opted out.
    pub(super) fn actor_env(&self, actor: ActorId) -> BTreeMap<String, String> {
        let Some(entry) = self.actors.get(&actor) else { return BTreeMap::new() };
        let mut env = entry.spec.options.env.clone();
        let opted_out = self.config.noset_cuda_visible_devices
            || opt_out(env.get(NOSET_CUDA_VISIBLE_DEVICES_ENV).map(String::as_str));
        if let Some(allocation) = &entry.allocation
            && !allocation.gpus.is_empty()
            && !opted_out
        {
            env.insert("CUDA_VISIBLE_DEVICES".into(), allocation.cuda_visible_devices());
            env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
        }
        env
    }

    /// Marks an actor dead for good: frees its resources and name, fails its waiters.
    pub(super) fn finish_actor(
        &mut self,
        actor: ActorId,
        reason: String,
        effects: &mut Vec<Effect>,
    ) {
        let Some(entry) = self.actors.get_mut(&actor) else { return };
        self.journal.actor(actor);
        if let Some(allocation) = entry.allocation.take() {
            self.holders.remove(&allocation.id);
            self.release(allocation.id);
        }
        let Some(entry) = self.actors.get_mut(&actor) else { return };
        entry.state = ActorState::Dead { reason: reason.clone() };
        for (_, reply) in std::mem::take(&mut entry.waiters) {
            effects.push(Effect::Respond(
                reply,
                Response::Error(Error::ActorDied { actor, reason: reason.clone() }),
            ));
        }
        if let Some(name) = entry.spec.options.name.clone() {
            let namespace =
                entry.spec.options.namespace.clone().unwrap_or_else(|| "default".into());
            self.names.remove(&(namespace, name));
        }
    }

    pub(super) fn actor_started(
        &mut self,
        actor: ActorId,
        incarnation: u64,
        result: std::result::Result<(), String>,
        effects: &mut Vec<Effect>,
    ) {
        let Some(entry) = self.actors.get_mut(&actor) else { return };
        let ActorState::Starting { worker } = entry.state else { return };
        if entry.incarnation != incarnation {
            return;
        }
        self.journal.actor(actor);
        match result {
            Ok(()) => {
                let Some(address) = self.workers.get(&worker).and_then(|w| w.address.clone())
                else {
                    return;
                };
                entry.state = ActorState::Alive { worker, address: address.clone() };
                let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut entry.waiters)
                    .into_iter()
                    .partition(|(after, _)| after.is_none_or(|a| incarnation > a));
                entry.waiters = waiting;
                for (_, reply) in ready {
                    effects.push(Effect::Respond(
                        reply,
                        Response::ActorAlive { address: address.clone(), incarnation },
                    ));
                }
            }
            Err(message) => {
                // A constructor that fails is not retried (as in Ray): the actor is dead.
                entry.killed = true;
                entry.death_reason = Some(format!("its constructor failed: {message}"));
                if let Some(w) = self.workers.get(&worker)
                    && let Some(pid) = w.pid
                {
                    effects.push(Effect::Kill { node: w.node, pid });
                }
            }
        }
    }

    /// The job of the process a request came from.
    pub(super) fn lineage_of(&self, from: Origin) -> Lineage {
        let Some(worker) = from.process else { return Lineage::default() };
        if let Some(job) = self.members.drivers.get(&worker) {
            return Lineage {
                job: job.clone(),
                driver: Some(worker),
                detached: false,
                owner: None,
            };
        }
        let Some(entry) = self.workers.get(&worker) else { return Lineage::default() };
        let mut lineage = entry.lineage.clone();
        // What an actor's worker creates is owned by that actor; a task worker's by nobody.
        lineage.owner = match entry.role {
            WorkerRole::Actor { actor, .. } => Some(actor),
            WorkerRole::Tasks { .. } => None,
        };
        lineage
    }
}
