//! Kimi chat formats: prompt rendering and incremental tool-call parsing.
//!
//! Two generations of Kimi use different control tokens:
//!
//! - [`kimi_k2`] (K2, K2.5, Kimi-Linear): `<|im_user|>` / `<|im_assistant|>` /
//!   `<|im_system|>` turns, tool calls in a `<|tool_calls_section_begin|>`
//!   block with JSON arguments, reasoning in `<think>…</think>`.
//! - [`kimi_k3`] / [`kimi_k3_parser`] (K3): "XTML" elements `<|open|>name attrs<|sep|>…<|close|>name<|sep|>`
//!   with `think` / `response` / `tools` channels, one `argument` element
//!   per tool argument, messages ended by `<|end_of_msg|>`.
//!
//! Both take OpenAI-shaped [`Message`]s and tool declarations (the `tools`
//! array of a chat completion request, as `serde_json::Value`s). Rendering
//! reproduces the published Jinja templates byte for byte (see the tests);
//! the stream parsers turn the model's text deltas into [`ParseEvent`]s,
//! for a stream split anywhere — a control marker cut in two is held back
//! until it is complete or proven not to be one.

pub mod hermes;
pub mod kimi_k2;
pub mod kimi_k3;
pub mod kimi_k3_parser;

pub use hermes::{hermes_messages, HermesStreamParser};
pub use kimi_k2::{render_k2, K2StreamParser, K2_DEFAULT_SYSTEM_PROMPT};
pub use kimi_k3::{render_k3, K3Options, ThinkingEffort, ToolChoice};
pub use kimi_k3_parser::K3StreamParser;

use serde::{Deserialize, Serialize};

/// One chat message in the OpenAI shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Text, a list of content parts, or none (an assistant turn with only tool calls).
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// The assistant's reasoning (K3 renders it in the `think` channel of history turns).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool calls made by an assistant turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// For a `tool` message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Optional participant name (K2 uses it as the turn header; for `tool`
    /// messages it names the tool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A message with a role and plain text.
    pub fn text(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: Some(MessageContent::Text(content.into())),
            reasoning_content: None,
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }

    /// An assistant turn with optional text and tool calls.
    pub fn assistant_with_calls(content: Option<&str>, calls: Vec<ToolCall>) -> Message {
        Message {
            content: content.map(|c| MessageContent::Text(c.into())),
            tool_calls: Some(calls),
            ..Message::text("assistant", "")
        }
    }

    /// A tool result answering `tool_call_id`.
    pub fn tool_result(tool_call_id: &str, content: &str) -> Message {
        Message {
            tool_call_id: Some(tool_call_id.into()),
            ..Message::text("tool", content)
        }
    }

    /// The non-empty `name`, if any (templates test `message.get('name')` for truth).
    fn name_if_set(&self) -> Option<&str> {
        self.name.as_deref().filter(|n| !n.is_empty())
    }
}

/// Message content: a string or a list of typed parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Text, image and video parts.
    Parts(Vec<ContentPart>),
}

/// One part of a multi-part message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    /// `text`, `image`, `image_url`, `video_url`, `input_video`, `video`, ...
    ///
    /// `video` is a resolved video: its `text` holds the concatenated chunk
    /// prompts (`{HH:MM:SS.mmm}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>`
    /// per chunk), which the renderers write as they stand. The gateway turns
    /// `video_url` / `input_video` parts into `video` parts before rendering
    /// (see `crate::gateway::media`); renderers write nothing for an
    /// unresolved video part.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part (the chunk prompts of a `video` part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The image reference of an `image_url` part (only its presence matters here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_url: Option<serde_json::Value>,
    /// The video reference of a `video_url` / `input_video` part: `{"url": …,
    /// "fps": …}` (Chat) or a URL string (Responses, Realtime).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub video_url: Option<serde_json::Value>,
    /// Frames per second to sample a video part at (a part-level `fps`;
    /// `video_url.fps` is read too); default 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fps: Option<f64>,
}

/// Whether a part kind is an unresolved video (`video_url`, `input_video`).
pub fn is_video_part(kind: &str) -> bool {
    matches!(kind, "video_url" | "input_video")
}

impl ContentPart {
    /// A text part.
    pub fn text(text: &str) -> ContentPart {
        ContentPart {
            kind: "text".into(),
            text: Some(text.into()),
            image_url: None,
            video_url: None,
            fps: None,
        }
    }

