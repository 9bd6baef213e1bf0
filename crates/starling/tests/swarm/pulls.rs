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
    // the config and the 64 KiB layer from the registry (below the swarm's threshold),
    // on every agent: one was elected for each before the tracker knew their sizes,
    // and it fetches them directly like the others.
    let served = |source: &str| format!("starling_agent_served_bytes_total{{source=\"{source}\"}}");
    let small_layers: u64 = image.layers.iter().map(|l| l.size).sum::<u64>() - big;
    let small = image.config.size + small_layers;
    let mut by_swarm = 0;
    for a in &agents {
        until_metric_above("the small blobs served", a, &served("registry"), small - 1).await;
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
    // The manifest, the config and the small layer have swarms too, of their
    // holders only (for a node the registry cannot answer): at most the one election
    // made before the tracker knew a small blob's size.
    let mut swarmed = 0;
    for s in swarms.as_array().unwrap() {
        let elections = s["source_elections"].as_u64().unwrap();
        if s["size"].as_u64().unwrap() >= 1 << 20 {
            swarmed += 1;
            assert_eq!(elections, 1, "one registry fetcher per blob: {s}");
        } else {
            assert!(elections <= 1, "{s}");
        }
    }
    let big_count = image.layers.iter().filter(|l| l.size >= 1 << 20).count();
    assert_eq!(swarmed, big_count);
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

/// A blob asked for before any manifest declared its size (a runtime resuming a pull,
/// a client that fetches by digest) goes to the tracker, and the first asker is elected
/// before anyone knows the size. Finding it below the P2P threshold, the elected node
/// fetches it directly like every other node and leaves the swarm, so its dashboard
/// says "registry" and the tracker holds no member fetching it (only, once they hold
/// it, the nodes' seeding). Once a manifest has declared a blob small, asking for it
/// does not touch the tracker at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn small_blobs_go_to_the_registry_with_or_without_a_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/small", "1", &[64 << 10, 48 << 10], 12)
            .unwrap();
    let t = tracker(dir.path(), &[]).await;
    let (a, b) = (
        agent(dir.path(), "a", &t.url(), &registry, &[]).await,
        agent(dir.path(), "b", &t.url(), &registry, &[]).await,
    );
    let get = |agent: &common::Proc, digest: &str| {
        let url = format!("{}/v2/swarm/small/blobs/{digest}", agent.url());
        async move {
            let r = reqwest::get(url).await.unwrap();
            assert!(r.status().is_success(), "{}", r.status());
            r.bytes().await.unwrap().len() as u64
        }
    };
    let by_digest = &image.layers[0];
    let (got_a, got_b) = tokio::join!(get(&a, &by_digest.digest), get(&b, &by_digest.digest));
    assert_eq!((got_a, got_b), (by_digest.size, by_digest.size));
    let served_registry = "starling_agent_served_bytes_total{source=\"registry\"}";
    let served_swarm = "starling_agent_served_bytes_total{source=\"swarm\"}";
    for n in [&a, &b] {
        until_metric_above("the layer served", n, served_registry, by_digest.size - 1).await;
        assert_eq!(
            metric(n, served_swarm).await,
            0,
            "no swarm for a small blob"
        );
    }
    let swarms = |t: String| async move {
        reqwest::get(format!("{t}/swarm/v1/swarms"))
            .await
            .unwrap()
            .json::<Vec<serde_json::Value>>()
            .await
            .unwrap()
    };
    let listed = swarms(t.url()).await;
    let small = listed
        .iter()
        .find(|s| s["digest"] == by_digest.digest.as_str())
        .expect("the blob asked for by digest went to the tracker");
    assert_eq!(small["size"], by_digest.size, "{small}");
    assert_eq!(small["source"], serde_json::Value::Null, "{small}");
    assert_eq!(small["source_elections"], 1, "{small}");
    // The elected node left; the only members kept are complete holders, seeded for
    // a node the registry cannot answer.
    assert_eq!(
        small["peers"], small["complete"],
        "the elected node left: {small}"
    );
    // After the manifest, the config and the other small layer skip the tracker.
    pull_via(&a.url(), &image).await.expect("pull");
    // Their swarms are only the holder's seeding (waited for here, so it is in the
    // listing): nobody was elected to fetch them and nobody fetches them.
    let seeded = |listed: &[serde_json::Value]| {
        [&image.config, &image.layers[1]]
            .iter()
            .all(|b| listed.iter().any(|s| s["digest"] == b.digest.as_str()))
    };
    testkit::until(
        "node a to seed what it holds",
        std::time::Duration::from_millis(50),
        std::time::Duration::from_secs(20),
        || async { seeded(&swarms(t.url()).await) },
    )
    .await;
    let listed = swarms(t.url()).await;
    for declared in [&image.config, &image.layers[1]] {
        for s in listed
            .iter()
            .filter(|s| s["digest"] == declared.digest.as_str())
        {
            assert_eq!(
                (&s["source_elections"], &s["peers"]),
                (&serde_json::json!(0), &s["complete"]),
                "{} was declared small by the manifest: {s}",
                declared.digest
            );
        }
    }
}
