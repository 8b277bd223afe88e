//! Images and videos in prompts: from a request's media parts to
//! content-keyed media spans the scheduler splices into the forward.
//!
//! ```text
//! messages ──media_refs──▶ [MediaRef] (prompt order: images and videos)
//!   ──locate──▶ bytes or a file (data: URL, or file:// under --allowed-media-dir)
//!   image: ──Ingest (decode + preprocess on its pool)──▶ PreparedMedia {hash, patches}
//!   video: ──FFmpeg decode + sample at the part's fps (blocking pool, bounded)──▶ frames
//!          ──Ingest prepare_frames (chunks of ≤4 frames)──▶ [PreparedChunk {hash, prompt}]
//!   ──VisionEncoder (packed tower pass, LRU by content hash)──▶ rows per item
//! video parts ──RequestMedia::substitute──▶ `video` parts holding the chunk prompts
//! render ──▶ prompt ids (one <|media_pad|> per image and per chunk)
//!   ──expand_media──▶ ids, cache key, spans
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
//! # Video
//!
//! Videos are resolved **before** rendering: a `video_url` (Chat) or
//! `input_video` (Responses, Realtime, `function_call_output`) part is
//! decoded, sampled at its `fps` (default 2; `video_url.fps` or a part-level
//! `fps`) by transformers' sampler, cut into chunks of up to 4 frames
//! (`caracal_media::chunk_frames`) and encoded chunk by chunk; then
//! [`RequestMedia::substitute`] replaces the part with a `video` part whose
//! text is the concatenation of the chunk prompts,
//! `{HH:MM:SS.mmm}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>`
//! per chunk (the chunk's first-frame time), which the K3 and K2 renderers
//! write as it stands (`video-anchors.md` §1: the template's video
//! placeholder becomes the chunk prompts). Each chunk's `<|media_pad|>` is
//! expanded to the chunk's tokens (one frame's worth: the tower mean-pools
//! the chunk's frames) and keyed by the chunk's frames hash, so the same
//! video at the same place encodes nothing new and its spans are cached.
//! Resolving first (rather than a placeholder id expanded after
//! tokenization) lets the timestamps be tokenized in place, as the
//! reference processor does, and needs no token the vocabulary lacks (K3
//! has no video placeholder id). Stored conversations keep the unresolved
//! parts: a later turn resolves them again and hits the encoder's cache.
//! Decoding runs on tokio's blocking pool, at most `ingest.threads`
//! videos at a time; the chunking on the Ingest pool.
//!
//! Nothing is fetched from the network: `http(s)://` URLs are refused with
//! `unsupported_parameter`; `file://` paths must resolve (symlinks
//! followed) inside `--allowed-media-dir`. Limits fail the request with a
//! 400 that names the limit: `--limit-mm-per-prompt` (`too_many_images`,
//! `too_many_videos`), `--max-image-bytes` (`image_too_large`),
//! `--max-video-bytes` (`video_too_large`), the decoder's pixel and side
//! limits, `--max-video-frames` (`video_too_many_frames`) and
//! `--max-video-seconds` (`video_too_long`). Bad video bytes get the media
//! error's kind (`video_format_mismatch`, `video_decode_failed`,
//! `video_truncated`, `video_open_failed`, ...).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use caracal_actors::engine::CausalLm;
use caracal_actors::ingest::{Ingest, IngestConfig, IngestError};
use caracal_actors::messages::ValidRequest;
use caracal_actors::vision::{
    EncodeRequest, VisionConfig, VisionEncoder, VisionError, VisionStats,
};
use caracal_media::video::{
    decode_video_bytes, decode_video_file, Container, OutputSize, VideoLimits, VideoOptions,
};
use caracal_media::{DecodeLimits, ImageProcessorConfig, MediaError};
use serde_json::Value;

