//! `TrackerState::announce` / `expire`: one live source per blob, handouts, hashes,
//! refused announces, expiry.

use std::collections::{BTreeMap, HashMap, HashSet};

use oci::Digest;
use proptest::prelude::*;
use swarm::pieces::{validate_geometry, PieceHash, MAX_BLOB_SIZE, MIN_PIECE_SIZE};
use swarm::{AnnounceRequest, Bitfield, Role, SwarmConfig, Topology, TrackerState};

use super::{Tally, MIB};

#[derive(Clone, Debug)]
enum Geometry {
    /// What an agent sends: 64 MiB in 1 MiB pieces.
    Agent,
    /// An agent that does not know the size yet.
    Unknown,
    /// Only a piece size (an agent that proposes one before it knows the size).
    PieceOnly(u64),
    /// Only a size (the tracker picks the piece size).
    SizeOnly(u64),
    /// Refused: not a power of two, too small, too large, too many pieces.
    Invalid(u64, u64),
}

#[derive(Clone, Debug)]
pub(super) struct Announce {
    node: usize,
    blob: usize,
    geometry: Geometry,
    have: Vec<u32>,
    complete: bool,
    fetching: bool,
    leaving: bool,
    hashes: Vec<u32>,
    bad: Vec<usize>,
    known_hashes: u32,
    rack: usize,
    /// The registry cannot answer it: only holders may serve it.
    registry_unavailable: bool,
}

#[derive(Clone, Debug)]
pub(super) enum TrackerOp {
    Announce(Announce),
    Advance(u64),
    Expire,
}

fn geometry() -> impl Strategy<Value = Geometry> {
    prop_oneof![
        6 => Just(Geometry::Agent),
        2 => Just(Geometry::Unknown),
        1 => prop_oneof![Just(MIN_PIECE_SIZE), Just(MIB), Just(256 * MIB)].prop_map(Geometry::PieceOnly),
        1 => prop_oneof![Just(1000u64), Just(64 * MIB), Just(1u64 << 40), Just(MAX_BLOB_SIZE)]
            .prop_map(Geometry::SizeOnly),
        1 => prop_oneof![
            Just((64 * MIB, 3 * MIB)),
            Just((64 * MIB, 1024)),
            Just((64 * MIB, 1 << 40)),
            Just((u64::MAX, MIB)),
            Just((1 << 40, MIN_PIECE_SIZE)),
        ]
        .prop_map(|(s, p)| Geometry::Invalid(s, p)),
    ]
}

fn announce_op() -> impl Strategy<Value = Announce> {
    (
        (
            0usize..6,
            0usize..2,
            geometry(),
            proptest::collection::vec(0u32..64, 0..8),
        ),
        (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()),
        (
            proptest::collection::vec(0u32..70, 0..4),
            proptest::collection::vec(0usize..6, 0..2),
            0u32..8,
            0usize..2,
            0u8..8,
        ),
    )
        .prop_map(
            |(
                (node, blob, geometry, have),
                (c, fetching, leaving, l2),
                (hashes, bad, known_hashes, rack, unavailable),
            )| {
                Announce {
                    node,
                    blob,
                    geometry,
                    have,
                    // Completing and leaving are rarer than downloading.
                    complete: c && l2,
                    fetching,
                    leaving: leaving && l2,
                    hashes,
                    bad,
                    known_hashes,
                    rack,
                    registry_unavailable: unavailable == 0,
                }
            },
        )
}

pub(super) fn tracker_op() -> impl Strategy<Value = TrackerOp> {
    prop_oneof![
        8 => announce_op().prop_map(TrackerOp::Announce),
        3 => prop_oneof![Just(300u64), Just(2_000), Just(6_000), Just(60_000)].prop_map(TrackerOp::Advance),
        1 => Just(TrackerOp::Expire),
    ]
}

fn digest(blob: usize) -> Digest {
    Digest::of(format!("blob-{blob}").as_bytes())
}

fn request(a: &Announce) -> AnnounceRequest {
    let node = format!("n{}", a.node);
    let topo = Topology {
        zone: Some("z".into()),
        rack: Some(format!("r{}", a.rack)),
    };
    let mut r = AnnounceRequest::new(&node, &format!("{node}:5051"), &topo, &digest(a.blob));
    let pieces = match a.geometry {
        Geometry::Agent => {
            r.size = Some(64 * MIB);
            r.piece_size = Some(MIB);
            64
        }
        Geometry::Unknown => 0,
        Geometry::PieceOnly(p) => {
            r.piece_size = Some(p);
            0
        }
        Geometry::SizeOnly(s) => {
            r.size = Some(s);
            0
        }
        Geometry::Invalid(s, p) => {
            r.size = Some(s);
            r.piece_size = Some(p);
            64
        }
    };
    if pieces > 0 {
        let mut have = Bitfield::new(pieces);
        for &i in &a.have {
            have.set(i);
        }
        r.have = Some(have);
    }
    r.complete = a.complete;
    r.fetching_from_registry = a.fetching;
    r.leaving = a.leaving;
    for &i in &a.hashes {
        r.hashes
            .insert(i, PieceHash::of(format!("{node}/{i}").as_bytes()).to_hex());
    }
    r.bad_peers = a.bad.iter().map(|b| format!("n{b}")).collect();
    r.known_hashes = a.known_hashes;
    r.registry_unavailable = a.registry_unavailable;
    r
}

