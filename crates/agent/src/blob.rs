//! Serving blobs over HTTP: status, headers, ranges and multipart framing around the
//! source `fetch` chose (cache, a running download, or passthrough), and the copy loop
//! that moves to another source when one fails mid-body.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use futures::{Stream, StreamExt};
use http::{header, HeaderValue, StatusCode};
use oci::range::ByteRange;
use oci::{Digest, Error};
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::fetch::{blob_err, store_err, Source};
use crate::OrInternalError;

use crate::metrics::SourceLabels;
use crate::zerocopy::{Sink, SPAN_MAX};
use crate::Agent;

/// A range that starts this far beyond the bytes downloaded so far is fetched from the
/// upstream with its own Range request, so lazy pullers reading a footer do not wait
/// for the whole blob.
const RANGE_AHEAD_DIRECT: u64 = 16 << 20;

/// Chunks buffered per client between the producer task and the socket.
const CLIENT_BUFFER_CHUNKS: usize = 2;

/// Response header naming the source of a blob's bytes: `cache`, `swarm`, `registry`
/// or `passthrough`.
pub(crate) const SOURCE_HEADER: &str = "starling-source";

pub struct BlobRequest<'a> {
    pub registry: &'a str,
    pub repo: &'a str,
    pub digest: &'a Digest,
    pub range: Option<&'a str>,
    pub head: bool,
    /// The connection's zero-copy sink, when the transport supports it.
    pub sink: Option<Sink>,
}

impl Agent {
    pub(crate) async fn serve_blob(&self, req: BlobRequest<'_>) -> Result<Response, Error> {
        // Both the blob's duration and its first byte count from here: a miss's wait
        // for the tracker and the registry is the runtime's wait too.
        let received = Instant::now();
        let specs = req.range.map(oci::range::parse).transpose()?;
        let d = req.digest;
        if let Some(open) = self.store.open_complete(d).map_err(store_err)? {
            self.metrics.cache_hits.inc();
            let total = open.size;
            let plan = plan(specs.as_deref(), total)?;
            let (status, headers_len) = (plan.status(), plan.body_len(total));
            let mut resp = plan.response_head(d, total, headers_len, status);
            let label = Source::Complete.label();
            resp.headers_mut()
                .insert(SOURCE_HEADER, HeaderValue::from_static(label));
            if !req.head {
                let file_stream = stream_plan_from_file(open, plan, total, req.sink.clone());
                *resp.body_mut() = Body::from_stream(self.account(
                    file_stream,
                    label,
                    d.clone(),
                    received,
                    headers_len,
                ));
            }
            return Ok(resp);
        }
        if req.head {
            let total = match self.store.inflight(d).and_then(|i| i.progress().total) {
                Some(t) => t,
                None => self
                    .upstream
                    .head_blob(req.registry, req.repo, d)
                    .await
                    .map_err(|e| blob_err(e, d))?,
            };
            let plan = plan(specs.as_deref(), total)?;
            let len = plan.body_len(total);
            return Ok(plan.response_head(d, total, len, plan.status()));
        }
        self.metrics.cache_misses.inc();
        let (source, total) = self.acquire(req.registry, req.repo, d, None).await?;
        let plan = plan(specs.as_deref(), total)?;
        let body_len = plan.body_len(total);
        let mut resp = plan.response_head(d, total, body_len, plan.status());
        // Tells `starling get` (and anyone curious) where this response's bytes come from.
        let label = source.label();
        resp.headers_mut()
            .insert(SOURCE_HEADER, HeaderValue::from_static(label));
        let (tx, rx) = mpsc::channel::<Result<Bytes, Error>>(CLIENT_BUFFER_CHUNKS);
        let agent = self.clone();
        let (registry, repo, digest) = (req.registry.to_owned(), req.repo.to_owned(), d.clone());
        let sink = req.sink.clone();
        tokio::spawn(async move {
            let mut first = Some(source);
            for part in plan.parts(total) {
                match part {
                    Part::Text(t) => {
                        if tx.send(Ok(t)).await.is_err() {
                            return;
                        }
                    }
                    Part::Range(r) => {
                        if !agent
                            .copy_range(
                                &registry,
                                &repo,
                                &digest,
                                (r.start, r.end + 1, total),
                                &tx,
                                sink.as_ref(),
                                first.take(),
                            )
                            .await
                        {
                            return;
                        }
                    }
                }
            }
        });
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        *resp.body_mut() =
            Body::from_stream(self.account(stream, label, d.clone(), received, body_len));
        Ok(resp)
    }

