//! `starling tracker`: which agent holds which pieces of which blob, who fetches from
//! the registry, which peers to hand out. State is soft: agents announce every few
//! hundred milliseconds while downloading and every second for what they seed, so a
//! restarted tracker is whole again within a second or two. It lives in this process
//! ([`store::Embedded`], the default) or, shared by several replicas, in Redis
//! ([`redis_store::RedisStore`], `--redis`); either way [`decide`] is the one path.
#![forbid(unsafe_code)]

mod access;
pub mod assignments;
pub mod cluster_glue;
mod decide;
mod member_entry;
mod redis_cluster;
mod redis_inventory;
mod redis_members;
pub mod redis_store;
mod server;
mod size_wait;
pub mod store;
pub mod tls;

pub use access::Caller;
pub use redis_store::RedisOptions;
pub use server::ServerLimits;
pub use tls::{CertResponse, JoinRequest, RenewRequest, TlsOptions, TrackerTls};

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use http::StatusCode;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use serde::{Deserialize, Serialize};
use swarm::{AnnounceRequest, Role, SwarmConfig, TrackerState};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot serve on {addr}: {source}")]
    Serve {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cluster TLS: {what}: {source}")]
    Pki {
        what: &'static str,
        source: pki::Error,
    },
    /// The `--redis` URL does not parse (or names an unsupported scheme).
    #[error("redis URL {url}: {source}")]
    RedisUrl {
        url: String,
        source: redis::RedisError,
    },
    /// A Redis call failed: unreachable, timed out, or an answer of the wrong shape.
    #[error("redis {what}: {source}")]
    Redis {
        what: &'static str,
        source: redis::RedisError,
    },
    /// Two replicas changed one swarm at the same moment; asking again settles it.
    #[error("shared state of {digest}: {what}")]
    Conflict { digest: String, what: &'static str },
    /// The announce itself is invalid (geometry, sizes, names).
    #[error(transparent)]
    Announce(swarm::Error),
}

impl Error {
    /// Whether the same request may succeed later or at another replica (the agent
    /// moves on to the next tracker), as opposed to a request that is wrong.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Redis { .. } | Error::Conflict { .. } => true,
            Error::Serve { .. } | Error::Pki { .. } | Error::RedisUrl { .. } => false,
            Error::Announce(_) => false,
        }
    }

    /// The HTTP answer for this error: 503 (retry, elsewhere) while the shared state is
    /// out of reach, never an answer computed without it.
    pub(crate) fn response(&self) -> Response {
        let status = match self {
            Error::Announce(_) => StatusCode::BAD_REQUEST,
            e if e.is_retryable() => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let mut resp = (
            status,
            Json(serde_json::json!({ "error": self.to_string() })),
        )
            .into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("1"),
            );
        }
        resp
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
    status: u16,
}

/// A fixed reason or outcome label (`pki::Error::reason`, join outcomes).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabels {
    pub reason: &'static str,
}

