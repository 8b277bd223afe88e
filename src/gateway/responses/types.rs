//! Reading a Responses request (`POST /v1/responses` body, or a WebSocket
//! `response.create`) and its input items into a conversation.
//!
//! Input items: messages (easy form with string content, or typed parts;
//! assistant history in output form), `function_call` (replayed model
//! output, joined to the assistant turn it belongs to), `function_call_output`
//! (a tool result), `reasoning` (replayed; kept as the next assistant turn's
//! `reasoning_content`, so the prompt matches what the model wrote). Flat
//! function tools (`{"type":"function","name","parameters"}`) become chat
//! tools for rendering. Unknown top-level keys are ignored.

use serde_json::{json, Map, Value};

use crate::chat::toolcall::{ContentPart, Message, MessageContent, ToolCall};
use crate::gateway::error::{ApiError, ApiResult};
use crate::gateway::fields::{as_object, type_name, Fields};
use crate::gateway::model::ToolChoiceSpec;
use crate::gateway::params::read_output_format;
use crate::gateway::params::{read_sampling, Sampling};
use crate::gateway::AppState;

/// A validated Responses request.
#[derive(Debug, Clone)]
pub struct ResponseRequest {
    /// Echoed model name.
    pub model: String,
    /// The input items as given (a string input becomes one user message item).
    pub input_items: Vec<Value>,
    /// The input as chat messages.
    pub messages: Vec<Message>,
    /// System text for this request only.
    pub instructions: Option<String>,
    /// Tools as given (flat), echoed in the response.
    pub tools: Vec<Value>,
    /// Tools in chat shape, for rendering.
    pub chat_tools: Vec<Value>,
    /// Tool choice for rendering.
    pub tool_choice: ToolChoiceSpec,
    /// Tool choice as given, echoed.
    pub tool_choice_raw: Value,
    /// Whether several calls may come back.
    pub parallel_tool_calls: bool,
    /// The turn this one continues.
    pub previous_response_id: Option<String>,
    /// Keep the response for later retrieval and chaining over HTTP.
    pub store: bool,
    /// SSE (HTTP only; WebSocket always streams).
    pub stream: bool,
    /// Sampling, stop strings and `max_output_tokens`.
    pub sampling: Sampling,
    /// Thinking for formats that have it (`reasoning.effort` `none` turns it off).
    pub thinking: bool,
    /// Echoed fields: `text`, `reasoning`, `metadata`, `truncation`, `temperature`, `top_p`.
    pub echo: Map<String, Value>,
    /// Cache session key (`prompt_cache_key`).
    pub cache_key: Option<String>,
    /// WebSocket lane (`stream_id`).
    pub stream_id: Option<String>,
    /// WebSocket `generate` (false: prefill and cache without output).
    pub generate: bool,
    /// Log-probabilities per answer token (`top_logprobs`, or `include`
    /// naming `message.output_text.logprobs`).
    pub logprobs: Option<usize>,
}

/// Text of a content value: a string, or text parts joined.
fn content_text(content: &Value, name: &str, vision: bool) -> ApiResult<String> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                let pname = format!("{name}[{j}]");
                let o = as_object(p, &pname)?;
                match o.get("type").and_then(Value::as_str) {
                    Some(
                        "input_text" | "output_text" | "text" | "summary_text" | "reasoning_text",
                    ) => out.push_str(o.get("text").and_then(Value::as_str).unwrap_or("")),
                    Some("refusal") => {
                        out.push_str(o.get("refusal").and_then(Value::as_str).unwrap_or(""))
                    }
                    Some("input_image") if !vision => {
                        return Err(ApiError::unsupported(&pname, "this model takes no images"))
                    }
                    Some("input_video") if !vision => {
                        return Err(ApiError::unsupported(&pname, "this model takes no video"))
                    }
                    Some(other) => {
                        return Err(ApiError::unsupported(
                            &pname,
                            format!("content parts of type `{other}`"),
                        ))
                    }
                    None => return Err(ApiError::missing(&format!("{pname}.type"))),
                }
            }
            Ok(out)
        }
        Value::Null => Ok(String::new()),
        other => Err(ApiError::invalid(
            "invalid_type",
            Some(name),
            format!(
                "`{name}`: expected a string or an array of parts, got {}",
                type_name(other)
            ),
        )),
    }
}

