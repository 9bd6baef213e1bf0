//! Registry authentication: `WWW-Authenticate` challenges, credentials (config and
//! docker `config.json`), and a token cache keyed by registry and scope.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;
use parking_lot::Mutex;
use serde::Deserialize;

use crate::reference::canonical_registry;

#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print secrets, not even in debug logs.
        write!(f, "Credentials({}, ***)", self.username)
    }
}

impl Credentials {
    pub fn basic_header(&self) -> String {
        let raw = format!("{}:{}", self.username, self.password);
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(raw)
        )
    }
}

/// A parsed `WWW-Authenticate` challenge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Challenge {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
    },
}

impl Challenge {
    pub fn parse(header: &str) -> Option<Self> {
        let header = header.trim();
        let (scheme, rest) = header
            .split_once(char::is_whitespace)
            .unwrap_or((header, ""));
        if scheme.eq_ignore_ascii_case("basic") {
            return Some(Self::Basic);
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return None;
        }
        let params = parse_auth_params(rest);
        let realm = params.get("realm")?.clone();
        Some(Self::Bearer {
            realm,
            service: params.get("service").cloned(),
            scope: params.get("scope").cloned(),
        })
    }
}

/// Parses `k="v", k2=v2` with quoted strings that may contain commas.
fn parse_auth_params(s: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace() || *c == ',') {
            chars.next();
        }
        let key: String = chars
            .by_ref()
            .take_while(|c| *c != '=')
            .collect::<String>()
            .trim()
            .to_ascii_lowercase();
        if key.is_empty() {
            break;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => {
                        if let Some(n) = chars.next() {
                            value.push(n)
                        }
                    }
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.peek() {
                if *c == ',' {
                    break;
                }
                value.push(*c);
                chars.next();
            }
            value = value.trim().to_owned();
        }
        out.insert(key, value);
    }
    out
}

/// Reply of a token endpoint. Both `token` and `access_token` occur in the wild.
#[derive(Deserialize)]
pub(crate) struct TokenReply {
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default)]
    pub access_token: Option<String>,
    #[serde(default)]
    pub expires_in: Option<u64>,
}

/// Default lifetime when the token endpoint does not say (distribution's token spec).
pub(crate) const DEFAULT_TOKEN_SECONDS: u64 = 60;

#[derive(Default)]
pub(crate) struct TokenCache {
    tokens: Mutex<HashMap<(String, String), (String, Instant)>>,
}

impl TokenCache {
    pub fn get(&self, registry: &str, scope: &str) -> Option<String> {
        let map = self.tokens.lock();
        map.get(&(registry.to_owned(), scope.to_owned()))
            .filter(|(_, exp)| *exp > Instant::now())
            .map(|(t, _)| t.clone())
    }

    pub fn put(&self, registry: &str, scope: &str, token: String, expires_in: u64) {
        // Refresh a little early so a token never expires between check and use.
        let life = Duration::from_secs(expires_in.max(1)).mul_f64(0.9);
        let mut map = self.tokens.lock();
        if map.len() > 10_000 {
            let now = Instant::now();
            map.retain(|_, (_, exp)| *exp > now);
        }
        map.insert(
            (registry.to_owned(), scope.to_owned()),
            (token, Instant::now() + life),
        );
    }

    pub fn invalidate(&self, registry: &str, scope: &str) {
        self.tokens
            .lock()
            .remove(&(registry.to_owned(), scope.to_owned()));
    }
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: HashMap<String, DockerAuth>,
}

#[derive(Deserialize)]
struct DockerAuth {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// Reads credentials from a docker `config.json` (`auths` section), keyed by canonical
/// registry. Credential helpers are not run: a node agent must not shell out per pull.
pub fn load_docker_config(path: &Path) -> std::io::Result<HashMap<String, Credentials>> {
    let text = std::fs::read_to_string(path)?;
    let cfg: DockerConfig = serde_json::from_str(&text)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let mut out = HashMap::new();
    for (key, a) in cfg.auths {
        let host = key
            .trim_start_matches("https://")
            .trim_start_matches("http://");
        let host = host.split('/').next().unwrap_or(host);
        let creds = if let (Some(u), Some(p)) = (a.username, a.password) {
            Some(Credentials {
                username: u,
                password: p,
            })
        } else if let Some(encoded) = a.auth {
            base64::engine::general_purpose::STANDARD
                .decode(encoded.trim())
                .ok()
                .and_then(|raw| String::from_utf8(raw).ok())
                .and_then(|s| {
                    s.split_once(':').map(|(u, p)| Credentials {
                        username: u.to_owned(),
                        password: p.to_owned(),
                    })
                })
        } else {
            None
        };
        if let Some(c) = creds {
            out.insert(canonical_registry(host), c);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges() {
        let c = Challenge::parse(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#,
        );
        assert_eq!(
            c,
            Some(Challenge::Bearer {
                realm: "https://auth.example/token".into(),
                service: Some("registry.example".into()),
                scope: Some("repository:a/b:pull,push".into())
            })
        );
        assert_eq!(
            Challenge::parse("Basic realm=\"x\""),
            Some(Challenge::Basic)
        );
        assert_eq!(Challenge::parse("Negotiate"), None);
        assert_eq!(Challenge::parse("Bearer service=x"), None);
    }

    #[test]
    fn docker_config() {
        let dir = std::env::temp_dir().join(format!("starling-dc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("config.json");
        let enc = base64::engine::general_purpose::STANDARD.encode("u1:p:1");
        std::fs::write(
            &p,
            format!(r#"{{"auths":{{"https://index.docker.io/v1/":{{"auth":"{enc}"}},"127.0.0.1:5000":{{"username":"a","password":"b"}}}}}}"#),
        )
        .unwrap();
        let m = load_docker_config(&p).unwrap();
        assert_eq!(
            m["docker.io"],
            Credentials {
                username: "u1".into(),
                password: "p:1".into()
            }
        );
        assert_eq!(m["127.0.0.1:5000"].username, "a");
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn token_cache_expiry() {
        let c = TokenCache::default();
        c.put("r", "s", "t".into(), 60);
        assert_eq!(c.get("r", "s").as_deref(), Some("t"));
        assert_eq!(c.get("r", "other"), None);
        c.invalidate("r", "s");
        assert_eq!(c.get("r", "s"), None);
    }
}
