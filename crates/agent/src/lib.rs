//! The node agent: an OCI registry mirror that containerd, Docker and skopeo pull
//! through. Requests are answered from the local store when possible; misses are
//! fetched once from the upstream (single flight) and streamed to every waiting client
//! while they arrive.
#![forbid(unsafe_code)]

mod blob;
mod cluster;
pub mod config;
mod fetch;
mod files;
mod handlers;
pub mod identity;
mod json_file;
mod manifest;
pub mod metrics;
pub mod p2p;
mod prewarm;
mod prewarm_journal;
mod registry_swarms;
pub mod routes;
mod server;
pub mod setup;
pub mod tracker_endpoints;
mod zerocopy;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use axum::Router;
use http::{header, HeaderMap, Method, StatusCode};
use oci::reference::{canonical_registry, validate_registry};
use oci::upstream::{Credentials, Upstream, UpstreamConfig};
use oci::ErrorBody;
use store::{Store, StoreConfig};
use tracing::{debug, info, warn};

pub use config::AgentConfig;
pub use handlers::error_response;
use handlers::{
    cache_handler, local_clients_only, metrics_bearer, metrics_handler, registry_handler,
    report_handler,
};
pub(crate) use handlers::{record, refuse_remote_client};
use routes::Route;

/// Turns a response builder's result into a response. A builder error (an invalid
/// header value) becomes a logged 500 with an empty body, never an empty 200 that a
/// client would take for a successful answer.
pub(crate) trait OrInternalError {
    fn or_internal_error(self) -> Response;
}

