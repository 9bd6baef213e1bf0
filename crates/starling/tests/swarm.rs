//! The swarm as real processes: a tracker and agents (`starling` binaries) on loopback,
//! the real docker-registry as origin, real containerd, and every fault of issue 3.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::path::Path;
use std::time::Duration;

use common::{pull_via, ready, Proc};

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
        "--insecure-plain-http".into(),
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
        "--insecure-plain-http".into(),
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

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

type PullTask = tokio::task::JoinHandle<Result<oci::pull::PullReport, oci::Error>>;

/// `agent` pulls `image` in the background.
fn spawn_pull(agent: &Proc, image: &testkit::PushedImage) -> PullTask {
    let (url, img) = (agent.url(), image.clone());
    tokio::spawn(async move { pull_via(&url, &img).await })
}

/// `src` pulls `image` in the background; returns once it reads from the registry
/// (elected source of the big layer).
async fn spawn_source_pull(src: &Proc, image: &testkit::PushedImage) -> PullTask {
    let pull = spawn_pull(src, image);
    testkit::until(
        "the source to read from the registry",
        Duration::from_millis(5),
        Duration::from_secs(60),
        || async { metric(src, "starling_agent_p2p_registry_bytes_total").await > 0 },
    )
    .await;
    pull
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

/// Asks the tracker who holds a blob, as a node that holds nothing: (name, address).
/// The tracker's answer to a probe that announces and leaves at once: the swarm's
/// geometry and its handout, without joining it.
async fn probe_announce(tracker: &str, digest: &str) -> serde_json::Value {
    let body = serde_json::json!({"node": "probe", "addr": "127.0.0.1:1", "digest": digest, "leaving": true});
    reqwest::Client::new()
        .post(format!("{tracker}/swarm/v1/announce"))
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A blob's bytes straight from the registry.
async fn registry_blob(registry: &Registry, repo: &str, digest: &str) -> Vec<u8> {
    let url = format!("{}/v2/{repo}/blobs/{digest}", registry.url());
    blocking(move || testkit::http_get(&url, &[]).unwrap().body).await
}

async fn holders(tracker: &str, digest: &str) -> Vec<(String, String)> {
    let r = probe_announce(tracker, digest).await;
    r["peers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["node"].as_str().unwrap().to_owned(),
                p["addr"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// An agent named "holder" pulling a one-layer image of 16 MiB from the registry at
/// 2 MiB/s (about 8 s), so the blob is in progress, piece by piece, while a test talks
/// to it as a peer. `pull` is its client's pull.
struct SlowHolder {
    registry: Registry,
    image: testkit::PushedImage,
    tracker: Proc,
    _holder: Proc,
    pull: tokio::task::JoinHandle<Result<oci::pull::PullReport, oci::Error>>,
}

impl SlowHolder {
    async fn start(dir: &Path, repo: &str, seed: u64) -> Self {
        let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
        let image = TestImage::push_multilayer(&registry, repo, "1", &[16 << 20], seed).unwrap();
        let tracker = tracker(dir, &[]).await;
        let holder = agent(
            dir,
            "holder",
            &tracker.url(),
            &registry,
            &["--download-limit", "2MiB"],
        )
        .await;
        let pull = tokio::spawn({
            let (url, image) = (holder.url(), image.clone());
            async move { pull_via(&url, &image).await }
        });
        Self {
            registry,
            image,
            tracker,
            _holder: holder,
            pull,
        }
    }
}

/// The swarm's piece size and the peer address of the agent named "holder", once a
/// tracker answer (`probe_announce`) has both.
fn holder_in(r: &serde_json::Value) -> Option<(u64, String)> {
    let piece_size = r["piece_size"].as_u64().filter(|&p| p > 1)?;
    let addr = r["peers"]
        .as_array()?
        .iter()
        .find(|x| x["node"] == "holder")?["addr"]
        .as_str()?;
    Some((piece_size, addr.to_owned()))
}

/// A channel opened while the holder (the blob's source) is still fetching it gets the
/// hashes the holder knows from piece 0 in a HASHES frame right after its bitfield, so
/// a downloader can verify its first piece without waiting for the tracker's copy of
/// the hash (which cost non-seeds 0.2–0.3 s of their first byte).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_sends_the_hashes_it_knows_after_its_bitfield() {
    use swarm::wire::Frame;
    use testkit::peer::{raw_digest, PeerClient, Read};
    let dir = tempfile::tempdir().unwrap();
    let slow = SlowHolder::start(dir.path(), "swarm/hashes", 23).await;
    let layer = &slow.image.layers[0];
    let blob = registry_blob(&slow.registry, &slow.image.repo, &layer.digest).await;
    let mut found = None;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let r = probe_announce(&slow.tracker.url(), &layer.digest).await;
        let Some((piece_size, addr)) = holder_in(&r) else {
            continue;
        };
        let mut c = PeerClient::connect(&addr, "downloader", Some(TOKEN))
            .await
            .unwrap();
        c.send(&[Frame::Open {
            chan: 3,
            digest: raw_digest(&layer.digest),
            blob_size: layer.size,
            piece_size,
        }])
        .await
        .unwrap();
        match c.read().await.unwrap() {
            Read::Frame(Frame::Bitfield { have, .. }) if have.count() > 0 => {
                found = Some((piece_size, have.count(), c.read().await.unwrap()));
                break;
            }
            Read::Frame(Frame::Bitfield { .. }) => continue,
            other => panic!("the source finished before it was asked: {other:?}"),
        }
    }
    let (piece_size, held, next) = found.expect("the source held a piece within 10 s");
    let layout = swarm::PieceLayout::new(layer.size, piece_size);
    assert!(layout.is_small_head(0), "{layout:?}: a small head piece");
    let Read::Frame(Frame::Hashes {
        chan: 3,
        first: 0,
        hashes,
    }) = next
    else {
        panic!("expected HASHES after the bitfield, got {next:?}");
    };
    assert!(
        !hashes.is_empty() && hashes.len() as u32 <= held,
        "{} hashes for {held} pieces held",
        hashes.len()
    );
    let mut before = None;
    for (i, h) in hashes.iter().enumerate() {
        let (a, b) = layout.range(i as u32);
        let mut hasher = swarm::pieces::PieceHasher::for_piece(layout, i as u32, before)
            .expect("pieces end on blocks");
        hasher.update(&blob[a as usize..b as usize]);
        assert_eq!(
            *h,
            hasher.finish(),
            "piece {i}'s hash is its chained sha256"
        );
        before = Some(*h);
    }
    slow.pull.await.unwrap().unwrap();
}

/// A downloader's HAVE_FILTER narrows the HAVEs a real holder sends on the channel
/// (a far holder in a rack-striped swarm is asked for the downloader's stripe only),
/// and widening it again brings the bitfield, so no piece goes unheard.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_sends_only_the_haves_its_channel_admits() {
    use swarm::links::HaveFilter;
    use swarm::wire::Frame;
    use testkit::peer::{raw_digest, PeerClient, Read};
    let dir = tempfile::tempdir().unwrap();
    let slow = SlowHolder::start(dir.path(), "swarm/filter", 29).await;
    let layer = &slow.image.layers[0];
    let mut joined = None;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        joined = holder_in(&probe_announce(&slow.tracker.url(), &layer.digest).await);
        if joined.is_some() {
            break;
        }
    }
    let (piece_size, addr) = joined.expect("the holder joined the swarm within 10 s");
    let mut c = PeerClient::connect(&addr, "downloader", Some(TOKEN))
        .await
        .unwrap();
    let odd = HaveFilter {
        modulus: 2,
        residue: 1,
    };
    // The PONG marks where the holder has taken the filter in: HAVEs after it obey it.
    c.send(&[
        Frame::Open {
            chan: 3,
            digest: raw_digest(&layer.digest),
            blob_size: layer.size,
            piece_size,
        },
        Frame::HaveFilter {
            chan: 3,
            filter: odd,
        },
        Frame::Ping { nonce: 7 },
    ])
    .await
    .unwrap();
    let mut ponged = false;
    let mut odd_haves = Vec::new();
    while odd_haves.len() < 3 {
        match c.read().await.unwrap() {
            Read::Frame(Frame::Pong { nonce: 7 }) => ponged = true,
            Read::Frame(Frame::Have { piece, .. }) if ponged => {
                assert_eq!(
                    piece % 2,
                    1,
                    "HAVE {piece} on a channel that admits odd pieces"
                );
                odd_haves.push(piece);
            }
            Read::Frame(Frame::Complete { .. }) => {
                panic!("the holder finished before three odd pieces: {odd_haves:?}")
            }
            _ => {}
        }
    }
    c.send(&[Frame::HaveFilter {
        chan: 3,
        filter: HaveFilter::ALL,
    }])
    .await
    .unwrap();
    let mut rebased = None;
    loop {
        match c.read().await.unwrap() {
            Read::Frame(Frame::Bitfield { have, .. }) => {
                rebased = Some(have);
            }
            Read::Frame(Frame::Have { piece, .. }) if rebased.is_some() && piece % 2 == 0 => {
                break;
            }
            Read::Frame(Frame::Complete { .. }) => break,
            _ => {}
        }
    }
    let have = rebased.expect("a bitfield after the filter widened");
    for p in &odd_haves {
        assert!(have.get(*p), "the bitfield has piece {p}");
    }
    assert!(
        (0..have.len()).any(|p| p % 2 == 0 && have.get(p)),
        "the bitfield names even pieces the filter held back"
    );
    slow.pull.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_peers_expire_from_handouts() {
    use swarm::wire::Frame;
    use testkit::peer::{raw_digest, PeerClient, Read};
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, "swarm/stale", "1", &[8 << 20], 17).unwrap();
    let t = tracker(dir.path(), &["--peer-ttl", "1s"]).await;
    let mut a = agent(dir.path(), "gone", &t.url(), &registry, &[]).await;
    pull_via(&a.url(), &image).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let layer = &image.layers[0];
    let held = holders(&t.url(), &layer.digest).await;
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].0, "gone");
    let addr = held[0].1.clone();
    // Peers serve pieces only to holders of the cluster token, and the token itself
    // never crosses the wire (challenge and answer).
    let mut stranger = PeerClient::connect(&addr, "mallory", None).await.unwrap();
    let open = Frame::Open {
        chan: 1,
        digest: raw_digest(&layer.digest),
        blob_size: layer.size,
        piece_size: 1 << 20,
    };
    let _ = stranger
        .send(&[
            open.clone(),
            Frame::Request {
                chan: 1,
                piece: 0,
                urgent: false,
            },
        ])
        .await;
    match stranger.read().await {
        Ok(Read::Frame(Frame::Goodbye { reason })) => assert!(reason.contains("token"), "{reason}"),
        Err(_) => {}
        other => panic!("a peer without the token got {other:?}"),
    }
    let mut member = PeerClient::connect(&addr, "member", Some(TOKEN))
        .await
        .unwrap();
    assert_eq!(member.holder, "gone");
    member.send(&[open]).await.unwrap();
    match member.read().await.unwrap() {
        Read::Frame(Frame::Complete { chan: 1 }) => {}
        other => panic!("expected COMPLETE, got {other:?}"),
    }
    let layout = swarm::PieceLayout::new(layer.size, 1 << 20);
    let mut blob = Vec::new();
    for piece in 0..layout.count() {
        member
            .send(&[Frame::Request {
                chan: 1,
                piece,
                urgent: false,
            }])
            .await
            .unwrap();
        let (bytes, _) = member
            .read_piece(1, piece, layout.len(piece) as usize)
            .await
            .unwrap();
        blob.extend(bytes);
    }
    assert_eq!(
        oci::Digest::of(&blob).to_string(),
        layer.digest,
        "every piece, byte for byte"
    );
    a.kill9();
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert!(
        holders(&t.url(), &layer.digest).await.is_empty(),
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
    // Only the small config blob (below the P2P threshold) comes from the registry,
    // by whichever path (the swarm's registry runs or a plain fetch).
    assert_eq!(
        metric(&b, "starling_agent_upstream_bytes_total").await,
        image.config.size,
        "the layer came from the seeder"
    );
    assert!(metric(&b, "starling_agent_p2p_peer_bytes_total").await >= image.layers[0].size);
}

