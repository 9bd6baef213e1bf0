//! Rack stripes and source stripes: what may be asked from outside the rack or of
//! the source, and when patience lets anyone ask; a request waiting at the source.

use super::*;

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
        hashes_epoch: 0,
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
fn a_quiet_rack_stripe_is_distrusted_once_and_for_the_rest_of_the_blob() {
    let cfg = SchedulerConfig {
        stripe_quiet_ms: 10_000,
        ..Default::default()
    };
    let mut s = PieceScheduler::new(Bitfield::new(8), MB, cfg);
    s.set_stripe(Some((1, 2)));
    s.set_peer_at("far", Some(bits(8, &[1, 3])), 2, 0);
    // No tracker answer yet: no clock to count from.
    assert!(!s.check_stripe_quiet(60_000));
    s.set_members(3, 1_000);
    assert!(!s.check_stripe_quiet(10_999), "not quiet long enough");
    // Something arrived: the clock starts again.
    s.on_done(1, "far", 5_000);
    assert!(!s.check_stripe_quiet(14_999));
    assert_eq!(s.far_have_stripe(), Some((1, 2)));
    assert!(s.check_stripe_quiet(15_000), "quiet for 10 s");
    assert_eq!(s.far_have_stripe(), None, "far holders now send every HAVE");
    assert!(!s.check_stripe_quiet(30_000), "reported once");
    // Pieces arriving again do not bring the stripe back for this blob.
    s.on_progress("far", 31_000);
    assert_eq!(s.far_have_stripe(), None);
    assert_eq!(
        s.stripe(),
        Some((1, 2)),
        "the tracker's stripe itself stays"
    );
}

#[test]
fn a_node_without_a_stripe_or_with_every_piece_distrusts_nothing() {
    let mut s = PieceScheduler::new(Bitfield::new(4), MB, SchedulerConfig::default());
    s.set_members(3, 0);
    assert!(!s.check_stripe_quiet(60_000), "no stripe to distrust");
    let mut full = Bitfield::new(4);
    for i in 0..4 {
        full.set(i);
    }
    let mut done = PieceScheduler::new(full, MB, SchedulerConfig::default());
    done.set_stripe(Some((0, 2)));
    done.set_members(3, 0);
    assert!(!done.check_stripe_quiet(60_000), "nothing missing");
    assert_eq!(done.far_have_stripe(), Some((0, 2)));
}

#[test]
fn only_peers_reset_the_peer_quiet_clock() {
    let mut s = PieceScheduler::new(Bitfield::new(8), MB, SchedulerConfig::default());
    s.set_peer_at("near", Some(bits(8, &[0, 1, 2])), 0, 0);
    assert_eq!(s.peer_quiet_ms(5_000), u64::MAX, "no tracker answer yet");
    s.set_members(2, 1_000);
    assert_eq!(s.peer_quiet_ms(3_000), 2_000);
    // The registry stream's pieces are this node's own doing, not the swarm's.
    s.on_done(5, "\u{0}registry", 2_500);
    assert_eq!(s.peer_quiet_ms(3_000), 2_000);
    s.on_progress("near", 3_000);
    assert_eq!(s.peer_quiet_ms(3_500), 500);
    s.on_done(0, "near", 4_000);
    assert_eq!(s.peer_quiet_ms(4_000), 0);
}
