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

pub mod events;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{Error as WsError, Message as WsMessage};

use self::events::{event, RealtimeResponse};
use super::error::{ApiError, ApiResult};
use super::fields::{as_object, Fields};
use super::generation::{self, GenEvent, GenRequest, GenSummary};
use super::media;
use super::metrics::Endpoint;
use super::model::{CachedPrefix, Conversation, ToolChoiceSpec};
use super::params::{valid_request, Sampling};
use super::responses::turn::name_tool_results;
use super::responses::types::{items_to_messages, prompt_messages};
use super::responses::ws::{connection_limit, spawn_writer, Outgoing};
use super::shutdown::Phase;
use super::upgrade::{accept, ServerSocket};
use super::{new_id, AppState};
use caracal_kernels::sampling::SamplingParams;

/// `GET /v1/realtime?model=…` with an upgrade.
pub async fn upgrade(State(state): State<Arc<AppState>>, mut req: Request) -> Response {
    if state.shutdown.is_shutting_down() {
        return ApiError::shutting_down().into_response();
    }
    let model = req.uri().query().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("model="))
            .map(String::from)
    });
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

/// What a finished response hands back to the session.
struct Outcome {
    /// The response's output items (to append to the conversation).
    output: Vec<Value>,
    /// Whether they join the conversation.
    in_conversation: bool,
    /// The cached prompt and output, when it finished.
    prefix: Option<CachedPrefix>,
}