pub struct Metrics {
    pub registry: prometheus_client::registry::Registry,
    requests: Family<RouteLabels, Counter>,
    latency: Histogram,
    swarms: Gauge,
    peers: Gauge,
    elections: Gauge,
    connections_refused: Counter,
    connections_open: Gauge,
    tls_handshakes_refused: Family<ReasonLabels, Counter>,
    joins: Family<ReasonLabels, Counter>,
    /// Redis reachability and failed calls by operation (`--redis`).
    redis: redis_store::RedisMetrics,
    /// Decisions of this replica the shared store overruled (an election another
    /// replica won, a geometry set elsewhere at the same moment).
    store_conflicts: Counter,
    /// Sources demoted because the members fetching could not reach them.
    source_demotions: Counter,
    /// Announces held until their swarm's size is known (`size_wait`).
    announces_waiting_for_size: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = prometheus_client::registry::Registry::with_prefix("starling_tracker");
        let requests = Family::<RouteLabels, Counter>::default();
        let latency = Histogram::new(exponential_buckets(0.00005, 2.0, 16));
        let (swarms, peers, elections) = (Gauge::default(), Gauge::default(), Gauge::default());
        registry.register(
            "requests",
            "Tracker HTTP requests by route and status",
            requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Tracker request handling time",
            latency.clone(),
        );
        registry.register("swarms", "Blobs with at least one peer", swarms.clone());
        registry.register(
            "swarm_peers",
            "Peer entries across all swarms",
            peers.clone(),
        );
        registry.register(
            "source_elections",
            "Registry fetchers elected (current swarms)",
            elections.clone(),
        );
        let (connections_refused, connections_open) = (Counter::default(), Gauge::default());
        registry.register(
            "connections_refused",
            "Connections closed as they arrived because max_connections were open",
            connections_refused.clone(),
        );
        registry.register(
            "connections_open",
            "Client connections being served",
            connections_open.clone(),
        );
        let tls_handshakes_refused = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "tls_handshakes_refused",
            "TLS handshakes that failed, by reason (expired, unknown_ca, timeout, ...)",
            tls_handshakes_refused.clone(),
        );
        let joins = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "joins",
            "Join requests by outcome (issued, rate_limited, bad_token, name_not_allowed, ...)",
            joins.clone(),
        );
        let redis = redis_store::RedisMetrics::default();
        registry.register(
            "redis_up",
            "1 while the shared Redis answers (--redis; 0 in embedded mode)",
            redis.up.clone(),
        );
        registry.register(
            "redis_errors",
            "Failed Redis calls by operation (load, commit, hashes, elections, ping, decode)",
            redis.errors.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the Redis janitor lease (one replica at a time)",
            redis.leader.clone(),
        );
        registry.register(
            "prewarm_leader",
            "1 while this replica holds the Redis prewarm planner lease (one replica at a time)",
            redis.prewarm_leader.clone(),
        );
        registry.register(
            "redis_member_reads",
            "Reads of a swarm's members from Redis by kind: changes (only what changed since \
             the last read) or full (start, stream trimmed past the last read, safety net)",
            redis.member_reads.clone(),
        );
        registry.register(
            "redis_inventory_reads",
            "Reads of the shared inventory by kind: changes (reports changed since the last \
             read, every second) or sweep (the whole index: heartbeats, start, safety net)",
            redis.inventory_reads.clone(),
        );
        let store_conflicts = Counter::default();
        registry.register(
            "store_conflicts",
            "Decisions the shared store overruled: an election another replica won, a \
             geometry set elsewhere at the same moment",
            store_conflicts.clone(),
        );
        let source_demotions = Counter::default();
        registry.register(
            "source_demotions",
            "Registry fetchers demoted because the members still fetching reported they \
             could not reach them (check the node's --advertise)",
            source_demotions.clone(),
        );
        let announces_waiting_for_size = Gauge::default();
        registry.register(
            "announces_waiting_for_size",
            "Announces held until the source has announced the blob's size",
            announces_waiting_for_size.clone(),
        );
        Self {
            redis,
            store_conflicts,
            source_demotions,
            announces_waiting_for_size,
            registry,
            requests,
            latency,
            swarms,
            peers,
            elections,
            connections_refused,
            connections_open,
            tls_handshakes_refused,
            joins,
        }
    }
}

#[derive(Clone)]
pub struct Tracker {
    pub state: Arc<Mutex<TrackerState>>,
    pub metrics: Arc<Metrics>,
    token: Option<Arc<str>>,
    /// The cluster layer (inventory, prewarm, extender, dashboard), when enabled.
    pub cluster: Option<cluster::ClusterState>,
    limits: ServerLimits,
    /// Cluster TLS: HTTPS, client certificates and the role table instead of the
    /// bearer token.
    tls: Option<TrackerTls>,
    /// Prewarm assignments waiting for their nodes to collect them.
    mailboxes: assignments::Mailboxes,
    /// Where the swarm state replicas share lives: this process, or Redis.
    store: Arc<dyn store::SwarmStore>,
    size_waiters: Arc<size_wait::SizeWaiters>,
}

/// A batch of complete blobs an agent seeds, re-sent every second.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SeedingRequest {
    pub node: String,
    pub addr: String,
    #[serde(default)]
    pub topology: swarm::Topology,
    pub blobs: Vec<SeedBlob>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SeedBlob {
    pub digest: oci::Digest,
    pub size: u64,
}

