//! The real docker-registry over HTTPS with a throwaway CA, with and without
//! required client certificates.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use testkit::{skopeo, Registry, RegistryAuth, RegistryTls, TestCa, TestImage};

/// `skopeo inspect --raw` of `reference` with `args` (TLS options).
fn inspect(reference: &str, args: &[&str]) -> std::process::Output {
    let src = format!("docker://{reference}");
    let mut a = vec!["inspect", "--raw", "--retry-times", "0"];
    a.extend_from_slice(args);
    a.push(&src);
    skopeo(&a).expect("spawn skopeo")
}

#[test]
fn https_registry_serves_with_the_test_ca_and_refuses_strangers() {
    let ca = TestCa::new("tls-registry").expect("CA");
    let reg = Registry::start_tls(RegistryAuth::None, RegistryTls::new(&ca).expect("tls"));
    assert!(reg.url().starts_with("https://127.0.0.1:"), "{}", reg.url());
    let img = TestImage::push_multilayer(&reg, "tls/app", "v1", &[64 << 10], 3).expect("push");
    let (_, digest, _) = reg
        .fetch_manifest("tls/app", "v1")
        .expect("manifest over TLS");
    assert_eq!(digest, img.digest);

    let cert_dir = reg.cert_dir().expect("cert dir");
    let cert_dir = cert_dir.display().to_string();
    let ok = inspect(&img.reference, &["--cert-dir", &cert_dir]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    // A client that does not trust the test CA is refused by its own verification.
    let other = tempfile::tempdir().expect("dir");
    let stranger = inspect(
        &img.reference,
        &["--cert-dir", &other.path().display().to_string()],
    );
    assert!(!stranger.status.success());
    let err = String::from_utf8_lossy(&stranger.stderr);
    assert!(err.contains("certificate"), "{err}");
}

#[test]
fn https_registry_can_require_client_certificates() {
    let ca = TestCa::new("server").expect("CA");
    let clients = TestCa::new("clients").expect("client CA");
    let tls = RegistryTls::new(&ca)
        .expect("tls")
        .require_client_certs(&clients)
        .expect("client certs");
    let reg = Registry::start_tls(RegistryAuth::None, tls);
    // testkit itself presents its client certificate: push and fetch work.
    let img = TestImage::push_multilayer(&reg, "mtls/app", "v1", &[32 << 10], 4).expect("push");
    let with = inspect(
        &img.reference,
        &[
            "--cert-dir",
            &reg.cert_dir().expect("dir").display().to_string(),
        ],
    );
    assert!(
        with.status.success(),
        "{}",
        String::from_utf8_lossy(&with.stderr)
    );
    // Trusting the server but without a client certificate: refused.
    let only_ca = tempfile::tempdir().expect("dir");
    std::fs::copy(reg.ca_file().expect("ca"), only_ca.path().join("ca.crt")).expect("copy");
    let without = inspect(
        &img.reference,
        &["--cert-dir", &only_ca.path().display().to_string()],
    );
    assert!(
        !without.status.success(),
        "pulled without a client certificate"
    );
}
