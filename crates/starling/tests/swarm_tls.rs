//! Agents in a cluster with TLS (issue 12, item 3): real `starling` processes join an
//! HTTPS tracker with a bootstrap token and the CA pin, keep their certificate in
//! `CACHE_DIR/pki`, talk to the tracker over mutual TLS, pull through the swarm, and
//! renew their certificate without a restart. Between agents, the peer protocol runs
//! over mutual TLS, and a peer is the node its certificate names.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use common::tls::{client_for, TestPki, TlsTracker};
use common::Proc;
use testkit::{Registry, RegistryAuth, TestImage};

fn agent_args(
    dir: &Path,
    name: &str,
    port: u16,
    tracker: &str,
    registry: &Registry,
) -> Vec<String> {
    let host = registry.host();
    common::args(&[
        "agent",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--cache-dir",
        &dir.join(name).display().to_string(),
        "--default-registry",
        &host,
        "--registry-endpoint",
        &format!("{host}={}", registry.url()),
        "--tracker",
        tracker,
        "--node-name",
        name,
        "--min-free",
        "0",
    ])
}

/// An agent joining with `token` and the CA pin.
async fn joined_agent(
    dir: &Path,
    name: &str,
    t: &TlsTracker,
    pki: &TestPki,
    token: &str,
    registry: &Registry,
) -> Proc {
    let port = testkit::free_port();
    let mut a = agent_args(dir, name, port, &t.url(), registry);
    a.extend(common::args(&["--join", token, "--ca-pin", &pki.pin]));
    Proc::start(a, port, dir.join(format!("{name}.log")), dir.join(name)).await
}

async fn pull_via(
    agent_url: &str,
    image: &testkit::PushedImage,
) -> Result<oci::pull::PullReport, oci::Error> {
    let reference = oci::ImageReference::parse(&image.reference).expect("reference");
    let mut cfg = oci::UpstreamConfig::default();
    cfg.endpoints
        .insert(reference.registry.clone(), agent_url.to_owned());
    let up = oci::Upstream::new(cfg).expect("upstream");
    oci::pull::pull(&up, &reference, &Default::default()).await
}

fn big_layers(image: &testkit::PushedImage) -> u64 {
    image
        .layers
        .iter()
        .filter(|l| l.size >= 4 << 20)
        .map(|l| l.size)
        .sum()
}

