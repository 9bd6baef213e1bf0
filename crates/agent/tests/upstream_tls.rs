//! Upstream TLS against the real docker-registry serving HTTPS with a certificate from
//! a throwaway CA (and, in one test, requiring client certificates): per-registry
//! `ca_file`, `client_cert`/`client_key` and `skip_verify`, errors that say what is
//! wrong, and settings that never leak to another registry.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::path::PathBuf;

use agent::config::RegistryConfig;
use common::{blocking, get, start_agent, RunningAgent};
use testkit::{skopeo_ok, PushedImage, Registry, RegistryAuth, RegistryTls, TestCa, TestImage};

/// A TLS registry with one pushed image.
async fn tls_registry(tls: RegistryTls, repo: &'static str, seed: u64) -> (Registry, PushedImage) {
    blocking(move || {
        let reg = Registry::start_tls(RegistryAuth::None, tls);
        let img = TestImage::push_multilayer(&reg, repo, "v1", &[256 << 10, 64 << 10], seed)
            .expect("push over TLS");
        (reg, img)
    })
    .await
}

/// An agent whose default registry is `reg`, with `tls` applied to its settings.
async fn agent_for(
    cache: &std::path::Path,
    reg: &Registry,
    tls: impl FnOnce(&mut RegistryConfig),
) -> RunningAgent {
    let host = reg.host();
    start_agent(cache, &reg.host(), &reg.url(), None, move |c| {
        tls(c.registries.get_mut(&host).expect("registry entry"))
    })
    .await
}

/// Starling's own pull client through the agent: every blob is sha256-verified.
async fn pull_via(
    agent: &RunningAgent,
    img: &PushedImage,
) -> Result<oci::pull::PullReport, oci::Error> {
    let r = oci::ImageReference::parse(&img.reference).expect("reference");
    let up = oci::Upstream::new(oci::UpstreamConfig {
        endpoints: [(r.registry.clone(), agent.url())].into(),
        ..Default::default()
    })
    .expect("client");
    oci::pull::pull(&up, &r, &Default::default()).await
}

fn assert_pulled(report: &oci::pull::PullReport, img: &PushedImage) {
    assert_eq!(report.manifest_digest.to_string(), img.digest);
    let mut got: Vec<String> = report.blobs.iter().map(|b| b.digest.to_string()).collect();
    let mut want: Vec<String> = img.layers.iter().map(|l| l.digest.clone()).collect();
    want.push(img.config.digest.clone());
    got.sort();
    want.sort();
    assert_eq!(got, want, "every blob pulled and verified");
}

