//! The tracker's soft state: per blob, who holds which pieces, who fetches from the
//! registry, the piece hashes, and which peers to hand out. Time is passed in (ms) so
//! the simulator can drive it.

use std::collections::{BTreeMap, HashMap};

use oci::Digest;
use serde::Serialize;

use crate::peers::{spread, Ask, PeerEntry, PeerTable};
use crate::pieces::{piece_size_for, validate_geometry, PieceHash, MAX_BLOB_SIZE, MAX_PIECES};
use crate::protocol::{
    AnnounceRequest, AnnounceResponse, PeerInfo, Role, SOURCE_STRIPE_MAX_MEMBERS,
};
use crate::{Bitfield, Error};

mod replica;
pub use replica::{SharedPeer, SharedSwarm};

#[derive(Clone, Debug)]
pub struct SwarmConfig {
    /// A peer not heard from for this long is not handed out (and a source is replaced).
    pub peer_ttl_ms: u64,
    pub max_peers: usize,
    /// Blobs smaller than this skip P2P. A swarm blob costs a tracker round trip and a
    /// piece round trip before its first byte (a few ms on a LAN), while every byte it
    /// keeps off the registry is worth N−1 registry transfers; in the 16-node benchmark
    /// a 2 MiB code layer below a 4 MiB threshold alone added 6 % registry egress. So
    /// the default is 1 MiB (Dragonfly uses 4 MiB); below it the piece machinery's
    /// per-blob overhead dominates.
    pub min_p2p_size: u64,
    /// The piece size for announces that propose none (the agents propose one from
    /// their link, `pieces::piece_size_for`); `None`: the rule with an unknown link.
    pub piece_size: Option<u64>,
    /// How long a peer reported (bad pieces, or unreachable) is left out.
    pub bad_peer_ms: u64,
    /// Distinct reporters after which a peer is left out of everyone's handouts, not
    /// only the reporters': one member cannot ban an honest peer cluster-wide.
    pub bad_peer_quorum: usize,
    /// How often a downloading agent announces. Piece availability travels between
    /// connected peers as it happens (HAVE), so this only refreshes membership, the
    /// tracker's view for handouts, and hashes for peers not connected to the source.
    pub announce_interval_ms: u64,
    /// Swarms with at least this many members get rack stripes.
    pub stripe_min_members: usize,
    /// A node already fetching another blob from the registry is elected source of a
    /// new blob only if nobody else asks for it within this long: sources spread over
    /// nodes, so registry bytes enter the swarm through several links, not one.
    pub source_defer_ms: u64,
}

/// In a large swarm, a member that holds nothing of the blob yet is asked to announce
/// this many times more often than [`SwarmConfig::announce_interval_ms`] (see
/// `TrackerState::announce`). It costs the tracker about 6-12 % more announces.
pub const EMPTY_HANDED_ANNOUNCE_DIVISOR: u64 = 4;

