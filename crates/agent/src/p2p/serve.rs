//! Serving pieces to other agents: only bytes that are verified (a complete blob) or a
//! piece this agent has written after verifying it (a partial blob in piece mode, or
//! the flushed prefix of a registry stream).

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures::StreamExt;
use http::{header, HeaderMap, StatusCode};
use serde::Deserialize;

use crate::zerocopy::Sink;
use crate::Agent;

#[derive(Deserialize)]
pub(crate) struct PieceQuery {
    piece_size: u64,
    /// `1`: the requester would rather wait in line for an upload slot than be
    /// refused (its tracker says the swarm is large).
    #[serde(default)]
    wait: u8,
}

fn status(code: StatusCode, msg: &str) -> Response {
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::json!({ "error": msg }).to_string()))
        .unwrap_or_default()
}

/// What every peer request must pass: P2P on, the cluster token, a valid digest and a
/// sane piece size.
fn check(
    agent: &Agent,
    digest: &str,
    piece_size: u64,
    headers: &HeaderMap,
) -> Result<(std::sync::Arc<crate::p2p::P2p>, oci::Digest), Response> {
    let Some(p2p) = agent.p2p.clone() else {
        return Err(status(StatusCode::NOT_FOUND, "p2p disabled"));
    };
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if !p2p.token_ok(auth) {
        return Err(status(
            StatusCode::UNAUTHORIZED,
            "missing or wrong cluster token",
        ));
    }
    let Ok(d) = oci::Digest::parse(digest) else {
        return Err(status(StatusCode::BAD_REQUEST, "invalid digest"));
    };
    if !((64 << 10)..=(1 << 30)).contains(&piece_size) {
        return Err(status(StatusCode::BAD_REQUEST, "piece_size out of range"));
    }
    Ok((p2p, d))
}

/// An upload slot, counted in `p2p_uploads_active` while held.
struct UploadSlot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    active: prometheus_client::metrics::gauge::Gauge,
}

impl Drop for UploadSlot {
    fn drop(&mut self) {
        self.active.dec();
    }
}

/// A free upload slot, or, for a requester willing to wait, one that frees within
/// `upload_wait` while at most `upload_queue` requests wait (in order: tokio's
/// semaphore is fair).
async fn upload_slot(p2p: &crate::p2p::P2p, willing: bool) -> Option<UploadSlot> {
    use std::sync::atomic::Ordering;
    let permit = match p2p.uploads.clone().try_acquire_owned() {
        Ok(permit) => permit,
        Err(_) => {
            if !willing || p2p.upload_wait.is_zero() {
                return None;
            }
            let waiting = p2p.upload_waiting.clone();
            if waiting.fetch_add(1, Ordering::AcqRel) >= p2p.upload_queue {
                waiting.fetch_sub(1, Ordering::AcqRel);
                return None;
            }
            // Leaves the line however this ends, including the requester hanging up.
            struct InLine(std::sync::Arc<std::sync::atomic::AtomicUsize>);
            impl Drop for InLine {
                fn drop(&mut self) {
                    self.0.fetch_sub(1, Ordering::AcqRel);
                }
            }
            let _in_line = InLine(waiting);
            p2p.metrics.uploads_queued.inc();
            tokio::time::timeout(p2p.upload_wait, p2p.uploads.clone().acquire_owned())
                .await
                .ok()?
                .ok()?
        }
    };
    p2p.metrics.uploads_active.inc();
    Some(UploadSlot {
        _permit: permit,
        active: p2p.metrics.uploads_active.clone(),
    })
}

