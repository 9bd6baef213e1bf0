//! Prewarm jobs in memory and in a redb file, and the scheduling step that turns them
//! into assignments.
//!
//! A job is stored as its header (the job without its nodes) and one record per
//! target node, so an agent's progress rewrites its own node's record only, whatever
//! the job's size (issue 14: jobs of 600–10,000 nodes). A shared store (Redis) is
//! told the same pieces ([`JobStore::take_changed`]).
//!
//! The steps that read the inventory ([`JobStore::observe`],
//! [`JobStore::next_assignments`], [`JobStore::take_lead_times`]) come in two forms:
//! the public one persists at once; the `*_deferred` one leaves the changes for
//! [`JobStore::flush`], so the tracker can release the inventory lock before the redb
//! commit (an fsync) and the scheduler extender never waits behind the disk.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use redb::{ReadableTable, TableDefinition};

use super::{
    resolve_targets, validate, Assignment, Job, NodeJob, NodeJobState, NodeUpdate, PrewarmRequest,
    MAX_SHARED_NODE_BYTES,
};
use crate::error::{Error, Result};
use crate::inventory::{union_blobs, Inventory, NodeStatus, ResolvedImage};

/// Job headers (files written before per-node records: whole jobs, moved on open).
const JOBS: TableDefinition<u64, &[u8]> = TableDefinition::new("prewarm_jobs");
/// One record per (job, node).
const JOB_NODES: TableDefinition<(u64, &str), &[u8]> = TableDefinition::new("prewarm_job_nodes");

/// Parts of the job set changed and not yet written somewhere.
#[derive(Default)]
struct Dirty {
    headers: BTreeSet<u64>,
    nodes: BTreeSet<(u64, String)>,
}

impl Dirty {
    fn is_empty(&self) -> bool {
        self.headers.is_empty() && self.nodes.is_empty()
    }

    fn extend(&mut self, other: Dirty) {
        self.headers.extend(other.headers);
        self.nodes.extend(other.nodes);
    }
}

/// Changes of the job set for a shared store, as JSON: headers (jobs without their
/// nodes) and node states.
#[derive(Default, Debug)]
pub struct JobChanges {
    pub headers: Vec<(u64, Vec<u8>)>,
    pub nodes: Vec<(u64, String, Vec<u8>)>,
}

/// What [`JobStore::replace_headers`] changed in the copy.
#[derive(Default, Debug)]
pub struct HeadersReplaced {
    /// Jobs new to this copy: their nodes must be read whole.
    pub fresh: Vec<u64>,
    /// Jobs the shared store no longer has (dropped from the copy).
    pub gone: Vec<u64>,
}

/// Prewarm jobs, in memory and in a redb file (headers and per-node records).
pub struct JobStore {
    db: redb::Database,
    jobs: BTreeMap<u64, Job>,
    /// Changed since the last [`flush`](Self::flush).
    unsaved: Dirty,
    /// With a shared store: changes not yet handed to it by
    /// [`take_changed`](Self::take_changed) (`None`: not shared, nothing kept).
    unshared: Option<Dirty>,
}

/// Jobs read from a shared store at most: far above what operators submit, so a
/// corrupted or hostile store cannot make a replica allocate without bound.
pub const MAX_SHARED_JOBS: usize = 100_000;
/// A stored job header longer than this is skipped.
pub const MAX_SHARED_JOB_BYTES: usize = 16 << 20;

