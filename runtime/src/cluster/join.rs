//! `rtrun join`: a node daemon joins the cluster; and what every joining process shares — its
//! credentials (loaded, or bootstrapped from the head with the join token) and its connection
//! to the head.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rtrun_net::{CredentialsDir, EndpointOptions, JoinToken};

use super::binaries::BinaryCache;
use super::member::close_connections_at_exit;
use super::protocol::encode_request;
use super::{
    LateSource, Member, NetReply, NetRequest, connect_timeout, head_unreachable, local_ip_towards,
    net_config, net_error, net_runtime, node, resolve,
};
use crate::error::{Error, Result};
use crate::runtime::{Config, Runtime};
use crate::transport::{NetLink, Route};

/// Options of `rtrun join`.
#[derive(Debug, Clone)]
pub struct JoinOptions {
    /// The head's `host:port`.
    pub address: String,
    /// The join token (flag); else `RTRUN_TOKEN`, else the credentials directory's token file.
    pub token: Option<String>,
    /// This node's name (its certificate's name when bootstrapping).
    pub node_name: String,
    /// Credentials directory (bootstrapped with the token when empty).
    pub credentials_dir: PathBuf,
    /// Job binaries and worker logs go under here.
    pub data_dir: PathBuf,
    /// The node's resources and store.
    pub config: Config,
    /// The IP to bind and advertise (default: the one that routes to the head).
    pub bind_ip: Option<IpAddr>,
}

/// How a process without credentials of its own gets them.
pub(super) enum Bootstrap {
    /// A node: a certificate with the node validity, saved in the credentials directory.
    SaveNode,
    /// A driver or client: a certificate valid this long, kept in memory only.
    InMemory(Duration),
}

/// Loads the credentials in `dir`, or bootstraps them from the head with the token, within
/// `timeout` in all.
pub(super) fn credentials(
    dir: &Path,
    token: Option<&str>,
    node_name: &str,
    head: SocketAddr,
    bootstrap: Bootstrap,
    timeout: Duration,
) -> Result<rtrun_net::NodeCredentials> {
    let credentials_dir = CredentialsDir::new(dir);
    if dir.join("node.pem").exists() {
        return credentials_dir.load_node().map_err(net_error("loading credentials"));
    }
    let token = JoinToken::resolve(token, Some(&credentials_dir.token_path()))
        .map_err(net_error("the join token"))?;
    let validity = match bootstrap {
        Bootstrap::SaveNode => None,
        Bootstrap::InMemory(validity) => Some(validity),
    };
    let net = net_runtime()?;
    let name = node_name.to_owned();
    // Retried on a timeout like every handshake (see `transport::connect_with_retries`), all
    // within `timeout`; the head signs a fresh request each time, so a retry after a lost
    // answer is harmless.
    let node = net
        .block_on(async move {
            let attempts = async {
                let mut attempt = 1;
                loop {
                    let config = net_config();
                    match rtrun_net::bootstrap_with_validity(head, &token, &name, validity, &config)
                        .await
                    {
                        Err(rtrun_net::NetError::Timeout { .. }) if attempt < 3 => {
                            tracing::warn!(%head, attempt, "bootstrap timed out; trying again");
                            attempt += 1;
                        }
                        result => return result,
                    }
                }
            };
            tokio::time::timeout(timeout, attempts).await
        })
        .map_err(|_| head_unreachable(head, timeout))?
        .map_err(net_error(&format!("bootstrapping credentials with the head at {head}")))?;
    if matches!(bootstrap, Bootstrap::SaveNode) {
        credentials_dir.save_node(&node).map_err(net_error("saving credentials"))?;
    }
    Ok(node)
}

/// A joined process's network side, before its runtime exists.
pub(super) struct Joining {
    pub(super) link: Arc<NetLink>,
    pub(super) control: rtrun_net::Connection,
    pub(super) net: Arc<tokio::runtime::Runtime>,
    pub(super) bind_ip: IpAddr,
    pub(super) endpoint: SocketAddr,
}

