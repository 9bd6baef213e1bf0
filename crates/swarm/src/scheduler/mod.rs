//! The downloader's piece scheduler: which missing piece to ask which peer for next.
//! I/O-free and driven by events, so the agent and the simulator run the same policy.
//!
//! Policy:
//! - The read head (the first missing piece) is asked for first and marked urgent, so
//!   bytes stream to the runtime in order; it goes to the best peer that holds it even
//!   when that peer's window is full.
//! - Every other request fills a per-peer *window*: enough requests in flight to keep
//!   the peer's measured rate busy for [`SchedulerConfig::window_ms`], at least
//!   `min_window`. Windows are counted in requests, sized from throughput measured on
//!   the connection, not fixed.
//! - Within a window, rarest first (holder counts kept up to date as bitfields and
//!   HAVEs arrive), ties in a per-node seeded order so nodes that start together fetch
//!   different pieces and trade them.
//! - Among holders of equal load and distance: one not measured yet first (so every
//!   holder is tried), then the faster in doublings of the measured rate, then this
//!   node's own order of peers, so requesters spread over equal holders.
//! - Near peers before far ones at equal load. With rack stripes (large swarms), a
//!   piece is fetched from outside the rack only by the member whose stripe it is in,
//!   or by anyone once it has been available outside for `patience_ms` without a near
//!   holder: each rack takes each piece from outside about once and spreads it inside.
//! - Source stripes (small swarms, while a source fetches from the registry): the
//!   source's uplink is where fresh pieces enter and it fills no faster than the
//!   source downloads, so a second copy of a piece from it is a piece the swarm lacks.
//!   The source is asked only for pieces of this node's source stripe; the rest come
//!   from the members whose stripes they are in, or from the source after
//!   `source_patience_factor` × the time this node's own stripe pieces took from it.
//! - A peer that answers "busy" rests for `busy_backoff_ms`; one that sent a piece
//!   failing its hash is banned. (A peer that stops answering is the connection's
//!   business: it pings, then drops the connection, and the peer is removed.)
//! - Endgame: when every missing piece is in flight and few remain, each is also asked
//!   of a second peer, so one slow peer cannot hold up the tail.
//! - Swarms of [`STALL_MIN_MEMBERS`] or more (the tracker's count, `set_members`): a
//!   request whose bytes have not begun after `stall_ms` is reported by
//!   [`PieceScheduler::stalled_requests`] for the caller to cancel; once the holder
//!   confirms ([`PieceScheduler::on_cancelled`]) the piece is open again and that
//!   holder rests for `stall_backoff_ms`, so the piece goes to another holder instead
//!   of waiting behind a long line. (The simulator showed lines of 100–240 requests at
//!   the few holders near where pieces enter the swarm while half the nodes received
//!   nothing.) This bounds how long a request waits in any holder's line. Swarms of
//!   more than [`LARGE_SWARM_MEMBERS`] wait `large_patience_ms` for a near holder
//!   before fetching outside their stripe: with stalls cancelled, a piece soon has a
//!   near holder, and far fetches cost the rack's uplink.

use std::collections::HashMap;

use crate::Bitfield;

use holders::Rows;
use picking::Cand;

mod holders;
mod outcomes;
mod picking;

pub type PeerId = String;

