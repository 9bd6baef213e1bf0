//! The router end to end (in-process, through tower): every endpoint, JSON errors
//! with 4xx codes, metrics.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use cluster::inventory::SourceBytes;
use cluster::{metrics_router, router, ClusterConfig, ClusterState, JobStore};
use common::*;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

struct App {
    state: ClusterState,
    clock: Arc<AtomicU64>,
}

impl App {
    fn new() -> Self {
        let clock = Arc::new(AtomicU64::new(NOW));
        let c = clock.clone();
        let state = ClusterState::with_options(
            ClusterConfig::default(),
            JobStore::in_memory().expect("store"),
            None,
            Arc::new(move || c.load(Ordering::SeqCst)),
        );
        Self { state, clock }
    }

    async fn call(
        &self,
        method: Method,
        uri: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value, String) {
        let req = Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .body(body.map_or(Body::empty(), |b| Body::from(b.to_string())))
            .expect("request");
        let app = router(self.state.clone()).merge(metrics_router(self.state.clone()));
        let resp = app.oneshot(req).await.expect("response");
        let status = resp.status();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::Null),
            text,
        )
    }
}

fn node_report(
    name: &str,
    generation: u64,
    held: &[(cluster::inventory::BlobRef, u64)],
    images: &[(&cluster::ResolvedImage, SourceBytes, f64)],
) -> Value {
    let mut r = report(name, generation, held);
    r.labels = labels(&[("starling.io/pool", "h100")]);
    r.images = images
        .iter()
        .map(|(i, s, secs)| image_record(i, NOW - 10, *s, *secs))
        .collect();
    serde_json::to_value(r).expect("json")
}

