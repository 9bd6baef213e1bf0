#![allow(clippy::unwrap_used)]
//! A prewarm job of 1,000 nodes across two tracker replicas sharing a real
//! `redis-server` (issue 14): every node's reports arrive through both replicas at
//! once, as agents moving between replicas would send them, and none is lost. A node
//! report touches that node's own state only (no job-wide rewrite, no cluster-wide
//! lock), so a thousand nodes reporting together are all answered and all kept; and a
//! node of a job cancelled through one replica is told so through the other.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::trackers::{get_json, redis_replica};
use testkit::RedisServer;

const NODES: usize = 1000;
/// Nodes reporting at once (each sends its reports one after the other).
const AT_ONCE: usize = 64;
/// Every tenth node fails with a reason of its own; the others finish.
const FAILING_EVERY: usize = 10;
/// How often and how long `testkit::until` checks (a bound on waiting, not a
/// measurement).
const POLL_EVERY: Duration = Duration::from_millis(200);
const POLL_WITHIN: Duration = Duration::from_secs(120);

fn node_name(i: usize) -> String {
    format!("gpu-{i:04}")
}

fn inventory_report(node: &str) -> serde_json::Value {
    serde_json::json!({
        "node": node,
        "generation": 1,
        "labels": {"gpu": "h100"},
        "cache_budget": 1u64 << 40,
        "cache_used": 0,
        "cache_free": 1u64 << 40,
        "blobs": [],
        "images": [],
    })
}

/// Node `i`'s reports, in order: two progress reports, then Done (or Failed with a
/// reason naming the node for every tenth). Each goes to the replica after the one
/// before, so every node's reports arrive through both.
fn reports_of(i: usize, size: u64) -> Vec<serde_json::Value> {
    let last = if i.is_multiple_of(FAILING_EVERY) {
        serde_json::json!({"kind": "failed", "reason": format!("disk full on {}", node_name(i))})
    } else {
        serde_json::json!({"kind": "done"})
    };
    vec![
        serde_json::json!({"kind": "progress", "bytes_done": size / 3 + i as u64}),
        serde_json::json!({"kind": "progress", "bytes_done": size / 2 + i as u64}),
        last,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_nodes_reporting_through_both_replicas_lose_no_report() {
    let dir = tempfile::tempdir().unwrap();
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let first = redis_replica(&dir.path().join("t1"), &redis.url(), None).await;
    let second = redis_replica(&dir.path().join("t2"), &redis.url(), None).await;
    let urls: Arc<[String]> = Arc::from(vec![first.url(), second.url()]);
    let client = reqwest::Client::new();

    // The inventory: half the nodes report to each replica.
    let names: Vec<String> = (0..NODES).map(node_name).collect();
    for chunk in (0..NODES).collect::<Vec<_>>().chunks(AT_ONCE) {
        let posts = chunk.iter().map(|&i| {
            client
                .post(format!("{}/api/v1/reports", urls[i % 2]))
                .json(&inventory_report(&names[i]))
                .send()
        });
        for r in futures::future::join_all(posts).await {
            assert!(r.unwrap().status().is_success());
        }
    }
    for u in urls.iter() {
        let u = u.clone();
        testkit::until(
            "every node in both inventories",
            POLL_EVERY,
            POLL_WITHIN,
            || {
                let u = u.clone();
                async move {
                    get_json(&format!("{u}/api/v1/nodes")).await["nodes"]
                        .as_array()
                        .map_or(0, Vec::len)
                        == NODES
                }
            },
        )
        .await;
    }

    // One job over all of them: a file source, so no registry is asked; one node
    // at a time is planned, the others move when their agents report.
    let key = oci::Digest::of(b"a thousand nodes");
    let size = 3u64 << 30;
    let job: serde_json::Value = client
        .post(format!("{}/api/v1/prewarm", urls[0]))
        .json(&serde_json::json!({
            "images": [cluster::wire::file_reference(&key)],
            "files": [{"key": key, "url": "http://127.0.0.1:9/weights.bin", "size": size}],
            "targets": {"nodes": names},
            "parallelism": 1,
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = job["id"].as_u64().unwrap_or_else(|| panic!("job: {job}"));

    // Every node's reports, AT_ONCE nodes at a time, alternating replicas.
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..AT_ONCE {
        let (client, urls, next) = (client.clone(), urls.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut refused = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= NODES {
                    return refused;
                }
                for (k, body) in reports_of(i, size).into_iter().enumerate() {
                    let url = format!(
                        "{}/api/v1/prewarm/{id}/nodes/{}",
                        urls[(i + k) % 2],
                        node_name(i)
                    );
                    let status = client.post(url).json(&body).send().await.unwrap().status();
                    if status != reqwest::StatusCode::NO_CONTENT {
                        refused.push((i, k, status));
                    }
                }
            }
        }));
    }
    let mut refused = Vec::new();
    for w in workers {
        refused.extend(w.await.unwrap());
    }
    assert!(refused.is_empty(), "reports not taken: {refused:?}");

    // Both replicas show every node's own last word.
    let failing = NODES.div_ceil(FAILING_EVERY) as u64;
    for u in urls.iter() {
        let u = u.clone();
        testkit::until(
            "the job finished as reported",
            POLL_EVERY,
            POLL_WITHIN,
            || {
                let u = u.clone();
                async move {
                    let p = &get_json(&format!("{u}/api/v1/prewarm/{id}")).await["progress"];
                    p["status"] == "completed_with_failures"
                        && p["nodes_by_state"]["done"].as_u64() == Some(NODES as u64 - failing)
                }
            },
        )
        .await;
        let view = get_json(&format!("{u}/api/v1/prewarm/{id}")).await;
        let nodes = view["nodes"].as_object().unwrap();
        assert_eq!(nodes.len(), NODES);
        for (i, name) in names.iter().enumerate() {
            let n = &nodes[name];
            if i.is_multiple_of(FAILING_EVERY) {
                assert_eq!(n["state"], "failed", "{name}: {n}");
                assert_eq!(n["reason"], format!("disk full on {name}"), "{name}: {n}");
            } else {
                assert_eq!(n["state"], "done", "{name}: {n}");
                assert_eq!(n["bytes_done"], size, "{name}: {n}");
            }
        }
    }

    // A job cancelled through one replica: a node's next word through the other is
    // answered 409, which tells its agent to stop (the state both share decides).
    let other_key = oci::Digest::of(b"cancelled before it was fetched");
    let job: serde_json::Value = client
        .post(format!("{}/api/v1/prewarm", urls[0]))
        .json(&serde_json::json!({
            "images": [cluster::wire::file_reference(&other_key)],
            "files": [{"key": other_key, "url": "http://127.0.0.1:9/other.bin", "size": size}],
            "targets": {"nodes": [names[1]]},
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let cancelled = job["id"].as_u64().unwrap_or_else(|| panic!("job: {job}"));
    let status = client
        .delete(format!("{}/api/v1/prewarm/{cancelled}", urls[0]))
        .send()
        .await
        .unwrap()
        .status();
    assert!(status.is_success(), "cancel: {status}");
    let word = client
        .post(format!(
            "{}/api/v1/prewarm/{cancelled}/nodes/{}",
            urls[1], names[1]
        ))
        .json(&serde_json::json!({"kind": "progress", "bytes_done": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        word.status(),
        reqwest::StatusCode::CONFLICT,
        "{}",
        word.text().await.unwrap_or_default()
    );
}
