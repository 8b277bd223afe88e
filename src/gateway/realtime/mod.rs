//! `/v1/realtime?model=`: the text subset of the Realtime protocol (GA
//! events, `agent-protocols.md` §3), one session task per connection that
//! owns its conversation.
//!
//! Client events: `session.update` (text output, `instructions`, function
//! `tools`, `tool_choice`, `max_output_tokens`; audio fields accepted and
//! ignored), `conversation.item.create` (`input_text` messages,
//! `function_call_output`, `function_call`; `previous_item_id` places it),
//! `conversation.item.delete` / `.truncate` / `.retrieve` (rewind),
//! `response.create` (with per-response overrides, `conversation: "none"`
//! and `input`), `response.cancel`. Server events run through
//! `response.done` with usage including cached tokens. Caracal's addition:
//! `caracal.cache_report` (prompt and cached tokens and the miss reason)
//! right before each `response.done`. Audio buffer events and unknown
//! events get an `error` event; the session keeps serving.
//!
//! Live video (`docs/protocol.md`, "Live video (Realtime)"): `session.video`
//! settings, `input_video_buffer.append` (base64, or a binary message of raw
//! bytes), `.commit` and `.clear`; the stream's state and jobs are
//! [`live::Live`], its results arrive on this task's select loop, and
//! questions ([`response`]) put the stream's window before the conversation.
//!
//! Files: `events.rs` (the events of one response), `response.rs` (building
//! and streaming a response), `live.rs` (the live stream), `video_settings.rs`
//! (`session.video`).

pub mod events;
pub mod live;
mod response;
pub mod video_settings;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{Error as WsError, Message as WsMessage};

use base64::Engine as _;

use self::events::event;
use self::live::{Live, PathContext};
use self::response::{
    clean_item, item_not_found, max_tokens, realtime_tools, tool_choice, Active, Outcome,
};
use super::error::{ApiError, ApiResult};
use super::fields::Fields;
use super::metrics::Endpoint;
use super::model::{CachedPrefix, ToolChoiceSpec};
use super::responses::types::items_to_messages;
use super::responses::ws::{connection_limit, spawn_writer, Outgoing};
use super::shutdown::Phase;
use super::upgrade::{accept, ServerSocket};
use super::{new_id, AppState};

/// `GET /v1/realtime?model=…` with an upgrade.
pub async fn upgrade(State(state): State<Arc<AppState>>, mut req: Request) -> Response {
    if state.shutdown.is_shutting_down() {
        return ApiError::shutting_down().into_response();
    }
    let model = match query_value(req.uri().query(), "model") {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = super::http::check_model(&state, model.as_deref()) {
        return e.into_response();
    }
    let handshake = match accept(&mut req) {
        Ok(h) => h,
        Err(e) => return e.into_response(),
    };
    let Ok(permit) = state.sessions.clone().try_acquire_owned() else {
        return connection_limit().into_response();
    };
    let limit = state.config.max_message_bytes;
    handshake.respond(limit.saturating_mul(2), move |ws| async move {
        RealtimeSession::new(state, permit).run(ws).await;
    })
}

/// The first `name=` value of a query string, decoded as a form value
/// (`+` is a space, `%XX` a byte): `model=org%2Fname` names `org/name`,
/// as the OpenAI SDKs send it. A value that is not UTF-8 once decoded is
/// a 400 `invalid_value`.
fn query_value(query: Option<&str>, name: &str) -> ApiResult<Option<String>> {
    let Some(raw) = query.and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
    }) else {
        return Ok(None);
    };
    let spaced = raw.replace('+', " ");
    percent_encoding::percent_decode_str(&spaced)
        .decode_utf8()
        .map(|v| Some(v.into_owned()))
        .map_err(|_| {
            ApiError::invalid(
                "invalid_value",
                Some(name),
                format!("The query parameter `{name}` is not UTF-8 once percent-decoded"),
            )
        })
}

