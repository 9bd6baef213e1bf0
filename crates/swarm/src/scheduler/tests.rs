use super::holders::intersects;
use super::*;

const MB: u64 = 1 << 20;

proptest::proptest! {
    #[test]
    fn intersects_finds_the_one_shared_bit_wherever_it_is(
        a in proptest::collection::vec(proptest::num::u8::ANY, 0..300),
        extra in 0usize..20,
        shared in proptest::option::of((0usize..300, 0u8..8)),
    ) {
        // `b` is `a`'s complement (no bit in common), longer or not, then one bit
        // set in both, or none.
        let mut a = a;
        let mut b: Vec<u8> = a.iter().map(|x| !x).chain(std::iter::repeat_n(0xff, extra)).collect();
        let shared = shared.filter(|&(at, _)| at < a.len());
        if let Some((at, bit)) = shared {
            a[at] |= 1 << bit;
            b[at] |= 1 << bit;
        }
        proptest::prop_assert_eq!(intersects(&a, &b), shared.is_some());
        proptest::prop_assert_eq!(intersects(&b, &a), shared.is_some());
    }
}

fn bits(len: u32, ones: &[u32]) -> Bitfield {
    let mut b = Bitfield::new(len);
    for &i in ones {
        b.set(i);
    }
    b
}

fn sched(len: u32, cfg: SchedulerConfig) -> PieceScheduler {
    PieceScheduler::new(Bitfield::new(len), MB, cfg)
}

#[test]
fn read_head_first_then_rarest_within_windows() {
    let mut s = sched(
        8,
        SchedulerConfig {
            min_window: 2,
            max_window: 2,
            ..Default::default()
        },
    );
    s.set_peer("a", None, 2);
    s.set_peer("b", Some(bits(8, &[0, 1, 2, 3])), 0);
    s.set_peer("c", Some(bits(8, &[0, 1, 2, 3])), 0);
    let reqs = s.next_requests(0, 100);
    assert_eq!(reqs[0].piece, 0);
    assert!(reqs[0].urgent, "the read head is urgent");
    assert!(reqs[1..].iter().all(|r| !r.urgent));
    assert_eq!(reqs.len(), 6, "3 peers × a window of 2");
    let from_a: Vec<u32> = reqs
        .iter()
        .filter(|r| r.peer == "a")
        .map(|r| r.piece)
        .collect();
    assert!(
        from_a.iter().all(|&p| p >= 4),
        "the only holder of rare pieces serves rare pieces: {from_a:?}"
    );
}

#[test]
fn a_head_stuck_as_an_ordinary_request_is_asked_of_another_holder_urgently() {
    let mut s = sched(
        8,
        SchedulerConfig {
            min_window: 2,
            max_window: 2,
            ..Default::default()
        },
    );
    s.set_peer("a", None, 0);
    s.set_peer("b", None, 0);
    let first = s.next_requests(0, 100);
    let next = first
        .iter()
        .filter(|r| !r.urgent)
        .min_by_key(|r| r.piece)
        .expect("ordinary requests")
        .clone();
    let (k, holder) = (next.piece, next.peer.clone());
    // Everything before it arrives: piece k is the head now, still an ordinary
    // request.
    for r in first.iter().filter(|r| r.piece < k) {
        s.on_done(r.piece, &r.peer, 50);
    }
    for i in 0..k {
        s.on_done(i, "a", 50);
    }
    assert_eq!(s.have.prefix(), k);
    assert!(
        s.next_requests(100, 0).iter().all(|r| r.piece != k),
        "not at once: the ordinary request may well be on its way"
    );
    let late = s.next_requests(100 + HEAD_PATIENCE_MS, 0);
    let again: Vec<&Request> = late.iter().filter(|r| r.piece == k).collect();
    assert_eq!(again.len(), 1, "{late:?}");
    assert!(again[0].urgent);
    assert_ne!(again[0].peer, holder, "another holder");
    assert!(
        s.next_requests(100 + 2 * HEAD_PATIENCE_MS, 0)
            .iter()
            .all(|r| r.piece != k),
        "once"
    );
}

#[test]
fn the_budget_caps_everything_but_the_read_head() {
    let mut s = sched(64, SchedulerConfig::default());
    s.set_peer("a", None, 0);
    s.set_peer("b", None, 0);
    let r = s.next_requests(0, 0);
    assert_eq!(r.len(), 1);
    assert!(r[0].urgent);
    let r = s.next_requests(0, 3);
    assert_eq!(r.len(), 3);
}

