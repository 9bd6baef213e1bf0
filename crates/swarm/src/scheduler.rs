//! The agent's piece scheduler: which missing piece to ask which peer for next.
//!
//! Policy: pieces at the read head (the first few missing ones) first, so bytes stream
//! to the runtime in order; otherwise rarest first, ties by index. Each peer gets a few
//! requests in flight; near peers and idle peers are preferred. When every missing
//! piece is already requested and few remain (endgame), pieces are also asked of a
//! second peer so one slow peer cannot hold up the tail. Peers that served a corrupt
//! piece are banned.

use std::collections::BTreeMap;

use crate::Bitfield;

pub type PeerId = String;

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub max_inflight_per_peer: u32,
    pub max_inflight_total: u32,
    /// Missing pieces at the read head that outrank rarity.
    pub read_head: u32,
    /// Endgame starts when at most this many pieces are missing.
    pub endgame: u32,
    /// Per-node seed for ordering pieces of equal rarity. Nodes that start together
    /// would otherwise all ask the source for the same piece; with distinct orders
    /// each gets different pieces first and they trade them among themselves.
    pub seed: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_inflight_per_peer: 3,
            max_inflight_total: 12,
            read_head: 1,
            endgame: 2,
            seed: 0,
        }
    }
}

#[derive(Clone, Debug)]
struct Slot {
    /// `None`: the peer has every piece.
    have: Option<Bitfield>,
    distance: u8,
    inflight: u32,
    banned: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub piece: u32,
    pub peer: PeerId,
}

#[derive(Clone, Debug)]
pub struct PieceScheduler {
    cfg: SchedulerConfig,
    have: Bitfield,
    /// Per piece, the peers it is requested from (empty: not in flight). A vector by
    /// piece index, not a map: this is looked up for every piece on every scheduling
    /// pass, millions of times in a simulated 10,000-node swarm.
    inflight: Vec<Vec<PeerId>>,
    peers: BTreeMap<PeerId, Slot>,
}

impl PieceScheduler {
    pub fn new(have: Bitfield, cfg: SchedulerConfig) -> Self {
        Self {
            cfg,
            inflight: vec![Vec::new(); have.len() as usize],
            have,
            peers: BTreeMap::new(),
        }
    }

    pub fn have(&self) -> &Bitfield {
        &self.have
    }

    pub fn is_complete(&self) -> bool {
        self.have.is_complete()
    }

    /// Adds or updates a peer; `have = None` means it holds everything.
    pub fn set_peer(&mut self, id: &str, have: Option<Bitfield>, distance: u8) {
        // Looked up before inserting: every announce re-sets every known peer, and
        // `entry` would allocate the id each time.
        if let Some(slot) = self.peers.get_mut(id) {
            slot.have = have;
            slot.distance = distance;
            return;
        }
        self.peers.insert(
            id.to_owned(),
            Slot {
                have,
                distance,
                inflight: 0,
                banned: false,
            },
        );
    }

    pub fn remove_peer(&mut self, id: &str) {
        self.peers.remove(id);
    }

    pub fn is_banned(&self, id: &str) -> bool {
        self.peers.get(id).is_some_and(|s| s.banned)
    }

    fn holds(slot: &Slot, piece: u32) -> bool {
        !slot.banned && slot.have.as_ref().is_none_or(|h| h.get(piece))
    }

    /// Pieces neither held nor in flight that no usable peer holds.
    pub fn orphans(&self) -> Vec<u32> {
        (0..self.have.len())
            .filter(|&i| {
                !self.have.get(i)
                    && !self.is_inflight(i)
                    && !self.peers.values().any(|s| Self::holds(s, i))
            })
            .collect()
    }

    pub fn inflight_count(&self) -> u32 {
        self.peers.values().map(|s| s.inflight).sum()
    }

