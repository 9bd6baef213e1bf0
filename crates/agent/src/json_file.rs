//! The small indexes the agent keeps as JSON beside its cache (`files.json`,
//! `registry-swarms.json`, `prewarm-jobs.json`): read whole at start (empty when
//! missing; when unreadable, empty too, with the file kept aside as `*.corrupt` and a
//! warning), written whole, owner-only and atomically when they change, and bounded by
//! forgetting the oldest entries.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One such index: its entries in memory behind a lock, the file they are saved to,
/// and its bound (at most `max` entries; those with the smallest `age` go first).
pub(crate) struct JsonIndex<K, V> {
    path: PathBuf,
    what: &'static str,
    max: usize,
    age: fn(&V) -> u64,
    entries: parking_lot::Mutex<BTreeMap<K, V>>,
}

impl<K, V> JsonIndex<K, V>
where
    K: Ord + Clone + serde::Serialize + serde::de::DeserializeOwned,
    V: Clone + serde::Serialize + serde::de::DeserializeOwned,
{
    /// The index in `cache_dir/file_name`, as saved (empty when there is none); `what`
    /// names it in a failure's log line.
    pub(crate) fn open(
        cache_dir: &Path,
        file_name: &str,
        what: &'static str,
        max: usize,
        age: fn(&V) -> u64,
    ) -> Self {
        let path = cache_dir.join(file_name);
        let entries = load(&path, what);
        JsonIndex {
            path,
            what,
            max,
            age,
            entries: parking_lot::Mutex::new(entries),
        }
    }

    /// Changes the entries under the lock (`f` says whether it changed anything worth
    /// keeping), bounds them, and saves a copy outside the lock when something changed.
    /// Returns whether it saved.
    pub(crate) fn change(&self, f: impl FnOnce(&mut BTreeMap<K, V>) -> bool) -> bool {
        let snapshot = {
            let mut m = self.entries.lock();
            let changed = f(&mut m);
            forget_oldest(&mut m, self.max, self.age);
            changed.then(|| m.clone())
        };
        if let Some(s) = &snapshot {
            save(&self.path, s, self.what);
        }
        snapshot.is_some()
    }

    /// Reads the entries under the lock.
    pub(crate) fn read<R>(&self, f: impl FnOnce(&BTreeMap<K, V>) -> R) -> R {
        f(&self.entries.lock())
    }
}

/// The index at `path`; the default when there is none or it cannot be read. An
/// unreadable one (a disk error, a hand edit gone wrong) is moved to `*.corrupt`
/// with a warning naming `what`: the agent starts without it rather than not at all,
/// and the next save does not overwrite what an operator may want to look at.
pub(crate) fn load<T: serde::de::DeserializeOwned + Default>(path: &Path, what: &str) -> T {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return T::default(),
        Err(e) => return set_aside(path, what, &e.to_string()),
    };
    serde_json::from_slice(&bytes).unwrap_or_else(|e| set_aside(path, what, &e.to_string()))
}

fn set_aside<T: Default>(path: &Path, what: &str, error: &str) -> T {
    let aside = path.with_extension("json.corrupt");
    let kept = match std::fs::rename(path, &aside) {
        Ok(()) => aside.display().to_string(),
        Err(e) => format!("not moved: {e}"),
    };
    tracing::warn!(path = %path.display(), %error, kept, "cannot read {what}; starting without it");
    T::default()
}

/// Writes `value` to `path` through a temporary file renamed over it, so a crash
/// leaves the old index or the new one. A failure is logged with `what`: the index in
/// memory still serves, and the next change writes it again.
pub(crate) fn save<T: serde::Serialize>(path: &Path, value: &T, what: &str) {
    // Owner-only: an index may hold what only this agent should read (a prewarm
    // file's presigned URL).
    let write = || {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = path.with_extension("json.tmp");
        let body = serde_json::to_vec(value).map_err(std::io::Error::other)?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&body)?;
        drop(f);
        std::fs::rename(&tmp, path)
    };
    if let Err(e) = write() {
        tracing::warn!(path = %path.display(), error = %e, "cannot save {what}");
    }
}

/// Removes the entries with the oldest `asked` until at most `max` are left.
pub(crate) fn forget_oldest<K: Ord + Clone, V>(
    m: &mut BTreeMap<K, V>,
    max: usize,
    asked: impl Fn(&V) -> u64,
) {
    while m.len() > max {
        let Some(oldest) = m
            .iter()
            .min_by_key(|(_, v)| asked(v))
            .map(|(k, _)| k.clone())
        else {
            break;
        };
        m.remove(&oldest);
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn an_index_is_saved_for_its_owner_only_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.json");
        let mut m = std::collections::BTreeMap::new();
        m.insert(
            1u64,
            "https://origin.example/w.bin?X-Amz-Signature=secret".to_owned(),
        );
        super::save(&path, &m, "a test index");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(
            mode & 0o077,
            0,
            "mode {mode:o}: nobody but the agent reads it"
        );
        let back: std::collections::BTreeMap<u64, String> = super::load(&path, "a test index");
        assert_eq!(back, m);
    }

    #[test]
    fn an_unreadable_index_is_set_aside_and_the_agent_starts_without_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.json");
        std::fs::write(&path, b"{\"1\": \"cut off").unwrap();
        let back: std::collections::BTreeMap<u64, String> = super::load(&path, "a test index");
        assert!(back.is_empty());
        assert!(!path.exists(), "the next save does not overwrite it");
        assert_eq!(
            std::fs::read(dir.path().join("index.json.corrupt")).unwrap(),
            b"{\"1\": \"cut off",
            "kept aside whole"
        );
        let none: std::collections::BTreeMap<u64, String> = super::load(&path, "a test index");
        assert!(none.is_empty(), "a missing index is an empty one");
    }
}
