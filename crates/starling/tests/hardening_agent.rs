//! Attacks on a real `starling agent` process (security issue 12): `?ns=` pointed at
//! internal hosts, slow and surplus connections, refused reports nobody hears about,
//! prewarm assignments only collected from the tracker (no address from a report is ever
//! dialled), private content kept to local clients, and secrets printed by `--print-config`.
//!
//! Settings a test needs are passed as `STARLING_*` environment variables, so the same
//! test runs against a build that lacks them and fails for the missing behaviour.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::other_host::OtherHost;
use common::{args, counting_listener, forged_report, start_tracker, start_with_env, Proc};
use testkit::{Registry, RegistryAuth, TestImage};

const TOKEN: &str = "hardening-token-0451";

/// An agent whose default (and only configured) registry is `registry`.
async fn start_agent(
    dir: &std::path::Path,
    name: &str,
    registry: &Registry,
    extra: &[&str],
    envs: &[(&str, &str)],
) -> Proc {
    let port = testkit::free_port();
    let cache = dir.join(name);
    let mut a = args(&[
        "agent",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--cache-dir",
        &cache.display().to_string(),
        "--default-registry",
        &registry.host(),
        "--registry-endpoint",
        &format!("{}={}", registry.host(), registry.url()),
        "--min-free",
        "0",
        "--node-name",
        name,
    ]);
    a.extend(args(extra));
    start_with_env(a, envs, port, dir.join(format!("{name}.log")), cache).await
}

/// GETs a manifest the way runtimes do (the registry hides OCI manifests from a bare
/// `Accept: */*`).
async fn manifest(url: &str) -> reqwest::Response {
    reqwest::Client::new()
        .get(url)
        .header("Accept", oci::media::DEFAULT_ACCEPT)
        .send()
        .await
        .expect("manifest request")
}

