//! Prewarm jobs: the request model, validation, target selection, a per-node state
//! machine, progress, cancel, persistence (redb) and the scheduling step that tells
//! the tracker which node should fetch what, at which rate.
//!
//! The registry is hit about once: while no node of the cluster holds every blob of
//! the job and no target has finished, only one target (the seed) runs; the rest fan
//! out from peers afterwards, `parallelism` at a time.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use oci::ImageReference;
use redb::{ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::inventory::{union_blobs, BlobRef, Inventory, NodeStatus, ResolvedImage};
use crate::selector::Selector;

/// Default label that names a node's pool.
pub const DEFAULT_POOL_LABEL: &str = "starling.io/pool";
/// Pin TTL when the request gives none.
pub const DEFAULT_PIN_TTL_SECONDS: u64 = 24 * 3600;

/// Which nodes to warm: explicit `nodes`, or a population (nodes matching
/// `selector` and/or `pool`, all nodes when neither) of which `count` or
/// `percentage` are taken (all when neither).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Targets {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Label key holding the pool name (default `starling.io/pool`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_label: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percentage: Option<f64>,
}

/// `POST /api/v1/prewarm` body.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PrewarmRequest {
    pub images: Vec<String>,
    pub targets: Targets,
    /// Nodes downloading at once (default: all targets, after the seed).
    #[serde(default)]
    pub parallelism: Option<u32>,
    #[serde(default)]
    pub per_node_bytes_per_sec: Option<u64>,
    /// Split evenly over `parallelism` slots.
    #[serde(default)]
    pub total_bytes_per_sec: Option<u64>,
    /// Seconds from submission; unfinished nodes fail after it.
    #[serde(default)]
    pub deadline_seconds: Option<u64>,
    /// Seconds from submission the agents keep the content pinned (default 24 h).
    #[serde(default)]
    pub pin_ttl_seconds: Option<u64>,
    /// Higher first.
    #[serde(default)]
    pub priority: i32,
    /// Warm mutable tags anyway.
    #[serde(default)]
    pub force: bool,
    /// Tags the caller has seen moving (refused unless `force`).
    #[serde(default)]
    pub moving_tags: Vec<String>,
    /// Also pull the image into the node's containerd and label it
    /// `io.cri-containerd.pinned=pinned`, so kubelet image GC keeps it.
    #[serde(default)]
    pub into_runtime: bool,
}

/// Checks the request's shape and its images' tags. Returns the parsed references.
pub fn validate(req: &PrewarmRequest, inv: &Inventory) -> Result<Vec<ImageReference>> {
    if req.images.is_empty() {
        return Err(Error::InvalidRequest("\"images\" is empty".into()));
    }
    let t = &req.targets;
    let population_given =
        t.selector.is_some() || t.pool.is_some() || t.count.is_some() || t.percentage.is_some();
    if !t.nodes.is_empty() && population_given {
        return Err(Error::InvalidRequest(
            "targets: give either \"nodes\" or selector/pool/count/percentage, not both".into(),
        ));
    }
    if t.nodes.is_empty() && !population_given {
        return Err(Error::InvalidRequest(
            "targets: give \"nodes\", \"selector\", \"pool\", \"count\" or \"percentage\"".into(),
        ));
    }
    if t.count.is_some() && t.percentage.is_some() {
        return Err(Error::InvalidRequest(
            "targets: give \"count\" or \"percentage\", not both".into(),
        ));
    }
    if t.count == Some(0) {
        return Err(Error::InvalidRequest(
            "targets.count must be at least 1".into(),
        ));
    }
    if let Some(p) = t.percentage {
        if !(p > 0.0 && p <= 100.0) {
            return Err(Error::InvalidRequest(format!(
                "targets.percentage must be in (0, 100], got {p}"
            )));
        }
    }
    if let Some(s) = &t.selector {
        Selector::parse(s)?;
    }
    if req.parallelism == Some(0) {
        return Err(Error::InvalidRequest(
            "parallelism must be at least 1".into(),
        ));
    }
    if req.per_node_bytes_per_sec == Some(0) || req.total_bytes_per_sec == Some(0) {
        return Err(Error::InvalidRequest(
            "bandwidth limits must be positive (omit them for no limit)".into(),
        ));
    }
    let moving: BTreeSet<String> = req
        .moving_tags
        .iter()
        .filter_map(|m| ImageReference::parse(m).ok())
        .map(|r| r.to_string())
        .collect();
    let mut out = Vec::new();
    for raw in &req.images {
        let r = ImageReference::parse(raw).map_err(|e| Error::BadReference {
            reference: raw.clone(),
            message: e.to_string(),
        })?;
        if r.digest.is_none() && !req.force {
            let tag = r.tag.clone().unwrap_or_default();
            let reason = if tag == "latest" {
                Some(if raw.contains(&format!(":{tag}")) {
                    "`latest` is a mutable tag".to_owned()
                } else {
                    "no tag given, which means the mutable tag `latest`".to_owned()
                })
            } else if moving.contains(&r.to_string()) {
                Some("the caller reports this tag as seen moving".to_owned())
            } else if inv.tag_seen_moving(&r) {
                Some("agents reported this tag pointing at different digests".to_owned())
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(Error::MutableTag {
                    reference: r.to_string(),
                    reason,
                });
            }
        }
        out.push(r);
    }
    Ok(out)
}

