//! CI mode: a TOML thresholds file and the rules that fail a build.
//!
//! ```toml
//! min_efficiency = 0.95          # lowest acceptable efficiency (0..1)
//! max_wasted_bytes = "500MiB"    # or an integer
//! forbid_weights = true          # no model weights baked in
//! max_code_layer_update = "200MiB" # bytes a code-only change may re-ship
//! allow_problems = false         # unreadable/corrupt layers fail unless true
//! ```

use serde::{Deserialize, Serialize};

use crate::cost::parse_size;
use crate::error::{Error, Result};
use crate::report::Report;
use crate::rules::Rule;
use oci::size::format_size;

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum Size {
    Bytes(u64),
    Text(String),
}

impl Size {
    pub fn bytes(&self) -> Result<u64> {
        match self {
            Size::Bytes(b) => Ok(*b),
            Size::Text(t) => parse_size(t),
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Thresholds {
    pub min_efficiency: Option<f64>,
    pub max_wasted_bytes: Option<Size>,
    #[serde(default)]
    pub forbid_weights: bool,
    pub max_code_layer_update: Option<Size>,
    #[serde(default)]
    pub allow_problems: bool,
}

impl Thresholds {
    pub fn parse(text: &str, path: &str) -> Result<Self> {
        let t: Self = toml::from_str(text).map_err(|e| Error::Thresholds {
            path: path.into(),
            message: e.to_string(),
        })?;
        let bad = |m: String| Error::Thresholds {
            path: path.into(),
            message: m,
        };
        if let Some(e) = t.min_efficiency {
            if !(0.0..=1.0).contains(&e) {
                return Err(bad(format!("min_efficiency {e} must be between 0 and 1")));
            }
        }
        for s in [&t.max_wasted_bytes, &t.max_code_layer_update]
            .into_iter()
            .flatten()
        {
            s.bytes().map_err(|e| bad(e.to_string()))?;
        }
        Ok(t)
    }

    pub fn load(path: &std::path::Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::io(path.display().to_string(), e))?;
        Self::parse(&text, &path.display().to_string())
    }
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Failure {
    pub rule: String,
    pub message: String,
}

/// Every failed rule, explained. Empty means the image passes.
pub fn check(r: &Report, t: &Thresholds) -> Vec<Failure> {
    let mut out = Vec::new();
    let e = &r.efficiency;
    let worst = r
        .wasted
        .first()
        .map(|w| {
            format!(
                "; largest waste /{} ({})",
                w.path,
                format_size(w.wasted_bytes)
            )
        })
        .unwrap_or_default();
    if let Some(min) = t.min_efficiency {
        if e.efficiency < min {
            out.push(Failure {
                rule: "min_efficiency".into(),
                message: format!(
                    "efficiency {:.4} is below the minimum {min:.4}: {} of {} file bytes are wasted{worst}",
                    e.efficiency,
                    format_size(e.wasted_bytes),
                    format_size(e.cumulative_bytes)
                ),
            });
        }
    }
    if let Some(max) = t.max_wasted_bytes.as_ref().and_then(|s| s.bytes().ok()) {
        if e.wasted_bytes > max {
            out.push(Failure {
                rule: "max_wasted_bytes".into(),
                message: format!(
                    "{} bytes wasted, more than the allowed {max}{worst}",
                    e.wasted_bytes
                ),
            });
        }
    }
    if t.forbid_weights {
        for f in r.finding(Rule::ModelWeights) {
            let ex: Vec<String> = f
                .examples
                .iter()
                .map(|(p, s)| format!("/{p} ({})", format_size(*s)))
                .collect();
            out.push(Failure {
                rule: "forbid_weights".into(),
                message: format!(
                    "{} weight file(s), {} baked in: {}; {}",
                    f.files,
                    format_size(f.bytes),
                    ex.join(", "),
                    f.fix
                ),
            });
        }
    }
    if let Some(max) = t
        .max_code_layer_update
        .as_ref()
        .and_then(|s| s.bytes().ok())
    {
        let c = &r.cost;
        if c.update_bytes > max {
            let from = c.update_from_layer.map(|l| {
                let cb = r
                    .layers
                    .get(l)
                    .and_then(|x| x.created_by.clone())
                    .unwrap_or_default();
                format!(" (from layer {l}: {})", crate::rules::clean_created_by(&cb))
            });
            out.push(Failure {
                rule: "max_code_layer_update".into(),
                message: format!(
                    "a code-only change re-ships {} bytes{}{}, more than the allowed {max}; move dependency installation before the source COPY",
                    c.update_bytes,
                    from.unwrap_or_default(),
                    if c.update_assumed { " [no code layer in history: assumed the last layer]" } else { "" }
                ),
            });
        }
    }
    if !t.allow_problems {
        for p in &r.problems {
            out.push(Failure {
                rule: "problems".into(),
                message: format!(
                    "{}{:?}: {}",
                    p.layer.map(|l| format!("layer {l}: ")).unwrap_or_default(),
                    p.kind,
                    p.message
                ),
            });
        }
    }
    out
}
