//! Plain-text tables for the CLI (`starling nodes`, `starling where IMAGE`,
//! `starling prewarm`): the binary fetches the JSON and prints these.

use oci::size::format_size;
use serde::{Deserialize, Serialize};

use crate::inventory::{Holding, NodeStatus, NodeSummary};
use crate::prewarm::{JobView, NodeJobState};

/// `GET /api/v1/where` reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WhereReply {
    pub image: String,
    pub manifest_digest: oci::Digest,
    pub total_bytes: u64,
    pub nodes: Vec<Holding>,
}

fn status(s: NodeStatus) -> &'static str {
    match s {
        NodeStatus::Known => "known",
        NodeStatus::Unknown => "UNKNOWN",
    }
}

fn render(rows: Vec<Vec<String>>) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{s:<w$}", w = widths[i]))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// `starling nodes`.
pub fn nodes_table(nodes: &[NodeSummary]) -> String {
    let mut rows = vec![[
        "NODE",
        "STATUS",
        "LAST SEEN",
        "CACHED",
        "BUDGET",
        "IMAGES",
        "DOWNLOADS",
    ]
    .map(String::from)
    .to_vec()];
    for n in nodes {
        rows.push(vec![
            n.name.clone(),
            status(n.status).to_owned(),
            format!("{}s ago", n.seconds_since_heartbeat),
            format_size(n.bytes_held),
            format_size(n.cache_budget),
            n.images.to_string(),
            n.downloads_in_flight.to_string(),
        ]);
    }
    render(rows)
}

/// `starling where IMAGE`.
pub fn where_table(w: &WhereReply) -> String {
    let mut out = format!(
        "{} ({}, {})\n",
        w.image,
        w.manifest_digest,
        format_size(w.total_bytes)
    );
    if w.nodes.is_empty() {
        out.push_str("no node holds any of its bytes\n");
        return out;
    }
    let mut rows = vec![["NODE", "STATUS", "HELD", "PERCENT"]
        .map(String::from)
        .to_vec()];
    for h in &w.nodes {
        let pct = if h.total_bytes == 0 {
            100.0
        } else {
            100.0 * h.bytes_held as f64 / h.total_bytes as f64
        };
        rows.push(vec![
            h.node.clone(),
            status(h.status).to_owned(),
            format_size(h.bytes_held),
            format!("{pct:.1}%"),
        ]);
    }
    out.push_str(&render(rows));
    out
}

/// `starling prewarm` progress of one job.
pub fn job_table(v: &JobView) -> String {
    let p = &v.progress;
    let status = serde_json::to_value(p.status)
        .ok()
        .and_then(|s| s.as_str().map(str::to_owned))
        .unwrap_or_default();
    let mut out = format!(
        "job {}: {status}, {} of {}{}\n",
        v.job.id,
        format_size(p.bytes_done),
        format_size(p.bytes_total),
        p.eta_seconds
            .map(|e| format!(", ETA {e:.0} s"))
            .unwrap_or_default()
    );
    for i in &v.job.images {
        out.push_str(&format!("  {} -> {}\n", i.reference, i.manifest_digest));
    }
    let mut rows = vec![["NODE", "STATE", "PROGRESS", "ETA", "DETAIL"]
        .map(String::from)
        .to_vec()];
    for (name, n) in &v.job.nodes {
        let (state, detail) = match &n.state {
            NodeJobState::Pending => ("pending", String::new()),
            NodeJobState::Running => (
                "running",
                if n.seed { "seed".into() } else { String::new() },
            ),
            NodeJobState::Done => ("done", String::new()),
            NodeJobState::Failed { reason } => ("failed", reason.clone()),
            NodeJobState::DoesNotFit { needed, budget } => (
                "does not fit",
                format!(
                    "needs {}, cache budget {}",
                    format_size(*needed),
                    format_size(*budget)
                ),
            ),
            NodeJobState::Cancelled => ("cancelled", String::new()),
            NodeJobState::Unknown => ("unknown", "node stopped reporting".into()),
        };
        rows.push(vec![
            name.clone(),
            state.to_owned(),
            format!(
                "{} / {}",
                format_size(n.bytes_done),
                format_size(n.bytes_total)
            ),
            n.eta_seconds
                .map(|e| format!("{e:.0} s"))
                .unwrap_or_else(|| "-".into()),
            detail,
        ]);
    }
    out.push_str(&render(rows));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn where_table_exact() {
        let d = oci::Digest::from_sha256([7; 32]);
        let w = WhereReply {
            image: "docker.io/library/busybox:1.36".into(),
            manifest_digest: d.clone(),
            total_bytes: 2 * 1024 * 1024,
            nodes: vec![
                Holding {
                    node: "gpu-a".into(),
                    status: NodeStatus::Known,
                    bytes_held: 2 * 1024 * 1024,
                    total_bytes: 2 * 1024 * 1024,
                },
                Holding {
                    node: "gpu-bb".into(),
                    status: NodeStatus::Unknown,
                    bytes_held: 512 * 1024,
                    total_bytes: 2 * 1024 * 1024,
                },
            ],
        };
        assert_eq!(
            where_table(&w),
            format!(
                "docker.io/library/busybox:1.36 ({d}, 2.00 MiB)\n\
                 NODE    STATUS   HELD        PERCENT\n\
                 gpu-a   known    2.00 MiB    100.0%\n\
                 gpu-bb  UNKNOWN  512.00 KiB  25.0%\n"
            )
        );
    }

    #[test]
    fn nodes_table_exact() {
        let n = NodeSummary {
            name: "dgx-017".into(),
            status: NodeStatus::Known,
            generation: 1,
            labels: Default::default(),
            last_heartbeat: 100,
            seconds_since_heartbeat: 3,
            cache_budget: 200 * (1 << 30),
            cache_used: 0,
            cache_free: 0,
            blobs: 4,
            bytes_held: 3 * (1 << 30),
            images: 2,
            pins: 0,
            downloads_in_flight: 1,
            throughput_bytes_per_sec: None,
        };
        assert_eq!(
            nodes_table(&[n]),
            "NODE     STATUS  LAST SEEN  CACHED    BUDGET      IMAGES  DOWNLOADS\n\
             dgx-017  known   3s ago     3.00 GiB  200.00 GiB  2       1\n"
        );
    }
}
