//! Worker processes as the control plane sees them: started for an actor or as task workers,
//! registered on their connection, killed, and reaped — an actor's worker that exits restarts
//! its actor (while restarts remain) or ends it; a task worker's running task is retried or
//! failed.

use std::collections::BTreeMap;

use super::{ActorState, Effect, HeadCore, Lineage, Origin, WorkerEntry, WorkerRole};
use rtrun_proto::env::WorkerSpec;
use rtrun_proto::error::{Error, Result};
use rtrun_proto::ids::{NodeId, WorkerId};
use rtrun_proto::protocol::{ActorStart, Address, Assignment, Outcome, WorkerExit};

impl HeadCore {
    /// Records a new worker and asks for its process.
    pub(super) fn new_worker(
        &mut self,
        role: WorkerRole,
        node: u64,
        lineage: Lineage,
        extra_env: &BTreeMap<String, String>,
        effects: &mut Vec<Effect>,
    ) -> WorkerId {
        let worker = WorkerId(self.members.next_id());
        let job = lineage.job.clone();
        // A submitted job's environment reaches its workers; the actor's own settings win.
        // Its job's number too, which its logs' spans carry.
        let mut env: Vec<(String, String)> = lineage
            .driver
            .and_then(|driver| self.members.jobs.iter().find(|(_, j)| j.driver == Some(driver)))
            .map(|(id, j)| {
                let mut env = j.env.clone();
                env.push((rtrun_proto::env::JOB_ENV.to_owned(), id.to_string()));
                env
            })
            .unwrap_or_default();
        env.extend(extra_env.iter().map(|(k, v)| (k.clone(), v.clone())));
        let spec = WorkerSpec {
            session: self.session.clone(),
            worker,
            head_address: self.members.head_address.clone().unwrap_or_else(|| {
                rtrun_proto::address::worker_address(
                    &self.session,
                    rtrun_proto::ids::DRIVER_WORKER_ID,
                )
            }),
            namespace: "default".into(),
        };
        env.push(spec.to_env());
        self.workers_on.entry(node).or_default().insert(worker);
        self.journal.worker(worker);
        self.workers.insert(
            worker,
            WorkerEntry {
                node,
                lineage,
                pid: None,
                address: None,
                conn: None,
                role,
                kill_requested: false,
            },
        );
        effects.push(Effect::Spawn { node, worker, env, job });
        worker
    }

    pub(super) fn register_worker(
        &mut self,
        from: Origin,
        worker: WorkerId,
        address: Address,
        pid: u32,
        effects: &mut Vec<Effect>,
    ) -> Result<Assignment> {
        let conn =
            from.conn.ok_or_else(|| Error::Invalid("workers register over a connection".into()))?;
        let entry = self
            .workers
            .get_mut(&worker)
            .ok_or_else(|| Error::Invalid(format!("unknown worker {worker} (pid {pid})")))?;
        self.journal.worker(worker);
        if let Some(old) = entry.conn.replace(conn)
            && old != conn
        {
            effects.push(Effect::Forget(old));
        }
        entry.address = Some(address.clone());
        entry.pid.get_or_insert(pid);
        effects.push(Effect::Remember { address, conn });
        match entry.role {
            WorkerRole::Actor { actor, incarnation } => {
                let actor_entry = self
                    .actors
                    .get(&actor)
                    .ok_or_else(|| Error::Invalid(format!("worker {worker} has no actor")))?;
                Ok(Assignment::Actor(Box::new(ActorStart {
                    actor,
                    incarnation,
                    type_name: actor_entry.spec.type_name.clone(),
                    ctor_args: actor_entry.spec.ctor_args.clone(),
                    max_concurrency: actor_entry.spec.options.max_concurrency,
                    group: actor_entry.spec.options.group.clone(),
                    name: actor_entry.spec.options.name.clone(),
                    allocation: actor_entry.allocation.clone(),
                    capture_group: actor_entry
                        .spec
                        .options
                        .placement
                        .filter(|schedule| schedule.capture_child_tasks)
                        .map(|schedule| schedule.group),
                })))
            }
            WorkerRole::Tasks { .. } => {
                self.starting_task_workers = self.starting_task_workers.saturating_sub(1);
                self.park_task_worker(worker);
                self.dispatch_tasks(effects);
                Ok(Assignment::Tasks)
            }
        }
    }

    /// A process started: a job driver's pid is recorded (and killed when the job was stopped
    /// before it started); a worker killed before its pid was known is killed now.
    pub(super) fn worker_spawned(&mut self, worker: WorkerId, pid: u32, effects: &mut Vec<Effect>) {
        if let Some(stop) = self.members.job_spawned(worker, pid) {
            // A job's driver has the job's number as its id.
            self.journal.job(worker.0);
            if stop {
                effects.push(Effect::Kill { node: self.members.head_node, pid });
            }
            return;
        }
        let shutting_down = self.shutting_down;
        if let Some(entry) = self.workers.get_mut(&worker) {
            self.journal.worker(worker);
            entry.pid = Some(pid);
            if entry.kill_requested || shutting_down {
                effects.push(Effect::Kill { node: entry.node, pid });
            }
        }
    }

