//! Checks for the parsers of what registry clients and registries send: request
//! paths and queries, Range and Content-Range, digests, references, manifests and
//! WWW-Authenticate challenges.

use std::sync::LazyLock;

use agent::routes::{self, Route};
use oci::media::{self, Manifest};
use oci::range::{self, ByteRange, RangeSpec};
use oci::reference::{
    canonical_registry, validate_registry, validate_repository, validate_tag, DOCKER_HUB,
};
use oci::upstream::{parse_content_range, Challenge, RegistryPolicy};
use oci::{Digest, ImageReference, ManifestRef};
use regex::Regex;

use crate::Input;

fn utf8(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

// ---------------------------------------------------------------------------------
// route: the agent's request target, `path?query`
// ---------------------------------------------------------------------------------

/// The agent's route parser and its `?ns=` handling. Invariants:
/// - an accepted path is exactly the rendering of its route (nothing in the path is
///   ignored or reinterpreted), and the repository passes the name grammar;
/// - whenever some split of the path is a valid route, the parser finds that route
///   (a repository with a component named `manifests`, `blobs`, … is still a name);
/// - `ns` is the first `ns=` pair, decoded exactly as RFC 3986 percent-decoding
///   (`%` and two hex digits) plus `+` as space, never longer than its raw form, and
///   percent-encoding any value decodes back to it;
/// - a decoded registry that passes validation has only host characters, and the
///   registry policy allows only configured names or names under an allowed domain.
pub fn route(data: &[u8]) -> bool {
    let Some(target) = utf8(data) else {
        return false;
    };
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    let expected = valid_split(path);
    let accepted = match routes::parse(path) {
        Some(Ok(r)) => {
            assert_eq!(
                render(&r, path),
                path,
                "an accepted path is its route's rendering"
            );
            if let Some(repo) = repo_of(&r) {
                assert!(validate_repository(repo).is_ok());
                assert!(!repo.contains("..") && !repo.contains('%') && !repo.contains("//"));
            }
            assert_eq!(expected.as_ref(), Some(&r), "{path:?}");
            true
        }
        other => {
            assert!(
                expected.is_none(),
                "{path:?} is a valid route {expected:?} but parse gave {other:?}"
            );
            false
        }
    };
    check_query(query);
    accepted
}

fn repo_of(r: &Route) -> Option<&str> {
    match r {
        Route::Base => None,
        Route::Manifest { repo, .. }
        | Route::Blob { repo, .. }
        | Route::TagsList { repo }
        | Route::Referrers { repo, .. } => Some(repo),
    }
}

fn render(r: &Route, path: &str) -> String {
    match r {
        Route::Base if path == "/v2" => "/v2".to_owned(),
        Route::Base => "/v2/".to_owned(),
        Route::Manifest { repo, reference } => format!("/v2/{repo}/manifests/{reference}"),
        Route::Blob { repo, digest } => format!("/v2/{repo}/blobs/{digest}"),
        Route::TagsList { repo } => format!("/v2/{repo}/tags/list"),
        Route::Referrers { repo, digest } => format!("/v2/{repo}/referrers/{digest}"),
    }
}

/// The route a path denotes by the distribution spec, found by trying every split.
fn valid_split(path: &str) -> Option<Route> {
    let rest = path.strip_prefix("/v2")?;
    if rest.is_empty() || rest == "/" {
        return Some(Route::Base);
    }
    let rest = rest.strip_prefix('/')?;
    if rest.len() > 2048 {
        return None;
    }
    let mut found = Vec::new();
    if let Some(repo) = rest.strip_suffix("/tags/list") {
        if validate_repository(repo).is_ok() {
            found.push(Route::TagsList {
                repo: repo.to_owned(),
            });
        }
    }
    for kw in ["/manifests/", "/blobs/", "/referrers/"] {
        // Every occurrence, overlapping ones too (`/manifests/manifests/`).
        let at = (0..rest.len()).filter(|&i| rest.as_bytes()[i..].starts_with(kw.as_bytes()));
        for idx in at {
            let (repo, arg) = (&rest[..idx], &rest[idx + kw.len()..]);
            if validate_repository(repo).is_err() {
                continue;
            }
            let r = match kw {
                "/manifests/" => ManifestRef::parse(arg)
                    .ok()
                    .map(|reference| Route::Manifest {
                        repo: repo.to_owned(),
                        reference,
                    }),
                "/blobs/" => Digest::parse(arg).ok().map(|digest| Route::Blob {
                    repo: repo.to_owned(),
                    digest,
                }),
                _ => Digest::parse(arg).ok().map(|digest| Route::Referrers {
                    repo: repo.to_owned(),
                    digest,
                }),
            };
            found.extend(r);
        }
    }
    assert!(found.len() <= 1, "{path:?} is ambiguous: {found:?}");
    found.pop()
}

/// RFC 3986 percent-decoding (`%` followed by two hex digits), `+` as a space
/// (form encoding), invalid UTF-8 replaced.
fn model_percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && b[i + 1].is_ascii_hexdigit()
            && b[i + 2].is_ascii_hexdigit()
        {
            let hex = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
            out.push(hex(b[i + 1]) << 4 | hex(b[i + 2]));
            i += 3;
            continue;
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

static POLICY: LazyLock<RegistryPolicy> = LazyLock::new(|| {
    RegistryPolicy::new(
        ["docker.io".to_owned(), "registry.local:5000".to_owned()],
        ["*.example.com".to_owned(), "ghcr.io".to_owned()],
    )
});

static SIMPLE_UNDER_EXAMPLE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[a-z0-9-]+(\.[a-z0-9-]+)*\.example\.com$").expect("regex"));

fn check_query(query: Option<&str>) {
    let ns = routes::query_param(query, "ns");
    let raw = query.and_then(|q| {
        q.split('&').find_map(|kv| {
            kv.split_once('=')
                .filter(|(k, _)| *k == "ns")
                .map(|(_, v)| v)
        })
    });
    assert_eq!(ns.is_some(), raw.is_some());
    let (Some(ns), Some(raw)) = (ns, raw) else {
        return;
    };
    assert_eq!(ns, model_percent_decode(raw), "decoding {raw:?}");
    assert!(ns.len() <= raw.len(), "decoding never grows: {raw:?}");
    let encoded: String = raw.bytes().map(|b| format!("%{b:02X}")).collect();
    assert_eq!(routes::percent_decode(&encoded), raw);
    let registry = canonical_registry(&ns);
    assert_eq!(
        canonical_registry(&registry),
        registry,
        "canonical is canonical"
    );
    if validate_registry(&registry).is_err() {
        return;
    }
    assert!(registry
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b)));
    let allowed = POLICY.allows(&registry);
    if allowed {
        let under = registry
            .strip_suffix(".example.com")
            .is_some_and(|head| !head.is_empty() && !registry.contains(':'));
        assert!(
            ["docker.io", "registry.local:5000", "ghcr.io"].contains(&registry.as_str()) || under,
            "the policy let {registry:?} through"
        );
    }
    if SIMPLE_UNDER_EXAMPLE.is_match(&registry) || registry == DOCKER_HUB {
        assert!(allowed, "{registry:?} should be allowed");
    }
}

