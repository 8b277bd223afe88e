//! Tool and item shapes that agent clients such as Codex CLI send, brought
//! to the ones [`super::types`] reads, before the request is parsed.
//!
//! Tools (`tools[]`):
//! - `namespace` groups (`{"type":"namespace","name","tools":[...]}`) are
//!   flattened: their member tools take the group's place.
//! - `custom` tools (freeform input, optionally with a Lark or regex
//!   grammar) become function tools with one string parameter `input`; the
//!   model's call comes back as a `custom_tool_call` item ([`CustomTools`]).
//! - Tools the server would run itself (`web_search`, `file_search`,
//!   `image_generation`, `code_interpreter`, `computer_use_preview`, `mcp`,
//!   `tool_search`) and `local_shell` (whose call item has its own fixed
//!   shape) are dropped: this engine runs none of them, and OpenAI's own
//!   servers skip a hosted tool the model does not use. Any other type still
//!   reaches the parser and is refused there.
//!
//! Input items:
//! - `custom_tool_call` becomes a `function_call` whose arguments are
//!   `{"input": ...}`, and `custom_tool_call_output` a `function_call_output`,
//!   so history replays render the same prompt as the turn that made them.
//! - `web_search_call` items (records of a hosted search) are dropped.
//!
//! Nothing here reports an error: shapes that do not match pass through
//! unchanged and the parser names what is wrong with them.

use std::collections::HashSet;

use serde_json::{json, Map, Value};

/// Tool types run by the server side of the API, or with call items of their own.
const SKIPPED_TOOLS: &[&str] = &[
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "image_generation",
    "code_interpreter",
    "computer_use_preview",
    "computer_use",
    "mcp",
    "tool_search",
    "local_shell",
];

/// Input item types that record a hosted tool's work and carry nothing to render.
const SKIPPED_ITEMS: &[&str] = &["web_search_call"];

/// Deepest `namespace` nesting flattened; deeper groups are left to the parser.
const MAX_NAMESPACE_DEPTH: usize = 4;

/// The names of the request's `custom` tools, whose calls are sent back as
/// `custom_tool_call` items.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CustomTools {
    /// Tool names.
    names: HashSet<String>,
}

impl CustomTools {
    /// Whether no custom tool was declared.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Rewrites a `function_call` item of a custom tool into its
    /// `custom_tool_call` form (`input` is the `input` argument, or the raw
    /// arguments when they are not an object holding a string `input`).
    pub fn output_item(&self, item: &mut Value) {
        let Some(o) = item.as_object_mut() else {
            return;
        };
        if o.get("type").and_then(Value::as_str) != Some("function_call") {
            return;
        }
        let Some(name) = o.get("name").and_then(Value::as_str) else {
            return;
        };
        if !self.names.contains(name) {
            return;
        }
        let args = o
            .remove("arguments")
            .and_then(|a| a.as_str().map(String::from))
            .unwrap_or_default();
        let input = custom_input(args);
        o.insert("type".into(), json!("custom_tool_call"));
        o.insert("input".into(), json!(input));
    }

    /// Rewrites the custom calls in a response object's `output`.
    pub fn response(&self, response: &mut Value) {
        if let Some(out) = response["output"].as_array_mut() {
            out.iter_mut().for_each(|i| self.output_item(i));
        }
    }

