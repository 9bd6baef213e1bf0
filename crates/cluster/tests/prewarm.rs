//! Prewarm: validation, target selection, the per-node state machine, seed-then-fan-out
//! scheduling, rate limits, cancel, deadlines, node loss, and persistence across reopen.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use cluster::inventory::{Inventory, NodeReport, Pin};
use cluster::prewarm::{
    resolve_targets, validate, Job, JobStatus, JobStore, NodeJobState, NodeUpdate, PrewarmRequest,
    Targets,
};
use cluster::Error;
use common::*;

fn pool_node(
    name: &str,
    pool: &str,
    zone: &str,
    held: &[(cluster::inventory::BlobRef, u64)],
) -> NodeReport {
    let mut r = report(name, 1, held);
    r.labels = labels(&[
        ("starling.io/pool", pool),
        ("topology.kubernetes.io/zone", zone),
    ]);
    r
}

/// n1..n4 in pool h100 (n3 already holds the 1 GiB layer), n5 in pool a100.
fn inv() -> Inventory {
    let mut inv = Inventory::new(60);
    inv.apply(pool_node("n1", "h100", "a", &[]), NOW)
        .expect("n1");
    inv.apply(pool_node("n2", "h100", "a", &[]), NOW)
        .expect("n2");
    inv.apply(pool_node("n3", "h100", "b", &[(blob(2, GIB), GIB)]), NOW)
        .expect("n3");
    inv.apply(pool_node("n4", "h100", "b", &[]), NOW)
        .expect("n4");
    inv.apply(pool_node("n5", "a100", "b", &[]), NOW)
        .expect("n5");
    inv
}

fn req(images: &[&str], targets: Targets) -> PrewarmRequest {
    PrewarmRequest {
        images: images.iter().map(|s| (*s).to_owned()).collect(),
        targets,
        ..Default::default()
    }
}

/// What an agent reports once it finished its part of a job: the job's pins (the
/// caller gives the blobs).
fn with_job_pins(mut r: NodeReport, job: &Job) -> NodeReport {
    r.pins = job
        .images
        .iter()
        .map(|i| Pin {
            reference: format!("prewarm job {} ({})", job.id, i.reference),
            digest: Some(i.manifest_digest.clone()),
            expires_at: Some(job.pin_until),
        })
        .collect();
    r
}

fn nodes(names: &[&str]) -> Targets {
    Targets {
        nodes: names.iter().map(|s| (*s).to_owned()).collect(),
        ..Default::default()
    }
}

#[test]
fn mutable_tags_are_refused_unless_forced() {
    let inv = inv();
    let msg = |r: &PrewarmRequest| validate(r, &inv).expect_err("refused").to_string();
    assert_eq!(
        msg(&req(&["python:latest"], nodes(&["n1"]))),
        "refusing mutable tag docker.io/library/python:latest: `latest` is a mutable tag; pin a digest or set \"force\": true"
    );
    assert_eq!(
        msg(&req(&["python"], nodes(&["n1"]))),
        "refusing mutable tag docker.io/library/python:latest: no tag given, which means the mutable tag `latest`; pin a digest or set \"force\": true"
    );
    let mut moving = req(&["registry.example.com/ml/train:v1.4.2"], nodes(&["n1"]));
    moving.moving_tags = vec!["registry.example.com/ml/train:v1.4.2".into()];
    assert!(msg(&moving).contains("the caller reports this tag as seen moving"));
    moving.force = true;
    assert_eq!(validate(&moving, &inv).expect("forced").len(), 1);
    let pinned = req(&[&format!("python@{}", d(9))], nodes(&["n1"]));
    assert_eq!(
        validate(&pinned, &inv).expect("digest ok")[0].digest,
        Some(d(9))
    );
}

#[test]
fn tags_agents_saw_moving_are_refused() {
    let mut inv = inv();
    let mut a = train();
    let mut r = report("n1", 2, &[]);
    r.images = vec![image_record(&a, 1, Default::default(), 1.0)];
    inv.apply(r, NOW).expect("n1");
    a.manifest_digest = d(200);
    let mut r = report("n2", 2, &[]);
    r.images = vec![image_record(&a, 2, Default::default(), 1.0)];
    inv.apply(r, NOW).expect("n2");
    let e = validate(
        &req(&["registry.example.com/ml/train:v1.4.2"], nodes(&["n1"])),
        &inv,
    )
    .expect_err("moving");
    assert!(
        matches!(&e, Error::MutableTag { reason, .. } if reason == "agents reported this tag pointing at different digests"),
        "{e}"
    );
}