#[test]
fn a_have_makes_a_piece_requestable_at_once() {
    let mut s = sched(4, SchedulerConfig::default());
    s.set_peer("a", Some(Bitfield::new(4)), 0);
    assert!(s.next_requests(0, 10).is_empty());
    s.peer_has("a", 2, 5);
    let r = s.next_requests(5, 10);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].piece, 2);
    for p in [0, 1, 3] {
        s.peer_has("a", p, 6);
    }
    assert!(!s.knows_peer("b"));
    assert_eq!(s.orphans(), Vec::<u32>::new());
}

#[test]
fn could_request_from_agrees_with_the_next_pass() {
    let cfg = SchedulerConfig {
        min_window: 1,
        max_window: 1,
        patience_ms: 1_000,
        ..Default::default()
    };
    let mut s = sched(8, cfg);
    s.set_stripe(Some((0, 2)));
    s.set_peer("near", Some(Bitfield::new(8)), 0);
    s.set_peer("far", Some(Bitfield::new(8)), 2);
    let near = s.peer_handle("near").expect("a known peer");
    let far = s.peer_handle("far").expect("a known peer");
    // A far holder of a piece outside this node's stripe: not before the patience.
    s.peer_has_handle(far, 3, 0);
    assert!(!s.could_request_from(far, 3, 10));
    assert!(s.next_requests(10, 10).is_empty());
    assert!(s.could_request_from(far, 3, 1_000));
    // A near holder: at once; its window (1) then full, so a second piece not.
    s.peer_has_handle(near, 5, 20);
    assert!(s.could_request_from(near, 5, 20));
    assert_eq!(s.next_requests(20, 10).len(), 1);
    assert!(!s.could_request_from(near, 5, 20), "in flight");
    s.peer_has_handle(near, 6, 21);
    assert!(!s.could_request_from(near, 6, 21), "window full");
    assert!(s.next_requests(21, 10).is_empty());
    // The read head needs no window.
    s.peer_has_handle(near, 0, 22);
    assert!(s.could_request_from(near, 0, 22));
    assert_eq!(s.next_requests(22, 10)[0].piece, 0);
}

#[test]
fn windows_grow_with_the_measured_rate() {
    let cfg = SchedulerConfig {
        min_window: 2,
        max_window: 8,
        window_ms: 100,
        max_inflight_total: 100,
        ..Default::default()
    };
    let mut s = sched(200, cfg);
    s.set_peer("fast", None, 0);
    s.set_peer("slow", None, 0);
    let _ = s.next_requests(0, 100);
    // fast delivers a 1 MiB piece every 2 ms (500 MiB/s), slow every 100 ms.
    let mut t = 0;
    for _ in 0..20 {
        t += 2;
        let p = *s
            .inflight
            .iter()
            .enumerate()
            .find(|(_, v)| v.contains(&s.by_name["fast"]))
            .map(|(i, _)| i as u32)
            .as_ref()
            .unwrap();
        s.on_done(p, "fast", t);
        let _ = s.next_requests(t, 100);
    }
    let fast = s.slot("fast").unwrap().1.inflight;
    let slow = s.slot("slow").unwrap().1.inflight;
    assert!(fast > slow, "fast {fast} in flight, slow {slow}");
    assert!(
        slow <= 3,
        "a window of 2, plus perhaps the urgent read head: {slow}"
    );
    assert!(
        fast >= 8,
        "rate × window_ms / piece = 50, capped at 8: {fast}"
    );
}

fn with_rate(s: &mut PieceScheduler, peer: &str, rate: f64) {
    let i = s.by_name[peer] as usize;
    let (cfg, piece_size) = (s.cfg.clone(), s.piece_size);
    s.slots[i]
        .as_mut()
        .unwrap()
        .set_rate(rate, &cfg, piece_size);
}

#[test]
fn a_holder_not_measured_yet_is_tried_before_measured_ones() {
    let mut s = sched(64, SchedulerConfig::default());
    for p in ["a", "b", "c"] {
        s.set_peer(p, None, 0);
    }
    with_rate(&mut s, "a", 8e6);
    with_rate(&mut s, "b", 9e6);
    let reqs = s.next_requests(0, 1);
    let head = reqs.iter().find(|r| r.urgent).expect("the read head");
    assert_eq!(head.peer, "c", "the unmeasured holder first: {reqs:?}");
    let other = reqs.iter().find(|r| !r.urgent).expect("one more request");
    assert_ne!(other.peer, "c", "c is loaded now: {reqs:?}");
}

