//! What a request asks the grammar for: [`ConstraintSpec`], read from the
//! OpenAI shapes.
//!
//! - Chat Completions: `tools` (`{"type":"function","function":{"name",
//!   "parameters"}}`), `tool_choice` (`"auto"`, `"none"`, `"required"`,
//!   `{"type":"function","function":{"name"}}`), `parallel_tool_calls`,
//!   `response_format` (`{"type":"json_schema","json_schema":{"schema"}}`,
//!   `{"type":"json_object"}`, `{"type":"text"}`).
//! - Responses: tools flattened (`{"type":"function","name","parameters"}`),
//!   `tool_choice` `{"type":"function","name"}`, and `text.format`
//!   (`{"type":"json_schema","schema"}` flattened).

use serde_json::Value;

use super::CompileError;

/// What the constraint enforces.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintSpec {
    /// Output is one JSON value matching this schema.
    Json(Value),
    /// Output is one JSON object, any keys.
    JsonObject,
    /// Tool calls in the model's own format.
    Tools(ToolsSpec),
}

/// Tool calling: which tools, whether a call is required, how many, and the
/// format the model writes them in.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolsSpec {
    /// The declared tools (names unique).
    pub tools: Vec<ToolDecl>,
    /// `tool_choice`.
    pub choice: ToolChoice,
    /// `parallel_tool_calls`: several calls in one turn (default true).
    pub parallel: bool,
    /// The model's tool-call format.
    pub format: ToolFormat,
}

/// One declared function tool.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDecl {
    /// The function name.
    pub name: String,
    /// JSON schema of the arguments object (`{"type":"object"}` if none given).
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// The model decides: free text until it opens a tool call (lazy grammar).
    #[default]
    Auto,
    /// No tool calls: no constraint.
    None,
    /// At least one call, constrained from the start.
    Required,
    /// Exactly this tool (one call, or several of it with `parallel`).
    Named(String),
}

/// The tool-call format of a model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// Kimi K2 / K2.5 / Kimi-Linear: `<|tool_calls_section_begin|>` and per
    /// call `<|tool_call_begin|>functions.{name}:{n}<|tool_call_argument_begin|>{json}<|tool_call_end|>`.
    KimiK2 {
        /// `n` of the first call: calls already made in the conversation
        /// (the chat template counts ids over the whole conversation).
        first_call_index: usize,
        /// The prompt opened `<think>`: output starts as reasoning, ended by `</think>`.
        thinking: bool,
    },
    /// Kimi K3 XTML: `<|open|>tools<|sep|>` with `call` and `argument`
    /// elements, after the `think` and `response` channels.
    KimiK3 {
        /// The generation prompt opened the `think` channel (else `response`).
        thinking: bool,
    },
    /// Hermes: `<tool_call>\n{"name":…,"arguments":{…}}\n</tool_call>`
    /// (SmolLM2, Qwen and other ChatML templates).
    Hermes,
}

impl ToolDecl {
    /// Reads one entry of a `tools` array (Chat Completions or Responses shape).
    pub fn from_openai(index: usize, tool: &Value) -> Result<ToolDecl, CompileError> {
        let bad = |detail: &str| CompileError::InvalidTool {
            index,
            detail: detail.to_string(),
        };
        let kind = tool
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("function");
        if kind != "function" {
            return Err(bad(&format!(
                "type `{kind}` cannot be constrained; only `function` tools can"
            )));
        }
        let function = tool.get("function").unwrap_or(tool);
        let name = function
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("has no `name` string"))?;
        if name.is_empty() || name.len() > 128 {
            return Err(bad("`name` must be 1 to 128 bytes"));
        }
        if name.chars().any(|c| c.is_control()) {
            return Err(bad("`name` must not contain control characters"));
        }
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => serde_json::json!({"type": "object"}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => return Err(bad("`parameters` must be a JSON schema object")),
        };
        Ok(ToolDecl {
            name: name.to_string(),
            parameters,
        })
    }

    /// Reads a whole `tools` array; names must be unique.
    pub fn list_from_openai(tools: &Value) -> Result<Vec<ToolDecl>, CompileError> {
        let list = tools.as_array().ok_or(CompileError::InvalidField {
            field: "tools",
            detail: "must be an array".into(),
        })?;
        let mut out: Vec<ToolDecl> = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let decl = ToolDecl::from_openai(i, t)?;
            if out.iter().any(|d| d.name == decl.name) {
                return Err(CompileError::InvalidTool {
                    index: i,
                    detail: format!("`{}` is declared twice", decl.name),
                });
            }
            out.push(decl);
        }
        Ok(out)
    }
}

