//! Images built with real tools: umoci (layers, whiteouts, opaque dirs, hard links,
//! PAX names), skopeo (docker-archive, zstd recompression, registry push) and a real
//! docker-registry on loopback.
#![allow(clippy::unwrap_used)]
mod common;

use std::path::Path;
use std::process::Command;

use analyze::engine::{Compression, EntryKind};
use analyze::rules::Rule;
use common::*;

const LONG_DIR: &str = "dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd";

fn fill(path: &Path, n: usize, c: u8) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, vec![c; n]).unwrap();
}

/// Builds the image with umoci; returns the layout dir.
fn build_umoci(root: &Path) -> std::path::PathBuf {
    let img = root.join("img");
    let s = root.join("src");
    fill(&s.join("base/usr/bin/gcc"), 4000, b'g');
    fill(&s.join("base/var/lib/apt/lists/x_Packages"), 600, b'l');
    fill(&s.join("base/opt/old/a"), 1000, b'a');
    fill(&s.join("base/opt/old/b"), 2000, b'b');
    fill(&s.join("app/main.py"), 3000, b'm');
    std::fs::hard_link(s.join("app/main.py"), s.join("app/hard.py")).unwrap();
    std::os::unix::fs::symlink("main.py", s.join("app/sym")).unwrap();
    fill(
        &s.join(format!("app/deep/{LONG_DIR}/{}", "f".repeat(110))),
        77,
        b'f',
    );
    fill(&s.join("newold/c"), 100, b'c');
    let image = format!("{}:latest", img.display());
    let umoci = |args: &[&str]| run(Command::new("umoci").args(args));
    umoci(&["init", "--layout", img.to_str().unwrap()]);
    umoci(&["new", "--image", &image]);
    let base = s.join("base");
    umoci(&[
        "insert",
        "--image",
        &image,
        "--history.created_by",
        "RUN apt-get install -y gcc",
        base.to_str().unwrap(),
        "/",
    ]);
    umoci(&[
        "insert",
        "--image",
        &image,
        "--history.created_by",
        "COPY app /app",
        s.join("app").to_str().unwrap(),
        "/app",
    ]);
    umoci(&[
        "insert",
        "--image",
        &image,
        "--history.created_by",
        "RUN rm /app/sym",
        "--whiteout",
        "/app/sym",
    ]);
    umoci(&[
        "insert",
        "--image",
        &image,
        "--history.created_by",
        "RUN pip install torch",
        "--opaque",
        s.join("newold").to_str().unwrap(),
        "/opt/old",
    ]);
    umoci(&[
        "insert",
        "--image",
        &image,
        "--history.created_by",
        "RUN rm -rf /var/lib/apt/lists",
        "--whiteout",
        "/var/lib/apt/lists",
    ]);
    img
}

/// The figures every transport of the umoci image must give.
fn assert_umoci_figures(a: &analyze::Analysis) {
    let r = &a.report;
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(r.layers.len(), 5);
    // 4000+600+1000+2000 + 3000+77 + 100; wasted: apt list 600 + opt/old/{a,b} 3000.
    assert_eq!(r.efficiency.cumulative_bytes, 10_777);
    assert_eq!(r.efficiency.wasted_bytes, 3_600);
    assert_eq!(r.efficiency.kept_bytes, 7_177);
    let ch: Vec<(u64, u64, u64)> = r
        .layers
        .iter()
        .map(|l| (l.changes.added, l.changes.changed, l.changes.deleted))
        .collect();
    assert_eq!(
        ch,
        vec![(4, 0, 0), (4, 0, 0), (0, 0, 1), (1, 0, 2), (0, 0, 1)]
    );
    assert_eq!(r.rule_bytes(Rule::BuildToolchain), 4000);
    assert_eq!(r.rule_bytes(Rule::DeletedLater), 3600);
    assert_eq!(r.rule_bytes(Rule::PackageCache), 0);
    assert_eq!(r.rule_bytes(Rule::LayerOrder), r.layers[3].declared_size);
    assert_eq!(r.cost.update_from_layer, Some(1));
    // Hard link: one file holds the 3000 bytes, the other is a link to it.
    let main = &a.model.tree["app/main.py"];
    let hard = &a.model.tree["app/hard.py"];
    let mut kinds = [main.kind, hard.kind];
    kinds.sort_by_key(|k| format!("{k:?}"));
    assert_eq!(kinds, [EntryKind::File, EntryKind::Hardlink]);
    assert_eq!(main.size + hard.size, 3000);
    // PAX long name.
    assert_eq!(
        a.model.tree[&format!("app/deep/{LONG_DIR}/{}", "f".repeat(110))].size,
        77
    );
    assert!(!a.model.tree.contains_key("app/sym"));
    assert!(a.model.tree.contains_key("opt/old/c") && !a.model.tree.contains_key("opt/old/a"));
    assert!(!a
        .model
        .tree
        .keys()
        .any(|k| k.starts_with("var/lib/apt/lists")));
}

