//! After a request: done, failed, busy, stalled or cancelled, and what is measured
//! from it (rates and windows, the source's patience).

use super::*;

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
fn a_liars_other_requests_end_when_its_channel_closes() {
    let cfg = SchedulerConfig {
        min_window: 8,
        max_window: 8,
        ..Default::default()
    };
    let mut s = PieceScheduler::new(Bitfield::new(8), MB, cfg);
    s.set_peer("liar", None, 0);
    let asked: Vec<u32> = s.next_requests(0, 8).iter().map(|r| r.piece).collect();
    assert!(
        asked.len() >= 3,
        "several pieces asked of the liar: {asked:?}"
    );
    // The first piece fails its hash: the liar is banned, its channel closed.
    s.on_failed(asked[0], "liar", true);
    assert_eq!(
        s.inflight_to("liar") as usize,
        asked.len() - 1,
        "the ban alone leaves its other requests in flight"
    );
    assert_eq!(s.registry_run(false, |_| false, |_| true), Some((0, 1)));
    let ended = s.release_all_from("liar");
    let mut rest = asked[1..].to_vec();
    rest.sort_unstable();
    assert_eq!(ended, rest, "its other requests end, in piece order");
    assert_eq!(s.inflight_to("liar"), 0);
    assert!(
        s.is_banned("liar"),
        "still banned: the peer is not forgotten"
    );
    // Nobody holds them now, so the registry run may take them all.
    assert_eq!(s.registry_run(false, |_| false, |_| true), Some((0, 8)));
    // An honest holder gets every piece the liar had been asked for.
    s.set_peer("honest", None, 0);
    let again: Vec<u32> = s.next_requests(1, 8).iter().map(|r| r.piece).collect();
    assert!(
        asked.iter().all(|p| again.contains(p)),
        "{asked:?} asked again: {again:?}"
    );
}