    /// Rewrites one server event: items of custom tools in
    /// `output_item.added`/`done` and in a final response's `output`, and
    /// argument events into `response.custom_tool_call_input.*`. Returns
    /// false for an event that should not be sent (argument deltas of a
    /// custom call, whose text is JSON the client did not ask for).
    pub fn event(&self, ev: &mut Value, custom_items: &mut HashSet<String>) -> bool {
        if self.is_empty() {
            return true;
        }
        let kind = ev["type"].as_str().unwrap_or_default().to_string();
        match kind.as_str() {
            "response.output_item.added" | "response.output_item.done" => {
                let item = &mut ev["item"];
                self.output_item(item);
                if item["type"] == "custom_tool_call" {
                    if let Some(id) = item["id"].as_str() {
                        custom_items.insert(id.to_string());
                    }
                }
                true
            }
            "response.function_call_arguments.delta" => !ev["item_id"]
                .as_str()
                .is_some_and(|id| custom_items.contains(id)),
            "response.function_call_arguments.done" => {
                let Some(id) = ev["item_id"].as_str() else {
                    return true;
                };
                if !custom_items.contains(id) {
                    return true;
                }
                let args = ev["arguments"].as_str().unwrap_or_default().to_string();
                let input = custom_input(args);
                if let Some(o) = ev.as_object_mut() {
                    o.remove("arguments");
                    o.insert("type".into(), json!("response.custom_tool_call_input.done"));
                    o.insert("input".into(), json!(input));
                }
                true
            }
            "response.completed" | "response.incomplete" | "response.failed" => {
                self.response(&mut ev["response"]);
                true
            }
            _ => true,
        }
    }
}

/// The freeform input in a custom call's arguments: the string `input` of a
/// JSON object, or the arguments themselves when they are not one.
fn custom_input(args: String) -> String {
    serde_json::from_str::<Value>(&args)
        .ok()
        .and_then(|v| v.get("input").and_then(Value::as_str).map(String::from))
        .unwrap_or(args)
}

/// Rewrites `obj` (a Responses create body) in place and returns its custom tools.
pub fn normalize(obj: &mut Map<String, Value>) -> CustomTools {
    let mut custom = CustomTools::default();
    if let Some(Value::Array(tools)) = obj.get_mut("tools") {
        let given = std::mem::take(tools);
        *tools = flatten_tools(given, 0, &mut custom);
    }
    if let Some(Value::Array(items)) = obj.get_mut("input") {
        let given = std::mem::take(items);
        *items = given.into_iter().filter_map(input_item).collect();
    }
    custom
}

fn flatten_tools(given: Vec<Value>, depth: usize, custom: &mut CustomTools) -> Vec<Value> {
    let mut out = Vec::with_capacity(given.len());
    for t in given {
        let kind = t.get("type").and_then(Value::as_str).unwrap_or_default();
        match kind {
            "namespace" if depth < MAX_NAMESPACE_DEPTH => match t.get("tools") {
                Some(Value::Array(members)) => {
                    out.extend(flatten_tools(members.clone(), depth + 1, custom))
                }
                _ => out.push(t),
            },
            "custom" => match custom_as_function(&t) {
                Some((name, f)) => {
                    custom.names.insert(name);
                    out.push(f);
                }
                None => out.push(t),
            },
            k if SKIPPED_TOOLS.contains(&k) => {}
            _ => out.push(t),
        }
    }
    out
}

/// A `custom` tool as a function tool taking its freeform text as `input`.
fn custom_as_function(t: &Value) -> Option<(String, Value)> {
    let name = t.get("name")?.as_str()?.to_string();
    let mut description = t
        .get("description")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let format = &t["format"];
    if format["type"] == "grammar" {
        if let (Some(syntax), Some(definition)) =
            (format["syntax"].as_str(), format["definition"].as_str())
        {
            description.push_str(&format!(
                "\n\nThe `input` string must match this {syntax} grammar:\n{definition}"
            ));
        }
    }
    let f = json!({
        "type": "function",
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {"input": {"type": "string", "description": "The tool's freeform input."}},
            "required": ["input"],
            "additionalProperties": false,
        },
    });
    Some((name, f))
}

