//! Which swarm a blob read through this client is shared in. An elected source
//! publishes piece hashes of the bytes its origin sent, and every member takes them
//! until the whole-blob digest is checked at the end; so nodes share a swarm only when
//! their bytes come from the same trusted origin. A registry the operator named (in
//! the configuration, or as an exact `allowed_registries` entry) is trusted with every
//! digest: its blobs share the digest's swarm. A registry admitted only by a wildcard
//! (`*`, `*.domain`: anyone may run one there) and a file origin (a tenant may write to
//! it) get swarms of their own, so their bytes never reach a puller of the same digest
//! elsewhere.

use super::*;

/// A blob's swarm on the tracker, and the blob's size when the key binds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlobSwarm {
    pub key: Digest,
    pub size: Option<u64>,
}

impl Upstream {
    /// The swarm of blob `blob` read from `registry` (a registry name, or a file's
    /// `file:…` key).
    pub fn swarm_of(&self, registry: &str, blob: &Digest) -> BlobSwarm {
        if let Some(file) = self.file_swarm(registry, blob) {
            return file;
        }
        // A file key not registered (any more) is no name the operator gave either.
        BlobSwarm {
            key: self
                .unnamed_registry_swarm(registry, blob)
                .unwrap_or_else(|| blob.clone()),
            size: None,
        }
    }

    /// The swarm of its own that blob `blob` has when read from `registry`, a registry
    /// only a wildcard admits; `None` for a registry the operator named (the digest's
    /// swarm) and for a file.
    pub fn wildcard_swarm_of(&self, registry: &str, blob: &Digest) -> Option<Digest> {
        if registry.starts_with(super::file_origin::FILE_KEY_PREFIX) {
            return None;
        }
        self.unnamed_registry_swarm(registry, blob)
    }

    fn unnamed_registry_swarm(&self, registry: &str, blob: &Digest) -> Option<Digest> {
        let registry = canonical_registry(registry);
        let named = match &self.inner.cfg.policy {
            Some(p) => p.names(&registry),
            None => true,
        };
        (!named).then(|| {
            Digest::of(format!("starling-registry-swarm-v1\n{blob}\n{registry}").as_bytes())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_registries_the_operator_named_share_a_digests_swarm() {
        let up = Upstream::new(UpstreamConfig {
            policy: Some(RegistryPolicy::new(
                ["registry.internal:5000".to_owned(), "docker.io".to_owned()],
                ["ghcr.io".to_owned(), "*.example".to_owned(), "*".to_owned()],
            )),
            ..UpstreamConfig::default()
        })
        .unwrap();
        let layer = Digest::of(b"an image layer");
        for configured in [
            "registry.internal:5000",
            "docker.io",
            "index.docker.io",
            "ghcr.io",
        ] {
            assert_eq!(up.swarm_of(configured, &layer).key, layer, "{configured}");
        }
        // Admitted by a wildcard only ("*.example", "*"): their own swarms.
        let anyone = up.swarm_of("registry.tenant.example", &layer).key;
        let another = up.swarm_of("other.org", &layer).key;
        assert_ne!(anyone, layer);
        assert_ne!(another, layer);
        assert_ne!(anyone, another);
        assert_eq!(up.swarm_of("registry.tenant.example", &layer).size, None);
        assert_eq!(
            up.wildcard_swarm_of("registry.tenant.example", &layer),
            Some(anyone)
        );
        assert_eq!(up.wildcard_swarm_of("ghcr.io", &layer), None);
        // Without a policy every registry is the operator's choice.
        let open = Upstream::new(UpstreamConfig::default()).unwrap();
        assert_eq!(open.swarm_of("registry.tenant.example", &layer).key, layer);
    }
}
