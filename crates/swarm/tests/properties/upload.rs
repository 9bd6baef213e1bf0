//! `UploadQueue`: slots, counts and order of the holder's upload line.

use std::collections::{BTreeMap, VecDeque};

use proptest::prelude::*;
use swarm::upload::{Admit, Queued, UploadConfig, UploadQueue, REQUEST_PATIENCE};

use super::Tally;

#[derive(Clone, Debug)]
pub(super) enum UploadOp {
    Push(u8, u32, u32, bool),
    Next,
    Done,
    Cancel(u8, u32, u32),
    Drop(u8, Option<u32>),
}

pub(super) fn upload_op() -> impl Strategy<Value = UploadOp> {
    prop_oneof![
        // Piece 0 (a head piece, which alone may take the urgent slot) often.
        6 => (0u8..4, 0u32..3, prop_oneof![1 => Just(0u32), 3 => 0u32..12], prop::bool::weighted(0.2)).prop_map(|(c, ch, p, u)| UploadOp::Push(c, ch, p, u)),
        4 => Just(UploadOp::Next),
        3 => Just(UploadOp::Done),
        2 => (0u8..4, 0u32..3, 0u32..12).prop_map(|(c, ch, p)| UploadOp::Cancel(c, ch, p)),
        1 => (0u8..4, proptest::option::of(0u32..3)).prop_map(|(c, ch)| UploadOp::Drop(c, ch)),
    ]
}

