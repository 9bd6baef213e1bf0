//! Pulls through the swarm by many agents and by real containerd: the registry serves
//! each blob about once.

use testkit::{Registry, RegistryAuth, TestImage};

use super::common::{self, pull_via};
use super::{agent, big_layers, blocking, metric, tracker, until_metric_above};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_agents_pull_at_once_and_the_registry_serves_each_blob_about_once() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(
        &registry,
        "swarm/eight",
        "1",
        &[12 << 20, 8 << 20, 64 << 10],
        11,
    )
    .unwrap();
    let t = tracker(dir.path(), &[]).await;
    let mut agents = Vec::new();
    for i in 0..8 {
        agents.push(
            agent(
                dir.path(),
                &format!("n{i}"),
                &t.url(),
                &registry,
                &[
                    "--download-limit",
                    "40MiB",
                    "--upload-limit",
                    "40MiB",
                    "--zone",
                    "z",
                    "--rack",
                    &format!("r{}", i % 2),
                ],
            )
            .await,
        );
    }
    let urls: Vec<String> = agents.iter().map(|a| a.url()).collect();
    let pulls = urls.iter().map(|u| pull_via(u, &image));
    for r in futures::future::join_all(pulls).await {
        assert_eq!(
            r.expect("pull through the swarm")
                .manifest_digest
                .to_string(),
            image.digest
        );
    }
    let mut upstream = 0;
    let mut from_peers = 0;
    for a in &agents {
        upstream += metric(a, "starling_agent_p2p_registry_bytes_total").await;
        from_peers += metric(a, "starling_agent_p2p_peer_bytes_total").await;
    }
    let big = big_layers(&image);
    assert!(
        upstream <= big + big / 20,
        "registry served the big layers {:.2}× (want ≤ 1.05×)",
        upstream as f64 / big as f64
    );
    assert!(
        from_peers >= 6 * big,
        "most bytes came from peers: {from_peers} of {}",
        7 * big
    );
    // Each agent's dashboard names where the bytes it served came from: the big layers
    // through the swarm (or the cache, had the manifest's prefetch finished first),
    // the image config from the registry (below the swarm's threshold).
    let served = |source: &str| format!("starling_agent_served_bytes_total{{source=\"{source}\"}}");
    let mut by_swarm = 0;
    for a in &agents {
        let config = image.config.size;
        until_metric_above("the config served", a, &served("registry"), config - 1).await;
        let (swarm, cache) = (
            metric(a, &served("swarm")).await,
            metric(a, &served("cache")).await,
        );
        assert!(
            swarm + cache >= big,
            "{swarm} + {cache} of the big layers' {big} bytes: {:?}",
            common::metric_lines(&a.url(), "starling_agent_served_bytes_total").await
        );
        by_swarm += swarm;
        assert_eq!(
            metric(a, &served("upstream")).await,
            0,
            "every byte is named by where it came from, none by the old catch-all"
        );
    }
    assert!(
        by_swarm >= big,
        "swarm downloads are counted as such: {by_swarm}"
    );
    let swarms: serde_json::Value = reqwest::get(format!("{}/swarm/v1/swarms", t.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for s in swarms.as_array().unwrap() {
        assert_eq!(
            s["source_elections"], 1,
            "one registry fetcher per blob: {s}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn containerd_pulls_through_two_swarm_agents() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/ctrd", "1", &[10 << 20, 6 << 20], 12).unwrap();
    let t = tracker(dir.path(), &[]).await;
    let a = agent(dir.path(), "a", &t.url(), &registry, &[]).await;
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let mut handles = Vec::new();
    for (i, ag) in [&a, &b].iter().enumerate() {
        let hosts = dir.path().join(format!("hosts{i}"));
        testkit::write_hosts_toml(&hosts, &registry.host(), &ag.url(), "http://127.0.0.1:9")
            .unwrap();
        let r = image.reference.clone();
        handles.push(tokio::task::spawn_blocking(move || {
            let c = testkit::Containerd::start();
            c.pull(&r, &hosts, &[])
                .expect("containerd pull via swarm agent");
            c.image_digest(&r).unwrap()
        }));
    }
    for h in handles {
        assert_eq!(h.await.unwrap(), image.digest);
    }
    let upstream = metric(&a, "starling_agent_p2p_registry_bytes_total").await
        + metric(&b, "starling_agent_p2p_registry_bytes_total").await;
    let big = big_layers(&image);
    assert!(
        upstream <= big + big / 20,
        "registry bytes {upstream} for {big}"
    );
}
