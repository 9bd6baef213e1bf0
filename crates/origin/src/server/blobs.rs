//! Blob responses: Range requests (one range, or `multipart/byteranges`) and bodies
//! streamed from disk under the shared egress limit. Separate from routing and
//! manifests: this is where the egress the origin caps and counts is produced.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use futures::stream::{self, BoxStream, StreamExt};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::StatusCode;
use oci::range::{self, ByteRange};
use oci::ErrorCode;
use ratelimit::TokenBucket;
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio_util::io::ReaderStream;

use super::{digest_header, parse_digest, AppState, OriginStats, Reject, DOCKER_CONTENT_DIGEST};
use crate::Error;

/// Read and send chunk size.
pub const CHUNK: usize = 256 * 1024;

/// The egress limit's unit: each body takes its turn on the shared link this many
/// bytes at a time. A real link interleaves flows packet by packet (64 KiB with
/// segmentation offload); a whole read chunk per turn made a new stream's first byte
/// wait behind every other stream's 256 KiB reservation (32 streams at 50 MiB/s:
/// 160 ms), which no registry's NIC does.
const PACE_UNIT: usize = 64 * 1024;

pub(super) async fn blob(
    st: &AppState,
    head: bool,
    reference: &str,
    headers: &HeaderMap,
) -> Result<Response, Reject> {
    let digest = parse_digest(reference)?;
    let opened = st
        .layout
        .open_blob(&digest)
        .await
        .map_err(|e| Reject::internal(&e))?;
    let Some((mut file, total)) = opened else {
        return Err(Reject::new(
            StatusCode::NOT_FOUND,
            ErrorCode::BlobUnknown,
            format!("blob unknown: {digest}"),
        ));
    };
    let mut base = Response::new(Body::empty());
    {
        let h = base.headers_mut();
        h.insert(
            HeaderName::from_static(DOCKER_CONTENT_DIGEST),
            digest_header(&digest),
        );
        h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
        h.insert(
            header::ETAG,
            HeaderValue::from_str(&format!("\"{digest}\"")).unwrap_or(HeaderValue::from_static("")),
        );
    }
    let range_header = headers
        .get(header::RANGE)
        .map(|v| v.to_str().unwrap_or("\u{0}invalid"));
    let ranges = match range_header {
        None => None,
        Some(v) => {
            let specs = range::parse(v).map_err(|e| Reject::from_oci(&e))?;
            let resolved = range::resolve(&specs, total);
            if resolved.is_empty() {
                let mut r = Reject::new(
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    ErrorCode::RangeInvalid,
                    format!("range {v:.100} not satisfiable for {total} bytes"),
                );
                r.headers.push((
                    header::CONTENT_RANGE,
                    HeaderValue::from_str(&format!("bytes */{total}"))
                        .unwrap_or(HeaderValue::from_static("bytes */0")),
                ));
                return Err(r);
            }
            // Overlapping ranges that add up to more than the blob (as asked, before
            // `resolve` coalesces them) would multiply egress: send the blob whole, as a
            // plain 200 (RFC 9110 §14.2 allows ignoring such a Range).
            let asked: u64 = specs
                .iter()
                .flat_map(|s| range::resolve(std::slice::from_ref(s), total))
                .map(|r| r.len())
                .fold(0, u64::saturating_add);
            if asked > total {
                None
            } else {
                Some(resolved)
            }
        }
    };
    let limiter = st.limiter.clone();
    let stats = st.stats.clone();
    match ranges {
        None => {
            let h = base.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(total));
            if !head {
                let s = ReaderStream::with_capacity(file.take(total), CHUNK).boxed();
                *base.body_mut() = Body::from_stream(paced(s, limiter, stats));
            }
            Ok(base)
        }
        Some(r) if r.len() == 1 => {
            let r = r[0];
            *base.status_mut() = StatusCode::PARTIAL_CONTENT;
            let h = base.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(r.len()));
            h.insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&r.content_range(total))
                    .unwrap_or(HeaderValue::from_static("")),
            );
            if !head {
                file.seek(std::io::SeekFrom::Start(r.start))
                    .await
                    .map_err(|e| {
                        Reject::internal(&Error::Io {
                            path: st.layout.blob_path(&digest),
                            source: e,
                        })
                    })?;
                let s = ReaderStream::with_capacity(file.take(r.len()), CHUNK).boxed();
                *base.body_mut() = Body::from_stream(paced(s, limiter, stats));
            }
            Ok(base)
        }
        Some(rs) => {
            drop(file);
            let seq = st.boundary_seq.fetch_add(1, Ordering::Relaxed);
            let boundary = format!("STARLING-BYTERANGES-{}-{seq:08x}", &digest.hex()[..16]);
            let (parts, len) = multipart_parts(&rs, total, &boundary);
            *base.status_mut() = StatusCode::PARTIAL_CONTENT;
            let h = base.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_str(&oci::range::multipart_content_type(&boundary))
                    .unwrap_or(HeaderValue::from_static("multipart/byteranges")),
            );
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
            if !head {
                let path = st.layout.blob_path(&digest);
                let s = stream::iter(parts)
                    .then(move |p| {
                        let path = path.clone();
                        async move {
                            match p {
                                Part::Bytes(b) => stream::once(async move { Ok(b) }).boxed(),
                                Part::File(r) => match open_range(&path, r).await {
                                    Ok(s) => s,
                                    Err(e) => stream::once(async move { Err(e) }).boxed(),
                                },
                            }
                        }
                    })
                    .flatten()
                    .boxed();
                *base.body_mut() = Body::from_stream(paced(s, limiter, stats));
            }
            Ok(base)
        }
    }
}

