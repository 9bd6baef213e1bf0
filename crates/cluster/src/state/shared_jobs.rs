//! The prewarm job set shared by tracker replicas (issue 14), on this replica's copy:
//! changes under the share's lock, reads, and agents' node reports that touch their
//! own node only (see [`crate::share`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::ClusterState;
use crate::error::{Error, Result};
use crate::prewarm::{NodeJob, NodeUpdate, MAX_SHARED_NODE_BYTES};
use crate::share::{ClusterShare, NodeWrite};

/// Where a replica's copy of the shared job set is.
#[derive(Default)]
pub(crate) struct JobSync {
    /// Version of the job headers the copy holds (0: read them all again).
    version: u64,
    /// The node revision the copy has read up to.
    revision: u64,
    /// Each node's revision as the copy holds it: what the copy's writes of that
    /// node expect to find.
    revisions: HashMap<(u64, String), u64>,
}

/// How often an agent's node report is tried again when another write of the same
/// node came first.
const NODE_WRITE_TRIES: usize = 8;

impl ClusterState {
    /// Runs `f`, which changes jobs through this state's methods, as one change of
    /// the job set: with a share, under its cluster-wide lock on a copy brought up to
    /// date first, and written back before the lock is released; without one, as is.
    pub async fn change_jobs<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        self.change_jobs_fenced(None, f).await.map(|(r, _)| r)
    }

    /// [`change_jobs`](Self::change_jobs) for a planner: with a `fence` (its lease
    /// epoch), nothing is written once a newer planner took the lease (an error);
    /// also returns the (job, node) changes that were not written because the node
    /// was written first by someone else (an agent's report through any replica):
    /// the node keeps that state, and whatever `f` decided for it (an assignment)
    /// must be dropped and decided again.
    pub async fn change_jobs_fenced<R>(
        &self,
        fence: Option<u64>,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<(R, BTreeSet<(u64, String)>)> {
        let Some(share) = self.inner.share.get().cloned() else {
            return f().map(|r| (r, BTreeSet::new()));
        };
        let mut sync = self.inner.job_sync.lock().await;
        let begun = share.begin(sync.version).await?;
        if let Err(e) = self
            .sync_copy(&*share, &mut sync, begun.jobs, begun.version)
            .await
        {
            let _ = share.commit(begun.lock, None, Vec::new()).await;
            return Err(e);
        }
        let r = f();
        match self
            .write_changes(&*share, &mut sync, begun.lock, fence)
            .await
        {
            Ok(lost) => r.map(|r| (r, lost)),
            Err(e) => {
                // The copy holds changes the share may lack: read everything again.
                *sync = JobSync::default();
                Err(e)
            }
        }
    }

    /// Applies headers (when given) and node states written since the copy's
    /// revision. On failure the copy is marked to be read whole next time.
    async fn sync_copy(
        &self,
        share: &dyn ClusterShare,
        sync: &mut JobSync,
        headers: Option<Vec<Vec<u8>>>,
        version: u64,
    ) -> Result<()> {
        let mut fresh = Vec::new();
        if let Some(records) = headers {
            let replaced = self.inner.jobs.lock().replace_headers(records);
            if !replaced.gone.is_empty() {
                sync.revisions
                    .retain(|(id, _), _| !replaced.gone.contains(id));
            }
            fresh = replaced.fresh;
        }
        sync.version = version;
        let pulled = match share.pull_nodes(sync.revision, fresh).await {
            Ok(p) => p,
            Err(e) => {
                *sync = JobSync::default();
                return Err(e);
            }
        };
        if pulled.reset {
            sync.revisions.clear();
        }
        let mut jobs = self.inner.jobs.lock();
        for r in pulled.nodes {
            if jobs.merge_node(r.job, r.node.clone(), &r.json) {
                sync.revisions.insert((r.job, r.node), r.revision);
            }
        }
        sync.revision = pulled.revision;
        Ok(())
    }

    /// Writes the copy's changes: node states first (each only if no one wrote it
    /// since the copy read it), then headers, releasing the lock. Returns the node
    /// changes that lost.
    async fn write_changes(
        &self,
        share: &dyn ClusterShare,
        sync: &mut JobSync,
        lock: String,
        fence: Option<u64>,
    ) -> Result<BTreeSet<(u64, String)>> {
        let changes = self.inner.jobs.lock().take_changed();
        let changes = match changes {
            Ok(c) => c,
            Err(e) => {
                let _ = share.commit(lock, None, Vec::new()).await;
                return Err(e);
            }
        };
        let mut by_job: BTreeMap<u64, Vec<NodeWrite>> = BTreeMap::new();
        for (job, node, json) in changes.nodes {
            let expect = sync
                .revisions
                .get(&(job, node.clone()))
                .copied()
                .unwrap_or(0);
            by_job
                .entry(job)
                .or_default()
                .push(NodeWrite { node, expect, json });
        }
        let mut lost = BTreeSet::new();
        for (job, writes) in by_job {
            let names: Vec<String> = writes.iter().map(|w| w.node.clone()).collect();
            let results = match share.write_nodes(job, fence, writes).await {
                Ok(r) => r,
                Err(e) => {
                    let _ = share.commit(lock, None, Vec::new()).await;
                    return Err(e);
                }
            };
            for (i, name) in names.into_iter().enumerate() {
                match results.get(i).copied().flatten() {
                    Some(revision) => {
                        sync.revisions.insert((job, name), revision);
                    }
                    None => {
                        lost.insert((job, name));
                    }
                }
            }
        }
        sync.version = share.commit(lock, fence, changes.headers).await?;
        Ok(lost)
    }

    /// Brings this copy of the job set up to date for a read (no lock; a no-op
    /// without a share).
    pub async fn refresh_jobs(&self) -> Result<()> {
        let Some(share) = self.inner.share.get().cloned() else {
            return Ok(());
        };
        let mut sync = self.inner.job_sync.lock().await;
        let (records, version) = share.read(sync.version).await?;
        self.sync_copy(&*share, &mut sync, records, version).await
    }

    /// An agent's progress, completion or failure for a job, as its HTTP report.
    /// With a share, only that node's state is read, changed and written back, if no
    /// one wrote it meanwhile (else tried again on the newer state): no lock is
    /// taken and no other node is touched, so a job's size does not make its
    /// reports slower.
    pub async fn report_prewarm_node(&self, id: u64, node: &str, update: NodeUpdate) -> Result<()> {
        let Some(share) = self.inner.share.get().cloned() else {
            return self.update_prewarm_node(id, node, update);
        };
        for _ in 0..NODE_WRITE_TRIES {
            let Some(record) = share.read_node(id, node.to_owned()).await? else {
                let job_known = self.with_jobs(|j| j.get(id).is_some());
                return Err(if job_known {
                    Error::UnknownNode(node.to_owned())
                } else {
                    Error::UnknownJob(id)
                });
            };
            if record.json.len() > MAX_SHARED_NODE_BYTES {
                return Err(Error::Shared(format!(
                    "the stored state of node {node} in job {id} is larger than {MAX_SHARED_NODE_BYTES} bytes"
                )));
            }
            let mut state: NodeJob = serde_json::from_slice(&record.json)?;
            // A job's deadline never changes, so this replica's copy of the job has it.
            let deadline_at = self.with_jobs(|j| j.get(id).and_then(|job| job.deadline_at));
            if !state.apply(id, node, update.clone(), self.now(), deadline_at)? {
                return Ok(());
            }
            let write = NodeWrite {
                node: node.to_owned(),
                expect: record.revision,
                json: serde_json::to_vec(&state)?,
            };
            if let Some(Some(_)) = share.write_nodes(id, None, vec![write]).await?.first() {
                return Ok(());
            }
        }
        Err(Error::Shared(format!(
            "node {node} of job {id} was written by others {NODE_WRITE_TRIES} times while this report was applied; retry"
        )))
    }
}