async fn nodes(operator: &reqwest::Client, t: &TlsTracker) -> Vec<serde_json::Value> {
    let v: serde_json::Value = operator
        .get(format!("{}/api/v1/nodes", t.url()))
        .send()
        .await
        .expect("nodes")
        .json()
        .await
        .expect("json");
    v["nodes"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agents_join_with_a_token_and_pull_through_the_swarm_over_mutual_tls() {
    let dir = tempfile::tempdir().expect("temp dir");
    let registry = tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .expect("registry");
    let image = TestImage::push_multilayer(
        &registry,
        "swarm/tls",
        "1",
        &[12 << 20, 8 << 20, 64 << 10],
        21,
    )
    .expect("image");
    let pki = TestPki::init(dir.path(), "pki");
    let t = TlsTracker::start(dir.path(), &pki, &[]).await;
    let token = pki.token(Some("gpu-*"));
    let mut agents = Vec::new();
    for i in 0..4 {
        agents
            .push(joined_agent(dir.path(), &format!("gpu-{i}"), &t, &pki, &token, &registry).await);
    }
    for (i, a) in agents.iter().enumerate() {
        let id = a.cache.join("pki");
        let cert = pki::CertSource::from_files(&id.join("node.crt"), &id.join("node.key"))
            .expect("stored identity");
        assert_eq!(
            cert.identity().to_string(),
            format!("starling:node:gpu-{i}")
        );
        let mode = std::fs::metadata(id.join("node.key"))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "node.key must be private");
        let ca = pki::ClusterTrust::from_file(&id.join("ca.crt")).expect("ca.crt");
        assert_eq!(ca.pins()[0].to_string(), pki.pin);
    }

    let urls: Vec<String> = agents.iter().map(Proc::url).collect();
    for r in futures::future::join_all(urls.iter().map(|u| pull_via(u, &image))).await {
        assert_eq!(
            r.expect("pull through the swarm")
                .manifest_digest
                .to_string(),
            image.digest
        );
    }
    let (mut upstream, mut from_peers) = (0, 0);
    for a in &agents {
        upstream += common::metric(&a.url(), "starling_agent_p2p_registry_bytes_total").await;
        from_peers += common::metric(&a.url(), "starling_agent_p2p_peer_bytes_total").await;
    }
    let big = big_layers(&image);
    // Only possible if announces reached the tracker (over mutual TLS) and peers were
    // handed out: without the tracker every agent fetches from the registry.
    assert!(
        upstream <= big + big / 20,
        "registry served {upstream} bytes for {big}"
    );
    assert!(
        from_peers >= 2 * big,
        "peers served {from_peers} bytes of {}",
        3 * big
    );

    // Reports arrive under each node's own name.
    let operator = client_for(&pki.ca_file(), &pki.issue("operator", "ops"), "operator");
    let mut seen = Vec::new();
    for _ in 0..100 {
        seen = nodes(&operator, &t)
            .await
            .iter()
            .filter_map(|n| n["name"].as_str().map(str::to_owned))
            .collect();
        seen.sort();
        if seen.len() == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(seen, ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]);

    // A restart uses the stored certificate; the token is not needed again.
    let first = &mut agents[0];
    first.kill9();
    let port = first.port;
    let restarted = Proc::start(
        agent_args(dir.path(), "gpu-0", port, &t.url(), &registry),
        port,
        dir.path().join("gpu-0-again.log"),
        dir.path().join("gpu-0"),
    )
    .await;
    let r = pull_via(&restarted.url(), &image)
        .await
        .expect("pull after restart");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
}

/// Runs an agent that must refuse to start; returns its log.
async fn refused_agent(
    dir: &Path,
    name: &str,
    extra: &[&str],
    t: &TlsTracker,
    registry: &Registry,
) -> String {
    let port = testkit::free_port();
    let mut a = agent_args(dir, name, port, &t.url(), registry);
    a.extend(common::args(extra));
    let log = dir.join(format!("{name}.log"));
    let mut child = common::spawn(&a, &log);
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .expect("join")
        .expect("wait");
    assert!(!status.success(), "agent {name} started");
    std::fs::read_to_string(&log).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agents_with_a_bad_token_pin_or_name_do_not_join() {
    let dir = tempfile::tempdir().expect("temp dir");
    let registry = tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .expect("registry");
    let pki = TestPki::init(dir.path(), "pki");
    let other = TestPki::init(dir.path(), "other");
    let t = TlsTracker::start(dir.path(), &pki, &[]).await;
    let pin = pki.pin.clone();

    let log = refused_agent(
        dir.path(),
        "gpu-1",
        &["--join", &other.token(None), "--ca-pin", &pin],
        &t,
        &registry,
    )
    .await;
    assert!(log.contains("401"), "another cluster's token: {log}");
    let log = refused_agent(
        dir.path(),
        "cpu-1",
        &["--join", &pki.token(Some("gpu-*")), "--ca-pin", &pin],
        &t,
        &registry,
    )
    .await;
    assert!(
        log.contains("403"),
        "a name outside the token's pattern: {log}"
    );
    let log = refused_agent(
        dir.path(),
        "gpu-2",
        &["--join", &pki.token(None), "--ca-pin", &other.pin],
        &t,
        &registry,
    )
    .await;
    assert!(
        log.contains("pin"),
        "a tracker whose CA does not match the pin: {log}"
    );
    let log = refused_agent(dir.path(), "gpu-3", &[], &t, &registry).await;
    assert!(log.contains("--join"), "no token and no certificate: {log}");
    for name in ["gpu-1", "cpu-1", "gpu-2", "gpu-3"] {
        assert!(
            !dir.path().join(name).join("pki/node.crt").exists(),
            "{name} stored a certificate"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_renews_its_certificate_and_keeps_reporting_after_the_first_expires() {
    let dir = tempfile::tempdir().expect("temp dir");
    let registry = tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .expect("registry");
    let pki = TestPki::init(dir.path(), "pki");
    // Node certificates of 15 s: with the 5 min backdating every certificate is past
    // 2/3 of its lifetime at once, so the agent renews right away and keeps renewing.
    let t = TlsTracker::start(dir.path(), &pki, &["--node-cert-ttl", "15s"]).await;
    let agent = joined_agent(dir.path(), "gpu-0", &t, &pki, &pki.token(None), &registry).await;
    let id = agent.cache.join("pki");
    let first = pki::CertSource::from_files(&id.join("node.crt"), &id.join("node.key"))
        .expect("stored identity")
        .info();
    let first_expiry = first
        .not_after
        .duration_since(UNIX_EPOCH)
        .expect("epoch")
        .as_secs();

    let operator = client_for(&pki.ca_file(), &pki.issue("operator", "ops"), "operator");
    let mut renewed = false;
    let mut heartbeat_after_expiry = false;
    for _ in 0..300 {
        if let Ok(now) = pki::CertSource::from_files(&id.join("node.crt"), &id.join("node.key")) {
            renewed |= now.info().serial != first.serial;
        }
        let heartbeat = nodes(&operator, &t)
            .await
            .iter()
            .find(|n| n["name"] == "gpu-0")
            .and_then(|n| n["last_heartbeat"].as_u64())
            .unwrap_or(0);
        // A report accepted after the first certificate expired was sent with a newer
        // one: the tracker refuses requests on connections whose certificate expired.
        if renewed && heartbeat > first_expiry + 1 {
            heartbeat_after_expiry = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(renewed, "the certificate on disk was never renewed");
    assert!(
        heartbeat_after_expiry,
        "no report accepted after the first certificate expired; agent log:\n{}",
        agent.log_text()
    );
    let mut agent = agent;
    assert!(
        agent.child.try_wait().expect("wait").is_none(),
        "the agent restarted or died"
    );
}

/// Sends HELLO as `me` over `stream`; the holder's name from its HELLO, or `None` when
/// the connection fails or closes first.
async fn hello<S>(mut stream: S, me: &str) -> Option<String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use swarm::wire::{self, Frame};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut out = bytes::BytesMut::new();
    Frame::Hello {
        version: wire::PROTOCOL_VERSION,
        node: me.into(),
        addr: "127.0.0.1:1".into(),
        nonce: [7; 16],
        proof: [0; 32],
    }
    .encode(&mut out);
    stream.write_all(&out).await.ok()?;
    stream.flush().await.ok()?;
    let mut buf = bytes::BytesMut::new();
    let read = async {
        loop {
            match Frame::decode(&mut buf) {
                Ok(Some(Frame::Hello { node, .. })) => return Some(node),
                Ok(Some(_)) | Err(_) => return None,
                Ok(None) => {}
            }
            if stream.read_buf(&mut buf).await.ok()? == 0 {
                return None;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .ok()
        .flatten()
}

/// A TLS connection to the agent `expected` at `addr`, presenting `cert` (chain, key).
async fn peer_tls(
    addr: &str,
    expected: &str,
    cert: (&str, &str),
    ca: &Path,
) -> Result<pki::tokio_rustls::client::TlsStream<tokio::net::TcpStream>, pki::Error> {
    let source = pki::CertSource::from_pem(cert.0, cert.1).expect("certificate");
    let trust = pki::ClusterTrust::from_file(ca).expect("CA");
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    pki::PeerConnector::new(source, trust)
        .connect(expected, tcp)
        .await
}

fn read_pair(dir: &Path, role: &str) -> (String, String) {
    (
        std::fs::read_to_string(dir.join(format!("{role}.crt"))).expect("cert"),
        std::fs::read_to_string(dir.join(format!("{role}.key"))).expect("key"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn peers_are_the_node_of_their_certificate_whatever_hello_says() {
    let dir = tempfile::tempdir().expect("temp dir");
    let registry = tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .expect("registry");
    let pki = TestPki::init(dir.path(), "pki");
    let other = TestPki::init(dir.path(), "other");
    let t = TlsTracker::start(dir.path(), &pki, &[]).await;
    let peer_port = testkit::free_port();
    let peer_addr = format!("127.0.0.1:{peer_port}");
    let port = testkit::free_port();
    let mut a = agent_args(dir.path(), "gpu-0", port, &t.url(), &registry);
    a.extend(common::args(&[
        "--join",
        &pki.token(None),
        "--ca-pin",
        &pki.pin,
        "--peer-listen",
        &peer_addr,
        "--advertise",
        &peer_addr,
    ]));
    let agent = Proc::start(
        a,
        port,
        dir.path().join("gpu-0.log"),
        dir.path().join("gpu-0"),
    )
    .await;
    let ca = pki.ca_file();
    let me = read_pair(&pki.issue("node", "gpu-9"), "node");

    // Control: a node certificate and a HELLO that repeats its name get an answer.
    let s = peer_tls(&peer_addr, "gpu-0", (&me.0, &me.1), &ca)
        .await
        .expect("TLS to gpu-0");
    assert_eq!(hello(s, "gpu-9").await.as_deref(), Some("gpu-0"));

    // The same certificate claiming to be another node is cut off.
    let s = peer_tls(&peer_addr, "gpu-0", (&me.0, &me.1), &ca)
        .await
        .expect("TLS to gpu-0");
    assert_eq!(
        hello(s, "gpu-1").await,
        None,
        "HELLO as gpu-1 with gpu-9's certificate"
    );

    // No TLS at all: the listener speaks only TLS once the node has a certificate.
    let tcp = tokio::net::TcpStream::connect(&peer_addr)
        .await
        .expect("connect");
    assert_eq!(hello(tcp, "gpu-9").await, None, "plain-TCP HELLO answered");

    // Another cluster's node certificate, and an expired one of this cluster.
    let foreign = read_pair(&other.issue("node", "gpu-9"), "node");
    if let Ok(s) = peer_tls(&peer_addr, "gpu-0", (&foreign.0, &foreign.1), &ca).await {
        assert_eq!(
            hello(s, "gpu-9").await,
            None,
            "another CA's certificate answered"
        );
    }
    let now = std::time::SystemTime::now();
    let expired = pki::ClusterCa::load(&pki.dir)
        .expect("CA")
        .issue(
            &pki::CertRequest::new(pki::Identity::node("gpu-9").expect("name")).validity(
                pki::Validity::between(
                    now - Duration::from_secs(7200),
                    now - Duration::from_secs(3600),
                )
                .expect("validity"),
            ),
        )
        .expect("issue");
    let key = expired.key_pem().expect("key").to_owned();
    if let Ok(s) = peer_tls(&peer_addr, "gpu-0", (&expired.chain_pem(), &key), &ca).await {
        assert_eq!(
            hello(s, "gpu-9").await,
            None,
            "an expired certificate answered"
        );
    }

    // The dialer checks the holder too: gpu-0's listener is not gpu-5.
    let wrong = peer_tls(&peer_addr, "gpu-5", (&me.0, &me.1), &ca).await;
    assert!(
        matches!(wrong, Err(pki::Error::WrongIdentity { .. })),
        "dialing gpu-5 reached gpu-0: {wrong:?}"
    );

    // The holder counted the foreign certificate's refusal by reason.
    let unknown_ca = common::metric(
        &agent.url(),
        "starling_agent_p2p_tls_handshakes_refused_total{reason=\"unknown_ca\"}",
    )
    .await;
    assert!(unknown_ca >= 1, "no unknown_ca refusal counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn containerd_pulls_through_two_agents_joined_over_tls() {
    let dir = tempfile::tempdir().expect("temp dir");
    let registry = tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .expect("registry");
    let image =
        TestImage::push_multilayer(&registry, "swarm/ctrd-tls", "1", &[10 << 20, 6 << 20], 22)
            .expect("image");
    let pki = TestPki::init(dir.path(), "pki");
    let t = TlsTracker::start(dir.path(), &pki, &[]).await;
    let token = pki.token(Some("gpu-*"));
    let a = joined_agent(dir.path(), "gpu-a", &t, &pki, &token, &registry).await;
    let b = joined_agent(dir.path(), "gpu-b", &t, &pki, &token, &registry).await;
    let mut handles = Vec::new();
    for (i, ag) in [&a, &b].iter().enumerate() {
        let hosts = dir.path().join(format!("hosts{i}"));
        testkit::write_hosts_toml(&hosts, &registry.host(), &ag.url(), "http://127.0.0.1:9")
            .expect("hosts.toml");
        let r = image.reference.clone();
        handles.push(tokio::task::spawn_blocking(move || {
            let c = testkit::Containerd::start();
            c.pull(&r, &hosts, &[])
                .expect("containerd pull via a TLS swarm agent");
            c.image_digest(&r).expect("digest")
        }));
    }
    for h in handles {
        assert_eq!(h.await.expect("join"), image.digest);
    }
    let upstream = common::metric(&a.url(), "starling_agent_p2p_registry_bytes_total").await
        + common::metric(&b.url(), "starling_agent_p2p_registry_bytes_total").await;
    let big = big_layers(&image);
    assert!(
        upstream <= big + big / 20,
        "registry bytes {upstream} for {big}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_prewarms_nodes_that_report_progress_over_mutual_tls() {
    let dir = tempfile::tempdir().expect("temp dir");
    let registry = tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .expect("registry");
    let image = TestImage::push_multilayer(&registry, "ml/warm-tls", "v1", &[6 << 20, 2 << 20], 23)
        .expect("image");
    let host = registry.host();
    let pki = TestPki::init(dir.path(), "pki");
    let endpoint = format!("{host}={}", registry.url());
    let t = TlsTracker::start(dir.path(), &pki, &["--registry-endpoint", &endpoint]).await;
    let token = pki.token(None);
    let a = joined_agent(dir.path(), "gpu-a", &t, &pki, &token, &registry).await;
    let _b = joined_agent(dir.path(), "gpu-b", &t, &pki, &token, &registry).await;
    // Nobody can hand an agent work on its HTTP API (there is no such endpoint):
    // assignments come from the tracker, fetched over mutual TLS.
    let forged = serde_json::json!({
        "job_id": 99, "node": "gpu-a", "agent_url": null, "images": [], "blobs": [],
        "bytes_per_sec": null, "pin_until": 0, "deadline_at": null, "priority": 0, "seed": true
    });
    let r = reqwest::Client::new()
        .post(format!("{}/api/v1/prewarm", a.url()))
        .json(&forged)
        .send()
        .await
        .expect("agent answers");
    assert!(
        r.status() == 404 || r.status() == 405,
        "the agent still has a push endpoint for assignments: {}",
        r.status()
    );
    let operator = client_for(&pki.ca_file(), &pki.issue("operator", "ops"), "operator");
    let viewer = client_for(&pki.ca_file(), &pki.issue("viewer", "v"), "viewer");
    for _ in 0..150 {
        if nodes(&operator, &t).await.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let body =
        serde_json::json!({"images": [image.reference], "targets": {"nodes": ["gpu-a", "gpu-b"]}});
    let r = viewer
        .post(format!("{}/api/v1/prewarm", t.url()))
        .json(&body)
        .send()
        .await
        .expect("answer");
    assert_eq!(r.status(), 403, "a viewer created a prewarm job");
    let r = operator
        .post(format!("{}/api/v1/prewarm", t.url()))
        .json(&body)
        .send()
        .await
        .expect("answer");
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap_or_default());
    let id = r.json::<serde_json::Value>().await.expect("job")["id"]
        .as_u64()
        .expect("id");
    // Done means both agents fetched their assignment and reported their progress, each
    // as itself, over mutual TLS.
    let mut status = String::new();
    for _ in 0..300 {
        let v: serde_json::Value = viewer
            .get(format!("{}/api/v1/prewarm/{id}", t.url()))
            .send()
            .await
            .expect("job")
            .json()
            .await
            .expect("json");
        status = v["progress"]["status"].as_str().unwrap_or("").to_owned();
        if status != "running" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(status, "done");
}

/// Eight agents joined over mutual TLS pull one image at once; the elected source is
/// killed with SIGKILL mid-transfer. Every other client's stream completes (a
/// replacement source is elected) and the registry serves the big layer about once
/// per election, not once per node.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_tls_agents_survive_a_kill_9_of_the_source() {
    let dir = tempfile::tempdir().expect("temp dir");
    let registry = tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .expect("registry");
    let image = TestImage::push_multilayer(&registry, "swarm/tls-kill", "1", &[32 << 20], 23)
        .expect("image");
    let pki = TestPki::init(dir.path(), "pki");
    let t = TlsTracker::start(dir.path(), &pki, &["--peer-ttl", "1s"]).await;
    let token = pki.token(Some("gpu-*"));
    let slow = ["--download-limit", "8MiB", "--upload-limit", "8MiB"];
    let start = |name: String| {
        let port = testkit::free_port();
        let mut a = agent_args(dir.path(), &name, port, &t.url(), &registry);
        a.extend(common::args(&["--join", &token, "--ca-pin", &pki.pin]));
        a.extend(common::args(&slow));
        Proc::start(
            a,
            port,
            dir.path().join(format!("{name}.log")),
            dir.path().join(&name),
        )
    };
    let mut src = start("gpu-0".into()).await;
    // The first node gets a head start, so it is the one elected.
    let src_url = src.url();
    let img = image.clone();
    let src_pull = tokio::spawn(async move { pull_via(&src_url, &img).await });
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mut peers = Vec::new();
    for i in 1..8 {
        peers.push(start(format!("gpu-{i}")).await);
    }
    let pulls: Vec<_> = peers
        .iter()
        .map(|p| {
            let (u, img) = (p.url(), image.clone());
            tokio::spawn(async move { pull_via(&u, &img).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    src.kill9();
    let _ = src_pull.await;
    for h in pulls {
        let r = h
            .await
            .expect("join")
            .expect("client stream survives the source's death");
        assert_eq!(r.manifest_digest.to_string(), image.digest);
    }
    let operator = client_for(&pki.ca_file(), &pki.issue("operator", "ops"), "operator");
    let swarms: serde_json::Value = operator
        .get(format!("{}/swarm/v1/swarms", t.url()))
        .send()
        .await
        .expect("swarms")
        .json()
        .await
        .expect("json");
    let big = swarms
        .as_array()
        .expect("list")
        .iter()
        .find(|s| s["size"].as_u64() == Some(image.layers[0].size))
        .cloned()
        .expect("the big layer's swarm");
    let elections = big["source_elections"].as_u64().expect("elections");
    assert!(elections >= 2, "a replacement source was elected: {big}");
    let mut from_registry = 0;
    for p in &peers {
        from_registry += common::metric(&p.url(), "starling_agent_p2p_registry_bytes_total").await;
    }
    assert!(
        from_registry <= (elections + 1) * image.layers[0].size,
        "the registry served the big layer about once per election, not per node: {from_registry} bytes for {elections} elections"
    );
}
