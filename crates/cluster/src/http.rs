//! Axum handlers. The tracker builds a [`ClusterState`], mounts [`router`] and calls
//! [`ClusterState::ingest`] / [`ClusterState::tick`] / [`ClusterState::next_assignments`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use oci::ImageReference;
use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::extender::{self, Chain, ExtenderArgs, ImageCatalog, RankRequest, ScoreConfig};
use crate::inventory::{Applied, Inventory, NodeReport, NodeStatus, ResolvedImage};
use crate::metrics::{ClusterMetrics, NodeLabels, PullLabels, StatusLabels, VerbLabels};
use crate::prewarm::{Assignment, JobStore, JobView, NodeUpdate, PrewarmRequest};

/// The dashboard page (inline JS/CSS, no external assets).
pub const DASHBOARD_HTML: &str = include_str!("../assets/dashboard.html");

/// Tracker-side settings.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// A node silent for longer becomes Unknown.
    pub node_timeout_s: u64,
    pub score: ScoreConfig,
    /// Samples kept of registry bytes saved over time.
    pub saved_history: usize,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            node_timeout_s: 60,
            score: ScoreConfig::default(),
            saved_history: 1440,
        }
    }
}

type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

#[derive(Default)]
struct Saved {
    per_node: HashMap<String, (u64, u64)>,
    total_saved: u64,
    total_registry: u64,
    series: VecDeque<(u64, u64)>,
}

struct Inner {
    inventory: RwLock<Inventory>,
    jobs: Mutex<JobStore>,
    catalog: Option<Arc<dyn ImageCatalog>>,
    metrics: ClusterMetrics,
    registry: Registry,
    config: ClusterConfig,
    clock: Clock,
    saved: Mutex<Saved>,
    last_tick: Mutex<Option<u64>>,
}

/// Shared state of the cluster layer. Cheap to clone.
#[derive(Clone)]
pub struct ClusterState {
    inner: Arc<Inner>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl ClusterState {
    /// Wall clock, image references resolved from agent reports only.
    pub fn new(config: ClusterConfig, jobs: JobStore) -> Self {
        Self::with_options(config, jobs, None, Arc::new(unix_now))
    }

    /// `catalog` is asked first (the tracker's manifests), then the inventory;
    /// `clock` returns unix seconds.
    pub fn with_options(
        config: ClusterConfig,
        jobs: JobStore,
        catalog: Option<Arc<dyn ImageCatalog>>,
        clock: Arc<dyn Fn() -> u64 + Send + Sync>,
    ) -> Self {
        let metrics = ClusterMetrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        Self {
            inner: Arc::new(Inner {
                inventory: RwLock::new(Inventory::new(config.node_timeout_s)),
                jobs: Mutex::new(jobs),
                catalog,
                metrics,
                registry,
                config,
                clock,
                saved: Mutex::new(Saved::default()),
                last_tick: Mutex::new(None),
            }),
        }
    }

    pub fn now(&self) -> u64 {
        (self.inner.clock)()
    }

    pub fn metrics(&self) -> &ClusterMetrics {
        &self.inner.metrics
    }

    /// OpenMetrics text of the cluster metrics.
    pub fn encode_metrics(&self) -> String {
        self.refresh_node_gauges(&self.inventory(), self.now());
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.inner.registry).is_err() {
            out.clear();
        }
        out
    }

    /// The cluster metrics as OpenMetrics text without the final `# EOF` line, to be
    /// inserted into another exposition before its own `# EOF`.
    pub fn encode_metrics_fragment(&self) -> String {
        let mut text = self.encode_metrics();
        if text.ends_with("# EOF\n") {
            text.truncate(text.len() - "# EOF\n".len());
        }
        text
    }

