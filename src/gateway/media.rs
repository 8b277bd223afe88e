//! Images in prompts: from a request's image parts to content-keyed media
//! spans the scheduler splices into the forward.
//!
//! ```text
//! messages ──image_refs──▶ [ImageRef] (prompt order)
//!   ──resolve──▶ bytes (data: URL, or file:// under --allowed-media-dir)
//!   ──Ingest (decode + preprocess on its pool)──▶ PreparedMedia {hash, patches}
//!   ──VisionEncoder (packed tower pass, LRU by content hash)──▶ rows
//! prompt ids (one <|media_pad|> per image) ──expand_media──▶ ids, cache key, spans
//! ```
//!
//! The chat renderers write one placeholder per image (K3's template writes
//! `<|kimi_image_placeholder|>`, which [`super::model::ServedModel::render`]
//! turns into [`IMAGE_WRAPPER`]; K2's writes its `<|media_start|>` wrapper),
//! and each `<|media_pad|>` is expanded to the image's token count. A span's
//! radix key is derived from the hash of the image's bytes
//! ([`caracal_media::placeholder_keys`]), so the same picture at the same
//! place is a prefix-cache hit and costs no encode (the encoder's LRU) and
//! no prefill of its span.
//!
//! Nothing is fetched from the network: `http(s)://` URLs are refused with
//! `unsupported_parameter`; `file://` paths must resolve (symlinks
//! followed) inside `--allowed-media-dir`. Limits (`--limit-mm-per-prompt`,
//! `--max-image-bytes`, the decoder's pixel and side limits) fail the
//! request with an error that names the limit.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use caracal_actors::engine::CausalLm;
use caracal_actors::ingest::{Ingest, IngestConfig, IngestError};
use caracal_actors::messages::ValidRequest;
use caracal_actors::vision::{
    EncodeRequest, VisionConfig, VisionEncoder, VisionError, VisionStats,
};
use caracal_media::{DecodeLimits, ImageProcessorConfig};
use serde_json::Value;

use super::error::{ApiError, ApiResult};
use super::AppState;
use crate::chat::toolcall::{Message, MessageContent};
use crate::generate::{expand_media, EncodedMedia};

/// How one image is announced in a Kimi K2.5 / K3 prompt; its
/// `<|media_pad|>` is expanded to the image's tokens.
pub const IMAGE_WRAPPER: &str = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>";

/// The image-processor preset of a model type (K3's larger patch limit,
/// K2.5's otherwise).
pub fn processor_for(model_type: &str) -> ImageProcessorConfig {
    match model_type {
        "kimi_k3" => ImageProcessorConfig::kimi_k3(),
        _ => ImageProcessorConfig::kimi_k25(),
    }
}

/// Media settings of `caracal serve`.
#[derive(Debug, Clone)]
pub struct MediaConfig {
    /// Preprocessing (the model's preset with `--mm-processor-kwargs` applied).
    pub processor: ImageProcessorConfig,
    /// Folder `file://` image URLs may point into (`--allowed-media-dir`); none: refused.
    pub allowed_dir: Option<PathBuf>,
    /// Images per request (`--limit-mm-per-prompt '{"image": N}'`, default 16).
    pub max_images: usize,
    /// Encoded bytes per image (`--max-image-bytes`, default 20 MiB).
    pub max_image_bytes: usize,
    /// Decoder limits: pixels per image (`--max-image-pixels`) and per side.
    pub decode: DecodeLimits,
    /// Encoder cache and batching.
    pub encoder: VisionConfig,
    /// Preprocessing pool.
    pub ingest: IngestConfig,
}

impl MediaConfig {
    /// Defaults for a model of `model_type`.
    pub fn for_model_type(model_type: &str) -> MediaConfig {
        MediaConfig {
            processor: processor_for(model_type),
            allowed_dir: None,
            max_images: 16,
            max_image_bytes: 20 << 20,
            decode: DecodeLimits::default(),
            encoder: VisionConfig::default(),
            ingest: IngestConfig::default(),
        }
    }
}

/// The media actors of a server whose model has a vision tower.
pub struct MediaServices {
    /// Decoding and preprocessing.
    ingest: Ingest,
    /// The tower, batched, with its embedding cache.
    encoder: VisionEncoder,
    /// Settings.
    config: MediaConfig,
    /// `<|media_pad|>`.
    placeholder: u32,
}

