//! What the Redis replica tests share: announces, requests through a replica's router,
//! inventory reports, a replica with the cluster layer.
#![allow(dead_code, clippy::unwrap_used)] // each test file uses a part

use axum::body::Body;
use http::{Request, StatusCode};
use swarm::{AnnounceRequest, AnnounceResponse, SwarmConfig, Topology};
use tower::ServiceExt;
use tracker::{RedisOptions, Tracker};

/// An announce of `node` for a 64 MiB blob in 1 MiB pieces.
pub fn ask(node: &str, digest: &oci::Digest) -> AnnounceRequest {
    let mut r = AnnounceRequest::new(node, "127.0.0.1:9", &Topology::default(), digest);
    r.size = Some(64 << 20);
    r.piece_size = Some(1 << 20);
    r
}

/// One request through a replica's router: the status and the body.
pub async fn call(t: &Tracker, req: Request<Body>) -> (StatusCode, axum::body::Bytes) {
    let resp = t.router().oneshot(req).await.unwrap();
    let status = resp.status();
    let body = axum::body::to_bytes(resp.into_body(), 64 << 20)
        .await
        .unwrap();
    (status, body)
}

pub async fn announce(
    t: &Tracker,
    req: &AnnounceRequest,
) -> (StatusCode, Option<AnnounceResponse>) {
    let (status, body) = call(
        t,
        Request::post("/swarm/v1/announce")
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Body::from(serde_json::to_vec(req).unwrap()))
            .unwrap(),
    )
    .await;
    (status, serde_json::from_slice(&body).ok())
}

pub async fn get(t: &Tracker, path: &str) -> (StatusCode, serde_json::Value) {
    let (status, body) = call(t, Request::get(path).body(Body::empty()).unwrap()).await;
    (
        status,
        serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    )
}

/// Swarm `digest` as replica `t` lists it on `/swarm/v1/swarms`.
pub async fn swarm_entry(t: &Tracker, digest: &oci::Digest) -> serde_json::Value {
    let (status, swarms) = get(t, "/swarm/v1/swarms").await;
    assert_eq!(status, StatusCode::OK);
    swarms
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["digest"] == digest.to_string())
        .cloned()
        .expect("the replica knows the swarm")
}

pub async fn metrics_text(t: &Tracker) -> String {
    let (_, body) = call(t, Request::get("/metrics").body(Body::empty()).unwrap()).await;
    String::from_utf8_lossy(&body).into_owned()
}

/// A replica sharing Redis as `opts` say, whose members expire after `peer_ttl_ms`.
pub fn replica_with_peer_ttl(opts: &RedisOptions, peer_ttl_ms: u64) -> Tracker {
    let cfg = SwarmConfig {
        peer_ttl_ms,
        ..SwarmConfig::default()
    };
    Tracker::new(cfg, None).with_redis(opts).unwrap()
}

/// A replica with the cluster layer (inventory, prewarm) sharing Redis as `opts` say.
pub fn cluster_replica(opts: &RedisOptions) -> (Tracker, cluster::ClusterState) {
    let state = cluster::ClusterState::new(
        cluster::ClusterConfig::default(),
        cluster::JobStore::in_memory().unwrap(),
    );
    let t = Tracker::new(SwarmConfig::default(), None)
        .with_cluster(state.clone())
        .with_redis(opts)
        .expect("a valid Redis URL");
    (t, state)
}

/// An inventory report of `node` holding nothing.
pub fn report(node: &str, generation: u64) -> cluster::NodeReport {
    serde_json::from_value(serde_json::json!({
        "node": node,
        "generation": generation,
        "labels": {"gpu": "h100"},
        "cache_budget": 1u64 << 40,
        "cache_used": 0,
        "cache_free": 1u64 << 40,
        "blobs": [],
        "images": [],
    }))
    .unwrap()
}

/// A connection of the test's own to `redis`, to look at and change keys directly.
pub async fn raw(redis: &testkit::RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Key `part` of swarm `digest` under the default prefix.
pub fn key(digest: &oci::Digest, part: &str) -> String {
    format!("st:{{{digest}}}:{part}")
}

/// The nodes named by the change stream of swarm `digest`, oldest first.
pub async fn stream_nodes(redis: &testkit::RedisServer, digest: &oci::Digest) -> Vec<String> {
    redis::cmd("EVAL")
        .arg(
            "local out = {} for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) \
             do out[#out + 1] = e[2][2] end return out",
        )
        .arg(1)
        .arg(key(digest, "changes"))
        .query_async(&mut raw(redis).await)
        .await
        .unwrap()
}

/// Submits, on `state` (under its shared job lock), a prewarm job of one image
/// `reference` (by digest) made of one layer, to `nodes`: the job's id.
pub async fn submit_one_layer_job(
    state: &cluster::ClusterState,
    reference: &str,
    layer: &oci::Digest,
    size: u64,
    nodes: &[&str],
) -> u64 {
    submit_one_layer_job_due(state, reference, layer, size, nodes, None).await
}

/// [`submit_one_layer_job`] with a deadline.
pub async fn submit_one_layer_job_due(
    state: &cluster::ClusterState,
    reference: &str,
    layer: &oci::Digest,
    size: u64,
    nodes: &[&str],
    deadline_seconds: Option<u64>,
) -> u64 {
    let req: cluster::PrewarmRequest = serde_json::from_value(serde_json::json!({
        "images": [reference],
        "targets": {"nodes": nodes},
        "deadline_seconds": deadline_seconds,
    }))
    .unwrap();
    let image = cluster::ResolvedImage {
        reference: reference.to_owned(),
        manifest_digest: oci::Digest::of(reference.as_bytes()),
        blobs: vec![cluster::wire::BlobRef {
            digest: layer.clone(),
            size,
        }],
    };
    state
        .change_jobs(|| state.submit_prewarm_resolved(req, vec![image]))
        .await
        .unwrap()
        .job
        .id
}