use super::decode_queue::DecodeQueue;
use super::error::{ApiError, ApiResult};
use super::AppState;
use crate::chat::toolcall::{is_video_part, ContentPart, Message, MessageContent};
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
    /// Videos per request (`--limit-mm-per-prompt '{"video": N}'`, default 4).
    pub max_videos: usize,
    /// Encoded bytes per video (`--max-video-bytes`, default 256 MiB).
    pub max_video_bytes: usize,
    /// Videos waiting for a decode slot before further ones are refused
    /// with `overloaded` (`--max-waiting-videos`, default 16).
    pub max_waiting_videos: usize,
    /// Video decoder limits: sampled frames (`--max-video-frames`, default
    /// 14400), media time (`--max-video-seconds`, default 7200 s), frame size
    /// (the image pixel and side limits); `max_bytes` follows `max_video_bytes`.
    pub video: VideoLimits,
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
            max_videos: 4,
            max_video_bytes: 256 << 20,
            max_waiting_videos: 16,
            video: VideoLimits {
                max_bytes: 256 << 20,
                ..VideoLimits::default()
            },
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
    /// Videos decoding at once (`ingest.threads`) and the bounded line
    /// in front of them (`max_waiting_videos`).
    video_slots: DecodeQueue,
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
        let video_slots = DecodeQueue::new(
            config.ingest.threads.clamp(1, 64),
            config.max_waiting_videos,
        );
        Ok(Some(MediaServices {
            ingest,
            encoder,
            config,
            placeholder,
            video_slots,
        }))
    }

    /// The encoder's counters (for `/metrics`).
    pub fn stats(&self) -> VisionStats {
        self.encoder.stats()
    }

    /// The media settings.
    pub fn config(&self) -> &MediaConfig {
        &self.config
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

/// One video part of a request, in prompt order.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoRef {
    /// Where it is in the request, for errors (`messages[1].content[0]`).
    pub param: String,
    /// Its URL (`data:` or `file://`).
    pub url: String,
    /// Sampling rate in frames per second (the part's, default 2).
    pub fps: f64,
}

/// A media part of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum MediaRef {
    /// An image: one item.
    Image(ImageRef),
    /// A video: one item per chunk.
    Video(VideoRef),
}

/// The default sampling rate of a video part (Kimi K2.5's `sample_fps`).
pub const DEFAULT_VIDEO_FPS: f64 = 2.0;

/// The URL of an image part: `image_url` as `{"url": …}` (Chat) or a
/// string (Responses, Realtime).
fn part_url(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("url").and_then(Value::as_str),
        _ => None,
    }
}

/// The sampling rate of a video part: its own `fps`, else `video_url.fps`,
/// else [`DEFAULT_VIDEO_FPS`]; in `(0, 1000]`.
fn part_fps(p: &ContentPart, param: &str) -> ApiResult<f64> {
    let nested = p.video_url.as_ref().and_then(|v| v.get("fps"));
    let fps = match (p.fps, nested) {
        (Some(f), _) => f,
        (None, Some(v)) => v.as_f64().ok_or_else(|| {
            ApiError::invalid(
                "invalid_type",
                Some(&format!("{param}.video_url.fps")),
                "`fps` must be a number",
            )
        })?,
        (None, None) => DEFAULT_VIDEO_FPS,
    };
    if !(fps > 0.0 && fps <= 1000.0) {
        return Err(ApiError::invalid(
            "invalid_value",
            Some(&format!("{param}.fps")),
            format!("`fps` must be in (0, 1000], got {fps}"),
        ));
    }
    Ok(fps)
}

/// The image and video parts of `messages` in the order the renderers
/// write them.
pub fn media_refs(messages: &[Message]) -> ApiResult<Vec<MediaRef>> {
    let mut out = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let Some(MessageContent::Parts(parts)) = &m.content else {
            continue;
        };
        for (j, p) in parts.iter().enumerate() {
            let param = format!("messages[{i}].content[{j}]");
            if is_video_part(&p.kind) {
                let url = p.video_url.as_ref().and_then(part_url).ok_or_else(|| {
                    ApiError::invalid(
                        "invalid_value",
                        Some(&param),
                        "a video part needs a `video_url` (a data: URL, or file:// under --allowed-media-dir)",
                    )
                })?;
                out.push(MediaRef::Video(VideoRef {
                    fps: part_fps(p, &param)?,
                    param,
                    url: url.to_string(),
                }));
                continue;
            }
            if !matches!(p.kind.as_str(), "image_url" | "image" | "input_image") {
                continue;
            }
            let url = p.image_url.as_ref().and_then(part_url).ok_or_else(|| {
                ApiError::invalid(
                    "invalid_value",
                    Some(&param),
                    "an image part needs an `image_url` (a data: URL, or file:// under --allowed-media-dir)",
                )
            })?;
            out.push(MediaRef::Image(ImageRef {
                param,
                url: url.to_string(),
            }));
        }
    }
    Ok(out)
}

/// A 400 naming the image part.
fn bad(param: &str, code: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(code, Some(param), message)
}

