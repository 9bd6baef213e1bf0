use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::{AlertDescription, CertificateError};

use crate::identity::Role;

/// Everything that can go wrong in this crate. Variants say where the error came from
/// (bad input, an expired or foreign certificate, a wrong name, a file) so that the
/// HTTP layer can map them to statuses and log lines without parsing messages.
///
/// `Clone` because verifier errors travel through rustls as a shared
/// [`rustls::OtherError`] and are turned back into this type after the handshake.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
// Variants are documented; their fields are named for what they hold.
#[allow(missing_docs)]
pub enum Error {
    /// A node/operator/viewer/tracker name does not follow the name grammar.
    #[error("invalid name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },

    /// A `starling:<role>:<name>` identity string is malformed.
    #[error("invalid identity {value:?}: {reason}")]
    InvalidIdentity { value: String, reason: &'static str },

    /// Input that could not be decoded or is not acceptable: PEM, DER, a CSR (including a
    /// bad CSR signature), a pin, a name pattern, a validity period.
    #[error("invalid {what}: {reason}")]
    BadInput { what: &'static str, reason: String },

    /// The certificate has no `starling:` URI SAN.
    #[error(
        "certificate carries no Starling identity (one URI SAN starling:<role>:<name> is required)"
    )]
    NoIdentity,

    /// The certificate has more than one `starling:` URI SAN; which one is meant would be
    /// ambiguous, so none is believed.
    #[error("certificate carries {count} Starling identities; exactly one is allowed")]
    MultipleIdentities { count: usize },

    /// A bootstrap token that does not parse.
    #[error("malformed bootstrap token: {0}")]
    MalformedToken(&'static str),

    /// A bootstrap token whose MAC does not verify: altered, or made by another cluster.
    #[error("bootstrap token was not issued by this cluster, or was altered")]
    TokenNotAuthentic,

    /// A bootstrap token past its expiry.
    #[error("bootstrap token {id} has expired")]
    TokenExpired { id: String, expired_at: SystemTime },

    /// A token TTL (or a token's remaining lifetime) above [`crate::MAX_TOKEN_TTL`].
    #[error("TTL of {requested:?} exceeds the maximum of {max:?}")]
    TtlTooLong { requested: Duration, max: Duration },

    /// The token is bound to a name pattern that does not match the requested name.
    #[error("node name {name:?} is not allowed by this bootstrap token (pattern {pattern:?})")]
    NameNotAllowed { name: String, pattern: String },

    /// A certificate past its `notAfter`.
    #[error("certificate has expired")]
    Expired,

    /// A certificate before its `notBefore` (often a clock skew beyond the 5 min backdate).
    #[error("certificate is not valid yet")]
    NotYetValid,

    /// The certificate does not chain to the cluster CA (another cluster, self-signed,
    /// altered).
    #[error("certificate was not issued by the cluster CA")]
    UnknownCa,

    /// The peer's identity is not the one that was expected (a peer answered for another
    /// node name).
    #[error("expected identity {expected}, the peer presented {found}")]
    WrongIdentity { expected: String, found: String },

    /// The peer's role is not allowed on this endpoint (a viewer where a node is required).
    #[error("role {found} is not allowed here (allowed: {allowed})")]
    WrongRole { found: Role, allowed: String },

    /// A certificate not valid for the host name or IP address that was dialled.
    #[error("certificate is not valid for the name that was dialled: {0}")]
    WrongName(String),

    /// First contact: no certificate sent by the tracker has the pinned public key.
    #[error("no CA certificate presented by the server matches the pin {pin}")]
    PinMismatch { pin: String },

    /// A connection that should be authenticated carries no certificate.
    #[error("the peer presented no certificate")]
    NoPeerCertificate,

    /// The other side of a handshake refused us (usually our certificate): the TLS alert.
    #[error("the peer refused the handshake: {0}")]
    RefusedByPeer(String),

    /// Any other TLS failure.
    #[error("TLS: {0}")]
    Tls(rustls::Error),

    /// Reading or writing a file.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: Arc<io::Error>,
    },

    /// The connection failed under TLS (reset, closed, timed out) during a handshake.
    #[error("connection failed during the TLS handshake: {0}")]
    Connection(Arc<io::Error>),

