//! Pointing container runtimes at the agent: containerd `hosts.toml`, Docker
//! `daemon.json`, and the skopeo/podman `registries.conf` stanza.

use std::path::{Path, PathBuf};

/// What `setup containerd` did and what it found worth a warning.
#[derive(Debug, Default)]
pub struct SetupReport {
    pub written: Vec<PathBuf>,
    pub backups: Vec<PathBuf>,
    pub warnings: Vec<String>,
}

fn hosts_toml(server: Option<&str>, mirror: &str) -> String {
    let mut s = String::from("# Written by `starling setup containerd`. The agent is tried first; on any error\n# containerd falls back to the next host and finally to `server`.\n");
    if let Some(server) = server {
        s.push_str(&format!("server = \"{server}\"\n"));
    }
    s.push_str(&format!("\n[host.\"{mirror}\"]\n  capabilities = [\"pull\", \"resolve\"]\n  dial_timeout = \"2s\"\n"));
    s
}

fn server_url(registry: &str) -> String {
    match registry {
        "docker.io" => "https://registry-1.docker.io".to_owned(),
        r => format!("https://{r}"),
    }
}

fn backup_and_write(path: &Path, content: &str, report: &mut SetupReport) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    if let Ok(old) = std::fs::read_to_string(path) {
        if old == content {
            return Ok(());
        }
        let backup = path.with_extension(format!("toml.starling-backup-{}", store::now_secs()));
        std::fs::write(&backup, old)?;
        report.backups.push(backup);
    }
    let tmp = path.with_extension("tmp-starling");
    std::fs::write(&tmp, content)?;
    std::fs::rename(&tmp, path)?;
    report.written.push(path.to_owned());
    Ok(())
}

/// Writes `certs.d/<registry>/hosts.toml` for each registry and `_default`, then checks
/// the containerd config for settings that would bypass or undo the mirror.
pub fn containerd(
    certs_dir: &Path,
    mirror_url: &str,
    registries: &[String],
    containerd_config: Option<&Path>,
) -> std::io::Result<SetupReport> {
    let mut report = SetupReport::default();
    for r in registries {
        let dir = certs_dir.join(r);
        backup_and_write(
            &dir.join("hosts.toml"),
            &hosts_toml(Some(&server_url(r)), mirror_url),
            &mut report,
        )?;
    }
    backup_and_write(
        &certs_dir.join("_default").join("hosts.toml"),
        &hosts_toml(None, mirror_url),
        &mut report,
    )?;
    if let Some(cfg) = containerd_config {
        match std::fs::read_to_string(cfg) {
            Ok(text) => report
                .warnings
                .extend(check_containerd_config(&text, certs_dir)),
            Err(e) => report
                .warnings
                .push(format!("cannot read {}: {e}", cfg.display())),
        }
    }
    Ok(report)
}

/// Finds containerd settings that make the mirror ineffective.
pub fn check_containerd_config(text: &str, certs_dir: &Path) -> Vec<String> {
    let mut w = Vec::new();
    let value: toml::Value = match toml::from_str(text) {
        Ok(v) => v,
        Err(e) => return vec![format!("containerd config is not valid TOML: {e}")],
    };
    let plugins = value.get("plugins");
    let cri_v1 = plugins.and_then(|p| p.get("io.containerd.grpc.v1.cri"));
    let images_v2 = plugins.and_then(|p| p.get("io.containerd.cri.v1.images"));
    let registry = cri_v1
        .and_then(|c| c.get("registry"))
        .or_else(|| images_v2.and_then(|c| c.get("registry")));
    let config_path = registry
        .and_then(|r| r.get("config_path"))
        .and_then(|v| v.as_str());
    match config_path {
        None => w.push(format!(
            "registry config_path is not set: CRI pulls ignore hosts.toml. Set config_path = \"{}\" under [plugins.\"io.containerd.grpc.v1.cri\".registry] (1.x) or [plugins.\"io.containerd.cri.v1.images\".registry] (2.x)",
            certs_dir.display()
        )),
        Some(p) if !p.split(':').any(|x| Path::new(x) == certs_dir) => {
            w.push(format!("registry config_path is {p}, not {}: the hosts.toml files written here are not read", certs_dir.display()))
        }
        Some(_) => {}
    }
    if registry.and_then(|r| r.get("mirrors")).is_some() {
        w.push("legacy registry.mirrors is set together with config_path: containerd refuses this combination; remove registry.mirrors".into());
    }
    let discard = cri_v1
        .and_then(|c| c.get("containerd"))
        .and_then(|c| c.get("discard_unpacked_layers"))
        .or_else(|| images_v2.and_then(|c| c.get("discard_unpacked_layers")));
    if discard.and_then(|v| v.as_bool()) == Some(true) {
        w.push("discard_unpacked_layers = true: containerd deletes layer blobs after unpacking, so this node cannot keep them; the agent's cache still serves peers".into());
    }
    let transfer = images_v2
        .and_then(|c| c.get("use_local_image_pull"))
        .and_then(|v| v.as_bool());
    if images_v2.is_some() && transfer != Some(true) {
        w.push("containerd 2.1+: set use_local_image_pull = true under [plugins.\"io.containerd.cri.v1.images\"], otherwise the transfer service may ignore hosts.toml".into());
    }
    w
}

