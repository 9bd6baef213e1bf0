//! A real CNCF distribution registry (`docker-registry serve`) on loopback, over
//! plain HTTP or HTTPS ([`Registry::start_tls`]: a certificate from a throwaway CA,
//! optionally requiring client certificates).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tempfile::TempDir;

use crate::http::HttpResponse;
use crate::process::{log_tail, ChildProc};
use crate::tls::RegistryTls;
use crate::token::{TokenConfig, TokenServer};
use crate::util::{free_port, run_ok};

/// How long to wait for the registry to answer `/v2/`.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const START_ATTEMPTS: usize = 5;

/// Authentication mode of a [`Registry`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistryAuth {
    /// Anonymous read/write.
    None,
    /// HTTP Basic auth against a bcrypt htpasswd file (`htpasswd -Bbn`).
    Htpasswd { user: String, password: String },
    /// Docker token auth; a [`TokenServer`] is started alongside.
    Token {
        user: String,
        password: String,
        allow_anonymous: bool,
    },
}

impl RegistryAuth {
    pub fn htpasswd(user: &str, password: &str) -> RegistryAuth {
        RegistryAuth::Htpasswd {
            user: user.into(),
            password: password.into(),
        }
    }

    pub fn token(user: &str, password: &str, allow_anonymous: bool) -> RegistryAuth {
        RegistryAuth::Token {
            user: user.into(),
            password: password.into(),
            allow_anonymous,
        }
    }

    /// `(user, password)` if this mode has credentials.
    pub fn creds(&self) -> Option<(&str, &str)> {
        match self {
            RegistryAuth::None => None,
            RegistryAuth::Htpasswd { user, password }
            | RegistryAuth::Token { user, password, .. } => Some((user, password)),
        }
    }
}

/// A running `docker-registry` with filesystem storage in a temp dir.
/// Killed (and its temp dir removed) on drop.
pub struct Registry {
    // Field order matters for drop: process first, then token server, then dir.
    proc: Option<ChildProc>,
    token: Option<TokenServer>,
    auth: RegistryAuth,
    /// HTTPS settings, and the client configuration testkit uses to reach it.
    tls: Option<(RegistryTls, Arc<rustls::ClientConfig>)>,
    port: u16,
    config_path: PathBuf,
    log_path: PathBuf,
    data_dir: PathBuf,
    dir: TempDir,
}

impl Registry {
    /// Starts a registry; panics with the registry log on failure (test helper).
    pub fn start(auth: RegistryAuth) -> Registry {
        Self::try_start(auth)
            .unwrap_or_else(|e| panic!("testkit: failed to start docker-registry: {e:#}"))
    }

    /// Starts a registry with a random free port, retrying on port clashes.
    pub fn try_start(auth: RegistryAuth) -> Result<Registry> {
        Self::try_start_with(auth, None)
    }

    /// Starts a registry serving HTTPS with `tls` (see [`RegistryTls`]); panics with
    /// the registry log on failure (test helper).
    pub fn start_tls(auth: RegistryAuth, tls: RegistryTls) -> Registry {
        Self::try_start_with(auth, Some(tls))
            .unwrap_or_else(|e| panic!("testkit: failed to start docker-registry (TLS): {e:#}"))
    }

    pub fn try_start_tls(auth: RegistryAuth, tls: RegistryTls) -> Result<Registry> {
        Self::try_start_with(auth, Some(tls))
    }

