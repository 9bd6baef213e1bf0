//! The upstream registry client: token and Basic auth, redirects that never leak
//! `Authorization` to another host, `429 Retry-After`, timeouts on connect and on
//! stalls, blob streams that resume with a Range request when a connection dies, and
//! TLS with the system trust store plus per-registry settings ([`tls`]).

pub mod auth;
mod authorize;
mod blob;
pub mod file_origin;
pub mod policy;
mod quota;
mod request;
pub mod swarm_scope;
pub mod tls;

pub use blob::parse_content_range;
pub(crate) use request::Hops;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use parking_lot::Mutex;
use tracing::{info, warn};

pub use auth::{Challenge, Credentials};
use auth::{TokenCache, TokenReply, DEFAULT_TOKEN_SECONDS};
pub use policy::RegistryPolicy;
pub use swarm_scope::BlobSwarm;
pub use tls::{RegistryTls, RootsSource};

use crate::reference::{canonical_registry, DOCKER_HUB};
use crate::{Digest, Error};

pub type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes, Error>> + Send>>;

#[derive(Clone, Debug)]
pub struct UpstreamConfig {
    /// Registry (canonical host) → base URL, e.g. `docker.io → http://127.0.0.1:5000`.
    pub endpoints: HashMap<String, String>,
    /// Registry → credentials; merged over those from `docker_config`.
    pub credentials: HashMap<String, Credentials>,
    pub docker_config: Option<PathBuf>,
    pub connect_timeout: Duration,
    /// Longest wait for response headers.
    pub response_timeout: Duration,
    /// Longest silence in the middle of a body before the connection counts as dead.
    pub stall_timeout: Duration,
    /// Attempts per request for retryable failures (transport errors, 5xx, 429).
    pub max_attempts: u32,
    /// A `Retry-After` longer than this is not waited out; the 429 goes to the caller.
    pub max_retry_after: Duration,
    pub user_agent: String,
    /// Which registries and addresses may be contacted. `None`: any (a client run by
    /// the user, like `starling pull`); servers that act on requests from others set it.
    pub policy: Option<RegistryPolicy>,
    /// Registry → TLS settings (extra CAs, client certificate, `skip_verify`), applied
    /// to that registry's hosts only; everything else gets the system trust store.
    pub tls: HashMap<String, RegistryTls>,
    /// Origins of plain files (`starling get https://…`) that may be contacted:
    /// `host[:port]` (may be an internal address), `*.domain` or `*` (public only).
    pub file_origins: Vec<String>,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            endpoints: HashMap::new(),
            credentials: HashMap::new(),
            docker_config: None,
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(20),
            max_attempts: 3,
            max_retry_after: Duration::from_secs(10),
            user_agent: concat!("starling/", env!("CARGO_PKG_VERSION")).to_owned(),
            policy: None,
            tls: HashMap::new(),
            file_origins: Vec::new(),
        }
    }
}

/// What a manifest HEAD or GET told us.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestMeta {
    pub digest: Digest,
    pub media_type: String,
    pub size: u64,
}

pub struct BlobResponse {
    /// Bytes of the whole blob, when the upstream said.
    pub total: Option<u64>,
    /// Offset of the first byte the stream yields.
    pub start: u64,
    pub stream: ByteStream,
}

/// A cheap-to-clone handle; all clones share connections, tokens and challenges.
#[derive(Clone)]
pub struct Upstream {
    inner: Arc<Inner>,
}

struct Inner {
    /// The default trust (system store): every host no registry setting covers.
    http: reqwest::Client,
    /// Registry → its own client, for the registry's hosts only. Registries with the
    /// same settings share one client (and its connections).
    registry_tls: HashMap<String, RegistryClient>,
    roots: RootsSource,
    cfg: UpstreamConfig,
    credentials: HashMap<String, Credentials>,
    tokens: TokenCache,
    /// Registries that answered with a Basic challenge.
    basic: Mutex<HashMap<String, bool>>,
    /// `host:port` of configured registries and endpoints: the only internal addresses
    /// (loopback, link-local, metadata) the policy lets this client reach.
    trusted: BTreeSet<(String, u16)>,
    /// Files read as blobs, by key (`file:<hex>`).
    files: Mutex<file_origin::FileRegistry>,
    /// Registries that answered 429 with a wait longer than a request waits out.
    quota_waits: quota::QuotaWaits,
    /// Requests that failed every attempt lately, sent less and less often.
    failing: quota::FailingRequests,
}

/// A registry's TLS client and the host names it is used for (endpoint and name).
struct RegistryClient {
    hosts: BTreeSet<String>,
    settings: RegistryTls,
    http: reqwest::Client,
}

