#![allow(dead_code)]
use std::net::SocketAddr;
use std::path::Path;

use agent::config::RegistryConfig;
use agent::{Agent, AgentConfig};

pub struct RunningAgent {
    pub agent: Agent,
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl RunningAgent {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn metric(&self, name: &str) -> f64 {
        let text = self.agent.metrics.encode();
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum()
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// An agent whose default registry is `registry_host`, reached at `upstream_url`.
pub async fn start_agent(
    cache: &Path,
    registry_host: &str,
    upstream_url: &str,
    creds: Option<(&str, &str)>,
    tweak: impl FnOnce(&mut AgentConfig),
) -> RunningAgent {
    let mut cfg = AgentConfig {
        cache_dir: cache.to_owned(),
        default_registry: registry_host.to_owned(),
        min_free: oci::size::ByteSize(0),
        ..Default::default()
    };
    cfg.registries.insert(
        registry_host.to_owned(),
        RegistryConfig {
            endpoint: Some(upstream_url.to_owned()),
            username: creds.map(|c| c.0.to_owned()),
            password: creds.map(|c| c.1.to_owned()),
            ..Default::default()
        },
    );
    tweak(&mut cfg);
    let agent = Agent::new(cfg).expect("agent starts");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(agent.clone().serve(listener, async move {
        let _ = rx.await;
    }));
    RunningAgent {
        agent,
        addr,
        stop: Some(tx),
    }
}

pub async fn get(url: &str, headers: &[(&str, &str)]) -> reqwest::Response {
    let client = reqwest::Client::new();
    let mut r = client.get(url);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    r.send().await.expect("request")
}

pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}