#[test]
fn requesters_spread_over_holders_of_the_same_speed() {
    let picks: std::collections::HashSet<String> = (0..8)
        .map(|n| {
            let cfg = SchedulerConfig {
                seed: seed_for(&format!("node-{n}")),
                ..Default::default()
            };
            let mut s = PieceScheduler::new(Bitfield::new(64), MB, cfg);
            for (p, rate) in [("a", 8.0e6), ("b", 8.5e6), ("c", 9.0e6), ("d", 9.5e6)] {
                s.set_peer(p, None, 0);
                with_rate(&mut s, p, rate);
            }
            let reqs = s.next_requests(0, 0);
            reqs[0].peer.clone()
        })
        .collect();
    assert!(
        picks.len() >= 3,
        "8 requesters should not all pick the same of 4 equal holders: {picks:?}"
    );
}

#[test]
fn nodes_starting_together_ask_the_source_for_different_pieces() {
    let firsts: std::collections::HashSet<u32> = (0..8)
        .map(|n| {
            let cfg = SchedulerConfig {
                seed: seed_for(&format!("node-{n}")),
                ..Default::default()
            };
            let mut s = PieceScheduler::new(bits(64, &[0]), MB, cfg);
            s.set_peer("source", None, 0);
            let r = s.next_requests(0, 1);
            r.iter().find(|r| !r.urgent).map(|r| r.piece).unwrap_or(0)
        })
        .collect();
    assert!(
        firsts.len() >= 6,
        "8 nodes should mostly start on different pieces: {firsts:?}"
    );
}

#[test]
fn corrupt_peer_is_banned_busy_peer_rests_and_orphans_are_reported() {
    let mut s = sched(3, SchedulerConfig::default());
    s.set_peer("liar", None, 0);
    let r = s.next_requests(0, 10);
    assert_eq!(r.len(), 2, "the urgent head counts against the window of 2");
    s.on_failed(0, "liar", true);
    assert!(s.is_banned("liar"));
    assert!(s.next_requests(0, 10).is_empty());
    let still_out = r.iter().find(|x| x.piece != 0).map(|x| x.piece);
    let want: Vec<u32> = (0..3).filter(|&p| Some(p) != still_out).collect();
    assert_eq!(
        s.orphans(),
        want,
        "nobody else holds them; one is still in flight"
    );
    s.set_peer("good", Some(bits(3, &[0])), 1);
    let r = s.next_requests(1, 10);
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].piece, r[0].peer.as_str()), (0, "good"));
    s.on_busy(0, "good", 10);
    assert!(s.next_requests(20, 10).is_empty(), "resting");
    assert_eq!(s.next_requests(40, 10).len(), 1, "rested");
    assert!(s.on_done(0, "good", 50));
    assert!(!s.on_done(0, "good", 51));
}

#[test]
fn endgame_asks_a_second_peer_for_the_tail() {
    let mut s = PieceScheduler::new(
        bits(4, &[0, 1, 2]),
        MB,
        SchedulerConfig {
            endgame: 2,
            ..Default::default()
        },
    );
    s.set_peer("slow", None, 0);
    s.set_peer("fast", None, 1);
    let r = s.next_requests(0, 10);
    assert_eq!(
        r.len(),
        2,
        "first request plus its endgame duplicate: {r:?}"
    );
    assert_ne!(r[0].peer, r[1].peer);
    assert!(r.iter().all(|x| x.piece == 3));
    assert!(s.on_done(3, &r[1].peer, 5));
    assert_eq!(s.duplicates_of(3), vec![r[0].peer.clone()]);
    s.forget(3, &r[0].peer);
    assert!(s.is_complete());
    assert_eq!(s.inflight_count(), 0);
}

