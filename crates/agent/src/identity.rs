//! The node's cluster identity, for a tracker at an `https://` URL: its certificate
//! (`starling:node:<node_name>`), key and the cluster CA in `<cache_dir>/pki/`.
//!
//! - First start: [`join_if_needed`] makes a key and CSR, calls the tracker's
//!   `POST /certs/v1/join` with the bootstrap token, trusting only the CA matching the
//!   pin (kubeadm-style discovery), and stores `node.crt`, `node.key` (0600), `ca.crt`.
//! - Every start: [`load`] reads them; the tracker client presents the certificate.
//! - Running: [`spawn_renewal`] asks for a new certificate at 2/3 of its lifetime over
//!   the current mutual-TLS connection and swaps it in ([`pki::CertSource`]) without a
//!   restart. Expiry is the cluster's revocation, so a node that cannot renew drops out.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::config::AgentConfig;

/// Certificate, key and CA file names in the identity directory.
pub const NODE_CERT_FILE: &str = "node.crt";
pub const NODE_KEY_FILE: &str = "node.key";
pub const CA_FILE: &str = "ca.crt";

/// What can go wrong setting up or renewing the identity.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("{what}: {source}")]
    Pki {
        what: String,
        #[source]
        source: pki::Error,
    },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the tracker is https:// but {} holds no node certificate: start once with --join TOKEN --ca-pin sha256:… (from `starling certs token` / `certs init`)", dir.display())]
    NotJoined { dir: PathBuf },
    #[error("{} is for {found}, but this node is {expected}; remove the directory to join again", dir.display())]
    WrongNode {
        dir: PathBuf,
        expected: String,
        found: String,
    },
    #[error("joining the cluster at {url}: {message}")]
    Join { url: String, message: String },
    #[error("renewing the node certificate: {0}")]
    Renew(String),
}

fn pki_err(what: impl Into<String>) -> impl FnOnce(pki::Error) -> IdentityError {
    let what = what.into();
    move |source| IdentityError::Pki { what, source }
}

/// This node's certificate (reloadable) and the cluster CA.
#[derive(Clone, Debug)]
pub struct NodeIdentity {
    pub cert: pki::CertSource,
    pub trust: pki::ClusterTrust,
    dir: PathBuf,
}

/// Whether the agent uses cluster TLS: a tracker at an `https://` URL.
pub fn tls_tracker(cfg: &AgentConfig) -> bool {
    cfg.tracker
        .as_deref()
        .is_some_and(|t| t.starts_with("https://"))
}

/// `<cache_dir>/pki`.
pub fn identity_dir(cfg: &AgentConfig) -> PathBuf {
    cfg.cache_dir.join("pki")
}

/// The stored identity, when the tracker is `https://`; an error when it should be there
/// and is not, or is another node's.
pub fn load(cfg: &AgentConfig) -> Result<Option<NodeIdentity>, IdentityError> {
    if !tls_tracker(cfg) {
        return Ok(None);
    }
    let dir = identity_dir(cfg);
    let (cert_path, key_path) = (dir.join(NODE_CERT_FILE), dir.join(NODE_KEY_FILE));
    if !cert_path.exists() || !key_path.exists() {
        return Err(IdentityError::NotJoined { dir });
    }
    let cert = pki::CertSource::from_files(&cert_path, &key_path)
        .map_err(pki_err("loading the node certificate"))?;
    let expected = pki::Identity::node(cfg.node_name.clone())
        .map_err(pki_err("the node name (it must be a lowercase DNS name)"))?;
    if cert.identity() != expected {
        return Err(IdentityError::WrongNode {
            dir,
            expected: expected.to_string(),
            found: cert.identity().to_string(),
        });
    }
    let trust = pki::ClusterTrust::from_file(&dir.join(CA_FILE))
        .map_err(pki_err("loading the cluster CA"))?;
    Ok(Some(NodeIdentity { cert, trust, dir }))
}

/// `POST /certs/v1/join` body (the tracker's `JoinRequest`).
#[derive(Serialize)]
struct JoinRequest<'a> {
    token: &'a str,
    node: &'a str,
    csr: &'a str,
}

/// The tracker's answer to join and renew.
#[derive(Deserialize)]
struct CertResponse {
    cert: String,
}

