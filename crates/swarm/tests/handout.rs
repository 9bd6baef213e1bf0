//! The tracker's peer handout at scale: the policy's properties must hold when the
//! swarm is too big to rank in full (more than 256 givers), and small swarms must get
//! exactly the ranked policy.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use std::collections::BTreeMap;

use oci::Digest;
use swarm::{AnnounceRequest, Bitfield, PeerInfo, SwarmConfig, Topology, TrackerState};

const PIECES: u32 = 64;

fn topo(zone: usize, rack: usize) -> Topology {
    Topology {
        zone: Some(format!("z{zone}")),
        rack: Some(format!("r{rack}")),
    }
}

fn req(node: &str, d: &Digest, t: Topology, held: u32) -> AnnounceRequest {
    let mut have = Bitfield::new(PIECES);
    for i in 0..held.min(PIECES) {
        have.set(i);
    }
    AnnounceRequest {
        node: node.into(),
        addr: format!("{node}:1"),
        topology: t,
        digest: d.clone(),
        // A head piece and the rest of the first MiB, then whole MiBs: PIECES pieces.
        size: Some((PIECES as u64 - 1) * (1 << 20)),
        piece_size: Some(1 << 20),
        have: Some(have),
        complete: false,
        fetching_from_registry: false,
        hashes: BTreeMap::new(),
        known_hashes: 0,
        bad_peers: vec![],
        leaving: false,
        wait_for_size_ms: 0,
        hashes_void: false,
        registry_unavailable: false,
    }
}

/// `n` peers in racks of 32 and zones of 10 racks; peer i holds `held(i)` pieces.
/// The first announcer ("p0") is elected source.
fn swarm(n: usize, held: impl Fn(usize) -> u32) -> (TrackerState, Digest) {
    let d = Digest::of(b"big");
    let mut t = TrackerState::new(SwarmConfig::default());
    for i in 0..n {
        let rack = i / 32;
        let mut r = req(&format!("p{i}"), &d, topo(rack / 10, rack), held(i));
        r.fetching_from_registry = i == 0;
        t.announce(&r, 1).unwrap();
    }
    (t, d)
}

fn names(peers: &[PeerInfo]) -> Vec<String> {
    peers.iter().map(|p| p.node.clone()).collect()
}

#[test]
fn big_swarm_handout_is_deterministic() {
    let held = |i: usize| (i % 7) as u32;
    let (mut a, d) = swarm(3000, held);
    let (mut b, _) = swarm(3000, held);
    for me in ["p5", "p1234", "p2999"] {
        let i: usize = me[1..].parse().unwrap_or(0);
        let r = req(me, &d, topo(i / 320, i / 32), 3);
        assert_eq!(
            names(&a.announce(&r, 2).unwrap().peers),
            names(&b.announce(&r, 2).unwrap().peers),
            "{me}"
        );
    }
}

