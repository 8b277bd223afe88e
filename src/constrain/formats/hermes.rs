//! Hermes tool calls (SmolLM2, Qwen and other ChatML templates): grammar
//! and parser.
//!
//! ```text
//! [text] <tool_call>\n{"name":"NAME","arguments":{…}}\n</tool_call>[\n<tool_call>…</tool_call>]…
//! ```
//!
//! `<tool_call>` / `</tool_call>` are special tokens where the vocabulary
//! has them, text otherwise (SmolLM2). Lazy (`auto`): any text not
//! containing `<tool_call>`, or text up to the first `<tool_call>` and the
//! calls after it; immediate: the calls first. [`parse`] reads the model's
//! text back: the JSON of each call is parsed as a value (so a
//! `</tool_call>` inside a string does not end it).

use serde_json::Value;

use super::ToolDecl;
use crate::constrain::lark::{
    free_text_terminal, json_rule, lit, regex_escape, JsonLayout, Marker,
};
use crate::constrain::{CompileError, TokenEnv};

/// Opens a call.
pub const OPEN: &str = "<tool_call>";
/// Closes a call.
pub const CLOSE: &str = "</tool_call>";

/// The Hermes grammar for `tools`.
pub fn grammar(
    tools: &[&ToolDecl],
    env: &TokenEnv,
    lazy: bool,
    max_calls: usize,
) -> Result<String, CompileError> {
    let open = Marker::special_or_text(env, OPEN);
    let close = Marker::special_or_text(env, CLOSE);
    let mut g = String::from("%llguidance {}\n");
    if lazy {
        match &open {
            Marker::Special { .. } => {
                g.push_str(&format!("start: TEXT | TEXT {} first_rest\n", open.lark()));
            }
            Marker::Text(t) => {
                // The head ends at the first `<tool_call>` (lazy), so the text
                // alternative and the call alternative never overlap.
                g.push_str("start: TEXT | head first_rest\n");
                g.push_str(&format!("head[lazy]: /(?s:.*){}/\n", regex_escape(t)));
            }
        }
        g.push_str(&free_text_terminal("TEXT", &[OPEN]));
    } else {
        g.push_str(&format!("start: {} first_rest\n", open.lark()));
    }
    g.push_str(&format!("first_rest: {} body {}", lit("\n"), lit("\n")));
    g.push_str(&format!(" {}", close.lark()));
    if max_calls > 1 {
        g.push_str(&format!(" more{{0,{}}}", max_calls - 1));
    }
    g.push('\n');
    g.push_str(&format!(
        "more: {} {} {} body {} {}\n",
        lit("\n"),
        open.lark(),
        lit("\n"),
        lit("\n"),
        close.lark()
    ));
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("t{i}")).collect();
    g.push_str(&format!("body: {}\n", alts.join(" | ")));
    for (i, tool) in tools.iter().enumerate() {
        let head = format!(
            "{{\"name\":{},\"arguments\":",
            serde_json::to_string(&tool.name).expect("a str always serialises")
        );
        g.push_str(&format!("t{i}: {} args_{i} {}\n", lit(&head), lit("}")));
        g.push_str(&format!(
            "args_{i}: {}\n",
            json_rule(&tool.parameters, JsonLayout::Compact)
        ));
    }
    Ok(g)
}

/// One call read back from Hermes output.
#[derive(Debug, Clone, PartialEq)]
pub struct HermesCall {
    /// The function name.
    pub name: String,
    /// The arguments object.
    pub arguments: Value,
}

/// What [`parse`] found.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HermesOutput {
    /// Text before the first call.
    pub content: String,
    /// The calls, in order.
    pub calls: Vec<HermesCall>,
    /// What was malformed (empty for well-formed output).
    pub errors: Vec<String>,
}

/// Parses complete Hermes output text.
pub fn parse(text: &str) -> HermesOutput {
    let mut out = HermesOutput::default();
    let Some(first) = text.find(OPEN) else {
        out.content = text.to_string();
        return out;
    };
    out.content = text[..first].to_string();
    let mut rest = &text[first..];
    while let Some(after) = rest.strip_prefix(OPEN) {
        let body = after.trim_start();
        let mut values = serde_json::Deserializer::from_str(body).into_iter::<Value>();
        let value = match values.next() {
            Some(Ok(v)) => v,
            Some(Err(e)) => {
                out.errors
                    .push(format!("call {}: not JSON: {e}", out.calls.len()));
                return out;
            }
            None => {
                out.errors.push(format!("call {}: empty", out.calls.len()));
                return out;
            }
        };
        let after_json = body[values.byte_offset()..].trim_start();
        match call_of(&value) {
            Ok(call) => out.calls.push(call),
            Err(e) => out.errors.push(format!("call {}: {e}", out.calls.len())),
        }
        let Some(next) = after_json.strip_prefix(CLOSE) else {
            out.errors
                .push(format!("call {} has no {CLOSE}", out.calls.len()));
            return out;
        };
        let trimmed = next.trim_start();
        if trimmed.is_empty() {
            return out;
        }
        if !trimmed.starts_with(OPEN) {
            out.errors
                .push(format!("text after the calls: {:?}", trimmed));
            return out;
        }
        rest = trimmed;
    }
    out
}

fn call_of(v: &Value) -> Result<HermesCall, String> {
    let name = v
        .get("name")
        .and_then(Value::as_str)
        .ok_or("no `name` string")?;
    let arguments = match v.get("arguments") {
        Some(a @ Value::Object(_)) => a.clone(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(a @ Value::Object(_)) => a,
            _ => return Err("`arguments` string is not a JSON object".into()),
        },
        _ => return Err("no `arguments` object".into()),
    };
    Ok(HermesCall {
        name: name.to_string(),
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_calls_and_keeps_markers_inside_strings() {
        let text = "Sure.<tool_call>\n{\"name\":\"f\",\"arguments\":{\"a\":\"</tool_call>\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": \"{\\\"b\\\": 1}\"}\n</tool_call>";
        let out = parse(text);
        assert_eq!(out.errors, Vec::<String>::new());
        assert_eq!(out.content, "Sure.");
        assert_eq!(
            out.calls,
            vec![
                HermesCall {
                    name: "f".into(),
                    arguments: json!({"a": "</tool_call>"})
                },
                HermesCall {
                    name: "g".into(),
                    arguments: json!({"b": 1})
                },
            ]
        );
    }

    #[test]
    fn reports_malformed_calls() {
        assert_eq!(parse("just text").calls.len(), 0);
        assert!(parse("just text").errors.is_empty());
        assert!(!parse("<tool_call>{\"name\":\"f\"}</tool_call>")
            .errors
            .is_empty());
        assert!(!parse("<tool_call>{\"name\":\"f\",\"arguments\":{}}")
            .errors
            .is_empty());
        assert!(!parse("<tool_call>{nope</tool_call>").errors.is_empty());
        assert!(
            !parse("<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call> tail")
                .errors
                .is_empty()
        );
    }
}
