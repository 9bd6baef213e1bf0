//! Where a tracker keeps what its replicas share (issue 14). The decision about an
//! announce is always `swarm::TrackerState::announce` on this replica's copy; a
//! [`SwarmStore`] brings the copy up to date before ([`SwarmStore::load`]) and settles
//! the outcome after ([`SwarmStore::commit`]): the election, the member entry, the
//! geometry and the hashes.
//!
//! - [`Embedded`] (the default): the copy is the whole truth; loading returns nothing
//!   and committing confirms what the copy decided.
//! - [`crate::redis_store::RedisStore`] (`--redis URL`): Redis holds the truth for
//!   every replica; an election is confirmed only by an atomic `SET NX PX` there.

use std::collections::BTreeMap;
use std::time::Instant;

use futures::future::BoxFuture;
use oci::Digest;
use swarm::state::{SharedPeer, SharedSwarm};
use swarm::PieceHash;

use crate::Error;

/// What one announce, as this replica decided it, leaves in the store.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub digest: Digest,
    pub node: String,
    /// The member entry; `None`: the node left.
    pub peer: Option<SharedPeer>,
    /// The geometry the decision used.
    pub size: Option<u64>,
    pub piece_size: u64,
    pub born: u64,
    /// What the decision did about the registry fetcher.
    pub intent: SourceIntent,
    /// The source this replica's copy names after the decision.
    pub decided_source: Option<String>,
    /// A source the decision demoted (the members fetching could not reach it): the
    /// store lets it go if it still holds the role, so that `Claim` can elect anew.
    pub deposed: Option<String>,
    /// The source voided its hashes (its registry bytes failed the digest): the store
    /// forgets them and every replica moves to the next hash epoch.
    pub void_hashes: bool,
    /// The source read another size from the registry than the one stored, or a
    /// complete holder mended a small swarm's (`intent` tells which): the store
    /// replaces the geometry, which it otherwise sets once.
    pub regeometry: bool,
    /// Hashes the node sent that fit the swarm; kept only if it is the source.
    pub hashes: BTreeMap<u32, PieceHash>,
    /// The node's reports of other members this announce recorded (accused, until in
    /// the store's milliseconds): shared, so a quorum counts reports heard by any
    /// replica.
    pub reports: Vec<(String, u64)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceIntent {
    /// The copy made (or kept) this node the source: claim or renew the role.
    Claim,
    /// The node finished or left: give the role up if it holds it.
    Release,
    /// Nothing about the role.
    Keep,
}

/// What the store settled for one [`Outcome`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settled {
    /// The registry fetcher the store names (the answer must say this one).
    pub source: Option<String>,
    /// The geometry the store holds; the decision's must match it.
    pub size: Option<u64>,
    pub piece_size: u64,
}

/// Elections of one swarm across all replicas.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Elections {
    pub count: u32,
    /// The first few elected.
    pub elected: Vec<String>,
}

pub type StoreFuture<'a, T> = BoxFuture<'a, Result<T, Error>>;

/// Whether a load also reads a swarm's members and hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refresh {
    /// Geometry and source only (seeding batches: a seeder needs no handout).
    No,
    /// Members too when this replica's copy is older than the refresh interval.
    WhenDue,
    /// Members now: a decision is about to elect a fetcher.
    Now,
}

/// The shared part of the tracker's swarm state.
pub trait SwarmStore: Send + Sync + 'static {
    /// Milliseconds on the clock every replica of this store uses.
    fn now_ms(&self) -> u64;
    /// The shared state of each swarm in `digests`, or `None` where this replica's copy is
    /// the truth. `refresh`: whether members and hashes are read too.
    fn load<'a>(
        &'a self,
        digests: &'a [Digest],
        refresh: Refresh,
    ) -> StoreFuture<'a, Vec<Option<SharedSwarm>>>;
    /// Settles what announces decided, in order.
    fn commit<'a>(&'a self, outcomes: &'a [Outcome]) -> StoreFuture<'a, Vec<Settled>>;
    /// Elections of each swarm across replicas; `None`: the copy counts them all.
    fn elections<'a>(&'a self, digests: &'a [Digest]) -> StoreFuture<'a, Option<Vec<Elections>>>;
    /// Whether the store answers right now (readiness).
    fn healthy(&self) -> bool;
    /// Short name for logs and `/healthz`.
    fn kind(&self) -> &'static str;
}

/// The single-process tracker: its memory is the whole state.
pub struct Embedded {
    started: Instant,
}

impl Default for Embedded {
    fn default() -> Self {
        Embedded {
            started: Instant::now(),
        }
    }
}

impl SwarmStore for Embedded {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn load<'a>(
        &'a self,
        digests: &'a [Digest],
        _refresh: Refresh,
    ) -> StoreFuture<'a, Vec<Option<SharedSwarm>>> {
        Box::pin(async move { Ok(vec![None; digests.len()]) })
    }

    fn commit<'a>(&'a self, outcomes: &'a [Outcome]) -> StoreFuture<'a, Vec<Settled>> {
        Box::pin(async move {
            Ok(outcomes
                .iter()
                .map(|o| Settled {
                    source: o.decided_source.clone(),
                    size: o.size,
                    piece_size: o.piece_size,
                })
                .collect())
        })
    }

    fn elections<'a>(&'a self, _digests: &'a [Digest]) -> StoreFuture<'a, Option<Vec<Elections>>> {
        Box::pin(async { Ok(None) })
    }

    fn healthy(&self) -> bool {
        true
    }

    fn kind(&self) -> &'static str {
        "embedded"
    }
}
