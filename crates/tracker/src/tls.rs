//! The tracker's cluster TLS (`starling tracker --pki DIR`): its own certificate, issued
//! at start from the cluster CA for its names and addresses, the acceptor that asks
//! clients for certificates, and the two certificate endpoints: `POST /certs/v1/join`
//! (bootstrap token + CSR → node certificate) and `POST /certs/v1/renew` (over mutual
//! TLS: CSR → a new certificate for the same node).

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use http::StatusCode;
use pki::tokio_rustls::TlsAcceptor;
use pki::{BootstrapKey, CertRequest, CertSource, ClusterCa, Identity, Role};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::access::Caller;
use crate::Error;

/// What `--pki` and its companion flags say.
#[derive(Clone, Debug)]
pub struct TlsOptions {
    /// The PKI directory: `ca.crt`, `ca.key`, `bootstrap.key` (`starling certs init`).
    pub pki_dir: PathBuf,
    /// The name in the tracker's identity, `starling:tracker:<name>`.
    pub name: String,
    /// DNS names and IP addresses the tracker certificate is valid for, beyond
    /// `localhost`, 127.0.0.1 and ::1 (which clients on the tracker host use).
    pub sans: Vec<String>,
    /// Lifetime of node certificates signed at join and renewal.
    pub node_cert_lifetime: Duration,
}

impl TlsOptions {
    /// Defaults for `pki_dir`: name `tracker`, no extra SANs, [`pki::DEFAULT_NODE_LIFETIME`].
    pub fn new(pki_dir: impl Into<PathBuf>) -> Self {
        TlsOptions {
            pki_dir: pki_dir.into(),
            name: "tracker".into(),
            sans: Vec::new(),
            node_cert_lifetime: pki::DEFAULT_NODE_LIFETIME,
        }
    }
}

/// The tracker's TLS state; cheap to clone.
#[derive(Clone)]
pub struct TrackerTls {
    pub(crate) acceptor: TlsAcceptor,
    ca: Arc<ClusterCa>,
    bootstrap: Arc<BootstrapKey>,
    node_cert_lifetime: Duration,
}

impl std::fmt::Debug for TrackerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackerTls")
            .field("ca", &self.ca)
            .finish_non_exhaustive()
    }
}

impl TrackerTls {
    /// Loads the CA and the bootstrap secret and issues the tracker's own certificate.
    /// The certificate is made fresh at every start and kept in memory only: the CA key
    /// is on this host anyway, so storing it would add a file to protect and a way for
    /// its SANs to go stale when the flags change.
    pub fn load(opts: &TlsOptions) -> Result<Self, Error> {
        let pki_err = |what: &'static str| move |source| Error::Pki { what, source };
        let ca = ClusterCa::load(&opts.pki_dir).map_err(pki_err("loading the cluster CA"))?;
        let bootstrap =
            BootstrapKey::load(&opts.pki_dir).map_err(pki_err("loading the bootstrap secret"))?;
        let mut request = CertRequest::new(
            Identity::tracker(opts.name.clone()).map_err(pki_err("the tracker name"))?,
        )
        .dns_name("localhost")
        .ip_address(IpAddr::from([127, 0, 0, 1]))
        .ip_address(IpAddr::from(std::net::Ipv6Addr::LOCALHOST));
        for san in &opts.sans {
            request = match san.parse::<IpAddr>() {
                Ok(ip) => request.ip_address(ip),
                Err(_) => request.dns_name(san.clone()),
            };
        }
        let issued = ca
            .issue(&request)
            .map_err(pki_err("issuing the tracker certificate"))?;
        let cert = CertSource::from_issued(&issued).map_err(pki_err("the tracker certificate"))?;
        let trust = ca.trust().map_err(pki_err("the cluster CA"))?;
        let mut config =
            pki::tracker_server_config(&cert, &trust).map_err(pki_err("the TLS configuration"))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        info!(
            identity = %issued.info().identity,
            dns = ?issued.info().dns_names,
            ips = ?issued.info().ip_addresses,
            ca_pin = %ca.pin(),
            "cluster TLS on: HTTPS with client certificates"
        );
        Ok(TrackerTls {
            acceptor: pki::acceptor(config),
            ca: Arc::new(ca),
            bootstrap: Arc::new(bootstrap),
            node_cert_lifetime: opts.node_cert_lifetime,
        })
    }
}