pub(super) fn run_upload(cfg: UploadConfig, ops: &[UploadOp]) -> Result<Tally, TestCaseError> {
    let mut tally = Tally::default();
    let max_active = cfg.max_active.max(1);
    let extra = cfg.urgent_extra;
    let (per_conn, total) = (cfg.max_queued_per_conn, cfg.max_queued_total);
    let mut u: UploadQueue<u8> = UploadQueue::new(cfg);
    let mut waiting: BTreeMap<u8, VecDeque<Queued>> = BTreeMap::new();
    // Per connection: requests served from its line, and that count at each waiting
    // request's arrival (in `waiting`'s order).
    let mut served_from: BTreeMap<u8, (u64, VecDeque<u64>)> = BTreeMap::new();
    let mut active = 0usize;
    let (mut pushed, mut served, mut cancelled, mut dropped) = (0usize, 0usize, 0usize, 0usize);
    for op in ops {
        let queued: usize = waiting.values().map(VecDeque::len).sum();
        match op {
            UploadOp::Push(c, chan, piece, urgent) => {
                let q = Queued {
                    chan: *chan,
                    blob: 1,
                    piece: *piece,
                    urgent: *urgent,
                    // Piece 0 stands for a small head piece here.
                    small_head: *piece == 0,
                };
                let line = waiting.entry(*c).or_default();
                let busy = line.len() >= per_conn || queued >= total;
                let admit = u.push(*c, q);
                prop_assert_eq!(admit == Admit::Busy, busy, "admission of {:?}", q);
                tally.add(if busy { "busy" } else { "queued" });
                if admit == Admit::Queued {
                    let (n, arrivals) = served_from.entry(*c).or_default();
                    arrivals.push_back(*n);
                    line.push_back(q);
                    pushed += 1;
                }
            }
            UploadOp::Next => {
                let urgent_waiting = waiting.values().flatten().any(|q| q.urgent);
                let urgent_head_waiting =
                    waiting.values().flatten().any(|q| q.urgent && q.small_head);
                match u.next_to_send() {
                    None => prop_assert!(
                        active >= max_active + extra
                            || queued == 0
                            || (active >= max_active && !urgent_head_waiting),
                        "nothing served with {} active and {} waiting",
                        active,
                        queued
                    ),
                    Some((c, q)) => {
                        prop_assert!(
                            active < max_active
                                || (q.urgent && q.small_head && active < max_active + extra),
                            "a slot past max_active for {:?}",
                            q
                        );
                        if active >= max_active {
                            tally.add("urgent in the extra slot");
                        }
                        prop_assert!(
                            q.urgent || !urgent_waiting,
                            "non-urgent {:?} before an urgent one",
                            q
                        );
                        let line = waiting.get_mut(&c);
                        let at = line.as_ref().and_then(|l| l.iter().position(|x| *x == q));
                        prop_assert!(at.is_some(), "{:?} was not waiting on {}", q, c);
                        let (n, arrivals) = served_from.entry(c).or_default();
                        let oldest_waited = arrivals.front().map_or(0, |a| *n - a);
                        prop_assert!(
                            q.urgent || oldest_waited < REQUEST_PATIENCE || at == Some(0),
                            "{:?} served before the oldest request of its line, which saw {} served",
                            q,
                            oldest_waited
                        );
                        *n += 1;
                        if let (Some(line), Some(at)) = (line, at) {
                            line.remove(at);
                            arrivals.remove(at);
                        }
                        tally.add(if urgent_waiting {
                            "served urgent first"
                        } else {
                            "served"
                        });
                        active += 1;
                        served += 1;
                    }
                }
            }
            UploadOp::Done => {
                u.done();
                active = active.saturating_sub(1);
            }
            UploadOp::Cancel(c, chan, piece) => {
                let line = waiting.entry(*c).or_default();
                let at = line
                    .iter()
                    .position(|q| q.chan == *chan && q.piece == *piece);
                prop_assert_eq!(u.cancel(*c, *chan, *piece), at.is_some());
                if let Some(at) = at {
                    tally.add("cancelled");
                    line.remove(at);
                    served_from.entry(*c).or_default().1.remove(at);
                    cancelled += 1;
                }
            }
            UploadOp::Drop(c, chan) => {
                u.drop_waiting(*c, *chan);
                let line = waiting.entry(*c).or_default();
                let before = line.len();
                let (n, arrivals) = served_from.entry(*c).or_default();
                let mut kept = arrivals.iter();
                let mut arrivals_kept = VecDeque::new();
                line.retain(|q| {
                    let arrived = kept.next().copied().unwrap_or(0);
                    let keep = chan.is_some_and(|ch| q.chan != ch);
                    if keep {
                        arrivals_kept.push_back(arrived);
                    }
                    keep
                });
                *arrivals = arrivals_kept;
                if line.is_empty() {
                    // The queue forgets an emptied line, and its count.
                    *n = 0;
                }
                dropped += before - line.len();
            }
        }
        let queued: usize = waiting.values().map(VecDeque::len).sum();
        prop_assert!(
            u.active() <= max_active + extra,
            "{} active > {} + {}",
            u.active(),
            max_active,
            extra
        );
        prop_assert_eq!(u.active(), active);
        prop_assert_eq!(u.queued(), queued);
        prop_assert_eq!(u.queued(), pushed - served - cancelled - dropped);
    }
    // Draining: everything waiting is served, urgent first, then nothing.
    loop {
        while u.active() > 0 {
            u.done();
        }
        let Some((c, q)) = u.next_to_send() else {
            break;
        };
        let urgent_waiting = waiting.values().flatten().any(|x| x.urgent);
        prop_assert!(q.urgent || !urgent_waiting);
        if let Some(line) = waiting.get_mut(&c) {
            if let Some(at) = line.iter().position(|x| *x == q) {
                line.remove(at);
            }
        }
    }
    prop_assert_eq!(u.queued(), 0);
    prop_assert!(
        waiting.values().all(VecDeque::is_empty),
        "left waiting: {:?}",
        waiting
    );
    Ok(tally)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn upload_queue_invariants(
        max_active in 0usize..4,
        per_conn in 1usize..12,
        total in 1usize..24,
        urgent_extra in 0usize..3,
        ops in proptest::collection::vec(upload_op(), 1..240),
    ) {
        run_upload(UploadConfig { max_active, max_queued_per_conn: per_conn, max_queued_total: total, urgent_extra }, &ops)?;
    }
}
