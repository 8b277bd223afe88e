//! The Responses WebSocket mode (`client.responses.connect()`, Codex):
//! `GET /v1/responses` upgraded, one [`Session`] task per connection.
//!
//! The session owns the connection's response chain (a bounded cache of
//! its recent responses, kept even with `store: false`), so a
//! `response.create` with `previous_response_id` and only the new items is
//! rebuilt from that cache and its prompt reuses the cached ids: a tool
//! result prefills only its own tokens. Every request carries the session
//! id in `ValidRequest::session`, so the radix cache pins the session's path.
//!
//! - Lanes: requests with the same `stream_id` run FIFO; lanes run
//!   concurrently (one task each); a create while one runs is queued.
//!   Every event of a lane's request echoes its `stream_id`.
//! - `generate: false` prefills and caches the prompt and returns
//!   `response.created` + `response.completed` with no output.
//! - `response.steer` answers `response.steer.failed` (`steering_not_supported`);
//!   unknown client events (`response.processed`, ...) are ignored.
//! - Errors: `{"type":"error","status","error":{type,code,message,param},"stream_id"?}`;
//!   the session keeps serving. A failed same-lane continuation evicts its parent.
//! - Close codes: 1000 when the client or the idle timeout ends the session,
//!   1001 after a graceful drain, 1009 for a frame past the hard size limit,
//!   1012 when shutdown runs out of time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio::task::{JoinHandle, JoinSet};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message as WsMessage};

use super::compat::{normalize, CustomTools};
use super::events::ResponseBuilder;
use super::store::ResponseStore;
use super::turn::{begin, prepare};
use super::types::{parse_request, previous_not_found, ResponseRequest};
use crate::gateway::error::ApiError;
use crate::gateway::metrics::Endpoint;
use crate::gateway::shutdown::Phase;
use crate::gateway::upgrade::{accept, ServerSocket};
use crate::gateway::{new_id, AppState};

/// Requests queued per lane before a create is refused.
const LANE_QUEUE: usize = 16;
/// Frames buffered for the socket writer.
const OUT_BUFFER: usize = 64;

/// What the writer task sends.
#[derive(Debug)]
pub enum Outgoing {
    /// One JSON event as a text frame.
    Event(Value),
    /// A close frame; the writer ends after it.
    Close(CloseCode, &'static str),
}

/// The refusal when every session slot is taken.
pub fn connection_limit() -> ApiError {
    ApiError {
        status: 429,
        kind: "invalid_request_error",
        code: "websocket_connection_limit_reached",
        param: None,
        message:
            "too many WebSocket sessions are open (--max-sessions); retry on a new connection later"
                .into(),
    }
}

/// `GET /v1/responses` with an upgrade.
pub async fn upgrade(State(state): State<Arc<AppState>>, mut req: Request) -> Response {
    if state.shutdown.is_shutting_down() {
        return ApiError::shutting_down().into_response();
    }
    let handshake = match accept(&mut req) {
        Ok(h) => h,
        Err(e) => return e.into_response(),
    };
    let Ok(permit) = state.sessions.clone().try_acquire_owned() else {
        return connection_limit().into_response();
    };
    let limit = state.config.max_message_bytes;
    let st = state.clone();
    handshake.respond(limit.saturating_mul(2), move |ws| async move {
        Session::new(st, permit).run(ws).await;
    })
}

/// Spawns the task that writes frames to the socket.
pub fn spawn_writer(
    mut sink: futures::stream::SplitSink<ServerSocket, WsMessage>,
) -> (mpsc::Sender<Outgoing>, JoinHandle<()>) {
    let (tx, mut rx) = mpsc::channel::<Outgoing>(OUT_BUFFER);
    let task = tokio::spawn(async move {
        while let Some(o) = rx.recv().await {
            let msg = match o {
                Outgoing::Event(v) => WsMessage::text(v.to_string()),
                Outgoing::Close(code, reason) => {
                    let _ = sink
                        .send(WsMessage::Close(Some(CloseFrame {
                            code,
                            reason: reason.into(),
                        })))
                        .await;
                    break;
                }
            };
            if sink.send(msg).await.is_err() {
                break;
            }
        }
        let _ = sink.close().await;
    });
    (tx, task)
}

/// One WebSocket connection.
pub struct Session {
    /// Shared state.
    state: Arc<AppState>,
    /// `ws_…`: the cache session key.
    id: String,
    /// This connection's responses, for `previous_response_id`.
    chain: Arc<ResponseStore>,
    /// Lane queues by `stream_id` (`""` is the default lane).
    lanes: HashMap<String, mpsc::Sender<(ResponseRequest, CustomTools)>>,
    /// The lanes' tasks, joined before the session is closed in the
    /// engine (dropping the set aborts them).
    lane_tasks: JoinSet<()>,
    /// Requests queued or running.
    active: Arc<AtomicUsize>,
    /// Holds a `--max-sessions` slot.
    _permit: OwnedSemaphorePermit,
}

impl Session {
    /// A session for a new connection.
    pub fn new(state: Arc<AppState>, permit: OwnedSemaphorePermit) -> Session {
        let chain = Arc::new(ResponseStore::new(
            state.config.ws_chain_capacity,
            state.config.ws_idle_timeout,
        ));
        Session {
            state,
            id: new_id("ws_"),
            chain,
            lanes: HashMap::new(),
            lane_tasks: JoinSet::new(),
            active: Arc::new(AtomicUsize::new(0)),
            _permit: permit,
        }
    }

