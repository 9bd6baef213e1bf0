//! Ties the engine, model, rules and cost together, and renders the result.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::cost::{distribution_cost, human_seconds, Bandwidths, DistributionCost};
use crate::engine::{scan_layers, LayerScan, Problem, ScanOptions};
use crate::model::{Efficiency, LayerChanges, Model, WastedPath};
use crate::rules::{self, Category, Finding, LayerRole, RuleOptions};
use crate::source::Image;
use oci::size::format_size;

/// Everything `analyze` can be told.
#[derive(Clone, Debug)]
pub struct AnalyzeOptions {
    pub scan: ScanOptions,
    pub rules: RuleOptions,
    pub nodes: u64,
    pub bandwidths: Bandwidths,
    /// How many wasted paths to list.
    pub top: usize,
}

impl Default for AnalyzeOptions {
    fn default() -> Self {
        Self {
            scan: ScanOptions::default(),
            rules: RuleOptions::default(),
            nodes: 64,
            bandwidths: Bandwidths::default(),
            top: 10,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct LayerReport {
    pub index: usize,
    pub digest: oci::Digest,
    pub media_type: String,
    pub compression: crate::engine::Compression,
    pub declared_size: u64,
    pub compressed_size: u64,
    pub uncompressed_size: u64,
    pub created_by: Option<String>,
    pub role: LayerRole,
    pub changes: LayerChanges,
    /// File bytes this layer writes, by category.
    pub categories: BTreeMap<Category, u64>,
    pub complete: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub image: String,
    pub tag: Option<String>,
    pub manifest_digest: Option<oci::Digest>,
    pub platform: Option<String>,
    pub layers: Vec<LayerReport>,
    pub total_compressed: u64,
    pub total_uncompressed: u64,
    pub efficiency: Efficiency,
    pub wasted: Vec<WastedPath>,
    pub findings: Vec<Finding>,
    pub cost: DistributionCost,
    pub problems: Vec<Problem>,
    /// Harmless oddities noticed while reading.
    pub notes: Vec<String>,
}

impl Report {
    pub fn finding(&self, rule: rules::Rule) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(move |f| f.rule == rule)
    }

    /// Bytes of all findings of a rule.
    pub fn rule_bytes(&self, rule: rules::Rule) -> u64 {
        self.finding(rule).map(|f| f.bytes).sum()
    }
}

/// The report plus the raw material `diff` needs.
pub struct Analysis {
    pub report: Report,
    pub scans: Vec<LayerScan>,
    pub model: Model,
}

/// Streams every layer once and produces the report.
pub fn analyze(image: &Image, opts: &AnalyzeOptions) -> Analysis {
    let scans = scan_layers(image.opener.as_ref(), &image.manifest.layers, &opts.scan);
    analyze_scans(image, scans, opts)
}

/// The report for already scanned layers.
pub fn analyze_scans(image: &Image, scans: Vec<LayerScan>, opts: &AnalyzeOptions) -> Analysis {
    let model = Model::build(&scans);
    let history = image.config.layer_history(scans.len());
    let roles: Vec<LayerRole> = scans
        .iter()
        .map(|l| rules::layer_role(history[l.index].as_deref(), l))
        .collect();
    let mut findings = rules::content_findings(&model, &opts.rules);
    findings.extend(rules::layer_order_finding(&roles, &scans));
    findings.extend(rules::mutable_tag_finding(
        image.tag.as_deref(),
        image.pinned,
        image.manifest_digest.as_ref(),
    ));
    findings.sort_by(|a, b| {
        b.bytes
            .cmp(&a.bytes)
            .then(a.rule.cmp(&b.rule))
            .then_with(|| a.title.cmp(&b.title))
    });
    let sizes: Vec<u64> = scans.iter().map(|l| l.declared_size).collect();
    let cost = distribution_cost(
        &sizes,
        rules::first_code_layer(&roles),
        opts.nodes,
        opts.bandwidths,
    );
    let mut problems: Vec<Problem> = scans
        .iter()
        .flat_map(|l| l.problems.iter().cloned())
        .collect();
    problems.extend(model.problems.iter().cloned());
    let layers: Vec<LayerReport> = scans
        .iter()
        .map(|l| LayerReport {
            index: l.index,
            digest: l.digest.clone(),
            media_type: l.media_type.clone(),
            compression: l.compression,
            declared_size: l.declared_size,
            compressed_size: l.compressed_size,
            uncompressed_size: l.uncompressed_size,
            created_by: history[l.index].clone(),
            role: roles[l.index],
            changes: model.changes.get(l.index).cloned().unwrap_or_default(),
            categories: rules::layer_categories(l, opts.rules.weight_threshold),
            complete: l.complete,
        })
        .collect();
    let mut wasted = model.wasted_paths();
    wasted.truncate(opts.top);
    let report = Report {
        image: image.name.clone(),
        tag: image.tag.clone(),
        manifest_digest: image.manifest_digest.clone(),
        platform: image.platform.clone(),
        total_compressed: sizes.iter().sum(),
        total_uncompressed: scans.iter().map(|l| l.uncompressed_size).sum(),
        layers,
        efficiency: model.efficiency(),
        wasted,
        findings,
        cost,
        problems,
        notes: scans
            .iter()
            .flat_map(|l| {
                l.notes
                    .iter()
                    .map(move |n| format!("layer {}: {n}", l.index))
            })
            .collect(),
    };
    Analysis {
        report,
        scans,
        model,
    }
}

/// ANSI styling that turns itself off when not on a terminal.
#[derive(Clone, Copy, Debug)]
pub struct Style {
    pub color: bool,
}

impl Style {
    fn paint(&self, code: &str, s: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_owned()
        }
    }
    pub fn bold(&self, s: &str) -> String {
        self.paint("1", s)
    }
    pub fn red(&self, s: &str) -> String {
        self.paint("31", s)
    }
    pub fn yellow(&self, s: &str) -> String {
        self.paint("33", s)
    }
    pub fn green(&self, s: &str) -> String {
        self.paint("32", s)
    }
    pub fn dim(&self, s: &str) -> String {
        self.paint("2", s)
    }
}

fn short(d: &oci::Digest) -> String {
    d.hex().chars().take(12).collect()
}

fn trunc(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        format!("{}…", s.chars().take(n - 1).collect::<String>())
    }
}

