//! The mirror against the real docker-registry: skopeo, Range semantics, single flight,
//! auth upstreams, bad input, and an upstream that cuts or corrupts blobs.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use futures::StreamExt;
use testkit::{skopeo_ok, ManifestFormat, Registry, RegistryAuth, TestImage};

fn sha(b: &[u8]) -> String {
    testkit::sha256_digest(b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn skopeo_copies_through_agent_oci_docker_and_index() {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let oci = TestImage::push_multilayer(&registry, "a/oci", "1", &[1 << 20, 64 << 10], 1).unwrap();
    let docker = TestImage::push_multilayer_format(
        &registry,
        "a/docker",
        "1",
        &[1 << 20],
        2,
        ManifestFormat::DockerV2S2,
    )
    .unwrap();
    let index = TestImage::push_multiplatform_index(&registry, "a/index", "1").unwrap();
    let cache = tempfile::tempdir().unwrap();
    let agent = start_agent(
        cache.path(),
        &registry.host(),
        &registry.url(),
        None,
        |_| {},
    )
    .await;
    let out = tempfile::tempdir().unwrap();
    for (repo, expect_digest, all) in [
        ("a/oci", &oci.digest, false),
        ("a/docker", &docker.digest, false),
        ("a/index", &index.digest, true),
    ] {
        let src = format!("docker://{}/{repo}:1", agent.addr);
        let dst = format!("dir:{}", out.path().join(repo.replace('/', "_")).display());
        let mut args = vec!["copy", "--src-tls-verify=false", "--preserve-digests"];
        if all {
            args.push("--all");
        }
        args.push(&src);
        args.push(&dst);
        let args: Vec<String> = args.into_iter().map(String::from).collect();
        blocking(move || {
            skopeo_ok(&args.iter().map(String::as_str).collect::<Vec<_>>()).map(|_| ())
        })
        .await
        .expect("skopeo copy through agent");
        let manifest = std::fs::read(
            out.path()
                .join(repo.replace('/', "_"))
                .join("manifest.json"),
        )
        .unwrap();
        assert_eq!(
            &sha(&manifest),
            expect_digest,
            "{repo}: byte-for-byte manifest"
        );
    }
    // Manifest headers on HEAD and GET, media types per Accept.
    let url = format!("{}/v2/a/docker/manifests/1", agent.url());
    let client = reqwest::Client::new();
    let head = client
        .head(&url)
        .header("Accept", testkit::DOCKER_MANIFEST)
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 200);
    assert_eq!(
        head.headers()["docker-content-digest"],
        docker.digest.as_str()
    );
    assert_eq!(head.headers()["content-type"], testkit::DOCKER_MANIFEST);
    assert_eq!(
        head.headers()["content-length"],
        docker.raw_manifest.len().to_string().as_str()
    );
    let not_accepted = client
        .get(&url)
        .header("Accept", testkit::OCI_MANIFEST)
        .send()
        .await
        .unwrap();
    assert_eq!(
        not_accepted.status(),
        404,
        "a docker manifest must not be served to a client accepting only OCI"
    );
    let body: serde_json::Value = not_accepted.json().await.unwrap();
    assert_eq!(body["errors"][0]["code"], "MANIFEST_UNKNOWN");
    let ns = client
        .get(format!(
            "{}/v2/a/oci/manifests/1?ns={}",
            agent.url(),
            registry.host()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(ns.headers()["oci-namespace"], registry.host().as_str());
    assert_eq!(sha(&ns.bytes().await.unwrap()), oci.digest);
    let tags: serde_json::Value = get(&format!("{}/v2/a/oci/tags/list", agent.url()), &[])
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(tags["tags"], serde_json::json!(["1"]));
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn range_requests_exact_cold_and_warm() {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let img = TestImage::push_multilayer(&registry, "r/ranges", "1", &[6 << 20], 3).unwrap();
    let layer = img.layers[0].clone();
    let full = registry
        .http_get(&format!("/v2/r/ranges/blobs/{}", layer.digest), &[])
        .unwrap()
        .body;
    let total = full.len() as u64;
    let cache = tempfile::tempdir().unwrap();
    let agent = start_agent(
        cache.path(),
        &registry.host(),
        &registry.url(),
        None,
        |_| {},
    )
    .await;
    let url = format!("{}/v2/r/ranges/blobs/{}", agent.url(), layer.digest);
    // First request is cold: a range served while the blob is still being fetched.
    for round in ["cold", "warm"] {
        let cases: Vec<(String, u64, u64)> = vec![
            ("bytes=0-1".into(), 0, 1),
            ("bytes=500-1499".into(), 500, 1499),
            ("bytes=500-".into(), 500, total - 1),
            ("bytes=-500".into(), total - 500, total - 1),
            (
                format!("bytes={}-{}", total - 10, total + 5000),
                total - 10,
                total - 1,
            ),
        ];
        for (h, a, b) in cases {
            let r = get(&url, &[("Range", &h)]).await;
            assert_eq!(r.status(), 206, "{round} {h}");
            assert_eq!(
                r.headers()["content-range"],
                format!("bytes {a}-{b}/{total}").as_str(),
                "{round} {h}"
            );
            let body = r.bytes().await.unwrap();
            assert_eq!(&body[..], &full[a as usize..=b as usize], "{round} {h}");
        }
        let r = get(&url, &[("Range", &format!("bytes={total}-"))]).await;
        assert_eq!(r.status(), 416, "{round}");
        assert_eq!(
            r.headers()["content-range"],
            format!("bytes */{total}").as_str()
        );
        let r = get(&url, &[("Range", "bytes=zz-1")]).await;
        assert_eq!(r.status(), 400, "{round}");
        // Far apart, so they are not coalesced into one range.
        let r = get(&url, &[("Range", "bytes=0-9,100000-100009")]).await;
        assert_eq!(r.status(), 206);
        let ct = r.headers()["content-type"].to_str().unwrap().to_owned();
        let boundary = ct
            .split("boundary=")
            .nth(1)
            .expect("multipart boundary")
            .to_owned();
        let body = r.bytes().await.unwrap();
        let parts: Vec<&[u8]> = body.split(|_| false).collect();
        let text = String::from_utf8_lossy(parts[0]);
        assert!(
            text.contains(&format!("--{boundary}"))
                && text.contains(&format!("Content-Range: bytes 0-9/{total}"))
                && text.contains(&format!("Content-Range: bytes 100000-100009/{total}"))
        );
        let needle = |s: &[u8]| body.windows(s.len()).any(|w| w == s);
        assert!(needle(&full[0..10]) && needle(&full[100_000..100_010]));
        // Give the background download time to finish before the warm round.
        let whole = get(&url, &[]).await.bytes().await.unwrap();
        assert_eq!(sha(&whole), layer.digest);
    }
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_identical_requests_cause_one_upstream_fetch() {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let img = TestImage::push_multilayer(&registry, "c/one", "1", &[24 << 20], 4).unwrap();
    let layer = img.layers[0].clone();
    let cache = tempfile::tempdir().unwrap();
    let agent = start_agent(
        cache.path(),
        &registry.host(),
        &registry.url(),
        None,
        |_| {},
    )
    .await;
    let url = format!("{}/v2/c/one/blobs/{}", agent.url(), layer.digest);
    let fetches = (0..8).map(|_| {
        let url = url.clone();
        async move {
            let r = get(&url, &[]).await;
            assert_eq!(r.status(), 200);
            let told = r.headers()["starling-source"].to_str().unwrap().to_owned();
            (told, sha(&r.bytes().await.unwrap()))
        }
    });
    let answers = futures::future::join_all(fetches).await;
    assert!(answers.iter().all(|(_, d)| d == &layer.digest));
    assert_eq!(
        agent.metric("starling_agent_upstream_bytes_total") as u64,
        layer.size,
        "8 concurrent requests, one upstream fetch"
    );
    // Where the bytes came from: the metric's split is the one the header told each
    // client (the registry download, or the cache for a request that came after it).
    let told = |source: &str| answers.iter().filter(|(t, _)| t == source).count() as u64;
    assert!(told("registry") >= 1, "a cold blob comes from the registry");
    assert_eq!(told("registry") + told("cache"), 8, "{answers:?}");
    let served = |source: &str| format!("starling_agent_served_bytes_total{{source=\"{source}\"}}");
    until_metric(&agent, &served("registry"), told("registry") * layer.size).await;
    // The last byte reaches the clients before the blob is renamed into the store and
    // recorded (fsync first): a request in between joins the download, and says so.
    let d = oci::Digest::parse(&layer.digest).unwrap();
    testkit::until(
        "the blob recorded in the store",
        std::time::Duration::from_millis(10),
        std::time::Duration::from_secs(10),
        || async { agent.agent.store.stat(&d).is_some() },
    )
    .await;
    let warm = get(&url, &[]).await;
    assert_eq!(warm.headers()["starling-source"], "cache");
    assert_eq!(sha(&warm.bytes().await.unwrap()), layer.digest);
    until_metric(&agent, &served("cache"), (told("cache") + 1) * layer.size).await;
    assert_eq!(
        agent.metric("starling_agent_served_bytes_total") as u64,
        9 * layer.size,
        "every byte served is counted under one source"
    );
    // Each response's wait for its first byte is timed once, under the same source.
    let first_bytes = |source: &str| {
        format!("starling_agent_blob_first_byte_seconds_count{{source=\"{source}\"}}")
    };
    assert_eq!(
        agent.metric(&first_bytes("registry")) as u64,
        told("registry")
    );
    assert_eq!(
        agent.metric(&first_bytes("cache")) as u64,
        told("cache") + 1
    );
    agent.stop().await;
}

/// The runtime's own first layer request goes to the registry while the layers the
/// agent only prefetches wait out `prefetch_grace` (so in a swarm the asked layer
/// gets a source first), and the prefetch then brings every layer in unasked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_layer_asked_for_after_the_manifest_goes_before_the_prefetched_ones() {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let img = TestImage::push_multilayer(&registry, "p/pre", "1", &[1 << 20; 4], 11).unwrap();
    let (proxy, asked) = recording_proxy(registry.url()).await;
    let cache = tempfile::tempdir().unwrap();
    let agent = start_agent(cache.path(), &registry.host(), &proxy, None, |c| {
        c.prefetch_grace = std::time::Duration::from_secs(3);
    })
    .await;
    let manifest = reqwest::Client::new()
        .get(format!("{}/v2/p/pre/manifests/1", agent.url()))
        .header("Accept", testkit::OCI_MANIFEST)
        .send()
        .await
        .unwrap();
    assert_eq!(manifest.status(), 200);
    let last = img.layers.last().unwrap();
    let r = get(
        &format!("{}/v2/p/pre/blobs/{}", agent.url(), last.digest),
        &[],
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(sha(&r.bytes().await.unwrap()), last.digest);
    // Without the grace the prefetch asks for every layer as the manifest is served.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(
        *asked.lock().unwrap(),
        vec![last.digest.clone()],
        "only the asked layer before the grace ends"
    );
    let total: u64 = img.layers.iter().map(|l| l.size).sum();
    until_metric(&agent, "starling_agent_upstream_bytes_total", total).await;
    let mut want: Vec<String> = img.layers.iter().map(|l| l.digest.clone()).collect();
    let mut got = asked.lock().unwrap().clone();
    want.sort();
    got.sort();
    assert_eq!(
        got, want,
        "each layer fetched once, prefetched or asked for"
    );
    agent.stop().await;
}

/// Forwards to the real registry and records the digests of blob GETs as they arrive.
async fn recording_proxy(upstream: String) -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let client = reqwest::Client::new();
    let record = asked.clone();
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let (client, upstream, record) = (client.clone(), upstream.clone(), record.clone());
        async move {
            if req.method() == axum::http::Method::GET {
                if let Some((_, d)) = req.uri().path().split_once("/blobs/") {
                    record.lock().unwrap().push(d.to_owned());
                }
            }
            let (_, resp, builder) = testkit::forward(&client, &upstream, req).await;
            builder
                .body(axum::body::Body::from_stream(resp.bytes_stream()))
                .unwrap()
        }
    });
    let url = testkit::serve_proxy(app).await;
    (url, asked)
}

/// Waits (up to 10 s) until `series` sums to `want`: a body's bytes are counted when
/// the server drops it, a moment after the client has read the last byte.
async fn until_metric(agent: &RunningAgent, series: &str, want: u64) {
    for _ in 0..1000 {
        if agent.metric(series) as u64 == want {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!(
        "{series} is {} (want {want}):\n{}",
        agent.metric(series),
        agent.agent.metrics.encode()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn htpasswd_and_token_upstreams_and_wrong_credentials() {
    for auth in [
        RegistryAuth::htpasswd("u", "p"),
        RegistryAuth::token("u", "p", false),
    ] {
        let registry = blocking(move || Registry::start(auth)).await;
        let img = TestImage::push_multilayer(&registry, "priv/img", "1", &[512 << 10], 5).unwrap();
        let cache = tempfile::tempdir().unwrap();
        let agent = start_agent(
            cache.path(),
            &registry.host(),
            &registry.url(),
            Some(("u", "p")),
            |_| {},
        )
        .await;
        let up = oci::Upstream::new(oci::UpstreamConfig {
            endpoints: [(registry.host(), agent.url())].into(),
            ..Default::default()
        })
        .unwrap();
        let r = oci::ImageReference::parse(&img.reference).unwrap();
        let report = oci::pull::pull(&up, &r, &Default::default())
            .await
            .expect("pull via agent with upstream auth");
        assert_eq!(report.manifest_digest.to_string(), img.digest);
        agent.stop().await;
        let cache = tempfile::tempdir().unwrap();
        let bad = start_agent(
            cache.path(),
            &registry.host(),
            &registry.url(),
            Some(("u", "wrong")),
            |_| {},
        )
        .await;
        let resp = get(&format!("{}/v2/priv/img/manifests/1", bad.url()), &[]).await;
        assert_eq!(resp.status(), 401);
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["errors"][0]["code"], "UNAUTHORIZED");
        bad.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_gets_oci_errors_and_agent_stays_up() {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let img = TestImage::push_multilayer(&registry, "ok/img", "1", &[64 << 10], 6).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let agent = start_agent(
        cache.path(),
        &registry.host(),
        &registry.url(),
        None,
        |_| {},
    )
    .await;
    let base = agent.url();
    let d = &img.layers[0].digest;
    let long_name = "a/".repeat(200) + "b";
    let cases: Vec<(String, u16, &str)> = vec![
        (format!("/v2/UPPER/blobs/{d}"), 400, "NAME_INVALID"),
        (format!("/v2/ok/../etc/blobs/{d}"), 400, "NAME_INVALID"),
        (format!("/v2/ok/%2e%2e/img/blobs/{d}"), 400, "NAME_INVALID"),
        ("/v2/ok/img/blobs/sha256:1234".into(), 400, "DIGEST_INVALID"),
        (
            "/v2/ok/img/blobs/sha256:../../../etc/passwd".into(),
            400,
            "DIGEST_INVALID",
        ),
        (
            format!("/v2/ok/img/blobs/sha512:{}", "a".repeat(128)),
            400,
            "UNSUPPORTED",
        ),
        (
            "/v2/ok/img/manifests/bad..tag!".into(),
            400,
            "MANIFEST_INVALID",
        ),
        (format!("/v2/{long_name}/manifests/1"), 400, "NAME_INVALID"),
        (
            format!("/v2/ok/img/blobs/{}", testkit::sha256_digest(b"nope")),
            404,
            "BLOB_UNKNOWN",
        ),
        (
            "/v2/ok/img/manifests/missing".into(),
            404,
            "MANIFEST_UNKNOWN",
        ),
        (
            format!("/v2/ok/img/blobs/{d}?ns=bad%20host"),
            400,
            "NAME_INVALID",
        ),
    ];
    for (path, status, code) in cases {
        // A raw client: reqwest would normalise `..` away before sending.
        let url = format!("{base}{path}");
        let r = blocking(move || testkit::http_get(&url, &[]).unwrap()).await;
        assert_eq!(r.status, status, "{path}");
        let body: serde_json::Value =
            serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{path}: not JSON: {e}"));
        assert_eq!(body["errors"][0]["code"], code, "{path}");
    }
    let huge = "x".repeat(60_000);
    let r = get(
        &format!("{base}/v2/ok/img/manifests/1"),
        &[("Accept", &huge)],
    )
    .await;
    assert!(
        r.status().is_client_error() || r.status() == 404,
        "absurd header answered {}",
        r.status()
    );
    for h in [
        "bytes=5-1",
        "bytes=abc",
        "items=0-1",
        &format!("bytes={}", vec!["0-1"; 200].join(",")),
    ] {
        let r = get(&format!("{base}/v2/ok/img/blobs/{d}"), &[("Range", h)]).await;
        assert_eq!(r.status(), 400, "{h}");
    }
    let r = reqwest::Client::new()
        .put(format!("{base}/v2/ok/img/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_client_error());
    // Still serving correctly after all that.
    let r = get(&format!("{base}/v2/ok/img/blobs/{d}"), &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(&sha(&r.bytes().await.unwrap()), d);
    agent.stop().await;
}

/// A proxy in front of the real registry that misbehaves on blob bodies.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// Flip one byte in the middle of every blob body.
    Corrupt,
    /// Cut the first blob response after 1 MiB; later requests pass.
    CutOnce,
}

async fn fault_proxy(upstream: String, fault: Fault) -> (String, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let h = hits.clone();
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let (client, upstream, hits) = (client.clone(), upstream.clone(), h.clone());
        async move {
            let (path, resp, builder) = testkit::forward(&client, &upstream, req).await;
            let is_blob = path.contains("/blobs/") && resp.status().is_success();
            let n = if is_blob {
                hits.fetch_add(1, Ordering::SeqCst)
            } else {
                usize::MAX
            };
            let mut seen = 0usize;
            let stream = resp.bytes_stream().map(move |c| {
                let mut c = c.map_err(std::io::Error::other)?.to_vec();
                if is_blob && fault == Fault::Corrupt && seen <= 100_000 && seen + c.len() > 100_000
                {
                    c[100_000 - seen] ^= 0xff;
                }
                if is_blob && fault == Fault::CutOnce && n == 0 && seen + c.len() > 1 << 20 {
                    return Err(std::io::Error::other("cut"));
                }
                seen += c.len();
                Ok::<_, std::io::Error>(bytes::Bytes::from(c))
            });
            builder.body(axum::body::Body::from_stream(stream)).unwrap()
        }
    });
    let url = testkit::serve_proxy(app).await;
    (url, hits)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upstream_sending_wrong_bytes_never_completes_and_never_caches() {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let img = TestImage::push_multilayer(&registry, "f/bad", "1", &[2 << 20], 8).unwrap();
    let layer = img.layers[0].clone();
    let (proxy, _) = fault_proxy(registry.url(), Fault::Corrupt).await;
    let cache = tempfile::tempdir().unwrap();
    let agent = start_agent(cache.path(), &registry.host(), &proxy, None, |_| {}).await;
    let url = format!("{}/v2/f/bad/blobs/{}", agent.url(), layer.digest);
    let r = get(&url, &[]).await;
    let outcome = if r.status() == 200 {
        r.bytes().await.map(|b| b.len())
    } else {
        Ok(0)
    };
    assert!(
        outcome.is_err() || outcome.as_ref().is_ok_and(|n| (*n as u64) < layer.size),
        "a corrupt blob must never arrive complete: {outcome:?}"
    );
    let d = oci::Digest::parse(&layer.digest).unwrap();
    assert!(
        agent.agent.store.stat(&d).is_none(),
        "corrupt blob must not be cached"
    );
    assert!(!cache.path().join("blobs/sha256").join(d.hex()).exists());
    // The agent is still healthy and serves other content.
    assert_eq!(
        get(&format!("{}/v2/", agent.url()), &[]).await.status(),
        200
    );
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_cut_mid_blob_is_resumed_with_range() {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let img = TestImage::push_multilayer(&registry, "f/cut", "1", &[8 << 20], 9).unwrap();
    let layer = img.layers[0].clone();
    let (proxy, hits) = fault_proxy(registry.url(), Fault::CutOnce).await;
    let cache = tempfile::tempdir().unwrap();
    let agent = start_agent(cache.path(), &registry.host(), &proxy, None, |_| {}).await;
    let r = get(
        &format!("{}/v2/f/cut/blobs/{}", agent.url(), layer.digest),
        &[],
    )
    .await;
    assert_eq!(r.status(), 200);
    let body = r.bytes().await.expect("client stream is not cut");
    assert_eq!(sha(&body), layer.digest);
    assert!(
        hits.load(Ordering::SeqCst) >= 2,
        "a second (Range) request was made after the cut"
    );
    let upstream = agent.metric("starling_agent_upstream_bytes_total") as u64;
    assert!(
        upstream < layer.size + (2 << 20),
        "resumed, not restarted: {upstream} upstream bytes for {}",
        layer.size
    );
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cache_that_cannot_take_the_blob_streams_it_without_caching() {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let img = TestImage::push_multilayer(&registry, "full/disk", "1", &[6 << 20], 31).unwrap();
    let layer = img.layers[0].clone();
    let cache = tempfile::tempdir().unwrap();
    // A 1 MiB budget plays a full disk: the 6 MiB layer cannot be stored.
    let agent = start_agent(cache.path(), &registry.host(), &registry.url(), None, |c| {
        c.cache_budget = oci::size::ByteSize(1 << 20)
    })
    .await;
    let url = format!("{}/v2/full/disk/blobs/{}", agent.url(), layer.digest);
    for _ in 0..2 {
        let r = get(&url, &[]).await;
        assert_eq!(r.status(), 200);
        assert_eq!(
            sha(&r.bytes().await.unwrap()),
            layer.digest,
            "full bytes, verified by the client"
        );
    }
    let d = oci::Digest::parse(&layer.digest).unwrap();
    assert!(agent.agent.store.stat(&d).is_none(), "nothing cached");
    until_metric(
        &agent,
        "starling_agent_served_bytes_total{source=\"passthrough\"}",
        2 * layer.size,
    )
    .await;
    let r = get(
        &format!("{}/v2/full/disk/blobs/{}", agent.url(), layer.digest),
        &[("Range", "bytes=100-199")],
    )
    .await;
    assert_eq!(r.status(), 206);
    assert_eq!(r.bytes().await.unwrap().len(), 100);
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn configured_pins_are_preloaded_and_survive_gc() {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let img = TestImage::push_multilayer(&registry, "base/pytorch", "2.4", &[3 << 20, 1 << 20], 41)
        .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let reference = img.reference.clone();
    let agent = start_agent(
        cache.path(),
        &registry.host(),
        &registry.url(),
        None,
        move |c| c.pin = vec![reference],
    )
    .await;
    let layers: Vec<oci::Digest> = img
        .layers
        .iter()
        .map(|l| oci::Digest::parse(&l.digest).unwrap())
        .collect();
    for _ in 0..200 {
        if layers.iter().all(|d| agent.agent.store.stat(d).is_some()) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        layers.iter().all(|d| agent.agent.store.stat(d).is_some()),
        "the pinned image was fetched when the node joined"
    );
    assert_eq!(
        agent.metric("starling_agent_cache_hits_total"),
        0.0,
        "no client asked: the agent preloaded on its own"
    );
    // Under pressure, GC cannot take the pinned layers.
    let report = agent.agent.store.gc_to(0).unwrap();
    assert_eq!(report.evicted, 0, "pinned content survives GC: {report:?}");
    assert!(layers.iter().all(|d| agent.agent.store.stat(d).is_some()));
    agent.stop().await;
}