/// A content value as message content: text when it has no media, else
/// text, `input_image` and `input_video` parts in order (media only when
/// `vision`). An `input_video` part is `{"type": "input_video", "video_url":
/// "data:video/mp4;base64,…", "fps": 2}` (`video_url` may also be
/// `{"url": …, "fps": …}`; `fps` is optional, default 2).
fn content_of(content: &Value, name: &str, vision: bool) -> ApiResult<MessageContent> {
    let Value::Array(parts) = content else {
        return Ok(MessageContent::Text(content_text(content, name, vision)?));
    };
    let kind = |p: &Value| p.get("type").and_then(Value::as_str).map(str::to_owned);
    let is_media = |p: &Value| matches!(kind(p).as_deref(), Some("input_image" | "input_video"));
    if !vision || !parts.iter().any(is_media) {
        return Ok(MessageContent::Text(content_text(content, name, vision)?));
    }
    let mut out = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        let pname = format!("{name}[{j}]");
        match kind(p).as_deref() {
            Some("input_image") => {
                let url = p
                    .get("image_url")
                    .filter(|u| u.is_string())
                    .ok_or_else(|| {
                        if p.get("file_id").is_some() {
                            ApiError::unsupported(&pname, "`file_id` images (send `image_url`)")
                        } else {
                            ApiError::missing(&format!("{pname}.image_url"))
                        }
                    })?;
                out.push(ContentPart {
                    kind: "input_image".into(),
                    text: None,
                    image_url: Some(url.clone()),
                    video_url: None,
                    fps: None,
                });
            }
            Some("input_video") => {
                let url = p
                    .get("video_url")
                    .filter(|u| u.is_string() || u.get("url").is_some_and(Value::is_string))
                    .ok_or_else(|| {
                        if p.get("file_id").is_some() {
                            ApiError::unsupported(&pname, "`file_id` videos (send `video_url`)")
                        } else {
                            ApiError::missing(&format!("{pname}.video_url"))
                        }
                    })?;
                let fps = match p.get("fps") {
                    None | Some(Value::Null) => None,
                    Some(v) => Some(v.as_f64().ok_or_else(|| {
                        ApiError::invalid(
                            "invalid_type",
                            Some(&format!("{pname}.fps")),
                            format!("`{pname}.fps` must be a number"),
                        )
                    })?),
                };
                out.push(ContentPart {
                    kind: "input_video".into(),
                    text: None,
                    image_url: None,
                    video_url: Some(url.clone()),
                    fps,
                });
            }
            _ => {
                let text = content_text(&Value::Array(vec![p.clone()]), &pname, vision)?;
                out.push(ContentPart::text(&text));
            }
        }
    }
    Ok(MessageContent::Parts(out))
}

/// `m` with `content`.
fn with_content(mut m: Message, content: MessageContent) -> Message {
    m.content = Some(content);
    m
}

