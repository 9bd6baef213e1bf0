//! Registry + token server + image builders against the real programs.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use std::time::Duration;

use testkit::{
    http_get, random_bytes, sha256_digest, skopeo, skopeo_ok, wait_http_ok, ManifestFormat,
    Registry, RegistryAuth, TestImage,
};

const MIB: usize = 1 << 20;

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `skopeo copy` from the registry into a local OCI layout (a real pull of
/// manifest, config and every layer blob).
fn skopeo_pull(reference: &str, creds: Option<&str>) -> std::process::Output {
    let dir = tempfile::tempdir().expect("tempdir");
    let dst = format!("oci:{}:pulled", dir.path().join("out").display());
    let src = format!("docker://{reference}");
    let mut args = vec!["copy", "--src-tls-verify=false"];
    if let Some(c) = creds {
        args.push("--src-creds");
        args.push(c);
    }
    args.push(&src);
    args.push(&dst);
    skopeo(&args).expect("spawn skopeo")
}

#[test]
fn anonymous_registry_push_stop_restart_keeps_data() {
    let mut reg = Registry::start(RegistryAuth::None);
    wait_http_ok(&format!("{}/v2/", reg.url()), Duration::from_secs(5)).expect("v2 ok");
    assert_eq!(reg.url(), format!("http://{}", reg.host()));

    let img = TestImage::push_multilayer(&reg, "team/app", "v1", &[MIB, 2 * MIB, 64 << 10], 1)
        .expect("push multilayer");
    assert_eq!(img.layers.len(), 3);
    assert_eq!(img.media_type, "application/vnd.oci.image.manifest.v1+json");
    assert_eq!(img.digest, sha256_digest(&img.raw_manifest));
    assert_eq!(img.platform.architecture, "amd64");
    // Random data is incompressible: gzip layers are not smaller than the input.
    assert!(img.layers[1].size >= 2 * MIB as u64, "{:?}", img.layers);
    let distinct: std::collections::HashSet<_> = img.layers.iter().map(|l| &l.digest).collect();
    assert_eq!(distinct.len(), 3);
    // The registry's own view of the manifest digest matches.
    let (_, digest, _) = reg.fetch_manifest("team/app", "v1").expect("fetch");
    assert_eq!(digest, img.digest);
    assert!(reg
        .data_dir()
        .join("docker/registry/v2/repositories/team/app")
        .is_dir());

    reg.stop();
    assert!(
        http_get(&format!("{}/v2/", reg.url()), &[]).is_err(),
        "registry still answering after stop"
    );
    let port = reg.port();
    reg.restart();
    assert_eq!(reg.port(), port);
    let (_, digest, _) = reg
        .fetch_manifest("team/app", "v1")
        .expect("fetch after restart");
    assert_eq!(digest, img.digest);
    let out = skopeo_pull(&img.reference, None);
    assert!(
        out.status.success(),
        "pull after restart failed: {}",
        stderr(&out)
    );
}

#[test]
fn docker_v2s2_format() {
    let reg = Registry::start(RegistryAuth::None);
    let img = TestImage::push_multilayer_format(
        &reg,
        "d/img",
        "t",
        &[MIB, MIB],
        2,
        ManifestFormat::DockerV2S2,
    )
    .expect("push v2s2");
    assert_eq!(
        img.media_type,
        "application/vnd.docker.distribution.manifest.v2+json"
    );
    assert_eq!(
        img.config.media_type,
        "application/vnd.docker.container.image.v1+json"
    );
    assert!(img
        .layers
        .iter()
        .all(|l| l.media_type == "application/vnd.docker.image.rootfs.diff.tar.gzip"));
    let raw = skopeo_ok(&[
        "inspect",
        "--raw",
        "--tls-verify=false",
        &format!("docker://{}", img.reference),
    ])
    .expect("inspect");
    assert_eq!(raw.stdout, img.raw_manifest);
}

#[test]
fn htpasswd_push_pull_and_bad_creds() {
    let reg = Registry::start(RegistryAuth::htpasswd("alice", "s3cret"));
    assert_eq!(
        http_get(&format!("{}/v2/", reg.url()), &[])
            .expect("get")
            .status,
        401
    );
    let img =
        TestImage::push_multilayer(&reg, "priv/img", "1", &[MIB], 3).expect("push with creds");
    let ok = skopeo_pull(&img.reference, Some("alice:s3cret"));
    assert!(
        ok.status.success(),
        "authenticated pull failed: {}",
        stderr(&ok)
    );
    let bad = skopeo_pull(&img.reference, Some("alice:wrong"));
    assert!(!bad.status.success(), "pull with wrong password succeeded");
    let anon = skopeo_pull(&img.reference, None);
    assert!(
        !anon.status.success(),
        "anonymous pull succeeded on htpasswd registry"
    );
    assert_eq!(reg.token_requests(), 0);
}

#[test]
fn token_auth_push_pull_with_real_registry() {
    let reg = Registry::start(RegistryAuth::token("bob", "hunter2", false));
    let ts = reg.token_server().expect("token server");
    let img = TestImage::push_multilayer(&reg, "secure/app", "latest", &[MIB, 512 << 10], 4)
        .expect("push through token auth");
    let after_push = reg.token_requests();
    assert!(after_push > 0, "push did not use the token server");

    let ok = skopeo_pull(&img.reference, Some("bob:hunter2"));
    assert!(ok.status.success(), "token pull failed: {}", stderr(&ok));
    assert!(reg.token_requests() > after_push);
    assert!(
        ts.requested_scopes()
            .iter()
            .any(|s| s == "repository:secure/app:pull"),
        "{:?}",
        ts.requested_scopes()
    );

    let denied_before = ts.denied();
    let bad = skopeo_pull(&img.reference, Some("bob:nope"));
    assert!(!bad.status.success(), "pull with wrong creds succeeded");
    assert!(ts.denied() > denied_before);
    let anon = skopeo_pull(&img.reference, None);
    assert!(
        !anon.status.success(),
        "anonymous pull succeeded though allow_anonymous=false"
    );

    // Wrong credentials also fail for push.
    let dir = tempfile::tempdir().expect("tempdir");
    let layout = format!("oci:{}:x", dir.path().join("l").display());
    let pulled = skopeo(&[
        "copy",
        "--src-tls-verify=false",
        "--src-creds",
        "bob:hunter2",
        &format!("docker://{}", img.reference),
        &layout,
    ])
    .expect("spawn");
    assert!(pulled.status.success(), "{}", stderr(&pulled));
    let push_bad = skopeo(&[
        "copy",
        "--dest-tls-verify=false",
        "--dest-creds",
        "bob:bad",
        &layout,
        &format!("docker://{}/secure/other:x", reg.host()),
    ])
    .expect("spawn");
    assert!(
        !push_bad.status.success(),
        "push with wrong creds succeeded"
    );

    // The token endpoint itself: 401 on bad creds, JSON token on good ones.
    let q = format!(
        "{}?service={}&scope=repository:secure/app:pull",
        ts.realm(),
        ts.service()
    );
    use base64::Engine;
    let good = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("bob:hunter2")
    );
    let wrong = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("bob:x")
    );
    assert_eq!(
        http_get(&q, &[("Authorization", &wrong)])
            .expect("get")
            .status,
        401
    );
    assert_eq!(http_get(&q, &[]).expect("get").status, 401);
    let r = http_get(&q, &[("Authorization", &good)]).expect("get");
    assert_eq!(r.status, 200);
    let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(v["expires_in"], 300);
    assert_eq!(v["token"], v["access_token"]);
    assert_eq!(v["token"].as_str().expect("token").split('.').count(), 3);
}

