//! The read-only registry: routes, range handling, streaming and accounting.
//!
//! Throughput: on loopback with no egress limit, one client connection pulled all layers
//! of a 1 GiB synthetic image (page cache warm) at **~2.3 GB/s** on the 2-core development
//! machine (`cargo run --release -p origin --example throughput -- 1 32`). With a
//! 32 MiB/s limit a 64 MiB range took 2.00 s and four concurrent 16 MiB ranges finished
//! between 1.90 s and 1.96 s (shared bucket, even split). Bodies are streamed from disk
//! in 256 KiB chunks; nothing larger than a manifest (≤ 4 MiB) is held in memory.
//! Responses carry no `Cache-Control` and keep connections alive (hyper defaults).

mod blobs;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Router;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode};
use oci::{Digest, ErrorBody, ErrorCode};

use crate::layout::{Layout, MAX_MANIFEST_BYTES};
use crate::Error;
use ratelimit::TokenBucket;

use blobs::blob;

const DOCKER_CONTENT_DIGEST: &str = "docker-content-digest";
const API_VERSION: &str = "docker-distribution-api-version";

#[derive(Clone, Debug)]
pub struct OriginConfig {
    /// An OCI image layout directory (`oci-layout`, `index.json`, `blobs/sha256/…`).
    pub layout_dir: PathBuf,
    pub listen: SocketAddr,
    /// Total egress of the whole origin (all connections share one token bucket).
    pub egress_limit_bytes_per_sec: Option<u64>,
    /// Serve only under this repository name; any valid name when `None`.
    pub repository: Option<String>,
    /// Held before answering each request: the round trip to a registry that is not
    /// next door (a cloud registry or CDN answers in 10–100 ms), which every Range
    /// request of a source pays.
    pub latency: Option<std::time::Duration>,
}

/// Counters of what the origin served; shared (`Arc`) and lock-free.
#[derive(Debug, Default)]
pub struct OriginStats {
    pub requests: AtomicU64,
    pub manifest_requests: AtomicU64,
    pub blob_requests: AtomicU64,
    /// Body bytes of blob responses handed to the connection (ranges and multipart
    /// framing included), i.e. the registry's blob egress.
    pub blob_bytes_sent: AtomicU64,
    pub manifest_bytes_sent: AtomicU64,
    /// Responses with a 4xx/5xx status.
    pub error_responses: AtomicU64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatsSnapshot {
    pub requests: u64,
    pub manifest_requests: u64,
    pub blob_requests: u64,
    pub blob_bytes_sent: u64,
    pub manifest_bytes_sent: u64,
    pub error_responses: u64,
}

impl OriginStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            manifest_requests: self.manifest_requests.load(Ordering::Relaxed),
            blob_requests: self.blob_requests.load(Ordering::Relaxed),
            blob_bytes_sent: self.blob_bytes_sent.load(Ordering::Relaxed),
            manifest_bytes_sent: self.manifest_bytes_sent.load(Ordering::Relaxed),
            error_responses: self.error_responses.load(Ordering::Relaxed),
        }
    }

    /// Total body bytes served (blobs + manifests): the "registry egress".
    pub fn egress_bytes(&self) -> u64 {
        self.blob_bytes_sent.load(Ordering::Relaxed)
            + self.manifest_bytes_sent.load(Ordering::Relaxed)
    }
}

impl StatsSnapshot {
    pub fn egress_bytes(&self) -> u64 {
        self.blob_bytes_sent + self.manifest_bytes_sent
    }
}

struct AppState {
    layout: Layout,
    limiter: Option<Arc<TokenBucket>>,
    stats: Arc<OriginStats>,
    repository: Option<String>,
    boundary_seq: AtomicU64,
    latency: Option<std::time::Duration>,
}

/// The registry as an axum `Router` (for embedding in another server). `bind`/`serve`
/// use this.
pub fn router(cfg: &OriginConfig, stats: Arc<OriginStats>) -> Result<Router, Error> {
    let layout = Layout::open(&cfg.layout_dir)?;
    if let Some(repo) = &cfg.repository {
        if !valid_name(repo) {
            return Err(Error::Oci(oci::Error::NameInvalid(format!(
                "invalid repository name {repo:?}"
            ))));
        }
    }
    let state = Arc::new(AppState {
        layout,
        limiter: cfg
            .egress_limit_bytes_per_sec
            .map(|r| Arc::new(TokenBucket::new(r))),
        stats,
        repository: cfg.repository.clone(),
        boundary_seq: AtomicU64::new(0),
        latency: cfg.latency,
    });
    Ok(Router::new().fallback(handle).with_state(state))
}

/// A listening origin that is not yet accepting connections.
pub struct BoundOrigin {
    listener: tokio::net::TcpListener,
    router: Router,
    addr: SocketAddr,
    stats: Arc<OriginStats>,
}