/// What the error codes and messages of one media kind say.
struct Kind {
    /// `image` / `video`.
    noun: &'static str,
    /// The code of a malformed URL.
    bad_url: &'static str,
    /// The code of an over-size item.
    too_large: &'static str,
    /// The flag that sets the size limit.
    flag: &'static str,
}

const IMAGE: Kind = Kind {
    noun: "image",
    bad_url: "invalid_image_url",
    too_large: "image_too_large",
    flag: "--max-image-bytes",
};

const VIDEO: Kind = Kind {
    noun: "video",
    bad_url: "invalid_video_url",
    too_large: "video_too_large",
    flag: "--max-video-bytes",
};

/// Where a media URL's bytes are.
enum Source {
    /// Decoded from a data: URL, with its media type (`video/mp4`).
    Bytes { bytes: Vec<u8>, mime: String },
    /// A file inside the allowed folder, its size checked.
    File(PathBuf),
}

/// Finds the bytes `url` stands for, checking the size limit.
fn locate(
    param: &str,
    url: &str,
    kind: &Kind,
    limit: usize,
    config: &MediaConfig,
) -> ApiResult<Source> {
    let too_large = |size: usize| {
        bad(
            param,
            kind.too_large,
            format!(
                "the {} has {size} bytes; the limit is {limit} ({})",
                kind.noun, kind.flag
            ),
        )
    };
    if let Some(rest) = url.strip_prefix("data:") {
        let (meta, data) = rest
            .split_once(',')
            .ok_or_else(|| bad(param, kind.bad_url, "a data: URL needs a `,`"))?;
        let Some(mime) = meta.strip_suffix(";base64") else {
            return Err(bad(
                param,
                kind.bad_url,
                format!(
                    "{} data URLs must be base64 (`data:{}/…;base64,…`)",
                    kind.noun, kind.noun
                ),
            ));
        };
        if data.len() / 4 * 3 > limit + 3 {
            return Err(too_large(data.len() / 4 * 3));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map_err(|e| {
                bad(
                    param,
                    kind.bad_url,
                    format!("bad base64 in the data URL: {e}"),
                )
            })?;
        if bytes.len() > limit {
            return Err(too_large(bytes.len()));
        }
        return Ok(Source::Bytes {
            bytes,
            mime: mime.to_ascii_lowercase(),
        });
    }
    if let Some(path) = url.strip_prefix("file://") {
        let Some(dir) = &config.allowed_dir else {
            return Err(ApiError::unsupported(
                param,
                format!(
                    "file:// {} URLs (start the server with --allowed-media-dir)",
                    kind.noun
                ),
            ));
        };
        let file = inside(dir, Path::new(path)).ok_or_else(|| {
            bad(
                param,
                "media_path_not_allowed",
                format!("`{path}` is not a file inside the allowed media folder"),
            )
        })?;
        let len = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) as usize;
        if len > limit {
            return Err(too_large(len));
        }
        return Ok(Source::File(file));
    }
    Err(ApiError::unsupported(
        param,
        format!(
            "{} URLs that need a network fetch (send a data: URL)",
            kind.noun
        ),
    ))
}

/// The bytes an image URL stands for.
fn resolve(r: &ImageRef, config: &MediaConfig) -> ApiResult<Vec<u8>> {
    let limit = config.max_image_bytes;
    match locate(&r.param, &r.url, &IMAGE, limit, config)? {
        Source::Bytes { bytes, .. } => Ok(bytes),
        Source::File(file) => {
            let bytes = std::fs::read(&file).map_err(|e| {
                bad(
                    &r.param,
                    IMAGE.bad_url,
                    format!("reading `{}`: {e}", file.display()),
                )
            })?;
            if bytes.len() > limit {
                return Err(bad(
                    &r.param,
                    IMAGE.too_large,
                    format!(
                        "the image has {} bytes; the limit is {limit} ({})",
                        bytes.len(),
                        IMAGE.flag
                    ),
                ));
            }
            Ok(bytes)
        }
    }
}

/// The container a data URL's media type declares (`Auto` for others,
/// which lets the bytes decide).
fn container_of(mime: &str) -> Container {
    match mime {
        "video/mp4" | "video/quicktime" | "video/x-m4v" => Container::Mp4,
        "video/webm" | "video/x-matroska" => Container::WebM,
        "video/mp2t" => Container::MpegTs,
        "video/h264" => Container::H264,
        _ => Container::Auto,
    }
}

