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
//! [`super::K3StreamParser`] (in `kimi_k3_parser`) parses the model's output.

use super::{write_json, JsonStyle, KeyOrder, Message, MessageContent, OrderedJson};
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
        K3Options {
            thinking: true,
            thinking_effort: Some(ThinkingEffort::Max),
            tool_choice: ToolChoice::Auto,
            expand_json_arguments: true,
        }
    }
}

/// Escapes an attribute value (`&` then `"`).
pub(crate) fn escape_attr(v: &str) -> String {
    v.replace('&', "&amp;").replace('"', "&quot;")
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
                if matches!(part.kind.as_str(), "image" | "image_url" | "input_image") {
                    out.push_str("<|kimi_image_placeholder|>");
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
        if let Some(reasoning) = message
            .reasoning_content
            .as_deref()
            .filter(|r| !r.trim().is_empty())
        {
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
        open_tag(
            out,
            "call",
            &[
                ("tool", &call.function.name),
                ("index", &(i + 1).to_string()),
            ],
        );
        let args = &call.function.arguments;
        let expanded = if options.expand_json_arguments {
            OrderedJson::parse(args).ok()
        } else {
            None
        };
        match expanded {
            Some(OrderedJson::Object(entries)) => {
                for (key, value) in &entries {
                    open_tag(
                        out,
                        "argument",
                        &[("key", key), ("type", value.xtml_type())],
                    );
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

fn render_tool_message(
    out: &mut String,
    message: &Message,
    state: &mut ToolState,
    resolved_name: Option<&str>,
) -> Result<()> {
    state.index += 1;
    let fallback = || {
        state
            .calls
            .and_then(|c| c.get(state.index - 1))
            .map(|c| c.function.name.as_str())
    };
    let name = resolved_name.or(message.name.as_deref()).or_else(fallback).ok_or_else(|| {
        Error::Template(format!(
            "Kimi K3 tool message {} needs a resolvable tool name: give it `name`, or match a preceding assistant tool_call",
            state.index
        ))
    })?;
    let index = state.index.to_string();
    open_tag(
        out,
        "message",
        &[("role", "tool"), ("tool", name), ("index", &index)],
    );
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
    let resolved = run
        .iter()
        .filter(|m| calls.iter().any(|c| matches(m, &c.id)))
        .count();
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
pub fn render_k3(
    messages: &[Message],
    tools: Option<&[serde_json::Value]>,
    add_generation_prompt: bool,
    options: &K3Options,
) -> Result<String> {
    let mut out = String::new();
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        open_tag(
            &mut out,
            "message",
            &[("role", "system"), ("type", "tool-declare")],
        );
        out.push_str(
            "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n",
        );
        let list = OrderedJson::Array(tools.iter().map(OrderedJson::from).collect());
        write_json(
            &mut out,
            &list,
            JsonStyle::Compact,
            KeyOrder::SortedIgnoreCase,
        );
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
    let mut state = ToolState {
        calls: None,
        index: 0,
    };
    for (i, message) in messages.iter().enumerate() {
        match message.role.as_str() {
            "user" | "system" => plain_message(&mut out, message),
            "assistant" => {
                state = ToolState {
                    calls: message.tool_calls.as_deref(),
                    index: 0,
                };
                let mut attrs = vec![("role", "assistant")];
                if let Some(name) = message.name_if_set() {
                    attrs.push(("name", name));
                }
                open_tag(&mut out, "message", &attrs);
                render_assistant(&mut out, message, options);
                close_tag(&mut out, "message");
                out.push_str("<|end_of_msg|>");
            }
            "tool" if i == 0 || messages[i - 1].role != "tool" => {
                render_tool_run(&mut out, &messages[i..], &mut state)?
            }
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
        open_tag(
            &mut out,
            if options.thinking {
                "think"
            } else {
                "response"
            },
            &[],
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::{ContentPart, ToolCall};
    use super::*;
    use minijinja::value::Kwargs;
    use minijinja::{Environment, ErrorKind, Value};

    const TEMPLATE: &str = include_str!("../../../tests/fixtures/templates/Kimi-K3.jinja");

    /// `json.dumps`' default layout: `", "` between items, `": "` after keys.
    struct PythonFormatter;
    impl serde_json::ser::Formatter for PythonFormatter {
        fn begin_array_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
        ) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }

    /// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False)`,
    /// no HTML escaping (minijinja's built-in escapes `<>&'` and rejects `ensure_ascii`).
    fn python_tojson(
        value: &Value,
        kwargs: Kwargs,
    ) -> std::result::Result<Value, minijinja::Error> {
        let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
        assert_ne!(
            ensure_ascii,
            Some(true),
            "ensure_ascii=True is not emulated"
        );
        kwargs.assert_all_used()?;
        let mut out = Vec::new();
        serde::Serialize::serialize(
            value,
            &mut serde_json::Serializer::with_formatter(&mut out, PythonFormatter),
        )
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
        Ok(Value::from_safe_string(
            String::from_utf8(out).expect("serde_json writes UTF-8"),
        ))
    }

    fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
        Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
    }

    /// A message as the template sees it; with `expand`, each call's
    /// arguments string is given as the (order-keeping) parsed object.
    fn template_message(m: &Message, expand: bool) -> Value {
        let serde_json::Value::Object(map) = serde_json::to_value(m).unwrap() else {
            unreachable!()
        };
        let mut entries: Vec<(String, Value)> = map
            .iter()
            .filter(|(k, _)| *k != "tool_calls")
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
            .collect();
        if let Some(calls) = &m.tool_calls {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    let args = match OrderedJson::parse(&c.function.arguments) {
                        Ok(parsed @ OrderedJson::Object(_)) if expand => {
                            Value::from_serialize(&parsed)
                        }
                        _ => Value::from(c.function.arguments.clone()),
                    };
                    let function = Value::from_iter([
                        ("name".to_string(), Value::from(c.function.name.clone())),
                        ("arguments".to_string(), args),
                    ]);
                    Value::from_iter([
                        ("id".to_string(), Value::from(c.id.clone())),
                        ("type".to_string(), Value::from("function")),
                        ("function".to_string(), function),
                    ])
                })
                .collect();
            entries.push(("tool_calls".into(), Value::from(calls)));
        }
        Value::from_iter(entries)
    }

    /// Renders the published template with minijinja (set up as `chat::render`
    /// does, plus transformers' `tojson`).
    fn render_template(
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        add: bool,
        o: &K3Options,
    ) -> std::result::Result<String, minijinja::Error> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", python_tojson);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template("chat", TEMPLATE).unwrap();
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| template_message(m, o.expand_json_arguments))
            .collect();
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
                        ToolCall::function(
                            "call_a",
                            "get_weather",
                            r#"{"city": "Paris", "days": 2, "opts": {"unit": "C", "hourly": [1, 2.5]}, "strict": true, "note": null}"#,
                        ),
                        ToolCall::function("call_b", "get_weather", r#"{"city":"Rome"}"#),
                        ToolCall::function(
                            "call_c",
                            "search",
                            r#"{"we\"ird&key": "x & y", "q": "multi\nline"}"#,
                        ),
                    ],
                )
            },
            // Results out of call order: rendered in call order, named by their calls.
            Message::tool_result("call_b", "Sunny, 25C"),
            Message::tool_result("call_c", "3 results"),
            Message::tool_result("call_a", "Rain, 14C"),
            Message::text("assistant", "Paris: rain. Rome: sunny."),
            Message {
                name: Some("alice".into()),
                ..Message::text("user", "Thanks!")
            },
        ]
    }

    #[test]
    fn renders_like_the_published_template_with_tools_and_results() {
        let tools = tools();
        let messages = tool_conversation();
        for expand in [true, false] {
            for add in [true, false] {
                let o = K3Options {
                    expand_json_arguments: expand,
                    ..K3Options::default()
                };
                assert_eq!(
                    render_k3(&messages, Some(&tools), add, &o).unwrap(),
                    render_template(&messages, Some(&tools), add, &o).unwrap(),
                    "expand {expand} add {add}"
                );
            }
        }
        let out = render_k3(&messages, Some(&tools), true, &K3Options::default()).unwrap();
        assert!(out
            .starts_with("<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\n"));
        assert!(out.contains("\"properties\":{\"city\":{\"description\":\"City name\",\"type\":\"string\"},\"Days\":{\"minimum\":1,\"type\":\"integer\"}}"), "dictsort ignores case");
        assert!(out.contains("<|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key=\"days\" type=\"number\"<|sep|>2<|close|>argument<|sep|><|open|>argument key=\"opts\" type=\"object\"<|sep|>{\"unit\": \"C\", \"hourly\": [1, 2.5]}<|close|>argument<|sep|>"));
        assert!(out.contains("<|open|>argument key=\"we&quot;ird&amp;key\" type=\"string\"<|sep|>x & y<|close|>argument<|sep|>"));
        assert!(out.contains("<|open|>message role=\"tool\" tool=\"get_weather\" index=\"1\"<|sep|>Rain, 14C<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"tool\" tool=\"get_weather\" index=\"2\"<|sep|>Sunny, 25C"));
        assert!(
            out.contains(
                "<|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>Paris: rain."
            ),
            "history keeps an empty think channel"
        );
        assert!(out.ends_with(
            "<|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"
        ));
    }

    #[test]
    fn renders_like_the_published_template_without_thinking() {
        let messages = vec![
            Message {
                name: Some("ops".into()),
                ..Message::text("system", "Be brief.")
            },
            Message {
                content: Some(MessageContent::Parts(vec![
                    ContentPart::text("What is "),
                    ContentPart::image_url("http://x/y.png"),
                    ContentPart::text("?"),
                ])),
                ..Message::text("user", "")
            },
            Message {
                reasoning_content: Some("hidden".into()),
                ..Message::assistant_with_calls(
                    None,
                    vec![
                        ToolCall::function("1", "lookup", ""),
                        ToolCall::function("2", "fetch", r#"{"url": "http://a/?b=1&c=2"}"#),
                    ],
                )
            },
            // No ids: names come from the message, else from the calls by position.
            Message {
                name: Some("lookup".into()),
                ..Message::text("tool", "a")
            },
            Message::text("tool", "b"),
            Message::text("user", "ok"),
        ];
        let o = K3Options {
            thinking: false,
            thinking_effort: None,
            tool_choice: ToolChoice::Required,
            expand_json_arguments: true,
        };
        let ours = render_k3(&messages, None, true, &o).unwrap();
        assert_eq!(ours, render_template(&messages, None, true, &o).unwrap());
        assert!(!ours.contains("think"));
        assert!(ours.contains("<|open|>message role=\"tool\" tool=\"fetch\" index=\"2\"<|sep|>b"));
        assert!(ours.ends_with("<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>"));
        let o = K3Options {
            thinking_effort: Some(ThinkingEffort::Low),
            tool_choice: ToolChoice::None,
            ..K3Options::default()
        };
        assert_eq!(
            render_k3(&messages, Some(&tools()), false, &o).unwrap(),
            render_template(&messages, Some(&tools()), false, &o).unwrap()
        );
        assert_eq!(
            render_k3(&[], None, true, &K3Options::default()).unwrap(),
            render_template(&[], None, true, &K3Options::default()).unwrap()
        );
    }

    #[test]
    fn a_tool_result_without_a_name_is_an_error_like_the_template() {
        let messages = vec![Message::text("user", "hi"), Message::text("tool", "orphan")];
        let err = render_k3(&messages, None, true, &K3Options::default()).unwrap_err();
        assert!(err.to_string().contains("resolvable tool name"), "{err}");
        assert!(render_template(&messages, None, true, &K3Options::default()).is_err());
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
        let out = render_k3(&messages, None, true, &K3Options::default()).unwrap();
        assert!(out.contains(&format!("{chunks}What happens?")), "{out}");
        assert_eq!(out.matches("<|media_pad|>").count(), 2, "{out}");
    }
}