/// Joins the cluster when the tracker is `https://`, no certificate is stored yet (or
/// the stored one has expired) and a bootstrap token and CA pin are configured.
pub async fn join_if_needed(cfg: &AgentConfig) -> Result<(), IdentityError> {
    if !tls_tracker(cfg) {
        return Ok(());
    }
    let dir = identity_dir(cfg);
    let cert_path = dir.join(NODE_CERT_FILE);
    if cert_path.exists() {
        let current = pki::CertSource::from_files(&cert_path, &dir.join(NODE_KEY_FILE));
        let expired = current
            .as_ref()
            .map_or(true, |c| c.info().not_after <= SystemTime::now());
        if !expired || cfg.join_token.is_none() {
            return Ok(());
        }
        warn!(dir = %dir.display(), "the stored node certificate has expired or is unreadable; joining again");
    }
    let (Some(token), Some(pin)) = (&cfg.join_token, &cfg.ca_pin) else {
        return Err(IdentityError::NotJoined { dir });
    };
    let pin: pki::CaPin = pin.parse().map_err(pki_err("--ca-pin"))?;
    let (config, learned) = pki::bootstrap_client_config(pin).map_err(pki_err("TLS"))?;
    let http = reqwest::Client::builder()
        .use_preconfigured_tls(config)
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| IdentityError::Join {
            url: String::new(),
            message: e.to_string(),
        })?;
    let (key_pem, csr_pem) =
        pki::generate_node_csr(&cfg.node_name).map_err(pki_err("the node name"))?;
    let trackers = crate::tracker_endpoints::TrackerEndpoints::parse(
        cfg.tracker.as_deref().unwrap_or_default(),
    )
    .map_err(|e| IdentityError::Join {
        url: String::new(),
        message: e.to_string(),
    })?;
    let body = JoinRequest {
        token,
        node: &cfg.node_name,
        csr: &csr_pem,
    };
    let r = trackers
        .send(|base| http.post(format!("{base}/certs/v1/join")).json(&body))
        .await;
    let url = format!("{}/certs/v1/join", trackers.current());
    let join_err = |message: String| IdentityError::Join {
        url: url.clone(),
        message,
    };
    let r = r.map_err(|e| join_err(error_chain(&e)))?;
    let status = r.status();
    if !status.is_success() {
        let body = r.text().await.unwrap_or_default();
        return Err(join_err(format!("{status}: {}", truncate(&body, 512))));
    }
    let answer: CertResponse = r.json().await.map_err(|e| join_err(e.to_string()))?;
    // The CA is the one the pin matched in the handshake, not what the body says.
    let ca = learned
        .trust()
        .ok_or_else(|| join_err("no CA was learned in the handshake".into()))?
        .map_err(pki_err("the learned CA"))?;
    // Check before storing: the certificate must be ours (key) and this node's.
    let cert = pki::CertSource::from_pem(&answer.cert, &key_pem)
        .map_err(pki_err("the certificate the tracker issued"))?;
    store(&dir, &answer.cert, &key_pem, Some(&ca.to_pem()))?;
    info!(identity = %cert.identity(), dir = %dir.display(), "joined the cluster");
    Ok(())
}

/// An error with its sources: reqwest's own message says only "error sending request",
/// the TLS reason (pin mismatch, unknown CA, expired) is further down.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Writes the key (0600) first, then the certificate and CA, each atomically, so a
/// reader never pairs a new certificate with an old key for longer than one rename.
fn store(dir: &Path, chain: &str, key: &str, ca: Option<&str>) -> Result<(), IdentityError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| IdentityError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io(dir))?;
    write_replace(&dir.join(NODE_KEY_FILE), key.as_bytes(), 0o600)
        .map_err(io(&dir.join(NODE_KEY_FILE)))?;
    write_replace(&dir.join(NODE_CERT_FILE), chain.as_bytes(), 0o644)
        .map_err(io(&dir.join(NODE_CERT_FILE)))?;
    if let Some(ca) = ca {
        write_replace(&dir.join(CA_FILE), ca.as_bytes(), 0o644).map_err(io(&dir.join(CA_FILE)))?;
    }
    Ok(())
}

fn write_replace(path: &Path, contents: &[u8], mode: u32) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.write_all(contents)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

/// An HTTP client for the tracker presenting this node's certificate. The certificate
/// is read at every handshake, so a renewal needs no new client.
pub fn tracker_client(id: &NodeIdentity) -> Result<reqwest::Client, IdentityError> {
    let tls = pki::tracker_client_config(&id.trust, Some(&id.cert)).map_err(pki_err("TLS"))?;
    reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .connect_timeout(Duration::from_secs(2))
        .pool_max_idle_per_host(8)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| IdentityError::Renew(format!("http client: {e}")))
}

/// Renews the certificate at 2/3 of its lifetime, for as long as the agent runs.
pub fn spawn_renewal(
    id: NodeIdentity,
    http: reqwest::Client,
    trackers: std::sync::Arc<crate::tracker_endpoints::TrackerEndpoints>,
) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(id.cert.next_check(SystemTime::now())).await;
            if !id.cert.needs_renewal(SystemTime::now()) {
                continue;
            }
            match renew(&id, &http, &trackers).await {
                Ok(info) => info!(
                    serial = %info.serial_hex(),
                    not_after = %humantime::format_rfc3339_seconds(info.not_after),
                    "node certificate renewed"
                ),
                Err(e) => {
                    warn!(error = %e, "node certificate renewal failed; retrying");
                    tokio::time::sleep(Duration::from_secs(10)).await;
                }
            }
        }
    });
}

async fn renew(
    id: &NodeIdentity,
    http: &reqwest::Client,
    trackers: &crate::tracker_endpoints::TrackerEndpoints,
) -> Result<pki::CertInfo, IdentityError> {
    let name = id.cert.identity().name().to_owned();
    let (key_pem, csr_pem) = pki::generate_node_csr(&name).map_err(pki_err("CSR"))?;
    let body = serde_json::json!({ "csr": csr_pem });
    let r = trackers
        .send(|base| {
            http.post(format!("{base}/certs/v1/renew"))
                .json(&body)
                .timeout(Duration::from_secs(10))
        })
        .await
        .map_err(|e| IdentityError::Renew(error_chain(&e)))?;
    let status = r.status();
    if !status.is_success() {
        let body = r.text().await.unwrap_or_default();
        return Err(IdentityError::Renew(format!(
            "{status}: {}",
            truncate(&body, 512)
        )));
    }
    let answer: CertResponse = r
        .json()
        .await
        .map_err(|e| IdentityError::Renew(e.to_string()))?;
    // Parse (and match against the new key) before touching the files or the live one.
    pki::CertSource::from_pem(&answer.cert, &key_pem)
        .map_err(pki_err("the renewed certificate"))?;
    store(&id.dir, &answer.cert, &key_pem, None)?;
    id.cert
        .replace_pem(&answer.cert, &key_pem)
        .map_err(pki_err("swapping in the renewed certificate"))
}
