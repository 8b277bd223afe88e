//! The fixed-width text rendering of a [`PlanReport`]: parameters in B
//! (1e9), bytes in GB (1e9) and GiB (2^30), per-token and per-session cache
//! sizes, and the verdict line last.

use std::fmt::Write;

use super::PlanReport;

const GB: f64 = 1e9;
const GIB: f64 = (1u64 << 30) as f64;
const TIB: f64 = (1u64 << 40) as f64;

/// Billions of parameters with 3 decimals.
fn b(params: u64) -> String {
    format!("{:.3}", params as f64 / 1e9)
}

/// `1,234,567`.
fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `12.34 GB (11.49 GiB)`.
fn gb_gib(bytes: u64) -> String {
    format!("{:.2} GB ({:.2} GiB)", bytes as f64 / GB, bytes as f64 / GIB)
}

/// Renders the report as a fixed-width table with units.
pub fn render_table(r: &PlanReport) -> String {
    let mut o = String::new();
    let w = &mut o;
    // Writing into a String cannot fail.
    let _ = writeln!(w, "{} ({})", r.model, r.source);
    let _ = writeln!(w, "{}", r.architecture);
    let _ = writeln!(w, "weights: {} = {}", r.scheme.name(), r.scheme_description);
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "{:<22} {:>12} {:>12} {:>12} {:>12}  {}",
        "component", "params (B)", "active (B)", "weights GB", "weights GiB", "formats"
    );
    let rule = "-".repeat(96);
    let _ = writeln!(w, "{rule}");
    for c in &r.components {
        let formats: Vec<&str> = c.formats.iter().map(|f| f.format.name()).collect();
        let _ = writeln!(
            w,
            "{:<22} {:>12} {:>12} {:>12.3} {:>12.3}  {}",
            c.label,
            b(c.params),
            b(c.active_params),
            c.bytes as f64 / GB,
            c.bytes as f64 / GIB,
            formats.join("+")
        );
    }
    let _ = writeln!(w, "{rule}");
    let p = &r.params;
    let _ = writeln!(
        w,
        "{:<22} {:>12} {:>12} {:>12.3} {:>12.3}",
        "total",
        b(p.total),
        b(p.active.with_embedding),
        r.devices.weight_bytes as f64 / GB,
        r.devices.weight_bytes as f64 / GIB
    );
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "params: {} B total = text {} B + vision tower {} B + projector {} B; routed experts {} B ({:.1}% of text)",
        b(p.total),
        b(p.text),
        b(p.vision_tower),
        b(p.projector),
        b(p.routed_experts),
        100.0 * p.routed_experts as f64 / p.text.max(1) as f64
    );
    let _ = writeln!(
        w,
        "active: {} B excl. input embedding (incl. lm_head; headline) | {} B incl. embedding | {} B excl. embedding and lm_head",
        b(p.active.without_embedding),
        b(p.active.with_embedding),
        b(p.active.without_embedding_and_lm_head)
    );
    let _ = writeln!(w, "        (text decoder only: the vision tower and projector run on media, not per token)");
    let formats: Vec<String> = r
        .weights_by_format
        .iter()
        .map(|f| format!("{} {:.2} GB for {} B params", f.format.name(), f.bytes as f64 / GB, b(f.params)))
        .collect();
    let _ = writeln!(w, "by format: {}", formats.join(", "));
    let _ = writeln!(w);
    let _ = writeln!(w, "{:<8} {:>12} {:>12} {:>9} {:>8}", "scheme", "GB", "GiB", "TiB", "b/w");
    for s in &r.schemes {
        let _ = writeln!(
            w,
            "{:<8} {:>12.2} {:>12.2} {:>9.3} {:>8.3}{}",
            s.scheme.name(),
            s.bytes as f64 / GB,
            s.bytes as f64 / GIB,
            s.bytes as f64 / TIB,
            s.bits_per_weight,
            if s.scheme == r.scheme { "  <- chosen" } else { "" }
        );
    }
    for c in &r.published {
        let verdict = if c.consistent {
            format!("consistent ({:+.1}%)", 100.0 * (c.claimed_bytes / c.planned_bytes as f64 - 1.0))
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
        let by: Vec<String> = s.by_dtype.iter().map(|(d, n)| format!("{d} {:.3} GB", *n as f64 / GB)).collect();
        let check = match r.stored_matches_plan {
            Some(true) => "= planned parameter count".to_string(),
            Some(false) => format!("!= planned {} (config and checkpoint disagree)", grouped(p.total)),
            None => "(packed tensors: elements are not weights)".to_string(),
        };
        let _ = writeln!(
            w,
            "checkpoint headers: {} tensors, {} elements {check}; {} ({})",
            grouped(s.tensors as u64),
            grouped(s.elements),
            gb_gib(s.bytes),
            by.join(", ")
        );
    }
    let c = &r.cache;
    let _ = writeln!(w);
    let _ = writeln!(w, "cache per session of {} tokens (KV {:?}):", grouped(c.context), c.kv_dtype);
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
    let _ = writeln!(w, "weights: {}; free after weights: {}", gb_gib(d.weight_bytes), gb_gib(d.free_bytes));
    for n in &r.notes {
        let _ = writeln!(w, "note: {n}");
    }
    let _ = writeln!(w, "verdict: {}", d.verdict);
    o
}
