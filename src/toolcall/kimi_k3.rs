//! Kimi K3 chat format ("XTML"): rendering and output parsing.
//!
//! K3 marks structure with three control tokens: an element is
//! `<|open|>name key="value" …<|sep|>body<|close|>name<|sep|>` (attribute
//! values escape `&` and `"` as `&amp;` / `&quot;`), and every message ends
//! with `<|end_of_msg|>`. Rendering follows the published `Kimi-K3.jinja`
//! (llama.cpp's port of the Python `encoding_k3.py`); where it differs from
//! our reference notes, the template wins:
//!
//! - tools are declared first, in a `role="system" type="tool-declare"`
//!   message: `# Tools` header and a ```` ```json ```` block with the tools as
//!   compact JSON, keys sorted case-insensitively at every level (Jinja's
//!   `dictsort`);
//! - with thinking on (the default), a `type="thinking-effort"` system
//!   message follows, and every assistant turn in history has a `think`
//!   channel holding its `reasoning_content` (empty if none) — reasoning is
//!   not stripped;
//! - tool calls: `<|open|>tools<|sep|>` with one `call tool="NAME" index="i"`
//!   (1-based) per call; object arguments become one `argument key="k"
//!   type="t"` element each (strings raw, other values as Python
//!   `json.dumps`), a JSON-string argument that is not expanded becomes one
//!   `json type="object"` element;
//! - tool results are `role="tool" tool="NAME" index="i"` messages, put in
//!   the order of the calls when every result's `tool_call_id` matches one;
//! - `tool_choice` `required` / `none` add a `type="tool-choice"` system message.
//!
//! Not rendered: image prompt substitution (images become
//! `<|kimi_image_placeholder|>`), `response_format`, system messages carrying
//! dynamic `tools`.
//!
//! [`K3StreamParser`] parses the model's output after the generation prompt
//! (`<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`).

use super::{coalesce, json_string, write_json, JsonStyle, KeyOrder, MarkerScanner, Message, MessageContent, OrderedJson, ParseEvent, Piece};
use crate::error::{Error, Result};

/// How much the model should think (the `thinking_effort` system message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThinkingEffort {
    /// `low`.
    Low,
    /// `high`.
    High,
    /// `max` (the template's default).
    Max,
}

impl ThinkingEffort {
    /// The template's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ThinkingEffort::Low => "low",
            ThinkingEffort::High => "high",
            ThinkingEffort::Max => "max",
        }
    }
}

/// The request's `tool_choice`, as far as the prompt is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// No instruction (`auto` or unset).
    #[default]
    Auto,
    /// The next message must call tools.
    Required,
    /// The next message must not call tools.
    None,
}

/// K3 rendering switches (the template's extra variables).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct K3Options {
    /// Thinking mode: assistant turns carry a `think` channel and generation
    /// starts in it. Default true (K3 always thinks).
    pub thinking: bool,
    /// The effort announced when thinking; `None` announces nothing. Default `Max`.
    pub thinking_effort: Option<ThinkingEffort>,
    /// Adds the `tool_choice` system message for `Required` / `None`.
    pub tool_choice: ToolChoice,
    /// Renders a JSON-object `arguments` string as `argument` elements (what
    /// the model emits, and what servers that `json.loads` the arguments
    /// before templating produce); false keeps it as one `json` element, as
    /// the template does for a string. Default true.
    pub expand_json_arguments: bool,
}

impl Default for K3Options {
    fn default() -> Self {
        K3Options { thinking: true, thinking_effort: Some(ThinkingEffort::Max), tool_choice: ToolChoice::Auto, expand_json_arguments: true }
    }
}

/// Escapes an attribute value (`&` then `"`).
fn escape_attr(v: &str) -> String {
    v.replace('&', "&amp;").replace('"', "&quot;")
}

/// Reverses [`escape_attr`].
fn unescape_attr(v: &str) -> String {
    v.replace("&quot;", "\"").replace("&amp;", "&")
}

fn open_tag(out: &mut String, tag: &str, attrs: &[(&str, &str)]) {
    out.push_str("<|open|>");
    out.push_str(tag);
    for (k, v) in attrs {
        out.push(' ');
        out.push_str(k);
        out.push_str("=\"");
        out.push_str(&escape_attr(v));
        out.push('"');
    }
    out.push_str("<|sep|>");
}

fn close_tag(out: &mut String, tag: &str) {
    out.push_str("<|close|>");
    out.push_str(tag);
    out.push_str("<|sep|>");
}

fn render_content(out: &mut String, content: &Option<MessageContent>) {
    match content {
        None => {}
        Some(MessageContent::Text(t)) => out.push_str(t),
        Some(MessageContent::Parts(parts)) => {
            for part in parts {
                if part.kind == "image" || part.kind == "image_url" {
                    out.push_str("<|kimi_image_placeholder|>");
                } else {
                    out.push_str(part.text.as_deref().unwrap_or(""));
                }
            }
        }
    }
}

fn internal_system_message(out: &mut String, kind: &str, body: &str) {
    open_tag(out, "message", &[("role", "system"), ("type", kind)]);
    out.push_str(body.trim());
    close_tag(out, "message");
    out.push_str("<|end_of_msg|>");
}

