//! Hermes-style tool calls for ChatML templates without native tool
//! support (SmolLM2, and the Qwen/Hermes family that writes the same text).
//!
//! Tools are declared in the system message as a `<tools>` block of JSON
//! signatures; the model answers a call with
//! `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, and tool
//! results go back as user turns wrapped in `<tool_response>…</tool_response>`.
//! Reasoning, when the model writes it, is `<think>…</think>` before the answer.
//!
//! [`hermes_messages`] flattens OpenAI-shaped [`Message`]s (tool calls,
//! tool results, reasoning) into plain role/content pairs that any ChatML
//! template renders, writing an assistant turn back exactly as the model
//! produced it, so the next turn's prompt starts with the tokens the
//! previous turn already cached. [`HermesStreamParser`] turns the model's
//! text deltas into [`ParseEvent`]s: it holds back a possible marker cut in
//! two, streams a call's arguments as soon as its name is known, and never
//! lets call text through as content.

use serde_json::Value;

use super::{coalesce, json_string, MarkerScanner, Message, MessageContent, ParseEvent, Piece};
use crate::chat::ChatMessage;

/// The markers [`HermesStreamParser`] recognises.
pub const HERMES_MARKERS: &[&str] = &["<tool_call>", "</tool_call>", "<think>", "</think>"];
const CALL_OPEN: usize = 0;
const CALL_CLOSE: usize = 1;
const THINK_OPEN: usize = 2;
const THINK_CLOSE: usize = 3;

/// The tool block added to the system message.
fn tools_block(tools: &[Value]) -> String {
    let mut out = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        out.push('\n');
        let sorted = crate::chat::sort_keys(t);
        out.push_str(&serde_json::to_string(&sorted).expect("a JSON value always serialises"));
    }
    out.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    out
}

/// The text of a message's content (text parts joined; other parts skipped).
fn content_text(content: &Option<MessageContent>) -> String {
    match content {
        None => String::new(),
        Some(MessageContent::Text(t)) => t.clone(),
        Some(MessageContent::Parts(parts)) => parts
            .iter()
            .filter_map(|p| p.text.as_deref())
            .collect::<Vec<_>>()
            .join(""),
    }
}

/// One tool call as the model writes it.
pub fn render_call(name: &str, arguments: &str) -> String {
    let args = match serde_json::from_str::<Value>(arguments) {
        Ok(v) => serde_json::to_string(&v).expect("a JSON value always serialises"),
        Err(_) => json_string(arguments),
    };
    format!(
        "<tool_call>\n{{\"name\": {}, \"arguments\": {args}}}\n</tool_call>",
        json_string(name)
    )
}

/// Flattens `messages` (and the declared `tools`, OpenAI chat shape) into
/// role/content pairs for a ChatML template: tools in the system message,
/// assistant calls as `<tool_call>` text, reasoning as `<think>` text,
/// consecutive tool results as one user turn of `<tool_response>` blocks.
pub fn hermes_messages(messages: &[Message], tools: Option<&[Value]>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::new();
    let tools = tools.filter(|t| !t.is_empty());
    let mut rest = messages;
    if let Some(tools) = tools {
        let block = tools_block(tools);
        match messages.first() {
            Some(m) if m.role == "system" || m.role == "developer" => {
                out.push(ChatMessage::new(
                    "system",
                    &format!("{}\n\n{block}", content_text(&m.content)),
                ));
                rest = &messages[1..];
            }
            _ => out.push(ChatMessage::new("system", &block)),
        }
    }
    let mut in_results = false;
    for m in rest {
        match m.role.as_str() {
            "tool" => {
                let block = format!(
                    "<tool_response>\n{}\n</tool_response>",
                    content_text(&m.content)
                );
                match out.last_mut() {
                    Some(last) if in_results => {
                        last.content.push('\n');
                        last.content.push_str(&block);
                    }
                    _ => out.push(ChatMessage::new("user", &block)),
                }
                in_results = true;
                continue;
            }
            "assistant" => {
                let mut text = String::new();
                if let Some(r) = m.reasoning_content.as_deref().filter(|r| !r.is_empty()) {
                    text.push_str("<think>");
                    text.push_str(r);
                    text.push_str("</think>");
                }
                text.push_str(&content_text(&m.content));
                for call in m.tool_calls.iter().flatten() {
                    if !text.is_empty() && !text.ends_with('\n') {
                        text.push('\n');
                    }
                    text.push_str(&render_call(&call.function.name, &call.function.arguments));
                }
                out.push(ChatMessage::new("assistant", &text));
            }
            "developer" => out.push(ChatMessage::new("system", &content_text(&m.content))),
            role => out.push(ChatMessage::new(role, &content_text(&m.content))),
        }
        in_results = false;
    }
    out
}

