//! Cluster identity and TLS on a real `starling tracker --pki` process (issue 12, items
//! 1–2): the `starling certs` commands, HTTPS with client certificates, the role table,
//! nodes speaking only for themselves, refused certificates, bootstrap join and renewal.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, SystemTime};

use common::forged_report;
use common::tls::{client_for, client_pem, starling_ok, TestPki, TlsTracker};

fn announce(node: &str) -> serde_json::Value {
    serde_json::json!({
        "node": node,
        "addr": "127.0.0.1:1",
        "digest": oci::Digest::of(b"tls-announce").to_string(),
        "size": 10u64 << 20,
    })
}

fn seeding(node: &str) -> serde_json::Value {
    serde_json::json!({
        "node": node,
        "addr": "127.0.0.1:1",
        "blobs": [{"digest": oci::Digest::of(b"tls-seed").to_string(), "size": 10u64 << 20}],
    })
}

/// Status of a request, or `None` when the connection failed (a refused handshake).
async fn status(req: reqwest::RequestBuilder) -> Option<u16> {
    req.send().await.ok().map(|r| r.status().as_u16())
}

#[test]
fn certs_cli_creates_the_ca_tokens_and_certificates() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = TestPki::init(dir.path(), "pki");
    let ca = pki::ClusterCa::load(&pki.dir).expect("CA written");
    assert_eq!(pki.pin, ca.pin().to_string(), "init prints the CA pin");

    // A second init must not replace the CA (every certificate would be orphaned).
    let key_before = std::fs::read(pki.dir.join("ca.key")).expect("ca.key");
    let again = std::process::Command::new(env!("CARGO_BIN_EXE_starling"))
        .args(["certs", "init", "--dir", &pki.dir.display().to_string()])
        .output()
        .expect("run");
    assert!(!again.status.success());
    assert_eq!(
        std::fs::read(pki.dir.join("ca.key")).expect("ca.key"),
        key_before
    );

    let bootstrap = pki::BootstrapKey::load(&pki.dir).expect("bootstrap.key");
    let claims = bootstrap
        .verify(&pki.token(Some("gpu-*")))
        .expect("token verifies");
    assert!(claims.authorize("gpu-17").is_ok());
    assert!(
        claims.authorize("cpu-1").is_err(),
        "the pattern binds the token"
    );
    let open = bootstrap.verify(&pki.token(None)).expect("token verifies");
    assert!(open.authorize("anything").is_ok());

    let out = pki.issue("viewer", "alice");
    let cert = std::fs::read_to_string(out.join("viewer.crt")).expect("viewer.crt");
    let info = pki::CertSource::from_pem(
        &cert,
        &std::fs::read_to_string(out.join("viewer.key")).expect("viewer.key"),
    )
    .expect("cert and key match")
    .info();
    assert_eq!(info.identity.to_string(), "starling:viewer:alice");
    let mode = std::fs::metadata(out.join("viewer.key"))
        .expect("stat")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let trust = pki::ClusterTrust::from_file(&out.join("ca.crt")).expect("ca.crt");
    assert_eq!(trust.pins(), vec![ca.pin()]);

    // Tracker certificates are the tracker's business.
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_starling"))
        .args(["certs", "issue", "--dir", &pki.dir.display().to_string()])
        .args(["--role", "tracker", "--name", "t", "--out"])
        .arg(dir.path().join("t"))
        .output()
        .expect("run");
    assert!(!refused.status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_route_but_healthz_needs_a_client_certificate() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = TestPki::init(dir.path(), "pki");
    let tracker = TlsTracker::start(dir.path(), &pki, &[]).await;
    let t = tracker.url();
    let anonymous = client_pem(&pki.ca_file(), None);
    assert_eq!(
        status(anonymous.get(format!("{t}/healthz"))).await,
        Some(200)
    );

    let operator = client_for(&pki.ca_file(), &pki.issue("operator", "ops"), "operator");
    let node = client_for(&pki.ca_file(), &pki.issue("node", "n1"), "node");
    let prewarm =
        serde_json::json!({"images": ["registry.test/a:v1"], "targets": {"nodes": ["n1"]}});
    let report = forged_report("n1", 1, 1, 1);
    let gets = [
        "/",
        "/api/v1/dashboard",
        "/api/v1/nodes",
        "/api/v1/nodes/n1",
        "/api/v1/where?image=registry.test/forged/n1:v1",
        "/api/v1/prewarm",
        "/api/v1/prewarm/1",
        "/swarm/v1/swarms",
        "/swarm/v1/hashes?digest=sha256:0000000000000000000000000000000000000000000000000000000000000000",
        "/metrics",
    ];
    for path in gets {
        assert_eq!(
            status(anonymous.get(format!("{t}{path}"))).await,
            Some(401),
            "GET {path} without a certificate"
        );
    }
    let posts: [(&str, &serde_json::Value); 8] = [
        ("/swarm/v1/announce", &announce("n1")),
        ("/swarm/v1/seeding", &seeding("n1")),
        ("/api/v1/reports", &report),
        ("/api/v1/prewarm", &prewarm),
        (
            "/api/v1/prewarm/1/nodes/n1",
            &serde_json::json!({"status": "done"}),
        ),
        ("/api/v1/rank", &serde_json::json!({})),
        ("/scheduler/filter", &serde_json::json!({})),
        ("/certs/v1/renew", &serde_json::json!({"csr": ""})),
    ];
    for (path, body) in posts {
        assert_eq!(
            status(anonymous.post(format!("{t}{path}")).json(body)).await,
            Some(401),
            "POST {path} without a certificate"
        );
    }
    assert_eq!(
        status(anonymous.delete(format!("{t}/api/v1/prewarm/1"))).await,
        Some(401)
    );

    // The same requests with certificates get past authentication: the 401s above are
    // the missing certificate, not missing routes.
    assert_eq!(
        status(node.post(format!("{t}/api/v1/reports")).json(&report)).await,
        Some(200)
    );
    assert_eq!(
        status(
            node.post(format!("{t}/swarm/v1/announce"))
                .json(&announce("n1"))
        )
        .await,
        Some(200)
    );
    for path in gets {
        // Hashes are part of the node protocol: a node's, not an operator's.
        let client = if path.starts_with("/swarm/v1/hashes") {
            &node
        } else {
            &operator
        };
        let s = status(client.get(format!("{t}{path}"))).await;
        assert!(
            !matches!(s, None | Some(401) | Some(403)),
            "GET {path} with a certificate: {s:?}"
        );
    }

    // Plain HTTP on the TLS port gets nothing.
    let plain = reqwest::Client::new()
        .get(format!(
            "http://127.0.0.1:{}/api/v1/nodes",
            tracker.proc.port
        ))
        .send()
        .await;
    assert!(
        plain.map_or(true, |r| !r.status().is_success()),
        "plain HTTP was served"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn roles_decide_what_a_certificate_may_do() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = TestPki::init(dir.path(), "pki");
    let tracker = TlsTracker::start(dir.path(), &pki, &[]).await;
    let t = tracker.url();
    let ca = pki.ca_file();
    let viewer = client_for(&ca, &pki.issue("viewer", "alice"), "viewer");
    let operator = client_for(&ca, &pki.issue("operator", "ops"), "operator");
    let node = client_for(&ca, &pki.issue("node", "n1"), "node");
    let report = forged_report("n1", 1, 1, 2);
    assert_eq!(
        status(node.post(format!("{t}/api/v1/reports")).json(&report)).await,
        Some(200)
    );

    for path in [
        "/api/v1/nodes",
        "/api/v1/dashboard",
        "/swarm/v1/swarms",
        "/metrics",
        "/",
        "/api/v1/prewarm",
    ] {
        assert_eq!(
            status(viewer.get(format!("{t}{path}"))).await,
            Some(200),
            "viewer GET {path}"
        );
        assert_eq!(
            status(node.get(format!("{t}{path}"))).await,
            Some(403),
            "node GET {path}"
        );
    }
    // By digest: the tracker knows it from the report and needs no registry.
    let image = format!(
        "registry.test/forged/n1@{}",
        report["images"][0]["manifest_digest"]
            .as_str()
            .expect("digest")
    );
    let prewarm = serde_json::json!({"images": [image], "targets": {"nodes": ["n1"]}});
    assert_eq!(
        status(viewer.post(format!("{t}/api/v1/prewarm")).json(&prewarm)).await,
        Some(403),
        "a viewer created a prewarm job"
    );
    assert_eq!(
        status(node.post(format!("{t}/api/v1/prewarm")).json(&prewarm)).await,
        Some(403),
        "a node created a prewarm job"
    );
    let created = operator
        .post(format!("{t}/api/v1/prewarm"))
        .json(&prewarm)
        .send()
        .await
        .expect("operator submits");
    assert_eq!(
        created.status(),
        201,
        "{}",
        created.text().await.unwrap_or_default()
    );
    let id = created.json::<serde_json::Value>().await.expect("job")["id"]
        .as_u64()
        .expect("job id");
    assert_eq!(
        status(viewer.delete(format!("{t}/api/v1/prewarm/{id}"))).await,
        Some(403),
        "a viewer cancelled a prewarm job"
    );
    assert_eq!(
        status(viewer.get(format!("{t}/api/v1/prewarm/{id}"))).await,
        Some(200)
    );
    // (The job may have ended already: its node's agent URL is fake. 409 then.)
    let s = status(operator.delete(format!("{t}/api/v1/prewarm/{id}"))).await;
    assert!(matches!(s, Some(200 | 409)), "operator cancel: {s:?}");
    // Operators do not speak for nodes: the node protocol is the nodes' own.
    assert_eq!(
        status(
            operator
                .post(format!("{t}/api/v1/reports"))
                .json(&forged_report("n1", 2, 1, 2))
        )
        .await,
        Some(403)
    );

    // The CLI with --cert/--key/--ca: a viewer lists nodes but cannot prewarm.
    let viewer_dir = dir.path().join("viewer-alice");
    let tls_args = |d: &std::path::Path, role: &str| {
        vec![
            "--tracker".to_owned(),
            t.clone(),
            "--cert".into(),
            d.join(format!("{role}.crt")).display().to_string(),
            "--key".into(),
            d.join(format!("{role}.key")).display().to_string(),
            "--ca".into(),
            ca.display().to_string(),
        ]
    };
    // (Blocking is fine here: the tracker is another process.)
    let mut nodes_args = vec!["nodes".to_owned()];
    nodes_args.extend(tls_args(&viewer_dir, "viewer"));
    let listed = starling_ok(&nodes_args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(listed.contains("n1"), "{listed}");
    let mut prewarm_args = vec![
        "prewarm".to_owned(),
        image.clone(),
        "--nodes".into(),
        "n1".into(),
    ];
    prewarm_args.extend(tls_args(&viewer_dir, "viewer"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_starling"))
        .args(&prewarm_args)
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("403"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_certificate_speaks_only_for_its_own_node() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = TestPki::init(dir.path(), "pki");
    let tracker = TlsTracker::start(dir.path(), &pki, &[]).await;
    let t = tracker.url();
    let ca = pki.ca_file();
    let node_a = client_for(&ca, &pki.issue("node", "node-a"), "node");
    let operator = client_for(&ca, &pki.issue("operator", "ops"), "operator");

    let as_b = node_a
        .post(format!("{t}/api/v1/reports"))
        .json(&forged_report("node-b", 1, 1, 2));
    assert_eq!(status(as_b).await, Some(403), "node-a reported as node-b");
    let as_a = node_a
        .post(format!("{t}/api/v1/reports"))
        .json(&forged_report("node-a", 1, 1, 2));
    assert_eq!(status(as_a).await, Some(200));
    assert_eq!(
        status(operator.get(format!("{t}/api/v1/nodes/node-b"))).await,
        Some(404),
        "the forged report reached the inventory"
    );
    assert_eq!(
        status(
            node_a
                .post(format!("{t}/swarm/v1/announce"))
                .json(&announce("node-b"))
        )
        .await,
        Some(403),
        "node-a announced as node-b"
    );
    assert_eq!(
        status(
            node_a
                .post(format!("{t}/swarm/v1/seeding"))
                .json(&seeding("node-b"))
        )
        .await,
        Some(403),
        "node-a seeded as node-b"
    );
    assert_eq!(
        status(
            node_a
                .post(format!("{t}/swarm/v1/seeding"))
                .json(&seeding("node-a"))
        )
        .await,
        Some(204)
    );
    let swarms: serde_json::Value = operator
        .get(format!("{t}/swarm/v1/swarms"))
        .send()
        .await
        .expect("swarms")
        .json()
        .await
        .expect("json");
    assert_eq!(
        swarms.as_array().map(Vec::len),
        Some(1),
        "only node-a's seeding counts: {swarms}"
    );
    assert_eq!(
        status(
            node_a
                .post(format!("{t}/api/v1/prewarm/1/nodes/node-b"))
                .json(&serde_json::json!({"status": "done"}))
        )
        .await,
        Some(403),
        "node-a reported prewarm progress for node-b"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn certificates_of_another_ca_or_expired_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = TestPki::init(dir.path(), "pki");
    let other = TestPki::init(dir.path(), "other");
    let tracker = TlsTracker::start(dir.path(), &pki, &[]).await;
    let t = tracker.url();
    let ca = pki.ca_file();
    let report = forged_report("n1", 1, 1, 1);

    // Control: the right CA's certificate for the same node is accepted.
    let good = client_for(&ca, &pki.issue("node", "n1"), "node");
    assert_eq!(
        status(good.post(format!("{t}/api/v1/reports")).json(&report)).await,
        Some(200)
    );

    // Same name and role, signed by another cluster's CA.
    let foreign = client_for(&ca, &other.issue("node", "n1"), "node");
    let s = status(foreign.post(format!("{t}/api/v1/reports")).json(&report)).await;
    assert_eq!(
        s, None,
        "a certificate from another CA got an answer: {s:?}"
    );
    let foreign_op = client_for(&ca, &other.issue("operator", "ops"), "operator");
    let s = status(foreign_op.get(format!("{t}/api/v1/nodes"))).await;
    assert_eq!(
        s, None,
        "an operator certificate from another CA got an answer: {s:?}"
    );

    // Right CA, but expired an hour ago.
    let cluster_ca = pki::ClusterCa::load(&pki.dir).expect("CA");
    let now = SystemTime::now();
    let expired = cluster_ca
        .issue(
            &pki::CertRequest::new(pki::Identity::node("n1").expect("name")).validity(
                pki::Validity::between(
                    now - Duration::from_secs(3 * 3600),
                    now - Duration::from_secs(3600),
                )
                .expect("validity"),
            ),
        )
        .expect("issue");
    let stale = client_pem(
        &ca,
        Some((&expired.chain_pem(), expired.key_pem().expect("key"))),
    );
    let s = status(stale.post(format!("{t}/api/v1/reports")).json(&report)).await;
    assert_eq!(s, None, "an expired certificate got an answer: {s:?}");

    // Every refusal is counted by reason, for an operator's alert.
    let viewer = client_for(&ca, &pki.issue("viewer", "v"), "viewer");
    let metrics = metrics_text(&viewer, &t).await;
    for reason in ["unknown_ca", "expired"] {
        assert!(
            counter(
                &metrics,
                "starling_tracker_tls_handshakes_refused_total",
                reason
            ) >= 1,
            "no {reason} refusal counted:\n{metrics}"
        );
    }
}

async fn metrics_text(client: &reqwest::Client, tracker: &str) -> String {
    client
        .get(format!("{tracker}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body")
}

/// The value of `name{reason="reason"}` in an OpenMetrics text, 0 when absent.
fn counter(metrics: &str, name: &str, reason: &str) -> u64 {
    common::sum_samples(metrics, &format!("{name}{{reason=\"{reason}\"}} "))
}

/// Issue 12: joining is the one route anyone may call, so each client address gets a
/// small budget; guesses beyond it get 429 with Retry-After before any token check, and
/// every outcome is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn joins_are_rate_limited_per_address_and_counted() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = TestPki::init(dir.path(), "pki");
    let tracker = TlsTracker::start(dir.path(), &pki, &["--join-limit", "3"]).await;
    let t = tracker.url();
    let anonymous = client_pem(&pki.ca_file(), None);
    let (_key, csr) = pki::generate_node_csr("n-guess").expect("csr");
    let guess = serde_json::json!({"token": "stb1.guess.guess", "node": "n-guess", "csr": csr});
    for i in 0..3 {
        let s = status(anonymous.post(format!("{t}/certs/v1/join")).json(&guess)).await;
        assert_eq!(s, Some(401), "guess {i}");
    }
    let r = anonymous
        .post(format!("{t}/certs/v1/join"))
        .json(&guess)
        .send()
        .await
        .expect("answered");
    assert_eq!(r.status(), 429, "the fourth guess within a minute");
    let retry: u64 = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    // A valid token from the same address waits too: the budget is spent.
    let token = pki.token(Some("n-*"));
    let join = serde_json::json!({"token": token, "node": "n-late", "csr": csr});
    assert_eq!(
        status(anonymous.post(format!("{t}/certs/v1/join")).json(&join)).await,
        Some(429)
    );
    let viewer = client_for(&pki.ca_file(), &pki.issue("viewer", "v"), "viewer");
    let metrics = metrics_text(&viewer, &t).await;
    assert_eq!(
        counter(&metrics, "starling_tracker_joins_total", "bad_token"),
        3,
        "{metrics}"
    );
    assert_eq!(
        counter(&metrics, "starling_tracker_joins_total", "rate_limited"),
        2,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodes_join_with_a_bootstrap_token_and_renew_over_mutual_tls() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = TestPki::init(dir.path(), "pki");
    let other = TestPki::init(dir.path(), "other");
    let tracker = TlsTracker::start(dir.path(), &pki, &[]).await;
    let t = tracker.url();

    // First contact knows only the pin; the tracker's chain must contain that CA.
    let (config, learned) =
        pki::bootstrap_client_config(pki.pin.parse().expect("pin")).expect("bootstrap config");
    let bootstrap = reqwest::Client::builder()
        .use_preconfigured_tls(config)
        .build()
        .expect("client");
    let join = |token: String, node: &str, csr: &str| {
        bootstrap
            .post(format!("{t}/certs/v1/join"))
            .json(&serde_json::json!({"token": token, "node": node, "csr": csr}))
    };
    let (key, csr) = pki::generate_node_csr("gpu-7").expect("csr");
    let r = join(pki.token(Some("gpu-*")), "gpu-7", &csr)
        .send()
        .await
        .expect("join answers");
    assert_eq!(r.status(), 200);
    let joined: tracker::CertResponse = r.json().await.expect("cert response");
    let me = pki::CertSource::from_pem(&joined.cert, &key).expect("cert matches our key");
    assert_eq!(me.identity().to_string(), "starling:node:gpu-7");
    let learned_ca = learned.cert().expect("CA learned");
    assert_eq!(
        pki::CaPin::of_cert_der(&learned_ca)
            .expect("pin")
            .to_string(),
        pki.pin
    );

    // The joined certificate works for the node's own report.
    let node = client_pem(&pki.ca_file(), Some((&joined.cert, &key)));
    assert_eq!(
        status(
            node.post(format!("{t}/api/v1/reports"))
                .json(&forged_report("gpu-7", 1, 1, 1))
        )
        .await,
        Some(200)
    );

    // Refusals: a name outside the token's pattern, a forged, an expired and another
    // cluster's token.
    let (_, csr2) = pki::generate_node_csr("cpu-1").expect("csr");
    assert_eq!(
        status(join(pki.token(Some("gpu-*")), "cpu-1", &csr2)).await,
        Some(403)
    );
    let mut forged = pki.token(Some("gpu-*"));
    forged.replace_range(forged.len() - 3.., "AAA");
    assert_eq!(
        status(join(forged, "gpu-8", &csr2)).await,
        Some(401),
        "forged token"
    );
    let bootstrap_key = pki::BootstrapKey::load(&pki.dir).expect("bootstrap key");
    let expired = bootstrap_key
        .create_token_at(
            SystemTime::now() - Duration::from_secs(7200),
            Duration::from_secs(3600),
            None,
        )
        .expect("token");
    assert_eq!(
        status(join(expired, "gpu-8", &csr2)).await,
        Some(401),
        "expired token"
    );
    assert_eq!(
        status(join(other.token(None), "gpu-8", &csr2)).await,
        Some(401),
        "foreign token"
    );
    assert_eq!(
        status(join("stb1.garbage".into(), "gpu-8", &csr2)).await,
        Some(401)
    );

    // A client expecting another CA's pin refuses the tracker.
    let (config, _) =
        pki::bootstrap_client_config(other.pin.parse().expect("pin")).expect("config");
    let wrong_pin = reqwest::Client::builder()
        .use_preconfigured_tls(config)
        .build()
        .expect("client");
    assert_eq!(status(wrong_pin.get(format!("{t}/healthz"))).await, None);

    // Renewal over mutual TLS: same identity, new key and serial.
    let (key2, csr3) = pki::generate_node_csr("gpu-7").expect("csr");
    let r = node
        .post(format!("{t}/certs/v1/renew"))
        .json(&serde_json::json!({"csr": csr3}))
        .send()
        .await
        .expect("renew answers");
    assert_eq!(r.status(), 200);
    let renewed: tracker::CertResponse = r.json().await.expect("cert response");
    let next = pki::CertSource::from_pem(&renewed.cert, &key2).expect("matches the new key");
    assert_eq!(next.identity(), me.identity());
    assert_ne!(next.info().serial, me.info().serial);
    // Only nodes renew, and only with a certificate.
    let viewer = client_for(&pki.ca_file(), &pki.issue("viewer", "v"), "viewer");
    let body = serde_json::json!({"csr": csr3});
    assert_eq!(
        status(viewer.post(format!("{t}/certs/v1/renew")).json(&body)).await,
        Some(403)
    );
    let anonymous = client_pem(&pki.ca_file(), None);
    assert_eq!(
        status(anonymous.post(format!("{t}/certs/v1/renew")).json(&body)).await,
        Some(401)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plain_http_mode_says_it_is_insecure() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tracker = common::start_tracker(dir.path(), &[], &[]).await;
    let log = tracker.log_text();
    assert!(log.contains("INSECURE"), "{log}");
}

/// Plain HTTP is never what a deployment gets by leaving a flag out: a tracker without
/// `--pki` and an agent given an `http://` tracker both refuse to start unless
/// `--insecure-plain-http` says so, and the error names the way out.
#[test]
fn plain_http_is_refused_without_the_explicit_opt_in() {
    let dir = tempfile::tempdir().expect("temp dir");
    let port = testkit::free_port();
    let tracker = std::process::Command::new(env!("CARGO_BIN_EXE_starling"))
        .args(["tracker", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--data-dir")
        .arg(dir.path().join("tdata"))
        .output()
        .expect("run starling tracker");
    let err = String::from_utf8_lossy(&tracker.stderr);
    assert!(!tracker.status.success(), "a plain tracker started: {err}");
    assert!(
        err.contains("--pki") && err.contains("--insecure-plain-http"),
        "{err}"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the refused tracker still listens"
    );

    let agent = std::process::Command::new(env!("CARGO_BIN_EXE_starling"))
        .args(["agent", "--listen", "127.0.0.1:0", "--min-free", "0"])
        .arg("--cache-dir")
        .arg(dir.path().join("cache"))
        .args(["--tracker", &format!("http://127.0.0.1:{port}")])
        .output()
        .expect("run starling agent");
    let err = String::from_utf8_lossy(&agent.stderr);
    assert!(
        !agent.status.success(),
        "an agent joined a plain tracker: {err}"
    );
    assert!(
        err.contains("https://") && err.contains("--insecure-plain-http"),
        "{err}"
    );
}

/// The serial of the certificate the tracker at 127.0.0.1:`port` presents now.
async fn tracker_cert_serial(pki: &TestPki, port: u16) -> String {
    let trust = pki::ClusterTrust::from_file(&pki.ca_file()).expect("CA file");
    let config = pki::tracker_client_config(&trust, None).expect("client config");
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let tls = pki::connect(&pki::connector(config), "127.0.0.1", tcp)
        .await
        .expect("handshake with the tracker's current certificate");
    let der = tls.get_ref().1.peer_certificates().expect("server chain")[0].clone();
    pki::CertInfo::from_der(&der).expect("parse").serial_hex()
}

/// Issue 12, item 2 ("certificates rotate without a restart"), the tracker's side: its
/// own certificate is re-issued from the CA at 2/3 of its lifetime while it runs, and
/// nodes keep working across the change. Certificates are backdated by 5 minutes for
/// clock skew, so with a 155 s lifetime 2/3 of it is reached about 3 s after issue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_tracker_renews_its_own_certificate_while_running() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = TestPki::init(dir.path(), "pki");
    let tracker = TlsTracker::start(dir.path(), &pki, &["--tls-cert-ttl", "155s"]).await;
    let port = tracker.proc.port;
    let first = tracker_cert_serial(&pki, port).await;
    let viewer = client_for(&pki.ca_file(), &pki.issue("viewer", "v-rot"), "viewer");
    let mut renewed = None;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = tracker_cert_serial(&pki, port).await;
        if now != first {
            renewed = Some(now);
            break;
        }
    }
    assert!(
        renewed.is_some(),
        "the tracker still presents certificate {first}; log:\n{}",
        tracker.proc.log_text()
    );
    let r = viewer
        .get(format!("{}/api/v1/nodes", tracker.url()))
        .send()
        .await
        .expect("a client reaches the tracker after the renewal");
    assert_eq!(r.status(), 200);
    assert!(tracker
        .proc
        .log_text()
        .contains("tracker certificate renewed"));
}
