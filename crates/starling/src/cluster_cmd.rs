//! Operator commands against the tracker's cluster API: `nodes`, `where`, `prewarm`.

use std::path::PathBuf;
use std::time::Duration;

use agent::tracker_endpoints::TrackerEndpoints;
use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args)]
pub struct TrackerOpt {
    /// Tracker URL; several (comma-separated or repeated) are tried in order when one
    /// is unreachable or answers 5xx.
    #[arg(
        long,
        env = "STARLING_TRACKER",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:7070"
    )]
    tracker: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Client certificate for an HTTPS tracker (operator or viewer; `starling certs issue`).
    #[arg(long, env = "STARLING_CERT", requires = "key")]
    cert: Option<PathBuf>,
    /// Its private key.
    #[arg(long, env = "STARLING_KEY", requires = "cert")]
    key: Option<PathBuf>,
    /// The cluster CA certificate, to verify an HTTPS tracker.
    #[arg(long, env = "STARLING_CA")]
    ca: Option<PathBuf>,
}

impl TrackerOpt {
    fn trackers(&self) -> Result<agent::tracker_endpoints::TrackerEndpoints> {
        Ok(agent::tracker_endpoints::TrackerEndpoints::parse(
            &self.tracker.join(","),
        )?)
    }

    /// An HTTP client for the tracker: with `--ca`, trusting only the cluster CA and
    /// presenting `--cert` when given; otherwise reqwest's defaults.
    fn client(&self) -> Result<reqwest::Client> {
        let Some(ca) = &self.ca else {
            if self.cert.is_some() {
                bail!("--cert needs --ca (the cluster CA that signed the tracker certificate)");
            }
            return Ok(reqwest::Client::new());
        };
        let trust = pki::ClusterTrust::from_file(ca)
            .with_context(|| format!("reading the cluster CA {}", ca.display()))?;
        let cert = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => Some(
                pki::CertSource::from_files(c, k)
                    .with_context(|| format!("loading {} and {}", c.display(), k.display()))?,
            ),
            _ => None,
        };
        let tls = pki::tracker_client_config(&trust, cert.as_ref())?;
        Ok(reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .build()?)
    }
}

#[derive(Args)]
pub struct NodesArgs {
    #[command(flatten)]
    t: TrackerOpt,
    /// Show one node in full.
    node: Option<String>,
}

#[derive(Args)]
pub struct WhereArgs {
    #[command(flatten)]
    t: TrackerOpt,
    /// Image reference, oci:// artifact, http(s) URL (its key is asked of the agent) or
    /// a file key sha256:….
    image: String,
    /// The node's agent, which names a URL's key.
    #[arg(long, env = "STARLING_AGENT", default_value = "http://127.0.0.1:5050")]
    agent: String,
}

#[derive(Args)]
pub struct PrewarmArgs {
    #[command(flatten)]
    t: TrackerOpt,
    /// Images, oci:// artifacts or http(s) file URLs to warm (tags are resolved to
    /// digests at submit time; a URL's key and size are asked of `--agent`, and each
    /// target agent fetches it only if its allowed_file_origins allow the origin).
    #[arg(required = true)]
    images: Vec<String>,
    /// The agent that names a URL's key (it reads one byte of the file from the origin).
    #[arg(long, env = "STARLING_AGENT", default_value = "http://127.0.0.1:5050")]
    agent: String,
    /// sha256:… of a URL's content (with a single URL): the file is keyed and verified
    /// by it, as with `starling get --digest`.
    #[arg(long)]
    digest: Option<String>,
    /// Target these nodes (comma-separated).
    #[arg(long, value_delimiter = ',')]
    nodes: Vec<String>,
    /// Kubernetes-style label selector, e.g. "gpu=h100,zone in (a,b)".
    #[arg(long)]
    selector: Option<String>,
    /// Node pool (label starling.io/pool).
    #[arg(long)]
    pool: Option<String>,
    /// Warm only this many of the matching nodes (those already holding most of the
    /// image first).
    #[arg(long, conflicts_with = "percentage")]
    count: Option<u32>,
    /// Warm only this share of the matching nodes, in (0, 100].
    #[arg(long)]
    percentage: Option<f64>,
    /// Nodes downloading at once after the seed.
    #[arg(long)]
    parallelism: Option<u32>,
    /// Per-node rate, e.g. 200MiB (per second).
    #[arg(long)]
    node_limit: Option<String>,
    /// Total rate over all nodes.
    #[arg(long)]
    total_limit: Option<String>,
    /// Unfinished nodes stop fetching and fail after this long, e.g. 30m.
    #[arg(long)]
    deadline: Option<humantime::Duration>,
    /// Keep the content pinned this long, e.g. 24h.
    #[arg(long)]
    pin_ttl: Option<humantime::Duration>,
    /// Jobs with a higher priority are dispatched first.
    #[arg(long, default_value_t = 0)]
    priority: i32,
    /// Warm mutable tags (e.g. latest) anyway.
    #[arg(long)]
    force: bool,
    /// Also pull into each node's containerd and label it pinned there.
    #[arg(long)]
    into_runtime: bool,
    /// Wait for the job and show progress.
    #[arg(long)]
    wait: bool,
    /// Cancel a job instead (by id).
    #[arg(long, conflicts_with = "wait")]
    cancel: Option<u64>,
}