#[test]
fn malformed_requests_have_clear_errors() {
    let inv = inv();
    let e = |r: PrewarmRequest| validate(&r, &inv).expect_err("invalid").to_string();
    assert_eq!(
        e(req(&[], nodes(&["n1"]))),
        "invalid request: \"images\" is empty"
    );
    assert_eq!(
        e(req(&["a:1"], Targets::default())),
        "invalid request: targets: give \"nodes\", \"selector\", \"pool\", \"count\" or \"percentage\""
    );
    let both = Targets {
        nodes: vec!["n1".into()],
        selector: Some("a=b".into()),
        ..Default::default()
    };
    assert!(e(req(&["a:1"], both)).contains("not both"));
    let bad_sel = Targets {
        selector: Some("zone in (a".into()),
        ..Default::default()
    };
    assert!(e(req(&["a:1"], bad_sel))
        .starts_with("invalid label selector \"zone in (a\": unclosed '('"));
    let pct = Targets {
        percentage: Some(150.0),
        ..Default::default()
    };
    assert_eq!(
        e(req(&["a:1"], pct)),
        "invalid request: targets.percentage must be in (0, 100], got 150"
    );
    let mut par = req(&["a:1"], nodes(&["n1"]));
    par.parallelism = Some(0);
    assert_eq!(e(par), "invalid request: parallelism must be at least 1");
    // TTLs and deadlines have documented maxima and never overflow the clock.
    for (ttl, deadline, msg) in [
        (
            Some(u64::MAX),
            None,
            "pin_ttl_seconds must be between 1 and 2592000 (30 days), got 18446744073709551615",
        ),
        (
            Some(0),
            None,
            "pin_ttl_seconds must be between 1 and 2592000 (30 days), got 0",
        ),
        (
            None,
            Some(u64::MAX),
            "deadline_seconds must be between 1 and 604800 (7 days), got 18446744073709551615",
        ),
        (
            None,
            Some(604_801),
            "deadline_seconds must be between 1 and 604800 (7 days), got 604801",
        ),
    ] {
        let mut r = req(&["a:1"], nodes(&["n1"]));
        r.pin_ttl_seconds = ttl;
        r.deadline_seconds = deadline;
        assert_eq!(e(r), format!("invalid request: {msg}"));
    }
    let mut fine = req(&["a:1"], nodes(&["n1"]));
    fine.pin_ttl_seconds = Some(cluster::prewarm::MAX_PIN_TTL_SECONDS);
    fine.deadline_seconds = Some(cluster::prewarm::MAX_DEADLINE_SECONDS);
    assert!(validate(&fine, &inv).is_ok());
    // Even unvalidated, planning refuses what would run past the end of the clock.
    let mut huge = req(&["a:1"], nodes(&["n1"]));
    huge.pin_ttl_seconds = Some(u64::MAX);
    assert!(matches!(
        cluster::prewarm::Job::plan(1, huge, vec![], &["n1".into()], &inv, NOW),
        Err(Error::InvalidRequest(_))
    ));
    assert!(matches!(
        validate(&req(&["Bad Ref"], nodes(&["n1"])), &inv),
        Err(Error::BadReference { .. })
    ));
}