/// The job's header: the job without its nodes.
fn header_json(job: &mut Job) -> Result<Vec<u8>> {
    let nodes = std::mem::take(&mut job.nodes);
    let json = serde_json::to_vec(job);
    job.nodes = nodes;
    Ok(json?)
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
        tx.open_table(JOB_NODES)?;
        tx.commit()?;
        let mut jobs = BTreeMap::new();
        let mut whole = Vec::new();
        {
            let tx = db.begin_read()?;
            let t = tx.open_table(JOBS)?;
            for row in t.iter()? {
                let (k, v) = row?;
                let job: Job = serde_json::from_slice(v.value())?;
                if !job.nodes.is_empty() {
                    whole.push(k.value());
                }
                jobs.insert(k.value(), job);
            }
            let t = tx.open_table(JOB_NODES)?;
            for row in t.iter()? {
                let (k, v) = row?;
                let (id, name) = k.value();
                if let Some(job) = jobs.get_mut(&id) {
                    job.nodes
                        .insert(name.to_owned(), serde_json::from_slice(v.value())?);
                }
            }
        }
        let mut store = Self {
            db,
            jobs,
            unsaved: Dirty::default(),
            unshared: None,
        };
        // A file of whole-job records: each becomes a header and node records once.
        for id in whole {
            store.mark_job(id);
        }
        store.flush()?;
        for job in store.jobs.values_mut() {
            for nj in job.nodes.values_mut() {
                if nj.state == NodeJobState::Running {
                    nj.state = NodeJobState::Pending;
                }
            }
        }
        Ok(store)
    }

    fn mark_node(&mut self, id: u64, node: &str) {
        self.unsaved.nodes.insert((id, node.to_owned()));
    }

    /// The header and every node of job `id`.
    fn mark_job(&mut self, id: u64) {
        self.unsaved.headers.insert(id);
        if let Some(job) = self.jobs.get(&id) {
            self.unsaved
                .nodes
                .extend(job.nodes.keys().map(|n| (id, n.clone())));
        }
    }

    /// From now on this copy is one of several sharing a store: changes are kept for
    /// [`take_changed`](Self::take_changed) and no longer written to the redb file.
    pub fn share(&mut self) {
        self.unshared.get_or_insert_with(Dirty::default);
    }

    /// Makes this copy's headers the ones a shared store holds (JSON records;
    /// oversized or unreadable ones are skipped with a warning). Jobs this copy has
    /// keep their nodes (they are read on their own, [`merge_node`](Self::merge_node));
    /// a record that still carries its nodes (written before per-node records) brings
    /// the ones this copy lacks, to be written as records of their own.
    pub fn replace_headers(&mut self, records: Vec<Vec<u8>>) -> HeadersReplaced {
        let mut out = HeadersReplaced::default();
        let mut seen = BTreeSet::new();
        for bytes in records.into_iter().take(MAX_SHARED_JOBS) {
            if bytes.len() > MAX_SHARED_JOB_BYTES {
                tracing::warn!(bytes = bytes.len(), "shared prewarm job too large; skipped");
                continue;
            }
            let mut job = match serde_json::from_slice::<Job>(&bytes) {
                Ok(job) => job,
                Err(e) => {
                    tracing::warn!(error = %e, "unreadable shared prewarm job; skipped");
                    continue;
                }
            };
            let id = job.id;
            seen.insert(id);
            let carried = std::mem::take(&mut job.nodes);
            match self.jobs.get_mut(&id) {
                Some(have) => {
                    job.nodes = std::mem::take(&mut have.nodes);
                    *have = job;
                }
                None => {
                    out.fresh.push(id);
                    self.jobs.insert(id, job);
                }
            }
            if let (Some(unshared), Some(job)) = (self.unshared.as_mut(), self.jobs.get_mut(&id)) {
                for (name, nj) in carried {
                    if let std::collections::btree_map::Entry::Vacant(slot) = job.nodes.entry(name)
                    {
                        unshared.nodes.insert((id, slot.key().clone()));
                        slot.insert(nj);
                    }
                }
            }
        }
        out.gone = self
            .jobs
            .keys()
            .filter(|id| !seen.contains(id))
            .copied()
            .collect();
        for id in &out.gone {
            self.jobs.remove(id);
        }
        if let Some(u) = self.unshared.as_mut() {
            u.headers.retain(|id| seen.contains(id));
            u.nodes.retain(|(id, _)| seen.contains(id));
        }
        out
    }

    /// A node's state as a shared store holds it (read on its own), into job `id` of
    /// this copy. Oversized or unreadable records are skipped with a warning; false
    /// when the copy does not have the job.
    pub fn merge_node(&mut self, id: u64, node: String, record: &[u8]) -> bool {
        let Some(job) = self.jobs.get_mut(&id) else {
            return false;
        };
        if record.len() > MAX_SHARED_NODE_BYTES {
            tracing::warn!(job = id, %node, "shared prewarm node state too large; skipped");
            return false;
        }
        match serde_json::from_slice::<NodeJob>(record) {
            Ok(nj) => {
                job.nodes.insert(node, nj);
                true
            }
            Err(e) => {
                tracing::warn!(job = id, %node, error = %e, "unreadable shared prewarm node state; skipped");
                false
            }
        }
    }

    /// The changes since the last call, for a shared store: headers and node states.
    pub fn take_changed(&mut self) -> Result<JobChanges> {
        self.flush()?;
        let Some(dirty) = self.unshared.as_mut().map(std::mem::take) else {
            return Ok(JobChanges::default());
        };
        let mut out = JobChanges::default();
        for id in dirty.headers {
            if let Some(job) = self.jobs.get_mut(&id) {
                out.headers.push((id, header_json(job)?));
            }
        }
        for (id, name) in dirty.nodes {
            if let Some(nj) = self.jobs.get(&id).and_then(|j| j.nodes.get(&name)) {
                let json = serde_json::to_vec(nj)?;
                out.nodes.push((id, name, json));
            }
        }
        Ok(out)
    }

    /// Persists what changed (from a `*_deferred` step or a change), in one
    /// transaction; with a shared store, keeps it for [`take_changed`](Self::take_changed)
    /// instead.
    pub fn flush(&mut self) -> Result<()> {
        if self.unsaved.is_empty() {
            return Ok(());
        }
        let dirty = std::mem::take(&mut self.unsaved);
        if let Some(unshared) = self.unshared.as_mut() {
            unshared.extend(dirty);
            return Ok(());
        }
        let tx = self.db.begin_write()?;
        {
            let mut t = tx.open_table(JOBS)?;
            for id in &dirty.headers {
                if let Some(job) = self.jobs.get_mut(id) {
                    t.insert(*id, header_json(job)?.as_slice())?;
                }
            }
            let mut t = tx.open_table(JOB_NODES)?;
            for (id, name) in &dirty.nodes {
                if let Some(nj) = self.jobs.get(id).and_then(|j| j.nodes.get(name)) {
                    t.insert((*id, name.as_str()), serde_json::to_vec(nj)?.as_slice())?;
                }
            }
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
        self.mark_job(id);
        self.flush()?;
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
        let mut cancelled = Vec::new();
        for (name, nj) in job.nodes.iter_mut() {
            if !nj.state.is_terminal() {
                nj.state = NodeJobState::Cancelled;
                nj.eta_seconds = None;
                nj.updated_at = now;
                cancelled.push(name.clone());
            }
        }
        self.unsaved.headers.insert(id);
        for name in cancelled {
            self.mark_node(id, &name);
        }
        self.flush()?;
        self.get(id).ok_or(Error::UnknownJob(id))
    }

    /// Applies the inventory to every active job; persists what changed.
    pub fn observe(&mut self, inv: &Inventory, now: u64) -> Result<()> {
        self.observe_deferred(inv, now);
        self.flush()
    }

    /// [`observe`](Self::observe) without persisting (until [`flush`](Self::flush)):
    /// the ids of the jobs that changed.
    pub fn observe_deferred(&mut self, inv: &Inventory, now: u64) -> BTreeSet<u64> {
        let mut ids = BTreeSet::new();
        for job in self.jobs.values_mut() {
            for name in job.observe(inv, now) {
                self.unsaved.nodes.insert((job.id, name));
                ids.insert(job.id);
            }
        }
        ids
    }

    /// An agent's word about its part of a job.
    pub fn update_node(&mut self, id: u64, node: &str, update: NodeUpdate, now: u64) -> Result<()> {
        let job = self.jobs.get_mut(&id).ok_or(Error::UnknownJob(id))?;
        let nj = job
            .nodes
            .get_mut(node)
            .ok_or_else(|| Error::UnknownNode(node.to_owned()))?;
        if !nj.apply(id, node, update, now, job.deadline_at)? {
            return Ok(());
        }
        self.mark_node(id, node);
        self.flush()
    }

    /// Moves Pending nodes to Running within each job's parallelism (higher priority
    /// first) and returns what each should fetch. A job that nobody in the cluster
    /// holds yet runs one seed node first.
    pub fn next_assignments(&mut self, inv: &Inventory, now: u64) -> Result<Vec<Assignment>> {
        let (out, _) = self.next_assignments_deferred(inv, now);
        self.flush()?;
        Ok(out)
    }

    /// [`next_assignments`](Self::next_assignments) without persisting (until
    /// [`flush`](Self::flush)); also the ids of the jobs that changed.
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
                self.unsaved.nodes.insert((id, name.clone()));
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
        let (out, _) = self.take_lead_times_deferred(inv);
        self.flush()?;
        Ok(out)
    }

    /// [`take_lead_times`](Self::take_lead_times) without persisting (until
    /// [`flush`](Self::flush)); also the ids of the jobs that changed.
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
                    self.unsaved.nodes.insert((job.id, name.clone()));
                }
            }
        }
        (out, changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::NodeReport;

    fn report(node: &str) -> NodeReport {
        serde_json::from_value(serde_json::json!({
            "node": node,
            "generation": 1,
            "cache_budget": 1u64 << 40,
            "cache_used": 0,
            "cache_free": 1u64 << 40,
            "blobs": [],
            "images": [],
        }))
        .unwrap()
    }

    fn image() -> ResolvedImage {
        ResolvedImage {
            reference: "registry.test/ml/train:v1".into(),
            manifest_digest: oci::Digest::of(b"manifest"),
            blobs: vec![crate::inventory::BlobRef {
                digest: oci::Digest::of(b"layer"),
                size: 1 << 20,
            }],
        }
    }

    /// A file written when a job was one record (nodes inside) is read whole, and
    /// moved to a header and node records on open, so later reports write one node.
    #[test]
    fn a_file_of_whole_job_records_is_read_and_moved_to_node_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jobs.redb");
        let mut inv = Inventory::new(60);
        for n in ["a", "b"] {
            inv.apply(report(n), 100).unwrap();
        }
        let req: PrewarmRequest = serde_json::from_value(serde_json::json!({
            "images": ["registry.test/ml/train:v1"],
            "targets": {"nodes": ["a", "b"]},
        }))
        .unwrap();
        let job = Job::plan(1, req, vec![image()], &["a".into(), "b".into()], &inv, 100).unwrap();
        {
            let db = redb::Database::create(&path).unwrap();
            let tx = db.begin_write().unwrap();
            tx.open_table(JOBS)
                .unwrap()
                .insert(1, serde_json::to_vec(&job).unwrap().as_slice())
                .unwrap();
            tx.commit().unwrap();
        }
        {
            let mut store = JobStore::open(&path).unwrap();
            assert_eq!(store.get(1).unwrap().nodes.len(), 2);
            store.update_node(1, "a", NodeUpdate::Done, 101).unwrap();
        }
        let db = redb::Database::create(&path).unwrap();
        let tx = db.begin_read().unwrap();
        let header: Job = serde_json::from_slice(
            tx.open_table(JOBS)
                .unwrap()
                .get(1)
                .unwrap()
                .unwrap()
                .value(),
        )
        .unwrap();
        assert!(
            header.nodes.is_empty(),
            "the header no longer carries nodes"
        );
        let nodes = tx.open_table(JOB_NODES).unwrap();
        let a: NodeJob =
            serde_json::from_slice(nodes.get((1, "a")).unwrap().unwrap().value()).unwrap();
        let b: NodeJob =
            serde_json::from_slice(nodes.get((1, "b")).unwrap().unwrap().value()).unwrap();
        assert_eq!(a.state, NodeJobState::Done);
        assert_eq!(b.state, NodeJobState::Pending);
    }
}