impl OrInternalError for Result<Response, http::Error> {
    fn or_internal_error(self) -> Response {
        self.unwrap_or_else(|e| {
            warn!(error = %e, "response could not be built");
            let mut r = Response::new(Body::empty());
            *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            r
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Store(#[from] store::Error),
    #[error(transparent)]
    Oci(#[from] oci::Error),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// A peer connection failed or broke the protocol; other peers or the registry
    /// can still deliver.
    #[error("peer {peer}: {message}")]
    Peer { peer: String, message: String },
    /// The tracker could not be reached or answered with an error; the agent falls
    /// back to the registry.
    #[error("tracker: {message}")]
    Tracker { message: String },
    /// A prewarm assignment that cannot be carried out or is refused; the reason goes
    /// back to the tracker as the job's failure.
    #[error("prewarm: {0}")]
    Prewarm(String),
    /// containerd (`ctr`) could not be run or refused an image.
    #[error("containerd: {0}")]
    Runtime(String),
    /// The node's cluster certificate (https:// tracker): missing, another node's,
    /// unreadable, or the join failed.
    #[error("cluster identity: {0}")]
    Identity(#[from] identity::IdentityError),
}

impl Error {
    /// Where the error came from (the parties a swarm agent talks to).
    pub fn error_source(&self) -> oci::ErrorSource {
        match self {
            Error::Config(_) | Error::Listen { .. } | Error::Runtime(_) | Error::Identity(_) => {
                oci::ErrorSource::Internal
            }
            Error::Store(e) => e.error_source(),
            Error::Oci(e) => e.error_source(),
            Error::Peer { .. } => oci::ErrorSource::Peer,
            // Assignments come from the tracker; a refused one is its request's fault.
            Error::Tracker { .. } | Error::Prewarm(_) => oci::ErrorSource::Tracker,
        }
    }

    /// Whether falling back makes sense: to another peer or the registry after a peer
    /// or tracker failure, to another source after a retryable content error. Not for
    /// configuration, identity or a refused assignment.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Peer { .. } | Error::Tracker { .. } => true,
            Error::Store(e) => e.is_retryable(),
            Error::Oci(e) => e.is_retryable(),
            Error::Config(_)
            | Error::Listen { .. }
            | Error::Prewarm(_)
            | Error::Runtime(_)
            | Error::Identity(_) => false,
        }
    }
}

/// Reads a response body, refusing more than `max` bytes (network input is bounded
/// before it is buffered).
pub(crate) async fn read_bounded(r: reqwest::Response, max: usize) -> Result<Vec<u8>, Error> {
    use futures::StreamExt;
    if r.content_length().is_some_and(|n| n > max as u64) {
        return Err(Error::Tracker {
            message: format!(
                "answer of {} bytes exceeds {max}",
                r.content_length().unwrap_or(0)
            ),
        });
    }
    let mut out = Vec::new();
    let mut body = r.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| Error::Tracker {
            message: e.to_string(),
        })?;
        if out.len() + chunk.len() > max {
            return Err(Error::Tracker {
                message: format!("answer exceeds {max} bytes"),
            });
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

#[derive(Clone)]
pub struct Agent {
    pub cfg: Arc<AgentConfig>,
    pub store: Store,
    pub upstream: Upstream,
    pub metrics: Arc<metrics::Metrics>,
    /// Present when a tracker is configured.
    pub p2p: Option<Arc<p2p::P2p>>,
    /// The node's download limit: every byte this agent fetches pays it, from peers
    /// or the registry, with a tracker or without.
    pub(crate) download_limit: Option<Arc<ratelimit::TokenBucket>>,
    /// The peer listener, bound in `new` so its address can be advertised, served by
    /// `serve`.
    peer_listener: Arc<parking_lot::Mutex<Option<std::net::TcpListener>>>,
    /// Blobs whose download ran the disk full, until when to stream them uncached, so
    /// clients resuming after the failure do not start another doomed download.
    pub(crate) uncacheable:
        Arc<parking_lot::Mutex<std::collections::HashMap<oci::Digest, std::time::Instant>>>,
    /// Files fetched through `/files/v1/fetch`, for the inventory.
    pub(crate) files: Arc<files::index::FileIndex>,
    /// The sizes manifests this agent served declared for their blobs.
    pub(crate) declared_sizes: Arc<parking_lot::Mutex<fetch::DeclaredSizes>>,
    /// Blobs asked for through registries only a wildcard admits, for seeding their
    /// swarms.
    pub(crate) registry_swarms: Arc<registry_swarms::RegistrySwarms>,
    /// Prewarm assignments taken and not yet settled with a tracker.
    pub(crate) prewarm_jobs: Arc<prewarm_journal::PrewarmJournal>,
}

impl Agent {
    pub fn new(cfg: AgentConfig) -> Result<Self, Error> {
        let mut store_cfg = StoreConfig::new(&cfg.cache_dir);
        store_cfg.budget_bytes = cfg.cache_budget.bytes();
        store_cfg.min_free_bytes = cfg.min_free.bytes();
        store_cfg.preallocate_from = if cfg.preallocate {
            0
        } else {
            cfg.preallocate_from.bytes()
        };
        store_cfg.high_watermark = cfg.gc_high_watermark;
        store_cfg.low_watermark = cfg.gc_low_watermark;
        cfg.validate()?;
        if cfg
            .tracker
            .as_deref()
            .is_some_and(|t| t.starts_with("http://"))
        {
            warn!("insecure plain-HTTP cluster mode (--insecure-plain-http): tracker and peer traffic are unencrypted");
        }
        let mut up = UpstreamConfig {
            connect_timeout: cfg.connect_timeout,
            stall_timeout: cfg.stall_timeout,
            docker_config: cfg.docker_config.clone(),
            ..Default::default()
        };
        for (name, r) in &cfg.registries {
            let reg = canonical_registry(name);
            if let Some(ep) = &r.endpoint {
                up.endpoints.insert(reg.clone(), ep.clone());
            }
            let tls = r.tls();
            if !tls.is_default() {
                up.tls.insert(reg.clone(), tls);
            }
            if let (Some(u), Some(p)) = (&r.username, &r.password) {
                up.credentials.insert(
                    reg.clone(),
                    Credentials {
                        username: u.clone(),
                        password: p.clone(),
                    },
                );
            }
        }
        up.policy = Some(config::registry_policy(&cfg)?);
        up.file_origins = cfg.allowed_file_origins.clone();
        let store = Store::open(store_cfg)?;
        let upstream = Upstream::new(up)?;
        let mut metrics = metrics::Metrics::default();
        let download_limit = cfg
            .download_limit
            .map(|rate| Arc::new(ratelimit::TokenBucket::new(rate.bytes())));
        let (peer_listener, advertised) = match &cfg.tracker {
            Some(_) => {
                let (l, a) = bind_peer_listener(&cfg)?;
                (Some(l), a)
            }
            None => (None, String::new()),
        };
        let p2p = p2p::P2p::from_config(
            &cfg,
            advertised,
            download_limit.clone(),
            &mut metrics.registry,
        )?;
        let metrics = Arc::new(metrics);
        let files = Arc::new(files::index::FileIndex::open(&cfg.cache_dir));
        let registry_swarms = Arc::new(registry_swarms::RegistrySwarms::open(&cfg.cache_dir));
        let prewarm_jobs = Arc::new(prewarm_journal::PrewarmJournal::open(&cfg.cache_dir));
        let agent = Self {
            files,
            registry_swarms,
            prewarm_jobs,
            cfg: Arc::new(cfg),
            store,
            upstream,
            metrics,
            p2p,
            download_limit,
            peer_listener: Arc::new(parking_lot::Mutex::new(peer_listener)),
            uncacheable: Default::default(),
            declared_sizes: Default::default(),
        };
        agent.refresh_cache_gauges();
        Ok(agent)
    }

    pub fn router(&self) -> Router {
        // The node's own views (metrics, cache, inventory report) are for this host:
        // remote readers get them through the tracker or `metrics_listen`.
        let local_only = Router::new()
            .route("/metrics", axum::routing::get(metrics_handler))
            .route("/api/v1/cache", axum::routing::get(cache_handler))
            .route("/api/v1/report", axum::routing::get(report_handler))
            .route(
                "/files/v1/fetch",
                axum::routing::get(files::files_handler).head(files::files_handler),
            )
            .route_layer(axum::middleware::from_fn(local_clients_only));
        Router::new()
            .merge(local_only)
            .route("/healthz", axum::routing::get(|| async { "ok" }))
            .fallback(registry_handler)
            .with_state(self.clone())
    }

    /// The `metrics_listen` listener's routes: `/metrics` (behind `metrics_token` when
    /// set) and `/healthz`, nothing else.
    fn metrics_router(&self) -> Router {
        Router::new()
            .route(
                "/metrics",
                axum::routing::get(metrics_handler).route_layer(
                    axum::middleware::from_fn_with_state(self.clone(), metrics_bearer),
                ),
            )
            .route("/healthz", axum::routing::get(|| async { "ok" }))
            .with_state(self.clone())
    }

    /// Binds and serves until `shutdown` resolves. Returns the bound address via `ready`.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), Error> {
        let addr = listener.local_addr().map_err(|e| Error::Listen {
            addr: self.cfg.listen,
            source: e,
        })?;
        info!(%addr, cache = %self.cfg.cache_dir.display(), "agent listening");
        let peer = self.peer_listener.lock().take();
        if let (Some(p2p), Some(l)) = (&self.p2p, peer) {
            let l = tokio::net::TcpListener::from_std(l).map_err(|e| Error::Listen {
                addr: self.cfg.listen,
                source: e,
            })?;
            info!(addr = %p2p.addr, "peer listener up");
            p2p.spawn_server(self.clone(), l);
        }
        if let Some(p2p) = &self.p2p {
            if let Some(id) = &p2p.identity {
                identity::spawn_renewal(id.clone(), p2p.http.clone(), p2p.trackers().clone());
            }
        }
        self.spawn_background();
        let limits = server::Limits {
            max_connections: self.cfg.max_connections,
            header_read_timeout: self.cfg.header_read_timeout,
            shutdown_grace: self.cfg.shutdown_grace,
            refused: self.metrics.connections_refused.clone(),
            open: self.metrics.connections_open.clone(),
        };
        let metrics_listener = match self.cfg.metrics_listen {
            None => None,
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| Error::Listen { addr, source: e })?,
            ),
        };
        let Some(metrics_listener) = metrics_listener else {
            server::serve(listener, self.router(), shutdown, limits).await;
            return Ok(());
        };
        info!(addr = %self.cfg.metrics_listen.unwrap_or(addr), token = self.cfg.metrics_token.is_some(), "metrics listener up");
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let metrics_limits = server::Limits {
            max_connections: METRICS_MAX_CONNECTIONS,
            ..limits.clone()
        };
        tokio::join!(
            server::serve(listener, self.router(), stopped(stop_rx.clone()), limits),
            server::serve(
                metrics_listener,
                self.metrics_router(),
                stopped(stop_rx),
                metrics_limits
            ),
        );
        Ok(())
    }

    fn spawn_background(&self) {
        let agent = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(30));
            loop {
                tick.tick().await;
                if let Err(e) = agent.store.flush_access() {
                    warn!(error = %e, "cannot persist access times");
                }
                match agent.store.maybe_gc() {
                    Ok(r) if r.evicted > 0 => {
                        agent.metrics.evictions.inc_by(r.evicted);
                    }
                    Ok(_) => {}
                    Err(e) => warn!(error = %e, "gc failed"),
                }
                agent.refresh_cache_gauges();
            }
        });
        let agent = self.clone();
        tokio::spawn(async move { agent.apply_pins().await });
        self.spawn_reporter();
        self.spawn_assignment_poller();
        if let Some(p2p) = self.p2p.clone() {
            let agent = self.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                let mut ticks: u64 = 0;
                loop {
                    tick.tick().await;
                    // Manifests and small blobs too, on every `SMALL_SEEDING_EVERY`th
                    // tick: the registry serves them to everyone while it can, but a
                    // node it cannot answer takes them from a holder
                    // (`Want::FromHolders`).
                    let with_small = ticks.is_multiple_of(SMALL_SEEDING_EVERY);
                    ticks += 1;
                    let swarmed =
                        |r: &store::BlobRecord| r.media_type.is_none() && r.size >= p2p.threshold;
                    let mut blobs: Vec<(store::BlobRecord, oci::Digest)> = agent
                        .store
                        .list()
                        .into_iter()
                        .filter(|(_, r)| with_small || swarmed(r))
                        .map(|(d, r)| (r, d))
                        .collect();
                    blobs.sort_by_key(|(r, _)| std::cmp::Reverse(r.last_access));
                    blobs.truncate(10_000);
                    let mut seeds: Vec<(oci::Digest, u64)> =
                        blobs.into_iter().map(|(r, d)| (d, r.size)).collect();
                    let held_size = |d: &oci::Digest| agent.store.stat(d).map(|r| r.size);
                    seeds.extend(agent.files.seeded_swarms(held_size));
                    let held_swarmed =
                        |d: &oci::Digest| held_size(d).filter(|&s| s >= p2p.threshold);
                    seeds.extend(agent.registry_swarms.seeded_swarms(held_swarmed));
                    if seeds.is_empty() {
                        continue;
                    }
                    if let Err(e) = p2p.seeding(seeds).await {
                        p2p.metrics.tracker_errors.inc();
                        debug!(error = %e, "seeding announce failed");
                    }
                }
            });
        }
    }

    /// Resolves the configured `pin` references and pins their manifests.
    pub async fn apply_pins(&self) {
        for r in &self.cfg.pin {
            let reference = match oci::ImageReference::parse(r) {
                Ok(x) => x,
                Err(e) => {
                    warn!(pin = %r, error = %e, "invalid pin reference");
                    continue;
                }
            };
            match self
                .manifest(
                    &reference.registry,
                    &reference.repository,
                    &reference.manifest_ref(),
                    None,
                )
                .await
            {
                Ok(m) => {
                    let mut roots = vec![m.digest.clone()];
                    // Pin platform manifests of an index too, so the closure reaches layers.
                    if let Ok(parsed) = oci::Manifest::parse(&m.body) {
                        for child in &parsed.manifests {
                            if self
                                .manifest(
                                    &reference.registry,
                                    &reference.repository,
                                    &oci::ManifestRef::Digest(child.digest.clone()),
                                    None,
                                )
                                .await
                                .is_ok()
                            {
                                roots.push(child.digest.clone());
                            }
                        }
                    }
                    for d in &roots {
                        if let Err(e) = self.store.pin(d, None, &format!("config pin {r}")) {
                            warn!(pin = %r, error = %e, "cannot pin");
                        }
                    }
                    // Node preload: the pinned image's layers are fetched now, not at first use.
                    let (os, arch) = oci::media::host_platform();
                    let platform = oci::Manifest::parse(&m.body)
                        .ok()
                        .filter(|x| x.is_index())
                        .and_then(|x| x.select_platform(os, arch).map(|c| c.digest.clone()));
                    self.preload(&reference, platform.as_ref().unwrap_or(&m.digest))
                        .await;
                    info!(pin = %r, digest = %m.digest, "pinned");
                }
                Err(e) => {
                    warn!(pin = %r, error = %e, "cannot resolve pinned image; will not pin it now")
                }
            }
        }
    }

    pub(crate) fn refresh_cache_gauges(&self) {
        let u = self.store.usage();
        self.metrics.cache_bytes.set(u.used_bytes as i64);
        self.metrics.cache_budget_bytes.set(u.budget_bytes as i64);
    }

    fn registry_for(&self, ns: Option<&str>) -> Result<String, oci::Error> {
        let r = canonical_registry(ns.unwrap_or(&self.cfg.default_registry));
        validate_registry(&r)?;
        // Before the cache too: a refused registry is refused the same way every time.
        self.upstream.check_registry(&r)?;
        Ok(r)
    }
}

