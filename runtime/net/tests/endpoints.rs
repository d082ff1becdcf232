//! Two or more endpoints on loopback: mutual authentication, refusals, bootstrap, large
//! multipart transfers, resumable pulls and heartbeat loss.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use rtrun_net::{
    CredentialsDir, HeadCredentials, HeartbeatConfig, HeartbeatMonitor, NetConfig, NetError,
    NodeCredentials, bootstrap,
};
use rtrun_object_store::{ObjectId, PullConfig, PullState};

#[tokio::test]
async fn two_endpoints_with_mutual_tls_exchange_requests_both_ways() {
    let head = HeadCredentials::generate("head").unwrap();
    let head_ep = head_endpoint(&head, NetConfig::default(), None);
    let node_ep = node_endpoint(issue(&head, "node-1"), NetConfig::default(), None);
    let head_addr = head_ep.local_addr().unwrap();
    let accepting = tokio::spawn(async move {
        let connection = head_ep.accept().await.unwrap();
        (head_ep, connection)
    });
    let to_head = node_ep.connect(head_addr).await.unwrap();
    let (_head_ep, from_node) = within(accepting).await.unwrap();
    assert_eq!(to_head.peer_name(), "head");
    assert_eq!(from_node.peer_name(), "node-1");
    spawn_echo(from_node.clone());
    spawn_echo(to_head.clone());

    let reply = to_head
        .request(Bytes::from_static(b"ping"), vec![Bytes::from_static(b"part")])
        .await
        .unwrap();
    assert_eq!(&reply.head[..], b"echo:ping");
    assert_eq!(reply.parts, vec![Bytes::from_static(b"part")]);
    let reply = from_node.request(Bytes::from_static(b"pong"), vec![]).await.unwrap();
    assert_eq!(&reply.head[..], b"echo:pong");
    // Many requests in flight on one connection, each answered to its own caller.
    let calls = (0..64u32).map(|i| {
        let connection = to_head.clone();
        async move { connection.request(Bytes::from(i.to_le_bytes().to_vec()), vec![]).await }
    });
    for (i, reply) in futures::future::join_all(calls).await.into_iter().enumerate() {
        let reply = reply.unwrap();
        assert_eq!(&reply.head[5..], &(i as u32).to_le_bytes());
    }
    // An application error reaches the caller as a remote error.
    let err = to_head.request(Bytes::from_static(b"fail"), vec![]).await.unwrap_err();
    assert!(
        matches!(&err, NetError::Remote { message, .. } if message == "asked to fail"),
        "{err}"
    );
}

#[tokio::test]
async fn peers_without_valid_credentials_are_refused() {
    let head = HeadCredentials::generate("head").unwrap();
    let head_ep = Arc::new(head_endpoint(&head, NetConfig::default(), None));
    let addr = head_ep.local_addr().unwrap();
    spawn_accept_echo(head_ep.clone());

    // A correct certificate with the wrong token.
    let mut wrong_token = issue(&head, "n1");
    wrong_token.token = rtrun_net::JoinToken::generate(*head.node.token.ca_fingerprint()).unwrap();
    let err =
        node_endpoint(wrong_token, NetConfig::default(), None).connect(addr).await.unwrap_err();
    assert!(
        matches!(&err, NetError::Refused { reason, .. } if reason.contains("wrong join token")),
        "{err}"
    );

    // A certificate from another cluster's CA (trusting our head, presenting the right token).
    let other = HeadCredentials::generate("other").unwrap();
    let foreign = NodeCredentials { ca_cert: head.node.ca_cert.clone(), ..other.node.clone() };
    let foreign = NodeCredentials { token: head.node.token.clone(), ..foreign };
    let err = node_endpoint(foreign, NetConfig::default(), None).connect(addr).await.unwrap_err();
    eprintln!("foreign certificate: {err}");
    assert!(matches!(err, NetError::Refused { .. }), "{err}");

    // A node of another cluster does not trust our head either.
    let err = node_endpoint(other.node.clone(), NetConfig::default(), None)
        .connect(addr)
        .await
        .unwrap_err();
    eprintln!("other cluster's node: {err}");
    assert!(matches!(err, NetError::Refused { .. }), "{err}");

    // No certificate at all: a raw QUIC client passes the head's handshake but may only
    // bootstrap; its hello is refused.
    let err = raw_uncertified_hello(addr, &head).await;
    assert!(err.contains("may only bootstrap"), "{err}");

    // Bootstrap with a wrong token is refused; against a node without the CA it fails already
    // in the handshake.
    let bad = rtrun_net::JoinToken::generate(*head.node.token.ca_fingerprint()).unwrap();
    let err = bootstrap(addr, &bad, "n2", &NetConfig::default()).await.unwrap_err();
    assert!(
        matches!(&err, NetError::Refused { reason, .. } if reason.contains("wrong join token")),
        "{err}"
    );
    let plain = node_endpoint(issue(&head, "plain"), NetConfig::default(), None);
    let err = bootstrap(plain.local_addr().unwrap(), &head.node.token, "n3", &NetConfig::default())
        .await
        .unwrap_err();
    eprintln!("bootstrap against a plain node: {err}");
    assert!(matches!(err, NetError::Refused { .. } | NetError::Connection { .. }), "{err}");
    // A token naming another CA never reveals its secret to this head.
    let err = bootstrap(addr, &other.node.token, "n4", &NetConfig::default()).await.unwrap_err();
    assert!(err.to_string().contains("fingerprint"), "{err}");

    // The head still serves a valid peer.
    let good = node_endpoint(issue(&head, "good"), NetConfig::default(), None);
    let connection = good.connect(addr).await.unwrap();
    assert_eq!(
        &connection.request(Bytes::from_static(b"ok"), vec![]).await.unwrap().head[..],
        b"echo:ok"
    );
}