fn stats(t: &TrackerState) -> String {
    serde_json::to_string(&t.stats()).unwrap_or_default()
}

/// The model of one (blob, node): when it last announced, and whether it said it
/// left or completed (a source that did is no longer the live source).
#[derive(Clone, Copy, Debug)]
struct Member {
    at: u64,
    gone: bool,
}

pub(super) fn run_tracker(max_peers: usize, ops: &[TrackerOp]) -> Result<Tally, TestCaseError> {
    let mut tally = Tally::default();
    let mut t = TrackerState::new(SwarmConfig {
        max_peers,
        stripe_min_members: 4,
        ..SwarmConfig::default()
    });
    let ttl = t.cfg.peer_ttl_ms;
    let mut now = 1_000u64;
    // Per blob: its members (announced, not left, not expired) and its source as last
    // seen in a response.
    let mut members: HashMap<Digest, BTreeMap<String, Member>> = HashMap::new();
    let mut sources: HashMap<Digest, String> = HashMap::new();
    // Per (blob, accused): reporter → when its report lapses.
    let mut reports: HashMap<(Digest, String), BTreeMap<String, u64>> = HashMap::new();
    let report_ms = t.cfg.bad_peer_ms;
    for op in ops {
        match op {
            TrackerOp::Advance(ms) => now += ms,
            TrackerOp::Expire => {
                t.expire(now);
                let before: usize = members.values().map(BTreeMap::len).sum();
                for m in members.values_mut() {
                    m.retain(|_, p| now.saturating_sub(p.at) <= ttl * 10);
                }
                if members.values().map(BTreeMap::len).sum::<usize>() < before {
                    tally.add("expire");
                }
                members.retain(|_, m| !m.is_empty());
                let swarms: BTreeMap<String, usize> =
                    t.stats().into_iter().map(|s| (s.digest, s.peers)).collect();
                let model: BTreeMap<String, usize> = members
                    .iter()
                    .map(|(d, m)| (d.to_string(), m.len()))
                    .collect();
                prop_assert_eq!(
                    swarms,
                    model,
                    "after expire, exactly the members heard from within 10 TTLs"
                );
                sources.retain(|d, _| members.contains_key(d));
            }
            TrackerOp::Announce(a) => {
                let req = request(a);
                let d = req.digest.clone();
                let before = stats(&t);
                let size_before = t
                    .stats()
                    .into_iter()
                    .find(|s| s.digest == d.to_string())
                    .and_then(|s| s.size);
                let hashes_before = t.hashes(&d, 0);
                let resp = match t.announce(&req, now) {
                    Ok(r) => r,
                    Err(_) => {
                        tally.add("announce refused");
                        prop_assert_eq!(stats(&t), before, "a refused announce changes nothing");
                        prop_assert_eq!(t.hashes(&d, 0), hashes_before);
                        continue;
                    }
                };
                if let Geometry::Invalid(..) = a.geometry {
                    return Err(TestCaseError::fail(format!(
                        "invalid geometry accepted: {req:?}"
                    )));
                }
                tally.add("announce taken");
                if !resp.peers.is_empty() {
                    tally.add("peers handed out");
                }
                if resp.peers.len() == max_peers && max_peers > 0 {
                    tally.add("full handout");
                }
                for accused in &req.bad_peers {
                    if accused != &req.node {
                        reports
                            .entry((d.clone(), accused.clone()))
                            .or_default()
                            .insert(req.node.clone(), now + report_ms);
                    }
                }
                let m = members.entry(d.clone()).or_default();
                // Only the elected source moves a known size (it read the registry's),
                // and the members laid out by the old one go with it. Below the P2P
                // threshold there is no source: there a complete holder, or a node
                // saying a size at or above the threshold, moves a size that no other
                // live complete member backs without a report against it.
                if size_before.is_some() && resp.size != size_before {
                    let min = t.cfg.min_p2p_size;
                    let by_source = sources.get(&d) == Some(&req.node);
                    if by_source {
                        tally.add("size replaced by the source");
                    } else {
                        tally.add("small swarm's size mended");
                        prop_assert!(
                            size_before.is_some_and(|s| s < min),
                            "size {:?} replaced by a non-source",
                            size_before
                        );
                        prop_assert!(
                            req.complete
                                || (req.size.is_some_and(|s| s >= min)
                                    && !req.registry_unavailable),
                            "a small swarm's size moved by a fetcher that cannot vouch for a large one"
                        );
                        let backed = m.iter().any(|(name, p)| {
                            p.gone
                                && name != &req.node
                                && now.saturating_sub(p.at) <= ttl * 10
                                && reports
                                    .get(&(d.clone(), name.clone()))
                                    .is_none_or(|r| r.values().all(|&until| until <= now))
                        });
                        prop_assert!(!backed, "a size a live, unreported holder backs moved");
                    }
                    prop_assert_eq!(resp.size, req.size);
                    prop_assert!(
                        t.hashes(&d, 0).keys().all(|k| req.hashes.contains_key(k)),
                        "the old layout's hashes are gone"
                    );
                    m.retain(|name, _| name == &req.node);
                }
                // A blob below the P2P threshold keeps no members fetching it (all
                // fetch directly), only those holding it whole at the swarm's size,
                // for a node the registry cannot answer.
                let small = resp.size.is_some_and(|s| s < t.cfg.min_p2p_size);
                let holds_whole = req.complete && req.size.is_none_or(|s| Some(s) == resp.size);
                if small && holds_whole && !req.leaving {
                    tally.add("small blob: a complete holder kept");
                }
                if req.leaving || (small && !holds_whole) {
                    if small {
                        tally.add("small blob: not a member");
                    }
                    m.remove(&req.node);
                } else {
                    m.insert(
                        req.node.clone(),
                        Member {
                            at: now,
                            gone: req.complete,
                        },
                    );
                }
                // A node is never handed itself, nobody twice, at most max_peers
                // (the live source is always included, and takes a slot: see
                // `peers::rank`, so only a handout of max_peers = 0 can hold 1).
                let names: HashSet<&str> = resp.peers.iter().map(|p| p.node.as_str()).collect();
                prop_assert_eq!(names.len(), resp.peers.len(), "nobody twice");
                prop_assert!(
                    !names.contains(req.node.as_str()),
                    "{} handed itself",
                    req.node
                );
                prop_assert!(
                    resp.peers.len() <= max_peers.max(1),
                    "{} peers > {}",
                    resp.peers.len(),
                    max_peers
                );
                if resp.role == Role::Source {
                    prop_assert_eq!(resp.source.as_deref(), Some(req.node.as_str()));
                }
                if req.leaving || req.complete {
                    prop_assert_ne!(resp.source.as_deref(), Some(req.node.as_str()));
                }
                // A node the registry cannot answer is never the one to read it.
                if req.registry_unavailable {
                    tally.add("registry unavailable to the announcer");
                    prop_assert_ne!(resp.role, Role::Source);
                    prop_assert_ne!(resp.source.as_deref(), Some(req.node.as_str()));
                }
                // The source's own final announce (complete or leaving) still counts.
                let was_source = sources.get(&d).map(String::as_str) == Some(req.node.as_str());
                // At most one elected source per blob: a different one only when the
                // previous left, completed, went silent for the TTL, or was reported
                // (unreachable or lying) by a member whose report still stands.
                if let (Some(old), Some(new)) = (sources.get(&d), resp.source.as_ref()) {
                    if old != new {
                        tally.add("source replaced");
                        let prev = members.get(&d).and_then(|m| m.get(old)).copied();
                        let reported = reports
                            .get(&(d.clone(), old.clone()))
                            .is_some_and(|r| r.values().any(|&until| until > now));
                        if reported && prev.is_some_and(|p| !p.gone && now - p.at <= ttl) {
                            tally.add("reported source replaced");
                        }
                        prop_assert!(
                            reported
                                || prev.is_none_or(|p| p.gone || now.saturating_sub(p.at) > ttl),
                            "{} elected while {} is live and unreported: {:?}",
                            new,
                            old,
                            prev
                        );
                    }
                }
                match &resp.source {
                    Some(s) => sources.insert(d.clone(), s.clone()),
                    None => sources.remove(&d),
                };
                // A known size always comes with a geometry every agent accepts.
                if let Some(size) = resp.size {
                    prop_assert!(
                        validate_geometry(size, resp.piece_size).is_ok(),
                        "swarm geometry {} in pieces of {}",
                        size,
                        resp.piece_size
                    );
                }
                // Hashes only from the elected source, and only what it sent.
                let hashes_after = t.hashes(&d, 0);
                if resp.source.as_deref() != Some(req.node.as_str()) && !was_source {
                    prop_assert_eq!(&hashes_after, &hashes_before, "hashes from a non-source");
                } else {
                    for (k, v) in &hashes_after {
                        if hashes_before.get(k) != Some(v) {
                            tally.add("hash taken");
                            prop_assert_eq!(req.hashes.get(k), Some(v));
                        }
                    }
                }
                for k in resp.hashes.keys() {
                    prop_assert!(*k >= req.known_hashes);
                }
            }
        }
    }
    t.expire(now + ttl * 10 + 1);
    prop_assert!(t.stats().is_empty(), "nothing outlives 10 TTLs");
    Ok(tally)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn tracker_announce_invariants(
        max_peers in 0usize..6,
        ops in proptest::collection::vec(tracker_op(), 1..80),
    ) {
        run_tracker(max_peers, &ops)?;
    }
}