/// A call being read.
#[derive(Debug, Clone, Default)]
struct OpenCall {
    /// Text after `<tool_call>` so far.
    buf: String,
    /// Index and the byte offset in `buf` where the arguments start, once the name is known.
    started: Option<(usize, usize)>,
    /// Bytes of the arguments already streamed (from the start offset).
    streamed: usize,
    /// The prefix did not read as `{"name": …, "arguments":`: parse it whole at the end.
    whole: bool,
}

/// Incremental parser of Hermes-style output.
#[derive(Debug, Clone)]
pub struct HermesStreamParser {
    /// Finds markers across deltas.
    scanner: MarkerScanner,
    /// Inside `<think>…</think>`.
    in_think: bool,
    /// The call being read.
    call: Option<OpenCall>,
    /// Whitespace after a call, released only if more content follows.
    after_call: Option<String>,
    /// Index the next call gets.
    next_index: usize,
}

impl Default for HermesStreamParser {
    fn default() -> Self {
        HermesStreamParser::new()
    }
}

/// What reading `{"name": "…", "arguments":` from the start of a call found.
enum Prefix {
    /// The name, and where the arguments begin.
    Found(String, usize),
    /// Not enough text yet.
    Incomplete,
    /// Some other layout.
    Other,
}

/// Skips JSON whitespace from `i`.
fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\n' | b'\r' | b'\t') {
        i += 1;
    }
    i
}

/// Expects the literal `lit` at `i` (after whitespace).
fn expect(b: &[u8], i: usize, lit: &[u8]) -> Result<usize, Prefix> {
    let i = skip_ws(b, i);
    let avail = (b.len() - i).min(lit.len());
    if b[i..i + avail] != lit[..avail] {
        return Err(Prefix::Other);
    }
    if avail < lit.len() {
        return Err(Prefix::Incomplete);
    }
    Ok(i + lit.len())
}

/// Reads the `{"name": "…", "arguments":` prefix of a call.
fn read_prefix(s: &str) -> Prefix {
    let b = s.as_bytes();
    let run = || -> Result<(String, usize), Prefix> {
        let i = expect(b, 0, b"{")?;
        let i = expect(b, i, b"\"name\"")?;
        let i = expect(b, i, b":")?;
        let i = expect(b, i, b"\"")?;
        // The name string, up to its closing quote.
        let mut j = i;
        while j < b.len() && b[j] != b'"' {
            if b[j] == b'\\' {
                j += 1;
            }
            j += 1;
        }
        if j >= b.len() {
            return Err(Prefix::Incomplete);
        }
        let name: String = serde_json::from_str(&s[i - 1..=j]).map_err(|_| Prefix::Other)?;
        let k = expect(b, j + 1, b",")?;
        let k = expect(b, k, b"\"arguments\"")?;
        let k = expect(b, k, b":")?;
        let k = skip_ws(b, k);
        if k >= b.len() {
            return Err(Prefix::Incomplete);
        }
        Ok((name, k))
    };
    match run() {
        Ok((name, at)) => Prefix::Found(name, at),
        Err(p) => p,
    }
}

/// Whether JSON text `s` ends inside a string literal (an odd number of
/// unescaped quotes).
fn in_json_string(s: &str) -> bool {
    let mut inside = false;
    let mut escaped = false;
    for b in s.bytes() {
        if escaped {
            escaped = false;
        } else if inside && b == b'\\' {
            escaped = true;
        } else if b == b'"' {
            inside = !inside;
        }
    }
    inside
}