pub(super) fn connect_to_head(
    head: SocketAddr,
    node: rtrun_net::NodeCredentials,
    bind_ip: Option<IpAddr>,
    object_source: Option<Arc<dyn rtrun_net::ObjectSource>>,
    timeout: Duration,
) -> Result<Joining> {
    let net = net_runtime()?;
    let bind_ip = bind_ip.unwrap_or_else(|| local_ip_towards(head));
    let endpoint = {
        let _guard = net.enter();
        rtrun_net::Endpoint::bind(
            SocketAddr::new(bind_ip, 0),
            node,
            EndpointOptions { object_source, config: net_config(), ..EndpointOptions::default() },
        )
        .map_err(net_error("binding this process's endpoint"))?
    };
    let local = endpoint.local_addr().map_err(net_error("binding this process's endpoint"))?;
    let link = Arc::new(NetLink {
        node: u64::MAX.into(),
        endpoint,
        handle: net.handle().clone(),
        requests: OnceLock::new(),
    });
    let connect_link = link.clone();
    let control = link
        .wait(async move {
            let connect =
                crate::transport::connect_with_retries(&connect_link.endpoint, head, true);
            tokio::time::timeout(timeout, connect).await
        })?
        .map_err(|_| head_unreachable(head, timeout))?
        .map_err(net_error(&format!("connecting to the head at {head}")))?;
    Ok(Joining { link, control, net, bind_ip, endpoint: local })
}

/// Starts a node daemon in this process and returns once it has joined.
pub fn start_node(options: JoinOptions) -> Result<Arc<Runtime>> {
    let head = resolve(&options.address)?;
    let timeout = connect_timeout(&options.config)?;
    let node = credentials(
        &options.credentials_dir,
        options.token.as_deref(),
        &options.node_name,
        head,
        Bootstrap::SaveNode,
        timeout,
    )?;
    let resources = crate::head::config::node_resources(&options.config, "joining")?;
    let source: Arc<OnceLock<Arc<dyn rtrun_net::ObjectSource>>> = Arc::new(OnceLock::new());
    let source_for_endpoint: Arc<dyn rtrun_net::ObjectSource> =
        Arc::new(LateSource(source.clone()));
    let joining = connect_to_head(head, node, options.bind_ip, Some(source_for_endpoint), timeout)?;
    let control = joining.control.clone();
    let request = encode_request(&NetRequest::JoinNode { resources, endpoint: joining.endpoint })?;
    let frame = joining
        .link
        .wait(async move { control.request(request, Vec::new()).await })?
        .map_err(net_error("joining the cluster"))?;
    let NetReply::Joined { session, worker, node: node_id, head: head_address, reconnect_ms } =
        crate::codec::decode(&frame.head)?
    else {
        return Err(Error::Transport("unexpected answer to a join".into()));
    };
    let link = joining.link.clone();
    link.node.store(node_id, std::sync::atomic::Ordering::Release);
    let address =
        Route::quic(joining.endpoint, node_id, &crate::runtime::socket_name(&session, worker));
    let heartbeats = {
        let _guard = joining.net.enter();
        joining.control.start_heartbeats()
    };
    let member = Member::new(
        link.clone(),
        Some(joining.control),
        Some(heartbeats),
        joining.bind_ip,
        Some(address.clone()),
        options.credentials_dir.clone(),
        joining.net,
    );
    member.install().set_reconnect_window(reconnect_ms.map(Duration::from_millis));
    let cache = Arc::new(BinaryCache::open(options.data_dir.join("binaries"))?);
    let log_dir = options.data_dir.join("logs");
    std::fs::create_dir_all(&log_dir)
        .map_err(|e| Error::System(format!("cannot create {}: {e}", log_dir.display())))?;
    let runtime = Runtime::start_cluster_node(
        &options.config,
        session,
        worker,
        node_id,
        address,
        head_address,
        node::NodeAgentConfig { binaries: cache, log_dir },
    )?;
    let _ = source.set(runtime.store_client()?.object_source()?);
    // The head hears a stopping node's last answers and its leaving at once.
    close_connections_at_exit();
    Ok(runtime)
}
