//! The constraint compiler fed arbitrary JSON as schemas and tool lists:
//! every input compiles or fails with a typed [`CompileError`] (whose
//! `kind()` is one of the stable strings), never panics and never hangs
//! (llguidance's limits bound the work; a watchdog fails the run if one
//! input takes over 60 s). A grammar that compiles is then driven for a
//! few steps — mask, pick an allowed token, consume, forced tokens — which
//! must give masks or typed errors too.
//!
//! Inputs: schema-shaped objects built from the keywords the checker
//! knows and the ones it refuses, with values of every JSON type (type
//! confusion), huge and fractional numbers, `$ref`s that resolve, dangle or
//! loop, pathological regex `pattern`s, property names with quotes,
//! newlines and Lark syntax; plus nesting as deep as a client's JSON can
//! be (serde_json stops parsing at 128 levels). Long run:
//! `FUZZ_SECS=600 cargo test --release --test fuzz_schema -- --ignored --nocapture`.

mod fuzz_support;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use caracal::constrain::{
    CompileError, Constraint, ConstraintFactory, ConstraintSpec, TokenEnv, ToolFormat, ToolsSpec,
};
use caracal::text::tokenizer::TextTokenizer;
use fuzz_support::Watchdog;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A factory over a checkpoint's vocabulary (as `caracal serve` builds one per model).
fn factory_for(dir: &Path) -> ConstraintFactory {
    let tok = Arc::new(TextTokenizer::from_dir(dir).expect("tokenizer loads"));
    let env = TokenEnv::load(dir, tok, None).expect("token env");
    ConstraintFactory::new(env).expect("factory")
}

/// tiny-llama's byte-level BPE (ChatML, Hermes tool calls).
fn factory() -> &'static ConstraintFactory {
    static F: OnceLock<ConstraintFactory> = OnceLock::new();
    F.get_or_init(|| factory_for(&fixture("tiny-llama")))
}

/// The built-in default model's Kimi tiktoken vocabulary, which has the
/// K2 and K3 control tokens their tool-call grammars need.
fn kimi_factory() -> &'static ConstraintFactory {
    static F: OnceLock<ConstraintFactory> = OnceLock::new();
    F.get_or_init(|| {
        factory_for(
            &caracal::convert::synth::default_model_dir().expect("the default model is made"),
        )
    })
}

/// The factory whose vocabulary `format`'s grammar needs.
fn factory_of(format: ToolFormat) -> &'static ConstraintFactory {
    match format {
        ToolFormat::Hermes => factory(),
        _ => kimi_factory(),
    }
}

fn watchdog() -> &'static Watchdog {
    static W: OnceLock<Watchdog> = OnceLock::new();
    W.get_or_init(|| Watchdog::new("constraint compiler", Duration::from_secs(60)))
}

/// Stable kinds a compile error may report.
const KINDS: &[&str] = &[
    "invalid_schema",
    "unsupported_schema_keyword",
    "unresolved_schema_ref",
    "invalid_tool",
    "unknown_tool",
    "invalid_value",
    "grammar_too_large",
    "grammar_error",
];

const KEYWORDS: &[&str] = &[
    "type",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "$defs",
    "definitions",
    "$anchor",
    "properties",
    "required",
    "additionalProperties",
    "patternProperties",
    "minProperties",
    "maxProperties",
    "items",
    "prefixItems",
    "additionalItems",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "description",
    "title",
    "default",
    "not",
    "if",
    "uniqueItems",
    "contains",
    "$dynamicRef",
];

const TYPES: &[&str] = &[
    "object", "array", "string", "integer", "number", "boolean", "null", "tuple", "",
];

const REFS: &[&str] = &[
    "#",
    "#/$defs/a",
    "#/$defs/b",
    "#/definitions/a",
    "#/properties/x",
    "#/$defs/missing",
    "#a",
    "#/items",
    "https://example.com/s.json",
    "#/%24defs/a",
    "#/$defs/a~1b",
    "",
];

