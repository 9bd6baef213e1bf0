//! A real Docker Engine pulls through the agent, configured by `starling setup docker`
//! (`registry-mirrors`, which Docker applies to Docker Hub images only). The agent maps
//! docker.io to the test registry, as an air-gapped site would. Then the registry goes
//! away and a Docker Engine with a fresh data root pulls by digest from the agent's cache.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use common::*;
use testkit::{DockerDaemon, ManifestFormat, Registry, RegistryAuth, TestImage};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn docker_pulls_docker_hub_images_through_the_agent_mirror() {
    let mut registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = {
        let r = &registry;
        TestImage::push_multilayer_format(
            r,
            "library/trainimg",
            "v1",
            &[2 << 20, 512 << 10],
            11,
            ManifestFormat::DockerV2S2,
        )
        .expect("push")
    };
    let cache = tempfile::tempdir().unwrap();
    let agent = start_agent(cache.path(), "docker.io", &registry.url(), None, |_| {}).await;

    let etc = tempfile::tempdir().unwrap();
    let daemon_json = etc.path().join("daemon.json");
    std::fs::write(&daemon_json, "{\"log-level\": \"warn\"}\n").unwrap();
    let report = agent::setup::docker(&daemon_json, &agent.url()).expect("setup docker");
    assert_eq!(report.written, vec![daemon_json.clone()]);

    let (dj, agent_url) = (daemon_json.clone(), agent.url());
    let (id, repo_digests, mirrors) = blocking(move || {
        let docker = DockerDaemon::start(&dj);
        let mirrors = docker.mirrors().expect("docker info");
        docker.pull("trainimg:v1").unwrap_or_else(|e| {
            panic!(
                "docker pull through {agent_url}: {e:#}\n{}",
                docker.log_tail(8192)
            )
        });
        let (id, digests) = docker.image_id_and_digests("trainimg:v1").expect("inspect");
        (id, digests, mirrors)
    })
    .await;
    assert!(
        mirrors
            .iter()
            .any(|m| m.trim_end_matches('/') == agent.url()),
        "dockerd uses the agent as its mirror: {mirrors:?}"
    );
    assert_eq!(id, image.config_digest(), "image ID is the config digest");
    assert!(
        repo_digests
            .iter()
            .any(|d| d == &format!("trainimg@{}", image.digest)),
        "RepoDigests {repo_digests:?} has the manifest digest {}",
        image.digest
    );
    assert!(
        agent.metric("starling_agent_upstream_bytes_total") >= image.total_layer_bytes() as f64,
        "the layers came through the agent"
    );

    registry.stop();
    let reference = format!("trainimg@{}", image.digest);
    let dj = daemon_json.clone();
    let id2 = blocking(move || {
        let docker = DockerDaemon::start(&dj);
        docker.pull(&reference).unwrap_or_else(|e| {
            panic!(
                "docker pull by digest from the agent's cache: {e:#}\n{}",
                docker.log_tail(8192)
            )
        });
        docker.image_id_and_digests(&reference).expect("inspect").0
    })
    .await;
    assert_eq!(id2, image.config_digest());
    agent.stop().await;
}
