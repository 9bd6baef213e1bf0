//! Who holds what: rows, bitfields and HAVEs, availability counts, slots.

use super::super::holders::intersects;
use super::*;

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

proptest::proptest! {
    // Many short cases: a skipped pass needs stripes, unripe far pieces and near
    // holders without room, together.
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

    #[test]
    fn holder_counts_and_their_bits_match_the_peers_after_any_events(
        pieces in 1u32..12,
        ops in proptest::collection::vec((0u8..9, 0usize..4, 0u32..20, 0u8..3), 1..150),
    ) {
        let mut s = sched(pieces, SchedulerConfig::default());
        let mut now = 0u64;
        for (op, peer, piece, distance) in ops {
            let name = format!("p{peer}");
            let piece = piece % pieces;
            match op {
                0 => {
                    let held = (0..pieces).filter(|i| (i + piece) % 3 != 0).collect::<Vec<_>>();
                    s.set_peer_at(&name, Some(bits(pieces, &held)), distance, now);
                }
                1 => s.set_peer_at(&name, None, distance, now),
                2 => s.peer_has(&name, piece, now),
                3 => {
                    s.remove_peer(&name);
                }
                4 => s.on_failed(piece, &name, distance == 0),
                5 => s.on_not_held(piece, &name),
                6 => {
                    // Rack stripes on or off, and time for their patience to ripen.
                    s.set_stripe((distance > 0).then_some((piece % 2, 2)));
                    s.set_members(if distance == 2 { 3_000 } else { 8 }, now);
                    now += 700;
                }
                7 => {
                    for r in s.next_requests(now, 4) {
                        proptest::prop_assert!(r.urgent || s.is_inflight(r.piece));
                    }
                }
                _ => {
                    s.on_done(piece, &name, now);
                }
            }
            now += 10;
            check_holder_counts(&s)?;
        }
    }
}

/// `avail`, the complete-holder counts and the held bits, recounted from the slots.
fn check_holder_counts(s: &PieceScheduler) -> Result<(), proptest::test_runner::TestCaseError> {
    let usable = || {
        s.slots
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| slot.as_ref().map(|slot| (i as u32, slot)))
            .filter(|(_, slot)| !slot.banned)
    };
    let complete = usable().filter(|(_, slot)| slot.complete);
    proptest::prop_assert_eq!(s.complete_holders as usize, complete.clone().count());
    proptest::prop_assert_eq!(
        s.complete_near_holders as usize,
        complete.filter(|(_, slot)| slot.distance == 0).count()
    );
    for piece in 0..s.have.len() {
        let holding = usable().filter(|&(i, slot)| !slot.complete && s.rows.get(i, piece));
        let any = holding.clone().count() as u32;
        let near = holding.filter(|(_, slot)| slot.distance == 0).count() as u32;
        let h = s.avail[piece as usize];
        proptest::prop_assert_eq!((h.any, h.near), (any, near), "piece {}", piece);
        proptest::prop_assert_eq!(s.partly_held.get(piece), any > 0);
        proptest::prop_assert_eq!(s.partly_held_near.get(piece), near > 0);
    }
    Ok(())
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
fn a_slot_is_one_cache_line() {
    assert_eq!(std::mem::size_of::<Option<Slot>>(), 64);
    assert_eq!(std::mem::align_of::<Option<Slot>>(), 64);
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

#[test]
fn a_holder_asked_and_silent_for_the_limit_is_named_and_one_delivering_is_not() {
    let mut s = sched(8, SchedulerConfig::default());
    s.set_peer("mute", None, 0);
    s.set_peer("slow", None, 0);
    assert!(
        s.silent_holders(100_000, 30_000).is_empty(),
        "nobody asked yet"
    );
    let asked = s.next_requests(1_000, 4);
    assert!(asked.iter().any(|r| r.peer == "mute"));
    assert!(asked.iter().any(|r| r.peer == "slow"));
    s.on_progress("slow", 20_000);
    assert!(
        s.silent_holders(30_999, 30_000).is_empty(),
        "not silent long enough"
    );
    assert_eq!(
        s.silent_holders(31_000, 30_000),
        vec!["mute".to_string()],
        "asked at 1 s, nothing since; the one sending bytes at 20 s is not silent"
    );
    // Dropped, its requests end: not named again.
    s.remove_peer("mute");
    assert!(s.silent_holders(40_000, 30_000).is_empty());
    assert_eq!(s.silent_holders(50_000, 30_000), vec!["slow".to_string()]);
}