// ---------------------------------------------------------------------------------
// range and content_range
// ---------------------------------------------------------------------------------

/// The bytes a satisfiable spec asks for, as RFC 9110 defines them.
fn wanted(s: &RangeSpec, total: u64) -> Option<(u64, u64)> {
    match *s {
        RangeSpec::From { start, .. } if start >= total => None,
        RangeSpec::From { start, end } => {
            Some((start, end.map_or(total - 1, |e| e.min(total - 1))))
        }
        RangeSpec::Suffix(0) => None,
        RangeSpec::Suffix(_) if total == 0 => None,
        RangeSpec::Suffix(n) => Some((total.saturating_sub(n), total - 1)),
    }
}

/// `Range` parse and resolve. Input: a blob size, then the header value. Invariants:
/// at most [`range::MAX_RANGE_SPECS`] specs; resolved ranges lie inside the blob, are
/// disjoint, ascending and not adjacent, at most [`range::MAX_RANGES`], never more
/// payload than the blob (and a multipart body smaller than the blob), cover every
/// byte asked for, 416 (empty) exactly when nothing asked for exists; each part's
/// `Content-Range` parses back.
pub fn range(data: &[u8]) -> bool {
    let mut input = Input::new(data);
    let total = input.number();
    let Some(header) = utf8(input.rest()) else {
        return false;
    };
    let Ok(specs) = range::parse(header) else {
        return false;
    };
    assert!(!specs.is_empty() && specs.len() <= range::MAX_RANGE_SPECS);
    for s in &specs {
        if let RangeSpec::From {
            start,
            end: Some(end),
        } = s
        {
            assert!(start <= end);
        }
    }
    let out = range::resolve(&specs, total);
    let asked: Vec<(u64, u64)> = specs.iter().filter_map(|s| wanted(s, total)).collect();
    assert_eq!(
        out.is_empty(),
        asked.is_empty(),
        "416 exactly when nothing exists"
    );
    assert!(out.len() <= range::MAX_RANGES);
    for r in &out {
        assert!(r.start <= r.end && r.end < total, "{r:?} inside {total}");
        assert_eq!(
            parse_content_range(&r.content_range(total)),
            Some((r.start, Some(total)))
        );
    }
    for w in out.windows(2) {
        assert!(
            w[0].end.saturating_add(1) < w[1].start,
            "disjoint, ascending, not adjacent"
        );
    }
    let payload = out
        .iter()
        .map(ByteRange::len)
        .fold(0u64, u64::saturating_add);
    assert!(payload <= total, "payload {payload} > blob {total}");
    if out.len() > 1 {
        let overhead =
            out.len() as u64 * range::MULTIPART_PART_OVERHEAD + range::MULTIPART_CLOSE_OVERHEAD;
        assert!(payload.saturating_add(overhead) < total);
    }
    for (a, b) in asked {
        assert!(
            out.iter().any(|r| r.start <= a && b <= r.end),
            "{a}-{b} covered"
        );
    }
    true
}

