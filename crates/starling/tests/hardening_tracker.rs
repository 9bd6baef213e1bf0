//! Attacks on a real `starling tracker` process (security issue 12): requests that made
//! it connect to arbitrary hosts, hold connections forever, grow without bound, refuse
//! real reports, overflow TTLs, or freeze behind a hung registry.
//!
//! Settings a test needs are passed as `STARLING_TRACKER_*` environment variables, so the
//! same test runs against a build that lacks them and fails for the missing behaviour.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{
    counting_listener, forged_report, hanging_listener, metric_lines, sigterm, start_tracker,
    wait_exit,
};

async fn post(url: &str, body: &serde_json::Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: no answer: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tracker_drops_slow_header_clients_and_caps_connections() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tracker = start_tracker(
        dir.path(),
        &[],
        &[
            ("STARLING_TRACKER_MAX_CONNECTIONS", "8"),
            ("STARLING_TRACKER_HEADER_READ_TIMEOUT", "5s"),
        ],
    )
    .await;
    common::assert_connection_limits(
        &tracker.url(),
        tracker.port,
        8,
        "starling_tracker_connections_refused_total",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tracker_catalog_never_connects_to_unconfigured_or_internal_registries() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (forbidden, accepts) = counting_listener().await;
    let tracker = start_tracker(dir.path(), &[], &[]).await;
    let t = tracker.url();
    let r = post(
        &format!("{t}/api/v1/reports"),
        &forged_report("n0", 1, 1, 2),
    )
    .await;
    assert_eq!(r.status(), 200);
    let http = reqwest::Client::new();
    for image in [
        format!("{forbidden}/ml/secret:v1"),
        format!("localhost:{}/ml/secret:v1", forbidden.port()),
        "169.254.169.254/latest/meta-data:v1".to_owned(),
    ] {
        let r = reqwest::get(format!("{t}/api/v1/where?image={image}"))
            .await
            .expect("where answers");
        let status = r.status();
        let body = r.text().await.unwrap_or_default();
        assert_eq!(status, 403, "where?image={image}: {body}");
        assert!(body.contains("not allowed"), "{body}");
        let r = post(
            &format!("{t}/api/v1/prewarm"),
            &serde_json::json!({"images": [image], "targets": {"nodes": ["n0"]}}),
        )
        .await;
        assert_eq!(r.status(), 403, "prewarm {image}");
        // The extender answers (neutrally) and its background lookup obeys the same rule.
        let pod = serde_json::json!({"Pod": {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": image}]}}, "NodeNames": ["n0"]});
        let r = http
            .post(format!("{t}/scheduler/prioritize"))
            .json(&pod)
            .send()
            .await
            .expect("prioritize answers");
        assert_eq!(r.status(), 200);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        accepts.load(Ordering::SeqCst),
        0,
        "the tracker connected to a registry that is neither configured nor allowed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forged_reports_cannot_grow_nodes_digests_or_metric_labels_without_bound() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tracker = start_tracker(
        dir.path(),
        &["--node-timeout", "1s"],
        &[
            ("STARLING_TRACKER_MAX_NODES", "20"),
            ("STARLING_TRACKER_NODE_EXPIRY", "4s"),
            ("STARLING_TRACKER_MAX_REPORT_BLOBS", "1000"),
            ("STARLING_TRACKER_METRIC_NODE_LABELS", "5"),
        ],
    )
    .await;
    let t = tracker.url();
    let mut refused = 0;
    for i in 0..50 {
        let r = post(
            &format!("{t}/api/v1/reports"),
            &forged_report(&format!("forged-{i:03}"), 1, i, 3),
        )
        .await;
        if !r.status().is_success() {
            refused += 1;
        }
    }
    let nodes = reqwest::get(format!("{t}/api/v1/nodes"))
        .await
        .expect("nodes answered")
        .json::<serde_json::Value>()
        .await
        .expect("nodes JSON")["nodes"]
        .as_array()
        .map_or(0, Vec::len);
    assert!(
        nodes <= 20,
        "50 forged node names grew the node table to {nodes} with a cap of 20"
    );
    assert_eq!(
        refused, 30,
        "reports from new nodes beyond the cap are refused"
    );

    // Too many digests in one report.
    let r = post(
        &format!("{t}/api/v1/reports"),
        &forged_report("forged-000", 2, 900, 1001),
    )
    .await;
    assert_eq!(r.status(), 413, "a report over the per-report digest cap");

    // Metric labels stay bounded: per-node series are capped and the rest folded.
    for i in 0..30 {
        let _ = reqwest::get(format!("{t}/swarm/probe-{i}")).await;
    }
    for name in [
        "starling_cluster_node_cached_bytes",
        "starling_cluster_node_cache_budget_bytes",
        "starling_cluster_pull_seconds",
    ] {
        let series = metric_lines(&t, name).await;
        assert!(
            series.len() <= 6,
            "{name}: {} series for 20 nodes with a label cap of 5",
            series.len()
        );
    }
    let routes: BTreeSet<String> = metric_lines(&t, "starling_tracker_requests_total")
        .await
        .iter()
        .filter_map(|l| {
            l.split("route=\"")
                .nth(1)?
                .split('"')
                .next()
                .map(str::to_owned)
        })
        .collect();
    assert!(
        routes.len() <= 8,
        "request paths became metric labels: {routes:?}"
    );

    // Nodes silent for longer than the expiry are forgotten, with their digests.
    let start = Instant::now();
    loop {
        let v: serde_json::Value = reqwest::get(format!("{t}/api/v1/nodes"))
            .await
            .expect("nodes answered")
            .json()
            .await
            .expect("nodes JSON");
        if v["nodes"].as_array().is_some_and(Vec::is_empty) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "silent nodes were never forgotten: {} left after 20 s",
            v["nodes"].as_array().map_or(0, Vec::len)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let digests = metric_lines(&t, "starling_cluster_inventory_digests").await;
    assert_eq!(
        digests,
        vec!["starling_cluster_inventory_digests 0".to_owned()],
        "digests of forgotten nodes are forgotten too"
    );
    let r = post(
        &format!("{t}/api/v1/reports"),
        &forged_report("newcomer", 1, 77, 3),
    )
    .await;
    assert_eq!(r.status(), 200, "room again for a real node");
}

/// A report the size of a real node with `blobs` blobs, each in one of its images.
fn large_report(node: &str, blobs: usize) -> serde_json::Value {
    let digests: Vec<String> = (0..blobs)
        .map(|i| oci::Digest::of(format!("large/{i}").as_bytes()).to_string())
        .collect();
    let images: Vec<serde_json::Value> = digests
        .chunks(20)
        .enumerate()
        .map(|(i, layers)| {
            serde_json::json!({
                "manifest_digest": oci::Digest::of(format!("large-manifest/{i}").as_bytes()).to_string(),
                "references": [format!("registry.example.com/team/image-{i}:v1.2.3")],
                "blobs": layers.iter().map(|d| serde_json::json!({"digest": d, "size": 123456789u64})).collect::<Vec<_>>(),
                "last_pull": 1_764_430_000u64, "last_use": 1_764_430_100u64,
                "bytes_by_source": {"cache": 0, "peer": 3221225472u64, "registry": 104857600u64},
                "pull_seconds": 42.5
            })
        })
        .collect();
    serde_json::json!({
        "node": node, "generation": 1,
        "labels": {"topology.kubernetes.io/zone": "us-east-1a", "starling.io/rack": "r12"},
        "agent_url": "http://10.0.3.17:5050",
        "blobs": digests.iter().map(|d| serde_json::json!({"digest": d, "size": 123456789u64, "bytes_held": 123456789u64, "complete": true})).collect::<Vec<_>>(),
        "images": images,
        "pins": [],
        "cache_budget": 214748364800u64, "cache_used": 3326093072u64, "cache_free": 211422271728u64,
        "downloads_in_flight": [],
        "throughput_bytes_per_sec": 104857600.0
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_real_100k_blob_report_is_taken_and_an_oversized_one_is_refused_loudly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tracker = start_tracker(dir.path(), &[], &[]).await;
    let t = tracker.url();
    let report = large_report("big-node", 100_000);
    let bytes = serde_json::to_vec(&report).expect("JSON");
    let r = reqwest::Client::new()
        .post(format!("{t}/api/v1/reports"))
        .header("content-type", "application/json")
        .body(bytes.clone())
        .send()
        .await
        .expect("report answered");
    assert_eq!(
        r.status(),
        200,
        "a report of 100,000 blobs ({} bytes) was refused",
        bytes.len()
    );
    let v: serde_json::Value = reqwest::get(format!("{t}/api/v1/nodes"))
        .await
        .expect("nodes answered")
        .json()
        .await
        .expect("nodes JSON");
    assert_eq!(v["nodes"][0]["blobs"], 100_000);

    // Three such reports in one body is over any real node: refused, and the tracker
    // says so (the body is refused by its size, before it is parsed).
    let huge = bytes.repeat(3);
    let r = reqwest::Client::new()
        .post(format!("{t}/api/v1/reports"))
        .header("content-type", "application/json")
        .body(huge)
        .send()
        .await;
    if let Ok(r) = r {
        assert_eq!(r.status(), 413);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let log = tracker.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("report")),
        "an oversized report is logged at warn on the tracker:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prewarm_ttls_and_deadlines_are_bounded_and_never_overflow() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tracker = start_tracker(dir.path(), &[], &[]).await;
    let t = tracker.url();
    let report = forged_report("n0", 1, 5, 2);
    let digest = report["images"][0]["manifest_digest"]
        .as_str()
        .expect("manifest digest")
        .to_owned();
    assert_eq!(
        post(&format!("{t}/api/v1/reports"), &report).await.status(),
        200
    );
    let image = format!("registry.test/forged/n0@{digest}");
    let cases = [
        ("pin_ttl_seconds", u64::MAX, "pin_ttl_seconds"),
        ("deadline_seconds", u64::MAX, "deadline_seconds"),
        ("pin_ttl_seconds", 3_000_000_000, "pin_ttl_seconds"), // 95 years
        ("deadline_seconds", 365 * 86_400, "deadline_seconds"),
        ("pin_ttl_seconds", 0, "pin_ttl_seconds"),
    ];
    for (field, value, mention) in cases {
        let body =
            serde_json::json!({"images": [image], "targets": {"nodes": ["n0"]}, field: value});
        let r = reqwest::Client::new()
            .post(format!("{t}/api/v1/prewarm"))
            .json(&body)
            .send()
            .await
            .unwrap_or_else(|e| {
                panic!("prewarm with {field}={value}: no answer ({e}): did the handler panic?")
            });
        let status = r.status();
        let text = r.text().await.unwrap_or_default();
        assert_eq!(status, 400, "{field}={value} accepted: {text}");
        assert!(
            text.contains(mention),
            "{field}={value}: unclear error {text}"
        );
    }
    let ok = post(
        &format!("{t}/api/v1/prewarm"),
        &serde_json::json!({"images": [image], "targets": {"nodes": ["n0"]}, "pin_ttl_seconds": 3600, "deadline_seconds": 600}),
    )
    .await;
    assert_eq!(ok.status(), 201, "sane values still work");
}

/// The kube-scheduler's extender timeout from the deployment's scheduler config.
fn extender_deadline() -> Duration {
    let yaml = include_str!("../../../deploy/kubernetes/scheduler-config.yaml");
    let v = yaml
        .lines()
        .find_map(|l| l.trim().strip_prefix("httpTimeout:"))
        .expect("httpTimeout in scheduler-config.yaml");
    humantime::parse_duration(v.trim()).expect("httpTimeout parses")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hung_registry_never_stalls_reports_the_extender_or_shutdown() {
    let dir = tempfile::tempdir().expect("temp dir");
    let hung = hanging_listener().await;
    let mut tracker = start_tracker(
        dir.path(),
        &["--registry-endpoint", &format!("stuck.test=http://{hung}")],
        &[],
    )
    .await;
    let t = tracker.url();
    for n in ["n0", "n1"] {
        assert_eq!(
            post(&format!("{t}/api/v1/reports"), &forged_report(n, 1, 9, 2))
                .await
                .status(),
            200
        );
    }
    // A lookup that waits on the hung registry...
    let where_url = format!("{t}/api/v1/where?image=stuck.test/ml/x:v1");
    let stuck = tokio::spawn(async move { reqwest::get(where_url).await.map(|r| r.status()) });
    tokio::time::sleep(Duration::from_millis(700)).await;

    // ...does not hold up reports (the write side of the inventory)...
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        post(
            &format!("{t}/api/v1/reports"),
            &forged_report("n0", 2, 9, 2),
        ),
    )
    .await
    .expect("a report waited behind a hung registry lookup for 5 s");
    assert_eq!(r.status(), 200);

    // ...nor the scheduler extender, which answers within its deadline from memory.
    let deadline = extender_deadline();
    let http = reqwest::Client::new();
    for (verb, warm) in [("prioritize", false), ("filter", true), ("filter", false)] {
        let annotations = if warm {
            serde_json::json!({"starling.io/require-warm": "true"})
        } else {
            serde_json::json!({})
        };
        let args = serde_json::json!({
            "Pod": {"metadata": {"name": "p", "annotations": annotations},
                    "spec": {"containers": [{"name": "c", "image": "stuck.test/ml/x:v1"}]}},
            "NodeNames": ["n0", "n1"]
        });
        let started = Instant::now();
        let r = tokio::time::timeout(
            deadline,
            http.post(format!("{t}/scheduler/{verb}")).json(&args).send(),
        )
        .await
        .unwrap_or_else(|_| {
            panic!("extender {verb} did not answer within the scheduler's {deadline:?} while the registry hangs")
        })
        .expect("extender answers");
        assert_eq!(r.status(), 200, "{verb}");
        let v: serde_json::Value = r.json().await.expect("JSON");
        match (verb, warm) {
            ("prioritize", _) => assert!(
                v.as_array()
                    .is_some_and(|a| a.len() == 2 && a.iter().all(|h| h["Score"] == 0)),
                "unknown image: neutral scores {v}"
            ),
            (_, true) => assert_eq!(
                v["FailedNodes"].as_object().map(|m| m.len()),
                Some(2),
                "{v}"
            ),
            _ => assert_eq!(v["NodeNames"].as_array().map(Vec::len), Some(2), "{v}"),
        }
        assert!(started.elapsed() < deadline);
    }
    stuck.abort();

    // SIGTERM ends the tracker within a few seconds even with a request in flight.
    let stuck2 = tokio::spawn(reqwest::get(format!(
        "{t}/api/v1/where?image=stuck.test/ml/y:v2"
    )));
    tokio::time::sleep(Duration::from_millis(500)).await;
    sigterm(&tracker.child);
    let took =
        tokio::task::block_in_place(|| wait_exit(&mut tracker.child, Duration::from_secs(10)));
    stuck2.abort();
    assert!(
        took.is_some(),
        "the tracker was still running 10 s after SIGTERM while a registry lookup hung"
    );
}