#[test]
fn target_selection() {
    let inv = inv();
    let blobs = train().blobs;
    let t = |t: Targets| resolve_targets(&t, &inv, &blobs, NOW);
    assert_eq!(t(nodes(&["n2", "n1", "n2"])).expect("names"), ["n2", "n1"]);
    match t(nodes(&["n1", "ghost", "zz"])) {
        Err(Error::UnknownNodes(n)) => assert_eq!(n, ["ghost", "zz"]),
        other => panic!("{other:?}"),
    }
    let sel = Targets {
        selector: Some("topology.kubernetes.io/zone=b".into()),
        ..Default::default()
    };
    assert_eq!(t(sel).expect("selector"), ["n3", "n4", "n5"]);
    let pool = Targets {
        pool: Some("h100".into()),
        count: Some(2),
        ..Default::default()
    };
    assert_eq!(
        t(pool).expect("count"),
        ["n3", "n1"],
        "warmest first, then by name"
    );
    let pct = Targets {
        pool: Some("h100".into()),
        percentage: Some(50.0),
        ..Default::default()
    };
    assert_eq!(t(pct).expect("pct").len(), 2);
    let pct = Targets {
        pool: Some("h100".into()),
        percentage: Some(60.0),
        ..Default::default()
    };
    assert_eq!(t(pct).expect("pct ceil").len(), 3);
    let too_many = Targets {
        pool: Some("a100".into()),
        count: Some(2),
        ..Default::default()
    };
    assert_eq!(
        t(too_many).expect_err("too many").to_string(),
        "invalid request: targets: asked for 2 node(s) but only 1 of the 1 matching node(s) are reporting"
    );
    let none = Targets {
        selector: Some("gpu=b200".into()),
        ..Default::default()
    };
    assert_eq!(
        t(none).expect_err("none").to_string(),
        "invalid request: targets: no node matches selector \"gpu=b200\""
    );
}

#[test]
fn plan_marks_warm_small_and_silent_nodes() {
    let mut inv = inv();
    let mut small = pool_node("tiny", "h100", "a", &[]);
    small.cache_budget = GIB;
    inv.apply(small, NOW).expect("tiny");
    inv.apply(pool_node("warm", "h100", "a", &full(&train())), NOW)
        .expect("warm");
    inv.apply(pool_node("gone", "h100", "a", &[]), NOW - 100)
        .expect("gone");
    let total = 10_000 + 3 * GIB + 100 * MIB;
    let job = Job::plan(
        1,
        req(&["x"], Targets::default()),
        vec![train()],
        &["n1".into(), "tiny".into(), "warm".into(), "gone".into()],
        &inv,
        NOW,
    )
    .expect("plan");
    let states: Vec<(&str, NodeJobState)> = job
        .nodes
        .iter()
        .map(|(k, v)| (k.as_str(), v.state.clone()))
        .collect();
    assert_eq!(
        states,
        vec![
            ("gone", NodeJobState::Unknown),
            ("n1", NodeJobState::Pending),
            (
                "tiny",
                NodeJobState::DoesNotFit {
                    needed: total,
                    budget: GIB
                }
            ),
            ("warm", NodeJobState::Done),
        ]
    );
    assert_eq!(
        serde_json::to_value(&job.nodes["tiny"].state).expect("json"),
        serde_json::json!({"state": "does_not_fit", "needed": total, "budget": GIB})
    );
    assert_eq!(job.pin_until, NOW + 24 * 3600);
}

