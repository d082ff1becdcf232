//! Multi-node clusters: `rtrun head`, `rtrun join`, drivers that `init` with an address, and
//! workers of a cluster.
//!
//! Every process of a cluster has a QUIC endpoint (`rtrun-net`: mutual TLS with the cluster
//! CA, then the join token) next to its abstract Unix socket; its address says both
//! (`quic://ip:port/node/name`, see the runtime's `transport` module). Processes of one node talk over
//! Unix sockets, processes of different nodes over QUIC channels, with the same frames, so
//! actor calls and replies go straight from caller to callee across nodes as on one node.
//!
//! Joining is one `rtrun-net` request to the head (`NetRequest::Join`) answered with the
//! session, the process's id and its node id; then the process opens its runtime connection to
//! the head like any worker. Node daemons and drivers also send heartbeats on that first
//! connection; the head's monitor declares a node dead (or a driver gone, with its actors and
//! groups) after `heartbeat_timeout` of silence. Job binaries move
//! as `rtrun-net` requests too, content-addressed ([`binaries`]).

pub mod binaries;
pub mod client;
pub(crate) mod driver;
mod head;
mod join;
mod member;
pub(crate) mod node;
pub(crate) mod protocol;
mod pull;
pub(crate) mod reconnect;
mod worker;
pub mod working_dir;

pub use client::Client;
pub(crate) use driver::start_driver;
pub use head::{DEFAULT_RECONNECT_WINDOW, HeadHandle, HeadOptions, start_head};
pub use join::{JoinOptions, start_node};
pub(crate) use member::{Member, control_request, exiting, member, node_env, upload_bytes};
use protocol::net_error;
pub(crate) use protocol::{NetReply, NetRequest, NetService};
pub(crate) use pull::{pull_into_node, pull_to_memory};
pub(crate) use worker::start_worker_link;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use rtrun_net::NetConfig;

use crate::error::{Error, Result};
use crate::runtime::Config;

/// The head address a driver connects to (`host:port`); `init()` joins that cluster instead of
/// starting an embedded one.
pub const ADDRESS_ENV: &str = "RTRUN_ADDRESS";
pub use rtrun_proto::env::JOB_ENV;
/// Environment variable the head sets for a submitted job's driver that has a working
/// directory: where it was unpacked (the driver's current directory).
pub const WORKING_DIR_ENV: &str = "RTRUN_WORKING_DIR";
/// The credentials directory of a cluster process.
pub const CREDENTIALS_ENV: &str = "RTRUN_CREDENTIALS_DIR";
/// Set in workers of a cluster: `<node id>;<node daemon address>;<bind ip>`.
pub(crate) const NODE_ENV: &str = "RTRUN_NODE";
/// Seconds a process joining a cluster waits for the head (see [`Config::connect_timeout`]).
pub const CONNECT_TIMEOUT_ENV: &str = "RTRUN_CONNECT_TIMEOUT";
/// How long joining a cluster waits for the head by default: a live head on a LAN answers a
/// QUIC handshake in milliseconds, so a few seconds is a generous bound for a dead one.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The connect timeout of `config`: its field, else [`CONNECT_TIMEOUT_ENV`], else the default.
pub(super) fn connect_timeout(config: &Config) -> Result<Duration> {
    if let Some(timeout) = config.connect_timeout {
        return Ok(timeout);
    }
    match std::env::var(CONNECT_TIMEOUT_ENV) {
        Ok(value) if !value.trim().is_empty() => value
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "{CONNECT_TIMEOUT_ENV}: expected a positive number of seconds, found `{value}`"
                ))
            }),
        _ => Ok(DEFAULT_CONNECT_TIMEOUT),
    }
}

/// The error for a head that did not answer within `timeout`.
pub(super) fn head_unreachable(head: SocketAddr, timeout: Duration) -> Error {
    Error::Transport(format!(
        "cannot reach the cluster head at {head}: no answer within {:.1} s (is `rtrun head` \
         running there and is UDP port {} reachable? --connect-timeout or {CONNECT_TIMEOUT_ENV} \
         waits longer)",
        timeout.as_secs_f64(),
        head.port()
    ))
}

/// The default credentials directory: `$RTRUN_CREDENTIALS_DIR`, else `~/.rtrun/credentials`.
pub fn default_credentials_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(CREDENTIALS_ENV) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".rtrun").join("credentials")
}

/// The idle timeout of connections with the head (see [`net_config`]).
pub(super) const HEAD_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// The network settings of cluster processes: `rtrun-net`'s defaults with a 10 s idle timeout
/// (2 s keep-alives), so that a peer process killed without closing its connections (a worker
/// of a dead node, a SIGKILLed driver) is noticed within seconds by those connected to it —
/// except on connections with the head, which stay up through 30 s of silence: a head paused
/// for 10 s (its failure detector then suspends judgement) must not lose every node, and a
/// killed head is noticed by its nodes within those 30 s (Ray's raylets wait 60 s for theirs).
pub(super) fn net_config() -> NetConfig {
    NetConfig {
        idle_timeout: Duration::from_secs(10),
        control_idle_timeout: HEAD_IDLE_TIMEOUT,
        keep_alive: Duration::from_secs(2),
        ..NetConfig::default()
    }
}

pub(super) fn net_runtime() -> Result<Arc<tokio::runtime::Runtime>> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("rtrun-net")
        .enable_all()
        .build()
        .map(Arc::new)
        .map_err(|e| Error::System(format!("cannot start the network runtime: {e}")))
}

/// Resolves `host:port` to a socket address.
pub fn resolve(address: &str) -> Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    address
        .to_socket_addrs()
        .map_err(|e| Error::Invalid(format!("cannot resolve head address `{address}`: {e}")))?
        .next()
        .ok_or_else(|| Error::Invalid(format!("head address `{address}` resolves to nothing")))
}

/// The local IP that routes to `peer` (what this process advertises to the cluster).
pub(super) fn local_ip_towards(peer: SocketAddr) -> IpAddr {
    if peer.ip().is_loopback() {
        return peer.ip();
    }
    let probe = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
        .and_then(|socket| socket.connect(peer).map(|()| socket))
        .and_then(|socket| socket.local_addr());
    probe.map(|addr| addr.ip()).unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// An object source installed once the store exists (the endpoint is bound before).
pub(super) struct LateSource(Arc<OnceLock<Arc<dyn rtrun_net::ObjectSource>>>);

impl rtrun_net::ObjectSource for LateSource {
    fn size(&self, object: rtrun_object_store::ObjectId) -> Option<u64> {
        self.0.get().and_then(|source| source.size(object))
    }

    fn read(
        &self,
        object: rtrun_object_store::ObjectId,
        offset: u64,
        len: u64,
    ) -> std::result::Result<Bytes, String> {
        match self.0.get() {
            Some(source) => source.read(object, offset, len),
            None => Err("the node's object store is not open yet".into()),
        }
    }
}