const PATTERNS: &[&str] = &[
    "^[a-z]+$",
    "(a*)*b",
    "(a|a)*$",
    "((a+)+)+",
    "[",
    "\\",
    "(?=x)",
    "\\p{L}+",
    "a{1000}",
    "a{0,100000}",
    "(x{1,1000}){1,1000}",
    ".*.*.*.*.*=.*",
    "^\\d{4}-\\d{2}-\\d{2}$",
    "",
];

const FORMATS: &[&str] = &[
    "date-time",
    "date",
    "time",
    "email",
    "uri",
    "uuid",
    "ipv4",
    "hostname",
    "regex",
    "bogus",
];

const NAMES: &[&str] = &[
    "a",
    "city",
    "",
    "\"",
    "a\"b",
    "line\nbreak",
    "%ignore",
    "start: x",
    "/",
    "~",
    "é🦙",
    "\\",
    "}",
    "{",
];

/// A JSON value of any type, numbers included at their extremes.
fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        prop::sample::select(vec![0.0, -0.0, 1e308, -1e308, 1e-308, 0.5, 2.5, 1e20])
            .prop_map(|f| json!(f)),
        prop::sample::select(TYPES.to_vec()).prop_map(|s| json!(s)),
        prop::sample::select(NAMES.to_vec()).prop_map(|s| json!(s)),
        "\\PC{0,12}".prop_map(Value::String),
    ]
}

/// A value for `key`: most often the right shape, sometimes any JSON.
fn value_for(key: &'static str, sub: BoxedStrategy<Value>) -> BoxedStrategy<Value> {
    let right: BoxedStrategy<Value> = match key {
        "type" => prop_oneof![
            prop::sample::select(TYPES.to_vec()).prop_map(|t| json!(t)),
            prop::collection::vec(prop::sample::select(TYPES.to_vec()), 0..4)
                .prop_map(|t| json!(t)),
        ]
        .boxed(),
        "$ref" => prop::sample::select(REFS.to_vec())
            .prop_map(|r| json!(r))
            .boxed(),
        "$anchor" => Just(json!("a")).boxed(),
        "pattern" => prop::sample::select(PATTERNS.to_vec())
            .prop_map(|p| json!(p))
            .boxed(),
        "format" => prop::sample::select(FORMATS.to_vec())
            .prop_map(|f| json!(f))
            .boxed(),
        "required" => prop::collection::vec(prop::sample::select(NAMES.to_vec()), 0..4)
            .prop_map(|r| json!(r))
            .boxed(),
        "enum" => prop::collection::vec(scalar(), 0..5)
            .prop_map(Value::Array)
            .boxed(),
        "const" | "default" => scalar().boxed(),
        "anyOf" | "oneOf" | "allOf" | "prefixItems" => prop::collection::vec(sub, 0..4)
            .prop_map(Value::Array)
            .boxed(),
        "properties" | "patternProperties" | "$defs" | "definitions" => {
            let name = prop_oneof![
                prop::sample::select(NAMES.to_vec()).prop_map(String::from),
                prop::sample::select(PATTERNS.to_vec()).prop_map(String::from),
            ];
            prop::collection::vec((name, sub), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect()))
                .boxed()
        }
        "items" | "additionalProperties" | "additionalItems" | "not" | "if" | "contains" => sub,
        _ => prop_oneof![
            any::<u32>().prop_map(|n| json!(n % 40)),
            any::<u64>().prop_map(|n| json!(n)),
            scalar(),
        ]
        .boxed(),
    };
    prop_oneof![5 => right, 1 => scalar()].boxed()
}

/// Schema-shaped JSON, nested a few levels.
fn schema() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        3 => prop::sample::select(TYPES.to_vec()).prop_map(|t| json!({"type": t})),
        1 => any::<bool>().prop_map(Value::Bool),
        1 => scalar(),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        let inner = inner.boxed();
        prop::collection::vec(prop::sample::select(KEYWORDS.to_vec()), 0..6).prop_flat_map(
            move |keys| {
                let fields: Vec<_> = keys
                    .into_iter()
                    .map(|k| value_for(k, inner.clone()).prop_map(move |v| (k.to_string(), v)))
                    .collect();
                fields.prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>()))
            },
        )
    })
}