#[test]
fn endgame_duplicates_take_from_the_budget_but_the_read_head_does_not() {
    let cfg = SchedulerConfig {
        endgame: 2,
        ..Default::default()
    };
    // Pieces 2 (the read head) and 3 missing, two complete peers.
    let mut s = PieceScheduler::new(bits(4, &[0, 1]), MB, cfg);
    s.set_peer("a", None, 0);
    s.set_peer("b", None, 1);
    let first = s.next_requests(0, 1);
    assert_eq!(first.iter().filter(|r| !r.urgent).count(), 1, "{first:?}");
    assert_eq!(
        first.iter().filter(|r| r.urgent && r.piece == 2).count(),
        2,
        "the read head and its duplicate, both outside the budget: {first:?}"
    );
    for budget in 0..3u32 {
        let mut t = s.clone();
        let dup = t.next_requests(1, budget);
        let non_urgent = dup.iter().filter(|r| !r.urgent).count();
        assert_eq!(
            non_urgent,
            (budget as usize).min(1),
            "budget {budget}: {dup:?}"
        );
    }
}

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
fn source_patience_follows_how_long_this_nodes_stripe_took_from_the_source() {
    let cfg = SchedulerConfig {
        min_window: 64,
        max_window: 64,
        max_inflight_total: 64,
        ..Default::default()
    };
    let mut s = PieceScheduler::new(Bitfield::new(64), MB, cfg.clone());
    s.set_source(Some("src"), Some((0, 2)));
    assert_eq!(
        s.source_patience_ms, cfg.source_patience_max_ms,
        "nothing measured"
    );
    // The source announces piece 0 (my stripe) and 1 at 100 ms; 0 arrives 500 ms later.
    s.set_peer_at("src", Some(bits(64, &[0, 1])), 0, 100);
    let r = s.next_requests(100, 64);
    assert_eq!(r.len(), 1, "only my stripe: {r:?}");
    assert!(s.on_done(0, "src", 600));
    assert_eq!(
        s.source_patience_ms,
        500 * cfg.source_patience_factor as u64
    );
    // A piece outside my stripe, taken after the patience, does not count.
    let f = cfg.source_patience_factor as u64;
    let patience = s.source_patience_ms;
    assert!(s.next_requests(100 + patience - 1, 64).is_empty());
    let late = s.next_requests(100 + patience, 64);
    assert_eq!(late.iter().map(|x| x.piece).collect::<Vec<_>>(), vec![1]);
    assert!(s.on_done(1, "src", 9_000));
    assert_eq!(s.source_patience_ms, patience);
    // A fast piece pulls it down, smoothed (0.8 × 500 + 0.2 × 1 ms, times f)...
    s.peer_has("src", 2, 9_000);
    assert!(s.next_requests(9_000, 64).iter().any(|x| x.piece == 2));
    assert!(s.on_done(2, "src", 9_001));
    assert_eq!(s.source_patience_ms, (400.2 * f as f64) as u64);
    // ... and never under the lower bound.
    for p in (4..64).step_by(2) {
        s.peer_has("src", p, 9_000 + p as u64);
        assert!(s
            .next_requests(9_000 + p as u64, 64)
            .iter()
            .any(|x| x.piece == p));
        assert!(s.on_done(p, "src", 9_001 + p as u64));
    }
    assert_eq!(s.source_patience_ms, cfg.source_patience_min_ms);
}

