//! The tracker's soft state: per blob, who holds which pieces, who fetches from the
//! registry, the piece hashes, and which peers to hand out. Time is passed in (ms) so
//! the simulator can drive it.

use std::collections::{BTreeMap, HashMap};

use oci::Digest;
use serde::Serialize;

use crate::peers::{spread, Ask, PeerEntry, PeerTable};
use crate::pieces::{
    admitted_piece_size, piece_size_for, validate_geometry, PieceHash, MAX_BLOB_SIZE, MAX_PIECES,
};
use crate::protocol::{
    AnnounceRequest, AnnounceResponse, PeerInfo, Role, SOURCE_STRIPE_MAX_MEMBERS,
};
use crate::{Bitfield, Error};

mod replica;
pub use replica::{SharedPeer, SharedReport, SharedSwarm};

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
    /// Times the hashes were voided by their source (`AnnounceRequest::hashes_void`).
    hashes_epoch: u32,
    /// The last announce voided the hashes, for a shared store to do the same
    /// ([`TrackerState::take_voided`]).
    voided: bool,
    /// The last announce replaced the size ([`Swarm::regeometry`]), for a shared store
    /// to do the same ([`TrackerState::take_regeometried`]).
    regeometried: bool,
    /// The source the last announce demoted, for a shared store to depose
    /// ([`TrackerState::take_demoted`]).
    demoted: Option<String>,
    /// Reports the last announce made (accused, until), for a shared store to pass to
    /// every replica ([`TrackerState::take_reports`]).
    reported: Vec<(String, u64)>,
}

impl Swarm {
    /// The elected source read another size from the registry than the one the swarm
    /// was laid out by: everything laid out by the old one goes. Members see the new
    /// size in their next answer and start over; the old hashes are void.
    fn regeometry(&mut self, size: Option<u64>, piece_size: Option<u64>) {
        self.size = size;
        self.piece_size = piece_size.unwrap_or(0);
        self.hashes.clear();
        self.hashes_epoch += 1;
        let source = self.source.clone();
        self.peers.retain(|p| Some(&p.name) == source.as_ref());
    }

    fn count(&self) -> u32 {
        match self.size {
            Some(s) if self.piece_size > 0 => crate::PieceLayout::new(s, self.piece_size).count(),
            _ => 0,
        }
    }

    /// Whether a quorum of distinct members reported `name` (bad pieces, or
    /// unreachable): out of everyone's handouts, and out of the rack stripes, whose
    /// share would otherwise wait on a member its rack cannot reach.
    fn reported_by_quorum(&self, name: &str, quorum: usize, now: u64) -> bool {
        self.live_reports(name, now) >= quorum
    }

    /// Records `reporter`'s report of `accused` standing until `until`; false when
    /// the accused already has as many reporters as are remembered.
    fn record_report(&mut self, accused: &str, reporter: &str, until: u64) -> bool {
        let reports = self.bad.entry(accused.to_owned()).or_default();
        if let Some(r) = reports.iter_mut().find(|(r, _)| r == reporter) {
            r.1 = r.1.max(until);
            return true;
        }
        if reports.len() >= MAX_REPORTERS {
            return false;
        }
        reports.push((reporter.to_owned(), until));
        true
    }

    /// Distinct members whose report of `name` still stands.
    fn live_reports(&self, name: &str, now: u64) -> usize {
        self.bad
            .get(name)
            .map_or(0, |r| r.iter().filter(|(_, until)| *until > now).count())
    }

    /// Members heard from within the TTL that do not hold the whole blob yet.
    fn fetching_members(&self, ttl_ms: u64, now: u64) -> impl Iterator<Item = &PeerEntry> {
        self.peers
            .iter()
            .filter(move |p| !p.complete && now.saturating_sub(p.last_seen) <= ttl_ms)
    }

    /// Whether the members still fetching cannot reach `name`: reported by a quorum of
    /// distinct members or, in a swarm with fewer members still fetching, by as many
    /// as there are. Such a node is no use as the swarm's source: in a two-node swarm
    /// the only member that needs the source is the only one who can say so.
    fn cut_off(&self, name: &str, quorum: usize, ttl_ms: u64, now: u64) -> bool {
        let reporters = self.live_reports(name, now);
        if reporters == 0 {
            return false;
        }
        let fetching = self
            .fetching_members(ttl_ms, now)
            .filter(|p| p.name != name)
            .count();
        reporters >= quorum.min(fetching).max(1)
    }

