//! Bounds on what agent reports may make the tracker keep. Reports come from the
//! network; without bounds, forged ones (new node names, fresh digests, long lists)
//! grow the tracker's memory until it dies.

use crate::error::{Error, Result};
use crate::inventory::NodeReport;

/// Limits of the inventory. Defaults are sized for real nodes (a node with 100,000
/// blobs fits) and clusters of up to 20,000 nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InventoryLimits {
    /// Nodes kept; a report from a new node beyond this is refused (503) once no
    /// node is old enough to expire.
    pub max_nodes: usize,
    /// A node silent for this long is forgotten (its inventory, digests and metrics).
    pub node_expiry_s: u64,
    /// Blobs (digests held) in one report.
    pub max_report_blobs: usize,
    /// Images in one report.
    pub max_report_images: usize,
    /// Blob references summed over a report's images.
    pub max_report_image_blobs: usize,
    /// References (tags) of one image.
    pub max_image_references: usize,
    /// Pins, and downloads in flight, in one report.
    pub max_report_list: usize,
    /// Labels of one node.
    pub max_labels: usize,
    /// Bytes of any one string in a report (label, reference, URL).
    pub max_string_bytes: usize,
    /// List entries (blobs, image blob references, images, pins, downloads) summed
    /// over every node kept: the bound on the inventory's memory (about 150 bytes
    /// each). A report that would go beyond it is refused (503).
    pub max_total_entries: usize,
    /// Image references and digests remembered for resolving and for moving tags.
    pub max_catalog_keys: usize,
}

impl Default for InventoryLimits {
    fn default() -> Self {
        Self {
            max_nodes: 20_000,
            node_expiry_s: 24 * 3600,
            max_report_blobs: 200_000,
            max_report_images: 20_000,
            max_report_image_blobs: 400_000,
            max_image_references: 64,
            max_report_list: 20_000,
            max_labels: 128,
            max_string_bytes: 1024,
            max_total_entries: 50_000_000,
            max_catalog_keys: 200_000,
        }
    }
}

/// Longest node name (a DNS name).
pub const MAX_NODE_NAME: usize = 253;

impl InventoryLimits {
    /// Refuses a report whose shape is over a limit (413) or whose node name is not one.
    pub fn check(&self, r: &NodeReport) -> Result<()> {
        if r.node.is_empty() {
            return Err(Error::InvalidRequest("report without a node name".into()));
        }
        if r.node.len() > MAX_NODE_NAME || r.node.chars().any(char::is_control) {
            return Err(Error::InvalidRequest(format!(
                "node name {:?} is not a name (at most {MAX_NODE_NAME} bytes, no control characters)",
                r.node.chars().take(80).collect::<String>()
            )));
        }
        let over = |what: &str, n: usize, max: usize| -> Result<()> {
            if n > max {
                return Err(Error::ReportTooLarge(format!(
                    "report from {}: {n} {what}, at most {max}",
                    r.node
                )));
            }
            Ok(())
        };
        over("blobs", r.blobs.len(), self.max_report_blobs)?;
        over("images", r.images.len(), self.max_report_images)?;
        over(
            "image blob references",
            r.images.iter().map(|i| i.blobs.len()).sum(),
            self.max_report_image_blobs,
        )?;
        over("pins", r.pins.len(), self.max_report_list)?;
        over(
            "downloads in flight",
            r.downloads_in_flight.len(),
            self.max_report_list,
        )?;
        over("labels", r.labels.len(), self.max_labels)?;
        for i in &r.images {
            over(
                "references of one image",
                i.references.len(),
                self.max_image_references,
            )?;
        }
        let longest = r
            .labels
            .iter()
            .flat_map(|(k, v)| [k.len(), v.len()])
            .chain(
                r.images
                    .iter()
                    .flat_map(|i| i.references.iter().map(String::len)),
            )
            .chain(r.pins.iter().map(|p| p.reference.len()))
            .chain(r.agent_url.iter().map(String::len))
            .max()
            .unwrap_or(0);
        over("bytes in one string", longest, self.max_string_bytes)
    }
}

/// The list entries a report makes the inventory keep (see `max_total_entries`).
pub(crate) fn entries(r: &NodeReport) -> usize {
    r.blobs.len()
        + r.images.len()
        + r.images.iter().map(|i| i.blobs.len()).sum::<usize>()
        + r.pins.len()
        + r.downloads_in_flight.len()
}
