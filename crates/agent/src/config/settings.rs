//! The agent's settings as one table: each setting is written once, in the
//! `agent_settings!` invocation in `config/mod.rs` (TOML key, type, default, help,
//! flag, environment variable), and the macro below turns that into the
//! [`AgentConfig`](super::AgentConfig) struct, its `Default`, and [`SETTINGS`], which
//! the `starling` binary turns into flags and [`load`](super::load) into layering.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// How a setting is given on the command line (and in its environment variable).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// `--flag VALUE`, parsed as the key's type.
    Value,
    /// Like `Value`, but the value is never echoed in help or error messages.
    Secret,
    /// `--flag` sets the key to `true`.
    Switch,
    /// `--no-…` sets the key to `false` (its default is `true`).
    SwitchOff,
    /// Repeatable (comma-separated in the variable); added to the file's list.
    List,
    /// Repeatable `KEY=VALUE` (comma-separated in the variable); added to the file's map.
    Map,
    /// Only in the file (nested tables); the binary may have dedicated flags for parts.
    FileOnly,
}

/// One setting: what the table in `config/mod.rs` says about it.
#[derive(Debug)]
pub struct Setting {
    /// TOML key and field name.
    pub key: &'static str,
    pub how: How,
    /// `--flag` (empty for [`How::FileOnly`]).
    pub flag: &'static str,
    /// `STARLING_…` (empty for [`How::FileOnly`]).
    pub env: &'static str,
    /// Placeholder in `--help` (`KEY=VALUE`); empty: clap's default from the key.
    pub value_name: &'static str,
    /// The doc comment, one entry per line.
    doc: &'static [&'static str],
}

impl Setting {
    #[doc(hidden)]
    pub const fn new(
        key: &'static str,
        how: How,
        cli: &'static [&'static str],
        doc: &'static [&'static str],
    ) -> Self {
        let (flag, env, value_name) = match cli {
            [flag, env] => (*flag, *env, ""),
            [flag, env, value_name] => (*flag, *env, *value_name),
            _ => ("", "", ""),
        };
        Self {
            key,
            how,
            flag,
            env,
            value_name,
            doc,
        }
    }

    /// The help text: the doc comment as one paragraph.
    pub fn help(&self) -> String {
        self.doc
            .iter()
            .map(|l| l.trim())
            .collect::<Vec<_>>()
            .join(" ")
    }

    pub fn has_flag(&self) -> bool {
        !self.flag.is_empty()
    }

    /// The setting named `key`, if any.
    pub fn find(key: &str) -> Option<&'static Setting> {
        super::SETTINGS.iter().find(|s| s.key == key)
    }
}

/// Where a setting's value came from, for messages about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The TOML file at this path.
    File(PathBuf),
    /// An environment variable.
    Env(&'static str),
    /// A command-line flag, `--cache-budget`.
    Flag(&'static str),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::File(p) => write!(f, "file {}", p.display()),
            Source::Env(v) => write!(f, "environment variable {v}"),
            Source::Flag(flag) => write!(f, "flag {flag}"),
        }
    }
}

/// Which source set each key (keys left at their default are absent). Registry entries
/// are kept as `registries."host"`, as messages name them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sources(BTreeMap<String, Source>);

impl Sources {
    pub fn set(&mut self, key: impl Into<String>, source: Source) {
        self.0.insert(key.into(), source);
    }

    pub fn get(&self, key: &str) -> Option<&Source> {
        self.0.get(key)
    }

    /// ` (flag --cache-budget)` for a key set somewhere, empty for a default, to follow
    /// the key's name in a message.
    pub fn of(&self, key: &str) -> String {
        self.get(key).map(|s| format!(" ({s})")).unwrap_or_default()
    }
}

/// Declares every setting once. Each entry: the doc comment (also the `--help` text),
/// `key: Type [optional serde attribute] = default`, then how the command line gives
/// it: `Value("--flag", "STARLING_VAR")`, `Secret(..)`, `Switch(..)`, `SwitchOff(..)`,
/// `List("--flag", "VAR", "VALUE_NAME")`, `Map(..)` or `FileOnly`. After the settings,
/// `internal { .. }` lists fields that are no setting (test switches).
macro_rules! agent_settings {
    (
        $(
            $(#[doc = $doc:literal])+
            $key:ident : $ty:ty $([$extra:meta])? = $default:expr,
                $how:ident $(( $($cli:literal),+ ))? ;
        )*
        internal {
            $(
                $(#[$imeta:meta])*
                $ikey:ident : $ity:ty = $idefault:expr ;
            )*
        }
    ) => {
        #[derive(Clone, serde::Serialize, serde::Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct AgentConfig {
            $(
                $(#[doc = $doc])+
                $(#[$extra])?
                pub $key: $ty,
            )*
            $(
                $(#[$imeta])*
                pub $ikey: $ity,
            )*
            /// Where each setting came from (flag, variable, file), for messages.
            #[serde(skip)]
            pub sources: $crate::config::settings::Sources,
        }

        impl Default for AgentConfig {
            fn default() -> Self {
                Self {
                    $( $key: $default, )*
                    $( $ikey: $idefault, )*
                    sources: Default::default(),
                }
            }
        }

        /// Every setting, in declaration order (the order of `starling agent --help`).
        pub static SETTINGS: &[$crate::config::settings::Setting] = &[
            $(
                $crate::config::settings::Setting::new(
                    stringify!($key),
                    $crate::config::settings::How::$how,
                    &[$($($cli),+)?],
                    &[$($doc),+],
                ),
            )*
        ];
    };
}

pub(crate) use agent_settings;
