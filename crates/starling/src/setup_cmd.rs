use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;

#[derive(Subcommand)]
pub enum SetupCmd {
    /// Write certs.d/<registry>/hosts.toml (and _default) pointing at the agent; check containerd's config.
    Containerd {
        /// containerd's registry config_path.
        #[arg(long, default_value = "/etc/containerd/certs.d")]
        certs_dir: PathBuf,
        /// The agent's URL.
        #[arg(long, default_value = "http://127.0.0.1:5050")]
        mirror: String,
        /// Registries to mirror (repeatable); _default covers the rest.
        #[arg(long = "registry", default_values_t = vec!["docker.io".to_string()])]
        registries: Vec<String>,
        /// containerd config to check for settings that bypass the mirror.
        #[arg(long, default_value = "/etc/containerd/config.toml")]
        containerd_config: PathBuf,
    },
    /// Merge the agent into Docker's daemon.json registry-mirrors (Docker Hub only).
    Docker {
        #[arg(long, default_value = "/etc/docker/daemon.json")]
        daemon_json: PathBuf,
        #[arg(long, default_value = "http://127.0.0.1:5050")]
        mirror: String,
    },
    /// Print the registries.conf stanza for skopeo and podman.
    RegistriesConf {
        #[arg(long, default_value = "http://127.0.0.1:5050")]
        mirror: String,
        #[arg(long = "registry", default_values_t = vec!["docker.io".to_string()])]
        registries: Vec<String>,
    },
}

pub fn run(cmd: SetupCmd) -> Result<()> {
    let report = match cmd {
        SetupCmd::Containerd {
            certs_dir,
            mirror,
            registries,
            containerd_config,
        } => {
            let cfg = containerd_config
                .exists()
                .then_some(containerd_config.as_path());
            agent::setup::containerd(&certs_dir, &mirror, &registries, cfg)
                .with_context(|| format!("writing {}", certs_dir.display()))?
        }
        SetupCmd::Docker {
            daemon_json,
            mirror,
        } => agent::setup::docker(&daemon_json, &mirror)
            .with_context(|| format!("updating {}", daemon_json.display()))?,
        SetupCmd::RegistriesConf { mirror, registries } => {
            print!("{}", agent::setup::registries_conf(&mirror, &registries));
            return Ok(());
        }
    };
    for p in &report.written {
        println!("wrote   {}", p.display());
    }
    for p in &report.backups {
        println!("backup  {}", p.display());
    }
    for w in &report.warnings {
        println!("warning {w}");
    }
    Ok(())
}
