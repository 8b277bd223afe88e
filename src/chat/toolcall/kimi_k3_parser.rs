//! Incremental parser of Kimi K3 ("XTML") output.
//!
//! After the generation prompt (`<|open|>message role="assistant"<|sep|>`
//! and `<|open|>think<|sep|>` or `<|open|>response<|sep|>`) the model writes
//! channel text, closes and opens elements with
//! `<|close|>name<|sep|>` / `<|open|>name attrs<|sep|>`, and ends with
//! `<|close|>message<|sep|><|end_of_msg|>`. [`K3StreamParser`] keeps a stack
//! of open elements: text in `think` is reasoning, in `response` content; a
//! `call` element starts a tool call, and its `argument` elements are
//! assembled into a JSON object (`type="string"` values stream as a JSON
//! string, other values are checked as JSON at their close), or a `json`
//! element gives the object as is.

use super::{coalesce, json_string, MarkerScanner, ParseEvent, Piece};

/// Reverses the template's attribute escaping (`&amp;`, `&quot;`).
fn unescape_attr(v: &str) -> String {
    v.replace("&quot;", "\"").replace("&amp;", "&")
}

/// The markers [`K3StreamParser`] recognises.
pub const K3_MARKERS: &[&str] = &["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"];
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
            stack: vec![
                Elem::Message,
                if thinking {
                    Elem::Think
                } else {
                    Elem::Response
                },
            ],
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
            events.push(ParseEvent::Malformed {
                index: self.call.as_ref().map(|c| c.index),
                message: format!("stream ended inside tag {}", json_string(header)),
            });
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
                events.push(ParseEvent::Malformed {
                    index: self.call.as_ref().map(|c| c.index),
                    message: format!("tag {} has no <|sep|>", json_string(&header)),
                });
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
                events.push(ParseEvent::Malformed {
                    index: self.call.as_ref().map(|c| c.index),
                    message: "stray <|sep|>".into(),
                });
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
                        events.push(ParseEvent::ToolCallArgs {
                            index: call.index,
                            delta: text,
                        });
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
        if self
            .stack
            .iter()
            .any(|e| matches!(e, Elem::Tools | Elem::Call))
        {
            events.push(ParseEvent::Malformed {
                index: self.call.as_ref().map(|c| c.index),
                message: format!("text inside tools: {}", json_string(&text)),
            });
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
                    events.push(ParseEvent::Malformed {
                        index: Some(index),
                        message: format!("tool call {index} has no tool name"),
                    });
                }
                events.push(ParseEvent::ToolCallStart {
                    index,
                    id: format!("functions.{name}:{index}"),
                    name,
                });
                self.call = Some(OpenCall {
                    index,
                    brace: false,
                    json: None,
                });
                Elem::Call
            }
            "argument" => match self.call.as_mut() {
                Some(call) => {
                    let key = attr("key").unwrap_or_default();
                    let ty = attr("type").unwrap_or_else(|| "string".into());
                    let prefix = format!(
                        "{}{}:",
                        if call.brace { "," } else { "{" },
                        json_string(&key)
                    );
                    call.brace = true;
                    let string = ty == "string";
                    if string {
                        events.push(ParseEvent::ToolCallArgs {
                            index: call.index,
                            delta: format!("{prefix}\""),
                        });
                    }
                    Elem::Argument {
                        string,
                        prefix,
                        value: String::new(),
                        ty,
                    }
                }
                None => {
                    events.push(ParseEvent::Malformed {
                        index: None,
                        message: "argument outside a tool call".into(),
                    });
                    Elem::Other(name)
                }
            },
            "json" => match self.call.as_mut() {
                Some(call) => {
                    if call.brace || call.json.is_some() {
                        events.push(ParseEvent::Malformed {
                            index: Some(call.index),
                            message: format!(
                                "tool call {} mixes json and argument elements",
                                call.index
                            ),
                        });
                    }
                    call.json.get_or_insert_with(String::new);
                    Elem::Json
                }
                None => {
                    events.push(ParseEvent::Malformed {
                        index: None,
                        message: "json outside a tool call".into(),
                    });
                    Elem::Other(name)
                }
            },
            _ => Elem::Other(name),
        };
        self.stack.push(elem);
    }

    fn close_element(&mut self, name: &str, events: &mut Vec<ParseEvent>) {
        let Some(pos) = self.stack.iter().rposition(|e| e.name() == name) else {
            events.push(ParseEvent::Malformed {
                index: self.call.as_ref().map(|c| c.index),
                message: format!("close of `{name}`, which is not open"),
            });
            return;
        };
        while self.stack.len() > pos {
            let elem = self.stack.pop().expect("stack is longer than pos");
            if self.stack.len() > pos {
                events.push(ParseEvent::Malformed {
                    index: self.call.as_ref().map(|c| c.index),
                    message: format!("`{}` closed by the close of `{name}`", elem.name()),
                });
            }
            self.on_closed(elem, events);
        }
    }

    fn on_closed(&mut self, elem: Elem, events: &mut Vec<ParseEvent>) {
        match elem {
            Elem::Argument {
                string,
                prefix,
                value,
                ty,
            } => {
                let Some(index) = self.call.as_ref().map(|c| c.index) else {
                    return;
                };
                if string {
                    events.push(ParseEvent::ToolCallArgs {
                        index,
                        delta: "\"".into(),
                    });
                } else if serde_json::from_str::<serde_json::Value>(&value).is_ok() {
                    events.push(ParseEvent::ToolCallArgs {
                        index,
                        delta: format!("{prefix}{}", value.trim()),
                    });
                } else {
                    events.push(ParseEvent::Malformed {
                        index: Some(index),
                        message: format!(
                            "argument {prefix} of type {ty} is not valid JSON; passed as a string"
                        ),
                    });
                    events.push(ParseEvent::ToolCallArgs {
                        index,
                        delta: format!("{prefix}{}", json_string(&value)),
                    });
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
            events.push(ParseEvent::Malformed {
                index: Some(index),
                message: format!("tool call {index} not closed: {why}"),
            });
        }
        match call.json {
            Some(json) => {
                if json.trim().is_empty() {
                    events.push(ParseEvent::ToolCallArgs {
                        index,
                        delta: "{}".into(),
                    });
                } else if !matches!(
                    serde_json::from_str::<serde_json::Value>(&json),
                    Ok(serde_json::Value::Object(_))
                ) {
                    events.push(ParseEvent::Malformed {
                        index: Some(index),
                        message: format!(
                            "json arguments of tool call {index} are not a JSON object"
                        ),
                    });
                }
            }
            None => events.push(ParseEvent::ToolCallArgs {
                index,
                delta: if call.brace { "}" } else { "{}" }.into(),
            }),
        }
        events.push(ParseEvent::ToolCallEnd { index });
    }

    /// Closes every open argument and call (end of message or stream).
    fn close_all(&mut self, events: &mut Vec<ParseEvent>, why: &str) {
        while let Some(elem) = self.stack.pop() {
            match elem {
                Elem::Argument { .. } => {
                    events.push(ParseEvent::Malformed {
                        index: self.call.as_ref().map(|c| c.index),
                        message: format!("argument not closed: {why}"),
                    });
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
    let (name, mut rest) = header
        .split_once(char::is_whitespace)
        .unwrap_or((header, ""));
    let mut attrs = Vec::new();
    while let Some((key, after)) = rest.split_once('=') {
        let Some(after) = after.trim_start().strip_prefix('"') else {
            break;
        };
        let Some((value, after)) = after.split_once('"') else {
            break;
        };
        attrs.push((key.trim().to_string(), unescape_attr(value)));
        rest = after;
    }
    (name.to_string(), attrs)
}

impl super::StreamParser for K3StreamParser {
    fn push(&mut self, delta: &str) -> Vec<ParseEvent> {
        K3StreamParser::push(self, delta)
    }
    fn finish(&mut self) -> Vec<ParseEvent> {
        K3StreamParser::finish(self)
    }
}

#[cfg(test)]
mod tests {
    use super::super::kimi_k3::escape_attr;
    use super::super::{render_k3, K3Options, Message, ToolCall};
    use super::*;
    use crate::chat::toolcall::parse_in_pieces;

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
            ParseEvent::ToolCallStart {
                index: 0,
                id: "functions.get_weather:0".into(),
                name: "get_weather".into(),
            },
            ParseEvent::ToolCallArgs {
                index: 0,
                delta: r#"{"city":"Zürich \"Nord\"\n","days":3}"#.into(),
            },
            ParseEvent::ToolCallEnd { index: 0 },
            ParseEvent::ToolCallStart {
                index: 1,
                id: "functions.search:1".into(),
                name: "search".into(),
            },
            ParseEvent::ToolCallArgs {
                index: 1,
                delta: r#"{"q&\"":"a &amp; b","filters":{"lang": "de", "n": [1, 2]}}"#.into(),
            },
            ParseEvent::ToolCallEnd { index: 1 },
            ParseEvent::ToolCallStart {
                index: 2,
                id: "functions.now:2".into(),
                name: "now".into(),
            },
            ParseEvent::ToolCallArgs {
                index: 2,
                delta: "{}".into(),
            },
            ParseEvent::ToolCallEnd { index: 2 },
        ]
    }

    #[test]
    fn parses_channels_and_calls_into_json_arguments() {
        let events = parse_in_pieces(K3StreamParser::new(true), OUTPUT, std::iter::empty());
        assert_eq!(events, expected());
        for e in &events {
            if let ParseEvent::ToolCallArgs { delta, .. } = e {
                assert!(serde_json::from_str::<serde_json::Value>(delta)
                    .unwrap()
                    .is_object());
            }
        }
    }

    #[test]
    fn every_split_gives_the_same_events() {
        let want = expected();
        for size in [1, 2, 3, 5] {
            assert_eq!(
                parse_in_pieces(K3StreamParser::new(true), OUTPUT, std::iter::repeat(size)),
                want,
                "pieces of {size}"
            );
        }
        let n = OUTPUT.chars().count();
        for cut in 0..=n {
            assert_eq!(
                parse_in_pieces(K3StreamParser::new(true), OUTPUT, [cut, n].into_iter()),
                want,
                "cut at {cut}"
            );
        }
        let mut rng = caracal_kernels::testing::Rng::seeded(9);
        for _ in 0..50 {
            let sizes = std::iter::from_fn(|| Some(1 + ((rng.next_u64() >> 33) % 12) as usize));
            assert_eq!(
                parse_in_pieces(K3StreamParser::new(true), OUTPUT, sizes.take(2000)),
                want
            );
        }
    }

    #[test]
    fn parsed_calls_render_back_to_the_same_tools_section() {
        let events = parse_in_pieces(K3StreamParser::new(true), OUTPUT, std::iter::repeat(4));
        let mut calls: Vec<ToolCall> = Vec::new();
        for e in events {
            match e {
                ParseEvent::ToolCallStart { id, name, .. } => {
                    calls.push(ToolCall::function(&id, &name, ""))
                }
                ParseEvent::ToolCallArgs { index, delta } => {
                    calls[index].function.arguments.push_str(&delta)
                }
                _ => {}
            }
        }
        let message = Message::assistant_with_calls(Some("Checking two things."), calls);
        let rendered = render_k3(
            &[message],
            None,
            false,
            &K3Options {
                thinking: false,
                ..K3Options::default()
            },
        )
        .unwrap();
        let section = |s: &str| {
            s[s.find("<|open|>tools").unwrap()..s.find("<|close|>tools<|sep|>").unwrap()]
                .to_string()
        };
        // Argument values are not entity-escaped (only attributes are), so `a &amp; b` survives as written.
        assert_eq!(section(&rendered), section(OUTPUT));
    }

    #[test]
    fn non_thinking_parser_starts_in_response() {
        let events = parse_in_pieces(
            K3StreamParser::new(false),
            "Hi<|close|>response<|sep|><|close|>message<|sep|>",
            std::iter::repeat(3),
        );
        assert_eq!(events, vec![ParseEvent::Content("Hi".into())]);
    }

    #[test]
    fn a_stream_ending_mid_marker_or_mid_tag_is_reported() {
        let mut p = K3StreamParser::new(true);
        assert_eq!(
            p.push("thinking <|clo"),
            vec![ParseEvent::Reasoning("thinking ".into())]
        );
        assert_eq!(p.finish(), vec![ParseEvent::Reasoning("<|clo".into())]);
        let mut p = K3StreamParser::new(false);
        let mut events = p.push("x<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"a\" type=\"str");
        events.extend(p.finish());
        let events = coalesce(events);
        assert_eq!(events[0], ParseEvent::Content("x".into()));
        assert!(events
            .iter()
            .any(|e| matches!(e, ParseEvent::Malformed { index: Some(0), .. })));
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
                .map(|i| {
                    events
                        .iter()
                        .filter_map(|e| match e {
                            ParseEvent::ToolCallArgs { index, delta } if *index == i => {
                                Some(delta.as_str())
                            }
                            _ => None,
                        })
                        .collect()
                })
                .collect();
            assert_eq!(
                args[0], r#"{"n":"twelve","s":"ok"}"#,
                "an invalid number becomes a string; a missing type means string"
            );
            assert_eq!(args[1], r#"{"a": 1"#, "json arguments stream raw");
            let malformed: Vec<Option<usize>> = events
                .iter()
                .filter_map(|e| {
                    if let ParseEvent::Malformed { index, .. } = e {
                        Some(*index)
                    } else {
                        None
                    }
                })
                .collect();
            assert_eq!(
                malformed,
                vec![Some(0), Some(1), None, None, None],
                "bad number, bad json, stray text, unknown close, stray sep"
            );
        }
    }

    #[test]
    fn headers_parse_names_and_unescaped_attributes() {
        assert_eq!(
            parse_header("call tool=\"a&amp;b&quot;\" index=\"2\""),
            (
                "call".into(),
                vec![
                    ("tool".into(), "a&b\"".into()),
                    ("index".into(), "2".into())
                ]
            )
        );
        assert_eq!(parse_header(" think "), ("think".into(), vec![]));
        assert_eq!(
            parse_header("argument key=\"k\" type=broken"),
            ("argument".into(), vec![("key".into(), "k".into())])
        );
        assert_eq!(unescape_attr(&escape_attr("&quot;\"&")), "&quot;\"&");
    }
}
