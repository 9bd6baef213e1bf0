//! Property tests of the swarm's three cores, each driven by random sequences of the
//! events it sees in production and checked against a small model:
//! - `TrackerState::announce` / `expire`: one live source per blob, handouts, hashes,
//!   refused announces, expiry;
//! - `PieceScheduler`: what it requests, from whom, how many, and its in-flight
//!   bookkeeping through every way a request ends;
//! - `UploadQueue`: slots, counts and order of the holder's upload line.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod scheduler;
mod tracker;
mod upload;

use std::collections::BTreeMap;

use proptest::prelude::*;
use swarm::upload::{UploadConfig, URGENT_EXTRA_SLOTS};

use scheduler::{run_scheduler, sched_op};
use tracker::{run_tracker, tracker_op};
use upload::{run_upload, upload_op};

const MIB: u64 = 1 << 20;

/// How often each interesting event happened in a run: the test at the end checks
/// that the random sequences reach what the properties are about.
#[derive(Default, Debug)]
struct Tally(BTreeMap<&'static str, usize>);

impl Tally {
    fn add(&mut self, what: &'static str) {
        *self.0.entry(what).or_default() += 1;
    }

    fn merge(&mut self, other: Tally) {
        for (k, v) in other.0 {
            *self.0.entry(k).or_default() += v;
        }
    }
}

/// The generators reach what the properties are about: refused and taken announces,
/// full handouts, replaced sources, hashes taken, expiry; requests, the budget used
/// up, every way a request ends; busy lines, urgent requests served first,
/// cancellations. 400 deterministic cases of each.
#[test]
fn the_sequences_reach_the_interesting_cases() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut tally = Tally::default();
    let mut runner = TestRunner::deterministic();
    // The upload line's cases draw from a runner of their own, so a change to one
    // generator does not reshuffle the others' cases.
    let mut upload_runner = TestRunner::deterministic();
    let tracker = (0usize..6, proptest::collection::vec(tracker_op(), 1..80));
    let sched = (1u32..24).prop_flat_map(|n| {
        (
            Just(n),
            proptest::collection::vec(0..n, 0..n as usize),
            proptest::collection::vec(sched_op(n), 1..120),
            0u32..6,
        )
    });
    let upload = (
        0usize..4,
        1usize..5,
        1usize..10,
        proptest::collection::vec(upload_op(), 1..120),
    );
    for _ in 0..400 {
        let (max_peers, ops) = tracker.new_tree(&mut runner).expect("case").current();
        tally.merge(run_tracker(max_peers, &ops).expect("tracker properties"));
        let (n, initial, ops, endgame) = sched.new_tree(&mut runner).expect("case").current();
        tally.merge(run_scheduler(n, &initial, endgame, &ops).expect("scheduler properties"));
        let (a, p, t, ops) = upload.new_tree(&mut upload_runner).expect("case").current();
        let cfg = UploadConfig {
            max_active: a,
            max_queued_per_conn: p,
            max_queued_total: t,
            urgent_extra: URGENT_EXTRA_SLOTS,
        };
        tally.merge(run_upload(cfg, &ops).expect("upload properties"));
    }
    for what in [
        "announce refused",
        "announce taken",
        "peers handed out",
        "full handout",
        "source replaced",
        "size replaced by the source",
        "small swarm's size mended",
        "small blob: a complete holder kept",
        "registry unavailable to the announcer",
        "reported source replaced",
        "hash taken",
        "expire",
        "request",
        "urgent request",
        "budget used up",
        "request ended",
        "busy",
        "queued",
        "served",
        "served urgent first",
        "urgent in the extra slot",
        "cancelled",
        "stalled request",
        "stalled request cancelled",
    ] {
        let n = tally.0.get(what).copied().unwrap_or(0);
        assert!(
            n >= 10,
            "{what}: only {n} times in 400 cases: {:?}",
            tally.0
        );
    }
    println!("{:?}", tally.0);
}
