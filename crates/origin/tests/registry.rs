//! The origin as a registry: manifests, blobs, HEAD, ranges, errors, path safety.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use common::*;
use oci::{Digest, Verifier};

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

async fn error_code(resp: reqwest::Response) -> String {
    assert_eq!(resp.headers()["content-type"], "application/json");
    let body: oci::ErrorBody = resp.json().await.expect("OCI error JSON");
    assert_eq!(body.errors.len(), 1);
    body.errors[0].code.clone()
}

#[test]
fn generation_is_deterministic() {
    let a = tempfile::tempdir().expect("tmp");
    let b = tempfile::tempdir().expect("tmp");
    let ia = generate(a.path());
    let ib = generate(b.path());
    assert_eq!(ia.manifest_digest, ib.manifest_digest);
    assert_eq!(ia.config_digest, ib.config_digest);
    assert_eq!(ia.layers, ib.layers);
    assert_eq!(ia.total_bytes, ib.total_bytes);
    assert_eq!(ia.layers.len(), 9);
    // Layers differ from each other and from another seed's.
    let mut ds: Vec<_> = ia.layers.iter().map(|l| l.digest.clone()).collect();
    ds.sort();
    ds.dedup();
    assert_eq!(ds.len(), 9);
    let c = tempfile::tempdir().expect("tmp");
    let mut spec = tiny_spec();
    spec.seed += 1;
    let ic = origin::generate_training_image(c.path(), &spec).expect("gen");
    assert_ne!(ic.manifest_digest, ia.manifest_digest);
    assert!(ic
        .layers
        .iter()
        .zip(&ia.layers)
        .all(|(x, y)| x.digest != y.digest));
    // Every file on disk matches its digest and the reported sizes.
    for l in &ia.layers {
        let bytes =
            std::fs::read(a.path().join("blobs/sha256").join(l.digest.hex())).expect("layer");
        assert_eq!(bytes.len() as u64, l.size);
        assert_eq!(Digest::of(&bytes), l.digest);
    }
    let sum: u64 =
        ia.layers.iter().map(|l| l.size).sum::<u64>() + ia.config_size + ia.manifest_size;
    assert_eq!(sum, ia.total_bytes);
}

#[test]
fn layers_are_valid_tar_gzip_with_matching_diff_ids() {
    use std::io::Read;
    let dir = tempfile::tempdir().expect("tmp");
    let img = generate(dir.path());
    let cfg: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            dir.path()
                .join("blobs/sha256")
                .join(img.config_digest.hex()),
        )
        .expect("config"),
    )
    .expect("config json");
    let diff_ids = cfg["rootfs"]["diff_ids"].as_array().expect("diff_ids");
    assert_eq!(diff_ids.len(), img.layers.len());
    let history = cfg["history"].as_array().expect("history");
    let non_empty: Vec<&str> = history
        .iter()
        .filter(|h| !h["empty_layer"].as_bool().unwrap_or(false))
        .map(|h| h["created_by"].as_str().expect("created_by"))
        .collect();
    assert_eq!(non_empty.len(), img.layers.len());
    assert!(non_empty[0].starts_with("FROM nvidia/cuda:12.4"));
    assert!(non_empty
        .iter()
        .any(|h| h.contains("pip install -r requirements.txt")));
    assert!(non_empty.iter().any(|h| h.contains("COPY . /workspace")));

    for (l, want) in img.layers.iter().zip(diff_ids) {
        let blob =
            std::fs::read(dir.path().join("blobs/sha256").join(l.digest.hex())).expect("layer");
        let mut tar_bytes = Vec::new();
        flate2::read::GzDecoder::new(&blob[..])
            .read_to_end(&mut tar_bytes)
            .expect("gunzip");
        assert_eq!(tar_bytes.len() as u64, l.uncompressed_size);
        assert_eq!(
            Digest::of(&tar_bytes).to_string(),
            want.as_str().expect("str")
        );
        assert_eq!(Digest::of(&tar_bytes), l.diff_id);
        let mut ar = tar::Archive::new(&tar_bytes[..]);
        let mut files = 0;
        for e in ar.entries().expect("entries") {
            let mut e = e.expect("entry");
            let path = e.path().expect("path").to_string_lossy().to_string();
            assert!(!path.starts_with('/') && !path.contains(".."), "{path}");
            if e.header().entry_type().is_file() {
                files += 1;
                let mut data = Vec::new();
                e.read_to_end(&mut data).expect("data");
                assert!(data.len() as u64 <= origin::synth::MAX_FILE_BYTES);
            }
        }
        assert_eq!(files, l.files);
        // Incompressible content: the gzip stream is not smaller than the tar.
        assert!(
            l.size >= l.uncompressed_size,
            "{} {}",
            l.size,
            l.uncompressed_size
        );
    }

    // And the system tar agrees.
    let big = &img.layers[1];
    let out = std::process::Command::new("tar")
        .arg("-tzf")
        .arg(dir.path().join("blobs/sha256").join(big.digest.hex()))
        .output()
        .expect("run tar");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(
        listing.contains("usr/local/cuda/lib64/libcuda-runtime-1-0.so"),
        "{listing}"
    );
}