#[tokio::test]
async fn a_node_with_only_the_token_bootstraps_saves_and_connects() {
    let head = HeadCredentials::generate("head").unwrap();
    let head_ep = Arc::new(head_endpoint(&head, NetConfig::default(), None));
    let addr = head_ep.local_addr().unwrap();
    spawn_accept_echo(head_ep.clone());
    let token: rtrun_net::JoinToken = head.node.token.to_string().parse().unwrap();
    let creds = bootstrap(addr, &token, "fresh-node", &NetConfig::default()).await.unwrap();
    assert_eq!(creds.node_name().unwrap(), "fresh-node");
    let dir = tempfile::tempdir().unwrap();
    let store = CredentialsDir::new(dir.path().join("creds"));
    store.save_node(&creds).unwrap();
    let loaded = store.load_node().unwrap();
    let node = node_endpoint(loaded, NetConfig::default(), None);
    let connection = node.connect(addr).await.unwrap();
    assert_eq!(connection.peer_name(), "head");
    assert_eq!(
        &connection.request(Bytes::from_static(b"hi"), vec![]).await.unwrap().head[..],
        b"echo:hi"
    );
}

#[tokio::test]
async fn a_256_mib_multipart_object_crosses_intact_both_as_parts_and_as_a_pull() {
    const SIZE: usize = 256 << 20;
    let head = HeadCredentials::generate("head").unwrap();
    let data = Bytes::from(pattern(SIZE, 7));
    let digest = sha256(&data);
    let source = Arc::new(MemorySource::default());
    source.insert(ObjectId(42), data.clone());
    let head_ep = Arc::new(head_endpoint(&head, NetConfig::default(), Some(source.clone())));
    let addr = head_ep.local_addr().unwrap();
    spawn_accept_echo(head_ep.clone());
    let node = node_endpoint(issue(&head, "n1"), NetConfig::default(), None);
    let connection = node.connect(addr).await.unwrap();

    // As parts of a request (echoed back): a small part and the large one.
    let small = Bytes::from_static(b"header part");
    let reply = connection
        .request(Bytes::from_static(b"blob"), vec![small.clone(), data.clone()])
        .await
        .unwrap();
    assert_eq!(reply.parts.len(), 2);
    assert_eq!(reply.parts[0], small);
    assert_eq!(reply.parts[1].len(), SIZE);
    assert_eq!(sha256(&reply.parts[1]), digest);
    drop(reply);

    // As a chunked pull into a pre-sized buffer.
    let pulled = connection.pull_object(ObjectId(42), PullConfig::default()).await.unwrap();
    assert_eq!(pulled.len(), SIZE);
    assert_eq!(sha256(&pulled), digest);
    assert_eq!(source.served.load(Ordering::Relaxed), SIZE.div_ceil(8 << 20));

    // An object the holder does not have is an error naming it.
    let err = connection.pull_object(ObjectId(7), PullConfig::default()).await.unwrap_err();
    assert!(err.to_string().contains("is not on node head"), "{err}");
}

