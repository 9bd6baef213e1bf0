//! OCI artifacts the way ORAS stores model files: an image manifest with
//! `artifactType`, the empty config (`application/vnd.oci.empty.v1+json`) and one layer
//! per file, named by its `org.opencontainers.image.title` annotation. Written as an OCI
//! layout and pushed with `skopeo`, like the test images.
//!
//! Distribution 2.8 accepts this form. It refuses the short-lived OCI 1.1 draft
//! artifact manifest (`application/vnd.oci.artifact.manifest.v1+json`) with
//! `MANIFEST_INVALID`, so that one is not built here.

use anyhow::Result;
use serde_json::json;

use crate::image::{push_layout, OCI_MANIFEST};
use crate::registry::Registry;
use crate::util::sha256_digest;

pub const ARTIFACT_TYPE: &str = "application/vnd.starling.test.model";
pub const EMPTY_CONFIG: &str = "application/vnd.oci.empty.v1+json";
pub const TITLE: &str = "org.opencontainers.image.title";

/// One layer of an artifact; `title: None` builds a layer without the annotation.
pub struct ArtifactFile<'a> {
    pub title: Option<&'a str>,
    pub bytes: &'a [u8],
}

#[derive(Debug, Clone)]
pub struct PushedArtifact {
    pub manifest_digest: String,
    /// `(title, digest, size)` per layer, in manifest order.
    pub layers: Vec<(Option<String>, String, u64)>,
}

pub struct TestArtifact;

impl TestArtifact {
    pub fn push(
        reg: &Registry,
        repo: &str,
        tag: &str,
        files: &[ArtifactFile<'_>],
    ) -> Result<PushedArtifact> {
        let work = tempfile::Builder::new()
            .prefix("testkit-artifact-")
            .tempdir()?;
        let layout = work.path().join("layout");
        let blobs = layout.join("blobs/sha256");
        std::fs::create_dir_all(&blobs)?;
        let put = |bytes: &[u8]| -> Result<String> {
            let d = sha256_digest(bytes);
            std::fs::write(blobs.join(&d["sha256:".len()..]), bytes)?;
            Ok(d)
        };
        let config = b"{}";
        let config_digest = put(config)?;
        let mut layers = Vec::new();
        let mut descriptors = Vec::new();
        for f in files {
            let d = put(f.bytes)?;
            let mut desc = json!({
                "mediaType": "application/octet-stream",
                "digest": d,
                "size": f.bytes.len(),
            });
            if let Some(t) = f.title {
                desc["annotations"] = json!({ TITLE: t });
            }
            descriptors.push(desc);
            layers.push((f.title.map(str::to_owned), d, f.bytes.len() as u64));
        }
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "artifactType": ARTIFACT_TYPE,
            "config": {"mediaType": EMPTY_CONFIG, "digest": config_digest, "size": config.len()},
            "layers": descriptors,
        });
        let manifest = serde_json::to_vec(&manifest)?;
        let manifest_digest = put(&manifest)?;
        std::fs::write(
            layout.join("oci-layout"),
            br#"{"imageLayoutVersion":"1.0.0"}"#,
        )?;
        let index = json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": OCI_MANIFEST,
                "digest": manifest_digest,
                "size": manifest.len(),
                "annotations": {"org.opencontainers.image.ref.name": "artifact"},
            }],
        });
        std::fs::write(layout.join("index.json"), serde_json::to_vec(&index)?)?;
        push_layout(reg, &layout, "artifact", repo, tag, None, false)?;
        Ok(PushedArtifact {
            manifest_digest,
            layers,
        })
    }
}
