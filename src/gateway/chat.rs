//! `POST /v1/chat/completions`: OpenAI Chat Completions, JSON or SSE.
//!
//! Messages (system, developer, user, assistant with `tool_calls` and Kimi's
//! `reasoning_content`, tool results), function `tools`, `tool_choice`,
//! `parallel_tool_calls`, `stop`, `seed`, `max_tokens` /
//! `max_completion_tokens`, sampling fields, `stream` with
//! `stream_options.include_usage`. Tool calls in the model's own format
//! come back as `tool_calls` (streamed as argument deltas: `id`, `type` and
//! `name` once in a call's first delta, then only `arguments`), reasoning
//! as `reasoning_content`. `logprobs` / `top_logprobs` give per-token
//! log-probabilities ([`super::logprobs`]); `n` > 1 is refused with
//! `unsupported_parameter`.
//!
//! Output constraints (on by default): declared `tools` constrain the
//! model's tool calls to the declared names and `parameters` schemas, in
//! its own format — lazily for `auto` (free text until the model opens a
//! call), from the first token for `required` and a named tool, not at all
//! for `none`; `--tool-call-constraint off` leaves calls to the parser
//! alone. `response_format` `json_schema` / `json_object` constrains the
//! answer to that JSON (reasoning is skipped: the answer starts at once).
//! A schema the compiler cannot take is a 400 naming the problem.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::error::{ApiError, ApiResult};
use super::fields::{as_object, Fields};
use super::generation::{self, Finish, GenEvent, GenRequest, GenSummary, LogprobEntry};
use super::http::{
    check_model, next_or_gone, ok_json, read_json, sse_done, sse_frame, sse_response, SSE_BUFFER,
};
use super::logprobs;
use super::media;
use super::metrics::Endpoint;
use super::model::{Conversation, ToolChoiceSpec};
use super::params::{
    compile_constraint, read_output_format, read_sampling, refuse_n, valid_request,
    OutputConstraint,
};
use super::{new_id, unix_now, AppState};
use crate::chat::toolcall::{Message, MessageContent};

/// Handles one request.
pub async fn handle(State(state): State<Arc<AppState>>, body: Body) -> Response {
    state.metrics.request(Endpoint::ChatCompletions);
    match run(state.clone(), body).await {
        Ok(r) => r,
        Err(e) => {
            state
                .metrics
                .errors
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            e.into_response()
        }
    }
}

/// Reads `messages` into chat-format messages; images and videos
/// (`video_url` parts, `{"url": …, "fps": …}` or a part-level `fps`) are
/// refused on a model without a vision tower, naming the part.
pub fn parse_messages(list: &[Value], vision: bool) -> ApiResult<Vec<Message>> {
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let name = format!("messages[{i}]");
        as_object(m, &name)?;
        let msg: Message = serde_json::from_value(m.clone()).map_err(|e| {
            ApiError::invalid("invalid_type", Some(&name), format!("`{name}`: {e}"))
        })?;
        match msg.role.as_str() {
            "system" | "developer" | "user" | "assistant" | "tool" => {}
            other => {
                return Err(ApiError::invalid(
                    "invalid_value",
                    Some(&format!("{name}.role")),
                    format!("`{name}.role` must be system, developer, user, assistant or tool, got `{other}`"),
                ))
            }
        }
        if let Some(MessageContent::Parts(parts)) = &msg.content {
            for (j, p) in parts.iter().enumerate() {
                match p.kind.as_str() {
                    "text" | "input_text" | "output_text" => {}
                    "image_url" | "image" | "input_image" if vision => {}
                    "image_url" | "image" | "input_image" => {
                        return Err(ApiError::unsupported(
                            &format!("{name}.content[{j}]"),
                            "this model takes no images",
                        ))
                    }
                    "video_url" | "input_video" if vision => {}
                    "video_url" | "input_video" => {
                        return Err(ApiError::unsupported(
                            &format!("{name}.content[{j}]"),
                            "this model takes no video",
                        ))
                    }
                    other => {
                        return Err(ApiError::unsupported(
                            &format!("{name}.content[{j}]"),
                            format!("content parts of type `{other}`"),
                        ))
                    }
                }
            }
        }
        out.push(msg);
    }
    Ok(out)
}

