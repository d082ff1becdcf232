//! Cluster credentials: the cluster CA, node certificates signed by it and the join token, with
//! their on-disk form (a directory of PEM files and a token file, owner-only permissions).
//!
//! On first start a head calls [`CredentialsDir::load_or_create_head`], which makes a CA, a
//! certificate for the head's own node and a 256-bit join token. Other nodes either copy the
//! credentials directory (minus the CA key) or bootstrap with the token alone (see
//! [`crate::bootstrap()`]) and then keep what the head issued with [`CredentialsDir::save_node`].

use std::fmt;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SerialNumber,
};
use ring::rand::{SecureRandom, SystemRandom};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateSigningRequestDer, PrivatePkcs8KeyDer};

use crate::error::{NetError, Result};

/// The TLS server name every node certificate carries: nodes are reached by address, so the
/// cluster's own CA (not DNS) vouches for identity and the name is the same cluster-wide.
pub const CLUSTER_SERVER_NAME: &str = "rtrun-cluster";
/// Environment variable read for the join token when no flag gives one.
pub const TOKEN_ENV: &str = "RTRUN_TOKEN";
/// The version prefix of the printed token form.
const TOKEN_PREFIX: &str = "rtrun1";
/// Validity of the cluster CA.
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Validity of node certificates (a rejoining node bootstraps again with the token).
const NODE_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);
/// Tolerated clock skew between nodes for `not_before`.
const CLOCK_SKEW: Duration = Duration::from_secs(3600);
/// Longest node name accepted in a certificate.
pub const MAX_NODE_NAME_LEN: usize = 64;

const CA_CERT_FILE: &str = "ca.pem";
const CA_KEY_FILE: &str = "ca-key.pem";
const NODE_CERT_FILE: &str = "node.pem";
const NODE_KEY_FILE: &str = "node-key.pem";
const TOKEN_FILE: &str = "token";

/// The join token: a 256-bit random secret that proves membership, plus the SHA-256 fingerprint
/// of the cluster CA certificate so that a node holding only the token can authenticate the
/// head before revealing the secret (kubeadm's `--discovery-token-ca-cert-hash`, folded into one
/// string). Printed as `rtrun1.<64 hex secret>.<64 hex fingerprint>`.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    secret: [u8; 32],
    ca_fingerprint: [u8; 32],
}

impl JoinToken {
    /// A fresh random secret bound to the CA with `ca_fingerprint`.
    pub fn generate(ca_fingerprint: [u8; 32]) -> Result<JoinToken> {
        let mut secret = [0u8; 32];
        SystemRandom::new()
            .fill(&mut secret)
            .map_err(|_| NetError::Certificate("system random number generator failed".into()))?;
        Ok(JoinToken { secret, ca_fingerprint })
    }

    /// The secret presented in the first message of every connection.
    pub fn secret(&self) -> &[u8; 32] {
        &self.secret
    }

    /// SHA-256 of the cluster CA certificate (DER).
    pub fn ca_fingerprint(&self) -> &[u8; 32] {
        &self.ca_fingerprint
    }

    /// Whether `presented` equals the secret, compared in constant time.
    pub fn secret_matches(&self, presented: &[u8]) -> bool {
        if presented.len() != self.secret.len() {
            return false;
        }
        let difference =
            presented.iter().zip(self.secret.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(difference) == 0
    }

    /// The token from, in order: the flag's value, the `RTRUN_TOKEN` environment variable, the
    /// token file. Errors say which source held a malformed token.
    pub fn resolve(flag: Option<&str>, token_file: Option<&Path>) -> Result<JoinToken> {
        let env = std::env::var(TOKEN_ENV).ok();
        JoinToken::resolve_from(flag, env.as_deref(), token_file)
    }

    /// [`JoinToken::resolve`] with the environment value passed in (testable without touching
    /// the process environment).
    pub fn resolve_from(
        flag: Option<&str>,
        env: Option<&str>,
        token_file: Option<&Path>,
    ) -> Result<JoinToken> {
        if let Some(value) = flag {
            return value.parse().map_err(|e: NetError| from_source("--token", e));
        }
        if let Some(value) = env.filter(|v| !v.trim().is_empty()) {
            return value.parse().map_err(|e: NetError| from_source(TOKEN_ENV, e));
        }
        if let Some(path) = token_file {
            check_private(path)?;
            let text = fs::read_to_string(path)
                .map_err(|e| NetError::io(format!("reading token file `{}`", path.display()), e))?;
            return text.parse().map_err(|e: NetError| {
                from_source(&format!("token file `{}`", path.display()), e)
            });
        }
        Err(NetError::MissingToken)
    }
}

fn from_source(source: &str, error: NetError) -> NetError {
    match error {
        NetError::BadToken(reason) => NetError::BadToken(format!("{reason} (from {source})")),
        other => other,
    }
}

impl fmt::Display for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{TOKEN_PREFIX}.{}.{}", hex(&self.secret), hex(&self.ca_fingerprint))
    }
}

