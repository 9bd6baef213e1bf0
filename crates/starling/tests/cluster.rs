//! The cluster layer end to end: tracker + labelled agents (real processes), the real
//! docker-registry, prewarm onto a subset, pins under GC pressure, the scheduler
//! extender on recorded ExtenderArgs, and the inventory across restarts.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::time::Duration;

use common::{metric, ready, Proc};

use testkit::{Registry, RegistryAuth, TestImage};

/// How often and how long `testkit::until` checks for reports and prewarms.
const POLL_EVERY: Duration = Duration::from_millis(250);
const POLL_WITHIN: Duration = Duration::from_secs(60);

const TOKEN: &str = "cluster-test-token";

/// Waits until the tracker at `t` lists `count` nodes (each agent's first report).
async fn until_nodes_reported(t: &str, count: usize) {
    testkit::until("the nodes reported", POLL_EVERY, POLL_WITHIN, async || {
        json(&format!("{t}/api/v1/nodes")).await["nodes"]
            .as_array()
            .is_some_and(|n| n.len() == count)
    })
    .await;
}

async fn json(url: &str) -> serde_json::Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

/// The real registry and a tracker resolving images in it (plain HTTP, the cluster
/// token of `common::trackers`).
async fn registry_and_tracker(dir: &std::path::Path) -> (Registry, Proc) {
    let registry = tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .unwrap();
    let endpoint = format!("{}={}", registry.host(), registry.url());
    let tracker = common::start_tracker(
        dir,
        &[
            "--cluster-token",
            common::trackers::TOKEN,
            "--registry-endpoint",
            &endpoint,
        ],
        &[],
    )
    .await;
    (registry, tracker)
}

/// Submits `reference` to prewarm on node `n0` at tracker `t` and returns the job
/// once it is no longer running.
async fn prewarm_on_n0_until_ended(t: &str, reference: &str) -> serde_json::Value {
    let id = submit_prewarm_on_n0(t, reference, None, None).await;
    prewarm_once_ended(t, id).await
}

