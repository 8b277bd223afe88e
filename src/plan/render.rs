//! The fixed-width text rendering of a [`PlanReport`]: parameters in B
//! (1e9), bytes in GB (1e9) and GiB (2^30) (M, MB, MiB for models under a
//! billion parameters), per-token and per-session cache sizes, and the
//! verdict line last.

use std::fmt::Write;

use super::{CacheDtype, PlanReport};

const GB: f64 = 1e9;
const GIB: f64 = (1u64 << 30) as f64;
const TIB: f64 = (1u64 << 40) as f64;

/// Display units: B/GB/GiB for models of a billion parameters or more, else M/MB/MiB.
struct Units {
    /// Parameters per displayed unit.
    params: f64,
    /// `B` or `M`.
    params_label: &'static str,
    /// Bytes per decimal unit.
    dec: f64,
    /// `GB` or `MB`.
    dec_label: &'static str,
    /// Bytes per binary unit.
    bin: f64,
    /// `GiB` or `MiB`.
    bin_label: &'static str,
}

impl Units {
    fn for_params(total: u64) -> Units {
        if total as f64 >= 1e9 {
            Units {
                params: 1e9,
                params_label: "B",
                dec: GB,
                dec_label: "GB",
                bin: GIB,
                bin_label: "GiB",
            }
        } else {
            Units {
                params: 1e6,
                params_label: "M",
                dec: 1e6,
                dec_label: "MB",
                bin: (1u64 << 20) as f64,
                bin_label: "MiB",
            }
        }
    }

    /// Parameters with 3 decimals.
    fn p(&self, params: u64) -> String {
        format!("{:.3}", params as f64 / self.params)
    }
}

/// `1,234,567`.
fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `12.34 GB (11.49 GiB)`.
fn gb_gib(bytes: u64) -> String {
    format!(
        "{:.2} GB ({:.2} GiB)",
        bytes as f64 / GB,
        bytes as f64 / GIB
    )
}

