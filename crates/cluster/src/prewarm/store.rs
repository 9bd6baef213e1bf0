//! Prewarm jobs in memory and in a redb file (one JSON record per job), and the
//! scheduling step that turns them into assignments.
//!
//! The steps that read the inventory ([`JobStore::observe`],
//! [`JobStore::next_assignments`], [`JobStore::take_lead_times`]) come in two forms:
//! the public one persists at once; the `*_deferred` one returns the ids to persist,
//! so the tracker can release the inventory lock before the redb commit (an fsync)
//! and the scheduler extender never waits behind the disk.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use redb::{ReadableTable, TableDefinition};

use super::{resolve_targets, validate, Assignment, Job, NodeJobState, NodeUpdate, PrewarmRequest};
use crate::error::{Error, Result};
use crate::inventory::{union_blobs, Inventory, NodeStatus, ResolvedImage};

const JOBS: TableDefinition<u64, &[u8]> = TableDefinition::new("prewarm_jobs");

/// Prewarm jobs, in memory and in a redb file (one JSON record per job).
pub struct JobStore {
    db: redb::Database,
    jobs: BTreeMap<u64, Job>,
    /// Jobs changed since [`take_changed`](Self::take_changed): what a shared store
    /// (Redis, issue 14) must be told.
    changed: BTreeSet<u64>,
}

/// Jobs read from a shared store at most: far above what operators submit, so a
/// corrupted or hostile store cannot make a replica allocate without bound.
pub const MAX_SHARED_JOBS: usize = 100_000;
/// A stored job longer than this is skipped (a job over 10,000 nodes is ≈ 3 MB).
pub const MAX_SHARED_JOB_BYTES: usize = 16 << 20;

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
        Ok(Self {
            db,
            jobs,
            changed: BTreeSet::new(),
        })
    }

    /// Makes this copy the job set a shared store holds (JSON records; oversized or
    /// unreadable ones are skipped with a warning). Nodes Running stay Running: their
    /// agents are at work and report to any replica.
    pub fn replace_all(&mut self, records: Vec<Vec<u8>>) {
        self.jobs.clear();
        self.changed.clear();
        for bytes in records.into_iter().take(MAX_SHARED_JOBS) {
            if bytes.len() > MAX_SHARED_JOB_BYTES {
                tracing::warn!(bytes = bytes.len(), "shared prewarm job too large; skipped");
                continue;
            }
            match serde_json::from_slice::<Job>(&bytes) {
                Ok(job) => {
                    self.jobs.insert(job.id, job);
                }
                Err(e) => tracing::warn!(error = %e, "unreadable shared prewarm job; skipped"),
            }
        }
    }

    /// The jobs changed since the last call, as (id, JSON), for a shared store.
    pub fn take_changed(&mut self) -> Result<Vec<(u64, Vec<u8>)>> {
        let ids = std::mem::take(&mut self.changed);
        ids.into_iter()
            .filter_map(|id| self.jobs.get(&id).map(|j| (id, j)))
            .map(|(id, j)| Ok((id, serde_json::to_vec(j)?)))
            .collect()
    }

    /// Persists the given jobs (ids from a `*_deferred` step), in one transaction.
    pub fn save_all(&mut self, ids: &BTreeSet<u64>) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        self.changed.extend(ids.iter().copied());
        let tx = self.db.begin_write()?;
        {
            let mut t = tx.open_table(JOBS)?;
            for id in ids {
                if let Some(job) = self.jobs.get(id) {
                    t.insert(*id, serde_json::to_vec(job)?.as_slice())?;
                }
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn save(&mut self, id: u64) -> Result<()> {
        let Some(job) = self.jobs.get(&id) else {
            return Ok(());
        };
        self.changed.insert(id);
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
        let job = Job::plan(id, req, images, &targets, inv, now)?;
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
        let changed = self.observe_deferred(inv, now);
        self.save_all(&changed)
    }

    /// [`observe`](Self::observe) without persisting: the ids to [`save_all`](Self::save_all).
    pub fn observe_deferred(&mut self, inv: &Inventory, now: u64) -> BTreeSet<u64> {
        self.jobs
            .values_mut()
            .filter_map(|j| j.observe(inv, now).then_some(j.id))
            .collect()
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
        let (out, changed) = self.next_assignments_deferred(inv, now);
        self.save_all(&changed)?;
        Ok(out)
    }

    /// [`next_assignments`](Self::next_assignments) without persisting.
    pub fn next_assignments_deferred(
        &mut self,
        inv: &Inventory,
        now: u64,
    ) -> (Vec<Assignment>, BTreeSet<u64>) {
        let mut changed = BTreeSet::new();
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
                    nj.eta_seconds =
                        rate.map(|r| nj.bytes_total.saturating_sub(held) as f64 / r as f64);
                    nj.seed = !seeded;
                    nj.updated_at = now;
                }
                out.push(Assignment {
                    job_id: id,
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
                    files: job.request.files.clone(),
                });
            }
            changed.insert(id);
        }
        (out, changed)
    }

    /// Prewarm lead times (first use after the node finished warming − finish time)
    /// not measured before; each (job, node) is measured once.
    pub fn take_lead_times(&mut self, inv: &Inventory) -> Result<Vec<f64>> {
        let (out, changed) = self.take_lead_times_deferred(inv);
        self.save_all(&changed)?;
        Ok(out)
    }

    /// [`take_lead_times`](Self::take_lead_times) without persisting.
    pub fn take_lead_times_deferred(&mut self, inv: &Inventory) -> (Vec<f64>, BTreeSet<u64>) {
        let mut out = Vec::new();
        let mut changed = BTreeSet::new();
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
                    out.push(u.saturating_sub(done) as f64);
                    nj.lead_measured = true;
                    changed.insert(job.id);
                }
            }
        }
        (out, changed)
    }
}