#[tokio::test]
async fn pulls_manifest_and_every_blob() {
    let dir = tempfile::tempdir().expect("tmp");
    let img = generate(dir.path());
    let srv = start(dir.path(), None, None).await;
    let base = format!("http://{}", srv.local_addr());
    let c = client();

    let r = c.get(format!("{base}/v2/")).send().await.expect("ping");
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.expect("body"), "{}");

    let r = c
        .get(format!("{base}/v2/starling/train/manifests/train"))
        .header("accept", oci::media::DEFAULT_ACCEPT)
        .send()
        .await
        .expect("manifest");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], oci::media::OCI_MANIFEST);
    assert_eq!(
        r.headers()["docker-content-digest"],
        img.manifest_digest.to_string().as_str()
    );
    assert_eq!(
        r.headers()["content-length"],
        img.manifest_size.to_string().as_str()
    );
    let body = r.bytes().await.expect("body");
    assert_eq!(Digest::of(&body), img.manifest_digest);
    let m = oci::Manifest::parse(&body).expect("manifest");
    assert_eq!(m.layers.len(), img.layers.len());

    // By digest too.
    let r = c
        .get(format!("{base}/v2/x/manifests/{}", img.manifest_digest))
        .send()
        .await
        .expect("by digest");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], oci::media::OCI_MANIFEST);

    let mut total = body.len() as u64;
    for d in m.blobs() {
        let mut r = c
            .get(format!("{base}/v2/starling/train/blobs/{}", d.digest))
            .send()
            .await
            .expect("blob");
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["content-length"], d.size.to_string().as_str());
        assert_eq!(
            r.headers()["docker-content-digest"],
            d.digest.to_string().as_str()
        );
        let mut v = Verifier::new(d.digest.clone());
        while let Some(chunk) = r.chunk().await.expect("chunk") {
            v.update(&chunk);
        }
        assert_eq!(v.len(), d.size);
        v.finish().expect("digest matches");
        total += d.size;
    }
    assert_eq!(total, img.total_bytes);

    let s = srv.stats().snapshot();
    assert_eq!(s.manifest_requests, 2);
    assert_eq!(s.blob_requests, m.blobs().count() as u64);
    assert_eq!(s.blob_bytes_sent, total - body.len() as u64);
    assert_eq!(s.manifest_bytes_sent, 2 * body.len() as u64);
    assert_eq!(s.error_responses, 0);
    assert_eq!(s.requests, 3 + m.blobs().count() as u64);

    let r = c
        .get(format!("{base}/v2/starling/train/tags/list"))
        .send()
        .await
        .expect("tags");
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.expect("json");
    assert_eq!(
        v,
        serde_json::json!({"name": "starling/train", "tags": ["train"]})
    );
    srv.shutdown().await.expect("clean shutdown");
}

