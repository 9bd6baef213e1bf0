//! The crate's error type and the OCI distribution error codes it maps to.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::Digest;

/// Error codes from the distribution spec, plus the HTTP status a registry answers with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    BlobUnknown,
    BlobUploadInvalid,
    DigestInvalid,
    ManifestBlobUnknown,
    ManifestInvalid,
    ManifestUnknown,
    NameInvalid,
    NameUnknown,
    SizeInvalid,
    Unauthorized,
    Denied,
    Unsupported,
    Toomanyrequests,
    /// Not in the spec's table but used by registries for bad ranges and the like.
    RangeInvalid,
    /// Used by Starling for upstream failures (502/503/504).
    Unavailable,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BlobUnknown => "BLOB_UNKNOWN",
            Self::BlobUploadInvalid => "BLOB_UPLOAD_INVALID",
            Self::DigestInvalid => "DIGEST_INVALID",
            Self::ManifestBlobUnknown => "MANIFEST_BLOB_UNKNOWN",
            Self::ManifestInvalid => "MANIFEST_INVALID",
            Self::ManifestUnknown => "MANIFEST_UNKNOWN",
            Self::NameInvalid => "NAME_INVALID",
            Self::NameUnknown => "NAME_UNKNOWN",
            Self::SizeInvalid => "SIZE_INVALID",
            Self::Unauthorized => "UNAUTHORIZED",
            Self::Denied => "DENIED",
            Self::Unsupported => "UNSUPPORTED",
            Self::Toomanyrequests => "TOOMANYREQUESTS",
            Self::RangeInvalid => "RANGE_INVALID",
            Self::Unavailable => "UNAVAILABLE",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        serde_json::from_value(serde_json::Value::String(s.to_owned())).ok()
    }
}

/// One entry of an OCI error body.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorInfo {
    pub code: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<serde_json::Value>,
}

/// `{"errors":[...]}` as registries send and expect it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    pub errors: Vec<ErrorInfo>,
}

impl ErrorBody {
    pub fn single(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            errors: vec![ErrorInfo {
                code: code.as_str().to_owned(),
                message: message.into(),
                detail: None,
            }],
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_else(|_| b"{\"errors\":[]}".to_vec())
    }
}

/// Where an error came from (pingora's `ErrorSource`, with the parties a mirror in a
/// swarm talks to): what to blame in a log line or a metric, and who can fix it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorSource {
    /// The request itself: a bad name, digest, range or route; a refused client.
    Client,
    /// The upstream registry: its answers, its connection, its TLS, its credentials.
    Upstream,
    /// Another agent in the swarm.
    Peer,
    /// The tracker.
    Tracker,
    /// This node's cache or disk.
    Cache,
    /// This process: configuration, a bug, an exhausted resource.
    Internal,
}

