//! Writes the seed inputs (`fuzzcheck::seeds`) to `fuzz/corpus/<target>/seed-<name>`:
//! `cargo run -p fuzzcheck --example write_seeds [DIR]` (DIR defaults to the
//! workspace's `fuzz/corpus`). Existing files are left alone; seeds are overwritten.

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let dir = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus"));
    let mut n = 0;
    for (target, name, bytes) in fuzzcheck::seeds::seeds() {
        let d = dir.join(target);
        std::fs::create_dir_all(&d)?;
        std::fs::write(d.join(format!("seed-{name}")), bytes)?;
        n += 1;
    }
    println!("wrote {n} seeds under {}", dir.display());
    Ok(())
}
