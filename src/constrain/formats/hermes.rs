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
