//! Test-support library for Starling integration tests.
//!
//! Runs REAL components on loopback (`127.0.0.1`):
//!
//! * [`Registry`]: the CNCF distribution registry (`docker-registry serve`)
//!   with no auth, htpasswd auth or Docker token auth (backed by an in-process
//!   [`TokenServer`] issuing ES256 JWTs), over plain HTTP or HTTPS with a
//!   certificate from a throwaway [`TestCa`] (optionally requiring client
//!   certificates: [`RegistryTls`]).
//! * [`TestImage`]: builds real images with `umoci` and pushes them with
//!   `skopeo` (single-platform OCI / docker schema2, and multi-platform OCI
//!   indexes).
//! * [`Containerd`]: a private `containerd` daemon (own root/state/socket in a
//!   temp dir) driven through `ctr`.
//! * [`RedisServer`]: `redis-server` on a random port, killable and restartable.
//! * [`DockerDaemon`]: a private Docker Engine (own data root and socket, vfs,
//!   no networking) configured by a `daemon.json`.
//!
//! Everything is synchronous (blocking) and safe to call from inside a tokio
//! test (`#[tokio::test]`): no tokio runtime is entered or dropped on the
//! caller's thread. Child processes are killed and temp dirs removed on
//! `Drop`. Ports are picked by binding `127.0.0.1:0`; starts are retried when
//! the port turns out to be taken.
//!
//! Constructors named `start` panic with a descriptive message (they are meant
//! for tests); every one has a `try_start` twin returning `anyhow::Result`.
#![forbid(unsafe_code)]

mod artifact;
mod containerd;
mod docker;
mod http;
mod image;
mod process;
mod proxy;
mod redis;
mod registry;
mod tls;
mod tmpfs;
mod token;
mod util;
mod wait;

pub mod peer;
pub use artifact::{ArtifactFile, PushedArtifact, TestArtifact, ARTIFACT_TYPE};
pub use containerd::{write_hosts_toml, Containerd, CONTAINERD_NAMESPACE};
pub use docker::DockerDaemon;
pub use http::{http_get, HttpResponse};
pub use image::{
    Blob, ManifestFormat, Platform, PushedImage, PushedIndex, TestImage, DOCKER_LIST,
    DOCKER_MANIFEST, OCI_INDEX, OCI_MANIFEST,
};
pub use proxy::{forward, serve as serve_proxy};
pub use redis::RedisServer;
pub use registry::{Registry, RegistryAuth};
pub use tls::{CertPair, RegistryTls, TestCa};
pub use tmpfs::Tmpfs;
pub use token::{TokenConfig, TokenServer};
pub use util::{
    fill_disk, free_port, random_bytes, run_cmd, run_ok, sha256_digest, sha256_hex, skopeo,
    skopeo_ok, tool_available, wait_http, wait_http_ok,
};
pub use wait::until;
