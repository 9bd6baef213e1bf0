//! `starling get http(s)://…` as a process: a real nginx origin, agents and a tracker
//! (issue 13): one origin read for many nodes, presigned queries, digests, bad URLs,
//! an origin changing mid-get, a peer killed mid-file, resume against a version.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::getkit::*;
use testkit::{Registry, RegistryAuth};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_url_reaches_two_nodes_with_one_origin_read_whatever_its_query() {
    let dir = tempfile::tempdir().unwrap();
    let Origin {
        registry,
        nginx,
        bytes,
    } = origin_with_file(6 << 20, 40).await;
    let t = tracker(dir.path()).await;
    let allow = ["--allowed-file-origin", &nginx.origin()];
    let a1 = agent(dir.path(), "n1", Some(&t.url()), &registry, &allow).await;
    let a2 = agent(dir.path(), "n2", Some(&t.url()), &registry, &allow).await;

    let d1 = dir.path().join("d1/weights.bin");
    let u1 = format!(
        "{}?X-Amz-Signature=aaa&X-Amz-Expires=60",
        nginx.url("w.bin")
    );
    let r1 = report(&get(&[&u1, d1.to_str().unwrap(), "--agent", &a1.url(), "--json"]).await);
    assert_eq!(std::fs::read(&d1).unwrap(), bytes);
    assert_eq!(r1["via"], "agent");
    assert_eq!(r1["files"][0]["verified_digest"], false);

    // Another presigned query for the same file: same identity, taken from the peer.
    let d2 = dir.path().join("d2");
    std::fs::create_dir_all(&d2).unwrap();
    let u2 = format!("{}?X-Amz-Signature=bbb", nginx.url("w.bin"));
    let r2 = report(&get(&[&u2, d2.to_str().unwrap(), "--agent", &a2.url(), "--json"]).await);
    assert_eq!(std::fs::read(d2.join("w.bin")).unwrap(), bytes);
    assert_eq!(r2["files"][0]["source"], "swarm");
    assert!(
        r2["agent_received"]["peers"].as_u64().unwrap() >= bytes.len() as u64,
        "{r2}"
    );
    let origin_bytes = nginx.bytes_sent("w.bin");
    assert!(
        origin_bytes <= bytes.len() as u64 + 16,
        "the origin sent the file once (plus one-byte probes): {origin_bytes}"
    );

    // The inventory knows which nodes hold the file: `where` by URL (the agent names
    // the key) and by the key the report gave.
    let key = r2["files"][0]["key"]
        .as_str()
        .expect("the agent named the key")
        .to_owned();
    let mut holders = Vec::new();
    for _ in 0..100 {
        let out = Command::new(env!("CARGO_BIN_EXE_starling"))
            .args([
                "where",
                "--tracker",
                &t.url(),
                "--agent",
                &a1.url(),
                &u2,
                "--json",
            ])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        holders = v["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|n| n["bytes_held"].as_u64() == Some(bytes.len() as u64))
            .filter_map(|n| n["node"].as_str().map(str::to_owned))
            .collect();
        holders.sort();
        if holders == ["n1", "n2"] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(holders, ["n1", "n2"], "where finds the file on both nodes");
    let out = Command::new(env!("CARGO_BIN_EXE_starling"))
        .args(["where", "--tracker", &t.url(), &key, "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["nodes"].as_array().map(Vec::len), Some(2), "{v}");
    // The file's bytes were never checked against a content digest: `/v2` does not
    // serve them under their key as a blob.
    let blob = reqwest::get(format!(
        "{}/v2/any/repo/blobs/{key}?ns={}",
        a1.url(),
        registry.host()
    ))
    .await
    .unwrap();
    assert_eq!(blob.status(), 404);
    // The ranking API (what the scheduler extender uses) counts the file's bytes.
    let rank: serde_json::Value = reqwest::Client::new()
        .post(format!("{}/api/v1/rank", t.url()))
        .json(&serde_json::json!({"image": format!("files.starling.invalid/file@{key}")}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let held: Vec<u64> = rank["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["bytes_held"].as_u64())
        .collect();
    assert_eq!(held, vec![bytes.len() as u64; 2], "{rank}");

    // With the right digest the whole file is verified; a wrong one leaves nothing.
    let good = oci::Digest::of(&bytes).to_string();
    let d3 = dir.path().join("d3/w.bin");
    let r3 = report(
        &get(&[
            &u1,
            d3.to_str().unwrap(),
            "--agent",
            &a1.url(),
            "--digest",
            &good,
            "--json",
        ])
        .await,
    );
    assert_eq!(r3["files"][0]["verified_digest"], true);
    assert_eq!(std::fs::read(&d3).unwrap(), bytes);
    let wrong = oci::Digest::of(b"something else").to_string();
    let d4 = dir.path().join("d4");
    std::fs::create_dir_all(&d4).unwrap();
    for agent_url in [
        a2.url(),
        format!("http://127.0.0.1:{}", testkit::free_port()),
    ] {
        let out = get(&[
            &u1,
            d4.to_str().unwrap(),
            "--agent",
            &agent_url,
            "--digest",
            &wrong,
        ])
        .await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "wrong digest accepted via {agent_url}"
        );
        assert!(
            stderr.contains("does not match") || stderr.contains("verification"),
            "{agent_url}: {stderr}"
        );
        assert_eq!(listing(&d4), Vec::<String>::new());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_reading_over_two_origin_connections_delivers_the_file_whole() {
    // Past 256 MiB the elected source reads over two connections, in runs of
    // neighbouring pieces near the front (`swarm::pieces::plan_registry_runs`), each its
    // own Range GET; the runs must meet exactly, in order, with one origin copy. (The
    // size comes from the agent's probe, so no open-ended first GET is cut short: that
    // cost the origin 2-5 % more, varying with load.)
    let dir = tempfile::tempdir().unwrap();
    let size = (256 << 20) + (16 << 20) + 12_345;
    let Origin {
        registry,
        nginx,
        bytes,
    } = origin_with_file(size, 41).await;
    let t = tracker(dir.path()).await;
    let allow = ["--allowed-file-origin", &nginx.origin()];
    let a = agent(dir.path(), "n1", Some(&t.url()), &registry, &allow).await;
    let dest = dir.path().join("d/w.bin");
    let r = report(
        &get(&[
            &nginx.url("w.bin"),
            dest.to_str().unwrap(),
            "--agent",
            &a.url(),
            "--json",
        ])
        .await,
    );
    assert_eq!(r["files"][0]["source"], "swarm", "{r}");
    let got = std::fs::read(&dest).unwrap();
    assert!(got == bytes, "the file differs from the origin's");
    let responses = nginx.body_responses("w.bin");
    assert!(
        responses > 2,
        "runs are bounded, each its own GET (two halves before): {responses}"
    );
    let sent = nginx.bytes_sent("w.bin");
    assert!(
        sent <= size as u64 + 16,
        "one origin copy (plus one-byte probes): {sent} of {size}"
    );

    // Named by its digest, the file is in a swarm of its own (so read again, by
    // another node), and that swarm's key binds the size too: again one copy.
    let b = agent(dir.path(), "n2", Some(&t.url()), &registry, &allow).await;
    let dest = dir.path().join("d2/w.bin");
    let digest = oci::Digest::of(&bytes).to_string();
    let r = report(
        &get(&[
            &nginx.url("w.bin"),
            dest.to_str().unwrap(),
            "--agent",
            &b.url(),
            "--digest",
            &digest,
            "--json",
        ])
        .await,
    );
    assert_eq!(r["files"][0]["verified_digest"], true, "{r}");
    let second = nginx.bytes_sent("w.bin") - sent;
    assert!(
        second <= size as u64 + 16,
        "one origin copy with --digest (plus one-byte probes): {second} of {size}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_file_named_by_its_digest_is_seeded_in_its_own_swarm_after_the_tracker_restarts() {
    // A file named by its digest has a swarm of its own (URL, version and digest), not
    // the digest's; a node holding it says so in its seeding announces, so a get after
    // that swarm's members left (here: a tracker that lost them) takes the file from
    // that node instead of the origin.
    let dir = tempfile::tempdir().unwrap();
    let Origin {
        registry,
        nginx,
        bytes,
    } = origin_with_file(6 << 20, 42).await;
    let mut t = tracker(dir.path()).await;
    let allow = ["--allowed-file-origin", &nginx.origin()];
    let a1 = agent(dir.path(), "n1", Some(&t.url()), &registry, &allow).await;
    let a2 = agent(dir.path(), "n2", Some(&t.url()), &registry, &allow).await;
    let digest = oci::Digest::of(&bytes).to_string();
    let url = nginx.url("w.bin");
    let fetch = |agent_url: String, dest: std::path::PathBuf| {
        let (url, digest) = (url.clone(), digest.clone());
        async move {
            let dest = dest.display().to_string();
            report(
                &get(&[
                    &url, &dest, "--agent", &agent_url, "--digest", &digest, "--json",
                ])
                .await,
            )
        }
    };
    let r1 = fetch(a1.url(), dir.path().join("d1/w.bin")).await;
    assert_eq!(r1["files"][0]["verified_digest"], true, "{r1}");

    t.kill9();
    t.restart();
    common::ready(&t.url()).await;
    // n1 seeds two swarms: the digest's and the file's.
    let mut seeded = 0;
    for _ in 0..200 {
        let swarms: serde_json::Value = reqwest::Client::new()
            .get(format!("{}/swarm/v1/swarms", t.url()))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap_or_default();
        seeded = swarms
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["complete"] == 1 && s["size"] == bytes.len())
            .count();
        if seeded == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(seeded, 2, "n1 seeds the digest's swarm and the file's");

    let r2 = fetch(a2.url(), dir.path().join("d2/w.bin")).await;
    assert_eq!(r2["files"][0]["verified_digest"], true, "{r2}");
    assert_eq!(r2["files"][0]["source"], "swarm", "{r2}");
    assert_eq!(std::fs::read(dir.path().join("d2/w.bin")).unwrap(), bytes);
    let origin_bytes = nginx.bytes_sent("w.bin");
    assert!(
        origin_bytes <= bytes.len() as u64 + 16,
        "the origin sent the file once (plus one-byte probes): {origin_bytes}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_urls_get_clear_errors_and_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let nginx = blocking(Nginx::start).await;
    nginx.put("w.bin", &testkit::random_bytes(100_000, 50));
    let a = agent(
        dir.path(),
        "n1",
        None,
        &registry,
        &["--allowed-file-origin", &nginx.origin()],
    )
    .await;
    let dest = dir.path().join("d");
    std::fs::create_dir_all(&dest).unwrap();

    let out = get(&[
        &nginx.url("missing.bin"),
        dest.to_str().unwrap(),
        "--agent",
        &a.url(),
    ])
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("404"), "{stderr}");

    // An origin the agent was not told to reach: refused before anything is sent.
    let other = Nginx::start();
    other.put("w.bin", b"x");
    let out = get(&[
        &other.url("w.bin"),
        dest.to_str().unwrap(),
        "--agent",
        &a.url(),
    ])
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("403") && stderr.contains("file_origins"),
        "{stderr}"
    );
    assert_eq!(other.bytes_sent("w.bin"), 0);
    assert_eq!(listing(&dest), Vec::<String>::new());

    // No agent: straight from the origin, said so.
    let out = get(&[
        &nginx.url("w.bin"),
        dest.to_str().unwrap(),
        "--agent",
        &format!("http://127.0.0.1:{}", testkit::free_port()),
        "--json",
    ])
    .await;
    assert!(String::from_utf8_lossy(&out.stderr).contains("downloading directly"));
    assert_eq!(report(&out)["via"], "direct");
    assert_eq!(listing(&dest), vec!["w.bin".to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_origin_that_rewrites_the_file_mid_get_fails_it_and_nothing_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let t = tracker(dir.path()).await;
    // A lone agent, then a swarm member (the tracker elects it source).
    for (round, tracker_url) in [None, Some(t.url())].into_iter().enumerate() {
        origin_rewrite_round(dir.path(), round, tracker_url.as_deref()).await;
    }
}

async fn origin_rewrite_round(dir: &Path, round: usize, tracker_url: Option<&str>) {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let nginx = blocking(Nginx::start).await;
    let size = 12 << 20;
    nginx.put("w.bin", &testkit::random_bytes(size, 60));
    let a = agent(
        dir,
        &format!("r{round}"),
        tracker_url,
        &registry,
        &[
            "--allowed-file-origin",
            &nginx.origin(),
            "--download-limit",
            "3MiB",
        ],
    )
    .await;
    let dest = dir.join(format!("d{round}"));
    std::fs::create_dir_all(&dest).unwrap();
    let url = nginx.url("w.bin");
    let target = dest.join("w.bin");
    let partial = dest.join(".w.bin.url.starling-partial");
    let run = {
        let (url, target) = (url.clone(), target.display().to_string());
        let agent_url = a.url();
        tokio::spawn(async move { get(&[&url, &target, "--agent", &agent_url]).await })
    };
    for _ in 0..400 {
        if std::fs::metadata(&partial).is_ok_and(|m| m.len() >= 1 << 20) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // Rewritten in place (same inode, so the running response reads the new bytes),
    // with a new modification time, so the origin's ETag changes.
    {
        use std::io::Write;
        let path = nginx.dir.path().join("www/w.bin");
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all(&testkit::random_bytes(size, 61)).unwrap();
        f.set_modified(std::time::SystemTime::now() + Duration::from_secs(100))
            .unwrap();
    }
    let out = run.await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a mixed file was accepted");
    assert!(stderr.contains("changed"), "{stderr}");
    assert_eq!(listing(&dest), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_node_serving_the_pieces_dies_mid_file_and_the_get_still_completes() {
    let dir = tempfile::tempdir().unwrap();
    let Origin {
        registry,
        nginx,
        bytes,
    } = origin_with_file(24 << 20, 70).await;
    let t = tracker(dir.path()).await;
    let allow = ["--allowed-file-origin", &nginx.origin()];
    let mut seeder = agent(dir.path(), "n1", Some(&t.url()), &registry, &allow).await;
    let d1 = dir.path().join("d1/w.bin");
    report(
        &get(&[
            &nginx.url("w.bin"),
            d1.to_str().unwrap(),
            "--agent",
            &seeder.url(),
            "--json",
        ])
        .await,
    );
    let slow = [&allow[..], &["--download-limit", "4MiB"]].concat();
    let taker = agent(dir.path(), "n2", Some(&t.url()), &registry, &slow).await;
    let d2 = dir.path().join("d2/w.bin");
    let run = {
        let (url, target, agent_url) = (nginx.url("w.bin"), d2.display().to_string(), taker.url());
        tokio::spawn(async move { get(&[&url, &target, "--agent", &agent_url, "--json"]).await })
    };
    let mut from_peer = 0;
    for _ in 0..400 {
        from_peer = common::metric(&taker.url(), "starling_agent_p2p_peer_bytes_total").await;
        if from_peer >= 4 << 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        from_peer >= 4 << 20,
        "pieces came from the seeder before the kill"
    );
    seeder.kill9();
    let r = report(&run.await.unwrap());
    assert_eq!(std::fs::read(&d2).unwrap(), bytes);
    let got = &r["agent_received"];
    assert!(
        got["peers"].as_u64().unwrap() < bytes.len() as u64 && got["origin"].as_u64().unwrap() > 0,
        "the rest came from the origin after the seeder died: {got}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_urls_partial_resumes_only_against_the_version_it_started_with() {
    let nginx = blocking(Nginx::start).await;
    let bytes = testkit::random_bytes(2 << 20, 95);
    nginx.put("w.bin", &bytes);
    let etag = reqwest::get(nginx.url("w.bin"))
        .await
        .unwrap()
        .headers()
        .get("etag")
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("w.bin");
    let partial = dir.path().join(".w.bin.url.starling-partial");
    let id = dir.path().join(".w.bin.url.starling-partial.id");
    let nobody = format!("http://127.0.0.1:{}", testkit::free_port());
    // Same version: resumed where the partial ends.
    std::fs::write(&partial, &bytes[..1 << 20]).unwrap();
    std::fs::write(&id, &etag).unwrap();
    let r = report(
        &get(&[
            &nginx.url("w.bin"),
            dest.to_str().unwrap(),
            "--agent",
            &nobody,
            "--json",
        ])
        .await,
    );
    assert_eq!(r["files"][0]["resumed_from"], 1 << 20);
    assert_eq!(std::fs::read(&dest).unwrap(), bytes);
    assert_eq!(listing(dir.path()), vec!["w.bin".to_owned()]);
    // A partial of another version: refused and removed; the next get starts over.
    std::fs::remove_file(&dest).unwrap();
    std::fs::write(&partial, &bytes[..1 << 20]).unwrap();
    std::fs::write(&id, "\"an-older-version\"").unwrap();
    let out = get(&[
        &nginx.url("w.bin"),
        dest.to_str().unwrap(),
        "--agent",
        &nobody,
    ])
    .await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("changed"));
    assert_eq!(listing(dir.path()), Vec::<String>::new());
    let r = report(
        &get(&[
            &nginx.url("w.bin"),
            dest.to_str().unwrap(),
            "--agent",
            &nobody,
            "--json",
        ])
        .await,
    );
    assert_eq!(r["files"][0]["resumed_from"], 0);
    assert_eq!(std::fs::read(&dest).unwrap(), bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_url_prewarmed_onto_a_selector_is_then_served_from_each_nodes_cache() {
    let dir = tempfile::tempdir().unwrap();
    let Origin {
        registry,
        nginx,
        bytes,
    } = origin_with_file(8 << 20, 110).await;
    let t = tracker(dir.path()).await;
    let allow = ["--allowed-file-origin", &nginx.origin()];
    let mut agents = Vec::new();
    for (i, gpu) in ["h100", "h100", "a100"].iter().enumerate() {
        let label = format!("gpu={gpu}");
        // The a100 node may not contact the origin: a prewarm there must fail.
        let extra: Vec<&str> = if i < 2 {
            [&allow[..], &["--label", &label]].concat()
        } else {
            vec!["--label", &label]
        };
        agents.push(
            agent(
                dir.path(),
                &format!("n{i}"),
                Some(&t.url()),
                &registry,
                &extra,
            )
            .await,
        );
    }
    let tracker_url = t.url();
    wait_for_nodes(&tracker_url, 3).await;
    let signed = format!("{}?X-Amz-Signature=secret-sig-1", nginx.url("w.bin"));
    let out = cli(&[
        "prewarm",
        "--tracker",
        &tracker_url,
        "--agent",
        &agents[0].url(),
        &signed,
        "--selector",
        "gpu=h100",
        "--node-limit",
        "4MiB",
        "--wait",
        "--json",
    ])
    .await;
    assert!(
        out.status.success(),
        "prewarm: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Asking the key read one byte; the two nodes then read the file about once.
    let after_prewarm = nginx.bytes_sent("w.bin");
    assert!(
        after_prewarm >= bytes.len() as u64 && after_prewarm <= bytes.len() as u64 + 64,
        "the origin sent the file once for two nodes: {after_prewarm}\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        std::fs::read_to_string(nginx.dir.path().join("access.log")).unwrap_or_default()
    );
    // Job views do not show the presigned signature; the rate limit reached the nodes.
    let views = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!views.contains("secret-sig-1"), "{views}");
    let job: serde_json::Value = serde_json::from_str(views.lines().last().unwrap()).unwrap();
    assert_eq!(
        job["request"]["files"][0]["url"],
        format!("{}?redacted", nginx.url("w.bin"))
    );
    for n in ["n0", "n1"] {
        assert_eq!(job["nodes"][n]["state"], "done", "{job}");
        assert_eq!(job["nodes"][n]["rate_bytes_per_sec"], 4 << 20, "{job}");
    }
    // Each target pinned the file until the job's TTL: GC keeps it for the job.
    let key = job["images"][0]["manifest_digest"]
        .as_str()
        .unwrap()
        .to_owned();
    for a in agents.iter().take(2) {
        let cache: serde_json::Value = reqwest::get(format!("{}/api/v1/cache", a.url()))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let pinned = cache["pins"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["digest"] == key.as_str() && p["until"] == job["pin_until"]);
        assert!(pinned, "{cache}");
    }
    // Each target's own cache serves a get (another presigned query: same file).
    for (i, a) in agents.iter().take(2).enumerate() {
        let dest = dir.path().join(format!("d{i}/w.bin"));
        let url = format!("{}?X-Amz-Signature=other-{i}", nginx.url("w.bin"));
        let r = report(&get(&[&url, dest.to_str().unwrap(), "--agent", &a.url(), "--json"]).await);
        assert_eq!(r["files"][0]["source"], "cache", "{r}");
        assert_eq!(std::fs::read(&dest).unwrap(), bytes);
        assert!(r["agent_received"]["origin"].as_u64().unwrap() <= 8, "{r}");
    }
    let probes = nginx.bytes_sent("w.bin") - after_prewarm;
    assert!(
        probes <= 8,
        "only version probes reached the origin: {probes}"
    );
    // `where` finds the file on the h100 nodes only.
    let out = cli(&[
        "where",
        "--tracker",
        &tracker_url,
        "--agent",
        &agents[0].url(),
        &signed,
        "--json",
    ])
    .await;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut holders: Vec<String> = v["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n["bytes_held"].as_u64() == Some(bytes.len() as u64))
        .filter_map(|n| n["node"].as_str().map(str::to_owned))
        .collect();
    holders.sort();
    assert_eq!(holders, ["n0", "n1"], "{v}");
    // With --digest the file is keyed (and verified) by its content.
    let other = testkit::random_bytes(1 << 20, 111);
    nginx.put("v.bin", &other);
    let digest = oci::Digest::of(&other).to_string();
    let out = cli(&[
        "prewarm",
        "--tracker",
        &tracker_url,
        "--agent",
        &agents[0].url(),
        &nginx.url("v.bin"),
        "--digest",
        &digest,
        "--selector",
        "gpu=h100",
        "--wait",
        "--json",
    ])
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dest = dir.path().join("d9/v.bin");
    let r = report(
        &get(&[
            &nginx.url("v.bin"),
            dest.to_str().unwrap(),
            "--agent",
            &agents[1].url(),
            "--digest",
            &digest,
            "--json",
        ])
        .await,
    );
    assert_eq!(r["files"][0]["source"], "cache", "{r}");
    assert_eq!(r["files"][0]["key"], digest.as_str());
    assert_eq!(std::fs::read(&dest).unwrap(), other);
    // A node whose agent may not contact the origin fails its part, saying why.
    let before = nginx.bytes_sent("w.bin");
    let out = cli(&[
        "prewarm",
        "--tracker",
        &tracker_url,
        "--agent",
        &agents[0].url(),
        &signed,
        "--selector",
        "gpu=a100",
        "--wait",
        "--json",
    ])
    .await;
    assert!(
        !out.status.success(),
        "a prewarm beyond allowed_file_origins succeeded"
    );
    let last = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .to_owned();
    assert!(last.contains("file_origins"), "{last}");
    assert_eq!(
        nginx.bytes_sent("w.bin") - before,
        1,
        "only n0's one-byte probe for the key: n2 contacted nothing"
    );
}