#[test]
fn token_auth_anonymous_pull_only() {
    let reg = Registry::start(RegistryAuth::token("carol", "pw", true));
    let img = TestImage::push_multilayer(&reg, "pub/app", "1", &[256 << 10], 5).expect("push");
    let anon = skopeo_pull(&img.reference, None);
    assert!(
        anon.status.success(),
        "anonymous pull refused: {}",
        stderr(&anon)
    );

    // Anonymous push gets a pull-only token and must be rejected by the registry.
    let dir = tempfile::tempdir().expect("tempdir");
    let layout = format!("oci:{}:x", dir.path().join("l").display());
    let pulled = skopeo(&[
        "copy",
        "--src-tls-verify=false",
        &format!("docker://{}", img.reference),
        &layout,
    ])
    .expect("spawn");
    assert!(pulled.status.success(), "{}", stderr(&pulled));
    let push = skopeo(&[
        "copy",
        "--dest-tls-verify=false",
        &layout,
        &format!("docker://{}/pub/anon:x", reg.host()),
    ])
    .expect("spawn");
    assert!(!push.status.success(), "anonymous push succeeded");
}

#[test]
fn token_expiry_is_configurable() {
    let reg = Registry::start(RegistryAuth::token("u", "p", true));
    let ts = reg.token_server().expect("token server");
    ts.set_expires_in(7);
    let r = http_get(
        &format!(
            "{}?service={}&scope=repository:a:pull",
            ts.realm(),
            ts.service()
        ),
        &[],
    )
    .expect("get");
    let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(v["expires_in"], 7);
    assert_eq!(ts.requests(), 1);
}

