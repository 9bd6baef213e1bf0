//! A minimal blocking HTTP/1.0 GET client for loopback servers (plain HTTP, and
//! HTTPS with a given rustls configuration for TLS registries).
//!
//! Deliberately runtime-free so it can be called from anywhere (including inside
//! a tokio test) without touching any runtime.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

/// A fully-read HTTP response.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    /// Header names are lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// First header value with this (case-insensitive) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// GET `url` (must be `http://host:port/path`), sending extra `headers`.
/// Uses HTTP/1.0 + `Connection: close`, so the body is read until EOF.
/// Connect/read timeouts are 10 s.
pub fn http_get(url: &str, headers: &[(&str, &str)]) -> Result<HttpResponse> {
    get(url, headers, None)
}

/// GET `url`, `https://` with `tls` when given (else `http://` only).
pub(crate) fn get(
    url: &str,
    headers: &[(&str, &str)],
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<HttpResponse> {
    let rest = match (
        url.strip_prefix("http://"),
        url.strip_prefix("https://"),
        tls,
    ) {
        (Some(rest), _, _) => rest,
        (_, Some(rest), Some(_)) => rest,
        _ => bail!("only http:// URLs (or https:// with a TLS configuration) are supported: {url}"),
    };
    let https = url.starts_with("https://");
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr = authority
        .to_socket_addrs()
        .with_context(|| format!("resolving {authority}"))?
        .next()
        .ok_or_else(|| anyhow!("no address for {authority}"))?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
        .with_context(|| format!("connecting to {authority}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut req = format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let mut raw = Vec::new();
    match tls {
        Some(cfg) if https => {
            let host = authority
                .rsplit_once(':')
                .map_or(authority, |(h, _)| h)
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let name = rustls::pki_types::ServerName::try_from(host)
                .with_context(|| format!("server name of {authority}"))?;
            let conn = rustls::ClientConnection::new(cfg.clone(), name)
                .with_context(|| format!("TLS to {authority}"))?;
            let mut tls_stream = rustls::StreamOwned::new(conn, stream);
            tls_stream
                .write_all(req.as_bytes())
                .with_context(|| format!("TLS request to {url}"))?;
            match tls_stream.read_to_end(&mut raw) {
                Ok(_) => {}
                // A server that closes without close_notify: the body ran to EOF.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
                Err(e) => return Err(e).with_context(|| format!("reading response from {url}")),
            }
        }
        _ => {
            stream.write_all(req.as_bytes())?;
            stream
                .read_to_end(&mut raw)
                .with_context(|| format!("reading response from {url}"))?;
        }
    }
    parse_response(&raw).with_context(|| format!("parsing response from {url}"))
}

fn parse_response(raw: &[u8]) -> Result<HttpResponse> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("no end of headers in {} bytes", raw.len()))?;
    let head = std::str::from_utf8(&raw[..end]).context("non-UTF-8 headers")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("bad status line {status_line:?}"))?;
    let mut headers = Vec::new();
    for line in lines {
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let mut body = raw[end + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    if chunked {
        body = dechunk(&body)?;
    }
    Ok(HttpResponse {
        status,
        headers,
        body,
    })
}

fn dechunk(mut data: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let nl = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| anyhow!("truncated chunk header"))?;
        let size_str = std::str::from_utf8(&data[..nl])?;
        let size_str = size_str.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_str, 16)?;
        data = &data[nl + 2..];
        if size == 0 {
            return Ok(out);
        }
        if data.len() < size {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&data[..size]);
        data = data.get(size + 2..).unwrap_or_default();
    }
}
