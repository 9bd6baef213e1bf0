//! The swarm as real processes: a tracker and agents (`starling` binaries) on loopback,
//! the real docker-registry as origin, real containerd, and every fault of issue 3.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

#[path = "../common/mod.rs"]
mod common;

mod bad_peers;
mod faults;
mod protocol;
mod pulls;
mod registry_outage;
mod size_lies;
mod wildcard;

use std::path::Path;
use std::time::Duration;

use common::{pull_via, Proc};

use testkit::{Registry, RegistryAuth, TestImage};

const TOKEN: &str = "test-cluster-token";

async fn tracker(dir: &Path, extra: &[&str]) -> Proc {
    let port = testkit::free_port();
    let data = dir.join(format!("tracker-data-{port}"));
    let mut args: Vec<String> = vec![
        "tracker".into(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--cluster-token".into(),
        TOKEN.into(),
        "--insecure-plain-http".into(),
        "--data-dir".into(),
        data.display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::start(
        args,
        port,
        dir.join(format!("tracker-{port}.log")),
        dir.to_owned(),
    )
    .await
}

async fn agent(dir: &Path, name: &str, tracker: &str, registry: &Registry, extra: &[&str]) -> Proc {
    agent_via(dir, name, tracker, registry, &registry.url(), extra).await
}

/// An agent that reaches `registry` at `endpoint` (a proxy in front of it).
async fn agent_via(
    dir: &Path,
    name: &str,
    tracker: &str,
    registry: &Registry,
    endpoint: &str,
    extra: &[&str],
) -> Proc {
    agent_with_env(dir, name, tracker, registry, endpoint, extra, &[]).await
}

/// [`agent_via`] with environment variables `envs`.
async fn agent_with_env(
    dir: &Path,
    name: &str,
    tracker: &str,
    registry: &Registry,
    endpoint: &str,
    extra: &[&str],
    envs: &[(&str, &str)],
) -> Proc {
    let port = testkit::free_port();
    let cache = dir.join(name);
    let host = registry.host();
    let mut args: Vec<String> = vec![
        "agent".into(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--cache-dir".into(),
        cache.display().to_string(),
        "--default-registry".into(),
        host.clone(),
        "--registry-endpoint".into(),
        format!("{host}={endpoint}"),
        "--tracker".into(),
        tracker.into(),
        "--cluster-token".into(),
        TOKEN.into(),
        "--insecure-plain-http".into(),
        "--node-name".into(),
        name.into(),
        "--min-free".into(),
        "0".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    common::start_with_env(args, envs, port, dir.join(format!("{name}.log")), cache).await
}

/// An agent named "seed" (with `extra` flags) that has pulled `image`: the swarm's
/// first holder of every layer.
async fn seed_holding(
    dir: &Path,
    tracker: &str,
    registry: &Registry,
    image: &testkit::PushedImage,
    extra: &[&str],
) -> Proc {
    let seed = agent(dir, "seed", tracker, registry, extra).await;
    pull_via(&seed.url(), image).await.unwrap();
    seed
}

async fn metric(agent: &Proc, name: &str) -> u64 {
    common::metric(&agent.url(), name).await
}

/// Waits (up to 60 s) until `agent`'s counter `name` is above `floor`; `what` names the
/// wait in the failure.
async fn until_metric_above(what: &str, agent: &Proc, name: &str, floor: u64) {
    testkit::until(
        what,
        Duration::from_millis(5),
        Duration::from_secs(60),
        || async { metric(agent, name).await > floor },
    )
    .await;
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

type PullTask = tokio::task::JoinHandle<Result<oci::pull::PullReport, oci::Error>>;

/// `agent` pulls `image` in the background.
fn spawn_pull(agent: &Proc, image: &testkit::PushedImage) -> PullTask {
    let (url, img) = (agent.url(), image.clone());
    tokio::spawn(async move { pull_via(&url, &img).await })
}

/// `src` pulls `image` in the background; returns once it reads from the registry
/// (elected source of the big layer).
async fn spawn_source_pull(src: &Proc, image: &testkit::PushedImage) -> PullTask {
    let pull = spawn_pull(src, image);
    until_metric_above(
        "the source to read from the registry",
        src,
        "starling_agent_p2p_registry_bytes_total",
        0,
    )
    .await;
    pull
}

fn big_layers(image: &testkit::PushedImage) -> u64 {
    image
        .layers
        .iter()
        .filter(|l| l.size >= 4 << 20)
        .map(|l| l.size)
        .sum()
}

/// Asks the tracker who holds a blob, as a node that holds nothing: (name, address).
/// The tracker's answer to a probe that announces and leaves at once: the swarm's
/// geometry and its handout, without joining it.
async fn probe_announce(tracker: &str, digest: &str) -> serde_json::Value {
    let body = serde_json::json!({"node": "probe", "addr": "127.0.0.1:1", "digest": digest, "leaving": true});
    reqwest::Client::new()
        .post(format!("{tracker}/swarm/v1/announce"))
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A blob's bytes straight from the registry.
async fn registry_blob(registry: &Registry, repo: &str, digest: &str) -> Vec<u8> {
    let url = format!("{}/v2/{repo}/blobs/{digest}", registry.url());
    blocking(move || testkit::http_get(&url, &[]).unwrap().body).await
}

async fn holders(tracker: &str, digest: &str) -> Vec<(String, String)> {
    let r = probe_announce(tracker, digest).await;
    r["peers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["node"].as_str().unwrap().to_owned(),
                p["addr"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// An agent named "holder" pulling a one-layer image of 16 MiB from the registry at
/// 2 MiB/s (about 8 s), so the blob is in progress, piece by piece, while a test talks
/// to it as a peer. `pull` is its client's pull.
struct SlowHolder {
    registry: Registry,
    image: testkit::PushedImage,
    tracker: Proc,
    _holder: Proc,
    pull: tokio::task::JoinHandle<Result<oci::pull::PullReport, oci::Error>>,
}

impl SlowHolder {
    async fn start(dir: &Path, repo: &str, seed: u64) -> Self {
        let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
        let image = TestImage::push_multilayer(&registry, repo, "1", &[16 << 20], seed).unwrap();
        let tracker = tracker(dir, &[]).await;
        let holder = agent(
            dir,
            "holder",
            &tracker.url(),
            &registry,
            &["--download-limit", "2MiB"],
        )
        .await;
        let pull = tokio::spawn({
            let (url, image) = (holder.url(), image.clone());
            async move { pull_via(&url, &image).await }
        });
        Self {
            registry,
            image,
            tracker,
            _holder: holder,
            pull,
        }
    }
}

/// The swarm's piece size and the peer address of the agent named "holder", once a
/// tracker answer (`probe_announce`) has both.
fn holder_in(r: &serde_json::Value) -> Option<(u64, String)> {
    let piece_size = r["piece_size"].as_u64().filter(|&p| p > 1)?;
    let addr = r["peers"]
        .as_array()?
        .iter()
        .find(|x| x["node"] == "holder")?["addr"]
        .as_str()?;
    Some((piece_size, addr.to_owned()))
}
