//! Drivers and command-line clients of a cluster: joining with a short-lived certificate, the
//! driver's binary uploaded to the head's content-addressed cache.

use std::sync::Arc;
use std::time::Duration;

use super::join::{Bootstrap, connect_to_head, credentials};
use super::member::{close_connections_at_exit, upload_binary};
use super::{
    JOB_ENV, Member, NetReply, NetRequest, binaries, client, connect_timeout, control_request,
    default_credentials_dir, resolve,
};
use crate::error::{Error, Result};
use crate::runtime::{Config, Runtime};
use crate::transport::Route;

/// How long the certificate of a token-only command-line client is valid: it lives for one
/// command, and is never written to disk.
const CLIENT_CERTIFICATE_VALIDITY: Duration = Duration::from_secs(3600);
/// How long the certificate of a token-only driver is valid: one job; a driver that must run
/// longer uses a credentials directory (a node certificate).
const DRIVER_CERTIFICATE_VALIDITY: Duration = Duration::from_secs(7 * 24 * 3600);

/// Joins the cluster at `address` as a driver (`init` with an address) or a command-line
/// client (`binary: false`).
pub(crate) fn start_driver(config: &Config, address: &str, binary: bool) -> Result<Arc<Runtime>> {
    let head = resolve(address)?;
    let timeout = connect_timeout(config)?;
    let dir = config.credentials_dir.clone().unwrap_or_else(default_credentials_dir);
    // A driver or client with only a token gets a short-lived certificate of its own, kept in
    // memory: nothing that grants access to the cluster outlives the process.
    let validity = if binary { DRIVER_CERTIFICATE_VALIDITY } else { CLIENT_CERTIFICATE_VALIDITY };
    // Unique in the cluster: the head watches drivers' heartbeats by this name.
    let name = format!("driver-{}-{:08x}", std::process::id(), crate::runtime::random_u64() as u32);
    let node = credentials(
        &dir,
        config.token.as_deref(),
        &name,
        head,
        Bootstrap::InMemory(validity),
        timeout,
    )?;
    let joining = connect_to_head(head, node, None, None, timeout)?;
    let endpoint = joining.endpoint;
    // A driver's heartbeats let the head notice it died within the heartbeat timeout.
    let heartbeats = binary.then(|| {
        let _guard = joining.net.enter();
        joining.control.start_heartbeats()
    });
    let member = Member::new(
        joining.link,
        Some(joining.control),
        heartbeats,
        joining.bind_ip,
        None,
        dir,
        joining.net,
    );
    let digest = if binary {
        let exe = std::env::current_exe()
            .map_err(|e| Error::System(format!("cannot find this executable: {e}")))?;
        let digest = binaries::digest_file(&exe)?;
        upload_binary(&member, &exe, &digest)?;
        Some(digest)
    } else {
        None
    };
    // A driver the head started for `rtrun submit` says which job it is.
    let job = std::env::var(JOB_ENV).ok().and_then(|job| job.parse().ok()).filter(|_| binary);
    let (reply, _) = control_request(
        &member,
        NetRequest::JoinDriver { binary: digest.clone(), endpoint, job, resume: None },
        Vec::new(),
    )?;
    let NetReply::Joined { session, worker, node: node_id, head: head_address, reconnect_ms } =
        reply
    else {
        return Err(Error::Transport("unexpected answer to a join".into()));
    };
    member.link.node.store(node_id, std::sync::atomic::Ordering::Release);
    let address = Route::quic(endpoint, node_id, &crate::runtime::socket_name(&session, worker));
    let member = member.install();
    // A driver, or a client following a job's log, reconnects to a head that restarts.
    if let Some(digest) = digest {
        member.set_driver_binary(digest);
    }
    member.set_reconnect_window(reconnect_ms.map(Duration::from_millis));
    // Peers (the head above all, which ends the job's actors) learn of a normal exit at once;
    // a killed driver is noticed when its heartbeats stop.
    close_connections_at_exit();
    let runtime =
        Runtime::start_cluster_driver(config, session, worker, node_id, address, head_address)?;
    if binary {
        client::stream_actor_output(runtime.clone());
    }
    Ok(runtime)
}
