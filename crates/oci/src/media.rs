//! Media types and the few manifest fields a mirror and a pull client need.

use serde::{Deserialize, Serialize};

use crate::{Digest, Error};

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// The largest manifest taken from a registry or another node: a bound on what a
/// hostile one can make a mirror hold in memory.
pub const MAX_MANIFEST_BYTES: usize = 4 << 20;

/// What containerd sends; used when our own client resolves a tag.
pub const DEFAULT_ACCEPT: &str = "application/vnd.docker.distribution.manifest.v2+json, application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json, */*";

pub fn is_index(media_type: &str) -> bool {
    media_type == OCI_INDEX || media_type == DOCKER_MANIFEST_LIST
}

/// Whether an `Accept` header value admits `media_type`. A missing header admits
/// everything (old clients); `*/*` and `application/*` wildcards are honoured.
pub fn accept_admits(accept: Option<&str>, media_type: &str) -> bool {
    let Some(accept) = accept else { return true };
    if accept.trim().is_empty() {
        return true;
    }
    let (mt_type, _) = media_type.split_once('/').unwrap_or((media_type, ""));
    accept.split(',').any(|item| {
        let item = item.split(';').next().unwrap_or("").trim();
        item == media_type
            || item == "*/*"
            || item
                .strip_suffix("/*")
                .is_some_and(|t| t.eq_ignore_ascii_case(mt_type))
    })
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Platform {
    pub architecture: String,
    pub os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: Digest,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<std::collections::BTreeMap<String, String>>,
}

/// An image manifest or an index, parsed loosely: unknown fields are ignored so that
/// vendor extensions never stop a pull.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    #[serde(default)]
    pub schema_version: u32,
    #[serde(default)]
    pub media_type: Option<String>,
    #[serde(default)]
    pub config: Option<Descriptor>,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
    #[serde(default)]
    pub manifests: Vec<Descriptor>,
}

impl Manifest {
    pub fn parse(bytes: &[u8]) -> Result<Self, Error> {
        let m: Self =
            serde_json::from_slice(bytes).map_err(|e| Error::ManifestInvalid(e.to_string()))?;
        if m.schema_version != 2 {
            return Err(Error::Unsupported(format!(
                "manifest schemaVersion {}",
                m.schema_version
            )));
        }
        Ok(m)
    }

    /// The media type from the body, or inferred from its shape.
    pub fn effective_media_type(&self) -> &str {
        match &self.media_type {
            Some(mt) => mt,
            None if !self.manifests.is_empty() => OCI_INDEX,
            None => OCI_MANIFEST,
        }
    }

    pub fn is_index(&self) -> bool {
        is_index(self.effective_media_type())
            || (!self.manifests.is_empty() && self.config.is_none())
    }

    /// Picks the manifest for a platform from an index.
    pub fn select_platform(&self, os: &str, arch: &str) -> Option<&Descriptor> {
        self.manifests.iter().find(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.os == os && p.architecture == arch)
        })
    }

    /// Every blob an image manifest references: config first, then layers.
    pub fn blobs(&self) -> impl Iterator<Item = &Descriptor> {
        self.config.iter().chain(self.layers.iter())
    }
}

/// The host's platform as OCI spells it.
pub fn host_platform() -> (&'static str, &'static str) {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    ("linux", arch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_matching() {
        assert!(accept_admits(None, OCI_INDEX));
        assert!(accept_admits(Some(DEFAULT_ACCEPT), OCI_INDEX));
        assert!(accept_admits(Some("application/*"), OCI_INDEX));
        assert!(!accept_admits(Some(DOCKER_MANIFEST), OCI_MANIFEST));
        assert!(accept_admits(
            Some("text/plain, application/vnd.oci.image.manifest.v1+json;q=0.5"),
            OCI_MANIFEST
        ));
    }

    #[test]
    fn parse_manifest() {
        let d = Digest::of(b"c");
        let body = format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","config":{{"mediaType":"{OCI_CONFIG}","digest":"{d}","size":1}},"layers":[{{"mediaType":"{OCI_LAYER_GZIP}","digest":"{d}","size":1,"x-vendor":1}}]}}"#
        );
        let m = Manifest::parse(body.as_bytes()).unwrap();
        assert_eq!(m.blobs().count(), 2);
        assert!(!m.is_index());
        assert!(Manifest::parse(b"{\"schemaVersion\":1}").is_err());
        assert!(Manifest::parse(b"not json").is_err());
    }
}
