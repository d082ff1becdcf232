//! What this process is in its session, with what that role holds ([`ProcessRole`], built
//! once as the process starts), and how its part in the session ends ([`Ending`]).

use std::sync::{Arc, OnceLock};

use super::Runtime;
use crate::cluster::node::NodeAgent;
use crate::error::{Error, Result};
use crate::head::Head;
use crate::store::StoreClient;
use crate::transport::Connection;
use crate::worker::{HostedActor, TaskExecutor};

/// The exit code of a process that lost its cluster head, or that the head declared dead
/// (`EX_TEMPFAIL` of sysexits.h: restarting it later may succeed; a restarted `rtrun join`
/// joins as a new node).
pub const EXIT_HEAD_LOST: i32 = 75;

/// What a process is in its session, with the parts that role needs. Each start function of
/// `start.rs` builds one and installs it once, before the runtime is published; it never
/// changes after.
pub(crate) enum ProcessRole {
    /// The driver of an embedded session, or `rtrun head`: the control plane and the node's
    /// object store.
    ControlPlane {
        /// The control plane.
        head: Arc<Head>,
        /// The node's store, opened here.
        store: Arc<StoreClient>,
    },
    /// `rtrun join`: the node's store and its workers, under a remote head.
    NodeDaemon {
        /// The connection to the head.
        head: HeadLink,
        /// The node's store, opened here.
        store: Arc<StoreClient>,
        /// The node's worker supervision.
        agent: Arc<NodeAgent>,
    },
    /// A driver or command-line client of a cluster: no store of its own.
    ClusterDriver {
        /// The connection to the head.
        head: HeadLink,
    },
    /// A worker process, of an embedded session or of a cluster.
    Worker(WorkerRole),
}

/// What a worker process holds.
pub(crate) struct WorkerRole {
    /// The connection to the control plane.
    pub(super) head: HeadLink,
    /// A cluster worker's connection to its node daemon (its store operations go there).
    pub(super) node: Option<Arc<Connection>>,
    /// Its access to the node's store (attached through the inherited arena).
    pub(super) store: Option<Arc<StoreClient>>,
    /// The actor it hosts, once constructed (its assignment says whether it hosts one).
    pub(crate) hosted: OnceLock<Arc<dyn HostedActor>>,
    /// Its task executor, started by the first task.
    pub(crate) tasks: OnceLock<Arc<TaskExecutor>>,
}

impl WorkerRole {
    pub(super) fn new(
        head: Arc<Connection>,
        node: Option<Arc<Connection>>,
        store: Option<Arc<StoreClient>>,
    ) -> WorkerRole {
        WorkerRole {
            head: HeadLink::new(head),
            node,
            store,
            hosted: OnceLock::new(),
            tasks: OnceLock::new(),
        }
    }
}

/// The connection to a remote control plane: replaced when the process reconnects to a head
/// that restarted on its state directory.
pub(crate) struct HeadLink(parking_lot::RwLock<Arc<Connection>>);

impl HeadLink {
    pub(crate) fn new(conn: Arc<Connection>) -> HeadLink {
        HeadLink(parking_lot::RwLock::new(conn))
    }

    pub(crate) fn get(&self) -> Arc<Connection> {
        self.0.read().clone()
    }

    pub(crate) fn replace(&self, conn: Arc<Connection>) {
        *self.0.write() = conn;
    }
}

/// Why this process's part in its session ends; the process's main turns it into its exit
/// code. Request handlers and connection threads report it (`Runtime::end`) and never exit
/// themselves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// An operator stopped the cluster, or (for a worker) its embedded session ended: exit 0.
    Stopped,
    /// The control plane is gone for this process, or declared it dead; the message says
    /// which and what was done. Exit [`EXIT_HEAD_LOST`].
    HeadLost(String),
    /// A worker could not start (the message says why): exit 3.
    StartFailed(String),
}

impl Ending {
    /// The process's exit code.
    pub fn code(&self) -> i32 {
        match self {
            Ending::Stopped => 0,
            Ending::HeadLost(_) => EXIT_HEAD_LOST,
            Ending::StartFailed(_) => 3,
        }
    }

    /// Says why (printed, not only logged: the process may have no log subscriber) and ends
    /// the process with [`Ending::code`]. The one exit of the library: called by the mains
    /// that wait for their process's ending (`rtrun head`, `rtrun join`, a worker's entry
    /// point), and by `Runtime::end` in a cluster driver, whose main is the user's.
    pub fn exit(self) -> ! {
        if let Ending::HeadLost(message) | Ending::StartFailed(message) = &self {
            eprintln!("{message}");
        }
        std::process::exit(self.code())
    }
}

/// Where a process's ending is recorded (the first report wins) and waited for.
#[derive(Default)]
pub(super) struct EndSignal {
    ending: parking_lot::Mutex<Option<Ending>>,
    ended: parking_lot::Condvar,
}

