//! The invariants every fuzz target checks, in one place.
//!
//! Each check takes the raw bytes a fuzzer (or a corpus file) produced, feeds them to
//! one parser of network input, and panics when an invariant breaks; "no panic" is
//! only the floor. The cargo-fuzz harness (`fuzz/fuzz_targets/<name>.rs`) is one line
//! that calls `fuzzcheck::<name>`, and the stable replay test
//! (`tests/corpus.rs`) runs every file of `fuzz/corpus/<name>/` through the same
//! function, so what CI replays and what the fuzzer explores cannot drift apart.
//!
//! A check returns whether the parser *accepted* the input (as opposed to rejecting it
//! cleanly), so the replay test can tell that a corpus reaches past the first error.
#![forbid(unsafe_code)]

mod cluster_checks;
mod input;
mod oci_checks;
pub mod seeds;
mod swarm_checks;

pub use cluster_checks::{node_report, prewarm_request, selector};
pub use input::Input;
pub use oci_checks::{challenge, content_range, digest, manifest, range, reference, route};
pub use swarm_checks::{announce, bitfield, frame_decode, frame_roundtrip};

/// One fuzz target: its name (the cargo-fuzz binary and the corpus directory) and
/// its check.
#[derive(Clone, Copy)]
pub struct Target {
    pub name: &'static str,
    pub check: fn(&[u8]) -> bool,
    /// What the target covers, for `scripts/fuzz` and SECURITY.md.
    pub about: &'static str,
}

/// Every target. `fuzz/Cargo.toml` has one `[[bin]]` per entry, and the replay test
/// fails when either side has one the other lacks.
pub const TARGETS: &[Target] = &[
    Target {
        name: "route",
        check: route,
        about: "agent::routes::parse of the raw request path, ?ns= extraction and percent-decoding, registry policy",
    },
    Target {
        name: "range",
        check: range,
        about: "oci::range::parse and resolve against a blob size",
    },
    Target {
        name: "content_range",
        check: content_range,
        about: "oci::upstream::parse_content_range (registry 206 answers on resume)",
    },
    Target {
        name: "digest",
        check: digest,
        about: "oci::Digest::parse, its Display and serde forms",
    },
    Target {
        name: "reference",
        check: reference,
        about: "oci::reference: image references, manifest references, repository/tag/registry grammars",
    },
    Target {
        name: "manifest",
        check: manifest,
        about: "oci::Manifest::parse, media types and Accept matching",
    },
    Target {
        name: "challenge",
        check: challenge,
        about: "oci::upstream::auth::Challenge::parse (WWW-Authenticate)",
    },
    Target {
        name: "bitfield",
        check: bitfield,
        about: "swarm::Bitfield::from_bytes, from_base64 and the serde form",
    },
    Target {
        name: "frame_decode",
        check: frame_decode,
        about: "swarm::wire::Frame::decode on a hostile byte stream",
    },
    Target {
        name: "frame_roundtrip",
        check: frame_roundtrip,
        about: "swarm::wire::Frame encode then decode for frames built from the input",
    },
    Target {
        name: "selector",
        check: selector,
        about: "cluster::Selector::parse (label selectors), label key/value grammars",
    },
    Target {
        name: "node_report",
        check: node_report,
        about: "cluster::NodeReport JSON into Inventory::apply, queries, forget",
    },
    Target {
        name: "prewarm_request",
        check: prewarm_request,
        about: "cluster::PrewarmRequest JSON: validate, targets, plan, assignments",
    },
    Target {
        name: "announce",
        check: announce,
        about: "swarm::AnnounceRequest JSON lines into TrackerState::announce and expire",
    },
];

/// The target called `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}
