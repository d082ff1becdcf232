//! Tasks: the queue, dispatch to pooled task workers per node and job (spawning workers as
//! needed, up to `max_task_workers`), replies, retries, cancellation and answers.

use rtrun_placement::{AllocationId, ResourceSet};

use super::{Effect, HeadCore, Lineage, QueuedTask, ReplyToken, RunningTask, WorkerRole, groups};
use rtrun_proto::error::{Error, Result};
use rtrun_proto::ids::{ObjectId, WorkerId};
use rtrun_proto::protocol::{CallFrame, CallTarget, Frame, Outcome, Response};
use rtrun_proto::task::TaskSpec;

impl HeadCore {
    /// Queues a task (answered later to `reply`) and dispatches what can run.
    pub(super) fn submit_task(
        &mut self,
        spec: TaskSpec,
        lineage: Lineage,
        reply: ReplyToken,
        effects: &mut Vec<Effect>,
    ) -> Result<()> {
        let demand = self.validate_task(&spec)?;
        let key = (demand.clone(), spec.options.placement);
        let next = self.classes.len() as u64;
        let class = *self.classes.entry(key).or_insert(next);
        tracing::debug!(task = %spec.task, function = %spec.function, driver = ?lineage.driver, "task queued");
        self.task_queue.push_back(QueuedTask { lineage, class, spec, demand, reply, attempts: 0 });
        self.dispatch_tasks(effects);
        Ok(())
    }

    fn validate_task(&self, spec: &TaskSpec) -> Result<ResourceSet> {
        let demand = super::resources_of(
            spec.options.num_cpus,
            spec.options.num_gpus,
            &spec.options.resources,
        )?;
        self.check_placeable(
            &format!("task {}", spec.function),
            &demand,
            spec.options.placement.as_ref(),
        )?;
        Ok(demand)
    }

    /// A task worker answered: its resources return, it is idle again, the task is answered.
    pub(super) fn task_reply(&mut self, call_id: u64, outcome: Outcome, effects: &mut Vec<Effect>) {
        let Some(running) = self.running_tasks.remove(&call_id) else { return };
        self.release(running.allocation);
        if let Some(entry) = self.workers.get_mut(&running.worker) {
            entry.role = WorkerRole::Tasks { running: None };
            self.park_task_worker(running.worker);
        }
        self.answer_task(running.task, outcome, effects);
        self.reschedule(effects);
    }

    /// Starts queued tasks that fit, on idle task workers of the node and job each task is
    /// placed on, spawning workers there as needed.
    pub(super) fn dispatch_tasks(&mut self, effects: &mut Vec<Effect>) {
        // Nothing queued: nothing to do (and no count of the task workers, a scan of every
        // worker, on each of the many events that reschedule).
        if self.shutting_down || self.task_queue.is_empty() {
            return;
        }
        let mut wanted: Vec<(u64, Lineage)> = Vec::new();
        let task_workers =
            self.workers.values().filter(|w| matches!(w.role, WorkerRole::Tasks { .. })).count();
        // Tasks that find no idle worker are placed only to learn which node wants a worker;
        // past what could still be started (and started already), the rest of the queue waits
        // untouched, so a long queue costs nothing per reply.
        let startable =
            self.config.max_task_workers.saturating_sub(task_workers) + self.starting_task_workers;
        // Demands that had to wait in this pass: the same demand later in the queue waits too
        // (resources only get scarcer within a pass: an allocation made here is either kept
        // or released at once), so it is not placed again. Without this, idle workers and a
        // full node (more task workers than CPUs) made every reply scan the whole queue
        // through the placement code: 1,000 queued tasks ran at 3k/s.
        let mut waiting: Vec<u64> = Vec::new();
        let mut index = 0;
        while index < self.task_queue.len() {
            if self.idle_task_workers.is_empty() && wanted.len() >= startable {
                break;
            }
            let queued = &self.task_queue[index];
            let placement = queued.spec.options.placement;
            let class = queued.class;
            if waiting.contains(&class) {
                index += 1;
                continue;
            }
            let demand = queued.demand.clone();
            let allocation = match self.place_demand(&demand, placement.as_ref()) {
                Ok(allocation) => allocation,
                Err(e) if groups::is_waiting(&e) => {
                    waiting.push(class);
                    index += 1;
                    continue;
                }
                Err(e) => {
                    if let Some(task) = self.task_queue.remove(index) {
                        let error = Error::Infeasible(format!(
                            "task {} cannot be placed: {e}",
                            task.spec.function
                        ));
                        self.answer_task(task, Outcome::Error(error), effects);
                    }
                    continue;
                }
            };
            let node = self.members.node_of(&allocation.node);
            let lineage = self.task_queue[index].lineage.clone();
            let idle = self.idle_task_workers.iter().rposition(|(w, _)| {
                self.workers.get(w).is_some_and(|entry| {
                    entry.node == node && same_job(&entry.lineage, &lineage) && entry.conn.is_some()
                })
            });
            let Some(position) = idle else {
                self.release(allocation.id);
                wanted.push((node, lineage));
                index += 1;
                continue;
            };
            let (worker, _) = self.idle_task_workers.remove(position);
            let Some(conn) = self.workers.get(&worker).and_then(|w| w.conn) else {
                self.release(allocation.id);
                continue;
            };
            let Some(task) = self.task_queue.remove(index) else {
                self.release(allocation.id);
                break;
            };
            let call_id = self.next_call;
            self.next_call += 1;
            if let Some(entry) = self.workers.get_mut(&worker) {
                entry.role = WorkerRole::Tasks { running: Some(call_id) };
            }
            let frame = Frame::Call(CallFrame {
                call_id,
                target: CallTarget::Task { function: task.spec.function.clone() },
                args: task.spec.args.clone(),
            });
            // The worker's `task` span names this call id and the head as its caller.
            tracing::debug!(
                task = %task.spec.task,
                function = %task.spec.function,
                call = call_id,
                %worker,
                driver = ?task.lineage.driver,
                "task dispatched"
            );
            self.running_tasks
                .insert(call_id, RunningTask { task, worker, allocation: allocation.id });
            effects.push(Effect::Call { conn, call_id, frame });
        }
        self.start_task_workers(task_workers, wanted, effects);
    }

