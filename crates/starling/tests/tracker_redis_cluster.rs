#![allow(clippy::unwrap_used)]
//! The cluster layer across tracker replicas sharing a real `redis-server` (issue 14):
//! what agents report through one replica, `starling nodes` shows through another; a
//! prewarm job submitted to the replica that plans it finishes through the other after
//! `kill -9` of the first, and `starling where` there finds the image on the nodes the
//! job selected.
//!
//! Against trackers without the shared cluster state (each replica its own inventory
//! and jobs), the second replica knows neither the nodes nor the job.

mod common;

use std::time::Duration;

use common::trackers::{agent_with, get_json, redis_and_registry, redis_replica as replica, TOKEN};
use testkit::{RedisServer, TestImage};

/// How often and how long `testkit::until` checks (a bound on waiting, not a
/// measurement).
const POLL_EVERY: Duration = Duration::from_millis(200);
const POLL_WITHIN: Duration = Duration::from_secs(90);

/// `starling ARGS… --tracker TRACKER --json`, parsed.
async fn cli_json(args: &[&str], tracker: &str) -> serde_json::Value {
    let mut a = common::args(args);
    a.extend(common::args(&["--tracker", tracker, "--json"]));
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_starling"))
            .args(&a)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

/// Names of the nodes `starling nodes` lists through `tracker`.
async fn node_names(tracker: &str) -> Vec<String> {
    let v = cli_json(&["nodes"], tracker).await;
    let mut names: Vec<String> = v["nodes"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|n| n["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reports_taken_by_one_replica_are_listed_by_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let first = replica(&dir.path().join("t1"), &redis.url(), None).await;
    let second = replica(&dir.path().join("t2"), &redis.url(), None).await;
    let http = reqwest::Client::new();
    for (node, blobs) in [("r1", 3), ("r2", 5)] {
        let r = http
            .post(format!("{}/api/v1/reports", first.url()))
            .bearer_auth(TOKEN)
            .json(&common::forged_report(node, 1, 7, blobs))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    }
    let second_url = second.url();
    testkit::until(
        "the second replica to list both nodes",
        POLL_EVERY,
        POLL_WITHIN,
        || {
            let u = second_url.clone();
            async move { node_names(&u).await == ["r1", "r2"] }
        },
    )
    .await;
    // A newer generation through the first replica replaces what the second shows.
    let r = http
        .post(format!("{}/api/v1/reports", first.url()))
        .bearer_auth(TOKEN)
        .json(&common::forged_report("r1", 2, 8, 9))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    testkit::until(
        "the second replica to show r1's new report",
        POLL_EVERY,
        POLL_WITHIN,
        || {
            let u = second_url.clone();
            async move {
                let v = cli_json(&["nodes", "r1"], &u).await;
                v["summary"]["generation"] == 2 && v["summary"]["blobs"] == 9
            }
        },
    )
    .await;
    drop(redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prewarm_job_finishes_through_the_other_replica_after_its_planner_dies() {
    let dir = tempfile::tempdir().unwrap();
    let (redis, registry) = redis_and_registry().await;
    let image = TestImage::push_multilayer(&registry, "ha/prewarm", "1", &[12 << 20, 12 << 20], 41)
        .unwrap();
    let mut first = replica(&dir.path().join("t1"), &redis.url(), Some(&registry)).await;
    let first_url = first.url();
    // The first replica plans (it holds the prewarm lease before the second starts).
    testkit::until("the first replica to plan", POLL_EVERY, POLL_WITHIN, || {
        let u = first_url.clone();
        async move { common::metric(&u, "starling_tracker_prewarm_leader").await == 1 }
    })
    .await;
    let second = replica(&dir.path().join("t2"), &redis.url(), Some(&registry)).await;
    let second_url = second.url();
    let list = format!("{first_url},{second_url}");
    let mut agents = Vec::new();
    for (name, gpu) in [("p1", "h100"), ("p2", "h100"), ("p3", "a100")] {
        let label = format!("gpu={gpu}");
        agents.push(agent_with(dir.path(), name, &list, &registry, &["--label", &label]).await);
    }
    // Reported through the first replica, listed by the second.
    testkit::until(
        "the second replica to list the agents",
        POLL_EVERY,
        POLL_WITHIN,
        || {
            let u = second_url.clone();
            async move { node_names(&u).await == ["p1", "p2", "p3"] }
        },
    )
    .await;
    assert_eq!(
        common::metric(&second_url, "starling_tracker_prewarm_leader").await,
        0,
        "one planner at a time"
    );

    // 4 MiB/s per node: the job runs for seconds, so the kill lands mid-job.
    let job: serde_json::Value = reqwest::Client::new()
        .post(format!("{first_url}/api/v1/prewarm"))
        .json(&serde_json::json!({
            "images": [image.reference],
            "targets": {"selector": "gpu=h100"},
            "per_node_bytes_per_sec": 4 << 20,
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = job["id"].as_u64().unwrap_or_else(|| panic!("job: {job}"));
    testkit::until(
        "a node of the job running",
        Duration::from_millis(50),
        POLL_WITHIN,
        || {
            let u = first_url.clone();
            async move {
                let v = get_json(&format!("{u}/api/v1/prewarm/{id}")).await;
                v["progress"]["nodes_by_state"]["running"].as_u64() >= Some(1)
            }
        },
    )
    .await;
    first.kill9();

    testkit::until(
        "the job done through the second replica",
        POLL_EVERY,
        POLL_WITHIN,
        || {
            let u = second_url.clone();
            async move {
                get_json(&format!("{u}/api/v1/prewarm/{id}")).await["progress"]["status"] == "done"
            }
        },
    )
    .await;
    assert_eq!(
        common::metric(&second_url, "starling_tracker_prewarm_leader").await,
        1,
        "the second replica took the planner lease"
    );
    let view = get_json(&format!("{second_url}/api/v1/prewarm/{id}")).await;
    let targeted: Vec<&str> = view["nodes"]
        .as_object()
        .map(|m| m.keys().map(String::as_str).collect())
        .unwrap_or_default();
    assert_eq!(targeted, ["p1", "p2"], "the selector's nodes: {view}");
    for n in targeted {
        assert_eq!(view["nodes"][n]["state"], "done", "{view}");
    }

    // `starling where` through the second replica: the selected nodes hold it all.
    let full = |w: &serde_json::Value, n: &str| {
        w["nodes"].as_array().is_some_and(|v| {
            v.iter().any(|x| {
                x["node"] == n
                    && x["bytes_held"].as_u64().is_some_and(|b| b > 0)
                    && x["bytes_held"] == x["total_bytes"]
            })
        })
    };
    let reference = image.reference.clone();
    testkit::until(
        "starling where to find the image on the selected nodes",
        POLL_EVERY,
        POLL_WITHIN,
        || {
            let (u, r) = (second_url.clone(), reference.clone());
            async move {
                let w = cli_json(&["where", &r], &u).await;
                full(&w, "p1") && full(&w, "p2") && !full(&w, "p3")
            }
        },
    )
    .await;
    drop(agents);
}
