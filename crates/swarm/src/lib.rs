//! The P2P swarm's core, free of I/O so the tracker, the agent and the simulator share
//! it: piece geometry, bitfields, the announce protocol, the tracker's swarm state (who
//! holds what, who fetches from the registry, which peers to hand out) and the agent's
//! piece scheduler (which piece from which peer next).
#![forbid(unsafe_code)]

pub mod bitfield;
mod peers;
pub mod pieces;
pub mod protocol;
pub mod scheduler;
pub mod state;

pub use bitfield::Bitfield;
pub use pieces::PieceLayout;
pub use protocol::{AnnounceRequest, AnnounceResponse, PeerInfo, Role, Topology};
pub use scheduler::{PeerId, PieceScheduler, Request};
pub use state::{SwarmConfig, TrackerState};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid bitfield: {0}")]
    Bitfield(String),
    #[error("invalid announce: {0}")]
    Announce(String),
}