impl fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JoinToken(secret: <redacted>, ca: {})", hex(&self.ca_fingerprint[..8]))
    }
}

impl FromStr for JoinToken {
    type Err = NetError;

    fn from_str(text: &str) -> Result<JoinToken> {
        let text = text.trim();
        let mut fields = text.split('.');
        let (Some(prefix), Some(secret), Some(fingerprint), None) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            return Err(NetError::BadToken(format!(
                "expected `{TOKEN_PREFIX}.<64 hex>.<64 hex>`, found {} dot-separated fields",
                text.split('.').count()
            )));
        };
        if prefix != TOKEN_PREFIX {
            return Err(NetError::BadToken(format!(
                "expected prefix `{TOKEN_PREFIX}`, found `{}`",
                prefix.chars().take(16).collect::<String>()
            )));
        }
        Ok(JoinToken {
            secret: unhex32(secret, "secret")?,
            ca_fingerprint: unhex32(fingerprint, "CA fingerprint")?,
        })
    }
}

/// The cluster certificate authority; only the head holds its key.
pub struct ClusterAuthority {
    cert: CertificateDer<'static>,
    key: KeyPair,
}

impl fmt::Debug for ClusterAuthority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClusterAuthority(ca: {})", hex(&self.fingerprint()[..8]))
    }
}

impl ClusterAuthority {
    /// A new CA with a fresh key (ECDSA P-256).
    pub fn generate() -> Result<ClusterAuthority> {
        let key = KeyPair::generate().map_err(cert_error)?;
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        // A random suffix tells clusters apart in logs and certificate dumps.
        let mut tag = [0u8; 4];
        SystemRandom::new()
            .fill(&mut tag)
            .map_err(|_| NetError::Certificate("system random number generator failed".into()))?;
        name.push(DnType::CommonName, format!("rtrun cluster CA {}", hex(&tag)));
        name.push(DnType::OrganizationName, "rtrun");
        params.distinguished_name = name;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        set_validity(&mut params, CA_VALIDITY);
        params.serial_number = Some(random_serial()?);
        let cert = params.self_signed(&key).map_err(cert_error)?;
        Ok(ClusterAuthority { cert: cert.der().clone(), key })
    }

    /// The CA certificate (DER).
    pub fn cert(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    /// SHA-256 of the CA certificate, as carried in the join token.
    pub fn fingerprint(&self) -> [u8; 32] {
        fingerprint(&self.cert)
    }

    /// A certificate and fresh key for `node_name`, made locally (the head's own node).
    pub fn issue_node(
        &self,
        node_name: &str,
    ) -> Result<(CertificateDer<'static>, PrivatePkcs8KeyDer<'static>)> {
        let key = KeyPair::generate().map_err(cert_error)?;
        let cert = node_params(node_name)?.signed_by(&key, &self.issuer()?).map_err(cert_error)?;
        Ok((cert.der().clone(), PrivatePkcs8KeyDer::from(key.serialize_der())))
    }

    /// Signs the public key of a certificate signing request for `node_name`. Everything the
    /// request asks for besides its key is ignored: the head decides names, usages and validity.
    pub fn sign_request(&self, csr_der: &[u8], node_name: &str) -> Result<CertificateDer<'static>> {
        self.sign_request_valid_for(csr_der, node_name, None)
    }

