//! Prewarm jobs: the request model, validation, target selection, a per-node state
//! machine, progress, cancel, persistence (redb) and the scheduling step that tells
//! the tracker which node should fetch what, at which rate.
//!
//! The registry is hit about once: while no node of the cluster holds every blob of
//! the job and no target has finished, only one target (the seed) runs; the rest fan
//! out from peers afterwards, `parallelism` at a time.

mod store;

use std::collections::{BTreeMap, BTreeSet};

use oci::ImageReference;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::inventory::{union_blobs, BlobRef, Inventory, NodeStatus, ResolvedImage};
use crate::selector::Selector;
pub use store::{HeadersReplaced, JobChanges, JobStore, MAX_SHARED_JOBS, MAX_SHARED_JOB_BYTES};

pub use crate::wire::{
    file_reference, FileSource, PrewarmRequest, Targets, DEFAULT_PIN_TTL_SECONDS,
    DEFAULT_POOL_LABEL, FILE_REGISTRY, MAX_DEADLINE_SECONDS, MAX_FILE_URL, MAX_PIN_TTL_SECONDS,
};

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
    if let Some(t) = req.pin_ttl_seconds {
        if !(1..=MAX_PIN_TTL_SECONDS).contains(&t) {
            return Err(Error::InvalidRequest(format!(
                "pin_ttl_seconds must be between 1 and {MAX_PIN_TTL_SECONDS} (30 days), got {t}"
            )));
        }
    }
    if let Some(d) = req.deadline_seconds {
        if !(1..=MAX_DEADLINE_SECONDS).contains(&d) {
            return Err(Error::InvalidRequest(format!(
                "deadline_seconds must be between 1 and {MAX_DEADLINE_SECONDS} (7 days), got {d}"
            )));
        }
    }
    let moving: BTreeSet<String> = req
        .moving_tags
        .iter()
        .filter_map(|m| ImageReference::parse(m).ok())
        .map(|r| r.to_string())
        .collect();
    validate_files(req)?;
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

/// Each file source names a file reference among the images (and each file reference
/// has its source), with an http(s) URL of bounded length.
fn validate_files(req: &PrewarmRequest) -> Result<()> {
    if req.files.len() > req.images.len() {
        return Err(Error::InvalidRequest(
            "more \"files\" than \"images\"".into(),
        ));
    }
    for f in &req.files {
        if f.url.len() > MAX_FILE_URL {
            return Err(Error::InvalidRequest(format!(
                "a file URL is longer than {MAX_FILE_URL} bytes"
            )));
        }
        let ok = url::Url::parse(&f.url)
            .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host_str().is_some());
        if !ok {
            return Err(Error::InvalidRequest(format!(
                "file {}: not an http(s) URL",
                f.key
            )));
        }
        if !req.images.contains(&file_reference(&f.key)) {
            return Err(Error::InvalidRequest(format!(
                "file {} is not among \"images\" as {}",
                f.key,
                file_reference(&f.key)
            )));
        }
    }
    for raw in &req.images {
        if raw.starts_with(&format!("{FILE_REGISTRY}/"))
            && !req.files.iter().any(|f| &file_reference(&f.key) == raw)
        {
            return Err(Error::InvalidRequest(format!(
                "{raw}: a file needs its source in \"files\" (starling prewarm URL)"
            )));
        }
    }
    Ok(())
}