/// Picks the target nodes. Explicit names must all be known to the inventory. For a
/// count or percentage, reporting nodes of the population that already hold most of
/// `blobs` are taken first (name breaks ties).
pub fn resolve_targets(
    t: &Targets,
    inv: &Inventory,
    blobs: &[BlobRef],
    now: u64,
) -> Result<Vec<String>> {
    if !t.nodes.is_empty() {
        let unknown: Vec<String> = t
            .nodes
            .iter()
            .filter(|n| inv.entry(n).is_none())
            .cloned()
            .collect();
        if !unknown.is_empty() {
            return Err(Error::UnknownNodes(unknown));
        }
        let mut seen = BTreeSet::new();
        return Ok(t
            .nodes
            .iter()
            .filter(|n| seen.insert(*n))
            .cloned()
            .collect());
    }
    let mut sel = match &t.selector {
        Some(s) => Selector::parse(s)?,
        None => Selector::default(),
    };
    if let Some(p) = &t.pool {
        let key = t.pool_label.as_deref().unwrap_or(DEFAULT_POOL_LABEL);
        sel.requirements
            .extend(Selector::equals(key, p).requirements);
    }
    let population: Vec<&str> = inv
        .entries()
        .filter(|e| sel.matches(&e.report.labels))
        .map(|e| e.report.node.as_str())
        .collect();
    if population.is_empty() {
        return Err(Error::InvalidRequest(format!(
            "targets: no node matches selector {sel:?}",
            sel = sel.to_string()
        )));
    }
    let want = match (t.count, t.percentage) {
        (Some(c), _) => c as usize,
        (None, Some(p)) => ((population.len() as f64) * p / 100.0).ceil() as usize,
        (None, None) => return Ok(population.into_iter().map(str::to_owned).collect()),
    };
    let mut known: Vec<(u64, &str)> = population
        .iter()
        .filter(|n| inv.status(n, now) == Some(NodeStatus::Known))
        .map(|n| (inv.bytes_held(n, blobs).unwrap_or(0), *n))
        .collect();
    if known.len() < want {
        return Err(Error::InvalidRequest(format!(
            "targets: asked for {want} node(s) but only {} of the {} matching node(s) are reporting",
            known.len(),
            population.len()
        )));
    }
    known.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    Ok(known
        .into_iter()
        .take(want)
        .map(|(_, n)| n.to_owned())
        .collect())
}

/// Where one node is in a job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum NodeJobState {
    Pending,
    Running,
    Done,
    Failed {
        reason: String,
    },
    /// The job's images are larger than the node's whole cache budget.
    DoesNotFit {
        needed: u64,
        budget: u64,
    },
    Cancelled,
    /// The node stopped reporting; it resumes when it comes back.
    Unknown,
}

impl NodeJobState {
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            Self::Done | Self::Failed { .. } | Self::DoesNotFit { .. } | Self::Cancelled
        )
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeJob {
    #[serde(flatten)]
    pub state: NodeJobState,
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub eta_seconds: Option<f64>,
    pub started_at: Option<u64>,
    /// Bytes held when the node started (for the rate estimate).
    pub bytes_at_start: u64,
    pub finished_at: Option<u64>,
    pub updated_at: u64,
    pub rate_bytes_per_sec: Option<u64>,
    pub seed: bool,
    /// Set once the prewarm lead time (first use − done) has been measured.
    #[serde(default)]
    pub lead_measured: bool,
}