    /// Like [`ClusterAuthority::sign_request`], valid for `validity` when that is shorter
    /// than a node certificate's (a short-lived client's); never longer.
    pub fn sign_request_valid_for(
        &self,
        csr_der: &[u8],
        node_name: &str,
        validity: Option<Duration>,
    ) -> Result<CertificateDer<'static>> {
        let mut request =
            CertificateSigningRequestParams::from_der(&CertificateSigningRequestDer::from(csr_der))
                .map_err(|e| NetError::Certificate(format!("certificate signing request: {e}")))?;
        request.params = node_params(node_name)?;
        if let Some(validity) = validity.filter(|v| *v < NODE_VALIDITY) {
            set_validity(&mut request.params, validity);
        }
        let cert = request.signed_by(&self.issuer()?).map_err(cert_error)?;
        Ok(cert.der().clone())
    }

    fn issuer(&self) -> Result<Issuer<'static, &KeyPair>> {
        Issuer::from_ca_cert_der(&self.cert, &self.key).map_err(cert_error)
    }
}

/// What every node (and driver) holds: the CA certificate it trusts, its own certificate and
/// key, and the join token it presents.
pub struct NodeCredentials {
    /// The cluster CA certificate.
    pub ca_cert: CertificateDer<'static>,
    /// This node's certificate, signed by the CA.
    pub cert: CertificateDer<'static>,
    /// This node's private key (PKCS#8).
    pub key: PrivatePkcs8KeyDer<'static>,
    /// The join token.
    pub token: JoinToken,
}

impl fmt::Debug for NodeCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeCredentials")
            .field("node", &node_name_of(&self.cert).unwrap_or_default())
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl Clone for NodeCredentials {
    fn clone(&self) -> NodeCredentials {
        NodeCredentials {
            ca_cert: self.ca_cert.clone(),
            cert: self.cert.clone(),
            key: self.key.clone_key(),
            token: self.token.clone(),
        }
    }
}

impl NodeCredentials {
    /// The node name in this node's certificate (its common name).
    pub fn node_name(&self) -> Result<String> {
        node_name_of(&self.cert)
    }
}

/// A head's credentials: the CA (with its key) and the head node's own credentials.
#[derive(Debug)]
pub struct HeadCredentials {
    /// The cluster CA (shared with the endpoint, which signs bootstrap requests).
    pub authority: Arc<ClusterAuthority>,
    /// The head node's credentials.
    pub node: NodeCredentials,
}

impl HeadCredentials {
    /// A new cluster: CA, head node certificate for `node_name`, join token.
    pub fn generate(node_name: &str) -> Result<HeadCredentials> {
        let authority = ClusterAuthority::generate()?;
        let (cert, key) = authority.issue_node(node_name)?;
        let token = JoinToken::generate(authority.fingerprint())?;
        let node = NodeCredentials { ca_cert: authority.cert().clone(), cert, key, token };
        Ok(HeadCredentials { authority: Arc::new(authority), node })
    }
}

/// A credentials directory (`0700`), its files `0600`: `ca.pem`, `ca-key.pem` (head only),
/// `node.pem`, `node-key.pem`, `token`.
#[derive(Debug, Clone)]
pub struct CredentialsDir {
    path: PathBuf,
}

impl CredentialsDir {
    /// The directory at `path` (not created until something is saved).
    pub fn new(path: impl Into<PathBuf>) -> CredentialsDir {
        CredentialsDir { path: path.into() }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The token file (what `--token-file` points at).
    pub fn token_path(&self) -> PathBuf {
        self.path.join(TOKEN_FILE)
    }

    /// The head's credentials, created and saved when the directory holds none yet. Returns
    /// whether they were created. A directory with some but not all head files is an error
    /// (never silently replaced: that would lock every node out of the cluster).
    pub fn load_or_create_head(&self, node_name: &str) -> Result<(HeadCredentials, bool)> {
        let files = [CA_CERT_FILE, CA_KEY_FILE, NODE_CERT_FILE, NODE_KEY_FILE, TOKEN_FILE];
        let present = files.iter().filter(|f| self.path.join(f).exists()).count();
        if present == 0 {
            let head = HeadCredentials::generate(node_name)?;
            self.save_head(&head)?;
            return Ok((head, true));
        }
        Ok((self.load_head()?, false))
    }

    /// Loads a head's credentials (including the CA key).
    pub fn load_head(&self) -> Result<HeadCredentials> {
        let node = self.load_node()?;
        let key_path = self.path.join(CA_KEY_FILE);
        let key_pem = self.read_private(CA_KEY_FILE, "the cluster CA key", HEAD_HINT)?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| NetError::BadCredential {
            path: key_path.clone(),
            reason: format!("expected a PEM private key: {e}"),
        })?;
        let authority = ClusterAuthority { cert: node.ca_cert.clone(), key };
        // The key must belong to the CA certificate, or every certificate it issues is refused.
        let probe = authority.issue_node("probe")?;
        crate::tls::verify_chain(&authority.cert, &probe.0).map_err(|reason| {
            NetError::BadCredential {
                path: key_path,
                reason: format!("the key does not match `{CA_CERT_FILE}`: {reason}"),
            }
        })?;
        Ok(HeadCredentials { authority: Arc::new(authority), node })
    }

