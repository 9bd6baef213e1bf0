//! Faults of the swarm's source, tracker and registry: the source killed, unreachable
//! or out of disk, the tracker down, dying or restarted, an agent restarted mid-blob,
//! bad bytes from the registry once. Peers that misbehave are in `bad_peers`.

use std::time::Duration;

use testkit::{Registry, RegistryAuth, TestImage};

use super::bad_peers::nobody_can_dial;
use super::common::{pull_via, ready};
use super::{
    agent, agent_via, blocking, metric, seed_holding, spawn_pull, spawn_source_pull, tracker,
    until_metric_above,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_source_mid_transfer_does_not_cut_other_clients() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, "swarm/kill", "1", &[32 << 20], 13).unwrap();
    let t = tracker(dir.path(), &["--peer-ttl", "1s"]).await;
    let slow = ["--download-limit", "8MiB", "--upload-limit", "8MiB"];
    let mut src = agent(dir.path(), "src", &t.url(), &registry, &slow).await;
    // The first node becomes the source; give it a head start so it is elected.
    let src_url = src.url();
    let img = image.clone();
    let src_pull = tokio::spawn(async move { pull_via(&src_url, &img).await });
    tokio::time::sleep(Duration::from_millis(800)).await;
    let p1 = agent(dir.path(), "p1", &t.url(), &registry, &slow).await;
    let p2 = agent(dir.path(), "p2", &t.url(), &registry, &slow).await;
    let (u1, u2) = (p1.url(), p2.url());
    let (i1, i2) = (image.clone(), image.clone());
    let h1 = tokio::spawn(async move { pull_via(&u1, &i1).await });
    let h2 = tokio::spawn(async move { pull_via(&u2, &i2).await });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    src.kill9();
    let _ = src_pull.await;
    for h in [h1, h2] {
        let r = h
            .await
            .unwrap()
            .expect("client stream survives the source's death");
        assert_eq!(r.manifest_digest.to_string(), image.digest);
    }
    let elections: serde_json::Value = reqwest::get(format!("{}/swarm/v1/swarms", t.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let big = elections
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["size"].as_u64() == Some(image.layers[0].size))
        .cloned()
        .unwrap();
    assert!(
        big["source_elections"].as_u64().unwrap() >= 2,
        "a replacement source was elected: {big}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tracker_down_or_dying_never_fails_a_pull() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/notracker", "1", &[16 << 20], 14).unwrap();
    // No tracker at all.
    let dead = format!("http://127.0.0.1:{}", testkit::free_port());
    let a = agent(dir.path(), "lonely", &dead, &registry, &[]).await;
    assert_eq!(
        pull_via(&a.url(), &image)
            .await
            .expect("pull without tracker")
            .manifest_digest
            .to_string(),
        image.digest
    );
    assert!(metric(&a, "starling_agent_p2p_tracker_errors_total").await >= 1);
    // A tracker that dies mid-download.
    let mut t = tracker(dir.path(), &[]).await;
    let b = agent(
        dir.path(),
        "b",
        &t.url(),
        &registry,
        &["--download-limit", "6MiB"],
    )
    .await;
    let url = b.url();
    let img = image.clone();
    let h = tokio::spawn(async move { pull_via(&url, &img).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    t.kill9();
    assert_eq!(
        h.await
            .unwrap()
            .expect("pull survives tracker death")
            .manifest_digest
            .to_string(),
        image.digest
    );
    // The tracker comes back: soft state is rebuilt from announcements.
    t.restart();
    ready(&t.url()).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let swarms: serde_json::Value = reqwest::get(format!("{}/swarm/v1/swarms", t.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        swarms
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["complete"].as_u64() >= Some(1)),
        "agent re-announced its blobs: {swarms}"
    );
}

/// The tracker dies while a swarm is mid-pull: the members keep taking pieces from the
/// source they are connected to, and none of them turns to the registry while that
/// still brings bytes. (Every member reading the rest from the registry at once is the
/// stampede the swarm exists to prevent; it is what happened before.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tracker_that_dies_mid_pull_does_not_send_the_swarm_to_the_registry() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/tracker-dies", "1", &[32 << 20], 49).unwrap();
    let mut t = tracker(dir.path(), &[]).await;
    let src = agent(
        dir.path(),
        "src",
        &t.url(),
        &registry,
        &["--download-limit", "4MiB"],
    )
    .await;
    let src_pull = spawn_source_pull(&src, &image).await;
    let mut members = Vec::new();
    let mut pulls = Vec::new();
    for name in ["m1", "m2", "m3"] {
        let m = agent(dir.path(), name, &t.url(), &registry, &[]).await;
        pulls.push(spawn_pull(&m, &image));
        members.push(m);
    }
    for m in &members {
        testkit::until(
            "every member to receive from the source",
            Duration::from_millis(10),
            Duration::from_secs(60),
            || async { metric(m, "starling_agent_p2p_peer_bytes_total").await > 0 },
        )
        .await;
    }
    t.kill9();
    for p in pulls {
        let r = tokio::time::timeout(Duration::from_secs(120), p)
            .await
            .expect("the member's pull finishes without a tracker")
            .unwrap()
            .expect("and succeeds");
        assert_eq!(r.manifest_digest.to_string(), image.digest);
    }
    src_pull.await.unwrap().expect("the source's own pull");
    let layer = image.layers[0].size;
    let mut read = metric(&src, "starling_agent_p2p_registry_bytes_total").await;
    for m in &members {
        read += metric(m, "starling_agent_p2p_registry_bytes_total").await;
    }
    assert!(
        read <= layer + layer / 4,
        "the registry sent about one copy: {read} bytes for a {layer}-byte layer"
    );
}

/// A proxy in front of the real registry that flips one byte of the first response
/// carrying `digest`'s bytes (a flaky cache or link: once, then never again).
/// Returns its URL.
async fn corrupting_once_proxy(registry: String, digest: String) -> String {
    use futures::StreamExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let done = Arc::new(AtomicBool::new(false));
    let client = reqwest::Client::new();
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let (client, registry, digest, done) = (
            client.clone(),
            registry.clone(),
            digest.clone(),
            done.clone(),
        );
        async move {
            let (path, resp, out) = testkit::forward(&client, &registry, req).await;
            let corrupt = path.contains(&digest)
                && resp.status().is_success()
                && !done.swap(true, Ordering::SeqCst);
            let mut flipped = !corrupt;
            let body = resp.bytes_stream().map(move |chunk| {
                let mut c = chunk.map_err(std::io::Error::other)?.to_vec();
                if !flipped && !c.is_empty() {
                    let at = c.len() / 2;
                    c[at] ^= 0xff;
                    flipped = true;
                }
                Ok::<_, std::io::Error>(bytes::Bytes::from(c))
            });
            out.body(axum::body::Body::from_stream(body)).unwrap()
        }
    });
    testkit::serve_proxy(app).await
}

