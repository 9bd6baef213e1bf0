//! Fault-injecting proxies in front of the real registry: the forwarding they share.

/// For fault-injecting proxies in front of the real registry (or tracker): sends `req`,
/// body included, on to
/// `upstream` and returns its path and query, the upstream response, and a response
/// builder carrying the upstream's status and headers (the caller supplies the body).
pub async fn forward(
    client: &reqwest::Client,
    upstream: &str,
    req: axum::extract::Request,
) -> (String, reqwest::Response, http::response::Builder) {
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.to_string())
        .unwrap_or_default();
    let mut fwd = client.request(req.method().clone(), format!("{upstream}{path}"));
    for (k, v) in req.headers() {
        if k != "host" {
            fwd = fwd.header(k, v);
        }
    }
    let body = axum::body::to_bytes(req.into_body(), 1 << 30)
        .await
        .expect("a request body under 1 GiB");
    if !body.is_empty() {
        fwd = fwd.body(body);
    }
    let resp = fwd.send().await.expect("upstream answers");
    let mut builder = axum::response::Response::builder().status(resp.status());
    for (k, v) in resp.headers() {
        builder = builder.header(k, v);
    }
    (path, resp, builder)
}

/// Serves a fault-injecting proxy's `app` on a free loopback port until the test's
/// runtime ends; returns its base URL.
pub async fn serve(app: axum::Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let url = format!("http://{}", l.local_addr().expect("local address"));
    tokio::spawn(async move { axum::serve(l, app).await });
    url
}
