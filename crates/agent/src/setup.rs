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

/// containerd's TLS keys for a host (`ca`, `client`, `skip_verify`). At the top of a
/// hosts.toml they apply to `server`.
const TLS_KEYS: [&str; 3] = ["ca", "client", "skip_verify"];

fn hosts_toml(server: Option<&str>, mirror: &str, server_tls: &toml::Table) -> String {
    let mut s = String::from("# Written by `starling setup containerd`. The agent is tried first; on any error\n# containerd falls back to the next host and finally to `server`.\n");
    if let Some(server) = server {
        s.push_str(&format!("server = \"{server}\"\n"));
    }
    if !server_tls.is_empty() {
        s.push_str("# TLS for `server` (containerd's own fallback), kept from the previous file.\n# containerd talks plain HTTP to the agent; the agent talks TLS to the registry with\n# its own settings: [registries.\"<registry>\"] ca_file, client_cert, client_key, skip_verify.\n");
        s.push_str(&toml::to_string(server_tls).unwrap_or_default());
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

/// The TLS settings of an existing hosts.toml that still apply to `server` once it is
/// rewritten (its top-level `ca`/`client`/`skip_verify`, when it had the same server or
/// none), with warnings for what the agent needs and for what is dropped.
fn carried_tls(
    old: &str,
    path: &Path,
    registry: Option<&str>,
    server: Option<&str>,
    mirror: &str,
    warnings: &mut Vec<String>,
) -> toml::Table {
    let Ok(old) = toml::from_str::<toml::Table>(old) else {
        return toml::Table::new();
    };
    let mut tls = toml::Table::new();
    for k in TLS_KEYS {
        if let Some(v) = old.get(k) {
            tls.insert(k.to_owned(), v.clone());
        }
    }
    let same_server = match (old.get("server").and_then(|v| v.as_str()), server) {
        (None, _) => true,
        (Some(o), Some(n)) => o.trim_end_matches('/') == n.trim_end_matches('/'),
        (Some(_), None) => false,
    };
    let shown = path.display();
    if !tls.is_empty() && !same_server {
        warnings.push(format!("{shown}: the previous file had TLS settings ({}) for another server; they are not kept (see the backup)", keys(&tls)));
        tls.clear();
    }
    if !tls.is_empty() {
        let agent_side = match registry {
            Some(r) => format!("[registries.\"{r}\"] ca_file / client_cert + client_key / skip_verify (flags --registry-ca {r}=PATH, --registry-client-cert, --registry-client-key, --registry-skip-verify)"),
            None => "[registries.\"<registry>\"] ca_file / client_cert + client_key / skip_verify for each registry that needs them".to_owned(),
        };
        warnings.push(format!("{shown}: kept {} for containerd's fallback to the registry; the agent does not read hosts.toml: give it the same in its config, {agent_side}", keys(&tls)));
    }
    if let Some(hosts) = old.get("host").and_then(|h| h.as_table()) {
        for (h, t) in hosts {
            let has_tls = t
                .as_table()
                .is_some_and(|t| TLS_KEYS.iter().any(|k| t.contains_key(*k)));
            if has_tls && h.trim_end_matches('/') != mirror.trim_end_matches('/') {
                warnings.push(format!(
                    "{shown}: host {h} had TLS settings and is no longer listed (see the backup)"
                ));
            }
        }
    }
    tls
}

fn keys(t: &toml::Table) -> String {
    t.keys().cloned().collect::<Vec<_>>().join(", ")
}

/// Writes `certs.d/<registry>/hosts.toml` for each registry and `_default`, then checks
/// the containerd config for settings that would bypass or undo the mirror. TLS
/// settings an existing file had for the registry (`ca`, `client`, `skip_verify` at
/// the top) are kept for containerd's fallback; the agent's own host entry never has
/// any (containerd talks plain HTTP to it).
pub fn containerd(
    certs_dir: &Path,
    mirror_url: &str,
    registries: &[String],
    containerd_config: Option<&Path>,
) -> std::io::Result<SetupReport> {
    let mut report = SetupReport::default();
    let targets = registries
        .iter()
        .map(|r| (Some(r.as_str()), r.as_str()))
        .chain(std::iter::once((None, "_default")));
    for (registry, dir) in targets {
        let path = certs_dir.join(dir).join("hosts.toml");
        let server = registry.map(server_url);
        let tls = match std::fs::read_to_string(&path) {
            Ok(old) => carried_tls(
                &old,
                &path,
                registry,
                server.as_deref(),
                mirror_url,
                &mut report.warnings,
            ),
            Err(_) => toml::Table::new(),
        };
        backup_and_write(
            &path,
            &hosts_toml(server.as_deref(), mirror_url, &tls),
            &mut report,
        )?;
    }
    if mirror_url.starts_with("https://") {
        report.warnings.push(format!("{mirror_url}: the agent serves plain HTTP; containerd cannot reach it over HTTPS. Use http://"));
    }
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
    fn containerd_keeps_the_registrys_tls_for_its_fallback() {
        let dir = tempfile::tempdir().expect("dir");
        let certs = dir.path().join("certs.d");
        std::fs::create_dir_all(certs.join("reg.corp:5000")).expect("dir");
        std::fs::write(
            certs.join("reg.corp:5000/hosts.toml"),
            "server = \"https://reg.corp:5000\"\nca = \"/etc/corp/ca.pem\"\nclient = [[\"/etc/corp/n.crt\", \"/etc/corp/n.key\"]]\n\n[host.\"https://other.mirror\"]\n  ca = \"/x.pem\"\n",
        )
        .expect("write");
        let r = containerd(
            &certs,
            "http://127.0.0.1:5050",
            &["reg.corp:5000".into()],
            None,
        )
        .expect("setup");
        let text = std::fs::read_to_string(certs.join("reg.corp:5000/hosts.toml")).expect("read");
        let v: toml::Value = toml::from_str(&text).expect("TOML");
        assert_eq!(v["server"].as_str(), Some("https://reg.corp:5000"));
        assert_eq!(v["ca"].as_str(), Some("/etc/corp/ca.pem"));
        assert_eq!(v["client"][0][1].as_str(), Some("/etc/corp/n.key"));
        // The agent's entry is plain HTTP: no TLS keys there.
        let mirror = v["host"]["http://127.0.0.1:5050"]
            .as_table()
            .expect("mirror host");
        assert!(TLS_KEYS.iter().all(|k| !mirror.contains_key(*k)), "{text}");
        assert!(v["host"].get("https://other.mirror").is_none());
        let w = r.warnings.join("\n");
        assert!(
            w.contains("--registry-ca reg.corp:5000=PATH") && w.contains("ca, client"),
            "{w}"
        );
        assert!(w.contains("https://other.mirror had TLS settings"), "{w}");
        // A second run changes nothing.
        let again = containerd(
            &certs,
            "http://127.0.0.1:5050",
            &["reg.corp:5000".into()],
            None,
        )
        .expect("again");
        assert!(again.backups.is_empty(), "{:?}", again.backups);
        // Settings for another server are not carried over to ours.
        std::fs::write(
            certs.join("reg.corp:5000/hosts.toml"),
            "server = \"https://elsewhere\"\nskip_verify = true\n",
        )
        .expect("write");
        let r = containerd(
            &certs,
            "http://127.0.0.1:5050",
            &["reg.corp:5000".into()],
            None,
        )
        .expect("setup");
        let text = std::fs::read_to_string(certs.join("reg.corp:5000/hosts.toml")).expect("read");
        assert!(!text.contains("skip_verify"), "{text}");
        assert!(
            r.warnings.iter().any(|w| w.contains("another server")),
            "{:?}",
            r.warnings
        );
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
