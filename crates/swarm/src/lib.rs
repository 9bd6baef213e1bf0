//! The P2P swarm's core, free of I/O so the tracker, the agent and the simulator share
//! it: piece geometry and hashes, bitfields, the announce protocol and the tracker's
//! swarm state (who holds what, who fetches from the registry, which peers to hand
//! out), the peer wire protocol's frames, the downloader's piece scheduler (which
//! piece from which peer next), the links it keeps (`links`) and the holder's upload
//! line (which request next).
#![forbid(unsafe_code)]

pub mod bitfield;
pub mod chain;
pub mod links;
mod peers;
pub mod pieces;
pub mod prefetch;
pub mod protocol;
pub mod scheduler;
pub mod state;
pub mod upload;
pub mod wire;

pub use bitfield::Bitfield;
pub use pieces::{PieceHash, PieceLayout};
pub use protocol::{AnnounceRequest, AnnounceResponse, PeerInfo, Role, Topology};
pub use scheduler::{PeerId, PieceScheduler, Request};
pub use state::{SwarmConfig, TrackerState};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid bitfield: {0}")]
    Bitfield(String),
    #[error("invalid announce: {0}")]
    Announce(String),
    #[error("invalid swarm geometry: {0}")]
    Geometry(String),
    #[error("invalid piece hash: {0}")]
    Hash(String),
    #[error("peer protocol violation: {0}")]
    Wire(String),
}
