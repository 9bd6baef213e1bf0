//! `cargo run -p analyze --example analyze -- analyze IMAGE [flags]` or `... -- diff A B`.
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    Analyze(analyze::cli::AnalyzeArgs),
    Diff(analyze::cli::DiffArgs),
}

fn main() {
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Cmd::Analyze(a) => analyze::cli::run_analyze(a),
        Cmd::Diff(d) => analyze::cli::run_diff(d),
    };
    match r {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