/// `POST /certs/v1/join`: a new node, authenticated by a bootstrap token.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JoinRequest {
    /// `stb1.…` from `starling certs token`.
    pub token: String,
    /// The node name to be certified; the token's pattern must allow it.
    pub node: String,
    /// PEM CSR; only its public key is used.
    pub csr: String,
}

/// `POST /certs/v1/renew`: a node with a valid certificate asks for a new one.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RenewRequest {
    /// PEM CSR for the new key.
    pub csr: String,
}

/// The answer to join and renew.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CertResponse {
    /// The node certificate followed by the CA certificate (PEM).
    pub cert: String,
    /// The CA certificate (PEM).
    pub ca: String,
    /// End of validity, seconds since the Unix epoch.
    pub not_after: u64,
}

fn refuse(status: StatusCode, message: impl std::fmt::Display) -> Response {
    (
        status,
        Json(serde_json::json!({ "error": message.to_string() })),
    )
        .into_response()
}

/// HTTP status of a pki error met while handling a join or renewal.
fn status_of(e: &pki::Error) -> StatusCode {
    match e {
        pki::Error::MalformedToken(_)
        | pki::Error::TokenNotAuthentic
        | pki::Error::TokenExpired { .. }
        | pki::Error::TtlTooLong { .. } => StatusCode::UNAUTHORIZED,
        pki::Error::NameNotAllowed { .. } => StatusCode::FORBIDDEN,
        pki::Error::InvalidName { .. } | pki::Error::BadInput { .. } => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn sign(tls: &TrackerTls, csr: &str, identity: Identity) -> Result<CertResponse, pki::Error> {
    let issued = tls.ca.sign_csr(
        csr,
        &CertRequest::new(identity).lifetime(tls.node_cert_lifetime),
    )?;
    Ok(CertResponse {
        cert: issued.chain_pem(),
        ca: tls.ca.cert_pem().to_owned(),
        not_after: issued
            .info()
            .not_after
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    })
}

pub(crate) async fn join(State(tls): State<TrackerTls>, Json(req): Json<JoinRequest>) -> Response {
    // The token first: it is a cheap MAC check, and nothing else is parsed for a caller
    // that has none.
    let identity = match tls
        .bootstrap
        .verify(&req.token)
        .and_then(|claims| claims.authorize(&req.node))
    {
        Ok(identity) => identity,
        Err(e) => {
            warn!(node = %req.node, error = %e, "join refused");
            return refuse(status_of(&e), e);
        }
    };
    match sign(&tls, &req.csr, identity) {
        Ok(resp) => {
            info!(node = %req.node, "node joined: certificate issued");
            Json(resp).into_response()
        }
        Err(e) => refuse(status_of(&e), e),
    }
}

pub(crate) async fn renew(
    State(tls): State<TrackerTls>,
    caller: Option<Extension<Caller>>,
    Json(req): Json<RenewRequest>,
) -> Response {
    // The access layer let only nodes through; the identity is the certificate's, so a
    // node can renew itself and nobody else.
    let Some(identity) = caller
        .and_then(|Extension(c)| c.identity)
        .filter(|id| id.role() == Role::Node)
    else {
        return refuse(StatusCode::FORBIDDEN, "only nodes renew certificates");
    };
    let node = identity.name().to_owned();
    match sign(&tls, &req.csr, identity) {
        Ok(resp) => {
            info!(%node, "node certificate renewed");
            Json(resp).into_response()
        }
        Err(e) => refuse(status_of(&e), e),
    }
}
