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

use std::future::Future;
use std::pin::Pin;

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
