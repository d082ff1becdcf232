//! This process's membership in a cluster (its QUIC link, its connection to the head, its
//! credentials), set once when it joins, and the close of its connections at a normal exit.

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::{CREDENTIALS_ENV, NODE_ENV, client};
use crate::protocol::Address;
use crate::transport::NetLink;

/// This process's membership in a cluster.
pub(crate) struct Member {
    /// Its QUIC side.
    pub(crate) link: Arc<NetLink>,
    /// Its connection to the head's endpoint (joins, binaries, a node's heartbeats).
    pub(crate) control: Option<rtrun_net::Connection>,
    /// Keeps a node daemon's heartbeats going.
    _heartbeats: Option<rtrun_net::HeartbeatSender>,
    /// The IP it binds and advertises.
    pub(crate) bind_ip: IpAddr,
    /// The node daemon's address (store operations go there).
    pub(crate) node_address: Option<Address>,
    /// Its credentials directory.
    pub(crate) credentials_dir: PathBuf,
    /// Keeps the net runtime alive.
    _net: Arc<tokio::runtime::Runtime>,
    /// Connections to other nodes' endpoints for object pulls.
    pub(super) pulls: dashmap::DashMap<SocketAddr, rtrun_net::Connection>,
}

/// The process's membership: with `runtime::CURRENT`, the one process-global (decision 052 says
/// why it is not part of the `ProcessRole`).
static MEMBER: OnceLock<Arc<Member>> = OnceLock::new();

impl Member {
    /// This process's membership: `link` with its connection to the head (`control`, with
    /// `heartbeats` for nodes and drivers), on `net`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        link: Arc<NetLink>,
        control: Option<rtrun_net::Connection>,
        heartbeats: Option<rtrun_net::HeartbeatSender>,
        bind_ip: IpAddr,
        node_address: Option<Address>,
        credentials_dir: PathBuf,
        net: Arc<tokio::runtime::Runtime>,
    ) -> Member {
        Member {
            link,
            control,
            _heartbeats: heartbeats,
            bind_ip,
            node_address,
            credentials_dir,
            _net: net,
            pulls: Default::default(),
        }
    }

    /// Makes this the process's membership (once: a process is part of one cluster).
    pub(super) fn install(self) -> &'static Arc<Member> {
        MEMBER.get_or_init(|| Arc::new(self))
    }
}

/// This process's cluster membership, when it is part of one.
pub(crate) fn member() -> Option<&'static Arc<Member>> {
    MEMBER.get()
}

/// The environment a worker spawned on node `node` (whose daemon is at `node_address`) needs
/// to take part in the cluster.
pub(crate) fn node_env(node: u64, node_address: &str) -> Vec<(String, String)> {
    let Some(member) = member() else { return Vec::new() };
    vec![
        (NODE_ENV.into(), format!("{node};{node_address};{}", member.bind_ip)),
        (CREDENTIALS_ENV.into(), member.credentials_dir.display().to_string()),
    ]
}

/// Set once this process has begun to exit.
static EXITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process is exiting (its connections closing is then no failure).
pub(crate) fn exiting() -> bool {
    EXITING.load(std::sync::atomic::Ordering::Acquire)
}

/// Registers [`close_on_exit`] (a driver, a client, a node daemon).
pub(super) fn close_connections_at_exit() {
    // SAFETY: `atexit` registers a plain `extern "C"` function with no preconditions.
    unsafe {
        libc::atexit(close_on_exit);
    }
}

/// Closes this process's QUIC connections with a close frame when the process exits normally.
extern "C" fn close_on_exit() {
    // A driver's actors are still alive here (its connections close below): their last lines.
    client::flush_actor_output(Duration::from_millis(500));
    EXITING.store(true, std::sync::atomic::Ordering::Release);
    let Some(member) = member() else { return };
    let link = member.link.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    member.link.handle.spawn(async move {
        link.endpoint.close();
        let _ = tokio::time::timeout(Duration::from_millis(300), link.endpoint.wait_idle()).await;
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(Duration::from_millis(500));
}
