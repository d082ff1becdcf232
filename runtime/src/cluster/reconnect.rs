//! Reconnecting to a head that restarted on its state directory (`rtrun head --state-dir`):
//! a node daemon, worker or driver that loses such a head keeps running — actors keep their
//! state, calls between processes go on — and tries to reach it again with back-off (100 ms
//! doubling to 1 s) for the reconnect window the head announced when it joined:
//! - a node daemon opens a new control connection, reports the workers it runs
//!   ([`NetRequest::RejoinNode`]) and sends heartbeats again;
//! - a worker registers again under its id, pid and address;
//! - a driver joins again as the same driver (`resume`).
//!
//! Then it replaces its connection to the head. A head that refuses it (it declared the node
//! dead, never knew the worker, counted the driver gone, or answers from another address) or
//! that does not come back within the window ends it as losing a head without a state
//! directory does: the message says why, and a node daemon stops its workers first.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::protocol::encode_request;
use super::{NetReply, NetRequest, member, net_error};
use crate::error::{Error, Result};
use crate::protocol::ask;
use crate::runtime::{ProcessRole, Runtime, To};
use crate::transport::Route;

/// Set while a reconnect runs (one at a time).
static RECONNECTING: AtomicBool = AtomicBool::new(false);

/// The first wait between attempts, and the longest.
const FIRST_DELAY: Duration = Duration::from_millis(100);
const MAX_DELAY: Duration = Duration::from_secs(1);
/// How long one attempt waits for the head's handshake.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// Why an attempt failed.
enum Failed {
    /// The head is not back yet (or the attempt was cut off): try again.
    Retry(String),
    /// The head answered and refused this process.
    Refused(String),
}

/// Starts reconnecting `runtime` to its head, lost because of `lost`, for `window` (unless a
/// reconnect already runs).
pub(crate) fn start(runtime: Arc<Runtime>, window: Duration, lost: String) {
    if RECONNECTING.swap(true, Ordering::AcqRel) {
        return;
    }
    tracing::warn!(
        "lost the connection to the cluster head at {lost}; reconnecting for up to {:.0} s",
        window.as_secs_f64()
    );
    let spawned = std::thread::Builder::new().name("rtrun-reconnect".into()).spawn(move || {
        let started = Instant::now();
        let mut delay = FIRST_DELAY;
        let ending = loop {
            match attempt(&runtime) {
                Ok(()) => {
                    tracing::warn!(
                        seconds = started.elapsed().as_secs_f64(),
                        "reconnected to the restarted cluster head"
                    );
                    break None;
                }
                Err(Failed::Refused(why)) => break Some(format!("the head refused it: {why}")),
                Err(Failed::Retry(why)) if started.elapsed() + delay >= window => {
                    break Some(format!(
                        "it did not come back within {:.0} s (last attempt: {why})",
                        window.as_secs_f64()
                    ));
                }
                Err(Failed::Retry(why)) => {
                    tracing::debug!("the head is not back yet: {why}");
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(MAX_DELAY);
                }
            }
        };
        RECONNECTING.store(false, Ordering::Release);
        if let Some(why) = ending {
            runtime.fail_parked(&why);
            runtime.give_up_on_head(&lost, &why);
        }
    });
    if let Err(e) = spawned {
        RECONNECTING.store(false, Ordering::Release);
        tracing::error!("cannot start reconnecting to the head: {e}");
    }
}

