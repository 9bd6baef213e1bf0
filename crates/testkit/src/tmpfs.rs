//! A small real filesystem, to run something out of disk space.

use std::path::PathBuf;
use std::process::Command;

/// A tmpfs of `size` (`mount -o size=`, e.g. `"10m"`) on a fresh directory; unmounted
/// on drop. Needs root, like the containerd tests.
pub struct Tmpfs {
    _dir: tempfile::TempDir,
    /// Where it is mounted.
    pub mount: PathBuf,
}

impl Tmpfs {
    pub fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().expect("temp dir");
        let mount = dir.path().join("fs");
        std::fs::create_dir(&mount).expect("mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&mount)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mounting a tmpfs needs root: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs { _dir: dir, mount }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazy: a process still holding a file there must not keep the test from ending.
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
    }
}