    /// A resolved video: its chunk prompts, written by the renderers as
    /// they stand.
    pub fn video(chunk_prompts: String) -> ContentPart {
        ContentPart {
            kind: "video".into(),
            text: Some(chunk_prompts),
            image_url: None,
            video_url: None,
            fps: None,
        }
    }

    /// A `video_url` part (Chat Completions shape).
    pub fn video_url(url: &str, fps: Option<f64>) -> ContentPart {
        ContentPart {
            kind: "video_url".into(),
            text: None,
            image_url: None,
            video_url: Some(serde_json::json!({ "url": url })),
            fps,
        }
    }

    /// An `image_url` part.
    pub fn image_url(url: &str) -> ContentPart {
        ContentPart {
            kind: "image_url".into(),
            text: None,
            image_url: Some(serde_json::json!({ "url": url })),
            video_url: None,
            fps: None,
        }
    }
}

/// A tool call of an assistant message (OpenAI shape).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Call id, echoed by the tool result's `tool_call_id`.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// Which function and its arguments.
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

impl ToolCall {
    /// A function call with `arguments` as a JSON string.
    pub fn function(id: &str, name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            kind: function_kind(),
            function: FunctionCall {
                name: name.into(),
                arguments: arguments.into(),
            },
        }
    }
}

/// The function of a tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// Function name.
    pub name: String,
    /// Arguments as a JSON string (usually an object).
    pub arguments: String,
}

/// An incremental parser of one model's output format: text deltas in,
/// [`ParseEvent`]s out, as soon as they are certain.
pub trait StreamParser {
    /// Feeds the next piece of output text.
    fn push(&mut self, delta: &str) -> Vec<ParseEvent>;
    /// Ends the output: what is still held back, and unterminated calls.
    fn finish(&mut self) -> Vec<ParseEvent>;
}

/// Feeds `text` to `parser` cut after the given char counts (the rest in one
/// piece) and coalesces the events: how the parsers' tests check that any
/// cut gives the same result.
#[cfg(test)]
pub(crate) fn parse_in_pieces(
    mut parser: impl StreamParser,
    text: &str,
    sizes: impl Iterator<Item = usize>,
) -> Vec<ParseEvent> {
    let chars: Vec<char> = text.chars().collect();
    let mut events = Vec::new();
    let mut at = 0;
    for size in sizes {
        if at >= chars.len() {
            break;
        }
        let end = (at + size.max(1)).min(chars.len());
        events.extend(parser.push(&chars[at..end].iter().collect::<String>()));
        at = end;
    }
    if at < chars.len() {
        events.extend(parser.push(&chars[at..].iter().collect::<String>()));
    }
    events.extend(parser.finish());
    coalesce(events)
}

/// What a stream parser recognised in the model's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseEvent {
    /// Answer text.
    Content(String),
    /// Reasoning text (`<think>` in K2, the `think` channel in K3).
    Reasoning(String),
    /// A tool call begins.
    ToolCallStart {
        /// 0-based position of the call in this output.
        index: usize,
        /// Call id (`functions.{name}:{index}`, Kimi's convention).
        id: String,
        /// Function name.
        name: String,
    },
    /// More of a call's JSON arguments.
    ToolCallArgs {
        /// The call.
        index: usize,
        /// Next piece of the arguments JSON text.
        delta: String,
    },
    /// A tool call is complete.
    ToolCallEnd {
        /// The call.
        index: usize,
    },
    /// The output broke the format: arguments that are not a JSON object,
    /// a stray marker, text where none belongs, a stream cut inside a call.
    Malformed {
        /// The tool call concerned, if any.
        index: Option<usize>,
        /// What was wrong.
        message: String,
    },
}

/// Splits a text stream into plain text and control markers, holding back a
/// trailing piece that may be the start of a marker.
#[derive(Debug, Clone)]
pub(crate) struct MarkerScanner {
    /// The markers to find.
    markers: &'static [&'static str],
    /// Text received but not yet released (a proper prefix of some marker).
    held: String,
}

/// A piece of scanned text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Piece {
    /// Text containing no marker.
    Text(String),
    /// The marker with this index into the scanner's list.
    Marker(usize),
}

