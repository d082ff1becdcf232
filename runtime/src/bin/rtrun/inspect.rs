//! What `rtrun status`, `rtrun list` and `rtrun kill` ask: a cluster's head, or an embedded
//! session on this machine (whose driver holds the control plane and answers the same state
//! queries over its Unix socket).

use rtrun::ActorInfo;
use rtrun::cluster::Client;
use rtrun::placement_group::PlacementGroupState;
use rtrun::protocol::ask as rq;
use rtrun::protocol::{
    ActorSummary, Ask, ClusterInfo, JobInfo, NodeMemory, TaskTable, WorkerSummary,
};
use rtrun::session::ask;

/// The control plane a state query goes to.
pub enum Inspect {
    /// A cluster, through its head.
    Cluster(Client),
    /// An embedded session on this machine, by name.
    Session(String),
}

impl Inspect {
    /// Nodes, resources and counts.
    pub fn status(&self) -> anyhow::Result<ClusterInfo> {
        match self {
            Inspect::Cluster(client) => Ok(client.status()?),
            Inspect::Session(s) => Ok(ask(s, rq::ClusterInfo)?),
        }
    }

    /// Every actor.
    pub fn actors(&self) -> anyhow::Result<Vec<ActorSummary>> {
        match self {
            Inspect::Cluster(client) => Ok(client.actors()?),
            Inspect::Session(s) => Ok(ask(s, rq::ListActors)?),
        }
    }

    /// Queued and running tasks, and counts by function.
    pub fn tasks(&self) -> anyhow::Result<TaskTable> {
        self.request(rq::ListTasks)
    }

    /// Every worker process.
    pub fn workers(&self) -> anyhow::Result<Vec<WorkerSummary>> {
        self.request(rq::ListWorkers)
    }

    fn request<A: Ask>(&self, request: A) -> anyhow::Result<A::Reply> {
        match self {
            Inspect::Cluster(client) => Ok(client.ask(request)?),
            Inspect::Session(s) => Ok(ask(s, request)?),
        }
    }

    /// Every live placement group.
    pub fn placement_groups(&self) -> anyhow::Result<Vec<PlacementGroupState>> {
        match self {
            Inspect::Cluster(client) => Ok(client.placement_groups()?),
            Inspect::Session(s) => Ok(ask(s, rq::ListPlacementGroups)?),
        }
    }

    /// Every submitted job (an embedded session has none).
    pub fn jobs(&self) -> anyhow::Result<Vec<JobInfo>> {
        match self {
            Inspect::Cluster(client) => Ok(client.jobs()?),
            Inspect::Session(_) => Ok(Vec::new()),
        }
    }

    /// The object store of every live node.
    pub fn objects(&self) -> anyhow::Result<Vec<NodeMemory>> {
        match self {
            Inspect::Cluster(client) => Ok(client.objects()?),
            Inspect::Session(s) => Ok(vec![rtrun::session::node_memory(s)?]),
        }
    }

    /// Kills the live actor named `name` in `namespace` (restarting it if `restart`).
    pub fn kill_actor(
        &self,
        name: &str,
        namespace: &str,
        restart: bool,
    ) -> anyhow::Result<ActorInfo> {
        match self {
            Inspect::Cluster(client) => Ok(client.kill_actor(name, namespace, restart)?),
            Inspect::Session(s) => {
                let lookup =
                    rq::GetActorByName { name: name.to_owned(), namespace: namespace.to_owned() };
                let info = ask(s, lookup)?;
                ask(s, rq::KillActor { actor: info.id, no_restart: !restart })?;
                Ok(info)
            }
        }
    }
}