/// Reads chat-shaped `tools` (`{"type":"function","function":{"name",...}}`).
pub fn parse_tools(f: &Fields<'_>) -> ApiResult<Vec<Value>> {
    let Some(list) = f.array("tools")? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let name = format!("tools[{i}]");
        let o = as_object(t, &name)?;
        if o.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::unsupported(
                &format!("{name}.type"),
                "only function tools",
            ));
        }
        let func = o
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::missing(&format!("{name}.function")))?;
        if !func.get("name").is_some_and(Value::is_string) {
            return Err(ApiError::missing(&format!("{name}.function.name")));
        }
        out.push(t.clone());
    }
    Ok(out)
}

/// Reads `tool_choice` (`none`, `auto`, `required`, or a named function),
/// checking a named function against the declared tools.
pub fn parse_tool_choice(f: &Fields<'_>, tools: &[Value]) -> ApiResult<ToolChoiceSpec> {
    let choice = match f.raw("tool_choice") {
        None => ToolChoiceSpec::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoiceSpec::Auto,
            "none" => ToolChoiceSpec::None,
            "required" => ToolChoiceSpec::Required,
            other => {
                return Err(ApiError::invalid(
                    "invalid_value",
                    Some("tool_choice"),
                    format!(
                        "`tool_choice` must be none, auto, required or a function, got `{other}`"
                    ),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::missing("tool_choice.function.name"))?;
            ToolChoiceSpec::Function(name.to_string())
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "invalid_type",
                Some("tool_choice"),
                "`tool_choice`: expected a string or an object",
            ))
        }
    };
    if let ToolChoiceSpec::Function(name) = &choice {
        if !tools
            .iter()
            .any(|t| t["function"]["name"].as_str() == Some(name))
        {
            return Err(ApiError::invalid(
                "unknown_tool",
                Some("tool_choice"),
                format!("`tool_choice` names `{name}`, which is not among `tools`"),
            ));
        }
    }
    Ok(choice)
}

