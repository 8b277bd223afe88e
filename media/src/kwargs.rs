//! Processor options given as JSON, the way vLLM's `--mm-processor-kwargs` passes them to
//! the Hugging Face processor ([`ImageProcessorConfig::with_kwargs`]).
//!
//! The keys are those of transformers' `Kimi_K25ImageProcessorKwargs` and
//! `Kimi_K25VideoProcessorInitKwargs`. Like `ProcessorMixin._merge_kwargs`, a top-level
//! key that both the image and the video processor accept applies to both: a top-level
//! `max_patches` sets the image budget *and* the per-frame budget. To set one of them
//! only, nest it as transformers allows: `{"images_kwargs": {"max_patches": 1024}}` or
//! `{"videos_kwargs": {"max_patches": 1024}}`.
//!
//! | key | field | accepted |
//! |---|---|---|
//! | `max_patches` | image rule's patch limit and [`ImageProcessorConfig::frame_patch_limit`] | integer ≥ 1 |
//! | `patch_size` | `patch_size` | 1..=1024 |
//! | `merge_size` | `merge_kernel_size` | 1..=16 |
//! | `temporal_patch_size` | `temporal_patch_size` | 1..=16 |
//! | `size` | `patch_limit_on_one_side` | `{"max_height": n, "max_width": n}`, equal, K2.5/K3 rule only |
//! | `image_mean`, `image_std` | `image_mean`, `image_std` | a number or three numbers |
//! | `images_kwargs` | image-only | an object with `max_patches`, `size` |
//! | `videos_kwargs` | video-only | an object with `max_patches`, `temporal_patch_size` |
//!
//! Any other key is an error that names it and lists the accepted ones, so a typo never
//! silently leaves a default in place.

use serde_json::{Map, Value};

use crate::error::{MediaError, Result};
use crate::resize::{ImageProcessorConfig, ResizeRule};

/// Top-level keys [`ImageProcessorConfig::with_kwargs`] accepts.
pub const ACCEPTED_KWARGS: &[&str] = &[
    "max_patches",
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "size",
    "image_mean",
    "image_std",
    "images_kwargs",
    "videos_kwargs",
];

/// Keys accepted inside `images_kwargs`.
const IMAGE_ONLY_KWARGS: &[&str] = &["max_patches", "size"];
/// Keys accepted inside `videos_kwargs`.
const VIDEO_ONLY_KWARGS: &[&str] = &["max_patches", "temporal_patch_size"];

/// Which processor a nested `*_kwargs` object targets.
#[derive(Clone, Copy)]
enum Scope {
    Both,
    Images,
    Videos,
}

fn config_error(field: &'static str, reason: String) -> MediaError {
    MediaError::Config { field, reason }
}

/// A JSON integer in `min..=max`.
fn int_in(value: &Value, field: &'static str, min: u64, max: u64) -> Result<u64> {
    match value.as_u64() {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(config_error(
            field,
            format!("must be an integer in {min}..={max}, got {value}"),
        )),
    }
}

/// A JSON number, or an array of three, as one value per channel.
fn per_channel(value: &Value, field: &'static str) -> Result<[f32; 3]> {
    let bad = || {
        config_error(
            field,
            format!("must be a number or an array of 3 numbers, got {value}"),
        )
    };
    match value {
        Value::Number(n) => {
            let v = n.as_f64().ok_or_else(bad)? as f32;
            Ok([v; 3])
        }
        Value::Array(items) if items.len() == 3 => {
            let mut out = [0f32; 3];
            for (slot, item) in out.iter_mut().zip(items) {
                *slot = item.as_f64().ok_or_else(bad)? as f32;
            }
            Ok(out)
        }
        _ => Err(bad()),
    }
}

