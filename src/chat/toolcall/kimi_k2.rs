//! Kimi K2 chat format (K2, K2.5, Kimi-Linear): rendering and output parsing.
//!
//! Rendering follows the published `Kimi-K2-Instruct.jinja` (as vendored by
//! llama.cpp): an optional `tool_declare` system turn with the tools as
//! compact JSON, a default system prompt when the conversation does not open
//! with one (followed by a newline, as that template renders it), then
//! `<|im_{user,assistant,system}|>{name}<|im_middle|>{body}<|im_end|>` turns.
//! Assistant tool calls get ids `functions.{name}:{n}` with `n` counting
//! calls over the whole conversation; tool results answer those ids in
//! order (`## Return of {id}\n{content}`), whatever their `tool_call_id`.
//!
//! Model output: text, optionally `<think>…</think>`, then
//! `<|tool_calls_section_begin|>` and per call
//! `<|tool_call_begin|>functions.{name}:{n}<|tool_call_argument_begin|>{json}<|tool_call_end|>`,
//! then `<|tool_calls_section_end|>`. [`K2StreamParser`] parses it incrementally.

use std::collections::VecDeque;

use super::{
    coalesce, json_string, write_json, JsonStyle, KeyOrder, MarkerScanner, Message, MessageContent,
    OrderedJson, ParseEvent, Piece,
};

/// The system prompt K2 renders when the first message is not a system message.
pub const K2_DEFAULT_SYSTEM_PROMPT: &str = "You are Kimi, an AI assistant created by Moonshot AI.";

/// What an image part renders as (the template's literal, newline included).
const K2_IMAGE: &str = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>\n";

/// Appends a message's content: text, or parts (images as [`K2_IMAGE`]).
fn render_content(out: &mut String, content: &Option<MessageContent>) {
    match content {
        None => {}
        Some(MessageContent::Text(t)) => out.push_str(t),
        Some(MessageContent::Parts(parts)) => {
            for part in parts {
                if part.kind == "image" || part.kind == "image_url" || part.image_url.is_some() {
                    out.push_str(K2_IMAGE);
                } else if super::is_video_part(&part.kind) {
                    // Unresolved: the gateway resolves videos into `video`
                    // parts (their chunk prompts, written as text) first.
                } else {
                    out.push_str(part.text.as_deref().unwrap_or(""));
                }
            }
        }
    }
}

/// Renders a K2 prompt: tool declarations (OpenAI `tools` entries, keys
/// sorted as Kimi's tokenizer does), the messages, and the assistant header
/// if `add_generation_prompt`.
pub fn render_k2(
    messages: &[Message],
    tools: Option<&[serde_json::Value]>,
    add_generation_prompt: bool,
) -> String {
    let mut out = String::new();
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        out.push_str("<|im_system|>tool_declare<|im_middle|>");
        let list = OrderedJson::Array(tools.iter().map(OrderedJson::from).collect());
        write_json(&mut out, &list, JsonStyle::Compact, KeyOrder::Sorted);
        out.push_str("<|im_end|>");
    }
    let mut pending_ids: VecDeque<String> = VecDeque::new();
    let mut call_counter = 0usize;
    for (i, message) in messages.iter().enumerate() {
        if i == 0 && message.role != "system" {
            out.push_str("<|im_system|>system<|im_middle|>");
            out.push_str(K2_DEFAULT_SYSTEM_PROMPT);
            out.push_str("<|im_end|>\n");
        }
        let role_name = message.name_if_set().unwrap_or(&message.role);
        let class = match message.role.as_str() {
            "user" => "user",
            "assistant" => "assistant",
            _ => "system",
        };
        out.push_str("<|im_");
        out.push_str(class);
        out.push_str("|>");
        out.push_str(role_name);
        out.push_str("<|im_middle|>");
        let calls = message.tool_calls.as_deref().unwrap_or(&[]);
        if message.role == "assistant" && !calls.is_empty() {
            render_content(&mut out, &message.content);
            out.push_str("<|tool_calls_section_begin|>");
            for call in calls {
                let id = format!("functions.{}:{call_counter}", call.function.name);
                call_counter += 1;
                out.push_str("<|tool_call_begin|>");
                out.push_str(&id);
                out.push_str("<|tool_call_argument_begin|>");
                out.push_str(&call.function.arguments);
                out.push_str("<|tool_call_end|>");
                pending_ids.push_back(id);
            }
            out.push_str("<|tool_calls_section_end|>");
        } else if message.role == "tool" {
            let id = pending_ids.pop_front().unwrap_or_else(|| {
                format!(
                    "functions.{}:{call_counter}",
                    message.name.as_deref().unwrap_or("unknown")
                )
            });
            out.push_str("## Return of ");
            out.push_str(&id);
            out.push('\n');
            render_content(&mut out, &message.content);
        } else {
            render_content(&mut out, &message.content);
        }
        out.push_str("<|im_end|>");
    }
    if add_generation_prompt {
        out.push_str("<|im_assistant|>assistant<|im_middle|>");
    }
    out
}

