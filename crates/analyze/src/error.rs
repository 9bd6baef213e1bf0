//! The crate's single error type.

/// Everything that can stop an analysis. Problems *inside* a layer (truncation,
/// decompression bombs, unsafe paths, size lies) are not errors: they are reported
/// as [`crate::engine::Problem`]s so that one bad layer never hides the rest.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O error on {context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("invalid image source {0}")]
    Source(String),
    #[error("invalid manifest or config: {0}")]
    Manifest(String),
    #[error("no manifest for platform {0} in the index")]
    Platform(String),
    #[error("registry error: {0}")]
    Registry(String),
    #[error(transparent)]
    Oci(#[from] oci::Error),
    #[error("invalid thresholds file {path}: {message}")]
    Thresholds { path: String, message: String },
    #[error("invalid argument: {0}")]
    Argument(String),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
