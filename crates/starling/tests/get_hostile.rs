//! `starling get https://…` against origins that misbehave: redirects that lead out of
//! `allowed_file_origins`, a body running on past the declared size, a Content-Length
//! that disagrees with the size the probe saw, a huge header, and secrets in the URL
//! (user info, a presigned query) that must not reach messages or logs; and a cluster
//! member lying to the tracker about a file's size before anyone gets it. The origin is
//! a real nginx; where nginx cannot produce the fault, a small HTTP/1.1 front written
//! here stands in front of it and bends its answers.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use common::getkit::*;
use testkit::{Registry, RegistryAuth, TestImage};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redirect_out_of_the_allowed_origins_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    // A blob on the registry the agent is configured for (so the agent trusts its
    // internal address): the target of a redirect that must not be followed.
    let img = TestImage::push_multilayer(&registry, "internal/secret", "1", &[100_000], 7).unwrap();
    let secret = format!(
        "{}/v2/internal/secret/blobs/{}",
        registry.url(),
        img.layers[0].digest
    );
    let nginx = blocking(move || {
        Nginx::start_with(&format!(
            "location = /moved.bin {{ return 302 {secret}; }} \
             location = /alias.bin {{ return 302 /w.bin; }}"
        ))
    })
    .await;
    let bytes = testkit::random_bytes(300_000, 130);
    nginx.put("w.bin", &bytes);
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
        &nginx.url("moved.bin"),
        dest.join("m.bin").to_str().unwrap(),
        "--agent",
        &a.url(),
    ])
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "followed a redirect to {}",
        registry.host()
    );
    assert!(stderr.contains("file_origins"), "{stderr}");
    assert_eq!(listing(&dest), Vec::<String>::new());
    // A redirect that stays within the allowed origin is followed.
    let r = report(
        &get(&[
            &nginx.url("alias.bin"),
            dest.join("a.bin").to_str().unwrap(),
            "--agent",
            &a.url(),
            "--json",
        ])
        .await,
    );
    assert_eq!(r["files"][0]["bytes"], bytes.len());
    assert_eq!(std::fs::read(dest.join("a.bin")).unwrap(), bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn secrets_in_the_url_stay_out_of_errors_and_logs() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    // Allowed, but nothing listens there: every attempt fails with a transport error.
    let dead = format!("127.0.0.1:{}", testkit::free_port());
    let a = agent(
        dir.path(),
        "n1",
        None,
        &registry,
        &["--allowed-file-origin", &dead],
    )
    .await;
    let url = format!("http://alice:s3cretpw@{dead}/w.bin?X-Amz-Signature=topsecretsig");
    let dest = dir.path().join("d/w.bin");
    let nobody = format!("http://127.0.0.1:{}", testkit::free_port());
    for agent_url in [a.url(), nobody] {
        let out = get(&[&url, dest.to_str().unwrap(), "--agent", &agent_url]).await;
        assert!(!out.status.success());
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(all.contains(&dead), "the error names the origin: {all}");
        for secret in ["s3cretpw", "topsecretsig"] {
            assert!(
                !all.contains(secret),
                "{secret} shown via {agent_url}: {all}"
            );
        }
    }
    let log = std::fs::read_to_string(dir.path().join("n1.log")).unwrap();
    assert!(
        !log.contains("s3cretpw") && !log.contains("topsecretsig"),
        "{log}"
    );
}

/// How the front bends nginx's answers to whole-file GETs (200).
const EXTRA_BYTES: u8 = 1;
const SHORT_LENGTH: u8 = 2;
const HUGE_HEADER: u8 = 3;