    pub fn inventory(&self) -> RwLockReadGuard<'_, Inventory> {
        self.inner.inventory.read()
    }

    /// Runs `f` with the job store locked.
    pub fn with_jobs<R>(&self, f: impl FnOnce(&mut JobStore) -> R) -> R {
        f(&mut self.inner.jobs.lock())
    }

    /// Resolves a reference: the tracker's catalog, then agent reports.
    pub fn resolve(&self, r: &ImageReference) -> Option<ResolvedImage> {
        let inv = self.inventory();
        match &self.inner.catalog {
            Some(c) => Chain(c.as_ref(), &*inv).resolve(r),
            None => inv.resolve(r),
        }
    }

    /// Takes an agent report, updates metrics and job progress.
    pub fn ingest(&self, report: NodeReport) -> Result<Applied> {
        let now = self.now();
        let m = &self.inner.metrics;
        let (saved, registry) = report.images.iter().fold((0u64, 0u64), |(s, r), i| {
            (
                s + i.bytes_by_source.saved(),
                r + i.bytes_by_source.registry,
            )
        });
        let node = report.node.clone();
        let pulls: Vec<(String, f64)> = report
            .images
            .iter()
            .filter_map(|i| {
                let name = i
                    .references
                    .first()
                    .cloned()
                    .unwrap_or_else(|| i.manifest_digest.to_string());
                i.pull_seconds.map(|s| (name, s))
            })
            .collect();
        let applied = self.inner.inventory.write().apply(report, now)?;
        if applied != Applied::Heartbeat {
            for (image, s) in pulls {
                m.pull_seconds
                    .get_or_create(&PullLabels {
                        image,
                        node: node.clone(),
                    })
                    .set(s);
            }
            let mut sv = self.inner.saved.lock();
            let prev = sv
                .per_node
                .insert(node, (saved, registry))
                .unwrap_or((0, 0));
            // Per-image figures are of the last pull; count growth only.
            let ds = saved.saturating_sub(prev.0);
            let dr = registry.saturating_sub(prev.1);
            m.registry_bytes_saved.inc_by(ds);
            m.registry_bytes.inc_by(dr);
            sv.total_saved += ds;
            sv.total_registry += dr;
            let total = sv.total_saved;
            match sv.series.back_mut() {
                Some(last) if last.0 == now => last.1 = total,
                _ => sv.series.push_back((now, total)),
            }
            while sv.series.len() > self.inner.config.saved_history.max(1) {
                sv.series.pop_front();
            }
        }
        let due = self.inner.last_tick.lock().is_none_or(|t| now > t);
        if due {
            self.tick()?;
        }
        Ok(applied)
    }

    pub fn heartbeat(&self, node: &str, generation: u64) -> Result<()> {
        let now = self.now();
        self.inner
            .inventory
            .write()
            .heartbeat(node, generation, now)
    }

    /// Node gauges (known/unknown depends on the clock, so refreshed on every scrape).
    fn refresh_node_gauges(&self, inv: &Inventory, now: u64) {
        let m = &self.inner.metrics;
        let mut known = 0;
        let mut unknown = 0;
        for e in inv.entries() {
            match inv.status_of(e, now) {
                NodeStatus::Known => known += 1,
                NodeStatus::Unknown => unknown += 1,
            }
            let labels = NodeLabels {
                node: e.report.node.clone(),
            };
            m.node_cached_bytes
                .get_or_create(&labels)
                .set(e.report.cache_used as i64);
            m.node_cache_budget_bytes
                .get_or_create(&labels)
                .set(e.report.cache_budget as i64);
        }
        m.nodes
            .get_or_create(&StatusLabels {
                status: "known".into(),
            })
            .set(known);
        m.nodes
            .get_or_create(&StatusLabels {
                status: "unknown".into(),
            })
            .set(unknown);
    }

    /// Periodic work (call every few seconds): job progress from the inventory,
    /// silent nodes, deadlines, lead times, gauges. Reports also trigger it, at most
    /// once per clock second.
    pub fn tick(&self) -> Result<()> {
        let now = self.now();
        *self.inner.last_tick.lock() = Some(now);
        let inv = self.inner.inventory.read();
        let m = &self.inner.metrics;
        self.refresh_node_gauges(&inv, now);
        let mut jobs = self.inner.jobs.lock();
        jobs.observe(&inv, now)?;
        for lead in jobs.take_lead_times(&inv)? {
            m.prewarm_lead_seconds.observe(lead);
        }
        let mut by_status: BTreeMap<String, i64> =
            ["running", "done", "completed_with_failures", "cancelled"]
                .iter()
                .map(|s| ((*s).to_owned(), 0))
                .collect();
        let mut node_states: BTreeMap<String, i64> = BTreeMap::new();
        for j in jobs.list() {
            let p = j.progress();
            let key = serde_json::to_value(p.status)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            *by_status.entry(key).or_default() += 1;
            if p.status == crate::prewarm::JobStatus::Running {
                for (s, n) in p.nodes_by_state {
                    *node_states.entry(s).or_default() += n as i64;
                }
            }
        }
        for (s, n) in by_status {
            m.prewarm_jobs
                .get_or_create(&StatusLabels { status: s })
                .set(n);
        }
        m.prewarm_nodes.clear();
        for (s, n) in node_states {
            m.prewarm_nodes
                .get_or_create(&StatusLabels { status: s })
                .set(n);
        }
        Ok(())
    }

    /// Submits a prewarm job: validates, resolves each reference to a digest now,
    /// picks targets, persists.
    pub fn submit_prewarm(&self, req: PrewarmRequest) -> Result<JobView> {
        let now = self.now();
        let refs = {
            let inv = self.inventory();
            crate::prewarm::validate(&req, &inv)?
        };
        let mut images = Vec::new();
        for (raw, r) in req.images.iter().zip(&refs) {
            let mut img = self
                .resolve(r)
                .ok_or_else(|| Error::UnknownImage(raw.clone()))?;
            img.reference = r.to_string();
            images.push(img);
        }
        let inv = self.inventory();
        let mut jobs = self.inner.jobs.lock();
        Ok(jobs.submit(req, images, &inv, now)?.view())
    }

    /// Which node should fetch what now (the tracker sends these to agents).
    pub fn next_assignments(&self) -> Result<Vec<Assignment>> {
        let now = self.now();
        let inv = self.inventory();
        self.inner.jobs.lock().next_assignments(&inv, now)
    }

    /// An agent's progress, completion or failure for a job.
    pub fn update_prewarm_node(&self, id: u64, node: &str, update: NodeUpdate) -> Result<()> {
        let now = self.now();
        self.inner.jobs.lock().update_node(id, node, update, now)
    }

    fn time<R>(&self, verb: &str, f: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let r = f();
        self.inner
            .metrics
            .extender_seconds
            .get_or_create(&VerbLabels {
                verb: verb.to_owned(),
            })
            .observe(t.elapsed().as_secs_f64());
        r
    }

    /// The `filter` verb from memory.
    pub fn filter(&self, args: &ExtenderArgs) -> extender::ExtenderFilterResult {
        let now = self.now();
        self.time("filter", || {
            let inv = self.inventory();
            match &self.inner.catalog {
                Some(c) => extender::filter(args, &inv, &Chain(c.as_ref(), &*inv), now),
                None => extender::filter(args, &inv, &*inv, now),
            }
        })
    }

    /// The `prioritize` verb from memory.
    pub fn prioritize(&self, args: &ExtenderArgs) -> Vec<extender::HostPriority> {
        let now = self.now();
        let cfg = &self.inner.config.score;
        self.time("prioritize", || {
            let inv = self.inventory();
            match &self.inner.catalog {
                Some(c) => extender::prioritize(args, &inv, &Chain(c.as_ref(), &*inv), now, cfg),
                None => extender::prioritize(args, &inv, &*inv, now, cfg),
            }
        })
    }

    pub fn rank(&self, req: &RankRequest) -> Result<extender::RankResponse> {
        let now = self.now();
        let cfg = &self.inner.config.score;
        self.time("rank", || {
            let inv = self.inventory();
            match &self.inner.catalog {
                Some(c) => extender::rank(req, &inv, &Chain(c.as_ref(), &*inv), now, cfg),
                None => extender::rank(req, &inv, &*inv, now, cfg),
            }
        })
    }

    /// Everything the dashboard draws, in one object.
    pub fn dashboard(&self) -> Dashboard {
        let now = self.now();
        let inv = self.inventory();
        let mut images: BTreeMap<String, DashImage> = BTreeMap::new();
        for e in inv.entries() {
            for i in &e.report.images {
                let key = i.manifest_digest.to_string();
                let total = i.blobs.iter().map(|b| b.size).sum();
                images.entry(key.clone()).or_insert_with(|| DashImage {
                    reference: i.references.first().cloned().unwrap_or_else(|| key.clone()),
                    manifest_digest: key,
                    total_bytes: total,
                    blobs: i.blobs.clone(),
                });
            }
        }
        let images: Vec<DashImage> = images.into_values().collect();
        let image_ids: Vec<_> = images.iter().map(|i| inv.intern_blobs(&i.blobs)).collect();
        let matrix = inv
            .entries()
            .map(|e| DashRow {
                node: e.report.node.clone(),
                status: inv.status_of(e, now),
                cache_used: e.report.cache_used,
                cache_budget: e.report.cache_budget,
                bytes: image_ids.iter().map(|ids| e.held_sum(ids)).collect(),
            })
            .collect();
        let sources = inv
            .entries()
            .map(|e| DashSources {
                node: e.report.node.clone(),
                pulls: {
                    let mut p: Vec<DashPull> = e
                        .report
                        .images
                        .iter()
                        .map(|i| DashPull {
                            reference: i
                                .references
                                .first()
                                .cloned()
                                .unwrap_or_else(|| i.manifest_digest.to_string()),
                            last_pull: i.last_pull,
                            cache: i.bytes_by_source.cache,
                            peer: i.bytes_by_source.peer,
                            registry: i.bytes_by_source.registry,
                            pull_seconds: i.pull_seconds,
                        })
                        .collect();
                    p.sort_by_key(|x| std::cmp::Reverse(x.last_pull));
                    p.truncate(5);
                    p
                },
            })
            .collect();
        let mut swarms: BTreeMap<String, DashSwarm> = BTreeMap::new();
        for e in inv.entries() {
            for d in &e.report.downloads_in_flight {
                let s = swarms
                    .entry(d.digest.to_string())
                    .or_insert_with(|| DashSwarm {
                        digest: d.digest.to_string(),
                        nodes: Vec::new(),
                        bytes_done: 0,
                        bytes_total: 0,
                    });
                s.nodes.push(e.report.node.clone());
                s.bytes_done += d.bytes_done;
                s.bytes_total += d.bytes_total;
            }
        }
        let jobs = self
            .inner
            .jobs
            .lock()
            .list()
            .map(|j| DashJob {
                id: j.id,
                images: j.images.iter().map(|i| i.reference.clone()).collect(),
                progress: j.progress(),
            })
            .collect();
        let sv = self.inner.saved.lock();
        Dashboard {
            now,
            nodes: inv.nodes(now),
            images: images
                .into_iter()
                .map(|mut i| {
                    i.blobs.clear();
                    i
                })
                .collect(),
            matrix,
            swarms: swarms.into_values().collect(),
            jobs,
            registry_bytes_saved: sv.total_saved,
            registry_bytes: sv.total_registry,
            saved_series: sv.series.iter().copied().collect(),
            sources,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DashImage {
    pub reference: String,
    pub manifest_digest: String,
    pub total_bytes: u64,
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub blobs: Vec<crate::inventory::BlobRef>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DashRow {
    pub node: String,
    pub status: NodeStatus,
    pub cache_used: u64,
    pub cache_budget: u64,
    /// Bytes held of each image, in `images` order.
    pub bytes: Vec<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DashPull {
    pub reference: String,
    pub last_pull: Option<u64>,
    pub cache: u64,
    pub peer: u64,
    pub registry: u64,
    pub pull_seconds: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DashSources {
    pub node: String,
    /// Up to five most recent pulls.
    pub pulls: Vec<DashPull>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DashSwarm {
    pub digest: String,
    pub nodes: Vec<String>,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DashJob {
    pub id: u64,
    pub images: Vec<String>,
    pub progress: crate::prewarm::JobProgress,
}

/// `GET /api/v1/dashboard`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Dashboard {
    pub now: u64,
    pub nodes: Vec<crate::inventory::NodeSummary>,
    pub images: Vec<DashImage>,
    pub matrix: Vec<DashRow>,
    pub swarms: Vec<DashSwarm>,
    pub jobs: Vec<DashJob>,
    pub registry_bytes_saved: u64,
    pub registry_bytes: u64,
    /// (unix seconds, cumulative bytes saved).
    pub saved_series: Vec<(u64, u64)>,
    pub sources: Vec<DashSources>,
}

/// HTTP status of each error.
pub fn status_of(e: &Error) -> StatusCode {
    match e {
        Error::Selector { .. }
        | Error::InvalidRequest(_)
        | Error::BadReference { .. }
        | Error::MutableTag { .. } => StatusCode::BAD_REQUEST,
        Error::UnknownNode(_)
        | Error::UnknownNodes(_)
        | Error::UnknownJob(_)
        | Error::UnknownImage(_) => StatusCode::NOT_FOUND,
        Error::StaleGeneration { .. } | Error::JobFinished(_) => StatusCode::CONFLICT,
        Error::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = status_of(&self);
        if status.is_server_error() {
            tracing::error!(error = %self, "cluster API error");
        }
        (
            status,
            Json(serde_json::json!({ "error": self.to_string() })),
        )
            .into_response()
    }
}

fn parse_body<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T> {
    serde_json::from_slice(body).map_err(|e| Error::InvalidRequest(format!("JSON body: {e}")))
}

/// `GET /metrics` with the cluster metrics only, for a standalone server. The
/// tracker, which serves its own `/metrics`, appends
/// [`ClusterState::encode_metrics_fragment`] to its output instead (or registers
/// [`ClusterMetrics`] in its registry with [`ClusterMetrics::register`]).
pub fn metrics_router(state: ClusterState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// All cluster API routes (see API.md). No `/metrics` and no `/healthz`, so it
/// merges into the tracker's router without overlapping routes.
pub fn router(state: ClusterState) -> Router {
    Router::new()
        .route("/", get(dashboard_page))
        .route("/api/v1/dashboard", get(dashboard_json))
        .route("/api/v1/nodes", get(list_nodes))
        .route("/api/v1/nodes/{name}", get(one_node))
        .route("/api/v1/where", get(where_image))
        .route("/api/v1/reports", post(ingest_report))
        .route("/api/v1/prewarm", post(submit_prewarm).get(list_prewarm))
        .route(
            "/api/v1/prewarm/{id}",
            get(get_prewarm).delete(cancel_prewarm),
        )
        .route("/api/v1/rank", post(rank))
        .route("/scheduler/filter", post(filter))
        .route("/scheduler/prioritize", post(prioritize))
        .with_state(state)
}

async fn dashboard_page() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        DASHBOARD_HTML,
    )
}

async fn dashboard_json(State(s): State<ClusterState>) -> Json<Dashboard> {
    Json(s.dashboard())
}

async fn list_nodes(State(s): State<ClusterState>) -> Json<serde_json::Value> {
    let now = s.now();
    Json(serde_json::json!({ "nodes": s.inventory().nodes(now) }))
}

async fn one_node(
    State(s): State<ClusterState>,
    Path(name): Path<String>,
) -> Result<Json<serde_json::Value>> {
    let now = s.now();
    let inv = s.inventory();
    let (summary, report) = inv
        .node(&name, now)
        .ok_or_else(|| Error::UnknownNode(name.clone()))?;
    Ok(Json(
        serde_json::json!({ "summary": summary, "report": report }),
    ))
}

async fn where_image(
    State(s): State<ClusterState>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Json<crate::text::WhereReply>> {
    let raw = q
        .get("image")
        .ok_or_else(|| Error::InvalidRequest("missing query parameter image=REF".into()))?;
    let r = ImageReference::parse(raw).map_err(|e| Error::BadReference {
        reference: raw.clone(),
        message: e.to_string(),
    })?;
    let img = s
        .resolve(&r)
        .ok_or_else(|| Error::UnknownImage(raw.clone()))?;
    let now = s.now();
    let nodes = s.inventory().holders(&img.blobs, now);
    Ok(Json(crate::text::WhereReply {
        image: r.to_string(),
        total_bytes: img.total_bytes(),
        manifest_digest: img.manifest_digest,
        nodes,
    }))
}

async fn ingest_report(
    State(s): State<ClusterState>,
    body: Bytes,
) -> Result<Json<serde_json::Value>> {
    let report: NodeReport = parse_body(&body)?;
    let applied = s.ingest(report)?;
    let a = match applied {
        Applied::New => "new",
        Applied::Updated => "updated",
        Applied::Heartbeat => "heartbeat",
    };
    Ok(Json(serde_json::json!({ "applied": a })))
}

async fn submit_prewarm(
    State(s): State<ClusterState>,
    body: Bytes,
) -> Result<(StatusCode, Json<JobView>)> {
    let req: PrewarmRequest = parse_body(&body)?;
    Ok((StatusCode::CREATED, Json(s.submit_prewarm(req)?)))
}

async fn list_prewarm(State(s): State<ClusterState>) -> Json<serde_json::Value> {
    let jobs: Vec<serde_json::Value> = s.with_jobs(|j| {
        j.list()
            .map(|j| serde_json::json!({ "id": j.id, "images": j.images, "created_at": j.created_at, "progress": j.progress() }))
            .collect()
    });
    Json(serde_json::json!({ "jobs": jobs }))
}

fn parse_id(id: &str) -> Result<u64> {
    id.parse()
        .map_err(|_| Error::InvalidRequest(format!("job id {id:?} is not a number")))
}

async fn get_prewarm(
    State(s): State<ClusterState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>> {
    let id = parse_id(&id)?;
    s.with_jobs(|j| j.get(id).map(|j| j.view()))
        .map(Json)
        .ok_or(Error::UnknownJob(id))
}

async fn cancel_prewarm(
    State(s): State<ClusterState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>> {
    let id = parse_id(&id)?;
    let now = s.now();
    s.with_jobs(|j| j.cancel(id, now).map(|j| j.view()))
        .map(Json)
}

async fn rank(State(s): State<ClusterState>, body: Bytes) -> Result<Json<extender::RankResponse>> {
    let req: RankRequest = parse_body(&body)?;
    s.rank(&req).map(Json)
}

async fn filter(
    State(s): State<ClusterState>,
    body: Bytes,
) -> Result<Json<extender::ExtenderFilterResult>> {
    let args: ExtenderArgs = parse_body(&body)?;
    Ok(Json(s.filter(&args)))
}

async fn prioritize(
    State(s): State<ClusterState>,
    body: Bytes,
) -> Result<Json<Vec<extender::HostPriority>>> {
    let args: ExtenderArgs = parse_body(&body)?;
    Ok(Json(s.prioritize(&args)))
}

async fn metrics(State(s): State<ClusterState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.encode_metrics(),
    )
}