    /// A file this crate would write exists already (a CA is never overwritten).
    #[error("{} already exists; refusing to overwrite it", path.display())]
    AlreadyExists { path: PathBuf },

    /// rcgen failed to build or sign a certificate or key.
    #[error("certificate generation failed: {0}")]
    Generate(Arc<rcgen::Error>),

    /// The system random number generator failed.
    #[error("the system random number generator failed")]
    Rng,
}

/// Shorthand for this crate's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source: Arc::new(source),
        }
    }

    pub(crate) fn bad(what: &'static str, reason: impl std::fmt::Display) -> Self {
        Error::BadInput {
            what,
            reason: reason.to_string(),
        }
    }

    /// Turns the `io::Error` that tokio-rustls returns from a failed handshake into the
    /// reason it failed: rustls errors are classified (expired, unknown CA, wrong
    /// identity, ...), anything else is [`Error::Connection`].
    pub fn from_handshake(err: io::Error) -> Self {
        match err
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            Some(tls) => Error::from(tls.clone()),
            None => Error::Connection(Arc::new(err)),
        }
    }

    /// A short, fixed label for metrics (`reason="expired"`): bounded cardinality, no
    /// names or addresses from the peer.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::InvalidName { .. } | Error::InvalidIdentity { .. } => "invalid_name",
            Error::BadInput { .. } => "bad_input",
            Error::NoIdentity | Error::MultipleIdentities { .. } => "no_identity",
            Error::MalformedToken(_) | Error::TokenNotAuthentic => "bad_token",
            Error::TokenExpired { .. } => "token_expired",
            Error::TtlTooLong { .. } => "ttl_too_long",
            Error::NameNotAllowed { .. } => "name_not_allowed",
            Error::Expired => "expired",
            Error::NotYetValid => "not_yet_valid",
            Error::UnknownCa => "unknown_ca",
            Error::WrongIdentity { .. } => "wrong_identity",
            Error::WrongRole { .. } => "wrong_role",
            Error::WrongName(_) => "wrong_name",
            Error::PinMismatch { .. } => "pin_mismatch",
            Error::NoPeerCertificate => "no_certificate",
            Error::RefusedByPeer(_) => "refused_by_peer",
            Error::Tls(_) => "tls",
            Error::Connection(_) => "connection",
            Error::Io { .. } | Error::AlreadyExists { .. } => "io",
            Error::Generate(_) | Error::Rng => "internal",
        }
    }

    /// The rustls error a verifier reports for this rejection; the original is kept inside
    /// so [`Error::from_handshake`] can recover it on the side that refused.
    pub(crate) fn into_certificate_error(self) -> rustls::Error {
        let kind = match &self {
            Error::Expired => CertificateError::Expired,
            Error::NotYetValid => CertificateError::NotValidYet,
            Error::UnknownCa => CertificateError::UnknownIssuer,
            _ => CertificateError::Other(rustls::OtherError(Arc::new(self))),
        };
        rustls::Error::InvalidCertificate(kind)
    }
}

impl From<rcgen::Error> for Error {
    fn from(err: rcgen::Error) -> Self {
        Error::Generate(Arc::new(err))
    }
}

impl From<rustls::Error> for Error {
    fn from(err: rustls::Error) -> Self {
        match err {
            rustls::Error::InvalidCertificate(cert) => match cert {
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    Error::Expired
                }
                CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                    Error::NotYetValid
                }
                CertificateError::UnknownIssuer | CertificateError::BadSignature => {
                    Error::UnknownCa
                }
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => {
                    Error::WrongName(format!("{cert:?}"))
                }
                CertificateError::Other(ref other) => match other.0.downcast_ref::<Error>() {
                    Some(ours) => ours.clone(),
                    None => Error::Tls(rustls::Error::InvalidCertificate(cert)),
                },
                other => Error::Tls(rustls::Error::InvalidCertificate(other)),
            },
            rustls::Error::NoCertificatesPresented => Error::NoPeerCertificate,
            rustls::Error::AlertReceived(alert) => Error::RefusedByPeer(alert_name(alert)),
            other => Error::Tls(other),
        }
    }
}

fn alert_name(alert: AlertDescription) -> String {
    format!("{alert:?}")
}
