//! The request policy: the read head, windows and the budget, rarest first, holder
//! choice, endgame, registry runs, and the fill loop against its reference.

use super::*;

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
fn registry_runs_cover_what_nobody_gives() {
    let mut s = sched(10, SchedulerConfig::default());
    s.set_peer("a", Some(bits(10, &[0, 1, 5])), 0);
    let known = |_| true;
    assert_eq!(s.registry_run(false, |_| false, known), Some((2, 5)));
    assert_eq!(s.registry_run(false, |i| i == 2, known), Some((3, 5)));
    assert_eq!(s.registry_run(true, |_| false, known), Some((0, 10)));
    s.claim(2);
    assert_eq!(s.registry_run(false, |_| false, known), Some((3, 5)));
}

#[test]
fn a_held_piece_whose_hash_is_unknown_comes_from_the_registry() {
    let mut s = sched(10, SchedulerConfig::default());
    s.set_peer("a", Some(bits(10, &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9])), 0);
    assert_eq!(s.registry_run(false, |_| false, |_| true), None);
    // Hashes known for the first three pieces only (the rest were lost with the
    // tracker's state): the holder's copies of the rest cannot be checked.
    assert_eq!(s.registry_run(false, |_| false, |i| i < 3), Some((3, 10)));
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
fn held_pieces_without_a_hash_are_the_ones_a_source_must_read_itself() {
    let mut s = sched(6, SchedulerConfig::default());
    s.set_peer("a", Some(bits(6, &[0, 1, 2, 3])), 0);
    assert!(s.held_without_hash(|_| true).is_empty());
    // Hashes known for piece 0 only; piece 1 claimed already; 4 and 5 held by nobody.
    s.claim(1);
    assert_eq!(s.held_without_hash(|i| i == 0), vec![2, 3]);
}
