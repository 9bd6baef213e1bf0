//! Stateless bootstrap tokens: the operator mints one with a TTL, a joining agent
//! presents it once to get its first node certificate, and the tracker checks it with a
//! secret kept next to the CA — no database, no round trip.
//!
//! Format (all ASCII, safe in a shell and a URL):
//!
//! ```text
//! stb1.<id>.<expiry>.<pattern>.<mac>
//! ```
//!
//! - `id`: 12 lowercase hex digits, random; names the token in logs (and lets a tracker
//!   deny-list one without a database of all tokens);
//! - `expiry`: Unix seconds, decimal;
//! - `pattern`: empty, or the node-name pattern the token is bound to, base64url without
//!   padding (node names contain dots, the field separator);
//! - `mac`: HMAC-SHA256 over a fixed context string and everything before the last dot,
//!   keyed by `bootstrap.key`, base64url without padding.
//!
//! The MAC covers the exact text, so there is no second spelling of a valid token. A token
//! can be used until it expires, like a kubeadm token; a tracker that wants single use
//! remembers the ids it has seen until their expiry.

use std::fmt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ring::hmac;
use ring::rand::SecureRandom;

use crate::error::{Error, Result};
use crate::files;
use crate::identity::{validate_name, Identity};

/// File name of the bootstrap secret in a PKI directory (mode 0600).
pub const BOOTSTRAP_KEY_FILE: &str = "bootstrap.key";
/// Longest TTL a token may have: a leaked token is a way into the cluster until it
/// expires, so it must not live long.
pub const MAX_TOKEN_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

const VERSION: &str = "stb1";
const MAC_CONTEXT: &[u8] = b"starling bootstrap token v1\0";
const ID_LEN: usize = 12;
/// No valid token comes close; bounds the work done on hostile input.
const MAX_TOKEN_LEN: usize = 1024;

/// The secret bootstrap tokens are signed with. A separate file rather than a derivation
/// of the CA key, so that all outstanding tokens can be invalidated (replace the file)
/// without replacing the CA, and so that what signs tokens never touches what signs
/// certificates.
pub struct BootstrapKey {
    secret: [u8; 32],
    key: hmac::Key,
}

impl BootstrapKey {
    /// A new random secret.
    pub fn generate() -> Result<Self> {
        let mut secret = [0u8; 32];
        ring::rand::SystemRandom::new()
            .fill(&mut secret)
            .map_err(|_| Error::Rng)?;
        Ok(BootstrapKey::from_secret(secret))
    }