enum Part {
    Bytes(Bytes),
    File(ByteRange),
}

/// The pieces of a `multipart/byteranges` body (the framing shared with the agent)
/// and its exact length.
fn multipart_parts(ranges: &[ByteRange], total: u64, boundary: &str) -> (Vec<Part>, u64) {
    let pieces = oci::range::multipart_byteranges(ranges, total, boundary);
    let len = pieces.iter().map(oci::range::MultipartPiece::len).sum();
    let parts = pieces
        .into_iter()
        .map(|p| match p {
            oci::range::MultipartPiece::Framing(t) => Part::Bytes(Bytes::from(t)),
            oci::range::MultipartPiece::Range(r) => Part::File(r),
        })
        .collect();
    (parts, len)
}

async fn open_range(
    path: &std::path::Path,
    r: ByteRange,
) -> std::io::Result<BoxStream<'static, std::io::Result<Bytes>>> {
    let mut f = tokio::fs::File::open(path).await?;
    f.seek(std::io::SeekFrom::Start(r.start)).await?;
    Ok(ReaderStream::with_capacity(f.take(r.len()), CHUNK).boxed())
}

/// Applies the shared egress limit to a body stream and counts what it yields, in
/// turns of at most [`PACE_UNIT`] bytes (split without copying).
fn paced(
    s: BoxStream<'static, std::io::Result<Bytes>>,
    limiter: Option<Arc<TokenBucket>>,
    stats: Arc<OriginStats>,
) -> BoxStream<'static, std::io::Result<Bytes>> {
    let Some(limiter) = limiter else {
        return s
            .inspect(move |item| {
                if let Ok(b) = item {
                    stats
                        .blob_bytes_sent
                        .fetch_add(b.len() as u64, Ordering::Relaxed);
                }
            })
            .boxed();
    };
    s.flat_map(|item| {
        let parts: Vec<std::io::Result<Bytes>> = match item {
            Ok(mut b) => {
                let mut parts = Vec::with_capacity(b.len().div_ceil(PACE_UNIT));
                while b.len() > PACE_UNIT {
                    parts.push(Ok(b.split_to(PACE_UNIT)));
                }
                parts.push(Ok(b));
                parts
            }
            Err(e) => vec![Err(e)],
        };
        futures::stream::iter(parts)
    })
    .then(move |item| {
        let limiter = limiter.clone();
        let stats = stats.clone();
        async move {
            if let Ok(b) = &item {
                limiter.acquire(b.len() as u64).await;
                stats
                    .blob_bytes_sent
                    .fetch_add(b.len() as u64, Ordering::Relaxed);
            }
            item
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A paced body takes the link in turns of at most `PACE_UNIT`, loses and reorders
    /// nothing, and counts what it sent; unpaced it passes chunks through whole.
    #[tokio::test(start_paused = true)]
    async fn paced_bodies_take_the_link_in_small_turns() {
        let head: Vec<u8> = (0..CHUNK).map(|i| i as u8).collect();
        let body = || {
            futures::stream::iter(vec![
                Ok(Bytes::from(head.clone())),
                Ok(Bytes::from_static(b"tail")),
            ])
            .boxed()
        };
        let whole: Vec<u8> = head.iter().copied().chain(*b"tail").collect();
        for limiter in [Some(Arc::new(TokenBucket::new(1 << 20))), None] {
            let stats = Arc::new(OriginStats::default());
            let paced_on = limiter.is_some();
            let parts: Vec<Bytes> = paced(body(), limiter, stats.clone())
                .map(|p| p.unwrap_or_default())
                .collect()
                .await;
            let sizes: Vec<usize> = parts.iter().map(Bytes::len).collect();
            if paced_on {
                assert_eq!(sizes, vec![PACE_UNIT, PACE_UNIT, PACE_UNIT, PACE_UNIT, 4]);
            } else {
                assert_eq!(sizes, vec![CHUNK, 4]);
            }
            assert_eq!(parts.concat(), whole);
            assert_eq!(
                stats.blob_bytes_sent.load(Ordering::Relaxed),
                whole.len() as u64
            );
        }
    }

    #[test]
    fn multipart_length_is_exact() {
        let rs = [
            ByteRange { start: 0, end: 9 },
            ByteRange {
                start: 100,
                end: 199,
            },
        ];
        let (parts, len) = multipart_parts(&rs, 4000, "B");
        let sum: u64 = parts
            .iter()
            .map(|p| match p {
                Part::Bytes(b) => b.len() as u64,
                Part::File(r) => r.len(),
            })
            .sum();
        assert_eq!(sum, len);
        let Part::Bytes(first) = &parts[0] else {
            panic!("first part is framing")
        };
        assert!(first.starts_with(b"--B\r\nContent-Type: application/octet-stream\r\nContent-Range: bytes 0-9/4000\r\n\r\n"));
    }
}