    fn try_start_with(auth: RegistryAuth, tls: Option<RegistryTls>) -> Result<Registry> {
        let dir = tempfile::Builder::new()
            .prefix("testkit-registry-")
            .tempdir()
            .context("creating registry temp dir")?;
        let data_dir = dir.path().join("data");
        std::fs::create_dir_all(&data_dir)?;
        let config_path = dir.path().join("config.yml");
        let log_path = dir.path().join("registry.log");

        let (auth_yaml, token) = match &auth {
            RegistryAuth::None => (String::new(), None),
            RegistryAuth::Htpasswd { user, password } => {
                let out = run_ok(Command::new("htpasswd").args(["-Bbn", user, password]))?;
                let file = dir.path().join("htpasswd");
                std::fs::write(&file, &out.stdout)?;
                (
                    format!(
                        "auth:\n  htpasswd:\n    realm: testkit-registry\n    path: {}\n",
                        file.display()
                    ),
                    None,
                )
            }
            RegistryAuth::Token {
                user,
                password,
                allow_anonymous,
            } => {
                let ts = TokenServer::start(TokenConfig::new(user, password, *allow_anonymous))?;
                let bundle = ts.write_cert_bundle(&dir.path().join("token-root.pem"))?;
                let yaml = format!(
                    "auth:\n  token:\n    realm: {}\n    service: {}\n    issuer: {}\n    rootcertbundle: {}\n",
                    ts.realm(),
                    ts.service(),
                    ts.issuer(),
                    bundle.display()
                );
                (yaml, Some(ts))
            }
        };

        let tls_yaml = match &tls {
            None => String::new(),
            Some(t) => {
                let (cert, key) = t.server.write(dir.path(), "server")?;
                let ca = dir.path().join("ca.crt");
                std::fs::write(&ca, &t.ca_pem)?;
                let mut y = format!(
                    "  tls:\n    certificate: {}\n    key: {}\n",
                    cert.display(),
                    key.display()
                );
                if let Some(client_ca) = &t.client_ca_pem {
                    let p = dir.path().join("client-ca.crt");
                    std::fs::write(&p, client_ca)?;
                    y.push_str(&format!("    clientcas:\n      - {}\n", p.display()));
                }
                // skopeo's --cert-dir layout: *.crt CAs, *.cert/*.key client pairs.
                let certs = dir.path().join("certs.d");
                std::fs::create_dir_all(&certs)?;
                std::fs::write(certs.join("ca.crt"), &t.ca_pem)?;
                if let Some(c) = &t.client {
                    std::fs::write(certs.join("client.cert"), &c.cert_pem)?;
                    std::fs::write(certs.join("client.key"), &c.key_pem)?;
                }
                y
            }
        };
        let auth_yaml = format!("{tls_yaml}{auth_yaml}");
        let tls = match tls {
            None => None,
            Some(t) => {
                let cfg = t.client_config()?;
                Some((t, cfg))
            }
        };
        let mut reg = Registry {
            proc: None,
            token,
            auth,
            tls,
            port: 0,
            config_path,
            log_path,
            data_dir,
            dir,
        };
        let mut last_err = anyhow!("no attempt made");
        for _ in 0..START_ATTEMPTS {
            reg.port = free_port();
            reg.write_config(&auth_yaml)?;
            match reg.spawn_and_wait() {
                Ok(()) => return Ok(reg),
                Err(e) => {
                    let clash =
                        log_tail(&reg.log_path, 64 * 1024).contains("address already in use");
                    last_err = e;
                    if !clash {
                        break;
                    }
                }
            }
        }
        Err(last_err)
    }

    fn write_config(&self, auth_yaml: &str) -> Result<()> {
        let yaml = format!(
            "version: 0.1\n\
             log:\n  level: warn\n  accesslog:\n    disabled: true\n\
             storage:\n  filesystem:\n    rootdirectory: {data}\n  delete:\n    enabled: true\n  \
             maintenance:\n    uploadpurging:\n      enabled: false\n\
             http:\n  addr: 127.0.0.1:{port}\n  secret: testkit-not-secret\n\
             {auth_yaml}",
            data = self.data_dir.display(),
            port = self.port,
        );
        std::fs::write(&self.config_path, yaml)
            .with_context(|| format!("writing {}", self.config_path.display()))
    }