#[tokio::test]
async fn head_requests_carry_headers_without_body() {
    let dir = tempfile::tempdir().expect("tmp");
    let img = generate(dir.path());
    let srv = start(dir.path(), None, None).await;
    let base = format!("http://{}", srv.local_addr());
    let (status, head, body) = raw_head(srv.local_addr(), "/v2/a/manifests/train").await;
    assert_eq!(status, 200);
    assert!(body.is_empty());
    let h = head.to_ascii_lowercase();
    assert!(
        h.contains(&format!("content-length: {}\r\n", img.manifest_size)),
        "{head}"
    );
    assert!(
        h.contains(&format!(
            "docker-content-digest: {}\r\n",
            img.manifest_digest
        )),
        "{head}"
    );
    assert!(
        h.contains(&format!("content-type: {}\r\n", oci::media::OCI_MANIFEST)),
        "{head}"
    );

    let l = &img.layers[1];
    let r = client()
        .head(format!("{base}/v2/a/blobs/{}", l.digest))
        .send()
        .await
        .expect("head");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-length"], l.size.to_string().as_str());
    assert_eq!(
        r.headers()["docker-content-digest"],
        l.digest.to_string().as_str()
    );
    assert_eq!(r.headers()["accept-ranges"], "bytes");
    assert!(r.bytes().await.expect("body").is_empty());

    let r = client()
        .head(format!("{base}/v2/a/blobs/sha256:{}", "0".repeat(64)))
        .send()
        .await
        .expect("head");
    assert_eq!(r.status(), 404);
    // HEAD moves no blob bytes.
    assert_eq!(srv.stats().snapshot().blob_bytes_sent, 0);
    assert_eq!(srv.stats().snapshot().manifest_bytes_sent, 0);
}