/// Piece requests beyond the upload slots wait in a bounded line on the holder: the
/// one being sent goes on, a waiting one is served once the slot frees (or cancelled
/// on request), and one beyond the line is told "busy" at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn piece_requests_wait_in_a_bounded_upload_line() {
    use swarm::wire::{Frame, RejectReason};
    use testkit::peer::{raw_digest, PeerClient, Read};
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, "swarm/line", "1", &[8 << 20], 19).unwrap();
    let t = tracker(dir.path(), &[]).await;
    // One slot, a line of one per connection, paced at 2 MiB/s: a 1 MiB piece holds
    // the slot for about half a second.
    let holder = agent(
        dir.path(),
        "holder",
        &t.url(),
        &registry,
        &[
            "--max-uploads",
            "1",
            "--upload-queue",
            "1",
            "--upload-limit",
            "2MiB",
        ],
    )
    .await;
    pull_via(&holder.url(), &image).await.unwrap();
    let layer = &image.layers[0];
    let addr = holders(&t.url(), &layer.digest)
        .await
        .into_iter()
        .find(|(n, _)| n == "holder")
        .expect("the holder is handed out")
        .1;
    let mut c = PeerClient::connect(&addr, "downloader", Some(TOKEN))
        .await
        .unwrap();
    c.send(&[Frame::Open {
        chan: 7,
        digest: raw_digest(&layer.digest),
        blob_size: layer.size,
        piece_size: 1 << 20,
    }])
    .await
    .unwrap();
    assert!(matches!(
        c.read().await.unwrap(),
        Read::Frame(Frame::Complete { chan: 7 })
    ));
    // Pieces 2 to 5 are whole MiBs (piece 0 is the small head, 1 the rest of the
    // first MiB): named here 0 to 3 for the order they are asked in.
    let layout = swarm::PieceLayout::new(layer.size, 1 << 20);
    assert_eq!(layout.len(2), 1 << 20);
    let req = |piece: u32| Frame::Request {
        chan: 7,
        piece: piece + 2,
        urgent: false,
    };
    c.send(&[req(0)]).await.unwrap();
    // Piece 0 is on its way (its first bytes are here) before the others are asked.
    let first = match c.read().await.unwrap() {
        Read::Data {
            piece: 2,
            offset: 0,
            bytes,
            ..
        } => bytes,
        other => panic!("expected piece 0's first bytes, got {other:?}"),
    };
    c.send(&[req(1), req(2)]).await.unwrap();
    let (rest, others) = c
        .read_piece_from(7, 2, first.len(), (1 << 20) - first.len())
        .await
        .unwrap();
    let mut all_others = others;
    // Piece 2 was beyond the line of one: busy, at once (before piece 0 ended).
    assert!(
        all_others.contains(&Frame::Reject {
            chan: 7,
            piece: 4,
            reason: RejectReason::Busy
        }),
        "the request beyond the line is refused while piece 0 is still being sent: {all_others:?}"
    );
    let mut piece0 = first;
    piece0.extend(rest);
    // Piece 1 waited in line and comes next, whole.
    let (piece1, others) = c.read_piece(7, 3, 1 << 20).await.unwrap();
    all_others.extend(others);
    // Cancel a waiting request: ask for 2 and 3, cancel 3 while 2 is being sent.
    c.send(&[req(2)]).await.unwrap();
    let started = match c.read().await.unwrap() {
        Read::Data {
            piece: 4,
            offset: 0,
            bytes,
            ..
        } => bytes,
        other => panic!("expected piece 2, got {other:?}"),
    };
    c.send(&[req(3), Frame::Cancel { chan: 7, piece: 5 }])
        .await
        .unwrap();
    let (rest2, others) = c
        .read_piece_from(7, 4, started.len(), (1 << 20) - started.len())
        .await
        .unwrap();
    all_others.extend(others);
    let mut tail = Vec::new();
    while !all_others.iter().chain(&tail).any(|f| {
        *f == Frame::Reject {
            chan: 7,
            piece: 5,
            reason: RejectReason::Cancelled,
        }
    }) {
        match c.read().await.unwrap() {
            Read::Frame(f) => tail.push(f),
            Read::Data { piece, .. } => panic!("a cancelled request was served: piece {piece}"),
        }
    }
    let mut piece2 = started;
    piece2.extend(rest2);
    // The bytes are the blob's bytes.
    let blob = registry_blob(&registry, &image.repo, &layer.digest).await;
    let bytes_of = |i: u32| {
        let (a, b) = layout.range(i + 2);
        &blob[a as usize..b as usize]
    };
    assert_eq!(&piece0[..], bytes_of(0));
    assert_eq!(&piece1[..], bytes_of(1));
    assert_eq!(&piece2[..], bytes_of(2));
    assert_eq!(
        metric(&holder, "starling_agent_p2p_uploads_refused_total").await,
        1
    );
    assert_eq!(
        metric(&holder, "starling_agent_p2p_uploads_active").await,
        0,
        "slots are given back"
    );
}

