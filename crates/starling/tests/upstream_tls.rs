//! Upstream TLS through the real `starling` processes and the real docker-registry
//! serving HTTPS with a throwaway CA: the agent's and the tracker's per-registry TLS
//! flags and environment variables, the system trust store as the default
//! (`SSL_CERT_FILE`), and `skip_verify` logged at warn.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use common::{args, start_tracker, start_with_env, Proc};
use testkit::{PushedImage, Registry, RegistryAuth, RegistryTls, TestCa, TestImage};

async fn tls_registry(ca_name: &'static str, repo: &'static str) -> (Registry, PushedImage) {
    tokio::task::spawn_blocking(move || {
        let ca = TestCa::new(ca_name).expect("CA");
        let reg = Registry::start_tls(RegistryAuth::None, RegistryTls::new(&ca).expect("tls"));
        let img =
            TestImage::push_multilayer(&reg, repo, "v1", &[128 << 10], 21).expect("push over TLS");
        (reg, img)
    })
    .await
    .expect("registry task")
}

/// `starling agent` whose default registry is `reg` (HTTPS), with `extra` flags and
/// `envs`.
async fn agent(
    dir: &std::path::Path,
    name: &str,
    reg: &Registry,
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
        &reg.host(),
        "--registry-endpoint",
        &format!("{}={}", reg.host(), reg.url()),
        "--min-free",
        "0",
    ]);
    a.extend(args(extra));
    start_with_env(a, envs, port, dir.join(format!("{name}.log")), cache).await
}

