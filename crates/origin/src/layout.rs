//! Read-only access to an OCI image layout directory.
//!
//! Only `blobs/sha256/<64 hex>` paths are ever opened, built from a validated
//! [`oci::Digest`], and symlinks are refused, so no request can reach a file outside
//! the layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use oci::{Descriptor, Digest};
use serde::Deserialize;

use crate::Error;

/// The annotation carrying a tag in `index.json`.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Largest manifest the origin will serve (manifests are read into memory).
pub const MAX_MANIFEST_BYTES: u64 = 4 * 1024 * 1024;

#[derive(Clone, Debug)]
pub struct Layout {
    root: PathBuf,
}

#[derive(Deserialize)]
struct IndexJson {
    #[serde(default)]
    manifests: Vec<Descriptor>,
}

impl Layout {
    /// Opens a layout, checking that `oci-layout` and `index.json` are present and valid.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, Error> {
        let root = root.into();
        let marker = root.join("oci-layout");
        let text = std::fs::read(&marker).map_err(Error::io(&marker))?;
        let v: serde_json::Value = serde_json::from_slice(&text).map_err(|e| Error::Layout {
            path: root.clone(),
            reason: format!("oci-layout: {e}"),
        })?;
        if v.get("imageLayoutVersion")
            .and_then(|v| v.as_str())
            .is_none()
        {
            return Err(Error::Layout {
                path: root,
                reason: "oci-layout lacks imageLayoutVersion".into(),
            });
        }
        let layout = Self { root };
        layout.index()?;
        Ok(layout)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The descriptors listed in `index.json` (read on every call: cheap, and a layout
    /// rewritten while served is picked up).
    pub fn index(&self) -> Result<Vec<Descriptor>, Error> {
        let path = self.root.join("index.json");
        let text = std::fs::read(&path).map_err(Error::io(&path))?;
        let idx: IndexJson = serde_json::from_slice(&text).map_err(|e| Error::Layout {
            path: self.root.clone(),
            reason: format!("index.json: {e}"),
        })?;
        Ok(idx.manifests)
    }

    /// Tag → descriptor, from the `org.opencontainers.image.ref.name` annotations.
    /// The first entry wins when a tag is listed twice.
    pub fn tags(&self) -> Result<BTreeMap<String, Descriptor>, Error> {
        let mut out = BTreeMap::new();
        for d in self.index()? {
            if let Some(tag) = d
                .annotations
                .as_ref()
                .and_then(|a| a.get(REF_NAME))
                .cloned()
            {
                out.entry(tag).or_insert(d);
            }
        }
        Ok(out)
    }

    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        self.root.join("blobs").join("sha256").join(digest.hex())
    }

    /// Opens a blob for reading and returns it with its length; `Ok(None)` if absent
    /// (or not a regular file, e.g. a symlink).
    pub async fn open_blob(
        &self,
        digest: &Digest,
    ) -> Result<Option<(tokio::fs::File, u64)>, Error> {
        let path = self.blob_path(digest);
        let meta = match tokio::fs::symlink_metadata(&path).await {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::Io { path, source: e }),
        };
        if !meta.file_type().is_file() {
            return Ok(None);
        }
        let file = match tokio::fs::File::open(&path).await {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::Io { path, source: e }),
        };
        Ok(Some((file, meta.len())))
    }

    /// Reads a (small) blob fully; `Ok(None)` if absent or larger than `limit`.
    pub async fn read_small_blob(
        &self,
        digest: &Digest,
        limit: u64,
    ) -> Result<Option<Vec<u8>>, Error> {
        let Some((file, len)) = self.open_blob(digest).await? else {
            return Ok(None);
        };
        if len > limit {
            return Ok(None);
        }
        use tokio::io::AsyncReadExt;
        let mut buf = Vec::with_capacity(len as usize);
        file.take(limit)
            .read_to_end(&mut buf)
            .await
            .map_err(Error::io(self.blob_path(digest)))?;
        Ok(Some(buf))
    }
}
