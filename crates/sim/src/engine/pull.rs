//! One node's fetch of one layer: the download task's state (`p2p/download.rs`'s
//! `Download`, what the simulator needs of it), or a direct or cache pull.

use std::collections::{HashMap, VecDeque};

use swarm::{AnnounceResponse, Bitfield, PieceLayout, PieceScheduler, Role};

/// How far a pull has come.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Idle,
    /// Announced, waiting for the tracker (and, as a peer, for the source to learn
    /// the blob's size; as the source, for the registry's answer).
    Starting,
    /// The download task runs.
    Swarm,
    /// Not a swarm blob: the plain registry path.
    Direct,
    /// Through the shared cache.
    Cache,
}

/// A peer the tracker handed out, and our channel to it (download.rs `Link`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Link {
    pub distance: u8,
    pub connected: bool,
    pub connecting: bool,
    /// Whether the latest tracker answer named it.
    pub fresh: bool,
    /// The peer's handle in the scheduler, once its bitfield arrived.
    pub handle: Option<u32>,
    /// When it last gave a piece, or when it was handed out (ms), for
    /// `swarm::links::to_drop`.
    pub useful_ms: u64,
    /// The HAVEs asked of the holder on the open channel.
    pub have_filter: swarm::links::HaveFilter,
}

impl Link {
    /// A peer the tracker just handed out, not dialed yet.
    pub fn handed_out(distance: u8, now_ms: u64) -> Self {
        Self {
            distance,
            connected: false,
            connecting: false,
            fresh: true,
            handle: None,
            useful_ms: now_ms,
            have_filter: swarm::links::HaveFilter::ALL,
        }
    }
}

/// A task's links by peer slot: keys and values in two vectors, keys in order. Every
/// HAVE delivered looks its sender up here (139 M times at 10,000 nodes), and a few
/// dozen sorted `u32`s are found in a cache line or three, without hashing. Iteration
/// is in slot order.
#[derive(Clone, Debug, Default)]
pub(crate) struct Links {
    keys: Vec<u32>,
    values: Vec<Link>,
}