    /// Serves the connection until it closes.
    pub async fn run(mut self, ws: ServerSocket) {
        let _guard = self.state.shutdown.guard();
        self.state.metrics.sessions.fetch_add(1, Ordering::Relaxed);
        let (sink, mut stream) = ws.split();
        let (out, writer) = spawn_writer(sink);
        let shutdown = self.state.shutdown.clone();
        let idle = self.state.config.ws_idle_timeout;
        let mut deadline = tokio::time::Instant::now() + idle;
        let close = loop {
            let msg = tokio::select! {
                m = stream.next() => m,
                _ = shutdown.reached(Phase::Draining) => break self.drain(&out).await,
                _ = tokio::time::sleep_until(deadline) => {
                    if self.active.load(Ordering::Relaxed) == 0 {
                        break Some((CloseCode::Normal, "idle timeout"));
                    }
                    deadline = tokio::time::Instant::now() + idle;
                    continue;
                }
            };
            deadline = tokio::time::Instant::now() + idle;
            match msg {
                Some(Ok(WsMessage::Text(t))) => self.on_text(t.as_str(), &out).await,
                Some(Ok(WsMessage::Binary(_))) => {
                    let e = ApiError::invalid(
                        "unsupported_frame",
                        None,
                        "binary frames are not supported: send JSON text frames",
                    );
                    let _ = out.send(Outgoing::Event(e.ws_event(None))).await;
                }
                Some(Ok(WsMessage::Close(_))) | None => break None,
                Some(Ok(_)) => {} // ping/pong: answered by tungstenite
                Some(Err(WsError::Capacity(e))) => {
                    let err = too_large(&format!("{e}"));
                    let _ = out.send(Outgoing::Event(err.ws_event(None))).await;
                    break Some((CloseCode::Size, "message too large"));
                }
                Some(Err(_)) => break None,
            }
        };
        // Every lane has ended before the engine hears of the close: a
        // request a lane was still submitting is then queued ahead of
        // `close_session`, which cancels it, and none can finish after the
        // close and pin the session's path again.
        self.lanes.clear();
        self.lane_tasks.abort_all();
        while self.lane_tasks.join_next().await.is_some() {}
        if let Some((code, reason)) = close {
            let _ = out.send(Outgoing::Close(code, reason)).await;
        }
        drop(out);
        let _ = writer.await;
        self.state.engine.close_session(&self.id).await;
        self.state.metrics.sessions.fetch_sub(1, Ordering::Relaxed);
    }

    /// Shutdown: finish queued and running requests, unless time runs out.
    async fn drain(&mut self, out: &mpsc::Sender<Outgoing>) -> Option<(CloseCode, &'static str)> {
        // Closing the queues lets each lane finish what it holds and end.
        self.lanes.clear();
        let shutdown = self.state.shutdown.clone();
        let tasks = &mut self.lane_tasks;
        let all = async move { while tasks.join_next().await.is_some() {} };
        tokio::select! {
            _ = all => Some((CloseCode::Away, "server shutting down")),
            _ = shutdown.reached(Phase::Cancel) => {
                let _ = out.send(Outgoing::Event(ApiError::shutting_down().ws_event(None))).await;
                Some((CloseCode::Restart, "server restarting"))
            }
        }
    }

