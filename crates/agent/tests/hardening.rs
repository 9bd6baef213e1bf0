//! Attacks on the agent's mirror (security issue 12): Range headers that amplify a blob,
//! and upstream replies (token endpoint, error bodies) that never end. The agent is
//! served on loopback in front of the real docker-registry; the endless replies come
//! from fault proxies, since no real server can be made to send them.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{blocking, get, start_agent};
use futures::StreamExt;
use testkit::{Registry, RegistryAuth, TestImage};

/// Reads at most `cap` bytes of a body; the bytes and whether more was left.
async fn read_capped(r: reqwest::Response, cap: usize) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    let mut s = r.bytes_stream();
    while let Some(c) = s.next().await {
        let c = c.expect("body chunk");
        if out.len() + c.len() > cap {
            return (out, true);
        }
        out.extend_from_slice(&c);
    }
    (out, false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_and_many_ranges_never_amplify_the_body() {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let img = TestImage::push_multilayer(&registry, "r/amp", "1", &[4 << 20, 4 << 20], 41)
        .expect("push image");
    let cache = tempfile::tempdir().expect("temp dir");
    let agent = start_agent(
        cache.path(),
        &registry.host(),
        &registry.url(),
        None,
        |_| {},
    )
    .await;
    // The first layer is cached before the attack, the second is fetched by it.
    let warm = &img.layers[0];
    let url = format!("{}/v2/r/amp/blobs/{}", agent.url(), warm.digest);
    let full = get(&url, &[]).await.bytes().await.expect("body");
    assert_eq!(full.len() as u64, warm.size);
    let total = warm.size;
    let whole = format!("0-{}", total - 1);
    let step = total / 20;
    let cases: Vec<(&str, String, u64)> = vec![
        (
            "64 copies of the whole blob",
            vec![whole.as_str(); 64].join(","),
            total,
        ),
        (
            "64 overlapping 1 KiB ranges",
            vec!["0-1023"; 64].join(","),
            1024,
        ),
        (
            "64 ranges that each overlap the next",
            (0..64)
                .map(|i| format!("{}-{}", i * 1000, i * 1000 + 1999))
                .collect::<Vec<_>>()
                .join(","),
            64_999 + 1,
        ),
        (
            "17 disjoint ranges (over the cap of 16)",
            (0..17)
                .map(|i| format!("{}-{}", i * step, i * step + 9))
                .collect::<Vec<_>>()
                .join(","),
            total,
        ),
        (
            "suffixes and prefixes covering it all",
            ["-3000000", "0-2000000", "1000000-"].repeat(20).join(","),
            total,
        ),
    ];
    for (round, layer) in [("cached", warm), ("cold", &img.layers[1])] {
        let url = format!("{}/v2/r/amp/blobs/{}", agent.url(), layer.digest);
        for (what, ranges, max_payload) in &cases {
            let header = format!("bytes={ranges}");
            let r = get(&url, &[("Range", &header)]).await;
            assert!(
                r.status() == 206 || r.status() == 200,
                "{round}, {what}: {}",
                r.status()
            );
            let len = r.content_length().unwrap_or(u64::MAX);
            assert!(
                len <= layer.size,
                "{round}, {what}: a {len}-byte body for a {}-byte blob",
                layer.size
            );
            let multipart = r
                .headers()
                .get("content-type")
                .is_some_and(|v| v.to_str().unwrap_or("").starts_with("multipart/"));
            let (body, more) = read_capped(r, layer.size as usize).await;
            assert!(!more && body.len() as u64 == len, "{round}, {what}");
            if !multipart {
                assert!(body.len() as u64 <= *max_payload, "{round}, {what}");
            }
            if body.len() as u64 == layer.size {
                assert_eq!(
                    oci::Digest::of(&body).to_string(),
                    layer.digest,
                    "{round}, {what}: the whole blob, intact"
                );
            }
        }
        // Coalesced overlapping ranges still answer with the right bytes.
        let r = get(&url, &[("Range", "bytes=100000-100999,100500-101999,0-9")]).await;
        let ct = r.headers()["content-type"]
            .to_str()
            .expect("header text")
            .to_owned();
        let body = r.bytes().await.expect("body");
        let text = String::from_utf8_lossy(&body);
        assert!(
            ct.starts_with("multipart/byteranges")
                && text.contains(&format!("Content-Range: bytes 0-9/{}", layer.size))
                && text.contains(&format!(
                    "Content-Range: bytes 100000-101999/{}",
                    layer.size
                )),
            "{round}: {ct}"
        );
        // HEAD agrees with GET on the length.
        let head = reqwest::Client::new()
            .head(&url)
            .header(
                "Range",
                format!("bytes={}", vec![whole.as_str(); 64].join(",")),
            )
            .send()
            .await
            .expect("HEAD answered");
        assert!(
            head.content_length().unwrap_or(u64::MAX) <= layer.size,
            "{round} HEAD"
        );
    }
    agent.stop().await;
}

/// Serves `status` with a body that never ends (64 KiB every 10 ms) to one request;
/// counts the bytes it produced and notes when the client hung up.
#[derive(Clone, Default)]
struct Endless {
    sent: Arc<AtomicU64>,
    hung_up: Arc<AtomicBool>,
}

struct HangUp(Arc<AtomicBool>);

impl Drop for HangUp {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Endless {
    fn response(&self, status: u16, prefix: &'static [u8]) -> axum::response::Response {
        let sent = self.sent.clone();
        let guard = HangUp(self.hung_up.clone());
        let first = futures::stream::once(async move {
            Ok::<_, std::io::Error>(bytes::Bytes::from_static(prefix))
        });
        let rest = futures::stream::unfold((sent, guard), |(sent, guard)| async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            sent.fetch_add(64 << 10, Ordering::SeqCst);
            Some((
                Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'a'; 64 << 10])),
                (sent, guard),
            ))
        });
        axum::response::Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(axum::body::Body::from_stream(first.chain(rest)))
            .expect("response")
    }
}

