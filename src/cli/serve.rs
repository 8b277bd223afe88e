//! `caracal serve`: the OpenAI-compatible HTTP and WebSocket server on one
//! port. Loads the model (the built-in tiny Kimi K3 without `--model`),
//! starts the engine with the flags `batch` takes, and serves until
//! SIGINT/SIGTERM, then shuts down gracefully within `--shutdown-timeout`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use caracal::constrain::{ConstraintFactory, TokenEnv};
use caracal::gateway::engine::ConstraintSetup;
use caracal::gateway::media::MediaServices;
use caracal::gateway::params::SamplingDefaults;
use caracal::gateway::upgrade::OriginPolicy;
use caracal::gateway::{self, EngineHost, Gateway, GatewayConfig, ServedModel};
use caracal::models::CausalLm;
use clap::Args;

use super::engine_args::{parse_bytes, EngineArgs};

/// Arguments of `caracal serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// Checkpoint folder; default: the built-in tiny Kimi K3 (random weights).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Model name clients use (default: the checkpoint folder's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on every route but /health and the
    /// console (browsers may send it as the WebSocket subprotocol
    /// `openai-insecure-api-key.KEY`).
    #[arg(long)]
    api_key: Option<String>,
    /// Browser origins besides the server's own that may open a WebSocket:
    /// a comma list (`https://app.example.com,http://localhost:3000`) or `*`
    /// for any; others get 403 origin_not_allowed.
    #[arg(long, default_value = "", value_parser = OriginPolicy::parse)]
    allowed_origins: OriginPolicy,
    /// WebSocket sessions open at once; further upgrades get 429 websocket_connection_limit_reached.
    #[arg(long, default_value_t = 256)]
    max_sessions: usize,
    /// Seconds open streams get to finish after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    /// Seconds an HTTP connection may wait for a complete request head
    /// (a fresh one, or one idle between requests, as uvicorn's
    /// `--timeout-keep-alive`; a half-sent head or WebSocket handshake
    /// counts as waiting) before it is closed; 0 never closes them.
    /// Upgraded WebSocket sessions are not affected.
    #[arg(long, default_value_t = 5)]
    timeout_keep_alive: u64,
    /// Seconds a request body may send nothing before the request is
    /// answered 408 and its connection closed (the time between two reads,
    /// as nginx's `client_body_timeout`); 0 waits forever.
    #[arg(long, default_value_t = 60)]
    body_read_timeout: u64,
    /// Largest HTTP request body, e.g. 16MiB.
    #[arg(long, default_value = "16MiB", value_parser = parse_bytes)]
    max_body_bytes: usize,
    /// Largest WebSocket message, e.g. 16MiB.
    #[arg(long, default_value = "16MiB", value_parser = parse_bytes)]
    max_message_bytes: usize,
    /// Output budget of requests that name none (capped by the context left).
    #[arg(long, default_value_t = 1024)]
    default_max_tokens: usize,
    /// Responses kept in memory for `previous_response_id` (store: true).
    #[arg(long, default_value_t = 1024)]
    response_store_size: usize,
    /// Seconds a stored response stays retrievable.
    #[arg(long, default_value_t = 3600)]
    response_store_ttl: u64,
    /// Constrain tool calls to the declared tools and their schemas (`on`),
    /// or only parse them after the fact (`off`, for comparison).
    #[arg(long, default_value = "on", value_parser = on_off, action = clap::ArgAction::Set)]
    tool_call_constraint: bool,
    /// Where sampling defaults for fields a request leaves out come from:
    /// `auto` reads the checkpoint's `generation_config.json` (temperature,
    /// top_p, top_k, min_p, repetition_penalty, do_sample), `openai` keeps
    /// OpenAI's (temperature 1, no cuts).
    #[arg(long, default_value = "auto", value_parser = ["auto", "openai"])]
    generation_config: String,
    /// JSON object applied over those defaults, e.g. `{"temperature": 0}`.
    #[arg(long)]
    override_generation_config: Option<String>,
    /// Append the tokens a grammar forces without one decode step each.
    #[arg(long, default_value = "on", value_parser = on_off, action = clap::ArgAction::Set)]
    jump_forward: bool,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    media: super::media_args::MediaArgs,
}

/// Whether `host` names only this machine (`127.0.0.1`, `::1`, `localhost`).
fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .trim_matches(|c| c == '[' || c == ']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Reads `on` / `off`.
fn on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("expected on or off, got `{other}`")),
    }
}

/// The model's constraint factory (token trie, llguidance parser factory),
/// built once; `None` (with a warning) when the tokenizer cannot give one.
pub fn constraint_factory(
    dir: &std::path::Path,
    tokenizer: Option<&Arc<caracal::text::tokenizer::TextTokenizer>>,
    vocab_size: usize,
) -> Option<Arc<ConstraintFactory>> {
    let tokenizer = tokenizer?;
    let t0 = Instant::now();
    let built =
        TokenEnv::load(dir, tokenizer.clone(), Some(vocab_size)).and_then(ConstraintFactory::new);
    match built {
        Ok(f) => {
            tracing::info!(
                "constraint factory ready in {:.0} ms",
                t0.elapsed().as_secs_f64() * 1e3
            );
            Some(Arc::new(f))
        }
        Err(e) => {
            eprintln!("warning: no constrained decoding for this model: {e}");
            None
        }
    }
}

