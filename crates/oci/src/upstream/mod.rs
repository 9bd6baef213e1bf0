//! The upstream registry client: token and Basic auth, redirects that never leak
//! `Authorization` to another host, `429 Retry-After`, timeouts on connect and on
//! stalls, and blob streams that resume with a Range request when a connection dies.

pub mod auth;

use std::collections::HashMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use parking_lot::Mutex;
use tracing::{debug, info, warn};

pub use auth::{Challenge, Credentials};
use auth::{TokenCache, TokenReply, DEFAULT_TOKEN_SECONDS};

use crate::reference::{canonical_registry, DOCKER_HUB};
use crate::{Digest, Error, ErrorBody, ErrorCode};

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
    http: reqwest::Client,
    cfg: UpstreamConfig,
    credentials: HashMap<String, Credentials>,
    tokens: TokenCache,
    /// Registries that answered with a Basic challenge.
    basic: Mutex<HashMap<String, bool>>,
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
        let http = reqwest::Client::builder()
            .connect_timeout(cfg.connect_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(cfg.user_agent.clone())
            .pool_max_idle_per_host(32)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| transport("*", e))?;
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                cfg,
                credentials,
                tokens: TokenCache::default(),
                basic: Mutex::default(),
            }),
        })
    }

    pub fn config(&self) -> &UpstreamConfig {
        &self.inner.cfg
    }

    /// The base URL for a registry: a configured override, else HTTPS on its host.
    pub fn base_url(&self, registry: &str) -> String {
        let registry = canonical_registry(registry);
        if let Some(url) = self.inner.cfg.endpoints.get(&registry) {
            return url.trim_end_matches('/').to_owned();
        }
        if registry == DOCKER_HUB {
            "https://registry-1.docker.io".to_owned()
        } else {
            format!("https://{registry}")
        }
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
        let resp = check_status(registry, resp).await?;
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
        const MAX_MANIFEST: usize = 4 << 20;
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
        let resp = check_status(registry, resp).await?;
        let headers = resp.headers().clone();
        if resp
            .content_length()
            .is_some_and(|l| l as usize > MAX_MANIFEST)
        {
            return Err(Error::ManifestInvalid(format!(
                "manifest larger than {MAX_MANIFEST} bytes"
            )));
        }
        let body = self.read_body(registry, resp, MAX_MANIFEST).await?;
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

    async fn read_body(
        &self,
        registry: &str,
        resp: reqwest::Response,
        cap: usize,
    ) -> Result<Bytes, Error> {
        let stall = self.inner.cfg.stall_timeout;
        let mut stream = resp.bytes_stream();
        let mut buf = Vec::new();
        loop {
            match tokio::time::timeout(stall, stream.next()).await {
                Err(_) => {
                    return Err(Error::Timeout {
                        registry: registry.to_owned(),
                        message: "body stalled".into(),
                    })
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(transport(registry, e)),
                Ok(Some(Ok(chunk))) => {
                    if buf.len() + chunk.len() > cap {
                        return Err(Error::ManifestInvalid(format!(
                            "body larger than {cap} bytes"
                        )));
                    }
                    buf.extend_from_slice(&chunk);
                }
            }
        }
        Ok(Bytes::from(buf))
    }

    /// `HEAD` a blob: its size, or the upstream's error.
    pub async fn head_blob(
        &self,
        registry: &str,
        repo: &str,
        digest: &Digest,
    ) -> Result<u64, Error> {
        let path = format!("/v2/{repo}/blobs/{digest}");
        let resp = self
            .request(Method::HEAD, registry, repo, &path, HeaderMap::new(), None)
            .await?;
        let resp = check_status(registry, resp).await?;
        content_length(resp.headers())
            .ok_or_else(|| transport(registry, "blob HEAD without Content-Length"))
    }

    /// Streams a blob from `start` (to the end). A connection lost or stalled mid-body is
    /// resumed with `Range: bytes=<offset>-` up to `max_attempts` times; the caller sees
    /// one uninterrupted stream or an error, never a silent gap.
    pub async fn get_blob(
        &self,
        registry: &str,
        repo: &str,
        digest: &Digest,
        start: u64,
    ) -> Result<BlobResponse, Error> {
        self.get_blob_range(registry, repo, digest, start, None).await
    }

    /// Streams bytes `[start, end)` of a blob (`end = None`: to the end), asking the
    /// registry for exactly that range, so a reader that needs a slice does not make
    /// the registry send the rest of the blob. Resumed like [`Upstream::get_blob`].
    pub async fn get_blob_range(
        &self,
        registry: &str,
        repo: &str,
        digest: &Digest,
        start: u64,
        end: Option<u64>,
    ) -> Result<BlobResponse, Error> {
        if end.is_some_and(|e| e <= start) {
            return Err(Error::RangeInvalid(format!(
                "empty range {start}..{}",
                end.unwrap_or(start)
            )));
        }
        let (total, resp) = self.open_blob(registry, repo, digest, start, end).await?;
        let state = ResumeState {
            end,
            upstream: self.clone(),
            registry: registry.to_owned(),
            repo: repo.to_owned(),
            digest: digest.clone(),
            offset: start,
            total,
            body: Some(Box::pin(resp.bytes_stream())),
            resumes: 0,
            done: false,
        };
        let stream = futures::stream::unfold(state, |mut st| async move {
            let item = st.next_chunk().await?;
            Some((item, st))
        });
        Ok(BlobResponse {
            total,
            start,
            stream: Box::pin(stream),
        })
    }

    async fn open_blob(
        &self,
        registry: &str,
        repo: &str,
        digest: &Digest,
        start: u64,
        end: Option<u64>,
    ) -> Result<(Option<u64>, reqwest::Response), Error> {
        let path = format!("/v2/{repo}/blobs/{digest}");
        let mut headers = HeaderMap::new();
        match end {
            Some(end) => {
                let last = end - 1;
                headers.insert(http::header::RANGE, hv(&format!("bytes={start}-{last}")));
            }
            None if start > 0 => {
                headers.insert(http::header::RANGE, hv(&format!("bytes={start}-")));
            }
            None => {}
        }
        let resp = self
            .request(Method::GET, registry, repo, &path, headers, None)
            .await?;
        let resp = check_status(registry, resp).await?;
        let status = resp.status();
        let total = if status == StatusCode::PARTIAL_CONTENT {
            let cr = resp
                .headers()
                .get(http::header::CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            let (first, total) = parse_content_range(cr)
                .ok_or_else(|| transport(registry, format!("bad Content-Range {cr:.80}")))?;
            if first != start {
                return Err(transport(
                    registry,
                    format!("asked for offset {start}, got {first}"),
                ));
            }
            total
        } else if start > 0 {
            // Range ignored: the caller asked for a suffix and got the whole blob.
            return Err(transport(registry, "upstream ignored Range on resume"));
        } else {
            content_length(resp.headers())
        };
        Ok((total, resp))
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

    /// One logical request: auth, redirects, and retries of retryable failures.
    async fn request(
        &self,
        method: Method,
        registry: &str,
        repo: &str,
        path_and_query: &str,
        headers: HeaderMap,
        _body: Option<Bytes>,
    ) -> Result<reqwest::Response, Error> {
        let registry = canonical_registry(registry);
        let scope = format!("repository:{repo}:pull");
        let url = format!("{}{}", self.base_url(&registry), path_and_query);
        let mut attempt = 0;
        let mut authed_retry = false;
        loop {
            attempt += 1;
            let auth = self.auth_header(&registry, &scope);
            let result = self
                .send_following_redirects(&registry, method.clone(), &url, &headers, auth.clone())
                .await;
            let retry_in = match result {
                Ok(resp) if resp.status() == StatusCode::UNAUTHORIZED && !authed_retry => {
                    authed_retry = true;
                    let challenge = resp
                        .headers()
                        .get(http::header::WWW_AUTHENTICATE)
                        .and_then(|v| v.to_str().ok())
                        .and_then(Challenge::parse);
                    match challenge {
                        Some(c) => {
                            self.answer_challenge(&registry, &scope, c).await?;
                            attempt -= 1;
                            continue;
                        }
                        None => return Ok(resp),
                    }
                }
                Ok(resp) if resp.status() == StatusCode::TOO_MANY_REQUESTS => {
                    let wait = retry_after(resp.headers()).unwrap_or(Duration::from_secs(1));
                    if attempt >= self.inner.cfg.max_attempts
                        || wait > self.inner.cfg.max_retry_after
                    {
                        return Ok(resp);
                    }
                    info!(%registry, wait_ms = wait.as_millis() as u64, "upstream rate-limited us; honouring Retry-After");
                    wait
                }
                Ok(resp)
                    if resp.status().is_server_error() && attempt < self.inner.cfg.max_attempts =>
                {
                    debug!(%registry, status = resp.status().as_u16(), "upstream 5xx; retrying");
                    backoff(attempt)
                }
                Ok(resp) => return Ok(resp),
                Err(e) if e.is_retryable() && attempt < self.inner.cfg.max_attempts => {
                    debug!(%registry, error = %e, "upstream transport error; retrying");
                    backoff(attempt)
                }
                Err(e) => return Err(e),
            };
            tokio::time::sleep(retry_in).await;
        }
    }

    fn auth_header(&self, registry: &str, scope: &str) -> Option<String> {
        if let Some(t) = self.inner.tokens.get(registry, scope) {
            return Some(format!("Bearer {t}"));
        }
        if self
            .inner
            .basic
            .lock()
            .get(registry)
            .copied()
            .unwrap_or(false)
        {
            return self
                .inner
                .credentials
                .get(registry)
                .map(Credentials::basic_header);
        }
        None
    }

    async fn answer_challenge(
        &self,
        registry: &str,
        scope: &str,
        challenge: Challenge,
    ) -> Result<(), Error> {
        let auth_err = |m: String| Error::Auth {
            registry: registry.to_owned(),
            message: m,
        };
        match challenge {
            Challenge::Basic => {
                if !self.inner.credentials.contains_key(registry) {
                    return Err(auth_err(
                        "registry requires Basic credentials and none are configured".into(),
                    ));
                }
                self.inner.basic.lock().insert(registry.to_owned(), true);
                Ok(())
            }
            Challenge::Bearer {
                realm,
                service,
                scope: challenge_scope,
            } => {
                self.inner.tokens.invalidate(registry, scope);
                let mut url = url::Url::parse(&realm)
                    .map_err(|e| auth_err(format!("bad token realm {realm:.100}: {e}")))?;
                {
                    let mut q = url.query_pairs_mut();
                    if let Some(s) = &service {
                        q.append_pair("service", s);
                    }
                    q.append_pair("scope", challenge_scope.as_deref().unwrap_or(scope));
                }
                let mut req = self.inner.http.get(url.as_str());
                if let Some(c) = self.inner.credentials.get(registry) {
                    req = req.header(http::header::AUTHORIZATION, c.basic_header());
                }
                let resp = tokio::time::timeout(self.inner.cfg.response_timeout, req.send())
                    .await
                    .map_err(|_| Error::Timeout {
                        registry: registry.to_owned(),
                        message: "token endpoint".into(),
                    })?
                    .map_err(|e| transport(registry, e))?;
                let status = resp.status();
                if !status.is_success() {
                    return Err(auth_err(format!("token endpoint answered {status}")));
                }
                let reply: TokenReply = resp
                    .json()
                    .await
                    .map_err(|e| auth_err(format!("token reply: {e}")))?;
                let token = reply
                    .token
                    .or(reply.access_token)
                    .ok_or_else(|| auth_err("token reply without token".into()))?;
                self.inner.tokens.put(
                    registry,
                    scope,
                    token,
                    reply.expires_in.unwrap_or(DEFAULT_TOKEN_SECONDS),
                );
                Ok(())
            }
        }
    }

    /// Follows up to 5 redirects by hand so `Authorization` is sent only to the origin
    /// it belongs to (S3 and CDNs reject requests that carry a registry token).
    async fn send_following_redirects(
        &self,
        registry: &str,
        method: Method,
        url: &str,
        headers: &HeaderMap,
        auth: Option<String>,
    ) -> Result<reqwest::Response, Error> {
        let mut current = url::Url::parse(url)
            .map_err(|e| transport(registry, format!("bad URL {url:.200}: {e}")))?;
        let origin = current.origin();
        for _ in 0..6 {
            let mut req = self
                .inner
                .http
                .request(method.clone(), current.as_str())
                .headers(headers.clone());
            if let Some(a) = &auth {
                if current.origin() == origin {
                    req = req.header(http::header::AUTHORIZATION, a);
                }
            }
            let resp = match tokio::time::timeout(self.inner.cfg.response_timeout, req.send()).await
            {
                Err(_) => {
                    return Err(Error::Timeout {
                        registry: registry.to_owned(),
                        message: format!("no response from {}", current.host_str().unwrap_or("?")),
                    })
                }
                Ok(Err(e)) if e.is_timeout() => {
                    return Err(Error::Timeout {
                        registry: registry.to_owned(),
                        message: e.to_string(),
                    })
                }
                Ok(Err(e)) => return Err(transport(registry, e)),
                Ok(Ok(r)) => r,
            };
            if !resp.status().is_redirection() || resp.status() == StatusCode::NOT_MODIFIED {
                return Ok(resp);
            }
            let loc = resp
                .headers()
                .get(http::header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| transport(registry, "redirect without Location"))?;
            current = current
                .join(loc)
                .map_err(|e| transport(registry, format!("bad redirect {loc:.200}: {e}")))?;
            debug!(%registry, to = %current.host_str().unwrap_or("?"), "following redirect");
        }
        Err(transport(registry, "too many redirects"))
    }
}

struct ResumeState {
    /// Where the stream stops (exclusive); `None`: the end of the blob.
    end: Option<u64>,
    upstream: Upstream,
    registry: String,
    repo: String,
    digest: Digest,
    offset: u64,
    total: Option<u64>,
    body: Option<Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>>,
    resumes: u32,
    done: bool,
}

impl ResumeState {
    async fn next_chunk(&mut self) -> Option<Result<Bytes, Error>> {
        if self.done {
            return None;
        }
        loop {
            let stall = self.upstream.inner.cfg.stall_timeout;
            if self.end.is_some_and(|e| self.offset >= e) {
                self.done = true;
                return None;
            }
            let failure = match &mut self.body {
                Some(body) => match tokio::time::timeout(stall, body.next()).await {
                    Ok(Some(Ok(mut chunk))) => {
                        // A registry that ignored the range's end sends more: cut it.
                        if let Some(e) = self.end {
                            chunk.truncate(chunk.len().min((e - self.offset) as usize));
                        }
                        self.offset += chunk.len() as u64;
                        return Some(Ok(chunk));
                    }
                    Ok(None) => match self.end.or(self.total) {
                        Some(t) if self.offset < t => {
                            format!("connection closed at {} of {t} bytes", self.offset)
                        }
                        _ => {
                            self.done = true;
                            return None;
                        }
                    },
                    Ok(Some(Err(e))) => e.to_string(),
                    Err(_) => format!("no data for {stall:?}"),
                },
                None => "reopening".to_owned(),
            };
            self.body = None;
            if self.resumes >= self.upstream.inner.cfg.max_attempts.max(1) * 2 {
                self.done = true;
                return Some(Err(transport(
                    &self.registry,
                    format!("{failure}; gave up after {} resumes", self.resumes),
                )));
            }
            self.resumes += 1;
            warn!(registry = %self.registry, digest = %self.digest, offset = self.offset, reason = %failure, "upstream blob stream broke; resuming with Range");
            match self
                .upstream
                .open_blob(&self.registry, &self.repo, &self.digest, self.offset, self.end)
                .await
            {
                Ok((total, resp)) => {
                    if self.total.is_none() {
                        self.total = total;
                    }
                    self.body = Some(Box::pin(resp.bytes_stream()));
                }
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
    }
}

fn backoff(attempt: u32) -> Duration {
    let base = 100u64 << attempt.min(6);
    Duration::from_millis(base + rand::random::<u64>() % base)
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

fn retry_after(h: &HeaderMap) -> Option<Duration> {
    let v = h.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    v.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// `bytes a-b/total` → (a, total).
pub fn parse_content_range(v: &str) -> Option<(u64, Option<u64>)> {
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (a, _b) = range.split_once('-')?;
    let total = if total == "*" {
        None
    } else {
        Some(total.parse().ok()?)
    };
    Some((a.parse().ok()?, total))
}

/// Turns an error status into [`Error::Upstream`] with the OCI code from the body.
async fn check_status(registry: &str, resp: reqwest::Response) -> Result<reqwest::Response, Error> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let retry = retry_after(resp.headers());
    let body = resp.bytes().await.unwrap_or_default();
    let (code, message) = match serde_json::from_slice::<ErrorBody>(&body) {
        Ok(b) if !b.errors.is_empty() => (
            ErrorCode::parse(&b.errors[0].code),
            b.errors[0].message.clone(),
        ),
        _ => (
            None,
            String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
        ),
    };
    Err(Error::Upstream {
        registry: registry.to_owned(),
        status: status.as_u16(),
        code,
        message,
        retry_after: retry,
    })
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
}