/// Swarms with at least this many members get stall timeouts (the size at which the
/// tracker gives rack stripes; the benchmarks of 4–16 nodes run without).
pub const STALL_MIN_MEMBERS: u32 = 64;
/// Swarms with more members than this wait `large_patience_ms` before fetching
/// outside their stripe (the size at which the tracker's handout spreads load); they
/// also bound their far links (`links`).
pub const LARGE_SWARM_MEMBERS: u32 = 256;
/// Swarms with more members than this wait `huge_patience_ms`: more racks hold each
/// piece sooner, so waiting for a near holder pays more (the simulator at 1,000 and
/// 10,000 nodes: BENCHMARKS.md, issue 11).
pub const HUGE_SWARM_MEMBERS: u32 = 2_048;
/// How long the read head may wait as an ordinary request before it is also asked of
/// another holder urgently.
pub const HEAD_PATIENCE_MS: u64 = 2_000;

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Requests in flight per peer, at least.
    pub min_window: u32,
    /// ... and at most.
    pub max_window: u32,
    /// A window covers this much time at the peer's measured rate.
    pub window_ms: u64,
    /// Requests in flight for the whole blob (read head and endgame aside).
    pub max_inflight_total: u32,
    /// Endgame starts when at most this many pieces are missing.
    pub endgame: u32,
    /// Among pieces equally rare, those within this many pieces of the read head go
    /// first (in the node's seeded order inside each such group): nodes that start
    /// together still ask for different pieces, while a node pulling from seeders
    /// gets the blob nearly in order, which its reader (the runtime) and its in-order
    /// digest want.
    pub order_group: u32,
    /// Per-node seed for ordering pieces of equal rarity.
    pub seed: u64,
    /// How long a peer that answered "busy" is left alone.
    pub busy_backoff_ms: u64,
    /// Rack stripes: how long a piece available only outside the rack waits for the
    /// member whose stripe it is in.
    pub patience_ms: u64,
    /// ... in swarms of more than [`LARGE_SWARM_MEMBERS`].
    pub large_patience_ms: u64,
    /// ... in swarms of more than [`HUGE_SWARM_MEMBERS`].
    pub huge_patience_ms: u64,
    /// Swarms of [`STALL_MIN_MEMBERS`] or more: a request whose bytes have not begun
    /// after this long is cancelled and asked elsewhere.
    pub stall_ms: u64,
    /// ... and the holder that kept it waiting rests this long.
    pub stall_backoff_ms: u64,
    /// Source stripes: how long a piece held only by the source waits for the member
    /// whose stripe it is in before anyone asks the source for it, as a multiple of
    /// the time this node's own stripe pieces took to come from the source (from the
    /// source's HAVE to the piece here: the wait in the source's line, which every
    /// member shares, and the transfer), between the two bounds below. It follows the
    /// links and the load; a rate-based rule did not (bursts of pieces completing
    /// together read as very fast links on a busy machine).
    pub source_patience_factor: u32,
    pub source_patience_min_ms: u64,
    /// ... also the patience before any rate is measured.
    pub source_patience_max_ms: u64,
    /// Swarms of [`STALL_MIN_MEMBERS`] or more leave this many of the agent-wide
    /// request budget (`max_new` of [`PieceScheduler::next_requests`]) unused: 16 of
    /// the default 32. In a large swarm a piece crosses several hops, each after the
    /// piece is whole here, so a link split over fewer pieces at once passes each on
    /// sooner; a small swarm needs the larger budget to keep every uplink busy while
    /// requests wait in the few holders' lines. The simulator with 16 against 32
    /// in flight, seeds 0/1/2: `seed-100x5gb` 1.285/1.257/1.255 against
    /// 1.285/1.269/1.262 × T*, `scale-1000x15gb` 1.278/1.282/1.293 against
    /// 1.284/1.286/1.314; real 16 × 8 MiB/s runs needed 32 (BENCHMARKS.md, issue 11).
    pub large_swarm_withheld_requests: u32,
    /// Rack stripes: after this long with nothing arriving (no piece, no bytes),
    /// far holders are asked for every HAVE again, for the rest of the blob
    /// ([`PieceScheduler::check_stripe_quiet`]). The stripe's near member may be alive
    /// for the tracker yet unreachable for its rack (a wrong `--advertise`, a
    /// firewalled peer port), and the far HAVEs it was trusted to replace would
    /// otherwise never come: two such rack-mates each waited forever for the other's
    /// half. Far longer than any gap between pieces in a working swarm.
    pub stripe_quiet_ms: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            min_window: 2,
            max_window: 16,
            window_ms: 40,
            max_inflight_total: 32,
            endgame: 4,
            order_group: 16,
            seed: 0,
            busy_backoff_ms: 25,
            patience_ms: 1_500,
            large_patience_ms: 4_000,
            huge_patience_ms: 6_000,
            stall_ms: 200,
            stall_backoff_ms: 1_000,
            source_patience_factor: 5,
            source_patience_min_ms: 1_000,
            source_patience_max_ms: 4_000,
            large_swarm_withheld_requests: 16,
            stripe_quiet_ms: 10_000,
        }
    }
}

