//! `caracal generate`: one prompt in, tokens out (text or JSON).
//!
//! With `--json-schema FILE` the output is one JSON value matching the
//! schema; with `--tools FILE` (a Chat Completions `tools` array) and
//! `--tool-choice required|auto|NAME` the model's tool calls are
//! constrained to those tools in its own format (the tools are rendered
//! into the prompt with `--chat`). Constrained runs go through the
//! runtime's scheduler, where the constraint is applied; plain runs use the
//! direct decode loop.
//!
//! `--image FILE` (repeatable) gives a vision-language model images, decoded
//! and preprocessed by `caracal_media` with the model's processor preset
//! (Kimi K2.5 for `kimi_k25`, Kimi K3 for `kimi_k3`; `--mm-processor-kwargs`
//! overrides it). With `--prompt-ids`, each occurrence of the model's
//! placeholder id (`media_placeholder_token_id` / `image_token_id`) stands
//! for the next image; with `--chat`, each image becomes
//! `<|media_begin|>image<|media_content|><|media_pad|><|media_end|>` before
//! the prompt text of the user message. The placeholder is then expanded to
//! the image's token count and the tower's rows replace those embeddings.
//!
//! `--video FILE [--fps N]` (repeatable) decodes each video with FFmpeg,
//! samples it at `--fps` (default 2) as transformers' Kimi K2.5 video
//! processor does, and cuts it into chunks of up to 4 frames, each encoded
//! by the tower and announced by
//! `{HH:MM:SS.mmm}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>`
//! (its first frame's time). With `--chat` the chunk prompts of every video
//! go before the prompt text of the user message (after the images). With
//! `--prompt-ids`, each occurrence of the media placeholder id
//! (`<|media_pad|>`, the tower's `placeholder_id`; K3 has no separate video
//! placeholder) stands for the next video and is replaced by its chunk
//! prompts, whose `<|media_pad|>`s then expand to each chunk's tokens; so
//! `--prompt-ids` takes `--image` or `--video`, not both. `--json` reports
//! `media_tokens` per item (per image, per video chunk) and `video_chunks`
//! (video, timestamp, tokens).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use caracal::chat::toolcall::{render_k2, render_k3, K3Options, Message};
use caracal::chat::{render, ChatMessage};
use std::sync::Arc;

use caracal::constrain::{ConstraintSpec, ToolFormat, ToolsSpec};
use caracal::generate::{generate_with, splice_media, GenerateRequest};
use caracal::models::{CausalLm, VisionInput};
use caracal::request::tool_format_for;
use caracal::text::tokenizer::{ChatFormat, StreamDecoder, TextTokenizer};
use caracal_actors::constraint::SeqConstraint;
use caracal_actors::messages::{StopConditions, TokenEvent, ValidRequest};
use caracal_actors::runtime::{Engine, EngineConfig};
use caracal_kernels::sampling::SamplingParams;
use clap::Args;
use serde_json::{json, Value};

/// Arguments of `caracal generate`.
#[derive(Args)]
pub struct GenerateArgs {
    /// Checkpoint folder (config.json, *.safetensors, tokenizer.json or
    /// tiktoken.model); default: the built-in tiny Kimi K3 (random weights).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt text.
    #[arg(long, conflicts_with_all = ["prompt_ids", "prompt_file"])]
    prompt: Option<String>,
    /// Prompt text read from a UTF-8 file (for prompts too large for a
    /// command line; chunked prefill takes any length up to the context).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt_file: Option<PathBuf>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Most new tokens.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass (1 disables).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 disables).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Seed of the sampler.
    #[arg(long)]
    seed: Option<u64>,
    /// Do not stop at the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
    /// JSON schema file: the output is one JSON value matching it.
    #[arg(long, conflicts_with = "tools")]
    json_schema: Option<PathBuf>,
    /// Tools file (a Chat Completions `tools` array): tool calls are
    /// constrained to these tools and their parameter schemas.
    #[arg(long)]
    tools: Option<PathBuf>,
    /// With --tools: `required`, `auto` (free text until a call opens) or a tool name.
    #[arg(long, default_value = "auto", requires = "tools")]
    tool_choice: String,
    /// Image file (PNG or JPEG); repeat for several. With --prompt-ids each
    /// placeholder id stands for the next image; with --chat the images go
    /// before the prompt text.
    #[arg(long = "image")]
    images: Vec<PathBuf>,
    /// Video file (MP4, WebM, MPEG-TS, raw H.264); repeat for several. With
    /// --prompt-ids each media placeholder id stands for the next video (and
    /// expands to its chunk prompts); with --chat the videos go before the
    /// prompt text.
    #[arg(long = "video")]
    videos: Vec<PathBuf>,
    /// Frames per second sampled from each --video, in (0, 1000].
    #[arg(long, default_value_t = caracal::gateway::media::DEFAULT_VIDEO_FPS)]
    fps: f64,
    /// JSON object overriding image-processor options, e.g.
    /// `{"max_patches": 256}` (the keys of transformers' Kimi K2.5
    /// processors: max_patches, patch_size, merge_size, temporal_patch_size,
    /// size, image_mean, image_std, images_kwargs, videos_kwargs).
    #[arg(long)]
    mm_processor_kwargs: Option<String>,
}