/// `path` resolved (symlinks followed) when it lies inside `dir`.
fn inside(dir: &Path, path: &Path) -> Option<PathBuf> {
    let root = dir.canonicalize().ok()?;
    let file = path.canonicalize().ok()?;
    (file.starts_with(&root) && file.is_file()).then_some(file)
}

/// A failed preprocessing as a 400 (bad media) or 503 (overloaded).
pub(crate) fn ingest_error(param: &str, e: IngestError) -> ApiError {
    match e {
        IngestError::Overloaded { .. } => ApiError::overloaded(e.to_string()),
        IngestError::Media(m) => media_error(param, m),
        IngestError::Internal(m) => ApiError::internal(m),
    }
}

/// Rejected media as a 400 with the media error's kind; the video limits
/// also name their flag.
pub(crate) fn media_error(param: &str, m: MediaError) -> ApiError {
    let flag = match &m {
        MediaError::VideoTooManyFrames { .. } => " (--max-video-frames)",
        MediaError::VideoTooLong { .. } => " (--max-video-seconds)",
        MediaError::VideoTooManyBytes { .. } => " (--max-video-bytes)",
        MediaError::VideoFrameTooLarge { .. } => " (--max-image-pixels)",
        _ => "",
    };
    bad(param, m.kind(), format!("{param}: {m}{flag}"))
}

fn vision_error(e: VisionError) -> ApiError {
    match e {
        VisionError::Overloaded { .. } => ApiError::overloaded(e.to_string()),
        VisionError::InvalidInput(_) => ApiError::invalid(e.kind(), None, e.to_string()),
        _ => ApiError::internal(e.to_string()),
    }
}

/// The media of a request, encoded.
#[derive(Debug, Default)]
pub struct RequestMedia {
    /// Items in the order their placeholders appear in the rendered prompt:
    /// one per image, one per video chunk.
    pub items: Vec<EncodedMedia>,
    /// The concatenated chunk prompts of each video part, in order.
    videos: Vec<String>,
}

impl RequestMedia {
    /// Replaces each video part of `messages` (in the order [`media_refs`]
    /// found them) with a `video` part holding its chunk prompts, which the
    /// renderers write as they stand.
    pub fn substitute(&self, messages: &mut [Message]) {
        if self.videos.is_empty() {
            return;
        }
        let mut next = self.videos.iter();
        for m in messages.iter_mut() {
            let Some(MessageContent::Parts(parts)) = &mut m.content else {
                continue;
            };
            for p in parts.iter_mut().filter(|p| is_video_part(&p.kind)) {
                if let Some(prompts) = next.next() {
                    *p = ContentPart::video(prompts.clone());
                }
            }
        }
    }
}

/// Decodes, preprocesses and encodes the images and videos of `messages`
/// (all items at once, so the encoder packs what it can into one pass).
pub async fn encode_media(state: &AppState, messages: &[Message]) -> ApiResult<RequestMedia> {
    let refs = media_refs(messages)?;
    if refs.is_empty() {
        return Ok(RequestMedia::default());
    }
    let Some(media) = state.media.as_ref() else {
        let (param, what) = match &refs[0] {
            MediaRef::Image(r) => (&r.param, "images: this model takes no images"),
            MediaRef::Video(r) => (&r.param, "video: this model takes no video"),
        };
        return Err(ApiError::unsupported(param, what));
    };
    let cfg = &media.config;
    let images: Vec<&ImageRef> = refs
        .iter()
        .filter_map(|r| match r {
            MediaRef::Image(i) => Some(i),
            MediaRef::Video(_) => None,
        })
        .collect();
    let videos: Vec<&VideoRef> = refs
        .iter()
        .filter_map(|r| match r {
            MediaRef::Video(v) => Some(v),
            MediaRef::Image(_) => None,
        })
        .collect();
    if images.len() > cfg.max_images {
        return Err(bad(
            &images[cfg.max_images].param,
            "too_many_images",
            format!(
                "the request has {} images; the limit is {} (--limit-mm-per-prompt)",
                images.len(),
                cfg.max_images
            ),
        ));
    }
    if videos.len() > cfg.max_videos {
        return Err(bad(
            &videos[cfg.max_videos].param,
            "too_many_videos",
            format!(
                "the request has {} videos; the limit is {} (--limit-mm-per-prompt)",
                videos.len(),
                cfg.max_videos
            ),
        ));
    }
    let jobs = refs.iter().map(|r| async move {
        match r {
            MediaRef::Image(r) => Ok((vec![encode_image(media, r).await?], None)),
            MediaRef::Video(v) => {
                let (items, prompts) = encode_video(media, v).await?;
                Ok::<_, ApiError>((items, Some(prompts)))
            }
        }
    });
    let mut out = RequestMedia::default();
    for (items, prompts) in futures::future::try_join_all(jobs).await? {
        out.items.extend(items);
        out.videos.extend(prompts);
    }
    Ok(out)
}

