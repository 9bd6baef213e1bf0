//! Layering: defaults, then the TOML file, then the environment, then flags (clap
//! already prefers a flag over its variable). Every value is checked on its own as it
//! is read, so a bad one is reported with the file and key, the flag or the variable
//! it came from, and every problem is reported at once.

use std::path::Path;

use super::settings::{How, Setting, Source, Sources};
use super::{problems_to_result, AgentConfig};
use crate::Error;

/// What the command line says about one setting: the flag's values, or the
/// environment variable's when the flag is absent (`from_env`). Switches carry no
/// values.
#[derive(Clone, Debug)]
pub struct CliValue {
    pub setting: &'static Setting,
    pub from_env: bool,
    pub values: Vec<String>,
}

impl CliValue {
    pub fn source(&self) -> Source {
        if self.from_env {
            Source::Env(self.setting.env)
        } else {
            Source::Flag(self.setting.flag)
        }
    }
}

/// Which part of `[registries."host"]` a registry flag sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegistryField {
    /// `REGISTRY=URL`.
    Endpoint,
    /// `REGISTRY=USER:PASSWORD`.
    Credentials,
    /// `REGISTRY=PATH`.
    CaFile,
    ClientCert,
    ClientKey,
    /// `REGISTRY`.
    SkipVerify,
}

/// A registry flag's values (or its variable's), applied over the file's
/// `[registries."host"]` entries field by field.
#[derive(Clone, Debug)]
pub struct RegistryCliValue {
    pub field: RegistryField,
    pub source: Source,
    pub values: Vec<String>,
}

/// Builds the configuration from an optional TOML file and the command line (the
/// settings' flags, then the registry flags). Unknown keys and bad values are refused,
/// each named with its source, together with what [`AgentConfig::validate`] finds in
/// the rest.
pub fn load(
    file: Option<&Path>,
    cli: &[CliValue],
    registry_cli: &[RegistryCliValue],
) -> Result<AgentConfig, Error> {
    let mut merged = toml::Table::new();
    let mut sources = Sources::default();
    let mut problems: Vec<String> = Vec::new();
    if let Some(path) = file {
        let shown = path.display();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("reading {shown}: {e}")))?;
        let table: toml::Table = text
            .parse()
            .map_err(|e| Error::Config(format!("{shown}: {e}")))?;
        let source = Source::File(path.to_owned());
        for (key, value) in table {
            if Setting::find(&key).is_none() {
                problems.push(format!("{shown}: unknown key {key:?}{}", near_miss(&key)));
                continue;
            }
            if let Err(e) = check(&key, &value) {
                problems.push(format!("{shown}: {key}: {e}"));
                continue;
            }
            if let Some(hosts) = value.as_table().filter(|_| key == "registries") {
                for host in hosts.keys() {
                    sources.set(format!("registries.{host:?}"), source.clone());
                }
            }
            sources.set(key.clone(), source.clone());
            merged.insert(key, value);
        }
    }
    for v in cli {
        let source = v.source();
        let key = v.setting.key;
        let value = match cli_value(v) {
            Ok(value) => value,
            Err(e) => {
                problems.push(format!("{source}: {e}"));
                continue;
            }
        };
        if let Err(e) = check(key, &value) {
            problems.push(format!("{source}: {e}"));
            continue;
        }
        // Lists and maps add to the file's entries; other values replace them.
        match (merged.get_mut(key), value) {
            (Some(toml::Value::Array(have)), toml::Value::Array(more)) => have.extend(more),
            (Some(toml::Value::Table(have)), toml::Value::Table(more)) => have.extend(more),
            (_, value) => {
                merged.insert(key.to_owned(), value);
            }
        }
        sources.set(key, source);
    }
    for v in registry_cli {
        for raw in &v.values {
            match registry_entry(v.field, raw) {
                Ok((host, fields)) => {
                    let registries = merged
                        .entry("registries")
                        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
                    if let toml::Value::Table(registries) = registries {
                        let entry = registries
                            .entry(host.clone())
                            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
                        if let toml::Value::Table(entry) = entry {
                            entry.extend(fields);
                        }
                    }
                    sources.set(format!("registries.{host:?}"), v.source.clone());
                }
                Err(e) => problems.push(format!("{}: {e}", v.source)),
            }
        }
    }
    let mut cfg: AgentConfig = match toml::Value::Table(merged).try_into() {
        Ok(cfg) => cfg,
        // Each value passed on its own; together they should not fail, but say so if they do.
        Err(e) => return Err(Error::Config(format!("combining the settings: {e}"))),
    };
    cfg.sources = sources;
    if !problems.is_empty() {
        problems.extend(cfg.problems());
        problems_to_result(problems)?;
    }
    Ok(cfg)
}

/// What is wrong with one value; the caller says where the value came from.
#[derive(Debug)]
struct Problem(String);

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether `value` is good for `key` on its own, by the same serde code that reads the
/// whole file.
fn check(key: &str, value: &toml::Value) -> Result<(), Problem> {
    let mut one = toml::Table::new();
    one.insert(key.to_owned(), value.clone());
    toml::Value::Table(one)
        .try_into::<AgentConfig>()
        .map(drop)
        // toml puts "in `key`" on a line of its own; one problem is one line.
        .map_err(|e| {
            Problem(
                e.to_string()
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" "),
            )
        })
}