/// The image-processor settings of a model type, with `kwargs` applied.
fn processor_config(
    model_type: &str,
    kwargs: Option<&str>,
) -> Result<caracal_media::ImageProcessorConfig> {
    let cfg = caracal::gateway::media::processor_for(model_type);
    let Some(text) = kwargs else {
        return Ok(cfg);
    };
    let v: Value =
        serde_json::from_str(text).map_err(|e| anyhow!("--mm-processor-kwargs: not JSON: {e}"))?;
    cfg.with_kwargs(&v)
        .map_err(|e| anyhow!("--mm-processor-kwargs: {e}"))
}

/// The processor settings for `model`'s tower (`flag` names the option in
/// errors, `what` the media): none without a tower, and the processor's
/// patch and merge sizes must be the tower's.
fn tower_processor(
    model: &dyn CausalLm,
    flag: &str,
    what: &str,
    kwargs: Option<&str>,
) -> Result<caracal_media::ImageProcessorConfig> {
    let tower = model.vision().ok_or_else(|| {
        anyhow!(
            "{flag}: the model (`{}`) has no vision tower, so it takes no {what}",
            model.info().model_type
        )
    })?;
    let cfg = processor_config(&model.info().model_type, kwargs)?;
    if cfg.patch_size as usize != tower.info().patch_size
        || cfg.merge_kernel_size as usize != tower.info().merge_size
    {
        bail!(
            "{flag}: the processor's patch {} / merge {} differ from the tower's {} / {}",
            cfg.patch_size,
            cfg.merge_kernel_size,
            tower.info().patch_size,
            tower.info().merge_size
        );
    }
    Ok(cfg)
}

/// Decodes and preprocesses the `--image` files for `model`'s tower.
fn load_images(
    model: &dyn CausalLm,
    paths: &[PathBuf],
    kwargs: Option<&str>,
) -> Result<Vec<VisionInput>> {
    let cfg = tower_processor(model, "--image", "images", kwargs)?;
    paths
        .iter()
        .map(|p| {
            let bytes = std::fs::read(p).map_err(|e| anyhow!("--image {}: {e}", p.display()))?;
            let img = caracal_media::process_image_bytes(&bytes, &cfg)
                .map_err(|e| anyhow!("--image {}: {e}", p.display()))?;
            Ok(VisionInput {
                pixel_values: img.pixel_values,
                grid_thw: img.grid_thw,
            })
        })
        .collect()
}

/// One `--video`, decoded, sampled and cut into tower chunks.
struct LoadedVideo {
    /// One tower item per chunk.
    items: Vec<VisionInput>,
    /// The chunks' prompts, concatenated.
    prompts: String,
    /// Each chunk's first-frame time (`HH:MM:SS.mmm`) and LM tokens.
    chunks: Vec<(String, usize)>,
}