/// Merges the agent into Docker's `registry-mirrors` (Docker Hub only), keeping every
/// other key and a backup of the old file.
pub fn docker(daemon_json: &Path, mirror_url: &str) -> std::io::Result<SetupReport> {
    let mut report = SetupReport::default();
    let mut value: serde_json::Value = match std::fs::read_to_string(daemon_json) {
        Ok(t) if !t.trim().is_empty() => serde_json::from_str(&t).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {e}", daemon_json.display()),
            )
        })?,
        _ => serde_json::json!({}),
    };
    let Some(obj) = value.as_object_mut() else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "daemon.json is not a JSON object",
        ));
    };
    let mirrors = obj
        .entry("registry-mirrors")
        .or_insert_with(|| serde_json::json!([]));
    let Some(list) = mirrors.as_array_mut() else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "registry-mirrors is not a list",
        ));
    };
    let url = mirror_url.trim_end_matches('/');
    list.retain(|v| v.as_str().map(|s| s.trim_end_matches('/')) != Some(url));
    list.insert(0, serde_json::Value::String(url.to_owned()));
    if url.starts_with("http://") {
        let host = url.trim_start_matches("http://").to_owned();
        let insecure = obj
            .entry("insecure-registries")
            .or_insert_with(|| serde_json::json!([]));
        if let Some(l) = insecure.as_array_mut() {
            if !l.iter().any(|v| v.as_str() == Some(&host)) {
                l.push(serde_json::Value::String(host));
            }
        }
    }
    let text = serde_json::to_string_pretty(&value).map_err(std::io::Error::other)? + "\n";
    if let Ok(old) = std::fs::read_to_string(daemon_json) {
        if old != text {
            let b =
                daemon_json.with_extension(format!("json.starling-backup-{}", store::now_secs()));
            std::fs::write(&b, old)?;
            report.backups.push(b);
        }
    }
    if let Some(p) = daemon_json.parent() {
        std::fs::create_dir_all(p)?;
    }
    std::fs::write(daemon_json, text)?;
    report.written.push(daemon_json.to_owned());
    report.warnings.push(
        "restart dockerd to apply registry-mirrors; Docker uses mirrors for Docker Hub images only"
            .into(),
    );
    Ok(report)
}

