//! The swarm as real processes: a tracker and agents (`starling` binaries) on loopback,
//! the real docker-registry as origin, real containerd, and every fault of issue 3.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{ready, Proc};

use testkit::{Registry, RegistryAuth, TestImage};

const TOKEN: &str = "test-cluster-token";

async fn tracker(dir: &Path, extra: &[&str]) -> Proc {
    let port = testkit::free_port();
    let data = dir.join(format!("tracker-data-{port}"));
    let mut args: Vec<String> = vec![
        "tracker".into(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--cluster-token".into(),
        TOKEN.into(),
        "--data-dir".into(),
        data.display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::start(
        args,
        port,
        dir.join(format!("tracker-{port}.log")),
        dir.to_owned(),
    )
    .await
}

async fn agent(dir: &Path, name: &str, tracker: &str, registry: &Registry, extra: &[&str]) -> Proc {
    let port = testkit::free_port();
    let cache = dir.join(name);
    let host = registry.host();
    let mut args: Vec<String> = vec![
        "agent".into(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--cache-dir".into(),
        cache.display().to_string(),
        "--default-registry".into(),
        host.clone(),
        "--registry-endpoint".into(),
        format!("{host}={}", registry.url()),
        "--tracker".into(),
        tracker.into(),
        "--cluster-token".into(),
        TOKEN.into(),
        "--node-name".into(),
        name.into(),
        "--min-free".into(),
        "0".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::start(args, port, dir.join(format!("{name}.log")), cache).await
}

async fn metric(agent: &Proc, name: &str) -> u64 {
    common::metric(&agent.url(), name).await
}

async fn pull_via(
    agent_url: &str,
    image: &testkit::PushedImage,
) -> Result<oci::pull::PullReport, oci::Error> {
    let reference = oci::ImageReference::parse(&image.reference).unwrap();
    let mut cfg = oci::UpstreamConfig::default();
    cfg.endpoints
        .insert(reference.registry.clone(), agent_url.to_owned());
    let up = oci::Upstream::new(cfg).unwrap();
    oci::pull::pull(&up, &reference, &Default::default()).await
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

fn big_layers(image: &testkit::PushedImage) -> u64 {
    image
        .layers
        .iter()
        .filter(|l| l.size >= 4 << 20)
        .map(|l| l.size)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_agents_pull_at_once_and_the_registry_serves_each_blob_about_once() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(
        &registry,
        "swarm/eight",
        "1",
        &[12 << 20, 8 << 20, 64 << 10],
        11,
    )
    .unwrap();
    let t = tracker(dir.path(), &[]).await;
    let mut agents = Vec::new();
    for i in 0..8 {
        agents.push(
            agent(
                dir.path(),
                &format!("n{i}"),
                &t.url(),
                &registry,
                &[
                    "--download-limit",
                    "40MiB",
                    "--upload-limit",
                    "40MiB",
                    "--zone",
                    "z",
                    "--rack",
                    &format!("r{}", i % 2),
                ],
            )
            .await,
        );
    }
    let urls: Vec<String> = agents.iter().map(|a| a.url()).collect();
    let pulls = urls.iter().map(|u| pull_via(u, &image));
    for r in futures::future::join_all(pulls).await {
        assert_eq!(
            r.expect("pull through the swarm")
                .manifest_digest
                .to_string(),
            image.digest
        );
    }
    let mut upstream = 0;
    let mut from_peers = 0;
    for a in &agents {
        upstream += metric(a, "starling_agent_p2p_registry_bytes_total").await;
        from_peers += metric(a, "starling_agent_p2p_peer_bytes_total").await;
    }
    let big = big_layers(&image);
    assert!(
        upstream <= big + big / 20,
        "registry served the big layers {:.2}× (want ≤ 1.05×)",
        upstream as f64 / big as f64
    );
    assert!(
        from_peers >= 6 * big,
        "most bytes came from peers: {from_peers} of {}",
        7 * big
    );
    let swarms: serde_json::Value = reqwest::get(format!("{}/swarm/v1/swarms", t.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for s in swarms.as_array().unwrap() {
        assert_eq!(
            s["source_elections"], 1,
            "one registry fetcher per blob: {s}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn containerd_pulls_through_two_swarm_agents() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/ctrd", "1", &[10 << 20, 6 << 20], 12).unwrap();
    let t = tracker(dir.path(), &[]).await;
    let a = agent(dir.path(), "a", &t.url(), &registry, &[]).await;
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let mut handles = Vec::new();
    for (i, ag) in [&a, &b].iter().enumerate() {
        let hosts = dir.path().join(format!("hosts{i}"));
        testkit::write_hosts_toml(&hosts, &registry.host(), &ag.url(), "http://127.0.0.1:9")
            .unwrap();
        let r = image.reference.clone();
        handles.push(tokio::task::spawn_blocking(move || {
            let c = testkit::Containerd::start();
            c.pull(&r, &hosts, &[])
                .expect("containerd pull via swarm agent");
            c.image_digest(&r).unwrap()
        }));
    }
    for h in handles {
        assert_eq!(h.await.unwrap(), image.digest);
    }
    let upstream = metric(&a, "starling_agent_p2p_registry_bytes_total").await
        + metric(&b, "starling_agent_p2p_registry_bytes_total").await;
    let big = big_layers(&image);
    assert!(
        upstream <= big + big / 20,
        "registry bytes {upstream} for {big}"
    );
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn corrupt_pieces_are_rejected_and_the_liar_avoided() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, "swarm/liar", "1", &[16 << 20], 15).unwrap();
    let t = tracker(dir.path(), &[]).await;
    let liar = agent(
        dir.path(),
        "liar",
        &t.url(),
        &registry,
        &["--corrupt-pieces"],
    )
    .await;
    pull_via(&liar.url(), &image).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await; // seeding announce
    let honest = agent(dir.path(), "honest", &t.url(), &registry, &[]).await;
    let r = pull_via(&honest.url(), &image)
        .await
        .expect("pull succeeds despite the liar");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    assert!(
        metric(&honest, "starling_agent_p2p_pieces_rejected_total").await >= 1,
        "the corrupt piece was caught"
    );
    assert!(honest.log_text().contains("piece failed verification"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restarted_agent_keeps_verified_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/restart", "1", &[40 << 20], 16).unwrap();
    let size = image.layers[0].size;
    let t = tracker(dir.path(), &[]).await;
    let seed = agent(dir.path(), "seed", &t.url(), &registry, &[]).await;
    pull_via(&seed.url(), &image).await.unwrap();
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
async fn stale_peers_expire_from_handouts() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, "swarm/stale", "1", &[8 << 20], 17).unwrap();
    let t = tracker(dir.path(), &["--peer-ttl", "1s"]).await;
    let mut a = agent(dir.path(), "gone", &t.url(), &registry, &[]).await;
    pull_via(&a.url(), &image).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let ask = || async {
        let body = serde_json::json!({"node": "probe", "addr": "http://127.0.0.1:1", "digest": image.layers[0].digest, "leaving": true});
        let r: serde_json::Value = reqwest::Client::new()
            .post(format!("{}/swarm/v1/announce", t.url()))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        r["peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["node"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(ask().await, vec!["gone".to_string()]);
    // Peers serve pieces only to holders of the cluster token.
    let piece = format!(
        "{}/p2p/v1/blobs/{}/pieces/0?piece_size=4194304",
        a.url(),
        image.layers[0].digest
    );
    assert_eq!(reqwest::get(&piece).await.unwrap().status(), 401);
    let ok = reqwest::Client::new()
        .get(&piece)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert_eq!(ok.bytes().await.unwrap().len(), 4 << 20);
    a.kill9();
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert!(
        ask().await.is_empty(),
        "a dead peer is not handed out after the TTL"
    );
    // Wrong token: refused.
    let r = reqwest::Client::new()
        .post(format!("{}/swarm/v1/announce", t.url()))
        .bearer_auth("nope")
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_tracker_restart_newcomers_pull_from_seeders_not_the_registry() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/seeders", "1", &[20 << 20], 18).unwrap();
    let mut t = tracker(dir.path(), &[]).await;
    let seed = agent(dir.path(), "seed", &t.url(), &registry, &[]).await;
    pull_via(&seed.url(), &image).await.unwrap();
    // The tracker forgets everything (piece hashes included); the seed re-announces.
    t.kill9();
    t.restart();
    ready(&t.url()).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let b = agent(dir.path(), "newcomer", &t.url(), &registry, &[]).await;
    let r = pull_via(&b.url(), &image).await.expect("pull from seeders");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    // Only the small config blob (below the P2P threshold) comes from the registry.
    assert_eq!(
        metric(&b, "starling_agent_p2p_registry_bytes_total").await,
        image.config.size,
        "the layer came from the seeder"
    );
    assert!(metric(&b, "starling_agent_p2p_peer_bytes_total").await >= image.layers[0].size);
}

/// Polls `cond` until it holds; fails the test after a minute instead of hanging.
async fn until<F: std::future::Future<Output = bool>>(what: &str, cond: impl Fn() -> F) {
    for _ in 0..12_000 {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Piece requests beyond the upload slots wait in a bounded line for a bounded time,
/// if they ask to (`wait=1`, what agents send when the tracker calls the swarm large):
/// a waiting request is served in full once a slot frees; a request beyond the line,
/// one that waits too long, and one that did not ask to wait get 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn piece_requests_wait_for_an_upload_slot_within_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, "swarm/line", "1", &[8 << 20], 19).unwrap();
    // Separate swarms: neither agent serves the other's pull.
    let t = tracker(dir.path(), &[]).await;
    let t2 = tracker(dir.path(), &[]).await;
    // One slot, paced at 2 MiB/s: a 4 MiB piece holds it for about two seconds.
    let patient = agent(
        dir.path(),
        "patient",
        &t.url(),
        &registry,
        &[
            "--max-uploads",
            "1",
            "--upload-queue",
            "1",
            "--upload-wait",
            "60s",
            "--upload-limit",
            "2MiB",
        ],
    )
    .await;
    // Same slot, but at 512 KiB/s the piece holds it for 8 s, far beyond a 200 ms wait.
    let hasty = agent(
        dir.path(),
        "hasty",
        &t2.url(),
        &registry,
        &[
            "--max-uploads",
            "1",
            "--upload-queue",
            "4",
            "--upload-wait",
            "200ms",
            "--upload-limit",
            "512KiB",
        ],
    )
    .await;
    pull_via(&patient.url(), &image).await.unwrap();
    pull_via(&hasty.url(), &image).await.unwrap();
    let digest = image.layers[0].digest.clone();
    let get = |base: String, piece: u32, wait: u8| {
        let digest = digest.clone();
        async move {
            let r = reqwest::Client::new()
                .get(format!(
                    "{base}/p2p/v1/blobs/{digest}/pieces/{piece}?piece_size=4194304&wait={wait}"
                ))
                .bearer_auth(TOKEN)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.bytes().await.unwrap().len())
        }
    };
    let busy_metric = |a: &Proc| {
        let url = a.url();
        async move {
            (
                common::metric(&url, "starling_agent_p2p_uploads_queued_total").await,
                common::metric(&url, "starling_agent_p2p_uploads_refused_total").await,
            )
        }
    };

    let active = |a: &Proc| {
        let url = a.url();
        async move { common::metric(&url, "starling_agent_p2p_uploads_active").await }
    };

    // Patient: the first request takes the slot; the next two arrive while it is held.
    let first = tokio::spawn(get(patient.url(), 0, 1));
    until("the first request holds the slot", || async {
        active(&patient).await == 1
    })
    .await;
    let unwilling = get(patient.url(), 1, 0).await;
    assert_eq!(unwilling.0, 503, "did not ask to wait: refused at once");
    let second = tokio::spawn(get(patient.url(), 1, 1));
    until("the second request waits in line", || async {
        busy_metric(&patient).await.0 == 1
    })
    .await;
    let third = get(patient.url(), 1, 1).await;
    assert_eq!(third.0, 503, "beyond the line: refused at once");
    assert_eq!(first.await.unwrap(), (200, 4 << 20));
    assert_eq!(
        second.await.unwrap(),
        (200, 4 << 20),
        "served after waiting"
    );
    assert_eq!(busy_metric(&patient).await, (1, 2));
    assert_eq!(active(&patient).await, 0, "slots are given back");

    // Hasty: the waiting request gives up long before the slot frees.
    let first = tokio::spawn(get(hasty.url(), 0, 1));
    until("the first request holds the slot", || async {
        active(&hasty).await == 1
    })
    .await;
    let second = get(hasty.url(), 1, 1).await;
    assert_eq!(second.0, 503, "waited too long: refused");
    assert_eq!(first.await.unwrap(), (200, 4 << 20));
    assert_eq!(busy_metric(&hasty).await, (1, 1));
}