impl EndSignal {
    /// Records `ending` unless one was; whether it was the first.
    fn report(&self, ending: Ending) -> bool {
        let mut slot = self.ending.lock();
        if slot.is_some() {
            return false;
        }
        *slot = Some(ending);
        drop(slot);
        self.ended.notify_all();
        true
    }

    fn get(&self) -> Option<Ending> {
        self.ending.lock().clone()
    }

    fn wait(&self) -> Ending {
        let mut slot = self.ending.lock();
        loop {
            if let Some(ending) = slot.as_ref() {
                return ending.clone();
            }
            self.ended.wait(&mut slot);
        }
    }
}

impl Runtime {
    /// This process's role; `None` only while it starts.
    pub(crate) fn role(&self) -> Option<&ProcessRole> {
        self.role.get()
    }

    /// Installs the role once; the start functions call it before publishing the runtime.
    pub(super) fn install_role(&self, role: ProcessRole) -> Result<()> {
        self.role
            .set(role)
            .map_err(|_| Error::System("this process's runtime was started twice".into()))
    }

    /// The control plane, in the process that holds it (an embedded driver, a cluster head).
    pub(crate) fn head(&self) -> Option<&Arc<Head>> {
        match self.role()? {
            ProcessRole::ControlPlane { head, .. } => Some(head),
            _ => None,
        }
    }

    /// The link to a remote control plane.
    pub(crate) fn head_link(&self) -> Option<&HeadLink> {
        match self.role()? {
            ProcessRole::NodeDaemon { head, .. } | ProcessRole::ClusterDriver { head } => {
                Some(head)
            }
            ProcessRole::Worker(worker) => Some(&worker.head),
            ProcessRole::ControlPlane { .. } => None,
        }
    }

    /// The connection to a remote control plane.
    pub(super) fn head_connection(&self) -> Option<Arc<Connection>> {
        self.head_link().map(HeadLink::get)
    }

    /// A node daemon's worker supervision.
    pub(super) fn node_agent(&self) -> Option<&Arc<NodeAgent>> {
        match self.role()? {
            ProcessRole::NodeDaemon { agent, .. } => Some(agent),
            _ => None,
        }
    }

    /// This process's access to the node's object store, if it has one.
    pub(crate) fn store(&self) -> Option<&Arc<StoreClient>> {
        match self.role()? {
            ProcessRole::ControlPlane { store, .. } | ProcessRole::NodeDaemon { store, .. } => {
                Some(store)
            }
            ProcessRole::Worker(worker) => worker.store.as_ref(),
            ProcessRole::ClusterDriver { .. } => None,
        }
    }

    /// What a worker process holds (`None` in any other process).
    pub(crate) fn worker(&self) -> Option<&WorkerRole> {
        match self.role()? {
            ProcessRole::Worker(worker) => Some(worker),
            _ => None,
        }
    }

    /// The actor this worker hosts, once constructed.
    pub(crate) fn hosted(&self) -> Option<&Arc<dyn HostedActor>> {
        self.worker()?.hosted.get()
    }

    /// This worker's task executor, once started.
    pub(crate) fn tasks(&self) -> Option<&Arc<TaskExecutor>> {
        self.worker()?.tasks.get()
    }

    /// Records how this process's part in the session ends (the first report wins) and wakes
    /// its main ([`Runtime::wait_for_end`]). A cluster driver's main is the user's and does not
    /// wait: it ends here, before the failed request that found the head gone can make its
    /// caller exit with another code.
    pub(crate) fn end(&self, ending: Ending) {
        if self.ended.report(ending.clone())
            && matches!(self.role(), Some(ProcessRole::ClusterDriver { .. }))
        {
            ending.exit();
        }
    }

    /// How this process's part in the session ended, if it has.
    pub(crate) fn ended(&self) -> Option<Ending> {
        self.ended.get()
    }

    /// Blocks until this process's part in the session ends; what a process main (`rtrun
    /// head`, `rtrun join`, a worker) waits for before it exits with [`Ending::code`].
    pub fn wait_for_end(&self) -> Ending {
        self.ended.wait()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_ending_wins_and_wakes_the_waiting_main() {
        let signal = Arc::new(EndSignal::default());
        let main = {
            let signal = signal.clone();
            std::thread::spawn(move || signal.wait())
        };
        assert_eq!(signal.get(), None);
        assert!(signal.report(Ending::HeadLost("lost".into())));
        // A later report (the head's connection closing after `StopNode`) changes nothing.
        assert!(!signal.report(Ending::Stopped));
        let ending = main.join().unwrap();
        assert_eq!(ending, Ending::HeadLost("lost".into()));
        assert_eq!(ending.code(), EXIT_HEAD_LOST);
        assert_eq!(signal.wait(), ending, "an ending, once reported, is what every waiter sees");
        assert_eq!(Ending::Stopped.code(), 0);
        assert_eq!(Ending::StartFailed("x".into()).code(), 3);
    }
}