/// A holder that stops in the middle of sending (its process frozen, the connection
/// open) is detected by its silence; the downloader drops it and finishes elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_peer_that_stops_mid_stream_is_dropped_and_the_pull_completes() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/frozen", "1", &[48 << 20], 23).unwrap();
    let t = tracker(dir.path(), &["--peer-ttl", "2s"]).await;
    let seed = agent(
        dir.path(),
        "seed",
        &t.url(),
        &registry,
        &["--upload-limit", "8MiB"],
    )
    .await;
    pull_via(&seed.url(), &image).await.unwrap();
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let url = b.url();
    let img = image.clone();
    let pull = tokio::spawn(async move { pull_via(&url, &img).await });
    testkit::until(
        "b to receive from the seed",
        Duration::from_millis(5),
        Duration::from_secs(60),
        || async { metric(&b, "starling_agent_p2p_peer_bytes_total").await > 4 << 20 },
    )
    .await;
    let pid = seed.child.id().to_string();
    let stop = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap();
    assert!(stop.success());
    let r = tokio::time::timeout(Duration::from_secs(90), pull).await;
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status();
    let r = r
        .expect("the pull finishes")
        .unwrap()
        .expect("and succeeds");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    assert!(
        metric(&b, "starling_agent_p2p_peers_stalled_total").await >= 1,
        "the frozen peer was detected"
    );
    assert!(
        metric(&b, "starling_agent_p2p_registry_bytes_total").await > image.config.size,
        "the rest came from the registry"
    );
}