async fn populated() -> App {
    let app = App::new();
    let src = SourceBytes {
        cache: 0,
        peer: 3 * GIB,
        registry: 100 * MIB,
    };
    let (s, v, _) = app
        .call(
            Method::POST,
            "/api/v1/reports",
            Some(node_report(
                "gpu-a",
                1,
                &full(&train()),
                &[(&train(), src, 42.5)],
            )),
        )
        .await;
    assert_eq!((s, v), (StatusCode::OK, json!({"applied": "new"})));
    let (s, _, _) = app
        .call(
            Method::POST,
            "/api/v1/reports",
            Some(node_report("gpu-b", 1, &[(blob(2, GIB), GIB)], &[])),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    app
}

#[tokio::test]
async fn reports_nodes_and_where() {
    let app = populated().await;
    let (s, v, _) = app
        .call(
            Method::POST,
            "/api/v1/reports",
            Some(node_report("gpu-a", 1, &[], &[])),
        )
        .await;
    assert_eq!((s, v), (StatusCode::OK, json!({"applied": "heartbeat"})));
    let (s, v, _) = app
        .call(
            Method::POST,
            "/api/v1/reports",
            Some(node_report("gpu-a", 0, &[], &[])),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(
        v,
        json!({"error": "stale report from gpu-a: generation 0 < current 1"})
    );
    let (s, v, _) = app
        .call(Method::POST, "/api/v1/reports", Some(json!({"node": "x"})))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(v["error"]
        .as_str()
        .expect("error")
        .starts_with("invalid request: JSON body: missing field `generation`"));

    let (s, v, _) = app.call(Method::GET, "/api/v1/nodes", None).await;
    assert_eq!(s, StatusCode::OK);
    let nodes = v["nodes"].as_array().expect("nodes");
    assert_eq!(
        nodes
            .iter()
            .map(|n| n["name"].as_str().unwrap_or(""))
            .collect::<Vec<_>>(),
        ["gpu-a", "gpu-b"]
    );
    assert_eq!(nodes[0]["bytes_held"], json!(10_000 + 3 * GIB + 100 * MIB));
    assert_eq!(nodes[0]["status"], json!("known"));

    let (s, v, _) = app.call(Method::GET, "/api/v1/nodes/gpu-b", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["summary"]["bytes_held"], json!(GIB));
    assert_eq!(v["report"]["labels"], json!({"starling.io/pool": "h100"}));
    let (s, v, _) = app.call(Method::GET, "/api/v1/nodes/ghost", None).await;
    assert_eq!(
        (s, v),
        (
            StatusCode::NOT_FOUND,
            json!({"error": "unknown node \"ghost\": not in the tracker's inventory"})
        )
    );

    // Silent for longer than the timeout: unknown, bytes still listed.
    app.clock.store(NOW + 61, Ordering::SeqCst);
    let (s, v, _) = app
        .call(
            Method::GET,
            "/api/v1/where?image=registry.example.com/ml/train:v1.4.2",
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v,
        json!({
            "image": "registry.example.com/ml/train:v1.4.2",
            "manifest_digest": d(100).to_string(),
            "total_bytes": 10_000 + 3 * GIB + 100 * MIB,
            "nodes": [
                {"node": "gpu-a", "status": "unknown", "bytes_held": 10_000 + 3 * GIB + 100 * MIB, "total_bytes": 10_000 + 3 * GIB + 100 * MIB},
                {"node": "gpu-b", "status": "unknown", "bytes_held": GIB, "total_bytes": 10_000 + 3 * GIB + 100 * MIB}
            ]
        })
    );
    let (s, v, _) = app
        .call(Method::GET, "/api/v1/where?image=nothing/here:1", None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(v["error"]
        .as_str()
        .expect("e")
        .starts_with("unknown image nothing/here:1"));
    let (s, _, _) = app.call(Method::GET, "/api/v1/where", None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn prewarm_lifecycle_over_http() {
    let app = populated().await;
    let (s, v, _) = app
        .call(
            Method::POST,
            "/api/v1/prewarm",
            Some(json!({"images": ["python:latest"], "targets": {"nodes": ["gpu-b"]}})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"], json!("refusing mutable tag docker.io/library/python:latest: `latest` is a mutable tag; pin a digest or set \"force\": true"));
    let (s, v, _) = app
        .call(
            Method::POST,
            "/api/v1/prewarm",
            Some(json!({"images": ["ghcr.io/x/y:1"], "targets": {"nodes": ["gpu-b"]}})),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(v["error"]
        .as_str()
        .expect("e")
        .starts_with("unknown image ghcr.io/x/y:1"));
    let (s, v, _) = app.call(Method::POST, "/api/v1/prewarm", Some(json!({"images": ["registry.example.com/ml/train:v1.4.2"], "targets": {"nodes": ["gpu-b", "ghost"]}}))).await;
    assert_eq!(
        (s, v),
        (
            StatusCode::NOT_FOUND,
            json!({"error": "unknown nodes: ghost"})
        )
    );
    let (s, v, _) = app.call(Method::POST, "/api/v1/prewarm", Some(json!({"images": ["registry.example.com/ml/train:v1.4.2"], "targets": {"selector": "pool in (h100"}}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(v["error"]
        .as_str()
        .expect("e")
        .starts_with("invalid label selector"));

    let body = json!({"images": ["registry.example.com/ml/train:v1.4.2"], "targets": {"pool": "h100"}, "parallelism": 4, "pin_ttl_seconds": 600});
    let (s, v, _) = app.call(Method::POST, "/api/v1/prewarm", Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["id"], json!(1));
    assert_eq!(
        v["images"][0]["manifest_digest"],
        json!(d(100).to_string()),
        "tag resolved to a digest at submit"
    );
    assert_eq!(v["nodes"]["gpu-a"]["state"], json!("done"));
    assert_eq!(v["nodes"]["gpu-b"]["state"], json!("pending"));
    assert_eq!(v["progress"]["status"], json!("running"));

    let a = app.state.next_assignments().expect("assign");
    assert_eq!(
        a.iter()
            .map(|x| (x.node.as_str(), x.seed))
            .collect::<Vec<_>>(),
        [("gpu-b", false)]
    );
    let (_, v, _) = app.call(Method::GET, "/api/v1/prewarm/1", None).await;
    assert_eq!(v["nodes"]["gpu-b"]["state"], json!("running"));
    assert_eq!(v["nodes"]["gpu-b"]["bytes_done"], json!(GIB));
    let (_, v, _) = app.call(Method::GET, "/api/v1/prewarm", None).await;
    assert_eq!(v["jobs"].as_array().map(Vec::len), Some(1));
    let (s, v, _) = app.call(Method::DELETE, "/api/v1/prewarm/1", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["progress"]["status"], json!("cancelled"));
    assert_eq!(v["nodes"]["gpu-a"]["state"], json!("done"));
    assert_eq!(v["nodes"]["gpu-b"]["state"], json!("cancelled"));
    let (s, v, _) = app.call(Method::DELETE, "/api/v1/prewarm/1", None).await;
    assert_eq!(
        (s, v),
        (
            StatusCode::CONFLICT,
            json!({"error": "prewarm job 1 is already finished"})
        )
    );
    let (s, v, _) = app.call(Method::GET, "/api/v1/prewarm/9", None).await;
    assert_eq!(
        (s, v),
        (
            StatusCode::NOT_FOUND,
            json!({"error": "unknown prewarm job 9"})
        )
    );
    let (s, _, _) = app.call(Method::GET, "/api/v1/prewarm/abc", None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn scheduler_verbs_and_rank() {
    let app = populated().await;
    let pod = json!({"metadata": {"name": "p", "annotations": {"starling.io/require-warm": "true"}},
                     "spec": {"containers": [{"name": "t", "image": "registry.example.com/ml/train:v1.4.2"}]}});
    let (s, v, _) = app
        .call(
            Method::POST,
            "/scheduler/filter",
            Some(json!({"Pod": pod, "NodeNames": ["gpu-a", "gpu-b", "gpu-x"]})),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["NodeNames"], json!(["gpu-a"]));
    assert_eq!(
        v["FailedNodes"]
            .as_object()
            .map(|o| o.keys().cloned().collect::<Vec<_>>()),
        Some(vec!["gpu-b".to_owned(), "gpu-x".to_owned()])
    );
    assert_eq!(v["Error"], json!(""));
    let (s, v, _) = app
        .call(
            Method::POST,
            "/scheduler/prioritize",
            Some(json!({"Pod": pod, "NodeNames": ["gpu-a", "gpu-b", "gpu-x"]})),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    // Both at 100 MiB/s: gpu-b misses 2 GiB + 100 MiB + 10 kB of 3 GiB + 100 MiB + 10 kB → 10 × (1 − 0.677) = 3.2 → 3.
    assert_eq!(
        v,
        json!([{"Host": "gpu-a", "Score": 10}, {"Host": "gpu-b", "Score": 3}, {"Host": "gpu-x", "Score": 0}])
    );
    let (s, _, _) = app
        .call(
            Method::POST,
            "/scheduler/prioritize",
            Some(json!({"Pod": 5})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, v, _) = app.call(Method::POST, "/api/v1/rank", Some(json!({"image": "registry.example.com/ml/train:v1.4.2", "nodes": ["gpu-b", "gpu-a"]}))).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["nodes"][0]["node"], json!("gpu-a"));
    assert_eq!(v["nodes"][0]["expected_pull_seconds"], json!(0.0));
    assert_eq!(
        v["nodes"][1]["missing_bytes"],
        json!(2 * GIB + 100 * MIB + 10_000)
    );

    let (s, _, text) = app.call(Method::GET, "/metrics", None).await;
    assert_eq!(s, StatusCode::OK);
    for line in [
        "starling_cluster_registry_bytes_saved_total 3221225472",
        "starling_cluster_registry_bytes_total 104857600",
        "starling_cluster_pull_seconds{image=\"registry.example.com/ml/train:v1.4.2\",node=\"gpu-a\"} 42.5",
        "starling_cluster_nodes{status=\"known\"} 2",
        "starling_cluster_extender_seconds_count{verb=\"filter\"} 1",
        "starling_cluster_extender_seconds_count{verb=\"prioritize\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
    }
    let fragment = app.state.encode_metrics_fragment();
    assert!(
        text.ends_with("# EOF\n") && !fragment.contains("# EOF") && text.starts_with(&fragment)
    );
    for name in cluster::metrics::METRIC_NAMES {
        assert!(
            text.contains(&format!("# TYPE {}", name.trim_end_matches("_total"))),
            "{name} not exposed"
        );
    }
}

#[tokio::test]
async fn dashboard_json_and_page() {
    let app = populated().await;
    let (s, v, _) = app.call(Method::GET, "/api/v1/dashboard", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["registry_bytes_saved"], json!(3 * GIB));
    assert_eq!(
        v["images"][0]["reference"],
        json!("registry.example.com/ml/train:v1.4.2")
    );
    assert_eq!(
        v["matrix"][0]["bytes"],
        json!([10_000 + 3 * GIB + 100 * MIB])
    );
    assert_eq!(v["matrix"][1]["bytes"], json!([GIB]));
    assert_eq!(v["sources"][0]["pulls"][0]["peer"], json!(3 * GIB));
    let (s, _, text) = app.call(Method::GET, "/", None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(text.contains("<title>Starling cluster</title>"));
    assert!(
        !text.contains("http://") && !text.contains("https://"),
        "no external assets"
    );
}
