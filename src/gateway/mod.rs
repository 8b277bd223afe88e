//! # The agent gateway (`caracal serve`)
//!
//! One port serves HTTP and WebSocket: axum routes on hyper for HTTP, and a
//! manual upgrade that hands `GET /v1/responses` and `GET /v1/realtime` to
//! tokio-tungstenite (no second tungstenite through axum's `ws` feature).
//! The sockets run on a multi-threaded tokio runtime; the engine's actors
//! run in their own actix `System` thread ([`engine::EngineHost`]), so no
//! socket task ever waits on a forward pass.
//!
//! ```text
//! client JSON ─► protocol handler (chat, completions, responses, realtime)
//!   → Conversation → ServedModel::render/encode (tokenizer + chat format, here)
//!   → ValidRequest ─► EngineHost::submit ─► Scheduler (actors)
//!   ◄─ TokenEvent ── generation::Driver (detokenize, stop strings, tool-call parser)
//!   ◄─ GenEvent ──── protocol handler → SSE frames / WebSocket frames / JSON
//! ```
//!
//! Modules:
//! - [`engine`]: the only file that talks to the actor runtime.
//! - [`model`]: the served model, prompt rendering, output parsers.
//! - [`generation`]: one generation as a stream of [`generation::GenEvent`]s.
//! - [`chat`], [`completions`]: `/v1/chat/completions`, `/v1/completions`.
//! - [`responses`]: `/v1/responses` over HTTP (JSON, SSE) and its WebSocket mode.
//! - [`realtime`]: `/v1/realtime`, the text subset of the Realtime protocol.
//! - [`http`]: routing, auth, `/health`, `/v1/models`, `/metrics`, SSE helpers.
//! - [`console`]: the web console at `/` (static files built into the binary).
//! - [`conn`]: the accept loop and the request-head timeout.
//! - [`decode_queue`]: the bounded line of videos waiting to be decoded.
//! - [`metrics`], [`shutdown`], [`error`], [`fields`], [`upgrade`].

pub mod chat;
pub mod completions;
pub mod conn;
pub mod console;
pub mod decode_queue;
pub mod engine;
pub mod error;
pub mod fields;
pub mod generation;
pub mod http;
pub mod logprobs;
pub mod media;
pub mod metrics;
pub mod model;
pub mod params;
pub mod realtime;
pub mod responses;
pub mod shutdown;
pub mod upgrade;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;

pub use engine::EngineHost;
pub use error::{ApiError, ApiResult};
pub use model::ServedModel;
use shutdown::{Phase, ShutdownController, ShutdownSignal};

/// Limits and switches of the gateway (`caracal serve` flags).
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Bearer key required on every route but `/health` and the console (`--api-key`).
    pub api_key: Option<String>,
    /// Browser origins besides the server's own that may open a WebSocket
    /// (`--allowed-origins`).
    pub allowed_origins: upgrade::OriginPolicy,
    /// WebSocket sessions open at once (`--max-sessions`, default 256).
    pub max_sessions: usize,
    /// Largest HTTP body in bytes (`--max-body-bytes`, default 16 MiB).
    pub max_body_bytes: usize,
    /// Largest WebSocket message in bytes (`--max-message-bytes`, default 16 MiB).
    pub max_message_bytes: usize,
    /// Default `max_tokens` when a request names none (default 1024, capped by the context).
    pub default_max_tokens: usize,
    /// Sampling values for fields a request leaves out (`generation_config.json`,
    /// `--override-generation-config`).
    pub sampling_defaults: params::SamplingDefaults,
    /// Responses kept for `previous_response_id` over HTTP (default 1024).
    pub store_capacity: usize,
    /// How long a stored response lives (default 1 h).
    pub store_ttl: Duration,
    /// Responses each WebSocket connection keeps for chaining (default 64).
    pub ws_chain_capacity: usize,
    /// Named `stream_id` lanes per WebSocket connection (default 32).
    pub ws_max_lanes: usize,
    /// A WebSocket session with no traffic for this long is closed (default 1 h).
    pub ws_idle_timeout: Duration,
    /// Time open work gets to finish after SIGINT/SIGTERM (`--shutdown-timeout`, default 30 s).
    pub shutdown_timeout: Duration,
    /// An HTTP connection waiting this long for a complete request head
    /// (fresh, or idle between requests) is closed (`--timeout-keep-alive`,
    /// default 5 s; `None`: never). WebSocket sessions are not affected.
    pub head_timeout: Option<Duration>,
    /// A request body with no data for this long is answered 408 and its
    /// connection closed (`--body-read-timeout`, default 60 s, nginx's
    /// `client_body_timeout`: the time between two reads, not the whole
    /// body; `None`: never).
    pub body_timeout: Option<Duration>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            api_key: None,
            allowed_origins: upgrade::OriginPolicy::default(),
            max_sessions: 256,
            max_body_bytes: 16 << 20,
            max_message_bytes: 16 << 20,
            default_max_tokens: 1024,
            sampling_defaults: params::SamplingDefaults::default(),
            store_capacity: 1024,
            store_ttl: Duration::from_secs(3600),
            ws_chain_capacity: 64,
            ws_max_lanes: 32,
            ws_idle_timeout: Duration::from_secs(3600),
            shutdown_timeout: Duration::from_secs(30),
            head_timeout: Some(Duration::from_secs(5)),
            body_timeout: Some(Duration::from_secs(60)),
        }
    }
}