#[test]
fn seed_first_then_fan_out_with_parallelism_and_rates() {
    let mut inv = inv();
    let mut store = JobStore::in_memory().expect("store");
    let mut r = req(
        &["registry.example.com/ml/train:v1.4.2"],
        Targets {
            pool: Some("h100".into()),
            ..Default::default()
        },
    );
    r.parallelism = Some(2);
    r.per_node_bytes_per_sec = Some(500 * MIB);
    r.total_bytes_per_sec = Some(600 * MIB);
    r.deadline_seconds = Some(3600);
    r.pin_ttl_seconds = Some(7200);
    let id = store
        .submit(r, vec![train()], &inv, NOW)
        .expect("submit")
        .id;
    assert_eq!(id, 1);

    // Nobody holds the image: one seed only, at min(per node, total).
    let a = store.next_assignments(&inv, NOW).expect("assign");
    assert_eq!(a.len(), 1);
    assert_eq!(
        (a[0].node.as_str(), a[0].seed, a[0].bytes_per_sec),
        ("n1", true, Some(500 * MIB))
    );
    assert_eq!(a[0].pin_until, NOW + 7200);
    assert_eq!(a[0].deadline_at, Some(NOW + 3600));
    assert_eq!(
        a[0].images,
        vec![(
            "registry.example.com/ml/train:v1.4.2".to_owned(),
            d(100).to_string()
        )]
    );
    assert!(
        store
            .next_assignments(&inv, NOW + 1)
            .expect("again")
            .is_empty(),
        "seed still running"
    );

    // Seed progress from a report: 1 GiB in 10 s.
    let mut n1 = pool_node("n1", "h100", "a", &[(blob(2, GIB), GIB)]);
    n1.generation = 2;
    inv.apply(n1, NOW + 10).expect("n1 progress");
    store.observe(&inv, NOW + 10).expect("observe");
    let job = store.get(id).expect("job").clone();
    let n1j = &job.nodes["n1"];
    assert_eq!(
        (n1j.state.clone(), n1j.bytes_done),
        (NodeJobState::Running, GIB)
    );
    let remaining = (2 * GIB + 100 * MIB + 10_000) as f64;
    assert_eq!(n1j.eta_seconds, Some(remaining / (GIB as f64 / 10.0)));

    // Seed done: fan out to parallelism 2, each at min(500 MiB, 600 MiB / 2).
    let job = store.get(id).expect("job").clone();
    let mut n1 = with_job_pins(pool_node("n1", "h100", "a", &full(&train())), &job);
    n1.generation = 3;
    inv.apply(n1, NOW + 20).expect("n1 done");
    store.observe(&inv, NOW + 20).expect("observe");
    assert_eq!(
        store.get(id).expect("job").nodes["n1"].state,
        NodeJobState::Done
    );
    let a = store.next_assignments(&inv, NOW + 20).expect("fan out");
    assert_eq!(
        a.iter()
            .map(|x| (x.node.as_str(), x.seed, x.bytes_per_sec))
            .collect::<Vec<_>>(),
        vec![
            ("n2", false, Some(300 * MIB)),
            ("n3", false, Some(300 * MIB))
        ]
    );
    assert!(store
        .next_assignments(&inv, NOW + 21)
        .expect("full")
        .is_empty());

    // An agent reports n2 done directly; n4 gets the freed slot.
    store
        .update_node(id, "n2", NodeUpdate::Done, NOW + 30)
        .expect("n2 done");
    let a = store.next_assignments(&inv, NOW + 30).expect("n4");
    assert_eq!(
        a.iter().map(|x| x.node.as_str()).collect::<Vec<_>>(),
        ["n4"]
    );
    store
        .update_node(
            id,
            "n4",
            NodeUpdate::Failed {
                reason: "disk full".into(),
            },
            NOW + 31,
        )
        .expect("n4 fail");
    store
        .update_node(id, "n3", NodeUpdate::Done, NOW + 32)
        .expect("n3 done");
    let job = store.get(id).expect("job");
    assert_eq!(job.status(), JobStatus::CompletedWithFailures);
    let p = job.progress();
    assert_eq!(p.nodes_by_state.get("done"), Some(&3));
    assert_eq!(p.nodes_by_state.get("failed"), Some(&1));
    assert_eq!(
        job.nodes["n4"].state,
        NodeJobState::Failed {
            reason: "disk full".into()
        }
    );
    assert!(matches!(
        store.cancel(id, NOW + 40),
        Err(Error::JobFinished(1))
    ));
    assert!(matches!(
        store.update_node(99, "n1", NodeUpdate::Done, NOW),
        Err(Error::UnknownJob(99))
    ));
}

#[test]
fn a_node_that_dies_mid_prewarm_becomes_unknown_and_resumes() {
    let mut inv = inv();
    // `src` holds the whole image, so there is no seed phase.
    inv.apply(pool_node("src", "cpu", "a", &full(&train())), NOW)
        .expect("src");
    let mut store = JobStore::in_memory().expect("store");
    let id = store
        .submit(
            req(
                &["registry.example.com/ml/train:v1.4.2"],
                nodes(&["n1", "n2"]),
            ),
            vec![train()],
            &inv,
            NOW,
        )
        .expect("submit")
        .id;
    let a = store.next_assignments(&inv, NOW).expect("assign");
    assert_eq!(
        a.iter()
            .map(|x| (x.node.as_str(), x.seed))
            .collect::<Vec<_>>(),
        [("n1", false), ("n2", false)],
        "a peer has it: no seed phase"
    );
    // n1 falls silent (others keep reporting).
    for n in ["n2", "src"] {
        inv.heartbeat(n, 1, NOW + 100).expect("hb");
    }
    store.observe(&inv, NOW + 100).expect("observe");
    assert_eq!(
        store.get(id).expect("job").nodes["n1"].state,
        NodeJobState::Unknown
    );
    assert_eq!(store.get(id).expect("job").status(), JobStatus::Running);
    // It comes back with half the bytes: Pending, re-issued.
    let mut n1 = pool_node("n1", "h100", "a", &[(blob(2, GIB), GIB)]);
    n1.generation = 2;
    inv.apply(n1, NOW + 110).expect("back");
    store.observe(&inv, NOW + 110).expect("observe");
    assert_eq!(
        store.get(id).expect("job").nodes["n1"].state,
        NodeJobState::Pending
    );
    let a = store.next_assignments(&inv, NOW + 110).expect("reissue");
    assert_eq!(
        a.iter().map(|x| x.node.as_str()).collect::<Vec<_>>(),
        ["n1"]
    );
    assert_eq!(store.get(id).expect("job").nodes["n1"].bytes_done, GIB);
}