pub(crate) async fn piece_handler(
    State(agent): State<Agent>,
    Path((digest, index)): Path<(String, u32)>,
    Query(q): Query<PieceQuery>,
    sink: Option<Extension<Sink>>,
    headers: HeaderMap,
) -> Response {
    let (p2p, d) = match check(&agent, &digest, q.piece_size, &headers) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let start = index as u64 * q.piece_size;
    let span = match agent.store.open_complete(&d) {
        Ok(Some(open)) => {
            if start >= open.size {
                return status(StatusCode::RANGE_NOT_SATISFIABLE, "piece beyond blob");
            }
            let len = (open.size - start).min(q.piece_size) as usize;
            // The file handle keeps the bytes readable even if GC unlinks the blob
            // while the piece is on its way.
            store::FileSpan {
                file: open.file.clone(),
                path: open.path.clone(),
                offset: start,
                len,
            }
        }
        _ => match agent.store.inflight(&d) {
            Some(inf) if inf.has_piece(q.piece_size, index) => {
                let total = inf.progress().total.unwrap_or(0);
                if start >= total {
                    return status(StatusCode::RANGE_NOT_SATISFIABLE, "piece beyond blob");
                }
                inf.span(start, (total - start).min(q.piece_size) as usize)
            }
            _ => return status(StatusCode::NOT_FOUND, "piece not held"),
        },
    };
    // Only a piece this node holds is worth a place in line. The slot covers the whole
    // transfer, not just the pacing: `max_uploads` bounds how many peers this node's
    // uplink serves at once, limiter or not.
    let Some(slot) = upload_slot(&p2p, q.wait == 1).await else {
        p2p.metrics.uploads_refused.inc();
        return status(StatusCode::SERVICE_UNAVAILABLE, "upload slots full");
    };
    let len = span.len;
    if let Some(l) = &p2p.upload {
        l.acquire(len as u64).await;
    }
    let body = match sink {
        // Zero-copy: the piece goes from the page cache to the peer's socket.
        Some(Extension(sink)) if !p2p.corrupt => Body::from_stream(
            sink.stream_file_holding(span.file, start, start + len as u64, Some(Box::new(slot)))
                .map(Ok::<_, std::convert::Infallible>),
        ),
        _ => {
            let path = span.path.clone();
            let Ok(data) = span.read().await else {
                return status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &format!("cannot read {}", path.display()),
                );
            };
            let data = if p2p.corrupt { corrupted(&data) } else { data };
            // Without a sink the slot lives as long as hyper holds the body.
            Body::from_stream(
                futures::stream::iter([Ok::<_, std::convert::Infallible>(data)]).map(
                    move |chunk| {
                        let _slot = &slot;
                        chunk
                    },
                ),
            )
        }
    };
    p2p.metrics.upload_bytes.inc_by(len as u64);
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, len)
        .body(body)
        .unwrap_or_default()
}

/// Test mode (`--corrupt-pieces`): one flipped byte per piece.
fn corrupted(data: &[u8]) -> bytes::Bytes {
    let mut v = data.to_vec();
    let mid = v.len() / 2;
    if let Some(b) = v.get_mut(mid) {
        *b ^= 0x5a;
    }
    bytes::Bytes::from(v)
}

/// Piece hashes of a complete (digest-verified) blob, for peers that joined a swarm
/// with no source publishing hashes.
pub(crate) async fn hashes_handler(
    State(agent): State<Agent>,
    Path(digest): Path<String>,
    Query(q): Query<PieceQuery>,
    headers: HeaderMap,
) -> Response {
    let (p2p, d) = match check(&agent, &digest, q.piece_size, &headers) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let key = (d.clone(), q.piece_size);
    if let Some(h) = p2p.hash_cache.lock().get(&key).cloned() {
        return axum::Json(h.as_ref().clone()).into_response();
    }
    let Ok(Some(open)) = agent.store.open_complete(&d) else {
        return status(StatusCode::NOT_FOUND, "blob not complete here");
    };
    let (file, size, ps) = (open.file.clone(), open.size, q.piece_size);
    let computed = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<String>> {
        use sha2::Digest as _;
        let mut out = Vec::new();
        let mut pos = 0;
        while pos < size {
            let len = (size - pos).min(ps) as usize;
            let b = store::inflight::read_exact_at_pub(&file, pos, len)?;
            out.push(hex::encode(sha2::Sha256::digest(&b)));
            pos += len as u64;
        }
        Ok(out)
    })
    .await;
    drop(open);
    match computed {
        Ok(Ok(list)) => {
            let list = std::sync::Arc::new(list);
            let mut cache = p2p.hash_cache.lock();
            if cache.len() > 1024 {
                cache.clear();
            }
            cache.insert(key, list.clone());
            axum::Json(list.as_ref().clone()).into_response()
        }
        _ => status(StatusCode::INTERNAL_SERVER_ERROR, "cannot read blob"),
    }
}
