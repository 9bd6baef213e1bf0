//! A private Docker Engine (`dockerd`) with its own data root, exec root and socket,
//! configured from a `daemon.json` the test writes (e.g. with `starling setup docker`).
//! No iptables, no bridge, the `vfs` storage driver: it pulls and unpacks images but
//! never needs to run a container, so it works in sandboxes without overlayfs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tempfile::TempDir;

use crate::containerd::short_tmp;
use crate::process::ChildProc;
use crate::util::{run_cmd, run_ok};

const READY_TIMEOUT: Duration = Duration::from_secs(60);

pub struct DockerDaemon {
    proc: Option<ChildProc>,
    socket: PathBuf,
    log_path: PathBuf,
    dir: TempDir,
}

impl DockerDaemon {
    /// Starts dockerd with `daemon_json` as its `--config-file`; panics with its log
    /// on failure (test helper).
    pub fn start(daemon_json: &Path) -> DockerDaemon {
        Self::try_start(daemon_json)
            .unwrap_or_else(|e| panic!("testkit: failed to start dockerd: {e:#}"))
    }

    pub fn try_start(daemon_json: &Path) -> Result<DockerDaemon> {
        let dir = tempfile::Builder::new()
            .prefix("tk-dkr-")
            .tempdir_in(short_tmp())
            .context("creating dockerd temp dir")?;
        let root = dir.path().join("root");
        let exec = dir.path().join("exec");
        for d in [&root, &exec] {
            std::fs::create_dir_all(d)?;
        }
        let socket = dir.path().join("d.sock");
        let log_path = dir.path().join("dockerd.log");
        let proc = ChildProc::spawn(
            "dockerd",
            Command::new("dockerd")
                .arg("--config-file")
                .arg(daemon_json)
                .arg("--data-root")
                .arg(&root)
                .arg("--exec-root")
                .arg(&exec)
                .arg("--pidfile")
                .arg(dir.path().join("pid"))
                .arg("-H")
                .arg(format!("unix://{}", socket.display()))
                .args([
                    "--iptables=false",
                    "--ip6tables=false",
                    "--bridge=none",
                    "--storage-driver=vfs",
                ])
                // Its managed containerd gets its own namespace, away from the tests'.
                .arg("--containerd-namespace")
                .arg(format!(
                    "tk-dkr-{}",
                    dir.path()
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default()
                )),
            &log_path,
        )?;
        let deadline = Instant::now() + READY_TIMEOUT;
        // Owned from here on, so a failed start still stops the daemon (Drop).
        let mut d = DockerDaemon {
            proc: Some(proc),
            socket,
            log_path,
            dir,
        };
        loop {
            if let Some(how) = d.proc.as_mut().and_then(|p| p.exited()) {
                bail!(
                    "dockerd {how} before becoming ready\n--- dockerd log ---\n{}",
                    d.log_tail(16 * 1024)
                );
            }
            if d.socket.exists()
                && run_cmd(d.docker_command().arg("version"))
                    .map(|o| o.status.success())
                    .unwrap_or(false)
            {
                return Ok(d);
            }
            if Instant::now() >= deadline {
                bail!(
                    "dockerd not ready within {READY_TIMEOUT:?}\n--- dockerd log ---\n{}",
                    d.log_tail(16 * 1024)
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `docker -H unix://SOCK` to which arguments can be added.
    pub fn docker_command(&self) -> Command {
        let mut c = Command::new("docker");
        c.arg("-H").arg(format!("unix://{}", self.socket.display()));
        c
    }

    /// `docker pull REFERENCE`; errors with docker's output when it fails.
    pub fn pull(&self, reference: &str) -> Result<String> {
        let out = run_ok(self.docker_command().args(["pull", reference]))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The image ID (`sha256:` of its config) and repo digests Docker recorded.
    pub fn image_id_and_digests(&self, reference: &str) -> Result<(String, Vec<String>)> {
        let out = run_ok(self.docker_command().args([
            "image",
            "inspect",
            "--format",
            "{{.Id}}{{range .RepoDigests}} {{.}}{{end}}",
            reference,
        ]))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let mut words = text.split_whitespace();
        let id = words
            .next()
            .ok_or_else(|| anyhow!("no image id for {reference}: {text}"))?
            .to_owned();
        Ok((id, words.map(str::to_owned).collect()))
    }

    /// The registry mirrors dockerd reports it is using (`docker info`).
    pub fn mirrors(&self) -> Result<Vec<String>> {
        let out = run_ok(self.docker_command().args([
            "info",
            "--format",
            "{{range .RegistryConfig.Mirrors}}{{.}} {{end}}",
        ]))?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_owned)
            .collect())
    }

    pub fn log_tail(&self, max: usize) -> String {
        crate::process::log_tail(&self.log_path, max)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for DockerDaemon {
    fn drop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            // SIGKILL leaves its containerd child behind; ask politely first.
            if let Some(pid) = p.pid() {
                let _ = Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status();
                let deadline = Instant::now() + Duration::from_secs(10);
                while p.exited().is_none() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            p.kill();
        }
    }
}