/// The registry (or a cache in front of it) sends the elected source one corrupted
/// response. The reader streaming through the source must see its transfer fail (not
/// a complete 200 of wrong bytes), the member's pull fails or stalls, as it must; the
/// retries must then succeed on every node, and no honest peer be blamed. Before, the
/// source's reader got a full-length 200 (the last byte fetched anew), and the member
/// kept the pieces it had checked against the bad hashes: every retry stopped at the
/// last piece, whose hash is the digest itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_the_registry_sends_bad_bytes_once_a_retry_succeeds_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/bad-bytes", "1", &[16 << 20], 55).unwrap();
    let proxy = corrupting_once_proxy(registry.url(), image.layers[0].digest.clone()).await;
    let t = tracker(dir.path(), &[]).await;
    let slow = ["--download-limit", "2MiB"];
    let src = agent_via(dir.path(), "src", &t.url(), &registry, &proxy, &slow).await;
    let layer = image.layers[0].clone();
    let url = format!("{}/v2/swarm/bad-bytes/blobs/{}", src.url(), layer.digest);
    let plain_read = tokio::spawn(async move { reqwest::get(url).await?.bytes().await });
    until_metric_above(
        "the source to read from the registry",
        &src,
        "starling_agent_p2p_registry_bytes_total",
        0,
    )
    .await;
    let m = agent_via(dir.path(), "m", &t.url(), &registry, &proxy, &[]).await;
    let m_pull = spawn_pull(&m, &image);
    // The member holds pieces checked against the source's hashes of the bad bytes.
    until_metric_above(
        "the member to receive from the source",
        &m,
        "starling_agent_p2p_peer_bytes_total",
        4 << 20,
    )
    .await;
    match plain_read.await.unwrap() {
        Err(_) => {}
        Ok(body) => {
            let got = testkit::sha256_digest(&body);
            assert!(
                (body.len() as u64) < layer.size || got == layer.digest,
                "a reader that does not check digests got {} bytes of the wrong content in a \
                 complete 200",
                body.len()
            );
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(60), m_pull).await;
    for (who, node) in [("source", &src), ("member", &m)] {
        let r = tokio::time::timeout(Duration::from_secs(60), pull_via(&node.url(), &image))
            .await
            .unwrap_or_else(|_| panic!("the {who}'s retry finishes"))
            .unwrap_or_else(|e| panic!("the {who}'s retry succeeds: {e}"));
        assert_eq!(r.manifest_digest.to_string(), image.digest);
    }
    let late = agent_via(dir.path(), "late", &t.url(), &registry, &proxy, &[]).await;
    let r = tokio::time::timeout(Duration::from_secs(60), pull_via(&late.url(), &image))
        .await
        .expect("a newcomer's pull finishes")
        .expect("and succeeds");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    assert_eq!(
        metric(&late, "starling_agent_p2p_pieces_rejected_total").await,
        0,
        "no honest peer's piece is rejected after the retry"
    );
}

