//! Endpoint addresses and where they route.
//!
//! An address is `unix:@name` (an abstract Unix socket on this host) or
//! `quic://ip:port/node/name` (a process of a cluster: its node's QUIC endpoint, its node id and
//! its socket name on that node).

use std::net::SocketAddr as NetAddr;

use crate::error::{Error, Result};
use rtrun_object_store::HolderId;

use crate::ids::WorkerId;

/// An endpoint address: `unix:@name` or `quic://ip:port/node/name`.
pub type Address = String;

/// Where an address is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// An abstract Unix socket name on this host.
    Unix(String),
    /// A cluster process: its QUIC endpoint, node and socket name.
    Quic {
        /// Its endpoint.
        addr: NetAddr,
        /// Its node.
        node: u64,
        /// Its abstract socket name.
        name: String,
    },
}

impl Route {
    /// Parses an address (see the module docs).
    pub fn parse(address: &str) -> Result<Route> {
        if let Some(name) = address.strip_prefix("unix:@") {
            return Ok(Route::Unix(name.to_owned()));
        }
        let bad = |why: &str| {
            Error::Invalid(format!(
                "expected an address unix:@name or quic://ip:port/node/name, found `{address}` ({why})"
            ))
        };
        let rest = address.strip_prefix("quic://").ok_or_else(|| bad("unknown scheme"))?;
        let mut parts = rest.splitn(3, '/');
        let addr = parts.next().unwrap_or_default();
        let node = parts.next().ok_or_else(|| bad("no node"))?;
        let name = parts.next().ok_or_else(|| bad("no socket name"))?;
        let addr: NetAddr = addr.parse().map_err(|_| bad("bad ip:port"))?;
        let node = node.parse().map_err(|_| bad("bad node id"))?;
        if name.is_empty() || name.contains('/') {
            return Err(bad("bad socket name"));
        }
        Ok(Route::Quic { addr, node, name: name.to_owned() })
    }

    /// The cluster address of a process.
    pub fn quic(addr: NetAddr, node: u64, name: &str) -> Address {
        format!("quic://{addr}/{node}/{name}")
    }

    /// The abstract socket name.
    pub fn socket_name(&self) -> &str {
        match self {
            Route::Unix(name) | Route::Quic { name, .. } => name,
        }
    }
}

/// The abstract socket name of `worker` in `session`.
pub fn socket_name(session: &str, worker: WorkerId) -> String {
    format!("rtrun-{session}-{}", worker.0)
}

/// The endpoint address of `worker` in an embedded `session`.
pub fn worker_address(session: &str, worker: WorkerId) -> Address {
    format!("unix:@{}", socket_name(session, worker))
}

/// The store identity of a worker (the driver is worker 0).
pub fn holder_of(worker: WorkerId) -> HolderId {
    HolderId(worker.0)
}

/// The holder behind a session endpoint address (`unix:@rtrun-<session>-<worker>`).
pub fn holder_of_address(address: &str) -> Option<HolderId> {
    let (_, worker) = address.rsplit_once('-')?;
    worker.parse().ok().map(HolderId)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_are_parsed_from_session_addresses() {
        assert_eq!(holder_of_address("unix:@rtrun-00ab-17"), Some(HolderId(17)));
        assert_eq!(holder_of_address("unix:@rtrun-cli"), None);
        assert_eq!(holder_of(WorkerId(3)), HolderId(3));
    }
}
