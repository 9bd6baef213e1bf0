//! Small metadata next to the blobs: manifests (written whole), tags with their last
//! known digests, and pins that keep content from eviction.

use bytes::Bytes;
use oci::Digest;

use tracing::warn;

use crate::{meta, now_secs, BlobRecord, Error, PinRecord, Store, TagRecord};

impl Store {
    /// Stores a manifest (small; written whole). The caller has verified its digest.
    pub fn put_manifest(
        &self,
        d: &Digest,
        media_type: &str,
        bytes: &[u8],
        children: Vec<Digest>,
    ) -> Result<(), Error> {
        if Digest::of(bytes) != *d {
            return Err(oci::Error::DigestMismatch {
                expected: d.clone(),
                actual: Digest::of(bytes),
            }
            .into());
        }
        if self
            .stat(d)
            .is_some_and(|r| r.media_type.as_deref() == Some(media_type))
        {
            return Ok(());
        }
        let path = self.blob_path(d);
        let tmp = self.inner.partial_dir.join(format!("{}.manifest", d.hex()));
        std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        let rec = BlobRecord {
            size: bytes.len() as u64,
            media_type: Some(media_type.to_owned()),
            children: children.iter().map(|c| c.to_string()).collect(),
            last_access: now_secs(),
            created: now_secs(),
            source: "registry".into(),
            identity_keyed: false,
        };
        meta::put(&self.inner.db, meta::BLOBS, &d.to_string(), &rec)?;
        self.inner.state.lock().index.insert(d.clone(), rec);
        Ok(())
    }

    /// A cached manifest: media type and exact bytes.
    pub fn get_manifest(&self, d: &Digest) -> Result<Option<(String, Bytes)>, Error> {
        let media_type = {
            let mut st = self.inner.state.lock();
            let Some(mt) = st.index.get(d).and_then(|r| r.media_type.clone()) else {
                return Ok(None);
            };
            self.touch(&mut st, d);
            mt
        };
        let path = self.blob_path(d);
        match std::fs::read(&path) {
            Ok(b) if Digest::of(&b) == *d => Ok(Some((media_type, Bytes::from(b)))),
            Ok(_) => {
                warn!(digest = %d, "cached manifest corrupt on disk; dropping it");
                std::fs::remove_file(&path).ok();
                self.forget(d)?;
                Ok(None)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.forget(d)?;
                Ok(None)
            }
            Err(e) => Err(Error::io(&path, e)),
        }
    }

    pub fn put_tag(&self, rec: &TagRecord) -> Result<(), Error> {
        meta::put(&self.inner.db, meta::TAGS, &rec.key(), rec)
    }

    /// Every media type this tag was last seen as.
    pub fn tags(&self, registry: &str, repo: &str, tag: &str) -> Result<Vec<TagRecord>, Error> {
        Ok(meta::scan(
            &self.inner.db,
            meta::TAGS,
            &meta::tag_prefix(registry, repo, tag),
        )?
        .into_iter()
        .map(|(_, v)| v)
        .collect())
    }

    pub fn all_tags(&self) -> Result<Vec<TagRecord>, Error> {
        Ok(meta::scan(&self.inner.db, meta::TAGS, "")?
            .into_iter()
            .map(|(_, v)| v)
            .collect())
    }

    /// Pins a manifest and everything it references until `until` (Unix seconds).
    pub fn pin(&self, d: &Digest, until: Option<u64>, reason: &str) -> Result<(), Error> {
        let rec = PinRecord {
            until,
            reason: reason.to_owned(),
        };
        meta::put(&self.inner.db, meta::PINS, &d.to_string(), &rec)?;
        self.inner.state.lock().pins.insert(d.clone(), rec);
        Ok(())
    }

    pub fn unpin(&self, d: &Digest) -> Result<(), Error> {
        meta::remove(&self.inner.db, meta::PINS, &[d.to_string()])?;
        self.inner.state.lock().pins.remove(d);
        Ok(())
    }

    pub fn pins(&self) -> Vec<(Digest, PinRecord)> {
        self.inner
            .state
            .lock()
            .pins
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}