impl Links {
    fn find(&self, h: u32) -> Result<usize, usize> {
        self.keys.binary_search(&h)
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn get(&self, h: &u32) -> Option<&Link> {
        self.find(*h).ok().map(|i| &self.values[i])
    }

    pub fn get_mut(&mut self, h: &u32) -> Option<&mut Link> {
        self.find(*h).ok().map(|i| &mut self.values[i])
    }

    pub fn remove(&mut self, h: &u32) -> Option<Link> {
        let i = self.find(*h).ok()?;
        self.keys.remove(i);
        Some(self.values.remove(i))
    }

    /// The link to `h`, made by `new` if there is none.
    pub fn get_or_insert_with(&mut self, h: u32, new: impl FnOnce() -> Link) -> &mut Link {
        let i = match self.find(h) {
            Ok(i) => i,
            Err(i) => {
                self.keys.insert(i, h);
                self.values.insert(i, new());
                i
            }
        };
        &mut self.values[i]
    }

    /// Reads every cache line of the keys, so that a lookup soon after finds them
    /// (`Engine::read_ahead_haves`); returns a value made of what it read.
    pub fn read_ahead(&self) -> u64 {
        // 16 keys to a 64-byte line.
        self.keys
            .iter()
            .step_by(16)
            .chain(self.keys.last())
            .fold(0, |acc, &k| acc ^ k as u64)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&u32, &Link)> {
        self.keys.iter().zip(&self.values)
    }

    pub fn values(&self) -> impl Iterator<Item = &Link> {
        self.values.iter()
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut Link> {
        self.values.iter_mut()
    }
}

/// A registry run: pieces `[first, end)` over one registry connection; `next` is
/// the piece whose bytes arrive now.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Run {
    pub first: u32,
    pub end: u32,
    pub next: u32,
    pub flow: u32,
}

pub(crate) struct Pull {
    pub active: bool,
    /// Started by the agent's layer prefetch, not by one of the pull client's
    /// `layer_concurrency` fetches (it takes none of them).
    pub prefetched: bool,
    pub done: bool,
    pub phase: Phase,
    pub requested_at: f64,
    pub finished_at: f64,
    pub layout: Option<PieceLayout>,
    pub sched: Option<PieceScheduler>,
    pub role: Role,
    /// The elected source's slot, whose HAVE hashes this task trusts.
    pub source: Option<u32>,
    pub links: Links,
    /// Links handed out but not dialed yet.
    pub to_dial: Vec<u32>,
    /// Piece hashes known (from the tracker, or from the source's HAVEs).
    pub hashes: Bitfield,
    /// Hashes this agent computed from registry bytes, not yet sent to the tracker.
    pub publish: Vec<u32>,
    /// Registry pieces on disk that the in-order digest has not reached: a piece's
    /// hash is the blob's sha256 state at its end (`swarm::chain`), so a source can
    /// hold and publish a registry piece only once every piece before it is on disk
    /// (the store's `PieceWriter`).
    pub unhashed: std::collections::BTreeSet<u32>,
    /// The first piece the digest has not passed.
    pub digest_at: u32,
    /// Pieces received before their hash was known, and from whom.
    pub unverified: HashMap<u32, u32>,
    /// Pieces a connection is receiving or that wait for their hash (the writer's
    /// claims): another copy of them is dropped.
    pub claimed: Bitfield,
    pub runs: Vec<Run>,
    /// Registry GETs sent whose runs have not started yet.
    pub pending_runs: u32,
    pub registry_bytes: f64,
    /// When the first registry run was asked for (its runs are sized from the rate).
    pub registry_since: Option<f64>,
    /// How many of `publish` the announce in flight carries.
    pub publish_sent: usize,
    /// Requests that took from the node's budget: (piece, holder slot). A few dozen
    /// at most, found by a scan (a hashed set cost a SipHash per request).
    pub budgeted: Vec<(u32, u32)>,
    pub announcing: bool,
    pub reply: Option<AnnounceResponse>,
    pub last_announce: f64,
    pub interval: f64,
    /// The task's start: its housekeeping ticks fall on `t0 + k · 50 ms`.
    pub t0: f64,
    pub last_hash_fetch: Option<f64>,
    /// Last time this task asked a complete peer for its hash list (no source).
    pub last_peer_hash_ask: Option<f64>,
    pub hash_reply: Option<std::collections::BTreeMap<u32, String>>,
    pub registry_retry_at: f64,
    /// Peers (by request) until the tracker knows the size: poll deadline.
    pub size_deadline: f64,
    pub queued_pump: bool,
    /// The node's budget grew since this task last scheduled.
    pub budget_seen: u32,
    /// Times at which something time-dependent in the scheduler ripens (a rested
    /// peer, stripe patience), in order.
    pub wake: VecDeque<f64>,
    /// The tracker gave this task a rack stripe.
    pub striped: bool,
    /// The swarm's members as the tracker counted them at the latest answer.
    pub members: u32,
    pub first_piece_at: Option<f64>,
    /// Cache read cursor.
    pub cursor: u32,
}

impl Pull {
    pub fn new(held: bool) -> Self {
        Self {
            active: false,
            done: held,
            phase: Phase::Idle,
            requested_at: 0.0,
            prefetched: false,
            finished_at: 0.0,
            layout: None,
            sched: None,
            role: Role::Peer,
            source: None,
            links: Links::default(),
            to_dial: Vec::new(),
            hashes: Bitfield::new(0),
            publish: Vec::new(),
            unhashed: std::collections::BTreeSet::new(),
            digest_at: 0,
            unverified: HashMap::new(),
            claimed: Bitfield::new(0),
            runs: Vec::new(),
            pending_runs: 0,
            registry_bytes: 0.0,
            registry_since: None,
            publish_sent: 0,
            budgeted: Vec::new(),
            announcing: false,
            reply: None,
            last_announce: 0.0,
            interval: 1.0,
            t0: 0.0,
            last_hash_fetch: None,
            last_peer_hash_ask: None,
            hash_reply: None,
            registry_retry_at: 0.0,
            size_deadline: 0.0,
            queued_pump: false,
            budget_seen: 0,
            wake: VecDeque::new(),
            striped: false,
            members: 0,
            first_piece_at: None,
            cursor: 0,
        }
    }

