//! `starling get oci://…` as a process, against real agents, a real tracker and the
//! real docker-registry holding OCI artifacts pushed by testkit (issue 13); the cluster
//! layer (prewarm, where) and a destination without room.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::process::Command;
use std::time::Duration;

use common::getkit::*;
use testkit::{ArtifactFile, Registry, RegistryAuth, TestArtifact};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_artifact_arrives_as_files_and_the_second_node_takes_it_from_the_swarm() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let big = testkit::random_bytes(6 << 20, 1);
    let small = testkit::random_bytes(300 << 10, 2);
    let loose = testkit::random_bytes(1000, 3);
    let pushed = TestArtifact::push(
        &registry,
        "models/tiny",
        "v1",
        &[
            ArtifactFile {
                title: Some("shards/model-00001.safetensors"),
                bytes: &big,
            },
            ArtifactFile {
                title: Some("config.json"),
                bytes: &small,
            },
            ArtifactFile {
                title: None,
                bytes: &loose,
            },
        ],
    )
    .unwrap();
    let t = tracker(dir.path()).await;
    let a1 = agent(dir.path(), "n1", Some(&t.url()), &registry, &[]).await;
    let a2 = agent(dir.path(), "n2", Some(&t.url()), &registry, &[]).await;
    let source = format!("oci://{}/models/tiny:v1", registry.host());

    let d1 = dir.path().join("dest1");
    let r1 = report(
        &get(&[
            &source,
            d1.to_str().unwrap(),
            "--agent",
            &a1.url(),
            "--json",
        ])
        .await,
    );
    assert_eq!(r1["via"], "agent");
    assert_eq!(r1["manifest_digest"], pushed.manifest_digest);
    assert_eq!(
        std::fs::read(d1.join("shards/model-00001.safetensors")).unwrap(),
        big
    );
    assert_eq!(std::fs::read(d1.join("config.json")).unwrap(), small);
    assert_eq!(
        listing(&d1),
        vec![
            "config.json".to_owned(),
            "shards/model-00001.safetensors".to_owned()
        ],
        "the untitled layer is not written, no partial file is left"
    );
    assert_eq!(r1["skipped_untitled"].as_array().unwrap().len(), 1);
    assert_eq!(file_report(&r1, "config.json")["verified_digest"], true);

    // The second node: the big file's pieces come from the first node.
    let d2 = dir.path().join("dest2");
    let r2 = report(
        &get(&[
            &source,
            d2.to_str().unwrap(),
            "--agent",
            &a2.url(),
            "--json",
        ])
        .await,
    );
    assert_eq!(
        std::fs::read(d2.join("shards/model-00001.safetensors")).unwrap(),
        big
    );
    assert_eq!(
        file_report(&r2, "shards/model-00001.safetensors")["source"],
        "swarm"
    );
    assert!(
        r2["agent_received"]["peers"].as_u64().unwrap() >= big.len() as u64,
        "the second agent took the big file from its peer: {r2}"
    );
    let registry_bytes = common::metric(&a1.url(), "starling_agent_upstream_bytes_total").await
        + common::metric(&a2.url(), "starling_agent_upstream_bytes_total").await;
    // The small file is under the P2P threshold: each agent reads it from the registry.
    assert_eq!(
        registry_bytes,
        (big.len() + 2 * small.len()) as u64,
        "the registry served the big file once"
    );

    // Again on the first node: everything is already in DEST.
    let r3 = report(
        &get(&[
            &source,
            d1.to_str().unwrap(),
            "--agent",
            &a1.url(),
            "--json",
        ])
        .await,
    );
    assert_eq!(r3["fetched"], 0);
    assert_eq!(file_report(&r3, "config.json")["already_present"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn titles_that_leave_dest_are_refused_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let a = agent(dir.path(), "n1", None, &registry, &[]).await;
    for (i, title) in ["../escape.bin", "/etc/escape.bin", "a/../../escape.bin"]
        .iter()
        .enumerate()
    {
        let bytes = testkit::random_bytes(2048, 10 + i as u64);
        let tag = format!("t{i}");
        TestArtifact::push(
            &registry,
            "models/evil",
            &tag,
            &[
                ArtifactFile {
                    title: Some("fine.bin"),
                    bytes: &bytes,
                },
                ArtifactFile {
                    title: Some(title),
                    bytes: &bytes,
                },
            ],
        )
        .unwrap();
        let dest = dir.path().join(format!("d{i}/inner"));
        let source = format!("oci://{}/models/evil:{tag}", registry.host());
        let out = get(&[&source, dest.to_str().unwrap(), "--agent", &a.url()]).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{title} accepted");
        assert!(stderr.contains("refused"), "{title}: {stderr}");
        assert_eq!(
            listing(&dir.path().join(format!("d{i}"))),
            Vec::<String>::new(),
            "{title}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_an_agent_it_downloads_directly_and_says_so_and_a_404_is_clear() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let bytes = testkit::random_bytes(3 << 20, 20);
    TestArtifact::push(
        &registry,
        "models/direct",
        "v1",
        &[ArtifactFile {
            title: Some("w.bin"),
            bytes: &bytes,
        }],
    )
    .unwrap();
    let nobody = format!("http://127.0.0.1:{}", testkit::free_port());
    let dest = dir.path().join("d");
    let source = format!("oci://{}/models/direct:v1", registry.host());
    let out = get(&[
        &source,
        dest.to_str().unwrap(),
        "--agent",
        &nobody,
        "--json",
    ])
    .await;
    assert!(String::from_utf8_lossy(&out.stderr).contains("downloading directly"));
    let r = report(&out);
    assert_eq!(r["via"], "direct");
    assert_eq!(std::fs::read(dest.join("w.bin")).unwrap(), bytes);

    let a = agent(dir.path(), "n1", None, &registry, &[]).await;
    let missing = format!("oci://{}/models/direct:nope", registry.host());
    for agent_url in [a.url(), nobody] {
        let dest = dir.path().join("missing");
        let out = get(&[&missing, dest.to_str().unwrap(), "--agent", &agent_url]).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            stderr.contains("404")
                || stderr.contains("MANIFEST_UNKNOWN")
                || stderr.contains("unknown"),
            "{stderr}"
        );
        assert_eq!(listing(&dest), Vec::<String>::new());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_interrupted_get_resumes_and_a_corrupt_partial_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let bytes = testkit::random_bytes(24 << 20, 30);
    let pushed = TestArtifact::push(
        &registry,
        "models/resume",
        "v1",
        &[ArtifactFile {
            title: Some("big.bin"),
            bytes: &bytes,
        }],
    )
    .unwrap();
    // A slow node link, so the get is still running when it is killed.
    let a = agent(
        dir.path(),
        "n1",
        None,
        &registry,
        &["--download-limit", "4MiB"],
    )
    .await;
    let dest = dir.path().join("d");
    let source = format!("oci://{}/models/resume:v1", registry.host());
    let digest = oci::Digest::parse(&pushed.layers[0].1).unwrap();
    let partial = dest.join(format!(".big.bin.{}.starling-partial", &digest.hex()[..16]));
    let mut child = Command::new(env!("CARGO_BIN_EXE_starling"))
        .args(["get", &source, dest.to_str().unwrap(), "--agent", &a.url()])
        .env("STARLING_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut seen = 0;
    for _ in 0..400 {
        seen = std::fs::metadata(&partial).map_or(0, |m| m.len());
        if seen >= 2 << 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        seen >= 2 << 20,
        "the get wrote {seen} bytes before the kill"
    );
    assert!(!dest.join("big.bin").exists());
    let kept = std::fs::metadata(&partial).unwrap().len();
    let r = report(
        &get(&[
            &source,
            dest.to_str().unwrap(),
            "--agent",
            &a.url(),
            "--json",
        ])
        .await,
    );
    let f = file_report(&r, "big.bin");
    assert_eq!(f["resumed_from"].as_u64().unwrap(), kept);
    assert_eq!(f["fetched"].as_u64().unwrap(), bytes.len() as u64 - kept);
    assert_eq!(std::fs::read(dest.join("big.bin")).unwrap(), bytes);
    assert_eq!(listing(&dest), vec!["big.bin".to_owned()]);

    // A partial whose bytes are wrong: the digest check fails, nothing is kept.
    let dest2 = dir.path().join("d2");
    std::fs::create_dir_all(&dest2).unwrap();
    let partial2 = dest2.join(partial.file_name().unwrap());
    let mut wrong = bytes[..1 << 20].to_vec();
    wrong[100] ^= 0xff;
    std::fs::write(&partial2, &wrong).unwrap();
    let out = get(&[&source, dest2.to_str().unwrap(), "--agent", &a.url()]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not match its digest"));
    assert_eq!(listing(&dest2), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_artifact_prewarmed_onto_a_selector_is_found_by_where() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let bytes = testkit::random_bytes(8 << 20, 80);
    TestArtifact::push(
        &registry,
        "models/warm",
        "v1",
        &[ArtifactFile {
            title: Some("w.bin"),
            bytes: &bytes,
        }],
    )
    .unwrap();
    let host = registry.host();
    let t = common::start_tracker(
        dir.path(),
        &[
            "--cluster-token",
            TOKEN,
            "--registry-endpoint",
            &format!("{host}={}", registry.url()),
        ],
        &[],
    )
    .await;
    let mut agents = Vec::new();
    for (i, gpu) in ["h100", "h100", "a100"].iter().enumerate() {
        let label = format!("gpu={gpu}");
        agents.push(
            agent(
                dir.path(),
                &format!("n{i}"),
                Some(&t.url()),
                &registry,
                &["--label", &label],
            )
            .await,
        );
    }
    let source = format!("oci://{host}/models/warm:v1");
    let tracker_url = t.url();
    wait_for_nodes(&tracker_url, 3).await;
    let out = cli(&[
        "prewarm",
        "--tracker",
        &tracker_url,
        &source,
        "--selector",
        "gpu=h100",
        "--wait",
    ])
    .await;
    assert!(
        out.status.success(),
        "prewarm: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut warm = Vec::new();
    for _ in 0..100 {
        let out = cli(&["where", "--tracker", &tracker_url, &source, "--json"]).await;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        warm = v["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|n| n["bytes_held"].as_u64() >= Some(bytes.len() as u64))
            .filter_map(|n| n["node"].as_str().map(str::to_owned))
            .collect();
        warm.sort();
        if warm == ["n0", "n1"] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        warm,
        ["n0", "n1"],
        "where finds the artifact on the h100 nodes only"
    );
    // A URL's key is asked of an agent first: one that may not reach the origin
    // refuses, and nothing is submitted.
    let agent0 = agents[0].url();
    let out = cli(&[
        "prewarm",
        "--tracker",
        &tracker_url,
        "--agent",
        &agent0,
        "https://x.example/w.bin?sig=1",
    ])
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("403") && !stderr.contains("sig=1"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_destination_without_room_is_refused_before_the_first_byte() {
    let dir = tempfile::tempdir().unwrap();
    let Origin {
        registry,
        nginx,
        bytes,
    } = origin_with_file(6 << 20, 90).await;
    TestArtifact::push(
        &registry,
        "models/big",
        "v1",
        &[
            ArtifactFile {
                title: Some("a.bin"),
                bytes: &bytes[..3 << 20],
            },
            ArtifactFile {
                title: Some("b.bin"),
                bytes: &bytes[3 << 20..],
            },
        ],
    )
    .unwrap();
    let a = agent(
        dir.path(),
        "n1",
        None,
        &registry,
        &["--allowed-file-origin", &nginx.origin()],
    )
    .await;
    let fs = Tmpfs::mount("4m");
    // Each file fits, both do not: refused as a whole, before anything is written.
    let source = format!("oci://{}/models/big:v1", registry.host());
    let out = get(&[&source, fs.mount.to_str().unwrap(), "--agent", &a.url()]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("not enough space"), "{stderr}");
    // (The agent may still prefetch the layers into its own cache on the manifest GET:
    // DEST is what must stay untouched.)
    assert_eq!(listing(&fs.mount), Vec::<String>::new());
    // A URL's size is known from its first answer: refused then, nothing written.
    let out = get(&[
        &nginx.url("w.bin"),
        fs.mount.to_str().unwrap(),
        "--agent",
        &a.url(),
    ])
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("free"), "{stderr}");
    assert_eq!(listing(&fs.mount), Vec::<String>::new());
}
