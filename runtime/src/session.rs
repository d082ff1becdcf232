//! Finding and querying running sessions from outside them (`rtrun memory`, and `rtrun status`
//! and `rtrun list` against an embedded session: its driver holds the control plane and answers
//! the same state queries a cluster head does).
//!
//! An embedded session has no published address, but every process of it listens on an abstract
//! Unix socket named `@rtrun-<session>-<worker>`, and the node process is worker 0. The kernel
//! lists bound abstract sockets in `/proc/net/unix`, so the running sessions on this machine are
//! the names `@rtrun-<16 hex digits>-0` found there; nothing has to be written to disk (and
//! nothing is left behind when a driver is killed).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::ids::DRIVER_WORKER_ID;
use crate::protocol::{Ask, Frame, NodeMemory, Reply, Response};
use crate::transport::{Connection, Endpoint, FrameHandler, TransportConfig};

/// How long a query waits for the node's answer.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

/// The sessions of this user whose node process is running on this machine, sorted (another
/// user's sessions are neither listed nor reachable: their sockets admit only their user).
pub fn list_sessions() -> Result<Vec<String>> {
    let table = std::fs::read_to_string("/proc/net/unix")
        .map_err(|e| Error::System(format!("cannot read /proc/net/unix: {e}")))?;
    let me = rustix::process::geteuid().as_raw();
    Ok(sessions_in(&table).into_iter().filter(|s| session_owner(s).ok() == Some(me)).collect())
}

/// The user id of the node process of `session`.
fn session_owner(session: &str) -> Result<u32> {
    crate::transport::listener_uid(&crate::runtime::worker_address(session, DRIVER_WORKER_ID))
}

/// Session names of node sockets (`@rtrun-<16 hex>-0`) in a `/proc/net/unix` table.
pub fn sessions_in(table: &str) -> BTreeSet<String> {
    table
        .lines()
        .filter_map(|line| line.split_whitespace().last())
        .filter_map(|path| path.strip_prefix("@rtrun-"))
        .filter_map(|rest| rest.strip_suffix(&format!("-{}", DRIVER_WORKER_ID.0)))
        .filter(|session| session.len() == 16 && session.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(str::to_owned)
        .collect()
}

/// Picks the session to query: `wanted` when given (and running), else the only one running.
pub fn pick_session(wanted: Option<&str>) -> Result<String> {
    let sessions = list_sessions()?;
    match wanted {
        Some(session) if sessions.iter().any(|s| s == session) => Ok(session.to_owned()),
        Some(session) if session_owner(session).is_ok() => Err(Error::Invalid(format!(
            "session `{session}` belongs to another user; yours: {}",
            describe(&sessions)
        ))),
        Some(session) => Err(Error::Invalid(format!(
            "no running session `{session}`; running: {}",
            describe(&sessions)
        ))),
        None => match sessions.as_slice() {
            [only] => Ok(only.clone()),
            [] => Err(Error::Invalid("no rtrun session is running on this machine".into())),
            many => Err(Error::Invalid(format!(
                "{} sessions are running ({}); pick one with --session",
                many.len(),
                describe(many)
            ))),
        },
    }
}

fn describe(sessions: &[String]) -> String {
    if sessions.is_empty() { "none".to_owned() } else { sessions.join(", ") }
}

/// Sends `request` to the node process of `session` (in an embedded session, the driver, which
/// holds the control plane) and returns its answer, typed by the request (see
/// [`Ask`]); an error answer is an `Err`.
pub fn ask<A: Ask>(session: &str, request: A) -> Result<A::Reply> {
    let request = request.into();
    let (tx, rx) = crossbeam_channel::bounded(1);
    let address =
        format!("unix:@rtrun-cli-{}-{:016x}", std::process::id(), crate::runtime::random_u64());
    let endpoint = Endpoint::bind(address, Arc::new(Answer(tx)), TransportConfig::default())?;
    let node = crate::runtime::worker_address(session, DRIVER_WORKER_ID);
    let conn = endpoint.connect(&node)?;
    conn.send(&Frame::Request { req_id: 1, body: request })?;
    let answer = rx.recv_timeout(QUERY_TIMEOUT).map_err(|_| {
        Error::Transport(format!("session {session} did not answer within {QUERY_TIMEOUT:?}"))
    });
    conn.shutdown();
    <A::Reply as Reply>::from_response(answer?)
}

/// Asks the node process of `session` for its object-store snapshot.
pub fn node_memory(session: &str) -> Result<NodeMemory> {
    let request =
        crate::protocol::ask::NodeStoreStats { holder: rtrun_object_store::HolderId(u64::MAX) };
    ask(session, request).map(|memory| *memory)
}

/// Forwards the first response to the waiting query.
struct Answer(crossbeam_channel::Sender<Response>);

impl FrameHandler for Answer {
    fn on_frame(&self, _conn: &Arc<Connection>, frame: Frame) {
        if let Frame::Response { body, .. } = frame {
            let _ = self.0.try_send(body);
        }
    }

    fn on_close(&self, _conn: &Arc<Connection>, _reason: &str) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_sockets_are_found_and_others_ignored() {
        let table = "Num       RefCount Protocol Flags    Type St Inode Path\n\
            0000: 00000002 00000000 00010000 0001 01 1 @rtrun-00112233aabbccdd-0\n\
            0000: 00000002 00000000 00010000 0001 01 2 @rtrun-00112233aabbccdd-4\n\
            0000: 00000002 00000000 00010000 0001 01 3 @rtrun-cli-1-0\n\
            0000: 00000002 00000000 00010000 0001 01 4 /run/systemd/notify\n\
            0000: 00000003 00000000 00000000 0001 03 5\n";
        let sessions: Vec<_> = sessions_in(table).into_iter().collect();
        assert_eq!(sessions, vec!["00112233aabbccdd".to_owned()]);
    }
}