/// Decodes the `--video` files for `model`'s tower, sampled at `fps`.
fn load_videos(
    model: &dyn CausalLm,
    paths: &[PathBuf],
    fps: f64,
    kwargs: Option<&str>,
) -> Result<Vec<LoadedVideo>> {
    use caracal_media::video::{decode_video_file, Container, OutputSize, VideoOptions};
    let cfg = tower_processor(model, "--video", "video", kwargs)?;
    let options = VideoOptions {
        fps,
        output: OutputSize::Processor(cfg.frame_config()),
        ..VideoOptions::default()
    };
    paths
        .iter()
        .map(|p| {
            let what = |e: caracal_media::MediaError| {
                anyhow!("--video {}: {e} ({})", p.display(), e.kind())
            };
            let decoded = decode_video_file(p, Container::Auto, &options).map_err(what)?;
            let (frames, times): (Vec<_>, Vec<_>) = decoded
                .frames
                .into_iter()
                .map(|f| (f.image, f.timestamp))
                .unzip();
            let chunks = caracal_media::chunk_frames(&frames, &times, &cfg).map_err(what)?;
            Ok(LoadedVideo {
                prompts: chunks.iter().map(|c| c.prompt()).collect(),
                chunks: chunks
                    .iter()
                    .map(|c| (c.timestamp_text(), c.num_tokens))
                    .collect(),
                items: chunks
                    .into_iter()
                    .map(|c| VisionInput {
                        pixel_values: c.pixel_values,
                        grid_thw: c.grid_thw,
                    })
                    .collect(),
            })
        })
        .collect()
}

/// `ids` with the `i`-th `placeholder` replaced by the tokens of video
/// `i`'s chunk prompts (one `<|media_pad|>` per chunk).
fn expand_video_ids(
    ids: &[u32],
    placeholder: u32,
    videos: &[LoadedVideo],
    tok: Option<&TextTokenizer>,
) -> Result<Vec<u32>> {
    let found = ids.iter().filter(|&&t| t == placeholder).count();
    if found != videos.len() {
        bail!(
            "--video: the prompt ids hold {found} media placeholders (id {placeholder}) for {} videos",
            videos.len()
        );
    }
    let tok = tok.ok_or_else(|| {
        anyhow!("--video with --prompt-ids needs a tokenizer (for the chunk timestamps)")
    })?;
    let mut next = videos.iter();
    let mut out = Vec::with_capacity(ids.len());
    for &t in ids {
        if t != placeholder {
            out.push(t);
            continue;
        }
        let v = next
            .next()
            .expect("one video per placeholder, counted above");
        out.extend(tok.encode_chat(&v.prompts)?);
    }
    Ok(out)
}