/// The running response.
struct Active {
    /// Its id.
    id: String,
    /// Cancel switch.
    cancel: watch::Sender<bool>,
    /// The task.
    task: JoinHandle<Outcome>,
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
        RealtimeSession {
            state,
            id: new_id("sess_"),
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
               "max_output_tokens": self.config.max_output_tokens})
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
            tokio::select! {
                outcome = finished => {
                    self.active = None;
                    if let Some(o) = outcome {
                        self.absorb(o);
                    }
                }
                msg = stream.next() => match msg {
                    Some(Ok(WsMessage::Text(t))) => self.on_text(t.as_str(), &out).await,
                    Some(Ok(WsMessage::Binary(_))) => {
                        let _ = out.send(Outgoing::Event(session_error("unsupported_frame",
                            "binary frames are not supported: send JSON text frames", None, None))).await;
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
                            _ = a.task => {}
                            _ = shutdown.reached(Phase::Cancel) => {}
                        }
                    }
                    break Some((CloseCode::Away, "server shutting down"));
                }
            }
        };
        if let Some(a) = self.active.take() {
            a.task.abort();
        }
        if let Some((code, reason)) = close {
            let _ = out.send(Outgoing::Close(code, reason)).await;
        }
        drop(out);
        let _ = writer.await;
        self.state.engine.close_session(&self.id).await;
        self.state.metrics.sessions.fetch_sub(1, Ordering::Relaxed);
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
                self.create_response(obj, out).await
            }
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

    async fn create_response(
        &mut self,
        obj: &Map<String, Value>,
        out: &mpsc::Sender<Outgoing>,
    ) -> ApiResult<Vec<Value>> {
        if self.active.is_some() {
            return Err(ApiError::invalid(
                "conversation_already_has_active_response",
                None,
                "a response is already in progress; cancel it or wait for response.done",
            ));
        }
        let empty = Map::new();
        let r = Fields::new(obj).object("response")?.unwrap_or(&empty);
        let f = Fields::nested(r, "response");
        let mut config = self.config.clone();
        if let Some(i) = f.str("instructions")? {
            config.instructions = i;
        }
        if f.raw("tools").is_some() {
            let (flat, chat) = realtime_tools(&f)?;
            config.tools = flat;
            config.chat_tools = chat;
        }
        if let Some(tc) = f.raw("tool_choice") {
            config.tool_choice = tool_choice(tc, &config.chat_tools)?;
        }
        let max_raw = f
            .raw("max_output_tokens")
            .cloned()
            .unwrap_or(config.max_output_tokens.clone());
        let max = max_tokens(&max_raw, "response.max_output_tokens")?;
        let in_conversation = f.str("conversation")?.as_deref() != Some("none");
        let items: Vec<Value> = match f.array("input")? {
            Some(list) => {
                let mut v = Vec::new();
                for (i, it) in list.iter().enumerate() {
                    let o = as_object(it, &format!("response.input[{i}]"))?;
                    if o.get("type").and_then(Value::as_str) == Some("item_reference") {
                        let id = o.get("id").and_then(Value::as_str).unwrap_or("");
                        let at = self
                            .position(id)
                            .ok_or_else(|| item_not_found(id, "response.input"))?;
                        v.push(self.items[at].clone());
                    } else {
                        v.push(Value::Object(clean_item(o, self.state.model.vision)?));
                    }
                }
                v
            }
            None => self.items.clone(),
        };
        let mut context = Vec::new();
        items_to_messages(&items, self.state.model.vision, &mut context)?;
        name_tool_results(&mut context);
        let messages = prompt_messages(Some(&config.instructions), &context);
        let mut conv = Conversation {
            messages,
            tools: config.chat_tools.clone(),
            tool_choice: config.tool_choice.clone(),
            thinking: true,
        };
        let encoded = media::encode_media(&self.state, &context).await?;
        encoded.substitute(&mut conv.messages);
        let prompt_text = self.state.model.render(&conv)?;
        let prefix = if in_conversation {
            self.prefix.as_ref()
        } else {
            None
        };
        let prompt_ids = self.state.model.encode(&prompt_text, prefix)?;
        let sampling = Sampling {
            params: SamplingParams {
                temperature: 0.8,
                ..SamplingParams::default()
            },
            stop: Vec::new(),
            max_tokens: max,
            ignore_eos: false,
        };
        let mut valid = valid_request(
            &self.state,
            prompt_ids.clone(),
            &sampling,
            Some(self.id.clone()),
        )?;
        media::splice(&self.state, &mut valid, &encoded.items)?;
        let (cancel, cancel_rx) = watch::channel(false);
        let rx = generation::start(
            &self.state,
            GenRequest {
                valid,
                parser: self.state.model.parser(true),
                skip_special: self.state.model.skip_special_in_output(),
                stop: Vec::new(),
                cancel: Some(cancel_rx),
            },
        )
        .await?;
        let previous = if in_conversation {
            self.items
                .last()
                .and_then(|i| i["id"].as_str())
                .map(String::from)
        } else {
            None
        };
        let metadata = f.raw("metadata").cloned().unwrap_or(Value::Null);
        let resp = RealtimeResponse::new(previous, &self.conversation_id, max_raw, metadata);
        let id = resp.id.clone();
        let state = self.state.clone();
        let out = out.clone();
        let task = tokio::spawn(run_response(
            state,
            resp,
            rx,
            out,
            in_conversation,
            prompt_text,
            prompt_ids,
        ));
        self.active = Some(Active { id, cancel, task });
        Ok(Vec::new())
    }
}

/// Streams one response and returns what joins the conversation.
async fn run_response(
    state: Arc<AppState>,
    mut resp: RealtimeResponse,
    mut rx: mpsc::Receiver<GenEvent>,
    out: mpsc::Sender<Outgoing>,
    in_conversation: bool,
    prompt_text: String,
    prompt_ids: Vec<u32>,
) -> Outcome {
    let send_all = |evs: Vec<Value>| {
        let out = out.clone();
        async move {
            for e in evs {
                if out.send(Outgoing::Event(e)).await.is_err() {
                    return false;
                }
            }
            true
        }
    };
    send_all(vec![resp.created()]).await;
    let mut summary: Option<GenSummary> = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Finished(s) => {
                send_all(resp.finish(&s)).await;
                summary = Some(s);
                break;
            }
            GenEvent::Failed(e) => {
                send_all(resp.fail(e.code, &e.message)).await;
                break;
            }
            ev => {
                let evs = resp.on_event(ev);
                if !send_all(evs).await {
                    break;
                }
            }
        }
    }
    let prefix = summary
        .filter(|s| s.finish != generation::Finish::Cancelled)
        .map(|s| CachedPrefix {
            prompt_text,
            prompt_ids,
            output_text: state.model.raw_text(&s.output_ids),
            output_ids: s.output_ids,
        });
    Outcome {
        output: std::mem::take(&mut resp.output),
        in_conversation,
        prefix,
    }
}