/// The `registries.conf` (v2) stanza for skopeo and podman.
pub fn registries_conf(mirror_url: &str, registries: &[String]) -> String {
    let host = mirror_url
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/');
    let insecure = mirror_url.starts_with("http://");
    let mut s = String::from(
        "# Add to /etc/containers/registries.conf (or a drop-in under registries.conf.d/)\n",
    );
    for r in registries {
        s.push_str(&format!("\n[[registry]]\nlocation = \"{r}\"\n\n[[registry.mirror]]\nlocation = \"{host}\"\ninsecure = {insecure}\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containerd_writes_hosts_and_backs_up() {
        let dir = tempfile::tempdir().unwrap();
        let certs = dir.path().join("certs.d");
        std::fs::create_dir_all(certs.join("docker.io")).unwrap();
        std::fs::write(
            certs.join("docker.io/hosts.toml"),
            "server = \"https://old\"\n",
        )
        .unwrap();
        let r = containerd(
            &certs,
            "http://127.0.0.1:5050",
            &["docker.io".into(), "ghcr.io".into()],
            None,
        )
        .unwrap();
        assert_eq!(r.written.len(), 3);
        assert_eq!(r.backups.len(), 1);
        let text = std::fs::read_to_string(certs.join("docker.io/hosts.toml")).unwrap();
        let v: toml::Value = toml::from_str(&text).unwrap();
        assert_eq!(v["server"].as_str(), Some("https://registry-1.docker.io"));
        assert_eq!(
            v["host"]["http://127.0.0.1:5050"]["capabilities"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        assert!(std::fs::read_to_string(&r.backups[0])
            .unwrap()
            .contains("https://old"));
        let d: toml::Value =
            toml::from_str(&std::fs::read_to_string(certs.join("_default/hosts.toml")).unwrap())
                .unwrap();
        assert!(d.get("server").is_none());
    }

    #[test]
    fn containerd_config_checks() {
        let certs = Path::new("/etc/containerd/certs.d");
        let w = check_containerd_config("version = 2\n", certs);
        assert!(
            w.iter().any(|x| x.contains("config_path is not set")),
            "{w:?}"
        );
        let good = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".registry]\nconfig_path = \"/etc/containerd/certs.d\"\n";
        assert!(check_containerd_config(good, certs).is_empty());
        let discard = format!("{good}[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndiscard_unpacked_layers = true\n");
        assert!(check_containerd_config(&discard, certs)
            .iter()
            .any(|x| x.contains("discard_unpacked_layers")));
        let v2 = "version = 3\n[plugins.\"io.containerd.cri.v1.images\".registry]\nconfig_path = \"/etc/containerd/certs.d\"\n";
        assert!(check_containerd_config(v2, certs)
            .iter()
            .any(|x| x.contains("use_local_image_pull")));
        let v2ok = "version = 3\n[plugins.\"io.containerd.cri.v1.images\"]\nuse_local_image_pull = true\n[plugins.\"io.containerd.cri.v1.images\".registry]\nconfig_path = \"/etc/containerd/certs.d\"\n";
        assert!(check_containerd_config(v2ok, certs).is_empty());
        let legacy = format!("{good}[plugins.\"io.containerd.grpc.v1.cri\".registry.mirrors.\"docker.io\"]\nendpoint = [\"x\"]\n");
        assert!(check_containerd_config(&legacy, certs)
            .iter()
            .any(|x| x.contains("legacy")));
    }

    #[test]
    fn docker_merge_keeps_other_keys() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("daemon.json");
        std::fs::write(
            &p,
            r#"{"log-driver":"json-file","registry-mirrors":["https://other"]}"#,
        )
        .unwrap();
        let r = docker(&p, "http://127.0.0.1:5050").unwrap();
        assert_eq!(r.backups.len(), 1);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(v["log-driver"], "json-file");
        assert_eq!(
            v["registry-mirrors"],
            serde_json::json!(["http://127.0.0.1:5050", "https://other"])
        );
        assert_eq!(
            v["insecure-registries"],
            serde_json::json!(["127.0.0.1:5050"])
        );
        docker(&p, "http://127.0.0.1:5050").unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(
            v["registry-mirrors"].as_array().unwrap().len(),
            2,
            "idempotent"
        );
        std::fs::write(&p, "[1]").unwrap();
        assert!(docker(&p, "http://x").is_err());
    }

    #[test]
    fn registries_conf_stanza() {
        let s = registries_conf("http://127.0.0.1:5050", &["docker.io".into()]);
        let v: toml::Value = toml::from_str(&s).unwrap();
        assert_eq!(
            v["registry"][0]["mirror"][0]["location"].as_str(),
            Some("127.0.0.1:5050")
        );
        assert_eq!(
            v["registry"][0]["mirror"][0]["insecure"].as_bool(),
            Some(true)
        );
    }
}