/// The session configuration (`session.update`).
#[derive(Debug, Clone)]
struct SessionConfig {
    /// System text.
    instructions: String,
    /// Tools as given (flat).
    tools: Vec<Value>,
    /// Tools in chat shape.
    chat_tools: Vec<Value>,
    /// Tool choice as given.
    tool_choice_raw: Value,
    /// Tool choice for rendering.
    tool_choice: ToolChoiceSpec,
    /// `max_output_tokens` as given (an integer or `"inf"`).
    max_output_tokens: Value,
}

/// One Realtime connection.
struct RealtimeSession {
    /// Shared state.
    state: Arc<AppState>,
    /// `sess_…`, also the cache session key.
    id: String,
    /// `conv_…`.
    conversation_id: String,
    /// Configuration.
    config: SessionConfig,
    /// Conversation items in order (each with `id`).
    items: Vec<Value>,
    /// The last response's cached prompt and output.
    prefix: Option<CachedPrefix>,
    /// The response generating now.
    active: Option<Active>,
    /// The live video stream.
    live: Live,
    /// Holds a `--max-sessions` slot.
    _permit: OwnedSemaphorePermit,
}

fn session_error(
    code: &'static str,
    message: impl Into<String>,
    client_event: Option<&str>,
    param: Option<&str>,
) -> Value {
    event(
        "error",
        json!({"error": {"type": "invalid_request_error", "code": code, "message": message.into(),
                                     "param": param, "event_id": client_event}}),
    )
}

fn api_error_event(e: &ApiError, client_event: Option<&str>) -> Value {
    event(
        "error",
        json!({"error": {"type": e.kind, "code": e.code, "message": e.message,
                                     "param": e.param, "event_id": client_event}}),
    )
}

impl RealtimeSession {
    fn new(state: Arc<AppState>, permit: OwnedSemaphorePermit) -> Self {
        let id = new_id("sess_");
        RealtimeSession {
            live: Live::new(state.clone(), id.clone()),
            state,
            id,
            conversation_id: new_id("conv_"),
            config: SessionConfig {
                instructions: String::new(),
                tools: Vec::new(),
                chat_tools: Vec::new(),
                tool_choice_raw: json!("auto"),
                tool_choice: ToolChoiceSpec::Auto,
                max_output_tokens: json!("inf"),
            },
            items: Vec::new(),
            prefix: None,
            active: None,
            _permit: permit,
        }
    }

    fn session_object(&self) -> Value {
        json!({"type": "realtime", "id": self.id, "object": "realtime.session", "model": self.state.model.name,
               "output_modalities": ["text"], "instructions": self.config.instructions,
               "tools": self.config.tools, "tool_choice": self.config.tool_choice_raw,
               "max_output_tokens": self.config.max_output_tokens, "video": self.live.settings.to_json()})
    }

