//! Constrained decoding through the gateway, over a real socket, on the
//! built-in default model (the synthesized tiny Kimi K3, random weights:
//! its unconstrained output never parses as a tool call or JSON).
//! `tool_choice: "required"` and a named tool return calls whose arguments
//! parse and validate against the declared schema (the `jsonschema` crate)
//! with `finish_reason: "tool_calls"`; `response_format` `json_schema`
//! returns JSON that validates; Responses `text.format` likewise; a bad
//! schema is a 400 naming the problem; `--tool-call-constraint off`
//! (`ConstraintSetup::tool_calls = false`) leaves calls unconstrained.

mod common;
mod gateway_support;

use std::sync::Arc;

use caracal::constrain::{ConstraintFactory, TokenEnv};
use caracal::gateway::engine::ConstraintSetup;
use caracal::gateway::{EngineHost, Gateway, GatewayConfig, ServedModel};
use caracal::generate::LoadedModel;
use caracal::models::CausalLm;
use caracal_actors::runtime::EngineConfig;
use gateway_support::json;
use serde_json::{json, Value};
use tokio::sync::oneshot;

/// A gateway on 127.0.0.1:0 over the default model with a constraint factory.
struct Server {
    addr: std::net::SocketAddr,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(tool_calls: bool) -> Server {
    let dir = caracal::convert::synth::default_model_dir().expect("the default model is made");
    let loaded = LoadedModel::load(&dir).expect("the default model loads");
    let model: Arc<dyn CausalLm> = Arc::from(loaded.model);
    let tokenizer = Arc::new(loaded.tokenizer.expect("the default model has a tokenizer"));
    let env = TokenEnv::load(&dir, tokenizer.clone(), Some(model.info().vocab_size))
        .expect("a token trie from the default model's tokenizer");
    let factory = ConstraintFactory::new(env).expect("a constraint factory");
    let served = ServedModel::new("default", model.as_ref(), Some(tokenizer.clone()), false);
    let setup = ConstraintSetup {
        factory: Some(Arc::new(factory)),
        tool_calls,
        jump_forward: true,
    };
    let detok = tokenizer as Arc<dyn caracal_actors::engine::Detokenize>;
    let host = EngineHost::start_with(model, EngineConfig::default(), Some(detok), setup)
        .expect("engine starts");
    let gateway = Gateway::new(served, host, GatewayConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(gateway.serve(listener, async move {
        let _ = rx.await;
    }));
    Server { addr, stop, task }
}

impl Server {
    async fn shutdown(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

fn weather_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"enum": ["celsius", "fahrenheit"]}
        },
        "required": ["city", "days"],
        "additionalProperties": false
    })
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": weather_schema()}},
        {"type": "function", "function": {"name": "read_file", "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "maxLength": 40}},
            "required": ["path"],
            "additionalProperties": false
        }}}
    ])
}

fn schema_of(name: &str) -> Value {
    tools()
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["function"]["name"] == name)
        .map(|t| t["function"]["parameters"].clone())
        .unwrap_or_else(|| panic!("no tool {name}"))
}

