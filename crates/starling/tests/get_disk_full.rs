//! `starling get` when a disk fills up in the middle of a file (another process takes
//! the free space after the free-space check passed): DEST's filesystem, then the
//! agent's cache filesystem. Small tmpfs mounts, so this needs root like the agent's
//! disk-full tests.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::path::Path;
use std::time::Duration;

use common::getkit::*;
use testkit::fill_disk;

async fn wait_for_len(path: &Path, at_least: u64) {
    for _ in 0..800 {
        if std::fs::metadata(path).is_ok_and(|m| m.len() >= at_least) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{} never reached {at_least} bytes", path.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_disk_that_fills_mid_get_fails_it_clearly_or_degrades_and_keeps_nothing_half_done() {
    let dir = tempfile::tempdir().unwrap();
    let Origin {
        registry,
        nginx,
        bytes,
    } = origin_with_file(12 << 20, 120).await;
    nginx.put("small.bin", &bytes[..100_000]);

    // 1. DEST fills up: the get fails naming the full disk, exit status 1, no partial
    //    and no DEST left; the agent (its cache elsewhere) keeps serving.
    let a = agent(
        dir.path(),
        "n1",
        None,
        &registry,
        &[
            "--allowed-file-origin",
            &nginx.origin(),
            "--download-limit",
            "2MiB",
        ],
    )
    .await;
    let dest_fs = Tmpfs::mount("16m");
    let target = dest_fs.mount.join("w.bin");
    let run = {
        let (url, target, agent_url) = (nginx.url("w.bin"), target.display().to_string(), a.url());
        tokio::spawn(async move { get(&[&url, &target, "--agent", &agent_url]).await })
    };
    wait_for_len(&dest_fs.mount.join(".w.bin.url.starling-partial"), 2 << 20).await;
    fill_disk(&dest_fs.mount.join("filler"));
    let out = run.await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("the disk is full"), "{stderr}");
    assert_eq!(listing(&dest_fs.mount), vec!["filler".to_owned()]);
    std::fs::remove_file(dest_fs.mount.join("filler")).unwrap();
    let r = report(
        &get(&[
            &nginx.url("w.bin"),
            target.to_str().unwrap(),
            "--agent",
            &a.url(),
            "--json",
        ])
        .await,
    );
    assert_eq!(std::fs::read(&target).unwrap(), bytes);
    assert_eq!(r["files"][0]["resumed_from"], 0);
    drop(a);

    // 2. The agent's cache fills up: the agent passes the rest through, the get
    //    completes with the right bytes, and the cache holds no entry for the file
    //    (nothing complete-looking that is not the whole file), no partial either.
    let cache_fs = Tmpfs::mount("24m");
    let cache_dir = cache_fs.mount.join("cache");
    let slow = [
        "--allowed-file-origin",
        &nginx.origin(),
        "--download-limit",
        "2MiB",
    ];
    let b = agent_with_cache(dir.path(), "n2", None, &registry, &cache_dir, &slow).await;
    let target = dir.path().join("d2/w.bin");
    let run = {
        let (url, target, agent_url) = (nginx.url("w.bin"), target.display().to_string(), b.url());
        tokio::spawn(async move { get(&[&url, &target, "--agent", &agent_url, "--json"]).await })
    };
    wait_for_len(&dir.path().join("d2/.w.bin.url.starling-partial"), 2 << 20).await;
    fill_disk(&cache_fs.mount.join("filler"));
    let out = run.await.unwrap();
    let r = report(&out);
    assert_eq!(std::fs::read(&target).unwrap(), bytes);
    assert!(
        common::metric(&b.url(), "starling_agent_disk_full_total").await >= 1,
        "the agent's write really failed with ENOSPC"
    );
    let key = oci::Digest::parse(r["files"][0]["key"].as_str().unwrap()).unwrap();
    let entry = cache_dir.join("blobs/sha256").join(key.hex());
    assert!(
        std::fs::metadata(&entry).map_or(true, |m| m.len() == bytes.len() as u64),
        "no short entry under the file's key"
    );
    if entry.exists() {
        assert_eq!(std::fs::read(&entry).unwrap(), bytes);
    }
    let partials: Vec<String> = listing(&cache_dir.join("partial"));
    assert_eq!(
        partials,
        Vec::<String>::new(),
        "no partial download holding the disk"
    );
    // Still serving while the disk stays full: another file, and this one again.
    let small = dir.path().join("d3/small.bin");
    report(
        &get(&[
            &nginx.url("small.bin"),
            small.to_str().unwrap(),
            "--agent",
            &b.url(),
            "--json",
        ])
        .await,
    );
    assert_eq!(std::fs::read(&small).unwrap(), &bytes[..100_000]);
    std::fs::remove_file(&target).unwrap();
    report(
        &get(&[
            &nginx.url("w.bin"),
            target.to_str().unwrap(),
            "--agent",
            &b.url(),
            "--json",
        ])
        .await,
    );
    assert_eq!(std::fs::read(&target).unwrap(), bytes);
}