/// RFC 9110 §14.4: `bytes first-last/complete` (or `/*`), digits only, `first ≤ last`,
/// `last < complete`. Anything else is invalid and must not be recombined.
fn model_content_range(v: &str) -> Option<(u64, Option<u64>)> {
    let num = |s: &str| -> Option<u64> {
        if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let (a, b) = (num(a)?, num(b)?);
    if b < a {
        return None;
    }
    let total = if total == "*" {
        None
    } else {
        let t = num(total)?;
        if t <= b {
            return None;
        }
        Some(t)
    };
    Some((a, total))
}

/// `Content-Range` of a registry's 206: exactly the RFC 9110 grammar and its validity
/// rules; the first byte lies inside the complete length.
pub fn content_range(data: &[u8]) -> bool {
    let Some(v) = utf8(data) else {
        return false;
    };
    let got = parse_content_range(v);
    assert_eq!(got, model_content_range(v), "{v:?}");
    if let Some((first, Some(total))) = got {
        assert!(first < total);
    }
    got.is_some()
}

// ---------------------------------------------------------------------------------
// digest, reference
// ---------------------------------------------------------------------------------

/// `Digest::parse` accepts exactly `sha256:` and 64 lowercase hex characters, and a
/// parsed digest prints back to its input (Display, Debug, serde); `sha384`/`sha512`
/// are unsupported rather than invalid. The input's own sha256 round-trips too.
pub fn digest(data: &[u8]) -> bool {
    let own = Digest::of(data);
    assert_eq!(Digest::parse(&own.to_string()).ok(), Some(own));
    let Some(s) = utf8(data) else {
        return false;
    };
    let valid = s.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    });
    match Digest::parse(s) {
        Ok(d) => {
            assert!(valid, "{s:?} accepted");
            assert_eq!(d.to_string(), s);
            assert_eq!(format!("{d:?}"), s);
            assert_eq!(d.hex(), &s[7..]);
            let json = serde_json::to_string(&d).unwrap_or_default();
            assert_eq!(json, format!("\"{s}\""));
            assert_eq!(serde_json::from_str::<Digest>(&json).ok(), Some(d.clone()));
            assert_eq!(ManifestRef::parse(s).ok(), Some(ManifestRef::Digest(d)));
            true
        }
        Err(e) => {
            assert!(!valid, "{s:?} refused: {e}");
            if s.starts_with("sha384:") || s.starts_with("sha512:") {
                assert!(matches!(e, oci::Error::Unsupported(_)), "{e}");
            }
            false
        }
    }
}

