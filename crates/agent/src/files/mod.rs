//! `GET|HEAD /files/v1/fetch?url=URL[&digest=sha256:…]`: a file on an HTTP origin (an
//! object store, a model-store mirror) through this agent, so the cache, single
//! flight, pins and the swarm carry it like a blob (`starling get https://…`).
//!
//! The file is keyed by its content digest when the client gives one (the whole file
//! is then verified as any blob is), else by its identity: the URL without its query
//! (presigned parameters change per request), the origin's ETag or Last-Modified and
//! the size ([`oci::upstream::file_origin::FileOrigin::identity_key`]). Identity-keyed
//! files are verified piece by piece against the hashes of the agent that read the
//! origin; nothing checks the whole file, so such entries are never served as
//! content-addressed blobs on `/v2`. Every request to the origin checks that it still
//! serves the same version (validator and size); a change fails the download (412).
//!
//! Same protection as `/v2`: local clients only unless `mirror_remote_clients`, and an
//! origin is contacted only when `allowed_file_origins` allows it.

use axum::extract::{Request, State};
use axum::response::Response;
use http::{header, HeaderValue, Method, StatusCode};
use oci::{Digest, Error, ErrorCode};

use crate::blob::BlobRequest;
use crate::{error_response, record, refuse_remote_client, routes, server, zerocopy, Agent};

pub(crate) mod index;

/// Longest URL taken (presigned URLs run to a few KiB).
const MAX_URL: usize = cluster::wire::MAX_FILE_URL;

/// The answer's header naming the key the file has in the cache and the swarm.
const KEY_HEADER: &str = "starling-file-key";

pub(crate) async fn files_handler(State(agent): State<Agent>, req: Request) -> Response {
    let client = req.extensions().get::<server::ClientAddr>().copied();
    if let Some(refusal) = refuse_remote_client(&agent, client) {
        return record(&agent, "denied", refusal);
    }
    let head = req.method() == Method::HEAD;
    let range = req
        .headers()
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let sink = req.extensions().get::<zerocopy::Sink>().cloned();
    let query = req.uri().query().map(str::to_owned);
    let resp = match serve_file(&agent, query.as_deref(), range.as_deref(), head, sink).await {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e, "file request failed");
            error_response(&e)
        }
    };
    record(&agent, "file", resp)
}

async fn serve_file(
    agent: &Agent,
    query: Option<&str>,
    range: Option<&str>,
    head: bool,
    sink: Option<zerocopy::Sink>,
) -> Result<Response, Error> {
    if query.is_some_and(|q| q.len() > 3 * MAX_URL) {
        return Err(Error::Unsupported("query too long".into()));
    }
    let raw = routes::query_param(query, "url")
        .ok_or_else(|| Error::Unsupported("missing ?url=".into()))?;
    if raw.len() > MAX_URL {
        return Err(Error::Unsupported(format!(
            "URL longer than {MAX_URL} bytes"
        )));
    }
    let url = url::Url::parse(&raw).map_err(|e| Error::Unsupported(format!("bad URL: {e}")))?;
    let digest = routes::query_param(query, "digest")
        .map(|d| Digest::parse(&d))
        .transpose()?;
    let PreparedFile {
        key,
        registry,
        origin,
    } = prepare_file(agent, &url, digest.as_ref()).await?;
    let mut resp = agent
        .serve_blob(BlobRequest {
            registry: &registry,
            repo: "file",
            digest: &key,
            range,
            head,
            sink,
        })
        .await?;
    let h = resp.headers_mut();
    if let Some(v) = origin
        .validator
        .as_deref()
        .and_then(|v| HeaderValue::from_str(v).ok())
    {
        h.insert(header::ETAG, v);
    }
    if let Ok(v) = HeaderValue::from_str(&key.to_string()) {
        h.insert(KEY_HEADER, v);
    }
    Ok(resp)
}

/// A file made ready to be read as a blob: its key, the registry name its reads go to
/// (`file:…`) and the version of the origin's file that key stands for.
pub(crate) struct PreparedFile {
    pub key: Digest,
    pub registry: String,
    pub origin: oci::upstream::file_origin::FileOrigin,
}

/// Checks the origin is allowed, learns the file's version from it, picks its key
/// (`digest` when given, else the identity key) and registers the origin under it, so
/// the blob path (cache, swarm, single flight) can read it. Used by the file route and
/// by prewarm assignments.
pub(crate) async fn prepare_file(
    agent: &Agent,
    url: &url::Url,
    digest: Option<&Digest>,
) -> Result<PreparedFile, Error> {
    agent.upstream.check_file_origin(url)?;
    let origin = agent.upstream.probe_file(url).await?;
    let key = match digest {
        Some(d) => d.clone(),
        None => {
            if origin.validator.is_none() {
                return Err(conflict(
                    "the origin sends neither ETag nor Last-Modified, so a change of the file \
                     could not be noticed: give the file's digest (--digest sha256:…)",
                ));
            }
            let k = origin.identity_key();
            if agent
                .store
                .stat(&k)
                .is_some_and(|r| !r.identity_keyed && r.media_type.is_none())
            {
                return Err(conflict(
                    "a blob with this file's identity key exists; refusing to serve it as the file",
                ));
            }
            agent.store.register_identity_key(&k);
            k
        }
    };
    agent.files.note(
        &key,
        index::FileEntry {
            url: origin.identity_url(),
            size: origin.size,
            last_get: store::now_secs(),
            content_digest: digest.is_some(),
            swarm: digest.map(|d| origin.swarm_key(d)),
        },
    );
    let registry = origin.registry_key(digest);
    // (Unless the blob is in the cache: content-addressed, it is the digest's bytes.)
    let recent_mismatch = digest
        .filter(|d| agent.store.stat(d).is_none())
        .and_then(|d| Some((d, agent.files.recent_mismatch(&registry)?)));
    if let Some((d, age)) = recent_mismatch {
        return Err(conflict(&format!(
            "{} (this version) does not match {d}: its bytes failed that digest {} s ago; \
             not read again for {} s unless the file changes",
            origin.identity_url(),
            age.as_secs(),
            index::MISMATCH_MEMORY.saturating_sub(age).as_secs()
        )));
    }
    agent.upstream.register_file(&registry, origin.clone());
    Ok(PreparedFile {
        key,
        registry,
        origin,
    })
}

/// `/v2` never serves a file keyed by identity: its bytes were never checked against
/// the digest the path names.
pub(crate) fn refuse_identity_key(agent: &Agent, d: &Digest) -> Result<(), Error> {
    if agent.store.is_identity_key(d) {
        return Err(Error::Upstream {
            registry: "-".into(),
            status: 404,
            code: Some(ErrorCode::BlobUnknown),
            message: format!("blob {d} unknown"),
            retry_after: None,
        });
    }
    Ok(())
}

fn conflict(message: &str) -> Error {
    Error::Upstream {
        registry: "-".into(),
        status: StatusCode::CONFLICT.as_u16(),
        code: None,
        message: message.into(),
        retry_after: None,
    }
}
