#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("store I/O on {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("store database: {0}")]
    Db(String),
    /// No room for the blob even after eviction; callers stream without caching.
    #[error("not enough disk space for {needed} bytes (free {free})")]
    DiskFull { needed: u64, free: u64 },
    #[error(transparent)]
    Content(#[from] oci::Error),
    /// The writer that was filling a blob went away or failed; readers may retry.
    #[error("download of {digest} failed: {reason}")]
    DownloadFailed {
        digest: String,
        reason: String,
        retryable: bool,
    },
}

impl Error {
    pub fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.display().to_string(),
            source,
        }
    }

    /// Where the error came from: the bytes' sender for content errors and failed
    /// downloads (the writer's source: registry or peers), this node's disk otherwise.
    pub fn error_source(&self) -> oci::ErrorSource {
        match self {
            Self::Content(e) => e.error_source(),
            Self::DownloadFailed { .. } => oci::ErrorSource::Upstream,
            Self::Io { .. } | Self::Db(_) | Self::DiskFull { .. } => oci::ErrorSource::Cache,
        }
    }

    /// Whether another attempt (another reader joining, another source) can succeed:
    /// the download's own verdict, or the content error's.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Content(e) => e.is_retryable(),
            Self::DownloadFailed { retryable, .. } => *retryable,
            Self::Io { .. } | Self::Db(_) => true,
            Self::DiskFull { .. } => false,
        }
    }

    /// The bytes were not the blob: its digest or size did not match.
    pub fn is_content_mismatch(&self) -> bool {
        matches!(
            self,
            Self::Content(oci::Error::DigestMismatch { .. } | oci::Error::SizeMismatch { .. })
        )
    }

    pub fn is_disk_full(&self) -> bool {
        match self {
            Self::DiskFull { .. } => true,
            Self::Io { source, .. } => {
                source.raw_os_error() == Some(28)
                    || source.kind() == std::io::ErrorKind::StorageFull
            }
            _ => false,
        }
    }
}

macro_rules! db_err {
    ($($t:ty),*) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Self { Error::Db(e.to_string()) }
        }
    )*};
}
db_err!(
    redb::Error,
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError,
    serde_json::Error
);