/// Opens the layout and binds `cfg.listen` (port 0 allowed; see [`BoundOrigin::local_addr`]).
pub async fn bind(cfg: OriginConfig) -> Result<BoundOrigin, Error> {
    let stats = Arc::new(OriginStats::default());
    let router = router(&cfg, stats.clone())?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| Error::Bind {
            addr: cfg.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| Error::Bind {
        addr: cfg.listen,
        source,
    })?;
    tracing::info!(%addr, layout = %cfg.layout_dir.display(), limit = ?cfg.egress_limit_bytes_per_sec, "origin registry listening");
    Ok(BoundOrigin {
        listener,
        router,
        addr,
        stats,
    })
}

/// Binds and serves until `shutdown` completes (then finishes in-flight requests).
pub async fn serve(
    cfg: OriginConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    bind(cfg).await?.serve(shutdown).await
}

impl BoundOrigin {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> Arc<OriginStats> {
        self.stats.clone()
    }

    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), Error> {
        axum::serve(self.listener, self.router)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(Error::Serve)
    }

    /// Serves on a background task; dropping the handle or calling
    /// [`RunningOrigin::shutdown`] stops it.
    pub fn spawn(self) -> RunningOrigin {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let addr = self.addr;
        let stats = self.stats.clone();
        let task = tokio::spawn(self.serve(async move {
            let _ = rx.await;
        }));
        RunningOrigin {
            addr,
            stats,
            shutdown: Some(tx),
            task: Some(task),
        }
    }
}

/// An origin serving on a background task.
pub struct RunningOrigin {
    addr: SocketAddr,
    stats: Arc<OriginStats>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), Error>>>,
}

impl RunningOrigin {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> Arc<OriginStats> {
        self.stats.clone()
    }

    /// Stops accepting, waits for in-flight requests, and returns the server's result.
    pub async fn shutdown(mut self) -> Result<(), Error> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.task.take() {
            Some(t) => t
                .await
                .map_err(|e| Error::Serve(std::io::Error::other(e)))?,
            None => Ok(()),
        }
    }
}

impl Drop for RunningOrigin {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// An error answer in the distribution spec's JSON form.
struct Reject {
    status: StatusCode,
    code: ErrorCode,
    message: String,
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl Reject {
    fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            headers: Vec::new(),
        }
    }

    fn from_oci(e: &oci::Error) -> Self {
        let (status, code) = e.oci_status();
        Self::new(
            StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
            code,
            e.to_string(),
        )
    }

    fn internal(e: &Error) -> Self {
        tracing::warn!(error = %e, "origin request failed");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Unavailable,
            e.to_string(),
        )
    }
}

impl IntoResponse for Reject {
    fn into_response(self) -> Response {
        let mut resp = json_response(ErrorBody::single(self.code, self.message).to_json());
        *resp.status_mut() = self.status;
        for (k, v) in self.headers {
            resp.headers_mut().insert(k, v);
        }
        resp
    }
}

async fn handle(State(st): State<Arc<AppState>>, req: Request) -> Response {
    st.stats.requests.fetch_add(1, Ordering::Relaxed);
    if let Some(d) = st.latency {
        tokio::time::sleep(d).await;
    }
    let method = req.method().clone();
    let head = method == Method::HEAD;
    let mut resp = if method != Method::GET && method != Method::HEAD {
        let mut r = Reject::new(
            StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::Unsupported,
            "this registry is read-only",
        );
        r.headers
            .push((header::ALLOW, HeaderValue::from_static("GET, HEAD")));
        r.into_response()
    } else {
        match route(
            &st,
            head,
            req.uri().path(),
            req.uri().query(),
            req.headers(),
        )
        .await
        {
            Ok(r) => r,
            Err(rej) => rej.into_response(),
        }
    };
    if resp.status().is_client_error() || resp.status().is_server_error() {
        st.stats.error_responses.fetch_add(1, Ordering::Relaxed);
    }
    resp.headers_mut().insert(
        HeaderName::from_static(API_VERSION),
        HeaderValue::from_static("registry/2.0"),
    );
    if head {
        // Keep the headers (Content-Length included); drop the body.
        *resp.body_mut() = Body::empty();
    }
    resp
}

async fn route(
    st: &AppState,
    head: bool,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
) -> Result<Response, Reject> {
    if path == "/v2" || path == "/v2/" {
        return Ok(json_response(b"{}".to_vec()));
    }
    let not_found = || {
        Reject::new(
            StatusCode::NOT_FOUND,
            ErrorCode::NameUnknown,
            "no such route",
        )
    };
    let rest = path.strip_prefix("/v2/").ok_or_else(not_found)?;
    if let Some(name) = rest.strip_suffix("/tags/list") {
        check_name(st, name)?;
        return tags_list(st, name, query);
    }
    if let Some(i) = rest.rfind("/manifests/") {
        let (name, reference) = (&rest[..i], &rest[i + "/manifests/".len()..]);
        check_name(st, name)?;
        st.stats.manifest_requests.fetch_add(1, Ordering::Relaxed);
        return manifest(st, head, reference).await;
    }
    if let Some(i) = rest.rfind("/blobs/") {
        let (name, reference) = (&rest[..i], &rest[i + "/blobs/".len()..]);
        check_name(st, name)?;
        st.stats.blob_requests.fetch_add(1, Ordering::Relaxed);
        return blob(st, head, reference, headers).await;
    }
    Err(not_found())
}

