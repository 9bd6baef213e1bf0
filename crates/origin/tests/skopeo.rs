//! Real-client compatibility: skopeo pulls from the origin, umoci unpacks the result.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::process::Command;

use common::*;

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skopeo_copies_and_umoci_unpacks() {
    // scripts/test installs skopeo and umoci; a missing tool is a failure, not a skip.
    assert!(
        have("skopeo"),
        "skopeo is required (scripts/test installs it)"
    );
    let dir = tempfile::tempdir().expect("tmp");
    let img = generate(&dir.path().join("layout"));
    let srv = start(&dir.path().join("layout"), Some("starling/train"), None).await;
    let out = dir.path().join("copy");
    let src = format!("docker://{}/starling/train:train", srv.local_addr());
    let dst = format!("oci:{}:train", out.display());
    let res = tokio::process::Command::new("skopeo")
        .args([
            "--insecure-policy",
            "copy",
            "--src-tls-verify=false",
            &src,
            &dst,
        ])
        .output()
        .await
        .expect("run skopeo");
    assert!(
        res.status.success(),
        "skopeo failed: {}\n{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
    // Same manifest digest on the other side: skopeo copied the image unchanged.
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("index.json")).expect("index"))
            .expect("json");
    assert_eq!(
        idx["manifests"][0]["digest"],
        img.manifest_digest.to_string()
    );
    for l in &img.layers {
        assert!(out.join("blobs/sha256").join(l.digest.hex()).is_file());
    }
    let s = srv.stats().snapshot();
    assert!(s.blob_bytes_sent >= img.layers.iter().map(|l| l.size).sum::<u64>());

    assert!(
        have("umoci"),
        "umoci is required (scripts/test installs it)"
    );
    let bundle = dir.path().join("bundle");
    let res = Command::new("umoci")
        .args(["unpack", "--rootless", "--image"])
        .arg(format!("{}:train", out.display()))
        .arg(&bundle)
        .output()
        .expect("run umoci");
    assert!(
        res.status.success(),
        "umoci failed: {}",
        String::from_utf8_lossy(&res.stderr)
    );
    let f = bundle.join("rootfs/usr/local/cuda/lib64/libcuda-runtime-1-0.so");
    assert_eq!(
        std::fs::metadata(&f).expect("unpacked file").len(),
        300 * 1024 + 17
    );
    assert!(bundle
        .join("rootfs/workspace/config/train-0.yaml")
        .is_file());
}
