//! Axum handlers. The tracker builds a [`ClusterState`], mounts [`router`] and calls
//! [`ClusterState::ingest`] / [`ClusterState::tick`] / [`ClusterState::next_assignments`].

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use oci::ImageReference;
use serde::Deserialize;

pub use crate::dashboard::{
    DashImage, DashJob, DashPull, DashRow, DashSources, DashSwarm, Dashboard,
};
use crate::error::{Error, Result};
use crate::extender::{self, ExtenderArgs, RankRequest};
use crate::inventory::Applied;
use crate::prewarm::{JobView, PrewarmRequest};
pub use crate::state::{ClusterConfig, ClusterState, DEFAULT_MAX_REPORT_BYTES};

/// The dashboard page (inline JS/CSS, no external assets).
pub const DASHBOARD_HTML: &str = include_str!("../assets/dashboard.html");

/// Request extension set by the front end (the tracker in TLS mode) when the caller is a
/// node authenticated by its certificate: what it sends must be about that node. Absent
/// in plain-HTTP mode, where nothing is authenticated per node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthenticatedNode(pub String);

/// HTTP status of each error.
pub fn status_of(e: &Error) -> StatusCode {
    match e {
        Error::Selector { .. }
        | Error::InvalidRequest(_)
        | Error::InvalidLabel(_)
        | Error::BadReference { .. }
        | Error::MutableTag { .. } => StatusCode::BAD_REQUEST,
        Error::RegistryDenied { .. } | Error::Forbidden(_) => StatusCode::FORBIDDEN,
        Error::ReportTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
        Error::Capacity(_) | Error::Shared(_) => StatusCode::SERVICE_UNAVAILABLE,
        Error::UnknownNode(_)
        | Error::UnknownNodes(_)
        | Error::UnknownJob(_)
        | Error::UnknownImage(_) => StatusCode::NOT_FOUND,
        Error::StaleGeneration { .. } | Error::JobFinished(_) | Error::NodeCancelled { .. } => {
            StatusCode::CONFLICT
        }
        Error::DeadlinePassed { .. } => StatusCode::GONE,
        Error::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = status_of(&self);
        if status.is_server_error() {
            tracing::error!(error = %self, "cluster API error");
        }
        (
            status,
            Json(serde_json::json!({ "error": self.to_string() })),
        )
            .into_response()
    }
}

fn parse_body<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T> {
    serde_json::from_slice(body).map_err(|e| Error::InvalidRequest(format!("JSON body: {e}")))
}

/// `GET /metrics` with the cluster metrics only, for a standalone server. The
/// tracker, which serves its own `/metrics`, appends
/// [`ClusterState::encode_metrics_fragment`] to its output instead (or registers
/// [`ClusterMetrics`] in its registry with [`ClusterMetrics::register`]).
pub fn metrics_router(state: ClusterState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// All cluster API routes (see API.md). No `/metrics` and no `/healthz`, so it
/// merges into the tracker's router without overlapping routes.
pub fn router(state: ClusterState) -> Router {
    Router::new()
        .route("/", get(dashboard_page))
        .route("/api/v1/dashboard", get(dashboard_json))
        .route("/api/v1/nodes", get(list_nodes))
        .route("/api/v1/nodes/{name}", get(one_node))
        .route("/api/v1/where", get(where_image))
        .route("/api/v1/reports", post(ingest_report))
        .route("/api/v1/prewarm", post(submit_prewarm).get(list_prewarm))
        .route(
            "/api/v1/prewarm/{id}",
            get(get_prewarm).delete(cancel_prewarm),
        )
        .route("/api/v1/rank", post(rank))
        .route("/scheduler/filter", post(filter))
        .route("/scheduler/prioritize", post(prioritize))
        .with_state(state)
}

async fn dashboard_page() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        DASHBOARD_HTML,
    )
}

async fn dashboard_json(State(s): State<ClusterState>) -> Json<Dashboard> {
    // With a share, jobs as the other replicas left them; a failed read shows this
    // replica's copy (the dashboard is a view, not a decision).
    if let Err(e) = s.refresh_jobs().await {
        tracing::debug!(error = %e, "dashboard shows this replica's copy of the jobs");
    }
    Json(s.dashboard())
}