/// Converts input items into chat messages, appended to `out`.
pub fn items_to_messages(items: &[Value], vision: bool, out: &mut Vec<Message>) -> ApiResult<()> {
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let name = format!("input[{i}]");
        let o = as_object(item, &name)?;
        let f = Fields::nested(o, &name);
        let kind = f.str("type")?.unwrap_or_else(|| "message".into());
        match kind.as_str() {
            "message" => {
                let role = f.require::<String>("role", "a string")?;
                let content = content_of(
                    o.get("content").unwrap_or(&Value::Null),
                    &format!("{name}.content"),
                    vision && role == "user",
                )?;
                match role.as_str() {
                    "user" | "system" | "developer" => {
                        out.push(with_content(Message::text(&role, ""), content))
                    }
                    "assistant" => {
                        let mut m = with_content(Message::text("assistant", ""), content);
                        m.reasoning_content = reasoning.take();
                        out.push(m);
                    }
                    other => {
                        return Err(ApiError::invalid(
                            "invalid_value",
                            Some(&format!("{name}.role")),
                            format!("`{name}.role` must be user, assistant, system or developer, got `{other}`"),
                        ))
                    }
                }
            }
            "function_call" => {
                let call_id = f
                    .str("call_id")?
                    .ok_or_else(|| ApiError::missing(&format!("{name}.call_id")))?;
                let fname = f.require::<String>("name", "a string")?;
                let args = f.str("arguments")?.unwrap_or_else(|| "{}".into());
                let call = ToolCall::function(&call_id, &fname, &args);
                // Calls right after an assistant turn (or other calls) belong to it.
                match out.last_mut() {
                    Some(m) if m.role == "assistant" && reasoning.is_none() => {
                        m.tool_calls.get_or_insert_with(Vec::new).push(call)
                    }
                    _ => {
                        let mut m = Message::assistant_with_calls(None, vec![call]);
                        m.reasoning_content = reasoning.take();
                        out.push(m);
                    }
                }
            }
            "function_call_output" => {
                let call_id = f
                    .str("call_id")?
                    .ok_or_else(|| ApiError::missing(&format!("{name}.call_id")))?;
                let output = content_of(
                    o.get("output").unwrap_or(&Value::Null),
                    &format!("{name}.output"),
                    vision,
                )?;
                out.push(with_content(Message::tool_result(&call_id, ""), output));
            }
            "reasoning" => {
                let mut text = String::new();
                if let Some(c) = o.get("content").filter(|c| c.is_array()) {
                    text = content_text(c, &format!("{name}.content"), vision)?;
                }
                if text.is_empty() {
                    if let Some(s) = o.get("summary").filter(|c| c.is_array()) {
                        text = content_text(s, &format!("{name}.summary"), vision)?;
                    }
                }
                reasoning = Some(reasoning.unwrap_or_default() + &text);
            }
            "item_reference" => {
                return Err(ApiError::unsupported(
                    &name,
                    "item references; send the item itself",
                ))
            }
            other => {
                return Err(ApiError::invalid(
                    "invalid_value",
                    Some(&format!("{name}.type")),
                    format!("unknown input item type `{other}`"),
                ))
            }
        }
    }
    Ok(())
}

/// Flat function tools → chat tools; other tool types are refused.
fn parse_tools(f: &Fields<'_>) -> ApiResult<(Vec<Value>, Vec<Value>)> {
    let Some(list) = f.array("tools")? else {
        return Ok((Vec::new(), Vec::new()));
    };
    let mut chat = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let name = format!("tools[{i}]");
        let o = as_object(t, &name)?;
        match o.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return Err(ApiError::unsupported(
                    &format!("{name}.type"),
                    format!("`{other}` tools (only function tools)"),
                ))
            }
            None => return Err(ApiError::missing(&format!("{name}.type"))),
        }
        let fname = o
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::missing(&format!("{name}.name")))?;
        let mut func = json!({"name": fname});
        if let Some(d) = o.get("description").filter(|d| !d.is_null()) {
            func["description"] = d.clone();
        }
        func["parameters"] = o
            .get("parameters")
            .filter(|p| !p.is_null())
            .cloned()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        chat.push(json!({"type": "function", "function": func}));
    }
    Ok((list.clone(), chat))
}

/// Reads `tool_choice` in the Responses shapes.
fn parse_tool_choice(f: &Fields<'_>, chat_tools: &[Value]) -> ApiResult<(ToolChoiceSpec, Value)> {
    let raw = f
        .raw("tool_choice")
        .cloned()
        .unwrap_or_else(|| json!("auto"));
    let spec = match &raw {
        Value::String(s) => match s.as_str() {
            "auto" => ToolChoiceSpec::Auto,
            "none" => ToolChoiceSpec::None,
            "required" => ToolChoiceSpec::Required,
            other => {
                return Err(ApiError::invalid(
                    "invalid_value",
                    Some("tool_choice"),
                    format!(
                        "`tool_choice` must be none, auto, required or an object, got `{other}`"
                    ),
                ))
            }
        },
        Value::Object(o) => match o.get("type").and_then(Value::as_str) {
            Some("function") => {
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
                ToolChoiceSpec::Function(name.to_string())
            }
            Some("allowed_tools") => match o.get("mode").and_then(Value::as_str) {
                Some("required") => ToolChoiceSpec::Required,
                _ => ToolChoiceSpec::Auto,
            },
            _ => {
                return Err(ApiError::unsupported(
                    "tool_choice",
                    "only none, auto, required, function and allowed_tools",
                ))
            }
        },
        other => {
            return Err(ApiError::invalid(
                "invalid_type",
                Some("tool_choice"),
                format!(
                    "`tool_choice`: expected a string or an object, got {}",
                    type_name(other)
                ),
            ))
        }
    };
    Ok((spec, raw))
}

