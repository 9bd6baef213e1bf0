//! `starling analyze` and `starling diff`, as clap-derive argument structs and run
//! functions returning the process exit code: 0 fine, 1 a CI rule failed (or, for
//! `analyze` outside CI mode, never). Errors are returned for the caller to print.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Args, ValueEnum};

use crate::ci::{check, Thresholds};
use crate::cost::{parse_bandwidth, parse_size, Bandwidths};
use crate::engine::{scan_layers, ScanOptions};
use crate::error::{Error, Result};
use crate::report::{analyze, render_html, render_text, AnalyzeOptions, Style};
use crate::rules::RuleOptions;
use crate::source::{self, OpenOptions, SourceSpec};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum ColorChoice {
    #[default]
    Auto,
    Always,
    Never,
}

/// Options shared by both commands.
#[derive(Args, Clone, Debug)]
pub struct CommonArgs {
    /// Platform to pick from a multi-platform index, os/arch[/variant] (default: the host's).
    #[arg(long)]
    pub platform: Option<String>,
    /// Registry credentials USER:PASSWORD.
    #[arg(long, env = "STARLING_REGISTRY_CREDS", hide_env_values = true)]
    pub creds: Option<String>,
    /// Talk plain HTTP to the registry (loopback registries always use HTTP).
    #[arg(long)]
    pub plain_http: bool,
    /// Print JSON instead of the terminal report.
    #[arg(long)]
    pub json: bool,
    /// Colour: auto (on a TTY), always, never.
    #[arg(long, value_enum, default_value_t = ColorChoice::Auto)]
    pub color: ColorChoice,
    /// Parallel layer decompression threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub jobs: usize,
    /// Stop decompressing a layer after this many bytes (gzip bomb guard).
    #[arg(long, default_value = "64GiB")]
    pub max_layer_bytes: String,
    /// Stop a layer whose compression ratio exceeds this (after 1 GiB).
    #[arg(long, default_value_t = 1000)]
    pub max_ratio: u64,
    /// Skip checking layer digests.
    #[arg(long)]
    pub no_verify: bool,
    /// Nodes to estimate distribution time for.
    #[arg(long, default_value_t = 64)]
    pub nodes: u64,
    /// Origin (registry) upload bandwidth, e.g. 10Gbit, 1.25GB/s.
    #[arg(long, default_value = "10Gbit")]
    pub origin_bandwidth: String,
    /// Node download bandwidth.
    #[arg(long, default_value = "25Gbit")]
    pub node_bandwidth: String,
    /// Node upload bandwidth for P2P (default: the download bandwidth).
    #[arg(long)]
    pub node_upload: Option<String>,
}

/// `starling analyze IMAGE`.
#[derive(Args, Clone, Debug)]
pub struct AnalyzeArgs {
    /// Image: registry reference, oci:DIR[:TAG], an OCI layout directory, or a docker-archive tar.
    pub image: String,
    #[command(flatten)]
    pub common: CommonArgs,
    /// Also write a self-contained HTML report to FILE.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// CI mode: check the image against a TOML thresholds file; exit 1 if a rule fails.
    #[arg(long, value_name = "THRESHOLDS")]
    pub ci: Option<PathBuf>,
    /// Weight files (*.safetensors, *.pt, …) at or above this size are flagged.
    #[arg(long, default_value = "10MiB")]
    pub weights_threshold: String,
    /// Wasted paths to list.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
}

/// `starling diff A B`.
#[derive(Args, Clone, Debug)]
pub struct DiffArgs {
    /// The version nodes already hold.
    pub a: String,
    /// The new version.
    pub b: String,
    #[command(flatten)]
    pub common: CommonArgs,
}

impl CommonArgs {
    fn style(&self) -> Style {
        let color = match self.color {
            ColorChoice::Always => true,
            ColorChoice::Never => false,
            ColorChoice::Auto => {
                std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none()
            }
        };
        Style { color }
    }

    fn open_options(&self) -> Result<OpenOptions> {
        let credentials = match &self.creds {
            Some(c) => {
                let (u, p) = c
                    .split_once(':')
                    .ok_or_else(|| Error::Argument("--creds wants USER:PASSWORD".into()))?;
                Some((u.to_owned(), p.to_owned()))
            }
            None => None,
        };
        Ok(OpenOptions {
            platform: self.platform.clone(),
            credentials,
            plain_http: self.plain_http,
        })
    }

    fn scan_options(&self, hash_files: bool) -> Result<ScanOptions> {
        Ok(ScanOptions {
            hash_files,
            max_layer_bytes: parse_size(&self.max_layer_bytes)?,
            max_ratio: self.max_ratio,
            jobs: self.jobs,
            verify_digests: !self.no_verify,
            ..ScanOptions::default()
        })
    }

