//! Reading a checkpoint's JSON files: `config.json` (typed into
//! [`crate::checkpoint::arch`], which also lists the supported `model_type`s),
//! `generation_config.json` (stop ids) and the RoPE settings, which
//! published configs write as `rope_scaling` and transformers 5.x as
//! `rope_parameters`.

use std::path::Path;

use caracal_kernels::rope::RopeScaling;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{Error, Result};

/// Reads a JSON file into a value.
pub fn read_json(path: &Path, what: &'static str) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::BadFile {
        what,
        path: path.into(),
        detail: e.to_string(),
    })
}

/// Deserialises `config.json` into an architecture's typed config.
pub fn parse_config<T: DeserializeOwned>(value: &Value, path: &Path) -> Result<T> {
    serde_json::from_value(value.clone()).map_err(|e| Error::BadFile {
        what: "config.json",
        path: path.into(),
        detail: e.to_string(),
    })
}

/// RoPE settings: base and scaling, from either key spelling.
pub fn rope_from_config(value: &Value, default_theta: f32) -> Result<(f32, RopeScaling)> {
    let params = value
        .get("rope_parameters")
        .filter(|v| v.is_object())
        .or_else(|| value.get("rope_scaling").filter(|v| v.is_object()));
    let mut theta = value
        .get("rope_theta")
        .and_then(|v| v.as_f64())
        .map(|v| v as f32)
        .unwrap_or(default_theta);
    let Some(p) = params else {
        return Ok((theta, RopeScaling::Default));
    };
    if let Some(t) = p.get("rope_theta").and_then(|v| v.as_f64()) {
        theta = t as f32;
    }
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let f = |k: &str| p.get(k).and_then(|v| v.as_f64()).map(|v| v as f32);
    let need =
        |k: &str| f(k).ok_or_else(|| Error::Config(format!("rope scaling `{kind}` needs `{k}`")));
    let max_pos = value
        .get("max_position_embeddings")
        .and_then(|v| v.as_u64())
        .map(|v| v as usize);
    let scaling = match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: need("factor")?,
        },
        "yarn" => {
            let factor = need("factor")?;
            let orig = p
                .get("original_max_position_embeddings")
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .or(max_pos.map(|m| (m as f32 / factor) as usize))
                .ok_or_else(|| {
                    Error::Config("yarn needs original_max_position_embeddings".into())
                })?;
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast: f("beta_fast").unwrap_or(32.0),
                beta_slow: f("beta_slow").unwrap_or(1.0),
                mscale: f("mscale"),
                mscale_all_dim: f("mscale_all_dim"),
                truncate: p.get("truncate").and_then(|v| v.as_bool()).unwrap_or(true),
                attention_factor: f("attention_factor"),
            }
        }
        "llama3" => RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: p
                .get("original_max_position_embeddings")
                .and_then(|v| v.as_u64())
                .ok_or_else(|| {
                    Error::Config("llama3 rope needs original_max_position_embeddings".into())
                })? as usize,
        },
        other => {
            return Err(Error::Config(format!(
                "unsupported rope type `{other}` (supported: default, linear, yarn, llama3)"
            )))
        }
    };
    check_rope(theta, &scaling)?;
    Ok((theta, scaling))
}

/// Refuses rotary settings whose frequencies are not finite positive
/// numbers: a base of at most 1 (a negative one gives NaN frequencies) or a
/// scaling factor that is not positive.
fn check_rope(theta: f32, scaling: &RopeScaling) -> Result<()> {
    if !(theta.is_finite() && theta > 1.0) {
        return Err(Error::Config(format!(
            "`rope_theta` must be a finite number > 1, got {theta}"
        )));
    }
    let fields: &[(&str, f32)] = match *scaling {
        RopeScaling::Default => &[],
        RopeScaling::Linear { factor } => &[("factor", factor)],
        RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings: orig,
            ..
        } => &[
            ("factor", factor),
            ("beta_fast", beta_fast),
            ("beta_slow", beta_slow),
            ("original_max_position_embeddings", orig as f32),
        ],
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: orig,
        } => &[
            ("factor", factor),
            ("low_freq_factor", low_freq_factor),
            ("high_freq_factor", high_freq_factor),
            ("original_max_position_embeddings", orig as f32),
        ],
    };
    match fields.iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
        Some((name, v)) => Err(Error::Config(format!(
            "rope scaling `{name}` must be a finite number > 0, got {v}"
        ))),
        None => Ok(()),
    }
}

/// Stop ids: `eos_token_id` of `generation_config.json` (number or list),
/// else of `config.json`.
pub fn eos_ids(dir: &Path, config: &Value) -> Vec<u32> {
    let from = |v: &Value| -> Vec<u32> {
        match v.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64().map(|x| x as u32))
                .collect(),
            _ => Vec::new(),
        }
    };
    let gen = dir.join("generation_config.json");
    if gen.exists() {
        if let Ok(v) = read_json(&gen, "generation_config.json") {
            let ids = from(&v);
            if !ids.is_empty() {
                return ids;
            }
        }
    }
    from(config)
}

/// Serde default helpers shared by model configs.
pub mod defaults {
    /// `true`.
    pub fn yes() -> bool {
        true
    }
    /// `1e-6`.
    pub fn eps_1e6() -> f32 {
        1e-6
    }
    /// `1e-5`.
    pub fn eps_1e5() -> f32 {
        1e-5
    }
    /// `10000.0`.
    pub fn theta_10k() -> f32 {
        10000.0
    }
    /// `1.0`.
    pub fn one_f32() -> f32 {
        1.0
    }
    /// `1`.
    pub fn one() -> usize {
        1
    }
    /// `"silu"`.
    pub fn silu() -> String {
        "silu".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_yarn_from_either_key() {
        let a = serde_json::json!({"rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 32.0,
            "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}});
        let b = serde_json::json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}});
        let (ta, sa) = rope_from_config(&a, 1.0).unwrap();
        let (tb, sb) = rope_from_config(&b, 1.0).unwrap();
        assert_eq!(ta, 50000.0);
        assert_eq!(tb, 50000.0);
        assert_eq!(format!("{sa:?}"), format!("{sb:?}"));
    }
}