impl Tracker {
    pub fn new(cfg: SwarmConfig, token: Option<String>) -> Self {
        let metrics = Arc::new(Metrics::default());
        let size_waiters = Arc::new(size_wait::SizeWaiters::new(
            metrics.announces_waiting_for_size.clone(),
        ));
        Self {
            state: Arc::new(Mutex::new(TrackerState::new(cfg))),
            metrics,
            size_waiters,
            token: token.map(Into::into),
            cluster: None,
            limits: ServerLimits::default(),
            tls: None,
            mailboxes: assignments::Mailboxes::default(),
            store: Arc::new(store::Embedded::default()),
        }
    }

    /// Share the swarm state with other replicas through Redis (`--redis`).
    pub fn with_redis(mut self, opts: &RedisOptions) -> Result<Self, Error> {
        let ttl = Duration::from_millis(self.state.lock().cfg.peer_ttl_ms);
        let redis = redis_store::RedisStore::connect(opts, ttl, self.metrics.redis.clone())?;
        redis.spawn_health();
        redis.spawn_janitor();
        if let Some(c) = &self.cluster {
            // Inventory, prewarm jobs and mailboxes in Redis too: any replica answers
            // `starling nodes`, `where` and job status alike, and one plans.
            redis_cluster::share_cluster(&redis, c);
            self.mailboxes = assignments::Mailboxes::shared(redis.clone());
        }
        self.store = redis;
        Ok(self)
    }

    /// Serve HTTPS with the cluster certificate, require client certificates and apply
    /// the role table ([`access`]). The bearer token, if any, is no longer checked: it
    /// is the plain-HTTP mode's authentication.
    pub fn with_tls(mut self, mut tls: TrackerTls) -> Self {
        tls.join_outcomes = self.metrics.joins.clone();
        self.token = None;
        self.tls = Some(tls);
        self
    }

    /// Whether an announce may be held open (`size_wait`): only while at most half the
    /// connection cap is in use, so that held joins at the start of a large pull never
    /// crowd out new connections; beyond it the agents ask again as they would of a
    /// tracker that does not hold.
    fn may_hold_a_connection(&self) -> bool {
        let open = self.metrics.connections_open.get().max(0) as usize;
        open < self.limits.max_connections / 2
    }

    pub fn with_limits(mut self, limits: ServerLimits) -> Self {
        self.limits = limits;
        self
    }

    pub fn with_cluster(mut self, state: cluster::ClusterState) -> Self {
        self.cluster = Some(state);
        self
    }

    /// Routes for agents (`/swarm/v1/...`, token-protected) and operators.
    pub fn router(&self) -> Router {
        let protected = Router::new()
            .route("/swarm/v1/announce", axum::routing::post(announce))
            .route("/swarm/v1/seeding", axum::routing::post(seeding))
            .route("/swarm/v1/hashes", axum::routing::get(hashes))
            .layer(axum::middleware::from_fn_with_state(self.clone(), auth));
        let mut router: Router = Router::new()
            .merge(protected)
            .route("/swarm/v1/swarms", axum::routing::get(swarms))
            .route("/metrics", axum::routing::get(metrics))
            .route("/healthz", axum::routing::get(healthz))
            .route("/readyz", axum::routing::get(healthz))
            .with_state(self.clone());
        if let Some(c) = &self.cluster {
            router = router.merge(cluster::router(c.clone())).merge(
                Router::new()
                    .route(
                        "/api/v1/prewarm/{id}/nodes/{node}",
                        axum::routing::post(cluster_glue::node_update),
                    )
                    .with_state(c.clone()),
            );
            // Agents collect their assignments (the tracker never connects to them).
            router = router.merge(
                Router::new()
                    .route(
                        "/api/v1/assignments",
                        axum::routing::get(assignments::collect),
                    )
                    .with_state(self.mailboxes.clone())
                    .layer(axum::middleware::from_fn_with_state(self.clone(), auth)),
            );
        }
        if let Some(tls) = &self.tls {
            router = router
                .merge(
                    Router::new()
                        .route("/certs/v1/join", axum::routing::post(tls::join))
                        .route("/certs/v1/renew", axum::routing::post(tls::renew))
                        .with_state(tls.clone()),
                )
                .layer(axum::middleware::from_fn(access::authorize));
        }
        router.layer(axum::middleware::from_fn_with_state(self.clone(), observe))
    }

