//! One swarm's peer table and the tracker's peer handout.
//!
//! The handout policy (see [`PeerTable::handout`]): three quarters of `max_peers` go to
//! the nearest peers (same rack, then same zone; the most complete among equals), the
//! rest to the most complete peers anywhere, and the live source always. Only peers
//! with something to give are handed out.
//!
//! Why the indexes: a tracker serving a 10,000-node swarm answers thousands of
//! announces per second, and ranking every live peer on each (O(n log n), ≈ 11 ms at
//! 10,000 peers) cannot keep up. So the table keeps the peers that can give something
//! in buckets (all, complete, per rack, per zone, and ranked by pieces held), and a
//! handout ranks only a bounded pool drawn from them: the requester's rack, a sample
//! of its zone, a sample of the complete peers, the most complete partial peers and a
//! sample of everyone. A swarm with at most [`EXACT_POOL`] givers is ranked in full, so
//! small swarms get exactly the ranked policy; larger ones get it over the pool, which
//! costs O(max_peers · log n) per announce.

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};

use crate::protocol::Topology;
use crate::Bitfield;

/// Swarms with at most this many givers are ranked in full.
pub const EXACT_POOL: usize = 256;

#[derive(Clone, Debug)]
pub(crate) struct PeerEntry {
    pub name: String,
    pub addr: String,
    pub topology: Topology,
    /// [`zone_key`] of `topology`, kept so ranking compares names only within a zone.
    pub zone_key: u64,
    pub have: Option<Bitfield>,
    pub complete: bool,
    pub last_seen: u64,
    /// Pieces held (`u32::MAX` when complete), cached so ranking scans no bitfield.
    pub held: u32,
}

impl PeerEntry {
    pub fn new(
        name: &str,
        addr: &str,
        topology: &Topology,
        have: Option<Bitfield>,
        complete: bool,
        now: u64,
    ) -> Self {
        let held = if complete {
            u32::MAX
        } else {
            have.as_ref().map_or(0, |h| h.count())
        };
        Self {
            name: name.to_owned(),
            addr: addr.to_owned(),
            topology: topology.clone(),
            zone_key: zone_key(topology),
            have,
            complete,
            last_seen: now,
            held,
        }
    }
}

/// A hash of the zone (or its absence): two topologies whose keys differ are not in
/// one zone, so they are at distance 2 ([`Topology::distance`]) without comparing
/// names — a handout ranks hundreds of candidates, and comparing every one's zone and
/// rack names was a tenth of the tracker's time at 10,000 simulated nodes.
fn zone_key(t: &Topology) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    t.zone.hash(&mut h);
    h.finish()
}

/// [`Topology::distance`], with the zone keys compared first.
fn distance_keyed(a: &Topology, a_key: u64, b: &PeerEntry) -> u8 {
    if a_key != b.zone_key {
        2
    } else {
        a.distance(&b.topology)
    }
}

/// A set of slots with O(1) insert, remove and uniform sampling.
#[derive(Clone, Debug, Default)]
struct Bucket {
    items: Vec<u32>,
    pos: HashMap<u32, u32>,
}

impl Bucket {
    fn insert(&mut self, s: u32) {
        if !self.pos.contains_key(&s) {
            self.pos.insert(s, self.items.len() as u32);
            self.items.push(s);
        }
    }

    fn remove(&mut self, s: u32) {
        if let Some(i) = self.pos.remove(&s) {
            let i = i as usize;
            self.items.swap_remove(i);
            if let Some(&moved) = self.items.get(i) {
                self.pos.insert(moved, i as u32);
            }
        }
    }

    /// All members when there are at most `k`, else `k` drawn at random (with
    /// replacement: duplicates are removed by the caller).
    fn sample(&self, k: usize, rng: &mut SplitMix, out: &mut Vec<u32>) {
        if self.items.len() <= k {
            out.extend_from_slice(&self.items);
        } else {
            for _ in 0..k {
                out.push(self.items[rng.below(self.items.len())]);
            }
        }
    }
}