/// The terminal report.
pub fn render_text(r: &Report, st: Style) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{} {}", st.bold("Image"), r.image);
    if let Some(d) = &r.manifest_digest {
        let _ = writeln!(o, "  manifest {d}");
    }
    if let Some(p) = &r.platform {
        let _ = writeln!(o, "  platform {p}");
    }
    let _ = writeln!(
        o,
        "  {} layers, {} compressed, {} uncompressed\n",
        r.layers.len(),
        format_size(r.total_compressed),
        format_size(r.total_uncompressed)
    );
    let _ = writeln!(o, "{}", st.bold("Layers"));
    let _ = writeln!(
        o,
        "  {:>3}  {:<12}  {:>10}  {:>10}  {:>6} {:>6} {:>6}  {:<9}  created by",
        "#", "digest", "compressed", "size", "added", "chg", "del", "role"
    );
    for l in &r.layers {
        let role = format!("{:?}", l.role).to_lowercase();
        let _ = writeln!(
            o,
            "  {:>3}  {:<12}  {:>10}  {:>10}  {:>6} {:>6} {:>6}  {:<9}  {}",
            l.index,
            short(&l.digest),
            format_size(l.declared_size),
            format_size(l.uncompressed_size),
            l.changes.added,
            l.changes.changed,
            l.changes.deleted,
            trunc(&role, 9),
            st.dim(&trunc(
                &rules::clean_created_by(l.created_by.as_deref().unwrap_or("-")),
                60
            ))
        );
    }
    let e = &r.efficiency;
    let eff = format!("{:.2} %", e.efficiency * 100.0);
    let eff = if e.efficiency >= 0.95 {
        st.green(&eff)
    } else if e.efficiency >= 0.8 {
        st.yellow(&eff)
    } else {
        st.red(&eff)
    };
    let _ = writeln!(
        o,
        "\n{} efficiency {eff}, wasted {} of {}",
        st.bold("Efficiency"),
        format_size(e.wasted_bytes),
        format_size(e.cumulative_bytes)
    );
    for w in &r.wasted {
        let why = match w.deleted_in {
            Some(l) => format!("deleted in layer {l}"),
            None => format!("{} copies", w.copies),
        };
        let _ = writeln!(
            o,
            "  {:>10}  /{}  ({why}, layers {:?})",
            format_size(w.wasted_bytes),
            w.path,
            w.layers
        );
    }
    let _ = writeln!(o, "\n{}", st.bold("Findings"));
    if r.findings.is_empty() {
        let _ = writeln!(o, "  {}", st.green("nothing to cut"));
    }
    for f in &r.findings {
        let bytes = if f.bytes > 0 {
            format_size(f.bytes)
        } else {
            "-".into()
        };
        let _ = writeln!(
            o,
            "  {} {}",
            st.yellow(&format!("{bytes:>10}")),
            st.bold(&f.title)
        );
        if !f.layers.is_empty() {
            let _ = writeln!(
                o,
                "              {} file(s), layers {:?}",
                f.files, f.layers
            );
        }
        for (p, s) in &f.examples {
            let _ = writeln!(o, "              {:>10}  /{}", format_size(*s), p);
        }
        let _ = writeln!(o, "              {} {}", st.green("fix:"), f.fix);
    }
    let c = &r.cost;
    let _ = writeln!(o, "\n{}", st.bold("Distribution"));
    let _ = writeln!(
        o,
        "  cold node pulls          {}",
        format_size(c.cold_bytes)
    );
    let from = match (c.update_from_layer, c.update_assumed) {
        (Some(l), false) => format!(
            "layers {l}..{} (from the first code layer)",
            r.layers.len().saturating_sub(1)
        ),
        (Some(l), true) => format!("layer {l} (no code layer in history; assumed the last)"),
        (None, _) => "nothing".into(),
    };
    let _ = writeln!(
        o,
        "  code-only update pulls   {}  {}",
        format_size(c.update_bytes),
        st.dim(&from)
    );
    let bw = &c.bandwidths;
    let _ = writeln!(
        o,
        "  {} nodes (origin {:.1} Gbit/s, node down {:.1} / up {:.1} Gbit/s):",
        c.cold.nodes,
        bw.origin_up * 8.0 / 1e9,
        bw.node_down * 8.0 / 1e9,
        bw.node_up * 8.0 / 1e9
    );
    for (name, est) in [("cold", &c.cold), ("update", &c.update)] {
        let _ = writeln!(
            o,
            "    {name:<7} direct {:>9}   P2P {:>9}",
            human_seconds(est.direct_seconds),
            human_seconds(est.p2p_seconds)
        );
    }
    if !r.notes.is_empty() {
        let _ = writeln!(o, "\n{}", st.bold("Notes"));
        for n in &r.notes {
            let _ = writeln!(o, "  {}", st.dim(n));
        }
    }
    if !r.problems.is_empty() {
        let _ = writeln!(o, "\n{}", st.bold(&st.red("Problems")));
        for p in &r.problems {
            let layer = p.layer.map(|l| format!("layer {l}: ")).unwrap_or_default();
            let _ = writeln!(
                o,
                "  {} {layer}{}",
                st.red(&format!("{:?}", p.kind)),
                p.message
            );
        }
    }
    o
}