    /// Saves a head's credentials.
    pub fn save_head(&self, head: &HeadCredentials) -> Result<()> {
        self.save_node(&head.node)?;
        self.write_private(CA_KEY_FILE, head.authority.key.serialize_pem().as_bytes())
    }

    /// Loads a node's credentials (CA certificate, node certificate and key, token), checking
    /// that the node certificate is signed by the CA and that the token names this CA.
    pub fn load_node(&self) -> Result<NodeCredentials> {
        let ca_cert = self.read_cert(CA_CERT_FILE, "the cluster CA certificate")?;
        let cert = self.read_cert(NODE_CERT_FILE, "this node's certificate")?;
        let key_pem = self.read_private(NODE_KEY_FILE, "this node's private key", NODE_HINT)?;
        let key = PrivatePkcs8KeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| {
            NetError::BadCredential {
                path: self.path.join(NODE_KEY_FILE),
                reason: format!("expected a PKCS#8 PEM private key: {e}"),
            }
        })?;
        let token_text = self.read_private(TOKEN_FILE, "the join token", NODE_HINT)?;
        let token: JoinToken = token_text.parse().map_err(|e: NetError| {
            NetError::BadCredential { path: self.token_path(), reason: e.to_string() }
        })?;
        if token.ca_fingerprint != fingerprint(&ca_cert) {
            return Err(NetError::BadCredential {
                path: self.token_path(),
                reason: format!(
                    "the token names CA {}, but `{CA_CERT_FILE}` is CA {}",
                    hex(&token.ca_fingerprint[..8]),
                    hex(&fingerprint(&ca_cert)[..8])
                ),
            });
        }
        crate::tls::verify_chain(&ca_cert, &cert).map_err(|reason| NetError::BadCredential {
            path: self.path.join(NODE_CERT_FILE),
            reason: format!("not signed by the cluster CA in `{CA_CERT_FILE}`: {reason}"),
        })?;
        Ok(NodeCredentials { ca_cert, cert, key, token })
    }

    /// Saves a node's credentials (creating the directory with mode `0700`).
    pub fn save_node(&self, node: &NodeCredentials) -> Result<()> {
        self.create_dir()?;
        self.write_private(CA_CERT_FILE, pem("CERTIFICATE", &node.ca_cert).as_bytes())?;
        self.write_private(NODE_CERT_FILE, pem("CERTIFICATE", &node.cert).as_bytes())?;
        self.write_private(
            NODE_KEY_FILE,
            pem("PRIVATE KEY", node.key.secret_pkcs8_der()).as_bytes(),
        )?;
        self.write_private(TOKEN_FILE, format!("{}\n", node.token).as_bytes())
    }

    fn create_dir(&self) -> Result<()> {
        fs::create_dir_all(&self.path).map_err(|e| {
            NetError::io(format!("creating credentials directory `{}`", self.path.display()), e)
        })?;
        fs::set_permissions(&self.path, fs::Permissions::from_mode(0o700)).map_err(|e| {
            NetError::io(format!("restricting `{}` to its owner", self.path.display()), e)
        })
    }

    /// Writes through a temporary file and a rename, so a crash never leaves half a key.
    fn write_private(&self, name: &str, contents: &[u8]) -> Result<()> {
        self.create_dir()?;
        let path = self.path.join(name);
        let temporary = self.path.join(format!(".{name}.tmp"));
        let context = || format!("writing `{}`", path.display());
        let _ = fs::remove_file(&temporary);
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temporary)
            .map_err(|e| NetError::io(context(), e))?;
        file.write_all(contents)
            .and_then(|()| file.sync_all())
            .map_err(|e| NetError::io(context(), e))?;
        fs::rename(&temporary, &path).map_err(|e| NetError::io(context(), e))
    }

    fn read_private(&self, name: &str, what: &'static str, hint: &'static str) -> Result<String> {
        let path = self.path.join(name);
        if !path.exists() {
            return Err(NetError::MissingCredential { path, what, hint });
        }
        check_private(&path)?;
        fs::read_to_string(&path)
            .map_err(|e| NetError::io(format!("reading `{}`", path.display()), e))
    }

    fn read_cert(&self, name: &str, what: &'static str) -> Result<CertificateDer<'static>> {
        let path = self.path.join(name);
        if !path.exists() {
            return Err(NetError::MissingCredential { path, what, hint: NODE_HINT });
        }
        let bytes = fs::read(&path)
            .map_err(|e| NetError::io(format!("reading `{}`", path.display()), e))?;
        CertificateDer::from_pem_slice(&bytes).map_err(|e| NetError::BadCredential {
            path,
            reason: format!("expected a PEM certificate: {e}"),
        })
    }
}

