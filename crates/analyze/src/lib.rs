//! Image slimming analyzer: streams every layer of a container image once (gzip,
//! zstd or plain; in parallel; bounded memory; nothing extracted), merges them like
//! a snapshotter, and reports what to cut — efficiency and wasted bytes, package
//! caches, toolchains, duplicate NVIDIA libraries, baked-in weights, layer order —
//! and what each update costs to distribute, direct versus peer to peer.
//!
//! Layout: [`source`] (OCI layout, docker archive, registry) → [`engine`] (layer
//! streams) → [`model`] (merged filesystem) → [`rules`] + [`cost`] → [`report`];
//! [`diff`] compares two images; [`ci`] checks thresholds; [`cli`] is the command line.
#![forbid(unsafe_code)]

pub mod ci;
pub mod cli;
pub mod cost;
pub mod diff;
pub mod engine;
pub mod error;
pub mod model;
pub mod report;
pub mod rules;
pub mod source;

pub use error::{Error, Result};
pub use report::{analyze, Analysis, AnalyzeOptions, Report};
