#![allow(clippy::unwrap_used)]
//! Replicas sharing one real `redis-server` read only what changed (issue 14): swarm
//! members through each swarm's change stream, inventory reports through the
//! inventory's. The safety-net full reads are set an hour apart, so every change a
//! replica sees here after its first read came through the stream: a change the
//! incremental path missed fails the test. Also: a replica whose place in a stream
//! was trimmed away reads whole again, a member re-announcing within its heartbeat
//! writes nothing, the janitor's removals are in the stream (`redis_replicas.rs`), and
//! a burst of inventory reports beyond the old publish queue
//! (1,024) reaches the other replica whole.

mod common;

use std::time::Duration;

use common::{
    ask, cluster_replica, key, metrics_text, raw, replica_with_peer_ttl, report,
    submit_one_layer_job,
};
use http::StatusCode;
use swarm::{AnnounceRequest, SwarmConfig};
use testkit::RedisServer;
use tracker::{RedisOptions, Tracker};

const HOUR: Duration = Duration::from_secs(3600);

fn options(redis: &RedisServer) -> RedisOptions {
    RedisOptions {
        refresh: Duration::ZERO,
        full_reread: HOUR,
        inventory_sweep: HOUR,
        ..RedisOptions::new(redis.url())
    }
}

fn replica(redis: &RedisServer) -> Tracker {
    Tracker::new(SwarmConfig::default(), None)
        .with_redis(&options(redis))
        .unwrap()
}

async fn announce(t: &Tracker, req: &AnnounceRequest) {
    let (status, _) = common::announce(t, req).await;
    assert_eq!(status, StatusCode::OK);
}

/// (members, complete members) of swarm `digest` as replica `t` has them now.
async fn members(t: &Tracker, digest: &oci::Digest) -> (u64, u64) {
    let s = common::swarm_entry(t, digest).await;
    (
        s["peers"].as_u64().unwrap(),
        s["complete"].as_u64().unwrap(),
    )
}

