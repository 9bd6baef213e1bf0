//! [`ClusterState`]: the inventory, the job store, the image catalog and the metrics
//! behind one cheap handle. The tracker feeds it reports ([`ClusterState::ingest`]),
//! ticks it ([`ClusterState::tick`]) and sends what [`ClusterState::next_assignments`]
//! returns.
//!
//! Locks: the inventory (read/write) and the job store are only held for computing,
//! never across network I/O; registry lookups ([`ClusterState::resolve`]) run with no
//! lock held, and the scheduler extender never waits for one (it answers from memory
//! and asks the catalog to look in the background). Lock order: inventory, then jobs,
//! then the smaller ones.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use oci::ImageReference;
use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use prometheus_client::registry::Registry;
use tracing::warn;

use crate::error::{Error, Result};
use crate::extender::{self, ExtenderArgs, ImageCatalog, Lookup, RankRequest, ScoreConfig};
use crate::inventory::{
    Applied, Inventory, InventoryLimits, NodeReport, NodeStatus, ResolvedImage,
};
use crate::metrics::{
    ClusterMetrics, NodeLabels, PullLabels, ReasonLabels, StatusLabels, VerbLabels,
};
use crate::prewarm::{Assignment, JobStore, JobView, NodeUpdate, PrewarmRequest};
use crate::share::{ClusterShare, PublishQueue, Published};

/// Tracker-side settings.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// A node silent for longer becomes Unknown.
    pub node_timeout_s: u64,
    pub score: ScoreConfig,
    /// Samples kept of registry bytes saved over time.
    pub saved_history: usize,
    /// What the inventory keeps (nodes, report sizes, expiry).
    pub limits: InventoryLimits,
    /// Largest report body taken, in bytes (see API.md for how it is sized).
    pub max_report_bytes: usize,
    /// Per-node metric series (cached bytes, budget, pull seconds) exported per family;
    /// the other nodes are summed (or, for pull seconds, maxed) into `node="other"`.
    pub metric_node_labels: usize,
}

/// 100,000 blobs as agents report them take ~30 MB of JSON at worst (164 bytes per
/// holding with 20-digit sizes, 123 per image reference to it, ~400 per image of 20
/// layers); twice that, rounded up, leaves room for larger nodes.
pub const DEFAULT_MAX_REPORT_BYTES: usize = 64 << 20;

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            node_timeout_s: 60,
            score: ScoreConfig::default(),
            saved_history: 1440,
            limits: InventoryLimits::default(),
            max_report_bytes: DEFAULT_MAX_REPORT_BYTES,
            metric_node_labels: 1000,
        }
    }
}

mod shared_jobs;
pub(crate) use shared_jobs::JobSync;

type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

#[derive(Default)]
pub(crate) struct Saved {
    pub per_node: HashMap<String, (u64, u64)>,
    pub total_saved: u64,
    pub total_registry: u64,
    pub series: VecDeque<(u64, u64)>,
}

pub(crate) struct Inner {
    pub inventory: RwLock<Inventory>,
    pub jobs: Mutex<JobStore>,
    pub catalog: Option<Arc<dyn ImageCatalog>>,
    pub metrics: ClusterMetrics,
    pub registry: Registry,
    pub config: ClusterConfig,
    pub clock: Clock,
    pub saved: Mutex<Saved>,
    pub last_tick: Mutex<Option<u64>>,
    /// Serialises gauge refresh and encoding, so two scrapes do not interleave.
    pub scrape: Mutex<()>,
    /// Bytes of report bodies being read and parsed at once: the memory they may take.
    pub report_budget: Arc<tokio::sync::Semaphore>,
    pub report_budget_bytes: usize,
    /// Unix seconds of the last warning about a refused report.
    pub last_refusal_warning: AtomicU64,
    /// Where the job set replicas share lives (`None`: this process is the truth).
    pub share: std::sync::OnceLock<Arc<dyn ClusterShare>>,
    /// Reports taken here go to the other replicas through this (one waiting per
    /// node, the latest).
    pub publish: std::sync::OnceLock<Arc<PublishQueue>>,
    /// Where this copy of the shared job set is; held by one change or read at a
    /// time from this replica (agents' node reports do not take it).
    pub job_sync: tokio::sync::Mutex<JobSync>,
    /// With a share: whether this replica has read the other replicas' reports once
    /// (its planner must not judge nodes before).
    pub shared_inventory_read: std::sync::atomic::AtomicBool,
}

