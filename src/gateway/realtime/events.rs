//! Realtime server events for one response (`agent-protocols.md` §3.3):
//! `response.created`, per output item `response.output_item.added` +
//! `conversation.item.added`, text parts (`response.content_part.added`
//! with a `"text"` part, `response.output_text.delta/done`,
//! `response.content_part.done`), function calls
//! (`response.function_call_arguments.delta/done` with `call_id`), then
//! `response.output_item.done` + `conversation.item.done`, and
//! `response.done` with usage (`input_token_details.cached_tokens`).

use serde_json::{json, Value};

use crate::gateway::generation::{Finish, GenEvent, GenSummary};
use crate::gateway::new_id;

/// A server event with a fresh `event_id`.
pub fn event(kind: &str, mut body: Value) -> Value {
    body["type"] = json!(kind);
    body["event_id"] = json!(new_id("event_"));
    body
}

/// The item being streamed.
#[derive(Debug)]
enum Open {
    /// An assistant message.
    Text {
        /// Item id.
        id: String,
        /// Text so far.
        text: String,
    },
    /// A function call.
    Call {
        /// Item id.
        id: String,
        /// Call id.
        call_id: String,
        /// Function name.
        name: String,
        /// Arguments so far.
        arguments: String,
        /// The parser's index.
        index: usize,
    },
}

/// Builds the events and the output of one Realtime response.
#[derive(Debug)]
pub struct RealtimeResponse {
    /// `resp_…`.
    pub id: String,
    /// Finished output items.
    pub output: Vec<Value>,
    /// The item being streamed.
    open: Option<Open>,
    /// The item the next output item follows in the conversation.
    pub previous_item_id: Option<String>,
    /// `conversation_id`.
    conversation_id: String,
    /// `max_output_tokens` as given.
    max_output_tokens: Value,
    /// `metadata` as given.
    metadata: Value,
}

impl RealtimeResponse {
    /// A response continuing after `previous_item_id`.
    pub fn new(
        previous_item_id: Option<String>,
        conversation_id: &str,
        max_output_tokens: Value,
        metadata: Value,
    ) -> Self {
        RealtimeResponse {
            id: new_id("resp_"),
            output: Vec::new(),
            open: None,
            previous_item_id,
            conversation_id: conversation_id.to_string(),
            max_output_tokens,
            metadata,
        }
    }

    /// The response object.
    pub fn object(&self, status: &str, details: Value, usage: Value) -> Value {
        json!({
            "id": self.id, "object": "realtime.response", "status": status, "status_details": details,
            "output": self.output, "output_modalities": ["text"], "conversation_id": self.conversation_id,
            "max_output_tokens": self.max_output_tokens, "metadata": self.metadata, "usage": usage,
        })
    }

    /// `response.created`.
    pub fn created(&self) -> Value {
        event(
            "response.created",
            json!({"response": self.object("in_progress", Value::Null, Value::Null)}),
        )
    }

    fn close(&mut self, out: &mut Vec<Value>, status: &str) {
        let Some(open) = self.open.take() else { return };
        let index = self.output.len();
        let item = match open {
            Open::Text { id, text } => {
                out.push(event(
                    "response.output_text.done",
                    json!({"response_id": self.id, "item_id": id,
                    "output_index": index, "content_index": 0, "text": text}),
                ));
                out.push(event("response.content_part.done", json!({"response_id": self.id, "item_id": id,
                    "output_index": index, "content_index": 0, "part": {"type": "text", "text": text}})));
                json!({"id": id, "object": "realtime.item", "type": "message", "role": "assistant", "status": status,
                       "content": [{"type": "output_text", "text": text}]})
            }
            Open::Call {
                id,
                call_id,
                name,
                arguments,
                ..
            } => {
                out.push(event("response.function_call_arguments.done", json!({"response_id": self.id,
                    "item_id": id, "output_index": index, "call_id": call_id, "name": name, "arguments": arguments})));
                json!({"id": id, "object": "realtime.item", "type": "function_call", "status": status,
                       "call_id": call_id, "name": name, "arguments": arguments})
            }
        };
        out.push(event(
            "response.output_item.done",
            json!({"response_id": self.id, "output_index": index, "item": item}),
        ));
        out.push(event(
            "conversation.item.done",
            json!({"item": item, "previous_item_id": self.previous_item_id}),
        ));
        self.previous_item_id = item["id"].as_str().map(String::from);
        self.output.push(item);
    }

    fn open_item(&mut self, out: &mut Vec<Value>, item: Value) {
        let index = self.output.len();
        out.push(event(
            "response.output_item.added",
            json!({"response_id": self.id, "output_index": index, "item": item}),
        ));
        out.push(event(
            "conversation.item.added",
            json!({"item": item, "previous_item_id": self.previous_item_id}),
        ));
    }