    /// Expires stale peers periodically; call once after creating the tracker.
    pub fn spawn_expiry(&self) {
        let t = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                let now = t.store.now_ms();
                t.state.lock().expire(now);
            }
        });
    }

    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), Error> {
        let addr = listener.local_addr().map_err(|e| Error::Serve {
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            source: e,
        })?;
        if self.tls.is_some() {
            tracing::info!(%addr, "tracker listening (HTTPS, client certificates)");
        } else {
            // Loud on purpose: this mode is for tests and trusted lab networks.
            tracing::warn!(
                %addr,
                "tracker listening on PLAIN HTTP: INSECURE. Traffic is unencrypted and nodes \
                 are not authenticated (at most a shared bearer token); use --pki DIR for \
                 cluster TLS"
            );
        }
        self.spawn_expiry();
        if let Some(tls) = &self.tls {
            tls.spawn_renewal();
        }
        if let Some(c) = &self.cluster {
            assignments::spawn_planner(c.clone(), self.mailboxes.clone());
        }
        let gauges = server::Gauges {
            handshakes_refused: self.metrics.tls_handshakes_refused.clone(),
            refused: self.metrics.connections_refused.clone(),
            open: self.metrics.connections_open.clone(),
        };
        server::serve(
            listener,
            self.router(),
            shutdown,
            self.limits.clone(),
            gauges,
            self.tls.clone(),
        )
        .await;
        Ok(())
    }
}

async fn auth(State(t): State<Tracker>, req: Request, next: Next) -> Response {
    if let Some(want) = &t.token {
        let given = req
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !pki::secrets_equal(given.as_bytes(), want.as_bytes()) {
            return (
                StatusCode::UNAUTHORIZED,
                Json(serde_json::json!({"error": "missing or wrong cluster token"})),
            )
                .into_response();
        }
    }
    next.run(req).await
}

/// Paths counted under their own name in the request metric; everything else is
/// "other", so request paths cannot grow the label set.
const METRIC_ROUTES: &[&str] = &[
    "/swarm/v1/announce",
    "/swarm/v1/seeding",
    "/swarm/v1/swarms",
    "/metrics",
    "/healthz",
    "/readyz",
];

async fn observe(State(t): State<Tracker>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = METRIC_ROUTES
        .iter()
        .find(|r| **r == req.uri().path())
        .map_or("other", |r| *r)
        .to_owned();
    // A request (its body included) that outlives this is dropped: a client feeding a
    // body one byte at a time must not hold a handler, or a report's memory, forever.
    let resp = match tokio::time::timeout(t.limits.request_timeout, next.run(req)).await {
        Ok(r) => r,
        Err(_) => (
            StatusCode::REQUEST_TIMEOUT,
            Json(serde_json::json!({"error": "request took too long"})),
        )
            .into_response(),
    };
    t.metrics.latency.observe(started.elapsed().as_secs_f64());
    t.metrics
        .requests
        .get_or_create(&RouteLabels {
            route,
            status: resp.status().as_u16(),
        })
        .inc();
    resp
}

async fn announce(
    State(t): State<Tracker>,
    node: Option<axum::Extension<cluster::http::AuthenticatedNode>>,
    Json(req): Json<AnnounceRequest>,
) -> Response {
    if let Some(refused) = access::refuse_other_node(node.as_deref(), &req.node) {
        return refused;
    }
    let wait = Duration::from_millis(req.wait_for_size_ms.into()).min(size_wait::MAX_SIZE_WAIT);
    let deadline = Instant::now() + wait;
    // Taken before the first decision, and each wake-up armed before its decision: a
    // size decided in between wakes the held answer at once.
    let watch = (!wait.is_zero() && req.size.is_none()).then(|| t.size_waiters.watch(&req.digest));
    loop {
        let armed = watch.as_ref().map(|w| w.arm());
        let answer = decide::decide(&t, std::slice::from_ref(&req), true)
            .await
            .and_then(|mut answers| {
                answers.pop().unwrap_or_else(|| {
                    Err(Error::Conflict {
                        digest: req.digest.to_string(),
                        what: "no answer",
                    })
                })
            });
        match (answer, &watch, armed) {
            (Ok(r), Some(watch), Some(armed))
                if r.role == Role::Peer
                    && r.size.is_none()
                    && Instant::now() < deadline
                    && t.may_hold_a_connection() =>
            {
                watch.wait(armed).await;
            }
            (Ok(r), ..) => {
                if req.size.is_some() {
                    t.size_waiters.size_known(&req.digest);
                }
                return Json(r).into_response();
            }
            (Err(e), ..) => return e.response(),
        }
    }
}

