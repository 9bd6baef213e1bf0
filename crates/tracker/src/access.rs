//! Who may call what, in TLS mode. The TLS layer verified the client certificate (chain
//! to the cluster CA, validity, role node/operator/viewer) and put the identity on the
//! request ([`Caller`]); this layer decides by role and route:
//!
//! | route | allowed |
//! |---|---|
//! | `GET /healthz`, `POST /certs/v1/join` (token-authenticated) | anyone |
//! | `/swarm/v1/announce`, `/swarm/v1/seeding`, `/swarm/v1/hashes`, `POST /api/v1/reports`, `GET /api/v1/assignments`, `POST /certs/v1/renew` | node (about itself) |
//! | `POST /api/v1/prewarm/{id}/nodes/{node}` (progress) | that node, operator |
//! | other `GET`s (nodes, where, swarms, prewarm jobs, dashboard, metrics), scheduler queries | viewer, operator |
//! | everything else (prewarm create/cancel, pins, ...) | operator |
//!
//! Node routes are for nodes only, operators included: they speak for one node, and
//! only that node's certificate may. What a node sends must name the node of its
//! certificate; the handlers check that against [`cluster::http::AuthenticatedNode`].
//!
//! Without TLS (plain HTTP) this layer is not installed.

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{Method, StatusCode};
use pki::{Identity, Role};

/// The verified client of the connection a request came on. Set for every request in
/// TLS mode.
#[derive(Clone, Debug, Default)]
pub struct Caller {
    /// `None`: the client sent no certificate.
    pub identity: Option<Identity>,
    /// When the client certificate expires. The handshake checked it, but connections
    /// are kept alive for long: a request after this is refused and the connection
    /// closed, so that expiry (the cluster's revocation) also ends open connections.
    pub not_after: Option<std::time::SystemTime>,
}

impl Caller {
    /// The client of an accepted TLS connection.
    pub fn of<IO>(stream: &pki::tokio_rustls::server::TlsStream<IO>) -> Caller {
        let leaf = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| chain.first());
        match leaf.map(|der| pki::CertInfo::from_der(der)) {
            Some(Ok(info)) => Caller {
                identity: Some(info.identity),
                not_after: Some(info.not_after),
            },
            // No certificate (allowed: only /healthz and join need none), or one the
            // verifier accepted and we cannot read (not expected): no identity.
            _ => Caller::default(),
        }
    }
}

/// What a route requires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Need {
    Anyone,
    Node,
    NodeOrOperator,
    Reader,
    Operator,
}

fn required(method: &Method, path: &str) -> Need {
    match (method.as_str(), path) {
        ("GET", "/healthz" | "/readyz") | ("POST", "/certs/v1/join") => Need::Anyone,
        ("POST", "/swarm/v1/announce")
        | ("POST", "/swarm/v1/seeding")
        | ("GET", "/swarm/v1/hashes")
        | ("POST", "/api/v1/reports")
        | ("GET", "/api/v1/assignments")
        | ("POST", "/certs/v1/renew") => Need::Node,
        ("POST", p) if node_update_target(p).is_some() => Need::NodeOrOperator,
        ("GET" | "HEAD", _) => Need::Reader,
        // Scheduler extender and rank queries are POSTs that change nothing.
        ("POST", "/scheduler/filter" | "/scheduler/prioritize" | "/api/v1/rank") => Need::Reader,
        _ => Need::Operator,
    }
}

/// The node of `/api/v1/prewarm/{id}/nodes/{node}`.
pub(crate) fn node_update_target(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/api/v1/prewarm/")?;
    let (id, rest) = rest.split_once('/')?;
    let node = rest.strip_prefix("nodes/")?;
    (!id.is_empty() && !node.is_empty() && !node.contains('/')).then_some(node)
}

fn allowed(need: Need, role: Role) -> bool {
    match need {
        Need::Anyone => true,
        Need::Node => role == Role::Node,
        Need::NodeOrOperator => matches!(role, Role::Node | Role::Operator),
        Need::Reader => matches!(role, Role::Viewer | Role::Operator),
        Need::Operator => role == Role::Operator,
    }
}