/// Renders the report as a fixed-width table with units: parameters in B
/// (M below a billion), weights in GB and GiB (MB and MiB below a billion
/// parameters), caches in GB and GiB.
pub fn render_table(r: &PlanReport) -> String {
    let mut o = String::new();
    let w = &mut o;
    let p = &r.params;
    let u = Units::for_params(p.total);
    let (pl, dl, bl) = (u.params_label, u.dec_label, u.bin_label);
    // Writing into a String cannot fail, so the fmt::Results are ignored.
    let _ = writeln!(w, "{} ({})", r.model, r.source);
    let _ = writeln!(w, "{}", r.architecture);
    let _ = writeln!(w, "weights: {} = {}", r.scheme.name(), r.scheme_description);
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "{:<22} {:>12} {:>12} {:>12} {:>12}  formats",
        "component",
        format!("params ({pl})"),
        format!("active ({pl})"),
        format!("weights {dl}"),
        format!("weights {bl}")
    );
    let rule = "-".repeat(96);
    let _ = writeln!(w, "{rule}");
    let row = |w: &mut String, label: &str, params: u64, active: u64, bytes: u64, formats: &str| {
        let line = format!(
            "{:<22} {:>12} {:>12} {:>12.3} {:>12.3}  {formats}",
            label,
            u.p(params),
            u.p(active),
            bytes as f64 / u.dec,
            bytes as f64 / u.bin
        );
        let _ = writeln!(w, "{}", line.trim_end());
    };
    for c in &r.components {
        let formats: Vec<&str> = c.formats.iter().map(|f| f.format.name()).collect();
        row(
            w,
            &c.label,
            c.params,
            c.active_params,
            c.bytes,
            &formats.join("+"),
        );
    }
    let _ = writeln!(w, "{rule}");
    row(
        w,
        "total",
        p.total,
        p.active.with_embedding,
        r.devices.weight_bytes,
        "",
    );
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "params: {} {pl} total = text {} {pl} + vision tower {} {pl} + projector {} {pl}; routed experts {} {pl} ({:.1}% of text)",
        u.p(p.total),
        u.p(p.text),
        u.p(p.vision_tower),
        u.p(p.projector),
        u.p(p.routed_experts),
        100.0 * p.routed_experts as f64 / p.text.max(1) as f64
    );
    let _ = writeln!(
        w,
        "active: {} {pl} excl. input embedding (incl. lm_head; headline) | {} {pl} incl. embedding | {} {pl} excl. embedding and lm_head",
        u.p(p.active.without_embedding),
        u.p(p.active.with_embedding),
        u.p(p.active.without_embedding_and_lm_head)
    );
    let _ = writeln!(
        w,
        "        (text decoder only: the vision tower and projector run on media, not per token)"
    );
    let formats: Vec<String> = r
        .weights_by_format
        .iter()
        .map(|f| {
            format!(
                "{} {:.2} {dl} for {} {pl} params",
                f.format.name(),
                f.bytes as f64 / u.dec,
                u.p(f.params)
            )
        })
        .collect();
    let _ = writeln!(w, "by format: {}", formats.join(", "));
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "{:<8} {:>12} {:>12} {:>9} {:>8}",
        "scheme", dl, bl, "TiB", "b/w"
    );
    for s in &r.schemes {
        let _ = writeln!(
            w,
            "{:<8} {:>12.2} {:>12.2} {:>9.3} {:>8.3}{}",
            s.scheme.name(),
            s.bytes as f64 / u.dec,
            s.bytes as f64 / u.bin,
            s.bytes as f64 / TIB,
            s.bits_per_weight,
            if s.scheme == r.scheme {
                "  <- chosen"
            } else {
                ""
            }
        );
    }
    for c in &r.published {
        let verdict = if c.consistent {
            format!(
                "consistent ({:+.1}%)",
                100.0 * (c.claimed_bytes / c.planned_bytes as f64 - 1.0)
            )
        } else {
            format!(
                "the figure corresponds to {:.2} bits/weight, not {}'s ~{:.2}",
                c.implied_bits_per_weight,
                c.scheme.name().to_uppercase(),
                c.planned_bits_per_weight
            )
        };
        let _ = writeln!(
            w,
            "published: {} -> {:.3} b/w; planned {} {:.2} GB ({:.3} b/w): {verdict}",
            c.label,
            c.implied_bits_per_weight,
            c.scheme.name(),
            c.planned_bytes as f64 / GB,
            c.planned_bits_per_weight
        );
    }
    if let Some(s) = &r.stored {
        let by: Vec<String> = s
            .by_dtype
            .iter()
            .map(|d| format!("{} {:.3} {dl}", d.dtype, d.bytes as f64 / u.dec))
            .collect();
        let check = match r.stored_matches_plan {
            Some(true) => "= planned parameter count".to_string(),
            Some(false) => format!(
                "!= planned {} (config and checkpoint disagree)",
                grouped(p.total)
            ),
            None => "(packed tensors: elements are not weights)".to_string(),
        };
        let _ = writeln!(
            w,
            "checkpoint headers: {} tensors, {} elements {check}; {:.3} {dl} ({})",
            grouped(s.tensors as u64),
            grouped(s.elements),
            s.bytes as f64 / u.dec,
            by.join(", ")
        );
    }
    let c = &r.cache;
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "cache per session of {} tokens (KV cache {}):",
        grouped(c.context),
        c.kv_dtype.name()
    );
    if c.mla_layers > 0 {
        let _ = writeln!(
            w,
            "  MLA latent   {} layers x {} values: {} B/token BF16, {} B/token FP8 -> {} per session (BF16){}",
            c.mla_layers,
            c.mla_values_per_layer,
            grouped(c.mla_bytes_per_token_bf16),
            grouped(c.mla_bytes_per_token_fp8),
            gb_gib(c.mla_bytes_per_token_bf16 * c.context),
            if c.mla_cache_replicas > 1 { format!(", x{} replicas", c.mla_cache_replicas) } else { String::new() }
        );
    }
    if c.gqa_layers > 0 {
        let _ = writeln!(
            w,
            "  GQA K+V      {} layers: {} B/token BF16 -> {} per session (BF16)",
            c.gqa_layers,
            grouped(c.gqa_bytes_per_token_bf16),
            gb_gib(c.gqa_bytes_per_token_bf16 * c.context)
        );
    }
    if c.kv_dtype != CacheDtype::Bf16 {
        let _ = writeln!(
            w,
            "  KV {:<9} {} B/token over every KV layer -> {} per session",
            c.kv_dtype.name(),
            grouped(c.bytes_per_token),
            gb_gib(c.bytes_per_token * c.context)
        );
    }
    if c.kda_layers > 0 {
        let state = c.kda_state_bytes + c.kda_conv_bytes;
        let _ = writeln!(
            w,
            "  KDA state    {} layers: {} B f32 state + {} B bf16 conv = {} B ({:.1} MiB) per session, any length",
            c.kda_layers,
            grouped(c.kda_state_bytes),
            grouped(c.kda_conv_bytes),
            grouped(state),
            state as f64 / (1u64 << 20) as f64
        );
    }
    if c.attn_res_activation_bytes_per_token > 0 {
        let _ = writeln!(
            w,
            "  AttnRes      {} B/token of block snapshots during a forward (activation, not cache)",
            grouped(c.attn_res_activation_bytes_per_token)
        );
    }
    let _ = writeln!(w, "  per session  {}", gb_gib(c.session_bytes));
    let d = &r.devices;
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "devices: {} x {} @ {:.1} GB = {:.1} GB; x {:.2} utilisation - {} x {:.1} GB reserve = {} for weights + cache",
        d.spec.count,
        d.spec.kind.name(),
        d.spec.bytes_per_device as f64 / GB,
        d.total_bytes as f64 / GB,
        d.utilisation,
        d.spec.count,
        d.reserve_per_device as f64 / GB,
        gb_gib(d.budget_bytes)
    );
    let _ = writeln!(
        w,
        "weights: {}; free after weights: {}",
        gb_gib(d.weight_bytes),
        gb_gib(d.free_bytes)
    );
    for n in &r.notes {
        let _ = writeln!(w, "note: {n}");
    }
    let _ = writeln!(w, "verdict: {}", d.verdict);
    o
}