async fn registry() -> Registry {
    tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .expect("registry")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ns_pointing_at_unconfigured_or_internal_hosts_is_denied_without_connecting() {
    let dir = tempfile::tempdir().expect("temp dir");
    let registry = registry().await;
    let img =
        TestImage::push_multilayer(&registry, "ok/img", "v1", &[64 << 10], 31).expect("push image");
    let (forbidden, accepts) = counting_listener().await;
    let layer = img.layers[0].digest.clone();
    for (round, envs) in [
        ("default", vec![]),
        // Even "any registry" does not open internal addresses nobody configured.
        (
            "allowed_registries=*",
            vec![("STARLING_ALLOWED_REGISTRIES", "*")],
        ),
    ] {
        let agent = start_agent(dir.path(), "n-ssrf", &registry, &[], &envs).await;
        let base = agent.url();
        let ok = manifest(&format!("{base}/v2/ok/img/manifests/v1")).await;
        assert_eq!(
            ok.status(),
            200,
            "{round}: the configured registry works: {}\n{}",
            ok.text().await.unwrap_or_default(),
            agent.log_text()
        );
        let ok = manifest(&format!(
            "{base}/v2/ok/img/manifests/v1?ns={}",
            registry.host().replace(':', "%3A")
        ))
        .await;
        assert_eq!(
            ok.status(),
            200,
            "{round}: ns= the configured registry works"
        );
        let mut targets = vec![
            forbidden.to_string().replace(':', "%3A"),
            format!("localhost%3A{}", forbidden.port()),
            "169.254.169.254".to_owned(),
            "169.254.169.254%3A80".to_owned(),
        ];
        if round == "default" {
            targets.push("metadata.google.internal".to_owned());
        }
        for ns in &targets {
            for path in [
                "/v2/x/y/manifests/latest".to_owned(),
                format!("/v2/x/y/blobs/{layer}"),
                "/v2/x/y/tags/list".to_owned(),
            ] {
                let url = format!("{base}{path}?ns={ns}");
                let r = tokio::time::timeout(Duration::from_secs(20), reqwest::get(&url))
                    .await
                    .unwrap_or_else(|_| panic!("{round}: {url} did not answer in 20 s"))
                    .expect("answer");
                let status = r.status();
                let body: serde_json::Value = r.json().await.unwrap_or_default();
                assert_eq!(status, 403, "{round}: {path}?ns={ns}: {body}");
                assert_eq!(body["errors"][0]["code"], "DENIED", "{round}: {body}");
            }
        }
        assert_eq!(
            accepts.load(Ordering::SeqCst),
            0,
            "{round}: the agent connected to an address it was never configured for"
        );
        drop(agent);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_drops_slow_header_clients_and_caps_connections() {
    let dir = tempfile::tempdir().expect("temp dir");
    let registry = registry().await;
    let agent = start_agent(
        dir.path(),
        "n-conn",
        &registry,
        &[],
        &[
            ("STARLING_MAX_CONNECTIONS", "8"),
            ("STARLING_HEADER_READ_TIMEOUT", "5s"),
        ],
    )
    .await;
    common::assert_connection_limits(
        &agent.url(),
        agent.port,
        8,
        "starling_agent_connections_refused_total",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_agent_warns_when_the_tracker_refuses_its_report() {
    let dir = tempfile::tempdir().expect("temp dir");
    let registry = registry().await;
    let tracker = start_tracker(dir.path(), &["--cluster-token", TOKEN], &[]).await;
    // A report under the agent's name from far in the future: the agent's own reports
    // are then stale and refused (409).
    let r = reqwest::Client::new()
        .post(format!("{}/api/v1/reports", tracker.url()))
        .json(&forged_report("n-stale", u64::MAX / 2, 3, 1))
        .send()
        .await
        .expect("forged report answered");
    assert_eq!(r.status(), 200);
    let agent = start_agent(
        dir.path(),
        "n-stale",
        &registry,
        &[
            "--tracker",
            &tracker.url(),
            "--cluster-token",
            TOKEN,
            "--insecure-plain-http",
        ],
        &[],
    )
    .await;
    let mut warned = false;
    for _ in 0..60 {
        if agent
            .log_text()
            .lines()
            .any(|l| l.contains("WARN") && l.contains("report") && l.contains("409"))
        {
            warned = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        warned,
        "the tracker refused every report for 15 s and the agent never said so at warn:\n{}",
        agent.log_text()
    );
}

/// Issue 12, finding 1: a forged report named an attacker's server as a node's
/// `agent_url`, and the tracker POSTed that node's prewarm assignment there with the
/// cluster token. Now agents collect their assignments from the tracker, which never
/// connects to an address from a report; the agent has no inbound prewarm endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn assignments_are_collected_by_agents_and_no_reported_address_is_ever_dialled() {
    let dir = tempfile::tempdir().expect("temp dir");
    let registry = registry().await;
    let tracker = start_tracker(dir.path(), &["--cluster-token", TOKEN], &[]).await;
    let agent = start_agent(
        dir.path(),
        "n-pre",
        &registry,
        &[
            "--tracker",
            &tracker.url(),
            "--cluster-token",
            TOKEN,
            "--insecure-plain-http",
        ],
        &[],
    )
    .await;
    let http = reqwest::Client::new();
    let t = tracker.url();

    // The attacker's server, named as the agent URL of a forged node.
    // A forged holder makes the image known; the forged victim holds nothing.
    let (trap, dialled) = counting_listener().await;
    let mut victim = forged_report("victim", 1, 8, 0);
    victim["agent_url"] = serde_json::json!(format!("http://{trap}"));
    for report in [forged_report("holder", 1, 7, 2), victim] {
        let r = http
            .post(format!("{t}/api/v1/reports"))
            .bearer_auth(TOKEN)
            .json(&report)
            .send()
            .await
            .expect("report answered");
        assert!(r.status().is_success(), "forged report: {}", r.status());
    }
    let job: serde_json::Value = http
        .post(format!("{t}/api/v1/prewarm"))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({
            "images": ["registry.test/forged/holder:v7"],
            "targets": {"nodes": ["victim"]},
            "force": true
        }))
        .send()
        .await
        .expect("prewarm answered")
        .json()
        .await
        .expect("prewarm JSON");
    assert!(job["id"].as_u64().is_some(), "prewarm accepted: {job}");

    // The assignment waits at the tracker for "victim" to collect it ...
    let mut waiting = Vec::new();
    for _ in 0..50 {
        let r = http
            .get(format!("{t}/api/v1/assignments?node=victim"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("assignments answered");
        assert_eq!(r.status(), 200);
        waiting = r.json::<Vec<serde_json::Value>>().await.expect("JSON list");
        if !waiting.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        waiting.len(),
        1,
        "the victim's assignment was posted for collection"
    );
    assert!(
        waiting[0].get("agent_url").is_none(),
        "assignments carry no address: {}",
        waiting[0]
    );
    // ... and collecting needs the cluster token.
    let r = http
        .get(format!("{t}/api/v1/assignments?node=victim"))
        .send()
        .await
        .expect("answered");
    assert_eq!(r.status(), 401, "collecting without the token");
    // The tracker never dialled the reported address.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        dialled.load(Ordering::SeqCst),
        0,
        "the tracker connected to an address taken from a report"
    );
    // The agent has no inbound prewarm endpoint to attack.
    let r = http
        .post(format!("{}/api/v1/prewarm", agent.url()))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({}))
        .send()
        .await
        .expect("answered");
    assert!(
        r.status() == 404 || r.status() == 405,
        "the agent still takes pushed assignments: {}",
        r.status()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn print_config_and_logs_never_show_secrets() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        "[registries.\"reg.example.com\"]\nusername = \"puller\"\npassword = \"file-secret-Pw1\"\n",
    )
    .expect("write config");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_starling"))
        .args(["agent", "--config"])
        .arg(&cfg)
        .args([
            "--print-config",
            "--cluster-token",
            "flag-secret-Tok2",
            "--registry-credentials",
            "other.example.com=u2:flag-secret-Pw3",
        ])
        .env("STARLING_LOG", "debug")
        .output()
        .expect("run starling");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    for secret in ["file-secret-Pw1", "flag-secret-Tok2", "flag-secret-Pw3"] {
        assert!(
            !text.contains(secret),
            "--print-config printed the secret {secret}:\n{text}"
        );
    }
    assert!(
        text.contains("puller") && text.contains("redacted"),
        "non-secret keys stay visible and secrets are marked:\n{text}"
    );

    // An agent with credentials and a cluster token, at debug level, after a pull
    // through it with upstream auth: the log does not carry the secrets either.
    let registry = tokio::task::spawn_blocking(|| {
        Registry::start(RegistryAuth::htpasswd("puller", "log-secret-Pw4"))
    })
    .await
    .expect("registry");
    let img = TestImage::push_multilayer(&registry, "priv/img", "v1", &[128 << 10], 32)
        .expect("push image");
    let tracker = start_tracker(dir.path(), &["--cluster-token", "log-secret-Tok5"], &[]).await;
    let agent = start_agent(
        dir.path(),
        "n-secret",
        &registry,
        &[
            "--registry-credentials",
            &format!("{}=puller:log-secret-Pw4", registry.host()),
            "--tracker",
            &tracker.url(),
            "--cluster-token",
            "log-secret-Tok5",
            "--insecure-plain-http",
        ],
        &[("STARLING_LOG", "debug")],
    )
    .await;
    let r = manifest(&format!("{}/v2/priv/img/manifests/v1", agent.url())).await;
    assert_eq!(r.status(), 200);
    let r = reqwest::get(format!(
        "{}/v2/priv/img/blobs/{}",
        agent.url(),
        img.layers[0].digest
    ))
    .await
    .expect("blob answered");
    assert_eq!(r.status(), 200);
    tokio::time::sleep(Duration::from_secs(4)).await;
    for log in [agent.log_text(), tracker.log_text()] {
        for secret in ["log-secret-Pw4", "log-secret-Tok5"] {
            assert!(!log.contains(secret), "a log line carries {secret}");
        }
    }
}

/// Issue 12, tenancy (finding 5): content the agent fetched with its registry
/// credentials is served over `/v2` to this node's own clients only; another host
/// that reaches the mirror port gets 403, unless the operator opted in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_credentialed_mirror_serves_private_content_to_local_clients_only() {
    let dir = tempfile::tempdir().expect("temp dir");
    let registry = tokio::task::spawn_blocking(|| {
        Registry::start(RegistryAuth::htpasswd("puller", "tenant-Pw6"))
    })
    .await
    .expect("registry");
    let img = TestImage::push_multilayer(&registry, "priv/img", "v1", &[64 << 10], 33)
        .expect("push image");
    let other = OtherHost::create(231);
    let start = |name: &'static str, extra: &'static [&'static str]| {
        let port = testkit::free_port();
        let cache = dir.path().join(name);
        let mut a = args(&[
            "agent",
            "--listen",
            &format!("0.0.0.0:{port}"),
            "--cache-dir",
            &cache.display().to_string(),
            "--default-registry",
            &registry.host(),
            "--registry-endpoint",
            &format!("{}={}", registry.host(), registry.url()),
            "--registry-credentials",
            &format!("{}=puller:tenant-Pw6", registry.host()),
            "--min-free",
            "0",
        ]);
        a.extend(args(extra));
        start_with_env(a, &[], port, dir.path().join(format!("{name}.log")), cache)
    };
    let agent = start("n-private", &[]).await;
    let blob = format!("/v2/priv/img/blobs/{}", img.layers[0].digest);
    // The node's own clients: loopback and the node's address.
    let r = reqwest::get(format!("{}{blob}", agent.url()))
        .await
        .expect("local blob");
    assert_eq!(r.status(), 200, "a local client gets the private blob");
    let via_node_ip = format!("http://{}:{}{blob}", other.host_ip, agent.port);
    let r = reqwest::get(&via_node_ip).await.expect("node-address blob");
    assert_eq!(r.status(), 200, "this host through its own address");
    // Another host: refused, although the blob is in the cache.
    assert_eq!(
        other.status(&via_node_ip),
        "403",
        "another host read a private blob"
    );
    let manifest_url = format!(
        "http://{}:{}/v2/priv/img/manifests/v1",
        other.host_ip, agent.port
    );
    assert_eq!(
        other.status(&manifest_url),
        "403",
        "another host read a private manifest"
    );
    // The explicit opt-in serves it.
    let open = start("n-open", &["--mirror-remote-clients"]).await;
    let r = reqwest::get(format!("{}{blob}", open.url()))
        .await
        .expect("local blob");
    assert_eq!(r.status(), 200);
    let open_url = format!("http://{}:{}{blob}", other.host_ip, open.port);
    assert_eq!(
        other.status(&open_url),
        "200",
        "--mirror-remote-clients serves other hosts"
    );
}

/// Issue 12, item 1 (agent routes): the node's own views — metrics, cache, inventory
/// report — answer clients on this host only; a scraper on another host reads metrics
/// on the dedicated `--metrics-listen` port, with the bearer token when one is set, and
/// that port serves nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_node_api_answers_this_host_and_metrics_need_the_scrape_token() {
    let dir = tempfile::tempdir().expect("temp dir");
    let other = OtherHost::create(231);
    let port = testkit::free_port();
    let metrics_port = testkit::free_port();
    let cache = dir.path().join("n-api");
    let agent = start_with_env(
        args(&[
            "agent",
            "--listen",
            &format!("0.0.0.0:{port}"),
            "--cache-dir",
            &cache.display().to_string(),
            "--min-free",
            "0",
            "--metrics-listen",
            &format!("0.0.0.0:{metrics_port}"),
            "--metrics-token",
            "scrape-Tok7",
        ]),
        &[],
        port,
        dir.path().join("n-api.log"),
        cache,
    )
    .await;
    for path in ["/metrics", "/api/v1/cache", "/api/v1/report"] {
        let r = reqwest::get(format!("{}{path}", agent.url()))
            .await
            .expect("local request");
        assert_eq!(r.status(), 200, "{path} for a local client");
        let remote = format!("http://{}:{port}{path}", other.host_ip);
        assert_eq!(
            other.status(&remote),
            "403",
            "{path} served to another host"
        );
    }
    let health = format!("http://{}:{port}/healthz", other.host_ip);
    assert_eq!(other.status(&health), "200", "health checks stay open");

    let scrape = format!("http://{}:{metrics_port}/metrics", other.host_ip);
    assert_eq!(other.status(&scrape), "401", "metrics without the token");
    assert_eq!(
        other.status_with(&scrape, &["Authorization: Bearer wrong-Tok"]),
        "401",
        "metrics with a wrong token"
    );
    assert_eq!(
        other.status_with(&scrape, &["Authorization: Bearer scrape-Tok7"]),
        "200",
        "metrics with the token"
    );
    for path in ["/api/v1/cache", "/api/v1/report", "/v2/"] {
        let url = format!("http://{}:{metrics_port}{path}", other.host_ip);
        assert_eq!(
            other.status_with(&url, &["Authorization: Bearer scrape-Tok7"]),
            "404",
            "the metrics port serves {path}"
        );
    }
}
