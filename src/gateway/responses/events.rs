//! Building a response and its stream events from generation events, in
//! the order the SDK's stream accumulator checks (`agent-protocols.md`
//! §1.5–1.6): `response.created`, `response.in_progress`, then per output
//! item `output_item.added` → (`content_part.added` → deltas → `*.done` →
//! `content_part.done`) → `output_item.done`, and a terminal
//! `response.completed` / `response.incomplete` / `response.failed`
//! carrying the whole response. Every event has a `sequence_number`; item
//! ids (`rs_…`, `msg_…`, `fc_…`) and `call_id`s are fixed at
//! `output_item.added` and are the ones the final response and the store hold.

use serde_json::{json, Value};

use super::types::ResponseRequest;
use crate::chat::toolcall::{Message, ToolCall};
use crate::gateway::error::ApiError;
use crate::gateway::generation::{Finish, GenEvent, GenSummary, LogprobEntry};
use crate::gateway::logprobs::entries_json;
use crate::gateway::{new_id, unix_now};

/// The output item being streamed.
#[derive(Debug, Clone)]
enum Open {
    /// A reasoning item.
    Reasoning {
        /// Item id.
        id: String,
        /// Text so far.
        text: String,
    },
    /// A message item.
    Message {
        /// Item id.
        id: String,
        /// Text so far.
        text: String,
        /// Log-probabilities of its tokens (when asked for).
        logprobs: Vec<LogprobEntry>,
    },
    /// A function call item.
    Call {
        /// Item id.
        id: String,
        /// Call id.
        call_id: String,
        /// Function name.
        name: String,
        /// Arguments so far.
        arguments: String,
        /// The parser's index of the call.
        index: usize,
    },
}

/// Builds one response.
#[derive(Debug)]
pub struct ResponseBuilder {
    /// `resp_…`.
    pub id: String,
    /// Unix seconds.
    created_at: u64,
    /// Next `sequence_number`.
    seq: u64,
    /// Finished output items.
    output: Vec<Value>,
    /// The item being streamed.
    open: Option<Open>,
    /// Request fields echoed in the response.
    echo: Value,
    /// Whether calls past the first are dropped.
    single_call: bool,
    /// Parser indices of the calls that were dropped.
    dropped_calls: Vec<usize>,
    /// Status once known.
    status: &'static str,
    /// Usage once known.
    usage: Value,
    /// `incomplete_details`.
    incomplete: Value,
    /// `error`.
    error: Value,
    /// Answer text, reasoning and calls, for the conversation history.
    history: Message,
    /// Log-probabilities of tokens whose text has not arrived yet.
    pending_logprobs: Vec<LogprobEntry>,
}

impl ResponseBuilder {
    /// A builder for `req`.
    pub fn new(req: &ResponseRequest) -> ResponseBuilder {
        let mut echo = json!({
            "model": req.model,
            "instructions": req.instructions,
            "tools": req.tools,
            "tool_choice": req.tool_choice_raw,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "max_output_tokens": req.sampling.max_tokens,
            "top_logprobs": req.logprobs.unwrap_or(0),
            "background": false,
            "service_tier": "default",
        });
        for (k, v) in &req.echo {
            echo[k] = v.clone();
        }
        if echo["text"].is_null() {
            echo["text"] = json!({"format": {"type": "text"}});
        }
        if echo["truncation"].is_null() {
            echo["truncation"] = json!("disabled");
        }
        if echo["metadata"].is_null() {
            echo["metadata"] = json!({});
        }
        ResponseBuilder {
            id: new_id("resp_"),
            created_at: unix_now(),
            seq: 0,
            output: Vec::new(),
            open: None,
            echo,
            single_call: !req.parallel_tool_calls,
            dropped_calls: Vec::new(),
            status: "in_progress",
            usage: Value::Null,
            incomplete: Value::Null,
            error: Value::Null,
            history: Message::text("assistant", ""),
            pending_logprobs: Vec::new(),
        }
    }