/// A user or system message: `role` and optional `name` attributes, the content.
fn plain_message(out: &mut String, message: &Message) {
    let mut attrs = vec![("role", message.role.as_str())];
    if let Some(name) = message.name_if_set() {
        attrs.push(("name", name));
    }
    open_tag(out, "message", &attrs);
    render_content(out, &message.content);
    close_tag(out, "message");
    out.push_str("<|end_of_msg|>");
}

fn render_assistant(out: &mut String, message: &Message, options: &K3Options) {
    if options.thinking {
        open_tag(out, "think", &[]);
        if let Some(reasoning) = message.reasoning_content.as_deref().filter(|r| !r.trim().is_empty()) {
            out.push_str(reasoning);
        }
        close_tag(out, "think");
    }
    open_tag(out, "response", &[]);
    render_content(out, &message.content);
    close_tag(out, "response");
    let calls = message.tool_calls.as_deref().unwrap_or(&[]);
    if calls.is_empty() {
        return;
    }
    open_tag(out, "tools", &[]);
    for (i, call) in calls.iter().enumerate() {
        open_tag(out, "call", &[("tool", &call.function.name), ("index", &(i + 1).to_string())]);
        let args = &call.function.arguments;
        let expanded = if options.expand_json_arguments { OrderedJson::parse(args).ok() } else { None };
        match expanded {
            Some(OrderedJson::Object(entries)) => {
                for (key, value) in &entries {
                    open_tag(out, "argument", &[("key", key), ("type", value.xtml_type())]);
                    match value {
                        OrderedJson::String(s) => out.push_str(s),
                        other => write_json(out, other, JsonStyle::Python, KeyOrder::Stored),
                    }
                    close_tag(out, "argument");
                }
            }
            _ if !args.trim().is_empty() => {
                open_tag(out, "json", &[("type", "object")]);
                out.push_str(args);
                close_tag(out, "json");
            }
            _ => {}
        }
        close_tag(out, "call");
    }
    close_tag(out, "tools");
}

/// Tool-result state carried across messages, as the template's `state` namespace.
struct ToolState<'a> {
    /// Calls of the latest assistant message (`None` if it had no `tool_calls` field).
    calls: Option<&'a [super::ToolCall]>,
    /// Tool results rendered since that message.
    index: usize,
}

fn render_tool_message(out: &mut String, message: &Message, state: &mut ToolState, resolved_name: Option<&str>) -> Result<()> {
    state.index += 1;
    let fallback = || state.calls.and_then(|c| c.get(state.index - 1)).map(|c| c.function.name.as_str());
    let name = resolved_name.or(message.name.as_deref()).or_else(fallback).ok_or_else(|| {
        Error::Template(format!(
            "Kimi K3 tool message {} needs a resolvable tool name: give it `name`, or match a preceding assistant tool_call",
            state.index
        ))
    })?;
    let index = state.index.to_string();
    open_tag(out, "message", &[("role", "tool"), ("tool", name), ("index", &index)]);
    render_content(out, &message.content);
    close_tag(out, "message");
    out.push_str("<|end_of_msg|>");
    Ok(())
}

/// Renders the run of consecutive tool messages starting at `messages[0]`.
fn render_tool_run(out: &mut String, messages: &[Message], state: &mut ToolState) -> Result<()> {
    let run: Vec<&Message> = messages.iter().take_while(|m| m.role == "tool").collect();
    let calls = state.calls.unwrap_or(&[]);
    let matches = |m: &Message, id: &str| m.tool_call_id.as_deref() == Some(id);
    let resolved = run.iter().filter(|m| calls.iter().any(|c| matches(m, &c.id))).count();
    if !run.is_empty() && resolved == run.len() {
        let mut emitted: Vec<&str> = Vec::new();
        for call in calls {
            if emitted.contains(&call.id.as_str()) {
                continue;
            }
            emitted.push(&call.id);
            for m in run.iter().filter(|m| matches(m, &call.id)) {
                render_tool_message(out, m, state, Some(&call.function.name))?;
            }
        }
    } else {
        for m in run {
            render_tool_message(out, m, state, None)?;
        }
    }
    Ok(())
}

