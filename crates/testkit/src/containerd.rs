//! A private `containerd` daemon driven through `ctr`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tempfile::TempDir;

use crate::process::ChildProc;
use crate::util::{run_cmd, run_ok};

/// Namespace used for every `ctr` command.
pub const CONTAINERD_NAMESPACE: &str = "test";
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Snapshotter used to unpack pulled images. `native` (plain copies) works
/// everywhere, including sandboxes without overlayfs.
const SNAPSHOTTER: &str = "native";

/// A running containerd with its own root, state dir and socket (all inside a
/// temp dir). Killed and removed on drop. A "fresh root" is simply a new
/// `Containerd::start()`.
pub struct Containerd {
    proc: Option<ChildProc>,
    socket: PathBuf,
    log_path: PathBuf,
    dir: TempDir,
}

impl Containerd {
    /// Starts containerd; panics with its log on failure (test helper).
    pub fn start() -> Containerd {
        Self::try_start().unwrap_or_else(|e| panic!("testkit: failed to start containerd: {e:#}"))
    }

    pub fn try_start() -> Result<Containerd> {
        // Unix socket paths are limited to 108 bytes: keep the dir short.
        let dir = tempfile::Builder::new()
            .prefix("tk-ctd-")
            .tempdir_in(short_tmp())
            .context("creating containerd temp dir")?;
        let root = dir.path().join("root");
        let state = dir.path().join("state");
        let opt = dir.path().join("opt");
        for d in [&root, &state, &opt] {
            std::fs::create_dir_all(d)?;
        }
        let socket = dir.path().join("c.sock");
        let config = dir.path().join("config.toml");
        let toml = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{sock}"

[ttrpc]
  address = "{sock}.ttrpc"

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
"#,
            root = root.display(),
            state = state.display(),
            sock = socket.display(),
            opt = opt.display(),
        );
        std::fs::write(&config, toml)?;
        let log_path = dir.path().join("containerd.log");
        let mut proc = ChildProc::spawn(
            "containerd",
            Command::new("containerd").arg("--config").arg(&config),
            &log_path,
        )?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(how) = proc.exited() {
                bail!(
                    "containerd {how} before becoming ready\n--- containerd log ---\n{}",
                    proc.log_tail(16 * 1024)
                );
            }
            if socket.exists() {
                let ok = run_cmd(
                    Command::new("ctr")
                        .arg("--address")
                        .arg(&socket)
                        .arg("version"),
                )
                .map(|o| o.status.success())
                .unwrap_or(false);
                if ok {
                    break;
                }
            }
            if Instant::now() >= deadline {
                bail!(
                    "containerd not ready within {READY_TIMEOUT:?}\n--- containerd log ---\n{}",
                    proc.log_tail(16 * 1024)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(Containerd {
            proc: Some(proc),
            socket,
            log_path,
            dir,
        })
    }

    /// gRPC socket path (`ctr --address`).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    pub fn log_tail(&self, max: usize) -> String {
        crate::process::log_tail(&self.log_path, max)
    }

    /// A `ctr --address SOCK -n test` command to which arguments can be added.
    pub fn ctr_command(&self) -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address")
            .arg(&self.socket)
            .arg("-n")
            .arg(CONTAINERD_NAMESPACE);
        c
    }

    /// Runs `ctr --address SOCK -n test ARGS`; any exit status is `Ok`.
    pub fn ctr(&self, args: &[&str]) -> Result<Output> {
        run_cmd(self.ctr_command().args(args))
    }

    /// `ctr images pull --snapshotter native --hosts-dir HOSTS_DIR EXTRA.. REF`.
    /// No `--plain-http` is needed: the scheme comes from `hosts.toml`.
    /// Errors (with ctr's stdout/stderr in the message) if ctr exits non-zero;
    /// see [`Self::pull_output`] to inspect a failed pull.
    pub fn pull(&self, reference: &str, hosts_dir: &Path, extra: &[&str]) -> Result<Output> {
        run_ok(&mut self.pull_command(reference, hosts_dir, extra))
    }

    /// Like [`Self::pull`] but returns the output whatever the exit status.
    pub fn pull_output(&self, reference: &str, hosts_dir: &Path, extra: &[&str]) -> Result<Output> {
        run_cmd(&mut self.pull_command(reference, hosts_dir, extra))
    }

    fn pull_command(&self, reference: &str, hosts_dir: &Path, extra: &[&str]) -> Command {
        let mut c = self.ctr_command();
        c.args([
            "images",
            "pull",
            "--snapshotter",
            SNAPSHOTTER,
            "--hosts-dir",
        ])
        .arg(hosts_dir)
        .args(extra)
        .arg(reference);
        c
    }

    /// The target (manifest or index) digest containerd recorded for
    /// `reference` (from `ctr images ls`).
    pub fn image_digest(&self, reference: &str) -> Result<String> {
        let out = run_ok(&mut self.ctr_command_args(&["images", "ls"]))?;
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.first() == Some(&reference) {
                return cols
                    .get(2)
                    .map(|s| s.to_string())
                    .ok_or_else(|| anyhow!("malformed `ctr images ls` line: {line}"));
            }
        }
        Err(anyhow!(
            "image {reference} not found in `ctr images ls`:\n{text}"
        ))
    }

    /// Image references known to containerd.
    pub fn images(&self) -> Result<Vec<String>> {
        let out = run_ok(&mut self.ctr_command_args(&["images", "ls", "-q"]))?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .filter(|s| !s.is_empty())
            .collect())
    }

    /// `ctr images check` output (content completeness per image).
    pub fn check(&self) -> Result<String> {
        let out = run_ok(&mut self.ctr_command_args(&["images", "check"]))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `ctr images rm REF`.
    pub fn remove_image(&self, reference: &str) -> Result<()> {
        run_ok(&mut self.ctr_command_args(&["images", "rm", "--sync", reference])).map(|_| ())
    }

    fn ctr_command_args(&self, args: &[&str]) -> Command {
        let mut c = self.ctr_command();
        c.args(args);
        c
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }
}

pub(crate) fn short_tmp() -> PathBuf {
    let t = std::env::temp_dir();
    if t.as_os_str().len() <= 40 {
        t
    } else {
        PathBuf::from("/tmp")
    }
}

/// Writes `HOSTS_DIR/<registry_host>/hosts.toml` so that containerd resolves
/// and pulls `registry_host` images through `mirror_url` first, falling back
/// to `server_url`:
///
/// ```toml
/// server = "SERVER_URL"
///
/// [host."MIRROR_URL"]
///   capabilities = ["pull", "resolve"]
/// ```
///
/// URLs must include the scheme (`http://127.0.0.1:PORT`). Returns the path.
pub fn write_hosts_toml(
    hosts_dir: &Path,
    registry_host: &str,
    mirror_url: &str,
    server_url: &str,
) -> Result<PathBuf> {
    let dir = hosts_dir.join(registry_host);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("hosts.toml");
    let body = format!(
        "server = \"{server_url}\"\n\n[host.\"{mirror_url}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
    );
    std::fs::write(&path, body).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}