/// A piece's holders among partial, unbanned peers: all of them, and those in this
/// node's rack. Side by side, so a HAVE that counts both touches one cache line.
#[derive(Clone, Copy, Debug, Default)]
struct Holders {
    any: u32,
    near: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub piece: u32,
    pub peer: PeerId,
    /// A reader waits on this piece: the holder serves it before queued requests.
    pub urgent: bool,
}

/// A peer's state, one cache line each (its name is in `PieceScheduler::names`): a
/// scheduling pass reads every slot, and a HAVE reads its sender's.
#[derive(Clone, Debug)]
#[repr(align(64))]
struct Slot {
    /// The peer has every piece (else its pieces are its row in `rows`).
    complete: bool,
    /// Pieces set in its row.
    held: u32,
    distance: u8,
    inflight: u32,
    banned: bool,
    /// Measured throughput from this peer (bytes/s, EWMA); 0 until the first piece.
    rate: f64,
    /// From `rate`, kept beside it (every pass reads them for every peer), small
    /// enough that a slot stays one cache line: requests in flight it may have
    /// ([`window_for`](outcomes::window_for)) ...
    window: u16,
    /// ... and its [`speed_class`](outcomes::speed_class) (`u8::MAX` before it is
    /// measured).
    speed: u8,
    /// This requester's own order among peers alike in everything else: a hash of
    /// its seed and the peer's name, so requesters spread over equal holders instead
    /// of all preferring the same one.
    tie: u64,
    /// Start of the current measurement: when the peer went from idle to busy, or its
    /// previous piece completed while others were still in flight.
    mark_ms: Option<u64>,
    busy_until_ms: u64,
    last_progress_ms: u64,
    /// The blob's source (it fetches from the registry): asked only within this node's
    /// source stripe.
    is_source: bool,
}

#[derive(Clone, Debug)]
pub struct PieceScheduler {
    cfg: SchedulerConfig,
    piece_size: u64,
    have: Bitfield,
    /// Pieces requested from at least one peer, or claimed by the registry stream.
    inflight_any: Bitfield,
    /// Per piece, the peer slots it is requested from. A vector by piece index:
    /// looked up on every scheduling pass, millions of times in a simulated swarm.
    inflight: Vec<Vec<u32>>,
    claimed: Bitfield,
    /// The read head and since when (ms) it has been the head.
    head_since: (u32, u64),
    /// The last piece asked for urgently as the read head.
    head_asked_urgently: Option<u32>,
    /// Holders per piece among partial, unbanned peers; complete peers are counted
    /// once in `complete_holders`.
    avail: Vec<Holders>,
    complete_holders: u32,
    /// ... and of those, the complete ones in this node's rack.
    complete_near_holders: u32,
    /// The pieces whose `avail` counts are not zero (`any`, `near`): a pass asks
    /// whether an open piece has a holder, one AND per byte instead of a count per
    /// piece (that loop was a seventh of `next_requests`' own time at 10,000
    /// simulated nodes).
    partly_held: Bitfield,
    partly_held_near: Bitfield,
    /// When each piece was first seen at some peer (ms), for rack-stripe patience.
    first_seen: Vec<u64>,
    slots: Vec<Option<Slot>>,
    /// The peers' names by slot (a freed slot's until it is taken again).
    names: Vec<PeerId>,
    rows: Rows,
    /// The sum of the slots' `inflight`, kept as they change: asked on every pass.
    inflight_total: u32,
    by_name: HashMap<PeerId, u32>,
    stripe: Option<(u32, u32)>,
    /// The pieces in `stripe` (none without one): a pass reads a piece's patience only
    /// outside it (`first_seen`, a cache miss per piece at 10,000 simulated nodes).
    stripe_pieces: Bitfield,
    /// When something last arrived (a piece, or bytes of one), or when the tracker
    /// first answered: what `stripe_quiet_ms` counts from.
    last_arrival_ms: Option<u64>,
    /// The same for pieces and bytes from peers only (`peer_quiet_ms`).
    last_peer_arrival_ms: Option<u64>,
    /// The rack stripe left far holders' HAVE filters for good (`check_stripe_quiet`).
    stripe_distrusted: bool,
    /// The source (the agent fetching from the registry) and this node's stripe of
    /// what to ask it for.
    source: Option<PeerId>,
    source_stripe: Option<(u32, u32)>,
    /// The source patience now (see [`SchedulerConfig::source_patience_factor`]),
    /// and the smoothed time a fresh piece took from the source's HAVE to here.
    source_patience_ms: u64,
    fresh_latency_ms: Option<f64>,
    /// The swarm's members as the tracker counted them last.
    members: u32,
    /// Stall timeouts on (`members` ≥ [`STALL_MIN_MEMBERS`]).
    large: bool,
    /// Requests in flight to peers: (piece, slot, when asked or last checked, ms).
    /// Kept only with stall timeouts on; a few dozen at most.
    asked: Vec<(u32, u32, u64)>,
    /// Requests cancelled for a stall, waiting for the holder's answer.
    stall_cancelled: Vec<(u32, u32)>,
    /// The fill loop's masks of open pieces (all peers, far peers), kept between
    /// passes so a pass allocates none.
    open_scratch: Vec<u8>,
    open_far_scratch: Vec<u8>,
    /// The fill loop's candidates, kept between passes (one allocation per pass was
    /// a tenth of the simulator's 10,000-node run, with `malloc`).
    cands_scratch: Vec<Cand>,
}

