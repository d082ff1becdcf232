//! rustls configurations for the QUIC endpoints: TLS 1.3 only, the `ring` provider, and mutual
//! authentication against the cluster CA. Every node certificate carries the SAN
//! [`CLUSTER_SERVER_NAME`], which is the server name clients verify (nodes are reached by
//! address; the cluster CA, not DNS, vouches for them).
//!
//! A head also accepts handshakes without a client certificate, but such connections may only
//! carry one bootstrap exchange (see [`crate::bootstrap()`]); nodes without the CA key require a
//! client certificate in the handshake itself.

use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::credentials::{CLUSTER_SERVER_NAME, NodeCredentials, fingerprint, hex};
use crate::error::{NetError, Result};

/// The ALPN protocol id of rtrun's node-to-node protocol.
pub const ALPN: &[u8] = b"rtrun/1";

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_error(error: impl std::fmt::Display) -> NetError {
    NetError::Tls(error.to_string())
}

fn roots(ca: &CertificateDer<'static>) -> Result<Arc<RootCertStore>> {
    let mut roots = RootCertStore::empty();
    roots.add(ca.clone()).map_err(|e| NetError::Tls(format!("cluster CA certificate: {e}")))?;
    Ok(Arc::new(roots))
}

/// Checks that `cert` is a valid node certificate issued by `ca` (signature, validity period,
/// server name, usage). Returns the verifier's reason on failure.
pub fn verify_chain(
    ca: &CertificateDer<'static>,
    cert: &CertificateDer<'static>,
) -> std::result::Result<(), String> {
    let roots = roots(ca).map_err(|e| e.to_string())?;
    let verifier = WebPkiServerVerifier::builder_with_provider(roots, provider())
        .build()
        .map_err(|e| e.to_string())?;
    let name = ServerName::try_from(CLUSTER_SERVER_NAME).map_err(|e| e.to_string())?;
    verifier
        .verify_server_cert(cert, &[], &name, &[], UnixTime::now())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The server side: presents the node certificate (with the CA certificate, so bootstrapping
/// clients can pin it) and requires a client certificate from the cluster CA — optional only
/// when `allow_bootstrap` (the head, which holds the CA key).
pub fn server_config(
    node: &NodeCredentials,
    allow_bootstrap: bool,
    transport: Arc<quinn::TransportConfig>,
) -> Result<quinn::ServerConfig> {
    let provider = provider();
    let mut verifier =
        WebPkiClientVerifier::builder_with_provider(roots(&node.ca_cert)?, provider.clone());
    if allow_bootstrap {
        verifier = verifier.allow_unauthenticated();
    }
    let verifier = verifier.build().map_err(tls_error)?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_error)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![node.cert.clone(), node.ca_cert.clone()],
            PrivateKeyDer::Pkcs8(node.key.clone_key()),
        )
        .map_err(tls_error)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let quic = QuicServerConfig::try_from(tls).map_err(tls_error)?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(quic));
    config.transport_config(transport);
    Ok(config)
}

/// The client side: verifies the server against the cluster CA and presents the node
/// certificate.
pub fn client_config(
    node: &NodeCredentials,
    transport: Arc<quinn::TransportConfig>,
) -> Result<quinn::ClientConfig> {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_error)?
        .with_root_certificates(roots(&node.ca_cert)?)
        .with_client_auth_cert(vec![node.cert.clone()], PrivateKeyDer::Pkcs8(node.key.clone_key()))
        .map_err(tls_error)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let quic = QuicClientConfig::try_from(tls).map_err(tls_error)?;
    let mut config = quinn::ClientConfig::new(Arc::new(quic));
    config.transport_config(transport);
    Ok(config)
}

/// The client side of a bootstrap: no client certificate; the server must present a chain whose
/// CA has the fingerprint carried in the join token, and a node certificate signed by it.
pub fn bootstrap_client_config(
    ca_fingerprint: [u8; 32],
    transport: Arc<quinn::TransportConfig>,
) -> Result<quinn::ClientConfig> {
    let provider = provider();
    let verifier = Arc::new(PinnedCaVerifier { ca_fingerprint, provider: provider.clone() });
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_error)?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let quic = QuicClientConfig::try_from(tls).map_err(tls_error)?;
    let mut config = quinn::ClientConfig::new(Arc::new(quic));
    config.transport_config(transport);
    Ok(config)
}

/// The certificates a peer presented in the handshake (empty for a bootstrapping client).
pub(crate) fn peer_certificates(connection: &quinn::Connection) -> Vec<CertificateDer<'static>> {
    connection
        .peer_identity()
        .and_then(|identity| identity.downcast::<Vec<CertificateDer<'static>>>().ok())
        .map(|certs| *certs)
        .unwrap_or_default()
}

/// Trusts a server whose chain contains the CA with a pinned fingerprint and whose end-entity
/// certificate that CA signed: how a node holding only the join token authenticates the head.
#[derive(Debug)]
struct PinnedCaVerifier {
    ca_fingerprint: [u8; 32],
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let ca = intermediates
            .iter()
            .find(|cert| fingerprint(cert) == self.ca_fingerprint)
            .ok_or_else(|| {
                rustls::Error::General(format!(
                    "the server's certificate chain has no CA with the token's fingerprint {}",
                    hex(&self.ca_fingerprint[..8])
                ))
            })?;
        let mut roots = RootCertStore::empty();
        roots.add(ca.clone().into_owned())?;
        let verifier =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?;
        verifier.verify_server_cert(end_entity, &[], server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}