impl ToolChoice {
    /// Reads `tool_choice`; absent means `auto`.
    pub fn from_openai(v: Option<&Value>) -> Result<ToolChoice, CompileError> {
        let bad = |detail: String| CompileError::InvalidField {
            field: "tool_choice",
            detail,
        };
        match v {
            None | Some(Value::Null) => Ok(ToolChoice::Auto),
            Some(Value::String(s)) => match s.as_str() {
                "auto" => Ok(ToolChoice::Auto),
                "none" => Ok(ToolChoice::None),
                "required" => Ok(ToolChoice::Required),
                other => Err(bad(format!(
                    "`{other}` is not one of auto, none, required or a function"
                ))),
            },
            Some(obj @ Value::Object(_)) => {
                let name = obj
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .or_else(|| obj.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("an object choice needs a function name".into()))?;
                Ok(ToolChoice::Named(name.to_string()))
            }
            Some(other) => Err(bad(format!("unexpected value {other}"))),
        }
    }
}

impl ToolsSpec {
    /// The spec of a request's `tools`, `tool_choice` and
    /// `parallel_tool_calls`; `None` when nothing is to be constrained (no
    /// tools, or `tool_choice: "none"`).
    pub fn from_openai(
        tools: Option<&Value>,
        tool_choice: Option<&Value>,
        parallel_tool_calls: Option<bool>,
        format: ToolFormat,
    ) -> Result<Option<ToolsSpec>, CompileError> {
        let choice = ToolChoice::from_openai(tool_choice)?;
        let tools = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(t) => ToolDecl::list_from_openai(t)?,
        };
        if let ToolChoice::Named(name) = &choice {
            if !tools.iter().any(|t| &t.name == name) {
                return Err(CompileError::UnknownTool {
                    name: name.clone(),
                    declared: tools
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
        if choice == ToolChoice::Required && tools.is_empty() {
            return Err(CompileError::InvalidField {
                field: "tool_choice",
                detail: "`required` needs at least one declared tool".into(),
            });
        }
        if tools.is_empty() || choice == ToolChoice::None {
            return Ok(None);
        }
        Ok(Some(ToolsSpec {
            tools,
            choice,
            parallel: parallel_tool_calls.unwrap_or(true),
            format,
        }))
    }

    /// The tools a call may name under the choice.
    pub fn callable(&self) -> Vec<&ToolDecl> {
        match &self.choice {
            ToolChoice::Named(n) => self.tools.iter().filter(|t| &t.name == n).collect(),
            _ => self.tools.iter().collect(),
        }
    }
}

impl ConstraintSpec {
    /// Reads a Chat Completions `response_format`; `None` for `text` or absent.
    pub fn from_response_format(v: Option<&Value>) -> Result<Option<ConstraintSpec>, CompileError> {
        let Some(v) = v.filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let kind = v
            .get("type")
            .and_then(Value::as_str)
            .ok_or(CompileError::InvalidField {
                field: "response_format.type",
                detail: "is missing".into(),
            })?;
        match kind {
            "text" => Ok(None),
            "json_object" => Ok(Some(ConstraintSpec::JsonObject)),
            "json_schema" => {
                let schema = v
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .or_else(|| v.get("schema"))
                    .ok_or(CompileError::InvalidField {
                        field: "response_format.json_schema.schema",
                        detail: "is missing".into(),
                    })?;
                Ok(Some(ConstraintSpec::Json(schema.clone())))
            }
            other => Err(CompileError::InvalidField {
                field: "response_format.type",
                detail: format!("`{other}` is not one of text, json_object, json_schema"),
            }),
        }
    }

    /// Reads a Responses `text.format` (the schema sits beside `type`).
    pub fn from_text_format(v: Option<&Value>) -> Result<Option<ConstraintSpec>, CompileError> {
        Self::from_response_format(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn k3() -> ToolFormat {
        ToolFormat::KimiK3 { thinking: false }
    }

    #[test]
    fn reads_chat_and_responses_tool_shapes() {
        let tools = json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
            {"type": "function", "name": "b"}
        ]);
        let spec = ToolsSpec::from_openai(Some(&tools), None, None, k3())
            .unwrap()
            .unwrap();
        assert_eq!(spec.tools[1].name, "b");
        assert_eq!(spec.tools[1].parameters, json!({"type": "object"}));
        assert_eq!(spec.choice, ToolChoice::Auto);
        assert!(spec.parallel);
        let named = json!({"type": "function", "function": {"name": "b"}});
        let spec = ToolsSpec::from_openai(Some(&tools), Some(&named), Some(false), k3())
            .unwrap()
            .unwrap();
        assert_eq!(spec.callable().len(), 1);
        assert!(!spec.parallel);
        let responses_named = json!({"type": "function", "name": "a"});
        assert_eq!(
            ToolChoice::from_openai(Some(&responses_named)).unwrap(),
            ToolChoice::Named("a".into())
        );
    }

    #[test]
    fn none_or_no_tools_constrains_nothing_and_bad_choices_are_named() {
        let tools = json!([{"type": "function", "function": {"name": "a"}}]);
        assert_eq!(
            ToolsSpec::from_openai(Some(&tools), Some(&json!("none")), None, k3()).unwrap(),
            None
        );
        assert_eq!(
            ToolsSpec::from_openai(None, None, None, k3()).unwrap(),
            None
        );
        let err = ToolsSpec::from_openai(
            Some(&tools),
            Some(&json!({"type": "function", "function": {"name": "zzz"}})),
            None,
            k3(),
        )
        .unwrap_err();
        assert_eq!(err.kind(), "unknown_tool");
        assert!(err.to_string().contains("zzz") && err.to_string().contains('a'));
        let err = ToolsSpec::from_openai(None, Some(&json!("required")), None, k3()).unwrap_err();
        assert!(err.to_string().contains("required"));
        let dup = json!([{"name": "a"}, {"name": "a"}]);
        let err = ToolsSpec::from_openai(Some(&dup), None, None, k3()).unwrap_err();
        assert!(err.to_string().contains("declared twice"));
    }

    #[test]
    fn reads_response_formats() {
        let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}});
        assert_eq!(
            ConstraintSpec::from_response_format(Some(&rf)).unwrap(),
            Some(ConstraintSpec::Json(json!({"type": "integer"})))
        );
        let tf = json!({"type": "json_schema", "name": "x", "schema": {"type": "string"}});
        assert_eq!(
            ConstraintSpec::from_text_format(Some(&tf)).unwrap(),
            Some(ConstraintSpec::Json(json!({"type": "string"})))
        );
        assert_eq!(
            ConstraintSpec::from_response_format(Some(&json!({"type": "json_object"}))).unwrap(),
            Some(ConstraintSpec::JsonObject)
        );
        assert_eq!(
            ConstraintSpec::from_response_format(Some(&json!({"type": "text"}))).unwrap(),
            None
        );
        assert!(ConstraintSpec::from_response_format(Some(&json!({"type": "yaml"}))).is_err());
    }
}