static REPOSITORY: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*$")
        .expect("regex")
});
static TAG: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}$").expect("regex"));
static REGISTRY: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[a-zA-Z0-9\[\]][a-zA-Z0-9.:\[\]-]{0,252}$").expect("regex"));

/// Image references and the name grammars. Invariants: the hand-written grammar
/// checks agree with the distribution spec's regular expressions; an accepted
/// reference is canonical (its registry, repository and tag pass those checks, it
/// has a tag or a digest) and its printed form parses back to the same reference;
/// an accepted manifest reference prints back to its input.
pub fn reference(data: &[u8]) -> bool {
    let Some(s) = utf8(data) else {
        return false;
    };
    assert_eq!(
        validate_repository(s).is_ok(),
        s.len() <= 255 && REPOSITORY.is_match(s),
        "repository grammar on {s:?}"
    );
    assert_eq!(
        validate_tag(s).is_ok(),
        TAG.is_match(s),
        "tag grammar on {s:?}"
    );
    assert_eq!(
        validate_registry(s).is_ok(),
        REGISTRY.is_match(s),
        "registry grammar on {s:?}"
    );
    if let Ok(m) = ManifestRef::parse(s) {
        assert_eq!(m.to_string(), s);
    }
    let Ok(r) = ImageReference::parse(s) else {
        return false;
    };
    assert!(validate_registry(&r.registry).is_ok());
    assert_eq!(canonical_registry(&r.registry), r.registry);
    assert!(validate_repository(&r.repository).is_ok());
    if let Some(t) = &r.tag {
        assert!(validate_tag(t).is_ok());
    }
    assert!(r.tag.is_some() || r.digest.is_some());
    if r.registry == DOCKER_HUB {
        assert!(r.repository.contains('/'), "Docker Hub names get library/");
    }
    match (&r.digest, r.manifest_ref()) {
        (Some(d), ManifestRef::Digest(m)) => assert_eq!(d, &m),
        (None, ManifestRef::Tag(t)) => assert_eq!(r.tag.as_ref(), Some(&t)),
        (d, m) => panic!("manifest_ref {m:?} for digest {d:?}"),
    }
    let text = r.to_string();
    let again = ImageReference::parse(&text);
    assert_eq!(
        again.as_ref().ok(),
        Some(&r),
        "{s:?} → {text:?} → {again:?}"
    );
    true
}

// ---------------------------------------------------------------------------------
// manifest
// ---------------------------------------------------------------------------------

const MEDIA_TYPES: [&str; 6] = [
    media::OCI_MANIFEST,
    media::OCI_INDEX,
    media::DOCKER_MANIFEST,
    media::DOCKER_MANIFEST_LIST,
    media::OCI_LAYER_GZIP,
    media::OCI_CONFIG,
];