    /// The response object as it stands.
    pub fn response(&self) -> Value {
        let mut r = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "output": self.output,
            "usage": self.usage,
        });
        if self.status != "in_progress" {
            r["completed_at"] = json!(unix_now());
        }
        if let (Some(r), Some(e)) = (r.as_object_mut(), self.echo.as_object()) {
            for (k, v) in e {
                r.insert(k.clone(), v.clone());
            }
        }
        r
    }

    /// The assistant turn this response adds to the conversation.
    pub fn history(&self) -> Message {
        self.history.clone()
    }

    fn event(&mut self, kind: &str, mut body: Value) -> Value {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        body
    }

    /// `response.created` and `response.in_progress`.
    pub fn start(&mut self) -> Vec<Value> {
        let r = self.response();
        let a = self.event("response.created", json!({ "response": r }));
        let b = self.event("response.in_progress", json!({ "response": r }));
        vec![a, b]
    }

    /// Only `response.created` (for `generate: false`).
    pub fn created_only(&mut self) -> Vec<Value> {
        let r = self.response();
        vec![self.event("response.created", json!({ "response": r }))]
    }

    /// Closes the open item.
    fn close(&mut self, out: &mut Vec<Value>) {
        let Some(open) = self.open.take() else { return };
        let index = self.output.len();
        match open {
            Open::Reasoning { id, text } => {
                out.push(self.event(
                    "response.reasoning_text.done",
                    json!({
                    "item_id": id, "output_index": index, "content_index": 0, "text": text}),
                ));
                out.push(self.event(
                    "response.content_part.done",
                    json!({
                    "item_id": id, "output_index": index, "content_index": 0,
                    "part": {"type": "reasoning_text", "text": text}}),
                ));
                let item = json!({"type": "reasoning", "id": id, "summary": [], "status": "completed",
                                  "content": [{"type": "reasoning_text", "text": text}]});
                out.push(self.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                ));
                self.output.push(item);
                self.history.reasoning_content =
                    Some(self.history.reasoning_content.take().unwrap_or_default() + &text);
            }
            Open::Message { id, text, logprobs } => {
                let logprobs = entries_json(&logprobs);
                out.push(self.event("response.output_text.done", json!({
                    "item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": logprobs})));
                let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs});
                out.push(self.event(
                    "response.content_part.done",
                    json!({
                    "item_id": id, "output_index": index, "content_index": 0, "part": part}),
                ));
                let item = json!({"type": "message", "id": id, "status": "completed", "role": "assistant",
                                  "content": [part]});
                out.push(self.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                ));
                self.output.push(item);
                let prev = match self.history.content.take() {
                    Some(crate::chat::toolcall::MessageContent::Text(t)) => t,
                    _ => String::new(),
                };
                self.history.content =
                    Some(crate::chat::toolcall::MessageContent::Text(prev + &text));
            }
            Open::Call {
                id,
                call_id,
                name,
                arguments,
                ..
            } => {
                out.push(self.event(
                    "response.function_call_arguments.done",
                    json!({
                    "item_id": id, "output_index": index, "arguments": arguments, "name": name}),
                ));
                let item = json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
                                  "arguments": arguments, "status": "completed"});
                out.push(self.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                ));
                self.output.push(item);
                self.history
                    .tool_calls
                    .get_or_insert_with(Vec::new)
                    .push(ToolCall::function(&call_id, &name, &arguments));
            }
        }
    }

    /// The events for one generation event (terminal events excluded).
    pub fn on_event(&mut self, ev: GenEvent) -> Vec<Value> {
        let mut out = Vec::new();
        let index = self.output.len();
        // Only answer text carries log-probabilities: tokens that became
        // reasoning or tool calls drop theirs.
        if !matches!(ev, GenEvent::Text(_) | GenEvent::Logprob(_)) {
            self.pending_logprobs.clear();
        }
        match ev {
            GenEvent::Reasoning(t) => {
                if !matches!(self.open, Some(Open::Reasoning { .. })) {
                    self.close(&mut out);
                    let id = new_id("rs_");
                    let index = self.output.len();
                    out.push(self.event("response.output_item.added", json!({"output_index": index,
                        "item": {"type": "reasoning", "id": id, "summary": [], "content": [], "status": "in_progress"}})));
                    out.push(self.event(
                        "response.content_part.added",
                        json!({"item_id": id, "output_index": index,
                        "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}),
                    ));
                    self.open = Some(Open::Reasoning {
                        id,
                        text: String::new(),
                    });
                }
                let index = self.output.len();
                if let Some(Open::Reasoning { id, text }) = &mut self.open {
                    text.push_str(&t);
                    let id = id.clone();
                    out.push(self.event(
                        "response.reasoning_text.delta",
                        json!({"item_id": id,
                        "output_index": index, "content_index": 0, "delta": t}),
                    ));
                }
            }
            GenEvent::Text(t) => {
                if !matches!(self.open, Some(Open::Message { .. })) {
                    if t.trim().is_empty() && matches!(self.open, Some(Open::Call { .. })) {
                        return out;
                    }
                    self.close(&mut out);
                    let id = new_id("msg_");
                    let index = self.output.len();
                    out.push(self.event("response.output_item.added", json!({"output_index": index,
                        "item": {"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []}})));
                    out.push(self.event("response.content_part.added", json!({"item_id": id, "output_index": index,
                        "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})));
                    self.open = Some(Open::Message {
                        id,
                        text: String::new(),
                        logprobs: Vec::new(),
                    });
                }
                let index = self.output.len();
                let fresh = std::mem::take(&mut self.pending_logprobs);
                if let Some(Open::Message { id, text, logprobs }) = &mut self.open {
                    text.push_str(&t);
                    let id = id.clone();
                    let delta_lp = entries_json(&fresh);
                    logprobs.extend(fresh);
                    out.push(self.event(
                        "response.output_text.delta",
                        json!({"item_id": id,
                        "output_index": index, "content_index": 0, "delta": t, "logprobs": delta_lp}),
                    ));
                }
            }
            GenEvent::ToolStart {
                index: call_index,
                id: call_id,
                name,
            } => {
                let calls_so_far = self
                    .output
                    .iter()
                    .filter(|i| i["type"] == "function_call")
                    .count()
                    + usize::from(matches!(self.open, Some(Open::Call { .. })));
                if self.single_call && calls_so_far >= 1 {
                    self.dropped_calls.push(call_index);
                    return out;
                }
                self.close(&mut out);
                let id = new_id("fc_");
                let index = self.output.len();
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": index,
                    "item": {"type": "function_call", "id": id, "call_id": call_id, "name": name,
                             "arguments": "", "status": "in_progress"}}),
                ));
                self.open = Some(Open::Call {
                    id,
                    call_id,
                    name,
                    arguments: String::new(),
                    index: call_index,
                });
            }
            GenEvent::ToolArgs {
                index: call_index,
                delta,
            } => {
                if let Some(Open::Call {
                    id,
                    arguments,
                    index: open_index,
                    ..
                }) = &mut self.open
                {
                    if *open_index == call_index {
                        arguments.push_str(&delta);
                        let id = id.clone();
                        out.push(self.event(
                            "response.function_call_arguments.delta",
                            json!({
                            "item_id": id, "output_index": index, "delta": delta}),
                        ));
                    }
                }
            }
            GenEvent::ToolEnd { index: call_index } => {
                if matches!(&self.open, Some(Open::Call { index, .. }) if *index == call_index) {
                    self.close(&mut out);
                }
            }
            GenEvent::Logprob(e) => self.pending_logprobs.push(e),
            GenEvent::Finished(_) | GenEvent::Failed(_) => {}
        }
        out
    }

    /// Usage of a finished generation.
    pub fn usage_of(s: &GenSummary) -> Value {
        let out = s.output_ids.len();
        json!({
            "input_tokens": s.prompt_tokens,
            "input_tokens_details": {"cached_tokens": s.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": s.prompt_tokens + out,
        })
    }

    /// Closes open items and emits the terminal event for `s`.
    pub fn finish(&mut self, s: &GenSummary) -> Vec<Value> {
        let mut out = Vec::new();
        self.close(&mut out);
        self.usage = Self::usage_of(s);
        let kind = match s.finish {
            Finish::Stop => {
                self.status = "completed";
                "response.completed"
            }
            Finish::Length => {
                self.status = "incomplete";
                self.incomplete = json!({"reason": "max_output_tokens"});
                "response.incomplete"
            }
            Finish::Cancelled => {
                self.status = "cancelled";
                "response.incomplete"
            }
        };
        let r = self.response();
        out.push(self.event(kind, json!({ "response": r })));
        out
    }

    /// Completes with no output (`generate: false`) and `usage`.
    pub fn finish_empty(&mut self, usage: Value) -> Vec<Value> {
        self.status = "completed";
        self.usage = usage;
        let r = self.response();
        vec![self.event("response.completed", json!({ "response": r }))]
    }

    /// Fails after `response.created`: closes open items, `response.failed`.
    pub fn fail(&mut self, e: &ApiError) -> Vec<Value> {
        let mut out = Vec::new();
        self.close(&mut out);
        self.status = "failed";
        self.error = json!({"code": e.code, "message": e.message});
        let r = self.response();
        out.push(self.event("response.failed", json!({ "response": r })));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::params::Sampling;
    use caracal_kernels::sampling::SamplingParams;

    fn request(parallel: bool) -> ResponseRequest {
        ResponseRequest {
            model: "m".into(),
            input_items: Vec::new(),
            messages: Vec::new(),
            instructions: None,
            tools: Vec::new(),
            chat_tools: Vec::new(),
            tool_choice: Default::default(),
            tool_choice_raw: json!("auto"),
            parallel_tool_calls: parallel,
            previous_response_id: None,
            store: false,
            stream: true,
            sampling: Sampling {
                params: SamplingParams::greedy(),
                stop: Vec::new(),
                max_tokens: Some(8),
                ignore_eos: false,
            },
            thinking: true,
            echo: Default::default(),
            cache_key: None,
            stream_id: None,
            generate: true,
            logprobs: None,
        }
    }

    fn summary(finish: Finish) -> GenSummary {
        GenSummary {
            finish,
            prompt_tokens: 10,
            cached_tokens: 8,
            miss_reason: None,
            output_ids: vec![1, 2, 3],
            malformed: Vec::new(),
            media: Vec::new(),
        }
    }

    #[test]
    fn events_follow_the_sdk_order_with_stable_ids() {
        let mut b = ResponseBuilder::new(&request(true));
        let mut evs = b.start();
        for ev in [
            GenEvent::Reasoning("think".into()),
            GenEvent::Text("Hi".into()),
            GenEvent::Text("!".into()),
            GenEvent::ToolStart {
                index: 0,
                id: "call_a".into(),
                name: "f".into(),
            },
            GenEvent::ToolArgs {
                index: 0,
                delta: "{\"x\":".into(),
            },
            GenEvent::ToolArgs {
                index: 0,
                delta: "1}".into(),
            },
            GenEvent::ToolEnd { index: 0 },
        ] {
            evs.extend(b.on_event(ev));
        }
        evs.extend(b.finish(&summary(Finish::Stop)));
        let kinds: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            vec![
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, e) in evs.iter().enumerate() {
            assert_eq!(e["sequence_number"], i as u64);
        }
        let done = evs.last().unwrap();
        let output = done["response"]["output"].as_array().unwrap();
        assert_eq!(output.len(), 3);
        assert_eq!(output[1]["content"][0]["text"], "Hi!");
        assert_eq!(output[2]["call_id"], "call_a");
        assert_eq!(output[2]["arguments"], "{\"x\":1}");
        assert_eq!(output[2]["id"], evs[15]["item"]["id"]);
        assert_eq!(
            done["response"]["usage"]["input_tokens_details"]["cached_tokens"],
            8
        );
        assert_eq!(done["response"]["id"], evs[0]["response"]["id"]);
        let h = b.history();
        assert_eq!(h.reasoning_content.as_deref(), Some("think"));
        assert_eq!(h.tool_calls.unwrap()[0].function.arguments, "{\"x\":1}");
    }

    #[test]
    fn length_is_incomplete_and_single_call_drops_the_rest() {
        let mut b = ResponseBuilder::new(&request(false));
        b.start();
        for i in 0..2 {
            b.on_event(GenEvent::ToolStart {
                index: i,
                id: format!("c{i}"),
                name: "f".into(),
            });
            b.on_event(GenEvent::ToolArgs {
                index: i,
                delta: "{}".into(),
            });
            b.on_event(GenEvent::ToolEnd { index: i });
        }
        let evs = b.finish(&summary(Finish::Length));
        let last = evs.last().unwrap();
        assert_eq!(last["type"], "response.incomplete");
        assert_eq!(
            last["response"]["incomplete_details"]["reason"],
            "max_output_tokens"
        );
        assert_eq!(last["response"]["output"].as_array().unwrap().len(), 1);
    }
}
