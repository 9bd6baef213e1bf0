//! A Docker token-auth server (the `realm` of `WWW-Authenticate: Bearer ...`).
//!
//! Implements `GET /token?service=..&scope=..` (optional Basic auth) and the
//! OAuth2 variant `POST /token` (form `grant_type=password&username=..&
//! password=..&scope=..&service=..`, used by containerd). Tokens are ES256
//! JWTs whose header carries the self-signed signing certificate in `x5c`;
//! the same certificate is what the registry trusts (`rootcertbundle`).

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, Context, Result};
use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde_json::json;

/// Configuration of a [`TokenServer`].
#[derive(Debug, Clone)]
pub struct TokenConfig {
    pub user: String,
    pub password: String,
    /// Anonymous (no credentials) requests get a token with `pull` only.
    /// When false they are refused with 401.
    pub allow_anonymous: bool,
    /// `service` / JWT `aud`.
    pub service: String,
    /// JWT `iss`.
    pub issuer: String,
    /// Token lifetime in seconds (default 300); can be changed later with
    /// [`TokenServer::set_expires_in`].
    pub expires_in: u64,
}

impl TokenConfig {
    pub fn new(user: &str, password: &str, allow_anonymous: bool) -> TokenConfig {
        TokenConfig {
            user: user.to_string(),
            password: password.to_string(),
            allow_anonymous,
            service: "starling-test-registry".to_string(),
            issuer: "starling-testkit-token-issuer".to_string(),
            expires_in: 300,
        }
    }
}

struct Inner {
    cfg: TokenConfig,
    key: EcdsaKeyPair,
    rng: SystemRandom,
    cert_der_b64: String,
    expires_in: AtomicU64,
    requests: AtomicUsize,
    denied: AtomicUsize,
    scopes: Mutex<Vec<String>>,
    jti: AtomicU64,
}

