//! containerd pulls (through hosts.toml) from a real registry.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use testkit::{write_hosts_toml, Containerd, Registry, RegistryAuth, TestImage};

#[test]
fn containerd_pulls_multilayer_via_hosts_dir() {
    let reg = Registry::start(RegistryAuth::None);
    let img = TestImage::push_multilayer(&reg, "lib/app", "v1", &[1 << 20, 2 << 20, 4096], 11)
        .expect("push");
    let ctd = Containerd::start();
    let hosts = tempfile::tempdir().expect("tempdir");
    let path =
        write_hosts_toml(hosts.path(), &reg.host(), &reg.url(), &reg.url()).expect("hosts.toml");
    assert!(path.ends_with(format!("{}/hosts.toml", reg.host())));
    ctd.pull(&img.reference, hosts.path(), &[])
        .expect("ctr pull");
    assert_eq!(
        ctd.image_digest(&img.reference).expect("digest"),
        img.digest
    );
    let check = ctd.check().expect("check");
    assert!(check.contains("complete"), "{check}");
    assert_eq!(ctd.images().expect("images"), vec![img.reference.clone()]);
}

#[test]
fn containerd_pull_fails_when_registry_down_and_mirror_is_used() {
    // Mirror = the registry, server = a dead port: pulling must still work,
    // proving containerd goes to the [host] entry first.
    let mut reg = Registry::start(RegistryAuth::None);
    let img = TestImage::push_multilayer(&reg, "m/app", "1", &[256 << 10], 12).expect("push");
    let dead = format!("http://127.0.0.1:{}", testkit::free_port());
    let hosts = tempfile::tempdir().expect("tempdir");
    write_hosts_toml(hosts.path(), &reg.host(), &reg.url(), &dead).expect("hosts.toml");
    let ctd = Containerd::start();
    ctd.pull(&img.reference, hosts.path(), &[])
        .expect("pull via mirror");
    assert_eq!(
        ctd.image_digest(&img.reference).expect("digest"),
        img.digest
    );

    // With the registry stopped a fresh containerd cannot pull.
    reg.stop();
    let fresh = Containerd::start();
    let out = fresh
        .pull_output(&img.reference, hosts.path(), &[])
        .expect("spawn ctr");
    assert!(!out.status.success(), "pull succeeded with registry down");
    assert!(fresh.pull(&img.reference, hosts.path(), &[]).is_err());
}

#[test]
fn containerd_pulls_index_with_token_auth() {
    let reg = Registry::start(RegistryAuth::token("u", "p", false));
    let idx = TestImage::push_multiplatform_index(&reg, "multi/app", "v1").expect("push index");
    let hosts = tempfile::tempdir().expect("tempdir");
    write_hosts_toml(hosts.path(), &reg.host(), &reg.url(), &reg.url()).expect("hosts.toml");
    let ctd = Containerd::start();
    let before = reg.token_requests();
    ctd.pull(
        &idx.reference,
        hosts.path(),
        &["--user", "u:p", "--platform", "linux/arm64"],
    )
    .expect("pull index");
    assert!(
        reg.token_requests() > before,
        "containerd did not use the token server"
    );
    assert_eq!(
        ctd.image_digest(&idx.reference).expect("digest"),
        idx.digest
    );

    let bad = ctd
        .pull_output(&idx.reference, hosts.path(), &["--user", "u:wrong"])
        .expect("spawn");
    assert!(!bad.status.success(), "pull with wrong creds succeeded");
}

#[test]
fn containerd_honours_hosts_toml() {
    // Note: for 127.0.0.1 containerd 1.6 already falls back to plain http
    // without any hosts.toml, so pulling "works" either way. To prove the
    // hosts.toml is read, point both mirror and server at dead ports: the
    // pull must fail although the registry named in the reference is up.
    let reg = Registry::start(RegistryAuth::None);
    let img = TestImage::push_multilayer(&reg, "a/b", "1", &[4096], 13).expect("push");
    let ctd = Containerd::start();
    let empty = tempfile::tempdir().expect("tempdir");
    ctd.pull(&img.reference, empty.path(), &[])
        .expect("pull without hosts.toml (localhost => http)");
    ctd.remove_image(&img.reference).expect("rm");

    let dead1 = format!("http://127.0.0.1:{}", testkit::free_port());
    let dead2 = format!("http://127.0.0.1:{}", testkit::free_port());
    let hosts = tempfile::tempdir().expect("tempdir");
    write_hosts_toml(hosts.path(), &reg.host(), &dead1, &dead2).expect("hosts.toml");
    let fresh = Containerd::start();
    let err = fresh
        .pull(&img.reference, hosts.path(), &[])
        .expect_err("pull via dead hosts succeeded");
    assert!(format!("{err:#}").contains("connection refused"), "{err:#}");
    assert!(fresh.images().expect("images").is_empty());
}