/// Refuses constrained `response_format`s (for endpoints that serve none).
pub fn refuse_response_format(f: &Fields<'_>) -> ApiResult<()> {
    if let Some(rf) = f.object("response_format")? {
        match rf.get("type").and_then(Value::as_str) {
            None | Some("text") => {}
            Some(other) => {
                return Err(ApiError::unsupported(
                    "response_format",
                    format!(
                        "`{other}` needs constrained decoding, which this server does not do yet"
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// The usage object.
pub fn usage(s: &GenSummary) -> Value {
    let completion = s.output_ids.len();
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": s.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens, "cache_write_tokens": 0,
                                  "image_tokens": s.media_tokens()},
        "completion_tokens_details": {"reasoning_tokens": 0},
    })
}

/// A call collected from a stream.
#[derive(Debug, Clone, Default)]
pub struct CollectedCall {
    /// Call id.
    pub id: String,
    /// Function name.
    pub name: String,
    /// Arguments JSON text.
    pub arguments: String,
}

/// Everything a generation produced, collected.
#[derive(Debug, Clone, Default)]
pub struct Collected {
    /// Answer text.
    pub text: String,
    /// Reasoning text.
    pub reasoning: String,
    /// Tool calls.
    pub calls: Vec<CollectedCall>,
    /// Per-token log-probabilities (when asked for).
    pub logprobs: Vec<LogprobEntry>,
}

impl Collected {
    /// Adds one event; returns the summary at the end, or the failure.
    pub fn add(&mut self, ev: GenEvent) -> Option<ApiResult<GenSummary>> {
        match ev {
            GenEvent::Text(t) => self.text.push_str(&t),
            GenEvent::Reasoning(t) => self.reasoning.push_str(&t),
            GenEvent::ToolStart { id, name, .. } => self.calls.push(CollectedCall {
                id,
                name,
                arguments: String::new(),
            }),
            GenEvent::ToolArgs { index, delta } => {
                if let Some(c) = self.calls.get_mut(index) {
                    c.arguments.push_str(&delta);
                }
            }
            GenEvent::ToolEnd { .. } => {}
            GenEvent::Logprob(e) => self.logprobs.push(e),
            GenEvent::Finished(s) => return Some(Ok(s)),
            GenEvent::Failed(e) => return Some(Err(e)),
        }
        None
    }
}

/// Reads the events of a generation to its end.
pub async fn collect(mut rx: mpsc::Receiver<GenEvent>) -> ApiResult<(Collected, GenSummary)> {
    let mut c = Collected::default();
    while let Some(ev) = rx.recv().await {
        if let Some(end) = c.add(ev) {
            return end.map(|s| (c, s));
        }
    }
    Err(ApiError::internal("the generation ended without a result"))
}

/// A parsed chat request.
struct ChatRequest {
    /// Echoed model name.
    model: String,
    /// Stream SSE.
    stream: bool,
    /// Final usage chunk.
    include_usage: bool,
    /// Keep only the first tool call.
    parallel_tool_calls: bool,
    /// Log-probabilities asked for.
    logprobs: bool,
}

async fn run(state: Arc<AppState>, body: Body) -> ApiResult<Response> {
    let obj: Map<String, Value> = read_json(&state, body).await?;
    let f = Fields::new(&obj);
    let model = check_model(&state, f.str("model")?.as_deref())?;
    let logprobs = logprobs::read_chat(&f)?;
    refuse_n(&f)?;
    let format = read_output_format(&state, "response_format", f.raw("response_format"))?;
    let list = f
        .array("messages")?
        .ok_or_else(|| ApiError::missing("messages"))?;
    if list.is_empty() {
        return Err(ApiError::invalid(
            "invalid_value",
            Some("messages"),
            "`messages` must not be empty",
        ));
    }
    let messages = parse_messages(list, state.model.vision)?;
    let tools = parse_tools(&f)?;
    let tool_choice = parse_tool_choice(&f, &tools)?;
    let sampling = read_sampling(
        &f,
        &["max_completion_tokens", "max_tokens"],
        &state.config.sampling_defaults,
    )?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        Some(o) => Fields::nested(o, "stream_options")
            .bool("include_usage")?
            .unwrap_or(false),
        None => false,
    };
    let thinking =
        !matches!(f.str("reasoning_effort")?.as_deref(), Some("none")) && format.is_none();
    let parallel_tool_calls = f.bool("parallel_tool_calls")?;
    let constraint = compile_constraint(
        &state,
        OutputConstraint {
            tools: &tools,
            tool_choice: f.raw("tool_choice"),
            parallel_tool_calls,
            format,
            thinking,
            messages: &messages,
        },
    )
    .await?;
    let mut conv = Conversation {
        messages,
        tools,
        tool_choice,
        thinking,
    };
    let encoded = media::encode_media(&state, &conv.messages).await?;
    encoded.substitute(&mut conv.messages);
    let text = state.model.render(&conv)?;
    let prompt = state.model.encode(&text, None)?;
    let mut valid = valid_request(&state, prompt, &sampling, f.str("user")?)?;
    media::splice(&state, &mut valid, &encoded.items)?;
    valid.logprobs = logprobs;
    let req = ChatRequest {
        model,
        stream,
        include_usage,
        parallel_tool_calls: parallel_tool_calls.unwrap_or(true),
        logprobs: logprobs.is_some(),
    };
    let rx = generation::start_with(
        &state,
        GenRequest {
            valid,
            parser: state.model.parser(thinking),
            skip_special: state.model.skip_special_in_output(),
            stop: sampling.stop.clone(),
            cancel: None,
        },
        constraint,
    )
    .await?;
    let id = new_id("chatcmpl-");
    let created = unix_now();
    if !req.stream {
        let (mut c, summary) = collect(rx).await?;
        if !req.parallel_tool_calls {
            c.calls.truncate(1);
        }
        return Ok(ok_json(&completion_object(
            &id,
            created,
            &req.model,
            &c,
            &summary,
            req.logprobs,
        )));
    }
    let (tx, frames) = mpsc::channel::<Bytes>(SSE_BUFFER);
    tokio::spawn(stream_chunks(rx, tx, id, created, req));
    Ok(sse_response(frames))
}

/// The finish reason of a finished generation.
fn finish_reason(s: &GenSummary, calls: bool) -> &'static str {
    match s.finish {
        _ if calls => "tool_calls",
        Finish::Length => "length",
        Finish::Stop | Finish::Cancelled => "stop",
    }
}

fn completion_object(
    id: &str,
    created: u64,
    model: &str,
    c: &Collected,
    s: &GenSummary,
    logprobs: bool,
) -> Value {
    let mut message = json!({
        "role": "assistant",
        "content": if c.text.is_empty() && !c.calls.is_empty() { Value::Null } else { json!(c.text) },
    });
    if !c.reasoning.is_empty() {
        message["reasoning_content"] = json!(c.reasoning);
    }
    if !c.calls.is_empty() {
        message["tool_calls"] = c
            .calls
            .iter()
            .map(|call| {
                json!({"id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}})
            })
            .collect();
    }
    json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": null,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": if logprobs { logprobs::chat_json(&c.logprobs) } else { Value::Null },
            "finish_reason": finish_reason(s, !c.calls.is_empty()),
        }],
        "usage": usage(s),
    })
}