    /// The next requests to issue, already counted as in flight.
    pub fn next_requests(&mut self) -> Vec<Request> {
        let mut out = Vec::new();
        // Sized up front: growing these vectors (`collect` from a filter) cost more than
        // the ranking itself in a simulated 10,000-node swarm.
        let mut missing = Vec::with_capacity((self.have.len() - self.have.count()) as usize);
        missing.extend((0..self.have.len()).filter(|&i| !self.have.get(i)));
        if missing.is_empty() {
            return out;
        }
        // Counted once and kept up to date: this runs after every piece event, and in a
        // simulated 10,000-node swarm millions of times.
        let mut inflight = self.inflight_count();
        // With the blob's cap reached, or no peer able to take another request, no
        // candidate can be assigned: skip ranking them (same result, far cheaper when a
        // swarm refuses most requests).
        let max_per_peer = self.cfg.max_inflight_per_peer;
        let can_assign = inflight < self.cfg.max_inflight_total
            && self
                .peers
                .values()
                .any(|s| !s.banned && s.inflight < max_per_peer);
        let mut candidates: Vec<(u32, usize)> = Vec::new();
        if can_assign {
            candidates = self.rank(&missing);
        }
        for (piece, _) in candidates {
            if inflight >= self.cfg.max_inflight_total {
                break;
            }
            if let Some(peer) = self.pick_peer(piece, &[]) {
                self.assign(piece, &peer);
                inflight += 1;
                out.push(Request { piece, peer });
            }
        }
        // Endgame: duplicate the remaining in-flight pieces on another peer.
        if missing.len() as u32 <= self.cfg.endgame && missing.iter().all(|&i| self.is_inflight(i))
        {
            for &piece in &missing {
                if self.requested_from(piece).len() >= 2 {
                    continue;
                }
                let busy = self.requested_from(piece).to_vec();
                if let Some(peer) = self.pick_peer(piece, &busy) {
                    self.assign(piece, &peer);
                    out.push(Request { piece, peer });
                }
            }
        }
        out
    }

    /// Missing pieces not in flight that some usable peer holds, read head first, then
    /// rarest first, ties in this node's seeded order.
    fn rank(&self, missing: &[u32]) -> Vec<(u32, usize)> {
        let mut open = Vec::with_capacity(missing.len());
        open.extend(missing.iter().copied().filter(|&i| !self.is_inflight(i)));
        // Holders per open piece in one pass over the peers (not one per piece): peers
        // holding everything count for all of them.
        let mut holders = vec![0usize; open.len()];
        let mut everyone = 0usize;
        for slot in self.peers.values().filter(|s| !s.banned) {
            match &slot.have {
                None => everyone += 1,
                Some(h) => {
                    for (n, &i) in holders.iter_mut().zip(&open) {
                        *n += usize::from(h.get(i));
                    }
                }
            }
        }
        let read_head = self.cfg.read_head as usize;
        let seed = self.cfg.seed;
        let mut keyed: Vec<((bool, usize, u64), u32)> = Vec::with_capacity(open.len());
        keyed.extend(
            open.iter()
                .zip(&holders)
                .map(|(&i, &n)| (i, n + everyone))
                .filter(|&(_, n)| n > 0)
                .map(|(i, n)| {
                    let head = missing[..read_head.min(missing.len())].contains(&i);
                    ((!head, n, mix(seed, i)), i)
                }),
        );
        // `mix` is a bijection of the piece index, so keys are distinct and an unstable
        // sort gives the one order.
        keyed.sort_unstable_by_key(|&(k, _)| k);
        keyed.into_iter().map(|((_, n, _), i)| (i, n)).collect()
    }

    fn pick_peer(&self, piece: u32, exclude: &[PeerId]) -> Option<PeerId> {
        self.peers
            .iter()
            .filter(|(id, s)| {
                Self::holds(s, piece)
                    && s.inflight < self.cfg.max_inflight_per_peer
                    && !exclude.contains(id)
            })
            // Idle before busy, near before far; complete peers (seeds) after partial
            // ones at equal load, so seeds are not the only uploaders. Peers iterate in
            // id order, so the first minimum is the one with the smallest id.
            .min_by_key(|(_, s)| (s.inflight, s.distance, s.have.is_none()))
            .map(|(id, _)| id.clone())
    }