#[test]
fn big_swarm_handout_keeps_the_policy() {
    // 4,000 peers, every seventh holds nothing (never handed out); 40 complete seeds
    // far away (zone 9); the source holds one piece.
    let d = Digest::of(b"big");
    let mut t = TrackerState::new(SwarmConfig::default());
    let max = t.cfg.max_peers;
    let mut src = req("src", &d, topo(5, 55), 1);
    src.fetching_from_registry = true;
    t.announce(&src, 0).unwrap();
    for i in 0..4000 {
        let rack = i / 32;
        let held = if i % 7 == 0 { 0 } else { 1 + (i % 5) as u32 };
        t.announce(&req(&format!("p{i}"), &d, topo(rack / 10, rack), held), 1)
            .unwrap();
    }
    for i in 0..40 {
        let mut s = req(&format!("seed{i}"), &d, topo(9, 99), PIECES);
        s.complete = true;
        s.have = None;
        t.announce(&s, 1).unwrap();
    }
    // A requester in rack 3 (zone 0): racks hold 32 peers, 27 or 28 of them givers.
    // It asks in the next announce interval, so the handouts made while the swarm
    // formed (each peer's own announce) do not count against anyone's budget.
    let me = req("me", &d, topo(0, 3), 0);
    let resp = t.announce(&me, 1_000).unwrap();
    let peers = resp.peers;
    assert_eq!(peers.len(), max);
    let mut seen = peers.iter().map(|p| &p.node).collect::<Vec<_>>();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), max, "no duplicates");
    for p in &peers {
        let i: Option<usize> = p.node.strip_prefix('p').and_then(|x| x.parse().ok());
        assert!(
            i.is_none_or(|i| i % 7 != 0),
            "a peer holding nothing: {}",
            p.node
        );
        assert_ne!(p.node, "me");
    }
    let same_rack = peers
        .iter()
        .filter(|p| p.topology.rack.as_deref() == Some("r3"))
        .count();
    assert!(
        same_rack >= (max * 3).div_ceil(4) - 1,
        "three quarters near (one may yield to the source): {same_rack} of {max}"
    );
    // The near slots take the rack's most useful peers, in doublings of what they can
    // give: 3 to 5 pieces rank alike, above 1 or 2.
    let useful_in_rack = (96..128).filter(|i| i % 7 != 0 && 1 + i % 5 >= 4).count();
    let got_useful = peers
        .iter()
        .filter(|p| p.topology.rack.as_deref() == Some("r3"))
        .filter(|p| p.have.as_ref().is_some_and(|h| h.count() >= 4))
        .count();
    assert_eq!(got_useful, useful_in_rack.min(same_rack));
    // The far quarter goes to the most useful peers anywhere: the seeds.
    let seeds = peers.iter().filter(|p| p.have.is_none()).count();
    assert!(seeds >= max / 4 - 1, "far slots to complete seeds: {seeds}");

    // The source (one piece, rack 55) is in its own rack's handouts, and in a small
    // share of the others': it serves a few peers at a time.
    let near_src = t
        .announce(&req("near-src", &d, topo(5, 55), 0), 1_000)
        .unwrap();
    assert!(
        near_src.peers.iter().any(|p| p.node == "src"),
        "rack-mates see the source"
    );
    let with_source = (0..400)
        .filter(|i| {
            let r = req(&format!("far{i}"), &d, topo(1, 10 + i % 10), 0);
            t.announce(&r, 1_000)
                .unwrap()
                .peers
                .iter()
                .any(|p| p.node == "src")
        })
        .count();
    assert!(
        (1..=40).contains(&with_source),
        "the source in about 64 of 4,000 handouts per round: {with_source} of 400"
    );
}

#[test]
fn big_swarm_handouts_leave_out_peers_with_nothing_to_give_and_spread_the_load() {
    // 1,000 peers holding pieces 0..4; the 200 in racks 25-31 also hold piece 60; one
    // complete seed, the best pick for everyone.
    let d = Digest::of(b"big");
    let mut t = TrackerState::new(SwarmConfig::default());
    let max = t.cfg.max_peers;
    for i in 0..1000 {
        let rack = i / 32;
        let mut r = req(&format!("p{i}"), &d, topo(rack / 10, rack), 4);
        if i >= 800 {
            if let Some(h) = r.have.as_mut() {
                h.set(60);
            }
        }
        t.announce(&r, 1).unwrap();
    }
    let mut seed = req("seed", &d, topo(9, 99), PIECES);
    seed.complete = true;
    seed.have = None;
    t.announce(&seed, 1).unwrap();
    // 300 requesters holding what the many hold, in one announce interval.
    let mut seed_named = 0;
    for i in 0..300 {
        let r = req(&format!("q{i}"), &d, topo(i % 3, 100 + i % 30), 4);
        let peers = t.announce(&r, 1_000).unwrap().peers;
        assert_eq!(peers.len(), max, "handouts stay full");
        // p0, the first to announce, is the source: it is streaming, so what it
        // announced is already out of date, and it may be handed out regardless.
        for p in peers.iter().filter(|p| p.node != "p0") {
            assert!(
                p.have.is_none() || p.have.as_ref().is_some_and(|h| h.get(60)),
                "{} has nothing this requester lacks",
                p.node
            );
        }
        seed_named += usize::from(peers.iter().any(|p| p.node == "seed"));
    }
    // Without the budget the seed would be in all 300 views and refuse nearly all of
    // them; with it, in about two handouts' worth per peer.
    assert!(
        (1..=2 * max).contains(&seed_named),
        "the seed is named in {seed_named} of 300 handouts"
    );
}