/// The TOML value a flag or variable stands for.
fn cli_value(v: &CliValue) -> Result<toml::Value, Problem> {
    let key = v.setting.key;
    match v.setting.how {
        How::Switch => Ok(toml::Value::Boolean(true)),
        How::SwitchOff => Ok(toml::Value::Boolean(false)),
        How::List => Ok(toml::Value::Array(
            v.values.iter().cloned().map(toml::Value::String).collect(),
        )),
        How::Map => {
            let mut t = toml::Table::new();
            for pair in &v.values {
                let Some((k, val)) = pair.split_once('=') else {
                    return Err(Problem(format!("wants KEY=VALUE, got {pair:?}")));
                };
                t.insert(k.to_owned(), toml::Value::String(val.to_owned()));
            }
            Ok(toml::Value::Table(t))
        }
        How::Value | How::Secret => {
            let Some(raw) = v.values.last() else {
                return Err(Problem("a value is required".into()));
            };
            // A number or boolean where the key takes one (`--max-uploads 8`),
            // otherwise the text (`--node-name 8` stays a name).
            Ok(literal(raw)
                .filter(|lit| check(key, lit).is_ok())
                .unwrap_or_else(|| toml::Value::String(raw.clone())))
        }
        How::FileOnly => Err(Problem(format!(
            "{key} is set in the configuration file only"
        ))),
    }
}

/// The registry and the `[registries."host"]` keys one registry flag value sets.
/// A refused value is not echoed: it may hold a password.
fn registry_entry(field: RegistryField, raw: &str) -> Result<(String, toml::Table), Problem> {
    let text = |v: &str| toml::Value::String(v.to_owned());
    let mut keys = toml::Table::new();
    if field == RegistryField::SkipVerify {
        let host = raw.trim();
        if host.is_empty() || host.contains('=') {
            return Err(Problem(format!("wants a REGISTRY, got {raw:?}")));
        }
        keys.insert("skip_verify".into(), toml::Value::Boolean(true));
        return Ok((host.to_owned(), keys));
    }
    // Paths are trimmed (as in a comma-separated variable); a URL or a password is
    // taken as written.
    let trim = matches!(
        field,
        RegistryField::CaFile | RegistryField::ClientCert | RegistryField::ClientKey
    );
    let split = raw
        .split_once('=')
        .map(|(h, v)| if trim { (h.trim(), v.trim()) } else { (h, v) })
        .filter(|(h, v)| !h.trim().is_empty() && !v.is_empty());
    let (host, value) = match (field, split) {
        (RegistryField::Credentials, Some((_, up))) if !up.contains(':') => {
            return Err(Problem("wants REGISTRY=USER:PASSWORD".into()))
        }
        (_, Some(pair)) => pair,
        (RegistryField::Endpoint, None) => {
            return Err(Problem(format!("wants REGISTRY=URL, got {raw:?}")))
        }
        (RegistryField::Credentials, None) => {
            return Err(Problem("wants REGISTRY=USER:PASSWORD".into()))
        }
        (_, None) => return Err(Problem(format!("wants REGISTRY=PATH, got {raw:?}"))),
    };
    match field {
        RegistryField::Endpoint => keys.insert("endpoint".into(), text(value)),
        RegistryField::Credentials => {
            let (user, password) = value.split_once(':').unwrap_or((value, ""));
            keys.insert("username".into(), text(user));
            keys.insert("password".into(), text(password))
        }
        RegistryField::CaFile => keys.insert("ca_file".into(), text(value)),
        RegistryField::ClientCert => keys.insert("client_cert".into(), text(value)),
        RegistryField::ClientKey => keys.insert("client_key".into(), text(value)),
        RegistryField::SkipVerify => None,
    };
    Ok((host.to_owned(), keys))
}

fn literal(raw: &str) -> Option<toml::Value> {
    let t = raw.trim();
    if let Ok(i) = t.parse::<i64>() {
        Some(toml::Value::Integer(i))
    } else if let Ok(f) = t.parse::<f64>() {
        Some(toml::Value::Float(f))
    } else {
        t.parse::<bool>().ok().map(toml::Value::Boolean)
    }
}

