//! Chat templates: Hugging Face Jinja templates rendered with `minijinja`.
//!
//! Templates get what transformers' `apply_chat_template` passes: `messages`,
//! `tools`, `add_generation_prompt`, `bos_token`, `eos_token`, plus
//! `raise_exception` and Python string/dict methods (`minijinja-contrib`'s
//! pycompat), so published templates render unchanged.
//!
//! Child: [`toolcall`] renders and incrementally parses each model's own
//! tool-call format (Kimi K2 sections, K3 XTML).

pub mod toolcall;

use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use crate::error::{Error, Result};

/// One chat message as OpenAI clients send it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// `v` with every object's keys in code-point order (Python's
/// `sort_keys=True`). Rendered tool declarations keep this one order
/// whatever key order the client sent and whether or not `serde_json`'s
/// maps preserve insertion order in this build (a dependency turns that on),
/// so the same tools always give the same prompt and the same cached prefix.
pub fn sort_keys(v: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        J::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            J::Object(
                keys.into_iter()
                    .map(|k| (k.clone(), sort_keys(&map[k])))
                    .collect(),
            )
        }
        J::Array(items) => J::Array(items.iter().map(sort_keys).collect()),
        other => other.clone(),
    }
}

/// Renders `template` for `messages` (and optional OpenAI `tools`, whose
/// keys are rendered in [`sort_keys`] order).
pub fn render(
    template: &str,
    messages: &[ChatMessage],
    tools: Option<&serde_json::Value>,
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
) -> Result<String> {
    let mut env = Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.add_template("chat", template)
        .map_err(|e| Error::Template(e.to_string()))?;
    let tmpl = env
        .get_template("chat")
        .map_err(|e| Error::Template(e.to_string()))?;
    let ctx = minijinja::context! {
        messages => Value::from_serialize(messages),
        tools => tools.map(|t| Value::from_serialize(sort_keys(t))),
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token.unwrap_or(""),
        eos_token => eos_token.unwrap_or(""),
    };
    tmpl.render(ctx).map_err(|e| Error::Template(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_default_system_prompt() {
        let out = render(
            CHATML,
            &[ChatMessage::new("user", "Hi")],
            None,
            true,
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_becomes_a_template_error() {
        let err = render(
            "{{ raise_exception('no system role') }}",
            &[],
            None,
            false,
            None,
            None,
        )
        .unwrap_err();
        assert!(err.to_string().contains("no system role"), "{err}");
    }
}