    /// Whether `name` may be (or stay) the registry fetcher: it is not cut off, or no
    /// other member still fetching could take its place (a swarm whose members all
    /// report each other must still elect someone, as before reports existed).
    fn may_source(&self, name: &str, quorum: usize, ttl_ms: u64, now: u64) -> bool {
        !self.cut_off(name, quorum, ttl_ms, now)
            || !self
                .fetching_members(ttl_ms, now)
                .any(|p| p.name != name && !self.cut_off(&p.name, quorum, ttl_ms, now))
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
        if req.bad_peers.len() > crate::protocol::MAX_BAD_PEERS {
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
        // Whoever announces first fixes the size, but only the elected source has read
        // it from the registry: a member that said otherwise first (a lie, or a wrong
        // manifest) would have spoiled the layer for every node while it kept
        // announcing. The source's word replaces the geometry and the hashes; anyone
        // else's disagreement is ignored, and the answer tells it the size in force.
        // A complete holder nobody reported has passed the blob's digest at the size in
        // force, which is then proven: an elected source saying otherwise is lying (one
        // elected after the swarm finished, say), and is ignored like anyone else.
        let conflicting =
            matches!((swarm.size, req.size), (Some(known), Some(said)) if known != said);
        let proven = |s: &Swarm| {
            s.peers.iter().any(|p| {
                p.complete
                    && p.name != req.node
                    && now.saturating_sub(p.last_seen) <= cfg.peer_ttl_ms * 10
                    && !s.cut_off(&p.name, cfg.bad_peer_quorum, cfg.peer_ttl_ms, now)
            })
        };
        // A swarm laid out below the P2P threshold has no source to mend its size: a
        // member claiming a large layer at a small size would otherwise send every node
        // to the registry for it, and one claiming a small blob at a wrong size would
        // keep its honest holders out. There the size is mended by a complete holder
        // (it passed the digest at its size), or by a node that checked the size with
        // the registry and would read it as the source of the large swarm it says
        // this is. A size a live holder nobody reported backs still stands, and while
        // a source is elected (before the size was known) its word mends it instead.
        let small_in_force = swarm.size.is_some_and(|s| s < cfg.min_p2p_size);
        let may_mend_small = small_in_force
            && swarm.source.is_none()
            && (req.complete
                || (req.size.is_some_and(|s| s >= cfg.min_p2p_size) && !req.registry_unavailable));
        swarm.regeometried = conflicting
            && (swarm.source.as_deref() == Some(req.node.as_str()) || may_mend_small)
            && !req.leaving
            && !proven(swarm);
        if swarm.regeometried {
            let piece_size = req
                .piece_size
                .zip(req.size)
                .map(|(p, s)| admitted_piece_size(s, p, cfg.piece_size));
            swarm.regeometry(req.size, piece_size);
        }
        let conflicting = conflicting && swarm.size != req.size;
        if swarm.size.is_none() {
            swarm.size = req.size;
        }
        if swarm.piece_size == 0 {
            swarm.piece_size = match (req.piece_size, swarm.size) {
                (Some(p), Some(s)) => admitted_piece_size(s, p, cfg.piece_size),
                // Nothing bounds a proposal without a size: the layout waits for one.
                (Some(_), None) => 0,
                (None, Some(s)) => cfg
                    .piece_size
                    .filter(|&p| validate_geometry(s, p).is_ok())
                    .unwrap_or_else(|| piece_size_for(s, None)),
                (None, None) => 0,
            };
        }
        let count = swarm.count();
        // A bitfield of another length, or of another size's layout, says nothing
        // about this swarm's pieces; nor does "complete" said with another size (no
        // blob of this digest has that size: a liar's claim, handed out, would send
        // every member to it and prove the wrong size against a mending source).
        let have = req
            .have
            .clone()
            .filter(|h| h.len() == count && !conflicting);
        let complete = req.complete && !conflicting;
        swarm.bad.retain(|_, reports| {
            reports.retain(|(_, until)| *until > now);
            !reports.is_empty()
        });
        swarm.reported.clear();
        for accused in &req.bad_peers {
            // Only a member can be handed out or elected, so only a member's reports
            // matter: a name the swarm does not know would only take room.
            if accused == &req.node || swarm.peers.get(accused).is_none() {
                continue;
            }
            let until = now + cfg.bad_peer_ms;
            if swarm.record_report(accused, &req.node, until) {
                swarm.reported.push((accused.clone(), until));
            }
        }
        // The source's last announce says "complete" and carries the hashes of the
        // pieces it read since its previous one: the election ends with this announce,
        // but those hashes are still the source's (peers that saw the pieces in a
        // bitfield rather than a HAVE have no other way to them but a seeder).
        let finishing_source =
            swarm.source.as_deref() == Some(&req.node) && req.complete && !req.leaving;
        // Only the elected source can say its hashes were wrong: it alone published
        // them, from registry bytes that then failed the blob's digest.
        let voids = req.hashes_void && swarm.source.as_deref() == Some(&req.node);
        if voids {
            swarm.hashes.clear();
            swarm.hashes_epoch += 1;
        }
        // A new size voids the hashes too: a shared store deletes them the same way.
        swarm.voided = voids || swarm.regeometried;
        // A blob below the P2P threshold has no swarm: whoever asks fetches it directly,
        // so nobody fetching it is kept as a member. Its complete holders (the seeding
        // loop's) are kept, for a node the registry cannot answer.
        let small = swarm.size.is_some_and(|s| s < cfg.min_p2p_size);
        if req.leaving || (small && !complete) {
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
                complete,
                now,
            ));
        }
        // A source that says it is done no longer fetches, whatever size it said (its
        // entry is no complete holder if that size was not the swarm's).
        if req.complete && swarm.source.as_deref() == Some(req.node.as_str()) {
            swarm.source = None;
        }
        let source_alive = |s: &Swarm| {
            s.source
                .as_ref()
                .and_then(|n| s.peers.get(n))
                .is_some_and(|p| now.saturating_sub(p.last_seen) <= cfg.peer_ttl_ms && !p.complete)
        };
        // A source the fetching members cannot reach (a wrong `--advertise`, a
        // firewalled peer port) would keep them waiting until it finished the whole
        // blob from the registry: demoted, so another member is elected in its place.
        let unreachable_source = swarm
            .source
            .as_deref()
            .is_some_and(|s| !swarm.may_source(s, cfg.bad_peer_quorum, cfg.peer_ttl_ms, now));
        swarm.demoted = None;
        if unreachable_source {
            swarm.demoted = swarm.source.take();
        }
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
        } else if small && !req.registry_unavailable {
            Role::Direct
        } else if req.registry_unavailable {
            // It cannot read the registry: never its source, whatever the swarm holds
            // (a source that can no longer read it hands the role on).
            if swarm.source.as_deref() == Some(&req.node) {
                swarm.source = None;
            }
            Role::Peer
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
        } else if swarm.source.is_none()
            && if any_complete {
                // Already streaming from the registry (its claim after a tracker
                // restart), unless it was demoted: that one takes the bytes from
                // the holders instead.
                req.fetching_from_registry
                    && !swarm.cut_off(&req.node, cfg.bad_peer_quorum, cfg.peer_ttl_ms, now)
            } else {
                swarm.may_source(&req.node, cfg.bad_peer_quorum, cfg.peer_ttl_ms, now)
            }
        {
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
        if (swarm.source.as_deref() == Some(&req.node) || finishing_source) && !req.hashes_void {
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
                let mut members = swarm.peers.rack_members(&req.topology, |p| {
                    now.saturating_sub(p.last_seen) <= ttl
                        && !swarm.reported_by_quorum(&p.name, cfg.bad_peer_quorum, now)
                });
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
        // A complete member fetches nothing, and no client reads a handout from its
        // announce (the seeding loop, the final announce). Ranking one cost each
        // heartbeat as much as a fetcher's announce (the tracker's time at 1,000
        // simulated nodes fell by 37 % without), and counted its peers as handed out
        // (`exposure`), which pushed them behind others in the handouts fetchers do
        // read. (A leaving announce, rare, still gets one: an observer outside the swarm
        // reads the holders that way.)
        let handed = if req.complete {
            Vec::new()
        } else {
            swarm.peers.handout(&ask)
        };
        let peers = handed
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
            hashes_epoch: swarm.hashes_epoch,
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
mod tests;
