//! Simulated time is deterministic, so these assert on simulated seconds (never on
//! wall-clock time).
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use std::path::Path;

use sim::scenario::{Kind, Scenario, StrategySpec};
use sim::{simulate, Outcome};

const MIB: f64 = 1048576.0;

fn scenario(nodes: usize, layers: &str, extra: &str) -> Scenario {
    let text = format!(
        r#"
name = "t"
[cluster]
nodes = {nodes}
nic_up = "10GB/s"
nic_down = "10GB/s"
[registry]
egress = "100MiB/s"
latency_ms = 0
[starling]
upload_limit = "50MiB/s"
download_limit = "50MiB/s"
peer_latency_ms = 0
[image]
layers = [{layers}]
[job]
nodes = {nodes}
{extra}
[[strategy]]
kind = "direct"
"#
    );
    Scenario::parse(&text, Path::new(".")).expect("scenario parses")
}

fn spec(kind: Kind) -> StrategySpec {
    StrategySpec {
        name: None,
        kind,
        transport: None,
        prewarm_fraction: 0.0,
        cached_fraction: 0.0,
        changed_layers: None,
    }
}

fn max(o: &Outcome) -> f64 {
    o.ready_s.iter().copied().fold(0.0, f64::max)
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs()
}

#[test]
fn direct_pulls_match_the_closed_form_within_2_percent() {
    for n in [1usize, 4, 16, 64] {
        let sc = scenario(
            n,
            r#"{ name = "a", size = "512MiB" }, { name = "b", size = "256MiB" }"#,
            "",
        );
        let o = simulate(&sc, &spec(Kind::Direct), n).expect("runs");
        let s = 768.0 * MIB;
        // One node alone is bounded by its link, not the registry.
        let closed = (n as f64 * s / (100.0 * MIB)).max(s / 10e9);
        assert!(
            close(max(&o), closed, 0.02),
            "n={n}: simulated {} s vs N·S/U {closed} s",
            max(&o)
        );
        assert_eq!(o.ready_s.len(), n);
        assert!(
            close(o.registry_bytes, n as f64 * s, 1e-9),
            "direct registry egress is N·S"
        );
    }
}