pub fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Inline SVG: one bar per layer, split by category.
pub fn render_svg(r: &Report) -> String {
    let row = 26.0;
    let left = 150.0;
    let width = 640.0;
    let max = r
        .layers
        .iter()
        .map(|l| l.categories.values().sum::<u64>())
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let h = row * (r.layers.len() as f64) + 60.0;
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{h}" font-family="sans-serif" font-size="12">"#,
        left + width + 120.0
    );
    for (i, l) in r.layers.iter().enumerate() {
        let y = i as f64 * row + 5.0;
        let _ = write!(
            s,
            r#"<text x="4" y="{}">layer {} ({})</text>"#,
            y + 15.0,
            l.index,
            html_escape(&format_size(l.declared_size))
        );
        let mut x = left;
        for c in Category::ALL {
            let b = l.categories.get(&c).copied().unwrap_or(0);
            if b == 0 {
                continue;
            }
            let w = b as f64 / max * width;
            let _ = write!(
                s,
                r#"<rect x="{x:.1}" y="{y}" width="{w:.1}" height="{}" fill="{}"><title>{}: {}</title></rect>"#,
                row - 6.0,
                c.color(),
                c.label(),
                format_size(b)
            );
            x += w;
        }
        let total: u64 = l.categories.values().sum();
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{}">{}</text>"#,
            x + 4.0,
            y + 15.0,
            html_escape(&format_size(total))
        );
    }
    let mut x = 4.0;
    let y = row * r.layers.len() as f64 + 25.0;
    for c in Category::ALL {
        let _ = write!(
            s,
            r#"<rect x="{x}" y="{y}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            c.color(),
            x + 16.0,
            y + 10.0,
            html_escape(c.label())
        );
        x += 16.0 + 7.0 * c.label().len() as f64 + 14.0;
    }
    s.push_str("</svg>");
    s
}