/// A job training on n1 and n2 with a deadline 60 s after `NOW`, its seed assigned.
fn train_on_two_nodes_within_a_minute(inv: &Inventory) -> (JobStore, u64) {
    let mut store = JobStore::in_memory().expect("store");
    let mut r = req(
        &["registry.example.com/ml/train:v1.4.2"],
        nodes(&["n1", "n2"]),
    );
    r.deadline_seconds = Some(60);
    let id = store.submit(r, vec![train()], inv, NOW).expect("submit").id;
    store.next_assignments(inv, NOW).expect("seed");
    (store, id)
}

#[test]
fn deadline_fails_unfinished_nodes_and_keeps_finished_ones() {
    let mut inv = inv();
    let (mut store, id) = train_on_two_nodes_within_a_minute(&inv);
    let job = store.get(id).expect("job").clone();
    let mut n1 = with_job_pins(pool_node("n1", "h100", "a", &full(&train())), &job);
    n1.generation = 2;
    inv.apply(n1, NOW + 30).expect("n1");
    store.observe(&inv, NOW + 30).expect("observe");
    inv.heartbeat("n2", 1, NOW + 61).expect("hb");
    inv.heartbeat("n1", 2, NOW + 61).expect("hb");
    store.observe(&inv, NOW + 61).expect("observe");
    let job = store.get(id).expect("job");
    assert_eq!(job.nodes["n1"].state, NodeJobState::Done);
    assert_eq!(
        job.nodes["n2"].state,
        NodeJobState::Failed {
            reason: "deadline exceeded with 0 of 3326093072 bytes".into()
        }
    );
}

/// A node whose clock runs behind the tracker's still makes progress after the
/// deadline: the tracker's clock decides, and its answer tells the node to stop. Its
/// last word (failed, or done) is still taken.
#[test]
fn progress_after_the_deadline_is_told_to_stop() {
    let inv = inv();
    let (mut store, id) = train_on_two_nodes_within_a_minute(&inv);
    let progress = NodeUpdate::Progress { bytes_done: 1 };
    store
        .update_node(id, "n1", progress.clone(), NOW + 60)
        .expect("at the deadline, progress is still taken");
    // Before the tracker's own pass marks the node failed, and after.
    for now in [NOW + 61, NOW + 62] {
        assert!(matches!(
            store.update_node(id, "n1", progress.clone(), now),
            Err(Error::DeadlinePassed { job, ref node }) if job == id && node == "n1"
        ));
        store.observe(&inv, now).expect("observe");
    }
    store
        .update_node(
            id,
            "n1",
            NodeUpdate::Failed {
                reason: "stopped".into(),
            },
            NOW + 63,
        )
        .expect("the node's last word");
    store
        .update_node(id, "n2", NodeUpdate::Done, NOW + 61)
        .expect("a late done is not refused");
    assert_eq!(
        cluster::http::status_of(&Error::DeadlinePassed {
            job: id,
            node: "n1".into()
        }),
        axum::http::StatusCode::GONE,
        "what the agent reads as \"stop at the deadline\", apart from a cancel's 409"
    );
}

