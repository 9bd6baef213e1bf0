//! OCI distribution vocabulary shared by every Starling component: digests,
//! references, media types and manifests, byte ranges, the error codes of the
//! distribution spec, and the upstream registry client.
#![forbid(unsafe_code)]

pub mod digest;
pub mod error;
pub mod layout;
pub mod media;
pub mod range;
pub mod reference;
pub mod size;

pub use digest::{Digest, Verifier};
pub use error::{Error, ErrorBody, ErrorCode, ErrorSource};
pub use media::{Descriptor, Manifest, Platform};
pub use reference::{ImageReference, ManifestRef};
pub mod upstream;
pub use upstream::{Upstream, UpstreamConfig};
pub mod pull;