impl MediaServices {
    /// Starts the actors for `model`; `None` when it has no tower.
    pub fn start(model: Arc<dyn CausalLm>, config: MediaConfig) -> Result<Option<Self>, String> {
        let Some(tower) = model.vision() else {
            return Ok(None);
        };
        let placeholder = tower.info().placeholder_id;
        let ingest = Ingest::start(config.ingest.clone()).map_err(|e| e.to_string())?;
        let encoder = VisionEncoder::start(model.clone(), config.encoder.clone())
            .map_err(|e| e.to_string())?;
        Ok(Some(MediaServices {
            ingest,
            encoder,
            config,
            placeholder,
        }))
    }

    /// The encoder's counters (for `/metrics`).
    pub fn stats(&self) -> VisionStats {
        self.encoder.stats()
    }
}

/// One image part of a request, in prompt order.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageRef {
    /// Where it is in the request, for errors (`messages[1].content[0]`).
    pub param: String,
    /// Its URL (`data:` or `file://`).
    pub url: String,
}

/// The URL of an image part: `image_url` as `{"url": …}` (Chat) or a
/// string (Responses, Realtime).
fn part_url(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("url").and_then(Value::as_str),
        _ => None,
    }
}

/// The image parts of `messages` in the order the renderers write them.
pub fn image_refs(messages: &[Message]) -> ApiResult<Vec<ImageRef>> {
    let mut out = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let Some(MessageContent::Parts(parts)) = &m.content else {
            continue;
        };
        for (j, p) in parts.iter().enumerate() {
            if !matches!(p.kind.as_str(), "image_url" | "image" | "input_image") {
                continue;
            }
            let param = format!("messages[{i}].content[{j}]");
            let url = p.image_url.as_ref().and_then(part_url).ok_or_else(|| {
                ApiError::invalid(
                    "invalid_value",
                    Some(&param),
                    "an image part needs an `image_url` (a data: URL, or file:// under --allowed-media-dir)",
                )
            })?;
            out.push(ImageRef {
                param,
                url: url.to_string(),
            });
        }
    }
    Ok(out)
}

/// A 400 naming the image part.
fn bad(param: &str, code: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(code, Some(param), message)
}

/// The bytes an image URL stands for.
fn resolve(r: &ImageRef, config: &MediaConfig) -> ApiResult<Vec<u8>> {
    let limit = config.max_image_bytes;
    if let Some(rest) = r.url.strip_prefix("data:") {
        let (meta, data) = rest
            .split_once(',')
            .ok_or_else(|| bad(&r.param, "invalid_image_url", "a data: URL needs a `,`"))?;
        if !meta.ends_with(";base64") {
            return Err(bad(
                &r.param,
                "invalid_image_url",
                "image data URLs must be base64 (`data:image/png;base64,…`)",
            ));
        }
        if data.len() / 4 * 3 > limit + 3 {
            return Err(image_too_large(&r.param, data.len() / 4 * 3, limit));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map_err(|e| {
                bad(
                    &r.param,
                    "invalid_image_url",
                    format!("bad base64 in the data URL: {e}"),
                )
            })?;
        return check_size(&r.param, bytes, limit);
    }
    if let Some(path) = r.url.strip_prefix("file://") {
        let Some(dir) = &config.allowed_dir else {
            return Err(ApiError::unsupported(
                &r.param,
                "file:// image URLs (start the server with --allowed-media-dir)",
            ));
        };
        let file = inside(dir, Path::new(path)).ok_or_else(|| {
            bad(
                &r.param,
                "media_path_not_allowed",
                format!("`{path}` is not a file inside the allowed media folder"),
            )
        })?;
        let len = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) as usize;
        if len > limit {
            return Err(image_too_large(&r.param, len, limit));
        }
        let bytes = std::fs::read(&file).map_err(|e| {
            bad(
                &r.param,
                "invalid_image_url",
                format!("reading `{path}`: {e}"),
            )
        })?;
        return check_size(&r.param, bytes, limit);
    }
    Err(ApiError::unsupported(
        &r.param,
        "image URLs that need a network fetch (send a data: URL)",
    ))
}

