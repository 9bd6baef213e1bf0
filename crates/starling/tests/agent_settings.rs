//! `starling agent` settings as an operator meets them: each from a file, a variable
//! or a flag, the flag winning, and a bad one named with where it came from, all of
//! them in one message. Runs the binary with `--print-config` (or until it refuses to
//! start), so no agent is left running.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use std::process::{Command, Output};

fn agent(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_starling"));
    cmd.arg("agent").args(args);
    // Only the variables this test sets, whatever the caller's environment holds.
    for (k, _) in std::env::vars() {
        if k.starts_with("STARLING_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    cmd.output().expect("run starling agent")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn printed(out: &Output) -> toml::Table {
    assert!(out.status.success(), "{}", stderr(out));
    String::from_utf8_lossy(&out.stdout)
        .parse()
        .expect("printed TOML")
}

#[test]
fn a_flag_beats_its_variable_which_beats_the_file() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("agent.toml");
    std::fs::write(&file, "cache_budget = \"1GiB\"\nmax_uploads = 2\n").expect("write");
    let file = file.display().to_string();
    let budget = |out: &Output| printed(out)["cache_budget"].as_str().map(str::to_owned);
    let env = [
        ("STARLING_CACHE_BUDGET", "2GiB"),
        ("STARLING_CONFIG", file.as_str()),
    ];
    let out = agent(&["--cache-budget", "3GiB", "--print-config"], &env);
    assert_eq!(budget(&out).as_deref(), Some("3GiB"));
    let out = agent(&["--print-config"], &env);
    assert_eq!(budget(&out).as_deref(), Some("2GiB"));
    let out = agent(&["--config", &file, "--print-config"], &[]);
    assert_eq!(budget(&out).as_deref(), Some("1GiB"));
    assert_eq!(printed(&out)["max_uploads"].as_integer(), Some(2));
    let out = agent(&["--print-config"], &[]);
    assert_eq!(budget(&out).as_deref(), Some("100GiB"), "the default");
}

#[test]
fn bad_settings_name_the_file_key_flag_or_variable_all_at_once() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("agent.toml");
    std::fs::write(
        &file,
        "cache_budget = \"lots\"\nmax-uploads = 3\nbogus = true\n[registries.\"r.example\"]\nendpiont = \"http://r\"\n",
    )
    .expect("write");
    let path = file.display().to_string();
    let out = agent(
        &[
            "--config",
            &path,
            "--min-free",
            "1 parsec",
            "--print-config",
        ],
        &[("STARLING_MAX_UPLOADS", "many")],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    for part in [
        format!("{path}: cache_budget:"),
        format!("{path}: unknown key \"max-uploads\", did you mean \"max_uploads\"?"),
        format!("{path}: unknown key \"bogus\""),
        format!("{path}: registries:"),
        "endpiont".to_owned(),
        "flag --min-free:".to_owned(),
        "environment variable STARLING_MAX_UPLOADS:".to_owned(),
        "6 problem(s)".to_owned(),
    ] {
        assert!(err.contains(&part), "{part:?} missing from:\n{err}");
    }
}

#[test]
fn a_bad_value_from_a_variable_names_the_variable_and_a_flag_the_flag() {
    let out = agent(&["--print-config"], &[("STARLING_GC_LOW_WATERMARK", "low")]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("environment variable STARLING_GC_LOW_WATERMARK"),
        "{err}"
    );
    // The registry flags too, which fill `[registries."host"]`.
    let out = agent(
        &["--registry-skip-verify", "lab=1", "--print-config"],
        &[("STARLING_REGISTRY_ENDPOINTS", "docker.io")],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    for part in [
        "environment variable STARLING_REGISTRY_ENDPOINTS: wants REGISTRY=URL",
        "flag --registry-skip-verify: wants a REGISTRY",
    ] {
        assert!(err.contains(part), "{part:?} missing from:\n{err}");
    }
}

/// Checks on the whole configuration (`AgentConfig::validate`) name the source too.
#[test]
fn an_invalid_configuration_names_where_each_value_came_from() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("agent.toml");
    std::fs::write(&file, "gc_high_watermark = 0.5\n").expect("write");
    let path = file.display().to_string();
    let cache = dir.path().join("cache").display().to_string();
    let out = agent(
        &[
            "--config",
            &path,
            "--cache-dir",
            &cache,
            "--listen",
            "127.0.0.1:0",
            "--cache-budget",
            "0",
            "--piece-size",
            "1k",
        ],
        &[("STARLING_GC_LOW_WATERMARK", "0.9")],
    );
    assert!(!out.status.success(), "an invalid configuration started");
    let err = stderr(&out);
    for part in [
        "cache_budget (flag --cache-budget): must be more than 0".to_owned(),
        format!(
            "gc_low_watermark 0.9 (environment variable STARLING_GC_LOW_WATERMARK) / \
             gc_high_watermark 0.5 (file {path})"
        ),
        "piece_size (flag --piece-size): 1000 is outside 64KiB..=256MiB".to_owned(),
    ] {
        assert!(err.contains(&part), "{part:?} missing from:\n{err}");
    }
}

#[test]
fn a_switch_variable_takes_the_usual_spellings_of_on_and_off() {
    let prealloc = |value: &str| {
        let out = agent(&["--print-config"], &[("STARLING_PREALLOCATE", value)]);
        printed(&out)["preallocate"].as_bool()
    };
    for on in ["1", "true", "yes", "on"] {
        assert_eq!(prealloc(on), Some(true), "STARLING_PREALLOCATE={on}");
    }
    for off in ["0", "false", "no", "off"] {
        assert_eq!(prealloc(off), Some(false), "STARLING_PREALLOCATE={off}");
    }
    // A switch that turns a default off: set means off.
    let prefetch = |value: &str| {
        let out = agent(&["--print-config"], &[("STARLING_NO_PREFETCH", value)]);
        printed(&out)["prefetch_layers"].as_bool()
    };
    assert_eq!(prefetch("1"), Some(false));
    assert_eq!(prefetch("0"), Some(true));
    let out = agent(&["--print-config"], &[("STARLING_PREALLOCATE", "maybe")]);
    assert!(
        !out.status.success(),
        "a switch variable of \"maybe\" was taken"
    );
    assert!(stderr(&out).contains("maybe"), "{}", stderr(&out));
}