/// A job as a whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    Running,
    Done,
    /// Finished, some nodes failed or did not fit.
    CompletedWithFailures,
    Cancelled,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub id: u64,
    pub request: PrewarmRequest,
    /// What each reference resolved to at submit time: the digest is what is warmed.
    pub images: Vec<ResolvedImage>,
    pub blobs: Vec<BlobRef>,
    pub total_bytes: u64,
    pub created_at: u64,
    pub deadline_at: Option<u64>,
    pub pin_until: u64,
    pub cancelled_at: Option<u64>,
    pub nodes: BTreeMap<String, NodeJob>,
}

/// Aggregate progress of a job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobProgress {
    pub status: JobStatus,
    pub nodes_total: usize,
    pub nodes_by_state: BTreeMap<String, usize>,
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Slowest running node's ETA.
    pub eta_seconds: Option<f64>,
}

/// A job with its progress (`GET /api/v1/prewarm/{id}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobView {
    #[serde(flatten)]
    pub job: Job,
    pub progress: JobProgress,
}

fn state_name(s: &NodeJobState) -> &'static str {
    match s {
        NodeJobState::Pending => "pending",
        NodeJobState::Running => "running",
        NodeJobState::Done => "done",
        NodeJobState::Failed { .. } => "failed",
        NodeJobState::DoesNotFit { .. } => "does_not_fit",
        NodeJobState::Cancelled => "cancelled",
        NodeJobState::Unknown => "unknown",
    }
}

impl Job {
    /// Builds a job from a validated request, the images resolved at submit time and
    /// the chosen targets. Nodes already warm start Done; nodes whose cache budget is
    /// smaller than the job start DoesNotFit; silent nodes start Unknown.
    pub fn plan(
        id: u64,
        request: PrewarmRequest,
        images: Vec<ResolvedImage>,
        targets: &[String],
        inv: &Inventory,
        now: u64,
    ) -> Self {
        let blobs = union_blobs(&images);
        let total: u64 = blobs.iter().map(|b| b.size).sum();
        let mut nodes = BTreeMap::new();
        for n in targets {
            let held = inv.bytes_held(n, &blobs).unwrap_or(0);
            let state = match inv.entry(n) {
                None => NodeJobState::Failed {
                    reason: "unknown node: not in the tracker's inventory".into(),
                },
                Some(e) if total > e.report.cache_budget => NodeJobState::DoesNotFit {
                    needed: total,
                    budget: e.report.cache_budget,
                },
                Some(e) if inv.status_of(e, now) == NodeStatus::Unknown => NodeJobState::Unknown,
                Some(_) if held == total => NodeJobState::Done,
                Some(_) => NodeJobState::Pending,
            };
            let done = state == NodeJobState::Done;
            nodes.insert(
                n.clone(),
                NodeJob {
                    state,
                    bytes_done: held,
                    bytes_total: total,
                    eta_seconds: None,
                    started_at: None,
                    bytes_at_start: held,
                    finished_at: done.then_some(now),
                    updated_at: now,
                    rate_bytes_per_sec: None,
                    seed: false,
                    lead_measured: false,
                },
            );
        }
        Self {
            id,
            deadline_at: request.deadline_seconds.map(|d| now + d),
            pin_until: now + request.pin_ttl_seconds.unwrap_or(DEFAULT_PIN_TTL_SECONDS),
            request,
            images,
            blobs,
            total_bytes: total,
            created_at: now,
            cancelled_at: None,
            nodes,
        }
    }

    pub fn status(&self) -> JobStatus {
        if self.cancelled_at.is_some() {
            JobStatus::Cancelled
        } else if self.nodes.values().any(|n| !n.state.is_terminal()) {
            JobStatus::Running
        } else if self.nodes.values().all(|n| n.state == NodeJobState::Done) {
            JobStatus::Done
        } else {
            JobStatus::CompletedWithFailures
        }
    }

    pub fn is_active(&self) -> bool {
        self.status() == JobStatus::Running
    }

