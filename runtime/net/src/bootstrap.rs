//! Bootstrap: how a node that holds only the join token obtains a certificate from the head.
//!
//! Modelled on kubeadm's token discovery and kubelet TLS bootstrap, in one round trip:
//!
//! 1. The joining node makes its own key pair and a certificate signing request (the private key
//!    never leaves the node).
//! 2. It connects to the head without a client certificate. It trusts the head only if the
//!    head's chain contains a CA whose SHA-256 equals the fingerprint in the token, and the
//!    head's certificate is signed by that CA — so the token's secret is revealed only to the
//!    real head, never to an impostor.
//! 3. It sends a [`BootstrapRequest`] (token secret, node name, CSR) as the first frame.
//! 4. The head compares the secret in constant time, signs the CSR's public key with its own
//!    parameters (node name as common name, the cluster server name, client+server usage) and
//!    answers [`Issued`] (certificate and CA certificate); then the connection closes.
//! 5. The node saves the credentials and connects normally, with mutual TLS and the hello.
//!
//! A certificate-less connection can do nothing else: any other first frame, a wrong token or
//! a connection to a node without the CA key is closed with a reason.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};

use crate::config::NetConfig;
use crate::credentials::{
    CLUSTER_SERVER_NAME, JoinToken, NodeCredentials, fingerprint, validate_node_name,
};
use crate::endpoint::{Shared, connection_error, refuse};
use crate::error::{NetError, Result};
use crate::frame::{FrameKind, FrameLimits, expect_frame, write_frame};
use crate::protocol::{BootstrapRequest, Issued, PROTOCOL_VERSION, decode, frame};
use crate::tls;

/// Obtains credentials for `node_name` from the head at `head` with only the join token.
pub async fn bootstrap(
    head: SocketAddr,
    token: &JoinToken,
    node_name: &str,
    config: &NetConfig,
) -> Result<NodeCredentials> {
    bootstrap_with_validity(head, token, node_name, None, config).await
}

/// Like [`bootstrap`], asking for a certificate valid only for `validity` (a short-lived
/// client's; `None`: a node's, the longest the head issues).
pub async fn bootstrap_with_validity(
    head: SocketAddr,
    token: &JoinToken,
    node_name: &str,
    validity: Option<std::time::Duration>,
    config: &NetConfig,
) -> Result<NodeCredentials> {
    validate_node_name(node_name)?;
    let timeout = config.handshake_timeout;
    let exchange = bootstrap_inner(head, token, node_name, validity, config);
    tokio::time::timeout(timeout, exchange).await.map_err(|_| NetError::Timeout {
        during: "bootstrapping with the head",
        after_ms: timeout.as_millis(),
    })?
}