/// Renders a K3 prompt: tool declarations (OpenAI `tools` entries), the
/// thinking-effort note, the messages, the tool-choice note and, if
/// `add_generation_prompt`, the assistant header opening `think` (or
/// `response` without thinking).
pub fn render_k3(messages: &[Message], tools: Option<&[serde_json::Value]>, add_generation_prompt: bool, options: &K3Options) -> Result<String> {
    let mut out = String::new();
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        open_tag(&mut out, "message", &[("role", "system"), ("type", "tool-declare")]);
        out.push_str("# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n");
        let list = OrderedJson::Array(tools.iter().map(OrderedJson::from).collect());
        write_json(&mut out, &list, JsonStyle::Compact, KeyOrder::SortedIgnoreCase);
        out.push_str("\n```");
        close_tag(&mut out, "message");
        out.push_str("<|end_of_msg|>");
    }
    if let (true, Some(effort)) = (options.thinking, options.thinking_effort) {
        let body = format!(
            "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), \
supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={}`.",
            effort.as_str()
        );
        internal_system_message(&mut out, "thinking-effort", &body);
    }
    let mut state = ToolState { calls: None, index: 0 };
    for (i, message) in messages.iter().enumerate() {
        match message.role.as_str() {
            "user" | "system" => plain_message(&mut out, message),
            "assistant" => {
                state = ToolState { calls: message.tool_calls.as_deref(), index: 0 };
                let mut attrs = vec![("role", "assistant")];
                if let Some(name) = message.name_if_set() {
                    attrs.push(("name", name));
                }
                open_tag(&mut out, "message", &attrs);
                render_assistant(&mut out, message, options);
                close_tag(&mut out, "message");
                out.push_str("<|end_of_msg|>");
            }
            "tool" if i == 0 || messages[i - 1].role != "tool" => render_tool_run(&mut out, &messages[i..], &mut state)?,
            _ => {}
        }
    }
    match options.tool_choice {
        ToolChoice::Auto => {}
        ToolChoice::Required => internal_system_message(
            &mut out,
            "tool-choice",
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
        ),
        ToolChoice::None => internal_system_message(
            &mut out,
            "tool-choice",
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
        ),
    }
    if add_generation_prompt {
        open_tag(&mut out, "message", &[("role", "assistant")]);
        open_tag(&mut out, if options.thinking { "think" } else { "response" }, &[]);
    }
    Ok(out)
}

/// The markers [`K3StreamParser`] recognises.
const K3_MARKERS: &[&str] = &["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"];
const OPEN: usize = 0;
const CLOSE: usize = 1;
const SEP: usize = 2;
const END_OF_MSG: usize = 3;

/// An open XTML element.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Elem {
    /// `message`.
    Message,
    /// `think`: text is reasoning.
    Think,
    /// `response`: text is content.
    Response,
    /// `tools`.
    Tools,
    /// `call`.
    Call,
    /// `argument`: `string` values stream as a JSON string, others are
    /// buffered in `value` and checked at the close.
    Argument {
        /// `type="string"`.
        string: bool,
        /// The JSON text `"key":` (with a leading `{` or `,`), emitted at the
        /// open for strings and at the close otherwise.
        prefix: String,
        /// Buffered non-string value.
        value: String,
        /// The declared type, for messages.
        ty: String,
    },
    /// `json`: the arguments as one JSON object, streamed raw.
    Json,
    /// Any other element; its text goes where its parent's would.
    Other(String),
}

impl Elem {
    fn name(&self) -> &str {
        match self {
            Elem::Message => "message",
            Elem::Think => "think",
            Elem::Response => "response",
            Elem::Tools => "tools",
            Elem::Call => "call",
            Elem::Argument { .. } => "argument",
            Elem::Json => "json",
            Elem::Other(n) => n,
        }
    }
}

/// The tool call being parsed.
#[derive(Debug, Clone)]
struct OpenCall {
    /// Its index in the output.
    index: usize,
    /// Whether `{` was emitted (an argument was seen).
    brace: bool,
    /// Text of a `json` element, if the call has one.
    json: Option<String>,
}

/// Where the scanner's text goes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    /// Element bodies.
    Body,
    /// Inside `<|open|>…<|sep|>` (`true`) or `<|close|>…<|sep|>` (`false`).
    Header(bool, String),
    /// After `<|end_of_msg|>`.
    Done,
}

/// Incremental parser of K3 output text.
#[derive(Debug, Clone)]
pub struct K3StreamParser {
    /// Finds markers across deltas.
    scanner: MarkerScanner,
    /// Open elements, outermost first.
    stack: Vec<Elem>,
    /// Body text or tag header.
    mode: Mode,
    /// Text between elements, judged at the next marker (blank → dropped).
    between: String,
    /// The tool call being parsed.
    call: Option<OpenCall>,
    /// Index the next tool call gets.
    next_index: usize,
}

impl K3StreamParser {
    /// A parser positioned after the generation prompt: inside the
    /// assistant message, in `think` if `thinking`, else in `response`.
    pub fn new(thinking: bool) -> K3StreamParser {
        K3StreamParser {
            scanner: MarkerScanner::new(K3_MARKERS),
            stack: vec![Elem::Message, if thinking { Elem::Think } else { Elem::Response }],
            mode: Mode::Body,
            between: String::new(),
            call: None,
            next_index: 0,
        }
    }

    /// Feeds the next text delta; returns the events it completes.
    pub fn push(&mut self, delta: &str) -> Vec<ParseEvent> {
        let mut events = Vec::new();
        for piece in self.scanner.push(delta) {
            self.on_piece(piece, &mut events);
        }
        coalesce(events)
    }

    /// Ends the stream: held-back text is released, an unfinished header or
    /// call is reported as [`ParseEvent::Malformed`] and the call closed.
    pub fn finish(&mut self) -> Vec<ParseEvent> {
        let mut events = Vec::new();
        for piece in self.scanner.finish() {
            self.on_piece(piece, &mut events);
        }
        if let Mode::Header(_, header) = &self.mode {
            events.push(ParseEvent::Malformed { index: self.call.as_ref().map(|c| c.index), message: format!("stream ended inside tag {}", json_string(header)) });
        }
        self.flush_between(&mut events);
        self.close_all(&mut events, "stream ended");
        self.mode = Mode::Done;
        coalesce(events)
    }