/// `, did you mean "cache_budget"?` for `cache-budget` or `Cache_Budget`.
fn near_miss(key: &str) -> String {
    let folded = key.replace('-', "_").to_ascii_lowercase();
    super::SETTINGS
        .iter()
        .find(|s| s.key == folded)
        .map(|s| format!(", did you mean {:?}?", s.key))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn given(key: &str, from_env: bool, values: &[&str]) -> CliValue {
        CliValue {
            setting: Setting::find(key).expect("a setting"),
            from_env,
            values: values.iter().map(|v| v.to_string()).collect(),
        }
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(f.path(), text).expect("write");
        f
    }

    #[test]
    fn every_bad_value_names_its_source_and_all_come_at_once() {
        let f = file("cache_budget = \"lots\"\ncache-dir = \"/x\"\ngc_low_watermark = 0.95\n");
        let path = f.path().display().to_string();
        let err = load(
            Some(f.path()),
            &[
                given("max_uploads", true, &["many"]),
                given("min_free", false, &["1 parsec"]),
                given("labels", false, &["rack"]),
            ],
            &[RegistryCliValue {
                field: RegistryField::Credentials,
                source: Source::Env("STARLING_REGISTRY_CREDENTIALS"),
                values: vec!["reg.example=pw-SECRET".into()],
            }],
        )
        .expect_err("refused")
        .to_string();
        for part in [
            format!("{path}: cache_budget:"),
            format!("{path}: unknown key \"cache-dir\", did you mean \"cache_dir\"?"),
            "environment variable STARLING_MAX_UPLOADS:".to_owned(),
            "flag --min-free:".to_owned(),
            "flag --label: wants KEY=VALUE, got \"rack\"".to_owned(),
            "environment variable STARLING_REGISTRY_CREDENTIALS: wants REGISTRY=USER:PASSWORD"
                .to_owned(),
            // validate() on the rest, with the file named as the watermark's source.
            format!("gc_low_watermark 0.95 (file {path})"),
        ] {
            assert!(err.contains(&part), "{part:?} missing from:\n{err}");
        }
        assert!(err.contains("7 problem(s)"), "{err}");
        assert!(
            !err.contains("SECRET"),
            "a refused credential is not echoed: {err}"
        );
    }

    #[test]
    fn flags_beat_variables_beat_the_file_and_lists_add_up() {
        let f = file(
            "cache_budget = \"1GiB\"\nmax_uploads = 2\npin = [\"a/b:1\"]\n[labels]\npool = \"x\"\n",
        );
        let cfg = load(
            Some(f.path()),
            &[
                given("cache_budget", false, &["3GiB"]),
                given("max_uploads", true, &["8"]),
                given("pin", false, &["c/d:2"]),
                given("labels", true, &["rack=r1"]),
                given("node_name", false, &["42"]),
                given("prefetch_layers", false, &[]),
            ],
            &[],
        )
        .expect("loads");
        assert_eq!(cfg.cache_budget.bytes(), 3 << 30);
        assert_eq!(cfg.max_uploads, 8);
        assert_eq!(cfg.pin, ["a/b:1", "c/d:2"]);
        assert_eq!(cfg.labels.len(), 2);
        assert_eq!(cfg.node_name, "42");
        assert!(!cfg.prefetch_layers);
        assert_eq!(
            cfg.sources.get("cache_budget"),
            Some(&Source::Flag("--cache-budget"))
        );
        assert_eq!(
            cfg.sources.get("max_uploads"),
            Some(&Source::Env("STARLING_MAX_UPLOADS"))
        );
        assert_eq!(
            cfg.sources.get("pin"),
            Some(&Source::Flag("--pin")),
            "the last layer to touch a key is its source"
        );
        assert_eq!(cfg.sources.get("tag_ttl"), None, "a default has no source");
    }

    #[test]
    fn validate_names_the_source_of_each_problem() {
        let f = file("[registries.\"reg.example\"]\nendpoint = \"ftp://reg\"\n");
        let mut cfg = load(
            Some(f.path()),
            &[
                given("cache_budget", false, &["0"]),
                given("metrics_token", true, &["t"]),
            ],
            &[RegistryCliValue {
                field: RegistryField::Endpoint,
                source: Source::Flag("--registry-endpoint"),
                values: vec!["other.example=ftp://other".into()],
            }],
        )
        .expect("loads: each value is well-formed");
        cfg.sources
            .set("piece_size", Source::Env("STARLING_PIECE_SIZE"));
        cfg.piece_size = oci::size::SizeOrAuto::Size(oci::size::ByteSize(1000));
        let err = cfg.validate().expect_err("invalid").to_string();
        let path = f.path().display().to_string();
        for part in [
            "cache_budget (flag --cache-budget): must be more than 0".to_owned(),
            "metrics_token (environment variable STARLING_METRICS_TOKEN)".to_owned(),
            format!("registries.\"reg.example\".endpoint \"ftp://reg\" (file {path})"),
            "registries.\"other.example\".endpoint \"ftp://other\" (flag --registry-endpoint)"
                .to_owned(),
            "piece_size (environment variable STARLING_PIECE_SIZE)".to_owned(),
        ] {
            assert!(err.contains(&part), "{part:?} missing from:\n{err}");
        }
    }

    #[test]
    fn every_setting_with_a_flag_has_help_and_its_own_variable() {
        let mut seen = std::collections::HashSet::new();
        for s in super::super::SETTINGS {
            if s.has_flag() {
                assert!(
                    seen.insert(s.flag) && seen.insert(s.env),
                    "{} reused",
                    s.key
                );
            }
            assert!(!s.help().is_empty(), "{}", s.key);
            if s.has_flag() {
                assert!(s.flag.starts_with("--"), "{}", s.key);
                assert!(s.env.starts_with("STARLING_"), "{}", s.key);
            }
        }
    }
}
