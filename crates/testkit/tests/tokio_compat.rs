//! The blocking helpers must be usable (and droppable) inside tokio tests.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use testkit::{Containerd, Registry, RegistryAuth, TestImage};

#[tokio::test]
async fn usable_from_current_thread_runtime() {
    let reg = Registry::start(RegistryAuth::token("u", "p", false));
    let img = TestImage::push_multilayer(&reg, "t/a", "1", &[8192], 21).expect("push");
    assert!(reg.token_requests() > 0);
    assert_eq!(img.layers.len(), 1);
    drop(reg); // joins the token server thread: must not panic inside a runtime
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usable_from_multi_thread_runtime() {
    let reg = Registry::start(RegistryAuth::None);
    let img = TestImage::push_multilayer(&reg, "t/b", "1", &[8192], 22).expect("push");
    let hosts = tempfile::tempdir().expect("tempdir");
    testkit::write_hosts_toml(hosts.path(), &reg.host(), &reg.url(), &reg.url()).expect("hosts");
    let ctd = Containerd::start();
    ctd.pull(&img.reference, hosts.path(), &[]).expect("pull");
    // The registry can be reached from async code too.
    let body = tokio::task::spawn_blocking(move || {
        reg.http_get("/v2/t/b/tags/list", &[]).expect("get").body
    })
    .await
    .expect("join");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).expect("json")["tags"][0],
        "1"
    );
}