    /// A secret given as exactly 32 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let secret: [u8; 32] = bytes
            .try_into()
            .map_err(|_| Error::bad("bootstrap key", "must be 32 bytes"))?;
        Ok(BootstrapKey::from_secret(secret))
    }

    fn from_secret(secret: [u8; 32]) -> Self {
        BootstrapKey {
            key: hmac::Key::new(hmac::HMAC_SHA256, &secret),
            secret,
        }
    }

    /// Reads `bootstrap.key` (64 hex digits) from `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join(BOOTSTRAP_KEY_FILE);
        let text = files::read_string(&path)?;
        let bytes = hex::decode(text.trim())
            .map_err(|e| Error::bad("bootstrap key", format!("{}: {e}", path.display())))?;
        BootstrapKey::from_bytes(&bytes)
    }

    /// Writes `bootstrap.key` (0600) into `dir`; refuses to overwrite it.
    pub fn save(&self, dir: &Path) -> Result<()> {
        files::ensure_dir(dir)?;
        let text = format!("{}\n", hex::encode(self.secret));
        files::write_new(
            &dir.join(BOOTSTRAP_KEY_FILE),
            text.as_bytes(),
            files::SECRET_MODE,
        )
    }

    /// A token valid for `ttl` from now, optionally bound to a node-name pattern.
    pub fn create_token(&self, ttl: Duration, pattern: Option<&NamePattern>) -> Result<String> {
        self.create_token_at(SystemTime::now(), ttl, pattern)
    }

    /// [`BootstrapKey::create_token`] with an explicit clock.
    pub fn create_token_at(
        &self,
        now: SystemTime,
        ttl: Duration,
        pattern: Option<&NamePattern>,
    ) -> Result<String> {
        if ttl.is_zero() {
            return Err(Error::bad("token TTL", "must be positive"));
        }
        if ttl > MAX_TOKEN_TTL {
            return Err(Error::TtlTooLong {
                requested: ttl,
                max: MAX_TOKEN_TTL,
            });
        }
        let expiry = (now + ttl)
            .duration_since(UNIX_EPOCH)
            .map_err(|_| Error::bad("clock", "before 1970"))?
            .as_secs();
        let mut id = [0u8; ID_LEN / 2];
        ring::rand::SystemRandom::new()
            .fill(&mut id)
            .map_err(|_| Error::Rng)?;
        let pattern = pattern
            .map(|p| URL_SAFE_NO_PAD.encode(p.as_str()))
            .unwrap_or_default();
        let body = format!("{VERSION}.{}.{expiry}.{pattern}", hex::encode(id));
        let mac = hmac::sign(&self.key, &mac_input(&body));
        Ok(format!("{body}.{}", URL_SAFE_NO_PAD.encode(mac.as_ref())))
    }

    /// Checks a token now: authentic, not expired, not longer-lived than
    /// [`MAX_TOKEN_TTL`]. Never panics, whatever the input.
    pub fn verify(&self, token: &str) -> Result<TokenClaims> {
        self.verify_at(token, SystemTime::now())
    }

    /// [`BootstrapKey::verify`] with an explicit clock.
    pub fn verify_at(&self, token: &str, now: SystemTime) -> Result<TokenClaims> {
        let parsed = ParsedToken::parse(token)?;
        // ring compares in constant time.
        hmac::verify(&self.key, &mac_input(parsed.body), &parsed.mac)
            .map_err(|_| Error::TokenNotAuthentic)?;
        let expires_at = UNIX_EPOCH + Duration::from_secs(parsed.expiry);
        if now > expires_at {
            return Err(Error::TokenExpired {
                id: parsed.id.to_owned(),
                expired_at: expires_at,
            });
        }
        let remaining = expires_at.duration_since(now).unwrap_or_default();
        if remaining > MAX_TOKEN_TTL {
            return Err(Error::TtlTooLong {
                requested: remaining,
                max: MAX_TOKEN_TTL,
            });
        }
        let name_pattern = match parsed.pattern {
            "" => None,
            encoded => {
                let bytes = URL_SAFE_NO_PAD
                    .decode(encoded)
                    .map_err(|_| Error::MalformedToken("pattern is not base64url"))?;
                let text = String::from_utf8(bytes)
                    .map_err(|_| Error::MalformedToken("pattern is not UTF-8"))?;
                Some(NamePattern::new(&text).map_err(|_| Error::MalformedToken("bad pattern"))?)
            }
        };
        Ok(TokenClaims {
            id: parsed.id.to_owned(),
            expires_at,
            name_pattern,
        })
    }
}

impl fmt::Debug for BootstrapKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BootstrapKey(<redacted>)")
    }
}

fn mac_input(body: &str) -> Vec<u8> {
    let mut input = Vec::with_capacity(MAC_CONTEXT.len() + body.len());
    input.extend_from_slice(MAC_CONTEXT);
    input.extend_from_slice(body.as_bytes());
    input
}

/// The fields of a token, split but not yet authenticated.
struct ParsedToken<'a> {
    body: &'a str,
    id: &'a str,
    expiry: u64,
    pattern: &'a str,
    mac: Vec<u8>,
}

