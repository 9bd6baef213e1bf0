//! Sending one logical request: auth retry on 401, `Retry-After` and backoff on 429
//! and 5xx, redirects followed by hand, timeouts, and error bodies turned into errors.
//! Kept apart so the endpoint calls (manifests, blobs, files) only ask for a response.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use http::{HeaderMap, Method, StatusCode};
use tracing::{debug, info, warn};

use super::{denied, policy, quota, tls, transport, Challenge, Upstream};
use crate::reference::canonical_registry;
use crate::{Error, ErrorBody, ErrorCode};

/// Largest error body read to find the OCI error code; the rest is dropped.
const MAX_ERROR_BODY: usize = 64 << 10;

impl Upstream {
    /// A transport error, or what it hides: the resolver refusing an internal address,
    /// a TLS failure (certificate not trusted, client certificate refused).
    pub(super) fn send_error(&self, registry: &str, url: &url::Url, e: reqwest::Error) -> Error {
        if let Some(t) = tls::tls_failure(&e) {
            let host = match url.port() {
                Some(p) => format!("{}:{p}", url.host_str().unwrap_or("?")),
                None => url.host_str().unwrap_or("?").to_owned(),
            };
            let message = tls::explain(registry, &host, &self.settings_for(registry, url), &t);
            warn!(%registry, %host, error = %message, "upstream TLS failure");
            return Error::Tls {
                registry: registry.to_owned(),
                message,
            };
        }
        // reqwest's message names the whole URL: a presigned signature or credentials
        // in it must not reach logs or clients.
        let refused = policy::refused_internal(&e);
        let timeout = e.is_timeout();
        let message = format!("{}: {}", policy::redact_url(url.as_str()), e.without_url());
        match refused {
            Some(why) => denied(registry, why),
            None if timeout => Error::Timeout {
                registry: registry.to_owned(),
                message,
            },
            None => transport(registry, message),
        }
    }

