//! Where the cluster state tracker replicas share lives (issue 14). The decisions are
//! always this crate's ([`crate::JobStore`], [`crate::Inventory`]) on this replica's
//! copy; a [`ClusterShare`] keeps the copies of several replicas one state:
//!
//! - prewarm jobs are stored as headers (the job without its nodes) and one state per
//!   (job, node), each with a revision from one counter:
//!   - an agent's report reads its node's state and revision, applies the report and
//!     writes it back if the revision did not move ([`ClusterShare::read_node`],
//!     [`ClusterShare::write_nodes`]): it touches that node only, takes no lock, and
//!     a report that raced another is applied again on the newer state;
//!   - everything else (submit, cancel, the planner's step) runs under a cluster-wide
//!     lock on a copy brought up to date first ([`ClusterShare::begin`],
//!     [`ClusterShare::pull_nodes`]); its node changes are written the same
//!     compare-and-set way (a node an agent changed meanwhile keeps the agent's
//!     state, and the planner decides again at its next step), its headers before the
//!     lock is let go ([`ClusterShare::commit`]);
//! - node inventory: a report this replica took is published
//!   ([`ClusterState::share_reports`](crate::ClusterState::share_reports)); the
//!   tracker reads the others' and applies them here with the same checks.
//!
//! Without a share (the default, one tracker) the copy is the whole truth.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;

use parking_lot::Mutex;

use crate::error::Result;

pub type ShareFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// What [`ClusterShare::begin`] found.
pub struct Begun {
    /// Proof of the cluster-wide lock, handed back to [`ClusterShare::commit`].
    pub lock: String,
    /// Every job header as the share holds it (JSON), when they changed since
    /// `version`; `None`: this replica's copy is current.
    pub jobs: Option<Vec<Vec<u8>>>,
    /// The version of the job headers the copy is at after this.
    pub version: u64,
}

/// A node state as the share holds it.
#[derive(Clone, Debug)]
pub struct NodeRecord {
    pub job: u64,
    pub node: String,
    /// Its revision: what a write of this node must name to go through.
    pub revision: u64,
    pub json: Vec<u8>,
}

/// What [`ClusterShare::pull_nodes`] found.
#[derive(Debug, Default)]
pub struct NodesPulled {
    /// Node states written after the revision asked for (and every node of the
    /// `fresh` jobs).
    pub nodes: Vec<NodeRecord>,
    /// The revision the copy is at after applying them.
    pub revision: u64,
    /// The share's counter went back (its data was lost): the copy should drop what
    /// it knows of node revisions.
    pub reset: bool,
}

/// A node state to write if its revision is still `expect` (0: the node is new).
#[derive(Clone, Debug)]
pub struct NodeWrite {
    pub node: String,
    pub expect: u64,
    pub json: Vec<u8>,
}

/// The prewarm job set shared by replicas.
pub trait ClusterShare: Send + Sync + 'static {
    /// Takes the lock on the job set (waiting a bounded time for it) and returns the
    /// job headers when they changed since `version`.
    fn begin(&self, version: u64) -> ShareFuture<'_, Begun>;
    /// Writes the changed job headers (id, JSON), bumps the version when there are
    /// any and lets go of the lock. Returns the version the copy is at. With a
    /// `fence` (a planner's lease epoch), nothing is written once a newer planner
    /// took the lease (an error).
    fn commit(
        &self,
        lock: String,
        fence: Option<u64>,
        headers: Vec<(u64, Vec<u8>)>,
    ) -> ShareFuture<'_, u64>;
    /// Job headers for a read, without the lock (`None`: unchanged since `version`).
    fn read(&self, version: u64) -> ShareFuture<'_, (Option<Vec<Vec<u8>>>, u64)>;
    /// Node states written after revision `since`, and every node of `fresh` jobs.
    fn pull_nodes(&self, since: u64, fresh: Vec<u64>) -> ShareFuture<'_, NodesPulled>;
    /// One node's state and revision (`None`: the share has no such node).
    fn read_node(&self, job: u64, node: String) -> ShareFuture<'_, Option<NodeRecord>>;
    /// Writes node states of job `job`, each only if its revision is still the one it
    /// names. Returns, per write, the new revision or `None` (someone wrote first).
    /// With a `fence`, as [`commit`](Self::commit): nothing once a newer planner leads.
    fn write_nodes(
        &self,
        job: u64,
        fence: Option<u64>,
        writes: Vec<NodeWrite>,
    ) -> ShareFuture<'_, Vec<Option<u64>>>;
}

/// A report this replica took, for the other replicas: the whole report when its
/// contents changed (`report`), only the generation when it was a heartbeat.
#[derive(Clone, Debug)]
pub struct Published {
    pub node: String,
    pub generation: u64,
    pub report: Option<crate::NodeReport>,
}

