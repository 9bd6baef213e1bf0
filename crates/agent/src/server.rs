//! The agent's HTTP/1.1 listener. Each connection's transport is a
//! [`ZeroCopyIo`](crate::zerocopy::ZeroCopyIo) and each request carries that
//! connection's [`Sink`], so handlers can answer with file spans instead of bytes.
//! Container runtimes and the agent's own peers speak HTTP/1.1 to a mirror; HTTP/2 is
//! not offered because it would copy placeholder chunks into frames.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tower::ServiceExt;
use tracing::{debug, warn};

use crate::zerocopy::{Sink, ZeroCopyIo};

/// Accepts connections until `shutdown` resolves, then lets in-flight responses finish.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let tcp = match accepted {
                    Ok((tcp, _)) => tcp,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                connections.spawn(serve_connection(tcp, router.clone(), stop_rx.clone()));
            }
        }
    }
    let _ = stop_tx.send(true);
    while connections.join_next().await.is_some() {}
}

async fn serve_connection(
    tcp: tokio::net::TcpStream,
    router: Router,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let sink = Sink::default();
    let io = TokioIo::new(ZeroCopyIo::new(tcp, sink.clone()));
    let service = hyper::service::service_fn(
        move |mut req: http::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(sink.clone());
            let req = req.map(axum::body::Body::new);
            let router = router.clone();
            async move { Ok::<_, Infallible>(router.oneshot(req).await.unwrap_or_else(|e| match e {})) }
        },
    );
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
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