/// Submits `reference` to prewarm on node `n0` (pinned for an hour, at `bytes_per_sec`
/// and with `deadline_seconds` if given) and returns the job's id.
async fn submit_prewarm_on_n0(
    t: &str,
    reference: &str,
    bytes_per_sec: Option<u64>,
    deadline_seconds: Option<u64>,
) -> u64 {
    let job: serde_json::Value = reqwest::Client::new()
        .post(format!("{t}/api/v1/prewarm"))
        .bearer_auth(common::trackers::TOKEN)
        .json(
            &serde_json::json!({"images": [reference], "targets": {"nodes": ["n0"]},
            "pin_ttl_seconds": 3600, "per_node_bytes_per_sec": bytes_per_sec,
            "deadline_seconds": deadline_seconds}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    job["id"]
        .as_u64()
        .unwrap_or_else(|| panic!("job id: {job}"))
}

/// Job `id` at tracker `t` once it is no longer running.
async fn prewarm_once_ended(t: &str, id: u64) -> serde_json::Value {
    testkit::until("the prewarm ended", POLL_EVERY, POLL_WITHIN, async || {
        json(&format!("{t}/api/v1/prewarm/{id}")).await["progress"]["status"] != "running"
    })
    .await;
    json(&format!("{t}/api/v1/prewarm/{id}")).await
}

fn extender_args(image: &str, nodes: &[&str], require_warm: bool) -> serde_json::Value {
    let annotations = if require_warm {
        serde_json::json!({"starling.io/require-warm": "true"})
    } else {
        serde_json::json!({})
    };
    serde_json::json!({
        "Pod": {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "trainer-0", "namespace": "ml", "annotations": annotations},
            "spec": {"containers": [{"name": "train", "image": image, "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}
        },
        "Nodes": null,
        "NodeNames": nodes,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prewarm_a_labelled_subset_then_schedule_where_the_bytes_are() {
    let dir = tempfile::tempdir().unwrap();
    let registry = tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .unwrap();
    let image = TestImage::push_multilayer(
        &registry,
        "ml/train",
        "v1",
        &[8 << 20, 6 << 20, 3 << 20],
        21,
    )
    .unwrap();
    let other =
        TestImage::push_multilayer(&registry, "ml/other", "v1", &[12 << 20, 12 << 20], 22).unwrap();
    let host = registry.host();
    let tport = testkit::free_port();
    let tracker_args: Vec<String> = [
        "tracker",
        "--listen",
        &format!("127.0.0.1:{tport}"),
        "--cluster-token",
        TOKEN,
        "--insecure-plain-http",
        "--data-dir",
        &dir.path().join("tdata").display().to_string(),
        "--registry-endpoint",
        &format!("{host}={}", registry.url()),
        "--node-timeout",
        "5s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut tracker = Proc::start(
        tracker_args,
        tport,
        dir.path().join("tracker.log"),
        dir.path().to_owned(),
    )
    .await;
    let mut agents = Vec::new();
    for (i, gpu) in ["h100", "h100", "h100", "a100"].iter().enumerate() {
        let port = testkit::free_port();
        let budget = if i == 0 { "32MiB" } else { "10GiB" };
        let args: Vec<String> = [
            "agent",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--cache-dir",
            &dir.path().join(format!("n{i}")).display().to_string(),
            "--default-registry",
            &host,
            "--registry-endpoint",
            &format!("{host}={}", registry.url()),
            "--tracker",
            &format!("http://127.0.0.1:{tport}"),
            "--cluster-token",
            TOKEN,
            "--insecure-plain-http",
            "--node-name",
            &format!("n{i}"),
            "--label",
            &format!("gpu={gpu}"),
            "--min-free",
            "0",
            "--cache-budget",
            budget,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        agents.push(
            Proc::start(
                args,
                port,
                dir.path().join(format!("n{i}.log")),
                dir.path().join(format!("n{i}")),
            )
            .await,
        );
    }
    let t = tracker.url();
    until_nodes_reported(&t, 4).await;

    // A mutable tag is refused with the reason.
    let http = reqwest::Client::new();
    let r = http.post(format!("{t}/api/v1/prewarm")).json(&serde_json::json!({"images": [format!("{host}/ml/train:latest")], "targets": {"selector": "gpu=h100"}})).send().await.unwrap();
    assert!(r.status().is_client_error());
    assert!(r.text().await.unwrap().contains("latest"));
    // A malformed selector is refused clearly.
    let r = http.post(format!("{t}/api/v1/prewarm")).json(&serde_json::json!({"images": [image.reference], "targets": {"selector": "gpu in (h100"}})).send().await.unwrap();
    assert_eq!(r.status(), 400);

    // Prewarm onto the h100 nodes: one seed from the registry, the rest from peers.
    let job: serde_json::Value = http
        .post(format!("{t}/api/v1/prewarm"))
        .json(&serde_json::json!({"images": [image.reference], "targets": {"selector": "gpu=h100"}, "pin_ttl_seconds": 3600, "per_node_bytes_per_sec": 64 << 20}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = job["id"].as_u64().expect("job id");
    assert_eq!(
        job["images"][0]["manifest_digest"], image.digest,
        "the tag was resolved to its digest at submit time"
    );
    testkit::until("prewarm done", POLL_EVERY, POLL_WITHIN, async || {
        json(&format!("{t}/api/v1/prewarm/{id}")).await["progress"]["status"] == "done"
    })
    .await;
    let layer_bytes: u64 = image.layers.iter().map(|l| l.size).sum();
    let mut registry_bytes = 0;
    for a in &agents {
        registry_bytes += metric(&a.url(), "starling_agent_upstream_bytes_total").await;
    }
    assert!(
        registry_bytes <= layer_bytes + layer_bytes / 20 + image.config.size * 3,
        "registry served the image about once: {registry_bytes} for {layer_bytes}"
    );
    // Warm nodes hold everything, the a100 node nothing.
    let full = |w: &serde_json::Value, n: &str| {
        w["nodes"].as_array().is_some_and(|v| {
            v.iter().any(|x| {
                x["node"] == n
                    && x["bytes_held"].as_u64().is_some()
                    && x["bytes_held"] == x["total_bytes"]
            })
        })
    };
    testkit::until(
        "inventory shows the warm nodes",
        POLL_EVERY,
        POLL_WITHIN,
        async || {
            let w = json(&format!("{t}/api/v1/where?image={}", image.reference)).await;
            ["n0", "n1", "n2"].iter().all(|n| full(&w, n))
        },
    )
    .await;
    let r3 = json(&format!("{}/api/v1/report", agents[3].url())).await;
    assert!(
        r3["blobs"].as_array().unwrap().is_empty(),
        "n3 (a100) was not targeted"
    );

    // The extender ranks warm nodes first; require-warm filters the cold one.
    let nodes = ["n0", "n1", "n2", "n3"];
    let scores: serde_json::Value = http
        .post(format!("{t}/scheduler/prioritize"))
        .json(&extender_args(&image.reference, &nodes, false))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let score = |n: &str| {
        scores
            .as_array()
            .unwrap()
            .iter()
            .find(|h| h["Host"] == n)
            .unwrap()["Score"]
            .as_i64()
            .unwrap()
    };
    assert!(
        score("n0") > score("n3") && score("n1") > score("n3") && score("n2") > score("n3"),
        "{scores}"
    );
    let filtered: serde_json::Value = http
        .post(format!("{t}/scheduler/filter"))
        .json(&extender_args(&image.reference, &nodes, true))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(filtered["FailedNodes"]["n3"].is_string(), "{filtered}");
    assert_eq!(filtered["NodeNames"].as_array().unwrap().len(), 3);

    // Pins hold under GC pressure: n0 has a 32 MiB budget and pulls a 24 MiB image.
    let reference = oci::ImageReference::parse(&other.reference).unwrap();
    let mut cfg = oci::UpstreamConfig::default();
    cfg.endpoints
        .insert(reference.registry.clone(), agents[0].url());
    let up = oci::Upstream::new(cfg).unwrap();
    oci::pull::pull(&up, &reference, &Default::default())
        .await
        .expect("pull under cache pressure");
    let report0 = json(&format!("{}/api/v1/report", agents[0].url())).await;
    let held: Vec<String> = report0["blobs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["complete"] == true)
        .map(|b| b["digest"].as_str().unwrap().to_owned())
        .collect();
    for l in &image.layers {
        assert!(
            held.contains(&l.digest),
            "prewarmed layer {} survived GC: {held:?}",
            l.digest
        );
    }

    // Inventory survives an agent restart and a tracker restart; the job survives too.
    agents[1].kill9();
    agents[1].restart();
    ready(&agents[1].url()).await;
    tracker.kill9();
    tracker.restart();
    ready(&t).await;
    testkit::until("inventory rebuilt", POLL_EVERY, POLL_WITHIN, async || {
        let w = json(&format!("{t}/api/v1/where?image={}", image.reference)).await;
        ["n0", "n1", "n2"].iter().all(|n| full(&w, n)) && !full(&w, "n3")
    })
    .await;
    assert_eq!(
        json(&format!("{t}/api/v1/prewarm/{id}")).await["progress"]["status"],
        "done",
        "job persisted across the tracker restart"
    );
    let dash = reqwest::get(format!("{t}/"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(dash.contains("<html") || dash.contains("<!doctype") || dash.contains("<!DOCTYPE"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prewarm_into_runtime_pulls_into_containerd_and_pins_it_there() {
    let dir = tempfile::tempdir().unwrap();
    let registry = tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .unwrap();
    let image =
        TestImage::push_multilayer(&registry, "ml/runtime", "v3", &[4 << 20, 1 << 20], 23).unwrap();
    let ctrd = tokio::task::spawn_blocking(testkit::Containerd::start)
        .await
        .unwrap();
    let host = registry.host();
    let tport = testkit::free_port();
    let targs: Vec<String> = [
        "tracker",
        "--listen",
        &format!("127.0.0.1:{tport}"),
        "--cluster-token",
        TOKEN,
        "--insecure-plain-http",
        "--data-dir",
        &dir.path().join("tdata").display().to_string(),
        "--registry-endpoint",
        &format!("{host}={}", registry.url()),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let tracker = Proc::start(
        targs,
        tport,
        dir.path().join("tracker.log"),
        dir.path().to_owned(),
    )
    .await;
    let port = testkit::free_port();
    let aargs: Vec<String> = [
        "agent",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--cache-dir",
        &dir.path().join("n0").display().to_string(),
        "--default-registry",
        &host,
        "--registry-endpoint",
        &format!("{host}={}", registry.url()),
        "--tracker",
        &format!("http://127.0.0.1:{tport}"),
        "--cluster-token",
        TOKEN,
        "--insecure-plain-http",
        "--node-name",
        "n0",
        "--min-free",
        "0",
        "--containerd-socket",
        &ctrd.socket().display().to_string(),
        "--containerd-namespace",
        testkit::CONTAINERD_NAMESPACE,
        "--containerd-snapshotter",
        "native",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let _agent = Proc::start(
        aargs,
        port,
        dir.path().join("n0.log"),
        dir.path().join("n0"),
    )
    .await;
    let t = tracker.url();
    until_nodes_reported(&t, 1).await;
    let job: serde_json::Value = reqwest::Client::new()
        .post(format!("{t}/api/v1/prewarm"))
        .json(&serde_json::json!({"images": [image.reference], "targets": {"nodes": ["n0"]}, "into_runtime": true}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = job["id"].as_u64().expect("job id");
    testkit::until(
        "prewarm into the runtime",
        POLL_EVERY,
        POLL_WITHIN,
        async || {
            let s = json(&format!("{t}/api/v1/prewarm/{id}")).await["progress"]["status"].clone();
            s != "running"
        },
    )
    .await;
    let view = json(&format!("{t}/api/v1/prewarm/{id}")).await;
    assert_eq!(view["progress"]["status"], "done", "{view}");
    let out = tokio::task::spawn_blocking(move || ctrd.ctr(&["images", "ls"]).unwrap())
        .await
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = listing
        .lines()
        .find(|l| l.contains("ml/runtime"))
        .unwrap_or_else(|| panic!("image in containerd: {listing}"));
    assert!(line.contains(&image.digest), "{line}");
    assert!(line.contains("io.cri-containerd.pinned=pinned"), "{line}");
}

/// A node whose cache cannot make room for a prewarmed image (what is there is pinned
/// by an earlier job) says so and reads none of it: a prewarm never streams a blob
/// it cannot keep. Before, each such node read every layer from the registry at the
/// prewarm's rate, threw it away and then failed, so a job onto full nodes cost the
/// registry a copy of the image per node. A client asking for the blob still gets it,
/// uncached.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prewarm_onto_a_node_that_cannot_keep_the_image_reads_none_of_it() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, tracker) = registry_and_tracker(dir.path()).await;
    let pinned = TestImage::push_multilayer(&registry, "ml/base", "v1", &[16 << 20], 24).unwrap();
    let next = TestImage::push_multilayer(&registry, "ml/next", "v1", &[12 << 20], 25).unwrap();
    let t = tracker.url();
    let agent = common::trackers::agent_with(
        dir.path(),
        "n0",
        &t,
        &registry,
        &["--cache-budget", "24MiB"],
    )
    .await;
    until_nodes_reported(&t, 1).await;
    let first = prewarm_on_n0_until_ended(&t, &pinned.reference).await;
    assert_eq!(first["progress"]["status"], "done", "{first}");
    let a = agent.url();
    let before = metric(&a, "starling_agent_upstream_bytes_total").await;

    // 16 MiB pinned in a 24 MiB budget: the 12 MiB layer fits the budget, so the
    // tracker plans it, but the node has no room it may free.
    let second = prewarm_on_n0_until_ended(&t, &next.reference).await;
    assert_eq!(
        second["progress"]["nodes_by_state"]["failed"], 1,
        "{second}"
    );
    let read = metric(&a, "starling_agent_upstream_bytes_total").await - before;
    assert!(
        read < 1 << 20,
        "the node read {read} bytes of a 12 MiB layer it could not keep"
    );
    assert!(
        second.to_string().contains("cannot be cached"),
        "the node's reason says why: {second}"
    );

    // A client still gets the layer, streamed uncached, and checked by the client.
    let reference = oci::ImageReference::parse(&next.reference).unwrap();
    let mut cfg = oci::UpstreamConfig::default();
    cfg.endpoints.insert(reference.registry.clone(), a.clone());
    let up = oci::Upstream::new(cfg).unwrap();
    oci::pull::pull(&up, &reference, &Default::default())
        .await
        .expect("a client pulls the image the node cannot keep");
    for l in &pinned.layers {
        let held = json(&format!("{a}/api/v1/report")).await.to_string();
        assert!(held.contains(&l.digest), "the pinned layer stays: {held}");
    }
}

/// A node's last word on a prewarm ("done") that does not reach the tracker is sent
/// again, for as long as the tracker is away. A proxy in front of the real tracker
/// fails every "done" for 20 s from the first and, once the node collected its
/// assignment, every inventory report of the node, so the job's pins never reach the
/// tracker either (which would finish the node without its word). At first the word
/// was sent once; then for about 15 s; either way the node showed "running" until the
/// job's deadline, and this job has none.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nodes_lost_last_word_on_a_prewarm_is_sent_again() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let (registry, tracker) = registry_and_tracker(dir.path()).await;
    let image = TestImage::push_multilayer(&registry, "ml/word", "v1", &[4 << 20], 26).unwrap();
    let t = tracker.url();
    const TRACKER_AWAY: Duration = Duration::from_secs(20);
    let done_words = Arc::new(AtomicU32::new(0));
    let first_done = Arc::new(std::sync::OnceLock::new());
    let proxy = {
        let (upstream, done_words) = (t.clone(), done_words.clone());
        let client = reqwest::Client::new();
        let assigned = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
            let (upstream, done_words, client, first_done) = (
                upstream.clone(),
                done_words.clone(),
                client.clone(),
                first_done.clone(),
            );
            async move {
                let (parts, body) = req.into_parts();
                let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
                let path = parts.uri.path().to_owned();
                let unavailable = || {
                    axum::response::Response::builder()
                        .status(503)
                        .body(axum::body::Body::empty())
                        .unwrap()
                };
                if path.contains("/nodes/") && body.windows(13).any(|w| w == br#""kind":"done""#) {
                    done_words.fetch_add(1, Ordering::SeqCst);
                    let first = *first_done.get_or_init(std::time::Instant::now);
                    if first.elapsed() < TRACKER_AWAY {
                        return unavailable();
                    }
                } else if path == "/api/v1/reports" && assigned.load(Ordering::SeqCst) {
                    return unavailable();
                }
                let req = axum::extract::Request::from_parts(parts, axum::body::Body::from(body));
                let (_, resp, builder) = testkit::forward(&client, &upstream, req).await;
                let answer = resp.bytes().await.unwrap();
                if path == "/api/v1/assignments" && answer.starts_with(b"[{") {
                    assigned.store(true, Ordering::SeqCst);
                }
                builder.body(axum::body::Body::from(answer)).unwrap()
            }
        });
        testkit::serve_proxy(app).await
    };
    let mut agent = common::trackers::agent_with(dir.path(), "n0", &proxy, &registry, &[]).await;
    until_nodes_reported(&t, 1).await;
    let id = submit_prewarm_on_n0(&t, &image.reference, None, None).await;
    testkit::until(
        "the node's first word",
        POLL_EVERY,
        POLL_WITHIN,
        async || done_words.load(Ordering::SeqCst) >= 1,
    )
    .await;
    // The agent restarts (an upgrade, say) while the tracker is still away: the word
    // outlives the process.
    agent.kill9();
    agent.restart();
    let job = prewarm_once_ended(&t, id).await;
    assert_eq!(job["progress"]["status"], "done", "{job}");
    assert!(
        done_words.load(Ordering::SeqCst) >= 3,
        "the word was sent again"
    );
    assert!(
        agent
            .log_text()
            .contains("sending again this node's last word on a prewarm taken before the restart"),
        "the restarted agent sent the word"
    );
    until_prewarm_journal_empty(&agent).await;
}

/// A prewarm cancelled while a node works on it stops there: the node reads no layer
/// after the one in flight and drops the pins the job set. Before, the tracker marked
/// the node cancelled and the agent, never told, fetched and pinned the whole image.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prewarm_cancelled_while_a_node_works_on_it_stops_there() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, tracker) = registry_and_tracker(dir.path()).await;
    const LAYER: u64 = 2 << 20;
    let image =
        TestImage::push_multilayer(&registry, "ml/cancel", "v1", &[LAYER as usize; 8], 28).unwrap();
    let t = tracker.url();
    let agent = common::trackers::agent_with(dir.path(), "n0", &t, &registry, &[]).await;
    until_nodes_reported(&t, 1).await;
    // 16 MiB at 1 MiB/s: cancelled a second or two in.
    let id = submit_prewarm_on_n0(&t, &image.reference, Some(1 << 20), None).await;
    until_prewarm_under_way(&t, id).await;
    cancel_prewarm(&t, id).await;
    until_logged(&agent, "prewarm cancelled by the tracker; stopped").await;
    assert_nothing_read_past_the_layer_in_flight(&agent, &image).await;
    let a = agent.url();
    let report = json(&format!("{a}/api/v1/report")).await;
    assert!(
        !report["pins"].to_string().contains(&image.digest),
        "a cancelled job pins nothing: {report}"
    );
    until_prewarm_journal_empty(&agent).await;
    let job = json(&format!("{t}/api/v1/prewarm/{id}")).await;
    assert_eq!(job["progress"]["status"], "cancelled", "{job}");
}

/// An assignment collected after its job was cancelled reads nothing. The tracker
/// keeps a node's assignments until the node collects them; here the agent is
/// stopped (SIGSTOP) while the job is handed to it and cancelled. Before, the agent
/// began the work and only heard of the cancel a second later, with a layer fetched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_assignment_collected_after_its_job_was_cancelled_reads_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, tracker) = registry_and_tracker(dir.path()).await;
    const LAYER: u64 = 2 << 20;
    let image =
        TestImage::push_multilayer(&registry, "ml/late", "v1", &[LAYER as usize; 4], 30).unwrap();
    let t = tracker.url();
    let agent = common::trackers::agent_with(dir.path(), "n0", &t, &registry, &[]).await;
    until_nodes_reported(&t, 1).await;
    common::signal(&agent.child, "STOP");
    let id = submit_prewarm_on_n0(&t, &image.reference, Some(1 << 20), None).await;
    testkit::until(
        "the assignment waits",
        POLL_EVERY,
        POLL_WITHIN,
        async || {
            json(&format!("{t}/api/v1/prewarm/{id}")).await["nodes"]["n0"]["state"] == "running"
        },
    )
    .await;
    cancel_prewarm(&t, id).await;
    common::signal(&agent.child, "CONT");
    until_logged(&agent, "prewarm cancelled by the tracker; stopped").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let read = metric(&agent.url(), "starling_agent_upstream_bytes_total").await;
    assert!(
        read < LAYER,
        "the node read {read} bytes of a cancelled job"
    );
    until_prewarm_journal_empty(&agent).await;
}

/// A prewarm whose deadline passes while a node works on it stops there: the tracker
/// fails the node's part at the deadline, and the node reads no layer after the one
/// in flight. Before, the node fetched on at the job's rate until it had the whole
/// image, for a job already marked failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prewarm_past_its_deadline_stops_there() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, tracker) = registry_and_tracker(dir.path()).await;
    const LAYER: u64 = 2 << 20;
    let image =
        TestImage::push_multilayer(&registry, "ml/deadline", "v1", &[LAYER as usize; 8], 29)
            .unwrap();
    let t = tracker.url();
    let agent = common::trackers::agent_with(dir.path(), "n0", &t, &registry, &[]).await;
    until_nodes_reported(&t, 1).await;
    // 16 MiB at 1 MiB/s, with 3 s to do it.
    let id = submit_prewarm_on_n0(&t, &image.reference, Some(1 << 20), Some(3)).await;
    until_logged(&agent, "deadline passed with").await;
    assert_nothing_read_past_the_layer_in_flight(&agent, &image).await;
    let job = prewarm_once_ended(&t, id).await;
    assert_eq!(
        job["progress"]["status"], "completed_with_failures",
        "{job}"
    );
    assert_eq!(job["nodes"]["n0"]["state"], "failed", "{job}");
    until_prewarm_journal_empty(&agent).await;
}

/// The deadline is the tracker's: a node whose clock runs two minutes behind (the
/// agent runs under libfaketime) would fetch on until its own clock reached it; the
/// tracker answers its progress after the deadline with "stop", and it stops there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_whose_clock_runs_behind_stops_at_the_trackers_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, tracker) = registry_and_tracker(dir.path()).await;
    const LAYER: u64 = 2 << 20;
    let image =
        TestImage::push_multilayer(&registry, "ml/skewed", "v1", &[LAYER as usize; 8], 31).unwrap();
    let t = tracker.url();
    let behind = [
        ("LD_PRELOAD", FAKETIME_LIB),
        ("FAKETIME", "-120"),
        // Only the wall clock: timers and rates run on the monotonic one.
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ];
    assert!(
        std::path::Path::new(FAKETIME_LIB).exists(),
        "{FAKETIME_LIB} is missing: scripts/test installs the faketime package"
    );
    let agent =
        common::trackers::agent_with_env(dir.path(), "n0", &t, &registry, &[], &behind).await;
    until_nodes_reported(&t, 1).await;
    // 16 MiB at 1 MiB/s, with 3 s to do it by the tracker's clock (123 s by the node's).
    let id = submit_prewarm_on_n0(&t, &image.reference, Some(1 << 20), Some(3)).await;
    until_logged(&agent, "deadline passed by the tracker's clock").await;
    assert!(
        !agent.log_text().contains("deadline passed with"),
        "the node's own clock, two minutes behind, cannot have reached the deadline"
    );
    assert_nothing_read_past_the_layer_in_flight(&agent, &image).await;
    let job = prewarm_once_ended(&t, id).await;
    assert_eq!(job["nodes"]["n0"]["state"], "failed", "{job}");
    until_prewarm_journal_empty(&agent).await;
}

const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// Cancels job `id` at tracker `t` (as an operator: `DELETE /api/v1/prewarm/{id}`).
async fn cancel_prewarm(t: &str, id: u64) {
    let cancel = reqwest::Client::new()
        .delete(format!("{t}/api/v1/prewarm/{id}"))
        .bearer_auth(common::trackers::TOKEN)
        .send()
        .await
        .unwrap();
    assert!(cancel.status().is_success(), "{}", cancel.status());
}

/// Waits until `agent`'s log has `line`.
async fn until_logged(agent: &Proc, line: &str) {
    testkit::until(line, POLL_EVERY, POLL_WITHIN, async || {
        agent.log_text().contains(line)
    })
    .await;
}

/// A node that stopped working on a prewarm of `image`: the layer in flight at the
/// stop may finish, then nothing more is read from the registry, and in all it read
/// under half the image.
async fn assert_nothing_read_past_the_layer_in_flight(agent: &Proc, image: &testkit::PushedImage) {
    let a = agent.url();
    let at_stop = metric(&a, "starling_agent_upstream_bytes_total").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let read = metric(&a, "starling_agent_upstream_bytes_total").await;
    let image_bytes: u64 = image.layers.iter().map(|l| l.size).sum();
    let largest = image.layers.iter().map(|l| l.size).max().unwrap_or(0);
    // Printed for the record, asserted only as bytes below.
    eprintln!("read {read} of {image_bytes} bytes; {at_stop} when the node stopped");
    assert!(
        read <= at_stop + largest && read < image_bytes / 2,
        "the node read {read} of {image_bytes} bytes ({at_stop} when it stopped)"
    );
}

/// Waits until job `id` at tracker `t` shows bytes fetched.
async fn until_prewarm_under_way(t: &str, id: u64) {
    testkit::until(
        "the prewarm under way",
        POLL_EVERY,
        POLL_WITHIN,
        async || {
            json(&format!("{t}/api/v1/prewarm/{id}")).await["progress"]["bytes_done"]
                .as_u64()
                .is_some_and(|b| b > 0)
        },
    )
    .await;
}

/// Waits until the agent's journal of prewarm jobs (`prewarm-jobs.json`) holds none:
/// a settled job is not kept.
async fn until_prewarm_journal_empty(agent: &Proc) {
    let path = agent.cache.join("prewarm-jobs.json");
    testkit::until("the journal settled", POLL_EVERY, POLL_WITHIN, async || {
        std::fs::read_to_string(&path).is_ok_and(|s| s.trim() == "{}")
    })
    .await;
}

/// An agent restarted in the middle of a prewarm (an upgrade, an OOM kill) finishes
/// it. The tracker hands an assignment out once; before, the restarted agent had
/// forgotten it, and a node back within the tracker's silence timeout showed
/// "running" for good on a job without a deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_restarted_in_the_middle_of_a_prewarm_finishes_it() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, tracker) = registry_and_tracker(dir.path()).await;
    let image = TestImage::push_multilayer(&registry, "ml/restart", "v1", &[16 << 20], 27).unwrap();
    let t = tracker.url();
    let mut agent = common::trackers::agent_with(dir.path(), "n0", &t, &registry, &[]).await;
    until_nodes_reported(&t, 1).await;
    // 16 MiB at 2 MiB/s: about 8 s, killed a second or two in.
    let id = submit_prewarm_on_n0(&t, &image.reference, Some(2 << 20), None).await;
    until_prewarm_under_way(&t, id).await;
    agent.kill9();
    agent.restart();
    let job = prewarm_once_ended(&t, id).await;
    assert_eq!(job["progress"]["status"], "done", "{job}");
    assert!(
        agent
            .log_text()
            .contains("resuming a prewarm assignment taken before the restart"),
        "the restarted agent resumed the job"
    );
    let report = json(&format!("{}/api/v1/report", agent.url())).await;
    assert!(
        report["pins"].to_string().contains(&image.digest),
        "the restarted agent pinned the image: {report}"
    );
    until_prewarm_journal_empty(&agent).await;
}