impl Default for SwarmConfig {
    fn default() -> Self {
        Self {
            peer_ttl_ms: 5_000,
            max_peers: 16,
            min_p2p_size: 1 << 20,
            piece_size: None,
            bad_peer_ms: 60_000,
            bad_peer_quorum: 3,
            announce_interval_ms: 1_000,
            stripe_min_members: 64,
            source_defer_ms: 100,
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Swarm {
    size: Option<u64>,
    piece_size: u64,
    hashes: BTreeMap<u32, PieceHash>,
    source: Option<String>,
    peers: PeerTable,
    /// Accused peer → (reporter, until).
    bad: HashMap<String, Vec<(String, u64)>>,
    /// Times a source was elected: 1 means the registry was asked once.
    elections: u32,
    /// Who was elected (the first few), for reports.
    elected: Vec<String>,
    /// When the swarm was first announced (ms).
    born: u64,
}

impl Swarm {
    fn count(&self) -> u32 {
        match self.size {
            Some(s) if self.piece_size > 0 => crate::PieceLayout::new(s, self.piece_size).count(),
            _ => 0,
        }
    }

    /// Peers this requester must not be handed: those it reported, and those a quorum
    /// of distinct members reported.
    fn bad_for(&self, requester: &str, quorum: usize, now: u64) -> HashMap<String, u64> {
        self.bad
            .iter()
            .filter_map(|(accused, reports)| {
                let live: Vec<&(String, u64)> =
                    reports.iter().filter(|(_, until)| *until > now).collect();
                let mine = live.iter().find(|(r, _)| r == requester).map(|(_, u)| *u);
                let quorum_until = (live.len() >= quorum)
                    .then(|| live.iter().map(|(_, u)| *u).max().unwrap_or(now));
                mine.or(quorum_until).map(|u| (accused.clone(), u))
            })
            .collect()
    }
}

#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct SwarmStats {
    pub digest: String,
    pub size: Option<u64>,
    pub piece_size: u64,
    /// The agents elected to fetch from the registry (at most 8).
    pub elected: Vec<String>,
    pub peers: usize,
    pub complete: usize,
    pub source: Option<String>,
    pub source_elections: u32,
}

#[derive(Default)]
pub struct TrackerState {
    pub cfg: SwarmConfig,
    swarms: HashMap<Digest, Swarm>,
}

/// Reporters remembered per accused peer.
const MAX_REPORTERS: usize = 16;

impl TrackerState {
    pub fn new(cfg: SwarmConfig) -> Self {
        Self {
            cfg,
            swarms: HashMap::new(),
        }
    }

    fn alive(&self, p: &PeerEntry, now: u64) -> bool {
        now.saturating_sub(p.last_seen) <= self.cfg.peer_ttl_ms
    }

    /// Checks what an announce claims before any of it is stored: a geometry every
    /// agent can live with, and hashes that are hashes.
    fn validate(req: &AnnounceRequest) -> Result<(), Error> {
        if let Some(size) = req.size {
            if size > MAX_BLOB_SIZE {
                return Err(Error::Geometry(format!(
                    "blob size {size} exceeds {MAX_BLOB_SIZE}"
                )));
            }
            if let Some(p) = req.piece_size {
                validate_geometry(size, p)?;
            }
        } else if let Some(p) = req.piece_size {
            validate_geometry(0, p)?;
        }
        if req.hashes.len() > MAX_PIECES as usize {
            return Err(Error::Announce(format!("{} hashes", req.hashes.len())));
        }
        if req.bad_peers.len() > 64 {
            return Err(Error::Announce(format!(
                "{} bad peers",
                req.bad_peers.len()
            )));
        }
        if req.node.is_empty() || req.node.len() > 253 {
            return Err(Error::Announce("node name must be 1 to 253 bytes".into()));
        }
        Ok(())
    }

    pub fn announce(&mut self, req: &AnnounceRequest, now: u64) -> Result<AnnounceResponse, Error> {
        Self::validate(req)?;
        // The first size of a swarm must fit the piece size an earlier announce
        // without a size fixed: 1 TiB in 64 KiB pieces is 2^24 pieces, and every
        // handout would carry 2 MiB bitfields (found by the announce property test).
        // Refused before anything is stored, like any other invalid geometry.
        if let (Some(s), Some(size)) = (self.swarms.get(&req.digest), req.size) {
            if s.size.is_none() && s.piece_size != 0 {
                validate_geometry(size, s.piece_size)?;
            }
        }
        let cfg = self.cfg.clone();
        // Blobs this node is fetching from the registry right now (only counted when
        // this swarm needs a source: elections are rare, the count is a scan).
        let sourcing_elsewhere = if self
            .swarms
            .get(&req.digest)
            .is_none_or(|s| s.source.is_none())
        {
            self.swarms
                .iter()
                .filter(|(d, s)| {
                    *d != &req.digest
                        && s.source.as_deref() == Some(req.node.as_str())
                        && s.peers.get(&req.node).is_some_and(|p| {
                            !p.complete && now.saturating_sub(p.last_seen) <= cfg.peer_ttl_ms
                        })
                })
                .count()
        } else {
            0
        };
        let swarm = self
            .swarms
            .entry(req.digest.clone())
            .or_insert_with(|| Swarm {
                born: now,
                ..Swarm::default()
            });
        if let (Some(known), Some(said)) = (swarm.size, req.size) {
            if known != said {
                return Err(Error::Geometry(format!(
                    "blob is {known} bytes, announce says {said}"
                )));
            }
        }
        if swarm.size.is_none() {
            swarm.size = req.size;
        }
        if swarm.piece_size == 0 {
            swarm.piece_size = match (req.piece_size, swarm.size) {
                (Some(p), _) => p,
                (None, Some(s)) => cfg
                    .piece_size
                    .filter(|&p| validate_geometry(s, p).is_ok())
                    .unwrap_or_else(|| piece_size_for(s, None)),
                (None, None) => 0,
            };
        }
        let count = swarm.count();
        // A bitfield of another length says nothing about this swarm's pieces.
        let have = req.have.clone().filter(|h| h.len() == count);
        for accused in &req.bad_peers {
            if accused == &req.node {
                continue;
            }
            let reports = swarm.bad.entry(accused.clone()).or_default();
            reports.retain(|(r, until)| r != &req.node && *until > now);
            if reports.len() < MAX_REPORTERS {
                reports.push((req.node.clone(), now + cfg.bad_peer_ms));
            }
        }
        swarm.bad.retain(|_, reports| {
            reports.retain(|(_, until)| *until > now);
            !reports.is_empty()
        });
        // The source's last announce says "complete" and carries the hashes of the
        // pieces it read since its previous one: the election ends with this announce,
        // but those hashes are still the source's (peers that saw the pieces in a
        // bitfield rather than a HAVE have no other way to them but a seeder).
        let finishing_source =
            swarm.source.as_deref() == Some(&req.node) && req.complete && !req.leaving;
        if req.leaving {
            swarm.peers.remove(&req.node);
            if swarm.source.as_deref() == Some(&req.node) {
                swarm.source = None;
            }
        } else {
            swarm.peers.upsert(PeerEntry::new(
                &req.node,
                &req.addr,
                &req.topology,
                have.clone(),
                req.complete,
                now,
            ));
        }
        let source_alive = |s: &Swarm| {
            s.source
                .as_ref()
                .and_then(|n| s.peers.get(n))
                .is_some_and(|p| now.saturating_sub(p.last_seen) <= cfg.peer_ttl_ms && !p.complete)
        };
        if !source_alive(swarm) {
            swarm.source = None;
        }
        let bad = swarm.bad_for(&req.node, cfg.bad_peer_quorum, now);
        let ask = Ask {
            node: &req.node,
            topology: &req.topology,
            now,
            ttl_ms: cfg.peer_ttl_ms,
            bad: &bad,
            source: None,
            max_peers: cfg.max_peers,
            have: have.as_ref(),
            window_ms: cfg.announce_interval_ms,
        };
        let any_complete = swarm.peers.any_complete(&ask);
        let role = if req.leaving || req.complete {
            Role::Peer
        } else if swarm.size.is_some_and(|s| s < cfg.min_p2p_size) {
            Role::Direct
        } else if swarm.source.as_deref() == Some(&req.node) {
            Role::Source
        } else if swarm.source.is_none()
            && !req.fetching_from_registry
            && !any_complete
            && sourcing_elsewhere > 0
            && now < swarm.born + cfg.source_defer_ms
        {
            // Busy with another registry fetch: give another node the chance.
            Role::Peer
        } else if swarm.source.is_none() && (req.fetching_from_registry || !any_complete) {
            // Elect: the blob is not in the cluster (or its holders vanished mid-way).
            swarm.source = Some(req.node.clone());
            swarm.elections += 1;
            if swarm.elected.len() < 8 {
                swarm.elected.push(req.node.clone());
            }
            Role::Source
        } else {
            Role::Peer
        };
        // Hashes are kept only from the elected source: it read the bytes from the
        // registry. Whoever else sends hashes is ignored, first or not.
        if swarm.source.as_deref() == Some(&req.node) || finishing_source {
            for (i, h) in &req.hashes {
                if *i < count {
                    if let Ok(h) = PieceHash::from_hex(h) {
                        swarm.hashes.insert(*i, h);
                    }
                }
            }
        }
        let hashes = swarm
            .hashes
            .range(req.known_hashes..)
            .map(|(k, v)| (*k, v.to_hex()))
            .collect();
        let stripe = (swarm.peers.len() >= cfg.stripe_min_members && !req.complete)
            .then(|| {
                let ttl = cfg.peer_ttl_ms;
                let mut members = swarm
                    .peers
                    .rack_members(&req.topology, |p| now.saturating_sub(p.last_seen) <= ttl);
                if members.len() < 2 || !members.contains(&req.node.as_str()) {
                    return None;
                }
                members.sort_by_key(|n| (spread(n, "stripe"), *n));
                let at = members.iter().position(|n| *n == req.node)?;
                Some([at as u32, members.len() as u32])
            })
            .flatten();
        let source_stripe = swarm
            .source
            .as_deref()
            .filter(|&src| {
                src != req.node && !req.complete && swarm.peers.len() <= SOURCE_STRIPE_MAX_MEMBERS
            })
            .and_then(|src| {
                let ttl = cfg.peer_ttl_ms;
                let mut members: Vec<&str> = swarm
                    .peers
                    .iter()
                    .filter(|p| {
                        !p.complete && p.name != src && now.saturating_sub(p.last_seen) <= ttl
                    })
                    .map(|p| p.name.as_str())
                    .collect();
                if members.len() < 2 {
                    return None;
                }
                // Ranked per blob: small layers have few pieces, and the same low
                // stripes must not own the first pieces of every layer.
                let blob = req.digest.to_string();
                members.sort_by_key(|n| (spread(n, &blob), *n));
                let at = members.iter().position(|n| *n == req.node)?;
                Some([at as u32, members.len() as u32])
            });
        // Three quarters of the slots go to the nearest peers (then the most complete),
        // the rest to the most complete peers anywhere, and the live source always: a
        // rack full of empty peers must still reach the bytes (found by the simulator).
        let ask = Ask {
            source: swarm.source.as_deref(),
            ..ask
        };
        let peers = swarm
            .peers
            .handout(&ask)
            .into_iter()
            .map(|p| PeerInfo {
                node: p.name.clone(),
                addr: p.addr.clone(),
                topology: p.topology.clone(),
                have: if p.complete {
                    None
                } else {
                    Some(p.have.clone().unwrap_or_else(|| Bitfield::new(count)))
                },
            })
            .collect();
        // In a large swarm the handout holds only peers with something to give, and
        // a member's rack-mates are not among them until they hold a piece: a member
        // that holds nothing learns of the first holders near it only by announcing.
        // At the full interval that took 2-3 s before the first byte (simulator,
        // 1,000 and 10,000 nodes); asked back sooner, about 0.7-0.8 s. Members of
        // small swarms are handed everyone, and announcing more there only churned
        // their links (seed-100x5gb: 1.276 → 1.386 × T* for one seed).
        let empty_handed = swarm.peers.is_large()
            && role == Role::Peer
            && !req.complete
            && req.have.as_ref().is_none_or(|h| h.count() == 0);
        let interval_ms = if empty_handed {
            (cfg.announce_interval_ms / EMPTY_HANDED_ANNOUNCE_DIVISOR).max(50)
        } else {
            cfg.announce_interval_ms
        };
        Ok(AnnounceResponse {
            role,
            size: swarm.size,
            piece_size: swarm.piece_size.max(1),
            hashes,
            peers,
            source_alive: swarm.source.is_some(),
            source: swarm.source.clone(),
            interval_ms,
            stripe,
            source_stripe,
            members: swarm.peers.len().min(u32::MAX as usize) as u32,
        })
    }

    /// Piece hashes from `from` on, for a downloader holding pieces it cannot verify
    /// yet (it is not connected to the source).
    pub fn hashes(&self, d: &Digest, from: u32) -> BTreeMap<u32, String> {
        self.swarms
            .get(d)
            .map(|s| {
                s.hashes
                    .range(from..)
                    .map(|(k, v)| (*k, v.to_hex()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Drops peers not heard from within the TTL and empty swarms.
    pub fn expire(&mut self, now: u64) {
        let ttl = self.cfg.peer_ttl_ms;
        self.swarms.retain(|_, s| {
            s.peers
                .retain(|p| now.saturating_sub(p.last_seen) <= ttl * 10);
            if let Some(src) = &s.source {
                if s.peers.get(src).is_none() {
                    s.source = None;
                }
            }
            s.bad.retain(|_, reports| {
                reports.retain(|(_, until)| *until > now);
                !reports.is_empty()
            });
            !s.peers.is_empty()
        });
    }

    pub fn stats(&self) -> Vec<SwarmStats> {
        let mut v: Vec<SwarmStats> = self
            .swarms
            .iter()
            .map(|(d, s)| SwarmStats {
                digest: d.to_string(),
                size: s.size,
                piece_size: s.piece_size,
                elected: s.elected.clone(),
                peers: s.peers.len(),
                complete: s.peers.iter().filter(|p| p.complete).count(),
                source: s.source.clone(),
                source_elections: s.elections,
            })
            .collect();
        v.sort_by(|a, b| a.digest.cmp(&b.digest));
        v
    }

    pub fn alive_peers(&self, d: &Digest, now: u64) -> usize {
        self.swarms
            .get(d)
            .map_or(0, |s| s.peers.iter().filter(|p| self.alive(p, now)).count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Topology;

    fn req(node: &str, d: &Digest) -> AnnounceRequest {
        AnnounceRequest::new(node, &format!("{node}:1"), &Topology::default(), d)
    }

    fn ann(t: &mut TrackerState, r: &AnnounceRequest, now: u64) -> AnnounceResponse {
        t.announce(r, now).expect("valid announce")
    }

    fn h(i: u32) -> String {
        PieceHash::of(&i.to_le_bytes()).to_hex()
    }

    #[test]
    fn one_source_then_peers_and_reelection_when_it_dies() {
        let d = Digest::of(b"blob");
        let mut t = TrackerState::new(SwarmConfig::default());
        assert_eq!(ann(&mut t, &req("a", &d), 0).role, Role::Source);
        for n in ["b", "c", "d"] {
            assert_eq!(ann(&mut t, &req(n, &d), 10).role, Role::Peer, "{n}");
        }
        let mut r = req("a", &d);
        r.size = Some(100 << 20);
        r.piece_size = Some(1 << 20);
        r.hashes.insert(0, h(0));
        r.fetching_from_registry = true;
        let mut have = Bitfield::new(100);
        have.set(0);
        r.have = Some(have);
        assert_eq!(ann(&mut t, &r, 20).role, Role::Source);
        let resp = ann(&mut t, &req("b", &d), 30);
        assert_eq!(resp.size, Some(100 << 20));
        assert_eq!(resp.source.as_deref(), Some("a"));
        assert_eq!(resp.hashes.get(&0), Some(&h(0)));
        assert!(resp.peers.iter().any(|p| p.node == "a"));
        // Hashes from anyone but the source are ignored, even first ones and even from
        // an agent claiming to fetch from the registry.
        let mut liar = req("c", &d);
        liar.hashes.insert(1, h(99));
        liar.fetching_from_registry = true;
        ann(&mut t, &liar, 40);
        assert!(!ann(&mut t, &req("b", &d), 50).hashes.contains_key(&1));
        assert_eq!(t.hashes(&d, 0).len(), 1);
        // The source goes silent: the next announcer takes over.
        let later = 40 + t.cfg.peer_ttl_ms + 1;
        assert_eq!(ann(&mut t, &req("b", &d), later).role, Role::Source);
        assert_eq!(t.stats()[0].source_elections, 2);
    }

    #[test]
    fn the_sources_last_hashes_are_kept_when_it_completes() {
        let d = Digest::of(b"last");
        let mut t = TrackerState::new(SwarmConfig::default());
        let mut src = req("a", &d);
        src.size = Some(4 << 20);
        src.piece_size = Some(1 << 20);
        assert_eq!(ann(&mut t, &src, 0).role, Role::Source);
        src.fetching_from_registry = true;
        src.hashes.insert(0, h(0));
        ann(&mut t, &src, 10);
        let mut done = req("a", &d);
        done.size = Some(4 << 20);
        done.complete = true;
        done.hashes = (1..4).map(|i| (i, h(i))).collect();
        ann(&mut t, &done, 20);
        assert_eq!(t.hashes(&d, 0).len(), 4, "every hash the source published");
        assert_eq!(
            ann(&mut t, &req("b", &d), 30).source,
            None,
            "the election ended"
        );
        // A complete announce from anyone else still adds nothing.
        let mut other = req("c", &d);
        other.size = Some(4 << 20);
        other.complete = true;
        other.hashes.insert(3, h(99));
        ann(&mut t, &other, 40);
        assert_eq!(t.hashes(&d, 3).get(&3), Some(&h(3)));
    }

    #[test]
    fn hostile_geometry_and_garbage_are_refused_before_anything_is_stored() {
        let d = Digest::of(b"geo");
        let mut t = TrackerState::new(SwarmConfig::default());
        let mut r = req("a", &d);
        r.size = Some(1 << 20);
        r.piece_size = Some(1 << 40);
        assert!(t.announce(&r, 0).is_err());
        assert!(t.stats().is_empty(), "nothing stored");
        r.piece_size = Some(1 << 16);
        r.size = Some(u64::MAX);
        assert!(t.announce(&r, 0).is_err());
        r.size = Some(64 << 20);
        r.piece_size = Some(1 << 20);
        ann(&mut t, &r, 0);
        let mut other = req("b", &d);
        other.size = Some(65 << 20);
        assert!(t.announce(&other, 1).is_err(), "conflicting size");
        // A bitfield of the wrong length is ignored, not stored.
        let mut wrong = req("c", &d);
        wrong.have = Some(Bitfield::full(7));
        let resp = ann(&mut t, &wrong, 2);
        let c = ann(&mut t, &req("d", &d), 3)
            .peers
            .into_iter()
            .find(|p| p.node == "c")
            .expect("c handed out");
        assert_eq!(c.have.map(|h| h.count()), Some(0));
        assert_eq!(resp.piece_size, 1 << 20);
    }

    #[test]
    fn a_first_size_must_fit_the_piece_size_already_chosen() {
        let d = Digest::of(b"sizeless");
        let mut t = TrackerState::new(SwarmConfig::default());
        let mut first = req("a", &d);
        first.piece_size = Some(crate::pieces::MIN_PIECE_SIZE);
        ann(&mut t, &first, 0);
        let mut sized = req("b", &d);
        sized.size = Some(1 << 40);
        assert!(t.announce(&sized, 1).is_err(), "1 TiB in 64 KiB pieces");
        assert_eq!(t.stats()[0].size, None, "nothing stored");
        assert_eq!(t.stats()[0].peers, 1);
        sized.size = Some(64 << 20);
        let resp = ann(&mut t, &sized, 2);
        assert_eq!((resp.size, resp.piece_size), (Some(64 << 20), 1 << 16));
    }

    #[test]
    fn small_blobs_go_direct_and_bad_peers_are_left_out() {
        let d = Digest::of(b"small");
        let mut t = TrackerState::new(SwarmConfig::default());
        let mut r = req("a", &d);
        r.size = Some(1000);
        assert_eq!(ann(&mut t, &r, 0).role, Role::Direct);
        let big = Digest::of(b"big");
        let mut c = req("seed", &big);
        c.complete = true;
        c.size = Some(64 << 20);
        ann(&mut t, &c, 0);
        let mut other = req("x", &big);
        other.have = Some(Bitfield::new(16));
        ann(&mut t, &other, 0);
        let resp = ann(&mut t, &req("b", &big), 1);
        assert_eq!(
            resp.role,
            Role::Peer,
            "a complete holder exists: no registry fetch"
        );
        assert_eq!(resp.peers[0].node, "seed", "complete peers first");
        let mut reporter = req("b", &big);
        reporter.bad_peers = vec!["seed".into()];
        let resp = ann(&mut t, &reporter, 2);
        assert!(resp.peers.iter().all(|p| p.node != "seed"));
        assert_eq!(
            resp.role,
            Role::Source,
            "the only holder lies: someone must go to the registry"
        );
    }

    #[test]
    fn one_reporter_cannot_ban_a_peer_for_everyone_but_a_quorum_can() {
        let d = Digest::of(b"quorum");
        let mut t = TrackerState::new(SwarmConfig::default());
        let mut seed = req("honest", &d);
        seed.complete = true;
        seed.size = Some(64 << 20);
        ann(&mut t, &seed, 0);
        let mut accuser = req("mallory", &d);
        accuser.bad_peers = vec!["honest".into()];
        ann(&mut t, &accuser, 1);
        assert!(
            ann(&mut t, &req("alice", &d), 2)
                .peers
                .iter()
                .any(|p| p.node == "honest"),
            "one report only affects the reporter"
        );
        for n in ["r1", "r2", "r3"] {
            let mut r = req(n, &d);
            r.bad_peers = vec!["honest".into()];
            ann(&mut t, &r, 3);
        }
        assert!(
            ann(&mut t, &req("alice", &d), 4)
                .peers
                .iter()
                .all(|p| p.node != "honest"),
            "a quorum of distinct reporters leaves it out for everyone"
        );
    }

    #[test]
    fn a_rack_of_empty_peers_still_reaches_the_source() {
        let d = Digest::of(b"racks");
        let mut t = TrackerState::new(SwarmConfig {
            max_peers: 4,
            ..Default::default()
        });
        let mut src = req("src", &d);
        src.topology = Topology {
            zone: Some("z".into()),
            rack: Some("r-src".into()),
        };
        src.size = Some(64 << 20);
        src.piece_size = Some(1 << 20);
        assert_eq!(ann(&mut t, &src, 0).role, Role::Source);
        let mut have = Bitfield::new(64);
        have.set(0);
        src.have = Some(have);
        ann(&mut t, &src, 1);
        for i in 0..8 {
            let mut q = req(&format!("m{i}"), &d);
            q.topology = Topology {
                zone: Some("z".into()),
                rack: Some("r1".into()),
            };
            let mut have = Bitfield::new(64);
            if i < 6 {
                have.set(1 + i);
            }
            q.have = Some(have);
            ann(&mut t, &q, 2);
        }
        let mut me = req("me", &d);
        me.topology = Topology {
            zone: Some("z".into()),
            rack: Some("r1".into()),
        };
        let peers = ann(&mut t, &me, 3).peers;
        assert_eq!(peers.len(), 4);
        assert!(
            peers.iter().any(|p| p.node == "src"),
            "the source is always handed out: {peers:?}"
        );
        assert!(peers.iter().all(|p| p.have.is_some()), "nobody is complete");
        assert!(
            peers
                .iter()
                .filter(|p| p.topology.rack.as_deref() == Some("r1"))
                .count()
                >= 2,
            "near peers still preferred"
        );
    }

    #[test]
    fn near_peers_first() {
        let d = Digest::of(b"topo");
        let mut t = TrackerState::new(SwarmConfig::default());
        for (n, z, r) in [
            ("far", "z2", "r9"),
            ("zone", "z1", "r2"),
            ("rack", "z1", "r1"),
        ] {
            let mut q = req(n, &d);
            q.complete = true;
            q.size = Some(64 << 20);
            q.topology = Topology {
                zone: Some(z.into()),
                rack: Some(r.into()),
            };
            ann(&mut t, &q, 0);
        }
        let mut me = req("me", &d);
        me.topology = Topology {
            zone: Some("z1".into()),
            rack: Some("r1".into()),
        };
        let names: Vec<String> = ann(&mut t, &me, 1)
            .peers
            .into_iter()
            .map(|p| p.node)
            .collect();
        assert_eq!(names, vec!["rack", "zone", "far"]);
    }

    #[test]
    fn a_node_busy_sourcing_one_blob_lets_another_source_the_next() {
        let (b1, b2, b3) = (Digest::of(b"1"), Digest::of(b"2"), Digest::of(b"3"));
        let mut t = TrackerState::new(SwarmConfig::default());
        assert_eq!(ann(&mut t, &req("a", &b1), 0).role, Role::Source);
        // "a" asks for a second blob first: held back for the defer window...
        assert_eq!(ann(&mut t, &req("a", &b2), 10).role, Role::Peer);
        // ...and "b", sourcing nothing, gets it.
        assert_eq!(ann(&mut t, &req("b", &b2), 20).role, Role::Source);
        // Nobody else wants a third blob: "a" gets it after the window.
        assert_eq!(ann(&mut t, &req("a", &b3), 30).role, Role::Peer);
        let later = 30 + t.cfg.source_defer_ms;
        assert_eq!(
            ann(&mut t, &req("a", &b1), later).role,
            Role::Source,
            "keeps the first"
        );
        assert_eq!(ann(&mut t, &req("a", &b3), later).role, Role::Source);
    }

    #[test]
    fn large_swarms_give_each_rack_member_its_own_stripe() {
        let d = Digest::of(b"stripes");
        let mut t = TrackerState::new(SwarmConfig {
            stripe_min_members: 8,
            ..Default::default()
        });
        let topo = |r: usize| Topology {
            zone: Some("z".into()),
            rack: Some(format!("r{r}")),
        };
        for i in 0..16 {
            let mut q = req(&format!("n{i}"), &d);
            q.size = Some(64 << 20);
            q.topology = topo(i % 2);
            ann(&mut t, &q, 0);
        }
        let mut seen = std::collections::HashSet::new();
        for i in (0..16).step_by(2) {
            let mut q = req(&format!("n{i}"), &d);
            q.topology = topo(0);
            let [idx, n] = ann(&mut t, &q, 1).stripe.expect("a stripe");
            assert_eq!(n, 8, "8 members in rack r0");
            assert!(seen.insert(idx), "stripes are distinct");
        }
        let small = Digest::of(b"few");
        let resp = ann(&mut t, &req("solo", &small), 0);
        assert_eq!(resp.stripe, None);
    }

    #[test]
    fn while_a_source_fetches_each_other_member_gets_its_own_source_stripe() {
        let d = Digest::of(b"one big file");
        let mut t = TrackerState::new(SwarmConfig::default());
        let mut src = req("src", &d);
        src.size = Some(512 << 20);
        src.fetching_from_registry = true;
        assert_eq!(ann(&mut t, &src, 0).role, Role::Source);
        for i in 0..7 {
            ann(&mut t, &req(&format!("n{i}"), &d), 1);
        }
        assert_eq!(
            ann(&mut t, &src, 2).source_stripe,
            None,
            "not the source itself"
        );
        let mut seen = std::collections::HashSet::new();
        for i in 0..7 {
            let [idx, n] = ann(&mut t, &req(&format!("n{i}"), &d), 3)
                .source_stripe
                .expect("a source stripe");
            assert_eq!(n, 7, "every member but the source");
            assert!(seen.insert(idx), "source stripes are distinct");
        }
        // Other blobs rank the same members differently: the same node does not own
        // piece 0 of every layer.
        let mut firsts = std::collections::HashSet::new();
        for b in 0..5u8 {
            let blob = Digest::of(&[b]);
            let mut s = req("src", &blob);
            s.size = Some(512 << 20);
            s.fetching_from_registry = true;
            ann(&mut t, &s, 4);
            for i in 0..7 {
                let resp = ann(&mut t, &req(&format!("n{i}"), &blob), 5);
                if resp.source_stripe.is_some_and(|[idx, _]| idx == 0) {
                    firsts.insert(i);
                }
            }
        }
        assert!(firsts.len() > 1, "different owners of stripe 0: {firsts:?}");
        // The source is done: no more stripes.
        let mut done = req("src", &d);
        done.complete = true;
        ann(&mut t, &done, 7);
        assert_eq!(ann(&mut t, &req("n0", &d), 8).source_stripe, None);
        // Swarms too large to rank every member get none.
        let big = Digest::of(b"big swarm");
        let mut src3 = req("src", &big);
        src3.size = Some(512 << 20);
        src3.fetching_from_registry = true;
        ann(&mut t, &src3, 10);
        for i in 0..SOURCE_STRIPE_MAX_MEMBERS {
            ann(&mut t, &req(&format!("m{i}"), &big), 11);
        }
        assert_eq!(ann(&mut t, &req("m0", &big), 12).source_stripe, None);
    }

    #[test]
    fn in_a_large_swarm_a_member_holding_nothing_is_asked_back_sooner() {
        let d = Digest::of(b"soon");
        let mut t = TrackerState::new(SwarmConfig::default());
        let full = t.cfg.announce_interval_ms;
        let mut src = req("a", &d);
        src.size = Some(100 << 20);
        src.piece_size = Some(1 << 20);
        assert_eq!(ann(&mut t, &src, 0).interval_ms, full, "the source");
        let mut b = req("b", &d);
        let small = ann(&mut t, &b, 10);
        assert_eq!(small.role, Role::Peer);
        assert_eq!(small.interval_ms, full, "a small swarm: the usual interval");
        for i in 0..crate::peers::EXACT_POOL {
            ann(&mut t, &req(&format!("n{i}"), &d), 10);
        }
        let empty = ann(&mut t, &b, 20);
        assert_eq!(empty.role, Role::Peer);
        assert_eq!(empty.interval_ms, full / EMPTY_HANDED_ANNOUNCE_DIVISOR);
        let mut have = Bitfield::new(crate::PieceLayout::new(100 << 20, 1 << 20).count());
        have.set(3);
        b.have = Some(have);
        assert_eq!(ann(&mut t, &b, 30).interval_ms, full, "one piece held");
        b.have = None;
        b.complete = true;
        assert_eq!(ann(&mut t, &b, 40).interval_ms, full, "complete");
    }

    #[test]
    fn answers_say_how_many_members_the_swarm_has() {
        let d = Digest::of(b"members");
        let mut t = TrackerState::new(SwarmConfig::default());
        for i in 0..5 {
            assert_eq!(ann(&mut t, &req(&format!("n{i}"), &d), 0).members, i + 1);
        }
        let mut gone = req("n0", &d);
        gone.leaving = true;
        assert_eq!(ann(&mut t, &gone, 1).members, 4);
        // An answer from a tracker that does not say parses as 0 (small-swarm rules).
        let mut v = serde_json::to_value(ann(&mut t, &req("n1", &d), 2)).expect("json");
        v.as_object_mut().expect("object").remove("members");
        let old: AnnounceResponse = serde_json::from_value(v).expect("parses");
        assert_eq!(old.members, 0);
    }
}