/// The elected source's disk fills up in the middle of the blob (another process took
/// the space). Its own reader still gets the blob, and its swarm goes on without it: a
/// member is elected and reads the rest. Needs root (a small tmpfs).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_whose_disk_fills_mid_blob_hands_its_swarm_on() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/disk-full", "1", &[48 << 20], 57).unwrap();
    let t = tracker(dir.path(), &[]).await;
    let fs = blocking(|| testkit::Tmpfs::mount("80m")).await;
    std::os::unix::fs::symlink(&fs.mount, dir.path().join("src")).unwrap();
    let src = agent(
        dir.path(),
        "src",
        &t.url(),
        &registry,
        &["--download-limit", "4MiB"],
    )
    .await;
    let src_pull = spawn_source_pull(&src, &image).await;
    let m = agent(dir.path(), "m", &t.url(), &registry, &[]).await;
    let m_pull = spawn_pull(&m, &image);
    until_metric_above(
        "the member to receive from the source",
        &m,
        "starling_agent_p2p_peer_bytes_total",
        4 << 20,
    )
    .await;
    let filler = fs.mount.join("filler");
    blocking(move || testkit::fill_disk(&filler)).await;
    for (who, pull) in [("member", m_pull), ("source", src_pull)] {
        let r = tokio::time::timeout(Duration::from_secs(120), pull)
            .await
            .unwrap_or_else(|_| panic!("the {who}'s pull finishes"))
            .unwrap()
            .unwrap_or_else(|e| panic!("the {who}'s pull succeeds: {e}"));
        assert_eq!(r.manifest_digest.to_string(), image.digest);
    }
    // The source streams the rest to its reader uncached: about two copies in all.
    let layer = image.layers[0].size;
    let read = metric(&src, "starling_agent_upstream_bytes_total").await
        + metric(&m, "starling_agent_upstream_bytes_total").await;
    assert!(
        read <= 2 * layer + (4 << 20),
        "the registry sent about two copies: {read} bytes for a {layer}-byte layer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restarted_agent_keeps_verified_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/restart", "1", &[40 << 20], 16).unwrap();
    let size = image.layers[0].size;
    let t = tracker(dir.path(), &[]).await;
    let _seed = seed_holding(dir.path(), &t.url(), &registry, &image, &[]).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut b = agent(
        dir.path(),
        "b",
        &t.url(),
        &registry,
        &["--download-limit", "10MiB"],
    )
    .await;
    let url = b.url();
    let img = image.clone();
    let h = tokio::spawn(async move { pull_via(&url, &img).await });
    tokio::time::sleep(Duration::from_millis(2000)).await;
    b.kill9();
    let _ = h.await;
    let sidecar = b.cache.join("partial").join(format!(
        "{}.pieces",
        image.layers[0].digest.trim_start_matches("sha256:")
    ));
    assert!(sidecar.exists(), "piece map persisted");
    b.restart();
    ready(&b.url()).await;
    let r = pull_via(&b.url(), &image)
        .await
        .expect("pull after restart");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    let refetched = metric(&b, "starling_agent_p2p_peer_bytes_total").await
        + metric(&b, "starling_agent_p2p_registry_bytes_total").await;
    assert!(
        refetched < size - (4 << 20),
        "verified pieces were kept: fetched {refetched} of {size} after restart"
    );
    assert!(
        b.log_text().contains("kept verified pieces")
            || b.log_text().contains("resuming partial download")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_tracker_restart_newcomers_pull_from_seeders_not_the_registry() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/seeders", "1", &[20 << 20], 18).unwrap();
    let mut t = tracker(dir.path(), &[]).await;
    let _seed = seed_holding(dir.path(), &t.url(), &registry, &image, &[]).await;
    // The tracker forgets everything (piece hashes included); the seed re-announces.
    t.kill9();
    t.restart();
    ready(&t.url()).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let b = agent(dir.path(), "newcomer", &t.url(), &registry, &[]).await;
    let r = pull_via(&b.url(), &image).await.expect("pull from seeders");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    // Only the small config blob (below the P2P threshold) comes from the registry,
    // by whichever path (the swarm's registry runs or a plain fetch).
    assert_eq!(
        metric(&b, "starling_agent_upstream_bytes_total").await,
        image.config.size,
        "the layer came from the seeder"
    );
    assert!(metric(&b, "starling_agent_p2p_peer_bytes_total").await >= image.layers[0].size);
}

