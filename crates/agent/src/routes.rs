//! Parsing of `/v2/...` request paths. Repository names contain slashes, so the path is
//! split from the right on the action keyword and each part validated strictly; the raw
//! (undecoded) path is used so `%2e%2e` never becomes `..`.

use oci::reference::validate_repository;
use oci::{Digest, Error, ManifestRef};

#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    Base,
    Manifest {
        repo: String,
        reference: ManifestRef,
    },
    Blob {
        repo: String,
        digest: Digest,
    },
    TagsList {
        repo: String,
    },
    Referrers {
        repo: String,
        digest: Digest,
    },
}

impl Route {
    pub fn label(&self) -> &'static str {
        match self {
            Self::Base => "base",
            Self::Manifest { .. } => "manifest",
            Self::Blob { .. } => "blob",
            Self::TagsList { .. } => "tags",
            Self::Referrers { .. } => "referrers",
        }
    }
}

/// `None` when the path is not a registry route at all (404 NOT FOUND).
pub fn parse(path: &str) -> Option<Result<Route, Error>> {
    let rest = path.strip_prefix("/v2")?;
    if rest.is_empty() || rest == "/" {
        return Some(Ok(Route::Base));
    }
    let rest = rest.strip_prefix('/')?;
    if rest.len() > 2048 {
        return Some(Err(Error::NameInvalid("request path too long".into())));
    }
    if let Some(repo) = rest.strip_suffix("/tags/list") {
        return Some(validate_repository(repo).map(|_| Route::TagsList {
            repo: repo.to_owned(),
        }));
    }
    // The action keyword is the last one in the path: a repository may have a
    // component named like one (`team/manifests/blobs/<digest>` is a blob of
    // `team/manifests`), while a tag or a digest never contains a slash.
    let last = ["/manifests/", "/blobs/", "/referrers/"]
        .into_iter()
        .filter_map(|kw| rest.rfind(kw).map(|idx| (idx, kw)))
        .max_by_key(|&(idx, _)| idx);
    let (idx, kw) = last?;
    let repo = &rest[..idx];
    let arg = &rest[idx + kw.len()..];
    Some(validate_repository(repo).and_then(|_| match kw {
        "/manifests/" => ManifestRef::parse(arg).map(|reference| Route::Manifest {
            repo: repo.to_owned(),
            reference,
        }),
        "/blobs/" => Digest::parse(arg).map(|digest| Route::Blob {
            repo: repo.to_owned(),
            digest,
        }),
        _ => Digest::parse(arg).map(|digest| Route::Referrers {
            repo: repo.to_owned(),
            digest,
        }),
    }))
}

/// The first `key=value` of a raw query string, percent-decoded (`?ns=` of containerd's
/// mirror requests).
pub fn query_param(query: Option<&str>, key: &str) -> Option<String> {
    query?.split('&').find_map(|kv| {
        kv.split_once('=')
            .filter(|(k, _)| *k == key)
            .map(|(_, v)| percent_decode(v))
    })
}

/// Decodes `%XX` escapes (containerd sends `ns=127.0.0.1%3A5000`). Invalid escapes are
/// kept literally and then rejected by registry-name validation.
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        // `%` and two hex digits (u8::from_str_radix alone also takes a sign: "%+5").
        if b[i] == b'%'
            && i + 2 < b.len()
            && b[i + 1].is_ascii_hexdigit()
            && b[i + 2].is_ascii_hexdigit()
        {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let d = Digest::of(b"x");
        assert_eq!(parse("/v2/").unwrap().unwrap(), Route::Base);
        assert_eq!(
            parse(&format!("/v2/a/b/c/blobs/{d}")).unwrap().unwrap(),
            Route::Blob {
                repo: "a/b/c".into(),
                digest: d.clone()
            }
        );
        assert_eq!(
            parse("/v2/library/ubuntu/manifests/22.04")
                .unwrap()
                .unwrap(),
            Route::Manifest {
                repo: "library/ubuntu".into(),
                reference: ManifestRef::Tag("22.04".into())
            }
        );
        assert_eq!(
            parse("/v2/a/tags/list").unwrap().unwrap(),
            Route::TagsList { repo: "a".into() }
        );
        assert!(parse("/v2/../etc/blobs/sha256:00").unwrap().is_err());
        assert!(parse("/v2/a/%2e%2e/blobs/sha256:00").unwrap().is_err());
        assert!(parse(&format!("/v2/a/../b/blobs/{d}")).unwrap().is_err());
        assert!(parse("/v2/a/blobs/sha256:../../etc/passwd")
            .unwrap()
            .is_err());
        assert!(parse("/v2/A/manifests/x").unwrap().is_err());
        assert!(parse("/v2/a/manifests/bad:tag").unwrap().is_err());
        assert!(parse("/v3/x").is_none());
        assert!(parse("/v2/a/unknown").is_none());
    }

    /// Found by the `route` fuzz target: `%+5` was decoded as byte 5, since
    /// `u8::from_str_radix` takes a leading `+`.
    #[test]
    fn percent_decoding_takes_exactly_two_hex_digits() {
        for (raw, want) in [
            ("127.0.0.1%3A5000", "127.0.0.1:5000"),
            ("%5b%3A%3a1%5D", "[::1]"),
            ("%+5", "% 5"),
            ("%-5", "%-5"),
            ("%zz%4", "%zz%4"),
            ("a+b", "a b"),
            ("%C3%A9", "é"),
            ("%ff", "\u{fffd}"),
            ("é%41", "éA"),
        ] {
            assert_eq!(percent_decode(raw), want, "{raw}");
        }
        assert_eq!(
            query_param(Some("a=1&ns=r%2Eio&ns=x"), "ns").as_deref(),
            Some("r.io")
        );
        assert_eq!(query_param(Some("nsx=1&ns"), "ns"), None);
    }

    /// Found by the `route` fuzz target: the keywords were tried in a fixed order, so
    /// a blob of a repository with a component named `manifests` was parsed as a
    /// manifest of its parent and refused.
    #[test]
    fn repository_components_named_like_keywords() {
        let d = Digest::of(b"x");
        assert_eq!(
            parse(&format!("/v2/k8s/manifests/blobs/{d}")).and_then(Result::ok),
            Some(Route::Blob {
                repo: "k8s/manifests".into(),
                digest: d.clone()
            })
        );
        assert_eq!(
            parse(&format!("/v2/a/referrers/b/manifests/{d}")).and_then(Result::ok),
            Some(Route::Manifest {
                repo: "a/referrers/b".into(),
                reference: ManifestRef::Digest(d.clone())
            })
        );
        assert_eq!(
            parse(&format!("/v2/a/blobs/x/referrers/{d}")).and_then(Result::ok),
            Some(Route::Referrers {
                repo: "a/blobs/x".into(),
                digest: d
            })
        );
        assert!(matches!(
            parse("/v2/a/manifests/latest/blobs/"),
            Some(Err(_))
        ));
    }
}