/// The markers [`K2StreamParser`] recognises; the index names them in [`K2StreamParser::on_marker`].
pub const K2_MARKERS: &[&str] = &[
    "<|tool_calls_section_begin|>",
    "<|tool_call_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<think>",
    "</think>",
    "<|im_end|>",
];
const SECTION_BEGIN: usize = 0;
const SECTION_BEGIN_ALT: usize = 1;
const SECTION_END: usize = 2;
const SECTION_END_ALT: usize = 3;
const CALL_BEGIN: usize = 4;
const ARGUMENT_BEGIN: usize = 5;
const CALL_END: usize = 6;
const THINK_BEGIN: usize = 7;
const THINK_END: usize = 8;
const IM_END: usize = 9;

/// Where in the output the parser is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum K2State {
    /// Free text (content, or reasoning inside `<think>`).
    Text,
    /// Inside the tool-calls section, between calls.
    Section,
    /// After `<|tool_call_begin|>`: reading the call id.
    CallId(String),
    /// After `<|tool_call_argument_begin|>`: streaming the arguments.
    CallArgs(String),
    /// After `<|im_end|>`: everything else is ignored.
    Done,
}

/// Incremental parser of K2 output text.
#[derive(Debug, Clone)]
pub struct K2StreamParser {
    /// Finds markers across deltas.
    scanner: MarkerScanner,
    /// Current state.
    state: K2State,
    /// Inside `<think>…</think>`.
    in_think: bool,
    /// Text inside the section but outside calls, reported at the next marker if not blank.
    stray: String,
    /// Index the next tool call gets.
    next_index: usize,
}

impl Default for K2StreamParser {
    fn default() -> Self {
        K2StreamParser::new()
    }
}

impl K2StreamParser {
    /// A parser positioned at the start of an assistant turn, outside `<think>`.
    pub fn new() -> K2StreamParser {
        K2StreamParser {
            scanner: MarkerScanner::new(K2_MARKERS),
            state: K2State::Text,
            in_think: false,
            stray: String::new(),
            next_index: 0,
        }
    }

