//! Several trackers (issue 14, first part): agents configured with two trackers keep
//! pulling when the one they use is killed, and move their announces, seeding and
//! reports to the other. Embedded trackers share no state (replicas sharing Redis:
//! `tracker_redis.rs`), so the pull may finish from the registry (the second tracker
//! elects new sources); what must hold is that no pull fails or restarts and that the
//! agents end up on the second tracker.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::path::Path;
use std::time::Duration;

use common::trackers::{agent, peers, swarms, TOKEN};
use common::{pull_via, Proc};
use testkit::{Registry, RegistryAuth, TestImage};

/// How often and how long `testkit::until` checks for announces.
const POLL_EVERY: Duration = Duration::from_millis(100);
const POLL_WITHIN: Duration = Duration::from_secs(30);

async fn tracker(dir: &Path) -> Proc {
    std::fs::create_dir_all(dir).unwrap();
    common::start_tracker(dir, &["--cluster-token", TOKEN], &[]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_first_tracker_mid_pull_moves_agents_to_the_second() {
    let dir = tempfile::tempdir().unwrap();
    let registry = tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .unwrap();
    let image =
        TestImage::push_multilayer(&registry, "ha/failover", "1", &[24 << 20, 24 << 20], 21)
            .unwrap();
    let mut first = tracker(&dir.path().join("t1")).await;
    let second = tracker(&dir.path().join("t2")).await;
    let list = format!("{},{}", first.url(), second.url());
    let mut agents = Vec::new();
    for name in ["n1", "n2", "n3"] {
        agents.push(agent(dir.path(), name, &list, &registry).await);
    }
    let pulls: Vec<_> = agents
        .iter()
        .map(|a| {
            let (url, img) = (a.url(), image.clone());
            tokio::spawn(async move { pull_via(&url, &img).await })
        })
        .collect();
    // Everyone starts on the first tracker (the list is an order of preference).
    let first_url = first.url();
    testkit::until(
        "the agents to announce to the first tracker",
        POLL_EVERY,
        POLL_WITHIN,
        || {
            let u = first_url.clone();
            async move { peers(&swarms(&u).await) >= 3 }
        },
    )
    .await;
    assert_eq!(
        peers(&swarms(&second.url()).await),
        0,
        "nobody uses the second tracker while the first works"
    );
    first.kill9();
    for (a, p) in agents.iter().zip(pulls) {
        let report = p
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("pull through {} failed: {e}\n{}", a.url(), a.log_text()));
        assert_eq!(report.manifest_digest.to_string(), image.digest);
    }
    // Later announces, seeding and reports go to the second tracker.
    let second_url = second.url();
    testkit::until(
        "all three agents on the second tracker",
        POLL_EVERY,
        POLL_WITHIN,
        || {
            let u = second_url.clone();
            async move { peers(&swarms(&u).await) >= 3 }
        },
    )
    .await;
    let nodes: serde_json::Value = reqwest::get(format!("{second_url}/api/v1/nodes"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let names: Vec<&str> = nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["name"].as_str())
        .collect();
    for n in ["n1", "n2", "n3"] {
        assert!(
            names.contains(&n),
            "{n} reports to the second tracker: {nodes}"
        );
    }
    for a in &agents {
        assert!(
            a.log_text().contains("moving on to the next one"),
            "the agent says it moved: {}",
            a.log_text()
        );
    }
}