    pub fn progress(&self) -> JobProgress {
        let mut by = BTreeMap::new();
        for n in self.nodes.values() {
            *by.entry(state_name(&n.state).to_owned()).or_insert(0) += 1;
        }
        JobProgress {
            status: self.status(),
            nodes_total: self.nodes.len(),
            nodes_by_state: by,
            bytes_done: self.nodes.values().map(|n| n.bytes_done).sum(),
            bytes_total: self.nodes.values().map(|n| n.bytes_total).sum(),
            eta_seconds: self
                .nodes
                .values()
                .filter(|n| n.state == NodeJobState::Running)
                .filter_map(|n| n.eta_seconds)
                .reduce(f64::max),
        }
    }

    pub fn view(&self) -> JobView {
        JobView {
            job: self.clone(),
            progress: self.progress(),
        }
    }

    /// Updates from the inventory: bytes held, done, node gone silent or back,
    /// deadline. Returns whether anything changed.
    pub fn observe(&mut self, inv: &Inventory, now: u64) -> bool {
        if !self.is_active() {
            return false;
        }
        let mut changed = false;
        let deadline_passed = self.deadline_at.is_some_and(|d| now > d);
        for (name, nj) in self.nodes.iter_mut() {
            if nj.state.is_terminal() {
                continue;
            }
            let before = nj.clone();
            match inv.entry(name) {
                None => {
                    nj.state = NodeJobState::Failed {
                        reason: "node removed from the inventory".into(),
                    };
                }
                Some(e) if inv.status_of(e, now) == NodeStatus::Unknown => {
                    nj.state = NodeJobState::Unknown;
                    nj.eta_seconds = None;
                }
                Some(_) => {
                    let held = inv.bytes_held(name, &self.blobs).unwrap_or(0);
                    nj.bytes_done = held;
                    if held == nj.bytes_total {
                        nj.state = NodeJobState::Done;
                        nj.finished_at = Some(now);
                        nj.eta_seconds = Some(0.0);
                    } else if nj.state == NodeJobState::Unknown {
                        // Back from silence: re-issue (the agent resumes partial blobs).
                        nj.state = NodeJobState::Pending;
                    } else if nj.state == NodeJobState::Running {
                        let elapsed = now.saturating_sub(nj.started_at.unwrap_or(now));
                        let gained = held.saturating_sub(nj.bytes_at_start);
                        let rate = if elapsed > 0 && gained > 0 {
                            Some(gained as f64 / elapsed as f64)
                        } else {
                            nj.rate_bytes_per_sec.map(|r| r as f64)
                        };
                        nj.eta_seconds = rate.map(|r| (nj.bytes_total - held) as f64 / r);
                    }
                }
            }
            if deadline_passed && !nj.state.is_terminal() {
                nj.state = NodeJobState::Failed {
                    reason: format!(
                        "deadline exceeded with {} of {} bytes",
                        nj.bytes_done, nj.bytes_total
                    ),
                };
                nj.eta_seconds = None;
            }
            if *nj != before {
                nj.updated_at = now;
                changed = true;
            }
        }
        changed
    }
}

/// What an agent tells the tracker about its part of a job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum NodeUpdate {
    Progress { bytes_done: u64 },
    Done,
    Failed { reason: String },
}

/// One instruction for the tracker to send to an agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    pub job_id: u64,
    pub node: String,
    pub agent_url: Option<String>,
    /// (reference, digest): fetch and pin by digest.
    pub images: Vec<(String, String)>,
    pub blobs: Vec<BlobRef>,
    pub bytes_per_sec: Option<u64>,
    pub pin_until: u64,
    pub deadline_at: Option<u64>,
    pub priority: i32,
    /// First node of a job nobody holds yet: the only one that goes to the registry.
    pub seed: bool,
    /// Pull into containerd and pin there too.
    #[serde(default)]
    pub into_runtime: bool,
}

const JOBS: TableDefinition<u64, &[u8]> = TableDefinition::new("prewarm_jobs");

/// Prewarm jobs, in memory and in a redb file (one JSON record per job).
pub struct JobStore {
    db: redb::Database,
    jobs: BTreeMap<u64, Job>,
}

impl JobStore {
    /// Opens (or creates) the store. Nodes that were Running when the tracker stopped
    /// go back to Pending so their assignment is sent again; Done stays Done.
    pub fn open(path: &Path) -> Result<Self> {
        let db = redb::Database::create(path)?;
        Self::load(db)
    }

    /// A store that lives in memory only (tests, `--ephemeral` trackers).
    pub fn in_memory() -> Result<Self> {
        let db =
            redb::Database::builder().create_with_backend(redb::backends::InMemoryBackend::new())?;
        Self::load(db)
    }