async fn list_nodes(State(s): State<ClusterState>) -> Json<serde_json::Value> {
    let now = s.now();
    Json(serde_json::json!({ "nodes": s.inventory().nodes(now) }))
}

async fn one_node(
    State(s): State<ClusterState>,
    Path(name): Path<String>,
) -> Result<Json<serde_json::Value>> {
    let now = s.now();
    let inv = s.inventory();
    let (summary, report) = inv
        .node(&name, now)
        .ok_or_else(|| Error::UnknownNode(name.clone()))?;
    Ok(Json(
        serde_json::json!({ "summary": summary, "report": report }),
    ))
}

async fn where_image(
    State(s): State<ClusterState>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Json<crate::text::WhereReply>> {
    let raw = q
        .get("image")
        .ok_or_else(|| Error::InvalidRequest("missing query parameter image=REF".into()))?;
    let r = ImageReference::parse(raw).map_err(|e| Error::BadReference {
        reference: raw.clone(),
        message: e.to_string(),
    })?;
    let img = s
        .resolve(&r)
        .await?
        .ok_or_else(|| Error::UnknownImage(raw.clone()))?;
    let now = s.now();
    let nodes = s.inventory().holders(&img.blobs, now);
    Ok(Json(crate::text::WhereReply {
        image: r.to_string(),
        total_bytes: img.total_bytes(),
        manifest_digest: img.manifest_digest,
        nodes,
    }))
}

async fn ingest_report(
    State(s): State<ClusterState>,
    req: Request,
) -> Result<Json<serde_json::Value>> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let reporter = req.extensions().get::<AuthenticatedNode>().cloned();
    let applied = s
        .ingest_body(
            req.into_body(),
            declared,
            reporter.as_ref().map(|n| n.0.as_str()),
        )
        .await?;
    let a = match applied {
        Applied::New => "new",
        Applied::Updated => "updated",
        Applied::Heartbeat => "heartbeat",
    };
    Ok(Json(serde_json::json!({ "applied": a })))
}

async fn submit_prewarm(
    State(s): State<ClusterState>,
    body: Bytes,
) -> Result<(StatusCode, Json<JobView>)> {
    let req: PrewarmRequest = parse_body(&body)?;
    Ok((StatusCode::CREATED, Json(s.submit_prewarm(req).await?)))
}

async fn list_prewarm(State(s): State<ClusterState>) -> Result<Json<serde_json::Value>> {
    s.refresh_jobs().await?;
    let jobs: Vec<serde_json::Value> = s.with_jobs(|j| {
        j.list()
            .map(|j| serde_json::json!({ "id": j.id, "images": j.images, "created_at": j.created_at, "progress": j.progress() }))
            .collect()
    });
    Ok(Json(serde_json::json!({ "jobs": jobs })))
}

fn parse_id(id: &str) -> Result<u64> {
    id.parse()
        .map_err(|_| Error::InvalidRequest(format!("job id {id:?} is not a number")))
}

async fn get_prewarm(
    State(s): State<ClusterState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>> {
    let id = parse_id(&id)?;
    s.refresh_jobs().await?;
    s.with_jobs(|j| j.get(id).map(|j| j.view()))
        .map(Json)
        .ok_or(Error::UnknownJob(id))
}

async fn cancel_prewarm(
    State(s): State<ClusterState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>> {
    let id = parse_id(&id)?;
    let now = s.now();
    s.change_jobs(|| s.with_jobs(|j| j.cancel(id, now).map(|j| j.view())))
        .await
        .map(Json)
}

async fn rank(State(s): State<ClusterState>, body: Bytes) -> Result<Json<extender::RankResponse>> {
    let req: RankRequest = parse_body(&body)?;
    s.rank(&req).await.map(Json)
}

async fn filter(
    State(s): State<ClusterState>,
    body: Bytes,
) -> Result<Json<extender::ExtenderFilterResult>> {
    let args: ExtenderArgs = parse_body(&body)?;
    Ok(Json(s.filter(&args)))
}

async fn prioritize(
    State(s): State<ClusterState>,
    body: Bytes,
) -> Result<Json<Vec<extender::HostPriority>>> {
    let args: ExtenderArgs = parse_body(&body)?;
    Ok(Json(s.prioritize(&args)))
}

async fn metrics(State(s): State<ClusterState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.encode_metrics(),
    )
}
