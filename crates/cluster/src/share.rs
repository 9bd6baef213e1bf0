//! Where the cluster state tracker replicas share lives (issue 14). The decisions are
//! always this crate's ([`crate::JobStore`], [`crate::Inventory`]) on this replica's
//! copy; a [`ClusterShare`] keeps the copies of several replicas one state:
//!
//! - prewarm jobs: every change runs under a cluster-wide lock, on a copy brought up to
//!   date first ([`ClusterShare::begin`]), and is written back before the lock is let
//!   go ([`ClusterShare::commit`]), so two replicas never overwrite each other's change;
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
    /// Every job as the share holds it (JSON), when it changed since `version`;
    /// `None`: this replica's copy is current.
    pub jobs: Option<Vec<Vec<u8>>>,
    /// The version of the job set the copy is at after this.
    pub version: u64,
}

/// The prewarm job set shared by replicas.
pub trait ClusterShare: Send + Sync + 'static {
    /// Takes the lock on the job set (waiting a bounded time for it) and returns the
    /// jobs when they changed since `version`.
    fn begin(&self, version: u64) -> ShareFuture<'_, Begun>;
    /// Writes the changed jobs (id, JSON), bumps the version when there are any and
    /// lets go of the lock. Returns the version the copy is at.
    fn commit(&self, lock: String, changed: Vec<(u64, Vec<u8>)>) -> ShareFuture<'_, u64>;
    /// Jobs for a read, without the lock (`None`: unchanged since `version`).
    fn read(&self, version: u64) -> ShareFuture<'_, (Option<Vec<Vec<u8>>>, u64)>;
}

/// A report this replica took, for the other replicas: the whole report when its
/// contents changed (`report`), only the generation when it was a heartbeat.
#[derive(Clone, Debug)]
pub struct Published {
    pub node: String,
    pub generation: u64,
    pub report: Option<crate::NodeReport>,
}