    /// Streams `[start, end)` of a blob of `total` bytes to the client, switching
    /// source when one fails. Returns false when the client went away or an
    /// unrecoverable error was sent. With a `sink`, bytes on disk are sent as file
    /// spans (zero-copy) rather than read.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn copy_range(
        &self,
        registry: &str,
        repo: &str,
        d: &Digest,
        (mut pos, end, total): (u64, u64, u64),
        tx: &mpsc::Sender<Result<Bytes, Error>>,
        sink: Option<&Sink>,
        mut first: Option<Source>,
    ) -> bool {
        let mut failures = 0;
        let start = pos;
        while pos < end {
            // The source the caller already acquired, then a fresh one after a failure.
            let source = match first.take() {
                Some(s) => s,
                None => match self.acquire(registry, repo, d, None).await {
                    Ok((s, size)) if size == total => s,
                    Ok((_, size)) => {
                        // The response's length was a swarm's wrong size (a member
                        // said it first): no byte more of a body that cannot be right.
                        warn!(digest = %d, offset = pos, promised = total, size, "blob stream to client failed: the blob is not the size its response said");
                        let _ = tx
                            .send(Err(oci::Error::SizeMismatch {
                                expected: total,
                                actual: size,
                            }))
                            .await;
                        return false;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return false;
                    }
                },
            };
            let stream: std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, Error>> + Send>> =
                match source {
                    Source::Complete => match self.store.open_complete(d) {
                        Ok(Some(open)) => {
                            let guard = open.guard;
                            Box::pin(file_bytes(sink, open.file, open.path, pos, end).map(
                                move |r| {
                                    let _keep = &guard;
                                    r
                                },
                            ))
                        }
                        _ => {
                            failures += 1;
                            if failures > 3 {
                                let _ = tx
                                    .send(Err(Error::Transport {
                                        registry: registry.into(),
                                        message: "blob vanished".into(),
                                    }))
                                    .await;
                                return false;
                            }
                            continue;
                        }
                    },
                    Source::Inflight(inf, _)
                        if pos > inf.progress().written + RANGE_AHEAD_DIRECT =>
                    {
                        self.passthrough(registry, repo, d, pos, end)
                    }
                    Source::Inflight(inf, _) => match sink.cloned() {
                        Some(sink) => Box::pin(
                            store::inflight_spans(inf, pos, Some(end), SPAN_MAX).map(move |r| {
                                r.map(|s| sink.chunk(s.file, s.offset, s.len))
                                    .map_err(store_err)
                            }),
                        ),
                        None => Box::pin(
                            store::read_inflight(inf, pos, Some(end)).map(|r| r.map_err(store_err)),
                        ),
                    },
                    Source::Passthrough(_) => self.passthrough(registry, repo, d, pos, end),
                };
            futures::pin_mut!(stream);
            let mut failed = None;
            while let Some(item) = stream.next().await {
                match item {
                    Ok(b) => {
                        pos += b.len() as u64;
                        if tx.send(Ok(b)).await.is_err() {
                            return false;
                        }
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = failed {
                failures += 1;
                // Bytes already sent of content that failed its digest cannot be
                // completed into a 200 a client would take for the blob: the stream
                // fails, and the client's retry gets a fresh download.
                let discredited = pos > start && e.discredits_sent_bytes();
                // A file's origin served the version it promised (validator and size
                // are checked on every request) and its bytes failed the digest the
                // caller named: each retry would read the same whole file again.
                let named_wrong = e.discredits_sent_bytes()
                    && registry.starts_with(oci::upstream::file_origin::FILE_KEY_PREFIX);
                if named_wrong {
                    self.files.note_mismatch(registry);
                }
                if !e.is_retryable() || failures > 3 || discredited || named_wrong {
                    warn!(digest = %d, offset = pos, error = %e, "blob stream to client failed");
                    let _ = tx.send(Err(e)).await;
                    return false;
                }
                warn!(digest = %d, offset = pos, error = %e, "source failed mid-blob; continuing from another");
            } else if pos < end {
                failures += 1;
                if failures > 3 {
                    let _ = tx
                        .send(Err(Error::Transport {
                            registry: registry.into(),
                            message: "source ended early".into(),
                        }))
                        .await;
                    return false;
                }
            }
        }
        true
    }

    /// Counts bytes by source, times the first byte and logs one line per blob when the
    /// body ends.
    fn account<S>(
        &self,
        stream: S,
        source: &'static str,
        d: Digest,
        started: Instant,
        expected: u64,
    ) -> impl Stream<Item = Result<Bytes, Error>> + Send + 'static
    where
        S: Stream<Item = Result<Bytes, Error>> + Send + 'static,
    {
        struct Tally {
            metrics: Arc<crate::metrics::Metrics>,
            source: &'static str,
            digest: Digest,
            started: Instant,
            bytes: u64,
            expected: u64,
            first_byte: Option<f64>,
        }
        impl Drop for Tally {
            fn drop(&mut self) {
                let secs = self.started.elapsed().as_secs_f64();
                let labels = SourceLabels {
                    source: self.source,
                };
                self.metrics
                    .bytes_served
                    .get_or_create(&labels)
                    .inc_by(self.bytes);
                if self.bytes == self.expected {
                    self.metrics
                        .blob_seconds
                        .get_or_create(&labels)
                        .observe(secs);
                }
                info!(
                    digest = %self.digest,
                    bytes = self.bytes,
                    complete = self.bytes == self.expected,
                    source = self.source,
                    seconds = format!("{secs:.3}"),
                    first_byte_ms = self.first_byte.map(|s| format!("{:.1}", s * 1e3)),
                    mib_per_s = format!("{:.1}", self.bytes as f64 / secs.max(1e-6) / 1048576.0),
                    "blob served"
                );
            }
        }
        let mut tally = Tally {
            metrics: self.metrics.clone(),
            source,
            digest: d,
            started,
            bytes: 0,
            expected,
            first_byte: None,
        };
        stream.map(move |item| {
            // Borrow the whole struct so the closure owns it (and its Drop) entirely.
            let t = &mut tally;
            if let Ok(b) = &item {
                if t.first_byte.is_none() && !b.is_empty() {
                    let secs = t.started.elapsed().as_secs_f64();
                    t.first_byte = Some(secs);
                    t.metrics
                        .blob_first_byte_seconds
                        .get_or_create(&SourceLabels { source: t.source })
                        .observe(secs);
                }
                t.bytes += b.len() as u64;
            }
            item
        })
    }
}

/// What the response body consists of.
enum Plan {
    Full,
    Single(ByteRange),
    Multi {
        ranges: Vec<ByteRange>,
        boundary: String,
    },
}

enum Part {
    Text(Bytes),
    Range(ByteRange),
}

fn plan(specs: Option<&[oci::range::RangeSpec]>, total: u64) -> Result<Plan, Error> {
    let Some(specs) = specs else {
        return Ok(Plan::Full);
    };
    let ranges = oci::range::resolve(specs, total);
    match ranges.len() {
        0 => Err(Error::RangeInvalid(format!(
            "unsatisfiable range for {total} bytes"
        )))
        .map_err(|e| unsatisfiable(e, total)),
        1 => Ok(Plan::Single(ranges[0])),
        _ => Ok(Plan::Multi {
            ranges,
            boundary: format!("starling{:016x}", rand::random::<u64>()),
        }),
    }
}

/// A range that selects nothing answers 416 with the `Content-Range: bytes */total`
/// the spec asks for.
fn unsatisfiable(e: Error, total: u64) -> Error {
    Error::RangeNotSatisfiable {
        total,
        reason: e.to_string(),
    }
}

impl Plan {
    fn status(&self) -> StatusCode {
        match self {
            Plan::Full => StatusCode::OK,
            _ => StatusCode::PARTIAL_CONTENT,
        }
    }

    fn parts(&self, total: u64) -> Vec<Part> {
        match self {
            Plan::Full => vec![Part::Range(ByteRange {
                start: 0,
                end: total.saturating_sub(1),
            })]
            .into_iter()
            .filter(|_| total > 0)
            .collect(),
            Plan::Single(r) => vec![Part::Range(*r)],
            Plan::Multi { ranges, boundary } => {
                oci::range::multipart_byteranges(ranges, total, boundary)
                    .into_iter()
                    .map(|p| match p {
                        oci::range::MultipartPiece::Framing(t) => Part::Text(Bytes::from(t)),
                        oci::range::MultipartPiece::Range(r) => Part::Range(r),
                    })
                    .collect()
            }
        }
    }

    fn body_len(&self, total: u64) -> u64 {
        self.parts(total)
            .iter()
            .map(|p| match p {
                Part::Text(t) => t.len() as u64,
                Part::Range(r) => r.len(),
            })
            .sum()
    }

    fn response_head(&self, d: &Digest, total: u64, body_len: u64, status: StatusCode) -> Response {
        let mut b = Response::builder()
            .status(status)
            .header("Docker-Content-Digest", d.to_string())
            .header(header::ACCEPT_RANGES, "bytes")
            .header(header::CONTENT_LENGTH, body_len)
            .header(header::ETAG, format!("\"{d}\""));
        b = match self {
            Plan::Full => b.header(header::CONTENT_TYPE, "application/octet-stream"),
            Plan::Single(r) => b
                .header(header::CONTENT_TYPE, "application/octet-stream")
                .header(header::CONTENT_RANGE, r.content_range(total)),
            Plan::Multi { boundary, .. } => b.header(
                header::CONTENT_TYPE,
                HeaderValue::from_str(&oci::range::multipart_content_type(boundary))
                    .unwrap_or(HeaderValue::from_static("multipart/byteranges")),
            ),
        };
        b.body(Body::empty()).or_internal_error()
    }
}

fn stream_plan_from_file(
    open: store::OpenBlob,
    plan: Plan,
    total: u64,
    sink: Option<Sink>,
) -> impl Stream<Item = Result<Bytes, Error>> + Send {
    let store::OpenBlob {
        file, path, guard, ..
    } = open;
    let parts = plan.parts(total);
    futures::stream::iter(parts)
        .map(
            move |p| -> std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, Error>> + Send>> {
                match p {
                    Part::Text(t) => Box::pin(futures::stream::once(async move { Ok(t) })),
                    Part::Range(r) => file_bytes(
                        sink.as_ref(),
                        file.clone(),
                        path.clone(),
                        r.start,
                        r.end + 1,
                    ),
                }
            },
        )
        .flatten()
        .map(move |x| {
            let _keep_from_gc = &guard;
            x
        })
}

/// `[start, end)` of a file on disk: as zero-copy spans when the connection has a sink,
/// read into memory otherwise.
fn file_bytes(
    sink: Option<&Sink>,
    file: std::sync::Arc<std::fs::File>,
    path: std::path::PathBuf,
    start: u64,
    end: u64,
) -> std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, Error>> + Send>> {
    match sink {
        Some(sink) => Box::pin(sink.stream_file(file, start, end).map(Ok)),
        None => Box::pin(store::read_file(file, path, start, end).map(|r| r.map_err(store_err))),
    }
}