const HEAD_HINT: &str = "only the head's credentials directory holds the CA key; start `rtrun head` with an empty directory to create a new cluster";
const NODE_HINT: &str = "run `rtrun join --token ...` to obtain credentials from the head, or copy the head's credentials directory";

/// Refuses a secret file that others can read.
fn check_private(path: &Path) -> Result<()> {
    let metadata = fs::metadata(path)
        .map_err(|e| NetError::io(format!("inspecting `{}`", path.display()), e))?;
    let mode = metadata.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(NetError::BadCredential {
            path: path.to_path_buf(),
            reason: format!(
                "mode is {mode:04o}, expected 0600 (owner only); fix with `chmod 600 {}`",
                path.display()
            ),
        });
    }
    Ok(())
}

/// Parameters of a node certificate: the node name as common name, the cluster server name as
/// the only SAN, usable as TLS server and client.
fn node_params(node_name: &str) -> Result<CertificateParams> {
    validate_node_name(node_name)?;
    let mut params =
        CertificateParams::new(vec![CLUSTER_SERVER_NAME.to_string()]).map_err(cert_error)?;
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, node_name);
    name.push(DnType::OrganizationName, "rtrun");
    params.distinguished_name = name;
    params.extended_key_usages =
        vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    set_validity(&mut params, NODE_VALIDITY);
    params.serial_number = Some(random_serial()?);
    Ok(params)
}

/// Node names are 1 to 64 characters of `[A-Za-z0-9._-]`.
pub fn validate_node_name(node_name: &str) -> Result<()> {
    let valid_chars =
        node_name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if node_name.is_empty() || node_name.len() > MAX_NODE_NAME_LEN || !valid_chars {
        return Err(NetError::Certificate(format!(
            "node name must be 1 to {MAX_NODE_NAME_LEN} characters of [A-Za-z0-9._-], found {:?}",
            node_name.chars().take(MAX_NODE_NAME_LEN + 8).collect::<String>()
        )));
    }
    Ok(())
}

fn set_validity(params: &mut CertificateParams, validity: Duration) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - CLOCK_SKEW;
    params.not_after = now + validity;
}

fn random_serial() -> Result<SerialNumber> {
    let mut bytes = [0u8; 16];
    SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| NetError::Certificate("system random number generator failed".into()))?;
    // A positive DER integer: clear the sign bit, keep it non-zero.
    bytes[0] = (bytes[0] & 0x7f) | 0x01;
    Ok(SerialNumber::from_slice(&bytes))
}

/// The common name of a certificate, which is the node name for certificates this crate issues.
pub fn node_name_of(cert: &CertificateDer<'_>) -> Result<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| NetError::Certificate(format!("unreadable certificate: {e}")))?;
    let name = parsed
        .subject()
        .iter_common_name()
        .next()
        .ok_or_else(|| NetError::Certificate("certificate has no common name".into()))?;
    name.as_str()
        .map(str::to_string)
        .map_err(|e| NetError::Certificate(format!("certificate common name is not text: {e}")))
}