/// Source stripes: each member asks the source only for its own share of the pieces
/// and passes them on. A member that freezes mid-transfer (SIGSTOP: its connections
/// stay open, it answers nothing) must not strand its share: the others take it from
/// the source after their patience, or once the source holds the whole blob and the
/// tracker stops giving stripes, whichever comes first (with the patience set to
/// hours this still passes, by the second way; the patience itself is unit-tested in
/// `swarm::scheduler`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_stripe_member_strands_no_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/stripes", "1", &[32 << 20], 29).unwrap();
    // The tracker keeps the frozen member for the whole test, so its stripe stays.
    let t = tracker(dir.path(), &["--peer-ttl", "300s"]).await;
    let slow = ["--download-limit", "8MiB", "--upload-limit", "8MiB"];
    let src = agent(dir.path(), "src", &t.url(), &registry, &slow).await;
    let src_pull = spawn_source_pull(&src, &image).await;
    let mut members = Vec::new();
    let mut pulls = Vec::new();
    for i in 0..3 {
        let m = agent(dir.path(), &format!("m{i}"), &t.url(), &registry, &slow).await;
        pulls.push(spawn_pull(&m, &image));
        members.push(m);
    }
    let frozen = &members[0];
    testkit::until(
        "the member to take its share",
        Duration::from_millis(5),
        Duration::from_secs(60),
        || async { metric(frozen, "starling_agent_p2p_peer_bytes_total").await > 2 << 20 },
    )
    .await;
    let pid = frozen.child.id().to_string();
    let stop = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap();
    assert!(stop.success());
    let frozen_pull = pulls.remove(0);
    let results =
        tokio::time::timeout(Duration::from_secs(120), futures::future::join_all(pulls)).await;
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status();
    for r in results.expect("the other members finish") {
        let r = r.unwrap().expect("and their pulls succeed");
        assert_eq!(r.manifest_digest.to_string(), image.digest);
    }
    src_pull.await.unwrap().expect("the source's own pull");
    frozen_pull.abort();
    // One copy from the registry: the stranded share came from the source's cache
    // or a member, not from a second registry read.
    let upstream = metric(&src, "starling_agent_p2p_registry_bytes_total").await;
    let mut others = 0;
    for m in &members[1..] {
        others += metric(m, "starling_agent_p2p_registry_bytes_total").await;
    }
    assert_eq!(others, 0, "the members read nothing from the registry");
    assert!(upstream <= image.layers[0].size + image.layers[0].size / 20);
}

