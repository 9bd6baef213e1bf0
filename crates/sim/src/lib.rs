//! Starling's scale simulator and capacity planner (`starling sim`).
//!
//! Answers "how long until my N-node job is running, and what does the registry see?"
//! for each distribution strategy. The swarm is not re-implemented: role election, peer
//! handout and piece hashes come from [`swarm::TrackerState::announce`], and every
//! agent's choice of which piece to fetch from whom comes from
//! [`swarm::PieceScheduler`]. The network is flow-level: bandwidth is shared max-min
//! fairly among concurrent transfers over node, rack, zone and registry links.
//!
//! Modules: [`scenario`] (TOML), [`model`] (topology and links), [`flow`] (max-min
//! solver), [`engine`] (event loop), [`strategy`], [`report`] (table, JSON, SVG),
//! [`cli`].
#![forbid(unsafe_code)]

pub mod cli;
pub mod engine;
pub mod flow;
pub mod model;
pub mod report;
pub mod scenario;
pub mod strategy;

pub use cli::{run, SimArgs};
pub use engine::{simulate, Outcome};
pub use report::{Report, StrategyResult};
pub use scenario::Scenario;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("scenario: {0}")]
    Scenario(String),
    #[error("{0}")]
    Io(String),
    #[error("simulation: {0}")]
    Sim(String),
}