    /// Kills a worker's process, now or as soon as its pid is known.
    pub(super) fn kill_worker(&mut self, worker: WorkerId, effects: &mut Vec<Effect>) {
        if let Some(w) = self.workers.get_mut(&worker) {
            self.journal.worker(worker);
            match w.pid {
                Some(pid) => effects.push(Effect::Kill { node: w.node, pid }),
                None => w.kill_requested = true,
            }
        }
    }

    /// A worker's process ended (`status` says how). The caller reschedules.
    /// How a worker ended, naming its node when that is not the head's: on a cluster, where a
    /// process died is where its operator looks (and a node killed with its workers may report
    /// a worker's SIGKILL before the head declares the node dead).
    pub(super) fn exit_reason(&self, worker: WorkerId, status: &WorkerExit) -> String {
        let node = self.workers.get(&worker).map(|w| w.node);
        match node.filter(|&n| n != self.members.head_node) {
            Some(node) => match self.members.nodes.get(&node) {
                Some(entry) => format!("{status} on {} ({})", NodeId(node), entry.name),
                None => status.to_string(),
            },
            None => status.to_string(),
        }
    }

    pub(super) fn worker_exited(
        &mut self,
        worker: WorkerId,
        status: String,
        effects: &mut Vec<Effect>,
    ) {
        let Some(entry) = self.workers.remove(&worker) else { return };
        self.journal.worker(worker);
        super::remove_member(&mut self.workers_on, &entry.node, &worker);
        if let Some(conn) = entry.conn {
            effects.push(Effect::Forget(conn));
        }
        if self.shutting_down {
            return;
        }
        match entry.role {
            WorkerRole::Actor { actor, incarnation } => {
                self.actor_worker_exited(actor, incarnation, status, effects)
            }
            WorkerRole::Tasks { running } => {
                self.unpark_task_worker(worker);
                if entry.conn.is_none() {
                    self.starting_task_workers = self.starting_task_workers.saturating_sub(1);
                }
                if let Some(call_id) = running
                    && let Some(run) = self.running_tasks.remove(&call_id)
                {
                    self.release(run.allocation);
                    let mut task = run.task;
                    if task.attempts < task.spec.options.max_retries {
                        task.attempts += 1;
                        self.task_queue.push_front(task);
                    } else {
                        let target = task.spec.function.clone();
                        self.answer_task(
                            task,
                            Outcome::Error(Error::WorkerDied { target, reason: status }),
                            effects,
                        );
                    }
                }
            }
        }
    }

    /// An actor's worker ended: the actor restarts (in place, or placed anew when its node
    /// died) while restarts remain and it was not killed, else it is dead.
    fn actor_worker_exited(
        &mut self,
        actor: rtrun_proto::ids::ActorId,
        incarnation: u64,
        status: String,
        effects: &mut Vec<Effect>,
    ) {
        let Some(actor_entry) = self.actors.get_mut(&actor) else { return };
        if actor_entry.incarnation != incarnation {
            return;
        }
        self.journal.actor(actor);
        self.ended_owners.push(actor);
        let Some(actor_entry) = self.actors.get_mut(&actor) else { return };
        let restart = !actor_entry.killed && actor_entry.restarts_left != 0;
        if !restart {
            let reason = actor_entry.death_reason.clone().unwrap_or(status);
            self.finish_actor(actor, reason, effects);
            return;
        }
        if actor_entry.restarts_left > 0 {
            actor_entry.restarts_left -= 1;
        }
        actor_entry.incarnation += 1;
        tracing::info!(%actor, %status, incarnation = actor_entry.incarnation, "restarting actor");
        let incarnation = actor_entry.incarnation;
        let lineage = actor_entry.lineage.clone();
        match actor_entry.allocation.as_ref().map(|a| a.node.clone()) {
            Some(placed) => {
                let node = self.members.node_of(&placed);
                let env = self.actor_env(actor);
                let role = WorkerRole::Actor { actor, incarnation };
                let new_worker = self.new_worker(role, node, lineage, &env, effects);
                if let Some(actor_entry) = self.actors.get_mut(&actor) {
                    actor_entry.state = ActorState::Starting { worker: new_worker };
                    actor_entry.last_worker = Some((new_worker, node));
                }
            }
            // Its node died: it is placed anew.
            None => {
                actor_entry.state = ActorState::Pending;
                self.pending_actors.push_back(actor);
            }
        }
    }
}
