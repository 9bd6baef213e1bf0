//! Blobs from the registry: `HEAD`, whole or ranged `GET`s whose bodies resume with
//! `Range` after a cut (within a budget, checking `Content-Range`), and the parse of a
//! registry's `Content-Range`.

use super::*;

impl Upstream {
    /// `HEAD` a blob: its size, or the upstream's error.
    pub async fn head_blob(
        &self,
        registry: &str,
        repo: &str,
        digest: &Digest,
    ) -> Result<u64, Error> {
        if let Some(f) = self.registered_file(registry) {
            return Ok(f.size);
        }
        let path = format!("/v2/{repo}/blobs/{digest}");
        let resp = self
            .request(Method::HEAD, registry, repo, &path, HeaderMap::new(), None)
            .await?;
        let resp = self.check_status(registry, resp).await?;
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
        self.get_blob_range(registry, repo, digest, start, None)
            .await
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
        let file = self.registered_file(registry);
        let resp = match &file {
            Some(f) => {
                self.send_file_request(registry, f, Method::GET, headers)
                    .await?
            }
            None => {
                self.request(Method::GET, registry, repo, &path, headers, None)
                    .await?
            }
        };
        let resp = self.check_status(registry, resp).await?;
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
        if let Some(f) = &file {
            self.check_same_version(registry, f, &resp, total)?;
            // A chunked answer declares no size: the version's size bounds the body.
            return Ok((total.or(Some(f.size)), resp));
        }
        Ok((total, resp))
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
                        } else if let Some(t) = self.total {
                            // Bytes beyond the size it declared (a body without
                            // Content-Length can run on) are not the blob's: cut them, as
                            // a Content-Length would have.
                            if self.offset + chunk.len() as u64 > t {
                                warn!(registry = %self.registry, digest = %self.digest, declared = t, "the upstream sent more bytes than it declared; ignoring the excess");
                                chunk.truncate(t.saturating_sub(self.offset) as usize);
                                self.done = true;
                            }
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
                    Ok(Some(Err(e))) => e.without_url().to_string(),
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
                .open_blob(
                    &self.registry,
                    &self.repo,
                    &self.digest,
                    self.offset,
                    self.end,
                )
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

/// `bytes first-last/complete` → (first, complete), `complete` being `None` for `*`.
/// Only a valid `Content-Range` (RFC 9110 §14.4: digits, `first ≤ last < complete`)
/// is taken: the body of an invalid one must not be recombined with a partial file.
pub fn parse_content_range(v: &str) -> Option<(u64, Option<u64>)> {
    let num = |s: &str| -> Option<u64> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    let (first, last) = (num(first)?, num(last)?);
    if last < first {
        return None;
    }
    let total = match total {
        "*" => None,
        t => Some(num(t).filter(|&t| t > last)?),
    };
    Some((first, total))
}