/// A counter of `t`'s metrics with the given labels (0 when absent).
async fn counter(t: &Tracker, name: &str, kind: &str) -> u64 {
    let text = metrics_text(t).await;
    let series = format!("starling_tracker_{name}_total{{kind=\"{kind}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .map_or(0, |v| v.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_added_changed_and_removed_on_one_replica_reach_the_other_through_the_stream() {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let (a, b) = (replica(&redis), replica(&redis));
    let digest = oci::Digest::of(b"changes");
    for i in 0..20 {
        announce(&a, &ask(&format!("n{i}"), &digest)).await;
    }
    announce(&b, &ask("watcher", &digest)).await;
    assert_eq!(members(&b, &digest).await, (21, 0));
    assert_eq!(counter(&b, "redis_member_reads", "full").await, 1);

    // Joined through A.
    for i in 20..25 {
        announce(&a, &ask(&format!("n{i}"), &digest)).await;
    }
    assert_eq!(members(&b, &digest).await, (26, 0));
    // Left through A.
    let mut leaving = ask("n0", &digest);
    leaving.leaving = true;
    announce(&a, &leaving).await;
    assert_eq!(members(&b, &digest).await, (25, 0));
    // Completed through A: the shape changed, shared at once.
    let mut done = ask("n1", &digest);
    done.complete = true;
    announce(&a, &done).await;
    assert_eq!(members(&b, &digest).await, (25, 1));

    assert_eq!(
        counter(&b, "redis_member_reads", "full").await,
        1,
        "everything after the first read came from the change stream"
    );
    assert!(counter(&b, "redis_member_reads", "changes").await >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_announcing_again_within_its_heartbeat_writes_nothing() {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    // A long peer TTL: the heartbeat (a third of it) cannot pass during the test.
    let a = replica_with_peer_ttl(&options(&redis), 3_600_000);
    let digest = oci::Digest::of(b"heartbeat");
    let mut con = raw(&redis).await;
    let mut req = ask("n", &digest);
    req.have = Some(swarm::Bitfield::new(64));
    announce(&a, &req).await;
    let stored: Vec<u8> = redis::cmd("HGET")
        .arg(key(&digest, "members"))
        .arg("n")
        .query_async(&mut con)
        .await
        .unwrap();
    let xlen = |con: &mut redis::aio::MultiplexedConnection| {
        let mut con = con.clone();
        let k = key(&digest, "changes");
        async move {
            redis::cmd("XLEN")
                .arg(k)
                .query_async::<u64>(&mut con)
                .await
                .unwrap()
        }
    };
    assert_eq!(xlen(&mut con).await, 1, "joining is a change");
    // A new bitfield and a later last_seen only: not a change yet.
    req.have.as_mut().unwrap().set(3);
    announce(&a, &req).await;
    assert_eq!(xlen(&mut con).await, 1);
    let again: Vec<u8> = redis::cmd("HGET")
        .arg(key(&digest, "members"))
        .arg("n")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(again, stored, "the stored entry was not rewritten");
    // Completion changes the shape: written and appended at once.
    req.complete = true;
    announce(&a, &req).await;
    assert_eq!(xlen(&mut con).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_place_in_the_stream_was_trimmed_away_reads_whole() {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let (a, b) = (replica(&redis), replica(&redis));
    let digest = oci::Digest::of(b"trimmed");
    announce(&a, &ask("first", &digest)).await;
    announce(&b, &ask("watcher", &digest)).await;
    assert_eq!(members(&b, &digest).await, (2, 0));
    for i in 0..10 {
        announce(&a, &ask(&format!("n{i}"), &digest)).await;
    }
    // The stream loses the entries after B's place (exact trim to the last one).
    let mut con = raw(&redis).await;
    let _: u64 = redis::cmd("XTRIM")
        .arg(key(&digest, "changes"))
        .arg("MAXLEN")
        .arg(1)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(members(&b, &digest).await, (12, 0));
    assert_eq!(
        counter(&b, "redis_member_reads", "full").await,
        2,
        "the trimmed stream could not say what changed: read whole"
    );
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..600 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never: {what}");
}

/// One thread: the burst is taken before the publisher runs at all, as when a replica
/// takes reports faster than it publishes them.
#[tokio::test(flavor = "current_thread")]
async fn a_burst_of_reports_beyond_the_old_queue_reaches_the_other_replica_whole() {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let ((_ta, a), (tb, b)) = (
        cluster_replica(&options(&redis)),
        cluster_replica(&options(&redis)),
    );
    const NODES: usize = 3_000;
    for generation in [1, 2] {
        for i in 0..NODES {
            a.ingest(report(&format!("n{i}"), generation)).unwrap();
        }
    }
    until("B holds every node A took", || {
        b.inventory().entries().count() == NODES
    })
    .await;
    assert!(b.inventory().entries().all(|e| e.report.generation == 2));

    // A changed report now reaches B through the change stream: no sweep is due for
    // an hour (B swept at start, and once more if the stream was still empty then).
    let sweeps = counter(&tb, "redis_inventory_reads", "sweep").await;
    assert!((1..=2).contains(&sweeps), "{sweeps} sweeps");
    a.ingest(report("n7", 3)).unwrap();
    until("B holds n7's new report", || {
        b.inventory().entry("n7").map(|e| e.report.generation) == Some(3)
    })
    .await;
    assert_eq!(counter(&tb, "redis_inventory_reads", "sweep").await, sweeps);
    assert!(counter(&tb, "redis_inventory_reads", "changes").await >= 1);
}

/// The planner's step observes every second; a running node whose bytes did not move
/// keeps its stored state and revision (before, its ETA drifted with the clock and
/// every step rewrote it for every replica), until its ETA moved by the step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_leaves_a_running_node_alone_while_only_its_eta_drifts() {
    use cluster::ClusterShare;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    const T: u64 = 1_000_000;
    let clock = Arc::new(AtomicU64::new(T));
    let state = cluster::ClusterState::with_options(
        cluster::ClusterConfig::default(),
        cluster::JobStore::in_memory().unwrap(),
        None,
        Arc::new({
            let clock = clock.clone();
            move || clock.load(Ordering::Relaxed)
        }),
    );
    let _t = Tracker::new(SwarmConfig::default(), None)
        .with_cluster(state.clone())
        .with_redis(&options(&redis))
        .unwrap();
    let layer = oci::Digest::of(b"eta layer");
    let holding = |generation: u64, held: u64| -> cluster::NodeReport {
        serde_json::from_value(serde_json::json!({
            "node": "n1", "generation": generation, "labels": {},
            "cache_budget": 1u64 << 40, "cache_used": held, "cache_free": 1u64 << 40,
            "blobs": [{"digest": layer, "size": 3u64 << 30, "bytes_held": held, "complete": false}],
            "images": [],
        }))
        .unwrap()
    };
    state.ingest(holding(1, 0)).unwrap();
    let id = submit_one_layer_job(
        &state,
        "registry.test/ml/eta@sha256:0000000000000000000000000000000000000000000000000000000000000003",
        &layer,
        3 << 30,
        &["n1"],
    )
    .await;
    state
        .change_jobs(|| state.next_assignments())
        .await
        .unwrap();
    let reader = tracker::redis_store::RedisStore::connect(
        &RedisOptions::new(redis.url()),
        Duration::from_secs(5),
        Default::default(),
    )
    .unwrap();
    async fn stored_revision(reader: &tracker::redis_store::RedisStore, id: u64) -> u64 {
        reader
            .read_node(id, "n1".into())
            .await
            .unwrap()
            .expect("n1 is stored")
            .revision
    }
    let revision = || stored_revision(&reader, id);
    // 1 GiB of 3 in 10 s: progress, written (ETA 20 s).
    clock.store(T + 10, Ordering::Relaxed);
    state.ingest(holding(2, 1 << 30)).unwrap();
    state.change_jobs(|| state.tick_jobs()).await.unwrap();
    let written = revision().await;
    // No new bytes: the ETA drifts to 22 s, then 24 s, less than the 5 s step.
    for t in [11, 12] {
        clock.store(T + t, Ordering::Relaxed);
        state.heartbeat("n1", 2).unwrap();
        state.change_jobs(|| state.tick_jobs()).await.unwrap();
        assert_eq!(revision().await, written, "n1 not rewritten at +{t} s");
    }
    // 26 s: 6 s from the written 20 s, past the step.
    clock.store(T + 13, Ordering::Relaxed);
    state.heartbeat("n1", 2).unwrap();
    state.change_jobs(|| state.tick_jobs()).await.unwrap();
    assert!(revision().await > written);
}
