//! The agent's HTTP handlers: who may call which route (local clients, the metrics
//! bearer), dispatch of `/v2/...` requests to manifests, blobs and passthrough, and the
//! registry-shaped error responses. Where a blob's bytes come from is decided in
//! [`crate::fetch`]; this module only shapes HTTP.

use super::*;

pub(crate) fn refusal(status: StatusCode, message: &str) -> Response {
    json_response(
        status,
        serde_json::json!({ "error": message })
            .to_string()
            .into_bytes(),
    )
}

/// Lets through requests from this host only (see [`AgentConfig::is_local_client`]).
pub(crate) async fn local_clients_only(req: Request, next: axum::middleware::Next) -> Response {
    let local = req
        .extensions()
        .get::<server::ClientAddr>()
        .is_none_or(|c| AgentConfig::is_local_client(c.peer, c.local));
    if !local {
        return refusal(
            StatusCode::FORBIDDEN,
            "this endpoint serves clients on this host only (metrics: see metrics_listen)",
        );
    }
    next.run(req).await
}

/// `metrics_token`, when set, as `Authorization: Bearer …` on `metrics_listen`.
pub(crate) async fn metrics_bearer(
    State(agent): State<Agent>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(want) = &agent.cfg.metrics_token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !pki::secrets_equal(given.as_bytes(), want.as_bytes()) {
            return refusal(
                StatusCode::UNAUTHORIZED,
                "metrics need the metrics bearer token",
            );
        }
    }
    next.run(req).await
}

pub(crate) async fn metrics_handler(State(agent): State<Agent>) -> Response {
    agent.refresh_cache_gauges();
    Response::builder()
        .header(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )
        .body(Body::from(agent.metrics.encode()))
        .or_internal_error()
}

pub(crate) async fn report_handler(State(agent): State<Agent>) -> Response {
    json_response(
        StatusCode::OK,
        serde_json::to_vec(&agent.node_report()).unwrap_or_default(),
    )
}

pub(crate) async fn cache_handler(State(agent): State<Agent>) -> Response {
    let body = serde_json::json!({ "usage": agent.store.usage(), "pins": agent.store.pins().iter().map(|(d, p)| serde_json::json!({"digest": d, "until": p.until, "reason": p.reason})).collect::<Vec<_>>() });
    json_response(StatusCode::OK, body.to_string().into_bytes())
}

pub(crate) fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .or_internal_error()
}

/// The OCI error body with the status the spec pairs it with.
pub fn error_response(e: &oci::Error) -> Response {
    let (status, code) = e.oci_status();
    let mut builder = Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json");
    if let oci::Error::Upstream {
        retry_after: Some(ra),
        ..
    } = e
    {
        builder = builder.header(header::RETRY_AFTER, ra.as_secs().max(1));
    }
    if let oci::Error::RangeNotSatisfiable { total, .. } = e {
        builder = builder.header(header::CONTENT_RANGE, format!("bytes */{total}"));
    }
    if status == 401 {
        builder = builder.header(header::WWW_AUTHENTICATE, "Basic realm=\"starling\"");
    }
    let message = match e {
        oci::Error::RangeNotSatisfiable { .. } => "requested range not satisfiable".to_owned(),
        other => other.to_string(),
    };
    builder
        .body(Body::from(ErrorBody::single(code, message).to_json()))
        .or_internal_error()
}

/// The client's error answer, counted by where the error came from.
pub(crate) fn failed(agent: &Agent, e: &oci::Error) -> Response {
    agent
        .metrics
        .error_responses
        .get_or_create(&metrics::ErrorLabels {
            source: e.error_source().as_str(),
            retryable: e.is_retryable(),
        })
        .inc();
    error_response(e)
}

/// Content fetched with this agent's registry credentials is served over `/v2` to
/// local clients only (the node's runtime), unless `mirror_remote_clients` says
/// otherwise: another host reaching the mirror port must not read private images.
pub(crate) fn refuse_remote_client(
    agent: &Agent,
    client: Option<server::ClientAddr>,
) -> Option<Response> {
    let server::ClientAddr { peer, local } = client?;
    if !agent.cfg.refuses_mirror_client(peer, local) {
        return None;
    }
    debug!(client = %peer, "mirror request from another host refused: this agent holds registry credentials");
    Some(failed(
        agent,
        &oci::Error::ClientDenied(
            "this mirror serves local clients only: it holds registry credentials \
         (mirror_remote_clients = true to serve other hosts)"
                .into(),
        ),
    ))
}

