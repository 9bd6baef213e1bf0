//! Registry hosts, repository names, tags and full image references.

use std::fmt;

use crate::{Digest, Error};

/// The canonical name of Docker Hub. `index.docker.io` and `registry-1.docker.io` are
/// the same registry and are folded into this one so that the cache is shared.
pub const DOCKER_HUB: &str = "docker.io";

/// Normalises a registry host as clients spell it (`?ns=` value, reference prefix).
/// Idempotent: whitespace and slashes are trimmed from the end together (`"x\n/"`
/// used to become `"x\n"`, which a second pass changed again; found by the `route`
/// fuzz target).
pub fn canonical_registry(host: &str) -> String {
    let h = host
        .trim_start()
        .trim_end_matches(|c: char| c == '/' || c.is_whitespace())
        .to_ascii_lowercase();
    match h.as_str() {
        "docker.io" | "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => {
            DOCKER_HUB.to_owned()
        }
        _ => h,
    }
}

/// Validates a registry host (`name[:port]`), rejecting anything that could change the
/// meaning of a URL built from it.
pub fn validate_registry(host: &str) -> Result<(), Error> {
    let ok = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'))
        && !host.starts_with(['.', '-', ':']);
    if ok {
        Ok(())
    } else {
        Err(Error::NameInvalid(format!(
            "invalid registry host {host:.100}"
        )))
    }
}

/// Validates a repository name against the distribution-spec grammar:
/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(\/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*`.
pub fn validate_repository(name: &str) -> Result<(), Error> {
    let bad = |why: &str| {
        Err(Error::NameInvalid(format!(
            "invalid repository name {name:.100}: {why}"
        )))
    };
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > 255 {
        return bad("longer than 255 characters");
    }
    for component in name.split('/') {
        if !valid_component(component) {
            return bad("each path component must match [a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*");
        }
    }
    Ok(())
}

fn valid_component(c: &str) -> bool {
    let b = c.as_bytes();
    if b.is_empty() {
        return false;
    }
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    let mut i = 0;
    // The component is alternating runs of [a-z0-9]+ and separators.
    loop {
        let start = i;
        while i < b.len() && alnum(b[i]) {
            i += 1;
        }
        if i == start {
            return false;
        }
        if i == b.len() {
            return true;
        }
        let sep_start = i;
        while i < b.len() && !alnum(b[i]) {
            i += 1;
        }
        let sep = &c[sep_start..i];
        let sep_ok = sep == "."
            || sep == "_"
            || sep == "__"
            || (!sep.is_empty() && sep.bytes().all(|x| x == b'-'));
        if !sep_ok || i == b.len() {
            return false;
        }
    }
}

/// Validates a tag: `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
pub fn validate_tag(tag: &str) -> Result<(), Error> {
    let b = tag.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter()
            .all(|x| x.is_ascii_alphanumeric() || matches!(x, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::TagInvalid(format!("invalid tag {tag:.140}")))
    }
}

/// What a manifest request names: a tag (mutable) or a digest (immutable).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ManifestRef {
    Tag(String),
    Digest(Digest),
}

impl ManifestRef {
    pub fn parse(s: &str) -> Result<Self, Error> {
        if s.contains(':') {
            Ok(Self::Digest(Digest::parse(s)?))
        } else {
            validate_tag(s)?;
            Ok(Self::Tag(s.to_owned()))
        }
    }
}

impl fmt::Display for ManifestRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tag(t) => f.write_str(t),
            Self::Digest(d) => d.fmt(f),
        }
    }
}

/// A full image reference such as `docker.io/library/ubuntu:22.04` or
/// `127.0.0.1:5000/team/train@sha256:...`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ImageReference {
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<Digest>,
}

impl ImageReference {
    /// Parses with Docker's conventions: no registry → docker.io; a single-component
    /// Docker Hub name gets `library/`; no tag and no digest → `latest`.
    pub fn parse(s: &str) -> Result<Self, Error> {
        let s = s.trim();
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => (r, Some(Digest::parse(d)?)),
            None => (s, None),
        };
        let (registry, path) = match rest.split_once('/') {
            Some((first, path))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                (canonical_registry(first), path)
            }
            _ => (DOCKER_HUB.to_owned(), rest),
        };
        validate_registry(&registry)?;
        let (repo, tag) = match path.rsplit_once(':') {
            Some((r, t)) if !t.contains('/') => (r, Some(t.to_owned())),
            _ => (path, None),
        };
        let mut repository = repo.to_owned();
        if registry == DOCKER_HUB && !repository.contains('/') {
            repository = format!("library/{repository}");
        }
        validate_repository(&repository)?;
        if let Some(t) = &tag {
            validate_tag(t)?;
        }
        let tag = if tag.is_none() && digest.is_none() {
            Some("latest".to_owned())
        } else {
            tag
        };
        Ok(Self {
            registry,
            repository,
            tag,
            digest,
        })
    }

    /// The digest if pinned, otherwise the tag.
    pub fn manifest_ref(&self) -> ManifestRef {
        match (&self.digest, &self.tag) {
            (Some(d), _) => ManifestRef::Digest(d.clone()),
            (None, Some(t)) => ManifestRef::Tag(t.clone()),
            (None, None) => ManifestRef::Tag("latest".to_owned()),
        }
    }
}

impl fmt::Display for ImageReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repository_grammar() {
        for ok in ["a", "library/ubuntu", "a.b/c_d/e__f/g-h/i---j", "x0/y9"] {
            assert!(validate_repository(ok).is_ok(), "{ok}");
        }
        for bad in [
            "", "A", "a/", "/a", "a//b", "a/../b", "..", "a_", "a___b", "a.-b", "-a", "a/.b",
            "a b", "a%2fb",
        ] {
            assert!(validate_repository(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tags() {
        assert!(validate_tag("v1.0_rc-2").is_ok());
        assert!(validate_tag("_x").is_ok());
        assert!(validate_tag(".x").is_err());
        assert!(validate_tag(&"a".repeat(129)).is_err());
        assert!(validate_tag("a/b").is_err());
    }

    #[test]
    fn canonical_registry_is_idempotent() {
        for raw in [
            "ae\0\n/",
            "Docker.IO/ /",
            " ghcr.io\t",
            "x/\n/",
            "127.0.0.1:5000/",
        ] {
            let once = canonical_registry(raw);
            assert_eq!(canonical_registry(&once), once, "{raw:?}");
        }
        assert_eq!(canonical_registry("Docker.IO/ /"), "docker.io");
        assert_eq!(
            canonical_registry(" Registry.Local:5000/\n"),
            "registry.local:5000"
        );
    }

    #[test]
    fn references() {
        let r = ImageReference::parse("ubuntu").unwrap();
        assert_eq!(r.to_string(), "docker.io/library/ubuntu:latest");
        let r = ImageReference::parse("registry-1.docker.io/team/x:1").unwrap();
        assert_eq!(r.registry, "docker.io");
        assert_eq!(r.repository, "team/x");
        let d = Digest::of(b"x");
        let r = ImageReference::parse(&format!("127.0.0.1:5000/a/b@{d}")).unwrap();
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.tag, None);
        assert_eq!(r.manifest_ref(), ManifestRef::Digest(d));
        let r = ImageReference::parse("localhost:5000/a:t").unwrap();
        assert_eq!(
            (r.registry.as_str(), r.tag.as_deref()),
            ("localhost:5000", Some("t"))
        );
        assert!(ImageReference::parse("Bad/Name").is_err());
        assert_eq!(canonical_registry("Index.Docker.IO"), "docker.io");
    }
}
