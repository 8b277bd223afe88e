//! Pieces of llguidance's Lark syntax the grammar builders share: string
//! literals, control markers (special tokens by id, or text), `%json`
//! rules with Caracal's JSON layout, free-text terminals that can never
//! spell a control marker, and [`guard_json_strings`], which keeps JSON
//! string values from spelling one either.

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

/// JSON string values with no `<|` (every Kimi marker starts so): any
/// `<` run is followed by a character other than `<` and `|`, or ends
/// the string.
pub const NO_PIPE_MARKER: &str = "^(?:[^<]|<+[^<|])*<*$";

/// JSON string values that contain none of the texts the K2 parser acts
/// on inside arguments: no `<|` (every `<|…|>` marker), no `<think>` and
/// no `</think>`. Each `<` starts a unit that either takes the next
/// character, which breaks the marker (`F`), or is a proper prefix of
/// `<think` / `</think` followed by another `<` or the end (`P`):
/// `^(?:[^<]|P*F)*P*$`.
pub const NO_K2_MARKER: &str = concat!(
    "^(?:[^<]|",
    "(?:<(?:t(?:h(?:i(?:n(?:k)?)?)?)?|/(?:t(?:h(?:i(?:n(?:k)?)?)?)?)?)?)*",
    "<(?:[^<|t/]|t(?:[^<h]|h(?:[^<i]|i(?:[^<n]|n(?:[^<k]|k[^<>]))))",
    "|/(?:[^<t]|t(?:[^<h]|h(?:[^<i]|i(?:[^<n]|n(?:[^<k]|k[^<>]))))))",
    ")*",
    "(?:<(?:t(?:h(?:i(?:n(?:k)?)?)?)?|/(?:t(?:h(?:i(?:n(?:k)?)?)?)?)?)?)*$",
);

/// `schema` with every `"type": "string"` subschema also matching
/// `no_marker` (one of [`NO_PIPE_MARKER`], [`NO_K2_MARKER`]): a pattern
/// is added, or intersected (`allOf`) with the schema's own.
///
/// A format whose parser scans the text for markers (K2 arguments, K3
/// non-string arguments) would otherwise act on a marker a string value
/// spells with plain tokens and cut the call there. Values the walk
/// cannot reach stay unguarded: strings under an untyped schema (`{}`, a
/// `type` list), keys of objects open to undeclared properties, and
/// `enum`/`const` values (the schema's author wrote those).
pub fn guard_json_strings(schema: &Value, no_marker: &str) -> Value {
    let Value::Object(o) = schema else {
        return schema.clone();
    };
    let mut out = serde_json::Map::with_capacity(o.len());
    for (k, v) in o {
        let guarded = match (k.as_str(), v) {
            (
                "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas",
                Value::Object(m),
            ) => Value::Object(
                m.iter()
                    .map(|(name, s)| (name.clone(), guard_json_strings(s, no_marker)))
                    .collect(),
            ),
            ("items" | "additionalItems" | "additionalProperties", s @ Value::Object(_)) => {
                guard_json_strings(s, no_marker)
            }
            ("items" | "prefixItems" | "anyOf" | "oneOf" | "allOf", Value::Array(list)) => {
                Value::Array(
                    list.iter()
                        .map(|s| guard_json_strings(s, no_marker))
                        .collect(),
                )
            }
            _ => v.clone(),
        };
        out.insert(k.clone(), guarded);
    }
    if out.get("type").and_then(Value::as_str) != Some("string") {
        return Value::Object(out);
    }
    if !out.contains_key("pattern") {
        out.insert("pattern".into(), Value::String(no_marker.to_string()));
        return Value::Object(out);
    }
    // Definitions stay at the level their references resolve from.
    let mut wrapper = serde_json::Map::new();
    for key in ["$defs", "definitions"] {
        if let Some(d) = out.remove(key) {
            wrapper.insert(key.into(), d);
        }
    }
    wrapper.insert(
        "allOf".into(),
        serde_json::json!([Value::Object(out), {"type": "string", "pattern": no_marker}]),
    );
    Value::Object(wrapper)
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

    /// The guards' regexes against their definition, on 200,000 seeded
    /// random strings built from the pieces markers are made of.
    #[test]
    fn marker_guards_match_exactly_the_strings_without_markers() {
        let k2 = fancy_regex::Regex::new(NO_K2_MARKER).unwrap();
        let pipe = fancy_regex::Regex::new(NO_PIPE_MARKER).unwrap();
        let pieces = [
            "<", "|", "/", "t", "h", "i", "n", "k", ">", "a", "<t", "hin", "think", "</", "\n",
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut checked = 0;
        let mut with_marker = 0;
        for _ in 0..200_000 {
            let len = (next() % 12) as usize;
            let s: String = (0..len)
                .map(|_| pieces[(next() % pieces.len() as u64) as usize])
                .collect();
            let no_pipe = !s.contains("<|");
            let no_k2 = no_pipe && !s.contains("<think>") && !s.contains("</think>");
            assert_eq!(pipe.is_match(&s).unwrap(), no_pipe, "{s:?}");
            assert_eq!(k2.is_match(&s).unwrap(), no_k2, "{s:?}");
            checked += 1;
            with_marker += usize::from(!no_k2 && no_pipe);
        }
        assert!(with_marker > 100, "think markers were drawn: {with_marker}");
        assert_eq!(checked, 200_000);
        for s in [
            "",
            "a < b | c",
            "<b>x</b>",
            "<thin>",
            "</thinking>",
            "<<t<",
            "x\n<",
        ] {
            assert!(k2.is_match(s).unwrap(), "{s:?}");
        }
        for s in ["<|", "a<|tool_call_end|>", "<think>", "x</think>", "<<|"] {
            assert!(!k2.is_match(s).unwrap(), "{s:?}");
        }
    }

    #[test]
    fn guards_reach_typed_strings_and_keep_definitions_in_place() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "a": {"type": "string", "maxLength": 5},
                "b": {"type": "array", "items": {"type": "string", "pattern": "^x"}},
                "c": {"anyOf": [{"$ref": "#/$defs/s"}, {"type": "integer"}]}
            },
            "$defs": {"s": {"type": "string"}}
        });
        let g = guard_json_strings(&schema, NO_PIPE_MARKER);
        assert_eq!(g["properties"]["a"]["pattern"], NO_PIPE_MARKER);
        assert_eq!(g["properties"]["a"]["maxLength"], 5);
        let b = &g["properties"]["b"]["items"]["allOf"];
        assert_eq!(b[0]["pattern"], "^x");
        assert_eq!(b[1]["pattern"], NO_PIPE_MARKER);
        assert_eq!(g["$defs"]["s"]["pattern"], NO_PIPE_MARKER);
        assert_eq!(
            g["properties"]["c"]["anyOf"][1],
            serde_json::json!({"type": "integer"})
        );
        let top = serde_json::json!({"type": "string", "pattern": "^a", "$defs": {"d": {}}});
        let g = guard_json_strings(&top, NO_PIPE_MARKER);
        assert!(
            g["$defs"].is_object() && g["allOf"][0].get("$defs").is_none(),
            "{g}"
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