fn item_not_found(id: &str, param: &str) -> ApiError {
    ApiError::invalid(
        "item_not_found",
        Some(param),
        format!("no conversation item with id `{id}`"),
    )
}

/// An item as the conversation keeps it: audio parts dropped (accepted and ignored).
fn clean_item(item: &Map<String, Value>, _vision: bool) -> ApiResult<Map<String, Value>> {
    let mut item = item.clone();
    if let Some(Value::Array(parts)) = item.get_mut("content") {
        parts.retain(|p| {
            !matches!(
                p.get("type").and_then(Value::as_str),
                Some("input_audio" | "output_audio" | "audio")
            )
        });
        for p in parts.iter_mut() {
            if p.get("type").and_then(Value::as_str) == Some("text") {
                p["type"] = json!("input_text");
            }
        }
    }
    match item.get("type").and_then(Value::as_str) {
        None | Some("message" | "function_call" | "function_call_output") => Ok(item),
        Some(other) => Err(ApiError::invalid(
            "invalid_value",
            Some("item.type"),
            format!("unknown item type `{other}`"),
        )),
    }
}

/// `max_output_tokens`: an integer, or `"inf"` (the context left).
fn max_tokens(v: &Value, name: &str) -> ApiResult<Option<usize>> {
    match v {
        Value::String(s) if s == "inf" => Ok(None),
        Value::Number(n)
            if n.as_u64()
                .is_some_and(|n| (1..=crate::request::MAX_OUTPUT_TOKENS as u64).contains(&n)) =>
        {
            Ok(n.as_u64().map(|n| n as usize))
        }
        _ => Err(ApiError::invalid(
            "invalid_value",
            Some(name),
            format!(
                "`{name}` must be an integer in [1, {}] or \"inf\"",
                crate::request::MAX_OUTPUT_TOKENS
            ),
        )),
    }
}

/// Realtime tools (flat, like Responses): `(as given, chat shape)`.
fn realtime_tools(f: &Fields<'_>) -> ApiResult<(Vec<Value>, Vec<Value>)> {
    let list = f.array("tools")?.cloned().unwrap_or_default();
    let mut chat = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let name = f.name(&format!("tools[{i}]"));
        let o = as_object(t, &name)?;
        if o.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::unsupported(
                &format!("{name}.type"),
                "only function tools",
            ));
        }
        let fname = o
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::missing(&format!("{name}.name")))?;
        chat.push(json!({"type": "function", "function": {"name": fname,
            "description": o.get("description").cloned().unwrap_or(Value::Null),
            "parameters": o.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object", "properties": {}}))}}));
    }
    Ok((list, chat))
}

fn tool_choice(v: &Value, chat_tools: &[Value]) -> ApiResult<ToolChoiceSpec> {
    Ok(match v {
        Value::String(s) if s == "auto" => ToolChoiceSpec::Auto,
        Value::String(s) if s == "none" => ToolChoiceSpec::None,
        Value::String(s) if s == "required" => ToolChoiceSpec::Required,
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::missing("tool_choice.name"))?;
            if !chat_tools.iter().any(|t| t["function"]["name"] == name) {
                return Err(ApiError::invalid(
                    "unknown_tool",
                    Some("tool_choice"),
                    format!("`tool_choice` names `{name}`, which is not among `tools`"),
                ));
            }
            ToolChoiceSpec::Function(name.into())
        }
        _ => {
            return Err(ApiError::invalid(
                "invalid_value",
                Some("tool_choice"),
                "`tool_choice` must be auto, none, required or a function",
            ))
        }
    })
}