    /// The events of one generation event.
    pub fn on_event(&mut self, ev: GenEvent) -> Vec<Value> {
        let mut out = Vec::new();
        let index = self.output.len();
        match ev {
            // Realtime has no reasoning events: the model's reasoning is not
            // shown; it asks for no log-probabilities.
            GenEvent::Reasoning(_) | GenEvent::Logprob(_) => {}
            GenEvent::Text(t) => {
                if !matches!(self.open, Some(Open::Text { .. })) {
                    if t.trim().is_empty() && matches!(self.open, Some(Open::Call { .. })) {
                        return out;
                    }
                    self.close(&mut out, "completed");
                    let id = new_id("item_");
                    self.open_item(
                        &mut out,
                        json!({"id": id, "object": "realtime.item", "type": "message",
                        "role": "assistant", "status": "in_progress", "content": []}),
                    );
                    out.push(event("response.content_part.added", json!({"response_id": self.id, "item_id": id,
                        "output_index": self.output.len(), "content_index": 0, "part": {"type": "text", "text": ""}})));
                    self.open = Some(Open::Text {
                        id,
                        text: String::new(),
                    });
                }
                let index = self.output.len();
                if let Some(Open::Text { id, text }) = &mut self.open {
                    text.push_str(&t);
                    out.push(event(
                        "response.output_text.delta",
                        json!({"response_id": self.id, "item_id": id,
                        "output_index": index, "content_index": 0, "delta": t}),
                    ));
                }
            }
            GenEvent::ToolStart {
                index: call_index,
                id: call_id,
                name,
            } => {
                self.close(&mut out, "completed");
                let id = new_id("item_");
                self.open_item(
                    &mut out,
                    json!({"id": id, "object": "realtime.item", "type": "function_call",
                    "status": "in_progress", "call_id": call_id, "name": name, "arguments": ""}),
                );
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
                    call_id,
                    arguments,
                    index: open,
                    ..
                }) = &mut self.open
                {
                    if *open == call_index {
                        arguments.push_str(&delta);
                        out.push(event("response.function_call_arguments.delta", json!({"response_id": self.id,
                            "item_id": id, "output_index": index, "call_id": call_id, "delta": delta})));
                    }
                }
            }
            GenEvent::ToolEnd { index: call_index } => {
                if matches!(&self.open, Some(Open::Call { index, .. }) if *index == call_index) {
                    self.close(&mut out, "completed");
                }
            }
            GenEvent::Finished(_) | GenEvent::Failed(_) => {}
        }
        out
    }

    /// Usage in the Realtime shape.
    pub fn usage(s: &GenSummary) -> Value {
        let out = s.output_ids.len();
        json!({
            "total_tokens": s.prompt_tokens + out, "input_tokens": s.prompt_tokens, "output_tokens": out,
            "input_token_details": {"cached_tokens": s.cached_tokens,
                "text_tokens": s.prompt_tokens - s.media_tokens(),
                "image_tokens": s.media_tokens(), "audio_tokens": 0,
                "cached_tokens_details": {"text_tokens": s.cached_tokens - s.cached_media_tokens(),
                    "image_tokens": s.cached_media_tokens(), "audio_tokens": 0}},
            "output_token_details": {"text_tokens": out, "audio_tokens": 0},
        })
    }

    /// Closes open items and emits `caracal.cache_report` and `response.done`.
    pub fn finish(&mut self, s: &GenSummary) -> Vec<Value> {
        let mut out = Vec::new();
        let (status, details) = match s.finish {
            Finish::Stop => ("completed", Value::Null),
            Finish::Length => (
                "incomplete",
                json!({"type": "incomplete", "reason": "max_output_tokens"}),
            ),
            Finish::Cancelled => (
                "cancelled",
                json!({"type": "cancelled", "reason": "client_cancelled"}),
            ),
        };
        self.close(
            &mut out,
            if status == "completed" {
                "completed"
            } else {
                "incomplete"
            },
        );
        out.push(event(
            "caracal.cache_report",
            json!({"response_id": self.id, "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "miss_kind": s.miss_reason.map(|m| m.as_str()),
            "miss_reason": s.miss_reason.map(|m| m.to_string()),
            "media": s.media.iter().map(|m| json!({"tokens": m.tokens, "cached": m.cached})).collect::<Vec<_>>()}),
        ));
        out.push(event(
            "response.done",
            json!({"response": self.object(status, details, Self::usage(s))}),
        ));
        out
    }

    /// Closes open items and emits `response.done` with status `failed`.
    pub fn fail(&mut self, code: &str, message: &str) -> Vec<Value> {
        let mut out = Vec::new();
        self.close(&mut out, "incomplete");
        let details = json!({"type": "failed", "error": {"type": "server_error", "code": code, "message": message}});
        out.push(event(
            "response.done",
            json!({"response": self.object("failed", details, Value::Null)}),
        ));
        out
    }
}