impl ImageProcessorConfig {
    /// These settings with `kwargs` (a JSON object of processor options, as vLLM's
    /// `--mm-processor-kwargs` carries them) applied; see the module docs for the keys.
    /// Unknown keys and out-of-range values are errors naming the key; the result is
    /// validated.
    pub fn with_kwargs(mut self, kwargs: &Value) -> Result<Self> {
        let object = kwargs.as_object().ok_or_else(|| {
            config_error(
                "mm_processor_kwargs",
                format!("must be a JSON object, got {kwargs}"),
            )
        })?;
        // Shared keys first, so that the modality-specific objects override them.
        self.apply(object, Scope::Both)?;
        for (key, scope, accepted) in [
            ("images_kwargs", Scope::Images, IMAGE_ONLY_KWARGS),
            ("videos_kwargs", Scope::Videos, VIDEO_ONLY_KWARGS),
        ] {
            let Some(nested) = object.get(key) else {
                continue;
            };
            let nested = nested.as_object().ok_or_else(|| {
                config_error(
                    "mm_processor_kwargs",
                    format!("`{key}` must be a JSON object, got {nested}"),
                )
            })?;
            if let Some(unknown) = nested.keys().find(|k| !accepted.contains(&k.as_str())) {
                return Err(config_error(
                    "mm_processor_kwargs",
                    format!(
                        "unknown key `{unknown}` in `{key}`; accepted keys: {}",
                        accepted.join(", ")
                    ),
                ));
            }
            self.apply(nested, scope)?;
        }
        self.validate()?;
        Ok(self)
    }

    fn apply(&mut self, object: &Map<String, Value>, scope: Scope) -> Result<()> {
        for (key, value) in object {
            match key.as_str() {
                "max_patches" => {
                    let n = int_in(value, "max_patches", 1, 1 << 40)?;
                    if matches!(scope, Scope::Both | Scope::Images) {
                        self.set_image_patch_limit(n);
                    }
                    if matches!(scope, Scope::Both | Scope::Videos) {
                        self.frame_patch_limit = n;
                    }
                }
                "patch_size" => self.patch_size = int_in(value, "patch_size", 1, 1024)? as u32,
                "merge_size" => {
                    self.merge_kernel_size = int_in(value, "merge_size", 1, 16)? as u32;
                }
                "temporal_patch_size" => {
                    self.temporal_patch_size = int_in(value, "temporal_patch_size", 1, 16)? as u32;
                }
                "size" => self.set_side_limit(value)?,
                "image_mean" => self.image_mean = per_channel(value, "image_mean")?,
                "image_std" => self.image_std = per_channel(value, "image_std")?,
                "images_kwargs" | "videos_kwargs" if matches!(scope, Scope::Both) => {}
                unknown => {
                    return Err(config_error(
                        "mm_processor_kwargs",
                        format!(
                            "unknown key `{unknown}`; accepted keys: {}",
                            ACCEPTED_KWARGS.join(", ")
                        ),
                    ))
                }
            }
        }
        Ok(())
    }

    fn set_image_patch_limit(&mut self, n: u64) {
        match &mut self.resize {
            ResizeRule::NavitPatchLimit { in_patch_limit, .. } => *in_patch_limit = n,
            ResizeRule::TokenLimit { in_token_limit, .. } => *in_token_limit = n,
        }
    }