async fn raw_head(addr: std::net::SocketAddr, path: &str) -> (u16, String, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("HEAD {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.expect("read");
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("header end");
    let head = String::from_utf8_lossy(&out[..split + 2]).to_string();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    (status, head, out[split + 4..].to_vec())
}

fn blob4000() -> Vec<u8> {
    (0..4000u32)
        .map(|i| (i.wrapping_mul(7919) % 251) as u8)
        .collect()
}

#[tokio::test]
async fn range_requests() {
    let dir = tempfile::tempdir().expect("tmp");
    generate(dir.path());
    let data = blob4000();
    let d = add_blob(dir.path(), &data);
    let srv = start(dir.path(), None, None).await;
    let url = format!("http://{}/v2/a/blobs/{d}", srv.local_addr());
    let c = client();

    for (h, start, end) in [
        ("bytes=500-1499", 500, 1499),
        ("bytes=500-", 500, 3999),
        ("bytes=-500", 3500, 3999),
        ("bytes=2000-5000", 2000, 3999),
    ] {
        let r = c.get(&url).header("range", h).send().await.expect("range");
        assert_eq!(r.status(), 206, "{h}");
        assert_eq!(
            r.headers()["content-range"],
            format!("bytes {start}-{end}/4000").as_str(),
            "{h}"
        );
        assert_eq!(
            r.headers()["content-length"],
            (end - start + 1).to_string().as_str(),
            "{h}"
        );
        assert_eq!(r.headers()["docker-content-digest"], d.to_string().as_str());
        let body = r.bytes().await.expect("body");
        assert_eq!(&body[..], &data[start..=end], "{h}");
    }

    // HEAD with a range reports the partial headers.
    let r = c
        .head(&url)
        .header("range", "bytes=10-19")
        .send()
        .await
        .expect("head range");
    assert_eq!(r.status(), 206);
    assert_eq!(r.headers()["content-range"], "bytes 10-19/4000");
    assert_eq!(r.headers()["content-length"], "10");

    for h in ["bytes=4000-", "bytes=5000-6000", "bytes=-0"] {
        let r = c.get(&url).header("range", h).send().await.expect("416");
        assert_eq!(r.status(), 416, "{h}");
        assert_eq!(r.headers()["content-range"], "bytes */4000", "{h}");
        assert_eq!(error_code(r).await, "RANGE_INVALID");
    }

    for h in ["items=0-1", "bytes=abc", "bytes=5-1", "bytes=", "bytes=--1"] {
        let r = c.get(&url).header("range", h).send().await.expect("400");
        assert_eq!(r.status(), 400, "{h}");
        assert_eq!(error_code(r).await, "RANGE_INVALID", "{h}");
    }

    // Multi-range: multipart/byteranges, each part checked, unsatisfiable parts dropped.
    let r = c
        .get(&url)
        .header("range", "bytes=0-9, 100-199, -5, 9000-")
        .send()
        .await
        .expect("multi");
    assert_eq!(r.status(), 206);
    let ct = r.headers()["content-type"].to_str().expect("ct").to_owned();
    let boundary = ct
        .strip_prefix("multipart/byteranges; boundary=")
        .expect("multipart ct");
    let declared: usize = r.headers()["content-length"]
        .to_str()
        .expect("cl")
        .parse()
        .expect("num");
    let body = r.bytes().await.expect("body");
    assert_eq!(body.len(), declared);
    let parts = parse_multipart(&body, boundary);
    let want = [(0usize, 9usize), (100, 199), (3995, 3999)];
    assert_eq!(parts.len(), want.len());
    for ((cr, bytes), (s, e)) in parts.iter().zip(want) {
        assert_eq!(cr, &format!("bytes {s}-{e}/4000"));
        assert_eq!(&bytes[..], &data[s..=e]);
    }

    // Overlapping ranges adding up to more than the blob: the whole blob, once.
    let r = c
        .get(&url)
        .header("range", "bytes=0-3999,0-3999")
        .send()
        .await
        .expect("overlap");
    assert_eq!(r.status(), 200);
    assert_eq!(&r.bytes().await.expect("body")[..], &data[..]);
}

/// Minimal multipart/byteranges parser: returns (Content-Range, bytes) per part.
fn parse_multipart(body: &[u8], boundary: &str) -> Vec<(String, Vec<u8>)> {
    let delim = format!("--{boundary}");
    let find = |hay: &[u8], needle: &[u8], from: usize| {
        hay[from..]
            .windows(needle.len())
            .position(|w| w == needle)
            .map(|p| p + from)
    };
    let mut out = Vec::new();
    let mut pos = find(body, delim.as_bytes(), 0).expect("first delimiter");
    loop {
        let after = pos + delim.len();
        if body[after..].starts_with(b"--") {
            assert_eq!(&body[after..], b"--\r\n");
            break;
        }
        assert!(body[after..].starts_with(b"\r\n"));
        let hdr_end = find(body, b"\r\n\r\n", after).expect("part headers");
        let headers = String::from_utf8_lossy(&body[after + 2..hdr_end]).to_string();
        let cr = headers
            .lines()
            .find_map(|l| l.strip_prefix("Content-Range: "))
            .expect("content-range")
            .to_owned();
        let (_, rest) = cr.split_once(' ').expect("unit");
        let (range, _) = rest.split_once('/').expect("total");
        let (s, e) = range.split_once('-').expect("range");
        let len = e.parse::<usize>().expect("e") - s.parse::<usize>().expect("s") + 1;
        let data_start = hdr_end + 4;
        out.push((cr, body[data_start..data_start + len].to_vec()));
        let next = data_start + len;
        assert!(body[next..].starts_with(format!("\r\n{delim}").as_bytes()));
        pos = next + 2;
    }
    out
}

#[tokio::test]
async fn errors_are_oci_json() {
    let dir = tempfile::tempdir().expect("tmp");
    let img = generate(dir.path());
    let srv = start(dir.path(), Some("starling/train"), None).await;
    let base = format!("http://{}", srv.local_addr());
    let c = client();
    let zero = format!("sha256:{}", "0".repeat(64));

    let r = c
        .get(format!("{base}/v2/starling/train/blobs/{zero}"))
        .send()
        .await
        .expect("req");
    assert_eq!(r.status(), 404);
    assert_eq!(error_code(r).await, "BLOB_UNKNOWN");

    let r = c
        .get(format!("{base}/v2/starling/train/manifests/nope"))
        .send()
        .await
        .expect("req");
    assert_eq!(r.status(), 404);
    assert_eq!(error_code(r).await, "MANIFEST_UNKNOWN");

    let r = c
        .get(format!("{base}/v2/starling/train/manifests/{zero}"))
        .send()
        .await
        .expect("req");
    assert_eq!(r.status(), 404);
    assert_eq!(error_code(r).await, "MANIFEST_UNKNOWN");

    // A layer is a blob, not a manifest.
    let r = c
        .get(format!(
            "{base}/v2/starling/train/manifests/{}",
            img.layers[0].digest
        ))
        .send()
        .await
        .expect("req");
    assert_eq!(r.status(), 404);
    assert_eq!(error_code(r).await, "MANIFEST_UNKNOWN");

    for bad in ["sha256:abc", "md5:0000", "sha256:ZZ", "nodigest"] {
        let r = c
            .get(format!("{base}/v2/starling/train/blobs/{bad}"))
            .send()
            .await
            .expect("req");
        assert_eq!(r.status(), 400, "{bad}");
        assert_eq!(error_code(r).await, "DIGEST_INVALID", "{bad}");
    }

    let r = c
        .get(format!("{base}/v2/Starling/Train/manifests/train"))
        .send()
        .await
        .expect("req");
    assert_eq!(r.status(), 400);
    assert_eq!(error_code(r).await, "NAME_INVALID");

    // Only the configured repository is served.
    let r = c
        .get(format!("{base}/v2/other/manifests/train"))
        .send()
        .await
        .expect("req");
    assert_eq!(r.status(), 404);
    assert_eq!(error_code(r).await, "NAME_UNKNOWN");
    let r = c
        .get(format!("{base}/v2/starling/train/manifests/train"))
        .send()
        .await
        .expect("req");
    assert_eq!(r.status(), 200);

    // Read-only.
    let r = c
        .post(format!("{base}/v2/starling/train/blobs/uploads/"))
        .send()
        .await
        .expect("req");
    assert_eq!(r.status(), 405);
    assert_eq!(error_code(r).await, "UNSUPPORTED");

    assert_eq!(srv.stats().snapshot().error_responses, 11);
}

#[tokio::test]
async fn never_serves_files_outside_the_layout() {
    let root = tempfile::tempdir().expect("tmp");
    let layout = root.path().join("layout");
    generate(&layout);
    std::fs::write(root.path().join("secret.txt"), "TOPSECRET").expect("secret");
    // A symlinked "blob" pointing outside the layout.
    let secret_digest = Digest::of(b"TOPSECRET");
    std::os::unix::fs::symlink(
        root.path().join("secret.txt"),
        layout.join("blobs/sha256").join(secret_digest.hex()),
    )
    .expect("symlink");
    let srv = start(&layout, None, None).await;
    let addr = srv.local_addr();

    let attempts = [
        "/v2/a/blobs/sha256:../../etc/passwd".to_owned(),
        "/v2/a/blobs/sha256:..%2f..%2f..%2fsecret.txt".to_owned(),
        "/v2/a/blobs/%2e%2e/%2e%2e/%2e%2e/secret.txt".to_owned(),
        "/v2/a/blobs/sha256:%2e%2e%2f%2e%2e%2f%2e%2e%2fsecret.txt".to_owned(),
        "/v2/a/blobs/../../../secret.txt".to_owned(),
        "/v2/../../secret.txt".to_owned(),
        "/v2/a/manifests/../../../secret.txt".to_owned(),
        "/v2/a/manifests/%2e%2e%2f%2e%2e%2fsecret.txt".to_owned(),
        "/v2/%2e%2e/blobs/sha256:0000000000000000000000000000000000000000000000000000000000000000"
            .to_owned(),
        "/v2/a/blobs/oci-layout".to_owned(),
        "/v2/a/manifests/index.json".to_owned(),
        format!("/v2/a/blobs/{secret_digest}"),
        format!("/v2/a/manifests/{secret_digest}"),
    ];
    for p in &attempts {
        let (status, head, body) = raw_get(addr, p).await;
        assert!(status == 400 || status == 404, "{p}: {status} {head}");
        let text = String::from_utf8_lossy(&body);
        assert!(
            !text.contains("TOPSECRET")
                && !text.contains("root:")
                && !text.contains("imageLayoutVersion"),
            "{p}: {text}"
        );
        let e: oci::ErrorBody =
            serde_json::from_slice(&body).unwrap_or_else(|_| panic!("{p}: not OCI JSON: {text}"));
        assert!(!e.errors.is_empty());
    }
    let (status, _, body) = raw_get(addr, "/v2/a/blobs/sha256:../../etc/passwd").await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("DIGEST_INVALID"));
}