    fn on_piece(&mut self, piece: Piece, events: &mut Vec<ParseEvent>) {
        let mode = std::mem::replace(&mut self.mode, Mode::Done);
        self.mode = match (mode, piece) {
            (Mode::Done, _) => Mode::Done,
            (Mode::Body, Piece::Text(text)) => {
                self.on_text(text, events);
                Mode::Body
            }
            (Mode::Header(open, mut header), Piece::Text(text)) => {
                header.push_str(&text);
                Mode::Header(open, header)
            }
            (Mode::Header(open, header), Piece::Marker(SEP)) => {
                if open {
                    self.open_element(&header, events);
                } else {
                    self.close_element(header.trim(), events);
                }
                Mode::Body
            }
            (Mode::Header(_, header), Piece::Marker(m)) => {
                events.push(ParseEvent::Malformed { index: self.call.as_ref().map(|c| c.index), message: format!("tag {} has no <|sep|>", json_string(&header)) });
                self.on_body_marker(m, events)
            }
            (Mode::Body, Piece::Marker(m)) => {
                self.flush_between(events);
                self.on_body_marker(m, events)
            }
        };
    }

    fn on_body_marker(&mut self, marker: usize, events: &mut Vec<ParseEvent>) -> Mode {
        match marker {
            OPEN => Mode::Header(true, String::new()),
            CLOSE => Mode::Header(false, String::new()),
            END_OF_MSG => {
                self.close_all(events, "message ended");
                Mode::Done
            }
            _ => {
                events.push(ParseEvent::Malformed { index: self.call.as_ref().map(|c| c.index), message: "stray <|sep|>".into() });
                Mode::Body
            }
        }
    }

    fn on_text(&mut self, text: String, events: &mut Vec<ParseEvent>) {
        let index = self.call.as_ref().map(|c| c.index);
        for elem in self.stack.iter_mut().rev() {
            match elem {
                Elem::Think => return events.push(ParseEvent::Reasoning(text)),
                Elem::Response => return events.push(ParseEvent::Content(text)),
                Elem::Argument { string: true, .. } => {
                    let quoted = json_string(&text);
                    let delta = quoted[1..quoted.len() - 1].to_string();
                    if let Some(index) = index {
                        events.push(ParseEvent::ToolCallArgs { index, delta });
                    }
                    return;
                }
                Elem::Argument { value, .. } => return value.push_str(&text),
                Elem::Json => {
                    if let Some(call) = self.call.as_mut() {
                        call.json.get_or_insert_with(String::new).push_str(&text);
                        events.push(ParseEvent::ToolCallArgs { index: call.index, delta: text });
                    }
                    return;
                }
                Elem::Other(_) => continue,
                Elem::Message | Elem::Tools | Elem::Call => break,
            }
        }
        self.between.push_str(&text);
    }

    /// Reports text found between elements: content at message level, an
    /// error inside `tools`; blank text is dropped.
    fn flush_between(&mut self, events: &mut Vec<ParseEvent>) {
        let text = std::mem::take(&mut self.between);
        if text.trim().is_empty() {
            return;
        }
        if self.stack.iter().any(|e| matches!(e, Elem::Tools | Elem::Call)) {
            events.push(ParseEvent::Malformed { index: self.call.as_ref().map(|c| c.index), message: format!("text inside tools: {}", json_string(&text)) });
        } else {
            events.push(ParseEvent::Content(text));
        }
    }

    fn open_element(&mut self, header: &str, events: &mut Vec<ParseEvent>) {
        let (name, attrs) = parse_header(header);
        let attr = |key: &str| attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        let elem = match name.as_str() {
            "message" => Elem::Message,
            "think" => Elem::Think,
            "response" => Elem::Response,
            "tools" => Elem::Tools,
            "call" => {
                self.close_open_call(events, "a new call began");
                let name = attr("tool").unwrap_or_default();
                let index = self.next_index;
                self.next_index += 1;
                if name.is_empty() {
                    events.push(ParseEvent::Malformed { index: Some(index), message: format!("tool call {index} has no tool name") });
                }
                events.push(ParseEvent::ToolCallStart { index, id: format!("functions.{name}:{index}"), name });
                self.call = Some(OpenCall { index, brace: false, json: None });
                Elem::Call
            }
            "argument" => match self.call.as_mut() {
                Some(call) => {
                    let key = attr("key").unwrap_or_default();
                    let ty = attr("type").unwrap_or_else(|| "string".into());
                    let prefix = format!("{}{}:", if call.brace { "," } else { "{" }, json_string(&key));
                    call.brace = true;
                    let string = ty == "string";
                    if string {
                        events.push(ParseEvent::ToolCallArgs { index: call.index, delta: format!("{prefix}\"") });
                    }
                    Elem::Argument { string, prefix, value: String::new(), ty }
                }
                None => {
                    events.push(ParseEvent::Malformed { index: None, message: "argument outside a tool call".into() });
                    Elem::Other(name)
                }
            },
            "json" => match self.call.as_mut() {
                Some(call) => {
                    if call.brace || call.json.is_some() {
                        events.push(ParseEvent::Malformed { index: Some(call.index), message: format!("tool call {} mixes json and argument elements", call.index) });
                    }
                    call.json.get_or_insert_with(String::new);
                    Elem::Json
                }
                None => {
                    events.push(ParseEvent::Malformed { index: None, message: "json outside a tool call".into() });
                    Elem::Other(name)
                }
            },
            _ => Elem::Other(name),
        };
        self.stack.push(elem);
    }