    fn load(db: redb::Database) -> Result<Self> {
        let tx = db.begin_write()?;
        tx.open_table(JOBS)?;
        tx.commit()?;
        let mut jobs = BTreeMap::new();
        {
            let tx = db.begin_read()?;
            let t = tx.open_table(JOBS)?;
            for row in t.iter()? {
                let (k, v) = row?;
                let mut job: Job = serde_json::from_slice(v.value())?;
                for nj in job.nodes.values_mut() {
                    if nj.state == NodeJobState::Running {
                        nj.state = NodeJobState::Pending;
                    }
                }
                jobs.insert(k.value(), job);
            }
        }
        Ok(Self { db, jobs })
    }

    fn save(&self, id: u64) -> Result<()> {
        let Some(job) = self.jobs.get(&id) else {
            return Ok(());
        };
        let bytes = serde_json::to_vec(job)?;
        let tx = self.db.begin_write()?;
        {
            let mut t = tx.open_table(JOBS)?;
            t.insert(id, bytes.as_slice())?;
        }
        tx.commit()?;
        Ok(())
    }

    pub fn next_id(&self) -> u64 {
        self.jobs.keys().next_back().map_or(1, |k| k + 1)
    }

    /// Validates, resolves targets, plans and persists a job. `images` are the
    /// request's references resolved (by the caller's catalog) at submit time.
    pub fn submit(
        &mut self,
        req: PrewarmRequest,
        images: Vec<ResolvedImage>,
        inv: &Inventory,
        now: u64,
    ) -> Result<&Job> {
        validate(&req, inv)?;
        let blobs = union_blobs(&images);
        let targets = resolve_targets(&req.targets, inv, &blobs, now)?;
        let id = self.next_id();
        let job = Job::plan(id, req, images, &targets, inv, now);
        self.jobs.insert(id, job);
        self.save(id)?;
        self.get(id).ok_or(Error::UnknownJob(id))
    }

    pub fn get(&self, id: u64) -> Option<&Job> {
        self.jobs.get(&id)
    }

    pub fn list(&self) -> impl Iterator<Item = &Job> {
        self.jobs.values()
    }

    /// Cancels the unfinished nodes; Done nodes keep their pinned content.
    pub fn cancel(&mut self, id: u64, now: u64) -> Result<&Job> {
        let job = self.jobs.get_mut(&id).ok_or(Error::UnknownJob(id))?;
        if !job.is_active() {
            return Err(Error::JobFinished(id));
        }
        job.cancelled_at = Some(now);
        for nj in job.nodes.values_mut() {
            if !nj.state.is_terminal() {
                nj.state = NodeJobState::Cancelled;
                nj.eta_seconds = None;
                nj.updated_at = now;
            }
        }
        self.save(id)?;
        self.get(id).ok_or(Error::UnknownJob(id))
    }

    /// Applies the inventory to every active job; persists what changed.
    pub fn observe(&mut self, inv: &Inventory, now: u64) -> Result<()> {
        let changed: Vec<u64> = self
            .jobs
            .values_mut()
            .filter_map(|j| j.observe(inv, now).then_some(j.id))
            .collect();
        for id in changed {
            self.save(id)?;
        }
        Ok(())
    }

    /// An agent's word about its part of a job.
    pub fn update_node(&mut self, id: u64, node: &str, update: NodeUpdate, now: u64) -> Result<()> {
        let job = self.jobs.get_mut(&id).ok_or(Error::UnknownJob(id))?;
        let nj = job
            .nodes
            .get_mut(node)
            .ok_or_else(|| Error::UnknownNode(node.to_owned()))?;
        if nj.state.is_terminal() {
            return Ok(());
        }
        match update {
            NodeUpdate::Progress { bytes_done } => {
                nj.bytes_done = bytes_done.min(nj.bytes_total);
                if nj.state != NodeJobState::Running {
                    nj.state = NodeJobState::Running;
                }
            }
            NodeUpdate::Done => {
                nj.state = NodeJobState::Done;
                nj.bytes_done = nj.bytes_total;
                nj.eta_seconds = Some(0.0);
                nj.finished_at = Some(now);
            }
            NodeUpdate::Failed { reason } => {
                nj.state = NodeJobState::Failed { reason };
                nj.eta_seconds = None;
            }
        }
        nj.updated_at = now;
        self.save(id)
    }

