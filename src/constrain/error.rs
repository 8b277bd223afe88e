//! Errors found while building a constraint, before any token is generated.
//!
//! Each names the problem and where it is (a JSON pointer into the schema,
//! the tool, the limit), so a client can fix its request; the server goes on
//! serving. [`CompileError::kind`] gives a stable name.

/// Why a [`super::ConstraintSpec`] could not be compiled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    /// The schema uses a keyword the grammar compiler does not implement.
    #[error("{context}: JSON schema keyword `{keyword}` at `{pointer}` is not supported")]
    UnsupportedKeyword {
        /// Which schema (`response_format`, `tool get_weather`).
        context: String,
        /// The keyword.
        keyword: String,
        /// JSON pointer of the schema object holding it (`""` = the root).
        pointer: String,
    },
    /// A `$ref` does not resolve inside the schema document.
    #[error("{context}: `$ref` `{reference}` at `{pointer}` does not resolve inside the schema")]
    UnresolvedRef {
        /// Which schema.
        context: String,
        /// The reference as written.
        reference: String,
        /// JSON pointer of the object holding the `$ref`.
        pointer: String,
    },
    /// The schema is malformed or unsatisfiable.
    #[error("{context}: invalid JSON schema: {detail}")]
    InvalidSchema {
        /// Which schema.
        context: String,
        /// What is wrong.
        detail: String,
    },
    /// The grammar exceeds the configured limits (size, lexer fuel, states).
    #[error("{context}: grammar exceeds the limits: {detail}")]
    TooLarge {
        /// Which schema or grammar.
        context: String,
        /// The limit that was hit.
        detail: String,
    },
    /// A tool declaration is malformed.
    #[error("tool {index}: {detail}")]
    InvalidTool {
        /// Position in `tools`.
        index: usize,
        /// What is wrong.
        detail: String,
    },
    /// `tool_choice` names a tool that is not declared.
    #[error("tool_choice names `{name}`, which is not among the declared tools ({declared})")]
    UnknownTool {
        /// The name asked for.
        name: String,
        /// Comma-separated declared names.
        declared: String,
    },
    /// A request field has a value this module does not accept.
    #[error("{field}: {detail}")]
    InvalidField {
        /// The request field (`tool_choice`, `response_format.type`).
        field: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// The tokenizer lacks a token the format needs, or cannot be turned
    /// into a token trie.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The grammar engine rejected a grammar this module built (a bug, or a
    /// tool name or schema text it cannot embed).
    #[error("{context}: grammar error: {detail}")]
    Grammar {
        /// Which schema or grammar.
        context: String,
        /// The engine's message.
        detail: String,
    },
}

impl CompileError {
    /// A stable name for clients and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            CompileError::UnsupportedKeyword { .. } => "unsupported_schema_keyword",
            CompileError::UnresolvedRef { .. } => "unresolved_schema_ref",
            CompileError::InvalidSchema { .. } => "invalid_schema",
            CompileError::TooLarge { .. } => "grammar_too_large",
            CompileError::InvalidTool { .. } => "invalid_tool",
            CompileError::UnknownTool { .. } => "unknown_tool",
            CompileError::InvalidField { .. } => "invalid_value",
            CompileError::Tokenizer(_) => "tokenizer",
            CompileError::Grammar { .. } => "grammar_error",
        }
    }

    /// Sorts an error message of the grammar engine into a variant: limits
    /// hit, unsupported keywords, missing definitions, other schema errors.
    pub(crate) fn from_engine(context: &str, message: String) -> CompileError {
        let context = context.to_string();
        // The engine's own words are the first line; the lines after it
        // quote the grammar, whose names (a property `limit`) say nothing.
        let lower = message.lines().next().unwrap_or_default().to_lowercase();
        if lower.contains("unsatisfiable") {
            return CompileError::InvalidSchema {
                context,
                detail: message,
            };
        }
        let limit_words = [
            "limit",
            "too large",
            "fuel",
            "too many",
            "exceeded",
            "max_grammar_size",
        ];
        if limit_words.iter().any(|w| lower.contains(w)) {
            return CompileError::TooLarge {
                context,
                detail: message,
            };
        }
        if let Some(rest) = message.split("Unimplemented keys: ").nth(1) {
            let keyword = rest
                .trim_start_matches(['[', '"'])
                .split(['"', ',', ']'])
                .next()
                .unwrap_or(rest)
                .to_string();
            return CompileError::UnsupportedKeyword {
                context,
                keyword,
                pointer: String::new(),
            };
        }
        if let Some(rest) = message.split("Definition not found: ").nth(1) {
            return CompileError::UnresolvedRef {
                context,
                reference: rest.lines().next().unwrap_or(rest).trim().to_string(),
                pointer: String::new(),
            };
        }
        CompileError::InvalidSchema {
            context,
            detail: message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_messages_sort_into_variants() {
        let e = CompileError::from_engine("x", "grammar size limit exceeded".into());
        assert_eq!(e.kind(), "grammar_too_large");
        let e = CompileError::from_engine("x", "Unimplemented keys: [\"not\"]".into());
        assert_eq!(
            e,
            CompileError::UnsupportedKeyword {
                context: "x".into(),
                keyword: "not".into(),
                pointer: String::new()
            }
        );
        let e = CompileError::from_engine("x", "Definition not found: #/$defs/a".into());
        assert_eq!(e.kind(), "unresolved_schema_ref");
        let e = CompileError::from_engine("x", "Unsatisfiable schema: min > max".into());
        assert_eq!(e.kind(), "invalid_schema");
        assert!(e.to_string().contains("Unsatisfiable"));
        // Grammar lines quoted after the message do not decide the kind.
        let quoted = "at 13(9): failed to compile JSON schema: Unsatisfiable schema: range [15, 14.5] \
                      does not contain a multiple of 0.5\n  11 | j0: %json {\"properties\":{\"limit0\":{}}}";
        let e = CompileError::from_engine("tools", quoted.into());
        assert_eq!(e.kind(), "invalid_schema", "{e}");
        let e = CompileError::from_engine("x", "Too many items (limit 9; mask)\n  1 | a: b".into());
        assert_eq!(e.kind(), "grammar_too_large");
    }
}
