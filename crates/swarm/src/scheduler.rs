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
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub piece: u32,
    pub peer: PeerId,
    /// A reader waits on this piece: the holder serves it before queued requests.
    pub urgent: bool,
}

/// A peer in the fill loop, with what orders it fixed for the pass.
#[derive(Clone, Debug)]
struct Cand {
    slot: u32,
    window: u32,
    distance: u8,
    speed: u8,
    complete: bool,
    tie: u64,
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
    /// ([`window_for`]) ...
    window: u16,
    /// ... and its [`speed_class`] (`u8::MAX` before it is measured).
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

/// Every peer's bitfield, one row per slot, all in one allocation: a scheduling pass
/// tests each peer's pieces, and a HAVE sets one bit, which in a simulated swarm of
/// 10,000 schedulers was a cache miss per peer while each bitfield had an allocation
/// of its own. A complete peer's row is not read.
#[derive(Clone, Debug, Default)]
struct Rows {
    bytes: Vec<u8>,
    /// Bytes per row (the blob's bitfield length).
    width: usize,
}

/// Whether two bitfields' bytes share a set bit: eight bytes at a time, a 64-byte
/// block between checks (a scheduling pass asks it of every candidate peer, and byte
/// by byte with an exit after each was a twentieth of the simulator's 10,000-node run).
fn intersects(a: &[u8], b: &[u8]) -> bool {
    let word = |c: &[u8]| u64::from_ne_bytes(c.try_into().unwrap_or([0; 8]));
    let (mut a, mut b) = (a, b);
    while !a.is_empty() && !b.is_empty() {
        let n = a.len().min(b.len()).min(64);
        let (ha, ta) = a.split_at(n);
        let (hb, tb) = b.split_at(n);
        let mut any = 0u64;
        let (ca, cb) = (ha.chunks_exact(8), hb.chunks_exact(8));
        for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
            any |= (x & y) as u64;
        }
        for (x, y) in ca.zip(cb) {
            any |= word(x) & word(y);
        }
        if any != 0 {
            return true;
        }
        (a, b) = (ta, tb);
    }
    false
}

impl Rows {
    fn row(&self, slot: u32) -> &[u8] {
        let at = slot as usize * self.width;
        &self.bytes[at..at + self.width]
    }

    fn get(&self, slot: u32, piece: u32) -> bool {
        self.bytes[slot as usize * self.width + (piece / 8) as usize] & (1 << (piece % 8)) != 0
    }

    fn set(&mut self, slot: u32, piece: u32) {
        self.bytes[slot as usize * self.width + (piece / 8) as usize] |= 1 << (piece % 8);
    }

    fn clear(&mut self, slot: u32, piece: u32) {
        self.bytes[slot as usize * self.width + (piece / 8) as usize] &= !(1 << (piece % 8));
    }

    /// Writes a slot's row (`bits`: a bitfield's bytes, or empty for all clear).
    fn write(&mut self, slot: u32, bits: &[u8]) {
        let at = slot as usize * self.width;
        if self.bytes.len() < at + self.width {
            self.bytes.resize(at + self.width, 0);
        }
        let row = &mut self.bytes[at..at + self.width];
        row.fill(0);
        let n = bits.len().min(self.width);
        row[..n].copy_from_slice(&bits[..n]);
    }
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
    avail: Vec<u32>,
    complete_holders: u32,
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
            avail: vec![0; n],
            complete_holders: 0,
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

    /// Requests whose bytes may not have begun for `stall_ms` (swarms of
    /// [`STALL_MIN_MEMBERS`] or more).
    /// Each is reported once per `stall_ms`; the caller cancels those whose bytes have
    /// not begun (a holder that has begun sending goes on) and tells the scheduler the
    /// holder's answer with [`PieceScheduler::on_cancelled`].
    pub fn stalled_requests(&mut self, now_ms: u64) -> Vec<Request> {
        if !self.large {
            return Vec::new();
        }
        let mut out = Vec::new();
        for k in 0..self.asked.len() {
            let (piece, slot, at) = self.asked[k];
            if now_ms.saturating_sub(at) < self.cfg.stall_ms {
                continue;
            }
            self.asked[k].2 = now_ms;
            if !self.stall_cancelled.contains(&(piece, slot)) {
                self.stall_cancelled.push((piece, slot));
            }
            out.push(self.request(piece, slot, piece == self.have.prefix()));
        }
        out
    }