/// The ranked policy, computed the slow way over every peer (the reference).
fn reference(
    all: &[(String, Topology, u32)],
    me: &str,
    mine: &Topology,
    max: usize,
    source: &str,
) -> Vec<String> {
    let spread = |b: &str| {
        let mut h: u64 = 0xcbf29ce484222325;
        for byte in me.bytes().chain([0]).chain(b.bytes()) {
            h ^= byte as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h
    };
    let mut c: Vec<_> = all
        .iter()
        // Small swarms hand out members that hold nothing yet too: they are
        // downloading, and their pieces reach connected peers as they complete.
        .filter(|(n, _, _)| n != me)
        .map(|(n, t, h)| {
            (
                mine.distance(t),
                std::cmp::Reverse(*h),
                spread(n),
                n.clone(),
            )
        })
        .collect();
    c.sort();
    let near = (max * 3).div_ceil(4).min(c.len());
    let mut chosen: Vec<_> = c[..near].to_vec();
    let mut rest: Vec<_> = c[near..].to_vec();
    rest.sort_by_key(|k| (k.1, k.0, k.2));
    let far = max.saturating_sub(near).min(rest.len());
    chosen.extend(rest[..far].iter().cloned());
    if !chosen.iter().any(|k| k.3 == source) {
        if let Some(s) = c.iter().find(|k| k.3 == source) {
            if chosen.len() >= max {
                chosen.pop();
            }
            chosen.push(s.clone());
        }
    }
    chosen.sort();
    chosen.into_iter().map(|k| k.3).collect()
}

#[test]
fn small_swarms_get_exactly_the_ranked_policy() {
    let d = Digest::of(b"small");
    let mut t = TrackerState::new(SwarmConfig::default());
    let mut all = Vec::new();
    for i in 0..200usize {
        let (rack, held) = (i / 8, ((i * 37) % 11) as u32);
        let tp = topo(rack / 4, rack);
        let mut r = req(&format!("n{i}"), &d, tp.clone(), held);
        r.fetching_from_registry = i == 0;
        t.announce(&r, 1).unwrap();
        all.push((format!("n{i}"), tp, held));
    }
    for me in [3usize, 77, 150] {
        let tp = topo(me / 32, me / 8);
        let mut r = req(&format!("n{me}"), &d, tp.clone(), all[me].2);
        r.fetching_from_registry = me == 0;
        let got = names(&t.announce(&r, 2).unwrap().peers);
        let want = reference(&all, &format!("n{me}"), &tp, 16, "n0");
        assert_eq!(got, want, "requester n{me}");
    }
}

#[test]
fn seeders_heartbeats_get_no_handout_and_take_no_one_s_turn() {
    // 1,000 fetchers and 300 complete seeders, all announced at t = 1. In one tracker
    // the seeders announce again (their seeding heartbeat) in the interval a fetcher
    // then asks in; in the other they do not. No client reads a handout from a
    // complete member's announce, so none is made: the heartbeats answer no peers, and
    // the fetcher's handout is the same in both (a handout made for a seeder would
    // count its peers as handed out and push them behind others).
    let seeder = |i: usize, d: &Digest| {
        let mut s = req(&format!("seed{i}"), d, topo(i % 4, 200 + i % 40), PIECES);
        s.complete = true;
        s.have = None;
        s
    };
    let build = |heartbeats: bool| {
        let (mut t, d) = swarm(1000, |i| 1 + (i % 9) as u32);
        for i in 0..300 {
            t.announce(&seeder(i, &d), 1).unwrap();
        }
        if heartbeats {
            for i in 0..300 {
                let resp = t.announce(&seeder(i, &d), 1_000).unwrap();
                assert!(resp.peers.is_empty(), "a seeder was handed peers");
            }
        }
        let mut fetched = Vec::new();
        for i in 0..20 {
            let r = req(&format!("q{i}"), &d, topo(i % 4, 200 + i % 40), 2);
            fetched.push(names(&t.announce(&r, 1_000).unwrap().peers));
        }
        fetched
    };
    let quiet = build(false);
    assert!(quiet.iter().all(|p| !p.is_empty()), "fetchers get peers");
    assert_eq!(build(true), quiet);
}