    /// A parser for prompts that already opened `<think>` (output starts as reasoning).
    pub fn in_reasoning() -> K2StreamParser {
        K2StreamParser {
            in_think: true,
            ..K2StreamParser::new()
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
        self.flush_stray(&mut events);
        match std::mem::replace(&mut self.state, K2State::Done) {
            K2State::CallId(id) => events.push(ParseEvent::Malformed {
                index: None,
                message: format!(
                    "stream ended inside the header of tool call `{}`",
                    id.trim()
                ),
            }),
            K2State::CallArgs(args) => {
                let index = self.next_index - 1;
                events.push(ParseEvent::Malformed {
                    index: Some(index),
                    message: format!("stream ended inside tool call {index}"),
                });
                check_arguments(index, &args, &mut events);
                events.push(ParseEvent::ToolCallEnd { index });
            }
            _ => {}
        }
        coalesce(events)
    }

    fn on_piece(&mut self, piece: Piece, events: &mut Vec<ParseEvent>) {
        match piece {
            Piece::Text(text) => self.on_text(text, events),
            Piece::Marker(m) => {
                self.flush_stray(events);
                self.on_marker(m, events);
            }
        }
    }

    fn on_text(&mut self, text: String, events: &mut Vec<ParseEvent>) {
        match &mut self.state {
            K2State::Text if self.in_think => events.push(ParseEvent::Reasoning(text)),
            K2State::Text => events.push(ParseEvent::Content(text)),
            K2State::Section => self.stray.push_str(&text),
            K2State::CallId(id) => id.push_str(&text),
            K2State::CallArgs(args) => {
                args.push_str(&text);
                events.push(ParseEvent::ToolCallArgs {
                    index: self.next_index - 1,
                    delta: text,
                });
            }
            K2State::Done => {}
        }
    }

    fn flush_stray(&mut self, events: &mut Vec<ParseEvent>) {
        let stray = std::mem::take(&mut self.stray);
        if !stray.trim().is_empty() {
            events.push(ParseEvent::Malformed {
                index: None,
                message: format!("text between tool calls: {}", json_string(&stray)),
            });
        }
    }

    fn on_marker(&mut self, marker: usize, events: &mut Vec<ParseEvent>) {
        let state = std::mem::replace(&mut self.state, K2State::Done);
        self.state = match (state, marker) {
            (K2State::Done, _) => K2State::Done,
            (K2State::CallId(id), IM_END) => {
                events.push(ParseEvent::Malformed {
                    index: None,
                    message: format!("turn ended inside the header of tool call `{}`", id.trim()),
                });
                K2State::Done
            }
            (K2State::CallArgs(args), IM_END) => {
                self.end_unterminated_call(&args, events);
                K2State::Done
            }
            (_, IM_END) => K2State::Done,
            (K2State::Text, SECTION_BEGIN | SECTION_BEGIN_ALT) => K2State::Section,
            (K2State::Text | K2State::Section, CALL_BEGIN) => K2State::CallId(String::new()),
            (K2State::Text, THINK_BEGIN) => {
                self.in_think = true;
                K2State::Text
            }
            (K2State::Text, THINK_END) => {
                self.in_think = false;
                K2State::Text
            }
            (K2State::Section, SECTION_END | SECTION_END_ALT) => K2State::Text,
            (K2State::CallId(id), ARGUMENT_BEGIN) => {
                self.start_call(&id, events);
                K2State::CallArgs(String::new())
            }
            (K2State::CallId(id), CALL_END) => {
                let index = self.start_call(&id, events);
                check_arguments(index, "", events);
                events.push(ParseEvent::ToolCallEnd { index });
                K2State::Section
            }
            (K2State::CallArgs(args), CALL_END) => {
                let index = self.next_index - 1;
                check_arguments(index, &args, events);
                events.push(ParseEvent::ToolCallEnd { index });
                K2State::Section
            }
            (K2State::CallArgs(args), SECTION_END | SECTION_END_ALT | CALL_BEGIN) => {
                self.end_unterminated_call(&args, events);
                if marker == CALL_BEGIN {
                    K2State::CallId(String::new())
                } else {
                    K2State::Text
                }
            }
            (state, marker) => {
                events.push(ParseEvent::Malformed {
                    index: None,
                    message: format!("unexpected {} here", K2_MARKERS[marker]),
                });
                state
            }
        };
    }

    /// Emits the start of a call with header `id`; returns its index.
    fn start_call(&mut self, id: &str, events: &mut Vec<ParseEvent>) -> usize {
        let id = id.trim();
        let index = self.next_index;
        self.next_index += 1;
        events.push(ParseEvent::ToolCallStart {
            index,
            id: id.to_string(),
            name: function_name(id).to_string(),
        });
        index
    }

    /// Closes the current call, which lacks its `<|tool_call_end|>`.
    fn end_unterminated_call(&mut self, args: &str, events: &mut Vec<ParseEvent>) {
        let index = self.next_index - 1;
        events.push(ParseEvent::Malformed {
            index: Some(index),
            message: format!("tool call {index} has no <|tool_call_end|>"),
        });
        check_arguments(index, args, events);
        events.push(ParseEvent::ToolCallEnd { index });
    }
}

/// Reports arguments that are not a JSON object.
fn check_arguments(index: usize, args: &str, events: &mut Vec<ParseEvent>) {
    match serde_json::from_str::<serde_json::Value>(args) {
        Ok(serde_json::Value::Object(_)) => {}
        Ok(_) => events.push(ParseEvent::Malformed {
            index: Some(index),
            message: format!("arguments of tool call {index} are not a JSON object"),
        }),
        Err(e) => events.push(ParseEvent::Malformed {
            index: Some(index),
            message: format!("arguments of tool call {index} are not valid JSON: {e}"),
        }),
    }
}

/// The function name in a K2 call id: `functions.get_weather:0` → `get_weather`.
pub fn function_name(id: &str) -> &str {
    let base = match id.rsplit_once(':') {
        Some((base, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => base,
        _ => id,
    };
    base.strip_prefix("functions.").unwrap_or(base)
}

impl super::StreamParser for K2StreamParser {
    fn push(&mut self, delta: &str) -> Vec<ParseEvent> {
        K2StreamParser::push(self, delta)
    }
    fn finish(&mut self) -> Vec<ParseEvent> {
        K2StreamParser::finish(self)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{ContentPart, ToolCall};
    use super::*;
    use crate::chat::toolcall::parse_in_pieces;
    use minijinja::{Environment, Value};

    const TEMPLATE: &str = include_str!("../../../tests/fixtures/templates/Kimi-K2-Instruct.jinja");

    /// Renders the published template with minijinja as `chat::render` sets
    /// it up. minijinja lists are immutable, so the template's two list
    /// mutations (`ids.append(x)`, `ids.pop(0)`) are rewritten into
    /// equivalent namespace assignments first.
    fn render_template(
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> String {
        let append = "{%- set _ = tool_response_queue.ids.append(formatted_id) -%}";
        let pop = "{%- set tool_call_id = tool_response_queue.ids.pop(0) -%}";
        assert!(
            TEMPLATE.contains(append) && TEMPLATE.contains(pop),
            "template changed"
        );
        let source = TEMPLATE
            .replace(append, "{%- set tool_response_queue.ids = tool_response_queue.ids + [formatted_id] -%}")
            .replace(pop, "{%- set tool_call_id = tool_response_queue.ids[0] -%}{%- set tool_response_queue.ids = tool_response_queue.ids[1:] -%}");
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template("chat", &source).unwrap();
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            // The template's `tojson` sees the keys in the order `render` passes
            // them ([`crate::chat::sort_keys`]).
            tools => tools.map(|t| Value::from_serialize(t.iter().map(crate::chat::sort_keys).collect::<Vec<_>>())),
            add_generation_prompt => add_generation_prompt,
        };
        env.get_template("chat").unwrap().render(ctx).unwrap()
    }

    fn weather_tool() -> serde_json::Value {
        serde_json::json!({"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}, "days": {"type": "integer"}}, "required": ["city"]}}})
    }

    fn tool_conversation() -> Vec<Message> {
        vec![
            Message::text("system", "You are a helpful assistant."),
            Message::text("user", "Weather in Paris and Rome?"),
            Message::assistant_with_calls(
                Some("Let me check."),
                vec![
                    ToolCall::function("call_a", "get_weather", r#"{"city": "Paris", "days": 2}"#),
                    ToolCall::function("call_b", "get_weather", r#"{"city":"Rome"}"#),
                ],
            ),
            Message::tool_result("call_a", "Rain, 14C"),
            Message {
                name: Some("get_weather".into()),
                ..Message::tool_result("call_b", "Sunny, 25C")
            },
            Message::text("assistant", "Paris: rain. Rome: sunny."),
            Message::text("user", "And Oslo?"),
            Message::assistant_with_calls(
                None,
                vec![ToolCall::function(
                    "call_c",
                    "get_weather",
                    r#"{"city":"Oslo"}"#,
                )],
            ),
            Message::tool_result("call_c", "Snow"),
        ]
    }

    #[test]
    fn renders_like_the_published_template_with_tools_and_results() {
        let tools = [weather_tool()];
        let messages = tool_conversation();
        for add in [true, false] {
            assert_eq!(
                render_k2(&messages, Some(&tools), add),
                render_template(&messages, Some(&tools), add)
            );
        }
        let out = render_k2(&messages, Some(&tools), true);
        assert!(out.starts_with("<|im_system|>tool_declare<|im_middle|>[{\"function\":{\"description\":\"Get the weather for a city\",\"name\":\"get_weather\""));
        assert!(out.contains("<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{\"city\":\"Rome\"}<|tool_call_end|>"));
        assert!(out.contains("<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:1\nSunny, 25C<|im_end|>"));
        assert!(
            out.contains("## Return of functions.get_weather:2\nSnow"),
            "ids count calls over the whole conversation"
        );
        assert!(out.ends_with("<|im_end|><|im_assistant|>assistant<|im_middle|>"));
    }

    #[test]
    fn renders_like_the_published_template_without_system_or_tools() {
        let messages = vec![
            Message::text("user", "Hi"),
            Message {
                name: Some("kimi".into()),
                ..Message::text("assistant", "Hello!")
            },
            Message {
                content: Some(MessageContent::Parts(vec![
                    ContentPart::text("Look:"),
                    ContentPart::image_url("http://x/y.png"),
                    ContentPart::text("ok?"),
                ])),
                ..Message::text("user", "")
            },
            Message {
                name: Some("lookup".into()),
                ..Message::text("tool", "orphan result")
            },
        ];
        let ours = render_k2(&messages, None, true);
        assert_eq!(ours, render_template(&messages, None, true));
        assert_eq!(
            render_k2(&messages, Some(&[]), true),
            ours,
            "an empty tools list declares nothing"
        );
        assert!(ours.starts_with("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>\n<|im_user|>user<|im_middle|>Hi<|im_end|>"));
        assert!(ours.contains("## Return of functions.lookup:0\norphan result"));
        assert_eq!(render_k2(&[], None, true), render_template(&[], None, true));
    }

    /// A recorded-style K2 output: reasoning, text, two calls (one with a
    /// multi-byte argument), end of turn.
    const OUTPUT: &str = "<think>User wants weather. Call the tool twice.</think>Sure — checking.<|tool_calls_section_begin|>\
<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>\
<|tool_call_begin|> functions.get_weather:1 <|tool_call_argument_begin|>{\"city\": \"Zürich\", \"days\": 3}<|tool_call_end|>\
<|tool_calls_section_end|><|im_end|>";

    fn expected() -> Vec<ParseEvent> {
        vec![
            ParseEvent::Reasoning("User wants weather. Call the tool twice.".into()),
            ParseEvent::Content("Sure — checking.".into()),
            ParseEvent::ToolCallStart {
                index: 0,
                id: "functions.get_weather:0".into(),
                name: "get_weather".into(),
            },
            ParseEvent::ToolCallArgs {
                index: 0,
                delta: "{\"city\": \"Paris\"}".into(),
            },
            ParseEvent::ToolCallEnd { index: 0 },
            ParseEvent::ToolCallStart {
                index: 1,
                id: "functions.get_weather:1".into(),
                name: "get_weather".into(),
            },
            ParseEvent::ToolCallArgs {
                index: 1,
                delta: "{\"city\": \"Zürich\", \"days\": 3}".into(),
            },
            ParseEvent::ToolCallEnd { index: 1 },
        ]
    }

    #[test]
    fn parses_reasoning_content_and_calls() {
        assert_eq!(
            parse_in_pieces(K2StreamParser::new(), OUTPUT, std::iter::empty()),
            expected()
        );
    }

    #[test]
    fn every_split_gives_the_same_events() {
        let want = expected();
        for size in [1, 2, 3, 7] {
            assert_eq!(
                parse_in_pieces(K2StreamParser::new(), OUTPUT, std::iter::repeat(size)),
                want,
                "pieces of {size}"
            );
        }
        let n = OUTPUT.chars().count();
        for cut in 0..=n {
            assert_eq!(
                parse_in_pieces(K2StreamParser::new(), OUTPUT, [cut, n].into_iter()),
                want,
                "cut at {cut}"
            );
        }
        let mut rng = caracal_kernels::testing::Rng::seeded(42);
        for _ in 0..50 {
            let sizes = std::iter::from_fn(|| Some(1 + ((rng.next_u64() >> 33) % 12) as usize));
            assert_eq!(
                parse_in_pieces(K2StreamParser::new(), OUTPUT, sizes.take(1000)),
                want
            );
        }
    }

    #[test]
    fn a_stream_ending_mid_marker_releases_it_as_content() {
        let mut p = K2StreamParser::new();
        let mut events = p.push("Answer <|tool_calls_sec");
        assert_eq!(events, vec![ParseEvent::Content("Answer ".into())]);
        events.extend(p.finish());
        assert_eq!(
            coalesce(events),
            vec![ParseEvent::Content("Answer <|tool_calls_sec".into())]
        );
        // A prefix that turns out not to be a marker is released at once.
        let mut p = K2StreamParser::new();
        assert_eq!(p.push("a <thin"), vec![ParseEvent::Content("a ".into())]);
        assert_eq!(p.push("g>"), vec![ParseEvent::Content("<thing>".into())]);
    }

    #[test]
    fn malformed_arguments_are_reported_not_panicked_on() {
        let text = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": <|tool_call_end|>\
<|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>[1]<|tool_call_end|>junk<|tool_calls_section_end|>";
        let events = parse_in_pieces(K2StreamParser::new(), text, std::iter::repeat(1));
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
        assert_eq!(malformed, vec![Some(0), Some(1), None]);
        assert!(
            events.contains(&ParseEvent::ToolCallEnd { index: 0 })
                && events.contains(&ParseEvent::ToolCallEnd { index: 1 })
        );
        // A stream cut inside the arguments still closes the call.
        let events = parse_in_pieces(K2StreamParser::new(), "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\"", std::iter::repeat(3));
        assert_eq!(events.last(), Some(&ParseEvent::ToolCallEnd { index: 0 }));
        assert!(events
            .iter()
            .any(|e| matches!(e, ParseEvent::Malformed { index: Some(0), .. })));
        // Stray markers in plain text.
        let events = parse_in_pieces(
            K2StreamParser::new(),
            "x<|tool_call_end|>y<|tool_call_argument_begin|>",
            std::iter::repeat(2),
        );
        assert_eq!(
            events
                .iter()
                .filter(|e| matches!(e, ParseEvent::Malformed { .. }))
                .count(),
            2
        );
    }

    #[test]
    fn in_reasoning_parser_starts_in_think() {
        let events = parse_in_pieces(
            K2StreamParser::in_reasoning(),
            "hmm</think>Yes.<|im_end|>ignored",
            std::iter::repeat(2),
        );
        assert_eq!(
            events,
            vec![
                ParseEvent::Reasoning("hmm".into()),
                ParseEvent::Content("Yes.".into())
            ]
        );
    }

    #[test]
    fn function_names_come_from_call_ids() {
        assert_eq!(function_name("functions.get_weather:0"), "get_weather");
        assert_eq!(function_name("functions.ns.tool:12"), "ns.tool");
        assert_eq!(function_name("search"), "search");
        assert_eq!(function_name("a:b"), "a:b");
    }

    #[test]
    fn video_parts_render_their_chunk_prompts_and_unresolved_ones_nothing() {
        let chunks = "00:00:00.000<|media_begin|>video<|media_content|><|media_pad|><|media_end|>\
                      00:00:02.000<|media_begin|>video<|media_content|><|media_pad|><|media_end|>";
        let messages = vec![Message {
            content: Some(MessageContent::Parts(vec![
                ContentPart::video(chunks.into()),
                ContentPart::video_url("data:video/mp4;base64,AAAA", Some(1.0)),
                ContentPart::text("What happens?"),
            ])),
            ..Message::text("user", "")
        }];
        let out = render_k2(&messages, None, true);
        assert!(out.contains(&format!("{chunks}What happens?")), "{out}");
        assert_eq!(out.matches("<|media_pad|>").count(), 2, "{out}");
    }
}
