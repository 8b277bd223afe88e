//! Pieces of llguidance's Lark syntax the grammar builders share: string
//! literals, control markers (special tokens by id, or text), `%json`
//! rules with Caracal's JSON layout, and free-text terminals that can
//! never spell a control marker.

use serde_json::Value;

use super::{CompileError, TokenEnv};

/// A Lark string literal for `s` (JSON escaping, which llguidance's Lark reads).
pub fn lit(s: &str) -> String {
    serde_json::to_string(s).expect("a str always serialises")
}

/// Escapes `s` for use inside a Lark `/…/` regex.
pub fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        match c {
            '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$'
            | '#' | '&' | '-' | '~' | '/' => {
                out.push('\\');
                out.push(c);
            }
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out
}

/// A control marker of a tool-call format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Marker {
    /// A special token of the vocabulary.
    Special {
        /// Its id.
        id: u32,
        /// Its text (what the detokenizer writes for it).
        text: String,
    },
    /// Plain text (the vocabulary has no special token for it).
    Text(String),
}

impl Marker {
    /// The special token `text` if the vocabulary has it, else an error naming it.
    pub fn special(env: &TokenEnv, text: &str) -> Result<Marker, CompileError> {
        env.special_token(text)
            .map(|id| Marker::Special {
                id,
                text: text.to_string(),
            })
            .ok_or_else(|| {
                CompileError::Tokenizer(format!(
                    "the vocabulary has no special token {text}, which this tool-call format needs"
                ))
            })
    }

    /// The special token `text` if the vocabulary has it, else the text itself.
    pub fn special_or_text(env: &TokenEnv, text: &str) -> Marker {
        Marker::special(env, text).unwrap_or_else(|_| Marker::Text(text.to_string()))
    }

    /// The marker as a Lark grammar item.
    pub fn lark(&self) -> String {
        match self {
            Marker::Special { id, .. } => format!("<[{id}]>"),
            Marker::Text(t) => lit(t),
        }
    }

    /// The text the detokenizer produces for it.
    pub fn text(&self) -> &str {
        match self {
            Marker::Special { text, .. } | Marker::Text(text) => text,
        }
    }
}

/// How `%json` rules lay out JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JsonLayout {
    /// `,` and `:` with no whitespace.
    Compact,
    /// `, ` and `: ` (Python's `json.dumps`, what Kimi K3 renders
    /// non-string arguments as).
    Python,
}

/// A `%json { … }` rule body for `schema`, laid out as `layout` says.
pub fn json_rule(schema: &Value, layout: JsonLayout) -> String {
    let mut schema = match schema {
        Value::Bool(true) => serde_json::json!({}),
        other => other.clone(),
    };
    let (item, key) = match layout {
        JsonLayout::Compact => (",", ":"),
        JsonLayout::Python => (", ", ": "),
    };
    if let Value::Object(o) = &mut schema {
        o.insert(
            "x-guidance".into(),
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": item,
                "key_separator": key,
                "lenient": false,
            }),
        );
    }
    format!("%json {schema}")
}

/// A terminal definition `NAME: …` matching any text (newlines included)
/// that does not contain any of `excluded` — so free text can never spell
/// a control marker that the format's parser would act on.
pub fn free_text_terminal(name: &str, excluded: &[&str]) -> String {
    if excluded.is_empty() {
        return format!("{name}: /(?s:.*)/\n");
    }
    let alts = excluded
        .iter()
        .map(|m| regex_escape(m))
        .collect::<Vec<_>>()
        .join("|");
    format!("{name}: /(?s:.*)/ & ~/(?s:.*)(?:{alts})(?s:.*)/\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_and_regexes_escape_what_lark_needs() {
        assert_eq!(lit("a\"b\\c\n"), r#""a\"b\\c\n""#);
        assert_eq!(regex_escape("<|a.b|>/x"), r"<\|a\.b\|>\/x");
        assert_eq!(
            free_text_terminal("T", &["<|x|>"]),
            "T: /(?s:.*)/ & ~/(?s:.*)(?:<\\|x\\|>)(?s:.*)/\n"
        );
    }

    #[test]
    fn json_rules_carry_the_layout() {
        let r = json_rule(&serde_json::json!({"type": "object"}), JsonLayout::Python);
        assert!(r.starts_with("%json {"));
        assert!(r.contains("\"item_separator\":\", \""));
        assert!(r.contains("\"whitespace_flexible\":false"));
        let any = json_rule(&Value::Bool(true), JsonLayout::Compact);
        assert!(
            any.starts_with("%json {") && any.contains("x-guidance"),
            "{any}"
        );
    }
}