impl MarkerScanner {
    /// A scanner for `markers`; none may be a prefix of another.
    pub(crate) fn new(markers: &'static [&'static str]) -> MarkerScanner {
        MarkerScanner {
            markers,
            held: String::new(),
        }
    }

    /// Scans `delta` (after the held text): complete markers and the text
    /// between them; a suffix that could begin a marker is held back.
    pub(crate) fn push(&mut self, delta: &str) -> Vec<Piece> {
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(delta);
        let mut out = Vec::new();
        let mut rest = buf.as_str();
        loop {
            let first = self
                .markers
                .iter()
                .enumerate()
                .filter_map(|(i, m)| rest.find(m).map(|pos| (pos, i)))
                .min_by_key(|&(pos, i)| (pos, std::cmp::Reverse(self.markers[i].len())));
            let Some((pos, i)) = first else { break };
            if pos > 0 {
                out.push(Piece::Text(rest[..pos].to_string()));
            }
            out.push(Piece::Marker(i));
            rest = &rest[pos + self.markers[i].len()..];
        }
        let hold = self.partial_marker_suffix(rest);
        let (text, held) = rest.split_at(rest.len() - hold);
        if !text.is_empty() {
            out.push(Piece::Text(text.to_string()));
        }
        self.held = held.to_string();
        out
    }

    /// Ends the stream: held text is released as text.
    pub(crate) fn finish(&mut self) -> Vec<Piece> {
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            Vec::new()
        } else {
            vec![Piece::Text(held)]
        }
    }

    /// Length of the longest suffix of `s` that is a proper prefix of a marker.
    fn partial_marker_suffix(&self, s: &str) -> usize {
        let longest = self.markers.iter().map(|m| m.len()).max().unwrap_or(0);
        (1..longest.min(s.len() + 1))
            .rev()
            .find(|&k| {
                s.is_char_boundary(s.len() - k)
                    && self
                        .markers
                        .iter()
                        .any(|m| m.len() > k && m.starts_with(&s[s.len() - k..]))
            })
            .unwrap_or(0)
    }
}

/// A JSON string literal for `s` (quotes included), as `json.dumps(s, ensure_ascii=False)`.
pub(crate) fn json_string(s: &str) -> String {
    serde_json::to_string(s).expect("a str always serialises")
}

/// How [`write_json`] lays out JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JsonStyle {
    /// `json.dumps(v, separators=(",", ":"), ensure_ascii=False)`.
    Compact,
    /// `json.dumps(v, ensure_ascii=False)`: `", "` and `": "` separators.
    Python,
}

/// How [`write_json`] orders object keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyOrder {
    /// As stored.
    Stored,
    /// By code point (`sort_keys=True`).
    Sorted,
    /// Case-insensitively, ties by code point (Jinja's `dictsort`).
    SortedIgnoreCase,
}

/// Appends `value` as JSON text with the given layout and key order.
pub(crate) fn write_json(out: &mut String, value: &OrderedJson, style: JsonStyle, order: KeyOrder) {
    let (item_sep, key_sep) = match style {
        JsonStyle::Compact => (",", ":"),
        JsonStyle::Python => (", ", ": "),
    };
    match value {
        OrderedJson::Null => out.push_str("null"),
        OrderedJson::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        OrderedJson::Number(n) => out.push_str(&n.to_string()),
        OrderedJson::String(s) => out.push_str(&json_string(s)),
        OrderedJson::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                write_json(out, item, style, order);
            }
            out.push(']');
        }
        OrderedJson::Object(entries) => {
            let mut entries: Vec<&(String, OrderedJson)> = entries.iter().collect();
            match order {
                KeyOrder::Stored => {}
                KeyOrder::Sorted => entries.sort_by(|a, b| a.0.cmp(&b.0)),
                KeyOrder::SortedIgnoreCase => entries.sort_by(|a, b| {
                    a.0.to_lowercase()
                        .cmp(&b.0.to_lowercase())
                        .then(a.0.cmp(&b.0))
                }),
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                out.push_str(&json_string(key));
                out.push_str(key_sep);
                write_json(out, item, style, order);
            }
            out.push('}');
        }
    }
}

/// A JSON value whose objects keep their key order (as Python's `json.loads`
/// does), independent of `serde_json`'s `preserve_order` feature.
#[derive(Debug, Clone, PartialEq)]
pub enum OrderedJson {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// A number.
    Number(serde_json::Number),
    /// A string.
    String(String),
    /// An array.
    Array(Vec<OrderedJson>),
    /// An object, keys in document order.
    Object(Vec<(String, OrderedJson)>),
}