/// The schema error kinds are the documented ones.
fn check_error(e: &CompileError) -> Result<(), TestCaseError> {
    prop_assert!(KINDS.contains(&e.kind()), "unknown kind {} ({e})", e.kind());
    prop_assert!(!e.to_string().is_empty());
    Ok(())
}

/// Drives a compiled constraint a few steps: masks, a token each mask
/// allows (chosen by `picks`), consume, forced tokens. Errors are fine.
fn drive(c: &mut dyn Constraint, vocab: usize, picks: &[u16]) -> Result<(), TestCaseError> {
    for &p in picks {
        let Ok(mask) = c.compute_mask() else {
            return Ok(());
        };
        let allowed: Vec<u32> = (0..vocab as u32).filter(|&t| mask.is_allowed(t)).collect();
        prop_assert_eq!(allowed.len(), mask.count());
        let Some(&tok) = allowed.get(p as usize % allowed.len().max(1)) else {
            return Ok(());
        };
        if c.consume(tok).is_err() || c.is_done() {
            return Ok(());
        }
        if c.forced_tokens().is_err() {
            return Ok(());
        }
    }
    Ok(())
}

/// Compiles `spec` with `f`: a constraint (then driven) or a typed error.
fn compile_with(
    f: &ConstraintFactory,
    spec: &ConstraintSpec,
    picks: &[u16],
) -> Result<(), TestCaseError> {
    match watchdog().run(spec, || f.compile_boxed(spec)) {
        Ok(mut c) => watchdog().run(spec, || drive(c.as_mut(), f.env().vocab_size(), picks)),
        Err(e) => check_error(&e),
    }
}

fn compile(spec: &ConstraintSpec, picks: &[u16]) -> Result<(), TestCaseError> {
    let f = match spec {
        ConstraintSpec::Tools(t) => factory_of(t.format),
        _ => factory(),
    };
    compile_with(f, spec, picks)
}

fn schema_case(schema: Value, picks: Vec<u16>) -> Result<(), TestCaseError> {
    compile(&ConstraintSpec::Json(schema.clone()), &picks)?;
    // The same value as a tool's parameters, in the Hermes and K3 formats
    // (the Kimi vocabulary is 200k tokens: fewer steps there). No fixture
    // vocabulary has K2's control tokens, so K2 grammars are not built here.
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": schema}}]);
    for format in [ToolFormat::Hermes, ToolFormat::KimiK3 { thinking: false }] {
        match ToolsSpec::from_openai(Some(&tools), Some(&json!("required")), Some(false), format) {
            Ok(Some(spec)) => compile(&ConstraintSpec::Tools(spec), &picks[..picks.len().min(3)])?,
            Ok(None) => {}
            Err(e) => check_error(&e)?,
        }
    }
    Ok(())
}

/// `tools`, `tool_choice`, `parallel_tool_calls` and `response_format`
/// as a client may send them: any JSON, sometimes shaped right.
fn request_fields() -> impl Strategy<Value = (Value, Value, Option<bool>, Value)> {
    let tool = prop_oneof![
        (prop::sample::select(NAMES.to_vec()), schema()).prop_map(
            |(n, s)| json!({"type": "function", "function": {"name": n, "parameters": s}})
        ),
        (prop::sample::select(NAMES.to_vec()), schema())
            .prop_map(|(n, s)| json!({"type": "function", "name": n, "parameters": s})),
        scalar().prop_map(|v| json!({"type": v, "function": v})),
        scalar(),
    ];
    let tools = prop_oneof![
        4 => prop::collection::vec(tool, 0..4).prop_map(Value::Array),
        1 => scalar(),
    ];
    let choice = prop_oneof![
        prop::sample::select(vec!["auto", "none", "required", "bogus"]).prop_map(|c| json!(c)),
        prop::sample::select(NAMES.to_vec())
            .prop_map(|n| json!({"type": "function", "function": {"name": n}})),
        prop::sample::select(NAMES.to_vec()).prop_map(|n| json!({"type": "function", "name": n})),
        scalar(),
    ];
    let format = prop_oneof![
        schema().prop_map(
            |s| json!({"type": "json_schema", "json_schema": {"name": "x", "schema": s}})
        ),
        Just(json!({"type": "json_object"})),
        Just(json!({"type": "text"})),
        scalar().prop_map(|v| json!({"type": v})),
        scalar(),
    ];
    (tools, choice, any::<Option<bool>>(), format)
}

