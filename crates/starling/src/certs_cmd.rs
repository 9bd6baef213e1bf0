//! `starling certs`: the operator's side of the cluster PKI (crate `pki`): create the CA,
//! make bootstrap tokens for joining nodes, issue certificates for operators, viewers and
//! (for tests or nodes that cannot join) nodes. Thin: every decision is in `pki`.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

/// Where the CA lives unless `--dir` says otherwise.
pub const DEFAULT_PKI_DIR: &str = "/etc/starling/pki";

#[derive(Subcommand)]
pub enum CertsCmd {
    /// Create the cluster CA (ca.crt, ca.key) and the bootstrap secret (bootstrap.key);
    /// prints the CA pin joining agents check the tracker against.
    Init(InitArgs),
    /// Print a bootstrap token (stb1.…) with which nodes join the cluster.
    Token(TokenArgs),
    /// Issue a certificate and key signed by the cluster CA into a directory.
    Issue(IssueArgs),
}

#[derive(Args)]
pub struct PkiDir {
    /// The PKI directory (ca.crt, ca.key, bootstrap.key).
    #[arg(long = "dir", env = "STARLING_PKI_DIR", default_value = DEFAULT_PKI_DIR)]
    dir: PathBuf,
}

#[derive(Args)]
pub struct InitArgs {
    #[command(flatten)]
    pki: PkiDir,
    /// Name of the cluster, shown in the CA's subject (a DNS-style name).
    #[arg(long, default_value = "starling")]
    cluster_name: String,
}

#[derive(Args)]
pub struct TokenArgs {
    #[command(flatten)]
    pki: PkiDir,
    /// How long the token may be used to join (at most 7 days).
    #[arg(long, default_value = "1h")]
    ttl: humantime::Duration,
    /// Node names the token may join as: one name, or a pattern with one '*' (gpu-*).
    #[arg(long = "name", value_name = "PATTERN")]
    name: Option<String>,
}

#[derive(Args)]
pub struct IssueArgs {
    #[command(flatten)]
    pki: PkiDir,
    /// node, operator or viewer (tracker certificates are made by the tracker itself).
    #[arg(long, value_parser = ["node", "operator", "viewer"])]
    role: String,
    /// Name in the identity starling:<role>:<name>.
    #[arg(long)]
    name: String,
    /// Directory to write <role>.crt (certificate + CA), <role>.key (0600) and ca.crt.
    #[arg(long)]
    out: PathBuf,
    /// Lifetime (default: 24h for nodes, 90 days for operators and viewers).
    #[arg(long)]
    ttl: Option<humantime::Duration>,
    /// Extra DNS name or IP address in a node certificate (repeatable).
    #[arg(long = "san", value_name = "DNS|IP")]
    sans: Vec<String>,
}

pub fn run(cmd: CertsCmd) -> Result<()> {
    match cmd {
        CertsCmd::Init(a) => init(a),
        CertsCmd::Token(a) => token(a),
        CertsCmd::Issue(a) => issue(a),
    }
}

fn init(a: InitArgs) -> Result<()> {
    let (ca, _) = pki::init_pki_dir(&a.pki.dir, &a.cluster_name, pki::DEFAULT_CA_LIFETIME)
        .with_context(|| format!("creating the cluster CA in {}", a.pki.dir.display()))?;
    eprintln!(
        "cluster CA created in {} (keep ca.key and bootstrap.key secret)",
        a.pki.dir.display()
    );
    // Alone on stdout so scripts can capture it: agents join with `--ca-pin <this>`.
    println!("{}", ca.pin());
    Ok(())
}

fn token(a: TokenArgs) -> Result<()> {
    let key = pki::BootstrapKey::load(&a.pki.dir)
        .with_context(|| format!("loading the bootstrap secret from {}", a.pki.dir.display()))?;
    let pattern = a
        .name
        .as_deref()
        .map(pki::NamePattern::new)
        .transpose()
        .context("--name")?;
    let token = key
        .create_token(Duration::from(a.ttl), pattern.as_ref())
        .context("creating the token")?;
    println!("{token}");
    Ok(())
}

fn issue(a: IssueArgs) -> Result<()> {
    let ca = pki::ClusterCa::load(&a.pki.dir)
        .with_context(|| format!("loading the cluster CA from {}", a.pki.dir.display()))?;
    let role: pki::Role = a.role.parse()?;
    let mut request = pki::CertRequest::new(pki::Identity::new(role, a.name.clone())?);
    if let Some(ttl) = a.ttl {
        request = request.lifetime(ttl.into());
    }
    for san in &a.sans {
        request = match san.parse::<IpAddr>() {
            Ok(ip) => request.ip_address(ip),
            Err(_) => request.dns_name(san.clone()),
        };
    }
    let issued = ca.issue(&request).context("issuing the certificate")?;
    let (cert, key) = issued
        .save(&a.out, role.as_str())
        .with_context(|| format!("writing into {}", a.out.display()))?;
    let ca_path = a.out.join(pki::CA_CERT_FILE);
    std::fs::write(&ca_path, ca.cert_pem())
        .with_context(|| format!("writing {}", ca_path.display()))?;
    eprintln!(
        "issued {} (serial {}) until {}",
        issued.info().identity,
        issued.info().serial_hex(),
        humantime::format_rfc3339_seconds(issued.info().not_after)
    );
    println!(
        "{}\n{}\n{}",
        cert.display(),
        key.display(),
        ca_path.display()
    );
    Ok(())
}