    /// The holder confirmed a cancel: the request is gone. One cancelled for a stall
    /// rests the holder, so the piece is asked of someone else.
    pub fn on_cancelled(&mut self, piece: u32, peer: &str, now_ms: u64) {
        let Some(&i) = self.by_name.get(peer) else {
            return;
        };
        let stalled = self.stall_cancelled.contains(&(piece, i));
        if piece < self.have.len() {
            self.release(piece, i);
        }
        if stalled {
            let backoff = self.cfg.stall_backoff_ms;
            if let Some(s) = self.slots[i as usize].as_mut() {
                s.busy_until_ms = s.busy_until_ms.max(now_ms + backoff);
            }
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
        self.stripe = stripe.filter(|&(i, n)| n > 1 && i < n);
    }

    /// The rack stripe set by the last tracker answer (`set_stripe`).
    pub fn stripe(&self) -> Option<(u32, u32)> {
        self.stripe
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

    fn slot(&self, id: &str) -> Option<(u32, &Slot)> {
        let i = *self.by_name.get(id)?;
        self.slots[i as usize].as_ref().map(|s| (i, s))
    }

    /// Whether the usable peer in `slot` holds `piece`.
    fn holds(&self, slot: u32, s: &Slot, piece: u32) -> bool {
        !s.banned && (s.complete || self.rows.get(slot, piece))
    }

    fn count_holdings(&mut self, slot: u32, sign: i32, now_ms: u64) {
        let Some(s) = self.slots[slot as usize].as_ref() else {
            return;
        };
        if s.banned {
            return;
        }
        if s.complete {
            self.complete_holders = (self.complete_holders as i64 + sign as i64) as u32;
            if sign > 0 {
                for t in &mut self.first_seen {
                    *t = (*t).min(now_ms);
                }
            }
            return;
        }
        let width = self.rows.width;
        let at = slot as usize * width;
        for byte in 0..width {
            let mut bits = self.rows.bytes[at + byte];
            while bits != 0 {
                let i = byte * 8 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let a = &mut self.avail[i];
                *a = (*a as i64 + sign as i64).max(0) as u32;
                if sign > 0 {
                    let t = &mut self.first_seen[i];
                    *t = (*t).min(now_ms);
                }
            }
        }
    }

    /// Adds a peer or replaces what it holds (a bitfield, a tracker answer); `have =
    /// None` means it holds everything. `distance`: 0 same rack, 1 same zone, 2 far.
    pub fn set_peer(&mut self, id: &str, have: Option<Bitfield>, distance: u8) {
        self.set_peer_at(id, have, distance, 0);
    }

    /// [`PieceScheduler::set_peer`] with the current time (for rack-stripe patience).
    pub fn set_peer_at(&mut self, id: &str, have: Option<Bitfield>, distance: u8, now_ms: u64) {
        let have = have.filter(|h| !h.is_complete() || h.len() != self.have.len());
        let have = match have {
            Some(h) if h.len() != self.have.len() => Some(Bitfield::new(self.have.len())),
            other => other,
        };
        let complete = have.is_none();
        let held = have.as_ref().map_or(0, Bitfield::count);
        let idx = match self.by_name.get(id) {
            Some(&i) => {
                self.count_holdings(i, -1, now_ms);
                if let Some(s) = self.slots[i as usize].as_mut() {
                    s.complete = complete;
                    s.held = held;
                    s.distance = distance;
                }
                i
            }
            None => {
                let slot = Slot {
                    complete,
                    held,
                    distance,
                    inflight: 0,
                    banned: false,
                    rate: 0.0,
                    window: window_for(0.0, &self.cfg, self.piece_size),
                    speed: speed_class(0.0),
                    tie: mix(self.cfg.seed ^ seed_for(id), 0),
                    mark_ms: None,
                    busy_until_ms: 0,
                    last_progress_ms: now_ms,
                    is_source: self.source.as_deref() == Some(id),
                };
                let i = match self.slots.iter().position(Option::is_none) {
                    Some(free) => {
                        self.slots[free] = Some(slot);
                        self.names[free] = id.to_owned();
                        free as u32
                    }
                    None => {
                        self.slots.push(Some(slot));
                        self.names.push(id.to_owned());
                        (self.slots.len() - 1) as u32
                    }
                };
                self.by_name.insert(id.to_owned(), i);
                i
            }
        };
        self.rows
            .write(idx, have.as_ref().map_or(&[][..], Bitfield::as_bytes));
        self.count_holdings(idx, 1, now_ms);
    }

    /// A HAVE: the peer now holds `piece`. Unknown peers and pieces are ignored.
    pub fn peer_has(&mut self, id: &str, piece: u32, now_ms: u64) {
        if let Some(&i) = self.by_name.get(id) {
            self.peer_has_handle(i, piece, now_ms);
        }
    }

    /// The peer's handle for [`PieceScheduler::peer_has_handle`]: valid until the peer
    /// is removed (its slot may then go to another peer).
    pub fn peer_handle(&self, id: &str) -> Option<u32> {
        self.by_name.get(id).copied()
    }

    /// [`PieceScheduler::peer_has`] by handle: a simulated swarm delivers millions of
    /// HAVEs, and looking each peer's name up dominated its run.
    pub fn peer_has_handle(&mut self, i: u32, piece: u32, now_ms: u64) {
        if piece >= self.have.len() {
            return;
        }
        let Some(s) = self.slots.get_mut(i as usize).and_then(Option::as_mut) else {
            return;
        };
        if s.complete || self.rows.get(i, piece) {
            return;
        }
        self.rows.set(i, piece);
        s.held += 1;
        if !s.banned {
            self.avail[piece as usize] += 1;
            let t = &mut self.first_seen[piece as usize];
            *t = (*t).min(now_ms);
        }
        if s.held == self.have.len() {
            self.count_holdings(i, -1, now_ms);
            if let Some(s) = self.slots[i as usize].as_mut() {
                s.complete = true;
            }
            self.count_holdings(i, 1, now_ms);
        }
    }

    /// Reads, and changes nothing, what a HAVE for `piece` reads of this node's own
    /// state: its bits and the in-flight bits, the piece's holder count and first
    /// sighting. Returns a value made of all of them, for `std::hint::black_box`.
    ///
    /// A caller handing one HAVE to many schedulers reads ahead for all of them
    /// before delivering it to each, so their cache misses overlap instead of coming
    /// one after another: the simulator hands 130 M HAVEs to 10,000 schedulers, and
    /// those misses were most of its run. See also
    /// [`PieceScheduler::read_ahead_peer`].
    pub fn read_ahead_piece(&self, piece: u32) -> u64 {
        let i = piece as usize;
        let byte = i / 8;
        let have = self.have.as_bytes().get(byte).copied().unwrap_or(0);
        let busy = self.inflight_any.as_bytes().get(byte).copied().unwrap_or(0);
        let avail = self.avail.get(i).copied().unwrap_or(0);
        let seen = self.first_seen.get(i).copied().unwrap_or(0);
        (have as u64) ^ ((busy as u64) << 8) ^ ((avail as u64) << 16) ^ seen
    }

    /// [`PieceScheduler::read_ahead_piece`] for what the HAVE reads of the peer with
    /// `handle` ([`PieceScheduler::peer_handle`]): its slot and its row.
    pub fn read_ahead_peer(&self, handle: u32, piece: u32) -> u64 {
        let Some(s) = self.slots.get(handle as usize).and_then(Option::as_ref) else {
            return 0;
        };
        let at = handle as usize * self.rows.width + piece as usize / 8;
        let row = self.rows.bytes.get(at).copied().unwrap_or(0);
        (row as u64)
            ^ (s.held as u64)
            ^ s.busy_until_ms
            ^ s.rate.to_bits()
            ^ ((s.inflight as u64) << 32)
            ^ ((s.complete as u64) << 40)
    }

    /// Forgets a peer; returns the pieces that were in flight from it (now open).
    pub fn remove_peer(&mut self, id: &str) -> Vec<u32> {
        let Some(i) = self.by_name.remove(id) else {
            return Vec::new();
        };
        self.count_holdings(i, -1, 0);
        let mut released = Vec::new();
        for piece in 0..self.inflight.len() {
            if self.inflight[piece].contains(&i) {
                self.release(piece as u32, i);
                released.push(piece as u32);
            }
        }
        if let Some(s) = self.slots[i as usize].take() {
            self.inflight_total -= s.inflight.min(self.inflight_total);
        }
        released
    }

    pub fn knows_peer(&self, id: &str) -> bool {
        self.by_name.contains_key(id)
    }

    pub fn peers(&self) -> impl Iterator<Item = &str> {
        self.slots
            .iter()
            .zip(&self.names)
            .filter(|(s, _)| s.is_some())
            .map(|(_, name)| name.as_str())
    }

    /// Whether a known peer holds the whole blob.
    pub fn peer_is_complete(&self, id: &str) -> bool {
        self.slot(id).is_some_and(|(_, s)| s.complete && !s.banned)
    }

    /// [`PieceScheduler::peer_is_complete`] by handle ([`PieceScheduler::peer_handle`]).
    pub fn peer_is_complete_handle(&self, handle: u32) -> bool {
        self.slots
            .get(handle as usize)
            .and_then(Option::as_ref)
            .is_some_and(|s| s.complete && !s.banned)
    }

    pub fn is_banned(&self, id: &str) -> bool {
        self.slot(id).is_some_and(|(_, s)| s.banned)
    }

    /// Requests in flight to a peer (by handle, [`PieceScheduler::peer_handle`]).
    pub fn inflight_to_handle(&self, handle: u32) -> u32 {
        self.slots
            .get(handle as usize)
            .and_then(Option::as_ref)
            .map_or(0, |s| s.inflight)
    }

    /// Requests in flight to a peer.
    pub fn inflight_to(&self, id: &str) -> u32 {
        self.slot(id).map_or(0, |(_, s)| s.inflight)
    }

    /// Measured throughput from a peer, bytes per second (0: not measured yet).
    pub fn peer_rate(&self, id: &str) -> f64 {
        self.slot(id).map_or(0.0, |(_, s)| s.rate)
    }

    fn usable_holders(&self, piece: u32) -> u32 {
        self.avail[piece as usize] + self.complete_holders
    }

    /// Pieces neither held, in flight nor claimed that no usable peer holds.
    pub fn orphans(&self) -> Vec<u32> {
        (0..self.have.len())
            .filter(|&i| {
                !self.have.get(i) && !self.inflight_any.get(i) && self.usable_holders(i) == 0
            })
            .collect()
    }

    /// Requests in flight to peers (claims by the registry stream not counted).
    pub fn inflight_count(&self) -> u32 {
        self.inflight_total
    }

    pub fn is_inflight(&self, piece: u32) -> bool {
        self.inflight_any.get(piece)
    }

    /// The window for a peer: its measured rate over `window_ms`, in requests.
    fn window(&self, s: &Slot) -> u32 {
        u32::from(s.window)
    }

    #[cfg(test)]
    fn can_take(&self, s: &Slot, now_ms: u64) -> bool {
        !s.banned && s.busy_until_ms <= now_ms && s.inflight < self.window(s)
    }

    /// May `piece` be fetched from a peer at `distance`? Near peers always; far peers
    /// for this node's stripe, or once the piece has waited `patience_ms` for a near
    /// holder.
    fn far_allowed(&self, piece: u32, distance: u8, now_ms: u64) -> bool {
        match self.stripe {
            Some((idx, n)) if distance > 0 => {
                piece % n == idx
                    || now_ms.saturating_sub(self.first_seen[piece as usize]) >= self.patience_ms()
            }
            _ => true,
        }
    }

    /// May `piece` be asked of the source? Within this node's source stripe, or once it
    /// has waited `source_patience_ms` there for its stripe's member to pass it on.
    fn source_allowed(&self, piece: u32, now_ms: u64) -> bool {
        // A small head piece (`pieces::HEAD_DIVISOR` times smaller than the others) straight
        // from the source to every member of a swarm small enough that all those copies
        // weigh no more than one piece: each node's first byte then waits for one hop,
        // not for the stripe's member to relay it.
        if piece == 0
            && crate::PieceLayout::splits(self.piece_size)
            && (1..=crate::pieces::HEAD_DIVISOR).contains(&(self.members as u64))
        {
            return true;
        }
        match self.source_stripe {
            Some((idx, n)) => {
                piece % n == idx
                    || now_ms.saturating_sub(self.first_seen[piece as usize])
                        >= self.source_patience_ms
            }
            None => true,
        }
    }

    /// Whether this peer may be asked for `piece` now: rack stripes and source stripes.
    fn allowed(&self, piece: u32, s: &Slot, now_ms: u64) -> bool {
        self.far_allowed(piece, s.distance, now_ms)
            && (!s.is_source || self.source_allowed(piece, now_ms))
    }

    /// The next requests to send, already counted as in flight. `max_new` caps the
    /// non-urgent ones (the agent-wide request budget); the read head is not capped.
    pub fn next_requests(&mut self, now_ms: u64, max_new: u32) -> Vec<Request> {
        let mut out = Vec::new();
        if self.have.is_complete() {
            return out;
        }
        // The read head: urgent, to the best holder even past its window.
        let head = self.have.prefix();
        if self.head_since.0 != head {
            self.head_since = (head, now_ms);
        }
        if head < self.have.len() && !self.inflight_any.get(head) {
            if let Some(p) = self.pick_peer(head, now_ms, true, &[]) {
                self.assign(head, p, now_ms);
                out.push(self.request(head, p, true));
                self.head_asked_urgently = Some(head);
            }
        } else if head < self.have.len()
            && self.head_asked_urgently != Some(head)
            && !self.claimed.get(head)
            && self.inflight[head as usize].len() < 2
            && now_ms.saturating_sub(self.head_since.1) >= HEAD_PATIENCE_MS
        {
            // The head was asked for as an ordinary request before it became the head,
            // and that request may wait in a holder's line behind fresher pieces while
            // the reader gets nothing (seen for 20–80 s at 16 × 8 MiB/s): ask another
            // holder urgently, once; the first copy wins and the other is cancelled.
            let busy = self.inflight[head as usize].clone();
            if let Some(p) = self.pick_peer(head, now_ms, true, &busy) {
                self.assign(head, p, now_ms);
                out.push(self.request(head, p, true));
                self.head_asked_urgently = Some(head);
            }
        }
        let mut budget = if self.large {
            max_new.saturating_sub(self.cfg.large_swarm_withheld_requests)
        } else {
            max_new
        };
        let total_cap = self.cfg.max_inflight_total;
        // Fill windows, one request at a time to the least-loaded peer that can take
        // one, so requests spread over peers instead of filling the first.
        let mut total = self.inflight_count();
        if budget > 0 && total < total_cap && self.any_open_piece() {
            let mut cands = self.fill_candidates(now_ms);
            while budget > 0 && total < total_cap {
                let Some(k) = self.least_loaded_of(&cands) else {
                    break;
                };
                let p = cands[k].slot;
                match self.best_piece_for(p, now_ms, head) {
                    Some(piece) => {
                        self.assign(piece, p, now_ms);
                        out.push(self.request(piece, p, false));
                        budget -= 1;
                        total += 1;
                    }
                    None => {
                        cands.swap_remove(k);
                    }
                }
            }
            self.cands_scratch = cands;
        }
        // Endgame: every missing piece is in flight and few remain. A duplicate of the
        // read head is urgent like the head; any other duplicate is an ordinary
        // request and takes from `max_new` (found by the scheduler property test: the
        // duplicates overdrew the agent-wide request budget).
        self.endgame_requests(head, budget, now_ms, &mut out);
        out
    }

    /// Endgame: when every missing piece is in flight and few remain, a second peer is
    /// asked for each. A duplicate of the read head is urgent; others take `budget`.
    fn endgame_requests(
        &mut self,
        head: u32,
        mut budget: u32,
        now_ms: u64,
        out: &mut Vec<Request>,
    ) {
        let missing = self.have.len() - self.have.count();
        if missing > self.cfg.endgame {
            return;
        }
        let pieces: Vec<u32> = (0..self.have.len())
            .filter(|&i| !self.have.get(i))
            .collect();
        if !pieces.iter().all(|&i| self.inflight_any.get(i)) {
            return;
        }
        for piece in pieces {
            let urgent = piece == head;
            if self.inflight[piece as usize].len() >= 2
                || self.claimed.get(piece)
                || (!urgent && budget == 0)
            {
                continue;
            }
            let busy = self.inflight[piece as usize].clone();
            if let Some(p) = self.pick_peer(piece, now_ms, false, &busy) {
                self.assign(piece, p, now_ms);
                out.push(self.request(piece, p, urgent));
                if !urgent {
                    budget -= 1;
                }
            }
        }
    }

    fn request(&self, piece: u32, slot: u32, urgent: bool) -> Request {
        Request {
            piece,
            peer: self.slots[slot as usize]
                .as_ref()
                .map(|_| self.names[slot as usize].clone())
                .unwrap_or_default(),
            urgent,
        }
    }

    /// The peers the fill loop may ask: not banned, not resting, with room in their
    /// window and an open piece (a peer without one now has none later in the same
    /// pass, and a full window stays full: a pass only adds requests), each with its
    /// window (its rate does not change during a pass) and its static tie keys, in
    /// slot order.
    fn fill_candidates(&mut self, now_ms: u64) -> Vec<Cand> {
        // The peers' own fields first: when no peer has room (often, in a big swarm),
        // the piece masks below are not built and no bitfield is read.
        let mut cands = std::mem::take(&mut self.cands_scratch);
        cands.clear();
        cands.extend(
            self.slots
                .iter()
                .enumerate()
                .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s)))
                .filter(|&(_, s)| !s.banned && s.busy_until_ms <= now_ms)
                .filter_map(|(i, s)| {
                    let window = self.window(s);
                    (s.inflight < window).then_some(Cand {
                        slot: i,
                        window,
                        distance: s.distance,
                        speed: s.speed,
                        complete: s.complete,
                        tie: s.tie,
                    })
                }),
        );
        if cands.is_empty() {
            return cands;
        }
        // The open pieces (neither held nor in flight), and those of them a far peer
        // may give, once per pass: each peer is then one AND over the bytes (at 1,000
        // nodes, testing each peer's pieces one by one was a fifth of the run). The
        // masks live in buffers kept between passes.
        let len = self.have.len();
        let mut open = std::mem::take(&mut self.open_scratch);
        let mut open_far = std::mem::take(&mut self.open_far_scratch);
        open.clear();
        open.extend(
            self.have
                .as_bytes()
                .iter()
                .zip(self.inflight_any.as_bytes())
                .map(|(&m, &b)| !m & !b),
        );
        if let Some(last) = open.last_mut() {
            if !len.is_multiple_of(8) {
                *last &= (1u8 << (len % 8)) - 1;
            }
        }
        open_far.clear();
        open_far.extend_from_slice(&open);
        // (Each open piece's patience is read only if a far peer is a candidate: in a
        // large swarm most passes have none with room.)
        if self.stripe.is_some() && cands.iter().any(|c| c.distance > 0) {
            for (byte, bits) in open_far.iter_mut().enumerate() {
                let mut rest = *bits;
                while rest != 0 {
                    let bit = rest.trailing_zeros();
                    rest &= rest - 1;
                    if !self.far_allowed(byte as u32 * 8 + bit, 2, now_ms) {
                        *bits &= !(1u8 << bit);
                    }
                }
            }
        }
        let source_allowed = |mask: &[u8]| -> Vec<u8> {
            let mut out = mask.to_vec();
            for (byte, bits) in out.iter_mut().enumerate() {
                let mut rest = *bits;
                while rest != 0 {
                    let bit = rest.trailing_zeros();
                    rest &= rest - 1;
                    if !self.source_allowed(byte as u32 * 8 + bit, now_ms) {
                        *bits &= !(1u8 << bit);
                    }
                }
            }
            out
        };
        let any_open = |i: u32, s: &Slot| {
            let base = if s.distance > 0 { &open_far } else { &open };
            let for_source;
            let mask = if s.is_source && self.source_stripe.is_some() {
                for_source = source_allowed(base);
                &for_source
            } else {
                base
            };
            if s.complete {
                mask.iter().any(|&b| b != 0)
            } else {
                intersects(mask, self.rows.row(i))
            }
        };
        cands.retain(|c| {
            self.slots[c.slot as usize]
                .as_ref()
                .is_some_and(|s| any_open(c.slot, s))
        });
        self.open_scratch = open;
        self.open_far_scratch = open_far;
        cands
    }

    /// `least_loaded` over the candidates: fewest in flight relative to the window,
    /// then nearest, fastest (in [`speed_class`]es), partial before complete, this
    /// requester's own order. Returns an index into `cands`.
    fn least_loaded_of(&self, cands: &[Cand]) -> Option<usize> {
        let mut best: Option<(usize, f64)> = None;
        for (k, c) in cands.iter().enumerate() {
            let inflight = self.slots[c.slot as usize]
                .as_ref()
                .map_or(u32::MAX, |s| s.inflight);
            if inflight >= c.window {
                continue;
            }
            let load = inflight as f64 / c.window as f64;
            let better = match best {
                None => true,
                Some((b, bl)) => {
                    let o = &cands[b];
                    load.total_cmp(&bl)
                        .then(c.distance.cmp(&o.distance))
                        .then(o.speed.cmp(&c.speed))
                        .then(c.complete.cmp(&o.complete))
                        .then(c.tie.cmp(&o.tie))
                        .is_lt()
                }
            };
            if better {
                best = Some((k, load));
            }
        }
        best.map(|(k, _)| k)
    }

    /// Whether a scheduling pass could now ask the peer with this handle for `piece`
    /// (or for another of its pieces, which is no different for the caller): the piece
    /// is open, the peer usable and allowed to serve it, with room in its window (the
    /// read head needs none); in endgame, always. A caller that ran a pass since
    /// anything else changed needs no new pass for a HAVE without this.
    pub fn could_request_from(&self, handle: u32, piece: u32, now_ms: u64) -> bool {
        if piece >= self.have.len() || self.have.get(piece) {
            return false;
        }
        if self.have.len() - self.have.count() <= self.cfg.endgame {
            return true;
        }
        if self.inflight_any.get(piece) {
            return false;
        }
        let Some(s) = self.slots.get(handle as usize).and_then(Option::as_ref) else {
            return false;
        };
        self.holds(handle, s, piece)
            && s.busy_until_ms <= now_ms
            && self.allowed(piece, s, now_ms)
            && (piece == self.have.prefix() || s.inflight < self.window(s))
    }

    /// Whether some unbanned peer may hold a piece neither held nor in flight: without
    /// one no peer has an open piece, and the fill loop need not look at each peer.
    fn any_open_piece(&self) -> bool {
        if self.complete_holders > 0 {
            return true;
        }
        let have = self.have.as_bytes();
        let busy = self.inflight_any.as_bytes();
        have.iter()
            .zip(busy)
            .enumerate()
            .any(|(byte, (&mine, &infl))| {
                let mut open = !mine & !infl;
                while open != 0 {
                    let piece = byte as u32 * 8 + open.trailing_zeros();
                    open &= open - 1;
                    if piece < self.have.len() && self.avail[piece as usize] > 0 {
                        return true;
                    }
                }
                false
            })
    }

    /// Load order: fewest in flight relative to the window, then nearest, then fastest,
    /// then partial before complete (so seeds are not the only uploaders).
    #[cfg(test)]
    fn least_loaded(&self, now_ms: u64, exclude: &[u32]) -> Option<u32> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s)))
            .filter(|(i, s)| self.can_take(s, now_ms) && !exclude.contains(i))
            .min_by(|(_, a), (_, b)| {
                let la = a.inflight as f64 / self.window(a) as f64;
                let lb = b.inflight as f64 / self.window(b) as f64;
                la.total_cmp(&lb)
                    .then(a.distance.cmp(&b.distance))
                    .then(b.speed.cmp(&a.speed))
                    .then(a.complete.cmp(&b.complete))
                    .then(a.tie.cmp(&b.tie))
            })
            .map(|(i, _)| i)
    }

    /// The rarest open piece this peer holds; ties go to the group of pieces nearest
    /// the read head, then in this node's seeded order.
    fn best_piece_for(&self, slot: u32, now_ms: u64, head: u32) -> Option<u32> {
        let group = self.cfg.order_group.max(1);
        let s = self.slots[slot as usize].as_ref()?;
        let have = self.have.as_bytes();
        let busy = self.inflight_any.as_bytes();
        let theirs = (!s.complete).then(|| self.rows.row(slot));
        let mut best: Option<((u32, u32, u64), u32)> = None;
        for (byte, (&mine, &infl)) in have.iter().zip(busy).enumerate() {
            let mut open = !mine & !infl;
            if let Some(t) = theirs {
                open &= t[byte];
            }
            while open != 0 {
                let bit = open.trailing_zeros();
                open &= open - 1;
                let piece = byte as u32 * 8 + bit;
                if piece >= self.have.len() {
                    continue;
                }
                // The key's parts in order, each only while the piece can still win:
                // most lose on the holder count, before the divisions below.
                let holders = self.usable_holders(piece);
                if best.is_some_and(|((h, _, _), _)| holders > h) || !self.allowed(piece, s, now_ms)
                {
                    continue;
                }
                let key = (
                    holders,
                    piece.saturating_sub(head) / group,
                    mix(self.cfg.seed, piece),
                );
                if best.is_none_or(|(k, _)| key < k) {
                    best = Some((key, piece));
                }
            }
        }
        best.map(|(_, p)| p)
    }

    /// The best peer for one piece: idle before busy, near before far, fast before
    /// slow. `urgent` ignores windows (not bans or "busy" answers).
    fn pick_peer(&self, piece: u32, now_ms: u64, urgent: bool, exclude: &[u32]) -> Option<u32> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s)))
            // The slot's own fields before its bitfield (another allocation, a cache
            // miss per peer in a simulated swarm).
            .filter(|(i, s)| {
                s.busy_until_ms <= now_ms
                    && (urgent || s.inflight < self.window(s))
                    && !exclude.contains(i)
                    && self.allowed(piece, s, now_ms)
                    && self.holds(*i, s, piece)
            })
            .min_by(|(_, a), (_, b)| {
                a.inflight
                    .cmp(&b.inflight)
                    .then(a.distance.cmp(&b.distance))
                    .then(b.speed.cmp(&a.speed))
                    .then(a.complete.cmp(&b.complete))
                    .then(a.tie.cmp(&b.tie))
            })
            .map(|(i, _)| i)
    }

    fn assign(&mut self, piece: u32, slot: u32, now_ms: u64) {
        self.inflight[piece as usize].push(slot);
        self.inflight_any.set(piece);
        if self.large {
            self.asked.push((piece, slot, now_ms));
        }
        if let Some(s) = self.slots[slot as usize].as_mut() {
            if s.inflight == 0 {
                s.mark_ms = Some(now_ms);
                s.last_progress_ms = now_ms;
            }
            s.inflight += 1;
            self.inflight_total += 1;
        }
    }

    fn release(&mut self, piece: u32, slot: u32) {
        let v = &mut self.inflight[piece as usize];
        if let Some(at) = v.iter().position(|&x| x == slot) {
            v.swap_remove(at);
            if let Some(k) = self
                .asked
                .iter()
                .position(|&(p, sl, _)| p == piece && sl == slot)
            {
                self.asked.swap_remove(k);
            }
            if let Some(k) = self
                .stall_cancelled
                .iter()
                .position(|&x| x == (piece, slot))
            {
                self.stall_cancelled.swap_remove(k);
            }
            if let Some(s) = self.slots[slot as usize].as_mut() {
                if s.inflight > 0 {
                    s.inflight -= 1;
                    self.inflight_total -= 1;
                }
                if s.inflight == 0 {
                    s.mark_ms = None;
                }
            }
        }
        if v.is_empty() {
            // Give the memory back: 10,000 simulated schedulers keep these.
            *v = Vec::new();
            if !self.claimed.get(piece) {
                self.inflight_any.clear(piece);
            }
        }
    }

    /// A verified piece arrived from `from` (a peer, or anything else: the registry
    /// stream, the disk). Returns `true` if it was new. Other requests for the piece
    /// (endgame duplicates) stay in flight until they end: the caller cancels them.
    pub fn on_done(&mut self, piece: u32, from: &str, now_ms: u64) -> bool {
        if piece >= self.have.len() {
            return false;
        }
        if let Some(&i) = self.by_name.get(from) {
            self.measure(i, piece, now_ms);
            self.release(piece, i);
            // Only this node's stripe: pieces fetched after the patience ran out
            // would feed the patience back into itself.
            let in_stripe = self.source_stripe.is_some_and(|(idx, n)| piece % n == idx);
            if in_stripe
                && !self.have.get(piece)
                && self.slots[i as usize].as_ref().is_some_and(|s| s.is_source)
            {
                self.measure_fresh_latency(piece, now_ms);
            }
        }
        self.claimed.clear(piece);
        if self.inflight[piece as usize].is_empty() {
            self.inflight_any.clear(piece);
        }
        let new = !self.have.get(piece);
        self.have.set(piece);
        new
    }

    /// The peers still asked for a piece this node now holds (to cancel).
    pub fn duplicates_of(&self, piece: u32) -> Vec<PeerId> {
        self.inflight
            .get(piece as usize)
            .map(|v| {
                v.iter()
                    .filter_map(|&i| {
                        self.slots[i as usize]
                            .as_ref()
                            .map(|_| self.names[i as usize].clone())
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Forgets a request (cancelled, or answered after the piece came from elsewhere).
    pub fn forget(&mut self, piece: u32, peer: &str) {
        if let Some(&i) = self.by_name.get(peer) {
            if piece < self.have.len() {
                self.release(piece, i);
            }
        }
    }

    fn measure(&mut self, slot: u32, piece: u32, now_ms: u64) {
        let piece_size = crate::PieceLayout::nominal_len(self.piece_size, piece) as f64;
        if let Some(s) = self.slots[slot as usize].as_mut() {
            s.last_progress_ms = now_ms;
            if let Some(mark) = s.mark_ms {
                let secs = (now_ms.saturating_sub(mark)).max(1) as f64 / 1000.0;
                let sample = piece_size / secs;
                let rate = if s.rate == 0.0 {
                    sample
                } else {
                    0.7 * s.rate + 0.3 * sample
                };
                s.set_rate(rate, &self.cfg, self.piece_size);
                s.mark_ms = Some(now_ms);
            }
        }
    }

    /// A piece came from the source: how long it took since the source announced it
    /// sets the patience of source stripes.
    fn measure_fresh_latency(&mut self, piece: u32, now_ms: u64) {
        let seen = self.first_seen[piece as usize];
        if seen == u64::MAX {
            return;
        }
        let sample = now_ms.saturating_sub(seen) as f64;
        let smoothed = match self.fresh_latency_ms {
            None => sample,
            Some(prev) => 0.8 * prev + 0.2 * sample,
        };
        self.fresh_latency_ms = Some(smoothed);
        self.source_patience_ms = ((smoothed * self.cfg.source_patience_factor as f64) as u64)
            .clamp(
                self.cfg.source_patience_min_ms,
                self.cfg
                    .source_patience_max_ms
                    .max(self.cfg.source_patience_min_ms),
            );
    }

    /// Bytes arrived from a peer: it is not stalled.
    pub fn on_progress(&mut self, peer: &str, now_ms: u64) {
        if let Some(&i) = self.by_name.get(peer) {
            if let Some(s) = self.slots[i as usize].as_mut() {
                s.last_progress_ms = now_ms;
            }
        }
    }

    /// A request failed. `corrupt` bans the peer: it served bytes that fail the hash.
    pub fn on_failed(&mut self, piece: u32, peer: &str, corrupt: bool) {
        let Some(&i) = self.by_name.get(peer) else {
            return;
        };
        if piece < self.have.len() {
            self.release(piece, i);
        }
        if corrupt {
            self.count_holdings(i, -1, 0);
            if let Some(s) = self.slots[i as usize].as_mut() {
                s.banned = true;
            }
        }
    }

    /// The peer's upload line is full: leave it alone for a moment.
    pub fn on_busy(&mut self, piece: u32, peer: &str, now_ms: u64) {
        let Some(&i) = self.by_name.get(peer) else {
            return;
        };
        if piece < self.have.len() {
            self.release(piece, i);
        }
        let backoff = self.cfg.busy_backoff_ms;
        if let Some(s) = self.slots[i as usize].as_mut() {
            // Never shortens a longer rest (after a stall; found by the property test).
            s.busy_until_ms = s.busy_until_ms.max(now_ms + backoff);
        }
    }

    /// The peer does not hold a piece it was asked for (a stale view): forget that it
    /// does, and release the request.
    pub fn on_not_held(&mut self, piece: u32, peer: &str) {
        let Some(&i) = self.by_name.get(peer) else {
            return;
        };
        if piece >= self.have.len() {
            return;
        }
        self.release(piece, i);
        let n = self.have.len();
        if let Some(s) = self.slots[i as usize].as_mut() {
            if s.complete {
                let mut all = Bitfield::full(n);
                all.clear(piece);
                self.count_holdings(i, -1, 0);
                if let Some(s) = self.slots[i as usize].as_mut() {
                    s.complete = false;
                    s.held = all.count();
                }
                self.rows.write(i, all.as_bytes());
                self.count_holdings(i, 1, 0);
            } else if self.rows.get(i, piece) {
                self.rows.clear(i, piece);
                s.held -= 1;
                if !s.banned {
                    self.avail[piece as usize] = self.avail[piece as usize].saturating_sub(1);
                }
            }
        }
    }

    /// A HAVE made `piece` available at `holder`. If this node's only request for it
    /// waits at `source` (the blob's registry fetcher), returns the source: the caller
    /// cancels that request unless its bytes already flow, so the source's uplink goes
    /// to pieces nobody else holds and this one comes from `holder`.
    pub fn retarget_on_have(
        &self,
        piece: u32,
        holder: &str,
        source: Option<&str>,
    ) -> Option<PeerId> {
        let source = source?;
        // Not in flight (the common case): no request to move, and no need to look
        // at the per-piece request lists (nor to compare names).
        if piece >= self.have.len()
            || self.have.get(piece)
            || !self.inflight_any.get(piece)
            || holder == source
        {
            return None;
        }
        let asked = &self.inflight[piece as usize];
        match asked.as_slice() {
            [only] => {
                self.slots[*only as usize].as_ref()?;
                let name = &self.names[*only as usize];
                (name == source).then(|| name.clone())
            }
            _ => None,
        }
    }

    /// [`PieceScheduler::retarget_on_have`] by handle ([`PieceScheduler::peer_handle`])
    /// for a HAVE from a peer other than the source: whether this node's only request
    /// for `piece` waits at the peer with handle `source`. No names are read: in a
    /// simulated swarm, reading the request's slot and name cost two cache misses per
    /// HAVE for a piece in flight.
    pub fn retarget_on_have_handle(&self, piece: u32, source: u32) -> bool {
        piece < self.have.len()
            && !self.have.get(piece)
            && self.inflight_any.get(piece)
            && self.inflight[piece as usize].as_slice() == [source]
    }

    /// The next run of consecutive pieces to fetch from the registry: pieces nobody
    /// can give (`everything`: every piece not on its way, when there is no tracker),
    /// skipping those `busy` says are being produced otherwise.
    pub fn registry_run(&self, everything: bool, busy: impl Fn(u32) -> bool) -> Option<(u32, u32)> {
        let want = |i: u32| {
            !self.have.get(i)
                && !self.inflight_any.get(i)
                && !busy(i)
                && (everything || self.usable_holders(i) == 0)
        };
        let first = (0..self.have.len()).find(|&i| want(i))?;
        let mut end = first + 1;
        while end < self.have.len() && want(end) {
            end += 1;
        }
        Some((first, end))
    }

    /// Marks a piece as being produced elsewhere (the registry stream).
    pub fn claim(&mut self, piece: u32) {
        if piece < self.have.len() && !self.have.get(piece) {
            self.claimed.set(piece);
            self.inflight_any.set(piece);
        }
    }

    /// The registry stream will not produce a claimed piece after all.
    pub fn unclaim(&mut self, piece: u32) {
        if piece < self.have.len() && self.claimed.get(piece) {
            self.claimed.clear(piece);
            if self.inflight[piece as usize].is_empty() {
                self.inflight_any.clear(piece);
            }
        }
    }
}

/// How peers of equal load and distance rank by speed: in doublings of the measured
/// rate, so peers of about the same speed tie and each requester's own order spreads
/// requests over them. A peer not measured yet ranks first, so every holder is tried
/// once: ranked last (rate 0), a holder that joined after the first rates were taken
/// got only what the others left while the request budget was the limit, so it was
/// never measured — at 16 × 8 MiB/s the four agents that started last ran their
/// uplinks at 23–59 % of the limit while the others ran at 96–99 %.
/// Requests in flight a peer measured at `rate` may have: enough to keep it busy for
/// `window_ms`, within `min_window..=max_window` (and 65,535).
fn window_for(rate: f64, cfg: &SchedulerConfig, piece_size: u64) -> u16 {
    let by_rate = (rate * cfg.window_ms as f64 / 1000.0 / piece_size as f64).ceil();
    let window = (by_rate as u32).clamp(cfg.min_window, cfg.max_window.max(cfg.min_window));
    window.min(u16::MAX.into()) as u16
}

impl Slot {
    fn set_rate(&mut self, rate: f64, cfg: &SchedulerConfig, piece_size: u64) {
        self.rate = rate;
        self.window = window_for(rate, cfg, piece_size);
        self.speed = speed_class(rate);
    }
}

fn speed_class(rate: f64) -> u8 {
    if rate > 0.0 {
        // (At most 1,023 for an f64.)
        (rate.max(1.0).log2() as u32).min(u8::MAX as u32 - 1) as u8
    } else {
        u8::MAX
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
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    proptest::proptest! {
        #[test]
        fn intersects_finds_the_one_shared_bit_wherever_it_is(
            a in proptest::collection::vec(proptest::num::u8::ANY, 0..300),
            extra in 0usize..20,
            shared in proptest::option::of((0usize..300, 0u8..8)),
        ) {
            // `b` is `a`'s complement (no bit in common), longer or not, then one bit
            // set in both, or none.
            let mut a = a;
            let mut b: Vec<u8> = a.iter().map(|x| !x).chain(std::iter::repeat_n(0xff, extra)).collect();
            let shared = shared.filter(|&(at, _)| at < a.len());
            if let Some((at, bit)) = shared {
                a[at] |= 1 << bit;
                b[at] |= 1 << bit;
            }
            proptest::prop_assert_eq!(intersects(&a, &b), shared.is_some());
            proptest::prop_assert_eq!(intersects(&b, &a), shared.is_some());
        }
    }

    fn bits(len: u32, ones: &[u32]) -> Bitfield {
        let mut b = Bitfield::new(len);
        for &i in ones {
            b.set(i);
        }
        b
    }

    fn sched(len: u32, cfg: SchedulerConfig) -> PieceScheduler {
        PieceScheduler::new(Bitfield::new(len), MB, cfg)
    }

    #[test]
    fn read_head_first_then_rarest_within_windows() {
        let mut s = sched(
            8,
            SchedulerConfig {
                min_window: 2,
                max_window: 2,
                ..Default::default()
            },
        );
        s.set_peer("a", None, 2);
        s.set_peer("b", Some(bits(8, &[0, 1, 2, 3])), 0);
        s.set_peer("c", Some(bits(8, &[0, 1, 2, 3])), 0);
        let reqs = s.next_requests(0, 100);
        assert_eq!(reqs[0].piece, 0);
        assert!(reqs[0].urgent, "the read head is urgent");
        assert!(reqs[1..].iter().all(|r| !r.urgent));
        assert_eq!(reqs.len(), 6, "3 peers × a window of 2");
        let from_a: Vec<u32> = reqs
            .iter()
            .filter(|r| r.peer == "a")
            .map(|r| r.piece)
            .collect();
        assert!(
            from_a.iter().all(|&p| p >= 4),
            "the only holder of rare pieces serves rare pieces: {from_a:?}"
        );
    }

    #[test]
    fn a_head_stuck_as_an_ordinary_request_is_asked_of_another_holder_urgently() {
        let mut s = sched(
            8,
            SchedulerConfig {
                min_window: 2,
                max_window: 2,
                ..Default::default()
            },
        );
        s.set_peer("a", None, 0);
        s.set_peer("b", None, 0);
        let first = s.next_requests(0, 100);
        let next = first
            .iter()
            .filter(|r| !r.urgent)
            .min_by_key(|r| r.piece)
            .expect("ordinary requests")
            .clone();
        let (k, holder) = (next.piece, next.peer.clone());
        // Everything before it arrives: piece k is the head now, still an ordinary
        // request.
        for r in first.iter().filter(|r| r.piece < k) {
            s.on_done(r.piece, &r.peer, 50);
        }
        for i in 0..k {
            s.on_done(i, "a", 50);
        }
        assert_eq!(s.have.prefix(), k);
        assert!(
            s.next_requests(100, 0).iter().all(|r| r.piece != k),
            "not at once: the ordinary request may well be on its way"
        );
        let late = s.next_requests(100 + HEAD_PATIENCE_MS, 0);
        let again: Vec<&Request> = late.iter().filter(|r| r.piece == k).collect();
        assert_eq!(again.len(), 1, "{late:?}");
        assert!(again[0].urgent);
        assert_ne!(again[0].peer, holder, "another holder");
        assert!(
            s.next_requests(100 + 2 * HEAD_PATIENCE_MS, 0)
                .iter()
                .all(|r| r.piece != k),
            "once"
        );
    }

    #[test]
    fn the_budget_caps_everything_but_the_read_head() {
        let mut s = sched(64, SchedulerConfig::default());
        s.set_peer("a", None, 0);
        s.set_peer("b", None, 0);
        let r = s.next_requests(0, 0);
        assert_eq!(r.len(), 1);
        assert!(r[0].urgent);
        let r = s.next_requests(0, 3);
        assert_eq!(r.len(), 3);
    }

    #[test]
    fn a_have_makes_a_piece_requestable_at_once() {
        let mut s = sched(4, SchedulerConfig::default());
        s.set_peer("a", Some(Bitfield::new(4)), 0);
        assert!(s.next_requests(0, 10).is_empty());
        s.peer_has("a", 2, 5);
        let r = s.next_requests(5, 10);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].piece, 2);
        for p in [0, 1, 3] {
            s.peer_has("a", p, 6);
        }
        assert!(!s.knows_peer("b"));
        assert_eq!(s.orphans(), Vec::<u32>::new());
    }

    #[test]
    fn could_request_from_agrees_with_the_next_pass() {
        let cfg = SchedulerConfig {
            min_window: 1,
            max_window: 1,
            patience_ms: 1_000,
            ..Default::default()
        };
        let mut s = sched(8, cfg);
        s.set_stripe(Some((0, 2)));
        s.set_peer("near", Some(Bitfield::new(8)), 0);
        s.set_peer("far", Some(Bitfield::new(8)), 2);
        let near = s.peer_handle("near").expect("a known peer");
        let far = s.peer_handle("far").expect("a known peer");
        // A far holder of a piece outside this node's stripe: not before the patience.
        s.peer_has_handle(far, 3, 0);
        assert!(!s.could_request_from(far, 3, 10));
        assert!(s.next_requests(10, 10).is_empty());
        assert!(s.could_request_from(far, 3, 1_000));
        // A near holder: at once; its window (1) then full, so a second piece not.
        s.peer_has_handle(near, 5, 20);
        assert!(s.could_request_from(near, 5, 20));
        assert_eq!(s.next_requests(20, 10).len(), 1);
        assert!(!s.could_request_from(near, 5, 20), "in flight");
        s.peer_has_handle(near, 6, 21);
        assert!(!s.could_request_from(near, 6, 21), "window full");
        assert!(s.next_requests(21, 10).is_empty());
        // The read head needs no window.
        s.peer_has_handle(near, 0, 22);
        assert!(s.could_request_from(near, 0, 22));
        assert_eq!(s.next_requests(22, 10)[0].piece, 0);
    }

    #[test]
    fn windows_grow_with_the_measured_rate() {
        let cfg = SchedulerConfig {
            min_window: 2,
            max_window: 8,
            window_ms: 100,
            max_inflight_total: 100,
            ..Default::default()
        };
        let mut s = sched(200, cfg);
        s.set_peer("fast", None, 0);
        s.set_peer("slow", None, 0);
        let _ = s.next_requests(0, 100);
        // fast delivers a 1 MiB piece every 2 ms (500 MiB/s), slow every 100 ms.
        let mut t = 0;
        for _ in 0..20 {
            t += 2;
            let p = *s
                .inflight
                .iter()
                .enumerate()
                .find(|(_, v)| v.contains(&s.by_name["fast"]))
                .map(|(i, _)| i as u32)
                .as_ref()
                .unwrap();
            s.on_done(p, "fast", t);
            let _ = s.next_requests(t, 100);
        }
        let fast = s.slot("fast").unwrap().1.inflight;
        let slow = s.slot("slow").unwrap().1.inflight;
        assert!(fast > slow, "fast {fast} in flight, slow {slow}");
        assert!(
            slow <= 3,
            "a window of 2, plus perhaps the urgent read head: {slow}"
        );
        assert!(
            fast >= 8,
            "rate × window_ms / piece = 50, capped at 8: {fast}"
        );
    }

    fn with_rate(s: &mut PieceScheduler, peer: &str, rate: f64) {
        let i = s.by_name[peer] as usize;
        let (cfg, piece_size) = (s.cfg.clone(), s.piece_size);
        s.slots[i]
            .as_mut()
            .unwrap()
            .set_rate(rate, &cfg, piece_size);
    }

    #[test]
    fn a_holder_not_measured_yet_is_tried_before_measured_ones() {
        let mut s = sched(64, SchedulerConfig::default());
        for p in ["a", "b", "c"] {
            s.set_peer(p, None, 0);
        }
        with_rate(&mut s, "a", 8e6);
        with_rate(&mut s, "b", 9e6);
        let reqs = s.next_requests(0, 1);
        let head = reqs.iter().find(|r| r.urgent).expect("the read head");
        assert_eq!(head.peer, "c", "the unmeasured holder first: {reqs:?}");
        let other = reqs.iter().find(|r| !r.urgent).expect("one more request");
        assert_ne!(other.peer, "c", "c is loaded now: {reqs:?}");
    }

    #[test]
    fn requesters_spread_over_holders_of_the_same_speed() {
        let picks: std::collections::HashSet<String> = (0..8)
            .map(|n| {
                let cfg = SchedulerConfig {
                    seed: seed_for(&format!("node-{n}")),
                    ..Default::default()
                };
                let mut s = PieceScheduler::new(Bitfield::new(64), MB, cfg);
                for (p, rate) in [("a", 8.0e6), ("b", 8.5e6), ("c", 9.0e6), ("d", 9.5e6)] {
                    s.set_peer(p, None, 0);
                    with_rate(&mut s, p, rate);
                }
                let reqs = s.next_requests(0, 0);
                reqs[0].peer.clone()
            })
            .collect();
        assert!(
            picks.len() >= 3,
            "8 requesters should not all pick the same of 4 equal holders: {picks:?}"
        );
    }

    #[test]
    fn nodes_starting_together_ask_the_source_for_different_pieces() {
        let firsts: std::collections::HashSet<u32> = (0..8)
            .map(|n| {
                let cfg = SchedulerConfig {
                    seed: seed_for(&format!("node-{n}")),
                    ..Default::default()
                };
                let mut s = PieceScheduler::new(bits(64, &[0]), MB, cfg);
                s.set_peer("source", None, 0);
                let r = s.next_requests(0, 1);
                r.iter().find(|r| !r.urgent).map(|r| r.piece).unwrap_or(0)
            })
            .collect();
        assert!(
            firsts.len() >= 6,
            "8 nodes should mostly start on different pieces: {firsts:?}"
        );
    }

    #[test]
    fn corrupt_peer_is_banned_busy_peer_rests_and_orphans_are_reported() {
        let mut s = sched(3, SchedulerConfig::default());
        s.set_peer("liar", None, 0);
        let r = s.next_requests(0, 10);
        assert_eq!(r.len(), 2, "the urgent head counts against the window of 2");
        s.on_failed(0, "liar", true);
        assert!(s.is_banned("liar"));
        assert!(s.next_requests(0, 10).is_empty());
        let still_out = r.iter().find(|x| x.piece != 0).map(|x| x.piece);
        let want: Vec<u32> = (0..3).filter(|&p| Some(p) != still_out).collect();
        assert_eq!(
            s.orphans(),
            want,
            "nobody else holds them; one is still in flight"
        );
        s.set_peer("good", Some(bits(3, &[0])), 1);
        let r = s.next_requests(1, 10);
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].piece, r[0].peer.as_str()), (0, "good"));
        s.on_busy(0, "good", 10);
        assert!(s.next_requests(20, 10).is_empty(), "resting");
        assert_eq!(s.next_requests(40, 10).len(), 1, "rested");
        assert!(s.on_done(0, "good", 50));
        assert!(!s.on_done(0, "good", 51));
    }

    #[test]
    fn endgame_asks_a_second_peer_for_the_tail() {
        let mut s = PieceScheduler::new(
            bits(4, &[0, 1, 2]),
            MB,
            SchedulerConfig {
                endgame: 2,
                ..Default::default()
            },
        );
        s.set_peer("slow", None, 0);
        s.set_peer("fast", None, 1);
        let r = s.next_requests(0, 10);
        assert_eq!(
            r.len(),
            2,
            "first request plus its endgame duplicate: {r:?}"
        );
        assert_ne!(r[0].peer, r[1].peer);
        assert!(r.iter().all(|x| x.piece == 3));
        assert!(s.on_done(3, &r[1].peer, 5));
        assert_eq!(s.duplicates_of(3), vec![r[0].peer.clone()]);
        s.forget(3, &r[0].peer);
        assert!(s.is_complete());
        assert_eq!(s.inflight_count(), 0);
    }

    #[test]
    fn endgame_duplicates_take_from_the_budget_but_the_read_head_does_not() {
        let cfg = SchedulerConfig {
            endgame: 2,
            ..Default::default()
        };
        // Pieces 2 (the read head) and 3 missing, two complete peers.
        let mut s = PieceScheduler::new(bits(4, &[0, 1]), MB, cfg);
        s.set_peer("a", None, 0);
        s.set_peer("b", None, 1);
        let first = s.next_requests(0, 1);
        assert_eq!(first.iter().filter(|r| !r.urgent).count(), 1, "{first:?}");
        assert_eq!(
            first.iter().filter(|r| r.urgent && r.piece == 2).count(),
            2,
            "the read head and its duplicate, both outside the budget: {first:?}"
        );
        for budget in 0..3u32 {
            let mut t = s.clone();
            let dup = t.next_requests(1, budget);
            let non_urgent = dup.iter().filter(|r| !r.urgent).count();
            assert_eq!(
                non_urgent,
                (budget as usize).min(1),
                "budget {budget}: {dup:?}"
            );
        }
    }

    #[test]
    fn rack_stripes_keep_far_fetches_to_this_nodes_share_until_patience_runs_out() {
        let cfg = SchedulerConfig {
            min_window: 64,
            max_window: 64,
            max_inflight_total: 64,
            patience_ms: 1_000,
            ..Default::default()
        };
        let mut s = PieceScheduler::new(Bitfield::new(16), MB, cfg);
        s.set_stripe(Some((1, 4)));
        s.set_peer_at("far", None, 2, 0);
        let r = s.next_requests(10, 64);
        let pieces: Vec<u32> = r.iter().map(|x| x.piece).collect();
        assert!(
            pieces.iter().all(|p| p % 4 == 1 || *p == s.have().prefix()),
            "only my stripe from afar (and the urgent head): {pieces:?}"
        );
        for x in &r {
            s.forget(x.piece, "far");
        }
        let r = s.next_requests(1_500, 64);
        assert!(r.len() > 4, "after patience, anything: {}", r.len());
        // A near peer may give anything at any time.
        let mut t = PieceScheduler::new(Bitfield::new(16), MB, s.cfg.clone());
        t.set_stripe(Some((1, 4)));
        t.set_peer_at("near", None, 0, 0);
        assert_eq!(t.next_requests(1, 64).len(), 16);
    }

    #[test]
    fn the_source_is_asked_only_for_this_nodes_source_stripe_until_patience_runs_out() {
        let cfg = SchedulerConfig {
            min_window: 64,
            max_window: 64,
            max_inflight_total: 64,
            ..Default::default()
        };
        let all: Vec<u32> = (0..16).collect();
        // The source named before and after the peer joins: both mark it.
        for source_first in [true, false] {
            let mut s = PieceScheduler::new(Bitfield::new(16), MB, cfg.clone());
            if source_first {
                s.set_source(Some("src"), Some((1, 4)));
            }
            s.set_peer_at("src", Some(bits(16, &all)), 0, 0);
            s.set_peer_at("other", Some(Bitfield::new(16)), 0, 0);
            if !source_first {
                s.set_source(Some("src"), Some((1, 4)));
            }
            let r = s.next_requests(10, 64);
            let pieces: Vec<u32> = r.iter().map(|x| x.piece).collect();
            assert_eq!(
                pieces.iter().filter(|p| *p % 4 == 1).count(),
                4,
                "my stripe: {pieces:?}"
            );
            assert!(
                pieces.iter().all(|p| p % 4 == 1),
                "nothing else, not even the read head: {pieces:?}"
            );
            // A member passes piece 0 on: it comes from there at once.
            s.peer_has("other", 0, 20);
            let r = s.next_requests(20, 64);
            assert_eq!(r.len(), 1, "{r:?}");
            assert_eq!(
                (r[0].piece, r[0].peer.as_str(), r[0].urgent),
                (0, "other", true)
            );
            // Before any rate is measured the patience is the maximum.
            let wait = cfg.source_patience_max_ms;
            assert!(s.next_requests(wait - 1, 64).is_empty());
            let late = s.next_requests(wait, 64);
            assert_eq!(
                late.len(),
                11,
                "after patience, the rest from the source: {late:?}"
            );
            assert!(late.iter().all(|x| x.peer == "src"));
        }
        // In a swarm of at most HEAD_DIVISOR members the head piece comes from the
        // source at once, outside the stripe; in a bigger one it waits like the others.
        for (members, at_once) in [(8, true), (crate::pieces::HEAD_DIVISOR as u32 + 1, false)] {
            let mut s = PieceScheduler::new(Bitfield::new(16), MB, cfg.clone());
            s.set_source(Some("src"), Some((1, 4)));
            s.set_members(members, 0);
            s.set_peer_at("src", Some(bits(16, &all)), 0, 0);
            let r = s.next_requests(10, 64);
            let head = r.iter().find(|x| x.piece == 0);
            assert_eq!(
                head.map(|x| (x.peer.as_str(), x.urgent)),
                at_once.then_some(("src", true)),
                "{members} members: {r:?}"
            );
            assert!(r.iter().all(|x| x.piece == 0 || x.piece % 4 == 1), "{r:?}");
        }
        // No stripe (no source, or a large swarm): anything from the source.
        let mut s = PieceScheduler::new(Bitfield::new(16), MB, cfg.clone());
        s.set_peer_at("src", Some(bits(16, &all)), 0, 0);
        s.set_source(Some("src"), None);
        assert_eq!(s.next_requests(10, 64).len(), 16);
    }

    #[test]
    fn a_tracker_answer_sets_the_source_and_this_nodes_source_stripe() {
        use crate::protocol::{AnnounceResponse, Role};
        let resp = |stripe: Option<[u32; 2]>| AnnounceResponse {
            role: Role::Peer,
            size: Some(16 << 20),
            piece_size: MB,
            hashes: Default::default(),
            peers: Vec::new(),
            source_alive: true,
            source: Some("src".into()),
            interval_ms: 1_000,
            stripe: None,
            source_stripe: stripe,
            members: 10,
        };
        let all: Vec<u32> = (0..16).collect();
        let mut s = PieceScheduler::new(
            Bitfield::new(16),
            MB,
            SchedulerConfig {
                min_window: 64,
                max_window: 64,
                max_inflight_total: 64,
                ..Default::default()
            },
        );
        s.set_peer_at("src", Some(bits(16, &all)), 0, 0);
        s.on_announce(&resp(Some([1, 9])), 0);
        let mut pieces: Vec<u32> = s.next_requests(10, 64).iter().map(|r| r.piece).collect();
        pieces.sort_unstable();
        assert_eq!(
            pieces,
            vec![0, 1, 10],
            "the stripe, and the head piece (ten members)"
        );
        // The source is done (the tracker names no stripe): anything from it.
        s.on_announce(&resp(None), 20);
        assert_eq!(s.next_requests(20, 64).len(), 13);
    }

    #[test]
    fn source_patience_follows_how_long_this_nodes_stripe_took_from_the_source() {
        let cfg = SchedulerConfig {
            min_window: 64,
            max_window: 64,
            max_inflight_total: 64,
            ..Default::default()
        };
        let mut s = PieceScheduler::new(Bitfield::new(64), MB, cfg.clone());
        s.set_source(Some("src"), Some((0, 2)));
        assert_eq!(
            s.source_patience_ms, cfg.source_patience_max_ms,
            "nothing measured"
        );
        // The source announces piece 0 (my stripe) and 1 at 100 ms; 0 arrives 500 ms later.
        s.set_peer_at("src", Some(bits(64, &[0, 1])), 0, 100);
        let r = s.next_requests(100, 64);
        assert_eq!(r.len(), 1, "only my stripe: {r:?}");
        assert!(s.on_done(0, "src", 600));
        assert_eq!(
            s.source_patience_ms,
            500 * cfg.source_patience_factor as u64
        );
        // A piece outside my stripe, taken after the patience, does not count.
        let f = cfg.source_patience_factor as u64;
        let patience = s.source_patience_ms;
        assert!(s.next_requests(100 + patience - 1, 64).is_empty());
        let late = s.next_requests(100 + patience, 64);
        assert_eq!(late.iter().map(|x| x.piece).collect::<Vec<_>>(), vec![1]);
        assert!(s.on_done(1, "src", 9_000));
        assert_eq!(s.source_patience_ms, patience);
        // A fast piece pulls it down, smoothed (0.8 × 500 + 0.2 × 1 ms, times f)...
        s.peer_has("src", 2, 9_000);
        assert!(s.next_requests(9_000, 64).iter().any(|x| x.piece == 2));
        assert!(s.on_done(2, "src", 9_001));
        assert_eq!(s.source_patience_ms, (400.2 * f as f64) as u64);
        // ... and never under the lower bound.
        for p in (4..64).step_by(2) {
            s.peer_has("src", p, 9_000 + p as u64);
            assert!(s
                .next_requests(9_000 + p as u64, 64)
                .iter()
                .any(|x| x.piece == p));
            assert!(s.on_done(p, "src", 9_001 + p as u64));
        }
        assert_eq!(s.source_patience_ms, cfg.source_patience_min_ms);
    }

    #[test]
    fn a_slot_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Option<Slot>>(), 64);
        assert_eq!(std::mem::align_of::<Option<Slot>>(), 64);
    }

    #[test]
    fn a_waiting_request_at_the_source_moves_to_a_new_holder() {
        let mut s = sched(
            8,
            SchedulerConfig {
                min_window: 1,
                max_window: 1,
                ..Default::default()
            },
        );
        s.set_peer("src", None, 0);
        s.set_peer("x", Some(Bitfield::new(8)), 0);
        let r = s.next_requests(0, 8);
        let from_src: Vec<u32> = r
            .iter()
            .filter(|x| x.peer == "src")
            .map(|x| x.piece)
            .collect();
        let p = *from_src.last().unwrap();
        s.peer_has("x", p, 1);
        assert_eq!(s.retarget_on_have(p, "x", Some("src")), Some("src".into()));
        assert_eq!(
            s.retarget_on_have(p, "x", Some("other")),
            None,
            "not the source"
        );
        assert_eq!(s.retarget_on_have(p, "src", Some("src")), None);
        assert_eq!(s.retarget_on_have(7 - p.min(7), "x", None), None);
        // By handle, the same answers for every piece and peer.
        let src = s.peer_handle("src").unwrap();
        let x = s.peer_handle("x").unwrap();
        for piece in 0..8 {
            for (handle, name) in [(src, "src"), (x, "x")] {
                assert_eq!(
                    s.retarget_on_have_handle(piece, handle),
                    s.retarget_on_have(piece, "y", Some(name)).is_some(),
                    "piece {piece} at {name}"
                );
            }
        }
        assert!(s.retarget_on_have_handle(p, src));
    }

    #[test]
    fn a_large_swarm_leaves_part_of_the_agents_budget_unused() {
        let cfg = SchedulerConfig {
            min_window: 16,
            max_window: 16,
            max_inflight_total: 64,
            ..Default::default()
        };
        let withheld = cfg.large_swarm_withheld_requests;
        assert!(withheld > 0 && withheld < 32);
        let run = |members: u32| {
            let mut s = sched(64, cfg.clone());
            s.set_members(members, 0);
            for p in ["a", "b", "c", "d"] {
                s.set_peer(p, None, 0);
            }
            let reqs = s.next_requests(0, 32);
            reqs.iter().filter(|r| !r.urgent).count() as u32
        };
        assert_eq!(
            run(STALL_MIN_MEMBERS - 1),
            32,
            "a small swarm takes the whole budget"
        );
        assert_eq!(
            run(STALL_MIN_MEMBERS),
            32 - withheld,
            "a large one leaves {withheld}"
        );
    }

    #[test]
    fn a_request_stalled_in_a_holders_line_moves_to_another_holder() {
        let cfg = SchedulerConfig {
            min_window: 2,
            max_window: 2,
            large_swarm_withheld_requests: 0,
            ..Default::default()
        };
        let stall = cfg.stall_ms;
        let mut s = sched(8, cfg);
        s.set_members(STALL_MIN_MEMBERS, 0);
        s.set_peer("slow", Some(bits(8, &[0, 1, 2, 3, 4, 5, 6, 7])), 0);
        let first = s.next_requests(0, 8);
        assert_eq!(
            first.len(),
            2,
            "a window of two, the read head in it: {first:?}"
        );
        assert!(s.stalled_requests(stall - 1).is_empty(), "not yet");
        let stalled = s.stalled_requests(stall);
        assert_eq!(stalled.len(), 2, "both wait past the timeout: {stalled:?}");
        assert!(
            s.stalled_requests(stall + 1).is_empty(),
            "reported once per timeout"
        );
        // The holder confirms both cancels; another holder appears.
        for r in &stalled {
            s.on_cancelled(r.piece, "slow", stall + 2);
        }
        s.set_peer("other", None, 0);
        let again = s.next_requests(stall + 2, 8);
        assert!(!again.is_empty());
        assert!(
            again.iter().all(|r| r.peer == "other"),
            "the holder that kept them waiting rests: {again:?}"
        );
        assert!(again.iter().any(|r| r.piece == first[0].piece && r.urgent));
    }

    #[test]
    fn small_swarms_have_no_stall_timeout_and_a_plain_cancel_rests_nobody() {
        let mut s = sched(8, SchedulerConfig::default());
        s.set_members(STALL_MIN_MEMBERS - 1, 0);
        s.set_peer("a", None, 0);
        let r = s.next_requests(0, 8);
        assert!(!r.is_empty());
        assert!(s.stalled_requests(60_000).is_empty());
        // A cancel that was not for a stall (a retarget) leaves the holder usable.
        s.on_cancelled(r[0].piece, "a", 60_000);
        let again = s.next_requests(60_000, 8);
        assert!(again.iter().any(|x| x.piece == r[0].piece && x.peer == "a"));
        // A swarm that grows past the threshold: requests sent before count from then.
        s.set_members(1_000, 60_000);
        assert!(s.stalled_requests(60_100).is_empty());
        assert!(!s.stalled_requests(60_000 + s.config().stall_ms).is_empty());
    }

    #[test]
    fn large_swarms_wait_longer_for_a_near_holder() {
        let cfg = SchedulerConfig {
            patience_ms: 1_000,
            large_patience_ms: 3_000,
            huge_patience_ms: 5_000,
            ..Default::default()
        };
        let mut s = sched(8, cfg);
        s.set_stripe(Some((0, 2)));
        s.set_peer_at("far", None, 2, 0);
        assert_eq!(s.patience_ms(), 1_000);
        let far = s.peer_handle("far").expect("known");
        assert!(s.could_request_from(far, 3, 1_000));
        s.set_members(LARGE_SWARM_MEMBERS + 1, 0);
        assert_eq!(s.patience_ms(), 3_000);
        assert!(!s.could_request_from(far, 3, 1_000));
        assert!(s.could_request_from(far, 3, 3_000));
        s.set_members(HUGE_SWARM_MEMBERS + 1, 0);
        assert_eq!(s.patience_ms(), 5_000);
        assert!(!s.could_request_from(far, 3, 3_000));
        assert!(s.could_request_from(far, 3, 5_000));
    }

    #[test]
    fn registry_runs_cover_what_nobody_gives() {
        let mut s = sched(10, SchedulerConfig::default());
        s.set_peer("a", Some(bits(10, &[0, 1, 5])), 0);
        assert_eq!(s.registry_run(false, |_| false), Some((2, 5)));
        assert_eq!(s.registry_run(false, |i| i == 2), Some((3, 5)));
        assert_eq!(s.registry_run(true, |_| false), Some((0, 10)));
        s.claim(2);
        assert_eq!(s.registry_run(false, |_| false), Some((3, 5)));
    }

    #[test]
    fn availability_counts_follow_bitfields_haves_bans_and_departures() {
        let mut s = sched(4, SchedulerConfig::default());
        s.set_peer("a", Some(bits(4, &[1])), 0);
        s.set_peer("b", Some(bits(4, &[1, 2])), 0);
        s.set_peer("c", None, 0);
        assert_eq!(
            (
                s.usable_holders(1),
                s.usable_holders(2),
                s.usable_holders(3)
            ),
            (3, 2, 1)
        );
        s.peer_has("a", 2, 0);
        assert_eq!(s.usable_holders(2), 3);
        s.set_peer("b", Some(bits(4, &[])), 0);
        assert_eq!(s.usable_holders(2), 2);
        s.on_failed(0, "c", true);
        assert_eq!(s.usable_holders(3), 0);
        s.remove_peer("a");
        assert_eq!((s.usable_holders(1), s.usable_holders(2)), (0, 0));
        s.on_not_held(3, "b");
        assert_eq!(s.orphans(), vec![0, 1, 2, 3]);
    }

    /// `next_requests` as it was before the fill loop kept its candidates (a scan of
    /// every peer per request, names compared): the reference the faster loop must
    /// match request for request.
    fn next_requests_reference(s: &mut PieceScheduler, now_ms: u64, max_new: u32) -> Vec<Request> {
        let mut out = Vec::new();
        if s.have.is_complete() {
            return out;
        }
        let head = s.have.prefix();
        if head < s.have.len() && !s.inflight_any.get(head) {
            if let Some(p) = s.pick_peer(head, now_ms, true, &[]) {
                s.assign(head, p, now_ms);
                out.push(s.request(head, p, true));
            }
        }
        let mut budget = max_new;
        let total_cap = s.cfg.max_inflight_total;
        let mut exhausted: Vec<u32> = Vec::new();
        while budget > 0 && s.inflight_count() < total_cap {
            let Some(p) = s.least_loaded(now_ms, &exhausted) else {
                break;
            };
            match s.best_piece_for(p, now_ms, head) {
                Some(piece) => {
                    s.assign(piece, p, now_ms);
                    out.push(s.request(piece, p, false));
                    budget -= 1;
                }
                None => exhausted.push(p),
            }
        }
        s.endgame_requests(head, budget, now_ms, &mut out);
        out
    }

    #[test]
    fn the_fill_loop_matches_the_reference_on_random_swarms() {
        let mut rng = 0x5eed_u64;
        let mut next = move |n: u64| {
            rng = mix(rng, 7);
            rng % n.max(1)
        };
        for round in 0..300 {
            let len = 1 + next(200) as u32;
            let cfg = SchedulerConfig {
                min_window: 1 + next(3) as u32,
                max_window: 2 + next(8) as u32,
                max_inflight_total: 4 + next(40) as u32,
                endgame: next(6) as u32,
                seed: round,
                ..Default::default()
            };
            let mut mine = Bitfield::new(len);
            for i in 0..len {
                if next(3) == 0 {
                    mine.set(i);
                }
            }
            let mut a = PieceScheduler::new(mine, MB, cfg);
            if next(2) == 0 {
                a.set_stripe(Some((next(4) as u32, 4)));
            }
            let peers = 1 + next(60);
            for p in 0..peers {
                // Names out of slot order, and some that sort alike but for a suffix.
                let name = format!("p{}-{}", next(5), p);
                let have = if next(8) == 0 {
                    None
                } else {
                    let mut h = Bitfield::new(len);
                    for i in 0..len {
                        if next(4) == 0 {
                            h.set(i);
                        }
                    }
                    Some(h)
                };
                a.set_peer_at(&name, have, next(3) as u8, next(2_000));
                if next(10) == 0 {
                    a.remove_peer(&name);
                }
            }
            let mut b = a.clone();
            let mut now = 2_000;
            for _ in 0..6 {
                now += next(400);
                let max_new = next(20) as u32;
                let ra = a.next_requests(now, max_new);
                let rb = next_requests_reference(&mut b, now, max_new);
                assert_eq!(ra, rb, "round {round} at {now}");
                // Some answers, the same on both sides: rates, rests, failures.
                for r in &ra {
                    if next(2) == 0 {
                        continue;
                    }
                    match next(4) {
                        0 => {
                            a.on_busy(r.piece, &r.peer, now);
                            b.on_busy(r.piece, &r.peer, now);
                        }
                        1 => {
                            let corrupt = next(5) == 0;
                            a.on_failed(r.piece, &r.peer, corrupt);
                            b.on_failed(r.piece, &r.peer, corrupt);
                        }
                        _ => {
                            let t = now + 1 + next(300);
                            a.on_done(r.piece, &r.peer, t);
                            b.on_done(r.piece, &r.peer, t);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn peer_rows_follow_haves_completion_and_slot_reuse() {
        // 10 pieces: rows of two bytes, the second one partly padding.
        let mut s = sched(10, SchedulerConfig::default());
        s.set_peer("a", Some(bits(10, &[0, 9])), 0);
        s.set_peer("b", Some(bits(10, &[1])), 0);
        for p in 1..9 {
            s.peer_has("a", p, 0);
        }
        assert!(s.peer_is_complete("a"), "the last HAVE makes it complete");
        assert_eq!(
            s.usable_holders(1),
            2,
            "b by its row, a as a complete holder"
        );
        s.on_not_held(3, "a");
        assert!(!s.peer_is_complete("a"));
        assert_eq!(s.usable_holders(3), 0);
        assert_eq!(s.usable_holders(4), 1);
        // b leaves and c takes its slot: c holds what it says, nothing of b's.
        let b = s.peer_handle("b");
        s.remove_peer("b");
        s.set_peer("c", Some(bits(10, &[5])), 0);
        assert_eq!(s.peer_handle("c"), b, "the freed slot is reused");
        assert_eq!(s.usable_holders(1), 1, "b's piece is only a's now");
        assert_eq!(s.usable_holders(5), 2);
        let reqs = s.next_requests(0, 16);
        assert!(
            reqs.iter().all(|r| r.peer == "a" || r.piece == 5),
            "c is asked only for its one piece: {reqs:?}"
        );
        assert!(reqs.iter().all(|r| r.piece != 3), "nobody holds piece 3");
    }
}
