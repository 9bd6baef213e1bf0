//! `cargo run --release -p sim --example sim -- scenarios/swarm16.toml [--json] [--svg-dir DIR]`
//! (the same flags as `starling sim`).
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: sim::SimArgs,
}

fn main() {
    sim::cli::reexec_with_huge_pages();
    let cli = Cli::parse();
    match sim::run(&cli.args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