/// The elected source itself cannot be dialled (it advertises a port nothing listens
/// on) while it reads a layer from a slow registry link. The member that cannot reach
/// it reports it; the tracker demotes it and elects the member, which reads the rest
/// from the registry. The demoted node stops reading the registry and takes what it
/// lacks from the member. Before demotion, the member waited until the unreachable
/// source had read the whole layer at its slow rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_source_is_demoted_and_its_swarm_goes_on_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/unreachable-src", "1", &[48 << 20], 43)
            .unwrap();
    let t = tracker(dir.path(), &[]).await;
    let mut flags = nobody_can_dial();
    flags.extend(["--download-limit", "2MiB"].map(String::from));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let src = agent(dir.path(), "src", &t.url(), &registry, &flags).await;
    let src_pull = spawn_source_pull(&src, &image).await;
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let r = tokio::time::timeout(Duration::from_secs(120), pull_via(&b.url(), &image))
        .await
        .expect("the member's pull finishes although it cannot reach the source")
        .expect("and succeeds");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    assert!(metric(&b, "starling_agent_p2p_peers_unreachable_total").await >= 1);
    assert!(
        super::common::metric(&t.url(), "starling_tracker_source_demotions_total").await >= 1,
        "the tracker demoted the source nobody could reach"
    );
    let layer = image.layers[0].size;
    src_pull
        .await
        .unwrap()
        .expect("the demoted node's own pull");
    let src_read = metric(&src, "starling_agent_p2p_registry_bytes_total").await;
    assert!(
        src_read < layer,
        "the demoted node stopped reading the registry: {src_read} of {layer} bytes"
    );
    assert!(
        metric(&src, "starling_agent_p2p_peer_bytes_total").await > 0,
        "and took the rest from the member it can reach"
    );
    let read = src_read + metric(&b, "starling_agent_p2p_registry_bytes_total").await;
    assert!(
        read <= 2 * layer,
        "the registry was read less than twice: {read} bytes for a {layer}-byte layer"
    );
}

/// The same with two tracker replicas sharing Redis and the members' connections
/// spread over them, as a Service spreads them: one member reports the source to one
/// replica, two to the other, so neither heard the quorum of three members fetching.
/// Reports are shared, so the source is still demoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_source_is_demoted_when_its_reporters_reach_different_replicas() {
    let dir = tempfile::tempdir().unwrap();
    let redis = blocking(testkit::RedisServer::start).await;
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/split-reports", "1", &[48 << 20], 44).unwrap();
    let shared = ["--redis", &redis.url(), "--redis-refresh", "200ms"];
    let (t1, t2) = (
        tracker(dir.path(), &shared).await,
        tracker(dir.path(), &shared).await,
    );
    let mut flags = nobody_can_dial();
    flags.extend(["--download-limit", "2MiB"].map(String::from));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let src = agent(dir.path(), "src", &t1.url(), &registry, &flags).await;
    let src_pull = spawn_source_pull(&src, &image).await;
    let b = agent(dir.path(), "b", &t1.url(), &registry, &[]).await;
    let c = agent(dir.path(), "c", &t2.url(), &registry, &[]).await;
    let d = agent(dir.path(), "d", &t2.url(), &registry, &[]).await;
    let pulls = [
        spawn_pull(&b, &image),
        spawn_pull(&c, &image),
        spawn_pull(&d, &image),
    ];
    for p in pulls {
        let r = tokio::time::timeout(Duration::from_secs(120), p)
            .await
            .expect("every member's pull finishes although none can reach the source")
            .unwrap()
            .expect("and succeeds");
        assert_eq!(r.manifest_digest.to_string(), image.digest);
    }
    let demotions = super::common::metric(&t1.url(), "starling_tracker_source_demotions_total")
        .await
        + super::common::metric(&t2.url(), "starling_tracker_source_demotions_total").await;
    assert!(
        demotions >= 1,
        "a replica demoted the source nobody could reach"
    );
    src_pull
        .await
        .unwrap()
        .expect("the demoted node's own pull");
    let layer = image.layers[0].size;
    let src_read = metric(&src, "starling_agent_p2p_registry_bytes_total").await;
    assert!(
        src_read < layer,
        "the demoted node stopped reading the registry: {src_read} of {layer} bytes"
    );
}
