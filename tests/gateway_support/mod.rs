//! A real gateway on `127.0.0.1:0` over a tiny checkpoint, and small HTTP,
//! SSE and WebSocket clients for the gateway tests (SSE framing from
//! `common::take_sse_data`: a test file using this module also declares `mod common;`).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use caracal::gateway::{AppState, EngineHost, Gateway, GatewayConfig, ServedModel};
use caracal::generate::LoadedModel;
use caracal::models::CausalLm;
use caracal_actors::runtime::EngineConfig;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// A committed fixture folder.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A running server.
pub struct TestServer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its shared state (engine counters, stores).
    pub state: Arc<AppState>,
    /// Triggers shutdown.
    stop: Option<oneshot::Sender<()>>,
    /// The serve task.
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Starts a gateway over the checkpoint in `dir` (with the media actors
/// when the model has a vision tower).
pub async fn start(dir: &Path, config: GatewayConfig, engine: EngineConfig) -> TestServer {
    start_media(dir, config, engine, None).await
}

/// [`start`] with these media settings (default: the model type's).
pub async fn start_media(
    dir: &Path,
    config: GatewayConfig,
    engine: EngineConfig,
    media: Option<caracal::gateway::media::MediaConfig>,
) -> TestServer {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    start_served(dir, &name, config, engine, media).await
}

/// [`start_media`] serving the model as `name` (`--served-model-name`).
pub async fn start_served(
    dir: &Path,
    name: &str,
    config: GatewayConfig,
    engine: EngineConfig,
    media: Option<caracal::gateway::media::MediaConfig>,
) -> TestServer {
    use caracal::gateway::media::{MediaConfig, MediaServices};
    let loaded = LoadedModel::load(dir).expect("fixture loads");
    let model: Arc<dyn CausalLm> = Arc::from(loaded.model);
    let tokenizer = loaded.tokenizer.map(Arc::new);
    let media = media.unwrap_or_else(|| MediaConfig::for_model_type(&model.info().model_type));
    let media = MediaServices::start(model.clone(), media).expect("media actors start");
    let served = ServedModel::new(name, model.as_ref(), tokenizer.clone(), media.is_some());
    let detok = tokenizer.map(|t| t as Arc<dyn caracal_actors::engine::Detokenize>);
    let host = EngineHost::start(model, engine, detok).expect("engine starts");
    let gateway = Gateway::with_media(served, host, config, media);
    let state = gateway.state.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(gateway.serve(listener, async move {
        let _ = rx.await;
    }));
    TestServer {
        addr,
        state,
        stop: Some(stop),
        task,
    }
}

/// Starts a gateway over `tiny-llama` with default limits.
pub async fn start_llama() -> TestServer {
    start(
        &fixture("tiny-llama"),
        GatewayConfig::default(),
        EngineConfig::default(),
    )
    .await
}

impl TestServer {
    /// Triggers shutdown and waits for `serve` to return.
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::timeout(Duration::from_secs(60), self.task)
            .await
            .expect("serve returns after shutdown")
            .expect("serve task does not panic")
    }

    /// Sends the shutdown trigger without waiting.
    pub fn trigger_shutdown(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    /// Waits for the serve task after [`TestServer::trigger_shutdown`].
    pub async fn join(self) -> std::io::Result<()> {
        tokio::time::timeout(Duration::from_secs(60), self.task)
            .await
            .expect("serve returns after shutdown")
            .expect("serve task does not panic")
    }

    /// Polls the engine until no sequence runs, every page is free or in
    /// the cache, no cached page is locked and no session is pinned (a
    /// closed WebSocket session unpins its path).
    pub async fn wait_engine_idle(&self) -> (u64, usize, usize) {
        let mut last = String::new();
        for _ in 0..600 {
            let snap = self.state.engine.snapshot().await;
            last = format!("{:?} {:?}", snap.scheduler, snap.memory);
            let (s, m) = (snap.scheduler.unwrap(), snap.memory.unwrap());
            let locked = m.cached_pages - m.evictable_pages;
            if s.running == 0
                && s.waiting == 0
                && locked == 0
                && m.pinned_sessions == 0
                && m.free_pages + m.cached_pages == m.total_pages
            {
                return (s.cancelled, m.free_pages, m.total_pages);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("engine never became idle (a page or a lock leaked): {last}");
    }
}

/// Sends one request on a fresh connection.
pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> hyper::Response<Incoming> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string());
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .unwrap();
    sender.send_request(req).await.unwrap()
}

/// Sends JSON and reads a JSON answer: `(status, body)`.
pub async fn json(addr: SocketAddr, method: &str, path: &str, body: &Value) -> (u16, Value) {
    raw_json(
        addr,
        method,
        path,
        &[],
        Some(serde_json::to_vec(body).unwrap()),
    )
    .await
}

/// Sends raw bytes and reads a JSON answer.
pub async fn raw_json(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> (u16, Value) {
    let resp = send(addr, method, path, headers, body).await;
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, v)
}

/// An SSE stream being read frame by frame.
pub struct SseReader {
    /// The body.
    body: Incoming,
    /// Bytes not yet split into events.
    buf: String,
    /// Whether `data: [DONE]` was seen.
    pub done: bool,
}

impl SseReader {
    /// Opens `path` with `body` and checks the content type.
    pub async fn open(addr: SocketAddr, path: &str, body: &Value) -> SseReader {
        let resp = send(
            addr,
            "POST",
            path,
            &[],
            Some(serde_json::to_vec(body).unwrap()),
        )
        .await;
        assert_eq!(resp.status(), 200, "stream opens");
        assert_eq!(
            resp.headers()["content-type"].to_str().unwrap(),
            "text/event-stream"
        );
        SseReader {
            body: resp.into_body(),
            buf: String::new(),
            done: false,
        }
    }

    /// The next `data:` JSON, or `None` at `[DONE]` or the end of the body.
    pub async fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(data) = crate::common::take_sse_data(&mut self.buf) {
                if data == "[DONE]" {
                    self.done = true;
                    return None;
                }
                return Some(serde_json::from_str(&data).expect("SSE data is JSON"));
            }
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.push_str(&String::from_utf8_lossy(&d));
                    }
                }
                _ => return None,
            }
        }
    }

    /// Every remaining event.
    pub async fn all(mut self) -> (Vec<Value>, bool) {
        let mut out = Vec::new();
        while let Some(v) = self.next().await {
            out.push(v);
        }
        (out, self.done)
    }
}

