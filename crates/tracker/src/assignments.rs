//! Prewarm assignments wait at the tracker until their node collects them.
//!
//! The tracker never connects to an agent: a node polls `GET /api/v1/assignments`
//! with its own credential — its node certificate (TLS mode: the node is the one the
//! certificate names) or the cluster token with `?node=` (plain mode). An address named in a
//! report is therefore never dialled, and no credential is ever sent to it (issue 12,
//! finding 1: a forged report pointed the tracker's assignment POST, with the cluster
//! token in it, at an attacker's server). Agents also need no inbound cluster API, so
//! their mirror can stay on loopback.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cluster::http::AuthenticatedNode;
use cluster::wire::{Assignment, NodeUpdate};
use cluster::ClusterState;
use http::StatusCode;
use parking_lot::Mutex;
use tracing::{info, warn};

/// Assignments one node may have waiting; more means the node is not collecting.
pub const MAILBOX_MAX: usize = cluster::wire::MAX_WAITING_ASSIGNMENTS;
/// An assignment not collected within this is failed, so its job moves on.
pub const COLLECT_WITHIN: Duration = Duration::from_secs(30);

/// Per-node queues of assignments not yet collected. Bounded: at most
/// [`MAILBOX_MAX`] per node, and only nodes the prewarm planner chose (known nodes,
/// themselves capped by the inventory's node limit) ever get one.
#[derive(Clone, Default)]
pub struct Mailboxes(Arc<Mutex<HashMap<String, Vec<(Instant, Assignment)>>>>);

impl Mailboxes {
    /// Queues `a` for its node; fails the node's part of the job when its box is full.
    pub fn post(&self, state: &ClusterState, a: Assignment, now: Instant) {
        let mut boxes = self.0.lock();
        let queue = boxes.entry(a.node.clone()).or_default();
        if queue.len() >= MAILBOX_MAX {
            let (job, node) = (a.job_id, a.node.clone());
            drop(boxes);
            let _ = state.update_prewarm_node(
                job,
                &node,
                NodeUpdate::Failed {
                    reason: format!("node has {MAILBOX_MAX} assignments it has not collected"),
                },
            );
            return;
        }
        info!(job = a.job_id, node = %a.node, seed = a.seed, "prewarm assignment ready for its node");
        queue.push((now, a));
    }

    /// Takes everything waiting for `node`.
    pub fn collect(&self, node: &str) -> Vec<Assignment> {
        self.0
            .lock()
            .remove(node)
            .map(|q| q.into_iter().map(|(_, a)| a).collect())
            .unwrap_or_default()
    }

    /// Fails assignments older than [`COLLECT_WITHIN`]: their node is down or not
    /// polling, and the job should not wait for it forever.
    pub fn expire(&self, state: &ClusterState, now: Instant) {
        let mut stale = Vec::new();
        self.0.lock().retain(|_, q| {
            q.retain(|(at, a)| {
                let keep = now.saturating_duration_since(*at) < COLLECT_WITHIN;
                if !keep {
                    stale.push((a.job_id, a.node.clone()));
                }
                keep
            });
            !q.is_empty()
        });
        for (job, node) in stale {
            warn!(job, %node, "prewarm assignment not collected in time");
            let _ = state.update_prewarm_node(
                job,
                &node,
                NodeUpdate::Failed {
                    reason: format!(
                        "node did not collect its assignment within {} s (agent down or without --tracker?)",
                        COLLECT_WITHIN.as_secs()
                    ),
                },
            );
        }
    }
}

#[derive(serde::Deserialize)]
pub struct CollectQuery {
    node: Option<String>,
}

/// `GET /api/v1/assignments[?node=NAME]`: the caller's waiting assignments, each handed
/// out once. With a node certificate the node is the certificate's (a `node` naming
/// another is 403); in plain mode `node` says which (behind the cluster token).
pub async fn collect(
    State(boxes): State<Mailboxes>,
    me: Option<axum::Extension<AuthenticatedNode>>,
    Query(q): Query<CollectQuery>,
) -> Response {
    let node = match (me, q.node) {
        (Some(axum::Extension(AuthenticatedNode(me))), Some(asked)) if asked != me => {
            return (
                StatusCode::FORBIDDEN,
                Json(serde_json::json!({"error": format!("{me} cannot collect {asked}'s assignments")})),
            )
                .into_response();
        }
        (Some(axum::Extension(AuthenticatedNode(me))), _) => me,
        (None, Some(node)) => node,
        (None, None) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(serde_json::json!({"error": "which node? (?node=NAME)"})),
            )
                .into_response();
        }
    };
    (StatusCode::OK, Json(boxes.collect(&node))).into_response()
}

/// Plans assignments and ticks the cluster state every second.
pub fn spawn_planner(state: ClusterState, boxes: Mailboxes) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            if let Err(e) = state.tick() {
                warn!(error = %e, "cluster tick failed");
            }
            let now = Instant::now();
            boxes.expire(&state, now);
            match state.next_assignments() {
                Ok(list) => {
                    for a in list {
                        boxes.post(&state, a, now);
                    }
                }
                Err(e) => warn!(error = %e, "cannot plan prewarm assignments"),
            }
        }
    });
}