/// SHA-256 of a certificate's DER.
pub fn fingerprint(cert: &CertificateDer<'_>) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, cert.as_ref());
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

fn cert_error(error: rcgen::Error) -> NetError {
    NetError::Certificate(error.to_string())
}

fn pem(tag: &str, der: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut encoded = String::with_capacity(der.len() * 4 / 3 + 4);
    for chunk in der.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                encoded.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                encoded.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {tag}-----\n");
    for line in encoded.as_bytes().chunks(64) {
        // The alphabet is ASCII, so every 64-byte slice is valid UTF-8.
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {tag}-----\n"));
    out
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex32(text: &str, what: &str) -> Result<[u8; 32]> {
    if text.len() != 64 {
        return Err(NetError::BadToken(format!(
            "expected the {what} as 64 hex digits, found {} characters",
            text.len()
        )));
    }
    let mut out = [0u8; 32];
    for (i, pair) in text.as_bytes().chunks(2).enumerate() {
        let digits = std::str::from_utf8(pair).ok().and_then(|p| u8::from_str_radix(p, 16).ok());
        out[i] = digits.ok_or_else(|| {
            NetError::BadToken(format!(
                "expected the {what} as hex digits, found a non-hex character"
            ))
        })?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_bad_tokens_say_what_is_wrong() {
        let token = JoinToken::generate([7; 32]).unwrap();
        let parsed: JoinToken = token.to_string().parse().unwrap();
        assert_eq!(parsed, token);
        assert!(parsed.secret_matches(token.secret()));
        assert!(!parsed.secret_matches(&[0; 32]));
        assert!(!parsed.secret_matches(&token.secret()[..31]));
        assert!(!format!("{token:?}").contains(&hex(token.secret())));
        let err = "rtrun1.abc".parse::<JoinToken>().unwrap_err().to_string();
        assert!(err.contains("2 dot-separated fields"), "{err}");
        let err = format!("rtrun2.{}.{}", "0".repeat(64), "0".repeat(64))
            .parse::<JoinToken>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("expected prefix `rtrun1`"), "{err}");
        let err = format!("rtrun1.{}.{}", "z".repeat(64), "0".repeat(64))
            .parse::<JoinToken>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("non-hex"), "{err}");
    }

    #[test]
    fn token_sources_are_tried_flag_then_env_then_file() {
        let dir = tempfile::tempdir().unwrap();
        let a = JoinToken::generate([1; 32]).unwrap();
        let b = JoinToken::generate([2; 32]).unwrap();
        let c = JoinToken::generate([3; 32]).unwrap();
        let file = dir.path().join("token");
        fs::write(&file, format!("{c}\n")).unwrap();
        fs::set_permissions(&file, fs::Permissions::from_mode(0o600)).unwrap();
        let (sa, sb) = (a.to_string(), b.to_string());
        assert_eq!(JoinToken::resolve_from(Some(&sa), Some(&sb), Some(&file)).unwrap(), a);
        assert_eq!(JoinToken::resolve_from(None, Some(&sb), Some(&file)).unwrap(), b);
        assert_eq!(JoinToken::resolve_from(None, None, Some(&file)).unwrap(), c);
        assert!(matches!(JoinToken::resolve_from(None, None, None), Err(NetError::MissingToken)));
        let err = JoinToken::resolve_from(None, Some("nope"), None).unwrap_err().to_string();
        assert!(err.contains("from RTRUN_TOKEN"), "{err}");
        fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
        let err = JoinToken::resolve_from(None, None, Some(&file)).unwrap_err().to_string();
        assert!(err.contains("expected 0600"), "{err}");
    }

    #[test]
    fn head_credentials_are_created_once_saved_private_and_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let creds = CredentialsDir::new(dir.path().join("creds"));
        let (head, created) = creds.load_or_create_head("head-0").unwrap();
        assert!(created);
        assert_eq!(head.node.node_name().unwrap(), "head-0");
        for name in [CA_CERT_FILE, CA_KEY_FILE, NODE_CERT_FILE, NODE_KEY_FILE, TOKEN_FILE] {
            let mode = fs::metadata(creds.path().join(name)).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{name}");
        }
        let dir_mode = fs::metadata(creds.path()).unwrap().permissions().mode();
        assert_eq!(dir_mode & 0o777, 0o700);
        let (again, created) = creds.load_or_create_head("other").unwrap();
        assert!(!created);
        assert_eq!(again.node.token, head.node.token);
        assert_eq!(again.node.cert, head.node.cert);
        assert_eq!(again.authority.fingerprint(), head.authority.fingerprint());
        // The reloaded CA still issues certificates that chain to the saved CA certificate.
        let (cert, _) = again.authority.issue_node("n1").unwrap();
        crate::tls::verify_chain(head.authority.cert(), &cert).unwrap();
    }

    #[test]
    fn missing_and_tampered_files_are_named_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let creds = CredentialsDir::new(dir.path());
        let err = creds.load_node().unwrap_err().to_string();
        assert!(err.contains("ca.pem") && err.contains("missing"), "{err}");
        let (head, _) = creds.load_or_create_head("head").unwrap();
        fs::remove_file(dir.path().join(CA_KEY_FILE)).unwrap();
        let err = creds.load_or_create_head("head").unwrap_err().to_string();
        assert!(err.contains("ca-key.pem") && err.contains("CA key"), "{err}");
        // A node certificate from another cluster is refused.
        let other = HeadCredentials::generate("x").unwrap();
        let node = NodeCredentials { cert: other.node.cert.clone(), ..head.node.clone() };
        creds.save_node(&node).unwrap();
        let err = creds.load_node().unwrap_err().to_string();
        assert!(err.contains("node.pem") && err.contains("not signed"), "{err}");
        // A token for another CA is refused.
        let node = NodeCredentials { token: other.node.token.clone(), ..head.node.clone() };
        creds.save_node(&node).unwrap();
        let err = creds.load_node().unwrap_err().to_string();
        assert!(err.contains("token names CA"), "{err}");
        // Loose permissions on the key are refused.
        creds.save_node(&head.node).unwrap();
        fs::set_permissions(dir.path().join(NODE_KEY_FILE), fs::Permissions::from_mode(0o640))
            .unwrap();
        let err = creds.load_node().unwrap_err().to_string();
        assert!(err.contains("node-key.pem") && err.contains("0640"), "{err}");
    }

    #[test]
    fn signing_requests_get_the_heads_parameters_and_bad_names_are_refused() {
        let head = HeadCredentials::generate("head").unwrap();
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["evil.example".to_string()]).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let csr = params.serialize_request(&key).unwrap();
        let cert = head.authority.sign_request(csr.der(), "worker-1").unwrap();
        crate::tls::verify_chain(head.authority.cert(), &cert).unwrap();
        assert_eq!(node_name_of(&cert).unwrap(), "worker-1");
        assert!(head.authority.sign_request(b"garbage", "worker-1").is_err());
        assert!(head.authority.sign_request(csr.der(), "bad name/").is_err());
        assert!(head.authority.sign_request(csr.der(), "").is_err());
    }

    #[test]
    fn short_lived_client_certificates_expire_within_their_validity_and_never_exceed_a_nodes() {
        let head = HeadCredentials::generate("head").unwrap();
        let key = KeyPair::generate().unwrap();
        let csr = CertificateParams::default().serialize_request(&key).unwrap();
        let not_after = |validity: Option<Duration>| {
            let cert = head.authority.sign_request_valid_for(csr.der(), "c", validity).unwrap();
            let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).unwrap();
            parsed.validity().not_after.timestamp()
                - time::OffsetDateTime::now_utc().unix_timestamp()
        };
        let hour = not_after(Some(Duration::from_secs(3600)));
        assert!((3500..=3700).contains(&hour), "a one-hour client certificate: {hour} s left");
        let node = not_after(None);
        assert!(node > 300 * 24 * 3600, "a node certificate: {node} s left");
        let asked_too_much = not_after(Some(NODE_VALIDITY * 10));
        assert!(asked_too_much <= node + 5, "capped at a node's validity: {asked_too_much} s");
    }
}
