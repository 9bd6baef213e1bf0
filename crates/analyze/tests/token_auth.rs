//! Bearer-token auth of the built-in registry client, against a minimal fake
//! registry + token server on loopback (std only) serving an OCI layout.
#![allow(clippy::unwrap_used)]
mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;

fn serve(dir: PathBuf, listener: TcpListener, tokens: Arc<AtomicUsize>, denied: Arc<AtomicUsize>) {
    let port = listener.local_addr().unwrap().port();
    for stream in listener.incoming() {
        let Ok(mut s) = stream else { continue };
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        if r.read_line(&mut line).is_err() {
            continue;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
        let mut auth = String::new();
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).is_err() || h == "\r\n" || h.is_empty() {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("authorization:") {
                auth = v.trim().to_owned();
            }
        }
        let reply = |s: &mut std::net::TcpStream, status: &str, extra: &str, body: &[u8]| {
            let _ = write!(
                s,
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n",
                body.len()
            );
            let _ = s.write_all(body);
        };
        if path.starts_with("/token?") {
            // user:pass
            if auth == "basic dxnlcjpwyxnz" && path.contains("scope=repository%3Ateam%2Fimg%3Apull")
            {
                tokens.fetch_add(1, Ordering::SeqCst);
                reply(
                    &mut s,
                    "200 OK",
                    "Content-Type: application/json\r\n",
                    br#"{"token":"tok123"}"#,
                );
            } else {
                reply(&mut s, "401 Unauthorized", "", b"{}");
            }
            continue;
        }
        if auth != "bearer tok123" {
            denied.fetch_add(1, Ordering::SeqCst);
            let h = format!("WWW-Authenticate: Bearer realm=\"http://127.0.0.1:{port}/token\",service=\"fake\"\r\n");
            reply(
                &mut s,
                "401 Unauthorized",
                &h,
                b"{\"errors\":[{\"code\":\"UNAUTHORIZED\"}]}",
            );
            continue;
        }
        let file = if let Some(rest) = path.strip_prefix("/v2/team/img/manifests/") {
            if rest == "v1" {
                let idx: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap())
                        .unwrap();
                idx["manifests"][0]["digest"]
                    .as_str()
                    .unwrap()
                    .trim_start_matches("sha256:")
                    .to_owned()
            } else {
                rest.trim_start_matches("sha256:").to_owned()
            }
        } else if let Some(rest) = path.strip_prefix("/v2/team/img/blobs/sha256:") {
            rest.to_owned()
        } else {
            reply(&mut s, "404 Not Found", "", b"{}");
            continue;
        };
        match std::fs::read(dir.join("blobs/sha256").join(file)) {
            Ok(b) => reply(
                &mut s,
                "200 OK",
                "Content-Type: application/vnd.oci.image.manifest.v1+json\r\n",
                &b,
            ),
            Err(_) => reply(&mut s, "404 Not Found", "", b"{}"),
        }
    }
}

#[test]
fn bearer_token_flow() {
    let t = tempfile::tempdir().unwrap();
    let mut lay = Layout::new(t.path());
    let layers = vec![
        Layer::gz(
            tar_layer(&[E::File("root/.cache/pip/wheels/x.whl", bytes(1234, 1))]),
            "RUN pip install x",
        ),
        Layer::zst(
            tar_layer(&[E::File("app/main.py", bytes(99, 2))]),
            "COPY . /app",
        ),
    ];
    let d = lay.image(&layers, "amd64");
    lay.tag(d, "v1");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tokens, denied) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (tk, dn, dir) = (tokens.clone(), denied.clone(), t.path().to_owned());
    std::thread::spawn(move || serve(dir, listener, tk, dn));
    let spec = analyze::source::SourceSpec::parse(&format!("127.0.0.1:{port}/team/img:v1"));
    // Without credentials the token server refuses: a clear error.
    let err = analyze::source::open(&spec, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("token endpoint answered 401"), "{err}");
    let o = analyze::source::OpenOptions {
        credentials: Some(("user".into(), "pass".into())),
        ..Default::default()
    };
    let image = analyze::source::open(&spec, &o).unwrap();
    let r = analyze::analyze(&image, &opts()).report;
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(r.efficiency.cumulative_bytes, 1333);
    assert_eq!(r.rule_bytes(analyze::rules::Rule::PackageCache), 1234);
    assert_eq!(
        tokens.load(Ordering::SeqCst),
        1,
        "one token, reused for manifest, config and both layers"
    );
    assert_eq!(denied.load(Ordering::SeqCst), 2, "one challenge per client");
}