    fn close_element(&mut self, name: &str, events: &mut Vec<ParseEvent>) {
        let Some(pos) = self.stack.iter().rposition(|e| e.name() == name) else {
            events.push(ParseEvent::Malformed { index: self.call.as_ref().map(|c| c.index), message: format!("close of `{name}`, which is not open") });
            return;
        };
        while self.stack.len() > pos {
            let elem = self.stack.pop().expect("stack is longer than pos");
            if self.stack.len() > pos {
                events.push(ParseEvent::Malformed { index: self.call.as_ref().map(|c| c.index), message: format!("`{}` closed by the close of `{name}`", elem.name()) });
            }
            self.on_closed(elem, events);
        }
    }

    fn on_closed(&mut self, elem: Elem, events: &mut Vec<ParseEvent>) {
        match elem {
            Elem::Argument { string, prefix, value, ty } => {
                let Some(index) = self.call.as_ref().map(|c| c.index) else { return };
                if string {
                    events.push(ParseEvent::ToolCallArgs { index, delta: "\"".into() });
                } else if serde_json::from_str::<serde_json::Value>(&value).is_ok() {
                    events.push(ParseEvent::ToolCallArgs { index, delta: format!("{prefix}{}", value.trim()) });
                } else {
                    events.push(ParseEvent::Malformed { index: Some(index), message: format!("argument {prefix} of type {ty} is not valid JSON; passed as a string") });
                    events.push(ParseEvent::ToolCallArgs { index, delta: format!("{prefix}{}", json_string(&value)) });
                }
            }
            Elem::Call => self.close_open_call(events, ""),
            _ => {}
        }
    }

    /// Ends the open call (if any); a non-empty `why` reports it as cut short.
    fn close_open_call(&mut self, events: &mut Vec<ParseEvent>, why: &str) {
        let Some(call) = self.call.take() else { return };
        let index = call.index;
        if !why.is_empty() {
            events.push(ParseEvent::Malformed { index: Some(index), message: format!("tool call {index} not closed: {why}") });
        }
        match call.json {
            Some(json) => {
                if json.trim().is_empty() {
                    events.push(ParseEvent::ToolCallArgs { index, delta: "{}".into() });
                } else if !matches!(serde_json::from_str::<serde_json::Value>(&json), Ok(serde_json::Value::Object(_))) {
                    events.push(ParseEvent::Malformed { index: Some(index), message: format!("json arguments of tool call {index} are not a JSON object") });
                }
            }
            None => events.push(ParseEvent::ToolCallArgs { index, delta: if call.brace { "}" } else { "{}" }.into() }),
        }
        events.push(ParseEvent::ToolCallEnd { index });
    }

    /// Closes every open argument and call (end of message or stream).
    fn close_all(&mut self, events: &mut Vec<ParseEvent>, why: &str) {
        while let Some(elem) = self.stack.pop() {
            match elem {
                Elem::Argument { .. } => {
                    events.push(ParseEvent::Malformed { index: self.call.as_ref().map(|c| c.index), message: format!("argument not closed: {why}") });
                    self.on_closed(elem, events);
                }
                Elem::Call => self.close_open_call(events, why),
                _ => {}
            }
        }
    }
}

/// Splits a tag header `name key="value" …` into the name and unescaped attributes.
fn parse_header(header: &str) -> (String, Vec<(String, String)>) {
    let header = header.trim();
    let (name, mut rest) = header.split_once(char::is_whitespace).unwrap_or((header, ""));
    let mut attrs = Vec::new();
    while let Some((key, after)) = rest.split_once('=') {
        let Some(after) = after.trim_start().strip_prefix('"') else { break };
        let Some((value, after)) = after.split_once('"') else { break };
        attrs.push((key.trim().to_string(), unescape_attr(value)));
        rest = after;
    }
    (name.to_string(), attrs)
}

#[cfg(test)]
mod tests {
    use super::super::{ContentPart, ToolCall};
    use super::*;
    use minijinja::value::Kwargs;
    use minijinja::{Environment, ErrorKind, Value};

    const TEMPLATE: &str = include_str!("../../tests/fixtures/templates/Kimi-K3.jinja");

    /// `json.dumps`' default layout: `", "` between items, `": "` after keys.
    struct PythonFormatter;
    impl serde_json::ser::Formatter for PythonFormatter {
        fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }

