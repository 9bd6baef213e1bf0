//! The tracker's decisions, announce by announce: election, geometry, handouts,
//! reports, rack and source stripes.

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
    let resp = ann(&mut t, &other, 1);
    assert_eq!(
        resp.size,
        Some(64 << 20),
        "a member's other size is not taken"
    );
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

/// A member announces a wrong size before anyone has read the blob, and keeps saying
/// it: the source elected later reads the registry's, which replaces it, with the
/// hashes and every bitfield laid out by the lie.
#[test]
fn a_size_said_first_by_a_member_gives_way_to_the_sources() {
    let d = Digest::of(b"lied about");
    let mut t = TrackerState::new(SwarmConfig::default());
    let mut liar = req("liar", &d);
    liar.size = Some(32 << 20);
    liar.piece_size = Some(1 << 20);
    ann(&mut t, &liar, 0);
    let mut early = req("early", &d);
    early.have = Some(Bitfield::full(32));
    assert_eq!(ann(&mut t, &early, 1).role, Role::Peer);
    let mut gone = liar.clone();
    gone.leaving = true;
    ann(&mut t, &gone, 2);
    let elected = ann(&mut t, &req("honest", &d), 3);
    assert_eq!(elected.role, Role::Source);
    assert_eq!(
        elected.size,
        Some(32 << 20),
        "the lie, until the source reads"
    );
    let epoch = elected.hashes_epoch;

    let mut read = req("honest", &d);
    read.size = Some(256 << 20);
    read.piece_size = Some(4 << 20);
    let resp = ann(&mut t, &read, 4);
    assert_eq!((resp.size, resp.piece_size), (Some(256 << 20), 4 << 20));
    assert_eq!(resp.role, Role::Source);
    assert!(
        resp.hashes_epoch > epoch,
        "the old layout's hashes are void"
    );
    assert!(
        resp.peers.iter().all(|p| p.node != "early"),
        "a bitfield of the old layout is not handed out"
    );

    // The liar goes on: its size is not taken, and the answer says the one in force.
    ann(&mut t, &liar, 5);
    let mut stale = req("early", &d);
    stale.size = Some(32 << 20);
    stale.have = Some(Bitfield::full(12));
    let resp = ann(&mut t, &stale, 6);
    assert_eq!(resp.size, Some(256 << 20));
    let s = t.stats().pop().unwrap();
    assert_eq!((s.size, s.piece_size), (Some(256 << 20), 4 << 20));
    let early = ann(&mut t, &req("probe", &d), 7)
        .peers
        .into_iter()
        .find(|p| p.node == "early")
        .expect("early handed out");
    assert_eq!(
        early.have.map(|h| h.count()),
        Some(0),
        "a bitfield sent with another size says nothing"
    );
    // Only the elected source moves the size: the liar's next word changes nothing.
    let mut again = liar.clone();
    again.size = Some(16 << 20);
    ann(&mut t, &again, 8);
    assert_eq!(t.stats().pop().unwrap().size, Some(256 << 20));
}

/// The liar says first that it holds the whole blob at a wrong size: no one is elected
/// while it counts as a holder. A member that read the registry's size reports it, is
/// elected, and moves the size; the liar's next "complete" at its own size is no claim
/// to hold this swarm's blob.
#[test]
fn a_holder_claimed_at_a_wrong_size_gives_way_to_a_member_that_reports_it() {
    let d = Digest::of(b"held at a lie");
    let mut t = TrackerState::new(SwarmConfig::default());
    let mut liar = req("liar", &d);
    liar.size = Some(32 << 20);
    liar.complete = true;
    ann(&mut t, &liar, 0);
    let unsure = ann(&mut t, &req("honest", &d), 1);
    assert_eq!(
        unsure.role,
        Role::Peer,
        "a complete holder: nobody to elect"
    );
    let mut reporting = req("honest", &d);
    reporting.bad_peers = vec!["liar".into()];
    assert_eq!(ann(&mut t, &reporting, 2).role, Role::Source);
    reporting.size = Some(48 << 20);
    let resp = ann(&mut t, &reporting, 3);
    assert_eq!(resp.size, Some(48 << 20), "not proven by the reported liar");
    assert!(resp.peers.iter().all(|p| p.node != "liar"));

    ann(&mut t, &liar, 4);
    let other = ann(&mut t, &req("other", &d), 5);
    let handed = other.peers.iter().find(|p| p.node == "liar");
    assert!(
        handed.is_none_or(|p| p.have.is_some()),
        "the liar is no complete holder at the size in force: {handed:?}"
    );
    assert_eq!(t.stats().pop().unwrap().size, Some(48 << 20));
}