/// Reads a JSON file named by a flag.
fn read_json_file(flag: &str, path: &std::path::Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).map_err(|e| anyhow!("{flag} {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| anyhow!("{flag} {}: not JSON: {e}", path.display()))
}

/// Runs `caracal generate`.
pub fn run(mut a: GenerateArgs, load: &caracal::checkpoint::LoadOptions) -> Result<()> {
    if let Some(path) = a.prompt_file.take() {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading --prompt-file {}", path.display()))?;
        a.prompt = Some(text);
    }
    if !(0.0..=100.0).contains(&a.temperature) {
        bail!("--temperature must be in [0, 100], got {}", a.temperature);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", a.top_p);
    }
    let model_dir = super::model_dir(a.model.clone())?;
    let loaded = super::load_model(&model_dir, load)?;
    let tok = loaded.tokenizer.as_ref();
    let schema = match &a.json_schema {
        Some(p) => Some(read_json_file("--json-schema", p)?),
        None => None,
    };
    let tools = match &a.tools {
        Some(p) => match read_json_file("--tools", p)? {
            Value::Array(list) => Some(list),
            _ => bail!("--tools: the file must hold a JSON array of tools"),
        },
        None => None,
    };
    // Constrained output starts at once (no reasoning channel first).
    let k3 = K3Options {
        thinking: schema.is_none() && tools.is_none() && K3Options::default().thinking,
        ..K3Options::default()
    };
    if !a.images.is_empty() && (schema.is_some() || tools.is_some()) {
        bail!("--image cannot be combined with --json-schema or --tools");
    }
    if !a.images.is_empty() && a.prompt_ids.is_none() && !a.chat {
        bail!("--image needs --chat (images go before the prompt text) or --prompt-ids with placeholder ids");
    }
    if !a.videos.is_empty() && (schema.is_some() || tools.is_some()) {
        bail!("--video cannot be combined with --json-schema or --tools");
    }
    if !a.videos.is_empty() && a.prompt_ids.is_none() && !a.chat {
        bail!("--video needs --chat (videos go before the prompt text) or --prompt-ids with placeholder ids");
    }
    if !a.videos.is_empty() && !a.images.is_empty() && a.prompt_ids.is_some() {
        bail!(
            "--prompt-ids takes --image or --video, not both (both use the media placeholder id)"
        );
    }
    if !(a.fps > 0.0 && a.fps <= 1000.0) {
        bail!("--fps must be in (0, 1000], got {}", a.fps);
    }
    let videos = if a.videos.is_empty() {
        Vec::new()
    } else {
        load_videos(
            loaded.model.as_ref(),
            &a.videos,
            a.fps,
            a.mm_processor_kwargs.as_deref(),
        )?
    };
    let images = if a.images.is_empty() {
        Vec::new()
    } else {
        load_images(
            loaded.model.as_ref(),
            &a.images,
            a.mm_processor_kwargs.as_deref(),
        )?
    };
    let wrapped;
    let prompt_text = match &a.prompt {
        Some(text) if !images.is_empty() || !videos.is_empty() => {
            let video_prompts: String = videos.iter().map(|v| v.prompts.as_str()).collect();
            wrapped = format!(
                "{}{video_prompts}{text}",
                caracal::gateway::media::IMAGE_WRAPPER.repeat(images.len())
            );
            Some(&wrapped)
        }
        other => other.as_ref(),
    };
    let prompt_ids = match (prompt_text, &a.prompt_ids) {
        (_, Some(ids)) if !videos.is_empty() => {
            let tower = loaded
                .model
                .vision()
                .expect("videos were loaded for the tower");
            expand_video_ids(ids, tower.info().placeholder_id, &videos, tok)?
        }
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => {
            let tok = tok.ok_or_else(|| {
                anyhow!(
                    "{} has no tokenizer; pass --prompt-ids",
                    model_dir.display()
                )
            })?;
            if a.chat {
                let rendered = match tok.chat_format() {
                    Some(ChatFormat::Jinja(template)) => render(
                        &template,
                        &[ChatMessage::new("user", text)],
                        tools.clone().map(Value::Array).as_ref(),
                        true,
                        tok.bos_token.as_deref(),
                        tok.eos_token.as_deref(),
                    )?,
                    Some(ChatFormat::KimiK3) => {
                        render_k3(&[Message::text("user", text)], tools.as_deref(), true, &k3)?
                    }
                    Some(ChatFormat::KimiK2) => {
                        render_k2(&[Message::text("user", text)], tools.as_deref(), true)
                    }
                    None => bail!("{} has no chat template", model_dir.display()),
                };
                tok.encode_chat(&rendered)?
            } else {
                tok.encode(text)?
            }
        }
        (None, None) => bail!("pass --prompt TEXT or --prompt-ids 1,2,3"),
    };
    let vocab = loaded.model.info().vocab_size;
    if let Some(bad) = prompt_ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("prompt id {bad} is outside the vocabulary (size {vocab})");
    }
    let mut items = images;
    items.extend(videos.iter().flat_map(|v| v.items.iter().cloned()));
    let (prompt_ids, spans, media_tokens) = if items.is_empty() {
        (prompt_ids, Vec::new(), Vec::new())
    } else {
        let flag = if videos.is_empty() {
            "--image"
        } else {
            "--image/--video"
        };
        let mp = splice_media(loaded.model.as_ref(), &prompt_ids, &items)
            .map_err(|e| anyhow!("{flag}: {e}"))?;
        (mp.ids, mp.spans, mp.media_tokens)
    };
    let req = GenerateRequest {
        prompt_ids,
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k,
            seed: a.seed,
            ..Default::default()
        },
        stop_ids: if a.ignore_eos {
            Vec::new()
        } else {
            loaded.model.info().eos_ids.clone()
        },
    };
    let spec = match (schema, tools) {
        (Some(s), _) => Some(ConstraintSpec::Json(s)),
        (None, Some(list)) => {
            let tok = tok.ok_or_else(|| anyhow!("--tools needs a model with a tokenizer"))?;
            let format = match tool_format_for(tok) {
                Some(ToolFormat::KimiK3 { .. }) => ToolFormat::KimiK3 {
                    thinking: k3.thinking,
                },
                Some(f) => f,
                None => bail!("--tools needs a model with a chat format"),
            };
            let choice = match a.tool_choice.as_str() {
                "auto" | "required" | "none" => json!(a.tool_choice),
                name => json!({"type": "function", "function": {"name": name}}),
            };
            ToolsSpec::from_openai(Some(&Value::Array(list)), Some(&choice), None, format)
                .map_err(|e| anyhow!("--tools: {e} ({})", e.kind()))?
                .map(ConstraintSpec::Tools)
        }
        (None, None) => None,
    };
    if let Some(spec) = spec {
        let tok = loaded
            .tokenizer
            .ok_or_else(|| anyhow!("constrained output needs a tokenizer"))?;
        return constrained(a.json, &model_dir, loaded.model, tok, req, &spec);
    }
    let mut stdout = std::io::stdout();
    let mut stream = StreamDecoder::new();
    let gen = generate_with(loaded.model.as_ref(), &req, &spans, |id| {
        if !a.json {
            if let Some(tok) = tok {
                if let Ok(delta) = stream.push(tok, id, true) {
                    let _ = write!(stdout, "{delta}");
                    let _ = stdout.flush();
                }
            } else {
                let _ = write!(stdout, "{id} ");
            }
        }
    })?;
    let text = match tok {
        Some(t) => t.decode(&gen.token_ids, true)?,
        None => String::new(),
    };
    if a.json {
        let mut v = serde_json::to_value(&gen)?;
        v["text"] = serde_json::Value::String(text);
        v["model"] = serde_json::Value::String(model_dir.display().to_string());
        if !media_tokens.is_empty() {
            v["media_tokens"] = json!(media_tokens);
        }
        if !videos.is_empty() {
            let chunks: Vec<Value> = videos
                .iter()
                .enumerate()
                .flat_map(|(i, v)| {
                    v.chunks
                        .iter()
                        .map(move |(ts, n)| json!({"video": i, "timestamp": ts, "tokens": n}))
                })
                .collect();
            v["video_chunks"] = Value::Array(chunks);
        }
        println!("{}", serde_json::to_string(&v)?);
    } else {
        if let Some(t) = tok {
            print!("{}", stream.flush(t, true)?);
        }
        println!();
        eprintln!(
            "prompt {} tokens, {:.1} tok/s prefill; generated {} tokens, {:.1} tok/s decode; finish: {:?}",
            gen.prompt_tokens,
            gen.prefill_tokens_per_s,
            gen.token_ids.len(),
            gen.decode_tokens_per_s,
            gen.finish_reason
        );
    }
    Ok(())
}