/// A self-contained HTML page (no external resources).
pub fn render_html(r: &Report) -> String {
    let mut o = String::from("<!doctype html><html><head><meta charset=\"utf-8\"><title>starling analyze</title><style>body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse}td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left}td.n{text-align:right}code{background:#f4f4f4}</style></head><body>");
    let _ = write!(o, "<h1>{}</h1>", html_escape(&r.image));
    let e = &r.efficiency;
    let _ = write!(
        o,
        "<p>{} layers, {} compressed, {} uncompressed. Efficiency <b>{:.2} %</b>, wasted <b>{}</b>.</p>",
        r.layers.len(),
        format_size(r.total_compressed),
        format_size(r.total_uncompressed),
        e.efficiency * 100.0,
        format_size(e.wasted_bytes)
    );
    o.push_str("<h2>Where the bytes are</h2>");
    o.push_str(&render_svg(r));
    o.push_str("<h2>Findings</h2><table><tr><th>bytes</th><th>finding</th><th>fix</th></tr>");
    for f in &r.findings {
        let ex: Vec<String> = f
            .examples
            .iter()
            .map(|(p, s)| format!("<code>/{}</code> {}", html_escape(p), format_size(*s)))
            .collect();
        let _ = write!(
            o,
            "<tr><td class=n>{}</td><td>{}<br><small>{}</small></td><td>{}</td></tr>",
            format_size(f.bytes),
            html_escape(&f.title),
            ex.join("<br>"),
            html_escape(&f.fix)
        );
    }
    o.push_str("</table><h2>Layers</h2><table><tr><th>#</th><th>compressed</th><th>size</th><th>added</th><th>changed</th><th>deleted</th><th>created by</th></tr>");
    for l in &r.layers {
        let _ = write!(
            o,
            "<tr><td>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td><code>{}</code></td></tr>",
            l.index,
            format_size(l.declared_size),
            format_size(l.uncompressed_size),
            l.changes.added,
            l.changes.changed,
            l.changes.deleted,
            html_escape(&rules::clean_created_by(l.created_by.as_deref().unwrap_or("")))
        );
    }
    let c = &r.cost;
    let _ = write!(
        o,
        "</table><h2>Distribution to {} nodes</h2><table><tr><th></th><th>bytes</th><th>direct</th><th>P2P</th></tr><tr><td>cold</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td></tr><tr><td>code-only update</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td></tr></table>",
        c.cold.nodes,
        format_size(c.cold_bytes),
        human_seconds(c.cold.direct_seconds),
        human_seconds(c.cold.p2p_seconds),
        format_size(c.update_bytes),
        human_seconds(c.update.direct_seconds),
        human_seconds(c.update.p2p_seconds)
    );
    if !r.problems.is_empty() {
        o.push_str("<h2>Problems</h2><ul>");
        for p in &r.problems {
            let _ = write!(o, "<li>{:?}: {}</li>", p.kind, html_escape(&p.message));
        }
        o.push_str("</ul>");
    }
    o.push_str("</body></html>\n");
    o
}