#[test]
fn cancel_keeps_done_nodes() {
    let mut inv = inv();
    inv.apply(pool_node("warm", "h100", "a", &full(&train())), NOW)
        .expect("warm");
    let mut store = JobStore::in_memory().expect("store");
    let id = store
        .submit(
            req(
                &["registry.example.com/ml/train:v1.4.2"],
                nodes(&["warm", "n1", "n2"]),
            ),
            vec![train()],
            &inv,
            NOW,
        )
        .expect("submit")
        .id;
    store.next_assignments(&inv, NOW).expect("assign");
    let job = store.cancel(id, NOW + 5).expect("cancel");
    assert_eq!(job.status(), JobStatus::Cancelled);
    assert_eq!(
        job.nodes
            .iter()
            .map(|(k, v)| (k.as_str(), v.state.clone()))
            .collect::<Vec<_>>(),
        vec![
            ("n1", NodeJobState::Cancelled),
            ("n2", NodeJobState::Cancelled),
            ("warm", NodeJobState::Done)
        ]
    );
    assert!(store
        .next_assignments(&inv, NOW + 6)
        .expect("none")
        .is_empty());
    assert!(matches!(store.cancel(7, NOW), Err(Error::UnknownJob(7))));
    // A cancelled node's agent is told so when it next reports (and stops); a done
    // node's late word changes nothing and is not refused.
    assert!(matches!(
        store.update_node(id, "n1", NodeUpdate::Progress { bytes_done: 1 }, NOW + 7),
        Err(Error::NodeCancelled { job, ref node }) if job == id && node == "n1"
    ));
    store
        .update_node(id, "warm", NodeUpdate::Done, NOW + 7)
        .expect("a done node's word");
}

#[test]
fn jobs_survive_a_tracker_restart() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("jobs.redb");
    let mut inv = inv();
    inv.apply(pool_node("warm", "h100", "a", &full(&train())), NOW)
        .expect("warm");
    let (id1, id2);
    {
        let mut store = JobStore::open(&path).expect("open");
        id1 = store
            .submit(
                req(
                    &["registry.example.com/ml/train:v1.4.2"],
                    nodes(&["warm", "n1"]),
                ),
                vec![train()],
                &inv,
                NOW,
            )
            .expect("1")
            .id;
        id2 = store
            .submit(
                req(&["docker.io/library/busybox:1.36"], nodes(&["n2"])),
                vec![busybox()],
                &inv,
                NOW,
            )
            .expect("2")
            .id;
        store.cancel(id2, NOW + 1).expect("cancel");
        let a = store.next_assignments(&inv, NOW + 2).expect("assign");
        assert_eq!(
            a.iter().map(|x| x.node.as_str()).collect::<Vec<_>>(),
            ["n1"]
        );
        store
            .update_node(id1, "n1", NodeUpdate::Progress { bytes_done: GIB }, NOW + 3)
            .expect("progress");
    }
    let mut store = JobStore::open(&path).expect("reopen");
    assert_eq!((id1, id2), (1, 2));
    assert_eq!(store.next_id(), 3);
    let j1 = store.get(id1).expect("job 1 persisted");
    assert_eq!(
        j1.nodes["warm"].state,
        NodeJobState::Done,
        "nothing already warmed is lost"
    );
    assert_eq!(
        j1.nodes["n1"].state,
        NodeJobState::Pending,
        "running work is re-issued"
    );
    assert_eq!(j1.nodes["n1"].bytes_done, GIB);
    assert_eq!(j1.images[0].manifest_digest, d(100));
    assert_eq!(
        store.get(id2).expect("job 2").status(),
        JobStatus::Cancelled
    );
    let a = store.next_assignments(&inv, NOW + 10).expect("reissue");
    assert_eq!(
        a.iter()
            .map(|x| (x.job_id, x.node.as_str()))
            .collect::<Vec<_>>(),
        [(1, "n1")]
    );
}

#[test]
fn priority_orders_assignments_across_jobs() {
    let mut inv = inv();
    inv.apply(pool_node("src", "cpu", "a", &full(&train())), NOW)
        .expect("src");
    let mut store = JobStore::in_memory().expect("store");
    let low = req(&["registry.example.com/ml/train:v1.4.2"], nodes(&["n1"]));
    let mut high = req(&["registry.example.com/ml/train:v1.4.2"], nodes(&["n2"]));
    high.priority = 10;
    store.submit(low, vec![train()], &inv, NOW).expect("low");
    store.submit(high, vec![train()], &inv, NOW).expect("high");
    let a = store.next_assignments(&inv, NOW).expect("assign");
    assert_eq!(
        a.iter().map(|x| (x.job_id, x.priority)).collect::<Vec<_>>(),
        [(2, 10), (1, 0)]
    );
}

