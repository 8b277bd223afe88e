//! `caracal generate`: one prompt in, tokens out (text or JSON).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{anyhow, bail, Result};
use caracal::chat::toolcall::{render_k2, render_k3, K3Options, Message};
use caracal::chat::{render, ChatMessage};
use caracal::generate::{generate, GenerateRequest};
use caracal::text::tokenizer::{ChatFormat, StreamDecoder};
use caracal_kernels::sampling::SamplingParams;
use clap::Args;

/// Arguments of `caracal generate`.
#[derive(Args)]
pub struct GenerateArgs {
    /// Checkpoint folder (config.json, *.safetensors, tokenizer.json or
    /// tiktoken.model); default: the built-in tiny Kimi K3 (random weights).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt text.
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
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
}

/// Runs `caracal generate`.
pub fn run(a: GenerateArgs, load: &caracal::checkpoint::LoadOptions) -> Result<()> {
    if !(0.0..=100.0).contains(&a.temperature) {
        bail!("--temperature must be in [0, 100], got {}", a.temperature);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", a.top_p);
    }
    let model_dir = super::model_dir(a.model.clone())?;
    let loaded = super::load_model(&model_dir, load)?;
    let tok = loaded.tokenizer.as_ref();
    let prompt_ids = match (&a.prompt, &a.prompt_ids) {
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
                        None,
                        true,
                        tok.bos_token.as_deref(),
                        tok.eos_token.as_deref(),
                    )?,
                    Some(ChatFormat::KimiK3) => render_k3(
                        &[Message::text("user", text)],
                        None,
                        true,
                        &K3Options::default(),
                    )?,
                    Some(ChatFormat::KimiK2) => {
                        render_k2(&[Message::text("user", text)], None, true)
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
    let mut stdout = std::io::stdout();
    let mut stream = StreamDecoder::new();
    let gen = generate(loaded.model.as_ref(), &req, |id| {
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
