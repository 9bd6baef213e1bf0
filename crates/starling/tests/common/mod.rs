//! Shared by the process-level tests: `starling` children that are killed on drop,
//! readiness polling and metric scraping.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct Proc {
    pub child: Child,
    pub port: u16,
    pub cache: PathBuf,
    pub args: Vec<String>,
    pub log: PathBuf,
}

impl Proc {
    /// Spawns `starling ARGS` logging to `log` and waits for `/healthz`.
    pub async fn start(args: Vec<String>, port: u16, log: PathBuf, cache: PathBuf) -> Proc {
        let p = Proc {
            child: spawn(&args, &log),
            port,
            cache,
            args,
            log,
        };
        ready(&p.url()).await;
        p
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn restart(&mut self) {
        self.child = spawn(&self.args, &self.log);
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

pub fn spawn(args: &[String], log: &Path) -> Child {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("log file");
    Command::new(env!("CARGO_BIN_EXE_starling"))
        .args(args)
        .env("STARLING_LOG", "info")
        .stdout(Stdio::null())
        .stderr(f)
        .spawn()
        .expect("spawn starling")
}

pub async fn ready(url: &str) {
    for _ in 0..400 {
        if reqwest::get(format!("{url}/healthz"))
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{url} not ready");
}

/// Sum of a Prometheus metric's samples on `base_url/metrics`.
pub async fn metric(base_url: &str, name: &str) -> u64 {
    let text = reqwest::get(format!("{base_url}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body");
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}