/// One image: decoded and preprocessed on the Ingest pool, then encoded.
async fn encode_image(media: &MediaServices, r: &ImageRef) -> ApiResult<EncodedMedia> {
    let cfg = &media.config;
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
    Ok(EncodedMedia {
        hash: prepared.hash,
        rows,
        num_tokens: prepared.num_tokens,
    })
}

/// One video: decoded and sampled at its fps on the blocking pool (at
/// most `ingest.threads` at once, `max_waiting_videos` more waiting, the
/// rest refused), chunked on the Ingest pool, each chunk
/// encoded. Returns the chunks' items and their concatenated prompts.
async fn encode_video(
    media: &MediaServices,
    v: &VideoRef,
) -> ApiResult<(Vec<EncodedMedia>, String)> {
    let cfg = &media.config;
    let source = locate(&v.param, &v.url, &VIDEO, cfg.max_video_bytes, cfg)?;
    let options = VideoOptions {
        fps: v.fps,
        output: OutputSize::Processor(cfg.processor.frame_config()),
        limits: VideoLimits {
            max_bytes: cfg.max_video_bytes as u64,
            ..cfg.video
        },
        ..VideoOptions::default()
    };
    let decoded = {
        let place = media.video_slots.enter()?;
        let turn = media.video_slots.turn(place).await?;
        // The turn is held by the decode itself, which goes on when the
        // request is dropped.
        tokio::task::spawn_blocking(move || {
            let _turn = turn;
            match source {
                Source::Bytes { bytes, mime } => {
                    decode_video_bytes(bytes, container_of(&mime), &options)
                }
                Source::File(path) => decode_video_file(path, Container::Auto, &options),
            }
        })
        .await
        .map_err(|e| ApiError::internal(format!("video decoding failed: {e}")))?
        .map_err(|m| media_error(&v.param, m))?
    };
    tracing::debug!(
        param = %v.param,
        codec = %decoded.info.codec,
        frames = decoded.frames.len(),
        src_fps = decoded.src_fps,
        "video decoded"
    );
    let (frames, times): (Vec<_>, Vec<_>) = decoded
        .frames
        .into_iter()
        .map(|f| (f.image, f.timestamp))
        .unzip();
    let chunks = encode_frames(media, frames, times, &v.param).await?;
    let prompts: String = chunks.iter().map(|c| c.prompt.as_str()).collect();
    Ok((chunks.into_iter().map(|c| c.item).collect(), prompts))
}

/// One video chunk, encoded.
#[derive(Debug, Clone)]
pub struct EncodedChunk {
    /// Its rows, hash and token count.
    pub item: EncodedMedia,
    /// `{HH:MM:SS.mmm}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>`.
    pub prompt: String,
    /// The time of its first frame in seconds.
    pub timestamp: f64,
}

/// Decoded frames (with their times in seconds) cut into chunks of up to 4
/// and preprocessed on the Ingest pool, then each chunk encoded: what a
/// video part and a live stream ([`super::realtime::live`]) share. `param`
/// names the input in errors.
pub async fn encode_frames(
    media: &MediaServices,
    frames: Vec<caracal_media::RgbImage>,
    times: Vec<f64>,
    param: &str,
) -> ApiResult<Vec<EncodedChunk>> {
    let chunks = media
        .ingest
        .prepare_frames(frames, times, &media.config.processor)
        .await
        .map_err(|e| ingest_error(param, e))?;
    let jobs = chunks.into_iter().map(|c| async move {
        let rows = media
            .encoder
            .encode(EncodeRequest {
                hash: c.hash,
                input: c.input,
            })
            .await
            .map_err(vision_error)?;
        Ok::<_, ApiError>(EncodedChunk {
            item: EncodedMedia {
                hash: c.hash,
                rows,
                num_tokens: c.num_tokens,
            },
            prompt: c.prompt,
            timestamp: c.timestamp,
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