    async fn on_text(&mut self, text: &str, out: &mpsc::Sender<Outgoing>) {
        let send_err = |e: ApiError, lane: Option<&str>| {
            let ev = e.ws_event(lane);
            async move {
                let _ = out.send(Outgoing::Event(ev)).await;
            }
        };
        if text.len() > self.state.config.max_message_bytes {
            return send_err(too_large("the message"), None).await;
        }
        let mut v: Value = match serde_json::from_str(text) {
            Ok(v) => v,
            Err(e) => return send_err(ApiError::invalid_json(e), None).await,
        };
        let Some(obj) = v.as_object_mut() else {
            return send_err(
                ApiError::invalid("invalid_type", None, "an event must be a JSON object"),
                None,
            )
            .await;
        };
        let lane_id = obj
            .get("stream_id")
            .and_then(Value::as_str)
            .map(String::from);
        match obj.get("type").and_then(Value::as_str) {
            Some("response.create") => {
                self.state.metrics.request(Endpoint::ResponsesWs);
                if self.state.shutdown.is_shutting_down() {
                    return send_err(ApiError::shutting_down(), lane_id.as_deref()).await;
                }
                let custom = normalize(obj);
                match parse_request(&self.state, obj, true) {
                    Ok(req) => {
                        if let Err(e) = self.enqueue(req, custom, out) {
                            send_err(e, lane_id.as_deref()).await
                        }
                    }
                    Err(e) => send_err(e, lane_id.as_deref()).await,
                }
            }
            Some("response.steer") => {
                let ev = json!({
                    "type": "response.steer.failed",
                    "sequence_number": 0,
                    "steer": {"input": obj.get("input"), "previous_response_id": obj.get("previous_response_id")},
                    "error": {"type": "invalid_request_error", "code": "steering_not_supported",
                              "message": "steering is not supported: send a new response.create"},
                });
                let _ = out.send(Outgoing::Event(ev)).await;
            }
            Some(other) => tracing::debug!(event = other, "ignoring an unknown client event"),
            None => {
                send_err(ApiError::missing("type"), lane_id.as_deref()).await;
            }
        }
    }

