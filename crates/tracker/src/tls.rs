//! The tracker's cluster TLS (`starling tracker --pki DIR`): its own certificate, issued
//! at start from the cluster CA for its names and addresses, the acceptor that asks
//! clients for certificates, and the two certificate endpoints: `POST /certs/v1/join`
//! (bootstrap token + CSR → node certificate) and `POST /certs/v1/renew` (over mutual
//! TLS: CSR → a new certificate for the same node).

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use http::StatusCode;
use pki::tokio_rustls::TlsAcceptor;
use pki::{BootstrapKey, CertRequest, CertSource, ClusterCa, Identity, Role};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use crate::access::Caller;
use crate::server::ClientIp;
use crate::{Error, ReasonLabels};

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
    /// Lifetime of the tracker's own server certificate; it is re-issued at 2/3 of it
    /// while the tracker runs.
    pub cert_lifetime: Duration,
    /// Join requests one client address may make a minute (and at once): a node joins
    /// once, so more is someone guessing tokens or a crash loop.
    pub joins_per_minute: u32,
}

/// Client addresses whose join budget is tracked at once (see
/// [`ratelimit::KeyedAdmission`]: beyond this, new addresses share one bucket).
const JOIN_TRACKED_ADDRESSES: usize = 16_384;

impl TlsOptions {
    /// Defaults for `pki_dir`: name `tracker`, no extra SANs, [`pki::DEFAULT_NODE_LIFETIME`].
    pub fn new(pki_dir: impl Into<PathBuf>) -> Self {
        TlsOptions {
            pki_dir: pki_dir.into(),
            name: "tracker".into(),
            sans: Vec::new(),
            node_cert_lifetime: pki::DEFAULT_NODE_LIFETIME,
            cert_lifetime: pki::DEFAULT_TRACKER_LIFETIME,
            joins_per_minute: 10,
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
    /// The tracker's own certificate, read at every handshake.
    cert: CertSource,
    /// What the tracker's certificate is issued from, again at each renewal.
    cert_request: Arc<CertRequest>,
    join_admission: Arc<ratelimit::KeyedAdmission<IpAddr>>,
    /// The clock of `join_admission`.
    started: std::time::Instant,
    /// Join outcomes, a metric family of the tracker's registry (set by `with_tls`).
    pub(crate) join_outcomes: Family<ReasonLabels, Counter>,
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
        .ip_address(IpAddr::from(std::net::Ipv6Addr::LOCALHOST))
        .lifetime(opts.cert_lifetime);
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
            cert,
            cert_request: Arc::new(request),
            join_admission: Arc::new(ratelimit::KeyedAdmission::new(
                opts.joins_per_minute,
                opts.joins_per_minute,
                JOIN_TRACKED_ADDRESSES,
            )),
            started: std::time::Instant::now(),
            join_outcomes: Family::default(),
        })
    }

    /// The certificate the tracker presents right now.
    pub fn cert_info(&self) -> pki::CertInfo {
        self.cert.info()
    }

    /// Re-issues the tracker's certificate from the cluster CA at 2/3 of its lifetime,
    /// for as long as the tracker runs: new handshakes get the new one, established
    /// connections keep theirs, and nothing restarts.
    pub(crate) fn spawn_renewal(&self) {
        let tls = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(tls.cert.next_check(SystemTime::now())).await;
                if !tls.cert.needs_renewal(SystemTime::now()) {
                    continue;
                }
                let renewed = tls.ca.issue(&tls.cert_request).and_then(|issued| {
                    let key = issued.key_pem().unwrap_or_default().to_owned();
                    tls.cert.replace_pem(&issued.chain_pem(), &key)
                });
                match renewed {
                    Ok(info) => info!(
                        serial = %info.serial_hex(),
                        not_after = %humantime::format_rfc3339_seconds(info.not_after),
                        "tracker certificate renewed"
                    ),
                    Err(e) => {
                        warn!(error = %e, "tracker certificate renewal failed; retrying");
                        tokio::time::sleep(Duration::from_secs(10)).await;
                    }
                }
            }
        });
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

pub(crate) async fn join(
    State(tls): State<TrackerTls>,
    client: Option<Extension<ClientIp>>,
    body: axum::body::Bytes,
) -> Response {
    let outcome = |reason: &'static str| {
        tls.join_outcomes
            .get_or_create(&ReasonLabels { reason })
            .inc()
    };
    // The budget first, before any parsing or token check: guessing tokens costs a
    // client its address's budget, and a flood costs the tracker a map lookup.
    if let Some(Extension(ClientIp(ip))) = client {
        if let Err(wait) = tls.join_admission.admit_at(&ip, tls.started.elapsed()) {
            outcome("rate_limited");
            debug!(client = %ip, "join refused: too many from this address");
            let mut r = refuse(
                StatusCode::TOO_MANY_REQUESTS,
                format_args!(
                    "too many join requests from {ip}; retry in {} s",
                    wait.as_secs() + 1
                ),
            );
            if let Ok(v) = http::HeaderValue::from_str(&(wait.as_secs() + 1).to_string()) {
                r.headers_mut().insert(http::header::RETRY_AFTER, v);
            }
            return r;
        }
    }
    let req: JoinRequest = match serde_json::from_slice(&body) {
        Ok(req) => req,
        Err(e) => {
            outcome("bad_request");
            return refuse(StatusCode::BAD_REQUEST, format_args!("join request: {e}"));
        }
    };
    // The token next: it is a cheap MAC check, and the CSR is not parsed for a caller
    // that has none.
    let identity = match tls
        .bootstrap
        .verify(&req.token)
        .and_then(|claims| claims.authorize(&req.node))
    {
        Ok(identity) => identity,
        Err(e) => {
            outcome(e.reason());
            warn!(node = %req.node, error = %e, "join refused");
            return refuse(status_of(&e), e);
        }
    };
    match sign(&tls, &req.csr, identity) {
        Ok(resp) => {
            outcome("issued");
            info!(node = %req.node, "node joined: certificate issued");
            Json(resp).into_response()
        }
        Err(e) => {
            outcome(e.reason());
            refuse(status_of(&e), e)
        }
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