/// Starling's pull client through the agent (every blob sha256-verified).
async fn pull_via(p: &Proc, img: &PushedImage) -> Result<oci::pull::PullReport, oci::Error> {
    let r = oci::ImageReference::parse(&img.reference).expect("reference");
    let up = oci::Upstream::new(oci::UpstreamConfig {
        endpoints: [(r.registry.clone(), p.url())].into(),
        max_attempts: 1,
        ..Default::default()
    })
    .expect("client");
    oci::pull::pull(&up, &r, &Default::default()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_tls_flags_env_and_system_trust_store() {
    let dir = tempfile::tempdir().expect("dir");
    let (reg, img) = tls_registry("agent-process", "proc/app").await;
    let ca = reg.ca_file().expect("CA file").display().to_string();
    let host = reg.host();

    // --registry-ca
    let a = agent(
        dir.path(),
        "ca-flag",
        &reg,
        &["--registry-ca", &format!("{host}={ca}")],
        &[],
    )
    .await;
    let report = pull_via(&a, &img).await.expect("pull with --registry-ca");
    assert_eq!(report.manifest_digest.to_string(), img.digest);
    drop(a);

    // STARLING_REGISTRY_CA
    let a = agent(
        dir.path(),
        "ca-env",
        &reg,
        &[],
        &[("STARLING_REGISTRY_CA", &format!("{host}={ca}"))],
    )
    .await;
    pull_via(&a, &img)
        .await
        .expect("pull with STARLING_REGISTRY_CA");
    drop(a);

    // No per-registry setting, the CA in the system trust store (SSL_CERT_FILE is
    // where rustls-native-certs, like OpenSSL, looks first; SSL_CERT_DIR emptied so
    // that file is the whole store): trusted by default.
    let a = agent(
        dir.path(),
        "system",
        &reg,
        &[],
        &[("SSL_CERT_FILE", &ca), ("SSL_CERT_DIR", "")],
    )
    .await;
    pull_via(&a, &img)
        .await
        .expect("pull trusting the system store");
    drop(a);

    // Neither, and an empty system store: the bundled roots are the fallback (logged),
    // the private CA is not among them, and the log says which registry and why.
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "").expect("write");
    let a = agent(
        dir.path(),
        "none",
        &reg,
        &[],
        &[
            ("SSL_CERT_FILE", &empty.display().to_string()),
            ("SSL_CERT_DIR", ""),
        ],
    )
    .await;
    let e = pull_via(&a, &img).await.expect_err("untrusted");
    assert!(e.to_string().contains("not trusted"), "{e}");
    let log = a.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("falling back to the bundled Mozilla roots")),
        "{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("upstream TLS failure") && l.contains(&host)),
        "{log}"
    );
    drop(a);

    // --registry-skip-verify: works, and start-up says loudly that it is dangerous.
    let a = agent(
        dir.path(),
        "skip",
        &reg,
        &["--registry-skip-verify", &host],
        &[],
    )
    .await;
    pull_via(&a, &img).await.expect("pull with skip_verify");
    let log = a.log_text();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("skip_verify")
            && l.contains("NOT verified")
            && l.contains(&host)),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn print_config_shows_tls_settings_and_bad_ones_stop_the_agent() {
    let dir = tempfile::tempdir().expect("dir");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_starling"))
        .args([
            "agent",
            "--cache-dir",
            &dir.path().display().to_string(),
            "--registry-ca",
            "reg.corp.example=/etc/starling/corp-ca.pem",
            "--registry-client-cert",
            "reg.corp.example=/etc/starling/node.crt",
            "--registry-client-key",
            "reg.corp.example=/etc/starling/node.key",
            "--registry-skip-verify",
            "lab.example",
            "--registry-credentials",
            "reg.corp.example=u:pw-SECRET",
            "--print-config",
        ])
        .output()
        .expect("print-config");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let v: toml::Value = toml::from_str(&text).expect("printed TOML");
    let r = &v["registries"]["reg.corp.example"];
    assert_eq!(r["ca_file"].as_str(), Some("/etc/starling/corp-ca.pem"));
    assert_eq!(r["client_key"].as_str(), Some("/etc/starling/node.key"));
    assert_eq!(
        v["registries"]["lab.example"]["skip_verify"].as_bool(),
        Some(true)
    );
    assert!(!text.contains("SECRET"), "{text}");

    // A CA file that does not exist: the agent refuses to start and says which.
    let port = testkit::free_port();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_starling"))
        .args([
            "agent",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--cache-dir",
            &dir.path().display().to_string(),
            "--registry-ca",
            "reg.corp.example=/nonexistent/ca.pem",
        ])
        .output()
        .expect("agent");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("reg.corp.example") && err.contains("/nonexistent/ca.pem"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tracker_catalog_resolves_tags_over_https_with_registry_ca() {
    let dir = tempfile::tempdir().expect("dir");
    let (reg, img) = tls_registry("tracker", "prewarm/app").await;
    let host = reg.host();
    let ca = reg.ca_file().expect("CA file").display().to_string();
    let endpoint = format!("{host}={}", reg.url());
    let where_url = |t: &Proc| format!("{}/api/v1/where?image={host}/prewarm/app:v1", t.url());

    let with_dir = dir.path().join("with");
    std::fs::create_dir_all(&with_dir).expect("dir");
    let t = start_tracker(
        &with_dir,
        &[
            "--registry-endpoint",
            &endpoint,
            "--registry-ca",
            &format!("{host}={ca}"),
        ],
        &[],
    )
    .await;
    let r = reqwest::get(where_url(&t)).await.expect("where");
    let status = r.status();
    let body: serde_json::Value = r.json().await.expect("JSON");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["manifest_digest"].as_str(), Some(img.digest.as_str()));
    drop(t);

    // The same through STARLING_TRACKER_REGISTRY_SKIP_VERIFY.
    let skip_dir = dir.path().join("skip");
    std::fs::create_dir_all(&skip_dir).expect("dir");
    let t = start_tracker(
        &skip_dir,
        &["--registry-endpoint", &endpoint],
        &[("STARLING_TRACKER_REGISTRY_SKIP_VERIFY", &host)],
    )
    .await;
    let r = reqwest::get(where_url(&t)).await.expect("where");
    assert_eq!(r.status(), 200);
    assert!(t
        .log_text()
        .lines()
        .any(|l| l.contains("WARN") && l.contains("skip_verify")));
    drop(t);

    // Without: the image is unknown to the tracker and its log says why.
    let without_dir = dir.path().join("without");
    std::fs::create_dir_all(&without_dir).expect("dir");
    let t = start_tracker(&without_dir, &["--registry-endpoint", &endpoint], &[]).await;
    let r = reqwest::get(where_url(&t)).await.expect("where");
    assert_eq!(r.status(), 404);
    let log = t.log_text();
    assert!(log.contains("not trusted") && log.contains(&host), "{log}");
}
