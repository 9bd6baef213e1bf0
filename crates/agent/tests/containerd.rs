//! Real containerd pulls through the agent; then the registry goes away and a fresh
//! containerd still pulls by tag and by digest from the agent's cache.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use common::*;
use testkit::{write_hosts_toml, Containerd, Registry, RegistryAuth, TestImage};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn containerd_pulls_through_agent_and_survives_registry_outage() {
    let mut registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let reg = registry.url();
    let host = registry.host();
    let image = {
        let r = &registry;
        TestImage::push_multilayer(r, "team/train", "v1", &[3 << 20, 1 << 20, 200 << 10], 7)
            .expect("push")
    };
    let cache = tempfile::tempdir().unwrap();
    let agent = start_agent(cache.path(), &host, &reg, None, |c| {
        c.tag_ttl = std::time::Duration::from_secs(0)
    })
    .await;
    let hosts = tempfile::tempdir().unwrap();
    write_hosts_toml(hosts.path(), &host, &agent.url(), &reg).unwrap();

    let reference = image.reference.clone();
    let h = hosts.path().to_owned();
    let digest = blocking(move || {
        let ctrd = Containerd::start();
        ctrd.pull(&reference, &h, &[])
            .expect("containerd pull through agent");
        ctrd.image_digest(&reference).unwrap()
    })
    .await;
    assert_eq!(digest, image.digest);
    let upstream_after_first = agent.metric("starling_agent_upstream_bytes_total");
    assert!(
        upstream_after_first >= image.total_layer_bytes() as f64,
        "layers came through the agent"
    );

    // The registry goes away. The hosts.toml fallback server is dead too, so only the
    // agent can answer.
    registry.stop();
    let (r1, r2) = (
        image.reference.clone(),
        format!("{}/{}@{}", host, image.repo, image.digest),
    );
    let h = hosts.path().to_owned();
    let (d1, d2) = blocking(move || {
        let ctrd = Containerd::start();
        ctrd.pull(&r1, &h, &[])
            .expect("pull by tag from cache while registry is down");
        let ctrd2 = Containerd::start();
        ctrd2
            .pull(&r2, &h, &[])
            .expect("pull by digest from cache while registry is down");
        (
            ctrd.image_digest(&r1).unwrap(),
            ctrd2.image_digest(&r2).unwrap(),
        )
    })
    .await;
    assert_eq!(d1, image.digest);
    assert_eq!(d2, image.digest);
    assert!(
        agent.metric("starling_agent_stale_tags_served_total") >= 1.0,
        "tag answered from the last known digest"
    );
    assert_eq!(
        agent.metric("starling_agent_upstream_bytes_total"),
        upstream_after_first,
        "no upstream bytes while the registry was down"
    );
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn containerd_pulls_multiplatform_index_with_token_auth_through_agent() {
    let registry =
        blocking(|| Registry::start(RegistryAuth::token("puller", "s3cret", false))).await;
    let (reg, host) = (registry.url(), registry.host());
    let index =
        TestImage::push_multiplatform_index(&registry, "ml/multi", "1.0").expect("push index");
    let cache = tempfile::tempdir().unwrap();
    // containerd sends no credentials to the mirror; the agent has its own.
    let agent = start_agent(
        cache.path(),
        &host,
        &reg,
        Some(("puller", "s3cret")),
        |_| {},
    )
    .await;
    let hosts = tempfile::tempdir().unwrap();
    write_hosts_toml(hosts.path(), &host, &agent.url(), "http://127.0.0.1:9").unwrap();
    let reference = index.reference.clone();
    let h = hosts.path().to_owned();
    let tokens_before = registry.token_requests();
    let digest = blocking(move || {
        let ctrd = Containerd::start();
        ctrd.pull(&reference, &h, &["--platform", "linux/arm64"])
            .expect("pull arm64 through agent");
        ctrd.image_digest(&reference).unwrap()
    })
    .await;
    assert_eq!(digest, index.digest);
    let token_requests = registry.token_requests() - tokens_before;
    assert!(
        token_requests >= 1,
        "agent authenticated with the token server"
    );
    assert!(
        token_requests <= 3,
        "tokens are cached per scope, got {token_requests} token requests"
    );
    agent.stop().await;
}
