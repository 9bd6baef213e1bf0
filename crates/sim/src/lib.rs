//! Starling's scale simulator and capacity planner (`starling sim`).
//!
//! Answers "how long until my N-node job is running, and what does the registry see?"
//! for each distribution strategy. The swarm is not re-implemented: role election, peer
//! handout and piece hashes come from [`swarm::TrackerState::announce`], and every
//! agent's choice of which piece to fetch from whom comes from
//! [`swarm::PieceScheduler`]. The network is flow-level: bandwidth is shared max-min
//! fairly among concurrent transfers over node, rack, zone and registry links.
//!
//! Modules: [`scenario`] (TOML), [`model`] (topology and links), [`flow`] (max-min
//! solver), [`engine`] (event loop), [`strategy`], [`report`] (table, JSON, SVG),
//! [`cli`].
//!
//! # What is modelled
//!
//! - Links: each node's uplink and downlink (NIC, disk write speed, and for P2P
//!   Starling's upload/download limits), each rack's and zone's uplink in both
//!   directions (crossed only by flows leaving or entering them), the registry's
//!   total egress plus a per-connection cap, the shared cache's egress. Rates are the
//!   max-min fair allocation (progressive filling) over the flows in progress.
//! - Agents (P2P), as `crates/agent/src/p2p/{download,serve}.rs` do it: announce when a
//!   blob starts, then at the interval the tracker's reply names (the
//!   `announce_interval_ms`, a quarter of it for a member of a large swarm holding
//!   nothing yet) while downloading and once when complete; the tracker's reply gives the role and up to `max_peers` peers, whose
//!   bitfields are handed to the `PieceScheduler` (`set_peer`; peers missing from the
//!   reply are removed). A Source claims the whole blob and streams it from the
//!   registry on one connection, piece by piece, publishing piece hashes at its next
//!   announces. `next_requests` decides every piece request (per-agent seed
//!   `seed_for(node)`, `SchedulerConfig::default()` limits per peer and per blob).
//!   Non-urgent requests take from the agent-wide `RequestBudget`
//!   (`max_piece_requests`, 32) until their response ends; a blob's read head is
//!   requested urgently, outside the budget.
//! - Serving a piece (serve.rs): the holder's `swarm::upload::UploadQueue` (its
//!   `max_uploads` slots, urgent first, then the piece it sent fewest times), the
//!   upload bucket and the body through the socket; a full line answers busy and the
//!   requester rests that peer. In swarms of 64 or more members the requester's
//!   `PieceScheduler::stalled_requests` cancels what waited 200 ms without bytes (the
//!   holder confirms, the piece goes elsewhere), and above 256 members
//!   `swarm::links::to_drop` bounds the far links each download keeps.
//! - The pull client (`oci::pull`): one registry round trip for the manifest, then the
//!   image's blobs in order (`--oci-layout` reads the config and the layers) with
//!   `layer_concurrency` at once. Beside it the agent's layer prefetch
//!   (`starling.prefetch_layers`, on as in the agent): `prefetch_grace_ms` after the
//!   manifest, every layer `swarm::prefetch` picks that has not started yet starts, and
//!   the client's later request for it joins it (it takes no client slot). Every
//!   registry request takes `registry.latency_ms`
//!   plus a pseudo-random share of `registry.latency_jitter_ms`, fixed per (node,
//!   blob): when nodes start together, that jitter decides who announces a blob first
//!   and so becomes its source, which matters (BENCHMARKS.md, issue 6).
//!   Complete agents re-announce every `seed_heartbeat_ms` (the agent's seeding loop,
//!   1 s) to stay in handouts.
//!   Blobs below `min_p2p_size` go to the registry directly (`Role::Direct`).
//! - Direct pulls: one registry connection per layer; `layer_concurrency` layers per
//!   node at once (containerd: 3). Shared cache: one registry stream per blob into the
//!   cache, nodes read it cut-through piece by piece (never ahead of the fill).
//!
//! # Approximations
//!
//! - Flow-level: no TCP slow start, no per-request overhead beyond a fixed latency
//!   (`registry.latency_ms` once per registry request, `peer_latency_ms` one way for
//!   every frame between agents: a piece's request, and its last byte's arrival).
//! - Token buckets are rates: the agent's buckets start full and keep a burst of
//!   1/20 s worth (≥ 256 KiB) while under-used, which lets that much through at once
//!   after an idle spell; the simulator does not (pessimistic by at most one burst
//!   per idle spell).
//! - Pieces are verified the moment they arrive (the agent waits for the piece's hash
//!   from the tracker; the source publishes hashes ahead of the holders' bitfields, so
//!   this rarely costs anything) and unpacking is not modelled.
//! - The upload bucket is shared fairly by the pieces in their upload stage (the
//!   agent's bucket serves whole-piece reservations in order: same throughput, a
//!   different order of completion).
//! - `sim.quantum_ms > 0`: rates are recomputed at most once per quantum; a flow that
//!   finishes inside a quantum completes at its exact time, but the bandwidth it frees
//!   (and the requests its completion triggers) start at the quantum's end. Error
//!   grows with quantum / piece transfer time; see `quantum_mode_stays_close_to_exact_mode`
//!   and the crate README figures.
//! - A coarser `starling.piece_size` than the agent's rule gives fewer scheduler and
//!   solver events, but store-and-forward per piece costs one piece time per hop, so
//!   results are pessimistic by about (tree depth × piece time). The shipped scenarios
//!   use the rule (64 MiB at 25 Gbit/s).
//! - Cost at scale: every HAVE goes to every channel open on the blob, so HAVE
//!   deliveries (pieces × nodes × links: 139 M at 10,000 nodes) dominate a large run,
//!   then the scheduling passes (7 M) and the tracker's handouts. Each is a cache miss
//!   or a few into one of 10,000 schedulers, so what they touch is kept small: a
//!   HAVE finds its link in a sorted vector (`pull::Links`) and sets one bit in the
//!   scheduler's row of peer bitfields, and a pass scans those rows, which lie in one
//!   allocation (BENCHMARKS.md, "Issue 6/11 — the simulator at 10,000 nodes").
#![forbid(unsafe_code)]

pub mod cli;
pub mod engine;
pub mod flow;
pub mod model;
pub mod report;
pub mod scenario;
pub mod strategy;

pub use cli::{run, SimArgs};
pub use engine::{simulate, Outcome, UploadRecord};
pub use report::{Report, StrategyResult};
pub use scenario::Scenario;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("scenario: {0}")]
    Scenario(String),
    #[error("{0}")]
    Io(String),
    #[error("simulation: {0}")]
    Sim(String),
}