impl PieceScheduler {
    pub fn new(have: Bitfield, piece_size: u64, cfg: SchedulerConfig) -> Self {
        let n = have.len() as usize;
        Self {
            source_patience_ms: cfg.source_patience_max_ms,
            cfg,
            piece_size: piece_size.max(1),
            inflight_any: Bitfield::new(have.len()),
            claimed: Bitfield::new(have.len()),
            head_since: (u32::MAX, 0),
            head_asked_urgently: None,
            inflight: vec![Vec::new(); n],
            avail: vec![Holders::default(); n],
            complete_holders: 0,
            complete_near_holders: 0,
            partly_held: Bitfield::new(have.len()),
            partly_held_near: Bitfield::new(have.len()),
            first_seen: vec![u64::MAX; n],
            have,
            slots: Vec::new(),
            names: Vec::new(),
            rows: Rows {
                bytes: Vec::new(),
                width: n.div_ceil(8),
            },
            inflight_total: 0,
            by_name: HashMap::new(),
            stripe: None,
            stripe_pieces: Bitfield::new(n as u32),
            last_arrival_ms: None,
            last_peer_arrival_ms: None,
            stripe_distrusted: false,
            source: None,
            source_stripe: None,
            fresh_latency_ms: None,
            members: 0,
            large: false,
            asked: Vec::new(),
            stall_cancelled: Vec::new(),
            open_scratch: Vec::new(),
            open_far_scratch: Vec::new(),
            cands_scratch: Vec::new(),
        }
    }

    /// The swarm's size as the tracker counts it (`AnnounceResponse::members`): it
    /// switches stall timeouts and the large swarms' patience on or off.
    pub fn set_members(&mut self, members: u32, now_ms: u64) {
        self.members = members;
        self.last_arrival_ms.get_or_insert(now_ms);
        self.last_peer_arrival_ms.get_or_insert(now_ms);
        let large = members >= STALL_MIN_MEMBERS;
        if large && !self.large {
            // Requests sent before count from now.
            self.asked = (0..self.inflight.len() as u32)
                .flat_map(|p| {
                    self.inflight[p as usize]
                        .iter()
                        .map(move |&sl| (p, sl, now_ms))
                })
                .collect();
        }
        if !large {
            self.asked.clear();
            self.stall_cancelled.clear();
        }
        self.large = large;
    }

    /// How long a piece available only outside the rack waits for the stripe's member.
    pub fn patience_ms(&self) -> u64 {
        if self.members > HUGE_SWARM_MEMBERS {
            self.cfg.huge_patience_ms
        } else if self.members > LARGE_SWARM_MEMBERS {
            self.cfg.large_patience_ms
        } else {
            self.cfg.patience_ms
        }
    }

    pub fn have(&self) -> &Bitfield {
        &self.have
    }

