//! One Realtime response: `response.create` (and the live stream's cadence
//! questions) parsed into a [`ResponsePlan`], its prompt built — the session's
//! instructions, the live stream's window when it has chunks
//! ([`super::live::Live::context`]), then the conversation items — and streamed
//! by a task of its own up to `response.done`, which the session sends after
//! it has taken the task's [`Outcome`] (so a `response.create` sent on reading
//! it never meets the finished response still marked active).
//!
//! A question over a live stream is submitted without the session's pin: the
//! pin stays on the stream path (the chunks' prefills move it), so an answer
//! never holds an old path in the cache after the window moved on.

use std::sync::Arc;

use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::events::RealtimeResponse;
use super::{RealtimeSession, SessionConfig};
use crate::gateway::error::{ApiError, ApiResult};
use crate::gateway::fields::{as_object, Fields};
use crate::gateway::generation::{self, GenEvent, GenRequest, GenSummary};
use crate::gateway::media;
use crate::gateway::model::{CachedPrefix, Conversation, ToolChoiceSpec};
use crate::gateway::params::{valid_request, Sampling};
use crate::gateway::responses::turn::name_tool_results;
use crate::gateway::responses::types::{items_to_messages, prompt_messages};
use crate::gateway::responses::ws::Outgoing;
use crate::gateway::AppState;
use caracal_kernels::sampling::SamplingParams;

/// What a finished response hands back to the session.
pub(super) struct Outcome {
    /// The response's output items (to append to the conversation).
    pub output: Vec<Value>,
    /// Whether they join the conversation.
    pub in_conversation: bool,
    /// The cached prompt and output, when it finished.
    pub prefix: Option<CachedPrefix>,
    /// Its `response.done`, which the session sends once it has taken the
    /// outcome and cleared the active response, so a client may create the
    /// next response as soon as it reads this one's end.
    pub done: Option<Value>,
}

/// The running response.
pub(super) struct Active {
    /// Its id.
    pub id: String,
    /// Cancel switch.
    pub cancel: watch::Sender<bool>,
    /// The task.
    pub task: JoinHandle<Outcome>,
}

/// A response to start: the session's configuration with its overrides.
pub(super) struct ResponsePlan {
    /// Instructions and tools.
    config: SessionConfig,
    /// `max_output_tokens` as given.
    max_raw: Value,
    /// The output budget (`None`: the context left).
    max: Option<usize>,
    /// Whether the output joins the conversation.
    in_conversation: bool,
    /// The items the prompt holds.
    items: Vec<Value>,
    /// `metadata` as given.
    metadata: Value,
}

impl RealtimeSession {
    /// `response.create`: a plan from the event's `response` object.
    pub(super) fn response_plan(&self, obj: &Map<String, Value>) -> ApiResult<ResponsePlan> {
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
        Ok(ResponsePlan {
            config,
            max_raw,
            max,
            in_conversation,
            items,
            metadata: f.raw("metadata").cloned().unwrap_or(Value::Null),
        })
    }

    /// A cadence question: the conversation and `analysis_prompt` over the stream,
    /// its output kept out of the conversation.
    pub(super) fn cadence_plan(&self) -> ResponsePlan {
        let v = &self.live.settings;
        let mut items = self.items.clone();
        items.push(json!({"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": v.analysis_prompt}]}));
        ResponsePlan {
            config: self.config.clone(),
            max_raw: json!(v.analysis_max_output_tokens),
            max: Some(v.analysis_max_output_tokens),
            in_conversation: false,
            items,
            metadata: json!({"caracal_analysis": "cadence"}),
        }
    }

    /// Builds the prompt of `plan` and starts its response.
    pub(super) async fn start_response(
        &mut self,
        plan: ResponsePlan,
        out: &mpsc::Sender<Outgoing>,
    ) -> ApiResult<()> {
        if self.active.is_some() {
            return Err(ApiError::invalid(
                "conversation_already_has_active_response",
                None,
                "a response is already in progress; cancel it or wait for response.done",
            ));
        }
        let ResponsePlan {
            config,
            max_raw,
            max,
            in_conversation,
            items,
            metadata,
        } = plan;
        let mut context = Vec::new();
        items_to_messages(&items, self.state.model.vision, &mut context)?;
        name_tool_results(&mut context);
        let encoded = media::encode_media(&self.state, &context).await?;
        let stream = self.live.context();
        let mut all = Vec::with_capacity(context.len() + 1);
        all.extend(stream.as_ref().map(|(m, _)| m.clone()));
        all.extend(context);
        let mut conv = Conversation {
            messages: prompt_messages(Some(&config.instructions), &all),
            tools: config.chat_tools.clone(),
            tool_choice: config.tool_choice.clone(),
            thinking: true,
        };
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
        // Over a stream the pin stays on the stream path (see the module docs).
        let session = stream.is_none().then(|| self.id.clone());
        let mut valid = valid_request(&self.state, prompt_ids.clone(), &sampling, session)?;
        let mut media_items = stream.map(|(_, items)| items).unwrap_or_default();
        media_items.extend(encoded.items);
        media::splice(&self.state, &mut valid, &media_items)?;
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
        let resp = RealtimeResponse::new(previous, &self.conversation_id, max_raw, metadata);
        let id = resp.id.clone();
        let task = tokio::spawn(run_response(
            self.state.clone(),
            resp,
            rx,
            out.clone(),
            in_conversation,
            prompt_text,
            prompt_ids,
        ));
        self.active = Some(Active { id, cancel, task });
        Ok(())
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
    let mut done = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Finished(s) => {
                let mut evs = resp.finish(&s);
                done = evs.pop();
                if !send_all(evs).await {
                    done = None;
                }
                summary = Some(s);
                break;
            }
            GenEvent::Failed(e) => {
                let mut evs = resp.fail(e.code, &e.message);
                done = evs.pop();
                if !send_all(evs).await {
                    done = None;
                }
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
        done,
    }
}

pub(super) fn item_not_found(id: &str, param: &str) -> ApiError {
    ApiError::invalid(
        "item_not_found",
        Some(param),
        format!("no conversation item with id `{id}`"),
    )
}

/// An item as the conversation keeps it: audio parts dropped (accepted and ignored).
pub(super) fn clean_item(
    item: &Map<String, Value>,
    _vision: bool,
) -> ApiResult<Map<String, Value>> {
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
pub(super) fn max_tokens(v: &Value, name: &str) -> ApiResult<Option<usize>> {
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
pub(super) fn realtime_tools(f: &Fields<'_>) -> ApiResult<(Vec<Value>, Vec<Value>)> {
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

pub(super) fn tool_choice(v: &Value, chat_tools: &[Value]) -> ApiResult<ToolChoiceSpec> {
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
