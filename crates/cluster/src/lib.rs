//! Starling's cluster layer (issue 4): node cache inventory, prewarm jobs,
//! locality-aware scheduling (kube-scheduler extender and a plain ranking API), the
//! dashboard and cluster metrics. Pure state and axum handlers; the tracker owns the
//! sockets, the clock loop and talking to agents. Endpoints: `API.md`.
#![forbid(unsafe_code)]

mod dashboard;
pub mod error;
pub mod extender;
pub mod http;
pub mod inventory;
pub mod metrics;
pub mod prewarm;
pub mod selector;
pub mod share;
mod state;
pub mod text;
pub mod wire;

pub use error::{Error, Result};
pub use extender::{ImageCatalog, Lookup, LookupFuture, ScoreConfig};
pub use http::{metrics_router, router, ClusterConfig, ClusterState};
pub use inventory::{Inventory, InventoryLimits, NodeReport, NodeStatus, ResolvedImage};
pub use metrics::ClusterMetrics;
pub use prewarm::{Assignment, JobStore, PrewarmRequest};
pub use selector::Selector;
pub use share::{
    Begun, ClusterShare, NodeRecord, NodeWrite, NodesPulled, PublishQueue, Published, ShareFuture,
};