/// Ready when the shared state answers (always, embedded): `/healthz` and `/readyz`.
async fn healthz(State(t): State<Tracker>) -> Response {
    if t.store.healthy() {
        "ok".into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ t.store.kind(): "unreachable" })),
        )
            .into_response()
    }
}

#[derive(Deserialize)]
struct HashesQuery {
    digest: oci::Digest,
    #[serde(default)]
    from: u32,
}

/// Piece hashes the elected source published, for downloaders holding pieces they
/// cannot verify yet.
async fn hashes(
    State(t): State<Tracker>,
    axum::extract::Query(q): axum::extract::Query<HashesQuery>,
) -> Response {
    // Through the copy: it holds what the store has and what this replica saw before
    // a store that lost its data came back (hashes stay true for their geometry).
    let digests = [q.digest.clone()];
    match t.store.load(&digests, store::Refresh::WhenDue).await {
        Ok(shared) => {
            let now = t.store.now_ms();
            let mut st = t.state.lock();
            if let Some(Some(s)) = shared.into_iter().next() {
                st.adopt(&q.digest, s, now);
            }
            Json(st.hashes(&q.digest, q.from)).into_response()
        }
        Err(e) => e.response(),
    }
}

async fn seeding(
    State(t): State<Tracker>,
    node: Option<axum::Extension<cluster::http::AuthenticatedNode>>,
    Json(req): Json<SeedingRequest>,
) -> Response {
    if let Some(refused) = access::refuse_other_node(node.as_deref(), &req.node) {
        return refused;
    }
    let batch: Vec<AnnounceRequest> = req
        .blobs
        .iter()
        .take(100_000)
        .map(|b| {
            let mut a = AnnounceRequest::new(&req.node, &req.addr, &req.topology, &b.digest);
            a.size = Some(b.size);
            a.complete = true;
            a.known_hashes = u32::MAX;
            a
        })
        .collect();
    // A seeder with a bad entry (another size than the swarm's) is skipped.
    match decide::decide(&t, &batch, false).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.response(),
    }
}

/// The swarms this replica knows, with elections counted across all replicas.
async fn swarms(State(t): State<Tracker>) -> Response {
    let digests: Vec<oci::Digest> = t
        .state
        .lock()
        .stats()
        .iter()
        .filter_map(|s| s.digest.parse().ok())
        .collect();
    // Members as the store has them (a replica's copy only sees its own announces
    // between refreshes).
    match t.store.load(&digests, store::Refresh::WhenDue).await {
        Ok(shared) => {
            let now = t.store.now_ms();
            let mut st = t.state.lock();
            for (d, s) in digests.iter().zip(shared) {
                if let Some(s) = s {
                    st.adopt(d, s, now);
                }
            }
        }
        Err(e) => return e.response(),
    }
    let mut stats = t.state.lock().stats();
    if digests.len() == stats.len() {
        match t.store.elections(&digests).await {
            Ok(Some(all)) => {
                for (s, e) in stats.iter_mut().zip(all) {
                    s.source_elections = e.count;
                    s.elected = e.elected;
                }
            }
            Ok(None) => {}
            Err(e) => return e.response(),
        }
    }
    Json(stats).into_response()
}

async fn metrics(State(t): State<Tracker>) -> Response {
    {
        let stats = t.state.lock().stats();
        t.metrics.swarms.set(stats.len() as i64);
        t.metrics
            .peers
            .set(stats.iter().map(|s| s.peers as i64).sum());
        t.metrics
            .elections
            .set(stats.iter().map(|s| s.source_elections as i64).sum());
    }
    let mut out = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut out, &t.metrics.registry);
    if let Some(c) = &t.cluster {
        // Both registries in one exposition: cut our `# EOF` and let the fragment end it.
        if let Some(body) = out.strip_suffix("# EOF\n") {
            out = format!("{body}{}# EOF\n", c.encode_metrics_fragment());
        }
    }
    (
        [(
            http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        out,
    )
        .into_response()
}