impl ErrorSource {
    /// A fixed metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorSource::Client => "client",
            ErrorSource::Upstream => "upstream",
            ErrorSource::Peer => "peer",
            ErrorSource::Tracker => "tracker",
            ErrorSource::Cache => "cache",
            ErrorSource::Internal => "internal",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid digest: {0}")]
    DigestInvalid(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("{0}")]
    NameInvalid(String),
    #[error("{0}")]
    TagInvalid(String),
    #[error("content does not match its digest: expected {expected}, got {actual}")]
    DigestMismatch { expected: Digest, actual: Digest },
    #[error("size mismatch: expected {expected} bytes, got {actual}")]
    SizeMismatch { expected: u64, actual: u64 },
    #[error("invalid manifest: {0}")]
    ManifestInvalid(String),
    #[error("invalid range: {0}")]
    RangeInvalid(String),
    /// A well-formed Range that selects nothing of a `total`-byte blob: 416 with
    /// `Content-Range: bytes */total`.
    #[error("range not satisfiable for {total} bytes: {reason}")]
    RangeNotSatisfiable { total: u64, reason: String },
    /// A path that is no distribution-spec route.
    #[error("no such route {0}")]
    RouteUnknown(String),
    /// The client may not use this endpoint (e.g. another host asking a mirror that
    /// holds registry credentials).
    #[error("{0}")]
    ClientDenied(String),
    /// The local cache could not store or read content.
    #[error("cache: {0}")]
    Cache(String),
    /// Content in the cache failed verification when read back: it is not served, and
    /// fetching it again can succeed.
    #[error("cached content failed verification: {0}")]
    CacheCorrupt(String),
    /// A size in configuration or on a command line (`512MiB`, `2GB`, `4096`).
    #[error("invalid size {0}")]
    SizeInvalid(String),
    #[error("invalid rate {0}")]
    RateInvalid(String),
    /// The upstream answered with an HTTP error status.
    #[error("upstream {registry} answered {status}: {message}")]
    Upstream {
        registry: String,
        status: u16,
        code: Option<ErrorCode>,
        message: String,
        retry_after: Option<Duration>,
    },
    /// The upstream could not be reached, or the connection failed mid-response.
    #[error("upstream {registry} unreachable: {message}")]
    Transport { registry: String, message: String },
    #[error("upstream {registry} timed out: {message}")]
    Timeout { registry: String, message: String },
    #[error("authentication with {registry} failed: {message}")]
    Auth { registry: String, message: String },
    /// The registry (or an address it leads to) is outside what this client may reach;
    /// nothing was sent to it.
    #[error("registry {registry} is not allowed: {message}")]
    Denied { registry: String, message: String },
    /// A reply from the registry was larger than the client takes for its kind.
    #[error("upstream {registry} sent a {what} larger than {limit} bytes")]
    TooLarge {
        registry: String,
        what: &'static str,
        limit: usize,
    },
    /// TLS with the registry failed: a certificate not trusted or not valid for the
    /// host, or the registry refused the handshake (a client certificate missing or
    /// not accepted). The message says which and what setting would help.
    #[error("TLS with upstream {registry} failed: {message}")]
    Tls { registry: String, message: String },
    /// A registry's TLS settings cannot be used (a file missing, not PEM, a client
    /// certificate without its key).
    #[error("TLS settings for registry {registry}: {message}")]
    TlsConfig { registry: String, message: String },
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// Whether trying again (same or another source) can succeed. Mirrors decide on this
    /// whether to fall back to the next source or give the client the error.
    /// The content turned out not to be the blob (its digest or size did not match, or
    /// a cached copy failed verification): bytes of it already sent to a reader cannot
    /// be trusted, so the reader's stream must fail rather than be completed from
    /// another source.
    pub fn discredits_sent_bytes(&self) -> bool {
        matches!(
            self,
            Self::DigestMismatch { .. } | Self::SizeMismatch { .. } | Self::CacheCorrupt(_)
        )
    }

    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Transport { .. } | Self::Timeout { .. } | Self::Io(_) => true,
            Self::Upstream { status, .. } => *status == 429 || *status >= 500,
            Self::DigestMismatch { .. } | Self::SizeMismatch { .. } => true,
            Self::Cache(_) | Self::CacheCorrupt(_) => true,
            _ => false,
        }
    }

    /// The registry could not answer (throttled, failing, unreachable, or its TLS
    /// cannot be trusted), as opposed to answering "no" (404, 401, 403) or sending
    /// wrong bytes: content another node holds, proven by its digest, may stand in.
    pub fn registry_unavailable(&self) -> bool {
        match self {
            Self::Transport { .. } | Self::Timeout { .. } | Self::Tls { .. } => true,
            Self::Upstream { status, .. } => *status == 429 || *status >= 500,
            _ => false,
        }
    }

    /// Where the error came from.
    pub fn error_source(&self) -> ErrorSource {
        match self {
            Self::DigestInvalid(_)
            | Self::Unsupported(_)
            | Self::NameInvalid(_)
            | Self::TagInvalid(_)
            | Self::RangeInvalid(_)
            | Self::RangeNotSatisfiable { .. }
            | Self::RouteUnknown(_)
            | Self::ClientDenied(_) => ErrorSource::Client,
            // Bytes that do not match their digest came from whoever sent them: the
            // upstream here (peers' pieces are checked by the swarm with their own errors).
            Self::DigestMismatch { .. }
            | Self::SizeMismatch { .. }
            | Self::ManifestInvalid(_)
            | Self::Upstream { .. }
            | Self::Transport { .. }
            | Self::Timeout { .. }
            | Self::Auth { .. }
            | Self::TooLarge { .. }
            | Self::Tls { .. } => ErrorSource::Upstream,
            // A registry outside the allow-list was asked for by the request.
            Self::Denied { .. } => ErrorSource::Client,
            Self::Cache(_) | Self::CacheCorrupt(_) => ErrorSource::Cache,
            Self::SizeInvalid(_) | Self::RateInvalid(_) | Self::TlsConfig { .. } | Self::Io(_) => {
                ErrorSource::Internal
            }
        }
    }

    /// The distribution-spec code and HTTP status a mirror answers its client with.
    pub fn oci_status(&self) -> (u16, ErrorCode) {
        match self {
            Self::DigestInvalid(_) => (400, ErrorCode::DigestInvalid),
            Self::Unsupported(_) => (400, ErrorCode::Unsupported),
            Self::NameInvalid(_) => (400, ErrorCode::NameInvalid),
            Self::TagInvalid(_) => (400, ErrorCode::ManifestInvalid),
            Self::ManifestInvalid(_) => (502, ErrorCode::ManifestInvalid),
            Self::RangeInvalid(_) => (400, ErrorCode::RangeInvalid),
            Self::RangeNotSatisfiable { .. } => (416, ErrorCode::RangeInvalid),
            Self::RouteUnknown(_) => (404, ErrorCode::NameUnknown),
            Self::ClientDenied(_) => (403, ErrorCode::Denied),
            // As for the upstream's faults: a gateway error, so clients move to their next
            // host (containerd falls back to the registry).
            Self::Cache(_) | Self::CacheCorrupt(_) => (502, ErrorCode::Unavailable),
            Self::SizeInvalid(_) | Self::RateInvalid(_) => (400, ErrorCode::Unsupported),
            // The upstream sent wrong bytes: a gateway fault, so clients move to their next host.
            Self::DigestMismatch { .. } | Self::SizeMismatch { .. } => {
                (502, ErrorCode::Unavailable)
            }
            Self::Upstream { status, code, .. } => match *status {
                401 => (401, ErrorCode::Unauthorized),
                403 => (403, ErrorCode::Denied),
                404 => (404, code.unwrap_or(ErrorCode::NameUnknown)),
                429 => (429, ErrorCode::Toomanyrequests),
                s @ 400..=499 => (s, code.unwrap_or(ErrorCode::Unsupported)),
                _ => (502, ErrorCode::Unavailable),
            },
            Self::Transport { .. } => (502, ErrorCode::Unavailable),
            Self::Timeout { .. } => (504, ErrorCode::Unavailable),
            Self::Auth { .. } => (401, ErrorCode::Unauthorized),
            Self::Denied { .. } => (403, ErrorCode::Denied),
            Self::TooLarge { .. } => (502, ErrorCode::Unavailable),
            // A gateway fault too: containerd moves on to its next host.
            Self::Tls { .. } => (502, ErrorCode::Unavailable),
            Self::TlsConfig { .. } => (500, ErrorCode::Unavailable),
            Self::Io(_) => (500, ErrorCode::Unavailable),
        }
    }

    /// A 404 from upstream says only "not found"; the caller knows whether a blob or a
    /// manifest was missing and gives it the right OCI code.
    pub fn with_not_found_code(self, code: ErrorCode) -> Self {
        match self {
            Self::Upstream {
                registry,
                status: 404,
                message,
                retry_after,
                ..
            } => Self::Upstream {
                registry,
                status: 404,
                code: Some(code),
                message,
                retry_after,
            },
            other => other,
        }
    }

    /// A TLS failure with the registry: not worth retrying at once (the same
    /// certificate comes back), but the registry is as good as unreachable.
    pub fn is_tls(&self) -> bool {
        matches!(self, Self::Tls { .. })
    }

    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Upstream { status: 404, .. })
    }
}

