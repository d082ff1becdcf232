//! What the control plane shows of itself: the cluster's resources, nodes, workers and task
//! counts (`rtrun status`, metrics, the dashboard) and the actor, task and worker tables
//! (`rtrun list actors|tasks|workers`).

use std::collections::BTreeMap;

use super::{ActorState, HeadCore, QueuedTask, WorkerRole, members::floats};
use rtrun_proto::ids::{NodeId, WorkerId};
use rtrun_proto::protocol::{
    ActorSummary, ClusterInfo, NodeInfo, TaskCounts, TaskSummary, TaskTable, WorkerSummary,
};

impl HeadCore {
    /// The cluster's resources, workers, nodes and tasks; the head's own node is listed even in
    /// an embedded session (which has no member nodes).
    pub(super) fn cluster_info(&self) -> ClusterInfo {
        let local = self.members.head_node;
        let mut total: BTreeMap<String, f64> = BTreeMap::new();
        let mut available: BTreeMap<String, f64> = BTreeMap::new();
        for node in self.cluster.live_nodes() {
            for (name, amount) in floats(node.total()) {
                *total.entry(name).or_default() += amount;
            }
            for (name, amount) in floats(node.available()) {
                *available.entry(name).or_default() += amount;
            }
        }
        let mut node_infos = self.members.info();
        if !node_infos.iter().any(|n| n.node.0 == local) {
            let id = NodeId(local);
            if let Some(node) = self.cluster.node(&rtrun_placement::NodeId::new(id.to_string())) {
                node_infos.insert(
                    0,
                    NodeInfo {
                        node: id,
                        name: "embedded".into(),
                        alive: true,
                        total: floats(node.total()),
                        ..Default::default()
                    },
                );
            }
        }
        for info in &mut node_infos {
            let placement = rtrun_placement::NodeId::new(info.node.to_string());
            if let Some(node) = self.cluster.node(&placement) {
                info.available = floats(node.available());
            }
        }
        ClusterInfo {
            total,
            available,
            workers: self.workers.len(),
            alive_actors: self
                .actors
                .values()
                .filter(|a| matches!(a.state, ActorState::Alive { .. }))
                .count(),
            worker_pids: self.workers.values().filter_map(|w| w.pid).collect(),
            nodes: node_infos,
            tasks: TaskCounts {
                queued: self.task_queue.len() as u64,
                running: self.running_tasks.len() as u64,
                finished: self.tasks_finished,
                failed: self.tasks_failed,
            },
        }
    }

    pub(super) fn actor_summaries(&self) -> Vec<ActorSummary> {
        let mut actors: Vec<_> = self
            .actors
            .iter()
            .map(|(id, entry)| {
                let worker = match entry.state {
                    ActorState::Starting { worker } | ActorState::Alive { worker, .. } => {
                        Some(worker)
                    }
                    _ => None,
                };
                let node = worker.and_then(|w| self.workers.get(&w)).map(|w| NodeId(w.node));
                ActorSummary {
                    actor: *id,
                    type_name: entry.spec.type_name.clone(),
                    name: entry.spec.options.name.clone(),
                    state: match &entry.state {
                        ActorState::Pending => "PENDING".into(),
                        ActorState::Starting { .. } => "STARTING".into(),
                        ActorState::Alive { .. } => "ALIVE".into(),
                        ActorState::Dead { reason } => format!("DEAD ({reason})"),
                    },
                    node,
                    pid: worker.and_then(|w| self.workers.get(&w)).and_then(|w| w.pid),
                    restarts: entry.incarnation,
                    worker: entry.last_worker.map(|(worker, _)| worker),
                    log_node: entry.last_worker.map(|(_, node)| NodeId(node)),
                    driver: entry.lineage.driver,
                    namespace: entry.spec.options.name.as_ref().map(|_| {
                        entry.spec.options.namespace.clone().unwrap_or_else(|| "default".into())
                    }),
                    detached: entry.lineage.detached,
                }
            })
            .collect();
        actors.sort_by_key(|a| a.actor.0);
        actors
    }

    /// Queued tasks in queue order, running ones by call; and every function's counts.
    pub(super) fn task_table(&self) -> TaskTable {
        let mut by_function = self.task_totals.clone();
        let summary = |task: &QueuedTask, state: &str, worker: Option<WorkerId>| {
            let entry = worker.and_then(|w| self.workers.get(&w));
            TaskSummary {
                task: task.spec.task,
                function: task.spec.function.clone(),
                state: state.to_owned(),
                retries: task.attempts,
                worker,
                node: entry.map(|w| NodeId(w.node)),
                pid: entry.and_then(|w| w.pid),
                driver: task.lineage.driver,
            }
        };
        let mut live: Vec<TaskSummary> = Vec::new();
        for task in &self.task_queue {
            by_function.entry(task.spec.function.clone()).or_default().queued += 1;
            live.push(summary(task, "QUEUED", None));
        }
        let mut running: Vec<_> = self.running_tasks.iter().collect();
        running.sort_by_key(|(call, _)| **call);
        for (_, run) in running {
            by_function.entry(run.task.spec.function.clone()).or_default().running += 1;
            live.push(summary(&run.task, "RUNNING", Some(run.worker)));
        }
        TaskTable { live, by_function }
    }

    /// Every worker process the control plane knows, by id.
    pub(super) fn worker_summaries(&self) -> Vec<WorkerSummary> {
        let mut workers: Vec<WorkerSummary> = self
            .workers
            .iter()
            .map(|(id, entry)| {
                let (kind, actor, task) = match entry.role {
                    WorkerRole::Actor { actor, .. } => ("actor", Some(actor), None),
                    WorkerRole::Tasks { running: Some(call) } => {
                        ("task", None, self.running_tasks.get(&call).map(|r| r.task.spec.task))
                    }
                    WorkerRole::Tasks { running: None } => ("idle", None, None),
                };
                WorkerSummary {
                    worker: *id,
                    node: NodeId(entry.node),
                    pid: entry.pid,
                    kind: kind.to_owned(),
                    actor,
                    task,
                    driver: entry.lineage.driver,
                    registered: entry.conn.is_some(),
                }
            })
            .collect();
        workers.sort_by_key(|w| w.worker.0);
        workers
    }
}