    /// Starts a task worker for each placed task that found none idle, on its node and for its
    /// job, counting those already starting there, up to `max_task_workers`.
    fn start_task_workers(
        &mut self,
        mut task_workers: usize,
        wanted: Vec<(u64, Lineage)>,
        effects: &mut Vec<Effect>,
    ) {
        let mut asked: Vec<(u64, Lineage, usize)> = Vec::new();
        for (node, lineage) in wanted {
            let asked_now =
                match asked.iter_mut().find(|(n, l, _)| *n == node && same_job(l, &lineage)) {
                    Some(entry) => {
                        entry.2 += 1;
                        entry.2
                    }
                    None => {
                        asked.push((node, lineage.clone(), 1));
                        1
                    }
                };
            let starting = self
                .workers
                .values()
                .filter(|w| {
                    matches!(w.role, WorkerRole::Tasks { .. })
                        && w.conn.is_none()
                        && w.node == node
                        && same_job(&w.lineage, &lineage)
                })
                .count();
            if asked_now <= starting || task_workers >= self.config.max_task_workers {
                continue;
            }
            task_workers += 1;
            self.starting_task_workers += 1;
            let role = WorkerRole::Tasks { running: None };
            self.new_worker(role, node, lineage, &Default::default(), effects);
        }
    }

    /// Puts a task worker into the idle pool, noting when.
    pub(super) fn park_task_worker(&mut self, worker: WorkerId) {
        self.idle_task_workers.push((worker, self.clock_ms));
    }

    /// Takes a task worker out of the idle pool (if it is there).
    pub(super) fn unpark_task_worker(&mut self, worker: WorkerId) {
        self.idle_task_workers.retain(|(w, _)| *w != worker);
    }

    /// The clock moved to `now_ms`: task workers idle for `task_worker_idle_timeout` end (a
    /// finished detached run's reward worker lived on with its job's environment until the
    /// cluster stopped).
    pub(super) fn tick(&mut self, now_ms: u64, effects: &mut Vec<Effect>) {
        self.clock_ms = self.clock_ms.max(now_ms);
        if self.shutting_down {
            return;
        }
        let timeout =
            u64::try_from(self.config.task_worker_idle_timeout.as_millis()).unwrap_or(u64::MAX);
        let now = self.clock_ms;
        let (expired, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.idle_task_workers)
            .into_iter()
            .partition(|(_, since)| now.saturating_sub(*since) >= timeout);
        self.idle_task_workers = kept;
        for (worker, _) in expired {
            self.kill_worker(worker, effects);
        }
        if self.awaiting_reconnects() {
            self.expire_awaiting(effects);
        }
    }

