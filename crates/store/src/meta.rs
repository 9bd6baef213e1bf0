//! Persistent metadata in redb. Values are JSON so records can gain fields without a
//! migration. Content itself lives in files; the database says what is complete.

use redb::TableDefinition;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::Error;

pub(crate) const BLOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("blobs");
pub(crate) const TAGS: TableDefinition<&str, &[u8]> = TableDefinition::new("tags");
pub(crate) const PINS: TableDefinition<&str, &[u8]> = TableDefinition::new("pins");

/// A complete, verified blob (or manifest) on disk.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct BlobRecord {
    pub size: u64,
    /// Set for manifests: the media type to answer with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    /// For manifests: blobs and child manifests it references (pins follow these).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<String>,
    /// Unix seconds.
    pub last_access: u64,
    pub created: u64,
    /// Where the bytes came from (registry, peer, ...), for the inventory.
    #[serde(default)]
    pub source: String,
    /// A file keyed by its identity (URL, validator, size) rather than its content
    /// digest: its pieces were verified, its whole content could not be. Never served
    /// as a content-addressed blob.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub identity_keyed: bool,
}

/// What a tag pointed to when it was last checked, for one media type.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct TagRecord {
    pub registry: String,
    pub repository: String,
    pub tag: String,
    pub digest: String,
    pub media_type: String,
    pub size: u64,
    /// Unix seconds of the last successful upstream check.
    pub checked: u64,
}

impl TagRecord {
    pub fn key(&self) -> String {
        tag_key(
            &self.registry,
            &self.repository,
            &self.tag,
            &self.media_type,
        )
    }
}

pub(crate) fn tag_prefix(registry: &str, repo: &str, tag: &str) -> String {
    format!("{registry}/{repo}:{tag}\u{1}")
}

pub(crate) fn tag_key(registry: &str, repo: &str, tag: &str, media_type: &str) -> String {
    format!("{}{media_type}", tag_prefix(registry, repo, tag))
}

/// A pinned manifest: it and everything it references survive GC until `until`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct PinRecord {
    /// Unix seconds; `None` pins forever.
    pub until: Option<u64>,
    pub reason: String,
}

pub(crate) fn put<T: Serialize>(
    db: &redb::Database,
    table: TableDefinition<&str, &[u8]>,
    key: &str,
    v: &T,
) -> Result<(), Error> {
    let bytes = serde_json::to_vec(v)?;
    let tx = db.begin_write()?;
    {
        let mut t = tx.open_table(table)?;
        t.insert(key, bytes.as_slice())?;
    }
    tx.commit()?;
    Ok(())
}

pub(crate) fn put_many<T: Serialize>(
    db: &redb::Database,
    table: TableDefinition<&str, &[u8]>,
    items: &[(String, T)],
) -> Result<(), Error> {
    let tx = db.begin_write()?;
    {
        let mut t = tx.open_table(table)?;
        for (k, v) in items {
            t.insert(k.as_str(), serde_json::to_vec(v)?.as_slice())?;
        }
    }
    tx.commit()?;
    Ok(())
}

pub(crate) fn remove(
    db: &redb::Database,
    table: TableDefinition<&str, &[u8]>,
    keys: &[String],
) -> Result<(), Error> {
    let tx = db.begin_write()?;
    {
        let mut t = tx.open_table(table)?;
        for k in keys {
            t.remove(k.as_str())?;
        }
    }
    tx.commit()?;
    Ok(())
}

pub(crate) fn scan<T: DeserializeOwned>(
    db: &redb::Database,
    table: TableDefinition<&str, &[u8]>,
    prefix: &str,
) -> Result<Vec<(String, T)>, Error> {
    let tx = db.begin_read()?;
    let t = match tx.open_table(table) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let mut out = Vec::new();
    for item in t.range(prefix..)? {
        let (k, v) = item?;
        let k = k.value();
        if !k.starts_with(prefix) {
            break;
        }
        match serde_json::from_slice(v.value()) {
            Ok(rec) => out.push((k.to_owned(), rec)),
            Err(e) => tracing::warn!(key = k, error = %e, "skipping unreadable metadata record"),
        }
    }
    Ok(out)
}

pub(crate) fn ensure_tables(db: &redb::Database) -> Result<(), Error> {
    let tx = db.begin_write()?;
    tx.open_table(BLOBS)?;
    tx.open_table(TAGS)?;
    tx.open_table(PINS)?;
    tx.commit()?;
    Ok(())
}