    /// Moves Pending nodes to Running within each job's parallelism (higher priority
    /// first) and returns what each should fetch. A job that nobody in the cluster
    /// holds yet runs one seed node first.
    pub fn next_assignments(&mut self, inv: &Inventory, now: u64) -> Result<Vec<Assignment>> {
        let mut order: Vec<(i32, u64)> = self
            .jobs
            .values()
            .filter(|j| j.is_active())
            .map(|j| (j.request.priority, j.id))
            .collect();
        order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut out = Vec::new();
        for (_, id) in order {
            let Some(job) = self.jobs.get_mut(&id) else {
                continue;
            };
            let someone_done = job.nodes.values().any(|n| n.state == NodeJobState::Done);
            let cluster_has_all = inv.entries().any(|e| {
                inv.status_of(e, now) == NodeStatus::Known
                    && job.blobs.iter().all(|b| inv.held(e, &b.digest) >= b.size)
            });
            let seeded = someone_done || cluster_has_all;
            let parallelism = job.request.parallelism.map_or(usize::MAX, |p| p as usize);
            let limit = if seeded { parallelism } else { 1 };
            let running = job
                .nodes
                .values()
                .filter(|n| n.state == NodeJobState::Running)
                .count();
            if running >= limit {
                continue;
            }
            let slots = job
                .request
                .parallelism
                .map_or(job.nodes.len().max(1), |p| p as usize);
            let share = job.request.total_bytes_per_sec.map(|t| {
                if seeded {
                    (t / slots as u64).max(1)
                } else {
                    t
                }
            });
            let rate = match (job.request.per_node_bytes_per_sec, share) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let pending: Vec<String> = job
                .nodes
                .iter()
                .filter(|(_, n)| n.state == NodeJobState::Pending)
                .map(|(k, _)| k.clone())
                .take(limit - running)
                .collect();
            if pending.is_empty() {
                continue;
            }
            for name in pending {
                let held = inv.bytes_held(&name, &job.blobs).unwrap_or(0);
                if let Some(nj) = job.nodes.get_mut(&name) {
                    nj.state = NodeJobState::Running;
                    nj.started_at = Some(now);
                    nj.bytes_at_start = held;
                    nj.bytes_done = held;
                    nj.rate_bytes_per_sec = rate;
                    nj.eta_seconds = rate.map(|r| (nj.bytes_total - held) as f64 / r as f64);
                    nj.seed = !seeded;
                    nj.updated_at = now;
                }
                out.push(Assignment {
                    job_id: id,
                    agent_url: inv.entry(&name).and_then(|e| e.report.agent_url.clone()),
                    node: name,
                    images: job
                        .images
                        .iter()
                        .map(|i| (i.reference.clone(), i.manifest_digest.to_string()))
                        .collect(),
                    blobs: job.blobs.clone(),
                    bytes_per_sec: rate,
                    pin_until: job.pin_until,
                    deadline_at: job.deadline_at,
                    priority: job.request.priority,
                    seed: !seeded,
                    into_runtime: job.request.into_runtime,
                });
            }
            self.save(id)?;
        }
        Ok(out)
    }

    /// Prewarm lead times (first use after the node finished warming − finish time)
    /// not measured before; each (job, node) is measured once.
    pub fn take_lead_times(&mut self, inv: &Inventory) -> Result<Vec<f64>> {
        let mut out = Vec::new();
        let mut changed = Vec::new();
        for job in self.jobs.values_mut() {
            let digests: BTreeSet<_> = job
                .images
                .iter()
                .map(|i| i.manifest_digest.clone())
                .collect();
            for (name, nj) in job.nodes.iter_mut() {
                let (NodeJobState::Done, Some(done), false) =
                    (&nj.state, nj.finished_at, nj.lead_measured)
                else {
                    continue;
                };
                let Some(e) = inv.entry(name) else { continue };
                let first_use = e
                    .report
                    .images
                    .iter()
                    .filter(|i| digests.contains(&i.manifest_digest))
                    .filter_map(|i| i.last_use)
                    .filter(|u| *u >= done)
                    .min();
                if let Some(u) = first_use {
                    out.push((u - done) as f64);
                    nj.lead_measured = true;
                    changed.push(job.id);
                }
            }
        }
        changed.dedup();
        for id in changed {
            self.save(id)?;
        }
        Ok(out)
    }
}