/// The OCI error body of a failed agent request: (status, code, message).
async fn agent_error(agent: &RunningAgent, path_and_query: &str) -> (u16, String, String) {
    let resp = get(&format!("{}{path_and_query}", agent.url()), &[]).await;
    let status = resp.status().as_u16();
    let body: serde_json::Value = resp.json().await.expect("OCI error body");
    (
        status,
        body["errors"][0]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        body["errors"][0]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ca_file_pulls_over_https_and_without_it_the_error_names_registry_and_certificate() {
    let ca = TestCa::new("private").expect("CA");
    let (reg, img) = tls_registry(RegistryTls::new(&ca).expect("tls"), "corp/train", 11).await;
    let ca_file: PathBuf = reg.ca_file().expect("CA file");

    // With ca_file: Starling's pull client and skopeo both get verified content.
    let cache = tempfile::tempdir().expect("dir");
    let with = agent_for(cache.path(), &reg, |r| r.ca_file = Some(ca_file.clone())).await;
    let report = pull_via(&with, &img)
        .await
        .expect("pull through the agent over HTTPS");
    assert_pulled(&report, &img);
    let out = tempfile::tempdir().expect("dir");
    let src = format!("docker://{}/corp/train:v1", with.addr);
    let dst = format!("dir:{}", out.path().join("img").display());
    blocking(move || {
        skopeo_ok(&[
            "copy",
            "--src-tls-verify=false",
            "--preserve-digests",
            &src,
            &dst,
        ])
        .map(|_| ())
    })
    .await
    .expect("skopeo through the agent");
    let manifest = std::fs::read(out.path().join("img/manifest.json")).expect("manifest");
    assert_eq!(testkit::sha256_digest(&manifest), img.digest);
    with.stop().await;

    // Without: a 502 that says which registry and that its certificate is not trusted.
    let cache = tempfile::tempdir().expect("dir");
    let without = agent_for(cache.path(), &reg, |_| {}).await;
    let e = pull_via(&without, &img)
        .await
        .expect_err("untrusted certificate");
    let msg = e.to_string();
    eprintln!("without ca_file: {msg}");
    assert!(
        matches!(e, oci::Error::Upstream { status: 502, .. }),
        "{e:?}"
    );
    for want in [reg.host().as_str(), "certificate", "not trusted", "ca_file"] {
        assert!(msg.contains(want), "{want:?} missing from: {msg}");
    }
    // A blob too, straight from the agent's HTTP API.
    let (status, code, message) = agent_error(
        &without,
        &format!("/v2/corp/train/blobs/{}", img.layers[0].digest),
    )
    .await;
    assert_eq!((status, code.as_str()), (502, "UNAVAILABLE"), "{message}");
    assert!(
        message.contains("TLS") && message.contains("certificate") && message.contains(&reg.host()),
        "{message}"
    );
    without.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn skip_verify_pulls_from_a_registry_nobody_trusts() {
    let ca = TestCa::new("unknown").expect("CA");
    let (reg, img) = tls_registry(RegistryTls::new(&ca).expect("tls"), "lab/x", 12).await;
    let cache = tempfile::tempdir().expect("dir");
    let agent = agent_for(cache.path(), &reg, |r| r.skip_verify = true).await;
    let report = pull_via(&agent, &img).await.expect("pull with skip_verify");
    assert_pulled(&report, &img);
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registry_requiring_client_certificates_takes_client_cert_and_refuses_without() {
    let ca = TestCa::new("server").expect("CA");
    let clients = TestCa::new("clients").expect("client CA");
    let tls = RegistryTls::new(&ca)
        .expect("tls")
        .require_client_certs(&clients)
        .expect("client certs");
    let (reg, img) = tls_registry(tls, "mtls/app", 13).await;
    let ca_file = reg.ca_file().expect("CA file");
    let keys = tempfile::tempdir().expect("dir");
    let (cert, key) = clients
        .client_cert("node-1")
        .expect("client cert")
        .write(keys.path(), "node-1")
        .expect("write");

    let cache = tempfile::tempdir().expect("dir");
    let with = agent_for(cache.path(), &reg, |r| {
        r.ca_file = Some(ca_file.clone());
        r.client_cert = Some(cert.clone());
        r.client_key = Some(key.clone());
    })
    .await;
    let report = pull_via(&with, &img)
        .await
        .expect("pull with a client certificate");
    assert_pulled(&report, &img);
    with.stop().await;

    // Server trusted, no client certificate: refused, and the error says what to set.
    let cache = tempfile::tempdir().expect("dir");
    let without = agent_for(cache.path(), &reg, |r| r.ca_file = Some(ca_file.clone())).await;
    let e = pull_via(&without, &img)
        .await
        .expect_err("no client certificate");
    let msg = e.to_string();
    eprintln!("without a client certificate: {msg}");
    assert!(
        matches!(e, oci::Error::Upstream { status: 502, .. }),
        "{e:?}"
    );
    assert!(
        msg.contains(&reg.host())
            && msg.contains("client certificate")
            && msg.contains("client_cert"),
        "{msg}"
    );
    without.stop().await;

    // A client certificate from a CA the registry does not accept: refused too.
    let stranger = TestCa::new("stranger").expect("CA");
    let (scert, skey) = stranger
        .client_cert("node-x")
        .expect("cert")
        .write(keys.path(), "stranger")
        .expect("write");
    let cache = tempfile::tempdir().expect("dir");
    let wrong = agent_for(cache.path(), &reg, |r| {
        r.ca_file = Some(ca_file.clone());
        r.client_cert = Some(scert);
        r.client_key = Some(skey);
    })
    .await;
    let e = pull_via(&wrong, &img)
        .await
        .expect_err("foreign client certificate");
    eprintln!("with a foreign client certificate: {e}");
    assert!(e.to_string().contains("client certificate"), "{e}");
    wrong.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_ca_configured_for_one_registry_is_not_trusted_for_another() {
    // Both registries have certificates from the same CA; only A is told about it.
    let ca = TestCa::new("shared").expect("CA");
    let (a, img_a) = tls_registry(RegistryTls::new(&ca).expect("tls"), "team/a", 14).await;
    let (b, img_b) = tls_registry(RegistryTls::new(&ca).expect("tls"), "team/b", 15).await;
    let ca_file = a.ca_file().expect("CA file");
    let cache = tempfile::tempdir().expect("dir");
    let (b_host, b_url) = (b.host(), b.url());
    let agent = start_agent(cache.path(), &a.host(), &a.url(), None, move |c| {
        let a_host = c.default_registry.clone();
        c.registries.get_mut(&a_host).expect("A").ca_file = Some(ca_file);
        c.registries.insert(
            b_host,
            RegistryConfig {
                endpoint: Some(b_url),
                ..Default::default()
            },
        );
    })
    .await;
    let report = pull_via(&agent, &img_a).await.expect("A is trusted");
    assert_pulled(&report, &img_a);
    let (status, _, message) =
        agent_error(&agent, &format!("/v2/team/b/manifests/v1?ns={}", b.host())).await;
    assert_eq!(status, 502, "{message}");
    assert!(
        message.contains(&b.host()) && message.contains("not trusted"),
        "{message}"
    );
    assert!(!message.contains(&a.host()), "{message}");
    // And B's content never arrived.
    let (status, _, _) = agent_error(
        &agent,
        &format!(
            "/v2/team/b/blobs/{}?ns={}",
            img_b.layers[0].digest,
            b.host()
        ),
    )
    .await;
    assert_eq!(status, 502);
    agent.stop().await;
}