/// A proxy in front of the real registry: 401 challenges point at an endless token
/// endpoint, and GETs of `poison` manifests get a 404 whose body never ends.
async fn endless_proxy(upstream: String, poison: String) -> (String, Endless, Endless) {
    let token = Endless::default();
    let error = Endless::default();
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", l.local_addr().expect("addr"));
    let (t, e, b) = (token.clone(), error.clone(), base.clone());
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let (client, upstream, t, e, base, poison) = (
            client.clone(),
            upstream.clone(),
            t.clone(),
            e.clone(),
            b.clone(),
            poison.clone(),
        );
        async move {
            let path = req.uri().path().to_owned();
            if path == "/endless-token" {
                return t.response(200, b"{\"token\": \"");
            }
            if path.ends_with(&format!("/manifests/{poison}")) && req.method() == "GET" {
                return e.response(
                    404,
                    b"{\"errors\": [{\"code\": \"MANIFEST_UNKNOWN\", \"message\": \"",
                );
            }
            let (_, resp, mut builder) = testkit::forward(&client, &upstream, req).await;
            if resp.status() == 401 {
                let challenge = format!(
                    "Bearer realm=\"{base}/endless-token\",service=\"starling-test-registry\""
                );
                if let Some(h) = builder.headers_mut() {
                    h.insert("www-authenticate", challenge.parse().expect("header value"));
                }
            }
            builder
                .body(axum::body::Body::from_stream(resp.bytes_stream()))
                .expect("response")
        }
    });
    tokio::spawn(async move { axum::serve(l, app).await });
    (base, token, error)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn endless_token_replies_and_error_bodies_are_cut_off() {
    let registry = blocking(|| Registry::start(RegistryAuth::token("u", "p", false))).await;
    let img = TestImage::push_multilayer(&registry, "priv/img", "1", &[64 << 10], 42)
        .expect("push image");
    let poison = oci::Digest::of(b"poison").to_string();
    let (proxy, token, error) = endless_proxy(registry.url(), poison.clone()).await;
    let cache = tempfile::tempdir().expect("temp dir");
    let agent = start_agent(
        cache.path(),
        &registry.host(),
        &proxy,
        Some(("u", "p")),
        |_| {},
    )
    .await;

    for (what, path, endless) in [
        (
            "endless token reply",
            format!("/v2/priv/img/manifests/{}", img.digest),
            &token,
        ),
        (
            "endless 404 body",
            format!("/v2/priv/img/manifests/{poison}"),
            &error,
        ),
    ] {
        let url = format!("{}{path}", agent.url());
        let answered = tokio::time::timeout(Duration::from_secs(30), get(&url, &[])).await;
        let sent = endless.sent.load(Ordering::SeqCst);
        let status = answered
            .unwrap_or_else(|_| {
                panic!(
                    "{what}: the agent was still reading after 30 s ({} MiB taken in)",
                    sent >> 20
                )
            })
            .status();
        assert!(
            status.is_client_error() || status.is_server_error(),
            "{what}: {status}"
        );
        for _ in 0..100 {
            if endless.hung_up.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            endless.hung_up.load(Ordering::SeqCst),
            "{what}: the agent kept the endless body open"
        );
        let sent = endless.sent.load(Ordering::SeqCst);
        assert!(
            sent < 16 << 20,
            "{what}: {} MiB were read before the agent stopped",
            sent >> 20
        );
    }
    agent.stop().await;
}
