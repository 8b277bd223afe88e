//! Each format's grammar accepts what [`crate::chat::toolcall`] renders (and
//! its parser reads back), and rejects undeclared tools and bad arguments.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use serde_json::{json, Value};

use crate::chat::toolcall::{
    render_k2, render_k3, K2StreamParser, K3Options, K3StreamParser, Message, ParseEvent, ToolCall,
};
use crate::constrain::{
    Constraint, ConstraintError, ConstraintFactory, ConstraintSpec, TokenEnv, ToolChoice, ToolDecl,
    ToolFormat, ToolsSpec,
};
use crate::convert::synth::{k3_tokenizer_config, truncated_o200k_rank_file, KIMI_NUM_RANKS};
use crate::text::tokenizer::TextTokenizer;

/// K2's named special tokens (reference §5.1).
const K2_SPECIALS: [(u32, &str); 12] = [
    (163_584, "[BOS]"),
    (163_585, "[EOS]"),
    (163_586, "<|im_end|>"),
    (163_587, "<|im_user|>"),
    (163_588, "<|im_assistant|>"),
    (163_594, "<|im_system|>"),
    (163_595, "<|tool_calls_section_begin|>"),
    (163_596, "<|tool_calls_section_end|>"),
    (163_597, "<|tool_call_begin|>"),
    (163_598, "<|tool_call_argument_begin|>"),
    (163_599, "<|tool_call_end|>"),
    (163_601, "<|im_middle|>"),
];

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("caracal-constrain-{tag}-{}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("stale dir removable");
    }
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// A Kimi tiktoken folder (o200k ranks, Kimi's regex) with these specials.
fn kimi_folder(tag: &str, config: Value) -> PathBuf {
    let dir = temp_dir(tag);
    let ranks = truncated_o200k_rank_file(KIMI_NUM_RANKS).expect("o200k ranks");
    std::fs::write(dir.join("tiktoken.model"), ranks).expect("write ranks");
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write config");
    dir
}

fn k2_config() -> Value {
    let mut added = serde_json::Map::new();
    for (id, name) in K2_SPECIALS
        .iter()
        .chain(&[(163_606, "<think>"), (163_607, "</think>")])
    {
        added.insert(id.to_string(), json!({"content": name, "special": true}));
    }
    json!({"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "<|im_end|>"})
}

struct Model {
    tok: Arc<TextTokenizer>,
    factory: ConstraintFactory,
}

fn load(dir: &Path) -> Model {
    let tok = Arc::new(TextTokenizer::from_dir(dir).expect("tokenizer loads"));
    let env = TokenEnv::load(dir, tok.clone(), None).expect("token env");
    Model {
        tok,
        factory: ConstraintFactory::new(env).expect("factory"),
    }
}

fn k2() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| load(&kimi_folder("k2", k2_config())))
}

fn k3() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| load(&kimi_folder("k3", k3_tokenizer_config())))
}

fn hf() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama")))
}

fn weather() -> ToolDecl {
    ToolDecl {
        name: "get_weather".into(),
        parameters: json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "units": {"enum": ["c", "f"]}
        }, "required": ["city"], "additionalProperties": false}),
    }
}

fn search() -> ToolDecl {
    ToolDecl {
        name: "search".into(),
        parameters: json!({"type": "object", "properties": {
            "q": {"type": "string"},
            "filters": {"type": "object", "properties": {"lang": {"type": "string"}, "n": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}}
        }, "required": ["q"]}),
    }
}

fn tools(choice: ToolChoice, format: ToolFormat) -> ConstraintSpec {
    ConstraintSpec::Tools(ToolsSpec {
        tools: vec![weather(), search()],
        choice,
        parallel: true,
        format,
    })
}

/// Feeds `tokens`, each checked against the mask first; then the end token.
fn run(m: &Model, spec: &ConstraintSpec, tokens: &[u32]) -> Result<(), (usize, ConstraintError)> {
    let mut c = m.factory.compile(spec).expect("compiles");
    for (i, &t) in tokens.iter().enumerate() {
        let mask = c.compute_mask().map_err(|e| (i, e))?;
        if !mask.is_allowed(t) {
            return Err((
                i,
                ConstraintError::TokenRejected {
                    token: t,
                    reason: format!("masked: {:?}", m.tok.decode(&[t], false)),
                },
            ));
        }
        c.consume(t).map_err(|e| (i, e))?;
    }
    let eos = m.factory.env().eos()[0];
    let mask = c.compute_mask().map_err(|e| (tokens.len(), e))?;
    if !mask.is_allowed(eos) {
        return Err((
            tokens.len(),
            ConstraintError::Stuck("end token not allowed at the end".into()),
        ));
    }
    c.consume(eos).map_err(|e| (tokens.len(), e))?;
    assert!(c.is_done(), "done after the end token");
    Ok(())
}