    /// Whether this node can serve `piece` now (serve.rs `holds`).
    pub fn holds(&self, piece: u32) -> bool {
        self.done || self.sched.as_ref().is_some_and(|s| s.have().get(piece))
    }

    /// Asks for a scheduling pass at the first housekeeping tick at or after `t` (the
    /// agent's tick passes through `schedule`): a tick earlier than `t` would find
    /// what ripens at `t` (a rested peer, a stripe's patience) not ripe yet.
    pub fn wake_at(&mut self, t: f64) {
        let t = self.tick_at(t);
        // Most wake-ups asked for are the latest yet, or at the latest tick already
        // asked for (now plus a patience that rarely changes): no search through the
        // line for those.
        match self.wake.back() {
            None => {
                self.wake.push_back(t);
                return;
            }
            Some(&last) if last < t - 1e-9 => {
                self.wake.push_back(t);
                return;
            }
            Some(&last) if last <= t + 1e-9 => return,
            Some(_) => {}
        }
        let at = self.wake.partition_point(|&x| x < t - 1e-9);
        if self.wake.get(at).is_none_or(|&x| x > t + 1e-9) {
            self.wake.insert(at, t);
        }
    }

    /// The first tick of the task's housekeeping at or after `t`.
    pub fn tick_at(&self, t: f64) -> f64 {
        let k = ((t - self.t0) / TICK - 1e-9).ceil().max(0.0);
        self.t0 + k * TICK
    }
}

/// The download task's housekeeping interval (download.rs `tick`).
pub(crate) const TICK: f64 = 0.050;
/// How often a source pushes new piece hashes to the tracker, at most
/// (download.rs `HASH_PUSH_EVERY`).
pub(crate) const HASH_PUSH_EVERY: f64 = 0.100;
/// How often a task holding unverified pieces asks the tracker for hashes, at most.
pub(crate) const HASH_FETCH_EVERY: f64 = 0.200;
/// With no source publishing, a task missing hashes asks a complete peer for its
/// hash list this often, at most.
pub(crate) const PEER_HASH_ASK_EVERY: f64 = 2.0;
/// Peers poll the tracker this often until the source has announced the size, for at
/// most `SIZE_WAIT`.
pub(crate) const SIZE_POLL: f64 = 0.020;
pub(crate) const SIZE_WAIT: f64 = 10.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_found_by_slot_and_kept_in_slot_order() {
        let mut links = Links::default();
        for h in [7, 3, 9, 1] {
            links.get_or_insert_with(h, || Link::handed_out(h as u8, 0));
        }
        links
            .get_or_insert_with(3, || Link::handed_out(99, 0))
            .connected = true;
        assert_eq!(links.len(), 4, "an existing link is not made again");
        let order: Vec<u32> = links.iter().map(|(&h, _)| h).collect();
        assert_eq!(order, vec![1, 3, 7, 9]);
        assert!(links
            .get(&3)
            .is_some_and(|k| k.connected && k.distance == 3));
        assert_eq!(links.remove(&7).map(|k| k.distance), Some(7));
        assert!(links.get(&7).is_none() && links.remove(&7).is_none());
        assert!(links.get(&9).is_some_and(|k| k.distance == 9));
        assert_eq!(links.values().count(), 3);
    }

    #[test]
    fn wake_ups_stay_one_per_tick_in_order() {
        // What `wake_at` keeps, by the plain rule: one entry per tick, in order.
        let mut p = Pull::new(false);
        p.t0 = 0.01;
        let mut want: Vec<f64> = Vec::new();
        let mut x = 7u64;
        for i in 0..2_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Mostly later and later, sometimes earlier, often the same tick again.
            let t = i as f64 * 0.013 + (x >> 40) as f64 / (1u64 << 24) as f64 * 3.0 - 1.0;
            p.wake_at(t);
            let tick = p.tick_at(t);
            if !want.iter().any(|&w| (w - tick).abs() <= 1e-9) {
                want.push(tick);
                want.sort_by(f64::total_cmp);
            }
            if x.is_multiple_of(5) && !want.is_empty() {
                want.remove(0);
                p.wake.pop_front();
            }
        }
        assert!(want.len() > 50);
        assert_eq!(p.wake.iter().copied().collect::<Vec<_>>(), want);
    }
}
