//! A real `redis-server` (Debian `redis-server`) on a random loopback port, its data in
//! a temp dir: for the tracker's shared-state mode. It can be killed (`kill -9`) and
//! restarted on the same port, as an operator's Redis restart looks to its clients.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tempfile::TempDir;

use crate::process::ChildProc;
use crate::util::free_port;

pub struct RedisServer {
    proc: Option<ChildProc>,
    port: u16,
    password: Option<String>,
    log: PathBuf,
    dir: TempDir,
}

impl RedisServer {
    /// Starts a Redis without persistence (a restart comes back empty, the hardest case
    /// for its clients); panics with its log on failure (test helper).
    pub fn start() -> RedisServer {
        Self::try_start(None).unwrap_or_else(|e| panic!("testkit: redis-server: {e:#}"))
    }

    /// Starts a Redis requiring `password` (`requirepass`).
    pub fn start_with_password(password: &str) -> RedisServer {
        Self::try_start(Some(password.to_owned()))
            .unwrap_or_else(|e| panic!("testkit: redis-server: {e:#}"))
    }

    pub fn try_start(password: Option<String>) -> Result<RedisServer> {
        let dir = tempfile::tempdir().context("temp dir for redis")?;
        let mut r = RedisServer {
            proc: None,
            port: 0,
            password,
            log: dir.path().join("redis.log"),
            dir,
        };
        let mut last = None;
        // A free port can be taken between the probe and the bind: try a few.
        for _ in 0..5 {
            r.port = free_port();
            match r.spawn() {
                Ok(()) => return Ok(r),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("redis-server did not start")))
    }

    fn spawn(&mut self) -> Result<()> {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--port"])
            .arg(self.port.to_string())
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(self.dir.path());
        if let Some(p) = &self.password {
            cmd.args(["--requirepass", p]);
        }
        let mut proc = ChildProc::spawn("redis-server", &mut cmd, &self.log)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Some(exit) = proc.exited() {
                bail!("redis-server {exit}: {}", proc.log_tail(2000));
            }
            if self.ping() {
                self.proc = Some(proc);
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("redis-server not answering: {}", proc.log_tail(2000))
    }

    /// Whether it answers PING (with AUTH first when it has a password).
    pub fn ping(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let mut req = String::new();
        if let Some(p) = &self.password {
            req.push_str(&format!("AUTH {p}\r\n"));
        }
        req.push_str("PING\r\n");
        if s.write_all(req.as_bytes()).is_err() {
            return false;
        }
        let mut buf = [0u8; 256];
        let mut got = Vec::new();
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            if got.windows(7).any(|w| w == b"+PONG\r\n") || got.starts_with(b"-") {
                break;
            }
        }
        got.windows(7).any(|w| w == b"+PONG\r\n")
    }

    /// `redis://[:password@]127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `kill -9`: clients see connections drop and refused.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// Starts it again on the same port, empty (no persistence).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match self.spawn() {
                Ok(()) => return,
                // The port may linger a moment after the kill.
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("testkit: redis-server restart: {e:#}"),
            }
        }
    }

    /// The server log, for failure messages.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}
