#![allow(clippy::unwrap_used)]
//! Two tracker replicas sharing one real `redis-server` (`--redis`), driven in process
//! through their routers: one registry fetcher per blob however announces race across
//! replicas, one geometry, hashes published on one replica served by the other, and
//! 503 (not answers from a stale copy) while Redis is down, then recovery.

mod common;

use std::time::Duration;

use common::{
    announce, ask, cluster_replica, get, metrics_text, replica_with_peer_ttl, report, stream_nodes,
    submit_one_layer_job, submit_one_layer_job_due,
};
use http::StatusCode;
use swarm::{AnnounceResponse, Role, SwarmConfig};
use testkit::RedisServer;
use tracker::{RedisOptions, Tracker};

fn replica(redis: &RedisServer) -> Tracker {
    let opts = RedisOptions {
        refresh: Duration::ZERO,
        ..RedisOptions::new(redis.url())
    };
    Tracker::new(SwarmConfig::default(), None)
        .with_redis(&opts)
        .expect("a valid Redis URL")
}

async fn until_status(t: &Tracker, path: &str, want: StatusCode) {
    for _ in 0..300 {
        if get(t, path).await.0 == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{path} never answered {want}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_announces_on_two_replicas_elect_exactly_one_fetcher() {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let replicas = [replica(&redis), replica(&redis)];
    for round in 0..5u8 {
        let digest = oci::Digest::of(&[b'r', round]);
        // Each announce on its own task, released together: the replicas decide at
        // the same moment, each on a copy where nobody is elected yet.
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(24));
        let tasks: Vec<_> = (0..24)
            .map(|i| {
                let t = replicas[i % 2].clone();
                let req = ask(&format!("node-{i}"), &digest);
                let start = start.clone();
                tokio::spawn(async move {
                    start.wait().await;
                    announce(&t, &req).await
                })
            })
            .collect();
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.unwrap());
        }
        let answers: Vec<AnnounceResponse> = answers
            .into_iter()
            .map(|(s, a)| {
                assert_eq!(s, StatusCode::OK);
                a.expect("an answer")
            })
            .collect();
        let sources: Vec<&AnnounceResponse> =
            answers.iter().filter(|a| a.role == Role::Source).collect();
        assert_eq!(sources.len(), 1, "round {round}: one fetcher cluster-wide");
        let elected = sources[0].source.clone().expect("the source names itself");
        // Everyone who was told of a source was told of the same one.
        for a in &answers {
            if let Some(s) = &a.source {
                assert_eq!(s, &elected);
            }
        }
        // Both replicas count one election for this blob.
        for t in &replicas {
            let mine = common::swarm_entry(t, &digest).await;
            assert_eq!(mine["source_elections"], 1, "{mine}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn geometry_and_hashes_set_on_one_replica_are_what_the_other_serves() {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let (a, b) = (replica(&redis), replica(&redis));
    let digest = oci::Digest::of(b"geometry");
    let (_, first) = announce(&a, &ask("src", &digest)).await;
    assert_eq!(first.expect("answer").role, Role::Source);
    let mut other = ask("late", &digest);
    other.piece_size = Some(4 << 20);
    let (_, second) = announce(&b, &other).await;
    let second = second.expect("answer");
    assert_eq!(
        second.piece_size,
        1 << 20,
        "the first geometry holds everywhere"
    );
    assert_eq!(second.role, Role::Peer);
    assert_eq!(second.source.as_deref(), Some("src"));
    assert!(
        second.peers.iter().any(|p| p.node == "src"),
        "members are shared"
    );

    let hash = swarm::PieceHash::of(b"piece zero");
    let mut publish = ask("src", &digest);
    publish.hashes.insert(0, hash.to_hex());
    announce(&a, &publish).await;
    // A non-source cannot publish, through either replica.
    let mut forged = ask("late", &digest);
    forged
        .hashes
        .insert(1, swarm::PieceHash::of(b"lie").to_hex());
    announce(&a, &forged).await;
    let (status, hashes) = get(&b, &format!("/swarm/v1/hashes?digest={digest}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(hashes, serde_json::json!({ "0": hash.to_hex() }));
    let (_, again) = announce(&b, &ask("late", &digest)).await;
    assert_eq!(again.expect("answer").hashes.get(&0), Some(&hash.to_hex()));
}

/// A source its swarm cannot reach holds the role in Redis, renewed by its own
/// announces on a replica that heard no report. The replica that did hear the reports
/// demotes it there too, so the member is elected at once rather than after the source
/// has read the whole blob.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_demoted_on_one_replica_loses_the_role_on_every_replica() {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let (a, b) = (replica(&redis), replica(&redis));
    let digest = oci::Digest::of(b"demoted");
    let mut src = ask("src", &digest);
    src.fetching_from_registry = true;
    let (_, first) = announce(&a, &src).await;
    assert_eq!(first.expect("answer").role, Role::Source);
    let (_, joined) = announce(&a, &ask("m", &digest)).await;
    assert_eq!(joined.expect("answer").role, Role::Peer);
    let (_, renewed) = announce(&a, &src).await;
    assert_eq!(renewed.expect("answer").role, Role::Source);
    let mut report = ask("m", &digest);
    report.bad_peers = vec!["src".into()];
    let (_, elected) = announce(&b, &report).await;
    let elected = elected.expect("answer");
    assert_eq!(
        (elected.role, elected.source.as_deref()),
        (Role::Source, Some("m")),
        "the replica that heard the report deposes the source in Redis"
    );
    let (_, demoted) = announce(&a, &src).await;
    let demoted = demoted.expect("answer");
    assert_eq!(
        (demoted.role, demoted.source.as_deref()),
        (Role::Peer, Some("m")),
        "the other replica, which heard no report, follows Redis"
    );
    assert!(metrics_text(&b)
        .await
        .contains("starling_tracker_source_demotions_total 1"));
}

/// Members whose connections a Service spread over two replicas report the source
/// they cannot reach to different ones: neither replica heard a quorum itself, and the
/// swarm still has to go on without that source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_split_over_replicas_still_demote_an_unreachable_source() {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let (a, b) = (replica(&redis), replica(&redis));
    let digest = oci::Digest::of(b"split reports");
    let mut src = ask("src", &digest);
    src.fetching_from_registry = true;
    let (_, first) = announce(&a, &src).await;
    assert_eq!(first.expect("answer").role, Role::Source);
    for m in ["m1", "m2", "m3"] {
        let (_, joined) = announce(&a, &ask(m, &digest)).await;
        assert_eq!(joined.expect("answer").role, Role::Peer);
    }
    let reporting = |m: &str| {
        let mut r = ask(m, &digest);
        r.bad_peers = vec!["src".into()];
        r
    };
    let (_, one) = announce(&a, &reporting("m1")).await;
    assert_eq!(one.expect("answer").source.as_deref(), Some("src"));
    let (_, two) = announce(&b, &reporting("m2")).await;
    assert_eq!(
        two.expect("answer").source.as_deref(),
        Some("src"),
        "two reports of three members fetching are no quorum"
    );
    let (_, three) = announce(&b, &reporting("m3")).await;
    let three = three.expect("answer");
    assert_eq!(
        (three.role, three.source.as_deref()),
        (Role::Source, Some("m3")),
        "m1's report, heard by the other replica, completes the quorum"
    );
    let (_, demoted) = announce(&a, &src).await;
    assert_eq!(demoted.expect("answer").role, Role::Peer);
}

/// A source whose registry bytes failed the digest voids the hashes it published,
/// through one replica; the other replica's copy, which had them, must drop them too
/// (copies merge what Redis has, so without the epoch it would keep serving them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hashes_voided_through_one_replica_are_gone_from_every_copy() {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let (a, b) = (replica(&redis), replica(&redis));
    let digest = oci::Digest::of(b"voided");
    let mut src = ask("src", &digest);
    src.fetching_from_registry = true;
    src.hashes
        .insert(0, swarm::PieceHash::of(b"bad bytes").to_hex());
    let (_, first) = announce(&a, &src).await;
    assert_eq!(first.expect("answer").role, Role::Source);
    let (_, seen) = announce(&b, &ask("m", &digest)).await;
    let seen = seen.expect("answer");
    assert_eq!(
        (seen.hashes.len(), seen.hashes_epoch),
        (1, 0),
        "b's copy has it"
    );
    let mut failed = ask("src", &digest);
    failed.leaving = true;
    failed.hashes_void = true;
    let (status, _) = announce(&a, &failed).await;
    assert_eq!(status, StatusCode::OK);
    let (_, after) = announce(&b, &ask("m", &digest)).await;
    let after = after.expect("answer");
    assert_eq!(
        (after.hashes.len(), after.hashes_epoch),
        (0, 1),
        "the other replica forgot them and says the epoch moved on"
    );
    let (status, hashes) = get(&b, &format!("/swarm/v1/hashes?digest={digest}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(hashes, serde_json::json!({}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_a_replica_is_unready_and_refuses_then_recovers() {
    let mut redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let t = replica(&redis);
    t.spawn_expiry();
    until_status(&t, "/readyz", StatusCode::OK).await;
    let digest = oci::Digest::of(b"outage");
    assert_eq!(announce(&t, &ask("a", &digest)).await.0, StatusCode::OK);

    redis.kill();
    let (status, _) = announce(&t, &ask("b", &digest)).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "no answer from a stale copy"
    );
    until_status(&t, "/healthz", StatusCode::SERVICE_UNAVAILABLE).await;
    let (_, metrics) = (StatusCode::OK, metrics_text(&t).await);
    assert!(metrics.contains("starling_tracker_redis_up 0"), "{metrics}");
    assert!(metrics.contains("starling_tracker_redis_errors_total{reason=\"load\"}"));

    let redis = tokio::task::spawn_blocking(move || {
        redis.restart();
        redis
    })
    .await
    .unwrap();
    until_status(&t, "/readyz", StatusCode::OK).await;
    // Redis came back empty: the next announce elects again, and it is a clean state.
    let mut ok = None;
    for _ in 0..100 {
        let (status, resp) = announce(&t, &ask("b", &digest)).await;
        if status == StatusCode::OK {
            ok = resp;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let resp = ok.expect("announces succeed again");
    assert_eq!(
        resp.role,
        Role::Source,
        "the restarted Redis had no fetcher"
    );
    assert!(metrics_text(&t)
        .await
        .contains("starling_tracker_redis_up 1"));
    drop(redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_leads_at_a_time_and_another_takes_over_when_it_stops() {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let opts = RedisOptions::new(redis.url());
    let connect = || {
        tracker::redis_store::RedisStore::connect(&opts, Duration::from_secs(5), Default::default())
            .unwrap()
    };
    let (a, b) = (connect(), connect());
    let lease = Duration::from_millis(300);
    assert!(a.lead("test", lease).await.unwrap());
    assert!(!b.lead("test", lease).await.unwrap(), "one leader");
    assert!(a.lead("test", lease).await.unwrap(), "the leader renews");
    assert!(!b.lead("test", lease).await.unwrap());
    // The leader stops renewing (dead or cut off): the other one takes over.
    let mut took = false;
    for _ in 0..200 {
        if b.lead("test", lease).await.unwrap() {
            took = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(took, "the lease passed on");
    assert!(
        !a.lead("test", lease).await.unwrap(),
        "the old leader is out"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_janitor_removes_members_that_stopped_announcing() {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let t = replica_with_peer_ttl(&RedisOptions::new(redis.url()), 10);
    let digest = oci::Digest::of(b"janitor");
    assert_eq!(announce(&t, &ask("gone", &digest)).await.0, StatusCode::OK);
    let janitor = tracker::redis_store::RedisStore::connect(
        &RedisOptions::new(redis.url()),
        Duration::from_millis(10),
        Default::default(),
    )
    .unwrap();
    assert_eq!(janitor.sweep().await.unwrap(), 0, "still fresh right after");
    let mut removed = 0;
    for _ in 0..200 {
        removed = janitor.sweep().await.unwrap();
        if removed > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(removed, 1, "the silent member left Redis");
    // Joined, then removed by the janitor: replicas reading the change stream learn both.
    assert_eq!(stream_nodes(&redis, &digest).await, ["gone", "gone"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_in_the_url_authenticates_and_a_wrong_one_keeps_the_replica_unready() {
    let redis = tokio::task::spawn_blocking(|| RedisServer::start_with_password("s3cret-pw"))
        .await
        .unwrap();
    let good = replica(&redis);
    until_status(&good, "/readyz", StatusCode::OK).await;
    let digest = oci::Digest::of(b"auth");
    let (status, resp) = announce(&good, &ask("a", &digest)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(resp.expect("answer").role, Role::Source);

    let wrong_url = redis.url().replace("s3cret-pw", "wrong");
    let wrong = Tracker::new(SwarmConfig::default(), None)
        .with_redis(&RedisOptions::new(wrong_url))
        .unwrap();
    let (status, _) = announce(&wrong, &ask("b", &digest)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    until_status(&wrong, "/readyz", StatusCode::SERVICE_UNAVAILABLE).await;
    let metrics = metrics_text(&wrong).await;
    assert!(!metrics.contains("s3cret") && !metrics.contains("wrong@"));
}

/// A real redis-server and two tracker replicas with cluster layers sharing it.
async fn two_cluster_replicas() -> (
    RedisServer,
    (Tracker, cluster::ClusterState),
    (Tracker, cluster::ClusterState),
) {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let a = cluster_replica(&RedisOptions::new(redis.url()));
    let b = cluster_replica(&RedisOptions::new(redis.url()));
    (redis, a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn job_changes_racing_on_two_replicas_are_all_kept() {
    let (_redis, (_ta, a), (_tb, b)) = two_cluster_replicas().await;
    let nodes: Vec<String> = (0..8).map(|i| format!("n{i}")).collect();
    for n in &nodes {
        a.ingest(report(n, 1)).unwrap();
    }
    // B learns A's reports from Redis.
    for _ in 0..200 {
        if b.inventory().entries().count() == nodes.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(b.inventory().entries().count(), nodes.len());

    let names: Vec<&str> = nodes.iter().map(String::as_str).collect();
    let id = submit_one_layer_job(
        &a,
        "registry.test/ml/train@sha256:0000000000000000000000000000000000000000000000000000000000000001",
        &oci::Digest::of(b"layer"),
        1 << 20,
        &names,
    )
    .await;
    // Every node's completion arrives at one replica or the other, all at once: each
    // change starts from the other's, none is lost.
    let mut updates = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        let (s, n) = (if i % 2 == 0 { a.clone() } else { b.clone() }, n.clone());
        updates.push(tokio::spawn(async move {
            s.change_jobs(|| s.update_prewarm_node(id, &n, cluster::wire::NodeUpdate::Done))
                .await
        }));
    }
    for u in updates {
        u.await.unwrap().unwrap();
    }
    for s in [&a, &b] {
        s.refresh_jobs().await.unwrap();
        let done = s.with_jobs(|j| {
            j.get(id).map_or(0, |job| {
                job.nodes
                    .values()
                    .filter(|n| n.state == cluster::prewarm::NodeJobState::Done)
                    .count()
            })
        });
        assert_eq!(done, nodes.len(), "every node's Done kept");
    }
}

/// A planner step on one replica decides for a node while an agent's report for that
/// node lands through the other: the report is kept, the step's change of that node
/// is reported lost (its assignment is not sent), and its change of another node is
/// written.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_report_racing_a_planner_step_wins_and_the_step_learns_it() {
    let (_redis, (_ta, a), (_tb, b)) = two_cluster_replicas().await;
    for n in ["n0", "n1"] {
        a.ingest(report(n, 1)).unwrap();
    }
    let id = submit_one_layer_job(
        &a,
        "registry.test/ml/train@sha256:0000000000000000000000000000000000000000000000000000000000000002",
        &oci::Digest::of(b"layer"),
        1 << 20,
        &["n0", "n1"],
    )
    .await;
    let failed = |why: &str| cluster::wire::NodeUpdate::Failed { reason: why.into() };
    let ((), lost) = a
        .change_jobs_fenced(None, || {
            // The agent of n0 reports Done through the other replica after this step
            // read the job, before it writes.
            tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(b.report_prewarm_node(
                    id,
                    "n0",
                    cluster::wire::NodeUpdate::Done,
                ))
            })
            .unwrap();
            a.update_prewarm_node(id, "n0", failed("planner's word"))?;
            a.update_prewarm_node(id, "n1", failed("planner's word"))
        })
        .await
        .unwrap();
    assert_eq!(
        lost.into_iter().collect::<Vec<_>>(),
        [(id, "n0".to_owned())],
        "only the raced node's change is lost"
    );
    for s in [&a, &b] {
        s.refresh_jobs().await.unwrap();
        let states = s.with_jobs(|j| {
            let job = j.get(id).unwrap();
            (job.nodes["n0"].state.clone(), job.nodes["n1"].state.clone())
        });
        assert_eq!(
            states.0,
            cluster::prewarm::NodeJobState::Done,
            "the agent's report kept"
        );
        assert_eq!(
            states.1,
            cluster::prewarm::NodeJobState::Failed {
                reason: "planner's word".into()
            }
        );
    }
}

/// The deadline is the tracker's on every replica: a node's progress after it, through
/// a replica that did not submit the job, is answered "stop" (the agent reads 410), and
/// its last word is still taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn progress_after_the_deadline_is_told_to_stop_through_any_replica() {
    let (_redis, (_ta, a), (_tb, b)) = two_cluster_replicas().await;
    a.ingest(report("n0", 1)).unwrap();
    let id = submit_one_layer_job_due(
        &a,
        "registry.test/ml/train@sha256:0000000000000000000000000000000000000000000000000000000000000003",
        &oci::Digest::of(b"layer"),
        1 << 20,
        &["n0"],
        Some(1),
    )
    .await;
    b.refresh_jobs().await.unwrap();
    let progress = cluster::wire::NodeUpdate::Progress { bytes_done: 1 };
    b.report_prewarm_node(id, "n0", progress.clone())
        .await
        .expect("progress before the deadline");
    // The deadline is in whole seconds: one second from submission has passed for
    // certain two seconds later.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let after = b.report_prewarm_node(id, "n0", progress).await;
    assert!(
        matches!(&after, Err(cluster::Error::DeadlinePassed { job, node }) if *job == id && node == "n0"),
        "{after:?}"
    );
    b.report_prewarm_node(
        id,
        "n0",
        cluster::wire::NodeUpdate::Failed {
            reason: "stopped".into(),
        },
    )
    .await
    .expect("the node's last word");
}

/// A planner paused past its lease, which another replica took meanwhile, resumes
/// believing it plans: its node writes and its commit carry its old epoch and are
/// refused (nothing written, the job lock let go), while the new planner's go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planner_that_lost_its_lease_writes_nothing_after_the_next_took_it() {
    use cluster::{ClusterShare, NodeWrite};
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let opts = RedisOptions::new(redis.url());
    let connect = || {
        tracker::redis_store::RedisStore::connect(&opts, Duration::from_secs(5), Default::default())
            .unwrap()
    };
    let (a, b) = (connect(), connect());
    let lease = Duration::from_millis(300);
    let old = a
        .lead_fenced("prewarm", lease)
        .await
        .unwrap()
        .expect("a leads");
    assert_eq!(
        b.lead_fenced("prewarm", lease).await.unwrap(),
        None,
        "one leader"
    );
    let mut new = None;
    for _ in 0..200 {
        new = b.lead_fenced("prewarm", lease).await.unwrap();
        if new.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let new = new.expect("the lease passed on");
    assert!(new > old, "a new term: {new} after {old}");

    let write = || NodeWrite {
        node: "n0".into(),
        expect: 0,
        json: br#"{"state":"pending"}"#.to_vec(),
    };
    assert!(a.write_nodes(1, Some(old), vec![write()]).await.is_err());
    let begun = a.begin(0).await.unwrap();
    assert!(a
        .commit(begun.lock, Some(old), vec![(1, b"{}".to_vec())])
        .await
        .is_err());
    let (headers, _) = b.read(0).await.unwrap();
    assert!(headers.unwrap_or_default().is_empty(), "no header written");
    assert!(
        b.pull_nodes(0, vec![1]).await.unwrap().nodes.is_empty(),
        "no node written"
    );

    // The refused commit let go of the job lock; the current planner writes.
    assert_eq!(
        b.write_nodes(1, Some(new), vec![write()]).await.unwrap(),
        [Some(1)]
    );
    let begun = b.begin(0).await.unwrap();
    b.commit(begun.lock, Some(new), vec![(1, b"{}".to_vec())])
        .await
        .unwrap();
    let pulled = b.pull_nodes(0, Vec::new()).await.unwrap();
    assert_eq!(pulled.nodes.len(), 1);
    assert_eq!(pulled.revision, 1);
}
