//! Helpers shared by the endpoint tests: credentials, endpoints, an echo service, an in-memory
//! object source.

#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use rtrun_net::frame::{FrameKind, FrameLimits, expect_frame, write_frame};
use rtrun_net::protocol::{Hello, PROTOCOL_VERSION, frame};
use rtrun_net::{
    CLUSTER_SERVER_NAME, Connection, Endpoint, EndpointOptions, HeadCredentials, HeartbeatMonitor,
    NetConfig, NodeCredentials, ObjectSource,
};
use rtrun_object_store::ObjectId;

/// Generous bound on anything a test waits for (the build machine is heavily shared).
pub const DEADLINE: Duration = Duration::from_secs(60);

pub async fn within<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(DEADLINE, future).await.expect("operation finished within the deadline")
}

pub fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

pub fn issue(head: &HeadCredentials, name: &str) -> NodeCredentials {
    let (cert, key) = head.authority.issue_node(name).unwrap();
    NodeCredentials {
        ca_cert: head.node.ca_cert.clone(),
        cert,
        key,
        token: head.node.token.clone(),
    }
}

pub fn head_endpoint(
    head: &HeadCredentials,
    config: NetConfig,
    source: Option<Arc<dyn ObjectSource>>,
) -> Endpoint {
    head_endpoint_with(head, config, source, None)
}

pub fn head_endpoint_with(
    head: &HeadCredentials,
    config: NetConfig,
    source: Option<Arc<dyn ObjectSource>>,
    monitor: Option<HeartbeatMonitor>,
) -> Endpoint {
    let options = EndpointOptions {
        config,
        authority: Some(head.authority.clone()),
        object_source: source,
        monitor,
    };
    Endpoint::bind(loopback(), head.node.clone(), options).unwrap()
}

pub fn node_endpoint(
    node: NodeCredentials,
    config: NetConfig,
    source: Option<Arc<dyn ObjectSource>>,
) -> Endpoint {
    let options = EndpointOptions { config, object_source: source, ..EndpointOptions::default() };
    Endpoint::bind(loopback(), node, options).unwrap()
}

/// Answers every request on `connection`: `fail` with an error, anything else with
/// `echo:<head>` and the same parts.
pub fn spawn_echo(connection: Connection) {
    tokio::spawn(async move {
        while let Some(request) = connection.next_request().await {
            tokio::spawn(async move {
                if &request.frame.head[..] == b"fail" {
                    let _ = request.respond_error("asked to fail").await;
                    return;
                }
                let mut head = b"echo:".to_vec();
                head.extend_from_slice(&request.frame.head);
                let parts = request.frame.parts.clone();
                let _ = request.respond(head, parts).await;
            });
        }
    });
}

/// Accepts every peer of `endpoint` and echoes its requests.
pub fn spawn_accept_echo(endpoint: Arc<Endpoint>) {
    tokio::spawn(async move {
        while let Some(connection) = endpoint.accept().await {
            spawn_echo(connection);
        }
    });
}

/// Connects without a client certificate (trusting the head's CA) and sends a hello; returns
/// the error the head answered with.
pub async fn raw_uncertified_hello(addr: SocketAddr, head: &HeadCredentials) -> String {
    let config = NetConfig::default();
    let client = rtrun_net::tls::bootstrap_client_config(
        *head.node.token.ca_fingerprint(),
        config.transport().unwrap(),
    )
    .unwrap();
    let endpoint = quinn::Endpoint::client(loopback()).unwrap();
    let connection =
        endpoint.connect_with(client, addr, CLUSTER_SERVER_NAME).unwrap().await.unwrap();
    let (mut send, mut recv) = connection.open_bi().await.unwrap();
    let hello =
        Hello { protocol: PROTOCOL_VERSION, token_secret: head.node.token.secret().to_vec() };
    write_frame(&mut send, &frame(FrameKind::Hello, 0, &hello), &FrameLimits::HANDSHAKE)
        .await
        .unwrap();
    send.finish().unwrap();
    let reply = within(expect_frame(&mut recv, &FrameLimits::HANDSHAKE)).await;
    assert!(reply.is_err(), "an uncertified hello was answered: {reply:?}");
    match within(connection.closed()).await {
        quinn::ConnectionError::ApplicationClosed(close) => {
            String::from_utf8_lossy(&close.reason).into_owned()
        }
        other => other.to_string(),
    }
}

/// Deterministic test bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn sha256(bytes: &[u8]) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, bytes).as_ref().to_vec()
}

/// An in-memory object source that counts successfully served chunks and can fail one chunk
/// once.
#[derive(Default)]
pub struct MemorySource {
    objects: Mutex<HashMap<ObjectId, Bytes>>,
    fail_once: Mutex<Option<(ObjectId, u64)>>,
    chunk_size: Mutex<HashMap<ObjectId, u64>>,
    pub served: AtomicUsize,
}

impl MemorySource {
    pub fn insert(&self, id: ObjectId, data: Bytes) {
        self.objects.lock().insert(id, data);
    }

    /// The first read starting at chunk `index` (of 100 000-byte chunks) fails.
    pub fn fail_once_at(&self, id: ObjectId, index: u64) {
        *self.fail_once.lock() = Some((id, index * 100_000));
        self.chunk_size.lock().insert(id, 100_000);
    }
}

impl ObjectSource for MemorySource {
    fn size(&self, object: ObjectId) -> Option<u64> {
        self.objects.lock().get(&object).map(|b| b.len() as u64)
    }

    fn read(&self, object: ObjectId, offset: u64, len: u64) -> Result<Bytes, String> {
        let mut fail = self.fail_once.lock();
        if *fail == Some((object, offset)) {
            *fail = None;
            return Err(format!("injected failure at offset {offset}"));
        }
        drop(fail);
        let objects = self.objects.lock();
        let data = objects.get(&object).ok_or("gone")?;
        self.served.fetch_add(1, Ordering::Relaxed);
        Ok(data.slice(offset as usize..(offset + len) as usize))
    }
}