#[test]
fn a_piece_size_proposed_without_a_size_lays_nothing_out() {
    let d = Digest::of(b"sizeless");
    let mut t = TrackerState::new(SwarmConfig::default());
    let mut first = req("a", &d);
    first.piece_size = Some(crate::pieces::MIN_PIECE_SIZE);
    assert_eq!(ann(&mut t, &first, 0).piece_size, 1, "no layout yet");
    // 1 TiB in the 64 KiB pieces proposed would be 2^24 pieces, and every handout
    // would carry 2 MiB bitfields (found by the announce property test).
    let mut sized = req("b", &d);
    sized.size = Some(1 << 40);
    let resp = ann(&mut t, &sized, 1);
    assert_eq!(
        (resp.size, resp.piece_size),
        (Some(1 << 40), piece_size_for(1 << 40, None))
    );
    assert_eq!(t.stats()[0].peers, 2);
}

/// A member proposing a piece size no link would get from the rule (the first
/// announce lays the swarm out) gets the nearest one the rule gives; an honest
/// proposal, or the tracker's configured piece size, stands.
#[test]
fn a_piece_size_no_link_would_choose_is_brought_within_the_rule() {
    use crate::pieces::{MAX_PIECE_SIZE, MIN_PIECE_SIZE};
    let layout = |cfg: SwarmConfig, size: u64, proposed: u64| {
        let d = Digest::of(format!("{size}/{proposed}").as_bytes());
        let mut t = TrackerState::new(cfg);
        let mut first = req("first", &d);
        first.size = Some(size);
        first.piece_size = Some(proposed);
        let said = ann(&mut t, &first, 0).piece_size;
        let mut later = req("later", &d);
        later.size = Some(size);
        assert_eq!(ann(&mut t, &later, 1).piece_size, said, "one layout");
        said
    };
    let gib = 1u64 << 30;
    // 1 GiB: the rule gives 1 MiB (slowest link) to 32 MiB (32 pieces).
    assert_eq!(
        layout(SwarmConfig::default(), gib, MAX_PIECE_SIZE),
        32 << 20
    );
    assert_eq!(layout(SwarmConfig::default(), gib, MIN_PIECE_SIZE), 1 << 20);
    assert_eq!(
        layout(SwarmConfig::default(), 4 * gib, MIN_PIECE_SIZE),
        1 << 20
    );
    for link in [1, 8 << 20, 25 << 20, 100 << 20, 3 << 30, 50 << 30] {
        for size in [2 << 20, 300 << 20, gib, 15 * gib] {
            let honest = piece_size_for(size, Some(link));
            assert_eq!(layout(SwarmConfig::default(), size, honest), honest);
        }
    }
    let configured = SwarmConfig {
        piece_size: Some(128 << 20),
        ..SwarmConfig::default()
    };
    assert_eq!(layout(configured.clone(), gib, 128 << 20), 128 << 20);
    assert_eq!(layout(configured, gib, MAX_PIECE_SIZE), 32 << 20);
}

