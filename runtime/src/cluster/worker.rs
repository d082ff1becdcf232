//! A worker process of a cluster: its endpoint, with its node's credentials, set up from the
//! environment its node daemon gave it.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, OnceLock};

use rtrun_net::{CredentialsDir, EndpointOptions};

use super::{Member, NODE_ENV, default_credentials_dir, net_config, net_error, net_runtime};
use crate::error::{Error, Result};
use crate::protocol::Address;
use crate::transport::{NetLink, Route};

/// Sets up a worker of a cluster (its environment has [`NODE_ENV`]): its endpoint with its
/// node's credentials; returns its node id, node daemon address and QUIC address for `name`.
pub(crate) fn start_worker_link(name: &str) -> Result<Option<(u64, Address, Address)>> {
    let Ok(value) = std::env::var(NODE_ENV) else { return Ok(None) };
    let mut parts = value.splitn(3, ';');
    let bad = || Error::Invalid(format!("{NODE_ENV} must be `node;address;ip`, found `{value}`"));
    let node: u64 = parts.next().and_then(|n| n.parse().ok()).ok_or_else(bad)?;
    let node_address = parts.next().ok_or_else(bad)?.to_owned();
    let bind_ip: IpAddr = parts.next().and_then(|ip| ip.parse().ok()).ok_or_else(bad)?;
    let dir = default_credentials_dir();
    let credentials =
        CredentialsDir::new(&dir).load_node().map_err(net_error("loading credentials"))?;
    let net = net_runtime()?;
    let endpoint = {
        let _guard = net.enter();
        rtrun_net::Endpoint::bind(
            SocketAddr::new(bind_ip, 0),
            credentials,
            EndpointOptions { config: net_config(), ..EndpointOptions::default() },
        )
        .map_err(net_error("binding this worker's endpoint"))?
    };
    let local = endpoint.local_addr().map_err(net_error("binding this worker's endpoint"))?;
    let link = Arc::new(NetLink {
        node: node.into(),
        endpoint,
        handle: net.handle().clone(),
        requests: OnceLock::new(),
    });
    let member = Member::new(link, None, None, bind_ip, Some(node_address.clone()), dir, net);
    // A worker of a head with a state directory reconnects to it as its node does.
    let window = std::env::var(super::member::RECONNECT_ENV)
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map(std::time::Duration::from_millis);
    member.install().set_reconnect_window(window);
    Ok(Some((node, node_address, Route::quic(local, node, name))))
}
