//! Registry sources. [`BlobSource`] is the seam: the agent's upstream client can
//! implement it; [`HttpBlobSource`] is a small self-contained client (anonymous,
//! basic and bearer-token auth; plain HTTP on loopback) so the analyzer works today.

use std::io::Read;
use std::sync::Arc;

use oci::{Descriptor, Digest, ImageReference, Manifest};
use std::sync::Mutex;

use super::{
    read_limited, select_platform, verify_blob, Image, ImageConfig, LayerOpener, OpenOptions,
    MAX_JSON_BYTES,
};
use crate::error::{Error, Result};

/// Fetches manifests and blobs of one repository.
pub trait BlobSource: Send + Sync {
    /// The manifest named by a tag or a digest, with its content type if known.
    fn fetch_manifest(&self, reference: &str) -> Result<(Vec<u8>, Option<String>)>;
    /// A stream of the blob's bytes.
    fn open_blob(&self, digest: &Digest) -> Result<Box<dyn Read + Send + '_>>;
}

struct BlobOpener(Arc<dyn BlobSource>);

impl LayerOpener for BlobOpener {
    fn open_layer(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send + '_>> {
        self.0.open_blob(&desc.digest)
    }
}

/// Resolves `reference` through any [`BlobSource`].
pub fn open_with(
    source: Arc<dyn BlobSource>,
    reference: &ImageReference,
    platform: Option<&str>,
) -> Result<Image> {
    let mref = reference.manifest_ref().to_string();
    let (bytes, _) = source.fetch_manifest(&mref)?;
    if let Some(d) = &reference.digest {
        let got = Digest::of(&bytes);
        if &got != d {
            return Err(Error::Manifest(format!(
                "manifest digest {got} does not match the reference {d}"
            )));
        }
    }
    let mut digest = Digest::of(&bytes);
    let mut m = Manifest::parse(&bytes)?;
    let mut shown_platform = None;
    if m.is_index() {
        let d = select_platform(&m, platform)?.clone();
        shown_platform = d
            .platform
            .as_ref()
            .map(|p| format!("{}/{}", p.os, p.architecture));
        let (b, _) = source.fetch_manifest(&d.digest.to_string())?;
        verify_blob(&d, &b, "manifest")?;
        digest = d.digest.clone();
        m = Manifest::parse(&b)?;
        if m.is_index() {
            return Err(Error::Manifest("nested index".into()));
        }
    }
    let cdesc = m
        .config
        .clone()
        .ok_or_else(|| Error::Manifest("image manifest has no config".into()))?;
    let cbytes = read_limited(source.open_blob(&cdesc.digest)?, MAX_JSON_BYTES, "config")?;
    verify_blob(&cdesc, &cbytes, "config")?;
    let config = ImageConfig::parse(&cbytes)?;
    Ok(Image {
        name: reference.to_string(),
        tag: if reference.digest.is_some() {
            None
        } else {
            reference.tag.clone()
        },
        pinned: reference.digest.is_some(),
        manifest_digest: Some(digest),
        manifest: m,
        config,
        platform: shown_platform,
        opener: Box::new(BlobOpener(source)),
    })
}

/// Opens a registry reference with the built-in HTTP client.
pub fn open(reference: &str, opts: &OpenOptions) -> Result<Image> {
    let r = ImageReference::parse(reference)?;
    let src = HttpBlobSource::new(&r, opts.credentials.clone(), opts.plain_http)?;
    open_with(Arc::new(src), &r, opts.platform.as_deref())
}

/// A minimal distribution-API client on reqwest, driven by a private tokio runtime.
pub struct HttpBlobSource {
    rt: tokio::runtime::Runtime,
    client: reqwest::Client,
    base: String,
    repository: String,
    credentials: Option<(String, String)>,
    auth: Mutex<Option<String>>,
}

impl HttpBlobSource {
    pub fn new(
        r: &ImageReference,
        credentials: Option<(String, String)>,
        plain_http: bool,
    ) -> Result<Self> {
        let host = if r.registry == oci::reference::DOCKER_HUB {
            "registry-1.docker.io"
        } else {
            &r.registry
        };
        let hostname = host.rsplit_once(':').map(|(h, _)| h).unwrap_or(host);
        let loopback = matches!(hostname, "localhost" | "127.0.0.1" | "[::1]");
        let scheme = if plain_http || loopback {
            "http"
        } else {
            "https"
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| Error::io("tokio runtime", e))?;
        let client = reqwest::Client::builder()
            .user_agent("starling-analyze")
            .build()
            .map_err(|e| Error::Registry(e.to_string()))?;
        Ok(Self {
            rt,
            client,
            base: format!("{scheme}://{host}"),
            repository: r.repository.clone(),
            credentials,
            auth: Mutex::new(None),
        })
    }

    fn registry_err(&self, e: impl std::fmt::Display) -> Error {
        Error::Registry(format!("{}: {e}", self.base))
    }

    async fn get(&self, url: &str, accept: Option<&str>) -> Result<reqwest::Response> {
        for attempt in 0..2 {
            let mut req = self.client.get(url);
            if let Some(a) = accept {
                req = req.header("Accept", a);
            }
            let auth = self.auth.lock().map(|g| g.clone()).unwrap_or(None);
            if let Some(a) = auth {
                req = req.header("Authorization", a);
            }
            let resp = req.send().await.map_err(|e| self.registry_err(e))?;
            if resp.status().as_u16() == 401 && attempt == 0 {
                let challenge = resp
                    .headers()
                    .get("www-authenticate")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let header = self.authorize(&challenge).await?;
                if let Ok(mut g) = self.auth.lock() {
                    *g = Some(header);
                }
                continue;
            }
            if !resp.status().is_success() {
                let status = resp.status();
                let body = resp.text().await.unwrap_or_default();
                return Err(self.registry_err(format!("GET {url}: {status}: {body:.300}")));
            }
            return Ok(resp);
        }
        Err(self.registry_err(format!("GET {url}: unauthorized")))
    }