/// `path` resolved (symlinks followed) when it lies inside `dir`.
fn inside(dir: &Path, path: &Path) -> Option<PathBuf> {
    let root = dir.canonicalize().ok()?;
    let file = path.canonicalize().ok()?;
    (file.starts_with(&root) && file.is_file()).then_some(file)
}

fn check_size(param: &str, bytes: Vec<u8>, limit: usize) -> ApiResult<Vec<u8>> {
    if bytes.len() > limit {
        return Err(image_too_large(param, bytes.len(), limit));
    }
    Ok(bytes)
}

fn image_too_large(param: &str, size: usize, limit: usize) -> ApiError {
    bad(
        param,
        "image_too_large",
        format!("the image has {size} bytes; the limit is {limit} (--max-image-bytes)"),
    )
}

/// A failed preprocessing as a 400 (bad media) or 503 (overloaded).
fn ingest_error(param: &str, e: IngestError) -> ApiError {
    match e {
        IngestError::Overloaded { .. } => ApiError::overloaded(e.to_string()),
        IngestError::Media(m) => bad(param, m.kind(), format!("{param}: {m}")),
        IngestError::Internal(m) => ApiError::internal(m),
    }
}

fn vision_error(e: VisionError) -> ApiError {
    match e {
        VisionError::Overloaded { .. } => ApiError::overloaded(e.to_string()),
        VisionError::InvalidInput(_) => ApiError::invalid(e.kind(), None, e.to_string()),
        _ => ApiError::internal(e.to_string()),
    }
}

/// Decodes, preprocesses and encodes the images of `messages` (all at
/// once, so the encoder packs them into one pass).
pub async fn encode_images(state: &AppState, messages: &[Message]) -> ApiResult<Vec<EncodedMedia>> {
    let refs = image_refs(messages)?;
    if refs.is_empty() {
        return Ok(Vec::new());
    }
    let Some(media) = state.media.as_ref() else {
        return Err(ApiError::unsupported(
            &refs[0].param,
            "images: this model takes no images",
        ));
    };
    let cfg = &media.config;
    if refs.len() > cfg.max_images {
        return Err(bad(
            &refs[cfg.max_images].param,
            "too_many_images",
            format!(
                "the request has {} images; the limit is {} (--limit-mm-per-prompt)",
                refs.len(),
                cfg.max_images
            ),
        ));
    }
    let jobs = refs.iter().map(|r| async move {
        let bytes: Arc<[u8]> = Arc::from(resolve(r, cfg)?);
        let prepared = media
            .ingest
            .prepare_image(bytes, &cfg.processor, cfg.decode)
            .await
            .map_err(|e| ingest_error(&r.param, e))?;
        let rows = media
            .encoder
            .encode(EncodeRequest {
                hash: prepared.hash,
                input: prepared.input,
            })
            .await
            .map_err(vision_error)?;
        Ok::<_, ApiError>(EncodedMedia {
            hash: prepared.hash,
            rows,
            num_tokens: prepared.num_tokens,
        })
    });
    futures::future::try_join_all(jobs).await
}

/// Puts `items` into `valid`: its placeholders expanded, the media spans
/// and the content-keyed cache key set; the prompt is checked against the
/// context again, expanded. Nothing changes without media.
pub fn splice(state: &AppState, valid: &mut ValidRequest, items: &[EncodedMedia]) -> ApiResult<()> {
    let placeholder = match (&state.media, items.is_empty()) {
        (_, true) => return Ok(()),
        (Some(m), false) => m.placeholder,
        (None, false) => return Err(ApiError::internal("media without a vision tower")),
    };
    let expanded = expand_media(&valid.prompt, placeholder, items)
        .map_err(|e| ApiError::invalid("invalid_value", Some("messages"), e.to_string()))?;
    state.model.check_prompt(expanded.ids.len())?;
    let room = state.model.info.max_position - expanded.ids.len();
    valid.max_tokens = valid.max_tokens.min(room).max(1);
    valid.prompt = expanded.ids;
    valid.cache_key = Some(expanded.cache_key);
    valid.media = expanded.spans;
    Ok(())
}