    /// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False)`,
    /// no HTML escaping (minijinja's built-in escapes `<>&'` and rejects `ensure_ascii`).
    fn python_tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
        let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
        assert_ne!(ensure_ascii, Some(true), "ensure_ascii=True is not emulated");
        kwargs.assert_all_used()?;
        let mut out = Vec::new();
        serde::Serialize::serialize(value, &mut serde_json::Serializer::with_formatter(&mut out, PythonFormatter))
            .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
        Ok(Value::from_safe_string(String::from_utf8(out).expect("serde_json writes UTF-8")))
    }

    fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
        Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
    }

    /// A message as the template sees it; with `expand`, each call's
    /// arguments string is given as the (order-keeping) parsed object.
    fn template_message(m: &Message, expand: bool) -> Value {
        let serde_json::Value::Object(map) = serde_json::to_value(m).unwrap() else { unreachable!() };
        let mut entries: Vec<(String, Value)> =
            map.iter().filter(|(k, _)| *k != "tool_calls").map(|(k, v)| (k.clone(), Value::from_serialize(v))).collect();
        if let Some(calls) = &m.tool_calls {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    let args = match OrderedJson::parse(&c.function.arguments) {
                        Ok(parsed @ OrderedJson::Object(_)) if expand => Value::from_serialize(&parsed),
                        _ => Value::from(c.function.arguments.clone()),
                    };
                    let function = Value::from_iter([("name".to_string(), Value::from(c.function.name.clone())), ("arguments".to_string(), args)]);
                    Value::from_iter([("id".to_string(), Value::from(c.id.clone())), ("type".to_string(), Value::from("function")), ("function".to_string(), function)])
                })
                .collect();
            entries.push(("tool_calls".into(), Value::from(calls)));
        }
        Value::from_iter(entries)
    }

    /// Renders the published template with minijinja (set up as `chat::render`
    /// does, plus transformers' `tojson`).
    fn render_template(messages: &[Message], tools: Option<&[serde_json::Value]>, add: bool, o: &K3Options) -> std::result::Result<String, minijinja::Error> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", python_tojson);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template("chat", TEMPLATE).unwrap();
        let messages: Vec<Value> = messages.iter().map(|m| template_message(m, o.expand_json_arguments)).collect();
        let tool_choice = match o.tool_choice {
            ToolChoice::Auto => "auto",
            ToolChoice::Required => "required",
            ToolChoice::None => "none",
        };
        let ctx = minijinja::context! {
            messages => messages,
            tools => tools.map(Value::from_serialize),
            add_generation_prompt => add,
            thinking => o.thinking,
            thinking_effort => o.thinking_effort.map(ThinkingEffort::as_str),
            tool_choice => tool_choice,
        };
        env.get_template("chat").unwrap().render(ctx)
    }

    fn tools() -> Vec<serde_json::Value> {
        vec![
            serde_json::json!({"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city (it's <free> & fast)",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}, "Days": {"type": "integer", "minimum": 1}}, "required": ["city"]}}}),
            serde_json::json!({"type": "function", "function": {"name": "search", "description": "Web search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}),
        ]
    }

    fn tool_conversation() -> Vec<Message> {
        vec![
            Message::text("system", "You are a helpful assistant."),
            Message::text("user", "Weather in Paris and Rome? Also search \"x & y\"."),
            Message {
                reasoning_content: Some("Need two weather calls and a search.".into()),
                ..Message::assistant_with_calls(
                    Some("Let me check."),
                    vec![
                        ToolCall::function("call_a", "get_weather", r#"{"city": "Paris", "days": 2, "opts": {"unit": "C", "hourly": [1, 2.5]}, "strict": true, "note": null}"#),
                        ToolCall::function("call_b", "get_weather", r#"{"city":"Rome"}"#),
                        ToolCall::function("call_c", "search", r#"{"we\"ird&key": "x & y", "q": "multi\nline"}"#),
                    ],
                )
            },
            // Results out of call order: rendered in call order, named by their calls.
            Message::tool_result("call_b", "Sunny, 25C"),
            Message::tool_result("call_c", "3 results"),
            Message::tool_result("call_a", "Rain, 14C"),
            Message::text("assistant", "Paris: rain. Rome: sunny."),
            Message { name: Some("alice".into()), ..Message::text("user", "Thanks!") },
        ]
    }

    #[test]
    fn renders_like_the_published_template_with_tools_and_results() {
        let tools = tools();
        let messages = tool_conversation();
        for expand in [true, false] {
            for add in [true, false] {
                let o = K3Options { expand_json_arguments: expand, ..K3Options::default() };
                assert_eq!(render_k3(&messages, Some(&tools), add, &o).unwrap(), render_template(&messages, Some(&tools), add, &o).unwrap(), "expand {expand} add {add}");
            }
        }
        let out = render_k3(&messages, Some(&tools), true, &K3Options::default()).unwrap();
        assert!(out.starts_with("<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\n"));
        assert!(out.contains("\"properties\":{\"city\":{\"description\":\"City name\",\"type\":\"string\"},\"Days\":{\"minimum\":1,\"type\":\"integer\"}}"), "dictsort ignores case");
        assert!(out.contains("<|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key=\"days\" type=\"number\"<|sep|>2<|close|>argument<|sep|><|open|>argument key=\"opts\" type=\"object\"<|sep|>{\"unit\": \"C\", \"hourly\": [1, 2.5]}<|close|>argument<|sep|>"));
        assert!(out.contains("<|open|>argument key=\"we&quot;ird&amp;key\" type=\"string\"<|sep|>x & y<|close|>argument<|sep|>"));
        assert!(out.contains("<|open|>message role=\"tool\" tool=\"get_weather\" index=\"1\"<|sep|>Rain, 14C<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"tool\" tool=\"get_weather\" index=\"2\"<|sep|>Sunny, 25C"));
        assert!(out.contains("<|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>Paris: rain."), "history keeps an empty think channel");
        assert!(out.ends_with("<|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"));
    }

    #[test]
    fn renders_like_the_published_template_without_thinking() {
        let messages = vec![
            Message { name: Some("ops".into()), ..Message::text("system", "Be brief.") },
            Message {
                content: Some(MessageContent::Parts(vec![ContentPart::text("What is "), ContentPart::image_url("http://x/y.png"), ContentPart::text("?")])),
                ..Message::text("user", "")
            },
            Message { reasoning_content: Some("hidden".into()), ..Message::assistant_with_calls(None, vec![ToolCall::function("1", "lookup", "")]) },
            // No ids: names come from the message, else from the calls by position.
            Message { name: Some("lookup".into()), ..Message::text("tool", "a") },
            Message::text("tool", "b"),
            Message::text("user", "ok"),
        ];
        let o = K3Options { thinking: false, thinking_effort: None, tool_choice: ToolChoice::Required, expand_json_arguments: true };
        let ours = render_k3(&messages, None, true, &o).unwrap();
        assert_eq!(ours, render_template(&messages, None, true, &o).unwrap());
        assert!(!ours.contains("think"));
        assert!(ours.contains("<|open|>message role=\"tool\" tool=\"lookup\" index=\"2\"<|sep|>b"));
        assert!(ours.ends_with("<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>"));
        let o = K3Options { thinking_effort: Some(ThinkingEffort::Low), tool_choice: ToolChoice::None, ..K3Options::default() };
        assert_eq!(render_k3(&messages, Some(&tools()), false, &o).unwrap(), render_template(&messages, Some(&tools()), false, &o).unwrap());
        assert_eq!(render_k3(&[], None, true, &K3Options::default()).unwrap(), render_template(&[], None, true, &K3Options::default()).unwrap());
    }

    #[test]
    fn a_tool_result_without_a_name_is_an_error_like_the_template() {
        let messages = vec![Message::text("user", "hi"), Message::text("tool", "orphan")];
        let err = render_k3(&messages, None, true, &K3Options::default()).unwrap_err();
        assert!(err.to_string().contains("resolvable tool name"), "{err}");
        assert!(render_template(&messages, None, true, &K3Options::default()).is_err());
    }

    /// A recorded-style K3 output after the thinking generation prompt.
    const OUTPUT: &str = "The user wants weather in Zürich.<|close|>think<|sep|>\n<|open|>response<|sep|>Checking two things.<|close|>response<|sep|>\
<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Zürich \"Nord\"\n<|close|>argument<|sep|>\
<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>\
<|open|>call tool=\"search\" index=\"2\"<|sep|><|open|>argument key=\"q&amp;&quot;\" type=\"string\"<|sep|>a &amp; b<|close|>argument<|sep|>\
<|open|>argument key=\"filters\" type=\"object\"<|sep|>{\"lang\": \"de\", \"n\": [1, 2]}<|close|>argument<|sep|><|close|>call<|sep|>\
<|open|>call tool=\"now\" index=\"3\"<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>ignored";

    fn expected() -> Vec<ParseEvent> {
        vec![
            ParseEvent::Reasoning("The user wants weather in Zürich.".into()),
            ParseEvent::Content("Checking two things.".into()),
            ParseEvent::ToolCallStart { index: 0, id: "functions.get_weather:0".into(), name: "get_weather".into() },
            ParseEvent::ToolCallArgs { index: 0, delta: r#"{"city":"Zürich \"Nord\"\n","days":3}"#.into() },
            ParseEvent::ToolCallEnd { index: 0 },
            ParseEvent::ToolCallStart { index: 1, id: "functions.search:1".into(), name: "search".into() },
            ParseEvent::ToolCallArgs { index: 1, delta: r#"{"q&\"":"a &amp; b","filters":{"lang": "de", "n": [1, 2]}}"#.into() },
            ParseEvent::ToolCallEnd { index: 1 },
            ParseEvent::ToolCallStart { index: 2, id: "functions.now:2".into(), name: "now".into() },
            ParseEvent::ToolCallArgs { index: 2, delta: "{}".into() },
            ParseEvent::ToolCallEnd { index: 2 },
        ]
    }

    fn parse_in_pieces(mut parser: K3StreamParser, text: &str, sizes: impl Iterator<Item = usize>) -> Vec<ParseEvent> {
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

    #[test]
    fn parses_channels_and_calls_into_json_arguments() {
        let events = parse_in_pieces(K3StreamParser::new(true), OUTPUT, std::iter::empty());
        assert_eq!(events, expected());
        for e in &events {
            if let ParseEvent::ToolCallArgs { delta, .. } = e {
                assert!(serde_json::from_str::<serde_json::Value>(delta).unwrap().is_object());
            }
        }
    }

    #[test]
    fn every_split_gives_the_same_events() {
        let want = expected();
        for size in [1, 2, 3, 5] {
            assert_eq!(parse_in_pieces(K3StreamParser::new(true), OUTPUT, std::iter::repeat(size)), want, "pieces of {size}");
        }
        let n = OUTPUT.chars().count();
        for cut in 0..=n {
            assert_eq!(parse_in_pieces(K3StreamParser::new(true), OUTPUT, [cut, n].into_iter()), want, "cut at {cut}");
        }
        let mut seed = 9u64;
        for _ in 0..50 {
            let sizes = std::iter::from_fn(|| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                Some(1 + ((seed >> 33) % 12) as usize)
            });
            assert_eq!(parse_in_pieces(K3StreamParser::new(true), OUTPUT, sizes.take(2000)), want);
        }
    }

    #[test]
    fn parsed_calls_render_back_to_the_same_tools_section() {
        let events = parse_in_pieces(K3StreamParser::new(true), OUTPUT, std::iter::repeat(4));
        let mut calls: Vec<ToolCall> = Vec::new();
        for e in events {
            match e {
                ParseEvent::ToolCallStart { id, name, .. } => calls.push(ToolCall::function(&id, &name, "")),
                ParseEvent::ToolCallArgs { index, delta } => calls[index].function.arguments.push_str(&delta),
                _ => {}
            }
        }
        let message = Message::assistant_with_calls(Some("Checking two things."), calls);
        let rendered = render_k3(&[message], None, false, &K3Options { thinking: false, ..K3Options::default() }).unwrap();
        let section = |s: &str| s[s.find("<|open|>tools").unwrap()..s.find("<|close|>tools<|sep|>").unwrap()].to_string();
        // The output escapes `&` in the string value as the model wrote it; rendering keeps values raw.
        assert_eq!(section(&rendered), section(OUTPUT).replace("a &amp; b", "a &amp; b"));
    }

    #[test]
    fn non_thinking_parser_starts_in_response() {
        let events = parse_in_pieces(K3StreamParser::new(false), "Hi<|close|>response<|sep|><|close|>message<|sep|>", std::iter::repeat(3));
        assert_eq!(events, vec![ParseEvent::Content("Hi".into())]);
    }

    #[test]
    fn a_stream_ending_mid_marker_or_mid_tag_is_reported() {
        let mut p = K3StreamParser::new(true);
        assert_eq!(p.push("thinking <|clo"), vec![ParseEvent::Reasoning("thinking ".into())]);
        assert_eq!(p.finish(), vec![ParseEvent::Reasoning("<|clo".into())]);
        let mut p = K3StreamParser::new(false);
        let mut events = p.push("x<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"a\" type=\"str");
        events.extend(p.finish());
        let events = coalesce(events);
        assert_eq!(events[0], ParseEvent::Content("x".into()));
        assert!(events.iter().any(|e| matches!(e, ParseEvent::Malformed { index: Some(0), .. })));
        assert_eq!(events.last(), Some(&ParseEvent::ToolCallEnd { index: 0 }));
    }

    #[test]
    fn malformed_values_are_reported_and_arguments_stay_valid_json() {
        let text = "<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>\
<|open|>argument key=\"n\" type=\"number\"<|sep|>twelve<|close|>argument<|sep|><|open|>argument key=\"s\"<|sep|>ok<|close|>argument<|sep|><|close|>call<|sep|>\
<|open|>call tool=\"g\" index=\"2\"<|sep|><|open|>json type=\"object\"<|sep|>{\"a\": 1<|close|>json<|sep|><|close|>call<|sep|>stray<|close|>tools<|sep|><|close|>nothing<|sep|><|sep|>";
        for size in [1, 4, 1000] {
            let events = parse_in_pieces(K3StreamParser::new(true), text, std::iter::repeat(size));
            let args: Vec<String> = (0..2)
                .map(|i| events.iter().filter_map(|e| match e { ParseEvent::ToolCallArgs { index, delta } if *index == i => Some(delta.as_str()), _ => None }).collect())
                .collect();
            assert_eq!(args[0], r#"{"n":"twelve","s":"ok"}"#, "an invalid number becomes a string; a missing type means string");
            assert_eq!(args[1], r#"{"a": 1"#, "json arguments stream raw");
            let malformed: Vec<Option<usize>> = events.iter().filter_map(|e| if let ParseEvent::Malformed { index, .. } = e { Some(*index) } else { None }).collect();
            assert_eq!(malformed, vec![Some(0), Some(1), None, None, None], "bad number, bad json, stray text, unknown close, stray sep");
        }
    }

    #[test]
    fn headers_parse_names_and_unescaped_attributes() {
        assert_eq!(parse_header("call tool=\"a&amp;b&quot;\" index=\"2\""), ("call".into(), vec![("tool".into(), "a&b\"".into()), ("index".into(), "2".into())]));
        assert_eq!(parse_header(" think "), ("think".into(), vec![]));
        assert_eq!(parse_header("argument key=\"k\" type=broken"), ("argument".into(), vec![("key".into(), "k".into())]));
        assert_eq!(unescape_attr(&escape_attr("&quot;\"&")), "&quot;\"&");
    }
}