/// Binds the peer listener: on `peer_listen`, else on the advertised port (all
/// interfaces), else on the mirror's address with a port of the system's choosing.
/// Returns it with the `host:port` other agents are told to dial.
fn bind_peer_listener(cfg: &AgentConfig) -> Result<(std::net::TcpListener, String), Error> {
    let advertise = cfg.advertise.as_deref().map(|a| {
        a.trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned()
    });
    let bind: SocketAddr = match (cfg.peer_listen, &advertise) {
        (Some(a), _) => a,
        (None, Some(adv)) => {
            let port = adv
                .rsplit_once(':')
                .and_then(|(_, p)| p.parse::<u16>().ok())
                .ok_or_else(|| Error::Config(format!("advertise {adv:?} is not host:port")))?;
            SocketAddr::from(([0, 0, 0, 0], port))
        }
        (None, None) => SocketAddr::new(cfg.listen.ip(), 0),
    };
    let l = std::net::TcpListener::bind(bind).map_err(|e| Error::Listen {
        addr: bind,
        source: e,
    })?;
    l.set_nonblocking(true).map_err(|e| Error::Listen {
        addr: bind,
        source: e,
    })?;
    let local = l.local_addr().map_err(|e| Error::Listen {
        addr: bind,
        source: e,
    })?;
    let advertised = advertise.unwrap_or_else(|| local.to_string());
    Ok((l, advertised))
}

/// Seeding ticks (1 s each) per announce of the manifests and small blobs held. The
/// tracker hands a holder out for its peer TTL (5 s) after its last announce, so every
/// 3 s keeps them handed out with a margin. 30 of them per agent cost a tracker with
/// 1,000 agents 0.70 → 1.07 cores sent every second, 0.71 → 0.81–0.89 every 3 s
/// (`starling bench tracker --seeded-small 30`, BENCHMARKS.md).
pub const SMALL_SEEDING_EVERY: u64 = 3;

/// Scrapers at once on `metrics_listen`: a handful is normal, and the cap keeps a flood
/// there from taking descriptors the mirror needs.
const METRICS_MAX_CONNECTIONS: usize = 64;

#[cfg(test)]
mod response_tests {
    use super::*;

    #[test]
    fn a_response_that_cannot_be_built_is_a_500_not_an_empty_200() {
        let bad = Response::builder()
            .header("X-Bad", "line\nbreak")
            .body(Body::empty())
            .or_internal_error();
        assert_eq!(bad.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let good = Response::builder()
            .status(StatusCode::PARTIAL_CONTENT)
            .body(Body::empty())
            .or_internal_error();
        assert_eq!(good.status(), StatusCode::PARTIAL_CONTENT);
    }
}