/// Largest token-endpoint reply taken (tokens are JWTs of a few KiB).
const MAX_TOKEN_REPLY: usize = 1 << 20;
/// Longest token lifetime honoured, whatever the endpoint claims (a huge `expires_in`
/// would otherwise overflow the expiry instant).
const MAX_TOKEN_SECONDS: u64 = 24 * 3600;

fn denied(registry: &str, message: impl Into<String>) -> Error {
    Error::Denied {
        registry: registry.to_owned(),
        message: message.into(),
    }
}

/// The base URL of a registry given the endpoint overrides.
fn base_url_of(endpoints: &HashMap<String, String>, registry: &str) -> String {
    let registry = canonical_registry(registry);
    if let Some(url) = endpoints.get(&registry) {
        return url.trim_end_matches('/').to_owned();
    }
    if registry == DOCKER_HUB {
        "https://registry-1.docker.io".to_owned()
    } else {
        format!("https://{registry}")
    }
}

fn transport(registry: &str, e: impl std::fmt::Display) -> Error {
    Error::Transport {
        registry: registry.to_owned(),
        message: e.to_string(),
    }
}

impl Upstream {
    pub fn new(cfg: UpstreamConfig) -> Result<Self, Error> {
        let mut credentials = HashMap::new();
        if let Some(path) = &cfg.docker_config {
            match auth::load_docker_config(path) {
                Ok(c) => credentials.extend(c),
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "cannot read docker config.json; continuing without it")
                }
            }
        }
        credentials.extend(
            cfg.credentials
                .iter()
                .map(|(k, v)| (canonical_registry(k), v.clone())),
        );
        let mut trusted = BTreeSet::new();
        if let Some(p) = &cfg.policy {
            let urls = p
                .configured
                .iter()
                .map(|r| base_url_of(&cfg.endpoints, r))
                .chain(cfg.endpoints.values().cloned());
            for u in urls {
                if let Some(a) = url::Url::parse(&u)
                    .ok()
                    .as_ref()
                    .and_then(policy::authority)
                {
                    trusted.insert(a);
                }
            }
        }
        if cfg.policy.is_some() {
            for o in file_origin::exact_origins(&cfg.file_origins) {
                for scheme in ["http", "https"] {
                    if let Some(a) = url::Url::parse(&format!("{scheme}://{}", o.trim()))
                        .ok()
                        .as_ref()
                        .and_then(policy::authority)
                    {
                        trusted.insert(a);
                    }
                }
            }
        }
        let names: Arc<BTreeSet<String>> =
            Arc::new(trusted.iter().map(|(h, _)| h.clone()).collect());
        let build = |registry: &str, tls: rustls::ClientConfig| {
            let mut builder = reqwest::Client::builder()
                .use_preconfigured_tls(tls)
                .connect_timeout(cfg.connect_timeout)
                .redirect(reqwest::redirect::Policy::none())
                .user_agent(cfg.user_agent.clone())
                .pool_max_idle_per_host(32)
                .tcp_nodelay(true);
            if cfg.policy.is_some() {
                builder = builder.dns_resolver(Arc::new(policy::GuardedResolver {
                    trusted: names.clone(),
                }));
            }
            builder.build().map_err(|e| transport(registry, e))
        };
        let roots = tls::DefaultRoots::load();
        match &roots.source {
            RootsSource::System { roots, problems } if problems.is_empty() => {
                info!(roots, "upstream TLS: trusting the system trust store")
            }
            RootsSource::System { roots, problems } => {
                warn!(roots, problems = %problems.join("; "), "upstream TLS: trusting the system trust store, parts of which could not be read")
            }
            RootsSource::Bundled { reason } => {
                warn!(%reason, "upstream TLS: system trust store empty or unavailable; falling back to the bundled Mozilla roots (webpki-roots)")
            }
        }
        let http = build(
            "*",
            tls::client_config("*", &roots, &RegistryTls::default())?,
        )?;
        // One client per distinct setting; each registry points at its own.
        let mut by_setting: HashMap<RegistryTls, reqwest::Client> = HashMap::new();
        let mut registry_tls = HashMap::new();
        let mut settings: Vec<(String, RegistryTls)> = cfg
            .tls
            .iter()
            .filter(|(_, t)| !t.is_default())
            .map(|(r, t)| (canonical_registry(r), t.clone()))
            .collect();
        settings.sort_by(|a, b| a.0.cmp(&b.0));
        for (registry, t) in settings {
            let client = match by_setting.get(&t) {
                Some(c) => c.clone(),
                None => {
                    let c = build(&registry, tls::client_config(&registry, &roots, &t)?)?;
                    by_setting.insert(t.clone(), c.clone());
                    c
                }
            };
            let base = base_url_of(&cfg.endpoints, &registry);
            let hosts = tls::registry_hosts(&registry, &base);
            log_registry_tls(&registry, &base, &hosts, &t);
            registry_tls.insert(
                registry,
                RegistryClient {
                    hosts,
                    settings: t,
                    http: client,
                },
            );
        }
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                registry_tls,
                roots: roots.source,
                cfg,
                credentials,
                tokens: TokenCache::default(),
                basic: Mutex::default(),
                trusted,
                files: Mutex::default(),
                quota_waits: quota::QuotaWaits::default(),
                failing: quota::FailingRequests::default(),
            }),
        })
    }

    pub fn config(&self) -> &UpstreamConfig {
        &self.inner.cfg
    }

    /// Where the default trust came from (the system store, or the bundled roots).
    pub fn roots_source(&self) -> &RootsSource {
        &self.inner.roots
    }

    /// The client for one hop of a request for `registry`: the registry's own TLS
    /// client when the hop stays on its hosts, else the default trust (a redirect to
    /// a blob CDN, a token realm elsewhere).
    fn client_for(&self, registry: &str, url: &url::Url) -> &reqwest::Client {
        match self.inner.registry_tls.get(registry) {
            Some(rc) if tls::host_of(url).is_some_and(|h| rc.hosts.contains(&h)) => &rc.http,
            _ => &self.inner.http,
        }
    }

    /// The TLS settings that applied to a hop (for explaining a failure).
    fn settings_for(&self, registry: &str, url: &url::Url) -> RegistryTls {
        match self.inner.registry_tls.get(registry) {
            Some(rc) if tls::host_of(url).is_some_and(|h| rc.hosts.contains(&h)) => {
                rc.settings.clone()
            }
            _ => RegistryTls::default(),
        }
    }

    /// The base URL for a registry: a configured override, else HTTPS on its host.
    pub fn base_url(&self, registry: &str) -> String {
        base_url_of(&self.inner.cfg.endpoints, registry)
    }

    /// Refuses a registry the policy does not allow, before anything is sent.
    pub fn check_registry(&self, registry: &str) -> Result<(), Error> {
        let registry = canonical_registry(registry);
        match &self.inner.cfg.policy {
            Some(p) if !p.allows(&registry) => Err(denied(
                &registry,
                "it is not configured and matches no allowed_registries pattern",
            )),
            _ => Ok(()),
        }
    }

    /// Refuses a URL whose host is an internal address (loopback, link-local,
    /// metadata) unless that address was configured.
    fn check_destination(&self, registry: &str, url: &url::Url) -> Result<(), Error> {
        if self.inner.cfg.policy.is_none() {
            return Ok(());
        }
        let Some(host) = policy::internal_host(url) else {
            return Ok(());
        };
        if policy::authority(url).is_some_and(|a| self.inner.trusted.contains(&a)) {
            return Ok(());
        }
        Err(denied(
            registry,
            format!("{host} is a loopback, link-local or metadata address that is not configured"),
        ))
    }

    /// A registry configured on an internal address (a registry on the node itself),
    /// whose token server is then allowed to live on loopback too.
    fn is_local_configured(&self, registry: &str) -> bool {
        url::Url::parse(&self.base_url(registry))
            .ok()
            .is_some_and(|u| {
                policy::internal_host(&u).is_some()
                    && policy::authority(&u).is_some_and(|a| self.inner.trusted.contains(&a))
            })
    }

    /// `HEAD` a manifest: how tags are checked (Docker Hub counts GETs, not HEADs).
    pub async fn head_manifest(
        &self,
        registry: &str,
        repo: &str,
        reference: &str,
        accept: &str,
    ) -> Result<ManifestMeta, Error> {
        let path = format!("/v2/{repo}/manifests/{reference}");
        let resp = self
            .request(
                Method::HEAD,
                registry,
                repo,
                &path,
                accept_headers(accept),
                None,
            )
            .await?;
        let resp = self.check_status(registry, resp).await?;
        let meta = manifest_meta(registry, resp.headers(), None)?;
        Ok(meta)
    }

    /// `GET` a manifest; the body is returned byte for byte and verified when the
    /// reference is a digest.
    pub async fn get_manifest(
        &self,
        registry: &str,
        repo: &str,
        reference: &str,
        accept: &str,
    ) -> Result<(ManifestMeta, Bytes), Error> {
        const MAX_MANIFEST: usize = crate::media::MAX_MANIFEST_BYTES;
        let path = format!("/v2/{repo}/manifests/{reference}");
        let resp = self
            .request(
                Method::GET,
                registry,
                repo,
                &path,
                accept_headers(accept),
                None,
            )
            .await?;
        let resp = self.check_status(registry, resp).await?;
        let headers = resp.headers().clone();
        if resp
            .content_length()
            .is_some_and(|l| l as usize > MAX_MANIFEST)
        {
            return Err(Error::ManifestInvalid(format!(
                "manifest larger than {MAX_MANIFEST} bytes"
            )));
        }
        let body = self
            .read_body(registry, resp, MAX_MANIFEST)
            .await
            .map_err(|e| match e {
                Error::TooLarge { .. } => {
                    Error::ManifestInvalid(format!("manifest larger than {MAX_MANIFEST} bytes"))
                }
                other => other,
            })?;
        let computed = Digest::of(&body);
        if let Ok(d) = Digest::parse(reference) {
            if d != computed {
                return Err(Error::DigestMismatch {
                    expected: d,
                    actual: computed,
                });
            }
        }
        let meta = manifest_meta(registry, &headers, Some(&body))?;
        if meta.digest != computed {
            return Err(Error::DigestMismatch {
                expected: meta.digest,
                actual: computed,
            });
        }
        Ok((meta, body))
    }

    /// Passes a GET through (tags/list, referrers): status, selected headers and body.
    pub async fn get_passthrough(
        &self,
        registry: &str,
        repo: &str,
        path_and_query: &str,
        accept: Option<&str>,
    ) -> Result<(u16, HeaderMap, Bytes), Error> {
        let mut headers = HeaderMap::new();
        if let Some(a) = accept {
            headers.insert(http::header::ACCEPT, hv(a));
        }
        let resp = self
            .request(Method::GET, registry, repo, path_and_query, headers, None)
            .await?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = self.read_body(registry, resp, 16 << 20).await?;
        Ok((status, headers, body))
    }
}

