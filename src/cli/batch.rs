//! `caracal batch`: offline inference through the runtime (vLLM's offline
//! mode). Every request is submitted at once; continuous batching runs them.
//! Lines with `tools` / `tool_choice` / `parallel_tool_calls` or
//! `response_format` are constrained like the server's requests (tool calls
//! in the model's own format, JSON matching the schema); the model's
//! constraint factory is built once, when some line asks for one.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use caracal::models::CausalLm;
use caracal::request::{tool_format_for, RequestSpec};
use caracal_actors::constraint::SeqConstraint;
use caracal_actors::messages::{ErrorKind, TokenEvent, ValidRequest};
use caracal_actors::runtime::Engine;
use clap::Args;
use serde_json::{json, Value};

use super::engine_args::EngineArgs;

/// Arguments of `caracal batch`.
#[derive(Args)]
pub struct BatchArgs {
    /// Checkpoint folder; default: the built-in tiny Kimi K3 (random weights).
    #[arg(long)]
    model: Option<PathBuf>,
    /// JSONL file, one request per line (`prompt` or `prompt_ids`, `max_tokens`, sampling fields,
    /// `tools`, `tool_choice`, `parallel_tool_calls`, `response_format`).
    #[arg(long)]
    input: PathBuf,
    /// Where to write one JSON line per request, in input order (default: stdout).
    #[arg(long)]
    output: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Runs `caracal batch`.
pub fn run(a: BatchArgs, load: &caracal::checkpoint::LoadOptions) -> Result<()> {
    let dir = super::model_dir(a.model.clone())?;
    let loaded = super::load_model(&dir, load)?;
    let file =
        std::fs::File::open(&a.input).with_context(|| format!("opening {}", a.input.display()))?;
    let lines: Vec<String> = std::io::BufReader::new(file)
        .lines()
        .collect::<std::io::Result<_>>()?;
    let model: Arc<dyn CausalLm> = Arc::from(loaded.model);
    let tokenizer = loaded.tokenizer.map(Arc::new);
    let info = model.info().clone();
    // Validate at the edge: a bad line becomes an error line, not an abort.
    let mut specs = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let format = tokenizer.as_deref().and_then(tool_format_for);
        let parsed = serde_json::from_str::<RequestSpec>(line)
            .map_err(|e| format!("line {}: invalid request JSON: {e}", i + 1))
            .and_then(|s| {
                let valid = s.validate(
                    tokenizer.as_deref(),
                    info.vocab_size,
                    info.max_position,
                    &info.eos_ids,
                );
                valid
                    .and_then(|v| Ok((v, s.constraint_spec(format)?)))
                    .map_err(|e| format!("line {}: {e}", i + 1))
            });
        specs.push(parsed);
    }
    let wants_constraint = specs.iter().any(|s| matches!(s, Ok((_, Some(_)))));
    let factory = if wants_constraint {
        super::serve::constraint_factory(&dir, tokenizer.as_ref(), info.vocab_size)
    } else {
        None
    };
    let specs: Vec<Result<(ValidRequest, Option<SeqConstraint>), String>> = specs
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let (req, spec) = s?;
            let Some(spec) = spec else {
                return Ok((req, None));
            };
            let f = factory
                .as_ref()
                .ok_or_else(|| format!("line {}: this model cannot be constrained", i + 1))?;
            let c = f
                .compile_boxed(&spec)
                .map_err(|e| format!("line {}: {} ({})", i + 1, e, e.kind()))?;
            Ok((req, Some(SeqConstraint::new(c))))
        })
        .collect();
    let cfg = a.engine.config();
    let detok = tokenizer
        .clone()
        .map(|t| t as Arc<dyn caracal_actors::engine::Detokenize>);
    let sys = actix::System::new();
    let (results, wall) = sys.block_on(async move {
        let engine = Engine::start(model, cfg, detok);
        let t0 = Instant::now();
        // Each line submits (waiting for a slot, in input order, rather than
        // being refused) and then reads its stream; all lines run at once, so
        // running streams are read while later lines wait for slots.
        let engine = &engine;
        let collect = specs.into_iter().map(|spec| async move {
            let (prompt_tokens, mut rx) = match spec {
                Ok((req, constraint)) => {
                    let prompt_tokens = req.prompt.len();
                    match engine.submit_queued_with(req, constraint).await {
                        Ok(sub) => (prompt_tokens, sub.events),
                        Err(e) => return error_line(e.kind(), e.to_string()),
                    }
                }
                Err(msg) => return error_line(ErrorKind::InvalidRequest, msg),
            };
            let mut ids = Vec::new();
            let mut t_first = None;
            while let Some(ev) = rx.recv().await {
                match ev {
                    TokenEvent::Token { id, .. } => {
                        t_first.get_or_insert_with(Instant::now);
                        ids.push(id);
                    }
                    TokenEvent::Finished { reason, cache, .. } => {
                        let miss = cache.miss_reason;
                        return json!({"token_ids": ids, "prompt_tokens": prompt_tokens, "cached_tokens": cache.cached_tokens,
                            "cache_miss_reason": miss.map(|m| m.to_string()).unwrap_or_default(),
                            "cache_miss_kind": miss.map(|m| m.as_str()).unwrap_or(""),
                            "finish_reason": reason.as_str()});
                    }
                    TokenEvent::Error { kind, message } => return error_line(kind, message),
                }
            }
            error_line(ErrorKind::InternalError, "the engine closed the stream".into())
        });
        let results = futures::future::join_all(collect).await;
        (results, t0.elapsed().as_secs_f64())
    });
    let mut out: Box<dyn Write> = match &a.output {
        Some(p) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => Box::new(std::io::stdout().lock()),
    };
    let (mut ok, mut prompt_total, mut gen_total, mut cached_total) =
        (0usize, 0usize, 0usize, 0usize);
    for (index, mut r) in results.into_iter().enumerate() {
        if let (Some(ids), Some(t)) = (r.get("token_ids").cloned(), tokenizer.as_ref()) {
            let ids: Vec<u32> = serde_json::from_value(ids)?;
            r["text"] = Value::String(t.decode(&ids, true)?);
        }
        if r.get("error").is_none() {
            ok += 1;
            prompt_total += r["prompt_tokens"].as_u64().unwrap_or(0) as usize;
            gen_total += r["token_ids"].as_array().map(|a| a.len()).unwrap_or(0);
            cached_total += r["cached_tokens"].as_u64().unwrap_or(0) as usize;
        }
        r["index"] = json!(index);
        writeln!(out, "{}", serde_json::to_string(&r)?)?;
    }
    out.flush()?;
    eprintln!(
        "batch: {ok}/{} requests ok, {prompt_total} prompt tokens ({cached_total} cached), {gen_total} generated in {wall:.2} s: {:.1} output tok/s, {:.1} total tok/s",
        lines.iter().filter(|l| !l.trim().is_empty()).count(),
        gen_total as f64 / wall.max(1e-9),
        (prompt_total + gen_total) as f64 / wall.max(1e-9),
    );
    Ok(())
}

/// A failed request's output line: the error and its stable kind.
fn error_line(kind: ErrorKind, message: String) -> Value {
    json!({"error": {"type": kind.as_str(), "message": message}, "error_kind": kind.as_str()})
}