    pub fn is_complete(&self) -> bool {
        self.have.is_complete()
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The rack stripe this node fetches from outside its rack: pieces `p` with
    /// `p % count == index`. `None`: fetch anything from anywhere.
    pub fn set_stripe(&mut self, stripe: Option<(u32, u32)>) {
        let stripe = stripe.filter(|&(i, n)| n > 1 && i < n);
        if stripe != self.stripe {
            self.stripe_pieces = Bitfield::new(self.have.len());
            if let Some((idx, n)) = stripe {
                for piece in (idx..self.have.len()).step_by(n as usize) {
                    self.stripe_pieces.set(piece);
                }
            }
        }
        self.stripe = stripe;
    }

    /// The rack stripe set by the last tracker answer (`set_stripe`).
    pub fn stripe(&self) -> Option<(u32, u32)> {
        self.stripe
    }

    /// The stripe far holders are asked to filter their HAVEs by
    /// (`links::HaveFilter::for_link`): the rack stripe, unless it was distrusted.
    pub fn far_have_stripe(&self) -> Option<(u32, u32)> {
        self.stripe.filter(|_| !self.stripe_distrusted)
    }

    /// Distrusts the rack stripe once nothing has arrived for `stripe_quiet_ms` while
    /// pieces are missing: far holders then send every HAVE, and a piece outside the
    /// stripe is taken from them after the usual patience. True at the moment it
    /// happens, when the caller sends the wider filters. For the rest of the blob: a
    /// stripe that starved this node once is not trusted again.
    pub fn check_stripe_quiet(&mut self, now_ms: u64) -> bool {
        let quiet = self
            .last_arrival_ms
            .is_some_and(|t| now_ms.saturating_sub(t) >= self.cfg.stripe_quiet_ms);
        if quiet && self.stripe.is_some() && !self.stripe_distrusted && !self.have.is_complete() {
            self.stripe_distrusted = true;
            return true;
        }
        false
    }

    /// Milliseconds since a piece or piece bytes last arrived from a peer (the clock
    /// starts with the first tracker answer; before it, `u64::MAX`): how long the
    /// swarm has given this node nothing.
    pub fn peer_quiet_ms(&self, now_ms: u64) -> u64 {
        self.last_peer_arrival_ms
            .map_or(u64::MAX, |t| now_ms.saturating_sub(t))
    }

    /// Takes in what a tracker answer says about the swarm's shape: rack stripe,
    /// source and source stripe, member count. (One place for the agent and the
    /// simulator.)
    pub fn on_announce(&mut self, resp: &crate::protocol::AnnounceResponse, now_ms: u64) {
        self.set_stripe(resp.stripe.map(|[i, n]| (i, n)));
        self.set_source(
            resp.source.as_deref(),
            resp.source_stripe.map(|[i, n]| (i, n)),
        );
        self.set_members(resp.members, now_ms);
    }

    /// The blob's source as the tracker names it, and this node's source stripe:
    /// pieces `p` with `p % count == index` are asked of the source by this node, the
    /// rest by others, who pass them on (see the module's policy).
    pub fn set_source(&mut self, source: Option<&str>, stripe: Option<(u32, u32)>) {
        self.source_stripe = stripe.filter(|&(i, n)| n > 1 && i < n && source.is_some());
        if self.source.as_deref() == source {
            return;
        }
        self.source = source.map(str::to_owned);
        for (s, name) in self.slots.iter_mut().zip(&self.names) {
            if let Some(s) = s {
                s.is_source = Some(name.as_str()) == source;
            }
        }
    }

    /// Requests in flight to peers (claims by the registry stream not counted).
    pub fn inflight_count(&self) -> u32 {
        self.inflight_total
    }

    pub fn is_inflight(&self, piece: u32) -> bool {
        self.inflight_any.get(piece)
    }
}

/// A cheap bijective mix of (seed, piece) for per-node piece orders (splitmix64).
pub fn mix(seed: u64, i: u32) -> u64 {
    let mut z = seed.wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A stable seed for a node name.
pub fn seed_for(node: &str) -> u64 {
    node.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

#[cfg(test)]
mod tests;