/// The train image to n1, submitted at NOW: the job's id.
fn submit_train_to_n1(store: &mut JobStore, inv: &Inventory) -> u64 {
    store
        .submit(
            req(&["registry.example.com/ml/train:v1.4.2"], nodes(&["n1"])),
            vec![train()],
            inv,
            NOW,
        )
        .expect("submit")
        .id
}

/// The tracker cannot call a node done while the node is still verifying its last
/// blob, or before it pinned the job's images (a client checking the cache right
/// after `prewarm --wait` found neither). Its own word, or a report showing both,
/// finishes it; a job importing into the runtime waits for its word.
#[test]
fn a_running_node_is_done_once_its_blobs_are_verified_and_its_pins_set() {
    for into_runtime in [false, true] {
        let mut inv = inv();
        let mut store = JobStore::in_memory().expect("store");
        let mut r = req(&["registry.example.com/ml/train:v1.4.2"], nodes(&["n1"]));
        r.into_runtime = into_runtime;
        let id = store
            .submit(r, vec![train()], &inv, NOW)
            .expect("submit")
            .id;
        store.next_assignments(&inv, NOW).expect("seed");
        let job = store.get(id).expect("job").clone();
        let state = |store: &JobStore| store.get(id).expect("job").nodes["n1"].state.clone();
        // Every byte written, the last blob not yet verified, pins already there.
        let mut unverified = with_job_pins(pool_node("n1", "h100", "a", &full(&train())), &job);
        unverified.blobs[0].complete = false;
        unverified.generation = 2;
        inv.apply(unverified, NOW + 10).expect("unverified");
        store.observe(&inv, NOW + 10).expect("observe");
        assert_eq!(state(&store), NodeJobState::Running, "{into_runtime}");
        assert!(store.get(id).expect("job").nodes["n1"].bytes_done < train().total_bytes());
        // Verified, not yet pinned.
        let mut unpinned = pool_node("n1", "h100", "a", &full(&train()));
        unpinned.generation = 3;
        inv.apply(unpinned, NOW + 11).expect("unpinned");
        store.observe(&inv, NOW + 11).expect("observe");
        assert_eq!(state(&store), NodeJobState::Running, "{into_runtime}");
        // Pinned until the job's time.
        let mut pinned = with_job_pins(pool_node("n1", "h100", "a", &full(&train())), &job);
        pinned.generation = 4;
        inv.apply(pinned, NOW + 12).expect("pinned");
        store.observe(&inv, NOW + 12).expect("observe");
        let expected = if into_runtime {
            NodeJobState::Running
        } else {
            NodeJobState::Done
        };
        assert_eq!(state(&store), expected, "{into_runtime}");
        store
            .update_node(id, "n1", NodeUpdate::Done, NOW + 13)
            .expect("its word");
        assert_eq!(state(&store), NodeJobState::Done, "{into_runtime}");
    }
}

#[test]
fn lead_time_is_first_use_after_done() {
    let mut inv = inv();
    let mut store = JobStore::in_memory().expect("store");
    let id = submit_train_to_n1(&mut store, &inv);
    store.next_assignments(&inv, NOW).expect("seed");
    let job = store.get(id).expect("job").clone();
    let mut n1 = with_job_pins(pool_node("n1", "h100", "a", &full(&train())), &job);
    n1.generation = 2;
    inv.apply(n1.clone(), NOW + 50).expect("done");
    store.observe(&inv, NOW + 50).expect("observe");
    assert_eq!(
        store.get(id).expect("job").nodes["n1"].finished_at,
        Some(NOW + 50)
    );
    assert!(store.take_lead_times(&inv).expect("none yet").is_empty());
    let mut rec = image_record(&train(), NOW + 50, Default::default(), 1.0);
    rec.last_use = Some(NOW + 950);
    n1.images = vec![rec];
    n1.generation = 3;
    inv.apply(n1, NOW + 950).expect("used");
    assert_eq!(store.take_lead_times(&inv).expect("lead"), vec![900.0]);
    assert!(
        store.take_lead_times(&inv).expect("once").is_empty(),
        "measured once"
    );
}