impl OrderedJson {
    /// Parses JSON text.
    pub fn parse(text: &str) -> serde_json::Result<OrderedJson> {
        serde_json::from_str(text)
    }

    /// The name XTML gives this value's type (`string`, `number`, `boolean`,
    /// `null`, `object`, `array`).
    pub fn xtml_type(&self) -> &'static str {
        match self {
            OrderedJson::Null => "null",
            OrderedJson::Bool(_) => "boolean",
            OrderedJson::Number(_) => "number",
            OrderedJson::String(_) => "string",
            OrderedJson::Array(_) => "array",
            OrderedJson::Object(_) => "object",
        }
    }
}

impl From<&serde_json::Value> for OrderedJson {
    fn from(v: &serde_json::Value) -> OrderedJson {
        match v {
            serde_json::Value::Null => OrderedJson::Null,
            serde_json::Value::Bool(b) => OrderedJson::Bool(*b),
            serde_json::Value::Number(n) => OrderedJson::Number(n.clone()),
            serde_json::Value::String(s) => OrderedJson::String(s.clone()),
            serde_json::Value::Array(a) => {
                OrderedJson::Array(a.iter().map(OrderedJson::from).collect())
            }
            serde_json::Value::Object(o) => OrderedJson::Object(
                o.iter()
                    .map(|(k, v)| (k.clone(), OrderedJson::from(v)))
                    .collect(),
            ),
        }
    }
}

