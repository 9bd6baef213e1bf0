//! A child process whose stdout+stderr go to a log file and which is killed
//! (and reaped) on drop.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result};

pub(crate) struct ChildProc {
    child: Option<Child>,
    log: PathBuf,
}

impl ChildProc {
    /// Spawns `cmd` with stdin closed and stdout+stderr appended to `log`.
    pub(crate) fn spawn(name: &str, cmd: &mut Command, log: &Path) -> Result<ChildProc> {
        let out = File::options()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening log {}", log.display()))?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .with_context(|| format!("spawning {name} (is it installed?)"))?;
        Ok(ChildProc {
            child: Some(child),
            log: log.to_path_buf(),
        })
    }

    /// `Some(description)` if the process has exited.
    pub(crate) fn exited(&mut self) -> Option<String> {
        match self.child.as_mut().map(|c| c.try_wait()) {
            None => Some("not running (stopped)".into()),
            Some(Ok(Some(status))) => Some(format!("exited with {status}")),
            Some(Ok(None)) => None,
            Some(Err(e)) => Some(format!("wait failed: {e}")),
        }
    }

    /// The last `max` bytes of the log, for error messages.
    pub(crate) fn log_tail(&self, max: usize) -> String {
        log_tail(&self.log, max)
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL + reap. Idempotent.
    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.kill();
    }
}

pub(crate) fn log_tail(path: &Path, max: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let start = bytes.len().saturating_sub(max);
            String::from_utf8_lossy(&bytes[start..]).into_owned()
        }
        Err(e) => format!("<cannot read {}: {e}>", path.display()),
    }
}
