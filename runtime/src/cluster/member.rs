//! This process's membership in a cluster (its QUIC link, its connection to the head, its
//! credentials), set once when it joins, and the close of its connections at a normal exit.

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;

use super::protocol::{NetReply, NetRequest, encode_request, net_error};
use super::{CREDENTIALS_ENV, NODE_ENV};
use crate::error::{Error, Result};
use crate::protocol::Address;
use crate::transport::NetLink;

/// This process's membership in a cluster.
pub(crate) struct Member {
    /// Its QUIC side.
    pub(crate) link: Arc<NetLink>,
    /// Its connection to the head's endpoint (joins, binaries, a node's heartbeats); replaced
    /// when it reconnects to a restarted head.
    control: parking_lot::Mutex<Option<rtrun_net::Connection>>,
    /// Keeps a node daemon's or driver's heartbeats going.
    heartbeats: parking_lot::Mutex<Option<rtrun_net::HeartbeatSender>>,
    /// How long it reconnects after losing the head (set when a head with a state directory
    /// accepted it; `None`: it ends when it loses the head).
    reconnect_window: OnceLock<Duration>,
    /// A driver's executable digest (it joins again with it).
    driver_binary: OnceLock<String>,
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
            control: parking_lot::Mutex::new(control),
            heartbeats: parking_lot::Mutex::new(heartbeats),
            reconnect_window: OnceLock::new(),
            driver_binary: OnceLock::new(),
            bind_ip,
            node_address,
            credentials_dir,
            _net: net,
            pulls: Default::default(),
        }
    }

    /// The connection to the head's endpoint, if this process has one.
    pub(crate) fn control(&self) -> Option<rtrun_net::Connection> {
        self.control.lock().clone()
    }

    /// Replaces the connection to the head (and its heartbeats) after a reconnect.
    pub(super) fn replace_control(
        &self,
        control: rtrun_net::Connection,
        heartbeats: Option<rtrun_net::HeartbeatSender>,
    ) {
        *self.control.lock() = Some(control);
        *self.heartbeats.lock() = heartbeats;
    }

    /// Whether this process sends heartbeats to the head (a node daemon, a driver).
    pub(super) fn sends_heartbeats(&self) -> bool {
        self.heartbeats.lock().is_some()
    }

    /// Sets how long this process reconnects after losing the head (from the head's answer
    /// to its join, or its node's environment).
    pub(crate) fn set_reconnect_window(&self, window: Option<Duration>) {
        if let Some(window) = window {
            let _ = self.reconnect_window.set(window);
        }
    }

    /// Records a driver's executable digest.
    pub(super) fn set_driver_binary(&self, digest: String) {
        let _ = self.driver_binary.set(digest);
    }

    /// A driver's executable digest.
    pub(super) fn driver_binary(&self) -> Option<String> {
        self.driver_binary.get().cloned()
    }

    /// How long this process reconnects after losing the head (`None`: it ends).
    pub(crate) fn reconnect_window(&self) -> Option<Duration> {
        self.reconnect_window.get().copied()
    }

    /// Makes this the process's membership (once: a process is part of one cluster).
    pub(super) fn install(self) -> &'static Arc<Member> {
        if let Some(address) = &self.node_address {
            crate::store::set_home(address.clone());
        }
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
    let mut env = vec![
        (NODE_ENV.into(), format!("{node};{node_address};{}", member.bind_ip)),
        (CREDENTIALS_ENV.into(), member.credentials_dir.display().to_string()),
    ];
    if let Some(window) = member.reconnect_window() {
        env.push((RECONNECT_ENV.into(), window.as_millis().to_string()));
    }
    env
}

/// Set in workers of a cluster whose head persists its state: how many milliseconds they
/// reconnect after losing it.
pub(crate) const RECONNECT_ENV: &str = "RTRUN_RECONNECT_MS";

/// Set once this process has begun to exit.
static EXITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process is exiting (its connections closing is then no failure).
pub(crate) fn exiting() -> bool {
    EXITING.load(std::sync::atomic::Ordering::Acquire)
}

/// What prints a driver's actors' last output at its exit, waiting at most the given time
/// (set when the driver starts streaming it: `client::stream_actor_output`).
static EXIT_FLUSH: OnceLock<fn(Duration)> = OnceLock::new();

/// Sets [`EXIT_FLUSH`] (once).
pub(crate) fn flush_at_exit(flush: fn(Duration)) {
    let _ = EXIT_FLUSH.set(flush);
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
    if let Some(flush) = EXIT_FLUSH.get() {
        flush(Duration::from_millis(500));
    }
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

/// Sends a request on the control connection.
pub(crate) fn control_request(
    member: &Member,
    request: NetRequest,
    parts: Vec<Bytes>,
) -> Result<(NetReply, Vec<Bytes>)> {
    let control = member
        .control()
        .ok_or_else(|| Error::Invalid("this process has no connection to the head".into()))?;
    let head = encode_request(&request)?;
    let frame = member
        .link
        .wait(async move { control.request(head, parts).await })?
        .map_err(net_error("request to the head"))?;
    let reply: NetReply = crate::codec::decode(&frame.head)?;
    Ok((reply, frame.parts))
}

/// Uploads a job binary unless the head has it.
pub(crate) fn upload_binary(member: &Member, path: &Path, digest: &str) -> Result<()> {
    upload_bytes(member, digest, || {
        std::fs::read(path)
            .map_err(|e| Error::System(format!("cannot read {}: {e}", path.display())))
    })
}

/// Uploads the content `digest` to the head's content-addressed cache unless it is there;
/// `bytes` reads it only when needed.
pub(crate) fn upload_bytes(
    member: &Member,
    digest: &str,
    bytes: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<()> {
    let (reply, _) =
        control_request(member, NetRequest::HasBinary { digest: digest.to_owned() }, Vec::new())?;
    if matches!(reply, NetReply::Present(true)) {
        return Ok(());
    }
    let bytes = bytes()?;
    control_request(
        member,
        NetRequest::UploadBinary { digest: digest.to_owned() },
        vec![Bytes::from(bytes)],
    )?;
    Ok(())
}
