//! Model-driven tool-call stress: random schemas, real logits, the real
//! scheduler and gateway, an independent validator.
//!
//! Each case draws tools with random `parameters` schemas
//! (`common::schemas`: nested objects to depth 3, arrays with item bounds,
//! enums, integer and number ranges, strings with `maxLength` and
//! `pattern`, required and optional keys, `anyOf`) and a choice
//! (`required`; a named tool every fourth request; `parallel_tool_calls`
//! every other one),
//! and sends it as a Chat Completions request over a socket to a gateway
//! serving the model with its constraint factory and jump-forward on, 8
//! requests in flight so the scheduler batches them. The model's logits,
//! masked by the grammar, pick every token; the gateway renders the tools
//! into the prompt with the model's template and parses the output back
//! with that format's stream parser; the test checks every returned call
//! with the `jsonschema` crate. The same requests are then sent to a
//! gateway with `--tool-call-constraint off` (`ConstraintSetup::tool_calls
//! = false`) as the baseline.
//!
//! Models: the built-in default (the synthesized Kimi K3 with random
//! weights and Kimi's tiktoken vocabulary, K3 XTML calls), and
//! SmolLM2-135M-Instruct (Hermes `<tool_call>` JSON) when its GGUF is
//! cached. A call that hits `max_tokens` fails the test.
//!
//! CI runs [`CI_CALLS`] and [`CI_CALLS_SMOLLM2`]; the full run is
//! `STRESS_CALLS=1000 cargo test --release --test constrain_model -- --ignored --test-threads 1`.

mod common;
mod gateway_support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use serde_json::{json, Value};
use tokio::sync::oneshot;

use caracal::checkpoint::gguf::{import_gguf, ImportOptions};
use caracal::constrain::{
    ConstraintFactory, ConstraintLimits, TokenEnv, ToolChoice, ToolFormat, ToolsSpec,
};
use caracal::gateway::engine::ConstraintSetup;
use caracal::gateway::{EngineHost, Gateway, GatewayConfig, ServedModel};
use caracal::generate::LoadedModel;
use caracal::models::CausalLm;
use caracal::text::tokenizer::TextTokenizer;
use caracal_actors::runtime::EngineConfig;
use common::schemas::{check_calls, draw_spec, openai_tools, Draw, Rng};
use common::{smollm2_gguf, TempDir};

/// Tool calls of the default model in the default (CI) run, and how many
/// of its requests the baseline repeats.
const CI_CALLS: (usize, usize) = (48, 8);
/// The same for SmolLM2, whose prompts (the tools in the system message)
/// make each request a few hundred prefill tokens.
const CI_CALLS_SMOLLM2: (usize, usize) = (16, 4);
/// Requests in flight at once.
const CONCURRENCY: usize = 8;
/// Completion budget of every constrained request (up to 8 parallel calls
/// of the largest schemas fit). The longest output is reported.
const MAX_TOKENS: usize = 1024;
/// The baseline's budget: this many times the tokens the constrained
/// output of the same request took (at least [`BASELINE_MIN_TOKENS`]).
/// Unconstrained, a model that writes the call at all writes it in about
/// as many tokens; the random-weight model never stops, so the full budget
/// would only cost time.
const BASELINE_FACTOR: usize = 2;
/// The baseline's smallest budget.
const BASELINE_MIN_TOKENS: usize = 64;

/// A model loaded once and served by gateways with or without the
/// tool-call constraint.
struct Model {
    label: &'static str,
    model: Arc<dyn CausalLm>,
    tokenizer: Arc<TextTokenizer>,
    factory: Arc<ConstraintFactory>,
    format: ToolFormat,
    temperature: f64,
}

impl Model {
    fn load(label: &'static str, dir: &Path, format: ToolFormat, temperature: f64) -> Model {
        let loaded = LoadedModel::load(dir).expect("the model loads");
        let model: Arc<dyn CausalLm> = Arc::from(loaded.model);
        let tokenizer = Arc::new(loaded.tokenizer.expect("the model has a tokenizer"));
        let env = TokenEnv::load(dir, tokenizer.clone(), Some(model.info().vocab_size))
            .expect("a token trie from the model's tokenizer");
        let factory = Arc::new(ConstraintFactory::new(env).expect("a constraint factory"));
        Model {
            label,
            model,
            tokenizer,
            factory,
            format,
            temperature,
        }
    }
}