/// Every event of a stream.
pub async fn sse(addr: SocketAddr, path: &str, body: &Value) -> Vec<Value> {
    let (events, done) = SseReader::open(addr, path, body).await.all().await;
    assert!(done, "stream ends with [DONE]");
    events
}

/// Starts a gateway over the built-in default model (the synthesized tiny
/// Kimi K3: K3 chat format, 1M-token context).
pub async fn start_default(config: GatewayConfig) -> TestServer {
    let dir = caracal::convert::synth::default_model_dir().expect("the default model is made");
    start(&dir, config, EngineConfig::default()).await
}

/// A WebSocket client of the gateway.
pub struct WsClient {
    /// The socket.
    pub ws: tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<TcpStream>>,
}

impl WsClient {
    /// Connects to `path` (e.g. `/v1/responses`).
    pub async fn connect(addr: SocketAddr, path: &str) -> WsClient {
        let (ws, resp) = tokio_tungstenite::connect_async(format!("ws://{addr}{path}"))
            .await
            .expect("WebSocket upgrade succeeds");
        assert_eq!(resp.status(), 101);
        WsClient { ws }
    }

    /// Sends one JSON event.
    pub async fn send(&mut self, v: &Value) {
        use futures::SinkExt;
        self.ws
            .send(tokio_tungstenite::tungstenite::Message::text(v.to_string()))
            .await
            .expect("send");
    }

    /// Sends raw text.
    pub async fn send_text(&mut self, t: &str) {
        use futures::SinkExt;
        self.ws
            .send(tokio_tungstenite::tungstenite::Message::text(t.to_string()))
            .await
            .expect("send");
    }

    /// The next JSON event; `Err` carries the close frame (code) or `None` at the end.
    pub async fn next(&mut self) -> Result<Value, Option<u16>> {
        use futures::StreamExt;
        use tokio_tungstenite::tungstenite::Message;
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(120), self.ws.next())
                .await
                .expect("the server answers");
            match msg {
                Some(Ok(Message::Text(t))) => {
                    return Ok(serde_json::from_str(t.as_str()).expect("JSON event"))
                }
                Some(Ok(Message::Close(frame))) => return Err(frame.map(|f| u16::from(f.code))),
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return Err(None),
            }
        }
    }

    /// Events until a terminal response event (or an error event), inclusive.
    pub async fn until_done(&mut self) -> Vec<Value> {
        let mut out = Vec::new();
        loop {
            let ev = self.next().await.expect("an event");
            let t = ev["type"].as_str().unwrap_or("").to_string();
            out.push(ev);
            if matches!(
                t.as_str(),
                "response.completed" | "response.incomplete" | "response.failed" | "error"
            ) {
                return out;
            }
        }
    }
}

/// A fresh temporary folder named after `tag` and this process.
pub fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `bytes` as a base64 `data:` URL of type `mime`.
pub fn data_url(mime: &str, bytes: &[u8]) -> String {
    use base64::Engine as _;
    format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// A counter's value from `/metrics`.
pub async fn metric(server: &TestServer, name: &str) -> u64 {
    let (_, body) = raw_json(server.addr, "GET", "/metrics", &[], None).await;
    body.as_str()
        .unwrap_or("")
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
}