/// One attempt: reach the head, register again as what this process is, and use the new
/// connection.
fn attempt(runtime: &Arc<Runtime>) -> std::result::Result<(), Failed> {
    let refused = |e: Error| Failed::Refused(e.to_string());
    let member = member().ok_or_else(|| Failed::Refused("not part of a cluster".into()))?;
    let head = runtime
        .endpoint()
        .head_address()
        .cloned()
        .ok_or_else(|| Failed::Refused("no head address".into()))?;
    let Ok(Route::Quic { addr, .. }) = Route::parse(&head) else {
        return Err(Failed::Refused(format!("the head's address {head} is not a cluster one")));
    };
    let role = runtime.role().ok_or_else(|| Failed::Refused("not started".into()))?;
    let request = match role {
        ProcessRole::NodeDaemon { agent, .. } => Some(NetRequest::RejoinNode {
            node: runtime.node_id.0,
            workers: agent.children(),
            endpoint: local_endpoint(member)?,
        }),
        ProcessRole::ClusterDriver { .. } => Some(NetRequest::JoinDriver {
            binary: member.driver_binary(),
            endpoint: local_endpoint(member)?,
            job: None,
            resume: Some(runtime.worker_id),
        }),
        ProcessRole::Worker(_) => None,
        ProcessRole::ControlPlane { .. } => return Ok(()),
    };
    if let Some(request) = request {
        let link = member.link.clone();
        let control = member
            .link
            .wait(async move {
                let connect = crate::transport::connect_with_retries(&link.endpoint, addr, true);
                tokio::time::timeout(ATTEMPT_TIMEOUT, connect).await
            })
            .map_err(|e| Failed::Retry(e.to_string()))?
            .map_err(|_| Failed::Retry(format!("no answer from {addr}")))?
            .map_err(|e| Failed::Retry(net_error("connecting")(e).to_string()))?;
        let body = encode_request(&request).map_err(refused)?;
        let asking = control.clone();
        let frame = member
            .link
            .wait(async move {
                tokio::time::timeout(ATTEMPT_TIMEOUT, asking.request(body, Vec::new())).await
            })
            .map_err(|e| Failed::Retry(e.to_string()))?
            .map_err(|_| Failed::Retry(format!("{addr} did not answer the reconnect")))?
            .map_err(|e| match e {
                rtrun_net::NetError::Remote { message, .. } => Failed::Refused(message),
                e => Failed::Retry(e.to_string()),
            })?;
        let reply: NetReply = crate::codec::decode(&frame.head).map_err(refused)?;
        let answered = match reply {
            NetReply::Rejoined { head, .. } | NetReply::Joined { head, .. } => head,
            other => return Err(Failed::Refused(format!("unexpected answer {other:?}"))),
        };
        if answered != head {
            return Err(Failed::Refused(format!(
                "the head at {addr} restarted as {answered}, not as the {head} this process \
                 joined (another session: it was restarted without this cluster's --state-dir)"
            )));
        }
        let heartbeats = member.sends_heartbeats().then(|| {
            let _guard = member.link.handle.enter();
            control.start_heartbeats()
        });
        member.replace_control(control, heartbeats);
    }
    let conn = runtime.endpoint().connect_head(&head).map_err(|e| Failed::Retry(e.to_string()))?;
    if let ProcessRole::Worker(_) = role {
        let registration = ask::RegisterWorker {
            worker: runtime.worker_id,
            address: runtime.address().clone(),
            pid: std::process::id(),
        };
        match ask_on(runtime, &conn, registration) {
            Ok(_) => {}
            Err(Error::Transport(why)) => return Err(Failed::Retry(why)),
            Err(e) => return Err(refused(e)),
        }
    }
    if let Some(link) = runtime.head_link() {
        link.replace(conn.clone());
    }
    runtime.resend_parked(&conn);
    Ok(())
}

/// This process's QUIC endpoint address.
fn local_endpoint(member: &super::Member) -> std::result::Result<std::net::SocketAddr, Failed> {
    member.link.endpoint.local_addr().map_err(|e| Failed::Refused(e.to_string()))
}

/// Sends `request` on `conn` and waits for its answer, at most [`ATTEMPT_TIMEOUT`]
/// (`Runtime::ask` waits without a bound, which would let a head that accepts and never answers
/// hold the reconnect past its window).
fn ask_on<A: crate::protocol::Ask>(
    runtime: &Arc<Runtime>,
    conn: &Arc<crate::transport::Connection>,
    request: A,
) -> Result<A::Reply> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    runtime.send(To::Peer(conn), request, move |answer| {
        let _ = tx.send(answer);
    });
    rx.recv_timeout(ATTEMPT_TIMEOUT)
        .unwrap_or_else(|_| Err(Error::Transport("the head did not answer".into())))
}