    fn assign(&mut self, piece: u32, peer: &str) {
        if let Some(v) = self.inflight.get_mut(piece as usize) {
            v.push(peer.to_owned());
        }
        if let Some(s) = self.peers.get_mut(peer) {
            s.inflight += 1;
        }
    }

    fn release(&mut self, piece: u32, peer: &str) {
        if let Some(v) = self.inflight.get_mut(piece as usize) {
            v.retain(|p| p != peer);
            if v.is_empty() {
                // Give the memory back: 10,000 simulated schedulers keep these.
                *v = Vec::new();
            }
        }
        if let Some(s) = self.peers.get_mut(peer) {
            s.inflight = s.inflight.saturating_sub(1);
        }
    }

    fn requested_from(&self, piece: u32) -> &[PeerId] {
        self.inflight.get(piece as usize).map_or(&[], |v| v)
    }

    /// A verified piece arrived from `peer` (or from anywhere: `peer` may be unknown).
    /// Returns `true` if it was new.
    pub fn on_done(&mut self, piece: u32, peer: &str) -> bool {
        self.release(piece, peer);
        let new = !self.have.get(piece);
        self.have.set(piece);
        new
    }

    /// A request failed. `corrupt` bans the peer: it served bytes that fail the hash.
    pub fn on_failed(&mut self, piece: u32, peer: &str, corrupt: bool) {
        self.release(piece, peer);
        if corrupt {
            if let Some(s) = self.peers.get_mut(peer) {
                s.banned = true;
            }
        }
    }

    /// Marks a piece as being produced elsewhere (e.g. the registry stream).
    pub fn claim(&mut self, piece: u32, by: &str) {
        if !self.have.get(piece) && !self.is_inflight(piece) {
            if let Some(v) = self.inflight.get_mut(piece as usize) {
                v.push(by.to_owned());
            }
        }
    }

    pub fn is_inflight(&self, piece: u32) -> bool {
        self.inflight
            .get(piece as usize)
            .is_some_and(|v| !v.is_empty())
    }
}