/// Shared state of the cluster layer. Cheap to clone.
#[derive(Clone)]
pub struct ClusterState {
    pub(crate) inner: Arc<Inner>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// How long a report waits for room in the report-body budget before it is refused.
const REPORT_BUDGET_WAIT: Duration = Duration::from_secs(10);

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
        // Four of the largest reports at once; permits are bytes (u32 in tokio).
        let budget = config
            .max_report_bytes
            .saturating_mul(4)
            .min(u32::MAX as usize >> 1);
        Self {
            inner: Arc::new(Inner {
                inventory: RwLock::new(Inventory::with_limits(
                    config.node_timeout_s,
                    config.limits.clone(),
                )),
                jobs: Mutex::new(jobs),
                catalog,
                metrics,
                registry,
                config,
                clock,
                saved: Mutex::new(Saved::default()),
                last_tick: Mutex::new(None),
                scrape: Mutex::new(()),
                report_budget: Arc::new(tokio::sync::Semaphore::new(budget)),
                report_budget_bytes: budget,
                last_refusal_warning: AtomicU64::new(0),
                share: std::sync::OnceLock::new(),
                publish: std::sync::OnceLock::new(),
                job_sync: tokio::sync::Mutex::new(JobSync::default()),
                shared_inventory_read: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    pub fn now(&self) -> u64 {
        (self.inner.clock)()
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.inner.config
    }

    pub fn metrics(&self) -> &ClusterMetrics {
        &self.inner.metrics
    }

    /// OpenMetrics text of the cluster metrics.
    pub fn encode_metrics(&self) -> String {
        let _one_at_a_time = self.inner.scrape.lock();
        self.refresh_gauges(&self.inventory(), self.now());
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

    /// Resolves from memory only: the catalog's answers so far, then agent reports.
    /// Never waits on a registry.
    pub fn resolve_cached(&self, r: &ImageReference) -> Option<ResolvedImage> {
        if let Some(x) = self.inner.catalog.as_ref().and_then(|c| c.resolve(r)) {
            return Some(x);
        }
        self.inventory().resolve(r)
    }

    /// Resolves a reference: the tracker's catalog (which may ask the registry, with
    /// no lock held and within its timeout), then agent reports. A registry the
    /// tracker may not contact is an error only when no agent reported the image.
    pub async fn resolve(&self, r: &ImageReference) -> Result<Option<ResolvedImage>> {
        let mut denied = None;
        if let Some(c) = self.inner.catalog.clone() {
            match c.fetch(r).await {
                Lookup::Found(x) => return Ok(Some(x)),
                Lookup::Denied(message) => denied = Some(message),
                Lookup::NotFound | Lookup::Failed(_) => {}
            }
        }
        if let Some(x) = self.inventory().resolve(r) {
            return Ok(Some(x));
        }
        match denied {
            Some(message) => Err(Error::RegistryDenied {
                reference: r.to_string(),
                message,
            }),
            None => Ok(None),
        }
    }

    /// Reads, checks and takes a report body: at most `max_report_bytes`, within a
    /// shared byte budget (so many large reports at once cannot exhaust memory).
    /// `reporter`: the node the caller authenticated as, when it did; a report about
    /// another node is refused ([`Error::Forbidden`]).
    pub async fn ingest_body(
        &self,
        body: axum::body::Body,
        declared: Option<u64>,
        reporter: Option<&str>,
    ) -> Result<Applied> {
        let limit = self.inner.config.max_report_bytes;
        if declared.is_some_and(|n| n > limit as u64) {
            let e = Error::ReportTooLarge(format!(
                "body of {} bytes, at most {limit}",
                declared.unwrap_or(0)
            ));
            self.refused(&e);
            return Err(e);
        }
        let want = declared
            .map_or(limit, |n| n as usize)
            .clamp(1, self.inner.report_budget_bytes.max(1));
        let permits = u32::try_from(want).unwrap_or(u32::MAX);
        let budget = self.inner.report_budget.clone();
        let _room = match tokio::time::timeout(
            REPORT_BUDGET_WAIT,
            budget.acquire_many_owned(permits),
        )
        .await
        {
            Ok(Ok(p)) => p,
            _ => {
                let e = Error::Capacity("too many reports being read at once; retry".into());
                self.refused(&e);
                return Err(e);
            }
        };
        let bytes = match axum::body::to_bytes(body, limit).await {
            Ok(b) => b,
            Err(e) => {
                let e =
                    Error::ReportTooLarge(format!("body unreadable or over {limit} bytes: {e}"));
                self.refused(&e);
                return Err(e);
            }
        };
        let report: NodeReport = serde_json::from_slice(&bytes)
            .map_err(|e| Error::InvalidRequest(format!("JSON body: {e}")))?;
        drop(bytes);
        // A node may only report about itself: otherwise one node's certificate could
        // rewrite what the cluster believes every other node holds.
        if let Some(reporter) = reporter {
            if report.node != reporter {
                let e = Error::Forbidden(format!(
                    "node {reporter:?} cannot report as {:?}",
                    report.node
                ));
                self.refused(&e);
                return Err(e);
            }
        }
        self.ingest(report)
    }

    /// Counts a refused report and says so at warn (once per 10 s: a flood of forged
    /// reports must not flood the log too).
    fn refused(&self, e: &Error) {
        let reason = match e {
            Error::ReportTooLarge(_) => "too_large",
            Error::Capacity(_) => "capacity",
            Error::StaleGeneration { .. } => "stale",
            Error::Forbidden(_) => "forbidden",
            _ => "invalid",
        };
        self.inner
            .metrics
            .reports_refused
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .inc();
        if reason == "stale" {
            // An agent restarted with a slower clock, or a duplicate name: the agent
            // side warns; here it is routine enough for the counter alone.
            return;
        }
        let now = unix_now();
        let last = self.inner.last_refusal_warning.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 10
            && self
                .inner
                .last_refusal_warning
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            warn!(error = %e, "inventory report refused; that node's contents go stale here");
        }
    }

    /// Takes an agent report, updates metrics and job progress.
    pub fn ingest(&self, report: NodeReport) -> Result<Applied> {
        let now = self.now();
        let m = &self.inner.metrics;
        let (saved, registry) = report.images.iter().fold((0u64, 0u64), |(s, r), i| {
            (
                s.saturating_add(i.bytes_by_source.saved()),
                r.saturating_add(i.bytes_by_source.registry),
            )
        });
        let node = report.node.clone();
        let generation = report.generation;
        // Kept only when other replicas are told (a copy of what `apply` consumes).
        let to_publish = self.inner.publish.get().map(|_| report.clone());
        let applied = self.inner.inventory.write().apply(report, now);
        let applied = match applied {
            Ok(a) => a,
            Err(e) => {
                self.refused(&e);
                return Err(e);
            }
        };
        if applied != Applied::Heartbeat {
            let mut sv = self.inner.saved.lock();
            let prev = sv
                .per_node
                .insert(node.clone(), (saved, registry))
                .unwrap_or((0, 0));
            // Per-image figures are of the last pull; count growth only.
            let ds = saved.saturating_sub(prev.0);
            let dr = registry.saturating_sub(prev.1);
            m.registry_bytes_saved.inc_by(ds);
            m.registry_bytes.inc_by(dr);
            sv.total_saved = sv.total_saved.saturating_add(ds);
            sv.total_registry = sv.total_registry.saturating_add(dr);
            let total = sv.total_saved;
            match sv.series.back_mut() {
                Some(last) if last.0 == now => last.1 = total,
                _ => sv.series.push_back((now, total)),
            }
            while sv.series.len() > self.inner.config.saved_history.max(1) {
                sv.series.pop_front();
            }
        }
        if let Some(sink) = self.inner.publish.get() {
            let report = (applied != Applied::Heartbeat)
                .then_some(to_publish)
                .flatten();
            // Dropped only when as many other nodes wait as the inventory keeps; the
            // node's next report (every few seconds) publishes again: soft state.
            let _ = sink.push(Published {
                node: node.clone(),
                generation,
                report,
            });
        }
        let due = self.inner.last_tick.lock().is_none_or(|t| now > t);
        if due {
            if self.is_shared() {
                // Jobs change only under the shared lock (the planner's tick).
                self.tick_inventory();
            } else {
                self.tick()?;
            }
        }
        Ok(applied)
    }

    /// Takes a report another replica took (read from the shared store): the same
    /// checks as [`ingest`](Self::ingest), without publishing it again. A report of
    /// the generation this copy holds counts as a heartbeat.
    pub fn ingest_shared(&self, report: NodeReport) -> Result<Applied> {
        let now = self.now();
        self.inner.inventory.write().apply(report, now)
    }

    /// Another replica heard from `node` (same generation as its last report).
    pub fn heartbeat_shared(&self, node: &str, generation: u64) -> Result<()> {
        self.heartbeat(node, generation)
    }

    /// Shares the job set with other replicas through `share`; reports taken here
    /// are sent to `publish` for them. Call once, before serving.
    pub fn share_with(&self, share: Arc<dyn ClusterShare>, publish: Arc<PublishQueue>) {
        let _ = self.inner.share.set(share);
        let _ = self.inner.publish.set(publish);
        self.inner.jobs.lock().share();
    }

    /// Whether the job set is shared with other replicas.
    pub fn is_shared(&self) -> bool {
        self.inner.share.get().is_some()
    }

    /// The other replicas' reports were read once (call after the first full read).
    pub fn note_shared_inventory_read(&self) {
        self.inner
            .shared_inventory_read
            .store(true, Ordering::Release);
    }

    /// Whether this replica's inventory may judge jobs: always without a share; with
    /// one, once the other replicas' reports were read (a fresh replica's empty copy
    /// would see every node as gone).
    pub fn inventory_complete(&self) -> bool {
        !self.is_shared() || self.inner.shared_inventory_read.load(Ordering::Acquire)
    }

    pub fn heartbeat(&self, node: &str, generation: u64) -> Result<()> {
        let now = self.now();
        self.inner
            .inventory
            .write()
            .heartbeat(node, generation, now)
    }

    /// Gauges computed from the inventory (known/unknown depends on the clock, so
    /// refreshed on every scrape). Per-node families keep `metric_node_labels` series
    /// (nodes in name order) and fold the rest into `node="other"`, so forged or
    /// forgotten node names never pile up as series.
    fn refresh_gauges(&self, inv: &Inventory, now: u64) {
        let m = &self.inner.metrics;
        let cap = self.inner.config.metric_node_labels;
        m.node_cached_bytes.clear();
        m.node_cache_budget_bytes.clear();
        m.pull_seconds.clear();
        let (mut known, mut unknown) = (0, 0);
        let (mut other_used, mut other_budget, mut folded) = (0i64, 0i64, false);
        let mut pulls = 0usize;
        let mut other_pull: Option<f64> = None;
        for (i, e) in inv.entries().enumerate() {
            match inv.status_of(e, now) {
                NodeStatus::Known => known += 1,
                NodeStatus::Unknown => unknown += 1,
            }
            let used = i64::try_from(e.report.cache_used).unwrap_or(i64::MAX);
            let budget = i64::try_from(e.report.cache_budget).unwrap_or(i64::MAX);
            if i < cap {
                let labels = NodeLabels {
                    node: e.report.node.clone(),
                };
                m.node_cached_bytes.get_or_create(&labels).set(used);
                m.node_cache_budget_bytes.get_or_create(&labels).set(budget);
            } else {
                other_used = other_used.saturating_add(used);
                other_budget = other_budget.saturating_add(budget);
                folded = true;
            }
            for img in &e.report.images {
                let Some(s) = img.pull_seconds.filter(|s| s.is_finite()) else {
                    continue;
                };
                if pulls < cap {
                    pulls += 1;
                    let image = img
                        .references
                        .first()
                        .cloned()
                        .unwrap_or_else(|| img.manifest_digest.to_string());
                    m.pull_seconds
                        .get_or_create(&PullLabels {
                            image,
                            node: e.report.node.clone(),
                        })
                        .set(s);
                } else {
                    other_pull = Some(other_pull.map_or(s, |o: f64| o.max(s)));
                }
            }
        }
        if folded {
            let labels = NodeLabels {
                node: "other".into(),
            };
            m.node_cached_bytes.get_or_create(&labels).set(other_used);
            m.node_cache_budget_bytes
                .get_or_create(&labels)
                .set(other_budget);
        }
        if let Some(s) = other_pull {
            m.pull_seconds
                .get_or_create(&PullLabels {
                    image: "other".into(),
                    node: "other".into(),
                })
                .set(s);
        }
        for (status, n) in [("known", known), ("unknown", unknown)] {
            m.nodes
                .get_or_create(&StatusLabels {
                    status: status.into(),
                })
                .set(n);
        }
        m.inventory_digests
            .set(i64::try_from(inv.digests()).unwrap_or(i64::MAX));
    }

    /// Periodic work (call every few seconds): nodes silent past the expiry are
    /// forgotten, job progress from the inventory, silent nodes, deadlines, lead
    /// times, gauges. Reports also trigger it, at most once per clock second.
    pub fn tick(&self) -> Result<()> {
        self.tick_inventory();
        self.tick_jobs()
    }

    /// The inventory's part of [`tick`](Self::tick): silent nodes are forgotten.
    pub fn tick_inventory(&self) {
        let now = self.now();
        *self.inner.last_tick.lock() = Some(now);
        let gone = self.inner.inventory.write().expire(now);
        if !gone.is_empty() {
            let mut sv = self.inner.saved.lock();
            for n in &gone {
                sv.per_node.remove(n);
            }
        }
    }

    /// The jobs' part of [`tick`](Self::tick): progress from the inventory, silent
    /// nodes, deadlines, lead times, job gauges (with a share: inside
    /// [`change_jobs`](Self::change_jobs)).
    pub fn tick_jobs(&self) -> Result<()> {
        let now = self.now();
        let m = &self.inner.metrics;
        let inv = self.inner.inventory.read();
        let mut jobs = self.inner.jobs.lock();
        jobs.observe_deferred(&inv, now);
        let (leads, _) = jobs.take_lead_times_deferred(&inv);
        // Committed with the inventory released: an fsync must not stall the extender.
        drop(inv);
        jobs.flush()?;
        for lead in leads {
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

    /// Submits a prewarm job: validates, resolves each reference to a digest now
    /// (the registry is asked with no lock held), picks targets, persists.
    pub async fn submit_prewarm(&self, req: PrewarmRequest) -> Result<JobView> {
        let refs = {
            let inv = self.inventory();
            crate::prewarm::validate(&req, &inv)?
        };
        let mut images = Vec::new();
        for (raw, r) in req.images.iter().zip(&refs) {
            // A file is known by the source the request gives, not by any registry.
            let file = crate::prewarm::resolve_file(&req, raw);
            let mut img = match file {
                Some(f) => f,
                None => self
                    .resolve(r)
                    .await?
                    .ok_or_else(|| Error::UnknownImage(raw.clone()))?,
            };
            img.reference = r.to_string();
            images.push(img);
        }
        self.change_jobs(|| self.submit_prewarm_resolved(req, images))
            .await
    }

    /// Submits a prewarm job whose images the caller resolved (in request order).
    pub fn submit_prewarm_resolved(
        &self,
        req: PrewarmRequest,
        images: Vec<ResolvedImage>,
    ) -> Result<JobView> {
        let now = self.now();
        let inv = self.inventory();
        let mut jobs = self.inner.jobs.lock();
        Ok(jobs.submit(req, images, &inv, now)?.view())
    }

    /// Which node should fetch what now (the tracker sends these to agents).
    pub fn next_assignments(&self) -> Result<Vec<Assignment>> {
        let now = self.now();
        let inv = self.inventory();
        let mut jobs = self.inner.jobs.lock();
        let (out, _) = jobs.next_assignments_deferred(&inv, now);
        drop(inv);
        jobs.flush()?;
        Ok(out)
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

    /// The `filter` verb, from memory: never waits on a registry.
    pub fn filter(&self, args: &ExtenderArgs) -> extender::ExtenderFilterResult {
        let now = self.now();
        self.time("filter", || {
            let inv = self.inventory();
            let memory = Memory {
                catalog: self.inner.catalog.as_deref(),
                inv: &inv,
            };
            extender::filter(args, &inv, &memory, now)
        })
    }

    /// The `prioritize` verb, from memory: never waits on a registry.
    pub fn prioritize(&self, args: &ExtenderArgs) -> Vec<extender::HostPriority> {
        let now = self.now();
        let cfg = &self.inner.config.score;
        self.time("prioritize", || {
            let inv = self.inventory();
            let memory = Memory {
                catalog: self.inner.catalog.as_deref(),
                inv: &inv,
            };
            extender::prioritize(args, &inv, &memory, now, cfg)
        })
    }

    /// The ranking API: images the tracker does not know yet are looked up (with no
    /// lock held, within the catalog's timeout) before ranking from memory.
    pub async fn rank(&self, req: &RankRequest) -> Result<extender::RankResponse> {
        let mut known = HashMap::new();
        for raw in req.image.iter().chain(&req.images) {
            let Ok(r) = ImageReference::parse(raw) else {
                continue;
            };
            if let Some(img) = self.resolve(&r).await? {
                known.insert(r.to_string(), img);
            }
        }
        let now = self.now();
        let cfg = &self.inner.config.score;
        self.time("rank", || {
            let inv = self.inventory();
            extender::rank(req, &inv, &Resolved(known), now, cfg)
        })
    }
}

/// The extender's view: the catalog's answers so far, then agent reports. A catalog
/// miss asks it to look in the background, so the next request finds the answer.
struct Memory<'a> {
    catalog: Option<&'a dyn ImageCatalog>,
    inv: &'a Inventory,
}

impl ImageCatalog for Memory<'_> {
    fn resolve(&self, image: &ImageReference) -> Option<ResolvedImage> {
        if let Some(c) = self.catalog {
            if let Some(x) = c.resolve(image) {
                return Some(x);
            }
            c.prefetch(image);
        }
        self.inv.resolve(image)
    }
}

/// Images resolved beforehand, by canonical reference.
struct Resolved(HashMap<String, ResolvedImage>);

impl ImageCatalog for Resolved {
    fn resolve(&self, image: &ImageReference) -> Option<ResolvedImage> {
        self.0.get(&image.to_string()).cloned()
    }
}