impl<'a> ParsedToken<'a> {
    fn parse(token: &'a str) -> Result<Self> {
        if token.len() > MAX_TOKEN_LEN {
            return Err(Error::MalformedToken("too long"));
        }
        let (body, mac) = token.rsplit_once('.').ok_or(Error::MalformedToken(
            "expected stb1.<id>.<expiry>.<pattern>.<mac>",
        ))?;
        let mut fields = body.split('.');
        let (Some(version), Some(id), Some(expiry), Some(pattern), None) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            return Err(Error::MalformedToken(
                "expected stb1.<id>.<expiry>.<pattern>.<mac>",
            ));
        };
        if version != VERSION {
            return Err(Error::MalformedToken("unknown version (expected stb1)"));
        }
        if id.len() != ID_LEN
            || !id
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(Error::MalformedToken("id is not 12 lowercase hex digits"));
        }
        let canonical_number = !expiry.is_empty()
            && expiry.len() <= 19
            && expiry.bytes().all(|b| b.is_ascii_digit())
            && !(expiry.len() > 1 && expiry.starts_with('0'));
        if !canonical_number {
            return Err(Error::MalformedToken("expiry is not a decimal Unix time"));
        }
        let expiry = expiry
            .parse::<u64>()
            .map_err(|_| Error::MalformedToken("expiry is not a decimal Unix time"))?;
        let mac = URL_SAFE_NO_PAD
            .decode(mac)
            .map_err(|_| Error::MalformedToken("MAC is not base64url"))?;
        if mac.len() != 32 {
            return Err(Error::MalformedToken("MAC is not 32 bytes"));
        }
        Ok(ParsedToken {
            body,
            id,
            expiry,
            pattern,
            mac,
        })
    }
}

/// What a verified token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenClaims {
    /// The token's id (for logs and deny-lists).
    pub id: String,
    /// When it stops being accepted.
    pub expires_at: SystemTime,
    /// The node names it may be used for; `None` means any.
    pub name_pattern: Option<NamePattern>,
}

impl TokenClaims {
    /// The node identity this token lets `node_name` obtain: the name must follow the
    /// name grammar and match the token's pattern, if any.
    pub fn authorize(&self, node_name: &str) -> Result<Identity> {
        validate_name(node_name)?;
        if let Some(pattern) = &self.name_pattern {
            if !pattern.matches(node_name) {
                return Err(Error::NameNotAllowed {
                    name: node_name.to_owned(),
                    pattern: pattern.as_str().to_owned(),
                });
            }
        }
        Identity::node(node_name)
    }
}

/// A node name with at most one `*`, which stands for one or more characters of
/// `[a-z0-9-]` inside a label (it never spans a dot): `gpu-*` matches `gpu-017` but not
/// `gpu-0.rack1`; `*.rack12.example` matches `n7.rack12.example`. Without a `*` the
/// pattern is one exact name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NamePattern(String);

impl NamePattern {
    /// Checks the pattern: with its `*` replaced by a letter it must be a valid name.
    pub fn new(pattern: &str) -> Result<Self> {
        let invalid = |reason| Error::BadInput {
            what: "name pattern",
            reason: format!("{pattern:?}: {reason}"),
        };
        if pattern.matches('*').count() > 1 {
            return Err(invalid("at most one '*' is allowed"));
        }
        validate_name(&pattern.replace('*', "x")).map_err(|_| {
            invalid("must be a node name in which one '*' may stand for part of a label")
        })?;
        Ok(NamePattern(pattern.to_owned()))
    }

    /// The pattern text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `name` is a valid name that the pattern admits.
    pub fn matches(&self, name: &str) -> bool {
        if validate_name(name).is_err() {
            return false;
        }
        match self.0.split_once('*') {
            None => self.0 == name,
            Some((prefix, suffix)) => {
                name.len() > prefix.len() + suffix.len()
                    && name.starts_with(prefix)
                    && name.ends_with(suffix)
                    && name[prefix.len()..name.len() - suffix.len()]
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            }
        }
    }
}

impl fmt::Display for NamePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
#[path = "token_tests.rs"]
mod tests;

/// Compares a presented shared secret (a cluster or metrics bearer token) with the
/// configured one in time that does not depend on where they differ, so a secret cannot
/// be guessed byte by byte from response times. Only the length leaks.
pub fn secrets_equal(given: &[u8], want: &[u8]) -> bool {
    given.len() == want.len()
        && given
            .iter()
            .zip(want)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}