/// A gateway on 127.0.0.1:0.
struct Server {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn serve(m: &Model, tool_calls: bool) -> Server {
    serve_with(m, m.factory.clone(), tool_calls).await
}

async fn serve_with(m: &Model, factory: Arc<ConstraintFactory>, tool_calls: bool) -> Server {
    let served = ServedModel::new("m", m.model.as_ref(), Some(m.tokenizer.clone()), false);
    let setup = ConstraintSetup {
        factory: Some(factory),
        tool_calls,
        jump_forward: true,
    };
    let detok = m.tokenizer.clone() as Arc<dyn caracal_actors::engine::Detokenize>;
    let host = EngineHost::start_with(m.model.clone(), EngineConfig::default(), Some(detok), setup)
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

/// One request of the run.
#[derive(Debug, Clone)]
struct Case {
    index: usize,
    spec: ToolsSpec,
    body: Value,
}

fn case(index: usize, m: &Model) -> Case {
    let mut rng = Rng(0x5eed_0000 + index as u64);
    let mut spec = draw_spec(
        &mut rng,
        m.format,
        Draw {
            auto: false,
            finite_numbers: true,
        },
    );
    // Every short run has each kind: every fourth request names a tool,
    // every other one allows parallel calls.
    spec.parallel = index % 2 == 1;
    if index % 4 == 2 {
        let name = spec.tools[rng.below(spec.tools.len())].name.clone();
        spec.choice = ToolChoice::Named(name);
    } else if matches!(spec.choice, ToolChoice::Named(_)) {
        spec.choice = ToolChoice::Required;
    }
    let mut body = json!({
        "model": "m",
        "messages": [{"role": "user", "content": "Call the tools you need with suitable arguments."}],
        "max_tokens": MAX_TOKENS,
        "temperature": m.temperature,
        "seed": index,
        "reasoning_effort": "none",
    });
    for (k, v) in openai_tools(&spec).as_object().unwrap() {
        body[k] = v.clone();
    }
    Case { index, spec, body }
}

/// What one response was.
#[derive(Debug)]
enum Outcome {
    /// Calls that parsed and validated.
    Valid(usize),
    /// Stopped by `max_tokens`.
    Length,
    /// Anything else, and why.
    Invalid(String),
}

/// Checks one Chat Completions response against its case.
fn judge(c: &Case, status: u16, body: &Value) -> Outcome {
    if status != 200 {
        return Outcome::Invalid(format!("status {status}: {body}"));
    }
    let choice = &body["choices"][0];
    let message = &choice["message"];
    match choice["finish_reason"].as_str() {
        Some("tool_calls") => {}
        Some("length") => return Outcome::Length,
        other => return Outcome::Invalid(format!("finish_reason {other:?}: {message}")),
    }
    for field in ["content", "reasoning_content"] {
        if let Some(t) = message[field].as_str().filter(|t| !t.trim().is_empty()) {
            return Outcome::Invalid(format!("{field} beside the calls: {t:?}"));
        }
    }
    let Some(list) = message["tool_calls"].as_array() else {
        return Outcome::Invalid(format!("no tool_calls: {message}"));
    };
    let mut calls = Vec::with_capacity(list.len());
    for call in list {
        let name = call["function"]["name"].as_str().unwrap_or_default();
        let text = call["function"]["arguments"].as_str().unwrap_or_default();
        match serde_json::from_str::<Value>(text) {
            Ok(args) => calls.push((name.to_string(), args)),
            Err(e) => return Outcome::Invalid(format!("arguments {text:?} of {name}: {e}")),
        }
    }
    match check_calls(&c.spec, &calls) {
        Ok(()) => Outcome::Valid(calls.len()),
        Err(e) => Outcome::Invalid(e),
    }
}

/// Counts of one pass.
#[derive(Debug, Default)]
struct Tally {
    requests: usize,
    calls: usize,
    valid_requests: usize,
    length: usize,
    invalid: Vec<String>,
    prompt_tokens: usize,
    completion_tokens: usize,
    longest: usize,
    named: usize,
    multi_call: usize,
    /// Indices of the requests answered and their completion tokens, in case order.
    answered: Vec<(usize, usize)>,
}

impl Tally {
    fn add(&mut self, c: &Case, status: u16, body: &Value) {
        self.requests += 1;
        let tokens = body["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
        self.answered.push((c.index, tokens));
        self.completion_tokens += tokens;
        self.prompt_tokens += body["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize;
        self.longest = self.longest.max(tokens);
        match judge(c, status, body) {
            Outcome::Valid(n) => {
                self.valid_requests += 1;
                self.calls += n;
                self.named += usize::from(matches!(c.spec.choice, ToolChoice::Named(_)));
                self.multi_call += usize::from(n > 1);
            }
            Outcome::Length => self.length += 1,
            Outcome::Invalid(e) => self.invalid.push(format!("case {}: {e}", c.index)),
        }
    }
}

/// Sends `cases` with [`CONCURRENCY`] in flight; stops issuing once
/// `calls` valid calls have come back (all of them when `None`).
async fn run(addr: SocketAddr, cases: Vec<Case>, calls: Option<usize>) -> Tally {
    let mut tally = Tally::default();
    let mut answers = futures::stream::iter(cases)
        .map(|c| async move {
            let (status, body) =
                gateway_support::json(addr, "POST", "/v1/chat/completions", &c.body).await;
            (c, status, body)
        })
        .buffer_unordered(CONCURRENCY);
    while let Some((c, status, body)) = answers.next().await {
        tally.add(&c, status, &body);
        if calls.is_some_and(|n| tally.calls >= n) {
            break;
        }
    }
    tally.answered.sort_unstable();
    tally
}

/// The number of calls to make per model (`STRESS_CALLS`, else `default`).
fn target(default: usize) -> usize {
    std::env::var("STRESS_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs the stress on `m` until `calls` calls validate, then the same
/// requests unconstrained (the first `baseline` of them); asserts every
/// constrained request validated.
async fn stress(m: &Model, calls: usize, baseline: usize) {
    let t0 = Instant::now();
    // Each valid request has at least one call: `calls` requests suffice.
    let cases: Vec<Case> = (0..calls).map(|i| case(i, m)).collect();
    let server = serve(m, true).await;
    let t = run(server.addr, cases.clone(), Some(calls)).await;
    server.shutdown().await;
    let constrained_secs = t0.elapsed().as_secs_f64();
    println!(
        "{}: {} tool calls from {} requests ({} named-tool, {} with several calls) parsed and \
         validated; {} hit max_tokens, {} invalid; {} completion tokens (longest {}) after {} \
         prompt tokens, concurrency {CONCURRENCY}, {constrained_secs:.1} s",
        m.label,
        t.calls,
        t.requests,
        t.named,
        t.multi_call,
        t.length,
        t.invalid.len(),
        t.completion_tokens,
        t.longest,
        t.prompt_tokens
    );
    for e in t.invalid.iter().take(5) {
        println!("  INVALID {}", truncate(e, 1500));
    }
    let t1 = Instant::now();
    let same: Vec<Case> = t
        .answered
        .iter()
        .take(baseline)
        .map(|&(i, tokens)| {
            let mut c = cases[i].clone();
            c.body["max_tokens"] = json!((tokens * BASELINE_FACTOR).max(BASELINE_MIN_TOKENS));
            c
        })
        .collect();
    let server = serve(m, false).await;
    let b = run(server.addr, same, None).await;
    server.shutdown().await;
    println!(
        "{} unconstrained baseline: {} of the same {} requests returned calls that parsed and \
         validated ({} calls); {} hit max_tokens ({BASELINE_FACTOR}x the constrained tokens); \
         {} completion tokens, {:.1} s",
        m.label,
        b.valid_requests,
        b.requests,
        b.calls,
        b.length,
        b.completion_tokens,
        t1.elapsed().as_secs_f64()
    );
    for e in b.invalid.iter().take(3) {
        println!("  baseline example: {}", truncate(e, 300));
    }
    assert!(
        t.invalid.is_empty() && t.length == 0,
        "{}: {} invalid, {} hit max_tokens; the first ones:\n{}",
        m.label,
        t.invalid.len(),
        t.length,
        t.invalid
            .iter()
            .take(5)
            .map(|e| truncate(e, 600))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(t.calls >= calls, "{}: only {} calls", m.label, t.calls);
    assert!(t.named > 0, "{t:?}");
}

fn truncate(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

fn default_model() -> Model {
    let dir = caracal::convert::synth::default_model_dir().expect("the default model is made");
    Model::load(
        "default model (synthesized Kimi K3, random weights, K3 XTML)",
        &dir,
        ToolFormat::KimiK3 { thinking: false },
        1.0,
    )
}

/// SmolLM2 imported from its GGUF into `dir`, or `None` (skipped, noted).
fn smollm2(dir: &TempDir) -> Option<Model> {
    let gguf = smollm2_gguf("the SmolLM2 tool-call stress")?;
    import_gguf(
        &gguf,
        dir.path(),
        &ImportOptions {
            progress: false,
            ..ImportOptions::default()
        },
    )
    .expect("SmolLM2 imports");
    Some(Model::load(
        "SmolLM2-135M-Instruct (Hermes)",
        dir.path(),
        ToolFormat::Hermes,
        0.8,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_model_tool_calls_through_the_scheduler_parse_and_validate() {
    let m = default_model();
    stress(&m, target(CI_CALLS.0), CI_CALLS.1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_tool_calls_through_the_scheduler_parse_and_validate() {
    let dir = TempDir::new("stress-smollm2");
    let Some(m) = smollm2(&dir) else {
        return;
    };
    stress(&m, target(CI_CALLS_SMOLLM2.0), CI_CALLS_SMOLLM2.1).await;
}

/// Requests of each full run the baseline repeats (`STRESS_BASELINE`).
const FULL_BASELINE: usize = 160;

fn full_baseline() -> usize {
    std::env::var("STRESS_BASELINE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(FULL_BASELINE)
}

/// The full run on the default model: 1,000 calls (or `STRESS_CALLS`), the
/// first [`FULL_BASELINE`] requests also sent unconstrained.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "minutes in release: STRESS_CALLS=1000 cargo test --release --test constrain_model -- --ignored --test-threads 1"]
async fn full_stress_default_model() {
    let m = default_model();
    stress(&m, target(1000), full_baseline()).await;
}

/// The full run on SmolLM2, as [`full_stress_default_model`].
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "minutes in release: STRESS_CALLS=1000 cargo test --release --test constrain_model -- --ignored --test-threads 1"]
async fn full_stress_smollm2() {
    let dir = TempDir::new("stress-smollm2-full");
    if let Some(m) = smollm2(&dir) {
        stress(&m, target(1000), full_baseline()).await;
    }
}

/// A grammar that cannot go on mid-generation reaches the client as
/// `constraint_violation`, and the server keeps serving. The honest way to
/// get there through the gateway is a step past the per-step limits
/// ([`ConstraintLimits::step_max_items`]: the Earley items one token mask
/// may create), which is what a hostile schema does to the default limits;
/// here the factory's limit is lowered to one item, so that an ordinary
/// schema's first steps (its forced-token computation) exceed it while its
/// compilation, which runs no step, still passes.
/// A grammar that merely runs out of `max_tokens` ends with
/// `finish_reason: "length"` instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grammar_past_its_step_limits_is_a_constraint_violation_on_the_socket() {
    let m = default_model();
    let dir = caracal::convert::synth::default_model_dir().expect("the default model is made");
    let env = TokenEnv::load(&dir, m.tokenizer.clone(), Some(m.model.info().vocab_size))
        .expect("a token trie");
    let limits = ConstraintLimits {
        step_max_items: 1,
        ..ConstraintLimits::default()
    };
    let tight = Arc::new(ConstraintFactory::with_limits(env, limits).expect("a factory"));
    let server = serve_with(&m, tight, true).await;
    let schema = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}
    }, "required": ["city", "days"], "additionalProperties": false});
    let rf = json!({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}});
    let body = json!({
        "model": "m",
        "messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 64,
        "reasoning_effort": "none",
        "response_format": rf,
    });
    let (status, answer) =
        gateway_support::json(server.addr, "POST", "/v1/chat/completions", &body).await;
    assert_eq!(status, 500, "{answer}");
    assert_eq!(answer["error"]["code"], "constraint_violation", "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    println!("constraint_violation: {message}");
    assert!(message.contains("limit"), "the message says why: {message}");
    // Streamed, the error arrives as an error frame.
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let frames = gateway_support::sse(server.addr, "/v1/chat/completions", &stream).await;
    assert!(
        frames
            .iter()
            .any(|f| f["error"]["code"] == "constraint_violation"),
        "{frames:?}"
    );
    // Tool calls take the same path.
    let tools =
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]);
    let mut call = body.clone();
    call.as_object_mut().unwrap().remove("response_format");
    call["tools"] = tools;
    call["tool_choice"] = json!("required");
    let (status, answer) =
        gateway_support::json(server.addr, "POST", "/v1/chat/completions", &call).await;
    assert_eq!(status, 500, "{answer}");
    assert_eq!(answer["error"]["code"], "constraint_violation", "{answer}");
    // The server goes on: unconstrained requests still complete.
    let plain = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4, "reasoning_effort": "none"});
    let (status, answer) =
        gateway_support::json(server.addr, "POST", "/v1/chat/completions", &plain).await;
    assert_eq!(status, 200, "{answer}");
    server.shutdown().await;
}