/// Deterministic PRNG (splitmix64): the same announces give the same handouts, which
/// the simulator's reproducibility relies on.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn rack_key(t: &Topology) -> Option<(String, String)> {
    Some((t.zone.clone()?, t.rack.clone()?))
}

/// What a handout depends on besides the table.
pub(crate) struct Ask<'a> {
    pub node: &'a str,
    pub topology: &'a Topology,
    pub now: u64,
    pub ttl_ms: u64,
    pub bad: &'a HashMap<String, u64>,
    pub source: Option<&'a str>,
    pub max_peers: usize,
    /// What the requester holds (`None`: complete, or not said).
    pub have: Option<&'a Bitfield>,
    /// The announce interval: the window of the handout budget.
    pub window_ms: u64,
}

impl Ask<'_> {
    /// Alive, not reported bad, and not the requester (by its slot `me` when known:
    /// comparing names is most of a handout's cost in a 10,000-peer swarm).
    fn usable_at(&self, p: &PeerEntry, s: u32, me: Option<u32>) -> bool {
        let not_me = match me {
            Some(me) => s != me,
            None => p.name != self.node,
        };
        not_me && self.alive_and_trusted(p)
    }

    fn usable(&self, p: &PeerEntry) -> bool {
        p.name != self.node && self.alive_and_trusted(p)
    }

    fn alive_and_trusted(&self, p: &PeerEntry) -> bool {
        self.now.saturating_sub(p.last_seen) <= self.ttl_ms
            && (self.bad.is_empty() || !self.bad.contains_key(&p.name))
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct PeerTable {
    slots: Vec<Option<PeerEntry>>,
    free: Vec<u32>,
    by_name: HashMap<String, u32>,
    /// Every member (the name is historical: members that hold nothing yet are in
    /// it too, and only large swarms leave them out of handouts).
    givers: Bucket,
    complete: Bucket,
    racks: HashMap<(String, String), Bucket>,
    zones: HashMap<String, Bucket>,
    /// Incomplete givers, most pieces first.
    ranked: BTreeSet<(Reverse<u32>, u32)>,
    /// Per slot: handouts naming the peer in the current window (large swarms only),
    /// as (window, count). A `Cell` because handing out is a read of the table.
    exposure: Vec<Cell<(u64, u32)>>,
}

impl PeerTable {
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    pub fn get(&self, name: &str) -> Option<&PeerEntry> {
        let s = *self.by_name.get(name)?;
        self.slots.get(s as usize)?.as_ref()
    }

    /// Every peer, in slot order (deterministic).
    pub fn iter(&self) -> impl Iterator<Item = &PeerEntry> {
        self.slots.iter().flatten()
    }

    pub fn upsert(&mut self, e: PeerEntry) {
        // The common case, a peer reporting progress: only its rank changes.
        if let Some(&s) = self.by_name.get(&e.name) {
            if let Some(old) = self.slots[s as usize].as_mut() {
                let same_buckets = old.topology == e.topology
                    && old.complete == e.complete
                    && (old.held > 0) == (e.held > 0);
                if same_buckets {
                    if !e.complete && e.held > 0 && old.held != e.held {
                        self.ranked.remove(&(Reverse(old.held), s));
                        self.ranked.insert((Reverse(e.held), s));
                    }
                    *old = e;
                    return;
                }
            }
        }
        let s = match self.by_name.get(&e.name) {
            Some(&s) => {
                self.unindex(s);
                s
            }
            None => {
                let s = self.free.pop().unwrap_or(self.slots.len() as u32);
                if s as usize == self.slots.len() {
                    self.slots.push(None);
                    self.exposure.push(Cell::new((0, 0)));
                }
                self.exposure[s as usize].set((0, 0));
                self.by_name.insert(e.name.clone(), s);
                s
            }
        };
        self.slots[s as usize] = Some(e);
        self.index(s);
    }

    pub fn remove(&mut self, name: &str) {
        if let Some(s) = self.by_name.remove(name) {
            self.unindex(s);
            self.slots[s as usize] = None;
            self.free.push(s);
        }
    }

    /// Keeps the peers for which `keep` holds.
    pub fn retain(&mut self, mut keep: impl FnMut(&PeerEntry) -> bool) {
        let gone: Vec<String> = self
            .iter()
            .filter(|p| !keep(p))
            .map(|p| p.name.clone())
            .collect();
        for n in gone {
            self.remove(&n);
        }
    }

    fn index(&mut self, s: u32) {
        let Some(e) = self.slots[s as usize].as_ref() else {
            return;
        };
        // Every member is indexed, also one holding nothing yet: pieces now travel
        // between connected peers as they complete (HAVE), so a peer that is
        // downloading is worth connecting to before it holds anything.
        self.givers.insert(s);
        if e.complete {
            self.complete.insert(s);
        } else if e.held > 0 {
            self.ranked.insert((Reverse(e.held), s));
        }
        if let Some(k) = rack_key(&e.topology) {
            self.racks.entry(k).or_default().insert(s);
        }
        if let Some(z) = &e.topology.zone {
            self.zones.entry(z.clone()).or_default().insert(s);
        }
    }

    fn unindex(&mut self, s: u32) {
        let Some(e) = self.slots[s as usize].as_ref() else {
            return;
        };
        self.givers.remove(s);
        self.complete.remove(s);
        self.ranked.remove(&(Reverse(e.held), s));
        if let Some(k) = rack_key(&e.topology) {
            if let Some(b) = self.racks.get_mut(&k) {
                b.remove(s);
                if b.items.is_empty() {
                    self.racks.remove(&k);
                }
            }
        }
        if let Some(z) = &e.topology.zone {
            if let Some(b) = self.zones.get_mut(z) {
                b.remove(s);
                if b.items.is_empty() {
                    self.zones.remove(z);
                }
            }
        }
    }

    /// The alive, incomplete members of a rack (names), for rack stripes.
    pub fn rack_members<'a>(
        &'a self,
        topology: &Topology,
        alive: impl Fn(&PeerEntry) -> bool + 'a,
    ) -> Vec<&'a str> {
        rack_key(topology)
            .and_then(|k| self.racks.get(&k))
            .map(|b| {
                b.items
                    .iter()
                    .filter_map(|&s| self.slots[s as usize].as_ref())
                    .filter(|p| !p.complete && alive(p))
                    .map(|p| p.name.as_str())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Whether some usable peer other than the requester holds the whole blob.
    pub fn any_complete(&self, ask: &Ask) -> bool {
        self.complete
            .items
            .iter()
            .filter_map(|&s| self.slots[s as usize].as_ref())
            .any(|p| ask.usable(p))
    }

    /// More members than [`EXACT_POOL`]: handouts spread the load (see `handout`).
    pub fn is_large(&self) -> bool {
        self.by_name.len() > EXACT_POOL
    }

    /// The peers to hand to `ask.node`, nearest first.
    pub fn handout(&self, ask: &Ask) -> Vec<&PeerEntry> {
        let mut pool: Vec<u32> = Vec::new();
        let mut withheld = None;
        let me = self.by_name.get(ask.node).copied();
        if self.givers.items.len() <= EXACT_POOL {
            pool.extend_from_slice(&self.givers.items);
        } else {
            let k = (4 * ask.max_peers).max(16);
            let mut rng = SplitMix(spread(ask.node, "") ^ ask.now.rotate_left(17));
            if let Some(b) = rack_key(ask.topology).and_then(|r| self.racks.get(&r)) {
                b.sample(k, &mut rng, &mut pool);
            }
            if let Some(b) = ask.topology.zone.as_ref().and_then(|z| self.zones.get(z)) {
                b.sample(k, &mut rng, &mut pool);
            }
            self.complete.sample(k, &mut rng, &mut pool);
            self.givers.sample(k, &mut rng, &mut pool);
            // The most complete partial peers; stale entries are skipped, within bounds.
            // In a large swarm, `k` drawn from the top `4k`: the same `k` for every
            // requester would be in every view.
            let mut top: Vec<u32> = self
                .ranked
                .iter()
                .take(4 * k)
                .map(|&(_, s)| s)
                .filter(|&s| {
                    self.slots[s as usize]
                        .as_ref()
                        .is_some_and(|p| ask.usable_at(p, s, me))
                })
                .collect();
            if self.is_large() && top.len() > k {
                for i in 0..k {
                    let j = i + rng.below(top.len() - i);
                    top.swap(i, j);
                }
            }
            pool.extend(top.into_iter().take(k));
            if let Some(&s) = ask.source.and_then(|n| self.by_name.get(n)) {
                pool.push(s);
            }
            pool.sort_unstable();
            pool.dedup();
        }
        // A large swarm: the source is the one holder of the freshest pieces, and its
        // uplink serves a few peers at a time. It goes into about 64 handouts per round
        // of announces (plus its own rack's), not into each of thousands, which would
        // only earn it thousands of refused requests per second.
        let large = self.is_large();
        if large {
            let k = (4 * ask.max_peers).max(16);
            let lottery = (self.by_name.len() / k).max(1) as u64;
            if let Some(&s) = ask.source.and_then(|n| self.by_name.get(n)) {
                let near = self.slots[s as usize]
                    .as_ref()
                    .is_some_and(|p| ask.topology.distance(&p.topology) == 0);
                let mut draw = SplitMix(spread(ask.node, "source") ^ ask.now);
                if !near && !draw.next().is_multiple_of(lottery) {
                    withheld = Some(s);
                    pool.retain(|&x| x != s);
                }
            }
        }
        let cands: Vec<(u32, &PeerEntry)> = pool
            .into_iter()
            .filter_map(|s| Some((s, self.slots[s as usize].as_ref()?)))
            .filter(|&(s, p)| (p.held > 0 || !large) && ask.usable_at(p, s, me))
            .collect();
        let exposure = large.then_some(&self.exposure[..]);
        if withheld.is_some() {
            return rank(
                &Ask {
                    source: None,
                    ..*ask
                },
                &cands,
                exposure,
            );
        }
        rank(ask, &cands, exposure)
    }
}

/// The ranked policy over `cands`.
///
/// Small swarms: near first, then the most complete; the far quarter goes to the most
/// complete anywhere. Large swarms (`spread_load`): every requester would get the same
/// few most complete peers and refuse-storm them, and peers with nothing this
/// requester lacks would take its slots. So candidates are ranked by what they can
/// give it (pieces it lacks, in doublings; those with nothing are left out), peers
/// already named in many handouts this announce interval go last, and ties go by a
/// hash of requester, peer and moment, so the load spreads and each announce shows
/// other holders. The far quarter then ignores distance.
fn rank<'a>(
    ask: &Ask,
    cands: &[(u32, &'a PeerEntry)],
    exposure: Option<&[Cell<(u64, u32)>]>,
) -> Vec<&'a PeerEntry> {
    let max = ask.max_peers;
    let spread_load = exposure.is_some();
    // Handouts per peer per window of one announce interval: on average each peer is
    // named `max_peers` times per window; one named more than twice that goes behind
    // every peer that is not (at its distance), so the few holders of the freshest
    // pieces, who can serve a handful of peers at a time, are not in every view.
    let window = ask.now / ask.window_ms.max(1);
    let budget = 2 * max as u32;
    let over = |i: usize| -> bool {
        exposure.is_some_and(|e| {
            let (w, n) = e[cands[i].0 as usize].get();
            w == window && n >= budget
        })
    };
    let missing = ask.have.map(|h| (h.len() - h.count()) as u64);
    let gives = |p: &PeerEntry| -> u64 {
        match (ask.have, &p.have, missing) {
            (Some(mine), Some(theirs), _) if !p.complete => theirs.count_not_in(mine) as u64,
            (_, _, Some(m)) if p.complete => m,
            _ => p.held as u64,
        }
    };
    let given: Vec<u64> = if spread_load {
        cands.iter().map(|(_, p)| gives(p)).collect()
    } else {
        Vec::new()
    };
    let salted = if spread_load {
        spread_prefix(&format!("{}@{}", ask.node, ask.now))
    } else {
        spread_prefix(ask.node)
    };
    let worth = |i: usize| -> u64 {
        if spread_load {
            // Doublings: 1, 2–3, 4–7, ... pieces to give rank alike.
            u64::from(64 - given[i].leading_zeros())
        } else {
            cands[i].1.held as u64
        }
    };
    let ask_zone = zone_key(ask.topology);
    let near_key = |i: usize| {
        let (s, p) = cands[i];
        (
            distance_keyed(ask.topology, ask_zone, p),
            over(i),
            Reverse(worth(i)),
            spread_from(salted, &p.name),
            s,
        )
    };
    let near_slots = (max * 3).div_ceil(4);
    let mut by_near: Vec<_> = (0..cands.len())
        .filter(|&i| !spread_load || given[i] > 0)
        .map(|i| (near_key(i), i))
        .collect();
    let take_near = near_slots.min(by_near.len());
    if take_near > 0 && take_near < by_near.len() {
        by_near.select_nth_unstable(take_near - 1);
    }
    let mut chosen: Vec<usize> = by_near[..take_near].iter().map(|k| k.1).collect();
    let mut rest: Vec<_> = by_near[take_near..]
        .iter()
        .map(|((d, o, h, sp, s), i)| {
            let d = if spread_load { 0 } else { *d };
            ((*o, *h, d, *sp, *s), *i)
        })
        .collect();
    let take_far = max.saturating_sub(take_near).min(rest.len());
    if take_far > 0 && take_far < rest.len() {
        rest.select_nth_unstable(take_far - 1);
    }
    // The farthest-ranked far pick goes first if the source must make room.
    rest[..take_far].sort_unstable();
    chosen.extend(rest[..take_far].iter().map(|k| k.1));
    if let Some(src) = ask.source {
        if let Some(i) = cands.iter().position(|(_, p)| p.name == src) {
            if !chosen.contains(&i) {
                if chosen.len() >= max {
                    chosen.pop();
                }
                chosen.push(i);
            }
        }
    }
    // Each key compares topologies and hashes a name: computed once per peer.
    chosen.sort_by_cached_key(|&i| near_key(i));
    if let Some(e) = exposure {
        for &i in &chosen {
            let cell = &e[cands[i].0 as usize];
            let (w, n) = cell.get();
            cell.set(if w == window { (w, n + 1) } else { (window, 1) });
        }
    }
    chosen.into_iter().map(|i| cands[i].1).collect()
}

pub(crate) fn spread(a: &str, b: &str) -> u64 {
    spread_from(spread_prefix(a), b)
}

/// FNV-1a of `a` and its separator, to continue with many `b`s.
fn spread_prefix(a: &str) -> u64 {
    // FNV-1a of the pair: deterministic, different for each requester.
    let mut h: u64 = 0xcbf29ce484222325;
    for byte in a.bytes().chain([0]) {
        h ^= byte as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

fn spread_from(mut h: u64, b: &str) -> u64 {
    for byte in b.bytes() {
        h ^= byte as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The zone keys only skip comparisons: every pair of topologies gets the
    /// distance `Topology::distance` gives.
    #[test]
    fn keyed_distances_are_the_topologies_distances() {
        let names = [None, Some("z1"), Some("z2"), Some("")];
        let racks = [None, Some("r1"), Some("r2")];
        let mut all = Vec::new();
        for z in names {
            for r in racks {
                all.push(Topology {
                    zone: z.map(str::to_owned),
                    rack: r.map(str::to_owned),
                });
            }
        }
        for a in &all {
            for b in &all {
                let entry = PeerEntry::new("n", "addr", b, None, false, 0);
                assert_eq!(
                    distance_keyed(a, zone_key(a), &entry),
                    a.distance(b),
                    "{a:?} to {b:?}"
                );
            }
        }
        let z1 = |rack: &str| Topology {
            zone: Some("z1".into()),
            rack: Some(rack.into()),
        };
        let entry = PeerEntry::new("n", "addr", &z1("r1"), None, false, 0);
        assert_eq!(distance_keyed(&z1("r1"), zone_key(&z1("r1")), &entry), 0);
        assert_eq!(distance_keyed(&z1("r2"), zone_key(&z1("r2")), &entry), 1);
    }
}
