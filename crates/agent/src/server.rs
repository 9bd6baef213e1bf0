//! The agent's HTTP/1.1 listener. Each connection's transport is a
//! [`ZeroCopyIo`](crate::zerocopy::ZeroCopyIo) and each request carries that
//! connection's [`Sink`], so handlers can answer with file spans instead of bytes.
//! Container runtimes and the agent's own peers speak HTTP/1.1 to a mirror; HTTP/2 is
//! not offered because it would copy placeholder chunks into frames.
//!
//! Limits: at most `max_connections` connections are served; one over is closed as it
//! is accepted (clients retry, and a mirror that accepted without bound would run out
//! of descriptors for everyone). A connection must deliver each request head within
//! `header_read_timeout`, which also bounds idle keep-alive time. On shutdown responses
//! in flight get `shutdown_grace`, then connections are dropped.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tower::ServiceExt;
use tracing::{debug, warn};

use crate::zerocopy::{Sink, ZeroCopyIo};

#[derive(Clone, Debug)]
pub(crate) struct Limits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub shutdown_grace: Duration,
    /// Connections closed at accept because the cap was reached.
    pub refused: Counter,
    pub open: Gauge,
}

/// Accepts connections until `shutdown` resolves, then lets in-flight responses finish
/// for at most the grace period.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    limits: Limits,
) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut connections = JoinSet::new();
    let mut last_refusal_warning: Option<std::time::Instant> = None;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let (tcp, client) = match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    limits.refused.inc();
                    if last_refusal_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                        last_refusal_warning = Some(std::time::Instant::now());
                        warn!(max_connections = limits.max_connections, "connection cap reached; closing new connections");
                    }
                    drop(tcp);
                    continue;
                };
                let _ = tcp.set_nodelay(true);
                let local = tcp.local_addr().unwrap_or(client);
                connections.spawn(serve_connection(
                    tcp,
                    ClientAddr { peer: client, local },
                    router.clone(),
                    stop_rx.clone(),
                    limits.clone(),
                    permit,
                ));
            }
        }
    }
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(limits.shutdown_grace, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        warn!(
            connections = connections.len(),
            grace = ?limits.shutdown_grace,
            "shutdown grace period over; closing connections still in use"
        );
        connections.shutdown().await;
    }
}

/// Both ends of a request's connection (a request extension).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClientAddr {
    pub peer: std::net::SocketAddr,
    pub local: std::net::SocketAddr,
}

async fn serve_connection(
    tcp: tokio::net::TcpStream,
    client: ClientAddr,
    router: Router,
    mut stop: tokio::sync::watch::Receiver<bool>,
    limits: Limits,
    _slot: OwnedSemaphorePermit,
) {
    let _open = OpenGuard::new(limits.open.clone());
    let sink = Sink::default();
    let io = TokioIo::new(ZeroCopyIo::new(tcp, sink.clone()));
    let service = hyper::service::service_fn(
        move |mut req: http::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(sink.clone());
            req.extensions_mut().insert(client);
            let req = req.map(axum::body::Body::new);
            let router = router.clone();
            async move { Ok::<_, Infallible>(router.oneshot(req).await.unwrap_or_else(|e| match e {})) }
        },
    );
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .serve_connection(io, service);
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                debug!(error = %e, "connection ended with an error");
            }
        }
        _ = async { drop(stop.wait_for(|s| *s).await) } => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

/// Counts a connection as open for as long as its task lives (aborted ones too).
struct OpenGuard(Gauge);

impl OpenGuard {
    fn new(g: Gauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