#[cfg(test)]
mod source_tests {
    use super::*;

    #[test]
    fn errors_say_where_they_came_from_and_whether_to_fall_back() {
        let upstream_503 = Error::Upstream {
            registry: "r.example".into(),
            status: 503,
            code: None,
            message: "busy".into(),
            retry_after: None,
        };
        let cases: Vec<(Error, ErrorSource, bool, u16)> = vec![
            (
                Error::RouteUnknown("/x".into()),
                ErrorSource::Client,
                false,
                404,
            ),
            (
                Error::ClientDenied("no".into()),
                ErrorSource::Client,
                false,
                403,
            ),
            (
                Error::RangeNotSatisfiable {
                    total: 10,
                    reason: "start beyond end".into(),
                },
                ErrorSource::Client,
                false,
                416,
            ),
            (upstream_503, ErrorSource::Upstream, true, 502),
            (
                Error::Transport {
                    registry: "r".into(),
                    message: "reset".into(),
                },
                ErrorSource::Upstream,
                true,
                502,
            ),
            (Error::Cache("disk".into()), ErrorSource::Cache, true, 502),
            (
                Error::CacheCorrupt("bad".into()),
                ErrorSource::Cache,
                true,
                502,
            ),
            (
                Error::Denied {
                    registry: "169.254.169.254".into(),
                    message: "not allowed".into(),
                },
                ErrorSource::Client,
                false,
                403,
            ),
            (
                Error::SizeInvalid("x".into()),
                ErrorSource::Internal,
                false,
                400,
            ),
        ];
        for (e, source, retryable, status) in cases {
            assert_eq!(e.error_source(), source, "{e}");
            assert_eq!(e.is_retryable(), retryable, "{e}");
            assert_eq!(e.oci_status().0, status, "{e}");
        }
    }

    #[test]
    fn only_a_registry_that_could_not_answer_lets_other_holders_stand_in() {
        let upstream = |status| Error::Upstream {
            registry: "r".into(),
            status,
            code: None,
            message: String::new(),
            retry_after: None,
        };
        for status in [429, 500, 502, 503] {
            assert!(upstream(status).registry_unavailable(), "{status}");
        }
        for status in [401, 403, 404, 410] {
            assert!(!upstream(status).registry_unavailable(), "{status}");
        }
        let d = crate::Digest::of(b"x");
        assert!(!Error::DigestMismatch {
            expected: d.clone(),
            actual: d
        }
        .registry_unavailable());
        assert!(!Error::Cache("disk".into()).registry_unavailable());
        assert!(Error::Timeout {
            registry: "r".into(),
            message: "slow".into()
        }
        .registry_unavailable());
    }
}