async fn bootstrap_inner(
    head: SocketAddr,
    token: &JoinToken,
    node_name: &str,
    validity: Option<std::time::Duration>,
    config: &NetConfig,
) -> Result<NodeCredentials> {
    let peer = head.to_string();
    let key = KeyPair::generate().map_err(|e| NetError::Certificate(e.to_string()))?;
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, node_name);
    params.distinguished_name = name;
    let csr = params.serialize_request(&key).map_err(|e| NetError::Certificate(e.to_string()))?;

    let local: SocketAddr = if head.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let endpoint = quinn::Endpoint::client(local)
        .map_err(|e| NetError::io("binding a QUIC client endpoint for bootstrap", e))?;
    let client = tls::bootstrap_client_config(*token.ca_fingerprint(), config.transport()?)?;
    let connection = endpoint
        .connect_with(client, head, CLUSTER_SERVER_NAME)
        .map_err(|e| NetError::Connection { peer: peer.clone(), reason: e.to_string() })?
        .await
        .map_err(|e| connection_error(&peer, e))?;
    let exchange = async {
        let (mut send, mut recv) =
            connection.open_bi().await.map_err(|e| connection_error(&peer, e))?;
        let request = BootstrapRequest {
            protocol: PROTOCOL_VERSION,
            token_secret: token.secret().to_vec(),
            node_name: node_name.to_string(),
            csr_der: csr.der().to_vec(),
            validity_s: validity.map(|v| v.as_secs().max(1)),
        };
        write_frame(&mut send, &frame(FrameKind::Bootstrap, 0, &request), &FrameLimits::HANDSHAKE)
            .await?;
        let _ = send.finish();
        let reply = expect_frame(&mut recv, &FrameLimits::HANDSHAKE).await?;
        match decode::<Issued>(&reply, FrameKind::Issued) {
            Ok(issued) => Ok(issued),
            Err(Ok(reason)) => Err(NetError::Refused { peer: peer.clone(), reason }),
            Err(Err(e)) => Err(e.into()),
        }
    };
    let issued = match exchange.await {
        Ok(issued) => issued,
        Err(error) => {
            return Err(connection
                .close_reason()
                .map(|e| connection_error(&peer, e))
                .unwrap_or(error));
        }
    };
    connection.close(quinn::VarInt::from_u32(crate::endpoint::CLOSE_NORMAL), b"bootstrapped");
    endpoint.wait_idle().await;

    let ca_cert = CertificateDer::from(issued.ca_der);
    let cert = CertificateDer::from(issued.cert_der);
    if fingerprint(&ca_cert) != *token.ca_fingerprint() {
        return Err(NetError::Protocol {
            peer,
            reason: "the head returned a CA certificate that does not match the token".into(),
        });
    }
    tls::verify_chain(&ca_cert, &cert).map_err(|reason| NetError::Protocol {
        peer: peer.clone(),
        reason: format!("the issued certificate does not verify: {reason}"),
    })?;
    Ok(NodeCredentials {
        ca_cert,
        cert,
        key: PrivatePkcs8KeyDer::from(key.serialize_der()),
        token: token.clone(),
    })
}

/// The head's side of a certificate-less connection: exactly one bootstrap exchange.
pub(crate) async fn serve_bootstrap(shared: &Shared, connection: &quinn::Connection) -> Result<()> {
    let remote = connection.remote_address().to_string();
    let Some(authority) = &shared.authority else {
        // Not reached with the default server configuration (it requires a certificate when
        // there is no authority); kept so a misconfiguration still refuses.
        let reason = "this node does not issue certificates; present a cluster certificate";
        refuse(connection, reason);
        return Err(NetError::Refused { peer: remote, reason: reason.into() });
    };
    let (mut send, mut recv) =
        connection.accept_bi().await.map_err(|e| connection_error(&remote, e))?;
    let outcome = async {
        let request =
            expect_frame(&mut recv, &FrameLimits::HANDSHAKE).await.map_err(|e| e.to_string())?;
        let request: BootstrapRequest = match decode(&request, FrameKind::Bootstrap) {
            Ok(request) => request,
            Err(Ok(message)) => {
                return Err(format!("expected a bootstrap request, found an error: {message}"));
            }
            Err(Err(e)) => {
                return Err(format!(
                    "a peer without a cluster certificate may only bootstrap: {e}"
                ));
            }
        };
        if request.protocol != PROTOCOL_VERSION {
            return Err(format!(
                "expected protocol {PROTOCOL_VERSION}, found {}",
                request.protocol
            ));
        }
        if !shared.node.token.secret_matches(&request.token_secret) {
            return Err("wrong join token".to_string());
        }
        let cert = authority
            .sign_request_valid_for(
                &request.csr_der,
                &request.node_name,
                request.validity_s.map(std::time::Duration::from_secs),
            )
            .map_err(|e| e.to_string())?;
        Ok((request.node_name, cert))
    }
    .await;
    let (node_name, cert) = match outcome {
        Ok(issued) => issued,
        Err(reason) => {
            refuse(connection, &reason);
            return Err(NetError::Refused { peer: remote, reason });
        }
    };
    let issued = Issued { cert_der: cert.to_vec(), ca_der: authority.cert().to_vec() };
    write_frame(&mut send, &frame(FrameKind::Issued, 0, &issued), &FrameLimits::HANDSHAKE).await?;
    let _ = send.finish();
    tracing::info!(node = %node_name, %remote, "issued a node certificate");
    // The joining node closes once it has the certificate; the handshake timeout bounds the wait.
    connection.closed().await;
    Ok(())
}