/// Runs one constrained generation through the runtime and prints it.
fn constrained(
    as_json: bool,
    dir: &std::path::Path,
    model: Box<dyn CausalLm>,
    tok: TextTokenizer,
    req: GenerateRequest,
    spec: &ConstraintSpec,
) -> Result<()> {
    let tok = Arc::new(tok);
    let model: Arc<dyn CausalLm> = Arc::from(model);
    let factory = super::serve::constraint_factory(dir, Some(&tok), model.info().vocab_size)
        .ok_or_else(|| anyhow!("this model's tokenizer gives no token trie"))?;
    let constraint = factory
        .compile_boxed(spec)
        .map_err(|e| anyhow!("{e} ({})", e.kind()))?;
    let valid = ValidRequest {
        session: None,
        prompt: req.prompt_ids.clone(),
        cache_key: None,
        max_tokens: req.max_tokens,
        sampling: req.sampling.clone(),
        stop: StopConditions {
            ids: req.stop_ids.clone(),
            strings: Vec::new(),
        },
        ..Default::default()
    };
    let sys = actix::System::new();
    let t0 = std::time::Instant::now();
    let (ids, finish) = sys.block_on(async move {
        let engine = Engine::start(model, EngineConfig::default(), None);
        let mut rx = engine
            .submit_queued_with(valid, Some(SeqConstraint::new(constraint)))
            .await
            .map_err(|e| anyhow!("{e}"))?
            .events;
        let mut ids = Vec::new();
        while let Some(ev) = rx.recv().await {
            match ev {
                TokenEvent::Token { id, .. } => ids.push(id),
                TokenEvent::Finished { reason, .. } => return Ok((ids, reason.as_str())),
                TokenEvent::Error { kind, message } => bail!("{kind}: {message}"),
            }
        }
        bail!("the engine closed the stream")
    })?;
    let secs = t0.elapsed().as_secs_f64();
    let text = tok.decode(&ids, false)?;
    if as_json {
        let v = json!({"token_ids": ids, "text": text, "finish_reason": finish,
                       "prompt_tokens": req.prompt_ids.len(), "model": dir.display().to_string()});
        println!("{}", serde_json::to_string(&v)?);
    } else {
        println!("{text}");
        eprintln!(
            "prompt {} tokens; generated {} tokens in {secs:.2} s (constrained); finish: {finish}",
            req.prompt_ids.len(),
            ids.len()
        );
    }
    Ok(())
}
