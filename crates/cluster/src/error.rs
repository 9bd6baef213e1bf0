//! The crate's one error type.

/// Everything the cluster layer can refuse or fail at. The HTTP layer maps each
/// variant to a status code (see `http::status_of`).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A label selector that does not parse.
    #[error("invalid label selector {selector:?}: {message} (at byte {position})")]
    Selector {
        selector: String,
        position: usize,
        message: String,
    },
    /// A request that is malformed or inconsistent.
    #[error("invalid request: {0}")]
    InvalidRequest(String),

    /// A label key or value outside the Kubernetes grammar.
    #[error("{0}")]
    InvalidLabel(String),
    /// A node the inventory has never heard of.
    #[error("unknown node {0:?}: not in the tracker's inventory")]
    UnknownNode(String),
    /// Several nodes the inventory has never heard of.
    #[error("unknown nodes: {}", .0.join(", "))]
    UnknownNodes(Vec<String>),
    /// A prewarm job id that does not exist.
    #[error("unknown prewarm job {0}")]
    UnknownJob(u64),
    /// An image reference the catalog cannot resolve (never pulled, not in the registry).
    #[error("unknown image {0}: no node has reported it and the catalog cannot resolve it")]
    UnknownImage(String),
    /// An image reference that does not parse.
    #[error("invalid image reference {reference:?}: {message}")]
    BadReference { reference: String, message: String },
    /// A mutable tag refused for prewarm (pass `force` to warm it anyway).
    #[error("refusing mutable tag {reference}: {reason}; pin a digest or set \"force\": true")]
    MutableTag { reference: String, reason: String },
    /// An agent report older than what the tracker already has.
    #[error("stale report from {node}: generation {got} < current {have}")]
    StaleGeneration { node: String, have: u64, got: u64 },
    /// The job is already finished and cannot change.
    #[error("prewarm job {0} is already finished")]
    JobFinished(u64),
    /// An agent's word on its part of a job that was cancelled: it should stop.
    #[error("prewarm job {job} was cancelled for node {node}")]
    NodeCancelled { job: u64, node: String },
    /// An agent's progress on its part of a job whose deadline has passed by the
    /// tracker's clock: it should stop, whatever its own clock says.
    #[error("prewarm job {job}'s deadline passed; node {node} should stop")]
    DeadlinePassed { job: u64, node: String },
    /// An agent report over a size limit (too many blobs, images, ... or bytes).
    #[error("report too large: {0}")]
    ReportTooLarge(String),
    /// The inventory cannot take more (nodes or entries at their maximum).
    #[error("inventory full: {0}")]
    Capacity(String),
    /// An image in a registry the tracker may not contact (not configured, not allowed,
    /// or on an internal address); nothing was sent to it.
    #[error("{reference}: {message}")]
    RegistryDenied { reference: String, message: String },
    /// An authenticated caller acting for someone else: a node certificate for one node
    /// sending the report of another (the identity comes from the TLS layer).
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// The state shared with other tracker replicas (Redis) is out of reach or busy;
    /// the same request may succeed later or at another replica.
    #[error("shared cluster state: {0}")]
    Shared(String),
    /// The embedded job store failed.
    #[error("job store: {0}")]
    Store(String),
}

macro_rules! store_err {
    ($($t:ty),*) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Self {
                Error::Store(e.to_string())
            }
        }
    )*};
}
store_err!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError,
    serde_json::Error
);

pub type Result<T, E = Error> = std::result::Result<T, E>;