fn refuse(status: StatusCode, message: String) -> Response {
    (status, Json(serde_json::json!({ "error": message }))).into_response()
}

/// The middleware: 401 without a client certificate, 403 for a role the route does not
/// allow or a node acting for another node.
pub(crate) async fn authorize(mut req: Request, next: Next) -> Response {
    let (caller, not_after) = req
        .extensions()
        .get::<Caller>()
        .map_or((None, None), |c| (c.identity.clone(), c.not_after));
    let need = required(req.method(), req.uri().path());
    if need != Need::Anyone {
        if not_after.is_some_and(|t| t < std::time::SystemTime::now()) {
            let mut resp = refuse(
                StatusCode::UNAUTHORIZED,
                "the client certificate of this connection has expired".into(),
            );
            // Closing makes the client reconnect, with its renewed certificate.
            resp.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
            return resp;
        }
        let Some(identity) = &caller else {
            return refuse(
                StatusCode::UNAUTHORIZED,
                "a client certificate of the cluster is required".into(),
            );
        };
        if !allowed(need, identity.role()) {
            return refuse(
                StatusCode::FORBIDDEN,
                format!("{identity} may not {} {}", req.method(), req.uri().path()),
            );
        }
        if identity.role() == Role::Node {
            if let Some(target) = node_update_target(req.uri().path()) {
                if target != identity.name() {
                    return refuse(
                        StatusCode::FORBIDDEN,
                        format!("{identity} cannot report progress for node {target:?}"),
                    );
                }
            }
            req.extensions_mut()
                .insert(cluster::http::AuthenticatedNode(identity.name().to_owned()));
        }
    }
    next.run(req).await
}

/// The refusal for a request naming another node than the certificate's (announce,
/// seeding, prewarm progress); `None` when it may go on.
pub(crate) fn refuse_other_node(
    auth: Option<&cluster::http::AuthenticatedNode>,
    claimed: &str,
) -> Option<Response> {
    match auth {
        Some(cluster::http::AuthenticatedNode(me)) if me != claimed => Some(refuse(
            StatusCode::FORBIDDEN,
            format!("node {me:?} cannot speak for node {claimed:?}"),
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_table() {
        let get = Method::GET;
        let post = Method::POST;
        assert_eq!(required(&get, "/healthz"), Need::Anyone);
        assert_eq!(required(&post, "/certs/v1/join"), Need::Anyone);
        assert_eq!(required(&post, "/api/v1/reports"), Need::Node);
        assert_eq!(required(&get, "/api/v1/nodes"), Need::Reader);
        assert_eq!(required(&get, "/metrics"), Need::Reader);
        assert_eq!(required(&post, "/api/v1/prewarm"), Need::Operator);
        assert_eq!(
            required(&Method::DELETE, "/api/v1/prewarm/3"),
            Need::Operator
        );
        assert_eq!(
            required(&post, "/api/v1/prewarm/3/nodes/gpu-1"),
            Need::NodeOrOperator
        );
        // POSTs to unknown paths are the operator's (default deny for the others).
        assert_eq!(required(&post, "/api/v1/whatever"), Need::Operator);
        assert!(!allowed(Need::Operator, Role::Viewer));
        assert!(!allowed(Need::Node, Role::Operator));
        assert!(!allowed(Need::Reader, Role::Node));
        assert!(allowed(Need::Reader, Role::Viewer));
    }

    #[test]
    fn node_update_paths() {
        assert_eq!(
            node_update_target("/api/v1/prewarm/3/nodes/gpu-1"),
            Some("gpu-1")
        );
        assert_eq!(node_update_target("/api/v1/prewarm/3"), None);
        assert_eq!(node_update_target("/api/v1/prewarm/3/nodes/a/b"), None);
        assert_eq!(node_update_target("/api/v1/prewarm//nodes/a"), None);
    }
}