impl<'de> Deserialize<'de> for OrderedJson {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<OrderedJson, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = OrderedJson;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_unit<E>(self) -> Result<OrderedJson, E> {
                Ok(OrderedJson::Null)
            }
            fn visit_none<E>(self) -> Result<OrderedJson, E> {
                Ok(OrderedJson::Null)
            }
            fn visit_bool<E>(self, b: bool) -> Result<OrderedJson, E> {
                Ok(OrderedJson::Bool(b))
            }
            fn visit_i64<E>(self, n: i64) -> Result<OrderedJson, E> {
                Ok(OrderedJson::Number(n.into()))
            }
            fn visit_u64<E>(self, n: u64) -> Result<OrderedJson, E> {
                Ok(OrderedJson::Number(n.into()))
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<OrderedJson, E> {
                serde_json::Number::from_f64(n)
                    .map(OrderedJson::Number)
                    .ok_or_else(|| E::custom("non-finite number"))
            }
            fn visit_str<E>(self, s: &str) -> Result<OrderedJson, E> {
                Ok(OrderedJson::String(s.to_string()))
            }
            fn visit_string<E>(self, s: String) -> Result<OrderedJson, E> {
                Ok(OrderedJson::String(s))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<OrderedJson, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(OrderedJson::Array(items))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<OrderedJson, A::Error> {
                let mut entries: Vec<(String, OrderedJson)> = Vec::new();
                while let Some((key, value)) = map.next_entry::<String, OrderedJson>()? {
                    // A repeated key keeps its first position and its last value, as a Python dict does.
                    match entries.iter_mut().find(|(k, _)| *k == key) {
                        Some(slot) => slot.1 = value,
                        None => entries.push((key, value)),
                    }
                }
                Ok(OrderedJson::Object(entries))
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl Serialize for OrderedJson {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        match self {
            OrderedJson::Null => s.serialize_unit(),
            OrderedJson::Bool(b) => s.serialize_bool(*b),
            OrderedJson::Number(n) => n.serialize(s),
            OrderedJson::String(v) => s.serialize_str(v),
            OrderedJson::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            OrderedJson::Object(entries) => {
                let mut map = s.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

/// Coalesces adjacent deltas of the same kind (and call), so that event
/// lists from differently split streams can be compared.
pub fn coalesce(events: Vec<ParseEvent>) -> Vec<ParseEvent> {
    let mut out: Vec<ParseEvent> = Vec::with_capacity(events.len());
    for ev in events {
        match (out.last_mut(), ev) {
            (Some(ParseEvent::Content(a)), ParseEvent::Content(b)) => a.push_str(&b),
            (Some(ParseEvent::Reasoning(a)), ParseEvent::Reasoning(b)) => a.push_str(&b),
            (
                Some(ParseEvent::ToolCallArgs { index: i, delta: a }),
                ParseEvent::ToolCallArgs { index: j, delta: b },
            ) if *i == j => a.push_str(&b),
            (_, ev) => out.push(ev),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MARKERS: &[&str] = &["<|a|>", "<|bb|>", "<t>"];

    fn scan_all(chunks: &[&str]) -> Vec<Piece> {
        let mut s = MarkerScanner::new(MARKERS);
        let mut out: Vec<Piece> = chunks.iter().flat_map(|c| s.push(c)).collect();
        out.extend(s.finish());
        // Merge adjacent text pieces.
        let mut merged: Vec<Piece> = Vec::new();
        for p in out {
            match (merged.last_mut(), p) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, p) => merged.push(p),
            }
        }
        merged
    }

    #[test]
    fn scanner_finds_markers_split_anywhere() {
        let text = "x<|a|>y <|b <t>z<|bb|>é<|";
        let want = vec![
            Piece::Text("x".into()),
            Piece::Marker(0),
            Piece::Text("y <|b ".into()),
            Piece::Marker(2),
            Piece::Text("z".into()),
            Piece::Marker(1),
            Piece::Text("é<|".into()),
        ];
        assert_eq!(scan_all(&[text]), want);
        for cut in 0..=text.len() {
            if text.is_char_boundary(cut) {
                assert_eq!(
                    scan_all(&[&text[..cut], &text[cut..]]),
                    want,
                    "cut at {cut}"
                );
            }
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        assert_eq!(
            scan_all(&chars.iter().map(String::as_str).collect::<Vec<_>>()),
            want
        );
    }

    #[test]
    fn scanner_holds_only_marker_prefixes() {
        let mut s = MarkerScanner::new(MARKERS);
        assert_eq!(s.push("ab<|"), vec![Piece::Text("ab".into())]);
        assert_eq!(s.push("c"), vec![Piece::Text("<|c".into())]);
        assert_eq!(s.push("<t"), vec![]);
        assert_eq!(s.finish(), vec![Piece::Text("<t".into())]);
    }

    #[test]
    fn ordered_json_keeps_key_order_and_dumps_like_python() {
        let v =
            OrderedJson::parse(r#"{"b": [1, 2.5, "x\n"], "a": {"z": null, "Y": true}, "é": -3}"#)
                .unwrap();
        let mut compact = String::new();
        write_json(&mut compact, &v, JsonStyle::Compact, KeyOrder::Stored);
        assert_eq!(
            compact,
            r#"{"b":[1,2.5,"x\n"],"a":{"z":null,"Y":true},"é":-3}"#
        );
        let mut python = String::new();
        write_json(&mut python, &v, JsonStyle::Python, KeyOrder::Stored);
        assert_eq!(
            python,
            r#"{"b": [1, 2.5, "x\n"], "a": {"z": null, "Y": true}, "é": -3}"#
        );
        let mut sorted = String::new();
        write_json(&mut sorted, &v, JsonStyle::Compact, KeyOrder::Sorted);
        assert_eq!(
            sorted,
            r#"{"a":{"Y":true,"z":null},"b":[1,2.5,"x\n"],"é":-3}"#
        );
        let mut dictsort = String::new();
        let w = OrderedJson::parse(r#"{"b": 1, "B": 2, "a": 3, "Z": 4}"#).unwrap();
        write_json(
            &mut dictsort,
            &w,
            JsonStyle::Compact,
            KeyOrder::SortedIgnoreCase,
        );
        assert_eq!(dictsort, r#"{"a":3,"B":2,"b":1,"Z":4}"#);
        assert_eq!(v.xtml_type(), "object");
    }

    #[test]
    fn coalesce_merges_only_same_kind_neighbours() {
        let evs = vec![
            ParseEvent::Content("a".into()),
            ParseEvent::Content("b".into()),
            ParseEvent::Reasoning("c".into()),
            ParseEvent::ToolCallArgs {
                index: 0,
                delta: "{".into(),
            },
            ParseEvent::ToolCallArgs {
                index: 0,
                delta: "}".into(),
            },
            ParseEvent::ToolCallArgs {
                index: 1,
                delta: "{".into(),
            },
        ];
        assert_eq!(
            coalesce(evs),
            vec![
                ParseEvent::Content("ab".into()),
                ParseEvent::Reasoning("c".into()),
                ParseEvent::ToolCallArgs {
                    index: 0,
                    delta: "{}".into()
                },
                ParseEvent::ToolCallArgs {
                    index: 1,
                    delta: "{".into()
                },
            ]
        );
    }
}