/// A minimal HTTP/1.1 front for nginx: forwards each GET (with its Range), and
/// rewrites 200 answers as `mode` says. One request per connection.
async fn bending_front(nginx_port: u16, mode: Arc<AtomicU8>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let mode = mode.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&head).into_owned();
                let path = text.split(' ').nth(1).unwrap_or("/").to_owned();
                let range = text
                    .lines()
                    .find(|l| l.to_ascii_lowercase().starts_with("range:"))
                    .map(|l| l[6..].trim().to_owned());
                let mut req =
                    reqwest::Client::new().get(format!("http://127.0.0.1:{nginx_port}{path}"));
                if let Some(r) = &range {
                    req = req.header("range", r);
                }
                let Ok(resp) = req.send().await else { return };
                let status = resp.status().as_u16();
                let mut out = format!("HTTP/1.1 {status} X\r\nConnection: close\r\n");
                for h in ["etag", "last-modified", "content-range", "accept-ranges"] {
                    if let Some(v) = resp.headers().get(h).and_then(|v| v.to_str().ok()) {
                        out.push_str(&format!("{h}: {v}\r\n"));
                    }
                }
                let mut body = resp.bytes().await.unwrap_or_default().to_vec();
                let m = if status == 200 {
                    mode.load(Ordering::SeqCst)
                } else {
                    0
                };
                match m {
                    // No Content-Length: the body runs until the connection closes.
                    EXTRA_BYTES => body.extend(std::iter::repeat_n(0xee, 1 << 20)),
                    SHORT_LENGTH => {
                        body.truncate(body.len() / 2);
                        out.push_str(&format!("content-length: {}\r\n", body.len()));
                    }
                    HUGE_HEADER => {
                        out.push_str(&format!("x-pad: {}\r\n", "p".repeat(2 << 20)));
                        out.push_str(&format!("content-length: {}\r\n", body.len()));
                    }
                    _ => out.push_str(&format!("content-length: {}\r\n", body.len())),
                }
                out.push_str("\r\n");
                let _ = s.write_all(out.as_bytes()).await;
                let _ = s.write_all(&body).await;
                let _ = s.shutdown().await;
            });
        }
    });
    format!("127.0.0.1:{}", addr.port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_origin_whose_sizes_lie_gets_bounded_reads_and_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let nginx = blocking(Nginx::start).await;
    let bytes = testkit::random_bytes(3 << 20, 140);
    let mode = Arc::new(AtomicU8::new(0));
    let front = bending_front(nginx.port, mode.clone()).await;
    let a = agent(
        dir.path(),
        "n1",
        None,
        &registry,
        &["--allowed-file-origin", &front],
    )
    .await;
    let url = |name: &str| format!("http://{front}/{name}");

    // A body that runs on past the size the origin declared: the excess is not the
    // file's; DEST and the cache hold exactly the declared bytes.
    nginx.put("extra.bin", &bytes);
    mode.store(EXTRA_BYTES, Ordering::SeqCst);
    let dest = dir.path().join("d1");
    std::fs::create_dir_all(&dest).unwrap();
    let r = report(
        &get(&[
            &url("extra.bin"),
            dest.to_str().unwrap(),
            "--agent",
            &a.url(),
            "--json",
        ])
        .await,
    );
    assert_eq!(std::fs::read(dest.join("extra.bin")).unwrap(), bytes);
    let key = oci::Digest::parse(r["files"][0]["key"].as_str().unwrap()).unwrap();
    let cached = a.cache.join("blobs/sha256").join(key.hex());
    assert_eq!(
        std::fs::metadata(&cached).map(|m| m.len()).ok(),
        Some(bytes.len() as u64)
    );

    // A whole-file answer whose Content-Length is not the size the probe saw: the
    // file changed or the origin lies; either way nothing is kept.
    nginx.put("short.bin", &bytes);
    mode.store(SHORT_LENGTH, Ordering::SeqCst);
    let dest = dir.path().join("d2");
    std::fs::create_dir_all(&dest).unwrap();
    let out = get(&[
        &url("short.bin"),
        dest.to_str().unwrap(),
        "--agent",
        &a.url(),
    ])
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a short file was accepted");
    assert!(stderr.contains("changed"), "{stderr}");
    assert_eq!(listing(&dest), Vec::<String>::new());

    // A header of megabytes: refused by the HTTP client's bound, a clear error, and
    // the agent keeps serving.
    nginx.put("huge.bin", &bytes);
    mode.store(HUGE_HEADER, Ordering::SeqCst);
    let dest = dir.path().join("d3");
    std::fs::create_dir_all(&dest).unwrap();
    let out = get(&[
        &url("huge.bin"),
        dest.to_str().unwrap(),
        "--agent",
        &a.url(),
    ])
    .await;
    assert!(!out.status.success(), "a 2 MiB header was taken");
    assert_eq!(listing(&dest), Vec::<String>::new());
    mode.store(0, Ordering::SeqCst);
    report(
        &get(&[
            &url("huge.bin"),
            dest.to_str().unwrap(),
            "--agent",
            &a.url(),
            "--json",
        ])
        .await,
    );
    assert_eq!(std::fs::read(dest.join("huge.bin")).unwrap(), bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenants_file_named_by_a_layers_digest_stays_out_of_that_layers_swarm() {
    // A tenant who may write to an allowed origin (its bucket) puts a file there and
    // gets it naming an image layer's digest. The origin trickles, so the tenant's node
    // would stay elected source for as long as the tenant likes, publishing piece hashes
    // of the tenant's bytes. A node pulling the layer from the registry meanwhile gets
    // the layer, from the registry, not those pieces.
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let img = TestImage::push_multilayer(&registry, "team/app", "1", &[8 << 20], 9).unwrap();
    let layer = img.layers[0].clone();
    let nginx = blocking(|| Nginx::start_with("location = /evil.bin { limit_rate 2m; }")).await;
    // The same size as the layer: nothing about the swarm's layout gives it away.
    nginx.put("evil.bin", &testkit::random_bytes(layer.size as usize, 99));
    let t = tracker(dir.path()).await;
    let allow = ["--allowed-file-origin", &nginx.origin()];
    let tenant = agent(dir.path(), "n1", Some(&t.url()), &registry, &allow).await;
    let victim = agent(dir.path(), "n2", Some(&t.url()), &registry, &allow).await;
    let dest = dir.path().join("d");
    std::fs::create_dir_all(&dest).unwrap();
    let tenant_get = tokio::spawn({
        let args = [
            nginx.url("evil.bin"),
            dest.join("e.bin").display().to_string(),
            "--agent".into(),
            tenant.url(),
            "--digest".into(),
            layer.digest.clone(),
        ];
        async move { get(&args.iter().map(String::as_str).collect::<Vec<_>>()).await }
    });
    let mut elected = 0;
    for _ in 0..400 {
        elected = common::metric(&tenant.url(), "starling_agent_p2p_source_roles").await;
        if elected > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert_eq!(
        elected, 1,
        "the tenant's node reads its file as elected source"
    );

    let pull_layer = |agent_url: String| {
        let url = format!(
            "{agent_url}/v2/team/app/blobs/{}?ns={}",
            layer.digest,
            registry.host()
        );
        async move {
            let resp = reqwest::get(url).await.unwrap();
            assert_eq!(resp.status(), 200);
            let body = resp.bytes().await.expect("the layer arrives whole");
            oci::Digest::of(&body).to_string()
        }
    };
    assert_eq!(pull_layer(victim.url()).await, layer.digest);
    let from_peers = common::metric(&victim.url(), "starling_agent_p2p_peer_bytes_total").await;
    assert_eq!(from_peers, 0, "no piece came from the tenant's node");
    // On the tenant's own node, a pull of the layer does not join the tenant's download
    // of that digest either: it reads the registry (uncached while that lasts).
    assert_eq!(pull_layer(tenant.url()).await, layer.digest);
    assert!(
        !tenant_get.is_finished(),
        "the tenant's get was still running while the layer was pulled"
    );

    let out = tenant_get.await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the tenant's file passed as the layer"
    );
    assert!(
        stderr.contains("does not match") || stderr.contains("verification"),
        "{stderr}"
    );
    assert_eq!(listing(&dest), Vec::<String>::new());
    // The file was read once: the agent neither retried it on its own nor read it again
    // for the `get` resuming the cut body (it remembers that version failed the digest).
    let read = nginx.bytes_sent("evil.bin");
    assert!(
        read <= layer.size + 16,
        "{read} bytes for a file of {}",
        layer.size
    );
}

/// A cluster member announces a wrong size for a file's swarm before any node gets the
/// file, and keeps saying it. The file's size is bound in its swarm's key, so every
/// honest node knows better: the first is elected in the liar's place and tells the
/// tracker the true size, and the next takes the file from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_lying_about_a_files_size_first_spoils_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let Origin {
        registry,
        nginx,
        bytes,
    } = origin_with_file(6 << 20, 41).await;
    let allow = ["--allowed-file-origin", &nginx.origin()];
    // The file's swarm key, learned on a tracker of its own (it is derived from the
    // URL's identity, so a member anywhere can compute it before anyone gets the file).
    let key = {
        let scout_tracker = tracker(dir.path()).await;
        let scout = agent(
            dir.path(),
            "scout",
            Some(&scout_tracker.url()),
            &registry,
            &allow,
        )
        .await;
        let out = dir.path().join("scout.bin");
        let r = report(
            &get(&[
                &nginx.url("w.bin"),
                out.to_str().unwrap(),
                "--agent",
                &scout.url(),
                "--json",
            ])
            .await,
        );
        r["files"][0]["key"].as_str().expect("the key").to_owned()
    };
    let origin_before = nginx.bytes_sent("w.bin");
    let t = tracker(dir.path()).await;
    let lie = bytes.len() as u64 / 2;
    let body = serde_json::json!({
        "node": "liar", "addr": "127.0.0.1:1", "digest": key, "size": lie,
    });
    let announcing =
        common::keep_announcing(&t.url(), TOKEN, body, std::time::Duration::from_secs(1));
    let a1 = agent(dir.path(), "n1", Some(&t.url()), &registry, &allow).await;
    let a2 = agent(dir.path(), "n2", Some(&t.url()), &registry, &allow).await;
    let mut reports = Vec::new();
    for (a, name) in [(&a1, "d1.bin"), (&a2, "d2.bin")] {
        let out = dir.path().join(name);
        reports.push(report(
            &get(&[
                &nginx.url("w.bin"),
                out.to_str().unwrap(),
                "--agent",
                &a.url(),
                "--json",
            ])
            .await,
        ));
        assert_eq!(std::fs::read(&out).unwrap(), bytes, "{name} whole");
    }
    assert!(
        common::metric(&a1.url(), "starling_agent_p2p_swarm_size_corrections_total").await >= 1,
        "n1, elected in the liar's place, told the tracker the file's size"
    );
    assert!(
        reports[1]["agent_received"]["peers"].as_u64().unwrap() >= bytes.len() as u64,
        "n2 took the file from n1 through the mended swarm: {}",
        reports[1]
    );
    let origin_bytes = nginx.bytes_sent("w.bin") - origin_before;
    assert!(
        origin_bytes <= bytes.len() as u64 + 16,
        "the origin sent the file once more (plus probes): {origin_bytes}"
    );
    announcing.abort();
}