async fn get_json(
    http: &reqwest::Client,
    trackers: &TrackerEndpoints,
    path: &str,
) -> Result<serde_json::Value> {
    let r = trackers
        .send(|base| http.get(format!("{base}{path}")))
        .await
        .with_context(|| format!("GET {}{path}", trackers.current()))?;
    let url = format!("{}{path}", trackers.current());
    let status = r.status();
    let v: serde_json::Value = r.json().await.unwrap_or(serde_json::Value::Null);
    if !status.is_success() {
        bail!("{url}: {status}: {}", v["error"].as_str().unwrap_or(""));
    }
    Ok(v)
}

pub async fn run_nodes(a: NodesArgs) -> Result<()> {
    let trackers = a.t.trackers()?;
    let http = a.t.client()?;
    match &a.node {
        Some(n) => {
            let v = get_json(&http, &trackers, &format!("/api/v1/nodes/{n}")).await?;
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        None => {
            let v = get_json(&http, &trackers, "/api/v1/nodes").await?;
            if a.t.json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                let nodes: Vec<cluster::inventory::NodeSummary> =
                    serde_json::from_value(v["nodes"].clone())?;
                print!("{}", cluster::text::nodes_table(&nodes));
            }
        }
    }
    Ok(())
}

pub async fn run_where(a: WhereArgs) -> Result<()> {
    let trackers = a.t.trackers()?;
    let image = if crate::get_cmd::is_url(&a.image) {
        let f = crate::get_cmd::file_source(&a.image, &a.agent, None).await?;
        cluster::wire::file_reference(&f.key)
    } else {
        crate::get_cmd::cluster_reference(&a.image)?
    };
    let q: String = image
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    let v = get_json(
        &a.t.client()?,
        &trackers,
        &format!("/api/v1/where?image={q}"),
    )
    .await?;
    if a.t.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!(
            "{}",
            cluster::text::where_table(&serde_json::from_value(v)?)
        );
    }
    Ok(())
}

pub async fn run_prewarm(a: PrewarmArgs) -> Result<()> {
    let trackers = a.t.trackers()?;
    let http = a.t.client()?;
    if let Some(id) = a.cancel {
        let r = trackers
            .send(|base| http.delete(format!("{base}/api/v1/prewarm/{id}")))
            .await?;
        println!("{}", r.text().await?);
        return Ok(());
    }
    let digest = a
        .digest
        .as_deref()
        .map(oci::Digest::parse)
        .transpose()
        .context("--digest")?;
    let urls = a
        .images
        .iter()
        .filter(|i| crate::get_cmd::is_url(i))
        .count();
    if digest.is_some() && urls != 1 {
        bail!("--digest names the content of exactly one URL; {urls} given");
    }
    let mut images = Vec::new();
    let mut files = Vec::new();
    for i in &a.images {
        if crate::get_cmd::is_url(i) {
            let f = crate::get_cmd::file_source(i, &a.agent, digest.as_ref()).await?;
            images.push(cluster::wire::file_reference(&f.key));
            files.push(f);
        } else {
            images.push(crate::get_cmd::cluster_reference(i)?);
        }
    }
    let req = cluster::wire::PrewarmRequest {
        images,
        files,
        targets: cluster::wire::Targets {
            nodes: a.nodes.clone(),
            selector: a.selector.clone(),
            pool: a.pool.clone(),
            pool_label: None,
            count: a.count,
            percentage: a.percentage,
        },
        parallelism: a.parallelism,
        per_node_bytes_per_sec: a.node_limit.as_deref().map(crate::parse_size).transpose()?,
        total_bytes_per_sec: a
            .total_limit
            .as_deref()
            .map(crate::parse_size)
            .transpose()?,
        deadline_seconds: a.deadline.map(|d| Duration::from(d).as_secs()),
        pin_ttl_seconds: a.pin_ttl.map(|d| Duration::from(d).as_secs()),
        priority: a.priority,
        force: a.force,
        moving_tags: vec![],
        into_runtime: a.into_runtime,
    };
    let r = trackers
        .send_unrepeatable(|base| http.post(format!("{base}/api/v1/prewarm")).json(&req))
        .await
        .context("submitting the prewarm job")?;
    let status = r.status();
    let v: serde_json::Value = r.json().await.unwrap_or(serde_json::Value::Null);
    if !status.is_success() {
        bail!(
            "prewarm refused ({status}): {}",
            v["error"].as_str().unwrap_or("?")
        );
    }
    let id = v["id"].as_u64().unwrap_or(0);
    if !a.wait {
        println!(
            "{}",
            if a.t.json {
                serde_json::to_string_pretty(&v)?
            } else {
                format!("prewarm job {id} submitted")
            }
        );
        return Ok(());
    }
    loop {
        let v = get_json(&http, &trackers, &format!("/api/v1/prewarm/{id}")).await?;
        if a.t.json {
            println!("{}", serde_json::to_string(&v)?);
        } else {
            print!(
                "\x1b[2J\x1b[H{}",
                cluster::text::job_table(&serde_json::from_value(v.clone())?)
            );
        }
        let st = v["progress"]["status"].as_str().unwrap_or("");
        if st != "running" {
            if st != "done" {
                bail!("prewarm job {id} ended {st}");
            }
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