#[test]
fn multiplatform_index() {
    let reg = Registry::start(RegistryAuth::token("u", "p", false));
    let idx = TestImage::push_multiplatform_index(&reg, "multi/app", "v1").expect("push index");
    assert_eq!(idx.media_type, "application/vnd.oci.image.index.v1+json");
    let raw = skopeo_ok(&[
        "inspect",
        "--raw",
        "--tls-verify=false",
        "--creds",
        "u:p",
        &format!("docker://{}", idx.reference),
    ])
    .expect("inspect");
    assert_eq!(raw.stdout, idx.raw_manifest);
    assert_eq!(sha256_digest(&raw.stdout), idx.digest);
    let v: serde_json::Value = serde_json::from_slice(&raw.stdout).expect("json");
    let list = v["manifests"].as_array().expect("manifests");
    assert_eq!(list.len(), 2);
    let arches: Vec<_> = list
        .iter()
        .map(|m| m["platform"]["architecture"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(arches, ["amd64", "arm64"]);
    let amd = idx.for_arch("amd64").expect("amd64");
    let arm = idx.for_arch("arm64").expect("arm64");
    assert_ne!(amd.digest, arm.digest);
    assert_eq!(amd.platform.os, "linux");
    for l in &amd.layers {
        assert!(
            !arm.layers.iter().any(|a| a.digest == l.digest),
            "layer shared between platforms"
        );
    }
}

#[test]
fn utilities() {
    assert_eq!(random_bytes(1000, 9), random_bytes(1000, 9));
    assert_ne!(random_bytes(1000, 9), random_bytes(1000, 10));
    assert_eq!(
        testkit::sha256_hex(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    let p = testkit::free_port();
    assert!(std::net::TcpListener::bind(("127.0.0.1", p)).is_ok());
    let err = wait_http_ok(
        &format!("http://127.0.0.1:{p}/"),
        Duration::from_millis(300),
    )
    .expect_err("nothing listens there");
    assert!(err.to_string().contains("not ready"), "{err}");
}

#[test]
fn registry_verifies_token_signatures() {
    let a = Registry::start(RegistryAuth::token("u", "p", false));
    let b = Registry::start(RegistryAuth::token("u", "p", false));
    TestImage::push_multilayer(&b, "r/x", "1", &[4096], 6).expect("push");
    let accept = "application/vnd.oci.image.manifest.v1+json";
    let get = |tok: &str| {
        let auth = format!("Bearer {tok}");
        b.http_get(
            "/v2/r/x/manifests/1",
            &[("Accept", accept), ("Authorization", &auth)],
        )
        .expect("get")
        .status
    };
    let good = b
        .token_server()
        .expect("ts")
        .issue("u", &["repository:r/x:pull"])
        .expect("issue");
    assert_eq!(get(&good), 200);
    // Same claims, signed by another server's key: rejected.
    let foreign = a
        .token_server()
        .expect("ts")
        .issue("u", &["repository:r/x:pull"])
        .expect("issue");
    assert_eq!(get(&foreign), 401);
    // Right key, wrong repository in the access claim: rejected.
    let other = b
        .token_server()
        .expect("ts")
        .issue("u", &["repository:r/y:pull"])
        .expect("issue");
    assert_eq!(get(&other), 401);
    // Tampered signature: rejected.
    // (Flip a character in the middle of the signature: the last base64url
    // character of a 64-byte signature carries padding bits a decoder may ignore.)
    let sig_start = good.rfind('.').expect("jwt") + 1;
    let pos = sig_start + 20;
    let c = &good[pos..pos + 1];
    let tampered = format!(
        "{}{}{}",
        &good[..pos],
        if c == "A" { "B" } else { "A" },
        &good[pos + 1..]
    );
    assert_eq!(get(&tampered), 401);
}
