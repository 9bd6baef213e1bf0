//! Several trackers and the agents that fail over between them (issue 14): shared by
//! `tracker_failover.rs` (independent trackers) and `tracker_redis.rs` (replicas
//! sharing Redis).

use super::Proc;
use std::path::Path;
use testkit::{RedisServer, Registry, RegistryAuth};

pub const TOKEN: &str = "test-cluster-token";

/// An agent given the comma-separated `trackers` (an order of preference), slowed to
/// 8 MiB/s so that kills land mid-pull.
pub async fn agent(dir: &Path, name: &str, trackers: &str, registry: &Registry) -> Proc {
    agent_with(dir, name, trackers, registry, &[]).await
}

/// [`agent`] with `extra` flags (labels, say).
pub async fn agent_with(
    dir: &Path,
    name: &str,
    trackers: &str,
    registry: &Registry,
    extra: &[&str],
) -> Proc {
    agent_with_env(dir, name, trackers, registry, extra, &[]).await
}

/// [`agent_with`] with `envs` set for the agent process.
pub async fn agent_with_env(
    dir: &Path,
    name: &str,
    trackers: &str,
    registry: &Registry,
    extra: &[&str],
    envs: &[(&str, &str)],
) -> Proc {
    let port = testkit::free_port();
    let cache = dir.join(name);
    let host = registry.host();
    let args = super::args(&[
        "agent",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--cache-dir",
        &cache.display().to_string(),
        "--default-registry",
        &host,
        "--registry-endpoint",
        &format!("{host}={}", registry.url()),
        "--tracker",
        trackers,
        "--cluster-token",
        TOKEN,
        "--insecure-plain-http",
        "--node-name",
        name,
        "--min-free",
        "0",
        "--download-limit",
        "8MiB",
    ]);
    let mut args = args;
    args.extend(super::args(extra));
    Proc::start_with_env(args, port, dir.join(format!("{name}.log")), cache, envs).await
}

/// `/swarm/v1/swarms` of a tracker; `Null` when it does not answer.
pub async fn swarms(tracker: &str) -> serde_json::Value {
    get_json(&format!("{tracker}/swarm/v1/swarms")).await
}

/// A GET answered with JSON; `Null` when nothing (or no JSON) answers.
pub async fn get_json(url: &str) -> serde_json::Value {
    match reqwest::get(url).await {
        Ok(r) => r.json().await.unwrap_or(serde_json::Value::Null),
        Err(_) => serde_json::Value::Null,
    }
}

/// A real redis-server and a real registry (without auth), each on its own port: what
/// every test of replicas sharing Redis starts from.
pub async fn redis_and_registry() -> (RedisServer, Registry) {
    let redis = tokio::task::spawn_blocking(RedisServer::start)
        .await
        .unwrap();
    let registry = tokio::task::spawn_blocking(|| Registry::start(RegistryAuth::None))
        .await
        .unwrap();
    (redis, registry)
}

/// A tracker replica sharing `redis`, resolving images in `registry` when given.
pub async fn redis_replica(dir: &Path, redis: &str, registry: Option<&Registry>) -> Proc {
    std::fs::create_dir_all(dir).unwrap();
    let mut extra = vec!["--cluster-token".to_owned(), TOKEN.to_owned()];
    if let Some(r) = registry {
        extra.push("--registry-endpoint".into());
        extra.push(format!("{}={}", r.host(), r.url()));
    }
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    super::start_tracker(dir, &extra, &[("STARLING_TRACKER_REDIS", redis)]).await
}

/// Members of the largest swarm in a `/swarm/v1/swarms` answer.
pub fn peers(swarms: &serde_json::Value) -> u64 {
    swarms
        .as_array()
        .and_then(|a| a.iter().filter_map(|s| s["peers"].as_u64()).max())
        .unwrap_or(0)
}