#[test]
fn p2p_is_above_the_physical_limit_and_within_a_sane_factor() {
    let n = 16;
    let sc = scenario(n, r#"{ name = "a", size = "256MiB" }"#, "");
    let s = 256.0 * MIB;
    let (u_origin, u_node, d_node) = (100.0 * MIB, 50.0 * MIB, 50.0 * MIB);
    let t_star = (s / u_origin)
        .max(s / d_node)
        .max(n as f64 * s / (u_origin + n as f64 * u_node));
    let o = simulate(&sc, &spec(Kind::P2p), n).expect("runs");
    let t = max(&o);
    assert!(
        t >= t_star * 0.999,
        "P2P {t} s beats the physical limit {t_star} s"
    );
    assert!(t <= 4.0 * t_star, "P2P {t} s vs T* {t_star} s");
    assert!(t < n as f64 * s / u_origin, "P2P beats direct pulls here");
}

#[test]
fn p2p_registry_egress_is_one_copy_and_one_source_per_blob() {
    let n = 8;
    let sc = scenario(
        n,
        r#"{ name = "a", size = "64MiB" }, { name = "b", size = "32MiB" }"#,
        "",
    );
    let o = simulate(&sc, &spec(Kind::P2p), n).expect("runs");
    assert!(
        close(o.registry_bytes, 96.0 * MIB, 1e-9),
        "registry bytes {}",
        o.registry_bytes
    );
    assert_eq!(o.source_elections, 2, "one source per layer");
    // The tracker spreads sources over nodes (`source_defer_ms`): a node already
    // fetching a blob from the registry is not elected for the next one.
    assert_eq!(
        o.source_bytes.len(),
        2,
        "one agent per blob: {:?}",
        o.source_bytes
    );
    let mut streamed: Vec<f64> = o.source_bytes.values().copied().collect();
    streamed.sort_by(f64::total_cmp);
    assert_eq!(
        streamed,
        vec![32.0 * MIB, 64.0 * MIB],
        "each blob streamed once"
    );
    assert_eq!(o.counters.not_held_rejects, 0);
    assert_eq!(o.stuck, 0);
    // Every other node received each byte once (plus endgame duplicates).
    let needed = (n - 1) as f64 * 96.0 * MIB;
    assert!(
        o.p2p_bytes >= needed && o.p2p_bytes <= needed * 1.2,
        "p2p bytes {} vs {needed}",
        o.p2p_bytes
    );
}

#[test]
fn small_blobs_go_direct_even_under_p2p() {
    let n = 4;
    let sc = scenario(n, r#"{ name = "tiny", size = "512KiB" }"#, "");
    assert!(sc.starling.min_p2p_size.0 > 512 << 10);
    let o = simulate(&sc, &spec(Kind::P2p), n).expect("runs");
    assert!(
        close(o.registry_bytes, 2.0 * MIB, 1e-9),
        "below min_p2p_size every node pulls directly"
    );
    assert_eq!(o.p2p_bytes, 0.0);
}

#[test]
fn warm_cache_moves_nothing_and_code_update_moves_only_the_app_layer() {
    let n = 8;
    let sc = scenario(
        n,
        r#"{ name = "base", size = "512MiB" }, { name = "app", size = "64MiB" }"#,
        "[job.x]\n".trim_end_matches("[job.x]\n"),
    );
    let mut warm = spec(Kind::CodeUpdate);
    warm.changed_layers = Some(vec![]);
    let o = simulate(&sc, &warm, n).expect("runs");
    assert_eq!(o.registry_bytes, 0.0);
    assert_eq!(o.p2p_bytes, 0.0);
    assert_eq!(max(&o), 0.0);

    let mut code = spec(Kind::CodeUpdate);
    code.changed_layers = Some(vec!["app".into()]);
    let o = simulate(&sc, &code, n).expect("runs");
    assert!(
        close(o.registry_bytes, 64.0 * MIB, 1e-9),
        "only the app layer leaves the registry: {}",
        o.registry_bytes
    );
    assert!(
        o.p2p_bytes <= (n - 1) as f64 * 64.0 * MIB * 1.2,
        "only app-layer pieces move between agents: {}",
        o.p2p_bytes
    );
    let cold = simulate(&sc, &spec(Kind::P2p), n).expect("runs");
    assert!(
        max(&o) < max(&cold) / 3.0,
        "a code change is much faster than a cold pull"
    );

    let mut code_direct = code.clone();
    code_direct.transport = Some(sim::scenario::Transport::Direct);
    let o = simulate(&sc, &code_direct, n).expect("runs");
    assert!(close(o.registry_bytes, n as f64 * 64.0 * MIB, 1e-9));
}

#[test]
fn shared_cache_fetches_once_and_prewarm_and_locality_help() {
    let n = 16;
    let mut sc = scenario(n, r#"{ name = "a", size = "256MiB" }"#, "");
    sc.cluster.nodes = Some(64);
    // One geometry for both runs: a swarm that prewarmed seeds start (their seeding
    // heartbeats propose no piece size) would get the tracker's rule for an unknown
    // link, 8 MiB here, against the 1 MiB a cold pull's source proposes at 50 MiB/s.
    sc.starling.piece_size = Some(sim::scenario::Bytes(1 << 20));
    let o = simulate(&sc, &spec(Kind::SharedCache), n).expect("runs");
    assert!(close(o.registry_bytes, 256.0 * MIB, 1e-9));
    let cold_run = simulate(&sc, &spec(Kind::P2p), n).expect("runs");
    let mut pre = spec(Kind::P2pPrewarm);
    pre.prewarm_fraction = 0.25;
    let o = simulate(&sc, &pre, n).expect("runs");
    assert_eq!(
        o.ready_s.iter().filter(|&&t| t == 0.0).count(),
        4,
        "prewarmed nodes are ready at once"
    );
    // The cold swarm is already near the nodes' download bound (5.12 s here), so the
    // rest cannot finish much sooner; what prewarm buys is the nodes that start ready
    // and a job that reads nothing from the registry.
    let mean = |o: &Outcome| o.ready_s.iter().sum::<f64>() / o.ready_s.len() as f64;
    assert!(
        mean(&o) < mean(&cold_run),
        "{} vs {}",
        mean(&o),
        mean(&cold_run)
    );
    assert_eq!(
        o.registry_bytes, 0.0,
        "the job reads nothing from the registry"
    );
    assert!(
        max(&o) <= max(&cold_run) * 1.1,
        "{} vs {}",
        max(&o),
        max(&cold_run)
    );
    let mut loc = spec(Kind::Locality);
    loc.cached_fraction = 0.25; // 16 of 64 cluster nodes hold the image: the whole job lands there
    let o = simulate(&sc, &loc, n).expect("runs");
    assert_eq!(o.registry_bytes, 0.0);
    assert_eq!(max(&o), 0.0);
}

#[test]
fn quantum_mode_stays_close_to_exact_mode() {
    let n = 24;
    let mut sc = scenario(
        n,
        r#"{ name = "a", size = "192MiB" }, { name = "b", size = "64MiB" }"#,
        "",
    );
    let exact = simulate(&sc, &spec(Kind::P2p), n).expect("runs");
    sc.sim.quantum_ms = 10.0;
    let approx = simulate(&sc, &spec(Kind::P2p), n).expect("runs");
    assert!(
        close(max(&approx), max(&exact), 0.10),
        "quantum {} s vs exact {} s",
        max(&approx),
        max(&exact)
    );
    assert!(
        approx.steps <= exact.steps,
        "steps {} vs exact {}",
        approx.steps,
        exact.steps
    );
}

#[test]
fn runs_are_deterministic() {
    let sc = scenario(12, r#"{ name = "a", size = "128MiB" }"#, "");
    let a = simulate(&sc, &spec(Kind::P2p), 12).expect("runs");
    let b = simulate(&sc, &spec(Kind::P2p), 12).expect("runs");
    assert_eq!(a.ready_s, b.ready_s);
    assert_eq!(a.p2p_bytes, b.p2p_bytes);
}

#[test]
fn scenario_errors_are_clear() {
    let base = |extra: &str, strategy: &str| {
        format!(
            "[cluster]\nnic_up = \"1Gbit/s\"\nnic_down = \"1Gbit/s\"\n{extra}\n[registry]\negress = \"1Gbit/s\"\n[image]\nlayers = [{{ name = \"base\", size = \"1GB\" }}, {{ name = \"app\", size = \"1GB\" }}]\n[job]\nnodes = 4\n{strategy}"
        )
    };
    let err = |t: &str| {
        Scenario::parse(t, Path::new("."))
            .expect_err("must fail")
            .to_string()
    };
    let e = err(&base("", "[[strategy]]\nkind = \"p2p\"\nbogus = 1\n"));
    assert!(e.contains("bogus"), "{e}");
    let e = err(&base("", "[[strategy]]\nkind = \"teleport\"\n"));
    assert!(e.contains("teleport") && e.contains("p2p"), "{e}");
    let e = err(&base(
        "disk_write = \"fast\"",
        "[[strategy]]\nkind = \"p2p\"\n",
    ));
    assert!(e.contains("fast"), "{e}");
    let e = err(&base(
        "disk_write = \"5 furlongs/s\"",
        "[[strategy]]\nkind = \"p2p\"\n",
    ));
    assert!(e.contains("unknown rate unit"), "{e}");
    let e = err(&base(
        "",
        "[[strategy]]\nkind = \"code_update\"\nchanged_layers = [\"ap\"]\n",
    ));
    assert!(e.contains("`ap`") && e.contains("base, app"), "{e}");
    let e = err(&base("", "[[strategy]]\nkind = \"code_update\"\n"));
    assert!(e.contains("changed_layers"), "{e}");
    let e = err(&base("nodes = 2", "[[strategy]]\nkind = \"p2p\"\n"));
    assert!(e.contains("smaller than job.nodes"), "{e}");
    let e = err(&base("", ""));
    assert!(e.contains("strategy"), "{e}");
    let e = err(&base(
        "",
        "[[strategy]]\nkind = \"p2p_prewarm\"\nprewarm_fraction = 1.5\n",
    ));
    assert!(e.contains("[0, 1]"), "{e}");
}

#[test]
fn shipped_scenarios_parse() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scenarios");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("scenarios/ exists") {
        let p = entry.expect("entry").path();
        if p.extension().is_some_and(|e| e == "toml") {
            Scenario::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            seen += 1;
        }
    }
    assert!(seen >= 6, "expected the shipped scenarios, found {seen}");
}

#[test]
fn oci_layout_layers_are_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let blobs = dir.path().join("blobs/sha256");
    std::fs::create_dir_all(&blobs).expect("mkdir");
    let manifest = r#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000","size":2},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:1111111111111111111111111111111111111111111111111111111111111111","size":7000000000},{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:2222222222222222222222222222222222222222222222222222222222222222","size":1000000000}]}"#;
    let d = oci::Digest::of(manifest.as_bytes());
    std::fs::write(blobs.join(d.hex()), manifest).expect("write");
    let index = format!(
        r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{d}","size":{},"annotations":{{"org.opencontainers.image.ref.name":"v1"}}}}]}}"#,
        manifest.len()
    );
    std::fs::write(dir.path().join("index.json"), index).expect("write");
    std::fs::write(
        dir.path().join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .expect("write");
    let text = format!(
        "[cluster]\nnic_up = \"1Gbit/s\"\nnic_down = \"1Gbit/s\"\n[registry]\negress = \"1Gbit/s\"\n[image]\noci_layout = {:?}\nreference = \"v1\"\n[job]\nnodes = 2\n[[strategy]]\nkind = \"direct\"\n",
        dir.path().display().to_string()
    );
    let sc = Scenario::parse(&text, Path::new(".")).expect("parses");
    let sizes: Vec<u64> = sc.image.layers.iter().map(|l| l.size.0).collect();
    assert_eq!(sizes, vec![7_000_000_000, 1_000_000_000]);
}

#[test]
fn cli_report_has_json_and_svgs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let scen = dir.path().join("s.toml");
    std::fs::write(
        &scen,
        "name = \"cli\"\n[cluster]\nnic_up = \"1GB/s\"\nnic_down = \"1GB/s\"\n[registry]\negress = \"100MB/s\"\n[image]\nlayers = [{ name = \"a\", size = \"100MB\" }]\n[job]\nnodes = 4\nsweep_nodes = [2, 4]\n[[strategy]]\nkind = \"direct\"\n[[strategy]]\nkind = \"p2p\"\n",
    )
    .expect("write");
    let args = sim::SimArgs {
        scenario: scen,
        json: false,
        svg_dir: Some(dir.path().join("svg")),
        nodes: None,
        strategies: vec![],
        piece_size: None,
        seed: None,
        quantum_ms: None,
        registry_egress: None,
        node_limit: None,
        oci_layout: None,
        no_topology: false,
        sweep: None,
        no_sweep: false,
    };
    let sc = sim::cli::load(&args).expect("loads");
    let rep = sim::cli::simulate_all(&sc).expect("runs");
    let json = serde_json::to_value(&rep).expect("json");
    assert_eq!(json["results"][0]["strategy"], "direct");
    assert!(
        (json["results"][0]["max_s"].as_f64().unwrap_or(0.0) - 4.0).abs() < 0.05,
        "4 x 100 MB at 100 MB/s"
    );
    assert!(json["peak_rss_kib"].as_u64().is_some());
    assert_eq!(rep.sweep.len(), 4);
    let files = rep.write_svgs(&dir.path().join("svg")).expect("svgs");
    assert_eq!(files.len(), 2);
    for f in files {
        let text = std::fs::read_to_string(&f).expect("read");
        assert!(
            text.starts_with("<svg") && text.contains("polyline"),
            "{}",
            f.display()
        );
    }
    assert!(rep.table().contains("p2p"));
    assert_eq!(sim::run(&args).expect("run"), 0);
}

/// A job of `n` nodes where `seeds` of them hold the image (prewarmed) and the others
/// pull it from them, with the given `[starling]` lines.
fn seeded(n: usize, seeds: usize, layers: &str, starling: &str) -> (Scenario, StrategySpec) {
    let text = format!(
        r#"
name = "t"
[cluster]
nodes = {n}
nic_up = "10GB/s"
nic_down = "10GB/s"
[registry]
egress = "100MiB/s"
[starling]
{starling}
[image]
layers = [{layers}]
[job]
nodes = {n}
[[strategy]]
kind = "direct"
"#
    );
    let sc = Scenario::parse(&text, Path::new(".")).expect("scenario parses");
    let mut pre = spec(Kind::P2pPrewarm);
    pre.prewarm_fraction = seeds as f64 / n as f64;
    (sc, pre)
}

#[test]
fn the_request_budget_caps_requests_in_flight() {
    // One seed, one puller, 64 pieces of 1 MiB, 50 ms each way between agents: with a
    // budget of 1 the puller has one request out (and its urgent read head, which the
    // budget does not count) and pays the round trip per piece; with 16 it overlaps.
    let run = |budget: u32| {
        let (sc, pre) = seeded(
            2,
            1,
            r#"{ name = "a", size = "64MiB" }"#,
            &format!("peer_latency_ms = 50\npiece_size = \"1MiB\"\nmax_piece_requests = {budget}"),
        );
        let o = simulate(&sc, &pre, 2).expect("runs");
        assert_eq!(o.stuck, 0);
        (max(&o), o.counters.peak_requests)
    };
    let (one, peak_one) = run(1);
    let (many, peak_many) = run(16);
    assert_eq!(peak_one, 1, "never more than the budget");
    assert!(
        (8..=16).contains(&peak_many),
        "the budget is used: {peak_many}"
    );
    // 64 pieces, at most 2 per 100 ms round trip.
    assert!(one >= 64.0 / 2.0 * 0.100 * 0.9, "one at a time: {one} s");
    assert!(
        many < one / 2.0,
        "16 in flight {many} s vs 1 in flight {one} s"
    );
}

#[test]
fn haves_make_pieces_requestable_without_waiting_for_announces() {
    // Announces once a minute: peers learn what others hold only from bitfields and
    // HAVEs on their channels, and still trade pieces as they arrive.
    let n = 6;
    let mut sc = scenario(n, r#"{ name = "a", size = "64MiB" }"#, "");
    sc.starling.announce_interval_ms = 60_000;
    let o = simulate(&sc, &spec(Kind::P2p), n).expect("runs");
    assert_eq!(o.stuck, 0);
    let t = max(&o);
    assert!(t < 10.0, "done long before a second announce: {t} s");
    assert!(o.counters.haves > 0);
    assert!(
        o.counters.announces < 4 * n as u64 * 2,
        "hardly any announces: {}",
        o.counters.announces
    );
    // Each non-source node got the blob once from peers (not only from the source).
    let needed = (n - 1) as f64 * 64.0 * MIB;
    assert!(o.p2p_bytes >= needed, "p2p bytes {}", o.p2p_bytes);
}

#[test]
fn a_holders_line_sends_fresh_pieces_before_second_copies() {
    // One seed sending one piece at a time, six pullers asking it for everything:
    // its line serves the request for the piece it has sent the fewest times first
    // (urgent read heads aside), so the swarm gets every piece from it once before
    // it spends its uplink on copies. A window of 4 per peer: with the default 2, one
    // of which a puller's read head takes, a request for a piece the seed has since
    // sent to another puller blocks that puller from asking for a fresh one, and the
    // line has only second copies to choose from. No slot beyond the one for urgent
    // requests: this is about the line's order, not about read heads overtaking it.
    let (mut sc, pre) = seeded(
        7,
        1,
        r#"{ name = "a", size = "32MiB" }"#,
        "peer_latency_ms = 1\nmin_window = 4\npiece_size = \"1MiB\"\nmax_uploads = 1\nurgent_upload_slots = 0\nupload_limit = \"20MiB/s\"",
    );
    sc.sim.trace = true;
    let o = simulate(&sc, &pre, 7).expect("runs");
    assert_eq!(o.stuck, 0);
    let seeds: std::collections::BTreeSet<u32> =
        (0..7).filter(|&i| o.ready_s[i as usize] == 0.0).collect();
    let mine: Vec<&sim::UploadRecord> = o
        .uploads
        .iter()
        .filter(|u| seeds.contains(&u.holder) && !u.urgent)
        .collect();
    // Among the line's ordinary requests (read heads jump it, in piece order), every
    // piece sent for the first time goes before the second copies: a repeat followed
    // by a first send means a stale request was served while a fresh one waited.
    let last_first = mine
        .iter()
        .enumerate()
        .filter(|(k, u)| mine[..*k].iter().all(|v| v.piece != u.piece))
        .map(|(k, _)| k)
        .next_back()
        .unwrap_or(0);
    let mut seen = std::collections::BTreeSet::new();
    let mut repeats_before_all = 0;
    for u in &mine[..=last_first] {
        if !seen.insert(u.piece) {
            repeats_before_all += 1;
        }
    }
    let sent: std::collections::BTreeSet<u32> = o
        .uploads
        .iter()
        .filter(|u| seeds.contains(&u.holder))
        .map(|u| u.piece)
        .collect();
    assert_eq!(
        sent.len(),
        swarm::PieceLayout::new(32 * MIB as u64, MIB as u64).count() as usize,
        "only the seed held pieces at first: each left it"
    );
    // A few races remain (three with the head piece, whose read heads finish sooner;
    // two before it); a line in arrival order repeats most of its six pullers' windows.
    assert!(
        repeats_before_all <= 3,
        "second copies before every piece went out once: {repeats_before_all} ({:?})",
        mine.iter().map(|u| u.piece).collect::<Vec<_>>()
    );
}

#[test]
fn a_source_reads_disjoint_slices_over_several_registry_connections() {
    // A 1 GiB blob, a registry that gives each connection 100 MiB/s of its 1 GiB/s:
    // the source reads over several connections (`registry_streams_for`: one per
    // 256 MiB, at most `registry_streams`), each a run of neighbouring pieces near the
    // front, a new Range GET per run (`plan_registry_runs`), and the registry sends one
    // copy. One connection reads the whole blob in one GET.
    let run = |streams: u32| {
        let mut sc = scenario(2, r#"{ name = "a", size = "1GiB" }"#, "");
        sc.registry.egress = sim::scenario::Rate(1024.0 * MIB);
        sc.registry.per_connection = Some(sim::scenario::Rate(100.0 * MIB));
        sc.starling.upload_limit = None;
        sc.starling.download_limit = None;
        sc.starling.registry_streams = streams;
        let o = simulate(&sc, &spec(Kind::P2p), 2).expect("runs");
        assert_eq!(o.stuck, 0);
        assert!(
            close(o.registry_bytes, 1024.0 * MIB, 1e-9),
            "one copy: {}",
            o.registry_bytes
        );
        (
            o.ready_s.iter().copied().fold(f64::INFINITY, f64::min),
            o.registry_connections,
        )
    };
    let (four, conns) = run(4);
    // More GETs than connections (runs are bounded), none shorter than 16 MiB.
    assert!((5..=1024 / 16).contains(&conns), "{conns} registry GETs");
    assert!(close(four, 1024.0 / 400.0, 0.05), "4 × 100 MiB/s: {four} s");
    let (one, conns) = run(1);
    assert_eq!(conns, 1);
    assert!(close(one, 1024.0 / 100.0, 0.05), "one connection: {one} s");
}

#[test]
fn old_protocol_keys_are_accepted_and_reported() {
    let sc = scenario(2, r#"{ name = "a", size = "8MiB" }"#, "");
    assert!(sc.warnings.is_empty());
    let text = "[cluster]\nnic_up = \"1Gbit/s\"\nnic_down = \"1Gbit/s\"\n[registry]\negress = \"1Gbit/s\"\n[starling]\nupload_wait_ms = 1000\nhead_requests = 4\nmax_inflight_per_peer = 3\n[image]\nlayers = [{ name = \"a\", size = \"1GB\" }]\n[job]\nnodes = 2\n[[strategy]]\nkind = \"p2p\"\n";
    let sc = Scenario::parse(text, Path::new(".")).expect("old keys still load");
    assert_eq!(sc.warnings.len(), 2, "{:?}", sc.warnings);
    assert_eq!(
        sc.starling.min_window, 3,
        "max_inflight_per_peer is min_window"
    );
    assert!(
        sc.starling.piece_size.is_none(),
        "pieces by the agent's rule"
    );
}

#[test]
fn defaults_are_the_agents() {
    let d = sim::scenario::Starling::default();
    let u = swarm::upload::UploadConfig::default();
    let c = swarm::scheduler::SchedulerConfig::default();
    let t = swarm::SwarmConfig::default();
    assert_eq!(d.max_uploads as usize, u.max_active);
    assert_eq!(d.upload_queue as usize, u.max_queued_per_conn);
    assert_eq!(d.upload_queue_total as usize, u.max_queued_total);
    assert_eq!(d.max_piece_requests, swarm::upload::DEFAULT_REQUEST_BUDGET);
    assert_eq!(d.registry_streams, swarm::pieces::DEFAULT_REGISTRY_STREAMS);
    assert_eq!(
        (d.min_window, d.max_window, d.window_ms),
        (c.min_window, c.max_window, c.window_ms)
    );
    assert_eq!(d.announce_interval_ms, t.announce_interval_ms);
    assert_eq!(d.stripe_min_members, t.stripe_min_members);
    assert!(
        d.prefetch_layers,
        "the agent prefetches layers unless told not to"
    );
    assert_eq!(
        d.prefetch_grace_ms,
        swarm::prefetch::DEFAULT_PREFETCH_GRACE_MS
    );
}

#[test]
fn an_upload_slot_is_held_until_the_body_is_in_the_socket() {
    // One seed with a single upload slot, two pullers, a one-piece blob (so the
    // pullers cannot trade pieces before one of them has it all), a download limit 20×
    // below the upload limit. The agent holds the slot until the body's last byte is
    // in the socket (serve.rs): with small socket buffers only one body crosses the
    // seed at a time, the other request waits in its line.
    let run = |limit: &str, buffer: &str| {
        let (sc, pre) = seeded(
            3,
            1,
            r#"{ name = "a", size = "64MiB" }"#,
            &format!(
                "peer_latency_ms = 0\npiece_size = \"64MiB\"\nmax_uploads = 1\nsocket_buffer = {buffer}\n{limit}download_limit = \"20MiB/s\"\n[sim]\nmax_seconds = 100"
            ),
        );
        let o = simulate(&sc, &pre, 3).expect("runs");
        assert_eq!(o.stuck, 0);
        let mut r = o.ready_s.clone();
        r.sort_by(f64::total_cmp);
        (r[1], r[2])
    };
    let s_over_d = 64.0 / 20.0;
    // With and without an upload limit (the bucket stage holds the slot too).
    for limit in ["upload_limit = \"400MiB/s\"\n", ""] {
        let (first, last) = run(limit, "0");
        assert!(first < 1.2 * s_over_d, "{limit}: first {first} s");
        assert!(
            last >= 1.9 * s_over_d,
            "{limit}: last {last} s vs S/D {s_over_d} s"
        );
        // Buffers that take the whole body: the slot frees as the body starts, so
        // both bodies cross at once.
        let (_, last) = run(limit, "\"64MiB\"");
        assert!(
            last < 1.5 * s_over_d,
            "{limit}: buffered, last {last} s vs S/D {s_over_d} s"
        );
    }
}

#[test]
fn registry_latency_jitter_decides_which_agents_become_sources() {
    // Every node fetches the manifest, then four swarm layers at once: the first to
    // announce a blob becomes its source, so the registry's round trip (jittered per
    // node and request, fixed by the seed) decides who the sources are.
    let layers = r#"{ name = "a", size = "32MiB" }, { name = "b", size = "32MiB" },
        { name = "c", size = "32MiB" }, { name = "d", size = "32MiB" }"#;
    let sources = |jitter: f64, seed: u64| {
        let mut sc = scenario(16, layers, "layer_concurrency = 4");
        sc.registry.latency_ms = 10.0;
        sc.registry.latency_jitter_ms = jitter;
        sc.sim.seed = seed;
        let o = simulate(&sc, &spec(Kind::P2p), 16).expect("runs");
        assert_eq!(o.source_elections, 4, "one per swarm layer");
        assert_eq!(o.stuck, 0);
        o.source_bytes.keys().cloned().collect::<Vec<_>>()
    };
    for seed in 0..2 {
        assert_ne!(
            sources(0.0, seed),
            sources(40.0, seed),
            "seed {seed}: jitter moves the elections"
        );
    }
}

#[test]
fn the_agents_layer_prefetch_starts_every_large_layer_after_the_manifest() {
    // One node, a pull client that asks for one blob at a time, and a registry that
    // takes 400 ms to answer each request: asked in turn, four layers pay four answers
    // one after another; the agent's prefetch starts them all a grace after the
    // manifest, so their answers overlap.
    let run = |prefetch: bool| {
        let text = format!(
            r#"
name = "t"
[cluster]
nodes = 1
nic_up = "10GB/s"
nic_down = "10GB/s"
[registry]
egress = "1GB/s"
latency_ms = 400
[starling]
prefetch_layers = {prefetch}
[image]
layers = [
  {{ name = "a", size = "8MiB" }}, {{ name = "b", size = "8MiB" }},
  {{ name = "c", size = "8MiB" }}, {{ name = "d", size = "8MiB" }},
]
[job]
nodes = 1
layer_concurrency = 1
[[strategy]]
kind = "p2p"
"#
        );
        let sc = Scenario::parse(&text, Path::new(".")).expect("scenario parses");
        let o = simulate(&sc, &spec(Kind::P2p), 1).expect("runs");
        assert_eq!(o.stuck, 0);
        max(&o)
    };
    let (asked_in_turn, prefetched) = (run(false), run(true));
    assert!(
        asked_in_turn > 4.0 * 0.4,
        "four registry answers in turn: {asked_in_turn:.2} s"
    );
    assert!(
        prefetched < asked_in_turn - 2.0 * 0.4,
        "the prefetched layers' answers overlap: {prefetched:.2} s against {asked_in_turn:.2} s"
    );
}