/// Length of the tail of `s` that may be the call's closing `}` (and whitespace).
fn closing_tail(s: &str) -> usize {
    let trimmed = s.trim_end();
    let mut tail = s.len() - trimmed.len();
    if let Some(body) = trimmed.strip_suffix('}') {
        tail += 1;
        tail += body.len() - body.trim_end().len();
    }
    tail
}

impl HermesStreamParser {
    /// A parser at the start of an assistant turn, outside `<think>`.
    pub fn new() -> HermesStreamParser {
        HermesStreamParser {
            scanner: MarkerScanner::new(HERMES_MARKERS),
            in_think: false,
            call: None,
            after_call: None,
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

    /// Ends the stream: held-back text is released, an unfinished call is
    /// reported as [`ParseEvent::Malformed`] and closed.
    pub fn finish(&mut self) -> Vec<ParseEvent> {
        let mut events = Vec::new();
        for piece in self.scanner.finish() {
            self.on_piece(piece, &mut events);
        }
        if self.call.is_some() {
            events.push(ParseEvent::Malformed {
                index: Some(self.next_index),
                message: "stream ended inside a <tool_call>".into(),
            });
            self.close_call(&mut events);
        }
        coalesce(events)
    }

    fn on_piece(&mut self, piece: Piece, events: &mut Vec<ParseEvent>) {
        match piece {
            Piece::Text(t) => self.on_text(t, events),
            Piece::Marker(CALL_OPEN) if self.call.is_none() => {
                self.after_call = None;
                self.call = Some(OpenCall::default());
            }
            // `</tool_call>` inside a JSON string of the call is argument text.
            Piece::Marker(CALL_CLOSE)
                if self.call.as_ref().is_some_and(|c| in_json_string(&c.buf)) =>
            {
                self.on_text(HERMES_MARKERS[CALL_CLOSE].to_string(), events);
            }
            Piece::Marker(CALL_CLOSE) if self.call.is_some() => {
                self.close_call(events);
                self.after_call = Some(String::new());
            }
            Piece::Marker(THINK_OPEN) if self.call.is_none() => self.in_think = true,
            Piece::Marker(THINK_CLOSE) if self.call.is_none() && self.in_think => {
                self.in_think = false
            }
            Piece::Marker(m) => {
                if self.call.is_some() {
                    self.on_text(HERMES_MARKERS[m].to_string(), events);
                } else {
                    events.push(ParseEvent::Malformed {
                        index: None,
                        message: format!("unexpected {} here", HERMES_MARKERS[m]),
                    });
                }
            }
        }
    }

    fn on_text(&mut self, text: String, events: &mut Vec<ParseEvent>) {
        let Some(call) = self.call.as_mut() else {
            if self.in_think {
                events.push(ParseEvent::Reasoning(text));
                return;
            }
            if let Some(ws) = self.after_call.as_mut() {
                ws.push_str(&text);
                if ws.trim().is_empty() {
                    return;
                }
                let all = std::mem::take(ws);
                self.after_call = None;
                events.push(ParseEvent::Content(all));
                return;
            }
            events.push(ParseEvent::Content(text));
            return;
        };
        call.buf.push_str(&text);
        if call.started.is_none() && !call.whole {
            match read_prefix(&call.buf) {
                Prefix::Found(name, at) => {
                    let index = self.next_index;
                    call.started = Some((index, at));
                    events.push(ParseEvent::ToolCallStart {
                        index,
                        id: format!("call_{index}"),
                        name,
                    });
                }
                Prefix::Incomplete => return,
                Prefix::Other => {
                    call.whole = true;
                    return;
                }
            }
        }
        if let Some((index, at)) = call.started {
            let args = &call.buf[at..];
            let ready = args.len() - closing_tail(args);
            if ready > call.streamed {
                events.push(ParseEvent::ToolCallArgs {
                    index,
                    delta: args[call.streamed..ready].to_string(),
                });
                call.streamed = ready;
            }
        }
    }

    /// Ends the current call at `</tool_call>` (or the end of the stream).
    fn close_call(&mut self, events: &mut Vec<ParseEvent>) {
        let Some(call) = self.call.take() else { return };
        // Only a call that starts takes an index: clients index `tool_calls`
        // by it, so a malformed block must not leave a hole before the next.
        let index = self.next_index;
        match call.started {
            Some((_, at)) => {
                self.next_index += 1;
                let args = &call.buf[at..];
                let tail = &args[call.streamed..];
                let rest = tail.trim();
                let rest = rest.strip_suffix('}').unwrap_or(rest).trim_end();
                if !rest.is_empty() {
                    events.push(ParseEvent::ToolCallArgs {
                        index,
                        delta: rest.to_string(),
                    });
                }
                let full = &args[..call.streamed + rest.len()];
                check_object(index, full, events);
            }
            None => match serde_json::from_str::<Value>(call.buf.trim()) {
                Ok(Value::Object(o)) if o.get("name").is_some_and(Value::is_string) => {
                    self.next_index += 1;
                    let name = o["name"].as_str().unwrap_or_default().to_string();
                    events.push(ParseEvent::ToolCallStart {
                        index,
                        id: format!("call_{index}"),
                        name,
                    });
                    let args = match o.get("arguments").or_else(|| o.get("parameters")) {
                        Some(Value::String(s)) => s.clone(),
                        Some(v) => v.to_string(),
                        None => "{}".into(),
                    };
                    check_object(index, &args, events);
                    events.push(ParseEvent::ToolCallArgs { index, delta: args });
                }
                _ => {
                    events.push(ParseEvent::Malformed {
                        index: None,
                        message: format!(
                            "<tool_call> does not hold {{\"name\", \"arguments\"}}: {}",
                            json_string(call.buf.trim())
                        ),
                    });
                    return;
                }
            },
        }
        events.push(ParseEvent::ToolCallEnd { index });
    }
}

/// Reports arguments that are not a JSON object.
fn check_object(index: usize, args: &str, events: &mut Vec<ParseEvent>) {
    if !matches!(serde_json::from_str::<Value>(args), Ok(Value::Object(_))) {
        events.push(ParseEvent::Malformed {
            index: Some(index),
            message: format!("arguments of tool call {index} are not a JSON object"),
        });
    }
}

impl super::StreamParser for HermesStreamParser {
    fn push(&mut self, delta: &str) -> Vec<ParseEvent> {
        HermesStreamParser::push(self, delta)
    }
    fn finish(&mut self) -> Vec<ParseEvent> {
        HermesStreamParser::finish(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::toolcall::ToolCall;

    const OUT: &str = "<think>user wants weather</think>Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"days\": [1, 2]}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";

    fn want() -> Vec<ParseEvent> {
        vec![
            ParseEvent::Reasoning("user wants weather".into()),
            ParseEvent::Content("Let me check.\n".into()),
            ParseEvent::ToolCallStart {
                index: 0,
                id: "call_0".into(),
                name: "get_weather".into(),
            },
            ParseEvent::ToolCallArgs {
                index: 0,
                delta: "{\"city\": \"Zürich\", \"days\": [1, 2]}".into(),
            },
            ParseEvent::ToolCallEnd { index: 0 },
            ParseEvent::ToolCallStart {
                index: 1,
                id: "call_1".into(),
                name: "now".into(),
            },
            ParseEvent::ToolCallArgs {
                index: 1,
                delta: "{}".into(),
            },
            ParseEvent::ToolCallEnd { index: 1 },
        ]
    }

    fn feed(text: &str, cuts: &[usize]) -> Vec<ParseEvent> {
        let mut p = HermesStreamParser::new();
        let mut events = Vec::new();
        let mut last = 0;
        for &c in cuts {
            events.extend(p.push(&text[last..c]));
            last = c;
        }
        events.extend(p.push(&text[last..]));
        events.extend(p.finish());
        coalesce(events)
    }

    #[test]
    fn parses_calls_split_anywhere() {
        assert_eq!(feed(OUT, &[]), want());
        for cut in 0..=OUT.len() {
            if OUT.is_char_boundary(cut) {
                assert_eq!(feed(OUT, &[cut]), want(), "cut at {cut}");
            }
        }
        let bounds: Vec<usize> = OUT.char_indices().map(|(i, _)| i).skip(1).collect();
        assert_eq!(feed(OUT, &bounds), want());
    }

    #[test]
    fn markers_inside_argument_strings_stay_arguments() {
        let text = "Sure.<tool_call>\n{\"name\":\"f\",\"arguments\":{\"a\":\"</tool_call>\"}}\n</tool_call>";
        let mut calls = Vec::new();
        let mut content = String::new();
        for e in feed(text, &[]) {
            match e {
                ParseEvent::Content(c) => content.push_str(&c),
                ParseEvent::ToolCallStart { name, .. } => calls.push((name, String::new())),
                ParseEvent::ToolCallArgs { delta, .. } => {
                    calls.last_mut().unwrap().1.push_str(&delta)
                }
                ParseEvent::Malformed { message, .. } => panic!("{message}"),
                _ => {}
            }
        }
        assert_eq!(content, "Sure.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].0, "f");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&calls[0].1).unwrap(),
            serde_json::json!({"a": "</tool_call>"})
        );
    }

    #[test]
    fn arguments_stream_before_the_call_closes() {
        let mut p = HermesStreamParser::new();
        let ev = p.push("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"lo");
        assert!(ev.contains(&ParseEvent::ToolCallStart {
            index: 0,
            id: "call_0".into(),
            name: "f".into()
        }));
        assert!(ev.contains(&ParseEvent::ToolCallArgs {
            index: 0,
            delta: "{\"a\": \"lo".into()
        }));
    }

    #[test]
    fn other_layouts_and_bad_json_are_reported_not_leaked() {
        let ev = feed(
            "<tool_call>{\"arguments\": {\"x\": 1}, \"name\": \"g\"}</tool_call>",
            &[],
        );
        assert_eq!(
            ev,
            vec![
                ParseEvent::ToolCallStart {
                    index: 0,
                    id: "call_0".into(),
                    name: "g".into()
                },
                ParseEvent::ToolCallArgs {
                    index: 0,
                    delta: "{\"x\":1}".into()
                },
                ParseEvent::ToolCallEnd { index: 0 },
            ]
        );
        let ev = feed("<tool_call>not json</tool_call>", &[]);
        assert!(matches!(ev[0], ParseEvent::Malformed { .. }), "{ev:?}");
        assert!(!ev.iter().any(|e| matches!(e, ParseEvent::Content(_))));
        let ev = feed("<tool_call>{\"name\": \"f\", \"arguments\": {\"a\"", &[]);
        assert!(ev
            .iter()
            .any(|e| matches!(e, ParseEvent::Malformed { index: Some(0), .. })));
        assert!(matches!(
            ev.last(),
            Some(ParseEvent::ToolCallEnd { index: 0 })
        ));
    }

    #[test]
    fn history_renders_as_the_model_wrote_it() {
        let call = ToolCall::function("call_0", "get_weather", "{\"city\":\"Zürich\"}");
        let mut asst = Message::assistant_with_calls(Some("Let me check."), vec![call]);
        asst.reasoning_content = Some("hmm".into());
        let msgs = vec![
            Message::text("user", "Weather?"),
            asst,
            Message::tool_result("call_0", "sunny"),
            Message::tool_result("call_1", "12:00"),
        ];
        let tools = vec![serde_json::json!({"type":"function","function":{"name":"get_weather"}})];
        let out = hermes_messages(&msgs, Some(&tools));
        assert_eq!(out[0].role, "system");
        assert!(
            out[0].content.contains("<tools>\n{\"function\""),
            "{}",
            out[0].content
        );
        assert_eq!(
            out[2].content,
            "<think>hmm</think>Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Zürich\"}}\n</tool_call>"
        );
        assert_eq!(out.len(), 4);
        assert_eq!(
            out[3].content,
            "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
        );
    }
}