fn request_case(
    (tools, choice, parallel, format): (Value, Value, Option<bool>, Value),
    picks: Vec<u16>,
) -> Result<(), TestCaseError> {
    match ConstraintSpec::from_response_format(Some(&format)) {
        Ok(Some(spec)) => compile(&spec, &picks)?,
        Ok(None) => {}
        Err(e) => check_error(&e)?,
    }
    for format in [ToolFormat::Hermes, ToolFormat::KimiK3 { thinking: true }] {
        match ToolsSpec::from_openai(Some(&tools), Some(&choice), parallel, format) {
            Ok(Some(spec)) => compile(&ConstraintSpec::Tools(spec), &picks)?,
            Ok(None) => {}
            Err(e) => check_error(&e)?,
        }
    }
    Ok(())
}

fn picks() -> impl Strategy<Value = Vec<u16>> {
    prop::collection::vec(any::<u16>(), 0..12)
}

proptest! {
    #![proptest_config(fuzz_support::config(128))]

    #[test]
    fn any_schema_compiles_or_fails_with_a_typed_error(s in schema(), p in picks()) {
        schema_case(s, p)?;
    }

    #[test]
    fn any_request_constraint_fields_compile_or_fail_with_a_typed_error(
        fields in request_fields(), p in picks()
    ) {
        request_case(fields, p)?;
    }
}

/// A schema nested `depth` levels through `key` (built in code: a client's
/// JSON cannot be deeper than serde_json's 128 levels).
fn nested(key: &str, depth: usize) -> Value {
    let mut v = json!({"type": "string"});
    for i in 0..depth {
        v = match key {
            "properties" => json!({"type": "object", "properties": {"p": v}, "required": ["p"]}),
            "anyOf" => json!({"anyOf": [v, {"type": "null"}]}),
            "$defs" => json!({"$defs": {format!("d{i}"): v}, "$ref": format!("#/$defs/d{i}")}),
            _ => json!({"type": "array", "items": v}),
        };
    }
    v
}

#[test]
fn schemas_as_deep_as_a_request_can_carry_compile_or_fail_cleanly() {
    for key in ["items", "properties", "anyOf", "$defs"] {
        let spec = ConstraintSpec::Json(nested(key, 126));
        match watchdog().run(&key, || factory().compile(&spec)) {
            Ok(_) => {}
            Err(e) => assert!(KINDS.contains(&e.kind()), "{key}: {e}"),
        }
    }
}

#[test]
fn self_referencing_schemas_compile_or_fail_cleanly() {
    for s in [
        json!({"$ref": "#"}),
        json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        json!({"type": "object", "properties": {"next": {"$ref": "#"}}}),
        json!({"anyOf": [{"$ref": "#"}]}),
        json!({"allOf": [{"$ref": "#"}, {"type": "object"}]}),
    ] {
        let spec = ConstraintSpec::Json(s.clone());
        match watchdog().run(&s, || factory().compile(&spec)) {
            Ok(mut c) => {
                let _ = c.compute_mask();
            }
            Err(e) => assert!(KINDS.contains(&e.kind()), "{s}: {e}"),
        }
    }
}

#[test]
#[ignore = "long run: FUZZ_SECS=600 cargo test --release --test fuzz_schema -- --ignored"]
fn soak_constraint_compiler() {
    let case = prop_oneof![
        (schema(), picks()).prop_map(|(s, p)| (Some(s), None, p)),
        (request_fields(), picks()).prop_map(|(f, p)| (None, Some(f), p)),
    ];
    fuzz_support::soak("constraint compiler", case, |(s, f, p)| match (s, f) {
        (Some(s), _) => schema_case(s, p),
        (_, Some(f)) => request_case(f, p),
        _ => Ok(()),
    });
}