/// Runs `caracal serve`.
pub fn run(a: ServeArgs, load: &caracal::checkpoint::LoadOptions) -> Result<()> {
    let dir = super::model_dir(a.model.clone())?;
    let t0 = Instant::now();
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(format!("loading {}", dir.display()));
    spinner.enable_steady_tick(Duration::from_millis(120));
    let loaded = super::load_model(&dir, load);
    spinner.finish_and_clear();
    let loaded = loaded?;
    eprintln!(
        "loaded {} in {:.1} s",
        dir.display(),
        t0.elapsed().as_secs_f64()
    );
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        dir.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "caracal".into())
    });
    let model: Arc<dyn CausalLm> = Arc::from(loaded.model);
    let tokenizer = loaded.tokenizer.map(Arc::new);
    let media_config = a.media.config(&model.info().model_type)?;
    let media = MediaServices::start(model.clone(), media_config)
        .map_err(|e| anyhow::anyhow!("starting the vision encoder: {e}"))?;
    if media.is_some() {
        eprintln!("vision tower loaded: the model takes images");
    }
    let served = ServedModel::new(&name, model.as_ref(), tokenizer.clone(), media.is_some());
    let constraints = ConstraintSetup {
        factory: constraint_factory(&dir, tokenizer.as_ref(), model.info().vocab_size),
        tool_calls: a.tool_call_constraint,
        jump_forward: a.jump_forward,
    };
    let detok = tokenizer.map(|t| t as Arc<dyn caracal_actors::engine::Detokenize>);
    let engine = EngineHost::start_with(model, a.engine.config(), detok, constraints)
        .context("starting the engine")?;
    let sampling_defaults = sampling_defaults(&dir, &a)?;
    let config = GatewayConfig {
        sampling_defaults,
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        allowed_origins: a.allowed_origins.clone(),
        max_sessions: a.max_sessions.max(1),
        max_body_bytes: a.max_body_bytes,
        max_message_bytes: a.max_message_bytes,
        default_max_tokens: a.default_max_tokens.max(1),
        store_capacity: a.response_store_size.max(1),
        store_ttl: Duration::from_secs(a.response_store_ttl),
        shutdown_timeout: Duration::from_secs(a.shutdown_timeout),
        head_timeout: (a.timeout_keep_alive > 0).then(|| Duration::from_secs(a.timeout_keep_alive)),
        body_timeout: (a.body_read_timeout > 0).then(|| Duration::from_secs(a.body_read_timeout)),
        ..GatewayConfig::default()
    };
    if let Some(n) = gateway::raise_fd_limit() {
        tracing::info!("open-files limit: {n}");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("caracal-gateway")
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        if a.api_key.is_none() && !is_loopback(&a.host) {
            eprintln!(
                "warning: listening on {} without --api-key: anyone who can reach this address can use the model",
                a.host
            );
        }
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        eprintln!(
            "caracal serve: model `{name}` at http://{local}/v1 (WebSocket ws://{local}/v1/responses, ws://{local}/v1/realtime; console http://{local}/); Ctrl-C stops"
        );
        if a.allowed_origins.allows_any() {
            eprintln!(
                "warning: --allowed-origins '*': a page on any site the browser opens may use this server's WebSockets"
            );
        }
        Gateway::with_media(served, engine, config, media)
            .serve(listener, gateway::shutdown_signal())
            .await
            .context("serving")
    })?;
    eprintln!("caracal serve: stopped");
    Ok(())
}

/// The sampling defaults of `--generation-config` and
/// `--override-generation-config` (see [`SamplingDefaults::apply`]).
fn sampling_defaults(dir: &std::path::Path, a: &ServeArgs) -> Result<SamplingDefaults> {
    let mut d = SamplingDefaults::default();
    let path = dir.join("generation_config.json");
    if a.generation_config == "auto" && path.exists() {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        d = d
            .apply(&v)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    }
    if let Some(o) = &a.override_generation_config {
        let v: serde_json::Value = serde_json::from_str(o)
            .with_context(|| format!("--override-generation-config `{o}` is not JSON"))?;
        if !v.is_object() {
            anyhow::bail!("--override-generation-config must be a JSON object, got `{o}`");
        }
        d = d
            .apply(&v)
            .map_err(|e| anyhow::anyhow!("--override-generation-config: {e}"))?;
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::is_loopback;

    #[test]
    fn only_loopback_hosts_skip_the_no_key_warning() {
        for h in ["127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"] {
            assert!(is_loopback(h), "{h}");
        }
        for h in ["0.0.0.0", "::", "192.168.1.4", "example.com"] {
            assert!(!is_loopback(h), "{h}");
        }
    }
}