    /// `size = {"max_height": n, "max_width": n}`: patches per side (transformers
    /// requires the two to be equal).
    fn set_side_limit(&mut self, value: &Value) -> Result<()> {
        let bad = |reason: String| Err(config_error("size", reason));
        let Some(size) = value.as_object() else {
            return bad(format!(
                "must be {{\"max_height\": n, \"max_width\": n}}, got {value}"
            ));
        };
        if let Some(other) = size
            .keys()
            .find(|k| *k != "max_height" && *k != "max_width")
        {
            return bad(format!(
                "takes only `max_height` and `max_width`, got `{other}`"
            ));
        }
        let side = |k: &str| size.get(k).and_then(Value::as_u64);
        let (Some(h), Some(w)) = (side("max_height"), side("max_width")) else {
            return bad(format!(
                "needs integer `max_height` and `max_width`, got {value}"
            ));
        };
        if h != w {
            return bad(format!(
                "`max_height` and `max_width` must be equal, got {h} and {w}"
            ));
        }
        match &mut self.resize {
            ResizeRule::NavitPatchLimit {
                patch_limit_on_one_side,
                ..
            } => {
                *patch_limit_on_one_side = u32::try_from(h).unwrap_or(u32::MAX);
                Ok(())
            }
            ResizeRule::TokenLimit { .. } => bad(
                "applies to the K2.5/K3 patch-limit rule only; Kimi-VL's grid limit is fixed"
                    .into(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn limits(cfg: &ImageProcessorConfig) -> (u64, u64, u32) {
        match cfg.resize {
            ResizeRule::NavitPatchLimit {
                in_patch_limit,
                patch_limit_on_one_side,
            } => (
                in_patch_limit,
                cfg.frame_patch_limit,
                patch_limit_on_one_side,
            ),
            ResizeRule::TokenLimit { in_token_limit, .. } => {
                (in_token_limit, cfg.frame_patch_limit, 0)
            }
        }
    }

    #[test]
    fn shared_keys_apply_to_images_and_frames_and_nested_ones_to_one() {
        let base = ImageProcessorConfig::kimi_k25();
        let cfg = base
            .with_kwargs(&json!({"max_patches": 1024, "size": {"max_height": 64, "max_width": 64}}))
            .expect("valid");
        assert_eq!(limits(&cfg), (1024, 1024, 64));
        let cfg = base
            .with_kwargs(&json!({
                "max_patches": 1024,
                "videos_kwargs": {"max_patches": 256, "temporal_patch_size": 2},
            }))
            .expect("valid");
        assert_eq!(limits(&cfg), (1024, 256, 512));
        assert_eq!(cfg.temporal_patch_size, 2);
        let cfg = base
            .with_kwargs(&json!({"images_kwargs": {"max_patches": 9000}}))
            .expect("valid");
        assert_eq!(limits(&cfg), (9000, 4096, 512));
        let cfg = base
            .with_kwargs(&json!({"image_mean": 0.25, "image_std": [0.1, 0.2, 0.3], "patch_size": 16, "merge_size": 1}))
            .expect("valid");
        assert_eq!(cfg.image_mean, [0.25; 3]);
        assert_eq!(cfg.image_std, [0.1, 0.2, 0.3]);
        assert_eq!((cfg.patch_size, cfg.merge_kernel_size), (16, 1));
        assert_eq!(base.with_kwargs(&json!({})).expect("empty"), base);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let base = ImageProcessorConfig::kimi_k25();
        let err = base.with_kwargs(&json!({"max_patch": 5})).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid image processor config: `mm_processor_kwargs` unknown key `max_patch`; \
             accepted keys: max_patches, patch_size, merge_size, temporal_patch_size, size, \
             image_mean, image_std, images_kwargs, videos_kwargs"
        );
        let err = base
            .with_kwargs(&json!({"videos_kwargs": {"size": {"max_height": 8, "max_width": 8}}}))
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("unknown key `size` in `videos_kwargs`"),
            "{err}"
        );
        let err = base.with_kwargs(&json!({"max_patches": 0})).unwrap_err();
        assert!(
            matches!(
                err,
                MediaError::Config {
                    field: "max_patches",
                    ..
                }
            ),
            "{err}"
        );
        let err = base.with_kwargs(&json!({"max_patches": 12.5})).unwrap_err();
        assert!(err.to_string().contains("got 12.5"), "{err}");
        let err = base
            .with_kwargs(&json!({"size": {"max_height": 8, "max_width": 9}}))
            .unwrap_err();
        assert!(
            err.to_string().contains("must be equal, got 8 and 9"),
            "{err}"
        );
        let err = base
            .with_kwargs(&json!({"image_std": [0.5, 0.0, 0.5]}))
            .unwrap_err();
        assert!(
            matches!(
                err,
                MediaError::Config {
                    field: "image_std",
                    ..
                }
            ),
            "{err}"
        );
        let err = base.with_kwargs(&json!([1, 2])).unwrap_err();
        assert!(err.to_string().contains("must be a JSON object"), "{err}");
        let err = ImageProcessorConfig::kimi_vl()
            .with_kwargs(&json!({"size": {"max_height": 8, "max_width": 8}}))
            .unwrap_err();
        assert!(err.to_string().contains("K2.5/K3"), "{err}");
        // Kimi-VL: max_patches is its in_token_limit.
        let cfg = ImageProcessorConfig::kimi_vl()
            .with_kwargs(&json!({"max_patches": 2048}))
            .expect("valid");
        assert_eq!(limits(&cfg), (2048, 2048, 0));
    }
}