#[test]
fn umoci_layout_docker_archive_and_zstd() {
    let t = tempfile::tempdir().unwrap();
    let img = build_umoci(t.path());
    let a = analyze::analyze(&open(&format!("oci:{}:latest", img.display())), &opts());
    assert_umoci_figures(&a);
    assert_eq!(a.report.finding(Rule::MutableTag).count(), 1);
    assert!(a
        .report
        .layers
        .iter()
        .all(|l| l.compression == Compression::Gzip));

    // docker save format, written by skopeo.
    let archive = t.path().join("img.tar");
    run(Command::new("skopeo").args([
        "copy",
        "-q",
        &format!("oci:{}:latest", img.display()),
        &format!("docker-archive:{}:team/img:v1", archive.display()),
    ]));
    let a = analyze::analyze(&open(archive.to_str().unwrap()), &opts());
    assert_umoci_figures(&a);
    assert!(a
        .report
        .layers
        .iter()
        .all(|l| l.compression == Compression::None));
    assert_eq!(a.report.finding(Rule::MutableTag).count(), 0);

    // zstd layers, recompressed by skopeo.
    let z = t.path().join("zimg");
    run(Command::new("skopeo").args([
        "copy",
        "-q",
        "--dest-compress",
        "--dest-compress-format",
        "zstd",
        &format!("oci:{}:latest", img.display()),
        &format!("oci:{}:z", z.display()),
    ]));
    let a = analyze::analyze(&open(&format!("oci:{}:z", z.display())), &opts());
    assert_umoci_figures(&a);
    assert!(
        a.report
            .layers
            .iter()
            .all(|l| l.compression == Compression::Zstd),
        "{:?}",
        a.report.layers
    );
}

struct Registry {
    child: std::process::Child,
    port: u16,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_registry(dir: &Path) -> Registry {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cfg = dir.join("config.yml");
    std::fs::write(
        &cfg,
        format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            dir.join("data").display()
        ),
    )
    .unwrap();
    let child = Command::new("docker-registry")
        .args(["serve", cfg.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let reg = Registry { child, port };
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return reg;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("docker-registry did not start");
}

#[test]
fn registry_source_with_real_registry() {
    let t = tempfile::tempdir().unwrap();
    let img = build_umoci(t.path());
    let reg = start_registry(t.path());
    let dest = format!("127.0.0.1:{}/team/img:latest", reg.port);
    run(Command::new("skopeo").args([
        "copy",
        "-q",
        "--dest-tls-verify=false",
        &format!("oci:{}:latest", img.display()),
        &format!("docker://{dest}"),
    ]));
    let image = open(&dest);
    let a = analyze::analyze(&image, &opts());
    assert_umoci_figures(&a);
    assert_eq!(a.report.finding(Rule::MutableTag).count(), 1);
    // Pinned by digest: no mutable-tag finding.
    let pinned = format!(
        "127.0.0.1:{}/team/img@{}",
        reg.port,
        image.manifest_digest.clone().unwrap()
    );
    let a = analyze::analyze(&open(&pinned), &opts());
    assert_umoci_figures(&a);
    assert_eq!(a.report.finding(Rule::MutableTag).count(), 0);
    // Unknown repository: a clear error, no panic.
    let err = analyze::source::open(
        &analyze::source::SourceSpec::parse(&format!("127.0.0.1:{}/team/nope:1", reg.port)),
        &Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("404"), "{err}");
}