/// What a file reference of the request stands for: an image of one blob, the file.
pub fn resolve_file(req: &PrewarmRequest, reference: &str) -> Option<ResolvedImage> {
    let f = req
        .files
        .iter()
        .find(|f| file_reference(&f.key) == reference)?;
    Some(ResolvedImage {
        reference: reference.to_owned(),
        manifest_digest: f.key.clone(),
        blobs: vec![BlobRef {
            digest: f.key.clone(),
            size: f.size,
        }],
    })
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

/// A failure reason an agent sends is kept up to this many bytes: a node's state is
/// stored on its own (issue 14) and read back bounded.
pub const MAX_REASON_BYTES: usize = 2048;

/// A stored node state longer than this is skipped when read from a shared store.
pub const MAX_SHARED_NODE_BYTES: usize = 16 << 10;

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

impl NodeJob {
    /// An agent's word about this node's part of job `job`. Returns whether it
    /// changed anything (a finished node's state is final). A cancelled node's agent
    /// is told so, so that it stops fetching and pinning what nobody wants any more; so
    /// is one still making progress after the job's `deadline_at` (the tracker's clock
    /// decides, not the node's, which may run behind).
    pub fn apply(
        &mut self,
        job: u64,
        node: &str,
        update: NodeUpdate,
        now: u64,
        deadline_at: Option<u64>,
    ) -> Result<bool> {
        if self.state == NodeJobState::Cancelled {
            return Err(Error::NodeCancelled {
                job,
                node: node.to_owned(),
            });
        }
        let deadline_passed = deadline_at.is_some_and(|d| now > d);
        if deadline_passed
            && matches!(update, NodeUpdate::Progress { .. })
            && self.state != NodeJobState::Done
        {
            return Err(Error::DeadlinePassed {
                job,
                node: node.to_owned(),
            });
        }
        if self.state.is_terminal() {
            return Ok(false);
        }
        match update {
            NodeUpdate::Progress { bytes_done } => {
                self.bytes_done = bytes_done.min(self.bytes_total);
                self.state = NodeJobState::Running;
            }
            NodeUpdate::Done => {
                self.state = NodeJobState::Done;
                self.bytes_done = self.bytes_total;
                self.eta_seconds = Some(0.0);
                self.finished_at = Some(now);
            }
            NodeUpdate::Failed { mut reason } => {
                if reason.len() > MAX_REASON_BYTES {
                    let mut end = MAX_REASON_BYTES;
                    while !reason.is_char_boundary(end) {
                        end -= 1;
                    }
                    reason.truncate(end);
                }
                self.state = NodeJobState::Failed { reason };
                self.eta_seconds = None;
            }
        }
        self.updated_at = now;
        Ok(true)
    }
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

/// Whether a node's report shows every image of a job pinned at least until the job's
/// pin time.
fn pinned_on(images: &[ResolvedImage], pin_until: u64, report: &crate::wire::NodeReport) -> bool {
    images.iter().all(|i| {
        report.pins.iter().any(|p| {
            p.digest.as_ref() == Some(&i.manifest_digest)
                && p.expires_at.is_none_or(|t| t >= pin_until)
        })
    })
}

impl Job {
    /// Builds a job from a validated request, the images resolved at submit time and
    /// the chosen targets. Nodes already warm start Done; nodes whose cache budget is
    /// smaller than the job start DoesNotFit; silent nodes start Unknown. Times past
    /// the end of the clock are refused (validation bounds them far below that).
    pub fn plan(
        id: u64,
        request: PrewarmRequest,
        images: Vec<ResolvedImage>,
        targets: &[String],
        inv: &Inventory,
        now: u64,
    ) -> Result<Self> {
        let after = |secs: u64, what: &str| {
            now.checked_add(secs).ok_or_else(|| {
                Error::InvalidRequest(format!("{what} of {secs} s runs past the end of time"))
            })
        };
        let deadline_at = request
            .deadline_seconds
            .map(|d| after(d, "deadline_seconds"))
            .transpose()?;
        let pin_until = after(
            request.pin_ttl_seconds.unwrap_or(DEFAULT_PIN_TTL_SECONDS),
            "pin_ttl_seconds",
        )?;
        let blobs = union_blobs(&images);
        let total: u64 = blobs.iter().map(|b| b.size).fold(0, u64::saturating_add);
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
        Ok(Self {
            id,
            deadline_at,
            pin_until,
            request,
            images,
            blobs,
            total_bytes: total,
            created_at: now,
            cancelled_at: None,
            nodes,
        })
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
            bytes_done: self
                .nodes
                .values()
                .map(|n| n.bytes_done)
                .fold(0, u64::saturating_add),
            bytes_total: self
                .nodes
                .values()
                .map(|n| n.bytes_total)
                .fold(0, u64::saturating_add),
            eta_seconds: self
                .nodes
                .values()
                .filter(|n| n.state == NodeJobState::Running)
                .filter_map(|n| n.eta_seconds)
                .reduce(f64::max),
        }
    }

    /// The job as shown: file URLs without their queries (presigned signatures).
    pub fn view(&self) -> JobView {
        let mut job = self.clone();
        for f in &mut job.request.files {
            *f = f.redacted();
        }
        JobView {
            job,
            progress: self.progress(),
        }
    }

    /// Updates from the inventory: bytes held, done, node gone silent or back,
    /// deadline. Returns the nodes whose state changed.
    pub fn observe(&mut self, inv: &Inventory, now: u64) -> Vec<String> {
        if !self.is_active() {
            return Vec::new();
        }
        let mut changed = Vec::new();
        let deadline_passed = self.deadline_at.is_some_and(|d| now > d);
        let (images, pin_until, into_runtime) =
            (&self.images, self.pin_until, self.request.into_runtime);
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
                Some(e) => {
                    let held = inv.bytes_held(name, &self.blobs).unwrap_or(0);
                    nj.bytes_done = held;
                    // A node working on this job pins its images (and may import them
                    // into its runtime) after the bytes are in: it is done when it says
                    // so, or when its report shows the job's pins (its word was lost).
                    let finished_its_part = nj.state != NodeJobState::Running
                        || (!into_runtime && pinned_on(images, pin_until, &e.report));
                    if held == nj.bytes_total && finished_its_part {
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
                        nj.eta_seconds =
                            rate.map(|r| nj.bytes_total.saturating_sub(held) as f64 / r);
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
            if !eta_moved(before.eta_seconds, nj.eta_seconds) {
                // The clock alone moves a running node's ETA every second: a node is
                // written (to redb, or to Redis for every replica) when something else
                // changed or the ETA moved by a step worth showing.
                nj.eta_seconds = before.eta_seconds;
            }
            if *nj != before {
                nj.updated_at = now;
                changed.push(name.clone());
            }
        }
        changed
    }
}

/// An ETA change below this many seconds is not worth a write...
const ETA_STEP_MIN_S: f64 = 5.0;
/// ...nor one below this fraction of the ETA last written.
const ETA_STEP_FRACTION: f64 = 0.1;

/// Whether a node's ETA moved enough to be written: it appeared or went, or it moved
/// by at least 5 s and 10 % of the one written (an ETA of 100 s is rewritten when it
/// crosses 90 or 110 s; 20 s when it crosses 15 or 25 s).
fn eta_moved(written: Option<f64>, now: Option<f64>) -> bool {
    match (written, now) {
        (Some(w), Some(n)) => {
            let step = (w.abs() * ETA_STEP_FRACTION).max(ETA_STEP_MIN_S);
            (n - w).abs() >= step || !n.is_finite() || !w.is_finite()
        }
        (None, None) => false,
        _ => true,
    }
}

pub use crate::wire::{Assignment, NodeUpdate, MAX_WAITING_ASSIGNMENTS};