#[test]
fn a_slot_is_one_cache_line() {
    assert_eq!(std::mem::size_of::<Option<Slot>>(), 64);
    assert_eq!(std::mem::align_of::<Option<Slot>>(), 64);
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
fn a_large_swarm_leaves_part_of_the_agents_budget_unused() {
    let cfg = SchedulerConfig {
        min_window: 16,
        max_window: 16,
        max_inflight_total: 64,
        ..Default::default()
    };
    let withheld = cfg.large_swarm_withheld_requests;
    assert!(withheld > 0 && withheld < 32);
    let run = |members: u32| {
        let mut s = sched(64, cfg.clone());
        s.set_members(members, 0);
        for p in ["a", "b", "c", "d"] {
            s.set_peer(p, None, 0);
        }
        let reqs = s.next_requests(0, 32);
        reqs.iter().filter(|r| !r.urgent).count() as u32
    };
    assert_eq!(
        run(STALL_MIN_MEMBERS - 1),
        32,
        "a small swarm takes the whole budget"
    );
    assert_eq!(
        run(STALL_MIN_MEMBERS),
        32 - withheld,
        "a large one leaves {withheld}"
    );
}

#[test]
fn a_request_stalled_in_a_holders_line_moves_to_another_holder() {
    let cfg = SchedulerConfig {
        min_window: 2,
        max_window: 2,
        large_swarm_withheld_requests: 0,
        ..Default::default()
    };
    let stall = cfg.stall_ms;
    let mut s = sched(8, cfg);
    s.set_members(STALL_MIN_MEMBERS, 0);
    s.set_peer("slow", Some(bits(8, &[0, 1, 2, 3, 4, 5, 6, 7])), 0);
    let first = s.next_requests(0, 8);
    assert_eq!(
        first.len(),
        2,
        "a window of two, the read head in it: {first:?}"
    );
    assert!(s.stalled_requests(stall - 1).is_empty(), "not yet");
    let stalled = s.stalled_requests(stall);
    assert_eq!(stalled.len(), 2, "both wait past the timeout: {stalled:?}");
    assert!(
        s.stalled_requests(stall + 1).is_empty(),
        "reported once per timeout"
    );
    // The holder confirms both cancels; another holder appears.
    for r in &stalled {
        s.on_cancelled(r.piece, "slow", stall + 2);
    }
    s.set_peer("other", None, 0);
    let again = s.next_requests(stall + 2, 8);
    assert!(!again.is_empty());
    assert!(
        again.iter().all(|r| r.peer == "other"),
        "the holder that kept them waiting rests: {again:?}"
    );
    assert!(again.iter().any(|r| r.piece == first[0].piece && r.urgent));
}

#[test]
fn small_swarms_have_no_stall_timeout_and_a_plain_cancel_rests_nobody() {
    let mut s = sched(8, SchedulerConfig::default());
    s.set_members(STALL_MIN_MEMBERS - 1, 0);
    s.set_peer("a", None, 0);
    let r = s.next_requests(0, 8);
    assert!(!r.is_empty());
    assert!(s.stalled_requests(60_000).is_empty());
    // A cancel that was not for a stall (a retarget) leaves the holder usable.
    s.on_cancelled(r[0].piece, "a", 60_000);
    let again = s.next_requests(60_000, 8);
    assert!(again.iter().any(|x| x.piece == r[0].piece && x.peer == "a"));
    // A swarm that grows past the threshold: requests sent before count from then.
    s.set_members(1_000, 60_000);
    assert!(s.stalled_requests(60_100).is_empty());
    assert!(!s.stalled_requests(60_000 + s.config().stall_ms).is_empty());
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
fn registry_runs_cover_what_nobody_gives() {
    let mut s = sched(10, SchedulerConfig::default());
    s.set_peer("a", Some(bits(10, &[0, 1, 5])), 0);
    assert_eq!(s.registry_run(false, |_| false), Some((2, 5)));
    assert_eq!(s.registry_run(false, |i| i == 2), Some((3, 5)));
    assert_eq!(s.registry_run(true, |_| false), Some((0, 10)));
    s.claim(2);
    assert_eq!(s.registry_run(false, |_| false), Some((3, 5)));
}

#[test]
fn availability_counts_follow_bitfields_haves_bans_and_departures() {
    let mut s = sched(4, SchedulerConfig::default());
    s.set_peer("a", Some(bits(4, &[1])), 0);
    s.set_peer("b", Some(bits(4, &[1, 2])), 0);
    s.set_peer("c", None, 0);
    assert_eq!(
        (
            s.usable_holders(1),
            s.usable_holders(2),
            s.usable_holders(3)
        ),
        (3, 2, 1)
    );
    s.peer_has("a", 2, 0);
    assert_eq!(s.usable_holders(2), 3);
    s.set_peer("b", Some(bits(4, &[])), 0);
    assert_eq!(s.usable_holders(2), 2);
    s.on_failed(0, "c", true);
    assert_eq!(s.usable_holders(3), 0);
    s.remove_peer("a");
    assert_eq!((s.usable_holders(1), s.usable_holders(2)), (0, 0));
    s.on_not_held(3, "b");
    assert_eq!(s.orphans(), vec![0, 1, 2, 3]);
}

/// `next_requests` as it was before the fill loop kept its candidates (a scan of
/// every peer per request, names compared): the reference the faster loop must
/// match request for request.
fn next_requests_reference(s: &mut PieceScheduler, now_ms: u64, max_new: u32) -> Vec<Request> {
    let mut out = Vec::new();
    if s.have.is_complete() {
        return out;
    }
    let head = s.have.prefix();
    if head < s.have.len() && !s.inflight_any.get(head) {
        if let Some(p) = s.pick_peer(head, now_ms, true, &[]) {
            s.assign(head, p, now_ms);
            out.push(s.request(head, p, true));
        }
    }
    let mut budget = max_new;
    let total_cap = s.cfg.max_inflight_total;
    let mut exhausted: Vec<u32> = Vec::new();
    while budget > 0 && s.inflight_count() < total_cap {
        let Some(p) = s.least_loaded(now_ms, &exhausted) else {
            break;
        };
        match s.best_piece_for(p, now_ms, head) {
            Some(piece) => {
                s.assign(piece, p, now_ms);
                out.push(s.request(piece, p, false));
                budget -= 1;
            }
            None => exhausted.push(p),
        }
    }
    s.endgame_requests(head, budget, now_ms, &mut out);
    out
}

#[test]
fn the_fill_loop_matches_the_reference_on_random_swarms() {
    let mut rng = 0x5eed_u64;
    let mut next = move |n: u64| {
        rng = mix(rng, 7);
        rng % n.max(1)
    };
    for round in 0..300 {
        let len = 1 + next(200) as u32;
        let cfg = SchedulerConfig {
            min_window: 1 + next(3) as u32,
            max_window: 2 + next(8) as u32,
            max_inflight_total: 4 + next(40) as u32,
            endgame: next(6) as u32,
            seed: round,
            ..Default::default()
        };
        let mut mine = Bitfield::new(len);
        for i in 0..len {
            if next(3) == 0 {
                mine.set(i);
            }
        }
        let mut a = PieceScheduler::new(mine, MB, cfg);
        if next(2) == 0 {
            a.set_stripe(Some((next(4) as u32, 4)));
        }
        let peers = 1 + next(60);
        for p in 0..peers {
            // Names out of slot order, and some that sort alike but for a suffix.
            let name = format!("p{}-{}", next(5), p);
            let have = if next(8) == 0 {
                None
            } else {
                let mut h = Bitfield::new(len);
                for i in 0..len {
                    if next(4) == 0 {
                        h.set(i);
                    }
                }
                Some(h)
            };
            a.set_peer_at(&name, have, next(3) as u8, next(2_000));
            if next(10) == 0 {
                a.remove_peer(&name);
            }
        }
        let mut b = a.clone();
        let mut now = 2_000;
        for _ in 0..6 {
            now += next(400);
            let max_new = next(20) as u32;
            let ra = a.next_requests(now, max_new);
            let rb = next_requests_reference(&mut b, now, max_new);
            assert_eq!(ra, rb, "round {round} at {now}");
            // Some answers, the same on both sides: rates, rests, failures.
            for r in &ra {
                if next(2) == 0 {
                    continue;
                }
                match next(4) {
                    0 => {
                        a.on_busy(r.piece, &r.peer, now);
                        b.on_busy(r.piece, &r.peer, now);
                    }
                    1 => {
                        let corrupt = next(5) == 0;
                        a.on_failed(r.piece, &r.peer, corrupt);
                        b.on_failed(r.piece, &r.peer, corrupt);
                    }
                    _ => {
                        let t = now + 1 + next(300);
                        a.on_done(r.piece, &r.peer, t);
                        b.on_done(r.piece, &r.peer, t);
                    }
                }
            }
        }
    }
}

#[test]
fn peer_rows_follow_haves_completion_and_slot_reuse() {
    // 10 pieces: rows of two bytes, the second one partly padding.
    let mut s = sched(10, SchedulerConfig::default());
    s.set_peer("a", Some(bits(10, &[0, 9])), 0);
    s.set_peer("b", Some(bits(10, &[1])), 0);
    for p in 1..9 {
        s.peer_has("a", p, 0);
    }
    assert!(s.peer_is_complete("a"), "the last HAVE makes it complete");
    assert_eq!(
        s.usable_holders(1),
        2,
        "b by its row, a as a complete holder"
    );
    s.on_not_held(3, "a");
    assert!(!s.peer_is_complete("a"));
    assert_eq!(s.usable_holders(3), 0);
    assert_eq!(s.usable_holders(4), 1);
    // b leaves and c takes its slot: c holds what it says, nothing of b's.
    let b = s.peer_handle("b");
    s.remove_peer("b");
    s.set_peer("c", Some(bits(10, &[5])), 0);
    assert_eq!(s.peer_handle("c"), b, "the freed slot is reused");
    assert_eq!(s.usable_holders(1), 1, "b's piece is only a's now");
    assert_eq!(s.usable_holders(5), 2);
    let reqs = s.next_requests(0, 16);
    assert!(
        reqs.iter().all(|r| r.peer == "a" || r.piece == 5),
        "c is asked only for its one piece: {reqs:?}"
    );
    assert!(reqs.iter().all(|r| r.piece != 3), "nobody holds piece 3");
}
