//! `starling`: one binary for every role. Library crates do the work; this file parses
//! flags, merges configuration and reports errors with context.
#![forbid(unsafe_code)]

mod agent_cmd;
mod bench;
mod bench_get;
mod bench_tracker;
mod certs_cmd;
mod cluster_cmd;
mod demo;
mod get_cmd;
mod get_file;
mod machine;
mod setup_cmd;
mod tracker_redis;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "starling", version, about = "Container images to GPU nodes, fast: a caching P2P registry mirror on every node", long_about = None)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. "info" or "agent=debug".
    #[arg(
        long,
        global = true,
        env = "STARLING_LOG",
        default_value = "info",
        help_heading = "Global options"
    )]
    log: String,
    /// Log as JSON lines.
    #[arg(
        long,
        global = true,
        env = "STARLING_LOG_JSON",
        help_heading = "Global options"
    )]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent: a caching, streaming registry mirror for containerd, Docker and skopeo.
    Agent(Box<agent_cmd::AgentArgs>),
    /// Run the tracker: swarm membership, registry-fetch election, peer handout.
    Tracker(Box<agent_cmd::TrackerArgs>),
    /// Serve an OCI image layout directory read-only as a registry (air-gapped origin).
    ServeOci(agent_cmd::ServeOciArgs),
    /// Pull an image through a registry or mirror with digest verification, and report timings.
    Pull(agent_cmd::PullArgs),
    /// List the nodes the tracker knows and what they hold.
    Nodes(cluster_cmd::NodesArgs),
    /// Which nodes hold how many bytes of an image.
    Where(cluster_cmd::WhereArgs),
    /// Fetch large files (OCI artifacts, http(s) URLs) through the node's agent and the swarm.
    Get(get_cmd::GetArgs),
    /// Warm images onto nodes ahead of a job (one registry fetch, then P2P fan-out).
    Prewarm(cluster_cmd::PrewarmArgs),
    /// Simulate a cluster pulling an image under each strategy (capacity planning).
    Sim(sim::cli::SimArgs),
    /// Show what bloats an image and what each update costs to ship.
    Analyze(analyze::cli::AnalyzeArgs),
    /// Compare two images: shared layers, bytes to fetch, content reused at file level.
    Diff(analyze::cli::DiffArgs),
    /// Point container runtimes at the agent.
    #[command(subcommand)]
    Setup(setup_cmd::SetupCmd),
    /// Cluster PKI: create the CA, bootstrap tokens for joining nodes, certificates.
    #[command(subcommand)]
    Certs(certs_cmd::CertsCmd),
    /// Self-contained demo: a synthetic training image behind a rate-limited registry,
    /// a tracker and N agents pulling it at once through the swarm, against the bound T*.
    Demo(demo::DemoArgs),
    /// Benchmarks that compare against a baseline in the same run.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
}

fn init_logging(filter: &str, json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Sim(_)) {
        sim::cli::reexec_with_huge_pages();
    }
    // The demo prints its own report; per-blob log lines would drown it.
    let quiet_default = matches!(cli.command, Command::Demo(_))
        && std::env::var_os("STARLING_LOG").is_none()
        && cli.log == "info";
    init_logging(if quiet_default { "warn" } else { &cli.log }, cli.log_json);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result: Result<i32> = rt.block_on(async move {
        match cli.command {
            Command::Agent(a) => agent_cmd::run_agent(*a).await.map(|_| 0),
            Command::Tracker(a) => agent_cmd::run_tracker(*a).await.map(|_| 0),
            Command::ServeOci(a) => agent_cmd::run_serve_oci(a).await.map(|_| 0),
            Command::Pull(a) => agent_cmd::run_pull(a).await.map(|_| 0),
            Command::Setup(s) => setup_cmd::run(s).map(|_| 0),
            Command::Certs(c) => certs_cmd::run(c).map(|_| 0),
            Command::Sim(a) => tokio::task::spawn_blocking(move || sim::cli::run(&a))
                .await?
                .map_err(anyhow::Error::from),
            Command::Get(a) => get_cmd::run_get(a).await,
            Command::Nodes(a) => cluster_cmd::run_nodes(a).await.map(|_| 0),
            Command::Where(a) => cluster_cmd::run_where(a).await.map(|_| 0),
            Command::Prewarm(a) => cluster_cmd::run_prewarm(a).await.map(|_| 0),
            // The analyzer blocks (it runs its own threads and, for registries, its own runtime).
            Command::Analyze(a) => {
                tokio::task::spawn_blocking(move || analyze::cli::run_analyze(&a))
                    .await?
                    .map_err(anyhow::Error::from)
            }
            Command::Diff(a) => tokio::task::spawn_blocking(move || analyze::cli::run_diff(&a))
                .await?
                .map_err(anyhow::Error::from),
            Command::Demo(d) => demo::run_demo(d).await.map(|_| 0),
            Command::Bench(b) => bench::run_bench(b).await.map(|_| 0),
        }
    });
    // Servers return once their grace period is over; tasks still running (a hung
    // registry lookup, a client that never reads) must not hold the process.
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(0) => std::process::ExitCode::SUCCESS,
        Ok(code) => std::process::ExitCode::from(code.clamp(1, 255) as u8),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Waits for Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down");
}

pub(crate) fn parse_size(s: &str) -> Result<u64> {
    oci::size::parse_size(s).context("size")
}
