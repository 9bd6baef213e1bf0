//! The tracker's HTTP/1.1 accept loop (axum::serve has no header timeout, no
//! connection cap and waits for every connection on shutdown).
//!
//! - At most `max_connections` connections are served; one over the cap is closed as
//!   it is accepted and counted, so a flood cannot take the tracker's descriptors
//!   (agents retry, and the scheduler extender is `ignorable`).
//! - A request head must arrive within `header_read_timeout`, which also bounds idle
//!   keep-alive time: slow-header clients cannot hold connections forever.
//! - On shutdown, requests in flight get `shutdown_grace`; then connections are
//!   dropped and `serve` returns, whatever they are waiting for.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tower::ServiceExt;
use tracing::{debug, warn};

use crate::access::Caller;
use crate::tls::TrackerTls;
use crate::ReasonLabels;

/// Connection and request limits of the tracker's server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub shutdown_grace: Duration,
    /// A request (body included) taking longer is answered 408 and dropped.
    pub request_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_connections: 16_384,
            header_read_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(5),
            request_timeout: Duration::from_secs(60),
        }
    }
}

pub(crate) struct Gauges {
    pub refused: Counter,
    pub open: Gauge,
    pub handshakes_refused: Family<ReasonLabels, Counter>,
}

/// The address a request's connection came from (a request extension).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClientIp(pub std::net::IpAddr);

pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    limits: ServerLimits,
    gauges: Gauges,
    tls: Option<TrackerTls>,
) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut connections = JoinSet::new();
    let mut last_warning: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let (tcp, client) = match accepted {
                    Ok((tcp, addr)) => (tcp, ClientIp(addr.ip())),
                    Err(e) => {
                        // Out of descriptors and the like: back off instead of spinning.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    gauges.refused.inc();
                    if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                        last_warning = Some(Instant::now());
                        warn!(max_connections = limits.max_connections, "connection cap reached; closing new connections");
                    }
                    drop(tcp);
                    continue;
                };
                let _ = tcp.set_nodelay(true);
                let (router, stop, open) = (router.clone(), stop_rx.clone(), gauges.open.clone());
                let header_timeout = limits.header_read_timeout;
                let tls = tls.clone();
                let handshakes_refused = gauges.handshakes_refused.clone();
                connections.spawn(async move {
                    let _slot = slot;
                    let _open = OpenGuard::new(open);
                    match tls {
                        None => serve_connection(tcp, router, client, None, header_timeout, stop).await,
                        Some(tls) => {
                            // The handshake gets the header timeout too: a client that
                            // opens a connection and never says hello must not keep it.
                            let accepted = tokio::time::timeout(
                                header_timeout,
                                tls.acceptor.accept(tcp),
                            )
                            .await;
                            match accepted {
                                Ok(Ok(stream)) => {
                                    let caller = Some(Caller::of(&stream));
                                    serve_connection(stream, router, client, caller, header_timeout, stop).await
                                }
                                Ok(Err(e)) => {
                                    let e = pki::Error::from_handshake(e);
                                    let reason = e.reason();
                                    handshakes_refused.get_or_create(&ReasonLabels { reason }).inc();
                                    debug!(client = %client.0, error = %e, "TLS handshake refused");
                                }
                                Err(_) => {
                                    handshakes_refused.get_or_create(&ReasonLabels { reason: "timeout" }).inc();
                                    debug!(client = %client.0, "TLS handshake timed out");
                                }
                            }
                        }
                    }
                });
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

/// Serves HTTP/1.1 on one connection (TCP or TLS) until it ends or the server stops.
/// `caller`: the connection's verified client identity in TLS mode, put on every request.
async fn serve_connection<IO>(
    io: IO,
    router: Router,
    client: ClientIp,
    caller: Option<Caller>,
    header_timeout: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
        let router = router.clone();
        let caller = caller.clone();
        async move {
            let mut req = req.map(axum::body::Body::new);
            req.extensions_mut().insert(client);
            if let Some(caller) = caller {
                req.extensions_mut().insert(caller);
            }
            Ok::<_, Infallible>(router.oneshot(req).await.unwrap_or_else(|e| match e {}))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(io), service);
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
