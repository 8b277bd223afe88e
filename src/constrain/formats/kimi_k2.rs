//! Kimi K2 tool-call grammar (K2, K2.5, Kimi-Linear).
//!
//! ```text
//! [reasoning </think>] [text] <|tool_calls_section_begin|>
//!   <|tool_call_begin|>functions.{name}:{n}<|tool_call_argument_begin|>{json}<|tool_call_end|> …
//! <|tool_calls_section_end|>
//! ```
//!
//! Markers are K2's special tokens; `n` counts from the spec's
//! `first_call_index` (the chat template numbers calls over the whole
//! conversation). Arguments are compact JSON under the tool's schema.
//! Lazy (`auto`): any text, then optionally the section; immediate:
//! the section first. Text and reasoning never spell a K2 marker, and
//! neither do string values of the arguments
//! ([`crate::constrain::lark::guard_json_strings`]): the parser scans the
//! arguments for markers as text, so a string that spelled
//! `<|tool_call_end|>` with plain tokens would end the call there.

use super::{call_sequence, ToolDecl};
use crate::constrain::lark::{
    free_text_terminal, guard_json_strings, json_rule, lit, JsonLayout, Marker, NO_K2_MARKER,
};
use crate::constrain::{CompileError, TokenEnv};

/// The marker texts [`crate::chat::toolcall::K2StreamParser`] acts on.
pub const K2_MARKER_TEXTS: [&str; 10] = [
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

/// The K2 grammar for `tools`.
pub fn grammar(
    tools: &[&ToolDecl],
    env: &TokenEnv,
    lazy: bool,
    thinking: bool,
    first_call_index: usize,
    max_calls: usize,
) -> Result<String, CompileError> {
    let section_begin = Marker::special(env, "<|tool_calls_section_begin|>")?;
    let section_end = Marker::special(env, "<|tool_calls_section_end|>")?;
    let call_begin = Marker::special(env, "<|tool_call_begin|>")?;
    let arg_begin = Marker::special(env, "<|tool_call_argument_begin|>")?;
    let call_end = Marker::special(env, "<|tool_call_end|>")?;
    let mut g = String::from("%llguidance {}\n");
    let prefix = if thinking {
        let think_end = Marker::special(env, "</think>")?;
        format!("REASONING {} ", think_end.lark())
    } else {
        String::new()
    };
    if lazy {
        g.push_str(&format!("start: {prefix}TEXT | {prefix}TEXT section\n"));
        g.push_str(&free_text_terminal("TEXT", &K2_MARKER_TEXTS));
    } else {
        g.push_str(&format!("start: {prefix}section\n"));
    }
    if thinking {
        g.push_str(&free_text_terminal("REASONING", &K2_MARKER_TEXTS));
    }
    g.push_str(&format!(
        "section: {} calls {}\n",
        section_begin.lark(),
        section_end.lark()
    ));
    call_sequence(&mut g, "calls", max_calls, |k| format!("call_{k}"));
    for k in 0..max_calls {
        let alts: Vec<String> = (0..tools.len()).map(|i| format!("t{i}_{k}")).collect();
        g.push_str(&format!("call_{k}: {}\n", alts.join(" | ")));
        for (i, tool) in tools.iter().enumerate() {
            let id = format!("functions.{}:{}", tool.name, first_call_index + k);
            g.push_str(&format!(
                "t{i}_{k}: {} {} {} args_{i} {}\n",
                call_begin.lark(),
                lit(&id),
                arg_begin.lark(),
                call_end.lark()
            ));
        }
    }
    for (i, tool) in tools.iter().enumerate() {
        g.push_str(&format!(
            "args_{i}: {}\n",
            json_rule(
                &guard_json_strings(&tool.parameters, NO_K2_MARKER),
                JsonLayout::Compact
            )
        ));
    }
    Ok(g)
}
