//! Kimi K3 XTML tool-call grammar.
//!
//! After the generation prompt (`<|open|>message role="assistant"<|sep|>`
//! and `<|open|>think<|sep|>` or `<|open|>response<|sep|>`):
//!
//! ```text
//! [reasoning <|close|>think<|sep|>[\n]<|open|>response<|sep|>] text <|close|>response<|sep|>
//! <|open|>tools<|sep|>
//!   <|open|>call tool="NAME" index="1"<|sep|>
//!     <|open|>argument key="k" type="string"<|sep|>raw text<|close|>argument<|sep|> …
//!   <|close|>call<|sep|> …
//! <|close|>tools<|sep|>
//! <|close|>message<|sep|>            (then <|end_of_msg|>, the end token)
//! ```
//!
//! Indices count from 1 within the message. Arguments are one `argument`
//! element per property of the tool's schema ([`super::xtml_args`]), or one
//! `json type="object"` element when the schema is not a plain object of
//! properties. Lazy (`auto`): the response channel holds any text and the
//! tools block is optional; immediate: the response is empty and the tools
//! block follows. Channel text never spells an XTML marker.

use super::{call_sequence, xtml_args, ToolDecl};
use crate::chat::toolcall::kimi_k3::escape_attr;
use crate::constrain::lark::{free_text_terminal, lit, Marker};
use crate::constrain::{CompileError, TokenEnv};

/// The marker texts [`crate::chat::toolcall::K3StreamParser`] acts on.
pub const K3_MARKER_TEXTS: [&str; 4] = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"];

/// K3's three structural special tokens.
pub(crate) struct Xtml {
    /// `<|open|>`.
    pub open: String,
    /// `<|close|>`.
    pub close: String,
    /// `<|sep|>`.
    pub sep: String,
}

impl Xtml {
    fn new(env: &TokenEnv) -> Result<Xtml, CompileError> {
        Ok(Xtml {
            open: Marker::special(env, "<|open|>")?.lark(),
            close: Marker::special(env, "<|close|>")?.lark(),
            sep: Marker::special(env, "<|sep|>")?.lark(),
        })
    }

    /// `<|open|>header<|sep|>` as Lark items.
    pub fn open_tag(&self, header: &str) -> String {
        format!("{} {} {}", self.open, lit(header), self.sep)
    }

    /// `<|close|>name<|sep|>` as Lark items.
    pub fn close_tag(&self, name: &str) -> String {
        format!("{} {} {}", self.close, lit(name), self.sep)
    }
}

/// The K3 grammar for `tools`.
pub fn grammar(
    tools: &[&ToolDecl],
    env: &TokenEnv,
    lazy: bool,
    thinking: bool,
    max_calls: usize,
) -> Result<String, CompileError> {
    let x = Xtml::new(env)?;
    let mut g = String::from("%llguidance {}\n");
    if thinking {
        g.push_str(&format!(
            "start: THINK_TEXT {} resp_open body\n",
            x.close_tag("think")
        ));
        g.push_str(&format!(
            "resp_open: {open} | {nl} {open}\n",
            open = x.open_tag("response"),
            nl = lit("\n")
        ));
        g.push_str(&free_text_terminal("THINK_TEXT", &K3_MARKER_TEXTS));
    } else {
        g.push_str("start: body\n");
    }
    let end = x.close_tag("message");
    let close_response = x.close_tag("response");
    if lazy {
        g.push_str(&format!(
            "body: RESP_TEXT {close_response} {end} | RESP_TEXT {close_response} tools {end}\n"
        ));
        g.push_str(&free_text_terminal("RESP_TEXT", &K3_MARKER_TEXTS));
    } else {
        g.push_str(&format!("body: {close_response} tools {end}\n"));
    }
    g.push_str(&format!(
        "tools: {} calls {}\n",
        x.open_tag("tools"),
        x.close_tag("tools")
    ));
    call_sequence(&mut g, "calls", max_calls, |k| format!("call_{k}"));
    let mut has_args = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        has_args.push(xtml_args::args_rules(&mut g, i, &tool.parameters, &x)?);
    }
    for k in 0..max_calls {
        let alts: Vec<String> = (0..tools.len()).map(|i| format!("t{i}_{k}")).collect();
        g.push_str(&format!("call_{k}: {}\n", alts.join(" | ")));
        for (i, tool) in tools.iter().enumerate() {
            let header = format!(
                "call tool=\"{}\" index=\"{}\"",
                escape_attr(&tool.name),
                k + 1
            );
            let args = if has_args[i] {
                format!(" args_{i}")
            } else {
                String::new()
            };
            g.push_str(&format!(
                "t{i}_{k}: {}{args} {}\n",
                x.open_tag(&header),
                x.close_tag("call")
            ));
        }
    }
    Ok(g)
}