pub(crate) async fn registry_handler(State(agent): State<Agent>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query = req.uri().query().map(str::to_owned);
    let headers = req.headers().clone();
    let sink = req.extensions().get::<zerocopy::Sink>().cloned();
    let client = req.extensions().get::<server::ClientAddr>().copied();
    if let Some(refusal) = refuse_remote_client(&agent, client) {
        return record(&agent, "denied", refusal);
    }
    let route = match routes::parse(&path) {
        None => {
            let r = failed(&agent, &oci::Error::RouteUnknown(format!("{path:.200}")));
            return record(&agent, "unknown", r);
        }
        Some(Err(e)) => return record(&agent, "invalid", failed(&agent, &e)),
        Some(Ok(r)) => r,
    };
    let label = route.label();
    if method != Method::GET && method != Method::HEAD {
        let e = oci::Error::Unsupported(format!(
            "{method} is not supported by a pull-through mirror"
        ));
        let mut r = error_response(&e);
        *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        return record(&agent, label, r);
    }
    let ns = routes::query_param(query.as_deref(), "ns");
    let ns = ns.as_deref();
    let resp = match handle(
        &agent,
        route,
        &method,
        ns,
        query.as_deref(),
        &headers,
        sink.as_ref(),
    )
    .await
    {
        Ok(r) => r,
        Err(e) => {
            debug!(%path, error = %e, source = e.error_source().as_str(), "request failed");
            failed(&agent, &e)
        }
    };
    let mut resp = record(&agent, label, resp);
    if let Some(ns) = ns {
        if let Ok(v) = http::HeaderValue::from_str(ns) {
            resp.headers_mut().insert("OCI-Namespace", v);
        }
    }
    resp
}

pub(crate) fn record(agent: &Agent, route: &'static str, resp: Response) -> Response {
    agent
        .metrics
        .requests
        .get_or_create(&metrics::RouteLabels {
            route,
            status: resp.status().as_u16(),
        })
        .inc();
    resp
}

pub(crate) async fn handle(
    agent: &Agent,
    route: Route,
    method: &Method,
    ns: Option<&str>,
    query: Option<&str>,
    headers: &HeaderMap,
    sink: Option<&zerocopy::Sink>,
) -> Result<Response, oci::Error> {
    let head = method == Method::HEAD;
    let hdr = |name: header::HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    match route {
        Route::Base => Ok(Response::builder()
            .header("Docker-Distribution-API-Version", "registry/2.0")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from("{}"))
            .or_internal_error()),
        Route::Manifest { repo, reference } => {
            let registry = agent.registry_for(ns)?;
            // Clients (skopeo, Docker) send one Accept header per media type.
            let accept: Vec<&str> = headers
                .get_all(header::ACCEPT)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            let accept = (!accept.is_empty()).then(|| accept.join(", "));
            let m = agent
                .manifest(&registry, &repo, &reference, accept.as_deref())
                .await?;
            if !head {
                agent.manifest_served(&registry, &repo, &m.body);
            }
            let b = Response::builder()
                .header(header::CONTENT_TYPE, &m.media_type)
                .header("Docker-Content-Digest", m.digest.to_string())
                .header(header::CONTENT_LENGTH, m.body.len())
                .header(header::ETAG, format!("\"{}\"", m.digest));
            Ok(b.body(if head {
                Body::empty()
            } else {
                Body::from(m.body)
            })
            .or_internal_error())
        }
        Route::Blob { repo, digest } => {
            let registry = agent.registry_for(ns)?;
            files::refuse_identity_key(agent, &digest)?;
            agent
                .serve_blob(blob::BlobRequest {
                    registry: &registry,
                    repo: &repo,
                    digest: &digest,
                    range: hdr(header::RANGE),
                    head,
                    sink: sink.cloned(),
                })
                .await
        }
        Route::TagsList { repo } => {
            let path = format!("/v2/{repo}/tags/list{}", strip_ns(query));
            let registry = agent.registry_for(ns)?;
            passthrough(agent, &registry, &repo, &path, hdr(header::ACCEPT), head).await
        }
        Route::Referrers { repo, digest } => {
            let path = format!("/v2/{repo}/referrers/{digest}{}", strip_ns(query));
            let registry = agent.registry_for(ns)?;
            passthrough(agent, &registry, &repo, &path, hdr(header::ACCEPT), head).await
        }
    }
}

pub(crate) fn strip_ns(query: Option<&str>) -> String {
    let kept: Vec<&str> = query
        .unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty() && !kv.starts_with("ns="))
        .collect();
    if kept.is_empty() {
        String::new()
    } else {
        format!("?{}", kept.join("&"))
    }
}

pub(crate) async fn passthrough(
    agent: &Agent,
    registry: &str,
    repo: &str,
    path: &str,
    accept: Option<&str>,
    head: bool,
) -> Result<Response, oci::Error> {
    let (status, headers, body) = agent
        .upstream
        .get_passthrough(registry, repo, path, accept)
        .await?;
    let mut b = Response::builder().status(status);
    for name in [
        header::CONTENT_TYPE,
        header::LINK,
        http::HeaderName::from_static("oci-filters-applied"),
    ] {
        if let Some(v) = headers.get(&name) {
            b = b.header(name, v);
        }
    }
    b = b.header(header::CONTENT_LENGTH, body.len());
    Ok(b.body(if head {
        Body::empty()
    } else {
        Body::from(body)
    })
    .or_internal_error())
}