/// What every handler shares.
pub struct AppState {
    /// The served model.
    pub model: ServedModel,
    /// The engine.
    pub engine: EngineHost,
    /// Limits.
    pub config: GatewayConfig,
    /// Counters.
    pub metrics: metrics::Metrics,
    /// Shutdown phase and connection guards.
    pub shutdown: ShutdownSignal,
    /// Stored responses (`store: true` over HTTP).
    pub store: responses::store::ResponseStore,
    /// Responses generating now, for `POST /v1/responses/{id}/cancel`.
    pub inflight: responses::store::InflightResponses,
    /// WebSocket session slots (`--max-sessions`).
    pub sessions: Arc<Semaphore>,
    /// Image ingest and the vision encoder (`None`: the model takes no images).
    pub media: Option<media::MediaServices>,
}

/// A fresh id: `prefix` and 24 hex digits, unique within the process and
/// unpredictable across processes.
pub fn new_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(n);
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    format!("{prefix}{:016x}{:08x}", h.finish(), n as u32)
}

/// Unix seconds now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A gateway ready to serve: its state and the shutdown controller.
pub struct Gateway {
    /// Shared state.
    pub state: Arc<AppState>,
    /// Shutdown.
    controller: ShutdownController,
}

impl Gateway {
    /// Assembles the gateway around a started engine.
    pub fn new(model: ServedModel, engine: EngineHost, config: GatewayConfig) -> Gateway {
        Gateway::with_media(model, engine, config, None)
    }

    /// [`Gateway::new`] with the media actors of a model that takes images.
    pub fn with_media(
        mut model: ServedModel,
        engine: EngineHost,
        config: GatewayConfig,
        media: Option<media::MediaServices>,
    ) -> Gateway {
        model.vision = media.is_some();
        let controller = ShutdownController::new();
        let state = Arc::new(AppState {
            store: responses::store::ResponseStore::new(config.store_capacity, config.store_ttl),
            inflight: Default::default(),
            sessions: Arc::new(Semaphore::new(config.max_sessions.max(1))),
            shutdown: controller.signal(),
            metrics: Default::default(),
            model,
            engine,
            config,
            media,
        });
        Gateway { state, controller }
    }

    /// Serves on `listener` until `trigger` resolves, then shuts down: stop
    /// accepting, let open streams and sessions finish for
    /// `shutdown_timeout`, then cancel what remains and close the sessions.
    pub async fn serve(
        mut self,
        listener: TcpListener,
        trigger: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let app = http::router(self.state.clone());
        let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
        let limits = conn::ConnLimits {
            head_timeout: self.state.config.head_timeout,
        };
        let mut server = tokio::spawn(conn::serve(listener, app, limits, async move {
            let _ = drain_rx.await;
        }));
        tokio::select! {
            _ = trigger => {}
            r = &mut server => {
                return r.map_err(std::io::Error::other)?;
            }
        }
        tracing::info!("shutting down: no new connections, finishing open work");
        self.controller.set(Phase::Draining);
        let _ = drain_tx.send(());
        let timeout = self.state.config.shutdown_timeout;
        let controller = &mut self.controller;
        let finished = tokio::time::timeout(timeout, async {
            let _ = (&mut server).await;
            controller.wait_idle().await;
        })
        .await;
        if finished.is_err() {
            tracing::info!("shutdown timeout: cancelling what still runs");
            self.controller.set(Phase::Cancel);
            let controller = &mut self.controller;
            let _ = tokio::time::timeout(Duration::from_secs(5), async {
                let _ = (&mut server).await;
                controller.wait_idle().await;
            })
            .await;
            server.abort();
        }
        Ok(())
    }
}

/// Raises this process's soft limit on open files to its hard limit (as
/// nginx's `worker_rlimit_nofile` or Go's runtime do at startup): every
/// connection, idle or not, holds a descriptor, and the usual soft default
/// of 1024 would refuse connections long before `--max-sessions` or memory
/// run out. Returns the soft limit in force afterwards (`None` where the
/// platform has no such limit or the call failed).
pub fn raise_fd_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `lim` is a valid, writable rlimit for the duration of the call.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            // SAFETY: `raised` is a valid rlimit; the kernel only reads it.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                lim = raised;
            }
        }
        Some(lim.rlim_cur)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