/// The elected source's word replaces a lie about the size, but its piece size is
/// bounded the same way as anyone's: an elected node is not thereby honest.
#[test]
fn an_elected_sources_piece_size_is_bounded_too() {
    let d = Digest::of(b"source proposes");
    let mut t = TrackerState::new(SwarmConfig::default());
    let mut liar = req("liar", &d);
    liar.size = Some(32 << 20);
    ann(&mut t, &liar, 0);
    let mut gone = liar.clone();
    gone.leaving = true;
    ann(&mut t, &gone, 1);
    assert_eq!(ann(&mut t, &req("source", &d), 2).role, Role::Source);
    let mut read = req("source", &d);
    read.size = Some(1 << 30);
    read.piece_size = Some(crate::pieces::MAX_PIECE_SIZE);
    let resp = ann(&mut t, &read, 3);
    assert_eq!((resp.size, resp.piece_size), (Some(1 << 30), 32 << 20));
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
fn a_source_elected_before_the_size_was_known_leaves_a_small_blob_to_everyone() {
    let d = Digest::of(b"config");
    let mut t = TrackerState::new(SwarmConfig::default());
    assert_eq!(ann(&mut t, &req("first", &d), 0).role, Role::Source);
    assert_eq!(ann(&mut t, &req("second", &d), 1).role, Role::Peer);
    let mut small = req("first", &d);
    small.size = Some(677);
    small.leaving = true;
    ann(&mut t, &small, 2);
    let resp = ann(&mut t, &req("second", &d), 3);
    assert_eq!(resp.role, Role::Direct);
    assert_eq!(resp.size, Some(677));
    let stats = &t.stats()[0];
    assert_eq!(
        (stats.peers, stats.source.as_deref()),
        (0, None),
        "{stats:?}"
    );
    assert_eq!(stats.source_elections, 1);
    t.expire(4);
    assert!(t.stats().is_empty(), "an empty small swarm is dropped");
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
fn a_rack_member_reported_by_a_quorum_leaves_the_stripes() {
    let d = Digest::of(b"stripes without the unreachable");
    let mut t = TrackerState::new(SwarmConfig {
        stripe_min_members: 4,
        bad_peer_quorum: 2,
        ..Default::default()
    });
    let member = |name: &str| {
        let mut q = req(name, &d);
        q.size = Some(64 << 20);
        q.topology = Topology {
            zone: Some("z".into()),
            rack: Some("r0".into()),
        };
        q
    };
    for n in ["a", "b", "c", "x"] {
        ann(&mut t, &member(n), 0);
    }
    let stripes = |t: &mut TrackerState, now: u64| -> Vec<Option<[u32; 2]>> {
        ["a", "b", "c", "x"]
            .iter()
            .map(|n| ann(t, &member(n), now).stripe)
            .collect()
    };
    assert!(stripes(&mut t, 1)
        .iter()
        .all(|s| s.is_some_and(|[_, n]| n == 4)));
    // One report is not a quorum: one member cannot reshape the rack.
    let mut a = member("a");
    a.bad_peers = vec!["x".into()];
    ann(&mut t, &a, 2);
    assert!(stripes(&mut t, 3)
        .iter()
        .all(|s| s.is_some_and(|[_, n]| n == 4)));
    let mut b = member("b");
    b.bad_peers = vec!["x".into()];
    ann(&mut t, &b, 4);
    let now = stripes(&mut t, 5);
    let mut idx: Vec<u32> = now[..3]
        .iter()
        .map(|s| {
            let [i, n] = s.expect("a stripe");
            assert_eq!(n, 3, "three members share the rack's far pieces");
            i
        })
        .collect();
    idx.sort_unstable();
    assert_eq!(idx, [0, 1, 2], "and every share has its member");
    assert_eq!(
        now[3], None,
        "the reported member takes its far pieces from anyone"
    );
    // The reports lapse (`bad_peer_ms`): back in the stripes (once every member has
    // announced again, as the others' entries went stale meanwhile).
    let later = 5 + SwarmConfig::default().bad_peer_ms;
    stripes(&mut t, later);
    assert!(stripes(&mut t, later)
        .iter()
        .all(|s| s.is_some_and(|[_, n]| n == 4)));
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

/// A source announcing as fetching from the registry, `size` bytes.
fn fetching(node: &str, d: &Digest) -> AnnounceRequest {
    let mut r = req(node, d);
    r.size = Some(64 << 20);
    r.fetching_from_registry = true;
    r
}

/// A member holding the whole blob, said to be `size` bytes (a seeding heartbeat).
fn holding(node: &str, d: &Digest, size: u64) -> AnnounceRequest {
    let mut r = req(node, d);
    r.size = Some(size);
    r.complete = true;
    r
}

fn reporting(node: &str, d: &Digest, accused: &str) -> AnnounceRequest {
    let mut r = req(node, d);
    r.bad_peers = vec![accused.into()];
    r
}

#[test]
fn a_source_the_fetching_members_cannot_reach_is_demoted_and_replaced() {
    let d = Digest::of(b"unreachable source");
    let mut t = TrackerState::new(SwarmConfig::default());
    assert_eq!(ann(&mut t, &fetching("a", &d), 0).role, Role::Source);
    for n in ["b", "c", "d"] {
        ann(&mut t, &req(n, &d), 1);
    }
    // One report of three members fetching is not a quorum: a stays.
    ann(&mut t, &reporting("b", &d, "a"), 2);
    assert_eq!(ann(&mut t, &fetching("a", &d), 3).role, Role::Source);
    assert_eq!(t.take_demoted(&d), None);
    ann(&mut t, &reporting("c", &d, "a"), 4);
    let resp = ann(&mut t, &reporting("d", &d, "a"), 5);
    assert_eq!(
        resp.role,
        Role::Source,
        "the third report demotes a, and the reporter is elected in its place"
    );
    assert_eq!(resp.source.as_deref(), Some("d"));
    assert_eq!(t.take_demoted(&d).as_deref(), Some("a"));
    assert_eq!(t.take_demoted(&d), None, "told once");
    let demoted = ann(&mut t, &fetching("a", &d), 6);
    assert_eq!(
        demoted.role,
        Role::Peer,
        "still reading the registry, but not elected again"
    );
    assert_eq!(demoted.source.as_deref(), Some("d"));
    assert_eq!(t.stats()[0].source_elections, 2);
}

/// Members spread over tracker replicas (a Service balancing their connections) report
/// the source to different ones: a quorum is counted over what every replica heard.
#[test]
fn reports_heard_by_another_replica_count_toward_a_demotion() {
    let d = Digest::of(b"reports across replicas");
    let (mut here, mut there) = (
        TrackerState::new(SwarmConfig::default()),
        TrackerState::new(SwarmConfig::default()),
    );
    for t in [&mut here, &mut there] {
        assert_eq!(ann(t, &fetching("a", &d), 0).role, Role::Source);
        for n in ["b", "c", "d"] {
            ann(t, &req(n, &d), 1);
        }
    }
    ann(&mut there, &reporting("b", &d, "a"), 2);
    let shared: Vec<SharedReport> = there
        .take_reports(&d)
        .into_iter()
        .map(|(accused, until)| SharedReport {
            accused,
            reporter: "b".into(),
            until,
        })
        .collect();
    assert_eq!(shared.len(), 1, "the report is handed to the store once");
    assert!(there.take_reports(&d).is_empty());
    ann(&mut here, &reporting("c", &d, "a"), 3);
    let resp = ann(&mut here, &reporting("d", &d, "a"), 4);
    assert_eq!(
        resp.source.as_deref(),
        Some("a"),
        "two reports of three members fetching are no quorum on their own"
    );
    here.adopt(
        &d,
        SharedSwarm {
            source: Some("a".into()),
            reports: Some(shared.clone()),
            ..SharedSwarm::default()
        },
        5,
    );
    let resp = ann(&mut here, &reporting("d", &d, "a"), 5);
    assert_eq!(
        resp.source.as_deref(),
        Some("d"),
        "with b's report, a is demoted"
    );
    assert_eq!(here.take_demoted(&d).as_deref(), Some("a"));
    // A report of a name the swarm does not know, or one that lapsed, is not taken.
    let mut stale = shared[0].clone();
    stale.until = 6;
    let stranger = SharedReport {
        accused: "nobody".into(),
        ..shared[0].clone()
    };
    there.adopt(
        &d,
        SharedSwarm {
            source: Some("a".into()),
            reports: Some(vec![stale, stranger]),
            ..SharedSwarm::default()
        },
        7,
    );
    assert_eq!(there.swarms[&d].live_reports("nobody", 7), 0);
}

#[test]
fn in_a_two_node_swarm_the_only_member_can_demote_an_unreachable_source() {
    let d = Digest::of(b"pair");
    let mut t = TrackerState::new(SwarmConfig::default());
    assert_eq!(ann(&mut t, &fetching("a", &d), 0).role, Role::Source);
    assert_eq!(ann(&mut t, &req("b", &d), 1).role, Role::Peer);
    assert_eq!(
        ann(&mut t, &reporting("b", &d, "a"), 2).role,
        Role::Source,
        "the only member that needs the source is the only one who can say so"
    );
    assert_eq!(ann(&mut t, &fetching("a", &d), 3).role, Role::Peer);
}

#[test]
fn members_that_all_report_each_other_still_have_a_source() {
    let d = Digest::of(b"partitioned");
    let mut t = TrackerState::new(SwarmConfig::default());
    assert_eq!(ann(&mut t, &fetching("a", &d), 0).role, Role::Source);
    assert_eq!(ann(&mut t, &req("b", &d), 1).role, Role::Peer);
    let mut a = fetching("a", &d);
    a.bad_peers = vec!["b".into()];
    ann(&mut t, &a, 1);
    assert_eq!(ann(&mut t, &reporting("b", &d, "a"), 2).role, Role::Peer);
    assert_eq!(
        ann(&mut t, &fetching("a", &d), 3).role,
        Role::Source,
        "nobody else could take its place: a keeps the role, as before reports"
    );
    assert_eq!(t.take_demoted(&d), None);
    // The source finishes and goes: the other is elected, reported or not.
    let mut done = req("a", &d);
    done.complete = true;
    ann(&mut t, &done, 4);
    assert_eq!(ann(&mut t, &reporting("b", &d, "a"), 5).role, Role::Source);
}

#[test]
fn only_the_source_can_void_the_hashes_and_that_starts_a_new_epoch() {
    let d = Digest::of(b"bad bytes once");
    let mut t = TrackerState::new(SwarmConfig::default());
    let mut src = fetching("a", &d);
    src.piece_size = Some(1 << 20);
    src.hashes.insert(0, h(0));
    src.hashes.insert(1, h(1));
    assert_eq!(ann(&mut t, &src, 0).role, Role::Source);
    let resp = ann(&mut t, &req("b", &d), 1);
    assert_eq!((resp.hashes.len(), resp.hashes_epoch), (2, 0));
    // A member cannot void them.
    let mut liar = req("b", &d);
    liar.hashes_void = true;
    ann(&mut t, &liar, 2);
    assert!(!t.take_voided(&d));
    assert_eq!(t.hashes(&d, 0).len(), 2);
    // The source's bytes failed the digest: it leaves and voids what it published.
    let mut failed = req("a", &d);
    failed.leaving = true;
    failed.hashes_void = true;
    failed.hashes.insert(2, h(2));
    ann(&mut t, &failed, 3);
    assert!(t.take_voided(&d), "told once, for the shared store");
    assert!(!t.take_voided(&d));
    assert!(
        t.hashes(&d, 0).is_empty(),
        "nothing of the bad bytes is kept"
    );
    let resp = ann(&mut t, &fetching("b", &d), 4);
    assert_eq!(resp.role, Role::Source, "someone reads the registry again");
    assert_eq!((resp.hashes.len(), resp.hashes_epoch), (0, 1));
}

#[test]
fn a_node_the_registry_cannot_answer_is_handed_the_holders_of_a_small_blob() {
    let d = Digest::of(b"config");
    let mut t = TrackerState::new(SwarmConfig::default());
    ann(&mut t, &holding("holder", &d, 677), 0);
    let mut fetching = req("fetching", &d);
    fetching.size = Some(677);
    let resp = ann(&mut t, &fetching, 1);
    assert_eq!(resp.role, Role::Direct, "the registry serves a small blob");
    assert!(resp.peers.iter().all(|p| p.node != "fetching"));
    let mut refused = req("refused", &d);
    refused.registry_unavailable = true;
    let resp = ann(&mut t, &refused, 2);
    assert_eq!(resp.role, Role::Peer);
    assert_eq!(resp.size, Some(677));
    let holders: Vec<_> = resp
        .peers
        .iter()
        .map(|p| (p.node.as_str(), p.have.is_none()))
        .collect();
    assert_eq!(holders, [("holder", true)], "only the complete holder");
    assert_eq!(t.stats()[0].source, None);
}

#[test]
fn a_node_the_registry_cannot_answer_is_never_elected() {
    let d = Digest::of(b"layer");
    let mut t = TrackerState::new(SwarmConfig::default());
    let mut refused = req("refused", &d);
    refused.registry_unavailable = true;
    let resp = ann(&mut t, &refused, 0);
    assert_eq!((resp.role, resp.source), (Role::Peer, None));
    assert_eq!(ann(&mut t, &req("able", &d), 200).role, Role::Source);
    // A source that loses the registry hands the role on.
    let mut lost = req("able", &d);
    lost.registry_unavailable = true;
    assert_eq!(ann(&mut t, &lost, 300).role, Role::Peer);
    assert_eq!(t.stats()[0].source, None);
    assert_eq!(ann(&mut t, &req("other", &d), 400).role, Role::Source);
}

/// A small swarm elects no source to mend its size: a complete holder's claim mends it
/// once the member that set it is reported, and never while an unreported holder backs
/// it.
#[test]
fn a_small_swarms_size_is_mended_by_a_holder_once_its_liar_is_reported() {
    let d = Digest::of(b"small layer");
    let mut t = TrackerState::new(SwarmConfig::default());
    ann(&mut t, &holding("liar", &d, 676), 0);
    let resp = ann(&mut t, &holding("holder", &d, 677), 10);
    assert_eq!(
        resp.size,
        Some(676),
        "the liar backs its size: the holder waits"
    );
    let mut refused = req("refused", &d);
    refused.registry_unavailable = true;
    let resp = ann(&mut t, &refused, 20);
    assert_eq!(resp.peers.len(), 1, "only the liar is handed out");
    refused.leaving = true;
    refused.bad_peers = vec!["liar".into()];
    ann(&mut t, &refused, 30);
    let resp = ann(&mut t, &holding("holder", &d, 677), 40);
    assert_eq!(resp.size, Some(677), "the reported liar backs nothing");
    let resp = ann(&mut t, &holding("liar", &d, 676), 50);
    assert_eq!(resp.size, Some(677), "the holder backs the size now");
    refused.leaving = false;
    refused.bad_peers.clear();
    let resp = ann(&mut t, &refused, 60);
    let holders: Vec<_> = resp.peers.iter().map(|p| p.node.as_str()).collect();
    assert_eq!(holders, ["holder"]);
}

/// A large layer claimed whole at a small size: the first node that checked the size
/// with the registry reports the claim, and its next announce lays the swarm out anew
/// and elects it. A fetcher cannot move a small blob's size while its holders back it,
/// nor can one the registry does not answer.
#[test]
fn a_large_layer_claimed_small_is_mended_by_the_node_that_will_read_it() {
    let d = Digest::of(b"large layer");
    let mut t = TrackerState::new(SwarmConfig::default());
    ann(&mut t, &holding("liar", &d, 4096), 0);
    let mut b = req("b", &d);
    b.size = Some(12 << 20);
    let resp = ann(&mut t, &b, 10);
    assert_eq!((resp.role, resp.size), (Role::Direct, Some(4096)));
    let mut unable = b.clone();
    unable.node = "unable".into();
    unable.registry_unavailable = true;
    unable.bad_peers = vec!["liar".into()];
    assert_eq!(
        ann(&mut t, &unable, 15).size,
        Some(4096),
        "it cannot read it"
    );
    b.bad_peers = vec!["liar".into()];
    let resp = ann(&mut t, &b, 20);
    assert_eq!(
        (resp.role, resp.size),
        (Role::Source, Some(12 << 20)),
        "reported by then, the liar backs nothing"
    );

    let small = Digest::of(b"small blob");
    ann(&mut t, &holding("holder", &small, 677), 0);
    let mut mover = req("mover", &small);
    mover.size = Some(12 << 20);
    let resp = ann(&mut t, &mover, 10);
    assert_eq!((resp.role, resp.size), (Role::Direct, Some(677)));
}

/// A source elected before the size was known is the one to mend a small size, not a
/// member beside it (found by the property test: the member's mend kept the source's
/// entry and left it elected on the old layout).
#[test]
fn a_small_swarms_size_is_not_mended_around_its_source() {
    let d = Digest::of(b"unknown size");
    let mut t = TrackerState::new(SwarmConfig::default());
    assert_eq!(ann(&mut t, &req("first", &d), 0).role, Role::Source);
    let mut refused = req("refused", &d);
    refused.size = Some(1000);
    refused.registry_unavailable = true;
    assert_eq!(ann(&mut t, &refused, 10).size, Some(1000));
    let mut b = req("b", &d);
    b.size = Some(12 << 20);
    let resp = ann(&mut t, &b, 20);
    assert_eq!(
        (resp.size, resp.source.as_deref()),
        (Some(1000), Some("first"))
    );
}
