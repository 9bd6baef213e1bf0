//! The trackers an agent (or the CLI) may talk to, and which one it talks to now.
//!
//! Configured as a comma-separated list (`http://t1:7070,http://t2:7070`). Every call
//! goes to the current tracker; one that cannot be reached, times out or answers 5xx
//! makes the call move on to the next (each tried at most once per call), and the one
//! that answered becomes current for every later call. A 4xx is an answer, not a
//! failure: the tracker is there and refuses.
//!
//! Everyone starts at the first URL and stays on the tracker that works: while
//! replicas do not share state, agents must gather on one tracker to find each other,
//! so the list is an order of preference, not a load balancer. One DNS name with
//! several addresses needs no list: the HTTP client tries each address in turn when a
//! connection is refused.

use std::sync::atomic::{AtomicUsize, Ordering};

use tracing::warn;

use crate::Error;

#[derive(Debug)]
pub struct TrackerEndpoints {
    urls: Vec<String>,
    current: AtomicUsize,
}

/// Most trackers in one list: replicas are a handful; a longer list is a mistake.
const MAX_TRACKERS: usize = 16;

impl TrackerEndpoints {
    /// Parses `URL[,URL...]`: each `http://` or `https://` (the same for all: one
    /// cluster has one transport), without a trailing slash, none twice.
    pub fn parse(spec: &str) -> Result<Self, Error> {
        let mut urls: Vec<String> = Vec::new();
        for part in spec.split(',') {
            let url = part.trim().trim_end_matches('/');
            if url.is_empty() {
                return Err(Error::Config(format!("tracker list {spec:?}: empty entry")));
            }
            if !url.starts_with("http://") && !url.starts_with("https://") {
                return Err(Error::Config(format!(
                    "tracker {url:?}: must start with https:// (or http:// with insecure_plain_http)"
                )));
            }
            if !urls.iter().any(|u| u == url) {
                urls.push(url.to_owned());
            }
        }
        if urls.len() > MAX_TRACKERS {
            return Err(Error::Config(format!(
                "{} trackers listed (at most {MAX_TRACKERS})",
                urls.len()
            )));
        }
        let https = urls.iter().filter(|u| u.starts_with("https://")).count();
        if https != 0 && https != urls.len() {
            return Err(Error::Config(format!(
                "tracker list {spec:?} mixes https:// and http:// trackers"
            )));
        }
        Ok(Self {
            urls,
            current: AtomicUsize::new(0),
        })
    }

    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    pub fn is_https(&self) -> bool {
        self.urls.iter().all(|u| u.starts_with("https://"))
    }

    /// The tracker calls go to now.
    pub fn current(&self) -> &str {
        &self.urls[self.current_index()]
    }

    fn current_index(&self) -> usize {
        self.current.load(Ordering::Relaxed) % self.urls.len()
    }

    /// `failed` did not answer: make the next one current, unless a concurrent call
    /// already moved on (then its choice stands). Returns the now current index.
    fn move_on_from(&self, failed: usize) -> usize {
        let next = (failed + 1) % self.urls.len();
        match self
            .current
            .compare_exchange(failed, next, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => next,
            Err(other) => other % self.urls.len(),
        }
    }