/// Reads a request; `ws` enables `stream_id` and `generate` and refuses `background`.
pub fn parse_request(
    state: &AppState,
    obj: &Map<String, Value>,
    ws: bool,
) -> ApiResult<ResponseRequest> {
    let f = Fields::new(obj);
    let model = crate::gateway::http::check_model(state, f.str("model")?.as_deref())?;
    if f.bool("background")?.unwrap_or(false) {
        return Err(ApiError::unsupported(
            "background",
            "responses run in the foreground",
        ));
    }
    if f.raw("conversation").is_some() {
        return Err(ApiError::unsupported(
            "conversation",
            "chain turns with `previous_response_id`",
        ));
    }
    let logprobs = crate::gateway::logprobs::read_responses(&f)?;
    // Checked here so a bad schema is refused before anything runs; the
    // turn compiles it again from the echoed `text` when it starts.
    let text_format = read_output_format(state, "text.format", text_format_of(f.raw("text")))?;
    let input_items: Vec<Value> = match f.raw("input") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![json!({"type": "message", "role": "user", "content": s})],
        Some(Value::Array(a)) => a.clone(),
        Some(other) => {
            return Err(ApiError::invalid(
                "invalid_type",
                Some("input"),
                format!(
                    "`input`: expected a string or an array of items, got {}",
                    type_name(other)
                ),
            ))
        }
    };
    let mut messages = Vec::new();
    items_to_messages(&input_items, state.model.vision, &mut messages)?;
    let (tools, chat_tools) = parse_tools(&f)?;
    let (tool_choice, tool_choice_raw) = parse_tool_choice(&f, &chat_tools)?;
    let sampling = read_sampling(&f, &["max_output_tokens"], &state.config.sampling_defaults)?;
    let reasoning = f.object("reasoning")?;
    let thinking = reasoning
        .and_then(|r| r.get("effort"))
        .and_then(Value::as_str)
        .is_none_or(|e| e != "none")
        && text_format.is_none();
    let mut echo = Map::new();
    for key in [
        "text",
        "reasoning",
        "metadata",
        "truncation",
        "temperature",
        "top_p",
        "user",
    ] {
        echo.insert(key.into(), f.raw(key).cloned().unwrap_or(Value::Null));
    }
    let stream_id = if ws { f.str("stream_id")? } else { None };
    if let Some(s) = &stream_id {
        let ok = (1..=256).contains(&s.len())
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !ok {
            return Err(ApiError::invalid(
                "invalid_stream_id",
                Some("stream_id"),
                "`stream_id` must be 1-256 characters of [A-Za-z0-9_.-]",
            ));
        }
    }
    Ok(ResponseRequest {
        model,
        input_items,
        messages,
        instructions: f.str("instructions")?,
        tools,
        chat_tools,
        tool_choice,
        tool_choice_raw,
        parallel_tool_calls: f.bool("parallel_tool_calls")?.unwrap_or(true),
        previous_response_id: f.str("previous_response_id")?,
        store: f.bool("store")?.unwrap_or(true),
        stream: f.bool("stream")?.unwrap_or(false),
        sampling,
        thinking,
        echo,
        cache_key: f.str("prompt_cache_key")?,
        stream_id,
        generate: if ws {
            f.bool("generate")?.unwrap_or(true)
        } else {
            true
        },
        logprobs,
    })
}

/// The `previous_response_not_found` error.
pub fn previous_not_found(id: &str) -> ApiError {
    ApiError::invalid(
        "previous_response_not_found",
        Some("previous_response_id"),
        format!("Previous response with id '{id}' not found."),
    )
}

/// The messages of the prompt: instructions, then the context.
pub fn prompt_messages(instructions: Option<&str>, context: &[Message]) -> Vec<Message> {
    let mut out = Vec::with_capacity(context.len() + 1);
    if let Some(i) = instructions.filter(|i| !i.is_empty()) {
        out.push(Message::text("system", i));
    }
    out.extend(context.iter().cloned());
    out
}

/// The `format` object of a Responses `text` field, if any.
pub fn text_format_of(text: Option<&Value>) -> Option<&Value> {
    text.and_then(|t| t.get("format"))
}