/// Manifest bodies (after the first line) and `Accept` headers (the first line).
/// Invariants: an accepted manifest has schemaVersion 2, its blobs are its config and
/// layers, an index by media type is an index, platform selection returns a matching
/// descriptor, and its JSON form parses back to the same fields. `Accept` admits a
/// type it names, admits everything when absent or blank, and admits nothing that is
/// neither named nor covered by a wildcard.
pub fn manifest(data: &[u8]) -> bool {
    let (accept, body) = match data.iter().position(|&b| b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (&data[..0], data),
    };
    if let Some(accept) = utf8(accept) {
        check_accept(accept);
    }
    let Ok(m) = Manifest::parse(body) else {
        return false;
    };
    assert_eq!(m.schema_version, 2);
    let mt = m.effective_media_type().to_owned();
    if media::is_index(&mt) {
        assert!(m.is_index());
    }
    assert_eq!(
        m.blobs().count(),
        usize::from(m.config.is_some()) + m.layers.len()
    );
    for (os, arch) in [("linux", "amd64"), ("linux", "arm64"), ("windows", "amd64")] {
        if let Some(d) = m.select_platform(os, arch) {
            let p = d.platform.as_ref().expect("selected by its platform");
            assert_eq!((p.os.as_str(), p.architecture.as_str()), (os, arch));
        }
    }
    for d in m.blobs().chain(&m.manifests) {
        assert_eq!(
            Digest::parse(&d.digest.to_string()).ok().as_ref(),
            Some(&d.digest)
        );
    }
    let json = serde_json::to_vec(&m).unwrap_or_default();
    let again = Manifest::parse(&json).unwrap_or_else(|e| panic!("own JSON refused: {e}"));
    assert_eq!(again.schema_version, m.schema_version);
    assert_eq!(again.media_type, m.media_type);
    assert_eq!(again.config, m.config);
    assert_eq!(again.layers, m.layers);
    assert_eq!(again.manifests, m.manifests);
    true
}

fn check_accept(accept: &str) {
    let items: Vec<&str> = accept
        .split(',')
        .map(|i| i.split(';').next().unwrap_or("").trim())
        .collect();
    for mt in MEDIA_TYPES {
        assert!(media::accept_admits(None, mt));
        let admitted = media::accept_admits(Some(accept), mt);
        if accept.trim().is_empty() || items.contains(&mt) {
            assert!(admitted, "{accept:?} admits {mt}");
        }
        if admitted && !accept.trim().is_empty() {
            let ty = mt.split('/').next().unwrap_or(mt);
            assert!(
                items.iter().any(|i| *i == mt
                    || *i == "*/*"
                    || i.strip_suffix("/*")
                        .is_some_and(|t| t.eq_ignore_ascii_case(ty))),
                "{accept:?} admitted {mt} without naming it"
            );
        }
    }
}

// ---------------------------------------------------------------------------------
// challenge
// ---------------------------------------------------------------------------------

fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// `WWW-Authenticate`. Invariants: the scheme decides (Basic, Bearer with a realm, or
/// nothing); a parsed Bearer challenge, written back with quoted parameters, parses to
/// the same challenge (quoted strings, escapes and commas inside them survive).
pub fn challenge(data: &[u8]) -> bool {
    let Some(h) = utf8(data) else {
        return false;
    };
    let scheme = h
        .trim()
        .split(char::is_whitespace)
        .next()
        .unwrap_or("")
        .to_ascii_lowercase();
    match Challenge::parse(h) {
        None => {
            assert_ne!(scheme, "basic");
            false
        }
        Some(Challenge::Basic) => {
            assert_eq!(scheme, "basic");
            true
        }
        Some(c @ Challenge::Bearer { .. }) => {
            assert_eq!(scheme, "bearer");
            let Challenge::Bearer {
                realm,
                service,
                scope,
            } = &c
            else {
                return true;
            };
            let mut text = format!("Bearer realm={}", quote(realm));
            if let Some(s) = service {
                text.push_str(&format!(",service={}", quote(s)));
            }
            if let Some(s) = scope {
                text.push_str(&format!(", scope={}", quote(s)));
            }
            assert_eq!(Challenge::parse(&text).as_ref(), Some(&c), "{text:?}");
            true
        }
    }
}
