//! `starling get` as a process, against real agents, a real tracker and the real
//! docker-registry holding OCI artifacts pushed by testkit (issue 13).

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::Proc;
use testkit::{ArtifactFile, Registry, RegistryAuth, TestArtifact};

const TOKEN: &str = "test-cluster-token";

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

async fn tracker(dir: &Path) -> Proc {
    common::start_tracker(dir, &["--cluster-token", TOKEN], &[]).await
}

async fn agent(
    dir: &Path,
    name: &str,
    tracker: Option<&str>,
    registry: &Registry,
    extra: &[&str],
) -> Proc {
    let port = testkit::free_port();
    let cache = dir.join(name);
    let host = registry.host();
    let mut args = common::args(&[
        "agent",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--cache-dir",
        &cache.display().to_string(),
        "--registry-endpoint",
        &format!("{host}={}", registry.url()),
        "--node-name",
        name,
        "--min-free",
        "0",
    ]);
    if let Some(t) = tracker {
        args.extend(common::args(&["--tracker", t, "--cluster-token", TOKEN]));
    }
    args.extend(common::args(extra));
    Proc::start(args, port, dir.join(format!("{name}.log")), cache).await
}

async fn get(args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_starling"))
            .arg("get")
            .args(&args)
            .env("STARLING_LOG", "warn")
            .output()
            .expect("run starling get")
    })
    .await
}

fn report(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "get failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    serde_json::from_slice(&out.stdout).expect("JSON report")
}

fn file_report<'a>(r: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    r["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == name)
        .unwrap_or_else(|| panic!("{name} not in report {r}"))
}

/// Names of what is in `dir` (recursively, relative), partial files included.
fn listing(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, d: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                out.push(p.strip_prefix(base).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

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

/// A real nginx on a free loopback port serving `www` (Range and ETag come with it),
/// logging every response's body size.
struct Nginx {
    child: std::process::Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Nginx {
    fn start() -> Nginx {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("www")).unwrap();
        std::fs::create_dir_all(d.join("tmp")).unwrap();
        let port = testkit::free_port();
        let p = |s: &str| d.join(s).display().to_string();
        let conf = format!(
            "daemon off;\nmaster_process off;\nerror_log {err};\npid {pid};\n\
             events {{ worker_connections 256; }}\n\
             http {{\n  log_format bytes '$request_method $uri $status $body_bytes_sent';\n\
               access_log {log} bytes;\n  client_body_temp_path {tmp};\n  proxy_temp_path {tmp};\n\
               fastcgi_temp_path {tmp};\n  uwsgi_temp_path {tmp};\n  scgi_temp_path {tmp};\n\
               server {{ listen 127.0.0.1:{port}; root {www}; }}\n}}\n",
            err = p("error.log"),
            pid = p("nginx.pid"),
            log = p("access.log"),
            tmp = p("tmp"),
            www = p("www"),
        );
        std::fs::write(d.join("nginx.conf"), conf).unwrap();
        let child = Command::new("nginx")
            .args(["-c", &p("nginx.conf"), "-p", &d.display().to_string()])
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nginx installed");
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Nginx { child, port, dir }
    }

    fn put(&self, name: &str, bytes: &[u8]) {
        std::fs::write(self.dir.path().join("www").join(name), bytes).unwrap();
    }

    fn url(&self, name: &str) -> String {
        format!("http://127.0.0.1:{}/{name}", self.port)
    }

    fn origin(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Body bytes sent for `name` so far.
    fn bytes_sent(&self, name: &str) -> u64 {
        let log = std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default();
        log.lines()
            .filter(|l| l.split(' ').nth(1) == Some(&format!("/{name}")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_url_reaches_two_nodes_with_one_origin_read_whatever_its_query() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let nginx = blocking(Nginx::start).await;
    let bytes = testkit::random_bytes(6 << 20, 40);
    nginx.put("w.bin", &bytes);
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
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let nginx = blocking(Nginx::start).await;
    let bytes = testkit::random_bytes(24 << 20, 70);
    nginx.put("w.bin", &bytes);
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
    let cli = |args: Vec<String>| async move {
        blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_starling"))
                .args(&args)
                .env("STARLING_LOG", "warn")
                .output()
                .unwrap()
        })
        .await
    };
    let tracker_url = t.url();
    let mut nodes_seen = false;
    for _ in 0..200 {
        let out = cli(common::args(&[
            "nodes",
            "--tracker",
            &tracker_url,
            "--json",
        ]))
        .await;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if v["nodes"].as_array().is_some_and(|n| n.len() == 3) {
            nodes_seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(nodes_seen, "3 nodes reported");
    let out = cli(common::args(&[
        "prewarm",
        "--tracker",
        &tracker_url,
        &source,
        "--selector",
        "gpu=h100",
        "--wait",
    ]))
    .await;
    assert!(
        out.status.success(),
        "prewarm: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut warm = Vec::new();
    for _ in 0..100 {
        let out = cli(common::args(&[
            "where",
            "--tracker",
            &tracker_url,
            &source,
            "--json",
        ]))
        .await;
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
    let out = cli(common::args(&[
        "prewarm",
        "--tracker",
        &tracker_url,
        "https://x.example/w.bin",
    ]))
    .await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not prewarmed by the cluster layer yet"));
}

/// A tmpfs of `size` on a fresh directory (needs root, like the agent's disk-full
/// tests); unmounted on drop.
struct Tmpfs {
    _dir: tempfile::TempDir,
    mount: std::path::PathBuf,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        let mount = dir.path().join("fs");
        std::fs::create_dir(&mount).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&mount)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mounting a tmpfs needs root: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs { _dir: dir, mount }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_destination_without_room_is_refused_before_the_first_byte() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let nginx = blocking(Nginx::start).await;
    let bytes = testkit::random_bytes(6 << 20, 90);
    nginx.put("w.bin", &bytes);
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