/// One input item in the shape the parser reads, or none to drop it.
fn input_item(item: Value) -> Option<Value> {
    let Value::Object(mut o) = item else {
        return Some(item);
    };
    let kind = o
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    match kind.as_str() {
        "custom_tool_call" => {
            if let Some(input) = o.remove("input") {
                let input = input
                    .as_str()
                    .map(String::from)
                    .unwrap_or_else(|| input.to_string());
                o.insert(
                    "arguments".into(),
                    json!(json!({ "input": input }).to_string()),
                );
            }
            o.insert("type".into(), json!("function_call"));
            Some(Value::Object(o))
        }
        "custom_tool_call_output" => {
            o.insert("type".into(), json!("function_call_output"));
            Some(Value::Object(o))
        }
        k if SKIPPED_ITEMS.contains(&k) => None,
        _ => Some(Value::Object(o)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().expect("a JSON object").clone()
    }

    #[test]
    fn namespaces_flatten_hosted_tools_drop_and_unknown_types_stay() {
        let mut obj = body(json!({"tools": [
            {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
            {"type": "namespace", "name": "agents", "tools": [
                {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}},
                {"type": "function", "name": "close_agent"}]},
            {"type": "web_search", "external_web_access": true},
            {"type": "local_shell"},
            {"type": "teleport"},
        ]}));
        let custom = normalize(&mut obj);
        assert!(custom.is_empty());
        let names: Vec<_> = obj["tools"]
            .as_array()
            .expect("tools")
            .iter()
            .map(|t| {
                t.get("name")
                    .or(t.get("type"))
                    .and_then(Value::as_str)
                    .expect("a name or type")
                    .to_string()
            })
            .collect();
        assert_eq!(
            names,
            ["exec_command", "spawn_agent", "close_agent", "teleport"]
        );
    }

    #[test]
    fn custom_tools_become_functions_and_their_calls_come_back_custom() {
        let mut obj = body(json!({
            "tools": [{"type": "custom", "name": "apply_patch", "description": "Patch files.",
                       "format": {"type": "grammar", "syntax": "lark", "definition": "start: \"*** Begin Patch\""}}],
            "input": [
                {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": "*** Begin Patch"},
                {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done"},
                {"type": "web_search_call", "id": "ws_1", "status": "completed"},
            ],
        }));
        let custom = normalize(&mut obj);
        let tool = &obj["tools"][0];
        assert_eq!(tool["type"], "function");
        assert_eq!(tool["parameters"]["required"], json!(["input"]));
        assert!(tool["description"]
            .as_str()
            .expect("description")
            .contains("lark grammar"));
        let input = obj["input"].as_array().expect("input");
        assert_eq!(input.len(), 2);
        assert_eq!(input[0]["type"], "function_call");
        assert_eq!(input[0]["arguments"], r#"{"input":"*** Begin Patch"}"#);
        assert_eq!(input[1]["type"], "function_call_output");

        let mut seen = HashSet::new();
        let mut added = json!({"type": "response.output_item.added", "item":
            {"type": "function_call", "id": "fc_1", "call_id": "call_2", "name": "apply_patch", "arguments": ""}});
        assert!(custom.event(&mut added, &mut seen));
        assert_eq!(added["item"]["type"], "custom_tool_call");
        assert_eq!(added["item"]["input"], "");
        let mut delta = json!({"type": "response.function_call_arguments.delta", "item_id": "fc_1", "delta": "{"});
        assert!(!custom.event(&mut delta, &mut seen));
        let mut done = json!({"type": "response.function_call_arguments.done", "item_id": "fc_1",
                              "arguments": r#"{"input":"*** End Patch"}"#});
        assert!(custom.event(&mut done, &mut seen));
        assert_eq!(done["type"], "response.custom_tool_call_input.done");
        assert_eq!(done["input"], "*** End Patch");
        let mut completed = json!({"type": "response.completed", "response": {"output": [
            {"type": "function_call", "id": "fc_1", "call_id": "call_2", "name": "apply_patch",
             "arguments": "not json"},
            {"type": "function_call", "id": "fc_2", "call_id": "call_3", "name": "exec_command",
             "arguments": "{}"}]}});
        assert!(custom.event(&mut completed, &mut seen));
        let out = &completed["response"]["output"];
        assert_eq!(out[0]["type"], "custom_tool_call");
        assert_eq!(out[0]["input"], "not json");
        assert_eq!(out[1]["type"], "function_call");
        assert_eq!(out[1]["arguments"], "{}");
    }
}