    fn bandwidths(&self) -> Result<Bandwidths> {
        let node_down = parse_bandwidth(&self.node_bandwidth)?;
        Ok(Bandwidths {
            origin_up: parse_bandwidth(&self.origin_bandwidth)?,
            node_down,
            node_up: match &self.node_upload {
                Some(u) => parse_bandwidth(u)?,
                None => node_down,
            },
        })
    }
}

/// Runs `analyze`, printing to stdout; returns the exit code.
pub fn run_analyze(args: &AnalyzeArgs) -> Result<i32> {
    let (code, out) = analyze_to_string(args)?;
    print!("{out}");
    Ok(code)
}

/// Like [`run_analyze`] but returns what would be printed (for tests and embedding).
pub fn analyze_to_string(args: &AnalyzeArgs) -> Result<(i32, String)> {
    let c = &args.common;
    let thresholds = args.ci.as_deref().map(Thresholds::load).transpose()?;
    let image = source::open(&SourceSpec::parse(&args.image), &c.open_options()?)?;
    let opts = AnalyzeOptions {
        scan: c.scan_options(false)?,
        rules: RuleOptions {
            weight_threshold: parse_size(&args.weights_threshold)?,
            ..RuleOptions::default()
        },
        nodes: c.nodes,
        bandwidths: c.bandwidths()?,
        top: args.top,
    };
    let report = analyze(&image, &opts).report;
    if let Some(path) = &args.html {
        std::fs::write(path, render_html(&report))
            .map_err(|e| Error::io(path.display().to_string(), e))?;
    }
    let failures = thresholds
        .as_ref()
        .map(|t| check(&report, t))
        .unwrap_or_default();
    let st = c.style();
    let mut out = if c.json {
        let mut v = serde_json::to_value(&report)?;
        if thresholds.is_some() {
            v["ci"] = serde_json::json!({ "passed": failures.is_empty(), "failures": failures });
        }
        format!("{}\n", serde_json::to_string_pretty(&v)?)
    } else {
        render_text(&report, st)
    };
    if thresholds.is_some() && !c.json {
        if failures.is_empty() {
            out.push_str(&format!("\n{}\n", st.green("CI: all thresholds pass")));
        } else {
            out.push_str(&format!(
                "\n{}\n",
                st.red(&format!("CI: {} rule(s) failed", failures.len()))
            ));
            for f in &failures {
                out.push_str(&format!(
                    "  {} {}\n",
                    st.red(&format!("✗ {}:", f.rule)),
                    f.message
                ));
            }
        }
    }
    Ok((i32::from(!failures.is_empty()), out))
}

/// Runs `diff`, printing to stdout; returns the exit code (0).
pub fn run_diff(args: &DiffArgs) -> Result<i32> {
    print!("{}", diff_to_string(args)?);
    Ok(0)
}

pub fn diff_to_string(args: &DiffArgs) -> Result<String> {
    let c = &args.common;
    let oo = c.open_options()?;
    let so = c.scan_options(true)?;
    let a = source::open(&SourceSpec::parse(&args.a), &oo)?;
    let b = source::open(&SourceSpec::parse(&args.b), &oo)?;
    let sa = scan_layers(a.opener.as_ref(), &a.manifest.layers, &so);
    // Only B's layers that A lacks need reading.
    let a_digests: std::collections::HashSet<&oci::Digest> =
        a.manifest.layers.iter().map(|d| &d.digest).collect();
    let mut sb = Vec::new();
    let todo: Vec<oci::Descriptor> = b
        .manifest
        .layers
        .iter()
        .filter(|d| !a_digests.contains(&d.digest))
        .cloned()
        .collect();
    let mut scanned = scan_layers(b.opener.as_ref(), &todo, &so).into_iter();
    for (i, d) in b.manifest.layers.iter().enumerate() {
        if a_digests.contains(&d.digest) {
            let mut l = crate::engine::LayerScan::empty(i, d);
            l.complete = true;
            sb.push(l);
        } else if let Some(mut l) = scanned.next() {
            l.index = i;
            for p in &mut l.problems {
                p.layer = Some(i);
            }
            sb.push(l);
        }
    }
    let hist = b.config.layer_history(b.manifest.layers.len());
    let d = crate::diff::diff(&a.name, &sa, &b.name, &sb, &hist, c.nodes, c.bandwidths()?);
    if c.json {
        Ok(format!("{}\n", serde_json::to_string_pretty(&d)?))
    } else {
        Ok(crate::diff::render_text(&d, c.style()))
    }
}