    async fn run(mut self, ws: ServerSocket) {
        let _guard = self.state.shutdown.guard();
        self.state.metrics.sessions.fetch_add(1, Ordering::Relaxed);
        let (sink, mut stream) = ws.split();
        let (out, writer) = spawn_writer(sink);
        let _ = out
            .send(Outgoing::Event(event(
                "session.created",
                json!({"session": self.session_object()}),
            )))
            .await;
        let _ = out
            .send(Outgoing::Event(event(
                "conversation.created",
                json!({
            "conversation": {"id": self.conversation_id, "object": "realtime.conversation"}}),
            )))
            .await;
        let shutdown = self.state.shutdown.clone();
        let close = loop {
            let finished = async {
                match self.active.as_mut() {
                    Some(a) => (&mut a.task).await.ok(),
                    None => std::future::pending().await,
                }
            };
            let accepting = self.live.accepting();
            tokio::select! {
                outcome = finished => {
                    self.active = None;
                    if let Some(mut o) = outcome {
                        let done = o.done.take();
                        self.absorb(o);
                        if let Some(d) = done {
                            let _ = out.send(Outgoing::Event(d)).await;
                        }
                    }
                    self.live.after_response();
                }
                done = self.live.next_done() => {
                    let ctx = self.path_context();
                    let result = self.live.on_done(done, &ctx);
                    for e in result.events {
                        let _ = out.send(Outgoing::Event(e)).await;
                    }
                    if result.cadence {
                        self.run_cadence(&out).await;
                    }
                }
                msg = stream.next(), if accepting => match msg {
                    Some(Ok(WsMessage::Text(t))) => self.on_text(t.as_str(), &out).await,
                    Some(Ok(WsMessage::Binary(b))) => {
                        let ctx = self.path_context();
                        for e in self.live.append(b.to_vec(), None, &ctx) {
                            let _ = out.send(Outgoing::Event(e)).await;
                        }
                    }
                    Some(Ok(WsMessage::Close(_))) | None => break None,
                    Some(Ok(_)) => {}
                    Some(Err(WsError::Capacity(_))) => {
                        let _ = out.send(Outgoing::Event(session_error("message_too_large",
                            "the message is larger than the limit (--max-message-bytes)", None, None))).await;
                        break Some((CloseCode::Size, "message too large"));
                    }
                    Some(Err(_)) => break None,
                },
                _ = shutdown.reached(Phase::Draining) => {
                    if let Some(a) = self.active.take() {
                        tokio::select! {
                            o = a.task => {
                                if let Some(d) = o.ok().and_then(|o| o.done) {
                                    let _ = out.send(Outgoing::Event(d)).await;
                                }
                            }
                            _ = shutdown.reached(Phase::Cancel) => {}
                        }
                    }
                    break Some((CloseCode::Away, "server shutting down"));
                }
            }
        };
        // The response and the stream's jobs end before the session is closed in
        // the engine, so none of them can submit afterwards and pin it again.
        if let Some(a) = self.active.take() {
            a.task.abort();
            // A response that ended before the abort still announces it.
            if let Some(d) = a.task.await.ok().and_then(|o| o.done) {
                let _ = out.send(Outgoing::Event(d)).await;
            }
        }
        self.live.shutdown().await;
        if let Some((code, reason)) = close {
            let _ = out.send(Outgoing::Close(code, reason)).await;
        }
        drop(out);
        let _ = writer.await;
        self.state.engine.close_session(&self.id).await;
        self.state.metrics.sessions.fetch_sub(1, Ordering::Relaxed);
    }

    /// What precedes the chunks in the stream path.
    fn path_context(&self) -> PathContext {
        PathContext {
            instructions: self.config.instructions.clone(),
            tools: self.config.chat_tools.clone(),
            tool_choice: self.config.tool_choice.clone(),
        }
    }

    /// Starts a cadence question unless a response runs (then the tick is skipped).
    async fn run_cadence(&mut self, out: &mpsc::Sender<Outgoing>) {
        if self.active.is_some() {
            tracing::debug!(session = %self.id, "cadence tick skipped: a response is running");
            return;
        }
        self.state.metrics.request(Endpoint::Realtime);
        let plan = self.cadence_plan();
        if let Err(e) = self.start_response(plan, out).await {
            let _ = out.send(Outgoing::Event(api_error_event(&e, None))).await;
        }
    }

    /// `input_video_buffer.append`: `video` (base64) and an optional `timestamp_ms`.
    fn video_append(&mut self, obj: &Map<String, Value>) -> ApiResult<Vec<Value>> {
        let f = Fields::new(obj);
        let data = f.require::<String>("video", "a base64 string")?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map_err(|e| {
                ApiError::invalid(
                    "invalid_value",
                    Some("video"),
                    format!("`video` is not base64: {e}"),
                )
            })?;
        let ts = f.get::<f64>("timestamp_ms", "a number")?;
        if ts.is_some_and(|t| !t.is_finite() || t < 0.0) {
            return Err(ApiError::invalid(
                "invalid_value",
                Some("timestamp_ms"),
                "`timestamp_ms` must be a finite number >= 0",
            ));
        }
        let ctx = self.path_context();
        Ok(self.live.append(bytes, ts, &ctx))
    }

