//! Files on plain HTTP origins (object stores, model-store mirrors) read as if they
//! were blobs, so the agent's cache, single flight and swarm carry them unchanged: the
//! agent registers a [`FileOrigin`] under a key that stands where a registry name
//! stands (`file:<hex>`, which no registry name can be), and every blob read for that
//! key — the first GET, Range resumes, the swarm source's registry runs — goes to the
//! file's URL instead, checking that the origin still serves the same version (its
//! validator and size) on every request.
//!
//! Which origins may be contacted is configured (`file_origins`), as registries are:
//! exact `host[:port]` entries (which may be internal addresses, like a configured
//! registry) and `*.domain` patterns or `*` (public addresses only).

use super::*;

/// Registered files kept at once; beyond this the oldest registrations are dropped
/// (a later request for them registers them again).
const MAX_REGISTERED: usize = 4096;

/// Prefix of the keys file origins are registered under.
pub const FILE_KEY_PREFIX: &str = "file:";

/// After [`FILE_KEY_PREFIX`]: the file is keyed by its identity (`identity_key`), not
/// by a digest its caller named.
pub const IDENTITY_KEY_TAG: &str = "id:";

/// One version of a file on an origin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileOrigin {
    /// The whole URL, query included (a presigned URL's signature lives there).
    pub url: url::Url,
    /// The origin's `ETag`, else its `Last-Modified`: what names this version.
    pub validator: Option<String>,
    pub size: u64,
}

impl FileOrigin {
    /// What names the file regardless of how it is reached: scheme, host, port and
    /// path. The query is left out: presigned parameters change on every request.
    pub fn identity_url(&self) -> String {
        let mut u = self.url.clone();
        u.set_query(None);
        u.set_fragment(None);
        let _ = u.set_username("");
        let _ = u.set_password(None);
        u.to_string()
    }

    /// The key of this version of the file in the store and the swarm when no content
    /// digest is known: sha256 over the identity URL, the validator and the size.
    pub fn identity_key(&self) -> Digest {
        Digest::of(
            format!(
                "starling-file-v1\n{}\n{}\n{}",
                self.identity_url(),
                self.validator.as_deref().unwrap_or(""),
                self.size
            )
            .as_bytes(),
        )
    }

    /// The key of the swarm this version of the file is shared in when its caller
    /// named the content digest: that digest with the identity. A digest alone would
    /// put a tenant's file into the swarm of any blob it names (an image layer, say):
    /// elected source, the tenant's node would publish piece hashes of its own bytes,
    /// and the blob's other downloaders would take them until the whole-blob digest
    /// failed, as late as the tenant's origin cares to finish. Under this key only
    /// nodes reading the same URL at the same version share pieces, and the size the
    /// probe saw is bound as in [`Self::identity_key`].
    pub fn swarm_key(&self, content: &Digest) -> Digest {
        Digest::of(
            format!(
                "starling-file-swarm-v1\n{content}\n{}\n{}\n{}",
                self.identity_url(),
                self.validator.as_deref().unwrap_or(""),
                self.size
            )
            .as_bytes(),
        )
    }

    /// The key this version is registered under, for `Upstream::register_file`.
    /// Named by a content digest, it is registered under its swarm key: two URLs
    /// given the same digest on one node keep their own origins.
    pub fn registry_key(&self, content: Option<&Digest>) -> String {
        match content {
            Some(d) => format!("{FILE_KEY_PREFIX}{}", self.swarm_key(d).hex()),
            None => format!(
                "{FILE_KEY_PREFIX}{IDENTITY_KEY_TAG}{}",
                self.identity_key().hex()
            ),
        }
    }
}

/// `host[:port]` as the origin policy compares it.
pub fn origin_name(url: &url::Url) -> Option<String> {
    let host = match url.host()? {
        url::Host::Ipv6(a) => format!("[{a}]"),
        h => h.to_string().to_ascii_lowercase(),
    };
    Some(match url.port() {
        Some(p) => format!("{host}:{p}"),
        None => host,
    })
}

/// Exact entries of `file_origins` (no wildcard): they may live on internal addresses.
pub(super) fn exact_origins(patterns: &[String]) -> impl Iterator<Item = &String> {
    patterns.iter().filter(|p| !p.contains('*'))
}

#[derive(Default)]
pub(super) struct FileRegistry {
    files: HashMap<String, FileOrigin>,
    order: std::collections::VecDeque<String>,
}