/// A running token server (own thread + own tokio runtime). Stops on drop.
pub struct TokenServer {
    inner: Arc<Inner>,
    addr: SocketAddr,
    cert_pem: String,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TokenServer {
    /// Starts the server on `127.0.0.1:<random port>`. Blocking; safe to call
    /// inside a tokio runtime (the server runs on its own thread).
    pub fn start(cfg: TokenConfig) -> Result<TokenServer> {
        let key_pair = rcgen::KeyPair::generate().context("generating ECDSA P-256 key")?;
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .context("certificate params")?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "starling testkit token signer");
        let cert = params
            .self_signed(&key_pair)
            .context("self-signing certificate")?;
        let rng = SystemRandom::new();
        let key = EcdsaKeyPair::from_pkcs8(
            &ECDSA_P256_SHA256_FIXED_SIGNING,
            &key_pair.serialize_der(),
            &rng,
        )
        .map_err(|e| anyhow!("loading signing key into ring: {e}"))?;
        let inner = Arc::new(Inner {
            expires_in: AtomicU64::new(cfg.expires_in),
            cfg,
            key,
            rng,
            cert_der_b64: STANDARD.encode(cert.der()),
            requests: AtomicUsize::new(0),
            denied: AtomicUsize::new(0),
            scopes: Mutex::new(Vec::new()),
            jti: AtomicU64::new(0),
        });

        // Binding here (port 0) means there is no free-port race at all.
        let listener = TcpListener::bind("127.0.0.1:0").context("binding token server")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
        let app = Router::new()
            .route("/token", get(get_token).post(post_token))
            .with_state(inner.clone());
        let thread = std::thread::Builder::new()
            .name(format!("testkit-token-{}", addr.port()))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(anyhow!("building runtime: {e}")));
                        return;
                    }
                };
                rt.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = ready_tx.send(Err(anyhow!("tokio listener: {e}")));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    let _ = axum::serve(listener, app)
                        .with_graceful_shutdown(async move {
                            let _ = rx.await;
                        })
                        .await;
                });
            })
            .context("spawning token server thread")?;
        ready_rx
            .recv()
            .map_err(|_| anyhow!("token server thread died during startup"))??;
        Ok(TokenServer {
            inner,
            addr,
            cert_pem: cert.pem(),
            shutdown: Some(tx),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:PORT/token` — the registry's `realm`.
    pub fn realm(&self) -> String {
        format!("http://{}/token", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn service(&self) -> &str {
        &self.inner.cfg.service
    }

    pub fn issuer(&self) -> &str {
        &self.inner.cfg.issuer
    }

    pub fn config(&self) -> &TokenConfig {
        &self.inner.cfg
    }

    /// PEM of the self-signed certificate whose key signs the tokens.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Writes [`Self::cert_pem`] to `path` (the registry's `rootcertbundle`).
    pub fn write_cert_bundle(&self, path: &Path) -> Result<PathBuf> {
        std::fs::write(path, &self.cert_pem)
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(path.to_path_buf())
    }

    /// Number of token requests received (GET and POST, granted or not).
    pub fn requests(&self) -> usize {
        self.inner.requests.load(Ordering::SeqCst)
    }

    /// Number of requests refused with 401.
    pub fn denied(&self) -> usize {
        self.inner.denied.load(Ordering::SeqCst)
    }

    /// Every `scope` value requested so far, in order.
    pub fn requested_scopes(&self) -> Vec<String> {
        self.inner
            .scopes
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default()
    }

    /// Changes the lifetime of tokens issued from now on.
    pub fn set_expires_in(&self, secs: u64) {
        self.inner.expires_in.store(secs, Ordering::SeqCst);
    }

    pub fn expires_in(&self) -> u64 {
        self.inner.expires_in.load(Ordering::SeqCst)
    }

    /// Issues a token directly (bypassing HTTP) for `sub` with `scopes`
    /// (`repository:NAME:pull,push`), granting exactly the requested actions.
    pub fn issue(&self, sub: &str, scopes: &[&str]) -> Result<String> {
        let access = scopes.iter().filter_map(|s| parse_scope(s)).collect();
        self.inner.issue(sub, access)
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// (type, name, actions)
type Access = (String, String, Vec<String>);

fn parse_scope(scope: &str) -> Option<Access> {
    let (typ, rest) = scope.split_once(':')?;
    let (name, actions) = rest.rsplit_once(':')?;
    let actions = actions
        .split(',')
        .filter(|a| !a.is_empty())
        .map(str::to_string)
        .collect();
    Some((typ.to_string(), name.to_string(), actions))
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// RFC 3339 UTC timestamp for unix seconds.
fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

impl Inner {
    fn issue(&self, sub: &str, access: Vec<Access>) -> Result<String> {
        let now = now_secs();
        let exp = now + self.expires_in.load(Ordering::SeqCst);
        let jti = format!(
            "testkit-{}-{}",
            now,
            self.jti.fetch_add(1, Ordering::SeqCst)
        );
        let header = json!({"typ": "JWT", "alg": "ES256", "x5c": [self.cert_der_b64]});
        let access: Vec<_> = access
            .into_iter()
            .map(|(t, n, a)| json!({"type": t, "name": n, "actions": a}))
            .collect();
        let claims = json!({
            "iss": self.cfg.issuer,
            "sub": sub,
            "aud": self.cfg.service,
            "exp": exp,
            "nbf": now.saturating_sub(10),
            "iat": now,
            "jti": jti,
            "access": access,
        });
        let signing_input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(serde_json::to_vec(&header)?),
            URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims)?)
        );
        let sig = self
            .key
            .sign(&self.rng, signing_input.as_bytes())
            .map_err(|e| anyhow!("signing JWT: {e}"))?;
        Ok(format!(
            "{signing_input}.{}",
            URL_SAFE_NO_PAD.encode(sig.as_ref())
        ))
    }

    /// Shared logic of GET and POST. `creds` is `None` for anonymous.
    fn respond(&self, creds: Option<(String, String)>, scopes: Vec<String>) -> Response {
        self.requests.fetch_add(1, Ordering::SeqCst);
        if let Ok(mut v) = self.scopes.lock() {
            v.extend(scopes.iter().cloned());
        }
        let sub = match &creds {
            Some((u, p)) if *u == self.cfg.user && *p == self.cfg.password => Some(u.clone()),
            Some(_) => return self.deny("invalid username or password"),
            None if self.cfg.allow_anonymous => None,
            None => return self.deny("authentication required"),
        };
        let mut access = Vec::new();
        for s in &scopes {
            // A space-separated list is allowed in the OAuth2 form.
            for one in s.split(' ').filter(|x| !x.is_empty()) {
                if let Some((typ, name, actions)) = parse_scope(one) {
                    let actions: Vec<String> = if sub.is_some() {
                        actions
                    } else {
                        actions.into_iter().filter(|a| a == "pull").collect()
                    };
                    access.push((typ, name, actions));
                }
            }
        }
        let token = match self.issue(sub.as_deref().unwrap_or(""), access) {
            Ok(t) => t,
            Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")).into_response(),
        };
        let now = now_secs();
        Json(json!({
            "token": token,
            "access_token": token,
            "expires_in": self.expires_in.load(Ordering::SeqCst),
            "issued_at": rfc3339(now),
        }))
        .into_response()
    }

    fn deny(&self, msg: &str) -> Response {
        self.denied.fetch_add(1, Ordering::SeqCst);
        (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Basic realm=\"testkit-token\"")],
            Json(json!({"errors": [{"code": "UNAUTHORIZED", "message": msg}]})),
        )
            .into_response()
    }
}

fn basic_creds(headers: &HeaderMap) -> Option<Option<(String, String)>> {
    let value = headers.get(header::AUTHORIZATION)?;
    // Some(None) = an Authorization header that is not valid Basic: treated as bad creds.
    let parsed = value
        .to_str()
        .ok()
        .and_then(|v| {
            v.strip_prefix("Basic ")
                .or_else(|| v.strip_prefix("basic "))
        })
        .and_then(|b| STANDARD.decode(b.trim()).ok())
        .and_then(|raw| String::from_utf8(raw).ok())
        .and_then(|s| {
            s.split_once(':')
                .map(|(u, p)| (u.to_string(), p.to_string()))
        });
    Some(parsed)
}

async fn get_token(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    let scopes: Vec<String> = url::form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .filter(|(k, _)| k == "scope")
        .map(|(_, v)| v.into_owned())
        .collect();
    let creds = match basic_creds(&headers) {
        None => None,
        Some(Some(c)) => Some(c),
        Some(None) => Some((String::new(), String::new())),
    };
    inner.respond(creds, scopes)
}

async fn post_token(State(inner): State<Arc<Inner>>, body: Bytes) -> Response {
    let mut user = None;
    let mut pass = None;
    let mut scopes = Vec::new();
    for (k, v) in url::form_urlencoded::parse(&body) {
        match k.as_ref() {
            "username" => user = Some(v.into_owned()),
            "password" => pass = Some(v.into_owned()),
            "scope" => scopes.push(v.into_owned()),
            _ => {}
        }
    }
    let creds = match (user, pass) {
        (None, None) => None,
        (u, p) => Some((u.unwrap_or_default(), p.unwrap_or_default())),
    };
    inner.respond(creds, scopes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_values() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn scope_parsing() {
        assert_eq!(
            parse_scope("repository:a/b:pull,push"),
            Some((
                "repository".to_string(),
                "a/b".to_string(),
                vec!["pull".to_string(), "push".to_string()]
            ))
        );
        assert_eq!(parse_scope("garbage"), None);
    }
}