#[tokio::test]
async fn limited_origin_serves_exact_bytes_and_counts_them() {
    let dir = tempfile::tempdir().expect("tmp");
    let img = generate(dir.path());
    // 64 MiB/s: the tiny image fits the 3.2 MiB burst, so this is quick; the pacing
    // itself is tested on a virtual clock in the limiter's unit tests.
    let srv = start(dir.path(), None, Some(64 << 20)).await;
    let base = format!("http://{}", srv.local_addr());
    let c = client();
    let mut tasks = Vec::new();
    for l in img.layers.clone() {
        let c = c.clone();
        let url = format!("{base}/v2/a/blobs/{}", l.digest);
        tasks.push(tokio::spawn(async move {
            let b = c
                .get(url)
                .send()
                .await
                .expect("get")
                .bytes()
                .await
                .expect("body");
            assert_eq!(Digest::of(&b), l.digest);
            b.len() as u64
        }));
    }
    let mut sum = 0;
    for t in tasks {
        sum += t.await.expect("task");
    }
    assert_eq!(sum, img.layers.iter().map(|l| l.size).sum::<u64>());
    assert_eq!(
        srv.stats()
            .blob_bytes_sent
            .load(std::sync::atomic::Ordering::Relaxed),
        sum
    );
    assert_eq!(srv.stats().egress_bytes(), sum);
}

#[tokio::test]
async fn bind_rejects_a_directory_that_is_not_a_layout() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = origin::OriginConfig {
        layout_dir: dir.path().to_owned(),
        listen: "127.0.0.1:0".parse().expect("addr"),
        egress_limit_bytes_per_sec: None,
        repository: None,
        latency: None,
    };
    // Named as what it is: not a layout (no oci-layout marker).
    assert!(matches!(
        origin::bind(cfg).await,
        Err(origin::Error::Layout { ref reason, .. }) if reason.contains("not an OCI image layout")
    ));
}

/// Pinned: a change here changes every generated image (and invalidates caches and
/// benchmark baselines keyed on these digests), so it must be deliberate.
#[test]
fn tiny_training_image_digest_is_pinned() {
    let dir = tempfile::tempdir().expect("tmp");
    let img = origin::generate_training_image(dir.path(), &origin::SynthSpec::training(0.0))
        .expect("gen");
    assert_eq!(
        img.manifest_digest.to_string(),
        "sha256:7347a44277da04726e39a31bc018572d696cb15c68410dff4b95ebd2ddb27b59"
    );
}