/// A cheap bijective mix of (seed, piece) for per-node piece orders (splitmix64).
fn mix(seed: u64, i: u32) -> u64 {
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

    fn bits(len: u32, ones: &[u32]) -> Bitfield {
        let mut b = Bitfield::new(len);
        for &i in ones {
            b.set(i);
        }
        b
    }

    #[test]
    fn read_head_then_rarest_first_with_per_peer_limits() {
        let mut s = PieceScheduler::new(
            Bitfield::new(8),
            SchedulerConfig {
                max_inflight_per_peer: 2,
                max_inflight_total: 10,
                read_head: 1,
                endgame: 0,
                seed: 0,
            },
        );
        s.set_peer("a", None, 2);
        s.set_peer("b", Some(bits(8, &[0, 1, 2, 3])), 0);
        s.set_peer("c", Some(bits(8, &[0, 1, 2, 3])), 0);
        let reqs = s.next_requests();
        // Piece 0 (read head) first; then pieces 4..7 held only by `a` are rarest.
        assert_eq!(reqs[0].piece, 0);
        let pieces: Vec<u32> = reqs.iter().map(|r| r.piece).collect();
        assert_eq!(pieces.len(), 6, "3 peers × 2 in flight");
        assert_eq!(reqs.iter().filter(|r| r.peer == "a").count(), 2);
        assert!(
            reqs.iter().filter(|r| r.peer == "a").all(|r| r.piece >= 4),
            "the only holder of rare pieces serves rare pieces"
        );
    }

    #[test]
    fn nodes_starting_together_ask_the_source_for_different_pieces() {
        let firsts: std::collections::HashSet<u32> = (0..8)
            .map(|n| {
                let cfg = SchedulerConfig {
                    read_head: 0,
                    max_inflight_per_peer: 1,
                    seed: seed_for(&format!("node-{n}")),
                    ..Default::default()
                };
                let mut s = PieceScheduler::new(Bitfield::new(64), cfg);
                s.set_peer("source", None, 0);
                s.next_requests()[0].piece
            })
            .collect();
        assert!(
            firsts.len() >= 6,
            "8 nodes should mostly start on different pieces: {firsts:?}"
        );
    }

    #[test]
    fn corrupt_peer_is_banned_and_orphans_are_reported() {
        let mut s = PieceScheduler::new(Bitfield::new(3), SchedulerConfig::default());
        s.set_peer("liar", None, 0);
        let r = s.next_requests();
        assert_eq!(r.len(), 3);
        s.on_failed(0, "liar", true);
        assert!(s.is_banned("liar"));
        assert!(s.next_requests().is_empty());
        assert_eq!(s.orphans(), vec![0]);
        s.set_peer("good", Some(bits(3, &[0])), 1);
        assert_eq!(
            s.next_requests(),
            vec![Request {
                piece: 0,
                peer: "good".into()
            }]
        );
        assert!(s.on_done(0, "good"));
        assert!(!s.on_done(0, "good"));
    }

    #[test]
    fn endgame_asks_a_second_peer_for_the_tail() {
        let mut s = PieceScheduler::new(
            bits(4, &[0, 1, 2]),
            SchedulerConfig {
                endgame: 2,
                ..Default::default()
            },
        );
        s.set_peer("slow", None, 0);
        s.set_peer("fast", None, 1);
        let r = s.next_requests();
        assert_eq!(
            r.len(),
            2,
            "first request plus its endgame duplicate: {r:?}"
        );
        assert_ne!(r[0].peer, r[1].peer);
        assert!(r.iter().all(|x| x.piece == 3));
        assert!(s.on_done(3, &r[1].peer));
        assert!(s.is_complete());
    }

    /// The ranking as first written (one pass over the peers per piece, a stable
    /// sort), kept to check that the faster `rank` orders identically.
    fn reference_rank(s: &PieceScheduler, missing: &[u32]) -> Vec<(u32, usize)> {
        let head: Vec<u32> = missing
            .iter()
            .copied()
            .take(s.cfg.read_head as usize)
            .collect();
        let mut c: Vec<(u32, usize)> = missing
            .iter()
            .copied()
            .filter(|&i| !s.is_inflight(i))
            .map(|i| {
                (
                    i,
                    s.peers
                        .values()
                        .filter(|p| PieceScheduler::holds(p, i))
                        .count(),
                )
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        c.sort_by_key(|&(i, n)| (!head.contains(&i), n, mix(s.cfg.seed, i)));
        c
    }

    #[test]
    fn rank_matches_the_reference_on_random_swarms() {
        let mut rng = 0x1234_5678_9abc_def0u64;
        let mut next = |m: u64| {
            rng = mix(rng, 7);
            rng % m
        };
        for round in 0..500 {
            let len = 1 + next(80) as u32;
            let mut have = Bitfield::new(len);
            for i in 0..len {
                if next(3) == 0 {
                    have.set(i);
                }
            }
            let mut s = PieceScheduler::new(
                have,
                SchedulerConfig {
                    read_head: next(3) as u32,
                    seed: round,
                    ..Default::default()
                },
            );
            for p in 0..next(20) {
                let bf = (next(4) > 0).then(|| {
                    let mut b = Bitfield::new(len);
                    for i in 0..len {
                        if next(2) == 0 {
                            b.set(i);
                        }
                    }
                    b
                });
                s.set_peer(&format!("p{p}"), bf, next(3) as u8);
                if next(8) == 0 {
                    s.on_failed(0, &format!("p{p}"), true);
                }
            }
            for i in 0..len {
                if next(6) == 0 {
                    s.claim(i, "registry");
                }
            }
            let missing: Vec<u32> = (0..len).filter(|&i| !s.have.get(i)).collect();
            assert_eq!(
                s.rank(&missing),
                reference_rank(&s, &missing),
                "round {round}"
            );
        }
    }
}
