//! Tool-call grammars in each model family's own format.
//!
//! Every builder turns a [`ToolsSpec`] into one Lark grammar whose language
//! is a subset of what that format's parser reads back as well-formed calls:
//!
//! - [`kimi_k2`]: what [`crate::chat::toolcall::K2StreamParser`] parses;
//! - [`kimi_k3`]: what [`crate::chat::toolcall::K3StreamParser`] parses;
//! - [`hermes`]: what the gateway's [`crate::chat::toolcall::HermesStreamParser`] parses.
//!
//! Shared rules: tool names are only the declared ones (only the named one
//! under `tool_choice: {"function": …}`), each call's arguments follow that
//! tool's `parameters` schema, one call or up to
//! [`super::ConstraintLimits::max_parallel_calls`] per
//! `parallel_tool_calls`, and free text can never spell a control marker.
//!
//! JSON string values inside K2 arguments and K3 non-string arguments
//! cannot spell a marker either ([`super::lark::guard_json_strings`]):
//! those parsers scan the text for markers, so a string that spelled
//! `<|tool_call_end|>` with plain tokens would end the call inside it.
//! (The Hermes parser reads whole JSON values and is immune; K3's raw
//! string arguments exclude markers by their own terminal.) Still
//! unguarded: strings under untyped schemas (`{}`, `type` lists), keys of
//! objects open to undeclared properties, and `enum`/`const` values.

pub mod hermes;
pub mod kimi_k2;
pub mod kimi_k3;
mod xtml_args;

#[cfg(test)]
mod tests;

pub use super::spec::ToolDecl;
use super::spec::{ToolChoice, ToolFormat, ToolsSpec};
use super::{schema, CompileError, TokenEnv};

/// The Lark grammar of `spec`; `max_calls` bounds parallel calls.
pub fn tools_grammar(
    spec: &ToolsSpec,
    env: &TokenEnv,
    max_calls: usize,
) -> Result<String, CompileError> {
    if spec.choice == ToolChoice::None {
        return Err(CompileError::InvalidField {
            field: "tool_choice",
            detail: "`none` allows no calls, so there is nothing to constrain".into(),
        });
    }
    let tools = spec.callable();
    if tools.is_empty() {
        return Err(CompileError::InvalidField {
            field: "tools",
            detail: "no tool can be called".into(),
        });
    }
    for t in &tools {
        schema::check(&format!("tool {}", t.name), &t.parameters)?;
    }
    let max_calls = if spec.parallel { max_calls.max(1) } else { 1 };
    let lazy = spec.choice == ToolChoice::Auto;
    match spec.format {
        ToolFormat::KimiK2 {
            first_call_index,
            thinking,
        } => kimi_k2::grammar(&tools, env, lazy, thinking, first_call_index, max_calls),
        ToolFormat::KimiK3 { thinking } => kimi_k3::grammar(&tools, env, lazy, thinking, max_calls),
        ToolFormat::Hermes => hermes::grammar(&tools, env, lazy, max_calls),
    }
}

/// Appends `calls: …` where call `k` (0-based) is the rule `call(k)` and
/// calls `0..n` are one required call then optional further ones, in order.
pub(crate) fn call_sequence(
    out: &mut String,
    name: &str,
    n: usize,
    call: impl Fn(usize) -> String,
) {
    // calls_k: call_k calls_{k+1}? ; the last has no tail.
    for k in (0..n).rev() {
        let head = call(k);
        if k + 1 < n {
            out.push_str(&format!("{name}_{k}: {head} | {head} {name}_{}\n", k + 1));
        } else {
            out.push_str(&format!("{name}_{k}: {head}\n"));
        }
    }
    out.push_str(&format!("{name}: {name}_0\n"));
}