/// Rack stripes between real agents (the tracker gives them from 3 members here): the
/// two members of one rack each ask the source, in another rack, only for their
/// stripe's HAVEs (HAVE_FILTER), the source holds the others back, and the rack's
/// pulls still complete from the source and each other, the registry read once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn far_peers_in_a_striped_swarm_hear_only_their_stripe() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/have-filter", "1", &[32 << 20], 31).unwrap();
    let t = tracker(dir.path(), &["--stripe-min-members", "3"]).await;
    let rack = |r: &'static str| ["--zone", "z", "--rack", r];
    let slow = ["--download-limit", "4MiB", "--upload-limit", "8MiB"];
    let src = agent(
        dir.path(),
        "src",
        &t.url(),
        &registry,
        &[&slow[..], &rack("r0")[..]].concat(),
    )
    .await;
    let src_pull = spawn_source_pull(&src, &image).await;
    let mut members = Vec::new();
    let mut pulls = Vec::new();
    for i in 0..2 {
        let m = agent(
            dir.path(),
            &format!("m{i}"),
            &t.url(),
            &registry,
            &["--download-limit", "64MiB", "--zone", "z", "--rack", "r1"],
        )
        .await;
        pulls.push(spawn_pull(&m, &image));
        members.push(m);
    }
    for r in futures::future::join_all(pulls).await {
        let r = r.unwrap().expect("a member's pull");
        assert_eq!(r.manifest_digest.to_string(), image.digest);
    }
    src_pull.await.unwrap().expect("the source's own pull");
    let filters = metric(&src, "starling_agent_p2p_have_filters_received_total").await;
    let held_back = metric(&src, "starling_agent_p2p_haves_filtered_total").await;
    let sent = metric(&src, "starling_agent_p2p_haves_sent_total").await;
    assert!(
        filters >= 2,
        "each member asked the far source for its stripe: {filters} HAVE_FILTERs"
    );
    assert!(
        held_back > 0 && sent > 0,
        "the source sent some HAVEs ({sent}) and held others back ({held_back})"
    );
    let mut from_registry = 0;
    for m in &members {
        from_registry += metric(m, "starling_agent_p2p_registry_bytes_total").await;
        assert_eq!(
            metric(m, "starling_agent_p2p_have_filters_received_total").await,
            0,
            "near peers filter nothing"
        );
    }
    // (Blobs under the P2P threshold, the config here, may come from the registry.)
    assert!(
        from_registry < 1 << 20,
        "the members read none of the layer from the registry: {from_registry} bytes"
    );
    let upstream = metric(&src, "starling_agent_p2p_registry_bytes_total").await;
    assert!(upstream <= image.layers[0].size + image.layers[0].size / 20);
}