#[tokio::test]
async fn a_failed_pull_resumes_with_only_the_missing_chunks() {
    let head = HeadCredentials::generate("head").unwrap();
    let data = Bytes::from(pattern(1_000_003, 3));
    let source = Arc::new(MemorySource::default());
    source.insert(ObjectId(5), data.clone());
    source.fail_once_at(ObjectId(5), 6);
    let head_ep = Arc::new(head_endpoint(&head, NetConfig::default(), Some(source.clone())));
    spawn_accept_echo(head_ep.clone());
    let node = node_endpoint(issue(&head, "n1"), NetConfig::default(), None);
    let connection = node.connect(head_ep.local_addr().unwrap()).await.unwrap();

    let config = PullConfig { chunk_size: 100_000, max_in_flight: 3 };
    let mut state = PullState::new(ObjectId(5), data.len() as u64, config).unwrap();
    let mut buffer = vec![0u8; data.len()];
    let mut pull = connection.open_pull(ObjectId(5), config.chunk_size).await.unwrap();
    let err = pull.run(&mut state, &mut buffer).await.unwrap_err();
    assert!(err.to_string().contains("chunk 6"), "{err}");
    let first = state.bytes_received();
    assert!(first >= 600_000 && !state.is_complete(), "{first}");
    let mut pull = connection.open_pull(ObjectId(5), config.chunk_size).await.unwrap();
    pull.run(&mut state, &mut buffer).await.unwrap();
    assert!(state.is_complete());
    assert_eq!(&buffer[..], &data[..]);
    // Every chunk was served successfully exactly once across both streams.
    assert_eq!(source.served.load(Ordering::Relaxed), 11);
}

#[tokio::test]
async fn heartbeat_loss_is_detected_within_the_timeout() {
    let heartbeat =
        HeartbeatConfig { interval: Duration::from_millis(100), timeout: Duration::from_secs(3) };
    let config = NetConfig { heartbeat, ..NetConfig::default() };
    let head = HeadCredentials::generate("head").unwrap();
    let (monitor, mut dead) = HeartbeatMonitor::start(heartbeat);
    let head_ep = head_endpoint_with(&head, config.clone(), None, Some(monitor.clone()));
    let addr = head_ep.local_addr().unwrap();
    let mut senders = Vec::new();
    let mut nodes = Vec::new();
    for name in ["beating", "steady"] {
        let node = node_endpoint(issue(&head, name), config.clone(), None);
        let connection = node.connect(addr).await.unwrap();
        let from_node = within(head_ep.accept()).await.unwrap();
        monitor.watch(from_node.peer_name());
        senders.push(connection.start_heartbeats());
        nodes.push((node, connection, from_node));
    }
    // While heartbeats flow, two timeouts pass without a death.
    let quiet = tokio::time::timeout(2 * heartbeat.timeout, dead.recv()).await;
    assert!(quiet.is_err(), "declared dead while sending heartbeats: {quiet:?}");
    assert!(monitor.is_alive("beating") && monitor.is_alive("steady"));
    // One node's heartbeats stop (its connection stays up): that node alone is reported dead.
    drop(senders.remove(0));
    let name = within(dead.recv()).await.unwrap();
    assert_eq!(name, "beating");
    assert!(!monitor.is_alive("beating"));
    assert!(monitor.is_alive("steady"));
    // The other node vanishes with its endpoint: it is reported too.
    drop(senders);
    drop(nodes);
    assert_eq!(within(dead.recv()).await.unwrap(), "steady");
}

#[tokio::test]
async fn requests_beyond_the_unanswered_bytes_budget_are_refused_and_the_connection_lives_on() {
    let config = NetConfig { max_unanswered_request_bytes: 1 << 20, ..NetConfig::default() };
    let head = HeadCredentials::generate("head").unwrap();
    let head_ep = Arc::new(head_endpoint(&head, config.clone(), None));
    spawn_accept_echo(head_ep.clone());
    let node = node_endpoint(issue(&head, "n1"), config, None);
    let connection = node.connect(head_ep.local_addr().unwrap()).await.unwrap();
    let big = Bytes::from(vec![1u8; 2 << 20]);
    let err = connection.request(Bytes::from_static(b"big"), vec![big]).await.unwrap_err();
    assert!(err.to_string().contains("budget"), "{err}");
    let fits = Bytes::from(vec![2u8; 512 << 10]);
    let reply = connection.request(Bytes::from_static(b"fits"), vec![fits.clone()]).await.unwrap();
    assert_eq!(reply.parts, vec![fits]);
}
