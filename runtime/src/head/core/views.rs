//! What the control plane shows of itself: the cluster's resources, nodes, workers and task
//! counts (`rtrun status`, metrics, the dashboard) and the actor table (`rtrun list actors`).

use std::collections::BTreeMap;

use super::{ActorState, HeadCore, members::floats};
use crate::ids::NodeId;
use crate::protocol::{ActorSummary, ClusterInfo, NodeInfo, TaskCounts};

impl HeadCore {
    /// The cluster's resources, workers, nodes and tasks; the head's own node is listed even in
    /// an embedded session (which has no member nodes).
    pub(super) fn cluster_info(&self) -> ClusterInfo {
        let local = self.members.head_node;
        let mut total: BTreeMap<String, f64> = BTreeMap::new();
        let mut available: BTreeMap<String, f64> = BTreeMap::new();
        for node in self.cluster.nodes() {
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
}
