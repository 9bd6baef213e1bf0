//! Simulated time is deterministic, so these assert on simulated seconds (never on
//! wall-clock time).

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
# These tests check physics (≥ T*, registry bytes, direct = N·S/U) and strategy
# orderings under the configuration they were written for (4 MiB pieces, 4 upload
# slots), independent of later tuning of the agent's defaults (1 MiB, 2 slots).
max_uploads = 4
piece_size = "4MiB"
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
    assert_eq!(o.failed_requests, 0);
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
    let o = simulate(&sc, &spec(Kind::SharedCache), n).expect("runs");
    assert!(close(o.registry_bytes, 256.0 * MIB, 1e-9));
    let cold = max(&simulate(&sc, &spec(Kind::P2p), n).expect("runs"));
    let mut pre = spec(Kind::P2pPrewarm);
    pre.prewarm_fraction = 0.25;
    let o = simulate(&sc, &pre, n).expect("runs");
    assert_eq!(
        o.ready_s.iter().filter(|&&t| t == 0.0).count(),
        4,
        "prewarmed nodes are ready at once"
    );
    assert!(max(&o) < cold);
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
/// pull it from them, with the given `[starling]` overrides (in `extra`).
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
piece_size = "4MiB"
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
fn the_agent_wide_request_cap_serialises_piece_fetches() {
    // One seed, one puller, 16 pieces of 4 MiB, 50 ms per piece request, fast links:
    // with one request at a time (`max_piece_requests = 1`, and no read-head lane) the
    // puller pays the latency 16 times over; with 4 it overlaps them. The read head's
    // own lane (`head_requests`) adds a request in flight beside the shared cap.
    let layer = r#"{ name = "a", size = "64MiB" }"#;
    let run = |cap: u32, head: u32| {
        let (sc, pre) = seeded(
            2,
            1,
            layer,
            // 4 upload slots: with the default 2, the seed would refuse the third
            // request and the puller would drop it until its next announce.
            &format!(
                "peer_latency_ms = 50\nmax_uploads = 4\nmax_piece_requests = {cap}\nhead_requests = {head}"
            ),
        );
        let o = simulate(&sc, &pre, 2).expect("runs");
        assert_eq!(o.stuck, 0);
        max(&o)
    };
    let (one, four) = (run(1, 0), run(4, 0));
    assert!(one >= 16.0 * 0.050, "one at a time: {one} s");
    assert!(
        four < one / 2.0,
        "4 in flight {four} s vs 1 in flight {one} s"
    );
    let one_and_head = run(1, 4);
    assert!(
        one_and_head < one * 0.8,
        "the read-head lane overlaps requests: {one_and_head} s vs {one} s"
    );
}

#[test]
fn an_upload_slot_is_held_until_the_body_is_in_the_socket() {
    // One seed with a single upload slot, two pullers, a one-piece blob (so the
    // pullers cannot trade pieces before one of them has it all), a 20× slower download
    // limit than the upload limit. The agent holds the slot until the body's last byte
    // is in the socket (serve.rs).
    let run = |limit: &str, buffer: &str| {
        let (mut sc, pre) = seeded(
            3,
            1,
            r#"{ name = "a", size = "64MiB" }"#,
            &format!(
                "peer_latency_ms = 0\nmax_uploads = 1\nsocket_buffer = {buffer}\n{limit}download_limit = \"20MiB/s\"\n[sim]\nmax_seconds = 100"
            ),
        );
        sc.starling.piece_size = sim::scenario::Bytes(64 << 20);
        let o = simulate(&sc, &pre, 3).expect("runs");
        assert_eq!(o.stuck, 0);
        let mut r = o.ready_s.clone();
        r.sort_by(f64::total_cmp);
        (r[1], r[2], o.refused_requests)
    };
    let s_over_d = 64.0 / 20.0;
    // With and without an upload limit (the bucket stage holds the slot too).
    for limit in ["upload_limit = \"400MiB/s\"\n", ""] {
        // Socket buffers smaller than the piece: only one body crosses the seed at a
        // time; the other puller is refused (503), drops the seed until its next
        // announce and gets the piece after the first body: about 2·S/D, not S/D.
        let (first, last, refused) = run(limit, "0");
        assert!(refused > 0, "{limit}: the second puller is refused");
        assert!(first < 1.2 * s_over_d, "{limit}: first {first} s");
        assert!(
            last >= 1.9 * s_over_d,
            "{limit}: last {last} s vs S/D {s_over_d} s"
        );
        // Buffers that take the whole body: the slot frees as the body starts, so both
        // bodies cross at once (a request in the few ms the slot is busy is refused).
        let (_, last, _) = run(limit, "\"64MiB\"");
        assert!(
            last < 1.5 * s_over_d,
            "{limit}: buffered, last {last} s vs S/D {s_over_d} s"
        );
    }
}

#[test]
fn a_rested_token_bucket_lets_its_burst_through() {
    // One puller, one seed, 8 MiB at an 8 MiB/s download limit: the bucket starts full
    // (1/20 s worth, as the agent's `TokenBucket::new`), so the pull takes
    // (S − burst)/D rather than S/D.
    let (sc, pre) = seeded(
        2,
        1,
        r#"{ name = "a", size = "8MiB" }"#,
        "peer_latency_ms = 0\ndownload_limit = \"8MiB/s\"",
    );
    let o = simulate(&sc, &pre, 2).expect("runs");
    let burst = 8.0 * MIB / 20.0;
    let want = (8.0 * MIB - burst) / (8.0 * MIB);
    assert!(close(max(&o), want, 0.01), "{} s vs {want} s", max(&o));
}

#[test]
fn registry_latency_jitter_decides_which_agents_become_sources() {
    // Every node fetches a tiny direct blob first (like the image config), then four
    // swarm layers with 4 fetches at a time: the fourth layer starts when the tiny
    // blob's registry round trip ends. Without jitter the node that arrives first is
    // elected for all four layers; with jitter another node wins the fourth.
    let layers = r#"{ name = "config", size = 2537 }, { name = "a", size = "32MiB" },
        { name = "b", size = "32MiB" }, { name = "c", size = "32MiB" }, { name = "d", size = "32MiB" }"#;
    let sources = |jitter: f64| {
        let mut sc = scenario(16, layers, "layer_concurrency = 4");
        sc.registry.latency_ms = 10.0;
        sc.registry.latency_jitter_ms = jitter;
        let o = simulate(&sc, &spec(Kind::P2p), 16).expect("runs");
        assert_eq!(o.source_elections, 4, "one per swarm layer");
        o.source_bytes.keys().cloned().collect::<Vec<_>>()
    };
    assert_eq!(sources(0.0).len(), 1);
    assert!(sources(40.0).len() >= 2, "{:?}", sources(40.0));
}