/// Turns generation events into `chat.completion.chunk` frames.
async fn stream_chunks(
    mut rx: mpsc::Receiver<GenEvent>,
    tx: mpsc::Sender<Bytes>,
    id: String,
    created: u64,
    req: ChatRequest,
) {
    // Entries of tokens whose text has not been sent yet.
    let pending = std::sync::Mutex::new(Vec::<LogprobEntry>::new());
    let chunk = |delta: Value, finish: Option<&str>| {
        let mut pending = pending.lock().unwrap_or_else(|e| e.into_inner());
        let lp = if req.logprobs && (!pending.is_empty() || finish.is_some()) {
            logprobs::chat_json(&std::mem::take(&mut *pending))
        } else {
            Value::Null
        };
        let mut c = json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": req.model,
            "system_fingerprint": null,
            "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}],
        });
        if req.include_usage {
            c["usage"] = Value::Null;
        }
        sse_frame(None, &c)
    };
    if tx
        .send(chunk(json!({"role": "assistant", "content": ""}), None))
        .await
        .is_err()
    {
        return;
    }
    let mut calls = 0usize;
    while let Some(ev) = next_or_gone(&mut rx, &tx).await {
        let frame = match ev {
            GenEvent::Text(t) => chunk(json!({"content": t}), None),
            GenEvent::Reasoning(t) => chunk(json!({"reasoning_content": t}), None),
            GenEvent::ToolStart {
                index,
                id: call_id,
                name,
            } => {
                if index > 0 && !req.parallel_tool_calls {
                    continue;
                }
                calls += 1;
                chunk(
                    json!({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                           "function": {"name": name, "arguments": ""}}]}),
                    None,
                )
            }
            GenEvent::ToolArgs { index, delta } => {
                if index > 0 && !req.parallel_tool_calls {
                    continue;
                }
                chunk(
                    json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]}),
                    None,
                )
            }
            GenEvent::ToolEnd { .. } => continue,
            GenEvent::Logprob(e) => {
                pending.lock().unwrap_or_else(|e| e.into_inner()).push(e);
                continue;
            }
            GenEvent::Finished(s) => {
                if tx
                    .send(chunk(json!({}), Some(finish_reason(&s, calls > 0))))
                    .await
                    .is_err()
                {
                    return;
                }
                if req.include_usage {
                    let u = json!({
                        "id": id, "object": "chat.completion.chunk", "created": created,
                        "model": req.model, "system_fingerprint": null, "choices": [], "usage": usage(&s),
                    });
                    if tx.send(sse_frame(None, &u)).await.is_err() {
                        return;
                    }
                }
                let _ = tx.send(sse_done()).await;
                return;
            }
            GenEvent::Failed(e) => {
                let _ = tx.send(sse_frame(None, &e.http_body())).await;
                let _ = tx.send(sse_done()).await;
                return;
            }
        };
        if tx.send(frame).await.is_err() {
            return;
        }
    }
}
