#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;

use origin::{OriginConfig, RunningOrigin, SynthImage, SynthSpec};

/// A small image: every layer at the 4 KiB minimum except two of ~100–300 KiB.
pub fn tiny_spec() -> SynthSpec {
    let mut s = SynthSpec::training(0.0);
    s.layers[1].1 = 300 * 1024 + 17;
    s.layers[5].1 = 100 * 1024;
    s
}

pub fn generate(dir: &Path) -> SynthImage {
    origin::generate_training_image(dir, &tiny_spec()).expect("generate")
}

pub async fn start(dir: &Path, repository: Option<&str>, limit: Option<u64>) -> RunningOrigin {
    let cfg = OriginConfig {
        layout_dir: dir.to_owned(),
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        egress_limit_bytes_per_sec: limit,
        repository: repository.map(str::to_owned),
        latency: None,
    };
    origin::bind(cfg).await.expect("bind").spawn()
}

/// Writes raw bytes into the layout as a blob and returns its digest.
pub fn add_blob(dir: &Path, bytes: &[u8]) -> oci::Digest {
    let d = oci::Digest::of(bytes);
    std::fs::write(dir.join("blobs/sha256").join(d.hex()), bytes).expect("write blob");
    d
}

/// Sends one request with the path exactly as given (no client-side normalisation)
/// and returns (status, head, body).
pub async fn raw_get(addr: SocketAddr, path: &str) -> (u16, String, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.expect("read");
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("header end");
    let head = String::from_utf8_lossy(&out[..split]).to_string();
    let body = out[split + 4..].to_vec();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    (status, head, body)
}