fn json_response(body: Vec<u8>) -> Response {
    let len = body.len();
    let mut resp = Response::new(Body::from(body));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    resp
}

fn check_name(st: &AppState, name: &str) -> Result<(), Reject> {
    if !valid_name(name) {
        return Err(Reject::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::NameInvalid,
            format!("invalid repository name {name:.100}"),
        ));
    }
    if let Some(repo) = &st.repository {
        if repo != name {
            return Err(Reject::new(
                StatusCode::NOT_FOUND,
                ErrorCode::NameUnknown,
                format!("repository {name} is not served here"),
            ));
        }
    }
    Ok(())
}

/// The distribution spec's name grammar:
/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(\/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*`.
pub(crate) fn valid_name(name: &str) -> bool {
    if name.is_empty() || name.len() > 255 {
        return false;
    }
    name.split('/').all(|comp| {
        let b = comp.as_bytes();
        let alnum = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
        if b.is_empty() || !alnum(b[0]) || !alnum(b[b.len() - 1]) {
            return false;
        }
        let mut i = 0;
        while i < b.len() {
            if alnum(b[i]) {
                i += 1;
                continue;
            }
            let start = i;
            while i < b.len() && !alnum(b[i]) {
                i += 1;
            }
            let sep = &comp[start..i];
            let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|c| c == b'-');
            if !ok {
                return false;
            }
        }
        true
    })
}

fn parse_digest(reference: &str) -> Result<Digest, Reject> {
    Digest::parse(reference).map_err(|e| Reject::from_oci(&e))
}

fn tags_list(st: &AppState, name: &str, query: Option<&str>) -> Result<Response, Reject> {
    let tags = st.layout.tags().map_err(|e| Reject::internal(&e))?;
    let mut n: Option<usize> = None;
    let mut last: Option<String> = None;
    for kv in query.unwrap_or("").split('&') {
        match kv.split_once('=') {
            Some(("n", v)) => n = v.parse().ok(),
            Some(("last", v)) => last = Some(v.to_owned()),
            _ => {}
        }
    }
    let list: Vec<&String> = tags
        .keys()
        .filter(|t| last.as_ref().is_none_or(|l| *t > l))
        .take(n.unwrap_or(usize::MAX))
        .collect();
    let body = serde_json::json!({ "name": name, "tags": list });
    Ok(json_response(serde_json::to_vec(&body).unwrap_or_default()))
}

async fn manifest(st: &AppState, head: bool, reference: &str) -> Result<Response, Reject> {
    let index = st.layout.index().map_err(|e| Reject::internal(&e))?;
    let unknown = || {
        Reject::new(
            StatusCode::NOT_FOUND,
            ErrorCode::ManifestUnknown,
            format!("manifest unknown: {reference:.140}"),
        )
    };
    let (digest, listed_type) = if reference.contains(':') {
        let d = parse_digest(reference)?;
        let mt = index
            .iter()
            .find(|x| x.digest == d)
            .map(|x| x.media_type.clone());
        (d, mt)
    } else {
        let tags = st.layout.tags().map_err(|e| Reject::internal(&e))?;
        let d = tags.get(reference).ok_or_else(unknown)?;
        (d.digest.clone(), Some(d.media_type.clone()))
    };
    let bytes = st
        .layout
        .read_small_blob(&digest, MAX_MANIFEST_BYTES)
        .await
        .map_err(|e| Reject::internal(&e))?;
    let bytes = bytes.ok_or_else(unknown)?;
    if Digest::of(&bytes) != digest {
        return Err(Reject::internal(&Error::Layout {
            path: st.layout.blob_path(&digest),
            reason: "blob content does not match its digest".into(),
        }));
    }
    // Only JSON that parses as a manifest or index is served as one.
    let parsed = oci::Manifest::parse(&bytes).map_err(|_| unknown())?;
    let media_type = listed_type
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| parsed.effective_media_type().to_owned());
    if !head {
        st.stats
            .manifest_bytes_sent
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
    }
    let len = bytes.len();
    let mut resp = Response::new(Body::from(bytes));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_str(&media_type)
            .unwrap_or(HeaderValue::from_static(oci::media::OCI_MANIFEST)),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    h.insert(
        HeaderName::from_static(DOCKER_CONTENT_DIGEST),
        digest_header(&digest),
    );
    Ok(resp)
}

fn digest_header(d: &Digest) -> HeaderValue {
    HeaderValue::from_str(&d.to_string()).unwrap_or(HeaderValue::from_static(""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in [
            "a",
            "library/ubuntu",
            "a.b_c__d--e/f-g",
            "starling/train",
            "0/1",
        ] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in [
            "", "A", "a/", "/a", "a//b", "a..b", "a._b", "a___b", "-a", "a-", "..", "a/../b",
            "%2e%2e", "a b",
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}