impl Upstream {
    /// Refuses a URL whose origin is not allowed by `file_origins`, before anything is
    /// sent.
    pub fn check_file_origin(&self, url: &url::Url) -> Result<(), Error> {
        let name = origin_name(url).unwrap_or_default();
        if !matches!(url.scheme(), "http" | "https") {
            return Err(denied(&name, "only http:// and https:// origins"));
        }
        let allowed = self
            .inner
            .cfg
            .file_origins
            .iter()
            .any(|p| policy::pattern_matches(&p.trim().to_ascii_lowercase(), &name));
        if !allowed {
            return Err(denied(
                &name,
                "this origin is not in file_origins (--allowed-file-origin)",
            ));
        }
        Ok(())
    }

    /// Learns a file's size and validator with a one-byte GET (a presigned URL is
    /// signed for GET only, so no HEAD).
    pub async fn probe_file(&self, url: &url::Url) -> Result<FileOrigin, Error> {
        self.check_file_origin(url)?;
        let name = origin_name(url).unwrap_or_default();
        let mut headers = HeaderMap::new();
        headers.insert(http::header::RANGE, HeaderValue::from_static("bytes=0-0"));
        let resp = self
            .send_following_redirects(
                &name,
                Method::GET,
                url.as_str(),
                &headers,
                None,
                Hops::FileOrigins,
            )
            .await?;
        let resp = self.check_status(&name, resp).await?;
        let size = match resp.status() {
            StatusCode::PARTIAL_CONTENT => resp
                .headers()
                .get(http::header::CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .and_then(blob::parse_content_range)
                .and_then(|(_, total)| total),
            _ => content_length(resp.headers()),
        }
        .ok_or_else(|| transport(&name, "the origin gave no size"))?;
        Ok(FileOrigin {
            url: url.clone(),
            validator: validator(resp.headers()),
            size,
        })
    }

    /// Makes blob reads for `key` go to `origin`.
    pub fn register_file(&self, key: &str, origin: FileOrigin) {
        let mut r = self.inner.files.lock();
        if r.files.insert(key.to_owned(), origin).is_none() {
            r.order.push_back(key.to_owned());
        }
        while r.order.len() > MAX_REGISTERED {
            if let Some(old) = r.order.pop_front() {
                r.files.remove(&old);
            }
        }
    }

    /// The swarm of a file registered under `registry_key` (`None` for a registry's
    /// blob): its identity key, or for a file named by the content digest `blob`, that
    /// digest's swarm key (`FileOrigin::swarm_key`). Both keys hash the size in, so no
    /// other blob has them and the size the probe saw may be told to a tracker before
    /// any byte is fetched.
    pub(super) fn file_swarm(&self, registry_key: &str, blob: &Digest) -> Option<BlobSwarm> {
        let tagged = registry_key.strip_prefix(FILE_KEY_PREFIX)?;
        let f = self.registered_file(registry_key)?;
        let key = if tagged.starts_with(IDENTITY_KEY_TAG) {
            f.identity_key()
        } else {
            f.swarm_key(blob)
        };
        Some(BlobSwarm {
            key,
            size: Some(f.size),
        })
    }

    pub(super) fn registered_file(&self, key: &str) -> Option<FileOrigin> {
        if !key.starts_with(FILE_KEY_PREFIX) {
            return None;
        }
        self.inner.files.lock().files.get(key).cloned()
    }

    /// A request for a registered file (the caller adds the Range).
    pub(super) async fn send_file_request(
        &self,
        key: &str,
        f: &FileOrigin,
        method: Method,
        headers: HeaderMap,
    ) -> Result<reqwest::Response, Error> {
        self.check_file_origin(&f.url)?;
        self.send_following_redirects(
            key,
            method,
            f.url.as_str(),
            &headers,
            None,
            Hops::FileOrigins,
        )
        .await
    }

    /// The origin must still serve the version the file was registered with.
    pub(super) fn check_same_version(
        &self,
        key: &str,
        f: &FileOrigin,
        resp: &reqwest::Response,
        total: Option<u64>,
    ) -> Result<(), Error> {
        let now = validator(resp.headers());
        if now != f.validator || total.is_some_and(|t| t != f.size) {
            return Err(Error::Upstream {
                registry: key.to_owned(),
                status: 412,
                code: None,
                message: format!(
                    "the origin's file {} changed (version {} → {}, size {} → {})",
                    f.identity_url(),
                    f.validator.as_deref().unwrap_or("none"),
                    now.as_deref().unwrap_or("none"),
                    f.size,
                    total.map_or("?".into(), |t| t.to_string())
                ),
                retry_after: None,
            });
        }
        Ok(())
    }
}

/// `ETag`, else `Last-Modified` (weak ETags included: they still change with content
/// for the servers this is for).
fn validator(h: &HeaderMap) -> Option<String> {
    h.get(http::header::ETAG)
        .or_else(|| h.get(http::header::LAST_MODIFIED))
        .and_then(|v| v.to_str().ok())
        .map(|s| s.chars().take(256).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_does_not_change_a_files_identity() {
        let at = |u: &str, etag: &str| FileOrigin {
            url: url::Url::parse(u).unwrap(),
            validator: Some(etag.into()),
            size: 10,
        };
        let a = at(
            "https://s3.example.com/b/model.bin?X-Amz-Signature=aaa",
            "\"e1\"",
        );
        let b = at(
            "https://s3.example.com/b/model.bin?X-Amz-Signature=bbb&X-Amz-Date=1",
            "\"e1\"",
        );
        assert_eq!(a.identity_key(), b.identity_key());
        assert_eq!(a.identity_url(), "https://s3.example.com/b/model.bin");
        assert_ne!(
            a.identity_key(),
            at("https://s3.example.com/b/model.bin", "\"e2\"").identity_key()
        );
        assert_ne!(
            a.identity_key(),
            at("https://s3.example.com/b/other.bin", "\"e1\"").identity_key()
        );
        let mut c = a.clone();
        c.size = 11;
        assert_ne!(a.identity_key(), c.identity_key());
    }

    #[test]
    fn only_allowed_origins_are_contacted() {
        let up = Upstream::new(UpstreamConfig {
            file_origins: vec![
                "models.example.com".into(),
                "*.s3.example.com".into(),
                "127.0.0.1:8080".into(),
            ],
            ..Default::default()
        })
        .unwrap();
        let ok = |u: &str| up.check_file_origin(&url::Url::parse(u).unwrap()).is_ok();
        assert!(ok("https://models.example.com/a"));
        assert!(ok("https://b.s3.example.com/a?sig=1"));
        assert!(ok("http://127.0.0.1:8080/w.bin"));
        assert!(!ok("http://127.0.0.1:8081/w.bin"));
        assert!(!ok("http://169.254.169.254/latest/meta-data"));
        assert!(!ok("https://evil.example.org/a"));
        assert!(!ok("file:///etc/passwd"));
    }

    #[test]
    fn a_files_swarm_is_its_own_whether_keyed_by_identity_or_by_a_named_digest() {
        let up = Upstream::new(UpstreamConfig::default()).unwrap();
        let origin = |url: &str, validator: &str, size| FileOrigin {
            url: url::Url::parse(url).unwrap(),
            validator: Some(validator.into()),
            size,
        };
        let honest = origin(
            "https://models.example.com/w.bin?sig=1",
            "\"e1\"",
            300 << 20,
        );
        let layer = Digest::of(b"an image layer");
        let by_identity = honest.registry_key(None);
        let by_digest = honest.registry_key(Some(&layer));
        up.register_file(&by_identity, honest.clone());
        up.register_file(&by_digest, honest.clone());
        let swarm = |key: &str| up.swarm_of(key, &layer);
        assert_eq!(swarm(&by_identity).key, honest.identity_key());
        assert_eq!(swarm(&by_identity).size, Some(300 << 20));
        // Named by a digest: not that digest's swarm (an image layer's, say).
        assert_ne!(swarm(&by_digest).key, layer);
        assert_eq!(swarm(&by_digest).size, Some(300 << 20));
        // The same file under another presigned query shares it.
        let requery = origin(
            "https://models.example.com/w.bin?sig=2",
            "\"e1\"",
            300 << 20,
        );
        assert_eq!(requery.swarm_key(&layer), swarm(&by_digest).key);
        // Another URL, version or size naming the same digest does not.
        for other in [
            origin("https://bucket.example.com/tenant.bin", "\"e1\"", 300 << 20),
            origin("https://models.example.com/w.bin", "\"e2\"", 300 << 20),
            origin("https://models.example.com/w.bin", "\"e1\"", 300 << 20 | 1),
        ] {
            assert_ne!(other.swarm_key(&layer), swarm(&by_digest).key, "{other:?}");
            assert_ne!(other.registry_key(Some(&layer)), by_digest, "{other:?}");
        }
        // Unregistered: no size is known.
        let unknown = origin("https://models.example.com/x.bin", "\"e1\"", 1);
        assert_eq!(swarm(&unknown.registry_key(None)).size, None);
    }
}