/// Every call names a declared tool and its arguments validate.
fn check_calls(body: &Value, only: Option<&str>) -> usize {
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .expect("tool_calls");
    assert!(!calls.is_empty(), "{body}");
    for c in calls {
        let name = c["function"]["name"].as_str().unwrap();
        if let Some(o) = only {
            assert_eq!(name, o);
        }
        let args: Value = serde_json::from_str(c["function"]["arguments"].as_str().unwrap())
            .unwrap_or_else(|e| panic!("arguments do not parse ({e}): {c}"));
        let validator = jsonschema::validator_for(&schema_of(name)).unwrap();
        assert!(
            validator.is_valid(&args),
            "arguments {args} break the schema of {name}"
        );
    }
    calls.len()
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "model": "default",
        "messages": [{"role": "user", "content": "What is the weather in Paris this week?"}],
        "max_tokens": 200,
        "temperature": 1.0,
        "reasoning_effort": "none",
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_and_named_tool_calls_always_parse_and_validate() {
    let s = start(true).await;
    let mut calls = 0;
    for seed in 0..4 {
        let (status, body) = json(
            s.addr,
            "POST",
            "/v1/chat/completions",
            &chat(
                json!({"tools": tools(), "tool_choice": "required", "seed": seed,
                         "parallel_tool_calls": false}),
            ),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            check_calls(&body, None),
            1,
            "one call without parallel_tool_calls"
        );
        calls += 1;
        let named = json!({"type": "function", "function": {"name": "read_file"}});
        let (status, body) = json(
            s.addr,
            "POST",
            "/v1/chat/completions",
            &chat(json!({"tools": tools(), "tool_choice": named, "seed": seed})),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        calls += check_calls(&body, Some("read_file"));
    }
    assert!(calls >= 8);
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_output_validates_and_bad_schemas_are_400s() {
    let s = start(true).await;
    let schema = json!({
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 30},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
        },
        "required": ["answer", "confidence", "tags"],
        "additionalProperties": false
    });
    let validator = jsonschema::validator_for(&schema).unwrap();
    for seed in 0..3 {
        let rf = json!({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}});
        let (status, body) = json(
            s.addr,
            "POST",
            "/v1/chat/completions",
            &chat(json!({"response_format": rf, "seed": seed, "max_tokens": 300})),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
        let text = body["choices"][0]["message"]["content"].as_str().unwrap();
        let v: Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("content is not JSON ({e}): {text:?}"));
        assert!(validator.is_valid(&v), "{v} breaks the schema");
    }
    // json_object: any object.
    let (status, body) = json(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &chat(json!({"response_format": {"type": "json_object"}, "max_tokens": 400})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    if body["choices"][0]["finish_reason"] == "stop" {
        let text = body["choices"][0]["message"]["content"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap();
        assert!(v.is_object());
    }
    // Responses text.format.
    let (status, body) = json(
        s.addr,
        "POST",
        "/v1/responses",
        &json!({"model": "default", "input": "hi", "max_output_tokens": 300,
                "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let text = body["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["type"] == "message")
        .and_then(|m| m["content"][0]["text"].as_str())
        .unwrap_or_else(|| panic!("no message output: {body}"));
    let v: Value = serde_json::from_str(text).unwrap();
    assert!(validator.is_valid(&v));
    // Bad schemas: named problems, before any token; the server goes on.
    let cases = [
        (
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/$defs/missing"}}}),
            "unresolved_schema_ref",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}),
            "invalid_schema",
        ),
        (json!({"type": "yaml"}), "invalid_value"),
    ];
    for (rf, code) in cases {
        let (status, body) = json(
            s.addr,
            "POST",
            "/v1/chat/completions",
            &chat(json!({"response_format": rf})),
        )
        .await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["code"], code, "{body}");
        assert_eq!(body["error"]["param"], "response_format");
    }
    let bad_tool = json!([{"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}}]);
    let (status, body) = json(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &chat(json!({"tools": bad_tool, "tool_choice": "required"})),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "tools");
    let (status, _) = json(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 4})),
    )
    .await;
    assert_eq!(status, 200, "the server keeps serving");
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_call_constraint_off_leaves_calls_to_the_parser() {
    let s = start(false).await;
    let mut valid = 0;
    for seed in 0..3 {
        let (status, body) = json(
            s.addr,
            "POST",
            "/v1/chat/completions",
            &chat(
                json!({"tools": tools(), "tool_choice": "required", "seed": seed,
                         "max_tokens": 40}),
            ),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        if body["choices"][0]["finish_reason"] == "tool_calls" {
            valid += 1;
        }
    }
    // Random weights, unconstrained: the model never writes a whole call.
    assert_eq!(valid, 0);
    s.shutdown().await;
}
