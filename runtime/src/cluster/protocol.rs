//! The head's `rtrun-net` service protocol: joins and job binaries as [`NetRequest`]s with
//! [`NetReply`]s (heads encoded with the runtime codec), sent on a process's control
//! connection, and served per link by a [`NetService`].

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::WorkerId;
use crate::protocol::Address;

/// What the head's network service answers (`rtrun-net` requests; heads encoded with the
/// runtime codec).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum NetRequest {
    /// Register a node daemon.
    JoinNode {
        /// Its resources (ids are reassigned by the head).
        resources: rtrun_placement::NodeResources,
        /// Its QUIC endpoint.
        endpoint: SocketAddr,
    },
    /// Register a driver (or a command-line client when `binary` is `None`).
    JoinDriver {
        /// The digest of the driver's executable.
        binary: Option<String>,
        /// Its QUIC endpoint.
        endpoint: SocketAddr,
        /// The submitted job it is the driver of ([`super::JOB_ENV`]), if any.
        job: Option<u64>,
        /// The driver id it had before the head restarted (a reconnect, not a new driver).
        resume: Option<WorkerId>,
    },
    /// A node daemon reconnects to a head that restarted (or whose connection it lost).
    RejoinNode {
        /// The node id the head gave it.
        node: u64,
        /// The workers it runs, with their pids once started.
        workers: Vec<(WorkerId, Option<u32>)>,
        /// Its QUIC endpoint.
        endpoint: SocketAddr,
    },
    /// Whether the head has a job binary.
    HasBinary {
        /// Its digest.
        digest: String,
    },
    /// A job binary (one part).
    UploadBinary {
        /// Its digest.
        digest: String,
    },
    /// Send a job binary (answered with one part).
    FetchBinary {
        /// Its digest.
        digest: String,
    },
}

/// Answers to [`NetRequest`]s.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum NetReply {
    /// Registered.
    Joined {
        /// The cluster's session.
        session: String,
        /// The joining process's id.
        worker: WorkerId,
        /// Its node id.
        node: u64,
        /// The control plane's address.
        head: Address,
        /// How long the nodes and drivers of a head that persists its state
        /// (`--state-dir`) reconnect after losing it, in milliseconds (`None`: they exit).
        reconnect_ms: Option<u64>,
    },
    /// Reconnected to a restarted head.
    Rejoined {
        /// The control plane's address (a process that knew another one refuses it).
        head: Address,
        /// As in [`NetReply::Joined`].
        reconnect_ms: Option<u64>,
    },
    /// Yes or no.
    Present(bool),
    /// Done (a binary follows as a part when asked for).
    Done,
}

pub(crate) fn encode_request(request: &NetRequest) -> Result<Bytes> {
    crate::codec::encode(request).map(Bytes::from)
}

/// What a [`NetLink`](crate::transport::NetLink) does with requests peers send it.
pub(crate) trait NetService: Send + Sync + 'static {
    /// Answers one request that came on the connection named `link` from `peer` (runs on a
    /// blocking thread).
    fn serve(
        self: Arc<Self>,
        peer: String,
        link: String,
        frame: rtrun_net::Frame,
    ) -> Result<(NetReply, Vec<Bytes>)>;

    /// The connection `link` closed (the peer closed it, or it was lost); no more requests come
    /// on it.
    fn link_closed(&self, _link: &rtrun_net::Connection) {}
}

/// Serves a link's requests with `service` (spawned per link by the endpoint).
pub(crate) async fn serve_requests(link: rtrun_net::Connection, service: Arc<dyn NetService>) {
    while let Some(request) = link.next_request().await {
        let service = service.clone();
        let (peer, link) = (request.peer().to_owned(), request.link().to_owned());
        let (frame, responder) = request.into_parts();
        tokio::spawn(async move {
            let answer =
                tokio::task::spawn_blocking(move || service.serve(peer, link, frame)).await;
            let result = match answer {
                Ok(Ok((reply, parts))) => match crate::codec::encode(&reply) {
                    Ok(head) => responder.respond(head, parts).await,
                    Err(e) => responder.error(e.to_string()).await,
                },
                Ok(Err(e)) => responder.error(e.to_string()).await,
                Err(e) => responder.error(format!("the request failed: {e}")).await,
            };
            if let Err(e) = result {
                tracing::debug!("could not answer a request: {e}");
            }
        });
    }
    service.link_closed(&link);
}

/// An error of the network layer, saying what was being done.
pub(crate) fn net_error(what: &str) -> impl Fn(rtrun_net::NetError) -> Error + '_ {
    move |e| Error::Transport(format!("{what}: {e}"))
}
