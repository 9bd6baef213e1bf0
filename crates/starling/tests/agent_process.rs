//! The agent as a real process: `kill -9` in the middle of a download, restart, resume.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures::StreamExt;

fn spawn_agent(port: u16, cache: &std::path::Path, origin: &str) -> Child {
    let log = std::fs::File::create(cache.with_extension(format!("log{port}"))).unwrap();
    Command::new(env!("CARGO_BIN_EXE_starling"))
        .args([
            "agent",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--cache-dir",
        ])
        .arg(cache)
        .args([
            "--default-registry",
            origin,
            "--registry-endpoint",
            &format!("{origin}=http://{origin}"),
            "--min-free",
            "0",
        ])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start starling agent")
}

async fn wait_ready(port: u16) {
    for _ in 0..200 {
        if reqwest::get(format!("http://127.0.0.1:{port}/healthz"))
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("agent on {port} did not become ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_mid_download_then_restart_resumes_and_never_serves_partial_as_complete() {
    let work = tempfile::tempdir().unwrap();
    let spec = origin::SynthSpec {
        layers: vec![("big".into(), 40 << 20)],
        seed: 42,
        tag: "t".into(),
    };
    let image = origin::generate_training_image(&work.path().join("layout"), &spec).unwrap();
    let layer = image.layers[0].clone();
    // A slow origin so the kill lands mid-blob.
    let origin = origin::bind(origin::OriginConfig {
        layout_dir: work.path().join("layout"),
        listen: "127.0.0.1:0".parse().unwrap(),
        egress_limit_bytes_per_sec: Some(16 << 20),
        repository: None,
        latency: None,
    })
    .await
    .unwrap()
    .spawn();
    let origin_host = origin.local_addr().to_string();
    let cache = work.path().join("cache");
    let port = testkit::free_port();
    let mut agent = spawn_agent(port, &cache, &origin_host);
    wait_ready(port).await;
    let url = format!("http://127.0.0.1:{port}/v2/demo/img/blobs/{}", layer.digest);
    let resp = reqwest::get(&url).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut got = 0usize;
    while got < 12 << 20 {
        match stream.next().await {
            Some(Ok(c)) => got += c.len(),
            other => panic!("stream ended early: {other:?}"),
        }
    }
    agent.kill().unwrap(); // SIGKILL
    agent.wait().unwrap();
    let partial = cache.join("partial").join(layer.digest.hex());
    let complete = cache.join("blobs/sha256").join(layer.digest.hex());
    let partial_len = std::fs::metadata(&partial).map(|m| m.len()).unwrap_or(0);
    assert!(
        partial_len > 0 && partial_len < layer.size,
        "partial file kept after kill -9: {partial_len}"
    );
    assert!(
        !complete.exists(),
        "a half-written blob is never in the complete store"
    );
    let sent_before_restart = origin.stats().snapshot().blob_bytes_sent;

    let mut agent = spawn_agent(port, &cache, &origin_host);
    wait_ready(port).await;
    let cache_api: serde_json::Value =
        reqwest::get(format!("http://127.0.0.1:{port}/api/v1/cache"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    assert_eq!(
        cache_api["usage"]["complete_blobs"], 0,
        "restart does not promote the partial blob"
    );
    let body = reqwest::get(&url).await.unwrap().bytes().await.unwrap();
    assert_eq!(oci::Digest::of(&body), layer.digest);
    // The last byte is released at verification; fsync and the rename into the store
    // follow without making the client wait, so the file appears a moment later.
    for _ in 0..200 {
        if complete.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        complete.exists(),
        "the verified blob is in the complete store"
    );
    let resumed_bytes = origin.stats().snapshot().blob_bytes_sent - sent_before_restart;
    assert!(
        resumed_bytes <= layer.size - partial_len + (4 << 20),
        "restart resumed from the partial file: fetched {resumed_bytes} after restart, {partial_len} were kept"
    );
    agent.kill().ok();
    agent.wait().ok();
}