    fn spawn_and_wait(&mut self) -> Result<()> {
        let mut proc = ChildProc::spawn(
            "docker-registry",
            Command::new("docker-registry")
                .arg("serve")
                .arg(&self.config_path),
            &self.log_path,
        )?;
        let url = format!("{}/v2/", self.url());
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(how) = proc.exited() {
                bail!(
                    "docker-registry on port {} {how} before becoming ready\n--- registry log ({}) ---\n{}",
                    self.port,
                    self.log_path.display(),
                    proc.log_tail(16 * 1024)
                );
            }
            // 200 without auth, 401 with auth: either means it is serving.
            if let Ok(r) = self.get_url(&url, &[]) {
                if r.status == 200 || r.status == 401 {
                    self.proc = Some(proc);
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                let tail = proc.log_tail(16 * 1024);
                proc.kill();
                bail!(
                    "docker-registry did not answer {url} within {READY_TIMEOUT:?}\n--- registry log ---\n{tail}"
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `http://127.0.0.1:PORT`, or `https://` when serving TLS.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// The TLS settings when the registry serves HTTPS.
    pub fn tls(&self) -> Option<&RegistryTls> {
        self.tls.as_ref().map(|(t, _)| t)
    }

    /// The CA certificate (PEM file) clients must trust, when serving HTTPS.
    pub fn ca_file(&self) -> Option<PathBuf> {
        self.tls.as_ref().map(|_| self.dir.path().join("ca.crt"))
    }

    /// A directory in skopeo/containers `--cert-dir` layout (`ca.crt`, and
    /// `client.cert`/`client.key` when client certificates are required).
    pub fn cert_dir(&self) -> Option<PathBuf> {
        self.tls.as_ref().map(|_| self.dir.path().join("certs.d"))
    }

    fn get_url(&self, url: &str, headers: &[(&str, &str)]) -> Result<HttpResponse> {
        crate::http::get(url, headers, self.tls.as_ref().map(|(_, c)| c))
    }

    /// `127.0.0.1:PORT` (the registry host part of image references).
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Filesystem storage root (survives [`Self::stop`] / [`Self::restart`]).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// File receiving the registry's stdout+stderr.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The last `max` bytes of the registry log.
    pub fn log_tail(&self, max: usize) -> String {
        log_tail(&self.log_path, max)
    }

    pub fn auth(&self) -> &RegistryAuth {
        &self.auth
    }

    /// `(user, password)` when the registry requires auth.
    pub fn creds(&self) -> Option<(&str, &str)> {
        self.auth.creds()
    }

    /// `"user:password"` (skopeo `--creds` format) when the registry has auth.
    pub fn creds_arg(&self) -> Option<String> {
        self.creds().map(|(u, p)| format!("{u}:{p}"))
    }

    /// The token server, for [`RegistryAuth::Token`].
    pub fn token_server(&self) -> Option<&TokenServer> {
        self.token.as_ref()
    }

    /// Token requests served so far (0 unless [`RegistryAuth::Token`]).
    pub fn token_requests(&self) -> usize {
        self.token.as_ref().map_or(0, |t| t.requests())
    }

    /// Process id of the running registry.
    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().and_then(|p| p.pid())
    }

    pub fn is_running(&mut self) -> bool {
        self.proc.as_mut().is_some_and(|p| p.exited().is_none())
    }

    /// Kills the registry (SIGKILL) for outage tests. Data and port are kept.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// Restarts on the same port with the same data (stops first if running).
    /// Panics if the registry cannot come back (e.g. the port was taken).
    pub fn restart(&mut self) {
        if let Err(e) = self.try_restart() {
            panic!("testkit: failed to restart docker-registry: {e:#}");
        }
    }

    pub fn try_restart(&mut self) -> Result<()> {
        self.stop();
        let mut last = anyhow!("no attempt made");
        // The old socket is gone once the process is reaped, but retry briefly
        // in case the kernel has not released it yet.
        for _ in 0..20 {
            match self.spawn_and_wait() {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(last)
    }

    /// GET of `path` (e.g. `/v2/repo/manifests/tag`) against the registry, without
    /// authentication; over TLS (trusting its CA, with its client certificate) when
    /// it serves HTTPS.
    pub fn http_get(&self, path: &str, headers: &[(&str, &str)]) -> Result<HttpResponse> {
        self.get_url(&format!("{}{path}", self.url()), headers)
    }

    /// Temp dir owned by this registry (holds config, log, auth files).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("url", &self.url())
            .field("auth", &self.auth)
            .field("dir", &self.dir.path())
            .finish()
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}
