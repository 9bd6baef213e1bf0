//! Small utilities: ports, hashing, random data, command runners, polling.

use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::{RngCore, SeedableRng};
use sha2::{Digest, Sha256};

use crate::http::http_get;

/// Ports handed out by [`free_port`]: below Linux's ephemeral range (32768–60999 by
/// default), which the kernel uses for every outgoing connection's local port and for
/// every `bind(…:0)`. A port taken from that range could be grabbed by any of the
/// thousands of connections the suite opens between the moment it was found free and
/// the moment a child process binds it ("Address already in use", seen in CI).
const FREE_PORTS: std::ops::Range<u16> = 20_000..32_768;

/// Returns a TCP port on 127.0.0.1 that was free a moment ago, chosen at random in
/// [`FREE_PORTS`], out of the kernel's way; only another test picking the same port
/// in the same instant can still take it. Falls back to a port of the kernel's
/// choosing if none is found.
pub fn free_port() -> u16 {
    let span = FREE_PORTS.end - FREE_PORTS.start;
    for _ in 0..1_000 {
        let port = FREE_PORTS.start + (rand::random::<u16>() % span);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    // Binding 127.0.0.1:0 only fails if the loopback interface is unusable,
    // in which case no test of this crate can work anyway.
    match TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(addr) => addr.port(),
        Err(e) => panic!("testkit: cannot bind 127.0.0.1:0 to find a free port: {e}"),
    }
}

/// Lower-case hex SHA-256 of `bytes` (no `sha256:` prefix).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// OCI digest string `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", sha256_hex(bytes))
}

/// `len` bytes of deterministic, incompressible pseudo-random data derived
/// from `seed` (ChaCha12 via `rand::rngs::StdRng`).
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut buf = vec![0u8; len];
    rng.fill_bytes(&mut buf);
    buf
}

/// Polls `url` with HTTP GET until a response whose status satisfies `accept`
/// arrives, or `timeout` elapses (error mentions the last status / error).
pub fn wait_http(url: &str, timeout: Duration, accept: impl Fn(u16) -> bool) -> Result<u16> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match http_get(url, &[]) {
            Ok(resp) if accept(resp.status) => return Ok(resp.status),
            Ok(resp) => format!("HTTP status {}", resp.status),
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() >= deadline {
            bail!("{url} not ready after {timeout:?}: last result: {last}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls `url` until it answers with a 2xx status, or `timeout` elapses.
pub fn wait_http_ok(url: &str, timeout: Duration) -> Result<()> {
    wait_http(url, timeout, |s| (200..300).contains(&s)).map(|_| ())
}

/// Whether `program` can be found on `PATH`.
pub fn tool_available(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
        .unwrap_or(false)
}

fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs `cmd` to completion (stdin closed, output captured). Errors only if
/// the program could not be spawned; a non-zero exit is returned as `Ok`.
pub fn run_cmd(cmd: &mut Command) -> Result<Output> {
    cmd.stdin(Stdio::null())
        .output()
        .with_context(|| format!("failed to spawn `{}` (is it installed?)", describe(cmd)))
}

/// Like [`run_cmd`] but a non-zero exit status is an error whose message
/// contains the command line, the status, stdout and stderr.
pub fn run_ok(cmd: &mut Command) -> Result<Output> {
    let out = run_cmd(cmd)?;
    if !out.status.success() {
        bail!(
            "`{}` failed with {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            describe(cmd),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}

/// Runs `skopeo --insecure-policy ARGS` (any exit status is `Ok`).
pub fn skopeo(args: &[&str]) -> Result<Output> {
    run_cmd(Command::new("skopeo").arg("--insecure-policy").args(args))
}

/// Runs `skopeo --insecure-policy ARGS`; non-zero exit is an error carrying stderr.
pub fn skopeo_ok(args: &[&str]) -> Result<Output> {
    run_ok(Command::new("skopeo").arg("--insecure-policy").args(args))
}

/// Writes into `path` until its filesystem refuses with ENOSPC (a disk filled by
/// another process, for disk-full tests on a small tmpfs). Panics on any other error.
pub fn fill_disk(path: &std::path::Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).expect("create the filler");
    let chunk = vec![0xa5u8; 64 << 10];
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(28), "filling the disk: {e}");
                break;
            }
        }
    }
    let _ = f.sync_all();
}
