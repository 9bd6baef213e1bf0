//! What one simulated run measured: the outcome the report is built from. Apart from
//! the engine because it is the run's result, read by `report` and `cli`, not state
//! the event loop steps through.

use std::collections::BTreeMap;

/// Counts of what the swarm protocol did in one run: messages, answers, transfers.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SwarmCounters {
    pub announces: u64,
    /// Pieces received from peers and kept.
    pub piece_transfers: u64,
    /// Piece copies received but not kept (an endgame duplicate, or a copy already
    /// claimed by another connection).
    pub dropped_pieces: u64,
    pub requests: u64,
    /// Scheduling passes (`next_requests` calls).
    pub passes: u64,
    /// Requests answered "busy" (the holder's line was full).
    pub busy_rejects: u64,
    /// Requests answered "not held" (a stale view).
    pub not_held_rejects: u64,
    /// Requests cancelled while waiting in a source's line because a HAVE showed the
    /// piece elsewhere (`retarget_on_have`), and endgame duplicates cancelled.
    pub retargets: u64,
    pub cancels: u64,
    /// Requests cancelled because their bytes had not begun within the stall timeout
    /// (`SchedulerConfig::stall_ms`, swarms of 64 or more).
    pub stall_cancels: u64,
    /// Downloads whose rack stripe went quiet (`SchedulerConfig::stripe_quiet_ms`) and
    /// that asked far holders for every HAVE again.
    pub stripes_distrusted: u64,
    /// Links dropped by `swarm::links::to_drop` with their channel open.
    pub links_dropped: u64,
    /// Pieces that arrived before their hash was known and waited for it.
    pub hash_waits: u64,
    pub hash_fetches: u64,
    /// Hash lists asked of a complete peer (no source publishing).
    pub peer_hash_lists: u64,
    /// HAVE frames delivered and bitfields sent on channel opens.
    pub haves: u64,
    pub bitfields: u64,
    /// Peer connections dialed (one per pair of nodes) and channels opened (per blob).
    pub connections: u64,
    pub channels: u64,
    /// The most links any download task kept for one blob.
    pub max_links: usize,
    /// The most budgeted piece requests any node had in flight at once.
    pub peak_requests: u32,
}

/// What one simulated run measured.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Time-to-ready per job node (seconds after the job starts; includes arrival
    /// offset and `start_overhead_s`).
    pub ready_s: Vec<f64>,
    pub registry_bytes: f64,
    pub cache_bytes: f64,
    /// Piece bytes delivered between agents (including copies dropped as duplicates).
    pub p2p_bytes: f64,
    /// Bytes that entered a rack from outside it (from peers in other racks, and from
    /// the registry or the cache, which sit outside every rack).
    pub cross_rack_bytes: f64,
    pub source_elections: u32,
    /// Registry bytes streamed by each swarm source, by node name.
    pub source_bytes: BTreeMap<String, f64>,
    /// Registry connections opened by swarm sources (one per slice).
    pub registry_connections: u64,
    pub steps: u64,
    /// What the swarm protocol did (also in the report, under the same names).
    pub counters: SwarmCounters,
    /// With `sim.trace`: every piece a holder handed to a connection's writer, in
    /// order.
    pub uploads: Vec<UploadRecord>,
    /// Time to first byte of swarm blobs on nodes that did not fetch them from the
    /// registry: from the blob's request to its first piece held (seconds).
    pub non_seed_ttfb: Vec<f64>,
    pub wall_s: f64,
    pub tracker_wall_s: f64,
    pub scheduler_wall_s: f64,
    pub solver_wall_s: f64,
    /// Nodes that never became ready (stopped at `max_seconds` or stuck).
    pub stuck: usize,
}

/// A piece a holder began to send (`sim.trace`).
#[derive(Clone, Debug, PartialEq)]
pub struct UploadRecord {
    pub t: f64,
    /// Cluster node indices.
    pub holder: u32,
    pub to: u32,
    pub layer: u32,
    pub piece: u32,
    pub urgent: bool,
}
