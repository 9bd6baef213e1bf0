//! Cluster TLS for the process tests: a PKI made with `starling certs`, certificates
//! issued by it, an HTTPS tracker, and HTTP clients that present a given certificate.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::{args, spawn_with_env, Proc};

/// A PKI directory made by `starling certs init`, with the pin it printed.
pub struct TestPki {
    pub dir: PathBuf,
    pub pin: String,
}

/// Runs `starling ARGS` to completion; panics with its stderr unless it succeeds.
pub fn starling_ok(a: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_starling"))
        .args(a)
        .output()
        .expect("run starling");
    assert!(
        out.status.success(),
        "starling {a:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

impl TestPki {
    /// `starling certs init --dir <parent>/<name>`.
    pub fn init(parent: &Path, name: &str) -> TestPki {
        let dir = parent.join(name);
        let out = starling_ok(&["certs", "init", "--dir", &dir.display().to_string()]);
        TestPki {
            dir,
            pin: out.trim().to_owned(),
        }
    }

    /// `starling certs token` (optionally `--name PATTERN`).
    pub fn token(&self, pattern: Option<&str>) -> String {
        let dir = self.dir.display().to_string();
        let mut a = vec!["certs", "token", "--dir", &dir, "--ttl", "10m"];
        if let Some(p) = pattern {
            a.extend(["--name", p]);
        }
        starling_ok(&a).trim().to_owned()
    }

    /// `starling certs issue --role ROLE --name NAME --out <parent>/<role>-<name>`;
    /// returns the directory (`<role>.crt`, `<role>.key`, `ca.crt`).
    pub fn issue(&self, role: &str, name: &str) -> PathBuf {
        let out = self
            .dir
            .parent()
            .expect("parent")
            .join(format!("{role}-{name}"));
        starling_ok(&[
            "certs",
            "issue",
            "--dir",
            &self.dir.display().to_string(),
            "--role",
            role,
            "--name",
            name,
            "--out",
            &out.display().to_string(),
        ]);
        out
    }

    /// The CA certificate file.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }
}

/// An HTTPS client trusting `ca_file` and presenting `cert`/`key` (PEM) when given.
pub fn client_pem(ca_file: &Path, cert: Option<(&str, &str)>) -> reqwest::Client {
    let trust = pki::ClusterTrust::from_file(ca_file).expect("CA file");
    let source = cert.map(|(c, k)| pki::CertSource::from_pem(c, k).expect("certificate"));
    let tls = pki::tracker_client_config(&trust, source.as_ref()).expect("client config");
    reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .timeout(Duration::from_secs(20))
        .build()
        .expect("client")
}

/// [`client_pem`] with the certificate of `starling certs issue` in `dir` for `role`.
pub fn client_for(ca_file: &Path, dir: &Path, role: &str) -> reqwest::Client {
    let cert = std::fs::read_to_string(dir.join(format!("{role}.crt"))).expect("cert");
    let key = std::fs::read_to_string(dir.join(format!("{role}.key"))).expect("key");
    client_pem(ca_file, Some((&cert, &key)))
}

/// A tracker serving HTTPS with `--pki`; ready once `/healthz` answers over TLS.
pub struct TlsTracker {
    pub proc: Proc,
}

impl TlsTracker {
    pub async fn start(dir: &Path, pki: &TestPki, extra: &[&str]) -> TlsTracker {
        let port = testkit::free_port();
        let mut a = args(&[
            "tracker",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
            &dir.join(format!("tdata-{port}")).display().to_string(),
            "--pki",
            &pki.dir.display().to_string(),
        ]);
        a.extend(args(extra));
        let log = dir.join(format!("tracker-{port}.log"));
        let proc = Proc {
            child: spawn_with_env(&a, &log, &[]),
            port,
            cache: dir.to_owned(),
            args: a,
            log,
        };
        let t = TlsTracker { proc };
        let anonymous = client_pem(&pki.ca_file(), None);
        for _ in 0..400 {
            if anonymous
                .get(format!("{}/healthz", t.url()))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
            {
                return t;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("HTTPS tracker not ready; log:\n{}", t.proc.log_text());
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.proc.port)
    }
}