    /// The driver `driver` is gone: its tasks, queued or running, are dropped (failed with the
    /// reason) and its task workers end with it. A pooled worker carries its job's environment
    /// and working directory, so the next job must never run in it.
    pub(super) fn end_tasks_of(&mut self, driver: WorkerId, effects: &mut Vec<Effect>) {
        let of_driver = |l: &Lineage| l.driver == Some(driver) && !l.detached;
        let gone = || Outcome::Error(Error::Cancelled);
        let mut index = 0;
        while index < self.task_queue.len() {
            match of_driver(&self.task_queue[index].lineage) {
                true => {
                    if let Some(task) = self.task_queue.remove(index) {
                        self.answer_task(task, gone(), effects);
                    }
                }
                false => index += 1,
            }
        }
        let running: Vec<u64> = self
            .running_tasks
            .iter()
            .filter(|(_, r)| of_driver(&r.task.lineage))
            .map(|(call_id, _)| *call_id)
            .collect();
        for call_id in running {
            if let Some(run) = self.running_tasks.remove(&call_id) {
                self.release(run.allocation);
                if let Some(entry) = self.workers.get_mut(&run.worker) {
                    entry.role = WorkerRole::Tasks { running: None };
                }
                self.answer_task(run.task, gone(), effects);
            }
        }
        let workers: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, w)| matches!(w.role, WorkerRole::Tasks { .. }) && of_driver(&w.lineage))
            .map(|(id, _)| *id)
            .collect();
        for worker in workers {
            self.unpark_task_worker(worker);
            self.kill_worker(worker, effects);
        }
    }

    pub(super) fn cancel_task(&mut self, task: ObjectId, force: bool, effects: &mut Vec<Effect>) {
        if let Some(index) = self.task_queue.iter().position(|t| t.spec.task == task) {
            if let Some(queued) = self.task_queue.remove(index) {
                self.answer_task(queued, Outcome::Error(Error::Cancelled), effects);
            }
            return;
        }
        let Some((call_id, worker)) = self
            .running_tasks
            .iter()
            .find(|(_, r)| r.task.spec.task == task)
            .map(|(call_id, r)| (*call_id, r.worker))
        else {
            return;
        };
        if force {
            if let Some(run) = self.running_tasks.remove(&call_id) {
                self.release(run.allocation);
                self.answer_task(run.task, Outcome::Error(Error::Cancelled), effects);
            }
            self.stop_task_worker(worker, effects);
            // What it held may start a pending group, actor or task now (found by the
            // simulator: a group that fitted waited for the next unrelated release).
            self.reschedule(effects);
        } else if let Some(conn) = self.workers.get(&worker).and_then(|w| w.conn) {
            effects.push(Effect::Send(conn, Frame::Cancel { call_id }));
        }
    }

    /// Fails the running tasks whose allocation `lost` says is gone (its group was removed,
    /// its node died) with `reason`, and stops their workers.
    pub(super) fn fail_running_tasks(
        &mut self,
        lost: impl Fn(AllocationId) -> bool,
        reason: &str,
        effects: &mut Vec<Effect>,
    ) {
        let running: Vec<u64> = self
            .running_tasks
            .iter()
            .filter(|(_, run)| lost(run.allocation))
            .map(|(call_id, _)| *call_id)
            .collect();
        for call_id in running {
            let Some(run) = self.running_tasks.remove(&call_id) else { continue };
            self.stop_task_worker(run.worker, effects);
            let error = Error::WorkerDied {
                target: run.task.spec.function.clone(),
                reason: reason.to_owned(),
            };
            self.answer_task(run.task, Outcome::Error(error), effects);
        }
    }

    /// Kills a task worker whose running task was taken from it (answered already).
    pub(super) fn stop_task_worker(&mut self, worker: WorkerId, effects: &mut Vec<Effect>) {
        if let Some(w) = self.workers.get_mut(&worker) {
            w.role = WorkerRole::Tasks { running: None };
            if let Some(pid) = w.pid {
                effects.push(Effect::Kill { node: w.node, pid });
            }
        }
    }

    /// Answers a submitted task (its value or its error), counting it for metrics and by its
    /// function for `rtrun summary tasks`.
    pub(super) fn answer_task(
        &mut self,
        task: QueuedTask,
        outcome: Outcome,
        effects: &mut Vec<Effect>,
    ) {
        // Counts by function are kept for as many functions as a cluster registers (a few
        // hundred at most): bounded by the binaries, not by the tasks.
        let counts = self.task_totals.entry(task.spec.function).or_default();
        match outcome {
            Outcome::Error(_) => {
                self.tasks_failed += 1;
                counts.failed += 1;
            }
            _ => {
                self.tasks_finished += 1;
                counts.finished += 1;
            }
        }
        effects.push(Effect::Respond(task.reply, Response::Outcome(outcome)));
    }
}

/// Whether a task worker of `worker`'s lineage may run a task of `task`'s: the same job binary
/// and the same driver (one run of the job, with its environment and working directory).
fn same_job(worker: &Lineage, task: &Lineage) -> bool {
    worker.job == task.job && worker.driver == task.driver
}