    /// Queues `req` on its lane, starting the lane if it is new.
    fn enqueue(
        &mut self,
        req: ResponseRequest,
        custom: CustomTools,
        out: &mpsc::Sender<Outgoing>,
    ) -> Result<(), ApiError> {
        let key = req.stream_id.clone().unwrap_or_default();
        if !self.lanes.contains_key(&key) {
            let named = self.lanes.keys().filter(|k| !k.is_empty()).count();
            if !key.is_empty() && named >= self.state.config.ws_max_lanes {
                return Err(ApiError {
                    status: 400,
                    kind: "invalid_request_error",
                    code: "websocket_stream_limit_reached",
                    param: Some("stream_id".into()),
                    message: format!(
                        "this connection already has {named} named streams (limit {})",
                        self.state.config.ws_max_lanes
                    ),
                });
            }
            let (tx, rx) = mpsc::channel(LANE_QUEUE);
            let lane = Lane {
                state: self.state.clone(),
                session: self.id.clone(),
                chain: self.chain.clone(),
                out: out.clone(),
                active: self.active.clone(),
            };
            self.lane_tasks.spawn(lane.run(rx));
            self.lanes.insert(key.clone(), tx);
        }
        let tx = &self.lanes[&key];
        self.active.fetch_add(1, Ordering::Relaxed);
        tx.try_send((req, custom)).map_err(|_| {
            self.active.fetch_sub(1, Ordering::Relaxed);
            ApiError {
                status: 429,
                kind: "invalid_request_error",
                code: "rate_limit_exceeded",
                param: Some("stream_id".into()),
                message: format!(
                    "{LANE_QUEUE} requests are already queued on this stream; try again in 1s"
                ),
            }
        })
    }
}

/// An oversize message.
fn too_large(what: &str) -> ApiError {
    ApiError {
        status: 413,
        kind: "invalid_request_error",
        code: "message_too_large",
        param: None,
        message: format!("{what} is larger than the limit (--max-message-bytes)"),
    }
}

/// One lane: runs its requests in order.
struct Lane {
    /// Shared state.
    state: Arc<AppState>,
    /// Cache session key.
    session: String,
    /// The connection's chain.
    chain: Arc<ResponseStore>,
    /// The socket writer.
    out: mpsc::Sender<Outgoing>,
    /// Requests queued or running on the connection.
    active: Arc<AtomicUsize>,
}

impl Lane {
    async fn run(self, mut rx: mpsc::Receiver<(ResponseRequest, CustomTools)>) {
        while let Some((req, custom)) = rx.recv().await {
            self.turn(req, &custom).await;
            self.active.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Sends `ev` stamped with the lane's `stream_id`.
    async fn emit(&self, mut ev: Value, lane: Option<&str>) {
        if let Some(l) = lane {
            ev["stream_id"] = json!(l);
        }
        let _ = self.out.send(Outgoing::Event(ev)).await;
    }

    async fn turn(&self, req: ResponseRequest, custom: &CustomTools) {
        let lane = req.stream_id.clone();
        let lane = lane.as_deref();
        let parent_id = req.previous_response_id.clone();
        let prev = match &parent_id {
            Some(id) => match self.chain.get(id).or_else(|| self.state.store.get(id)) {
                Some(p) => Some(p),
                None => return self.emit(previous_not_found(id).ws_event(None), lane).await,
            },
            None => None,
        };
        let store = req.store;
        let generate = req.generate;
        let mut turn = match prepare(&self.state, req, prev.as_deref()).await {
            Ok(t) => t,
            Err(e) => {
                return self
                    .fail(e, lane, parent_id.as_deref(), prev.as_deref())
                    .await
            }
        };
        if !generate && turn.prompt_ids.is_empty() {
            // Nothing to prefill: keep the state and answer at once.
            return self
                .warm_up_without_prompt(&mut turn.builder, turn.context, lane)
                .await;
        }
        let running = match begin(&self.state, turn, Some(self.session.clone()), None).await {
            Ok(r) => r,
            Err(e) => {
                return self
                    .fail(e, lane, parent_id.as_deref(), prev.as_deref())
                    .await
            }
        };
        let (tx, mut rx) = mpsc::channel::<Value>(OUT_BUFFER);
        let forward = async {
            let mut custom_items = std::collections::HashSet::new();
            while let Some(mut ev) = rx.recv().await {
                if custom.event(&mut ev, &mut custom_items) {
                    self.emit(ev, lane).await;
                }
            }
        };
        let drive = async move {
            let outcome = running.drive(&self.state, &tx).await;
            drop(tx);
            outcome
        };
        let (outcome, ()) = tokio::join!(drive, forward);
        match outcome.stored {
            Some(mut stored) => {
                custom.response(&mut stored.object);
                let id = stored.object["id"].as_str().unwrap_or_default().to_string();
                if store {
                    self.state.store.put(&id, stored.clone());
                }
                self.chain.put(&id, stored);
            }
            None => self.evict_parent(parent_id.as_deref(), prev.as_deref(), lane),
        }
    }

    async fn warm_up_without_prompt(
        &self,
        b: &mut ResponseBuilder,
        context: Vec<crate::chat::toolcall::Message>,
        lane: Option<&str>,
    ) {
        let mut evs = b.created_only();
        evs.extend(b.finish_empty(json!({
            "input_tokens": 0, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0})));
        for e in evs {
            self.emit(e, lane).await;
        }
        let object = b.response();
        let id = b.id.clone();
        self.chain.put(
            &id,
            super::store::StoredResponse {
                object,
                context,
                prefix: Default::default(),
                input_items: Vec::new(),
                lane: lane.map(String::from),
            },
        );
    }

    async fn fail(
        &self,
        e: ApiError,
        lane: Option<&str>,
        parent: Option<&str>,
        prev: Option<&super::store::StoredResponse>,
    ) {
        self.evict_parent(parent, prev, lane);
        self.emit(e.ws_event(None), lane).await;
    }

    /// A failed continuation on the parent's own lane evicts the parent.
    fn evict_parent(
        &self,
        parent: Option<&str>,
        prev: Option<&super::store::StoredResponse>,
        lane: Option<&str>,
    ) {
        if let (Some(id), Some(p)) = (parent, prev) {
            if p.lane.as_deref() == lane {
                self.chain.delete(id);
            }
        }
    }
}