    /// Answers a `WWW-Authenticate` challenge: Basic with the credentials, or Bearer
    /// by fetching a token from the realm (with the credentials if any).
    async fn authorize(&self, challenge: &str) -> Result<String> {
        use base64::Engine as _;
        let basic = self.credentials.as_ref().map(|(u, p)| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )
        });
        let (scheme, params) = challenge.split_once(' ').unwrap_or((challenge, ""));
        if scheme.eq_ignore_ascii_case("basic") {
            return basic.ok_or_else(|| {
                self.registry_err("registry wants basic auth; give --creds USER:PASS")
            });
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(self.registry_err(format!("unsupported auth challenge {challenge:.100}")));
        }
        let params = parse_challenge(params);
        let realm = params
            .iter()
            .find(|(k, _)| k == "realm")
            .map(|(_, v)| v.clone())
            .ok_or_else(|| self.registry_err("bearer challenge without realm"))?;
        let mut url = url_with_query(&realm, &params, &self.repository);
        if url.is_empty() {
            url = realm;
        }
        let mut req = self.client.get(&url);
        if let Some(b) = basic {
            req = req.header("Authorization", b);
        }
        let resp = req.send().await.map_err(|e| self.registry_err(e))?;
        if !resp.status().is_success() {
            return Err(self.registry_err(format!("token endpoint answered {}", resp.status())));
        }
        let v: serde_json::Value = resp.json().await.map_err(|e| self.registry_err(e))?;
        let token = v
            .get("token")
            .or_else(|| v.get("access_token"))
            .and_then(|t| t.as_str())
            .ok_or_else(|| self.registry_err("token response without token"))?;
        Ok(format!("Bearer {token}"))
    }
}

fn url_with_query(realm: &str, params: &[(String, String)], repository: &str) -> String {
    let mut q = Vec::new();
    if let Some((_, s)) = params.iter().find(|(k, _)| k == "service") {
        q.push(format!("service={}", encode(s)));
    }
    let scope = params
        .iter()
        .find(|(k, _)| k == "scope")
        .map(|(_, s)| s.clone())
        .unwrap_or_else(|| format!("repository:{repository}:pull"));
    q.push(format!("scope={}", encode(&scope)));
    let sep = if realm.contains('?') { '&' } else { '?' };
    format!("{realm}{sep}{}", q.join("&"))
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Parses `k="v",k2="v2"` auth-params (quoted values may contain commas).
pub fn parse_challenge(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let Some((k, after)) = rest.split_once('=') else {
            break;
        };
        let key = k.trim().trim_start_matches(',').trim().to_ascii_lowercase();
        let after = after.trim_start();
        let (val, next) = if let Some(stripped) = after.strip_prefix('"') {
            match stripped.find('"') {
                Some(end) => (stripped[..end].to_owned(), &stripped[end + 1..]),
                None => (stripped.to_owned(), ""),
            }
        } else {
            match after.find(',') {
                Some(end) => (after[..end].trim().to_owned(), &after[end..]),
                None => (after.trim().to_owned(), ""),
            }
        };
        out.push((key, val));
        rest = next.trim_start().trim_start_matches(',').trim_start();
    }
    out
}

impl BlobSource for HttpBlobSource {
    fn fetch_manifest(&self, reference: &str) -> Result<(Vec<u8>, Option<String>)> {
        let url = format!("{}/v2/{}/manifests/{reference}", self.base, self.repository);
        self.rt.block_on(async {
            let resp = self.get(&url, Some(oci::media::DEFAULT_ACCEPT)).await?;
            let ct = resp
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let bytes = resp.bytes().await.map_err(|e| self.registry_err(e))?;
            if bytes.len() as u64 > MAX_JSON_BYTES {
                return Err(Error::Manifest("manifest too large".into()));
            }
            Ok((bytes.to_vec(), ct))
        })
    }

    fn open_blob(&self, digest: &Digest) -> Result<Box<dyn Read + Send + '_>> {
        let url = format!("{}/v2/{}/blobs/{digest}", self.base, self.repository);
        let resp = self.rt.block_on(self.get(&url, None))?;
        let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<bytes::Bytes>>(16);
        self.rt.spawn(async move {
            let mut resp = resp;
            loop {
                match resp.chunk().await {
                    Ok(Some(c)) => {
                        if tx.send(Ok(c)).await.is_err() {
                            return;
                        }
                    }
                    Ok(None) => return,
                    Err(e) => {
                        let _ = tx.send(Err(std::io::Error::other(e))).await;
                        return;
                    }
                }
            }
        });
        Ok(Box::new(ChannelReader {
            rx,
            cur: bytes::Bytes::new(),
        }))
    }
}

struct ChannelReader {
    rx: tokio::sync::mpsc::Receiver<std::io::Result<bytes::Bytes>>,
    cur: bytes::Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        bytes::Buf::advance(&mut self.cur, n);
        Ok(n)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn challenge_params() {
        let p = parse_challenge(
            r#"realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#,
        );
        assert_eq!(p[0], ("realm".into(), "https://auth.example/token".into()));
        assert_eq!(p[1], ("service".into(), "registry.example".into()));
        assert_eq!(p[2], ("scope".into(), "repository:a/b:pull,push".into()));
        let u = url_with_query("https://auth.example/token", &p[..2], "team/x");
        assert_eq!(u, "https://auth.example/token?service=registry.example&scope=repository%3Ateam%2Fx%3Apull");
    }
}