/// Reports waiting to be published to the other replicas, at most one per node: a
/// node's newer report replaces the one waiting (latest wins), so a burst of reports
/// loses no node however large it is (before, a bounded channel of 1,024 dropped the
/// excess until the agents' next reports), and what waits is bounded by the nodes
/// the inventory keeps, not by the rate of reports.
pub struct PublishQueue {
    pending: Mutex<Pending>,
    ready: tokio::sync::Notify,
    max_nodes: usize,
}

#[derive(Default)]
struct Pending {
    /// Nodes in the order they first waited (each once).
    order: VecDeque<String>,
    by_node: HashMap<String, Published>,
}

impl PublishQueue {
    /// A queue for at most `max_nodes` distinct nodes at once (the inventory's limit:
    /// only reports it took are published).
    pub fn new(max_nodes: usize) -> Self {
        PublishQueue {
            pending: Mutex::new(Pending::default()),
            ready: tokio::sync::Notify::new(),
            max_nodes: max_nodes.max(1),
        }
    }

    /// Queues `p`, or folds it into the report of its node already waiting. False
    /// when it was dropped: `max_nodes` other nodes are waiting.
    pub fn push(&self, p: Published) -> bool {
        {
            let mut q = self.pending.lock();
            if let Some(waiting) = q.by_node.get_mut(&p.node) {
                // A heartbeat does not replace a waiting full report of its generation:
                // the other replicas need the contents.
                if p.report.is_some() || p.generation > waiting.generation {
                    *waiting = p;
                }
            } else {
                if q.by_node.len() >= self.max_nodes {
                    return false;
                }
                q.order.push_back(p.node.clone());
                q.by_node.insert(p.node.clone(), p);
            }
        }
        self.ready.notify_one();
        true
    }

    /// Waits until reports are queued, then takes up to `max` of them (the nodes that
    /// waited longest first).
    pub async fn take(&self, max: usize) -> Vec<Published> {
        loop {
            {
                let mut q = self.pending.lock();
                let mut out = Vec::new();
                while out.len() < max.max(1) {
                    let Some(node) = q.order.pop_front() else {
                        break;
                    };
                    if let Some(p) = q.by_node.remove(&node) {
                        out.push(p);
                    }
                }
                if !out.is_empty() {
                    return out;
                }
            }
            self.ready.notified().await;
        }
    }

    /// Nodes waiting.
    pub fn len(&self) -> usize {
        self.pending.lock().by_node.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heartbeat(node: &str, generation: u64) -> Published {
        Published {
            node: node.into(),
            generation,
            report: None,
        }
    }

    fn full(node: &str, generation: u64) -> Published {
        let report = serde_json::from_value(serde_json::json!({
            "node": node, "generation": generation, "labels": {},
            "cache_budget": 1, "cache_used": 0, "cache_free": 1,
            "blobs": [], "images": [],
        }))
        .expect("a report");
        Published {
            report: Some(report),
            ..heartbeat(node, generation)
        }
    }

    #[tokio::test]
    async fn a_burst_past_the_old_bound_keeps_every_node_once_with_its_latest_report() {
        let q = PublishQueue::new(20_000);
        // Three reports per node from 3,000 nodes: 9,000 pushes, beyond the 1,024 the
        // channel held.
        for generation in 1..=3 {
            for n in 0..3_000 {
                assert!(q.push(full(&format!("n{n}"), generation)));
            }
        }
        assert_eq!(q.len(), 3_000);
        let mut seen = Vec::new();
        while !q.is_empty() {
            seen.extend(q.take(512).await);
        }
        assert_eq!(seen.len(), 3_000, "every node once");
        assert!(seen.iter().all(|p| p.generation == 3 && p.report.is_some()));
        assert_eq!(seen[0].node, "n0", "in the order nodes first waited");
    }

    #[tokio::test]
    async fn a_heartbeat_does_not_replace_a_waiting_full_report() {
        let q = PublishQueue::new(10);
        q.push(full("a", 4));
        q.push(heartbeat("a", 4));
        let got = q.take(10).await;
        assert_eq!(got.len(), 1);
        assert!(got[0].report.is_some(), "the contents still go out");
        q.push(heartbeat("b", 1));
        q.push(heartbeat("b", 1));
        assert_eq!(q.take(10).await.len(), 1);
    }

    #[tokio::test]
    async fn distinct_nodes_beyond_the_bound_are_dropped_and_said_so() {
        let q = PublishQueue::new(2);
        assert!(q.push(heartbeat("a", 1)));
        assert!(q.push(heartbeat("b", 1)));
        assert!(!q.push(heartbeat("c", 1)));
        assert!(q.push(full("a", 2)), "a waiting node still takes news");
        assert_eq!(q.len(), 2);
    }

    #[tokio::test]
    async fn take_waits_for_a_push() {
        let q = std::sync::Arc::new(PublishQueue::new(10));
        let waiter = tokio::spawn({
            let q = q.clone();
            async move { q.take(10).await }
        });
        tokio::task::yield_now().await;
        q.push(heartbeat("late", 1));
        let got = waiter.await.expect("the task ends");
        assert_eq!(got[0].node, "late");
    }
}