/// One start-up line per registry with TLS settings; `skip_verify` at warn. Paths
/// only: a key's contents are never logged.
fn log_registry_tls(registry: &str, base: &str, hosts: &BTreeSet<String>, t: &RegistryTls) {
    let hosts = hosts.iter().cloned().collect::<Vec<_>>().join(",");
    if base.starts_with("http://") {
        warn!(%registry, endpoint = %base, "registry has TLS settings but a plain-HTTP endpoint; they apply only if it redirects to HTTPS on the same host");
    }
    if t.skip_verify {
        warn!(%registry, %hosts, "skip_verify: TLS certificates of this registry are NOT verified; anyone between this node and the registry can impersonate it, choose what its tags point to and read the credentials sent to it");
    }
    info!(
        %registry,
        %hosts,
        ca_file = ?t.ca_file,
        client_cert = ?t.client_cert,
        client_key = ?t.client_key,
        skip_verify = t.skip_verify,
        "registry TLS settings"
    );
}

fn hv(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static(""))
}

fn accept_headers(accept: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(http::header::ACCEPT, hv(accept));
    h
}

fn content_length(h: &HeaderMap) -> Option<u64> {
    h.get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse().ok())
}

fn manifest_meta(
    registry: &str,
    h: &HeaderMap,
    body: Option<&[u8]>,
) -> Result<ManifestMeta, Error> {
    let media_type = h
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.split(';').next().unwrap_or(s).trim().to_owned())
        .or_else(|| {
            body.and_then(|b| crate::Manifest::parse(b).ok())
                .map(|m| m.effective_media_type().to_owned())
        })
        .ok_or_else(|| transport(registry, "manifest without Content-Type"))?;
    let digest = match h.get("docker-content-digest").and_then(|v| v.to_str().ok()) {
        Some(d) => Digest::parse(d)?,
        None => match body {
            Some(b) => Digest::of(b),
            None => {
                return Err(transport(
                    registry,
                    "manifest HEAD without Docker-Content-Digest",
                ))
            }
        },
    };
    let size = match body {
        Some(b) => b.len() as u64,
        None => content_length(h)
            .ok_or_else(|| transport(registry, "manifest HEAD without Content-Length"))?,
    };
    Ok(ManifestMeta {
        digest,
        media_type,
        size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_range() {
        assert_eq!(
            parse_content_range("bytes 10-19/100"),
            Some((10, Some(100)))
        );
        assert_eq!(parse_content_range("bytes 10-19/*"), Some((10, None)));
        assert_eq!(parse_content_range("items 1-2/3"), None);
    }

    /// Found by the `content_range` fuzz target: the last position was never read,
    /// so ranges that end before they start or past the complete length, and signed
    /// numbers, were taken.
    #[test]
    fn invalid_content_ranges_are_refused() {
        for v in [
            "bytes 100-99/200",
            "bytes 0-10/5",
            "bytes 0-10/10",
            "bytes +1-2/3",
            "bytes 1-x/3",
            "bytes 1-/3",
            "bytes */100",
            "bytes 1-2/+3",
        ] {
            assert_eq!(parse_content_range(v), None, "{v}");
        }
        assert_eq!(parse_content_range("bytes 0-0/1"), Some((0, Some(1))));
        assert_eq!(parse_content_range(" bytes 5-9/* "), Some((5, None)));
    }
}
