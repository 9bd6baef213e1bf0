//! The dashboard in headless Chromium: the page's JS fetches the JSON API and renders
//! node names and byte figures that exist only in the JSON (so the JS ran).
//! Chromium is installed with apt when missing; the test fails if it cannot be.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::process::Command;
use std::sync::Arc;

use cluster::inventory::{Download, SourceBytes};
use cluster::prewarm::{PrewarmRequest, Targets};
use cluster::{router, ClusterConfig, ClusterState, JobStore};
use common::*;

fn chromium() -> String {
    for c in ["chromium", "chromium-browser"] {
        if Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return c.to_owned();
        }
    }
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends", "chromium"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    let ok = install()
        || (Command::new("apt-get")
            .arg("update")
            .status()
            .is_ok_and(|s| s.success())
            && install());
    assert!(
        ok,
        "chromium is missing and `apt-get install -y chromium` failed (scripts/test installs it)"
    );
    "chromium".to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_renders_in_headless_chromium() {
    let state = ClusterState::with_options(
        ClusterConfig::default(),
        JobStore::in_memory().expect("store"),
        None,
        Arc::new(|| NOW),
    );
    let mut a = report("dgx-h100-017", 1, &full(&train()));
    a.images = vec![image_record(
        &train(),
        NOW - 30,
        SourceBytes {
            cache: 0,
            peer: 3 * GIB,
            registry: 100 * MIB,
        },
        42.5,
    )];
    state.ingest(a).expect("a");
    let mut b = report(
        "dgx-h100-018",
        1,
        &[(blob(2, GIB), GIB), (blob(3, 2 * GIB), 123_456_789)],
    );
    b.downloads_in_flight = vec![Download {
        digest: d(3),
        bytes_done: 123_456_789,
        bytes_total: 2 * GIB,
    }];
    state.ingest(b).expect("b");
    state
        .submit_prewarm(PrewarmRequest {
            images: vec!["registry.example.com/ml/train:v1.4.2".into()],
            targets: Targets {
                nodes: vec!["dgx-h100-017".into(), "dgx-h100-018".into()],
                ..Default::default()
            },
            ..Default::default()
        })
        .await
        .expect("prewarm");

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let app = router(state);
    tokio::spawn(async move { axum::serve(listener, app).await });

    let bin = chromium();
    let profile = tempfile::tempdir().expect("profile dir");
    let url = format!("http://127.0.0.1:{port}/");
    let profile_arg = format!("--user-data-dir={}", profile.path().display());
    let out = tokio::task::spawn_blocking(move || {
        Command::new(bin)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                &profile_arg,
                "--virtual-time-budget=5000",
                "--dump-dom",
                &url,
            ])
            .output()
    })
    .await
    .expect("join")
    .expect("run chromium");
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        dom.contains("data-rendered=\"true\""),
        "JS did not render:\n{dom}"
    );
    // Node names, image reference and byte figures come only from the JSON.
    for needle in [
        "<td class=\"name\">dgx-h100-017</td>",
        "<td class=\"name\">dgx-h100-018</td>",
        "registry.example.com/ml/train:v1.4.2",
        "data-bytes=\"3326093072\"", // dgx-h100-017 holds the whole image
        "data-bytes=\"1197198613\"", // dgx-h100-018: 1 GiB + 123,456,789 partial
        ">3.1 GiB</td>",
        ">1.1 GiB</td>",
        "<b>3.0 GiB</b>registry bytes saved", // peer bytes of the last pull
        "<b>100.0 MiB</b>bytes from the registry",
        "42.5 s", // pull time in the sources table
        "#1 registry.example.com/ml/train:v1.4.2",
    ] {
        assert!(
            dom.contains(needle),
            "{needle:?} not in rendered DOM:\n{dom}"
        );
    }
    assert!(
        dom.contains("done 1, pending 1"),
        "job node states not rendered:\n{dom}"
    );
    assert!(
        dom.contains("dgx-h100-018</td><td>117.7 MiB / 2.0 GiB</td>"),
        "swarm row not rendered:\n{dom}"
    );
}