fn calls(events: &[ParseEvent]) -> Vec<(String, Value)> {
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, ParseEvent::Malformed { .. })),
        "{events:?}"
    );
    let mut out: Vec<(String, String)> = Vec::new();
    for e in events {
        match e {
            ParseEvent::ToolCallStart { name, .. } => out.push((name.clone(), String::new())),
            ParseEvent::ToolCallArgs { delta, .. } => {
                out.last_mut().expect("open").1.push_str(delta)
            }
            _ => {}
        }
    }
    out.into_iter()
        .map(|(n, a)| (n, serde_json::from_str(&a).expect("arguments are JSON")))
        .collect()
}

fn assistant_calls() -> Vec<ToolCall> {
    vec![
        ToolCall::function("a", "get_weather", r#"{"city":"Paris \"Nord\"","days":3}"#),
        ToolCall::function(
            "b",
            "search",
            r#"{"q":"rust & llguidance","filters":{"lang":"en","n":[1,2]}}"#,
        ),
    ]
}

/// The model-output part of a rendered K2 assistant turn.
fn k2_output(content: Option<&str>) -> String {
    let msgs = vec![
        Message::text("user", "hi"),
        Message::assistant_with_calls(content, assistant_calls()),
    ];
    let text = render_k2(&msgs, None, false);
    let start = text
        .rfind("<|im_assistant|>assistant<|im_middle|>")
        .expect("assistant turn")
        + "<|im_assistant|>assistant<|im_middle|>".len();
    text[start..text.len() - "<|im_end|>".len()].to_string()
}

#[test]
fn k2_accepts_rendered_calls_and_its_parser_reads_them_back() {
    let m = k2();
    let format = ToolFormat::KimiK2 {
        first_call_index: 0,
        thinking: false,
    };
    let required = k2_output(None);
    let ids = m.tok.encode_chat(&required).unwrap();
    run(m, &tools(ToolChoice::Required, format), &ids).unwrap();
    let with_text = k2_output(Some("Let me check."));
    let ids = m.tok.encode_chat(&with_text).unwrap();
    run(m, &tools(ToolChoice::Auto, format), &ids).unwrap();
    let err = run(m, &tools(ToolChoice::Required, format), &ids).unwrap_err();
    assert_eq!(err.0, 0, "required calls start at once");
    // Plain text with no call ends an auto turn.
    run(
        m,
        &tools(ToolChoice::Auto, format),
        &m.tok.encode_chat("No tools needed.").unwrap(),
    )
    .unwrap();
    let mut p = K2StreamParser::new();
    let mut events = p.push(&with_text);
    events.extend(p.finish());
    let got = calls(&events);
    assert_eq!(
        got[0],
        (
            "get_weather".into(),
            json!({"city": "Paris \"Nord\"", "days": 3})
        )
    );
    assert_eq!(got[1].0, "search");
}

#[test]
fn k2_rejects_undeclared_tools_bad_arguments_and_spelled_markers() {
    let m = k2();
    let format = ToolFormat::KimiK2 {
        first_call_index: 0,
        thinking: false,
    };
    let spec = tools(ToolChoice::Required, format);
    let undeclared = "<|tool_calls_section_begin|><|tool_call_begin|>functions.delete_all:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
    assert!(run(m, &spec, &m.tok.encode_chat(undeclared).unwrap()).is_err());
    let missing = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"days\":3}<|tool_call_end|><|tool_calls_section_end|>";
    assert!(run(m, &spec, &m.tok.encode_chat(missing).unwrap()).is_err());
    let out_of_range = missing.replace("{\"days\":3}", "{\"city\":\"x\",\"days\":30}");
    assert!(run(m, &spec, &m.tok.encode_chat(&out_of_range).unwrap()).is_err());
    // Only the named tool under a named choice.
    let named = tools(ToolChoice::Named("search".into()), format);
    assert!(run(m, &named, &m.tok.encode_chat(&k2_output(None)).unwrap()).is_err());
    // Free text cannot spell a section marker with plain tokens.
    let tik = m.tok.as_tiktoken().unwrap();
    let spelled = tik
        .encode_ordinary("a <|tool_calls_section_begin|>")
        .unwrap();
    assert!(run(m, &tools(ToolChoice::Auto, format), &spelled).is_err());
    // Ids continue the conversation's count.
    let later = ToolFormat::KimiK2 {
        first_call_index: 5,
        thinking: false,
    };
    let ok = missing
        .replace("{\"days\":3}", "{\"city\":\"x\"}")
        .replace(":0<", ":5<");
    run(
        m,
        &tools(ToolChoice::Required, later),
        &m.tok.encode_chat(&ok).unwrap(),
    )
    .unwrap();
}

#[test]
fn k2_thinking_output_reasons_first() {
    let m = k2();
    let format = ToolFormat::KimiK2 {
        first_call_index: 0,
        thinking: true,
    };
    let text = format!("The user wants weather.</think>{}", k2_output(None));
    run(
        m,
        &tools(ToolChoice::Required, format),
        &m.tok.encode_chat(&text).unwrap(),
    )
    .unwrap();
    let mut p = K2StreamParser::in_reasoning();
    let mut events = p.push(&text);
    events.extend(p.finish());
    assert_eq!(calls(&events).len(), 2);
}

/// The model-output part of a rendered K3 assistant turn.
fn k3_output(thinking: bool, content: &str) -> String {
    let mut msg = Message::assistant_with_calls(Some(content), assistant_calls());
    msg.reasoning_content = Some("Two lookups.".into());
    let msgs = vec![Message::text("user", "hi"), msg];
    let options = K3Options {
        thinking,
        ..K3Options::default()
    };
    let text = render_k3(&msgs, None, false, &options).unwrap();
    let prompt = if thinking {
        "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"
    } else {
        "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>"
    };
    let start = text.rfind(prompt).expect("assistant message") + prompt.len();
    text[start..text.len() - "<|end_of_msg|>".len()].to_string()
}

fn k3_parse(thinking: bool, text: &str) -> Vec<(String, Value)> {
    let mut p = K3StreamParser::new(thinking);
    let mut events = p.push(text);
    events.extend(p.push("<|end_of_msg|>"));
    events.extend(p.finish());
    calls(&events)
}

#[test]
fn k3_accepts_rendered_calls_and_its_parser_reads_them_back() {
    let m = k3();
    for thinking in [false, true] {
        let format = ToolFormat::KimiK3 { thinking };
        let required = k3_output(thinking, "");
        run(
            m,
            &tools(ToolChoice::Required, format),
            &m.tok.encode_chat(&required).unwrap(),
        )
        .unwrap_or_else(|e| panic!("thinking {thinking}: {e:?}\n{required}"));
        let auto = k3_output(thinking, "Checking.");
        run(
            m,
            &tools(ToolChoice::Auto, format),
            &m.tok.encode_chat(&auto).unwrap(),
        )
        .unwrap();
        let got = k3_parse(thinking, &auto);
        assert_eq!(
            got[0],
            (
                "get_weather".into(),
                json!({"city": "Paris \"Nord\"", "days": 3})
            )
        );
        assert_eq!(
            got[1],
            (
                "search".into(),
                json!({"q": "rust & llguidance", "filters": {"lang": "en", "n": [1, 2]}})
            )
        );
    }
}

#[test]
fn k3_rejects_undeclared_tools_and_wrong_types() {
    let m = k3();
    let spec = tools(ToolChoice::Required, ToolFormat::KimiK3 { thinking: false });
    let good = k3_output(false, "");
    let bad_name = good.replace("tool=\"search\"", "tool=\"rm_rf\"");
    assert!(run(m, &spec, &m.tok.encode_chat(&bad_name).unwrap()).is_err());
    let bad_type = good.replace(
        "key=\"days\" type=\"number\"",
        "key=\"days\" type=\"string\"",
    );
    assert!(run(m, &spec, &m.tok.encode_chat(&bad_type).unwrap()).is_err());
    let too_long = good.replace("Paris \"Nord\"", "Paris Paris Paris Paris Paris");
    assert!(run(m, &spec, &m.tok.encode_chat(&too_long).unwrap()).is_err());
}

#[test]
fn k3_json_element_carries_schemas_elements_cannot() {
    let m = k3();
    let tool = ToolDecl {
        name: "pick".into(),
        parameters: json!({"anyOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false},
            {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"], "additionalProperties": false}
        ]}),
    };
    let spec = ConstraintSpec::Tools(ToolsSpec {
        tools: vec![tool],
        choice: ToolChoice::Required,
        parallel: false,
        format: ToolFormat::KimiK3 { thinking: false },
    });
    let text = "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"pick\" index=\"1\"<|sep|><|open|>json type=\"object\"<|sep|>{\"b\":true}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";
    run(m, &spec, &m.tok.encode_chat(text).unwrap()).unwrap();
    assert_eq!(
        k3_parse(false, text),
        vec![("pick".into(), json!({"b": true}))]
    );
    // Not parallel: a second call is refused.
    let two = text.replace(
        "<|close|>call<|sep|>",
        "<|close|>call<|sep|><|open|>call tool=\"pick\" index=\"2\"<|sep|><|close|>call<|sep|>",
    );
    assert!(run(m, &spec, &m.tok.encode_chat(&two).unwrap()).is_err());
}

#[test]
fn hermes_accepts_calls_on_a_tokenizer_json_vocabulary() {
    let m = hf();
    let text = "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\",\"units\":\"c\"}}\n</tool_call>\n<tool_call>\n{\"name\":\"search\",\"arguments\":{\"q\":\"x\"}}\n</tool_call>";
    let ids = m.tok.encode_chat(text).unwrap();
    run(m, &tools(ToolChoice::Required, ToolFormat::Hermes), &ids).unwrap();
    let auto = format!("Sure. {text}");
    run(
        m,
        &tools(ToolChoice::Auto, ToolFormat::Hermes),
        &m.tok.encode_chat(&auto).unwrap(),
    )
    .unwrap();
    // The gateway's parser reads both calls back.
    let mut p = crate::chat::toolcall::HermesStreamParser::new();
    let mut events = p.push(&auto);
    events.extend(p.finish());
    let mut calls: Vec<String> = Vec::new();
    for e in crate::chat::toolcall::coalesce(events) {
        match e {
            ParseEvent::Malformed { message, .. } => panic!("{message}"),
            ParseEvent::ToolCallStart { .. } => calls.push(String::new()),
            ParseEvent::ToolCallArgs { delta, .. } => calls.last_mut().unwrap().push_str(&delta),
            _ => {}
        }
    }
    assert_eq!(calls.len(), 2);
    assert_eq!(
        serde_json::from_str::<Value>(&calls[0]).unwrap(),
        json!({"city": "Oslo", "units": "c"})
    );
    let bad = text.replace("\"search\"", "\"shell\"");
    assert!(run(
        m,
        &tools(ToolChoice::Required, ToolFormat::Hermes),
        &m.tok.encode_chat(&bad).unwrap()
    )
    .is_err());
}

#[test]
fn json_specs_constrain_plain_output() {
    let m = hf();
    let spec = ConstraintSpec::Json(
        json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
    );
    run(m, &spec, &m.tok.encode_chat("{\"n\":42}").unwrap()).unwrap();
    assert!(
        run(m, &spec, &m.tok.encode_chat("{\"n\": 42}").unwrap()).is_err(),
        "compact by default"
    );
    assert!(run(m, &spec, &m.tok.encode_chat("{\"m\":1}").unwrap()).is_err());
    run(
        m,
        &ConstraintSpec::JsonObject,
        &m.tok.encode_chat("{\"any\":[1,\"x\"]}").unwrap(),
    )
    .unwrap();
    assert!(run(
        m,
        &ConstraintSpec::JsonObject,
        &m.tok.encode_chat("[1]").unwrap()
    )
    .is_err());
}

#[test]
fn bad_schemas_fail_at_compile_time_with_a_named_problem() {
    let m = hf();
    let cases = [
        (
            json!({"type": "string", "not": {"const": "x"}}),
            "unsupported_schema_keyword",
            "not",
        ),
        (
            json!({"$ref": "#/$defs/nope"}),
            "unresolved_schema_ref",
            "#/$defs/nope",
        ),
        (
            json!({"type": "string", "minLength": 5, "maxLength": 2}),
            "invalid_schema",
            "minLength",
        ),
        (
            json!({"type": "string", "format": "no-such-format"}),
            "invalid_schema",
            "no-such-format",
        ),
    ];
    for (schema, kind, needle) in cases {
        let err = m
            .factory
            .compile(&ConstraintSpec::Json(schema.clone()))
            .unwrap_err();
        assert_eq!(err.kind(), kind, "{schema}: {err}");
        assert!(err.to_string().contains(needle), "{err}");
    }
    let bad_tool = ConstraintSpec::Tools(ToolsSpec {
        tools: vec![ToolDecl {
            name: "f".into(),
            parameters: json!({"type": "object", "properties": {"a": {"uniqueItems": true}}}),
        }],
        choice: ToolChoice::Required,
        parallel: false,
        format: ToolFormat::Hermes,
    });
    let err = m.factory.compile(&bad_tool).unwrap_err();
    assert!(
        err.to_string().contains("tool f") && err.to_string().contains("/properties/a"),
        "{err}"
    );
}

#[test]
fn grammars_past_the_limits_are_refused_before_any_token() {
    let m = hf();
    let limits = crate::constrain::ConstraintLimits {
        max_grammar_size: 2_000,
        ..Default::default()
    };
    let small = ConstraintFactory::with_limits(m.factory.env().clone(), limits).unwrap();
    let props: serde_json::Map<String, Value> = (0..400)
        .map(|i| {
            (
                format!("field_{i}"),
                json!({"type": "string", "maxLength": 8}),
            )
        })
        .collect();
    let big = json!({"type": "object", "properties": props});
    let err = small.compile(&ConstraintSpec::Json(big)).unwrap_err();
    assert_eq!(err.kind(), "grammar_too_large", "{err}");
}

#[test]
fn forced_runs_come_back_as_jump_forward_tokens() {
    let m = k3();
    let spec = ConstraintSpec::Tools(ToolsSpec {
        tools: vec![weather()],
        choice: ToolChoice::Required,
        parallel: false,
        format: ToolFormat::KimiK3 { thinking: false },
    });
    let mut c = m.factory.compile(&spec).unwrap();
    let forced = c.forced_tokens().unwrap();
    let text = m.tok.decode(&forced, false).unwrap();
    assert!(
        text.starts_with("<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"),
        "{text}"
    );
    for t in forced {
        c.consume(t).unwrap();
    }
    assert!(!c.is_done());
}

/// `before` and `after` tokenized with their special tokens, `plain` with
/// ordinary tokens only (a marker in it is spelled, not emitted).
fn spelled(m: &Model, before: &str, plain: &str, after: &str) -> Vec<u32> {
    let tik = m.tok.as_tiktoken().expect("a Kimi vocabulary");
    let mut ids = m.tok.encode_chat(before).unwrap();
    ids.extend(tik.encode_ordinary(plain).unwrap());
    ids.extend(m.tok.encode_chat(after).unwrap());
    ids
}

#[test]
fn k2_string_arguments_cannot_spell_a_marker() {
    let m = k2();
    let format = ToolFormat::KimiK2 {
        first_call_index: 0,
        thinking: false,
    };
    let spec = tools(ToolChoice::Required, format);
    let head = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>";
    let tail = "<|tool_call_end|><|tool_calls_section_end|>";
    // What the parser would make of one: the call ends inside the string.
    let mut p = K2StreamParser::new();
    let mut events = p.push(&format!("{head}{{\"city\":\"a<|tool_call_end|>\"}}{tail}"));
    events.extend(p.finish());
    assert!(
        events
            .iter()
            .any(|e| matches!(e, ParseEvent::Malformed { .. })),
        "{events:?}"
    );
    for bad in [
        "a<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "x<think>",
        "</think>",
    ] {
        let ids = spelled(m, head, &format!("{{\"city\":{}}}", json!(bad)), tail);
        assert!(run(m, &spec, &ids).is_err(), "{bad:?} was allowed");
    }
    for good in ["a < b | c", "<b>x</b>", "<thin>", "|>", "<"] {
        let ids = spelled(m, head, &format!("{{\"city\":{}}}", json!(good)), tail);
        run(m, &spec, &ids).unwrap_or_else(|e| panic!("{good:?}: {e:?}"));
    }
}

#[test]
fn k3_json_arguments_cannot_spell_a_marker() {
    let m = k3();
    let spec = tools(ToolChoice::Required, ToolFormat::KimiK3 { thinking: false });
    let good = k3_output(false, "");
    // `filters` is an object argument: JSON inside the element.
    let at = good.find("\"en\"").expect("the filters argument") + 1;
    let (before, after) = (&good[..at], &good[at + 2..]);
    for bad in ["<|close|>", "a<|sep|>b"] {
        let ids = spelled(m, before, bad, after);
        assert!(run(m, &spec, &ids).is_err(), "{bad:?} was allowed");
    }
    for fine in ["a < b", "|>x", "<think>"] {
        let ids = spelled(m, before, fine, after);
        run(m, &spec, &ids).unwrap_or_else(|e| panic!("{fine:?}: {e:?}"));
    }
}
