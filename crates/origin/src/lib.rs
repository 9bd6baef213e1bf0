//! Starling's origin side.
//!
//! * [`serve`] / [`bind`]: a read-only OCI distribution registry over an OCI image layout
//!   directory (`oci-layout`, `index.json`, `blobs/sha256/…`). It is the origin of the demo
//!   and an air-gapped origin; its total egress can be capped by one token bucket shared by
//!   all connections ([`ratelimit::TokenBucket`]) so it plays the part of a shared registry
//!   whose egress is the bottleneck. [`OriginStats`] counts what it served.
//! * [`generate_training_image`]: writes a deterministic, CUDA-training-shaped image
//!   (valid `tar+gzip` layers full of incompressible bytes) into an OCI layout.
#![forbid(unsafe_code)]

use std::path::PathBuf;

pub mod layout;
mod server;
pub mod synth;

pub use ratelimit::TokenBucket;
pub use server::{
    bind, router, serve, BoundOrigin, OriginConfig, OriginStats, RunningOrigin, StatsSnapshot,
};
pub use synth::{generate_training_image, SynthImage, SynthLayer, SynthSpec};

/// The crate's one error type.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid OCI layout at {path}: {reason}")]
    Layout { path: PathBuf, reason: String },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("server failed: {0}")]
    Serve(std::io::Error),
    #[error("invalid synthetic image spec: {0}")]
    Spec(String),
    #[error(transparent)]
    Oci(#[from] oci::Error),
    #[error("JSON encoding failed: {0}")]
    Json(#[from] serde_json::Error),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }
}