    /// Sends the request `build` makes for a tracker base URL, to the current tracker
    /// and then to the others while they fail (unreachable, timed out, 5xx). The last
    /// tracker's result is returned whatever it is.
    pub async fn send(
        &self,
        build: impl Fn(&str) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, reqwest::Error> {
        self.send_with(build, Retry::Idempotent).await
    }

    /// [`send`](Self::send) for a request that must not happen twice (submitting a
    /// prewarm job): it moves on only when no connection was made, never after a
    /// timeout or a 5xx, where the first tracker may have acted on it.
    pub async fn send_unrepeatable(
        &self,
        build: impl Fn(&str) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, reqwest::Error> {
        self.send_with(build, Retry::NotConnected).await
    }

    async fn send_with(
        &self,
        build: impl Fn(&str) -> reqwest::RequestBuilder,
        retry: Retry,
    ) -> Result<reqwest::Response, reqwest::Error> {
        let mut at = self.current_index();
        let mut tried = 0;
        loop {
            tried += 1;
            let result = build(&self.urls[at]).send().await;
            let failure = match (&result, retry) {
                (Ok(r), Retry::Idempotent) if r.status().is_server_error() => {
                    r.status().to_string()
                }
                (Ok(_), _) => return result,
                (Err(e), Retry::NotConnected) if !e.is_connect() => return result,
                (Err(e), _) => crate::identity::error_chain(e),
            };
            if tried >= self.urls.len() {
                return result;
            }
            let next = self.move_on_from(at);
            // Another call moving on at the same time may have picked the one that
            // just failed; try the one after it instead.
            let next = if next == at {
                (at + 1) % self.urls.len()
            } else {
                next
            };
            warn!(failed = %self.urls[at], error = %failure, now = %self.urls[next], "tracker failed; moving on to the next one");
            at = next;
        }
    }
}

#[derive(Clone, Copy)]
enum Retry {
    /// Any failure moves on: the request may be repeated (announces, reports).
    Idempotent,
    /// Only a connection that was never made moves on.
    NotConnected,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lists_and_refuses_bad_ones() {
        let t = TrackerEndpoints::parse("http://a:1/, http://b:2,http://a:1").unwrap();
        assert_eq!(t.urls(), ["http://a:1", "http://b:2"]);
        assert_eq!(t.current(), "http://a:1");
        assert!(!t.is_https());
        assert!(TrackerEndpoints::parse("https://a").unwrap().is_https());
        for bad in ["", "http://a,", "a:1", "https://a,http://b", "ftp://a"] {
            assert!(TrackerEndpoints::parse(bad).is_err(), "{bad:?} accepted");
        }
        let many = (0..=MAX_TRACKERS)
            .map(|i| format!("http://t{i}"))
            .collect::<Vec<_>>();
        assert!(TrackerEndpoints::parse(&many.join(",")).is_err());
    }

    #[test]
    fn moving_on_rotates_once_for_concurrent_failures() {
        let t = TrackerEndpoints::parse("http://a,http://b,http://c").unwrap();
        assert_eq!(t.move_on_from(0), 1);
        // A second call that also saw `a` fail does not skip `b`.
        assert_eq!(t.move_on_from(0), 1);
        assert_eq!(t.current(), "http://b");
        assert_eq!(t.move_on_from(1), 2);
        assert_eq!(t.move_on_from(2), 0);
        assert_eq!(t.current(), "http://a");
    }

    /// Real sockets on loopback: a refused connection and a 503 move the call on, a
    /// 404 does not, and the one that answered stays current.
    #[tokio::test]
    async fn send_moves_past_unreachable_and_failing_trackers() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        async fn answering(status: &'static str) -> String {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            tokio::spawn(async move {
                while let Ok((mut s, _)) = l.accept().await {
                    let mut buf = [0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    let _ = s
                        .write_all(
                            format!("HTTP/1.1 {status}\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                                .as_bytes(),
                        )
                        .await;
                }
            });
            format!("http://{addr}")
        }
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        let failing = answering("503 Service Unavailable").await;
        let refusing = answering("404 Not Found").await;
        let healthy = answering("200 OK").await;
        let http = reqwest::Client::new();
        let t = TrackerEndpoints::parse(&format!("{closed},{failing},{healthy}")).unwrap();
        let r = t.send(|base| http.get(format!("{base}/x"))).await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(t.current(), healthy);
        let t = TrackerEndpoints::parse(&format!("{refusing},{healthy}")).unwrap();
        let r = t.send(|base| http.get(format!("{base}/x"))).await.unwrap();
        assert_eq!(r.status(), 404);
        assert_eq!(t.current(), refusing);
        // All failing: the last answer comes back, as it is.
        let t = TrackerEndpoints::parse(&format!("{closed},{failing}")).unwrap();
        let r = t.send(|base| http.get(format!("{base}/x"))).await.unwrap();
        assert_eq!(r.status(), 503);
        // Not to be repeated: past a refused connection, not past a 503.
        let t = TrackerEndpoints::parse(&format!("{closed},{failing},{healthy}")).unwrap();
        let r = t
            .send_unrepeatable(|base| http.post(format!("{base}/x")))
            .await
            .unwrap();
        assert_eq!(r.status(), 503);
        assert_eq!(t.current(), failing);
    }
}