    fn absorb(&mut self, o: Outcome) {
        if o.in_conversation {
            self.items.extend(o.output);
            if let Some(p) = o.prefix {
                self.prefix = Some(p);
            }
        }
    }

    async fn on_text(&mut self, text: &str, out: &mpsc::Sender<Outgoing>) {
        let send = |v: Value| async move {
            let _ = out.send(Outgoing::Event(v)).await;
        };
        if text.len() > self.state.config.max_message_bytes {
            return send(session_error(
                "message_too_large",
                "the message is larger than the limit (--max-message-bytes)",
                None,
                None,
            ))
            .await;
        }
        let v: Value = match serde_json::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                return send(session_error(
                    "invalid_json",
                    format!("the event is not valid JSON: {e}"),
                    None,
                    None,
                ))
                .await
            }
        };
        let Some(obj) = v.as_object() else {
            return send(session_error(
                "invalid_type",
                "an event must be a JSON object",
                None,
                None,
            ))
            .await;
        };
        let client_event = obj
            .get("event_id")
            .and_then(Value::as_str)
            .map(String::from);
        let ce = client_event.as_deref();
        let kind = obj.get("type").and_then(Value::as_str).unwrap_or("");
        let result: ApiResult<Vec<Value>> = match kind {
            "session.update" => self.update(obj),
            "conversation.item.create" => self.create_item(obj),
            "conversation.item.delete" => self.delete_item(obj),
            "conversation.item.retrieve" => self
                .find_item(obj)
                .map(|(_, item)| vec![event("conversation.item.retrieved", json!({"item": item}))]),
            "conversation.item.truncate" => self.find_item(obj).map(|(id, _)| {
                vec![event(
                    "conversation.item.truncated",
                    json!({"item_id": id,
                    "content_index": obj.get("content_index").cloned().unwrap_or(json!(0)),
                    "audio_end_ms": obj.get("audio_end_ms").cloned().unwrap_or(json!(0))}),
                )]
            }),
            "response.create" => {
                self.state.metrics.request(Endpoint::Realtime);
                match self.response_plan(obj) {
                    Ok(plan) => self.start_response(plan, out).await.map(|()| Vec::new()),
                    Err(e) => Err(e),
                }
            }
            "input_video_buffer.append" => self.video_append(obj),
            "input_video_buffer.commit" => {
                let ctx = self.path_context();
                Ok(self.live.commit(&ctx))
            }
            "input_video_buffer.clear" => Ok(self.live.clear()),
            "response.cancel" => match &self.active {
                Some(a)
                    if obj
                        .get("response_id")
                        .and_then(Value::as_str)
                        .is_none_or(|id| id == a.id) =>
                {
                    let _ = a.cancel.send(true);
                    Ok(Vec::new())
                }
                _ => Err(ApiError::invalid(
                    "response_cancel_not_active",
                    Some("response_id"),
                    "there is no active response to cancel",
                )),
            },
            k if k.starts_with("input_audio_buffer.") || k.starts_with("output_audio_buffer.") => {
                Err(ApiError::unsupported(
                    "type",
                    format!("`{k}`: this server takes text only"),
                ))
            }
            "" => Err(ApiError::missing("type")),
            other => Err(ApiError::invalid(
                "unknown_event",
                Some("type"),
                format!("unknown client event `{other}`"),
            )),
        };
        match result {
            Ok(evs) => {
                for e in evs {
                    send(e).await;
                }
            }
            Err(e) => send(api_error_event(&e, ce)).await,
        }
    }

    fn update(&mut self, obj: &Map<String, Value>) -> ApiResult<Vec<Value>> {
        let s = Fields::new(obj)
            .object("session")?
            .ok_or_else(|| ApiError::missing("session"))?;
        let f = Fields::nested(s, "session");
        if let Some(m) = f.array("output_modalities")? {
            if m.iter().any(|v| v != "text") {
                return Err(ApiError::unsupported(
                    "session.output_modalities",
                    "this server answers with text only",
                ));
            }
        }
        if let Some(i) = f.str("instructions")? {
            self.config.instructions = i;
        }
        if f.raw("tools").is_some() {
            let (flat, chat) = realtime_tools(&f)?;
            self.config.tools = flat;
            self.config.chat_tools = chat;
        }
        if let Some(tc) = f.raw("tool_choice") {
            self.config.tool_choice = tool_choice(tc, &self.config.chat_tools)?;
            self.config.tool_choice_raw = tc.clone();
        }
        if let Some(m) = f.raw("max_output_tokens") {
            max_tokens(m, "session.max_output_tokens")?;
            self.config.max_output_tokens = m.clone();
        }
        if let Some(v) = f.object("video")? {
            let next = self.live.settings.updated(v, self.live.stream_open())?;
            self.live.set_settings(next);
        }
        Ok(vec![event(
            "session.updated",
            json!({"session": self.session_object()}),
        )])
    }

    fn create_item(&mut self, obj: &Map<String, Value>) -> ApiResult<Vec<Value>> {
        let f = Fields::new(obj);
        let item = f.object("item")?.ok_or_else(|| ApiError::missing("item"))?;
        let mut item = clean_item(item, self.state.model.vision)?;
        // Check it converts before it joins the conversation.
        items_to_messages(
            &[Value::Object(item.clone())],
            self.state.model.vision,
            &mut Vec::new(),
        )?;
        let id = item
            .get("id")
            .and_then(Value::as_str)
            .map(String::from)
            .unwrap_or_else(|| new_id("item_"));
        item.insert("id".into(), json!(id));
        item.insert("object".into(), json!("realtime.item"));
        item.insert("status".into(), json!("completed"));
        let item = Value::Object(item);
        let at = match f.str("previous_item_id")?.as_deref() {
            None => self.items.len(),
            Some("root") => 0,
            Some(prev) => {
                1 + self
                    .position(prev)
                    .ok_or_else(|| item_not_found(prev, "previous_item_id"))?
            }
        };
        let previous = if at == 0 {
            Value::Null
        } else {
            self.items[at - 1]["id"].clone()
        };
        self.items.insert(at, item.clone());
        Ok(vec![
            event(
                "conversation.item.added",
                json!({"item": item, "previous_item_id": previous}),
            ),
            event(
                "conversation.item.done",
                json!({"item": item, "previous_item_id": previous}),
            ),
        ])
    }

    fn position(&self, id: &str) -> Option<usize> {
        self.items.iter().position(|i| i["id"] == id)
    }

    fn find_item(&self, obj: &Map<String, Value>) -> ApiResult<(String, Value)> {
        let id = Fields::new(obj).require::<String>("item_id", "a string")?;
        let at = self
            .position(&id)
            .ok_or_else(|| item_not_found(&id, "item_id"))?;
        Ok((id, self.items[at].clone()))
    }

    fn delete_item(&mut self, obj: &Map<String, Value>) -> ApiResult<Vec<Value>> {
        let (id, _) = self.find_item(obj)?;
        self.items.retain(|i| i["id"] != id.as_str());
        Ok(vec![event(
            "conversation.item.deleted",
            json!({"item_id": id}),
        )])
    }
}

#[cfg(test)]
mod tests {
    use super::query_value;

    #[test]
    fn query_values_are_form_decoded() {
        let q = Some("intent=x&model=org%2Fkimi+k3&model=second");
        assert_eq!(
            query_value(q, "model").unwrap().as_deref(),
            Some("org/kimi k3")
        );
        assert_eq!(
            query_value(Some("model=org/raw"), "model")
                .unwrap()
                .as_deref(),
            Some("org/raw")
        );
        // A longer name with the same prefix is another parameter.
        assert_eq!(query_value(Some("models=a"), "model").unwrap(), None);
        assert_eq!(query_value(None, "model").unwrap(), None);
        assert_eq!(
            query_value(Some("model="), "model").unwrap().as_deref(),
            Some("")
        );
        let e = query_value(Some("model=%FF%FE"), "model").unwrap_err();
        assert_eq!(e.body()["code"], "invalid_value");
        assert_eq!(e.body()["param"], "model");
    }
}