#[test]
fn files_need_their_source_and_views_hide_the_urls_secrets() {
    use cluster::prewarm::{file_reference, resolve_file, FileSource};
    let inv = inv();
    let key = oci::Digest::of(b"a file's identity");
    let source = FileSource {
        key: key.clone(),
        url: "https://s3.example.com/b/w.bin?X-Amz-Signature=s3cret".into(),
        size: 4096,
        content_digest: false,
    };
    let reference = file_reference(&key);
    let mut r = req(&[&reference], nodes(&["n1"]));
    let msg = |r: &PrewarmRequest| validate(r, &inv).expect_err("refused").to_string();
    assert!(msg(&r).contains("needs its source"), "{}", msg(&r));
    r.files = vec![FileSource {
        url: "file:///etc/passwd".into(),
        ..source.clone()
    }];
    assert!(msg(&r).contains("not an http(s) URL"), "{}", msg(&r));
    r.files = vec![FileSource {
        key: oci::Digest::of(b"another"),
        ..source.clone()
    }];
    assert!(msg(&r).contains("not among"), "{}", msg(&r));
    r.files = vec![FileSource {
        url: format!("https://s3.example.com/{}", "a".repeat(9000)),
        ..source.clone()
    }];
    assert!(msg(&r).contains("longer than"), "{}", msg(&r));
    r.files = vec![source.clone()];
    validate(&r, &inv).expect("a file with its source");

    let image = resolve_file(&r, &reference).expect("resolved from the request");
    assert_eq!(image.manifest_digest, key);
    assert_eq!(image.total_bytes(), 4096);
    let mut store = JobStore::in_memory().expect("store");
    let job = store
        .submit(r, vec![image], &inv, NOW)
        .expect("submitted")
        .clone();
    let view = serde_json::to_string(&job.view()).expect("view as JSON");
    assert!(!view.contains("s3cret"), "{view}");
    assert!(
        view.contains("https://s3.example.com/b/w.bin?redacted"),
        "{view}"
    );
    // The agents get the whole URL: they need the signature.
    let a = store.next_assignments(&inv, NOW).expect("assignments");
    assert_eq!(a[0].files, vec![source]);
}

/// The planner observes every second; a running node whose bytes did not move is not
/// rewritten because the clock moved its ETA a little (with Redis, every rewrite went
/// to every replica), only once the ETA moved by the documented step.
#[test]
fn a_running_node_is_rewritten_for_its_eta_only_when_it_moved_by_a_step() {
    let mut inv = inv();
    inv.apply(pool_node("src", "cpu", "a", &full(&train())), NOW)
        .expect("src");
    let mut store = JobStore::in_memory().expect("store");
    let id = submit_train_to_n1(&mut store, &inv);
    store.next_assignments(&inv, NOW).expect("assign");
    // 1 GiB in after 10 s: progress, written; ETA (2.1 GiB left at 0.1 GiB/s) 21 s.
    let mut n1 = pool_node("n1", "h100", "a", &[(blob(2, GIB), GIB)]);
    n1.generation = 2;
    inv.apply(n1, NOW + 10).expect("progress");
    assert!(store.observe_deferred(&inv, NOW + 10).contains(&id));
    let written = store.get(id).expect("job").nodes["n1"].clone();
    assert_eq!(written.state, NodeJobState::Running);
    let eta = written.eta_seconds.expect("an ETA");
    // No new bytes: the estimate drifts to 23.1 s, then 25.2 s (< 5 s from 21 s).
    for t in [11, 12] {
        for n in ["n1", "src"] {
            inv.heartbeat(n, if n == "n1" { 2 } else { 1 }, NOW + t)
                .expect("hb");
        }
        assert!(
            store.observe_deferred(&inv, NOW + t).is_empty(),
            "nothing to write at +{t} s"
        );
        let nj = &store.get(id).expect("job").nodes["n1"];
        assert_eq!(nj, &written, "the node as written, ETA included");
    }
    // 27.3 s: moved 6.3 s from the written 21 s, past the 5 s step: written.
    inv.heartbeat("n1", 2, NOW + 13).expect("hb");
    assert!(store.observe_deferred(&inv, NOW + 13).contains(&id));
    let later = store.get(id).expect("job").nodes["n1"].eta_seconds;
    assert!(later.expect("an ETA") > eta + 5.0, "{later:?} after {eta}");
}
