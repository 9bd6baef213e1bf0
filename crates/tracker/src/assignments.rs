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

use crate::redis_cluster::{self, PostOutcome};
use crate::redis_store::RedisStore;

/// Assignments one node may have waiting; more means the node is not collecting.
pub const MAILBOX_MAX: usize = cluster::wire::MAX_WAITING_ASSIGNMENTS;
/// An assignment not collected within this is failed, so its job moves on.
pub const COLLECT_WITHIN: Duration = Duration::from_secs(30);

/// A node's part of a job that has to fail: its assignment could not wait or was not
/// collected in time.
type Refused = (u64, String, String);

/// A newer planner took the lease: this one's decisions are not written.
#[derive(Debug)]
struct Fenced;

/// Assignments waiting in this process, by node, with when they were posted.
type WaitingByNode = HashMap<String, Vec<(Instant, Assignment)>>;

/// Per-node queues of assignments not yet collected: in this process, or (with
/// `--redis`) in Redis, where every replica's collection finds them. Bounded: at most
/// [`MAILBOX_MAX`] per node, and only nodes the prewarm planner chose (known nodes,
/// themselves capped by the inventory's node limit) ever get one.
#[derive(Clone, Default)]
pub struct Mailboxes {
    memory: Arc<Mutex<WaitingByNode>>,
    shared: Option<Arc<RedisStore>>,
}

impl Mailboxes {
    /// Mailboxes every replica sharing `store` sees.
    pub fn shared(store: Arc<RedisStore>) -> Self {
        Mailboxes {
            memory: Arc::default(),
            shared: Some(store),
        }
    }

    /// Queues `a` for its node; returns the node's part to fail when its box is full
    /// (or the shared store cannot take it). With a `fence` (the planner's lease
    /// epoch) nothing is posted once a newer planner leads ([`Fenced`]).
    async fn post(
        &self,
        a: Assignment,
        now: Instant,
        fence: Option<u64>,
    ) -> Result<Option<Refused>, Fenced> {
        let full = || {
            Some((
                a.job_id,
                a.node.clone(),
                format!("node has {MAILBOX_MAX} assignments it has not collected"),
            ))
        };
        if let Some(store) = &self.shared {
            return match redis_cluster::post(store, &a, MAILBOX_MAX, fence).await {
                Ok(PostOutcome::Queued) => {
                    info!(job = a.job_id, node = %a.node, seed = a.seed, "prewarm assignment ready for its node");
                    Ok(None)
                }
                Ok(PostOutcome::Full) => Ok(full()),
                Ok(PostOutcome::Fenced) => Err(Fenced),
                Err(e) => {
                    store.count_error("mailbox");
                    Ok(Some((
                        a.job_id,
                        a.node.clone(),
                        format!("tracker could not queue the assignment: {e}"),
                    )))
                }
            };
        }
        let mut boxes = self.memory.lock();
        let queue = boxes.entry(a.node.clone()).or_default();
        if queue.len() >= MAILBOX_MAX {
            return Ok(full());
        }
        info!(job = a.job_id, node = %a.node, seed = a.seed, "prewarm assignment ready for its node");
        queue.push((now, a));
        Ok(None)
    }

    /// Takes everything waiting for `node`.
    async fn collect(&self, node: &str) -> Result<Vec<Assignment>, crate::Error> {
        if let Some(store) = &self.shared {
            return redis_cluster::collect(store, node, MAILBOX_MAX)
                .await
                .map_err(|source| {
                    store.count_error("mailbox");
                    crate::Error::Redis {
                        what: "mailbox",
                        source,
                    }
                });
        }
        Ok(self
            .memory
            .lock()
            .remove(node)
            .map(|q| q.into_iter().map(|(_, a)| a).collect())
            .unwrap_or_default())
    }

    /// Assignments older than [`COLLECT_WITHIN`], removed: their node is down or not
    /// polling, and the job should not wait for it forever.
    async fn expire(&self, now: Instant) -> Vec<Refused> {
        let stale: Vec<Assignment> = if let Some(store) = &self.shared {
            match redis_cluster::expire(store, COLLECT_WITHIN).await {
                Ok(stale) => stale,
                Err(e) => {
                    store.count_error("mailbox");
                    warn!(error = %e, "cannot expire shared prewarm mailboxes");
                    Vec::new()
                }
            }
        } else {
            let mut stale = Vec::new();
            self.memory.lock().retain(|_, q| {
                q.retain(|(at, a)| {
                    let keep = now.saturating_duration_since(*at) < COLLECT_WITHIN;
                    if !keep {
                        stale.push(a.clone());
                    }
                    keep
                });
                !q.is_empty()
            });
            stale
        };
        stale
            .into_iter()
            .map(|a| {
                warn!(job = a.job_id, node = %a.node, "prewarm assignment not collected in time");
                (
                    a.job_id,
                    a.node,
                    format!(
                        "node did not collect its assignment within {} s (agent down or without --tracker?)",
                        COLLECT_WITHIN.as_secs()
                    ),
                )
            })
            .collect()
    }
}

/// Fails each refused node's part of its job (inside a job change).
fn fail_all(state: &ClusterState, refused: Vec<Refused>) {
    for (job, node, reason) in refused {
        let _ = state.update_prewarm_node(job, &node, NodeUpdate::Failed { reason });
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
    match boxes.collect(&node).await {
        Ok(list) => (StatusCode::OK, Json(list)).into_response(),
        Err(e) => e.response(),
    }
}

/// Plans assignments and ticks the cluster state every second. With `--redis`, only
/// the replica holding the `prewarm` lease plans (one at a time); another takes over
/// within [`redis_cluster::PREWARM_LEASE`] when it stops renewing.
pub fn spawn_planner(state: ClusterState, boxes: Mailboxes) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        // With Redis: this replica's planner epoch while it holds the lease.
        let mut fence = None;
        loop {
            tick.tick().await;
            state.tick_inventory();
            if let Some(store) = &boxes.shared {
                fence = redis_cluster::leads_prewarm(store, fence).await;
                if fence.is_none() || !state.inventory_complete() {
                    continue;
                }
            }
            let now = Instant::now();
            let stale = boxes.expire(now).await;
            let planned = state
                .change_jobs_fenced(fence, || {
                    fail_all(&state, stale);
                    if let Err(e) = state.tick_jobs() {
                        warn!(error = %e, "cluster tick failed");
                    }
                    state.next_assignments()
                })
                .await;
            let list = match planned {
                // A node an agent reported on while this step ran keeps the agent's
                // state: its assignment is not sent (the next step decides again).
                Ok((mut list, lost)) => {
                    list.retain(|a| !lost.contains(&(a.job_id, a.node.clone())));
                    list
                }
                Err(e) => {
                    warn!(error = %e, "cannot plan prewarm assignments");
                    continue;
                }
            };
            let mut refused = Vec::new();
            for a in list {
                match boxes.post(a, now, fence).await {
                    Ok(r) => refused.extend(r),
                    Err(Fenced) => {
                        warn!("a newer prewarm planner leads; this one's assignments are not sent");
                        break;
                    }
                }
            }
            if !refused.is_empty() {
                if let Err(e) = state
                    .change_jobs_fenced(fence, || {
                        fail_all(&state, refused);
                        Ok(())
                    })
                    .await
                {
                    warn!(error = %e, "cannot record refused prewarm assignments");
                }
            }
        }
    });
}
