//! The tracker's soft state: per blob, who holds which pieces, who fetches from the
//! registry, the piece hashes, and which peers to hand out. Time is passed in (ms) so
//! the simulator can drive it.

use std::collections::{BTreeMap, HashMap};

use oci::Digest;
use serde::Serialize;

use crate::peers::{Ask, PeerEntry, PeerTable};
use crate::pieces::{piece_size_for, DEFAULT_PIECE_SIZE};
use crate::protocol::{AnnounceRequest, AnnounceResponse, PeerInfo, Role};

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
    pub piece_size: u64,
    /// How long a peer reported for bad pieces is left out.
    pub bad_peer_ms: u64,
    pub announce_interval_ms: u64,
}

impl Default for SwarmConfig {
    fn default() -> Self {
        Self {
            peer_ttl_ms: 3_000,
            max_peers: 16,
            min_p2p_size: 1 << 20,
            piece_size: DEFAULT_PIECE_SIZE,
            bad_peer_ms: 60_000,
            announce_interval_ms: 250,
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Swarm {
    size: Option<u64>,
    piece_size: u64,
    hashes: BTreeMap<u32, String>,
    source: Option<String>,
    peers: PeerTable,
    bad: HashMap<String, u64>,
    /// Times a source was elected: 1 means the registry was asked once.
    elections: u32,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct SwarmStats {
    pub digest: String,
    pub size: Option<u64>,
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

    pub fn announce(&mut self, req: &AnnounceRequest, now: u64) -> AnnounceResponse {
        let cfg = self.cfg.clone();
        let swarm = self.swarms.entry(req.digest.clone()).or_default();
        if swarm.size.is_none() {
            swarm.size = req.size;
        }
        if swarm.piece_size == 0 {
            swarm.piece_size = match (req.piece_size, swarm.size) {
                (Some(p), _) => p,
                (None, Some(s)) => piece_size_for(s, cfg.piece_size),
                (None, None) => 0,
            };
        }
        for bad in &req.bad_peers {
            swarm.bad.insert(bad.clone(), now + cfg.bad_peer_ms);
        }
        swarm.bad.retain(|_, until| *until > now);
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
                req.have.clone(),
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
        // Hashes come from whoever streams registry bytes; the first value for a piece wins.
        if swarm.source.as_deref() == Some(&req.node) || req.fetching_from_registry || req.complete
        {
            for (i, h) in &req.hashes {
                swarm.hashes.entry(*i).or_insert_with(|| h.clone());
            }
        }
        let ask = Ask {
            node: &req.node,
            topology: &req.topology,
            now,
            ttl_ms: cfg.peer_ttl_ms,
            bad: &swarm.bad,
            source: None,
            max_peers: cfg.max_peers,
            have: req.have.as_ref(),
            window_ms: cfg.announce_interval_ms,
        };
        let any_complete = swarm.peers.any_complete(&ask);
        let role = if req.leaving || req.complete {
            Role::Peer
        } else if swarm.size.is_some_and(|s| s < cfg.min_p2p_size) {
            Role::Direct
        } else if swarm.source.as_deref() == Some(&req.node) {
            Role::Source
        } else if swarm.source.is_none() && (req.fetching_from_registry || !any_complete) {
            // Elect: the blob is not in the cluster (or its holders vanished mid-way).
            swarm.source = Some(req.node.clone());
            swarm.elections += 1;
            Role::Source
        } else {
            Role::Peer
        };
        let hashes = swarm
            .hashes
            .range(req.known_hashes..)
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        // Three quarters of the slots go to the nearest peers (then the most complete),
        // the rest to the most complete peers anywhere, and the live source always: a
        // rack full of empty peers must still reach the bytes (found by the simulator).
        // Only peers with something to give: a peer that announced no bitfield yet holds
        // nothing (handing it out as `have: None` would advertise it as complete).
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
                have: if p.complete { None } else { p.have.clone() },
            })
            .collect();
        let source_alive = swarm.source.is_some();
        AnnounceResponse {
            role,
            size: swarm.size,
            piece_size: swarm.piece_size.max(1),
            hashes,
            peers,
            source_alive,
            interval_ms: cfg.announce_interval_ms,
            wait_for_upload_slots: swarm.peers.is_large(),
        }
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
    use crate::Bitfield;

    fn req(node: &str, d: &Digest) -> AnnounceRequest {
        AnnounceRequest {
            node: node.into(),
            addr: format!("http://{node}"),
            topology: Topology::default(),
            digest: d.clone(),
            size: None,
            piece_size: None,
            have: None,
            complete: false,
            fetching_from_registry: false,
            hashes: BTreeMap::new(),
            known_hashes: 0,
            bad_peers: vec![],
            leaving: false,
        }
    }

    #[test]
    fn one_source_then_peers_and_reelection_when_it_dies() {
        let d = Digest::of(b"blob");
        let mut t = TrackerState::new(SwarmConfig::default());
        assert_eq!(t.announce(&req("a", &d), 0).role, Role::Source);
        for n in ["b", "c", "d"] {
            assert_eq!(t.announce(&req(n, &d), 10).role, Role::Peer, "{n}");
        }
        let mut r = req("a", &d);
        r.size = Some(100 << 20);
        r.hashes.insert(0, "h0".into());
        r.fetching_from_registry = true;
        let mut have = Bitfield::new(100);
        have.set(0);
        r.have = Some(have);
        assert_eq!(t.announce(&r, 20).role, Role::Source);
        let resp = t.announce(&req("b", &d), 30);
        assert_eq!(resp.size, Some(100 << 20));
        assert_eq!(resp.hashes.get(&0).map(String::as_str), Some("h0"));
        assert!(resp.peers.iter().any(|p| p.node == "a"));
        // Hashes from a non-source are ignored.
        let mut liar = req("c", &d);
        liar.hashes.insert(1, "evil".into());
        t.announce(&liar, 40);
        assert!(!t.announce(&req("b", &d), 50).hashes.contains_key(&1));
        // The source goes silent: the next announcer takes over.
        let later = 40 + t.cfg.peer_ttl_ms + 1;
        assert_eq!(t.announce(&req("b", &d), later).role, Role::Source);
        assert_eq!(t.stats()[0].source_elections, 2);
    }

    #[test]
    fn small_blobs_go_direct_and_bad_peers_are_left_out() {
        let d = Digest::of(b"small");
        let mut t = TrackerState::new(SwarmConfig::default());
        let mut r = req("a", &d);
        r.size = Some(1000);
        assert_eq!(t.announce(&r, 0).role, Role::Direct);
        let big = Digest::of(b"big");
        let mut c = req("seed", &big);
        c.complete = true;
        c.size = Some(64 << 20);
        t.announce(&c, 0);
        let mut other = req("x", &big);
        other.have = Some(Bitfield::new(16));
        t.announce(&other, 0);
        let resp = t.announce(&req("b", &big), 1);
        assert_eq!(
            resp.role,
            Role::Peer,
            "a complete holder exists: no registry fetch"
        );
        assert_eq!(resp.peers[0].node, "seed", "complete peers first");
        let mut reporter = req("b", &big);
        reporter.bad_peers = vec!["seed".into()];
        let resp = t.announce(&reporter, 2);
        assert!(resp.peers.iter().all(|p| p.node != "seed"));
        assert_eq!(
            resp.role,
            Role::Source,
            "the only holder lies: someone must go to the registry"
        );
    }

    #[test]
    fn a_rack_of_empty_peers_still_reaches_the_source_and_fresh_peers_are_not_seeds() {
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
        assert_eq!(t.announce(&src, 0).role, Role::Source);
        src.have = Some(Bitfield::new(64));
        src.have.as_mut().unwrap().set(0);
        t.announce(&src, 1);
        for i in 0..8 {
            let mut q = req(&format!("m{i}"), &d);
            q.topology = Topology {
                zone: Some("z".into()),
                rack: Some("r1".into()),
            };
            q.have = Some(Bitfield::new(64));
            if i < 6 {
                q.have.as_mut().unwrap().set(1 + i);
            }
            t.announce(&q, 2);
        }
        // A brand-new peer (no bitfield yet) must not be advertised as complete.
        t.announce(&req("fresh", &d), 2);
        let mut me = req("me", &d);
        me.topology = Topology {
            zone: Some("z".into()),
            rack: Some("r1".into()),
        };
        let peers = t.announce(&me, 3).peers;
        assert_eq!(peers.len(), 4);
        assert!(
            peers.iter().any(|p| p.node == "src"),
            "the source is always handed out: {peers:?}"
        );
        assert!(peers.iter().all(|p| p.node != "fresh" && p.have.is_some()));
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
            t.announce(&q, 0);
        }
        let mut me = req("me", &d);
        me.topology = Topology {
            zone: Some("z1".into()),
            rack: Some("r1".into()),
        };
        let names: Vec<String> = t
            .announce(&me, 1)
            .peers
            .into_iter()
            .map(|p| p.node)
            .collect();
        assert_eq!(names, vec!["rack", "zone", "far"]);
    }
}