    pub(super) async fn read_body(
        &self,
        registry: &str,
        resp: reqwest::Response,
        cap: usize,
    ) -> Result<Bytes, Error> {
        let stall = self.inner.cfg.stall_timeout;
        // A body that trickles (a byte just before each stall timeout) must end too.
        let deadline = tokio::time::Instant::now() + self.inner.cfg.response_timeout * 4;
        let mut stream = resp.bytes_stream();
        let mut buf = Vec::new();
        loop {
            let wait = stall.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
            match tokio::time::timeout(wait, stream.next()).await {
                Err(_) => {
                    return Err(Error::Timeout {
                        registry: registry.to_owned(),
                        message: "body stalled or too slow".into(),
                    })
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(transport(registry, e)),
                Ok(Some(Ok(chunk))) => {
                    if buf.len() + chunk.len() > cap {
                        return Err(Error::TooLarge {
                            registry: registry.to_owned(),
                            what: "reply",
                            limit: cap,
                        });
                    }
                    buf.extend_from_slice(&chunk);
                }
            }
        }
        Ok(Bytes::from(buf))
    }

    /// One logical request: auth, redirects, and retries of retryable failures. One
    /// that failed every attempt (5xx, transport) is not sent again for a while that
    /// doubles with each failure in a row (`quota::FailingRequests`): what a swarm's
    /// retries or a runtime's send to a registry that is already failing.
    pub(super) async fn request(
        &self,
        method: Method,
        registry: &str,
        repo: &str,
        path_and_query: &str,
        headers: HeaderMap,
        _body: Option<Bytes>,
    ) -> Result<reqwest::Response, Error> {
        let registry = canonical_registry(registry);
        self.check_registry(&registry)?;
        self.check_quota(&registry)?;
        let path = path_and_query.split('?').next().unwrap_or_default();
        let key = format!("{registry}{path}");
        if let Some((strikes, left)) = self.inner.failing.left(&key, Instant::now()) {
            let wait = quota::retry_after_secs(left);
            return Err(Error::Upstream {
                message: format!(
                    "{registry} failed this request {strikes} times in a row; not sent again for {} s",
                    wait.as_secs()
                ),
                registry,
                status: 503,
                code: None,
                retry_after: Some(wait),
            });
        }
        let scope = format!("repository:{repo}:pull");
        let url = format!("{}{}", self.base_url(&registry), path_and_query);
        let r = self
            .request_with_retries(method, &registry, &scope, &url, headers)
            .await;
        match &r {
            Ok(resp) if resp.status().is_server_error() => {
                self.inner.failing.failed(&key, Instant::now())
            }
            Err(e) if e.is_retryable() => self.inner.failing.failed(&key, Instant::now()),
            Ok(_) => self.inner.failing.succeeded(&key),
            Err(_) => {}
        }
        r
    }

    async fn request_with_retries(
        &self,
        method: Method,
        registry: &str,
        scope: &str,
        url: &str,
        headers: HeaderMap,
    ) -> Result<reqwest::Response, Error> {
        let registry = registry.to_owned();
        let mut attempt = 0;
        let mut authed_retry = false;
        loop {
            attempt += 1;
            let auth = self.auth_header(&registry, scope);
            let result = self
                .send_following_redirects(
                    &registry,
                    method.clone(),
                    url,
                    &headers,
                    auth.clone(),
                    Hops::Any,
                )
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
                            self.answer_challenge(&registry, scope, c).await?;
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
                        warn!(%registry, wait_s = wait.as_secs(), "upstream rate-limited us for longer than a request waits; not asking it again until then");
                        self.inner
                            .quota_waits
                            .refused(&registry, wait, Instant::now());
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

    /// The registry's own 429, with the time left, while it has asked this node to
    /// wait (`quota`): the caller answers its client without asking the registry.
    pub fn check_quota(&self, registry: &str) -> Result<(), Error> {
        let registry = canonical_registry(registry);
        let Some(left) = self.inner.quota_waits.left(&registry, Instant::now()) else {
            return Ok(());
        };
        let wait = quota::retry_after_secs(left);
        Err(Error::Upstream {
            message: format!(
                "{registry} answered 429 and asked for a wait; not asked again for {} s",
                wait.as_secs()
            ),
            registry,
            status: 429,
            code: Some(ErrorCode::Toomanyrequests),
            retry_after: Some(wait),
        })
    }

    /// Follows up to 5 redirects by hand so `Authorization` is sent only to the origin
    /// it belongs to (S3 and CDNs reject requests that carry a registry token); every
    /// hop is checked, against `hops` too.
    pub(super) async fn send_following_redirects(
        &self,
        registry: &str,
        method: Method,
        url: &str,
        headers: &HeaderMap,
        auth: Option<String>,
        hops: Hops,
    ) -> Result<reqwest::Response, Error> {
        let mut current = url::Url::parse(url).map_err(|e| {
            transport(
                registry,
                format!("bad URL {}: {e}", policy::redact_url(url)),
            )
        })?;
        let origin = current.origin();
        for _ in 0..6 {
            // Every hop, redirects included: a registry must not lead us inside.
            self.check_destination(registry, &current)?;
            if hops == Hops::FileOrigins {
                // An allowed origin must not lead the agent to one that is not (another
                // service the agent trusts, such as a configured registry).
                self.check_file_origin(&current)?;
            }
            let mut req = self
                .client_for(registry, &current)
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
                Ok(Err(e)) => return Err(self.send_error(registry, &current, e)),
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
            current = current.join(loc).map_err(|e| {
                transport(
                    registry,
                    format!("bad redirect {}: {e}", policy::redact_url(loc)),
                )
            })?;
            debug!(%registry, to = %current.host_str().unwrap_or("?"), "following redirect");
        }
        Err(transport(registry, "too many redirects"))
    }
}

/// Where redirects may lead (beyond the checks every request gets).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hops {
    Any,
    /// Only origins `file_origins` allows.
    FileOrigins,
}

fn backoff(attempt: u32) -> Duration {
    let base = 100u64 << attempt.min(6);
    Duration::from_millis(base + rand::random::<u64>() % base)
}

fn retry_after(h: &HeaderMap) -> Option<Duration> {
    let v = h.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    retry_after_from(v, std::time::SystemTime::now())
}

/// A `Retry-After` value as a wait from `now`: seconds, or the HTTP-date to wait
/// until (RFC 9110 allows both; some CDNs in front of registries send the date). A date
/// already past is no wait. How long a wait is honoured is bounded where it is kept
/// (`quota`).
fn retry_after_from(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let until = httpdate::parse_http_date(value).ok()?;
    Some(until.duration_since(now).unwrap_or(Duration::ZERO))
}

impl Upstream {
    /// Turns an error status into [`Error::Upstream`] with the OCI code from the body
    /// (of which at most [`MAX_ERROR_BODY`] bytes are read, within the stall timeout).
    pub(super) async fn check_status(
        &self,
        registry: &str,
        resp: reqwest::Response,
    ) -> Result<reqwest::Response, Error> {
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let retry = retry_after(resp.headers());
        let body = self.read_prefix(resp, MAX_ERROR_BODY).await;
        Err(error_from_body(registry, status, retry, &body))
    }

    /// Up to `cap` bytes of a body, whatever arrived within the stall timeout; the
    /// rest is never read.
    async fn read_prefix(&self, resp: reqwest::Response, cap: usize) -> Vec<u8> {
        let mut stream = resp.bytes_stream();
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(self.inner.cfg.stall_timeout, async {
            while buf.len() < cap {
                match stream.next().await {
                    Some(Ok(chunk)) => {
                        let take = chunk.len().min(cap - buf.len());
                        buf.extend_from_slice(&chunk[..take]);
                    }
                    _ => break,
                }
            }
        })
        .await;
        buf
    }
}

fn error_from_body(
    registry: &str,
    status: StatusCode,
    retry: Option<Duration>,
    body: &[u8],
) -> Error {
    let (code, message) = match serde_json::from_slice::<ErrorBody>(body) {
        Ok(b) if !b.errors.is_empty() => (
            ErrorCode::parse(&b.errors[0].code),
            b.errors[0].message.chars().take(500).collect(),
        ),
        _ => (
            None,
            String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
        ),
    };
    Error::Upstream {
        registry: registry.to_owned(),
        status: status.as_u16(),
        code,
        message,
        retry_after: retry,
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::retry_after_from;

    #[test]
    fn retry_after_is_read_as_seconds_or_as_the_date_to_wait_until() {
        // 2015-10-21 07:28:00 UTC, the example date of RFC 9110.
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480);
        let wait = |v| retry_after_from(v, now);
        assert_eq!(wait("30"), Some(Duration::from_secs(30)));
        assert_eq!(wait(" 0 "), Some(Duration::ZERO));
        assert_eq!(
            wait("Wed, 21 Oct 2015 07:29:30 GMT"),
            Some(Duration::from_secs(90))
        );
        assert_eq!(
            wait("Wed, 21 Oct 2015 07:00:00 GMT"),
            Some(Duration::ZERO),
            "a date already past is no wait"
        );
        for bad in ["", "soon", "-5", "1.5", "Wed, 32 Oct 2015 07:29:30 GMT"] {
            assert_eq!(wait(bad), None, "{bad:?}");
        }
    }
}
